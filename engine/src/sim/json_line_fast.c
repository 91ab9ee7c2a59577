/*
 * json_line_fast.c — the trace reader's first path: a line as trace writers
 * emit it, read in one pass with no allocation per line. It takes only one
 * flat object whose strings are ASCII without escapes, whose numbers are
 * integers of at most 18 digits or decimals of at most 19 digits whose
 * value is exact in one IEEE operation (significand below 2^53, power of
 * ten within 22: Clinger's fast path, so the double is the correctly
 * rounded one simdjson gives), and whose arrays hold only such scalars.
 * Any other line returns -1 and goes to simdjson, then cJSON, which word
 * what is wrong: this path never refuses a line, it only passes it on.
 */
#include <stdlib.h>
#include <string.h>

#include "sim/json_line.h"
#include "ferry_sim.h"

/* 10^0 .. 10^22: every one exact in a double */
static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                 1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* Each function takes the position and the end of the line and returns the
 * position after what it read, or NULL to pass the line on: the position
 * stays in a register. */

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* JSON's whitespace; the first test passes over the usual case (none):
 * every whitespace byte is at most ' ' */
static inline const char *skip_ws(const char *p, const char *e) {
  while (p < e && (unsigned char)*p <= ' ' && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n'))
    p++;
  return p;
}

/* The number at p into *out. */
static inline const char *number(const char *p, const char *e, double *out) {
  int neg = *p == '-';
  p += neg;
  if (p >= e || !is_digit(*p)) return NULL;
  uint64_t w = 0;
  int digits = 0, exp10 = 0, is_int = 1;
  if (*p == '0') {
    p++;
    if (p < e && is_digit(*p)) return NULL; /* a leading zero: not JSON */
  } else {
    for (; p < e && is_digit(*p); p++, digits++)
      if (digits < 19) w = w * 10 + (uint64_t)(*p - '0');
  }
  if (p < e && *p == '.') {
    is_int = 0;
    p++;
    if (p >= e || !is_digit(*p)) return NULL;
    for (; p < e && is_digit(*p); p++, digits++, exp10--)
      if (digits < 19) w = w * 10 + (uint64_t)(*p - '0');
  }
  if (p < e && (*p == 'e' || *p == 'E')) {
    is_int = 0;
    p++;
    int eneg = 0;
    if (p < e && (*p == '+' || *p == '-')) eneg = *p++ == '-';
    if (p >= e || !is_digit(*p)) return NULL;
    int x = 0;
    for (; p < e && is_digit(*p); p++)
      if (x < 100000) x = x * 10 + (*p - '0');
    exp10 += eneg ? -x : x;
  }
  if (digits > 19) return NULL; /* w did not keep every digit */
  if (is_int) {
    if (digits > 18) return NULL;
    *out = (double)(neg ? -(int64_t)w : (int64_t)w); /* simdjson's int64, converted */
  } else {
    if (w > (1ull << 53) || exp10 < -22 || exp10 > 22) return NULL;
    double v = exp10 < 0 ? (double)w / POW10[-exp10] : (double)w * POW10[exp10];
    *out = neg ? -v : v;
  }
  return p;
}

/* The bytes of x (little-endian: lowest first) that end a string or that
 * this path passes on: '"', '\\', below 0x20 (controls), from 0x80 (UTF-8).
 * Their high bits; the lowest set one marks the first such byte exactly. */
static inline uint64_t string_stops(uint64_t x) {
  const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  uint64_t quote = x ^ (ones * '"'), slash = x ^ (ones * '\\');
  uint64_t zero_quote = (quote - ones) & ~quote, zero_slash = (slash - ones) & ~slash;
  uint64_t below_space = (x - ones * 0x20) & ~x;
  return (zero_quote | zero_slash | below_space | x) & highs;
}

/* The closing quote of the string whose text starts at p. */
static inline const char *string_end(const char *p, const char *e) {
  for (;;) {
    if (p + 8 <= e) { /* 8 bytes a test */
      uint64_t x;
      memcpy(&x, p, 8);
      uint64_t stops = string_stops(x);
      if (!stops) {
        p += 8;
        continue;
      }
      p += __builtin_ctzll(stops) >> 3;
    } else {
      while (p < e && *p != '"' && *p != '\\' && (unsigned char)*p >= 0x20 &&
             (unsigned char)*p < 0x80)
        p++;
      if (p >= e) return NULL;
    }
    /* an escape, a control or UTF-8: passed on */
    return *p == '"' ? p : NULL;
  }
}

/* A scalar at p into *v, its string copied to *strs (v NULL: checked only). */
static inline const char *scalar(const char *p, const char *e, json_value *v, char **strs) {
  json_value scratch;
  if (!v) v = &scratch;
  switch (*p) {
  case '"': {
    const char *end = string_end(p + 1, e);
    if (!end) return NULL;
    v->type = JV_STRING;
    if (v != &scratch) {
      size_t len = (size_t)(end - p - 1);
      memcpy(*strs, p + 1, len);
      (*strs)[len] = 0;
      v->str = *strs;
      *strs += len + 1;
    }
    return end + 1;
  }
  case 't': v->type = JV_TRUE; return e - p >= 4 && !memcmp(p, "true", 4) ? p + 4 : NULL;
  case 'f': v->type = JV_FALSE; return e - p >= 5 && !memcmp(p, "false", 5) ? p + 5 : NULL;
  case 'n': v->type = JV_OTHER; return e - p >= 4 && !memcmp(p, "null", 4) ? p + 4 : NULL;
  default: v->type = JV_NUMBER; return number(p, e, &v->num);
  }
}

/* An array of scalars after its '[' (its items kept in out->shape if keep). */
static const char *array(const char *p, const char *e, json_line *out, int keep, char **strs) {
  p = skip_ws(p + 1, e);
  if (p < e && *p == ']') return p + 1;
  for (;;) {
    if (p >= e || *p == '[' || *p == '{') return NULL;
    json_value *v = keep && out->shape_n < FERRY_MAX_DIMS ? &out->shape[out->shape_n] : NULL;
    if (!(p = scalar(p, e, v, strs))) return NULL;
    if (keep) out->shape_n++;
    p = skip_ws(p, e);
    if (p >= e) return NULL;
    if (*p == ']') return p + 1;
    if (*p != ',') return NULL;
    p = skip_ws(p + 1, e);
  }
}

void json_fast_free(json_fast *f) {
  free(f->buf);
  f->buf = NULL;
  f->cap = 0;
}

int json_fast_parse(json_fast *f, const char *s, size_t n, int max_depth, json_line *out) {
  out->present = 0;
  out->shape_n = 0;
  out->is_object = 0;
  if (max_depth < 1) return -1;
  /* every string's copy and its NUL fit in the line's length plus one */
  if (f->cap < n + 1) {
    char *b = realloc(f->buf, n + 1);
    if (!b) return -1;
    f->buf = b;
    f->cap = n + 1;
  }
  char *strs = f->buf;
  const char *p = skip_ws(s, s + n), *e = s + n;
  if (p >= e || *p != '{') return -1;
  p = skip_ws(p + 1, e);
  if (p < e && *p == '}') {
    p++;
  } else {
    for (;;) {
      if (p >= e || *p != '"') return -1;
      const char *k = p + 1, *kend = string_end(k, e);
      if (!kend) return -1;
      int key = json_key_find(k, (size_t)(kend - k));
      p = skip_ws(kend + 1, e);
      if (p >= e || *p != ':') return -1;
      p = skip_ws(p + 1, e);
      if (p >= e) return -1;
      json_value *v = json_line_slot(out, key);
      if (*p == '[') {
        if (max_depth < 2 || !(p = array(p, e, out, key == JK_SHAPE && v, &strs))) return -1;
        if (v) v->type = JV_ARRAY;
      } else if (*p == '{' || !(p = scalar(p, e, v, &strs))) {
        return -1;
      }
      p = skip_ws(p, e);
      if (p >= e) return -1;
      if (*p == '}') {
        p++;
        break;
      }
      if (*p != ',') return -1;
      p = skip_ws(p + 1, e);
    }
  }
  if (skip_ws(p, e) != e) return -1;
  out->is_object = 1;
  return 0;
}

/* ---- the check the tests run (ferry_sim.h) ------------------------------------ */
struct sim_line_check {
  json_fast fast;
  json_simd *simd;
};

sim_line_check *sim_line_check_new(void) {
  sim_line_check *c = calloc(1, sizeof *c);
  if (c && !(c->simd = json_simd_new(64))) {
    free(c);
    c = NULL;
  }
  return c;
}

void sim_line_check_free(sim_line_check *c) {
  if (!c) return;
  json_fast_free(&c->fast);
  json_simd_free(c->simd);
  free(c);
}

static int same_value(const json_value *a, const json_value *b) {
  if (a->type != b->type) return 0;
  if (a->type == JV_NUMBER) return memcmp(&a->num, &b->num, sizeof a->num) == 0;
  if (a->type == JV_STRING) return strcmp(a->str, b->str) == 0;
  return 1;
}

int sim_line_check_run(sim_line_check *c, const char *s, size_t n, int max_depth) {
  json_line fast, slow;
  if (!c) return -2;
  if (json_fast_parse(&c->fast, s, n, max_depth, &fast)) return 0;
  if (json_simd_parse(c->simd, s, n, n, &slow)) return -1;
  if (fast.is_object != slow.is_object || fast.present != slow.present ||
      fast.shape_n != slow.shape_n)
    return -1;
  for (int k = 0; k < JK_COUNT; k++)
    if ((fast.present >> k & 1) && !same_value(&fast.v[k], &slow.v[k])) return -1;
  for (uint32_t i = 0; i < fast.shape_n && i < FERRY_MAX_DIMS; i++)
    if (!same_value(&fast.shape[i], &slow.shape[i])) return -1;
  return 1;
}
