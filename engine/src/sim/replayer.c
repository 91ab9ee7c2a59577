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

#include "util/errbuf.h"
#include "ferry_tools.h"
#include "core/core.h"
#include "util/intern.h"

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

enum { TS_PACKED = 1, TS_DONE = 2 };

typedef struct reader {
  const char *name;
  sim_trace *t;
  char *err;
  size_t errlen;
  uint32_t line;
  id_map ids;
  intern_table strs; /* owned strings, deduplicated */
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

/* An owned copy of s, shared by equal strings; NULL out of memory. */
static const char *str_own(reader *r, const char *s) { return intern_get(&r->strs, s); }

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
  t->events[t->n_events++] =
      (trace_ev){.type = type, .layer = -1, .tensor = tensor, .gap_us = gap};
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
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = (uint64_t)bytes;
  if ((d.dtype = ferry_dtype_from_name(dtype)) < 0) return rd_fail(r, "unknown dtype \"%s\"", dtype);
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
    int64_t layer = -1;
    const char *op = NULL;
    if ((rc = get_int(r, o, "layer", 0, -1, MAX_LAYERS, &layer)) < 0) goto out;
    if ((rc = get_str(r, o, "op", 0, &op)) < 0) goto out;
    t->has_compute = 1;
    if ((rc = add_event(r, TEV_COMPUTE, 0, us->valuedouble))) goto out;
    t->events[t->n_events - 1].layer = (int32_t)layer;
    if (op && !(t->events[t->n_events - 1].op = str_own(r, op))) rc = rd_fail(r, "out of memory");
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

/* ============================================================================
 * Replay
 * ========================================================================== */

/* A device buffer of the replayed trainer; the owner token handed to ferry.
 * On the sim backend it has no memory (its address is the device pointer);
 * on the host backend it has real bytes, checked on every unpack. */
typedef struct sim_buf {
  uint64_t bytes;
  uint32_t refs;
  uint8_t counted; /* adds to device memory (not a parameter/buffer's own) */
  uint8_t *mem;
  struct sim_buf *next_free;
} sim_buf;

#define BUF_SLAB 1024

typedef struct replay {
  const sim_trace *t;
  const sim_config *c;
  ferry_engine *e;
  ferry_backend *sim; /* NULL on the host backend */
  double host_t0_us, host_scale;
  double host_excluded_us; /* wall time spent filling and checking buffers */
  ferry_tensor_desc *descs;
  ferry_handle *handles;
  sim_buf **bufs;       /* per tensor, while packed */
  sim_buf **slabs;
  uint32_t n_slabs;
  sim_buf *free_bufs;
  uint64_t live_bytes, peak_live;
  int recording;
  sim_result *res;
  int alloc_failed;
  int bad_bytes;        /* host backend: an unpack gave different bytes */
} replay;

static double wall_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static double rp_now(replay *r) {
  if (r->sim) return sim_backend_now(r->sim);
  return (wall_us() - r->host_t0_us - r->host_excluded_us) / r->host_scale;
}

static void rp_compute(replay *r, double us) {
  if (!(us > 0)) return;
  if (r->sim) {
    sim_backend_advance(r->sim, us);
    return;
  }
  /* The host backend's compute stream is this thread. Sleep through most of
   * it, leaving the cores to the copy workers (a GPU computes without the
   * CPU), and spin the last 100 us to end on time. */
  double end = wall_us() + us * r->host_scale;
  if (end - wall_us() > 300) {
    double until = end - 100;
    struct timespec ts = {(time_t)(until / 1e6), (long)(fmod(until, 1e6) * 1e3)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
  }
  while (wall_us() < end) {
  }
}

static int tl_push_iv(sim_timeline *tl, sim_interval iv) {
  if (tl->n_iv == tl->cap_iv) {
    size_t n = tl->cap_iv ? tl->cap_iv * 2 : 1024;
    sim_interval *p = realloc(tl->iv, n * sizeof *p);
    if (!p) return -1;
    tl->iv = p;
    tl->cap_iv = n;
  }
  tl->iv[tl->n_iv++] = iv;
  return 0;
}

static void mem_sample(replay *r) {
  if (!r->recording) return;
  sim_timeline *tl = &r->res->tl;
  double t = rp_now(r);
  uint64_t b = r->t->resident_bytes + r->live_bytes;
  if (tl->n_mem && tl->mem[tl->n_mem - 1].bytes == b) return;
  if (tl->n_mem == tl->cap_mem) {
    size_t n = tl->cap_mem ? tl->cap_mem * 2 : 1024;
    sim_mem_sample *p = realloc(tl->mem, n * sizeof *p);
    if (!p) return;
    tl->mem = p;
    tl->cap_mem = n;
  }
  tl->mem[tl->n_mem++] = (sim_mem_sample){t, b};
}

static void on_copy(void *ud, int dir, double t0, double t1, uint64_t bytes) {
  replay *r = ud;
  if (!r->recording) return;
  tl_push_iv(&r->res->tl, (sim_interval){t0, t1, bytes, 1 + dir, -1});
}

static sim_buf *buf_new(replay *r, uint64_t bytes, int counted) {
  if (!r->free_bufs) {
    sim_buf *slab = calloc(BUF_SLAB, sizeof *slab);
    sim_buf **slabs = slab ? realloc(r->slabs, (r->n_slabs + 1) * sizeof *slabs) : NULL;
    if (!slabs) {
      free(slab);
      return NULL;
    }
    r->slabs = slabs;
    r->slabs[r->n_slabs++] = slab;
    for (int i = BUF_SLAB - 1; i >= 0; i--) {
      slab[i].next_free = r->free_bufs;
      r->free_bufs = &slab[i];
    }
  }
  sim_buf *b = r->free_bufs;
  if (!r->sim) {
    b->mem = malloc(bytes);
    if (!b->mem) return NULL;
  }
  r->free_bufs = b->next_free;
  b->bytes = bytes;
  b->refs = 1;
  b->counted = (uint8_t)counted;
  if (counted) {
    r->live_bytes += bytes;
    if (r->live_bytes > r->peak_live) r->peak_live = r->live_bytes;
    mem_sample(r);
  }
  return b;
}

static void buf_unref(replay *r, sim_buf *b) {
  if (--b->refs) return;
  if (b->counted) {
    r->live_bytes -= b->bytes;
    mem_sample(r);
  }
  free(b->mem);
  b->mem = NULL;
  b->next_free = r->free_bufs;
  r->free_bufs = b;
}

static void *buf_ptr(sim_buf *b) { return b->mem ? (void *)b->mem : (void *)b; }

static int cb_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  replay *r = ud;
  sim_buf *b = buf_new(r, bytes, 1);
  if (!b) {
    r->alloc_failed = 1;
    return -1;
  }
  *dev = buf_ptr(b);
  *owner = b;
  return 0;
}

static void cb_release(void *ud, void *owner) { buf_unref(ud, owner); }
static void cb_retain(void *ud, void *owner) {
  (void)ud;
  ((sim_buf *)owner)->refs++;
}

static int cb_recorded(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                       ferry_decision *out) {
  replay *r = ud;
  (void)ctx;
  size_t i = (size_t)(d - r->descs);
  out->action = i < r->t->n_tensors ? r->t->tensors[i].decision : FERRY_KEEP;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 0;
  return 0;
}

static uint64_t engine_offloaded(ferry_engine *e) {
  ferry_stats st;
  return ferry_get_stats(e, &st, sizeof st) ? 0 : st.tensors_offloaded;
}

static double sim_stall(replay *r, double *host_wait) {
  if (!r->sim) {
    *host_wait = 0;
    return 0;
  }
  sim_backend_stats st;
  sim_backend_get_stats(r->sim, &st);
  *host_wait = st.host_wait_us;
  return st.stall_us;
}

static const char *base_name(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

void sim_result_free(sim_result *r) {
  if (!r) return;
  free(r->layers);
  free(r->tl.iv);
  free(r->tl.mem);
  free(r->decisions);
  memset(r, 0, sizeof *r);
}

/* Host backend: the bytes a tensor's buffer holds. */
static uint8_t tensor_pattern(uint32_t ti) { return (uint8_t)(ti * 131u + 7u); }

/* Fill (on pack) or check (on unpack) a real buffer's bytes. */
static int buf_bytes_ok(const sim_buf *b, uint8_t pattern, int fill) {
  if (!b->mem) return 1;
  if (fill) {
    memset(b->mem, pattern, b->bytes);
    return 1;
  }
  for (uint64_t i = 0; i < b->bytes; i++)
    if (b->mem[i] != pattern) return 0;
  return 1;
}

int sim_replay(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
               size_t errlen) {
  memset(out, 0, sizeof *out);
  if (err && errlen) err[0] = 0;
  if (!t || !c) return ferry_errbuf(err, errlen, FERRY_EINVAL, "sim_replay: NULL trace or config");
  int host = c->host_backend != 0;
  replay r;
  memset(&r, 0, sizeof r);
  r.t = t;
  r.c = c;
  r.res = out;
  r.host_scale = c->host_time_scale > 0 ? c->host_time_scale : 1;
  uint32_t steps = c->steps ? c->steps : t->n_steps;
  if (c->label) snprintf(out->label, sizeof out->label, "%s", c->label);
  else if (c->replay_decisions) snprintf(out->label, sizeof out->label, "recorded decisions");
  else if (c->policy_path) {
    snprintf(out->label, sizeof out->label, "%s", base_name(c->policy_path));
    char *dot = strrchr(out->label, '.');
    if (dot && !strcmp(dot, ".lua")) *dot = 0;
  } else if (c->policy_source) snprintf(out->label, sizeof out->label, "policy");
  else snprintf(out->label, sizeof out->label, "no offload");
  snprintf(out->backend, sizeof out->backend, "%s", host ? "host" : "sim");

  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = host ? FERRY_BACKEND_HOST : FERRY_BACKEND_SIM;
  cfg.arena = host ? FERRY_ARENA_AUTO : FERRY_ARENA_POOL;
  cfg.link = c->link;
  if (!(cfg.link.duplex > 0)) cfg.link.duplex = 1.0;
  cfg.host_cap_bytes = c->host_cap_bytes;
  cfg.device_alloc = cb_alloc;
  cfg.release = cb_release;
  cfg.retain = cb_retain;
  cfg.callback_ud = &r;
  if (c->replay_decisions) {
    cfg.decide = cb_recorded;
    cfg.decide_ud = &r;
  } else {
    cfg.policy_path = c->policy_path;
    cfg.policy_source = c->policy_path ? NULL : c->policy_source;
  }
  char msg[512] = "";
  int rc = ferry_engine_create(&cfg, &r.e, msg, sizeof msg);
  if (rc) return ferry_errbuf(err, errlen, rc, "%s: %s", out->label, msg);
  r.sim = host || !sim_backend_is(engine_backend(r.e)) ? NULL : engine_backend(r.e);
  if (r.sim) {
    sim_backend_set_listener(r.sim, on_copy, &r);
    if ((c->duplex_d2h > 0 || c->duplex_h2d > 0) &&
        (rc = sim_backend_set_duplex(r.sim, c->duplex_d2h > 0 ? c->duplex_d2h : cfg.link.duplex,
                                     c->duplex_h2d > 0 ? c->duplex_h2d : cfg.link.duplex))) {
      rc = ferry_errbuf(err, errlen, rc, "%s", r.sim->err);
      goto done;
    }
  }

  int32_t max_layer = -1;
  r.descs = malloc((size_t)(t->n_tensors ? t->n_tensors : 1) * sizeof *r.descs);
  r.handles = calloc(t->n_tensors ? t->n_tensors : 1, sizeof *r.handles);
  r.bufs = calloc(t->n_tensors ? t->n_tensors : 1, sizeof *r.bufs);
  if (!r.descs || !r.handles || !r.bufs) {
    rc = ferry_errbuf(err, errlen, FERRY_ENOMEM, "out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    r.descs[i] = t->tensors[i].desc;
    if (r.descs[i].module_path) r.descs[i].module_path = ferry_intern(r.e, r.descs[i].module_path);
    if (r.descs[i].module_class) r.descs[i].module_class = ferry_intern(r.e, r.descs[i].module_class);
    if (r.descs[i].layer > max_layer) max_layer = r.descs[i].layer;
  }
  out->n_layers = (uint32_t)(max_layer + 2);
  out->layers = calloc(out->n_layers, sizeof *out->layers);
  if (!out->layers) {
    rc = ferry_errbuf(err, errlen, FERRY_ENOMEM, "out of memory");
    goto done;
  }
  for (uint32_t i = 0; i < out->n_layers; i++) out->layers[i].layer = (int32_t)i - 1;
  out->resident_bytes = t->resident_bytes;
  out->steps = steps;

  double t_start = wall_us();
  r.host_t0_us = t_start;
  double sum_step = 0, sum_stall = 0, sum_wait = 0;
  double sum_d2h = 0, sum_h2d = 0, sum_packed = 0, sum_off = 0, sum_kept = 0, sum_pf = 0,
         sum_hits = 0;
  uint32_t n_steady = 0;
  double host_stall = 0, host_wait = 0; /* host backend: wall time inside ferry */
  for (uint32_t si = 0; si < steps; si++) {
    const trace_step *ts = &t->steps[si % t->n_steps];
    int last = si + 1 == steps;
    r.recording = last && c->timeline;
    if (last && c->record_decisions) {
      free(out->decisions);
      out->decisions = malloc((size_t)(ts->end - ts->first) + 1);
      out->n_decisions = 0;
    }
    if (last)
      for (uint32_t k = 0; k < out->n_layers; k++) {
        int32_t l = out->layers[k].layer;
        memset(&out->layers[k], 0, sizeof out->layers[k]);
        out->layers[k].layer = l;
      }
    ferry_stats s0, s1;
    ferry_get_stats(r.e, &s0, sizeof s0);
    double w0, st0 = sim_stall(&r, &w0);
    double hs0 = host_stall, hw0 = host_wait;
    double t0 = 0;
    int32_t cur_layer = -1;
    for (uint32_t k = ts->first; k < ts->end; k++) {
      const trace_ev *ev = &t->events[k];
      if (ev->gap_us > 0) {
        double a = rp_now(&r);
        rp_compute(&r, ev->gap_us);
        if (r.recording) {
          /* the layer this compute belongs to: the next tensor event's */
          int32_t layer = cur_layer;
          if (ev->type == TEV_COMPUTE && ev->layer >= 0) layer = ev->layer;
          else for (uint32_t j = k; j < ts->end && j < k + 64; j++)
            if (t->events[j].type == TEV_PACK || t->events[j].type == TEV_UNPACK) {
              layer = t->tensors[t->events[j].tensor].desc.layer;
              break;
            }
          tl_push_iv(&out->tl, (sim_interval){a, rp_now(&r), 0, 0, layer});
        }
      }
      out->events++;
      switch (ev->type) {
      case TEV_STEP_BEGIN:
        if ((rc = ferry_step_begin(r.e))) goto engine_err;
        t0 = rp_now(&r);
        if (r.recording) {
          out->tl.t_begin = t0;
          mem_sample(&r);
        }
        break;
      case TEV_PACK: {
        uint32_t ti = ev->tensor;
        const trace_tensor *tt = &t->tensors[ti];
        const ferry_tensor_desc *d = &r.descs[ti];
        cur_layer = d->layer;
        sim_buf *b;
        if (tt->alias_of >= 0) {
          b = r.bufs[tt->alias_of];
          b->refs++;
        } else {
          int counted = d->kind != FERRY_KIND_PARAMETER && d->kind != FERRY_KIND_BUFFER;
          b = buf_new(&r, d->bytes, counted);
          if (!b) {
            rc = ferry_errbuf(err, errlen, FERRY_ENOMEM, "out of memory for a %llu-byte buffer",
                         (unsigned long long)d->bytes);
            goto done;
          }
          if (host) {
            /* the trainer's work, not part of the modeled time */
            double w = wall_us();
            buf_bytes_ok(b, tensor_pattern(ti), 1);
            r.host_excluded_us += wall_us() - w;
          }
          /* The trainer holds it until its last alias is packed. */
          if (tt->last_alias >= 0) b->refs++;
        }
        r.bufs[ti] = b;
        uint64_t off0 = engine_offloaded(r.e);
        double a = host ? wall_us() : 0;
        rc = ferry_pack(r.e, d, buf_ptr(b), b, NULL, &r.handles[ti]);
        if (host) host_wait += wall_us() - a;
        if (rc) {
          buf_unref(&r, b);
          goto engine_err;
        }
        if (tt->alias_of >= 0 && t->tensors[tt->alias_of].last_alias == (int32_t)ti)
          buf_unref(&r, r.bufs[tt->alias_of]); /* the trainer's reference */
        int offloaded = engine_offloaded(r.e) != off0;
        if (last) {
          sim_layer_row *row = &out->layers[d->layer + 1];
          row->packed++;
          row->saved_bytes += d->bytes;
          if (offloaded) {
            row->offloaded++;
            row->offloaded_bytes += d->bytes;
          }
          if (out->decisions) out->decisions[out->n_decisions++] = (uint8_t)offloaded;
        }
        break;
      }
      case TEV_UNPACK: {
        uint32_t ti = ev->tensor;
        cur_layer = r.descs[ti].layer;
        void *dev = NULL, *owner = NULL;
        double w, s_before = sim_stall(&r, &w);
        double a = host ? wall_us() : 0;
        rc = ferry_unpack(r.e, r.handles[ti], NULL, &dev, &owner);
        double dt = host ? wall_us() - a : 0;
        if (rc) goto engine_err;
        host_stall += dt;
        sim_buf *b = owner;
        /* an alias hands back its primary's buffer */
        uint32_t src = t->tensors[ti].alias_of >= 0 ? (uint32_t)t->tensors[ti].alias_of : ti;
        double wb = host ? wall_us() : 0;
        if (!buf_bytes_ok(b, tensor_pattern(src), 0) || buf_ptr(b) != dev) r.bad_bytes++;
        if (host) r.host_excluded_us += wall_us() - wb;
        if (last) {
          double s_after = sim_stall(&r, &w);
          out->layers[cur_layer + 1].stall_us += host ? dt / r.host_scale : s_after - s_before;
        }
        buf_unref(&r, b); /* backward used it and let it go */
        r.bufs[ti] = NULL;
        break;
      }
      case TEV_DISCARD: {
        uint32_t ti = ev->tensor;
        if ((rc = ferry_discard(r.e, r.handles[ti]))) goto engine_err;
        r.bufs[ti] = NULL;
        break;
      }
      case TEV_BACKWARD_BEGIN:
        if ((rc = ferry_backward_begin(r.e))) goto engine_err;
        break;
      case TEV_BACKWARD_END:
        if ((rc = ferry_backward_end(r.e))) goto engine_err;
        break;
      case TEV_STEP_END: {
        double a = host ? wall_us() : 0;
        rc = ferry_step_end(r.e);
        if (host) host_wait += wall_us() - a;
        if (rc) goto engine_err;
        if (r.recording) {
          mem_sample(&r);
          out->tl.t_end = rp_now(&r);
        }
        break;
      }
      default: break;
      }
    }
    double step_us = rp_now(&r) - t0;
    ferry_get_stats(r.e, &s1, sizeof s1);
    double w1, st1 = sim_stall(&r, &w1);
    if (host) {
      st0 = hs0 / r.host_scale;
      st1 = host_stall / r.host_scale;
      w0 = hw0 / r.host_scale;
      w1 = host_wait / r.host_scale;
    }
    if (si == 0) out->first_step_us = step_us;
    if (si > 0 || steps == 1) {
      n_steady++;
      sum_step += step_us;
      sum_stall += st1 - st0;
      sum_wait += w1 - w0;
      sum_d2h += (double)(s1.bytes_d2h - s0.bytes_d2h);
      sum_h2d += (double)(s1.bytes_h2d - s0.bytes_h2d);
      sum_packed += (double)(s1.tensors_packed - s0.tensors_packed);
      sum_off += (double)(s1.tensors_offloaded - s0.tensors_offloaded);
      sum_kept += (double)(s1.tensors_kept - s0.tensors_kept);
      sum_pf += (double)(s1.prefetches - s0.prefetches);
      sum_hits += (double)(s1.stash_hits - s0.stash_hits);
    }
    if (c->progress) c->progress(c->progress_ud, si + 1, steps);
  }
  out->wall_s = (wall_us() - t_start) / 1e6;
  double n = n_steady ? n_steady : 1;
  out->step_us = sum_step / n;
  out->stall_us = sum_stall / n;
  out->host_wait_us = sum_wait / n;
  out->bytes_d2h = sum_d2h / n;
  out->bytes_h2d = sum_h2d / n;
  out->tensors_packed = sum_packed / n;
  out->tensors_offloaded = sum_off / n;
  out->tensors_kept = sum_kept / n;
  out->prefetches = sum_pf / n;
  out->stash_hits = sum_hits / n;
  out->peak_saved_bytes = r.peak_live;
  out->peak_device_bytes = t->resident_bytes + r.peak_live;
  ferry_stats fs;
  ferry_get_stats(r.e, &fs, sizeof fs);
  out->peak_host_bytes = fs.arena_peak;
  out->host_reserved_bytes = fs.arena_reserved;
  out->policy_errors = fs.policy_errors;
  out->policy_calls = fs.policy_calls;
  out->policy_cache_hits = fs.policy_cache_hits;
  out->cap_fallbacks = fs.cap_fallbacks;
  snprintf(out->policy_error, sizeof out->policy_error, "%s", ferry_last_policy_error(r.e));
  if (r.bad_bytes)
    rc = ferry_errbuf(err, errlen, FERRY_EBACKEND, "%s: %d unpack(s) gave back different bytes",
                 out->label, r.bad_bytes);
  goto done;

engine_err:
  rc = ferry_errbuf(err, errlen, rc, "%s: %s (replaying %s)", out->label, ferry_last_error(r.e),
               t->name);
done:
  if (r.e) ferry_engine_destroy(r.e);
  /* Buffers the trainer still held (an error stopped the step midway). */
  for (uint32_t i = 0; i < r.n_slabs; i++) {
    for (int k = 0; k < BUF_SLAB; k++) free(r.slabs[i][k].mem);
    free(r.slabs[i]);
  }
  free(r.slabs);
  free(r.descs);
  free(r.handles);
  free(r.bufs);
  if (rc && rc != FERRY_EBACKEND) sim_result_free(out);
  return rc;
}
