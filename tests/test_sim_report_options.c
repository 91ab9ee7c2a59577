/* test_sim_report_options.c — what `ferry sim`'s reports say about how the
 * runs were made: the sensitivity replays turned off (--mfu-sensitivity
 * off: one replay a run, and every report says so), and the Chrome trace's
 * lanes under the one_copy_stream knob (the reloads on the offloads'
 * stream, drawn on its lane). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_copy_knobs.h"

#define CHECK_NAME(got, want) CHECK((got) && !strcmp((got), (want)))

/* The file at path, whole (NULL on error); the caller frees it. */
static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = malloc(1 << 20);
  size_t got = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
  fclose(f);
  if (buf) buf[got] = 0;
  return buf;
}

/* A temporary file's name in path (the file created empty). */
static int temp_path(char *path) {
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  close(fd);
  return 0;
}

/* 1e9 FLOPs at 1 TFLOP/s: the compute is timed from FLOPs, so the
 * sensitivity replays apply. A full replay each: sim_result.replays counts
 * them (1 + 2 with the sensitivity, 1 without), and with it off the text
 * and JSON say so instead of the paragraph and compute_sensitivity. */
TEST(sim_mfu_sensitivity_off_replays_once_and_says_so) {
  static const char text[] = TRACE_START "{\"ev\":\"compute\",\"t_us\":0,\"us\":1,\"flops\":1e9}\n"
      BACKWARD_BEGIN TRACE_STOP;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("flops", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.warmup = -1;
  c.tflops = 1;
  c.mfu_sensitivity = 0.25;
  sim_result on, off[2];
  CHECK_OK(sim_replay(t, &c, &on, err, sizeof err));
  CHECK_EQ(on.replays, 3);
  CHECK_NEAR(on.sens_step_us[0], 1000 / 0.75, 1e-6);
  c.mfu_sensitivity = 0;
  CHECK_OK(sim_replay(t, &c, &off[0], err, sizeof err));
  CHECK_EQ(off[0].replays, 1);
  CHECK_NEAR(off[0].step_us, 1000, 1e-6);
  c.label = "again";
  CHECK_OK(sim_replay(t, &c, &off[1], err, sizeof err));

  sim_run_info info = {.trace_path = "flops", .trace = t, .hw = sim_hw_preset("h100")};
  info.mfu_sensitivity = -1; /* --mfu-sensitivity off */
  char *out = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&out, &len);
  sim_print_table(f, &info, off, 2);
  fclose(f);
  CHECK_STR_CONTAINS(out, "sensitivity to the compute rate: off (--mfu-sensitivity off");
  CHECK(!strstr(out, "step (overhead) at"));
  free(out);
  char path[] = "/tmp/ferry_sens_off_XXXXXX";
  CHECK_OK(temp_path(path));
  CHECK_OK(sim_write_json(path, &info, off, 2, err, sizeof err));
  char *json = slurp(path);
  unlink(path);
  CHECK(json != NULL);
  cJSON *root = cJSON_Parse(json);
  free(json);
  CHECK(root != NULL);
  const cJSON *ms = cJSON_GetObjectItem(root, "mfu_sensitivity");
  CHECK(cJSON_IsString(ms) && !strcmp(ms->valuestring, "off"));
  const cJSON *p = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "policies"), 0);
  CHECK(p != NULL);
  CHECK(!cJSON_GetObjectItem(p, "compute_sensitivity"));
  CHECK_NEAR(cJSON_GetObjectItem(p, "replays")->valuedouble, 1, 0);
  cJSON_Delete(root);
  /* on: the factor at the top, the entries per run */
  sim_result both[2] = {on, on};
  info.mfu_sensitivity = 0.25;
  CHECK_OK(sim_write_json(path, &info, both, 2, err, sizeof err));
  json = slurp(path);
  unlink(path);
  CHECK(json != NULL);
  root = cJSON_Parse(json);
  free(json);
  CHECK(root != NULL);
  CHECK_NEAR(cJSON_GetObjectItem(root, "mfu_sensitivity")->valuedouble, 0.25, 0);
  p = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "policies"), 0);
  CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(p, "compute_sensitivity")) == 2);
  CHECK_NEAR(cJSON_GetObjectItem(p, "replays")->valuedouble, 3, 0);
  cJSON_Delete(root);
  sim_result_free(&on);
  sim_result_free(&off[0]);
  sim_result_free(&off[1]);
  sim_trace_free(t);
  return 0;
}

/* The lane (tid) of the first slice of category cat in the Chrome trace,
 * and the name of lane tid; pid 2 is the policy's run. -1 / NULL: none. */
static int lane_of(const cJSON *events, const char *cat) {
  const cJSON *e;
  cJSON_ArrayForEach(e, events) {
    const cJSON *c = cJSON_GetObjectItem(e, "cat");
    if (cJSON_GetObjectItem(e, "pid")->valueint == 2 && cJSON_IsString(c) &&
        !strcmp(c->valuestring, cat))
      return cJSON_GetObjectItem(e, "tid")->valueint;
  }
  return -1;
}

static const char *lane_name(const cJSON *events, int tid) {
  const char *name = NULL; /* the last thread_name wins, as in Perfetto */
  const cJSON *e;
  cJSON_ArrayForEach(e, events) {
    const cJSON *n = cJSON_GetObjectItem(e, "name");
    if (cJSON_GetObjectItem(e, "pid")->valueint == 2 && cJSON_IsString(n) &&
        !strcmp(n->valuestring, "thread_name") && cJSON_GetObjectItem(e, "tid")->valueint == tid)
      name = cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), "name")->valuestring;
  }
  return name;
}

/* test_one_copy_stream.c's trace (pack 1 is reloaded at backward): with
 * the knob its reload ran on the D2H stream, so the timeline marks it and
 * the Chrome trace draws it (and the arrow's end) on the D2H lane, named
 * "copies (one stream)", nothing on the H2D lane; without, as before. */
TEST(sim_chrome_trace_draws_one_stream_reloads_on_its_lane) {
  static const char text[] =
      TRACE_START PACK(1, 100000, 0) COMPUTE PACK(2, 400000, 1) COMPUTE BACKWARD_BEGIN UNPACK(1)
      COMPUTE UNPACK(2) COMPUTE TRACE_STOP;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("one_stream", text, strlen(text), &t, err, sizeof err));
  for (int one = 0; one < 2; one++) {
    char src[512];
    snprintf(src, sizeof src,
             "return { api = 1, knobs = { max_fwd_stash = 1, min_offload_bytes = 1%s },\n"
             " decide = function(t, ctx)\n"
             " return ferry.OFFLOAD, ferry.ON_USE end }",
             one ? ", one_copy_stream = 1" : "");
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.timeline = 1;
    sim_result rs[2];
    CHECK_OK(sim_replay(t, &c, &rs[0], err, sizeof err));
    c.policy_source = src;
    c.label = "policy";
    CHECK_OK(sim_replay(t, &c, &rs[1], err, sizeof err));
    int reloads = 0, marked = 0;
    for (size_t i = 0; i < rs[1].tl.n_iv; i++) {
      const sim_interval *iv = &rs[1].tl.iv[i];
      reloads += iv->lane == 2;
      marked += iv->one_stream != 0;
      if (iv->one_stream) CHECK_EQ(iv->lane, 2); /* still an H2D copy */
    }
    CHECK_EQ(reloads, 1);
    CHECK_EQ(marked, one);
    char path[] = "/tmp/ferry_one_stream_XXXXXX";
    CHECK_OK(temp_path(path));
    CHECK_OK(sim_write_chrome_trace(path, rs, 2, err, sizeof err));
    char *json = slurp(path);
    unlink(path);
    CHECK(json != NULL);
    cJSON *root = cJSON_Parse(json);
    free(json);
    CHECK(root != NULL);
    const cJSON *ev = cJSON_GetObjectItem(root, "traceEvents");
    CHECK_EQ(lane_of(ev, "offload"), 2);
    CHECK_EQ(lane_of(ev, "reload"), one ? 2 : 3);
    CHECK_NAME(lane_name(ev, 2), one ? "copies (one stream)" : "D2H copies");
    CHECK_NAME(lane_name(ev, 3), "H2D copies");
    /* the arrow ends where the reload is drawn */
    const cJSON *e;
    int ends = 0;
    cJSON_ArrayForEach(e, ev) {
      const cJSON *ph = cJSON_GetObjectItem(e, "ph");
      if (cJSON_IsString(ph) && !strcmp(ph->valuestring, "f")) {
        CHECK_EQ(cJSON_GetObjectItem(e, "tid")->valueint, one ? 2 : 3);
        ends++;
      }
    }
    CHECK_EQ(ends, 1);
    cJSON_Delete(root);
    sim_result_free(&rs[0]);
    sim_result_free(&rs[1]);
  }
  sim_trace_free(t);
  return 0;
}
