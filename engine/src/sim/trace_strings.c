/*
 * trace_strings.c — the strings of trace lines, taken without hashing or
 * comparing them in full each time: a trace repeats a few hundred module
 * paths, classes, ops and dtypes every step, so the reader remembers each
 * text's owned copy (or its code) by a cheap hash of its bytes and checks
 * the one it finds with one comparison. Misses take the full way
 * (intern_get, ferry_dtype_from_name ...) and are remembered.
 */
#include "sim/trace_reader_internal.h"

static inline uint64_t word_at(const char *s) {
  uint64_t w;
  memcpy(&w, s, 8);
  return w;
}

/* Three words of s (its start, middle and end: module paths differ in the
 * middle, "model.layers.7.mlp") and its length, mixed to a slot. */
static inline size_t slot_of(const char *s, size_t n) {
  uint64_t h = n * 0x9e3779b97f4a7c15ull;
  if (n >= 8) {
    h ^= word_at(s) * 0xbf58476d1ce4e5b9ull;
    h ^= word_at(s + n / 2 - 4) * 0x94d049bb133111ebull;
    h ^= word_at(s + n - 8);
  } else {
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  }
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return (size_t)(h >> 32) & (READER_STR_SLOTS - 1);
}

const char *reader_own(reader *r, const json_value *v) {
  size_t n = v->len;
  reader_str_slot *m = &r->str_slots[slot_of(v->str, n)];
  if (m->owned && m->len == n && !memcmp(m->owned, v->str, n)) return m->owned;
  const char *owned = intern_get(&r->strs, v->str);
  if (owned) {
    m->owned = owned;
    m->len = (uint32_t)n;
  }
  return owned;
}

int reader_name_code(reader_name_memo *m, const json_value *v, int (*parse)(const char *)) {
  if (v->len && v->len == m->len && v->len < sizeof m->text && !memcmp(m->text, v->str, v->len))
    return m->code;
  int code = parse(v->str);
  if (v->len && v->len < sizeof m->text) {
    memcpy(m->text, v->str, v->len);
    m->len = v->len;
    m->code = code;
  }
  return code;
}
