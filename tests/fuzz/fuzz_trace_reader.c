/* fuzz_trace_reader.c — libFuzzer target for the trace reader: any input
 * must give a trace or a "FILE:LINE: message" error, never a crash, a leak
 * or undefined behaviour; a trace that reads must replay (recorded
 * decisions, sim backend) without an engine error.
 *
 * Build and run: tests/fuzz/run.sh [SECONDS]. Without libFuzzer, the test
 * sim_fuzz_corpus_replays_clean (tests/test_sim_replay.c) feeds corpus/ through
 * the same function in every `make test`. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

int fuzz_trace_reader_one(const uint8_t *data, size_t size);

/* "fuzz:LINE: message" with 1 <= LINE <= the input's line count, or
 * "fuzz: message" for errors about the whole trace; the message non-empty. */
static int error_shape_ok(const char *err, const uint8_t *data, size_t size) {
  if (strncmp(err, "fuzz:", 5) != 0) return 0;
  const char *p = err + 5;
  if (*p >= '0' && *p <= '9') {
    unsigned long long line = 0;
    while (*p >= '0' && *p <= '9') {
      line = line * 10 + (unsigned long long)(*p++ - '0');
      if (line > size + 1) return 0;
    }
    unsigned long long lines = 1;
    for (size_t i = 0; i < size; i++) lines += data[i] == '\n';
    if (line < 1 || line > lines || *p++ != ':') return 0;
  }
  return p[0] == ' ' && p[1] != '\0' && p[1] != ' ';
}

int fuzz_trace_reader_one(const uint8_t *data, size_t size) {
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("fuzz", (const char *)data, size, &t, err, sizeof err);
  if (rc) {
    if (t || !error_shape_ok(err, data, size)) { /* an error always says where and what */
      fprintf(stderr, "bad error message: \"%s\"\n", err);
      abort();
    }
    return 0;
  }
  if (t->n_events > 20000) { /* keep each run fast */
    sim_trace_free(t);
    return 0;
  }
  sim_config c = {0};
  c.link = (ferry_link){55e9, 55e9, 5, 0.9};
  c.steps = 2;
  c.replay_decisions = 1;
  c.timeline = 1;
  sim_result r;
  if (sim_replay(t, &c, &r, err, sizeof err)) {
    fprintf(stderr, "a trace that reads did not replay: %s\n", err);
    abort();
  }
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

#ifdef FERRY_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  return fuzz_trace_reader_one(data, size);
}
#endif
