/* test_chrome_one_stream.c — the real run's Chrome trace (chrome_recorder.c)
 * under the one_copy_stream knob, on the backend under test (host, CUDA
 * double): a reload issued with the knob is drawn on the D2H lane, renamed
 * "copies (one stream)", its arrow ending there; one issued without it on
 * the H2D lane. The knob follows the policy, which may be swapped between
 * steps: each copy is drawn where the knob of its own issue put it. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_sim.h"
#include "test.h"
#include "test_copy_knobs.h"
#include "test_device.h"

#define POLICY(knob)                                                                        \
  "return { api = 1, knobs = { max_fwd_stash = 1, min_offload_bytes = 1" knob " },\n"       \
  " decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE end }"

static char *read_all(const char *path) {
  FILE *in = fopen(path, "r");
  if (!in) return NULL;
  fseek(in, 0, SEEK_END);
  long n = ftell(in);
  fseek(in, 0, SEEK_SET);
  char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
  size_t got = text ? fread(text, 1, (size_t)n, in) : 0;
  fclose(in);
  if (text) text[got] = 0;
  return text;
}

static const char *str_of(const cJSON *e, const char *key) {
  const char *s = cJSON_GetStringValue(cJSON_GetObjectItem(e, key));
  return s ? s : "";
}
static double num_of(const cJSON *e, const char *key) {
  return cJSON_GetNumberValue(cJSON_GetObjectItem(e, key));
}

/* One step: three 64 KiB packs of known bytes (each pushes the one before out of the
 * one-deep stash), backward unpacks them newest first and reads them back. */
static int one_step(ferry_engine *e, test_device_stats *st) {
  enum { N = 3, SZ = 1 << 16 };
  ferry_handle h[N];
  static unsigned char bytes[N][SZ], back[SZ];
  CHECK_OK(ferry_step_begin(e));
  for (int i = 0; i < N; i++) {
    test_buffer *b = test_buffer_new(SZ);
    CHECK(b);
    for (size_t j = 0; j < SZ; j++) bytes[i][j] = (unsigned char)(j * 5u + (unsigned)i);
    test_dev_write(b->ptr, bytes[i], SZ);
    ferry_tensor_desc d = u8_activation(SZ);
    d.module_path = "model.layers.0.mlp";
    CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h[i]));
  }
  CHECK_OK(ferry_backward_begin(e));
  for (int i = N - 1; i >= 0; i--) {
    void *dev = NULL, *owner = NULL;
    CHECK_OK(ferry_unpack(e, h[i], NULL, &dev, &owner));
    /* the read waits for the copies (the CUDA double refuses a free under
     * one still reading the buffer, as the caller's allocator would wait) */
    test_dev_read(back, dev, SZ);
    CHECK(!memcmp(back, bytes[i], SZ));
    test_device_release_cb(st, owner);
  }
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  return 0;
}

/* Three steps: without the knob, with it (a policy swapped in), without
 * (swapped back). Pack numbers 1-3 are step 1's, 4-6 step 2's, 7-9 step 3's. */
TEST(chrome_trace_one_copy_stream_follows_a_swapped_policy) {
  char path[] = "/tmp/ferry-ct-one-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.retain = test_device_retain_cb;
  c.policy_source = POLICY("");
  c.chrome_trace_path = path;
  ferry_engine *e = NULL;
  char err[512] = "";
  int rc = ferry_engine_create(&c, &e, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  if (one_step(e, &st)) return 1;
  CHECK_OK(ferry_set_policy(e, NULL, POLICY(", one_copy_stream = 1"), 0));
  if (one_step(e, &st)) return 1;
  CHECK_OK(ferry_set_policy(e, NULL, POLICY(""), 0));
  if (one_step(e, &st)) return 1;
  ferry_engine_destroy(e);

  char *text = read_all(path);
  unlink(path);
  CHECK(text);
  cJSON *root = cJSON_Parse(text);
  free(text);
  CHECK(root); /* the whole file is JSON */
  const cJSON *ev = cJSON_GetObjectItem(root, "traceEvents"), *x;
  /* lane names by tid, the last declaration winning (as Perfetto reads it) */
  const char *lane[8] = {0};
  cJSON_ArrayForEach(x, ev) {
    if (strcmp(str_of(x, "ph"), "M") || strcmp(str_of(x, "name"), "thread_name")) continue;
    int tid = (int)num_of(x, "tid");
    if (tid >= 0 && tid < 8)
      lane[tid] = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(x, "args"), "name"));
  }
  CHECK(lane[1] && !strcmp(lane[1], "copies (one stream)"));
  CHECK(lane[2] && !strcmp(lane[2], "H2D copies"));
  int reloads[3] = {0, 0, 0}, on_d2h[3] = {0, 0, 0}, ends = 0, ends_on_slice = 0;
  cJSON_ArrayForEach(x, ev) {
    if (!strcmp(str_of(x, "ph"), "f")) {
      ends++;
      /* the arrow enters a reload slice at its start, on that slice's lane */
      const cJSON *y;
      cJSON_ArrayForEach(y, ev)
        ends_on_slice += !strcmp(str_of(y, "ph"), "X") && !strcmp(str_of(y, "cat"), "reload") &&
                         num_of(y, "ts") == num_of(x, "ts") && num_of(y, "tid") == num_of(x, "tid");
      continue;
    }
    if (strcmp(str_of(x, "ph"), "X")) continue;
    int tid = (int)num_of(x, "tid");
    if (!strcmp(str_of(x, "cat"), "offload")) CHECK_EQ(tid, 1);
    if (strcmp(str_of(x, "cat"), "reload")) continue;
    double tensor = cJSON_GetNumberValue(cJSON_GetObjectItem(cJSON_GetObjectItem(x, "args"), "tensor"));
    int step = (int)((tensor - 1) / 3);
    CHECK(step >= 0 && step < 3);
    reloads[step]++;
    on_d2h[step] += tid == 1;
    CHECK(tid == 1 || tid == 2);
  }
  for (int s = 0; s < 3; s++) CHECK(reloads[s] > 0);
  CHECK_EQ(on_d2h[0], 0);
  CHECK_EQ(on_d2h[1], reloads[1]); /* the knob's step: every reload on the one stream */
  CHECK_EQ(on_d2h[2], 0);
  CHECK(ends > 0);
  CHECK_EQ(ends_on_slice, ends);
  cJSON_Delete(root);
  return 0;
}

/* The simulator's trace names the lane as a real run's does: by the knob,
 * not by whether a reload happened. A policy with one_copy_stream that keeps
 * everything (no reload in the step) still gets "copies (one stream)"; one
 * without the knob keeps "D2H copies". */
TEST(sim_chrome_trace_names_the_one_stream_lane_by_the_knob) {
  static const char text[] =
      TRACE_START PACK(1, 100000, 0) COMPUTE PACK(2, 400000, 1) COMPUTE BACKWARD_BEGIN UNPACK(1)
      COMPUTE UNPACK(2) COMPUTE TRACE_STOP;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("keep_one_stream", text, strlen(text), &t, err, sizeof err));
  for (int one = 0; one < 2; one++) {
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.timeline = 1;
    c.policy_source = one ? "return { api = 1, knobs = { one_copy_stream = 1 },\n"
                            " decide = function(t, ctx) return ferry.KEEP end }"
                          : "return { api = 1,\n decide = function(t, ctx) return ferry.KEEP end }";
    sim_result r;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_NEAR(r.bytes_h2d, 0, 1e-9); /* nothing reloaded */
    char path[] = "/tmp/ferry-sim-ct-one-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK_OK(sim_write_chrome_trace(path, &r, 1, err, sizeof err));
    char *json = read_all(path);
    unlink(path);
    CHECK(json);
    cJSON *root = cJSON_Parse(json);
    free(json);
    CHECK(root);
    const char *d2h = NULL;
    const cJSON *x;
    cJSON_ArrayForEach(x, cJSON_GetObjectItem(root, "traceEvents"))
      if (!strcmp(str_of(x, "ph"), "M") && !strcmp(str_of(x, "name"), "thread_name") &&
          num_of(x, "tid") == 2)
        d2h = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(x, "args"), "name"));
    CHECK(d2h && !strcmp(d2h, one ? "copies (one stream)" : "D2H copies"));
    cJSON_Delete(root);
    sim_result_free(&r);
  }
  sim_trace_free(t);
  return 0;
}
