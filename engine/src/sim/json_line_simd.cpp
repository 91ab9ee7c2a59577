/*
 * json_line_simd.cpp — a trace line read with simdjson's DOM parser into a
 * json_line (json_line.h): the reader's fast path, several times cJSON's
 * speed. Any line simdjson refuses goes to the cJSON path, which words the
 * error, so this file decides nothing about what a trace may hold.
 * No exceptions: simdjson's error-code API only.
 */
#define SIMDJSON_EXCEPTIONS 0
#include <simdjson.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "sim/json_line.h"

static_assert(JSON_LINE_PADDING >= simdjson::SIMDJSON_PADDING, "json_line.h's padding is simdjson's");

struct json_simd {
  simdjson::dom::parser parser;
  char *scratch = nullptr; /* a padded copy of a line near the end of its buffer */
  size_t scratch_cap = 0;
};

extern "C" json_simd *json_simd_new(int max_depth) {
  json_simd *p = new (std::nothrow) json_simd;
  if (!p) return nullptr;
  /* grows with the longest line; the depth bound is the reader's */
  if (p->parser.allocate(4096, (size_t)(max_depth > 0 ? max_depth : 1)) != simdjson::SUCCESS) {
    delete p;
    return nullptr;
  }
  return p;
}

extern "C" void json_simd_free(json_simd *p) {
  if (!p) return;
  std::free(p->scratch);
  delete p;
}

/* The element's value; e's type is known, so the get()s cannot fail. */
static void set_value(json_value *v, simdjson::dom::element e) {
  using simdjson::dom::element_type;
  switch (e.type()) {
  case element_type::INT64: v->type = JV_NUMBER; v->num = (double)e.get_int64().value_unsafe(); break;
  case element_type::UINT64: v->type = JV_NUMBER; v->num = (double)e.get_uint64().value_unsafe(); break;
  case element_type::DOUBLE: v->type = JV_NUMBER; v->num = e.get_double().value_unsafe(); break;
  case element_type::STRING:
    v->type = JV_STRING;
    v->str = e.get_c_str().value_unsafe();
    v->len = (uint32_t)std::strlen(v->str); /* to its first NUL, as C reads it */
    break;
  case element_type::BOOL: v->type = e.get_bool().value_unsafe() ? JV_TRUE : JV_FALSE; break;
  case element_type::ARRAY: v->type = JV_ARRAY; break;
  default: v->type = JV_OTHER; break;
  }
}

extern "C" int json_simd_parse(json_simd *p, const char *s, size_t n, size_t readable,
                               json_line *out) {
  out->present = 0;
  out->shape_n = 0;
  out->is_object = 0;
  /* a byte-order mark: cJSON refuses it, so the fast path must too */
  if (n && (unsigned char)s[0] == 0xEF) return -1;
  if (readable < n + JSON_LINE_PADDING) {
    if (p->scratch_cap < n + JSON_LINE_PADDING) {
      char *b = (char *)std::realloc(p->scratch, n + JSON_LINE_PADDING);
      if (!b) return -1;
      p->scratch = b;
      p->scratch_cap = n + JSON_LINE_PADDING;
    }
    std::memcpy(p->scratch, s, n);
    std::memset(p->scratch + n, 0, JSON_LINE_PADDING);
    s = p->scratch;
  }
  simdjson::dom::element doc;
  if (p->parser.parse(s, n, false).get(doc) != simdjson::SUCCESS) return -1;
  simdjson::dom::object obj;
  if (doc.get_object().get(obj) != simdjson::SUCCESS) return -1;
  out->is_object = 1;
  for (simdjson::dom::key_value_pair kv : obj) {
    int key = json_key_find(kv.key.data(), kv.key.size());
    json_value *v = json_line_slot(out, key);
    if (!v) continue;
    set_value(v, kv.value);
    if (key != JK_SHAPE || v->type != JV_ARRAY) continue;
    simdjson::dom::array items;
    if (kv.value.get_array().get(items) != simdjson::SUCCESS) return -1;
    for (simdjson::dom::element x : items) {
      if (out->shape_n < FERRY_MAX_DIMS) set_value(&out->shape[out->shape_n], x);
      out->shape_n++;
    }
  }
  return 0;
}
