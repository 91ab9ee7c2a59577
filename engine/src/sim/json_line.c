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
};

#define LEN(s) (sizeof s - 1)
static const uint8_t key_len[JK_COUNT] = {
    [JK_EV] = LEN("ev"),         [JK_T_US] = LEN("t_us"),         [JK_ID] = LEN("id"),
    [JK_STEP] = LEN("step"),     [JK_BYTES] = LEN("bytes"),       [JK_DTYPE] = LEN("dtype"),
    [JK_SHAPE] = LEN("shape"),   [JK_KIND] = LEN("kind"),         [JK_PHASE] = LEN("phase"),
    [JK_LAYER] = LEN("layer"),   [JK_LAYERS] = LEN("layers"),     [JK_FLAGS] = LEN("flags"),
    [JK_MODULE] = LEN("module"), [JK_CLASS] = LEN("class"),       [JK_DECISION] = LEN("decision"),
    [JK_ALIAS] = LEN("alias"),   [JK_ALIAS_OF] = LEN("alias_of"), [JK_FLOPS] = LEN("flops"),
    [JK_US] = LEN("us"),         [JK_OP] = LEN("op"),             [JK_FORMAT] = LEN("format"),
    [JK_VERSION] = LEN("version"), [JK_BACKEND] = LEN("backend"), [JK_WHAT] = LEN("what"),
    [JK_HBM_BYTES] = LEN("hbm_bytes"), [JK_MIN_US] = LEN("min_us"),
    [JK_LAYER_BYTES] = LEN("layer_bytes"),
};

/* By length and first letter, then one comparison: a pack line has fourteen
 * members, so this runs a few million times a second. */
int json_key_find(const char *k, size_t n) {
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
  case 's': key = n == 4 ? JK_STEP : JK_SHAPE; break;
  case 't': key = JK_T_US; break;
  case 'u': key = JK_US; break;
  case 'v': key = JK_VERSION; break;
  case 'w': key = JK_WHAT; break;
  default: return -1;
  }
  /* "flags" and "flops" share length and letter: the comparison settles it */
  if (key == JK_FLAGS && n == 5 && k[2] == 'o') key = JK_FLOPS;
  if (key_len[key] != n) return -1;
  const char *name = json_key_names[key];
  for (size_t i = 1; i < n; i++) /* short: a call to memcmp cost more */
    if (name[i] != k[i]) return -1;
  return key;
}

static void from_cjson(json_value *v, const cJSON *x) {
  if (cJSON_IsNumber(x)) {
    v->type = JV_NUMBER;
    v->num = x->valuedouble;
  } else if (cJSON_IsString(x) && x->valuestring) {
    v->type = JV_STRING;
    v->str = x->valuestring;
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
