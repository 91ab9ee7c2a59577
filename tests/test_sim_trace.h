/* test_sim_trace.h — what several sim test files share: hand-written
 * trace lines (header, step begin and end, transient allocs), the reader's
 * error check, the hand-computed runs' link, a trace-recording engine, the
 * synthesizer's trace and its per-layer byte counts, the six-tensor replay
 * trace and the shipped policies' folder. */
#ifndef FERRY_TEST_SIM_TRACE_H
#define FERRY_TEST_SIM_TRACE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

#define HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"

#define BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define END "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"

static inline int expect_parse_error(const char *text, size_t len, const char *want) {
  sim_trace *t = NULL;
  char err[512] = "";
  int rc = sim_trace_parse("bad.jsonl", text, len, &t, err, sizeof err);
  if (rc != FERRY_EPARSE || t || !strstr(err, want)) {
    fprintf(stderr, "input:\n%.*s\nexpected error containing \"%s\", got rc %d \"%s\"\n",
            (int)len, text, want, rc, err);
    sim_trace_free(t);
    return 1;
  }
  return 0;
}
#define BAD(text, want) CHECK_EQ(expect_parse_error(text, strlen(text), want), 0)

/* The hand-computed runs' link: 1 GB/s each way (1000 us per MB), no
 * latency, no duplex slowdown; `steps` steps. */
static inline sim_config hand_config(int steps) {
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = steps;
  return c;
}

#define ALLOC(id, bytes) "{\"ev\":\"alloc\",\"t_us\":0,\"id\":" #id ",\"bytes\":" #bytes ",\"what\":\"logits\"}\n"
#define FREE(id) "{\"ev\":\"free\",\"t_us\":0,\"id\":" #id "}\n"

/* An engine with no policy recording its trace into a fresh temporary file,
 * whose name goes to path (at least 32 bytes): 0, or 1 (a test failure). */
static inline int recording_engine(test_device_stats *st, char *path, ferry_engine **e) {
  ferry_config c = test_engine_config(st);
  c.decide = NULL;
  snprintf(path, 32, "/tmp/ferry-trace-XXXXXX");
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.trace_path = path;
  char err[512];
  *e = NULL;
  CHECK_OK(ferry_engine_create(&c, e, err, sizeof err));
  return 0;
}

static inline int synth_to_trace(const synth_model *m, sim_trace **t) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  char err[256];
  if (!f || synth_write(m, f, err, sizeof err)) return -1;
  fclose(f);
  int rc = sim_trace_parse("synth", buf, len, t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  free(buf);
  return rc;
}

/* Activation bytes of layer `layer` in the trace: distinct buffers (alias
 * packs count once), forward phase, activations only. */
static inline uint64_t trace_layer_bytes(const sim_trace *t, int layer) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer == layer && x->desc.kind == FERRY_KIND_ACTIVATION && x->alias_of < 0 &&
        x->desc.phase == FERRY_PHASE_FORWARD)
      total += x->desc.bytes;
  }
  return total;
}

/* Bytes of the trace's allocs whose what is `what` (first step). */
static inline uint64_t alloc_bytes(const sim_trace *t, const char *what) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++)
    if (!strcmp(t->allocs[i].what, what)) n += t->allocs[i].bytes;
  return n;
}

/* Six 100000-byte tensors, all offloaded (recorded decisions), link 1000
 * B/us, no latency. D2H copies run back to back: [0,100] .. [500,600]. The
 * fifth and sixth packs push the stash past 4: the host waits for copies 1
 * and 2 (until 200: 200 us of host wait). 1000 us of compute, then backward
 * unpacks 6..3 from the stash and reloads 2 and 1: 100 us each, exposed. */
static inline const char *six_tensors(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s", HDR BEGIN);
  for (int i = 1; i <= 6; i++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","
                  "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
                  "\"layers\":6,\"decision\":\"offload\"}\n", i, i - 1);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":1000}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n");
  for (int i = 6; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n", i);
  snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

static inline const char *policy_dir(void) {
  static char dir[1024];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *s = strrchr(dir, '/');
  if (s) *s = 0;
  else snprintf(dir, sizeof dir, ".");
  strncat(dir, "/../policies", sizeof dir - strlen(dir) - 1);
  return dir;
}

#endif
