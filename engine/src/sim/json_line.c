/*
 * json_line.c — the member table of json_line.h, and its slow path: a line
 * read with cJSON, which accepts what simdjson refuses only to word the
 * error (or to read what simdjson cannot hold, such as an integer past
 * 2^64, which the reader then calls absurd).
 */
#include <cjson/cJSON.h>
#include <string.h>

#include "sim/json_line.h"

const char *const json_key_names[JK_COUNT] = {
    [JK_EV] = "ev",         [JK_T_US] = "t_us",       [JK_ID] = "id",
    [JK_STEP] = "step",     [JK_BYTES] = "bytes",     [JK_DTYPE] = "dtype",
    [JK_SHAPE] = "shape",   [JK_KIND] = "kind",       [JK_PHASE] = "phase",
    [JK_LAYER] = "layer",   [JK_LAYERS] = "layers",   [JK_FLAGS] = "flags",
    [JK_MODULE] = "module", [JK_CLASS] = "class",     [JK_DECISION] = "decision",
    [JK_ALIAS] = "alias",   [JK_ALIAS_OF] = "alias_of", [JK_FLOPS] = "flops",
    [JK_US] = "us",         [JK_OP] = "op",           [JK_FORMAT] = "format",
    [JK_VERSION] = "version", [JK_BACKEND] = "backend", [JK_WHAT] = "what",
    [JK_HBM_BYTES] = "hbm_bytes", [JK_MIN_US] = "min_us", [JK_LAYER_BYTES] = "layer_bytes",
    [JK_TRANSIENT] = "transient",
    [JK_RANKS] = "ranks",
};

#define LEN(s) (sizeof s - 1)
const uint8_t json_key_len[JK_COUNT] = {
    [JK_EV] = LEN("ev"),         [JK_T_US] = LEN("t_us"),         [JK_ID] = LEN("id"),
    [JK_STEP] = LEN("step"),     [JK_BYTES] = LEN("bytes"),       [JK_DTYPE] = LEN("dtype"),
    [JK_SHAPE] = LEN("shape"),   [JK_KIND] = LEN("kind"),         [JK_PHASE] = LEN("phase"),
    [JK_LAYER] = LEN("layer"),   [JK_LAYERS] = LEN("layers"),     [JK_FLAGS] = LEN("flags"),
    [JK_MODULE] = LEN("module"), [JK_CLASS] = LEN("class"),       [JK_DECISION] = LEN("decision"),
    [JK_ALIAS] = LEN("alias"),   [JK_ALIAS_OF] = LEN("alias_of"), [JK_FLOPS] = LEN("flops"),
    [JK_US] = LEN("us"),         [JK_OP] = LEN("op"),             [JK_FORMAT] = LEN("format"),
    [JK_VERSION] = LEN("version"), [JK_BACKEND] = LEN("backend"), [JK_WHAT] = LEN("what"),
    [JK_HBM_BYTES] = LEN("hbm_bytes"), [JK_MIN_US] = LEN("min_us"),
    [JK_LAYER_BYTES] = LEN("layer_bytes"), [JK_TRANSIENT] = LEN("transient"),
    [JK_RANKS] = LEN("ranks"),
};

static void from_cjson(json_value *v, const cJSON *x) {
  if (cJSON_IsNumber(x)) {
    v->type = JV_NUMBER;
    v->num = x->valuedouble;
  } else if (cJSON_IsString(x) && x->valuestring) {
    v->type = JV_STRING;
    v->str = x->valuestring;
    v->len = (uint32_t)strlen(x->valuestring);
  } else if (cJSON_IsTrue(x)) {
    v->type = JV_TRUE;
  } else if (cJSON_IsFalse(x)) {
    v->type = JV_FALSE;
  } else if (cJSON_IsArray(x)) {
    v->type = JV_ARRAY;
  } else {
    v->type = JV_OTHER;
  }
}

void json_line_from_cjson(const cJSON *o, json_line *out) {
  out->present = 0;
  out->shape_n = 0;
  out->is_object = cJSON_IsObject(o);
  if (!out->is_object) return;
  for (const cJSON *m = o->child; m; m = m->next) {
    if (!m->string) continue;
    int key = json_key_find(m->string, strlen(m->string));
    json_value *v = json_line_slot(out, key);
    if (!v) continue;
    from_cjson(v, m);
    if (key != JK_SHAPE || v->type != JV_ARRAY) continue;
    for (const cJSON *x = m->child; x; x = x->next, out->shape_n++)
      if (out->shape_n < FERRY_MAX_DIMS) from_cjson(&out->shape[out->shape_n], x);
  }
}

/* The deepest [ and { nesting of a JSON line, strings skipped: checked
 * before cJSON parses, so a hostile line costs one pass and no recursion. */
int json_depth(const char *s, size_t n) {
  int depth = 0, deepest = 0, in_string = 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (in_string) {
      if (c == '\\') i++;
      else if (c == '"') in_string = 0;
    } else if (c == '"') {
      in_string = 1;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
    } else if (c == ']' || c == '}') {
      depth--;
    }
  }
  return deepest;
}

/* Nesting levels json_escaped_nul keeps the member of; deeper ones name the
 * member of the deepest level kept. */
#define NUL_MEMBER_LEVELS 64

/* The column (from 1) of the first escaped NUL (\u0000) in a string of a
 * JSON line, 0 if none; where it is in *where (json_line.h). */
long json_escaped_nul(const char *s, size_t n, json_nul_at *where) {
  /* the member whose value holds the current level: an object's last name
   * read, an array's own member; each open container's parent saved */
  struct { const char *key; size_t len; } up[NUL_MEMBER_LEVELS];
  const char *key = NULL;
  size_t key_len = 0, depth = 0;
  memset(where, 0, sizeof *where);
  if (!memchr(s, '\\', n)) return 0; /* no escape at all: the usual line */
  for (size_t i = 0; i < n; i++) {
    if (s[i] == '{' || s[i] == '[') {
      if (depth < NUL_MEMBER_LEVELS) up[depth].key = key, up[depth].len = key_len;
      depth++;
      if (s[i] == '{' && depth <= NUL_MEMBER_LEVELS) key = NULL, key_len = 0; /* no name yet */
      continue;
    }
    if (s[i] == '}' || s[i] == ']') {
      if (depth && --depth < NUL_MEMBER_LEVELS) key = up[depth].key, key_len = up[depth].len;
      continue;
    }
    if (s[i] != '"') continue;
    size_t start = ++i;
    long col = 0;
    for (; i < n && s[i] != '"'; i++) {
      if (s[i] != '\\') continue;
      if (!col && i + 5 < n && s[i + 1] == 'u' && !memcmp(s + i + 2, "0000", 4)) col = (long)i + 1;
      i++; /* the escaped character (or \u's first digit: no quote) */
    }
    size_t len = (i < n ? i : n) - start, j = i + 1;
    while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\r' || s[j] == '\n')) j++;
    int is_name = j < n && s[j] == ':';
    if (col) {
      where->in_name = is_name;
      if (!is_name) where->member = key, where->member_len = key_len;
      return col;
    }
    if (is_name && depth <= NUL_MEMBER_LEVELS) key = s + start, key_len = len;
  }
  return 0;
}
