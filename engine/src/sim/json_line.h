/*
 * json_line.h — one line of a JSON-lines trace, as the members the trace
 * reader knows. Three parsers fill it, each passing on what it does not
 * take: a one-pass reader of the lines trace writers emit
 * (json_line_fast.c), simdjson (json_line_simd.cpp), and cJSON
 * (json_line.c), which also words the error of a malformed line with its
 * column. Unknown members are skipped; of a member given twice, the first
 * counts (cJSON's lookup).
 */
#ifndef FERRY_SIM_JSON_LINE_H
#define FERRY_SIM_JSON_LINE_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The members of docs/trace-format.md, in no particular order. */
typedef enum json_key {
  JK_EV, JK_T_US, JK_ID, JK_STEP, JK_BYTES, JK_DTYPE, JK_SHAPE, JK_KIND, JK_PHASE, JK_LAYER,
  JK_LAYERS, JK_FLAGS, JK_MODULE, JK_CLASS, JK_DECISION, JK_ALIAS, JK_ALIAS_OF, JK_FLOPS, JK_US,
  JK_OP, JK_FORMAT, JK_VERSION, JK_BACKEND, JK_WHAT, JK_HBM_BYTES, JK_MIN_US, JK_LAYER_BYTES,
  JK_TRANSIENT, JK_RANKS, JK_COUNT
} json_key;

typedef enum json_type {
  JV_OTHER = 1, /* null or an object */
  JV_NUMBER,
  JV_STRING,
  JV_TRUE,
  JV_FALSE,
  JV_ARRAY /* only "shape" keeps its items */
} json_type;

typedef struct json_value {
  uint8_t type;    /* json_type */
  uint32_t len;    /* JV_STRING: strlen(str) */
  double num;      /* JV_NUMBER */
  const char *str; /* JV_STRING: valid until the next line is parsed */
} json_value;

typedef struct json_line {
  uint32_t present; /* bit k: member k was given */
  json_value v[JK_COUNT];
  uint32_t shape_n; /* "shape"'s items, when it is an array */
  json_value shape[FERRY_MAX_DIMS];
  int is_object; /* the line was an object (else nothing else is set) */
} json_line;

/* The member's name, as the trace format spells it. */
extern const char *const json_key_names[JK_COUNT];

/* The length of each member's name (json_line.c). */
extern const uint8_t json_key_len[JK_COUNT];

/* The key of name k (n bytes), or -1 for a member the reader ignores. By
 * length and first letter, then one comparison: a pack line has fourteen
 * members, so this runs a few million times a second (inline: the call
 * was a fifth of it). */
static inline int json_key_find(const char *k, size_t n) {
  int key = -1;
  if (n == 0 || n > 11) return -1;
  switch (k[0]) {
  case 'a': key = n == 5 ? JK_ALIAS : JK_ALIAS_OF; break;
  case 'b': key = n == 5 ? JK_BYTES : JK_BACKEND; break;
  case 'c': key = JK_CLASS; break;
  case 'd': key = n == 5 ? JK_DTYPE : JK_DECISION; break;
  case 'e': key = JK_EV; break;
  case 'f': key = n == 5 ? JK_FLAGS : n == 6 ? JK_FORMAT : JK_FLOPS; break;
  case 'h': key = JK_HBM_BYTES; break;
  case 'i': key = JK_ID; break;
  case 'k': key = JK_KIND; break;
  case 'l': key = n == 5 ? JK_LAYER : n == 6 ? JK_LAYERS : JK_LAYER_BYTES; break;
  case 'm': key = k[1] == 'i' ? JK_MIN_US : JK_MODULE; break;
  case 'o': key = JK_OP; break;
  case 'p': key = JK_PHASE; break;
  case 'r': key = JK_RANKS; break;
  case 's': key = n == 4 ? JK_STEP : JK_SHAPE; break;
  case 't': key = n == 4 ? JK_T_US : JK_TRANSIENT; break;
  case 'u': key = JK_US; break;
  case 'v': key = JK_VERSION; break;
  case 'w': key = JK_WHAT; break;
  default: return -1;
  }
  /* "flags" and "flops" share length and letter: the comparison settles it */
  if (key == JK_FLAGS && n == 5 && k[2] == 'o') key = JK_FLOPS;
  if (json_key_len[key] != n) return -1;
  const char *name = json_key_names[key];
  for (size_t i = 1; i < n; i++) /* short: a call to memcmp cost more */
    if (name[i] != k[i]) return -1;
  return key;
}


/* Sets member key from its value, unless an earlier one was given. */
static inline json_value *json_line_slot(json_line *l, int key) {
  if (key < 0 || (l->present >> key & 1)) return NULL;
  l->present |= 1u << key;
  return &l->v[key];
}

static inline const json_value *json_line_get(const json_line *l, json_key key) {
  return l->present >> key & 1 ? &l->v[key] : NULL;
}

/* The slow path: the members of a line cJSON parsed (o lives as long as
 * *out's strings are used); is_object 0 if it is not an object. */
struct cJSON;
void json_line_from_cjson(const struct cJSON *o, json_line *out);

/* The first parser (json_line_fast.c): flat objects of ASCII strings
 * without escapes, numbers exact in a double as simdjson reads them, and
 * arrays of those. 0, or -1 for any other line (then simdjson, then cJSON,
 * decide); never accepts what simdjson would refuse. Strings live in *f
 * until the next line. f starts zeroed; json_fast_free gives it back. */
typedef struct json_fast {
  char *buf; /* the line's copy */
  size_t cap;
  /* `"name":` of each member as two little-endian words and their masks
   * (built on the first line), and the member that followed each member
   * last time (next[JK_COUNT]: the first of a line): tried first, by
   * comparing those bytes */
  uint64_t name_word[JK_COUNT][2], name_mask[JK_COUNT][2];
  uint8_t name_len[JK_COUNT];
  uint8_t next[JK_COUNT + 1];
  int ready;
} json_fast;
int json_fast_parse(json_fast *f, const char *s, size_t n, int max_depth, json_line *out);
void json_fast_free(json_fast *f);

/* Readable bytes a buffer keeps past its last line so that no line is
 * copied for simdjson (it reads up to this far past a document's end). */
#define JSON_LINE_PADDING 64

/* The fast parser: one per reader, lines nested at most max_depth deep. */
typedef struct json_simd json_simd;
json_simd *json_simd_new(int max_depth);
void json_simd_free(json_simd *p);
/* Parses the n bytes at s (readable bytes from s: at least n; with fewer
 * than n + JSON_LINE_PADDING the line is copied) into *out: 0, or -1 if simdjson did not
 * accept the line, which the cJSON path then reads and words. */
int json_simd_parse(json_simd *p, const char *s, size_t n, size_t readable, json_line *out);

/* The deepest [ and { nesting of a JSON line, strings skipped (trace_reader.c
 * checks it before parsing). */
int json_depth(const char *s, size_t n);

/* The column (from 1) of the first escaped NUL (\u0000) inside a string of
 * the line, 0 if none: the reader keeps strings as C strings, which would
 * end there, so it refuses such a line, saying where: in a member's name
 * (in_name), or in the value of member (member_len bytes, as written;
 * NULL: a string outside any member). */
typedef struct json_nul_at {
  int in_name;
  const char *member;
  size_t member_len;
} json_nul_at;
long json_escaped_nul(const char *s, size_t n, json_nul_at *where);

#ifdef __cplusplus
}
#endif

#endif
