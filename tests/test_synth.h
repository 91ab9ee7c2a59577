/* test_synth.h — the synthesizer's text of a model, for the sim tests. */
#ifndef FERRY_TEST_SYNTH_H
#define FERRY_TEST_SYNTH_H

#include <stdio.h>
#include <stdlib.h>

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

#endif
