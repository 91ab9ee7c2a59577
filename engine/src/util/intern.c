/* intern.c — see intern.h. */
#include "util/intern.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* Eight bytes a step (module paths run to 40 and more, and a byte at a time
 * made hashing most of an intern on the trace reader's path), then mixed so
 * the low bits index the table. */
static uint64_t hash_str(const char *s) {
  size_t n = strlen(s);
  uint64_t h = n;
  for (; n >= 8; s += 8, n -= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = (h ^ w) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  memcpy(&w, s, n);
  return util_mix64(h ^ w);
}

/* Doubles the table (256 slots at first), re-placing every string. */
static int rehash(intern_table *t) {
  size_t ncap = t->cap ? t->cap * 2 : 256;
  char **n = calloc(ncap, sizeof *n);
  if (!n) return -1;
  for (size_t i = 0; i < t->cap; i++) {
    if (!t->slots[i]) continue;
    size_t j = hash_str(t->slots[i]) & (ncap - 1);
    while (n[j]) j = (j + 1) & (ncap - 1);
    n[j] = t->slots[i];
  }
  free(t->slots);
  t->slots = n;
  t->cap = ncap;
  return 0;
}

const char *intern_get(intern_table *t, const char *s) {
  if (!s) return NULL;
  if ((t->count + 1) * 2 > t->cap && rehash(t)) return NULL;
  size_t j = hash_str(s) & (t->cap - 1);
  while (t->slots[j]) {
    if (t->slots[j] == s || strcmp(t->slots[j], s) == 0) return t->slots[j];
    j = (j + 1) & (t->cap - 1);
  }
  char *copy = strdup(s);
  if (!copy) return NULL;
  t->slots[j] = copy;
  t->count++;
  return copy;
}

void intern_clear(intern_table *t) {
  for (size_t i = 0; i < t->cap; i++) free(t->slots[i]);
  free(t->slots);
  t->slots = NULL;
  t->cap = t->count = 0;
}
