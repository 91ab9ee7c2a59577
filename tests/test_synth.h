/* test_synth.h — the synthesizer's text and trace of a model, for the sim
 * tests. */
#ifndef FERRY_TEST_SYNTH_H
#define FERRY_TEST_SYNTH_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

/* The synthesized text of m (malloc'd), NULL on error with err set. */
static inline char *synth_text_of(const synth_model *m, char *err, size_t errlen) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) return NULL;
  int rc = synth_write(m, f, err, errlen);
  fclose(f);
  if (rc) {
    free(buf);
    return NULL;
  }
  return buf;
}

/* The parsed trace of m's synthesized text; nonzero (the error printed) on
 * failure. */
static inline int trace_of(const synth_model *m, sim_trace **t) {
  char err[512] = "";
  char *text = synth_text_of(m, err, sizeof err);
  if (!text) {
    fprintf(stderr, "synth: %s\n", err);
    return -1;
  }
  int rc = sim_trace_parse("synth", text, strlen(text), t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  free(text);
  return rc;
}

/* A config that replays a synthesized trace on one node of H100s: the
 * preset's PCIe link and NVLink, two steps. */
static inline sim_config h100_node_config(void) {
  sim_config c = {0};
  c.link = sim_hw_preset("h100")->link;
  c.steps = 2;
  c.comm_nodes = 1;
  c.nvlink_bytes_per_s = sim_hw_preset("h100")->nvlink_bytes_per_s;
  return c;
}

#endif
