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

/* The 8-byte loads below read names and digits in little-endian order. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "json_line_fast.c reads 8 bytes at a time as a little-endian CPU does"
#endif

/* 10^0 .. 10^22: every one exact in a double */
static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                 1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The line is copied into f->buf with NUL bytes after it, so that no scan
 * tests for the end: a NUL is no byte of any JSON token, so every scan
 * stops there and the line is passed on, unless the object closed exactly
 * at the end. (A NUL inside the line stops the scan the same way.) Strings
 * are then ended in place, their closing quote overwritten. Each function
 * takes the position and returns the position after what it read, or NULL
 * to pass the line on. */
#define TAIL 16 /* NUL bytes after the copy: the 8-byte loads stay in it */

static inline int is_digit(char c) { return (unsigned char)(c - '0') < 10; }

/* JSON's whitespace (the NUL after the line is none) */
static inline char *skip_ws(char *p) {
  /* the first test passes over the usual case: no whitespace */
  while ((unsigned char)*p <= ' ' && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
  return p;
}

/* The bytes of x (little-endian: lowest first) that end a string or that
 * this path passes on: '"', '\\', below 0x20 (controls, the NUL after the
 * line), from 0x80 (UTF-8). Their high bits; the lowest set one marks the
 * first such byte exactly. */
static inline uint64_t string_stops(uint64_t x) {
  const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  uint64_t quote = x ^ (ones * '"'), slash = x ^ (ones * '\\');
  uint64_t zero_quote = (quote - ones) & ~quote, zero_slash = (slash - ones) & ~slash;
  uint64_t below_space = (x - ones * 0x20) & ~x;
  return (zero_quote | zero_slash | below_space | x) & highs;
}

static inline uint64_t load8(const char *p) {
  uint64_t x;
  memcpy(&x, p, 8);
  return x;
}

/* The count of digits x (8 bytes, the first lowest) starts with: a byte
 * is a digit when its high nibble is 3 before and after adding 6 (a carry
 * out of a byte that is not a digit reaches only later bytes). */
static inline int digit_run(uint64_t x) {
  const uint64_t highs = 0xF0F0F0F0F0F0F0F0ull, threes = 0x3030303030303030ull;
  uint64_t not_digit = ((x & highs) ^ threes) | (((x + 0x0606060606060606ull) & highs) ^ threes);
  return not_digit ? __builtin_ctzll(not_digit) >> 3 : 8;
}

/* The value of the d (1 to 8) digits x starts with: shifted to the top
 * (the bytes below read as zeros, leading digits), then pairs, fours and
 * eights summed in three multiplications. */
static inline uint64_t digits_value(uint64_t x, int d) {
  x = (x << (8 * (8 - d))) & 0x0F0F0F0F0F0F0F0Full;
  x = x * 10 + (x >> 8);
  x = ((x & 0x000000FF000000FFull) * (100 + (1000000ull << 32)) +
       ((x >> 16 & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >> 32;
  return x & 0xFFFFFFFFu;
}

static const uint64_t POW10_INT[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000,
                                      100000000};

/* The run of digits at p, 8 a step, added to *w (wrapping past 19 digits,
 * when the number is passed on anyway); the position after it. */
static inline char *digit_run_into(char *p, uint64_t *w) {
  for (;;) {
    uint64_t x = load8(p);
    int d = digit_run(x);
    if (!d) return p;
    *w = *w * POW10_INT[d] + digits_value(x, d);
    p += d;
    if (d < 8) return p;
  }
}

/* The number at p into *out. */
static inline char *number(char *p, double *out) {
  int neg = *p == '-';
  p += neg;
  uint64_t w = 0;
  char *first = p;
  p = digit_run_into(p, &w);
  if (p == first || (*first == '0' && p - first > 1)) return NULL; /* none, or a leading zero */
  int digits = (int)(p - first) - (*first == '0'), exp10 = 0; /* as w holds them */
  if (*p != '.' && (*p | 0x20) != 'e') { /* an integer: the usual case */
    if (digits > 18) return NULL;
    *out = (double)(neg ? -(int64_t)w : (int64_t)w); /* simdjson's int64, converted */
    return p;
  }
  if (*p == '.') {
    char *frac = ++p;
    p = digit_run_into(p, &w);
    if (p == frac) return NULL;
    exp10 = -(int)(p - frac);
    digits -= exp10;
  }
  if ((*p | 0x20) == 'e') {
    p++;
    int eneg = 0;
    if (*p == '+' || *p == '-') eneg = *p++ == '-';
    if (!is_digit(*p)) return NULL;
    int x = 0;
    for (; is_digit(*p); p++)
      if (x < 100000) x = x * 10 + (*p - '0');
    exp10 += eneg ? -x : x;
  }
  if (digits > 19) return NULL; /* w did not keep every digit */
  if (w > (1ull << 53) || exp10 < -22 || exp10 > 22) return NULL;
  double v = exp10 < 0 ? (double)w / POW10[-exp10] : (double)w * POW10[exp10];
  *out = neg ? -v : v;
  return p;
}

/* The closing quote of the string whose text starts at p, 8 bytes a test
 * (the NUL after the line stops it); NULL for an escape, a control or
 * UTF-8, which are passed on. */
static inline char *string_end(char *p) {
  uint64_t stops;
  while (!(stops = string_stops(load8(p)))) p += 8;
  p += __builtin_ctzll(stops) >> 3;
  return *p == '"' ? p : NULL;
}

/* The bytes of a name of up to 8 letters, as a little-endian load reads them. */
#define K8(a, b, c, d, e, f, g, h)                                                             \
  ((uint64_t)(a) | (uint64_t)(b) << 8 | (uint64_t)(c) << 16 | (uint64_t)(d) << 24 |            \
   (uint64_t)(e) << 32 | (uint64_t)(f) << 40 | (uint64_t)(g) << 48 | (uint64_t)(h) << 56)

/* The key of the member name at p (after its quote), and *end its closing
 * quote; -1 for a name the reader ignores, NULL *end for one this path
 * passes on. A name of at most 8 bytes is one masked load compared as a
 * number (the switch is a few comparisons); a longer one, a word more. */
static inline int member_key(char *p, char **end) {
  uint64_t w = load8(p), stops = string_stops(w);
  if (!stops) { /* 8 bytes or more */
    *end = string_end(p + 8);
    if (!*end) return -1;
    size_t n = (size_t)(*end - p);
    if (n == 8) {
      if (w == K8('d', 'e', 'c', 'i', 's', 'i', 'o', 'n')) return JK_DECISION;
      if (w == K8('a', 'l', 'i', 'a', 's', '_', 'o', 'f')) return JK_ALIAS_OF;
      return -1;
    }
    if (n > 16) return -1;
    uint64_t w2 = load8(p + 8) & (~0ull >> (64 - 8 * (n - 8))); /* the bytes after the 8th */
    if (w == K8('h', 'b', 'm', '_', 'b', 'y', 't', 'e') && w2 == 's') return JK_HBM_BYTES;
    if (w == K8('t', 'r', 'a', 'n', 's', 'i', 'e', 'n') && w2 == 't') return JK_TRANSIENT;
    if (w == K8('l', 'a', 'y', 'e', 'r', '_', 'b', 'y') && w2 == K8('t', 'e', 's', 0, 0, 0, 0, 0))
      return JK_LAYER_BYTES;
    return -1;
  }
  int at = __builtin_ctzll(stops) >> 3;
  *end = p + at;
  if (p[at] != '"') {
    *end = NULL;
    return -1;
  }
  w &= at ? ~0ull >> (64 - 8 * at) : 0;
  switch (w) {
  case K8('e', 'v', 0, 0, 0, 0, 0, 0): return JK_EV;
  case K8('t', '_', 'u', 's', 0, 0, 0, 0): return JK_T_US;
  case K8('i', 'd', 0, 0, 0, 0, 0, 0): return JK_ID;
  case K8('s', 't', 'e', 'p', 0, 0, 0, 0): return JK_STEP;
  case K8('b', 'y', 't', 'e', 's', 0, 0, 0): return JK_BYTES;
  case K8('d', 't', 'y', 'p', 'e', 0, 0, 0): return JK_DTYPE;
  case K8('s', 'h', 'a', 'p', 'e', 0, 0, 0): return JK_SHAPE;
  case K8('k', 'i', 'n', 'd', 0, 0, 0, 0): return JK_KIND;
  case K8('p', 'h', 'a', 's', 'e', 0, 0, 0): return JK_PHASE;
  case K8('l', 'a', 'y', 'e', 'r', 0, 0, 0): return JK_LAYER;
  case K8('l', 'a', 'y', 'e', 'r', 's', 0, 0): return JK_LAYERS;
  case K8('f', 'l', 'a', 'g', 's', 0, 0, 0): return JK_FLAGS;
  case K8('m', 'o', 'd', 'u', 'l', 'e', 0, 0): return JK_MODULE;
  case K8('c', 'l', 'a', 's', 's', 0, 0, 0): return JK_CLASS;
  case K8('a', 'l', 'i', 'a', 's', 0, 0, 0): return JK_ALIAS;
  case K8('f', 'l', 'o', 'p', 's', 0, 0, 0): return JK_FLOPS;
  case K8('u', 's', 0, 0, 0, 0, 0, 0): return JK_US;
  case K8('o', 'p', 0, 0, 0, 0, 0, 0): return JK_OP;
  case K8('f', 'o', 'r', 'm', 'a', 't', 0, 0): return JK_FORMAT;
  case K8('v', 'e', 'r', 's', 'i', 'o', 'n', 0): return JK_VERSION;
  case K8('b', 'a', 'c', 'k', 'e', 'n', 'd', 0): return JK_BACKEND;
  case K8('w', 'h', 'a', 't', 0, 0, 0, 0): return JK_WHAT;
  case K8('m', 'i', 'n', '_', 'u', 's', 0, 0): return JK_MIN_US;
  case K8('r', 'a', 'n', 'k', 's', 0, 0, 0): return JK_RANKS;
  default: return -1;
  }
}

/* A scalar at p into *v (v NULL: checked only); a string is ended in place. */
static inline __attribute__((always_inline)) char *scalar(char *p, json_value *v) {
  json_value scratch;
  if (!v) v = &scratch;
  switch (*p) {
  case '"': {
    char *end = string_end(p + 1);
    if (!end) return NULL;
    *end = 0;
    v->type = JV_STRING;
    v->str = p + 1;
    v->len = (uint32_t)(end - p - 1);
    return end + 1;
  }
  case 't': v->type = JV_TRUE; return !memcmp(p, "true", 4) ? p + 4 : NULL;
  case 'f': v->type = JV_FALSE; return !memcmp(p, "false", 5) ? p + 5 : NULL;
  case 'n': v->type = JV_OTHER; return !memcmp(p, "null", 4) ? p + 4 : NULL;
  default: {
    v->type = JV_NUMBER;
    /* a non-negative integer of at most 15 digits (ids, sizes, layers):
     * a load or two, no loop */
    uint64_t x = load8(p), w;
    int d = digit_run(x);
    if (d < 8) {
      w = d == 1 ? (uint64_t)(*p - '0') : d ? digits_value(x, d) : 0;
    } else {
      uint64_t x2 = load8(p + 8);
      int d2 = digit_run(x2);
      if (d2 == 8) return number(p, &v->num);
      w = digits_value(x, 8) * POW10_INT[d2] + (d2 ? digits_value(x2, d2) : 0);
      d += d2;
    }
    char after = p[d];
    if (d && (*p != '0' || d == 1) && after != '.' && (after | 0x20) != 'e') {
      v->num = (double)w;
      return p + d;
    }
    return number(p, &v->num);
  }
  }
}

/* An array of scalars after its '[' (its items kept in out->shape if keep). */
static char *array(char *p, json_line *out, int keep) {
  p = skip_ws(p + 1);
  if (*p == ']') return p + 1;
  for (;;) {
    if (*p == '[' || *p == '{') return NULL;
    json_value *v = keep && out->shape_n < FERRY_MAX_DIMS ? &out->shape[out->shape_n] : NULL;
    if (!(p = scalar(p, v))) return NULL;
    if (keep) out->shape_n++;
    if (*p == ',') {
      p = skip_ws(p + 1);
      continue;
    }
    p = skip_ws(p);
    if (*p == ']') return p + 1;
    if (*p != ',') return NULL;
    p = skip_ws(p + 1);
  }
}

void json_fast_free(json_fast *f) {
  free(f->buf);
  f->buf = NULL;
  f->cap = 0;
}

/* The words name_word/name_mask compare: `"name":` of each member. */
static void names_ready(json_fast *f) {
  for (int k = 0; k < JK_COUNT; k++) {
    char pat[16] = {0}, mask[16] = {0};
    size_t n = json_key_len[k];
    pat[0] = '"';
    memcpy(pat + 1, json_key_names[k], n);
    pat[n + 1] = '"';
    pat[n + 2] = ':';
    memset(mask, 0xFF, n + 3); /* at most 11 + 3 bytes */
    for (int i = 0; i < 2; i++) {
      memcpy(&f->name_word[k][i], pat + 8 * i, 8);
      memcpy(&f->name_mask[k][i], mask + 8 * i, 8);
    }
    f->name_len[k] = (uint8_t)(n + 3);
  }
  memset(f->next, 0xFF, sizeof f->next);
  f->ready = 1;
}

int json_fast_parse(json_fast *f, const char *s, size_t n, int max_depth, json_line *out) {
  out->present = 0;
  out->shape_n = 0;
  out->is_object = 0;
  if (max_depth < 1) return -1;
  if (f->cap < n + TAIL) {
    char *b = realloc(f->buf, n + TAIL);
    if (!b) return -1;
    f->buf = b;
    f->cap = n + TAIL;
  }
  if (!f->ready) names_ready(f);
  char *p = f->buf, *e = f->buf + n;
  memcpy(p, s, n);
  memset(e, 0, TAIL);
  p = skip_ws(p);
  if (*p != '{') return -1;
  p = skip_ws(p + 1);
  if (*p == '}') {
    p++;
  } else {
    int after = JK_COUNT; /* the member before this one (JK_COUNT: none) */
    for (;;) {
      int key = f->next[after];
      /* the member that followed last time, its bytes compared at once */
      if (key < JK_COUNT && !(((load8(p) ^ f->name_word[key][0]) & f->name_mask[key][0]) |
                              ((load8(p + 8) ^ f->name_word[key][1]) & f->name_mask[key][1]))) {
        p += f->name_len[key];
      } else {
        if (*p != '"') return -1;
        char *kend;
        key = member_key(p + 1, &kend);
        if (!kend) return -1;
        p = kend + 1;
        if (*p != ':') {
          p = skip_ws(p);
          if (*p != ':') return -1;
        }
        p++;
        if (key >= 0) f->next[after] = (uint8_t)key;
      }
      if (key >= 0) after = key;
      p = skip_ws(p);
      json_value *v = json_line_slot(out, key);
      if (*p == '[') {
        if (max_depth < 2 || !(p = array(p, out, key == JK_SHAPE && v))) return -1;
        if (v) v->type = JV_ARRAY;
      } else if (*p == '{' || !(p = scalar(p, v))) {
        return -1;
      }
      if (*p == ',') {
        p = skip_ws(p + 1);
        continue;
      }
      p = skip_ws(p);
      if (*p == '}') {
        p++;
        break;
      }
      if (*p != ',') return -1;
      p = skip_ws(p + 1);
    }
  }
  if (skip_ws(p) != e) return -1;
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
