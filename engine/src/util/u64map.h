/* u64map.h — a map from nonzero uint64 keys (ids, pointers) to uint32
 * values: open addressing, linear probing, power-of-two table grown to
 * twice its size at half load, deletion by backward shift (no tombstones).
 * Header-only so the stash's hot path inlines it. Not thread-safe. */
#ifndef FERRY_U64MAP_H
#define FERRY_U64MAP_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "util/util.h"

typedef struct u64map {
  uint64_t *keys; /* 0 = empty slot */
  uint32_t *vals;
  size_t cap, count;
} u64map;

#define U64MAP_FIRST_CAP 256

/* The slot key hashes to in a table of cap (a power of two) slots. */
static inline size_t u64map_home(uint64_t key, size_t cap) { return util_mix64(key) & (cap - 1); }

/* Doubles the table (U64MAP_FIRST_CAP at first); 0, or -1 out of memory. */
static inline int u64map_grow(u64map *m) {
  size_t ncap = m->cap ? m->cap * 2 : U64MAP_FIRST_CAP;
  uint64_t *keys = calloc(ncap, sizeof *keys);
  uint32_t *vals = calloc(ncap, sizeof *vals);
  if (!keys || !vals) {
    free(keys);
    free(vals);
    return -1;
  }
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->keys[i]) continue;
    size_t j = u64map_home(m->keys[i], ncap);
    while (keys[j]) j = (j + 1) & (ncap - 1);
    keys[j] = m->keys[i];
    vals[j] = m->vals[i];
  }
  free(m->keys);
  free(m->vals);
  m->keys = keys;
  m->vals = vals;
  m->cap = ncap;
  return 0;
}

/* 1 and *val when key is in the map, else 0. */
static inline int u64map_find(const u64map *m, uint64_t key, uint32_t *val) {
  if (!m->count) return 0;
  for (size_t j = u64map_home(key, m->cap); m->keys[j]; j = (j + 1) & (m->cap - 1))
    if (m->keys[j] == key) {
      *val = m->vals[j];
      return 1;
    }
  return 0;
}

/* Adds key (nonzero, not in the map yet) -> val; 0, or -1 out of memory. */
static inline int u64map_insert(u64map *m, uint64_t key, uint32_t val) {
  if ((m->count + 1) * 2 > m->cap && u64map_grow(m)) return -1;
  size_t j = u64map_home(key, m->cap);
  while (m->keys[j]) j = (j + 1) & (m->cap - 1);
  m->keys[j] = key;
  m->vals[j] = val;
  m->count++;
  return 0;
}

/* Removes key if there; the entries after it shift back into the hole. */
static inline void u64map_remove(u64map *m, uint64_t key) {
  if (!m->count) return;
  size_t j = u64map_home(key, m->cap);
  while (m->keys[j] && m->keys[j] != key) j = (j + 1) & (m->cap - 1);
  if (!m->keys[j]) return;
  m->keys[j] = 0;
  m->count--;
  for (size_t k = (j + 1) & (m->cap - 1); m->keys[k]; k = (k + 1) & (m->cap - 1)) {
    size_t home = u64map_home(m->keys[k], m->cap);
    /* Move k into the hole at j if its home is not within (j, k]. */
    if ((k > j && (home <= j || home > k)) || (k < j && (home <= j && home > k))) {
      m->keys[j] = m->keys[k];
      m->vals[j] = m->vals[k];
      m->keys[k] = 0;
      j = k;
    }
  }
}

/* Frees the table; the map is empty after. */
static inline void u64map_free(u64map *m) {
  free(m->keys);
  free(m->vals);
  m->keys = NULL;
  m->vals = NULL;
  m->cap = m->count = 0;
}

#endif
