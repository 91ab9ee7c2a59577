/*
 * trace_replayer.c — the trace replayer (trace_replayer.h): a strict reader
 * of docs/trace-format.md and a driver that calls ferry_pack/unpack/step/
 * backward exactly as a trainer would, for N steps.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_sim.h"
#include "engine_internal.h"
#include "names.h"
#include "trace_replayer.h"

#define MAX_TENSOR_BYTES (1ull << 50) /* the engine's own bound (stash.c) */
#define MAX_LAYERS 1000000
#define MAX_COMPUTE_US 3.6e9 /* an hour of compute in one event is a broken trace */
#define MAX_TRACE_BYTES ((size_t)1 << 34)

/* ============================================================================
 * Reading
 * ========================================================================== */

typedef struct id_map { /* trace id -> tensor index, open addressing */
  uint64_t *keys;       /* 0 = empty (ids are >= 1) */
  uint32_t *vals;
  size_t cap, count;
} id_map;

typedef struct str_set { /* owned strings, deduplicated */
  char **slots;
  size_t cap, count;
} str_set;

enum { TS_PACKED = 1, TS_DONE = 2 };

typedef struct reader {
  const char *name;
  sim_trace *t;
  char *err;
  size_t errlen;
  uint32_t line;
  id_map ids;
  str_set strs;
  uint8_t *state; /* per tensor: TS_* */
  uint32_t cap_events, cap_tensors, cap_steps, cap_resident;
  int seen_header;
  int in_step, in_backward;
  uint64_t step_number;
  uint32_t step_first;
  uint32_t live_in_step;
  double last_t; /* t_us of the previous line */
  int has_gap;   /* t_us moved at least once */
} reader;

static int rd_fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int rd_fail(reader *r, const char *fmt, ...) {
  if (r->err && r->errlen) {
    int n = r->line ? snprintf(r->err, r->errlen, "%s:%u: ", r->name, r->line)
                    : snprintf(r->err, r->errlen, "%s: ", r->name);
    if (n < 0) n = 0;
    if ((size_t)n < r->errlen) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(r->err + n, r->errlen - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return FERRY_EPARSE;
}

static uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static int idmap_find(const id_map *m, uint64_t key, uint32_t *val) {
  if (!m->cap) return 0;
  for (size_t j = mix64(key) & (m->cap - 1); m->keys[j]; j = (j + 1) & (m->cap - 1))
    if (m->keys[j] == key) {
      *val = m->vals[j];
      return 1;
    }
  return 0;
}

static int idmap_put(id_map *m, uint64_t key, uint32_t val) {
  if ((m->count + 1) * 2 > m->cap) {
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    uint64_t *k = calloc(ncap, sizeof *k);
    uint32_t *v = calloc(ncap, sizeof *v);
    if (!k || !v) {
      free(k);
      free(v);
      return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
      if (!m->keys[i]) continue;
      size_t j = mix64(m->keys[i]) & (ncap - 1);
      while (k[j]) j = (j + 1) & (ncap - 1);
      k[j] = m->keys[i];
      v[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = k;
    m->vals = v;
    m->cap = ncap;
  }
  size_t j = mix64(key) & (m->cap - 1);
  while (m->keys[j]) j = (j + 1) & (m->cap - 1);
  m->keys[j] = key;
  m->vals[j] = val;
  m->count++;
  return 0;
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* An owned copy of s, shared by equal strings; NULL out of memory. */
static const char *str_own(reader *r, const char *s) {
  str_set *t = &r->strs;
  if ((t->count + 1) * 2 > t->cap) {
    size_t ncap = t->cap ? t->cap * 2 : 256;
    char **n = calloc(ncap, sizeof *n);
    if (!n) return NULL;
    for (size_t i = 0; i < t->cap; i++) {
      if (!t->slots[i]) continue;
      size_t j = hash_str(t->slots[i]) & (ncap - 1);
      while (n[j]) j = (j + 1) & (ncap - 1);
      n[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = n;
    t->cap = ncap;
  }
  size_t j = hash_str(s) & (t->cap - 1);
  while (t->slots[j]) {
    if (!strcmp(t->slots[j], s)) return t->slots[j];
    j = (j + 1) & (t->cap - 1);
  }
  char *c = strdup(s);
  if (!c) return NULL;
  t->slots[j] = c;
  t->count++;
  return c;
}

static int grow(void **arr, uint32_t *cap, size_t elem, uint32_t need) {
  if (need <= *cap) return 0;
  uint32_t ncap = *cap ? *cap : 256;
  while (ncap < need) {
    if (ncap > UINT32_MAX / 2) return -1;
    ncap *= 2;
  }
  void *n = realloc(*arr, (size_t)ncap * elem);
  if (!n) return -1;
  *arr = n;
  *cap = ncap;
  return 0;
}

/* ---- members ------------------------------------------------------------------ */

/* An integer member within [lo, hi]. */
static int get_int(reader *r, const cJSON *o, const char *key, int required, double lo, double hi,
                   int64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v) {
    if (required) return rd_fail(r, "missing member \"%s\"", key);
    return 1;
  }
  if (!cJSON_IsNumber(v)) return rd_fail(r, "\"%s\" must be a number", key);
  double d = v->valuedouble;
  if (!isfinite(d) || d != floor(d)) return rd_fail(r, "\"%s\" must be an integer, got %g", key, d);
  if (d < lo || d > hi)
    return rd_fail(r, "\"%s\" = %.0f is %s (allowed %.0f .. %.0f)", key, d,
                   d < lo ? (d < 0 ? "negative" : "too small") : "absurd", lo, hi);
  *out = (int64_t)d;
  return 0;
}

static int get_str(reader *r, const cJSON *o, const char *key, int required, const char **out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = NULL;
  if (!v) return required ? rd_fail(r, "missing member \"%s\"", key) : 1;
  if (!cJSON_IsString(v) || !v->valuestring) return rd_fail(r, "\"%s\" must be a string", key);
  *out = v->valuestring;
  return 0;
}

static int add_event(reader *r, uint8_t type, uint32_t tensor, double gap) {
  sim_trace *t = r->t;
  if (grow((void **)&t->events, &r->cap_events, sizeof *t->events, t->n_events + 1))
    return rd_fail(r, "out of memory");
  t->events[t->n_events++] = (trace_event){.type = type, .tensor = tensor, .gap_us = gap};
  return 0;
}

/* The tensor an event names by its "id", which must be packed and live. */
static int get_live_tensor(reader *r, const cJSON *o, const char *ev, uint32_t *idx) {
  int64_t id;
  int rc = get_int(r, o, "id", 1, 1, 9007199254740992.0, &id);
  if (rc) return rc;
  if (!idmap_find(&r->ids, (uint64_t)id, idx))
    return rd_fail(r, "%s of id %lld before its pack", ev, (long long)id);
  if (r->state[*idx] == TS_DONE)
    return rd_fail(r, "%s of id %lld, which was already unpacked or discarded (line %u packed it)",
                   ev, (long long)id, r->t->tensors[*idx].line);
  if (r->t->tensors[*idx].desc.layer_count == -2) /* never */
    return rd_fail(r, "internal");
  return 0;
}

static int parse_pack(reader *r, const cJSON *o, double gap) {
  sim_trace *t = r->t;
  if (!r->in_step) return rd_fail(r, "pack outside a step (no step_begin before it)");
  int64_t id, step, bytes, layer, layers, flags = 0;
  int rc;
  if ((rc = get_int(r, o, "id", 1, 1, 9007199254740992.0, &id)) ||
      (rc = get_int(r, o, "step", 1, 0, 9007199254740992.0, &step)) ||
      (rc = get_int(r, o, "bytes", 1, 1, (double)MAX_TENSOR_BYTES, &bytes)) ||
      (rc = get_int(r, o, "layer", 1, -1, MAX_LAYERS, &layer)) ||
      (rc = get_int(r, o, "layers", 1, 0, MAX_LAYERS, &layers)))
    return rc;
  if ((rc = get_int(r, o, "flags", 0, 0, 255, &flags)) < 0) return rc;
  uint32_t dup;
  if (idmap_find(&r->ids, (uint64_t)id, &dup))
    return rd_fail(r, "id %lld packed twice (first at line %u)", (long long)id,
                   t->tensors[dup].line);
  const char *dtype, *kind, *phase, *decision, *module = NULL, *cls = NULL;
  if ((rc = get_str(r, o, "dtype", 1, &dtype)) || (rc = get_str(r, o, "kind", 1, &kind)) ||
      (rc = get_str(r, o, "phase", 1, &phase)) || (rc = get_str(r, o, "decision", 1, &decision)))
    return rc;
  if ((rc = get_str(r, o, "module", 0, &module)) < 0 || (rc = get_str(r, o, "class", 0, &cls)) < 0)
    return rc;
  ferry_tensor_desc d;
  memset(&d, 0, sizeof d);
  d.bytes = (uint64_t)bytes;
  if ((d.dtype = ferry_dtype_parse(dtype)) < 0) return rd_fail(r, "unknown dtype \"%s\"", dtype);
  if ((d.kind = ferry_kind_parse(kind)) < 0) return rd_fail(r, "unknown kind \"%s\"", kind);
  if ((d.phase = ferry_phase_parse(phase)) < 0) return rd_fail(r, "unknown phase \"%s\"", phase);
  uint8_t dec;
  if (!strcmp(decision, "keep")) dec = FERRY_KEEP;
  else if (!strcmp(decision, "offload")) dec = FERRY_OFFLOAD;
  else return rd_fail(r, "decision must be \"keep\" or \"offload\", got \"%s\"", decision);
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(o, "shape");
  if (!shape) return rd_fail(r, "missing member \"shape\"");
  if (!cJSON_IsArray(shape)) return rd_fail(r, "\"shape\" must be an array of integers");
  int n = cJSON_GetArraySize(shape);
  if (n > FERRY_MAX_DIMS) return rd_fail(r, "\"shape\" has %d dimensions (at most %d)", n, FERRY_MAX_DIMS);
  d.ndim = n;
  int i = 0;
  for (const cJSON *x = shape->child; x; x = x->next, i++) {
    if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || x->valuedouble != floor(x->valuedouble) ||
        x->valuedouble < 0 || x->valuedouble > 9007199254740992.0)
      return rd_fail(r, "\"shape\"[%d] must be a non-negative integer", i);
    d.shape[i] = (int64_t)x->valuedouble;
  }
  if (layers && layer >= layers)
    return rd_fail(r, "layer %lld is not below layers %lld", (long long)layer, (long long)layers);
  d.layer = (int32_t)layer;
  d.layer_count = (int32_t)layers;
  d.flags = (uint32_t)flags;
  if (module && !(d.module_path = str_own(r, module))) return rd_fail(r, "out of memory");
  if (cls && !(d.module_class = str_own(r, cls))) return rd_fail(r, "out of memory");
  if (layers > t->layers) t->layers = (int32_t)layers;

  /* alias: the same buffer as a live earlier pack, named by alias_of or,
   * in traces without it, the latest live pack of the same size */
  int32_t alias_of = -1;
  const cJSON *al = cJSON_GetObjectItemCaseSensitive(o, "alias");
  if (al && !cJSON_IsBool(al)) return rd_fail(r, "\"alias\" must be true or false");
  if (cJSON_IsTrue(al)) {
    int64_t of;
    rc = get_int(r, o, "alias_of", 0, 1, 9007199254740992.0, &of);
    if (rc < 0) return rc;
    if (rc == 0) {
      uint32_t p;
      if (!idmap_find(&r->ids, (uint64_t)of, &p) || r->state[p] != TS_PACKED)
        return rd_fail(r, "alias_of %lld is not a live id", (long long)of);
      alias_of = (int32_t)p;
    } else {
      for (uint32_t k = t->n_tensors; k-- > 0;) {
        if (r->state[k] == TS_PACKED && t->tensors[k].alias_of < 0 &&
            t->tensors[k].desc.bytes == d.bytes) {
          alias_of = (int32_t)k;
          break;
        }
      }
      if (alias_of < 0) return rd_fail(r, "alias pack with no live earlier pack of %llu bytes",
                                       (unsigned long long)d.bytes);
    }
    while (t->tensors[alias_of].alias_of >= 0) alias_of = t->tensors[alias_of].alias_of;
    if (t->tensors[alias_of].desc.bytes != d.bytes)
      return rd_fail(r, "alias of id %llu with another size (%llu vs %llu bytes)",
                     (unsigned long long)t->tensors[alias_of].id,
                     (unsigned long long)t->tensors[alias_of].desc.bytes,
                     (unsigned long long)d.bytes);
  }
  uint32_t idx = t->n_tensors;
  uint32_t old_cap = r->cap_tensors;
  if (grow((void **)&t->tensors, &r->cap_tensors, sizeof *t->tensors, idx + 1))
    return rd_fail(r, "out of memory");
  if (r->cap_tensors != old_cap) {
    uint8_t *s = realloc(r->state, r->cap_tensors);
    if (!s) return rd_fail(r, "out of memory");
    r->state = s;
  }
  if (idmap_put(&r->ids, (uint64_t)id, idx)) return rd_fail(r, "out of memory");
  trace_tensor *tt = &t->tensors[idx];
  tt->desc = d;
  tt->id = (uint64_t)id;
  tt->alias_of = alias_of;
  tt->last_alias = -1;
  tt->decision = dec;
  tt->line = r->line;
  if (alias_of >= 0) t->tensors[alias_of].last_alias = (int32_t)idx;
  r->state[idx] = TS_PACKED;
  t->n_tensors++;
  r->live_in_step++;
  return add_event(r, TEV_PACK, idx, gap);
}

static int parse_line(reader *r, const char *s, size_t n) {
  sim_trace *t = r->t;
  const char *end = NULL;
  cJSON *o = cJSON_ParseWithLengthOpts(s, n, &end, 0);
  if (!o) {
    const char *ep = cJSON_GetErrorPtr();
    long col = ep && ep >= s && ep <= s + n ? (long)(ep - s) + 1 : 1;
    return rd_fail(r, "malformed JSON near column %ld", col);
  }
  int rc = 0;
  for (const char *p = end; p && p < s + n; p++)
    if (*p != ' ' && *p != '\t' && *p != '\r') {
      rc = rd_fail(r, "text after the JSON object at column %ld", (long)(p - s) + 1);
      goto out;
    }
  if (!cJSON_IsObject(o)) {
    rc = rd_fail(r, "a line must be a JSON object");
    goto out;
  }
  const char *ev;
  if ((rc = get_str(r, o, "ev", 1, &ev))) goto out;
  const cJSON *tv = cJSON_GetObjectItemCaseSensitive(o, "t_us");
  if (!tv) {
    rc = rd_fail(r, "missing member \"t_us\"");
    goto out;
  }
  if (!cJSON_IsNumber(tv) || !isfinite(tv->valuedouble) || tv->valuedouble < 0) {
    rc = rd_fail(r, "\"t_us\" must be a non-negative number");
    goto out;
  }
  double tus = tv->valuedouble;
  if (r->seen_header && tus + 1e-6 < r->last_t) {
    rc = rd_fail(r, "t_us %.1f goes back in time (previous line: %.1f)", tus, r->last_t);
    goto out;
  }
  double gap = r->seen_header ? tus - r->last_t : 0;
  if (gap < 0) gap = 0;
  if (gap > 0) r->has_gap = 1;
  r->last_t = tus;

  if (!r->seen_header) {
    if (strcmp(ev, "header")) {
      rc = rd_fail(r, "the first line must be the header ({\"ev\":\"header\",...}), got \"%s\"", ev);
      goto out;
    }
    const char *fmt;
    int64_t version;
    if ((rc = get_str(r, o, "format", 1, &fmt))) goto out;
    if (strcmp(fmt, "ferry-trace")) {
      rc = rd_fail(r, "format \"%s\" is not \"ferry-trace\"", fmt);
      goto out;
    }
    if ((rc = get_int(r, o, "version", 1, 1, 1e9, &version))) goto out;
    if (version != 1) {
      rc = rd_fail(r, "trace format version %lld is newer than this reader (1)", (long long)version);
      goto out;
    }
    r->seen_header = 1;
    goto out;
  }

  if (!strcmp(ev, "pack")) {
    rc = parse_pack(r, o, gap);
  } else if (!strcmp(ev, "unpack") || !strcmp(ev, "discard")) {
    if (!r->in_step) {
      rc = rd_fail(r, "%s outside a step", ev);
      goto out;
    }
    uint32_t idx;
    if ((rc = get_live_tensor(r, o, ev, &idx))) goto out;
    r->state[idx] = TS_DONE;
    r->live_in_step--;
    rc = add_event(r, ev[0] == 'u' ? TEV_UNPACK : TEV_DISCARD, idx, gap);
  } else if (!strcmp(ev, "step_begin")) {
    int64_t step;
    if ((rc = get_int(r, o, "step", 1, 0, 9007199254740992.0, &step))) goto out;
    if (r->in_step) {
      rc = rd_fail(r, "step_begin of step %lld inside step %llu (no step_end)", (long long)step,
                   (unsigned long long)r->step_number);
      goto out;
    }
    r->in_step = 1;
    r->in_backward = 0;
    r->step_number = (uint64_t)step;
    r->step_first = t->n_events;
    r->live_in_step = 0;
    rc = add_event(r, TEV_STEP_BEGIN, 0, gap);
  } else if (!strcmp(ev, "step_end")) {
    int64_t step;
    if ((rc = get_int(r, o, "step", 1, 0, 9007199254740992.0, &step))) goto out;
    if (!r->in_step) {
      rc = rd_fail(r, "step_end without step_begin");
      goto out;
    }
    if ((uint64_t)step != r->step_number) {
      rc = rd_fail(r, "step_end of step %lld inside step %llu", (long long)step,
                   (unsigned long long)r->step_number);
      goto out;
    }
    if (r->live_in_step) {
      uint32_t first = 0;
      for (uint32_t k = 0; k < t->n_tensors; k++)
        if (r->state[k] == TS_PACKED) {
          first = k;
          break;
        }
      rc = rd_fail(r, "step %llu ends with %u id(s) neither unpacked nor discarded (first: id %llu "
                      "packed at line %u)",
                   (unsigned long long)step, r->live_in_step,
                   (unsigned long long)t->tensors[first].id, t->tensors[first].line);
      goto out;
    }
    if ((rc = add_event(r, TEV_STEP_END, 0, gap))) goto out;
    if (grow((void **)&t->steps, &r->cap_steps, sizeof *t->steps, t->n_steps + 1)) {
      rc = rd_fail(r, "out of memory");
      goto out;
    }
    t->steps[t->n_steps++] = (trace_step){r->step_first, t->n_events, (uint64_t)step};
    r->in_step = 0;
  } else if (!strcmp(ev, "backward_begin") || !strcmp(ev, "backward_end")) {
    int begin = ev[9] == 'b';
    if (!r->in_step) {
      rc = rd_fail(r, "%s outside a step", ev);
      goto out;
    }
    if (begin == r->in_backward) {
      rc = rd_fail(r, "%s %s", ev, begin ? "inside backward (no backward_end)" : "without backward_begin");
      goto out;
    }
    r->in_backward = begin;
    rc = add_event(r, begin ? TEV_BACKWARD_BEGIN : TEV_BACKWARD_END, 0, gap);
  } else if (!strcmp(ev, "compute")) {
    const cJSON *us = cJSON_GetObjectItemCaseSensitive(o, "us");
    if (!us) {
      rc = rd_fail(r, "missing member \"us\"");
      goto out;
    }
    if (!cJSON_IsNumber(us) || !isfinite(us->valuedouble) || us->valuedouble < 0 ||
        us->valuedouble > MAX_COMPUTE_US) {
      rc = rd_fail(r, "\"us\" must be a number within [0, %.0f] (an hour)", MAX_COMPUTE_US);
      goto out;
    }
    if (!r->in_step) {
      rc = rd_fail(r, "compute outside a step");
      goto out;
    }
    t->has_compute = 1;
    rc = add_event(r, TEV_COMPUTE, 0, us->valuedouble);
  } else if (!strcmp(ev, "resident")) {
    int64_t bytes;
    const char *what;
    if ((rc = get_int(r, o, "bytes", 1, 0, (double)MAX_TENSOR_BYTES, &bytes)) ||
        (rc = get_str(r, o, "what", 1, &what)))
      goto out;
    if (r->in_step) {
      rc = rd_fail(r, "resident inside a step: resident memory is declared before the first step");
      goto out;
    }
    uint32_t k = 0;
    while (k < t->n_resident && strcmp(t->resident[k].what, what)) k++;
    if (k == t->n_resident) {
      if (grow((void **)&t->resident, &r->cap_resident, sizeof *t->resident, k + 1)) {
        rc = rd_fail(r, "out of memory");
        goto out;
      }
      t->resident[k].what = strdup(what);
      if (!t->resident[k].what) {
        rc = rd_fail(r, "out of memory");
        goto out;
      }
      t->resident[k].bytes = 0;
      t->n_resident++;
    }
    t->resident_bytes -= t->resident[k].bytes; /* a second line for `what` replaces it */
    t->resident[k].bytes = (uint64_t)bytes;
    t->resident_bytes += (uint64_t)bytes;
  } else if (!strcmp(ev, "header")) {
    rc = rd_fail(r, "a second header");
  } else {
    rc = rd_fail(r, "unknown event \"%s\"", ev);
  }
out:
  cJSON_Delete(o);
  return rc;
}

void sim_trace_free(sim_trace *t) {
  if (!t) return;
  free(t->name);
  free(t->events);
  free(t->tensors);
  free(t->steps);
  for (uint32_t i = 0; i < t->n_resident; i++) free(t->resident[i].what);
  free(t->resident);
  for (size_t i = 0; i < t->n_strings; i++) free(t->strings[i]);
  free(t->strings);
  free(t);
}

int sim_trace_parse(const char *name, const char *data, size_t len, sim_trace **out, char *err,
                    size_t errlen) {
  *out = NULL;
  if (err && errlen) err[0] = 0;
  reader r;
  memset(&r, 0, sizeof r);
  r.name = name ? name : "trace";
  r.err = err;
  r.errlen = errlen;
  sim_trace *t = calloc(1, sizeof *t);
  if (!t || !(t->name = strdup(r.name))) {
    free(t);
    return rd_fail(&r, "out of memory");
  }
  r.t = t;
  int rc = 0;
  if (!data || len == 0) {
    rc = rd_fail(&r, "empty trace (no header line)");
    goto done;
  }
  size_t pos = 0;
  while (pos < len) {
    r.line++;
    const char *nl = memchr(data + pos, '\n', len - pos);
    if (!nl) {
      rc = rd_fail(&r, "truncated: the last line has no newline");
      goto done;
    }
    size_t n = (size_t)(nl - (data + pos));
    const char *s = data + pos;
    pos += n + 1;
    if (memchr(s, 0, n)) {
      rc = rd_fail(&r, "NUL byte in the line");
      goto done;
    }
    size_t k = 0;
    while (k < n && (s[k] == ' ' || s[k] == '\t' || s[k] == '\r')) k++;
    if (k == n) continue; /* blank lines carry nothing */
    if ((rc = parse_line(&r, s, n))) goto done;
  }
  r.line = 0;
  if (!r.seen_header) {
    rc = rd_fail(&r, "empty trace (no header line)");
  } else if (r.in_step) {
    rc = rd_fail(&r, "truncated: ends inside step %llu (no step_end)",
                 (unsigned long long)r.step_number);
  } else if (!t->n_steps) {
    rc = rd_fail(&r, "no complete step (step_begin .. step_end) in the trace");
  }
done:
  free(r.ids.keys);
  free(r.ids.vals);
  free(r.state);
  /* The trace keeps the strings. */
  t->strings = NULL;
  t->n_strings = 0;
  if (r.strs.count) {
    t->strings = malloc(r.strs.count * sizeof *t->strings);
    if (t->strings)
      for (size_t i = 0; i < r.strs.cap; i++)
        if (r.strs.slots[i]) t->strings[t->n_strings++] = r.strs.slots[i];
  }
  if (!t->strings)
    for (size_t i = 0; i < r.strs.cap; i++) free(r.strs.slots[i]);
  free(r.strs.slots);
  if (!rc && !t->strings && r.strs.count) rc = rd_fail(&r, "out of memory");
  /* Recorded traces carry time in t_us; synthesized ones in compute events. */
  if (!rc && t->has_compute && r.has_gap)
    for (uint32_t i = 0; i < t->n_events; i++)
      if (t->events[i].type != TEV_COMPUTE) t->events[i].gap_us = 0;
  if (rc) {
    sim_trace_free(t);
    return rc;
  }
  *out = t;
  return FERRY_OK;
}

int sim_trace_load(const char *path, sim_trace **out, char *err, size_t errlen) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (err && errlen) snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    return FERRY_EIO;
  }
  size_t cap = 1 << 20, n = 0;
  char *buf = malloc(cap);
  int rc = FERRY_OK;
  while (buf) {
    if (n == cap) {
      if (cap >= MAX_TRACE_BYTES) {
        if (err && errlen) snprintf(err, errlen, "%s: larger than 16 GiB", path);
        rc = FERRY_EPARSE;
        break;
      }
      char *nb = realloc(buf, cap * 2);
      if (!nb) break;
      buf = nb;
      cap *= 2;
    }
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (got == 0) break;
  }
  int read_err = ferror(f);
  fclose(f);
  if (!buf) {
    if (err && errlen) snprintf(err, errlen, "%s: out of memory reading it", path);
    return FERRY_ENOMEM;
  }
  if (rc) {
    free(buf);
    return rc;
  }
  if (read_err) {
    free(buf);
    if (err && errlen) snprintf(err, errlen, "%s: read error", path);
    return FERRY_EIO;
  }
  rc = sim_trace_parse(path, buf, n, out, err, errlen);
  free(buf);
  return rc;
}
