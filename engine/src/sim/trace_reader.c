/*
 * trace_reader.c — a strict reader of docs/trace-format.md: one JSON object
 * a line, checked line by line (file:line in every error), into a sim_trace
 * (ferry_tools.h) that sim_replay drives.
 */
#include "sim/trace_reader_internal.h"

int reader_fail(reader *r, const char *fmt, ...) {
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


/* ---- members ------------------------------------------------------------------ */

/* get_int's checks in turn, each with its error. */
static __attribute__((noinline)) int get_int_checked(reader *r, const json_value *v, json_key k,
                                                     int required, double lo, double hi,
                                                     int64_t *out) {
  const char *key = json_key_names[k];
  if (!v) {
    if (required) return reader_fail(r, "missing member \"%s\"", key);
    return 1;
  }
  if (v->type != JV_NUMBER) return reader_fail(r, "\"%s\" must be a number", key);
  double d = v->num;
  if (!isfinite(d) || d != floor(d)) return reader_fail(r, "\"%s\" must be an integer, got %g", key, d);
  if (d < lo || d > hi)
    return reader_fail(r, "\"%s\" = %.0f is %s (allowed %.0f .. %.0f)", key, d,
                   d < lo ? (d < 0 ? "negative" : "too small") : "absurd", lo, hi);
  *out = (int64_t)d;
  return 0;
}

/* An integer member within [lo, hi]; 1 if absent and not required. */
static inline int get_int(reader *r, const json_line *o, json_key k, int required, double lo,
                          double hi, int64_t *out) {
  const json_value *v = json_line_get(o, k);
  /* the usual case in one test: lo and hi lie within 2^53, where the
   * conversion is exact (NaN fails the comparisons) */
  if (v && v->type == JV_NUMBER && v->num >= lo && v->num <= hi &&
      v->num == (double)(int64_t)v->num) {
    *out = (int64_t)v->num;
    return 0;
  }
  return get_int_checked(r, v, k, required, lo, hi, out);
}

/* Whether string v is the literal lit (n bytes: a constant, so the
 * comparison is a load or two). */
static inline int str_is(const json_value *v, const char *lit, size_t n) {
  return v->len == n && !memcmp(v->str, lit, n);
}
#define STR_IS(v, lit) str_is(v, lit, sizeof lit - 1)

/* A string member; 1 if absent and not required. */
static int get_str(reader *r, const json_line *o, json_key k, int required, const char **out) {
  const json_value *v = json_line_get(o, k);
  *out = NULL;
  if (!v) return required ? reader_fail(r, "missing member \"%s\"", json_key_names[k]) : 1;
  if (v->type != JV_STRING) return reader_fail(r, "\"%s\" must be a string", json_key_names[k]);
  *out = v->str;
  return 0;
}

/* A string member as its value (length known); 1 if absent and not required. */
static inline int get_sv(reader *r, const json_line *o, json_key k, int required,
                         const json_value **out) {
  const json_value *v = json_line_get(o, k);
  *out = NULL;
  if (!v) return required ? reader_fail(r, "missing member \"%s\"", json_key_names[k]) : 1;
  if (v->type != JV_STRING) return reader_fail(r, "\"%s\" must be a string", json_key_names[k]);
  *out = v;
  return 0;
}

/* Ids are small and rising in every trace ferry writes: a dense array finds
 * them in cache where a hash table misses on each. A hostile id (2^50 in a
 * ten-line trace) goes to the map, so the array stays within 8 slots per
 * tensor read. */
static int id_find(const reader *r, uint64_t id, uint32_t *idx) {
  if (id < r->cap_by_id && r->by_id[id]) {
    *idx = r->by_id[id] - 1;
    return 1;
  }
  return u64map_find(&r->ids, id, idx);
}

static int id_insert(reader *r, uint64_t id, uint32_t idx) {
  size_t bound = 8 * ((size_t)r->t->n_tensors + 8192);
  if (id >= r->cap_by_id && id < bound) {
    size_t ncap = r->cap_by_id ? r->cap_by_id : 8192;
    while (ncap <= id) ncap *= 2;
    uint32_t *b = realloc(r->by_id, ncap * sizeof *b);
    if (!b) return -1;
    memset(b + r->cap_by_id, 0, (ncap - r->cap_by_id) * sizeof *b);
    r->by_id = b;
    r->cap_by_id = ncap;
  }
  if (id < r->cap_by_id) {
    r->by_id[id] = idx + 1;
    return 0;
  }
  return u64map_insert(&r->ids, id, idx);
}

/* Appends an event of the open step, gap_us after the previous one. */
static int add_event(reader *r, uint8_t type, uint32_t tensor, double gap) {
  sim_trace *t = r->t;
  if (util_grow((void **)&t->events, &r->cap_events, sizeof *t->events, t->n_events + 1, 256))
    return reader_fail(r, "out of memory");
  t->events[t->n_events++] =
      (trace_ev){.type = type, .layer = -1, .tensor = tensor, .gap_us = gap, .flops = r->flops,
                 .hbm_bytes = -1};
  if (r->flops >= 0) t->n_flops++;
  return 0;
}

/* The tensor an event names by its "id", which must be packed and live. */
static int get_live_tensor(reader *r, const json_line *o, const char *ev, uint32_t *idx) {
  int64_t id;
  int rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id);
  if (rc) return rc;
  if (!id_find(r, (uint64_t)id, idx))
    return reader_fail(r, "%s of id %lld before its pack", ev, (long long)id);
  if (r->state[*idx] == TS_DONE)
    return reader_fail(r, "%s of id %lld, which was already unpacked or discarded (line %u packed it)",
                   ev, (long long)id, r->t->tensors[*idx].line);
  return 0;
}

/* ---- pack --------------------------------------------------------------------- */

/* A pack's "shape" member into d->ndim and d->shape. */
static int get_shape(reader *r, const json_line *o, ferry_tensor_desc *d) {
  const json_value *shape = json_line_get(o, JK_SHAPE);
  if (!shape) return reader_fail(r, "missing member \"shape\"");
  if (shape->type != JV_ARRAY) return reader_fail(r, "\"shape\" must be an array of integers");
  if (o->shape_n > FERRY_MAX_DIMS)
    return reader_fail(r, "\"shape\" has %u dimensions (at most %d)", o->shape_n, FERRY_MAX_DIMS);
  d->ndim = (int)o->shape_n;
  for (int i = 0; i < d->ndim; i++) {
    const json_value *x = &o->shape[i];
    /* (within [0, 2^53] the conversion is exact; NaN fails the comparisons) */
    if (x->type != JV_NUMBER || !(x->num >= 0 && x->num <= MAX_ID) ||
        x->num != (double)(int64_t)x->num)
      return reader_fail(r, "\"shape\"[%d] must be a non-negative integer", i);
    d->shape[i] = (int64_t)x->num;
  }
  return 0;
}

/* A pack's string members (dtype, kind, phase, decision, module, class) and
 * shape into *d and *dec, checked in the order the errors name them. */
static int get_pack_desc(reader *r, const json_line *o, ferry_tensor_desc *d, uint8_t *dec) {
  const json_value *dtype, *kind, *phase, *decision, *module = NULL, *cls = NULL;
  int rc;
  if ((rc = get_sv(r, o, JK_DTYPE, 1, &dtype)) || (rc = get_sv(r, o, JK_KIND, 1, &kind)) ||
      (rc = get_sv(r, o, JK_PHASE, 1, &phase)) || (rc = get_sv(r, o, JK_DECISION, 1, &decision)))
    return rc;
  if ((rc = get_sv(r, o, JK_MODULE, 0, &module)) < 0 || (rc = get_sv(r, o, JK_CLASS, 0, &cls)) < 0)
    return rc;
  if ((d->dtype = reader_name_code(&r->dtype_memo, dtype, ferry_dtype_from_name)) < 0)
    return reader_fail(r, "unknown dtype \"%s\"", dtype->str);
  if ((d->kind = reader_name_code(&r->kind_memo, kind, ferry_kind_parse)) < 0)
    return reader_fail(r, "unknown kind \"%s\"", kind->str);
  if ((d->phase = reader_name_code(&r->phase_memo, phase, ferry_phase_parse)) < 0)
    return reader_fail(r, "unknown phase \"%s\"", phase->str);
  if (STR_IS(decision, "keep")) *dec = FERRY_KEEP;
  else if (STR_IS(decision, "offload")) *dec = FERRY_OFFLOAD;
  else return reader_fail(r, "decision must be \"keep\" or \"offload\", got \"%s\"", decision->str);
  if ((rc = get_shape(r, o, d))) return rc;
  if (d->layer_count && d->layer >= d->layer_count)
    return reader_fail(r, "layer %lld is not below layers %lld", (long long)d->layer,
                       (long long)d->layer_count);
  if (module && !(d->module_path = reader_own(r, module))) return reader_fail(r, "out of memory");
  if (cls && !(d->module_class = reader_own(r, cls))) return reader_fail(r, "out of memory");
  return 0;
}

/* With no alias_of: the latest live primary pack of the same size. */
static int latest_pack_of_size(reader *r, uint64_t bytes, int32_t *alias_of) {
  const sim_trace *t = r->t;
  for (uint32_t k = t->n_tensors; k-- > 0;) {
    if (r->state[k] == TS_PACKED && t->tensors[k].alias_of < 0 && t->tensors[k].desc.bytes == bytes) {
      *alias_of = (int32_t)k;
      return 0;
    }
  }
  return reader_fail(r, "alias pack with no live earlier pack of %llu bytes",
                     (unsigned long long)bytes);
}

/* alias: the same buffer as a live earlier pack, named by alias_of or, in
 * traces without it, the latest live pack of the same size; -1 if none. */
static int get_alias(reader *r, const json_line *o, uint64_t bytes, int32_t *alias_of) {
  const sim_trace *t = r->t;
  *alias_of = -1;
  const json_value *al = json_line_get(o, JK_ALIAS);
  if (al && al->type != JV_TRUE && al->type != JV_FALSE)
    return reader_fail(r, "\"alias\" must be true or false");
  if (!al || al->type != JV_TRUE) return 0;
  int64_t of;
  int rc = get_int(r, o, JK_ALIAS_OF, 0, 1, MAX_ID, &of);
  if (rc < 0) return rc;
  if (rc == 0) {
    uint32_t p;
    if (!id_find(r, (uint64_t)of, &p) || r->state[p] != TS_PACKED)
      return reader_fail(r, "alias_of %lld is not a live id", (long long)of);
    *alias_of = (int32_t)p;
  } else if ((rc = latest_pack_of_size(r, bytes, alias_of))) {
    return rc;
  }
  while (t->tensors[*alias_of].alias_of >= 0) *alias_of = t->tensors[*alias_of].alias_of;
  const trace_tensor *p = &t->tensors[*alias_of];
  if (p->desc.bytes != bytes)
    return reader_fail(r, "alias of id %llu with another size (%llu vs %llu bytes)",
                       (unsigned long long)p->id, (unsigned long long)p->desc.bytes,
                       (unsigned long long)bytes);
  return 0;
}

/* Room for need tensors and their states; -1 out of memory (the room is
 * then what it was). */
static int tensor_room(reader *r, uint32_t need) {
  if (need <= r->cap_tensors) return 0;
  uint32_t cap = r->cap_tensors;
  if (util_grow((void **)&r->t->tensors, &cap, sizeof *r->t->tensors, need, 256)) return -1;
  uint8_t *s = realloc(r->state, cap);
  if (!s) return -1;
  r->state = s;
  r->cap_tensors = cap;
  return 0;
}

/* Appends a packed tensor (its id not seen before) and its pack event. */
static int add_tensor(reader *r, uint64_t id, const ferry_tensor_desc *d, uint8_t dec,
                      int32_t alias_of, double gap) {
  sim_trace *t = r->t;
  uint32_t idx = t->n_tensors;
  if (tensor_room(r, idx + 1)) return reader_fail(r, "out of memory");
  if (id_insert(r, id, idx)) return reader_fail(r, "out of memory");
  trace_tensor *tt = &t->tensors[idx];
  tt->desc = *d;
  tt->id = id;
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

/* {"ev":"pack",...}: a saved tensor, with its description and decision. */
static int parse_pack(reader *r, const json_line *o, double gap) {
  sim_trace *t = r->t;
  if (!r->in_step) return reader_fail(r, "pack outside a step (no step_begin before it)");
  /* (zeroed: set by get_int when it returns 0, which gcc -O2 cannot see) */
  int64_t id = 0, step = 0, bytes = 0, layer = 0, layers = 0, flags = 0;
  int rc;
  if ((rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id)) ||
      (rc = get_int(r, o, JK_STEP, 1, 0, MAX_ID, &step)) ||
      (rc = get_int(r, o, JK_BYTES, 1, 1, (double)MAX_TENSOR_BYTES, &bytes)) ||
      (rc = get_int(r, o, JK_LAYER, 1, -1, MAX_LAYERS, &layer)) ||
      (rc = get_int(r, o, JK_LAYERS, 1, 0, MAX_LAYERS, &layers)))
    return rc;
  if ((rc = get_int(r, o, JK_FLAGS, 0, 0, 255, &flags)) < 0) return rc;
  uint32_t dup;
  if (id_find(r, (uint64_t)id, &dup))
    return reader_fail(r, "id %lld packed twice (first at line %u)", (long long)id,
                       t->tensors[dup].line);
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = (uint64_t)bytes;
  d.layer = (int32_t)layer;
  d.layer_count = (int32_t)layers;
  d.flags = (uint32_t)flags;
  uint8_t dec = FERRY_KEEP;
  if ((rc = get_pack_desc(r, o, &d, &dec))) return rc;
  if (layers > t->layers) t->layers = (int32_t)layers;
  int32_t alias_of;
  if ((rc = get_alias(r, o, d.bytes, &alias_of))) return rc;
  return add_tensor(r, (uint64_t)id, &d, dec, alias_of, gap);
}

/* ---- the other events ----------------------------------------------------------- */

/* {"ev":"header",...}: must be the first line, of format ferry-trace v1. */
static int parse_header(reader *r, const json_line *o, const char *ev) {
  if (strcmp(ev, "header"))
    return reader_fail(r, "the first line must be the header ({\"ev\":\"header\",...}), got \"%s\"",
                       ev);
  const char *fmt;
  int64_t version;
  int rc;
  if ((rc = get_str(r, o, JK_FORMAT, 1, &fmt))) return rc;
  if (strcmp(fmt, "ferry-trace")) return reader_fail(r, "format \"%s\" is not \"ferry-trace\"", fmt);
  if ((rc = get_int(r, o, JK_VERSION, 1, 1, 1e9, &version))) return rc;
  if (version > SIM_TRACE_VERSION)
    return reader_fail(r, "trace format version %lld is newer than this reader (%d)",
                       (long long)version, SIM_TRACE_VERSION);
  const char *backend = NULL;
  if ((rc = get_str(r, o, JK_BACKEND, 0, &backend)) < 0) return rc;
  if (backend) snprintf(r->t->backend, sizeof r->t->backend, "%s", backend);
  r->seen_header = 1;
  return 0;
}

/* {"ev":"unpack"|"discard","id":N}: the end of a live tensor. */
static int parse_unpack_or_discard(reader *r, const json_line *o, const char *ev, double gap) {
  if (!r->in_step) return reader_fail(r, "%s outside a step", ev);
  uint32_t idx = 0;
  int rc = get_live_tensor(r, o, ev, &idx);
  if (rc) return rc;
  r->state[idx] = TS_DONE;
  r->live_in_step--;
  return add_event(r, ev[0] == 'u' ? TEV_UNPACK : TEV_DISCARD, idx, gap);
}

/* {"ev":"step_begin","step":N}: opens a step. */
static int parse_step_begin(reader *r, const json_line *o, double gap) {
  int64_t step;
  int rc = get_int(r, o, JK_STEP, 1, 0, MAX_ID, &step);
  if (rc) return rc;
  if (r->in_step)
    return reader_fail(r, "step_begin of step %lld inside step %llu (no step_end)", (long long)step,
                       (unsigned long long)r->step_number);
  r->in_step = 1;
  r->in_backward = 0;
  r->step_number = (uint64_t)step;
  r->step_first = r->t->n_events;
  r->live_in_step = 0;
  r->live_allocs = 0;
  r->step_first_coll = r->t->n_collectives;
  return add_event(r, TEV_STEP_BEGIN, 0, gap);
}

/* The error for a step that ends with transient memory not freed: names
 * the first such alloc. */
static int fail_allocs_at_step_end(reader *r, int64_t step) {
  const sim_trace *t = r->t;
  uint32_t k = 0;
  while (k + 1 < t->n_allocs && !r->alloc_live[k]) k++;
  return reader_fail(r, "step %llu ends with %u alloc(s) not freed (first: id %llu at line %u)",
                     (unsigned long long)step, r->live_allocs,
                     (unsigned long long)t->allocs[k].id, t->allocs[k].line);
}

/* {"ev":"alloc","id":N,"bytes":B,"what":S}: transient device memory (a
 * tensor autograd does not save: logits, their fp32 copy, a gradient) from
 * here to its free; ids are the trace's own, apart from the packs'. */
static int parse_alloc(reader *r, const json_line *o, double gap) {
  sim_trace *t = r->t;
  int64_t id, bytes;
  const json_value *what;
  int rc;
  if ((rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id)) ||
      (rc = get_int(r, o, JK_BYTES, 1, 1, (double)MAX_TENSOR_BYTES, &bytes)) ||
      (rc = get_sv(r, o, JK_WHAT, 1, &what)))
    return rc;
  if (!r->in_step) return reader_fail(r, "alloc outside a step");
  uint32_t dup;
  if (u64map_find(&r->alloc_ids, (uint64_t)id, &dup))
    return reader_fail(r, "alloc id %lld given twice (first at line %u)", (long long)id,
                       t->allocs[dup].line);
  uint32_t idx = t->n_allocs, old_cap = r->cap_allocs;
  if (util_grow((void **)&t->allocs, &r->cap_allocs, sizeof *t->allocs, idx + 1, 64))
    return reader_fail(r, "out of memory");
  if (r->cap_allocs != old_cap) {
    uint8_t *live = realloc(r->alloc_live, r->cap_allocs);
    if (!live) return reader_fail(r, "out of memory");
    r->alloc_live = live;
  }
  const char *owned = reader_own(r, what);
  if (!owned || u64map_insert(&r->alloc_ids, (uint64_t)id, idx)) return reader_fail(r, "out of memory");
  t->allocs[idx] = (trace_alloc){(uint64_t)id, (uint64_t)bytes, owned, r->line};
  r->alloc_live[idx] = 1;
  t->n_allocs++;
  r->live_allocs++;
  return add_event(r, TEV_ALLOC, idx, gap);
}

/* {"ev":"collective","id":N,"op":"all_gather"|"reduce_scatter"|"all_reduce"|"all_to_all",
 * "bytes":B,"ranks":R,"what":"shard"|"tp"|"cp"[,"layer":L]}: a collective issued
 * here on its group's lane (docs/trace-format.md, "collective"). */
static int parse_collective(reader *r, const json_line *o, double gap) {
  sim_trace *t = r->t;
  int64_t id, bytes, ranks, layer = -1;
  const char *op, *what;
  int rc;
  if ((rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id)) ||
      (rc = get_int(r, o, JK_BYTES, 1, 1, (double)MAX_TENSOR_BYTES, &bytes)) ||
      (rc = get_int(r, o, JK_RANKS, 1, 2, 1e6, &ranks)) || (rc = get_str(r, o, JK_OP, 1, &op)) ||
      (rc = get_str(r, o, JK_WHAT, 1, &what)))
    return rc;
  if ((rc = get_int(r, o, JK_LAYER, 0, -1, MAX_LAYERS, &layer)) < 0) return rc;
  int kind = !strcmp(op, "all_gather")       ? SIM_COLL_ALL_GATHER
             : !strcmp(op, "reduce_scatter") ? SIM_COLL_REDUCE_SCATTER
             : !strcmp(op, "all_reduce")     ? SIM_COLL_ALL_REDUCE
             : !strcmp(op, "all_to_all")     ? SIM_COLL_ALL_TO_ALL
                                             : -1;
  if (kind < 0)
    return reader_fail(r, "collective \"op\" \"%s\" is not all_gather, reduce_scatter, all_reduce or all_to_all",
                       op);
  /* Ulysses' all-to-alls (cp) run within a node, on tensor parallelism's lane */
  int group = !strcmp(what, "shard") ? SIM_GROUP_SHARD
              : !strcmp(what, "tp") || !strcmp(what, "cp") ? SIM_GROUP_TP
                                                         : -1;
  if (group < 0) return reader_fail(r, "collective \"what\" \"%s\" is not shard, tp or cp", what);
  if (!r->in_step) return reader_fail(r, "collective outside a step");
  uint32_t dup;
  if (u64map_find(&r->coll_ids, (uint64_t)id, &dup))
    return reader_fail(r, "collective id %lld given twice (first at line %u)", (long long)id,
                       t->collectives[dup].line);
  uint32_t idx = t->n_collectives;
  if (util_grow((void **)&t->collectives, &r->cap_colls, sizeof *t->collectives, idx + 1, 64) ||
      u64map_insert(&r->coll_ids, (uint64_t)id, idx))
    return reader_fail(r, "out of memory");
  t->collectives[idx] = (trace_collective){.id = (uint64_t)id, .bytes = (uint64_t)bytes,
                                           .ranks = (int32_t)ranks, .layer = (int32_t)layer,
                                           .kind = (uint8_t)kind, .group = (uint8_t)group,
                                           .line = r->line};
  t->n_collectives++;
  return add_event(r, TEV_COLLECTIVE, idx, gap);
}

/* {"ev":"collective_wait","id":N}: the compute stream waits for collective
 * N of this step, issued before and not waited for yet. */
static int parse_collective_wait(reader *r, const json_line *o, double gap) {
  int64_t id;
  int rc;
  if ((rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id))) return rc;
  if (!r->in_step) return reader_fail(r, "collective_wait outside a step");
  uint32_t idx;
  if (!u64map_find(&r->coll_ids, (uint64_t)id, &idx))
    return reader_fail(r, "collective_wait of id %lld before its collective", (long long)id);
  trace_collective *c = &r->t->collectives[idx];
  if (c->waited)
    return reader_fail(r, "collective_wait of id %lld given twice", (long long)id);
  if (idx < r->step_first_coll)
    return reader_fail(r, "collective_wait of id %lld: its collective (line %u) is in an earlier step",
                       (long long)id, c->line);
  c->waited = 1;
  return add_event(r, TEV_COLLECTIVE_WAIT, idx, gap);
}

/* {"ev":"free","id":N}: the end of a live alloc of this step. */
static int parse_free(reader *r, const json_line *o, double gap) {
  int64_t id;
  int rc;
  if ((rc = get_int(r, o, JK_ID, 1, 1, MAX_ID, &id))) return rc;
  if (!r->in_step) return reader_fail(r, "free outside a step");
  uint32_t idx;
  if (!u64map_find(&r->alloc_ids, (uint64_t)id, &idx))
    return reader_fail(r, "free of id %lld before its alloc", (long long)id);
  if (!r->alloc_live[idx])
    return reader_fail(r, "free of id %lld, which was already freed (line %u allocated it)",
                       (long long)id, r->t->allocs[idx].line);
  r->alloc_live[idx] = 0;
  r->live_allocs--;
  return add_event(r, TEV_FREE, idx, gap);
}

/* The error for a step that ends with live tensors: names the first one. */
static int fail_live_at_step_end(reader *r, int64_t step) {
  const sim_trace *t = r->t;
  uint32_t first = 0;
  for (uint32_t k = 0; k < t->n_tensors; k++)
    if (r->state[k] == TS_PACKED) {
      first = k;
      break;
    }
  return reader_fail(r, "step %llu ends with %u id(s) neither unpacked nor discarded (first: id %llu "
                        "packed at line %u)",
                     (unsigned long long)step, r->live_in_step,
                     (unsigned long long)t->tensors[first].id, t->tensors[first].line);
}

/* {"ev":"step_end","step":N}: closes the open step, every tensor done. */
static int parse_step_end(reader *r, const json_line *o, double gap) {
  sim_trace *t = r->t;
  int64_t step;
  int rc = get_int(r, o, JK_STEP, 1, 0, MAX_ID, &step);
  if (rc) return rc;
  if (!r->in_step) return reader_fail(r, "step_end without step_begin");
  if ((uint64_t)step != r->step_number)
    return reader_fail(r, "step_end of step %lld inside step %llu", (long long)step,
                       (unsigned long long)r->step_number);
  if (r->live_in_step) return fail_live_at_step_end(r, step);
  if (r->live_allocs) return fail_allocs_at_step_end(r, step);
  if ((rc = add_event(r, TEV_STEP_END, 0, gap))) return rc;
  if (util_grow((void **)&t->steps, &r->cap_steps, sizeof *t->steps, t->n_steps + 1, 256))
    return reader_fail(r, "out of memory");
  t->steps[t->n_steps++] = (trace_step){r->step_first, t->n_events, (uint64_t)step};
  r->in_step = 0;
  return 0;
}

/* {"ev":"backward_begin"|"backward_end"}: inside a step, alternating. */
static int parse_backward(reader *r, const char *ev, double gap) {
  int begin = ev[9] == 'b';
  if (!r->in_step) return reader_fail(r, "%s outside a step", ev);
  if (begin == r->in_backward)
    return reader_fail(r, "%s %s", ev,
                       begin ? "inside backward (no backward_end)" : "without backward_begin");
  r->in_backward = begin;
  return add_event(r, begin ? TEV_BACKWARD_BEGIN : TEV_BACKWARD_END, 0, gap);
}

/* {"ev":"compute","us":X,...}: X microseconds of the trainer's compute. */
static int parse_compute(reader *r, const json_line *o) {
  sim_trace *t = r->t;
  const json_value *us = json_line_get(o, JK_US);
  if (!us) return reader_fail(r, "missing member \"us\"");
  if (us->type != JV_NUMBER || !isfinite(us->num) || us->num < 0 || us->num > MAX_COMPUTE_US)
    return reader_fail(r, "\"us\" must be a number within [0, %.0f] (an hour)", MAX_COMPUTE_US);
  if (!r->in_step) return reader_fail(r, "compute outside a step");
  int64_t layer = -1;
  const json_value *op = NULL;
  int rc;
  if ((rc = get_int(r, o, JK_LAYER, 0, -1, MAX_LAYERS, &layer)) < 0) return rc;
  if ((rc = get_sv(r, o, JK_OP, 0, &op)) < 0) return rc;
  /* optional roofline terms (synthesized traces): the bytes the compute
   * moves through device memory, and the least time it takes on any GPU */
  const json_value *hb = json_line_get(o, JK_HBM_BYTES), *mu = json_line_get(o, JK_MIN_US);
  if (hb && (hb->type != JV_NUMBER || !isfinite(hb->num) || hb->num < 0 || hb->num > 1e21))
    return reader_fail(r, "\"hbm_bytes\" must be a number within [0, 1e21]");
  if (mu && (mu->type != JV_NUMBER || !isfinite(mu->num) || mu->num < 0 || mu->num > MAX_COMPUTE_US))
    return reader_fail(r, "\"min_us\" must be a number within [0, %.0f] (an hour)", MAX_COMPUTE_US);
  t->has_compute = 1;
  if ((rc = add_event(r, TEV_COMPUTE, 0, us->num))) return rc;
  trace_ev *ev = &t->events[t->n_events - 1];
  ev->layer = (int32_t)layer;
  if (hb) {
    ev->hbm_bytes = hb->num;
    t->n_hbm++;
  }
  if (mu) ev->min_us = mu->num;
  if (op && !(ev->op = reader_own(r, op))) return reader_fail(r, "out of memory");
  return 0;
}

/* {"ev":"resident","bytes":N,"what":S[,"dtype":D][,"layer_bytes":B][,"transient":true]}:
 * device memory held outside the saved tensors, before the first step (B:
 * each repeated block's part of it, at most N); a second line for S
 * replaces it. A transient one is named for what reads it by name (the
 * optimizer offload's gradients) but not held all step: the step's allocs
 * hold it, so it is not in resident_bytes. */
static int parse_resident(reader *r, const json_line *o) {
  sim_trace *t = r->t;
  int64_t bytes, layer_bytes = 0;
  const char *what, *dtype = NULL;
  int rc;
  if ((rc = get_int(r, o, JK_BYTES, 1, 0, (double)MAX_TENSOR_BYTES, &bytes)) ||
      (rc = get_str(r, o, JK_WHAT, 1, &what)))
    return rc;
  if ((rc = get_int(r, o, JK_LAYER_BYTES, 0, 0, (double)bytes, &layer_bytes)) < 0) return rc;
  if ((rc = get_str(r, o, JK_DTYPE, 0, &dtype)) < 0) return rc;
  int dt = dtype ? ferry_dtype_from_name(dtype) : FERRY_DTYPE_UNKNOWN;
  if (dt < 0) return reader_fail(r, "unknown dtype \"%s\"", dtype);
  const json_value *tr = json_line_get(o, JK_TRANSIENT);
  if (tr && tr->type != JV_TRUE && tr->type != JV_FALSE)
    return reader_fail(r, "\"transient\" must be true or false");
  const int transient = tr && tr->type == JV_TRUE;
  if (r->in_step)
    return reader_fail(r, "resident inside a step: resident memory is declared before the first step");
  uint32_t k = 0;
  while (k < t->n_resident && strcmp(t->resident[k].what, what)) k++;
  if (k == t->n_resident) {
    if (util_grow((void **)&t->resident, &r->cap_resident, sizeof *t->resident, k + 1, 256))
      return reader_fail(r, "out of memory");
    t->resident[k].what = strdup(what);
    if (!t->resident[k].what) return reader_fail(r, "out of memory");
    t->resident[k].bytes = 0;
    t->resident[k].transient = 0;
    t->n_resident++;
  }
  if (!t->resident[k].transient) t->resident_bytes -= t->resident[k].bytes;
  t->resident[k].transient = transient;
  t->resident[k].bytes = (uint64_t)bytes;
  t->resident[k].dtype = dt;
  t->resident[k].layer_bytes = (uint64_t)layer_bytes; /* 0 when not given */
  if (!transient) t->resident_bytes += (uint64_t)bytes;
  return 0;
}

/* {"ev":"device_peak","step":S,"bytes":N}: the most device memory the
 * trainer's allocator had in use during step S, which has ended (written
 * between steps); the trace keeps the largest. */
static int parse_device_peak(reader *r, const json_line *o) {
  sim_trace *t = r->t;
  int64_t step = 0, bytes = 0;
  int rc;
  if ((rc = get_int(r, o, JK_STEP, 1, 0, MAX_ID, &step)) ||
      (rc = get_int(r, o, JK_BYTES, 1, 0, (double)MAX_TENSOR_BYTES, &bytes)))
    return rc;
  if (r->in_step)
    return reader_fail(r, "device_peak inside a step: it is written after the step it measured");
  if (!t->n_steps || (uint64_t)step != t->steps[t->n_steps - 1].number)
    return reader_fail(r, "device_peak of step %lld: not the step that ended last", (long long)step);
  if ((uint64_t)bytes > t->device_peak) t->device_peak = (uint64_t)bytes;
  t->n_device_peaks++;
  return 0;
}

/* ---- lines ---------------------------------------------------------------------- */

/* A line's "t_us": never back in time; *gap is the time since the last line. */
static int get_time(reader *r, const json_line *o, double *gap) {
  const json_value *tv = json_line_get(o, JK_T_US);
  if (!tv) return reader_fail(r, "missing member \"t_us\"");
  if (tv->type != JV_NUMBER || !isfinite(tv->num) || tv->num < 0)
    return reader_fail(r, "\"t_us\" must be a non-negative number");
  double tus = tv->num;
  if (r->seen_header && tus + 1e-6 < r->last_t)
    return reader_fail(r, "t_us %.1f goes back in time (previous line: %.1f)", tus, r->last_t);
  *gap = r->seen_header ? tus - r->last_t : 0;
  if (*gap < 0) *gap = 0;
  if (*gap > 0) r->has_gap = 1;
  r->last_t = tus;
  return 0;
}

/* One event (after the header) to its parser by its "ev" (ev: its text). */
static int parse_event(reader *r, const json_line *o, const json_value *evv, double gap) {
  const char *ev = evv->str;
  switch (ev[0]) { /* by first letter and length: one comparison per line */
  case 'p': if (STR_IS(evv, "pack")) return parse_pack(r, o, gap); break;
  case 'u': case 'd':
    if (STR_IS(evv, "unpack") || STR_IS(evv, "discard")) return parse_unpack_or_discard(r, o, ev, gap);
    if (STR_IS(evv, "device_peak")) return parse_device_peak(r, o);
    break;
  case 'c':
    if (STR_IS(evv, "compute")) return parse_compute(r, o);
    if (STR_IS(evv, "collective")) return parse_collective(r, o, gap);
    if (STR_IS(evv, "collective_wait")) return parse_collective_wait(r, o, gap);
    break;
  case 's':
    if (STR_IS(evv, "step_begin")) return parse_step_begin(r, o, gap);
    if (STR_IS(evv, "step_end")) return parse_step_end(r, o, gap);
    break;
  case 'b':
    if (STR_IS(evv, "backward_begin") || STR_IS(evv, "backward_end")) return parse_backward(r, ev, gap);
    break;
  case 'r': if (STR_IS(evv, "resident")) return parse_resident(r, o); break;
  case 'a': if (STR_IS(evv, "alloc")) return parse_alloc(r, o, gap); break;
  case 'f': if (STR_IS(evv, "free")) return parse_free(r, o, gap); break;
  case 'h': if (STR_IS(evv, "header")) return reader_fail(r, "a second header"); break;
  }
  return reader_fail(r, "unknown event \"%s\"", ev);
}

/* A parsed line's object: its ev and t_us, then the header or an event. */
static int parse_object(reader *r, const json_line *o) {
  if (!o->is_object) return reader_fail(r, "a line must be a JSON object");
  const json_value *ev;
  double gap = 0;
  int rc;
  if ((rc = get_sv(r, o, JK_EV, 1, &ev))) return rc;
  if ((rc = get_time(r, o, &gap))) return rc;
  if (!r->seen_header) return parse_header(r, o, ev->str);
  /* optional "flops": the floating-point work of the compute before this
   * event (recorded traces) or of this compute event (synthesized) */
  const json_value *fl = json_line_get(o, JK_FLOPS);
  r->flops = -1;
  if (fl) {
    if (fl->type != JV_NUMBER || !(fl->num >= 0 && fl->num <= 1e21)) /* (NaN fails) */
      return reader_fail(r, "\"flops\" must be a number within [0, 1e21]");
    r->flops = fl->num;
  }
  return parse_event(r, o, ev, gap);
}

/* A line simdjson refused, read with cJSON, which words why: the nesting,
 * malformed JSON at a column, or text after the object; or reads it, for
 * what only cJSON holds (a number past 2^64, text that is not UTF-8). */
static int parse_line_slow(reader *r, const char *s, size_t n) {
  if (json_depth(s, n) > r->max_depth)
    return reader_fail(r, "nested deeper than %d levels (no trace line is)", r->max_depth);
  const char *end = NULL;
  cJSON *o = cJSON_ParseWithLengthOpts(s, n, &end, 0);
  if (!o) {
    const char *ep = cJSON_GetErrorPtr();
    long col = ep && ep >= s && ep <= s + n ? (long)(ep - s) + 1 : 1;
    return reader_fail(r, "malformed JSON near column %ld", col);
  }
  int rc = 0;
  for (const char *p = end; p && p < s + n; p++)
    if (*p != ' ' && *p != '\t' && *p != '\r') {
      rc = reader_fail(r, "text after the JSON object at column %ld", (long)(p - s) + 1);
      break;
    }
  if (!rc) {
    json_line_from_cjson(o, &r->obj);
    rc = parse_object(r, &r->obj);
  }
  cJSON_Delete(o);
  return rc;
}

/* One non-blank line of n bytes at s, readable bytes from s on: one JSON
 * object and nothing after it. */
static int parse_line(reader *r, const char *s, size_t n, size_t readable) {
  if (!r->seen_header) sim_trace_read_run(r->t, s, n); /* once: for the error bands */
  if (json_fast_parse(&r->fast, s, n, r->max_depth, &r->obj) == 0) return parse_object(r, &r->obj);
  /* the fast path takes no escape: a line with one is checked here, before
   * simdjson and cJSON cut a string at its escaped NUL */
  json_nul_at at;
  long col = json_escaped_nul(s, n, &at);
  if (col && at.member)
    return reader_fail(r, "\"%.*s\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
                       "cannot hold one", (int)(at.member_len > 40 ? 40 : at.member_len), at.member, col);
  if (col)
    return reader_fail(r, "%s holds an escaped NUL (\\u0000) at column %ld",
                       at.in_name ? "a member's name" : "a string", col);
  if (r->simd && json_simd_parse(r->simd, s, n, readable, &r->obj) == 0)
    return parse_object(r, &r->obj);
  return parse_line_slow(r, s, n);
}

/* ---- traces --------------------------------------------------------------------- */

void sim_trace_free(sim_trace *t) {
  if (!t) return;
  free(t->name);
  free(t->events);
  free(t->tensors);
  free(t->steps);
  for (uint32_t i = 0; i < t->n_resident; i++) free(t->resident[i].what);
  free(t->resident);
  free(t->allocs);
  free(t->collectives);
  for (size_t i = 0; i < t->n_strings; i++) free(t->strings[i]);
  free(t->strings);
  free(t);
}

/* The complete lines in data[0, len) in turn (blank ones skipped); the
 * buffer stays readable up to end, which lets simdjson read past a line. */
int reader_parse_lines(reader *r, const char *data, size_t len, const char *end) {
  const char *nul = memchr(data, 0, len); /* one pass, not one per line */
  size_t pos = 0;
  int rc;
  while (pos < len) {
    r->line++;
    const char *nl = memchr(data + pos, '\n', len - pos);
    if (!nl) return reader_fail(r, "truncated: the last line has no newline");
    size_t n = (size_t)(nl - (data + pos));
    const char *s = data + pos;
    pos += n + 1;
    if (nul && nul < nl) return reader_fail(r, "a NUL byte: not a JSON-lines trace (a binary file?)");
    if (n > r->max_line)
      return reader_fail(r, "a line longer than %zu bytes (no trace line is; --max-line)", r->max_line);
    size_t k = 0;
    while (k < n && (s[k] == ' ' || s[k] == '\t' || s[k] == '\r')) k++;
    if (k == n) continue; /* blank lines carry nothing */
    if ((rc = parse_line(r, s, n, (size_t)(end - s)))) return rc;
  }
  return 0;
}

/* After the last line: a header, no step left open, a step at least. */
static int parse_end(reader *r) {
  r->line = 0;
  if (!r->seen_header) return reader_fail(r, "empty trace (no header line)");
  if (r->in_step)
    return reader_fail(r, "truncated: ends inside step %llu (no step_end)",
                       (unsigned long long)r->step_number);
  if (!r->t->n_steps) return reader_fail(r, "no complete step (step_begin .. step_end) in the trace");
  return 0;
}

/* Frees the reader's own state; the trace keeps the interned strings. */
static int reader_finish(reader *r, int rc) {
  sim_trace *t = r->t;
  u64map_free(&r->ids);
  u64map_free(&r->alloc_ids);
  u64map_free(&r->coll_ids);
  free(r->alloc_live);
  free(r->by_id);
  free(r->state);
  json_simd_free(r->simd);
  json_fast_free(&r->fast);
  t->strings = NULL;
  t->n_strings = 0;
  if (r->strs.count) {
    t->strings = malloc(r->strs.count * sizeof *t->strings);
    if (t->strings)
      for (size_t i = 0; i < r->strs.cap; i++)
        if (r->strs.slots[i]) t->strings[t->n_strings++] = r->strs.slots[i];
  }
  if (!t->strings)
    for (size_t i = 0; i < r->strs.cap; i++) free(r->strs.slots[i]);
  free(r->strs.slots);
  if (!rc && !t->strings && r->strs.count) rc = reader_fail(r, "out of memory");
  return rc;
}

/* A reader of a trace named name (in messages) within lim; FERRY_OK, or
 * FERRY_ENOMEM with the message in err. */
int reader_start(reader *r, const char *name, const sim_trace_limits *lim, char *err,
                 size_t errlen) {
  if (err && errlen) err[0] = 0;
  memset(r, 0, sizeof *r);
  r->name = name ? name : "trace";
  r->err = err;
  r->errlen = errlen;
  r->max_depth = lim->max_depth;
  r->max_line = lim->max_line_bytes;
  sim_trace *t = calloc(1, sizeof *t);
  if (!t || !(t->name = strdup(r->name))) {
    free(t);
    reader_fail(r, "out of memory");
    return FERRY_ENOMEM;
  }
  r->t = t;
  /* without it (out of memory) every line takes the cJSON path */
  r->simd = json_simd_new(lim->max_depth);
  return FERRY_OK;
}

/* Room for len bytes of trace, as trace files run (138 bytes a line in a
 * synthesized one, one tensor in three lines): reserved before the first
 * line, the arrays are not copied as they grow (that copying, and the page
 * faults of each new copy, were a quarter of the reading). Untouched
 * reserved pages cost no memory; reader_done gives back the rest. A hint:
 * without it the arrays grow as needed. */
void reader_reserve(reader *r, uint64_t len) {
  uint64_t events = len / 64 + 256, tensors = len / 160 + 256;
  if (events > (1u << 24)) events = 1u << 24;
  if (tensors > (1u << 23)) tensors = 1u << 23;
  if (!util_grow((void **)&r->t->events, &r->cap_events, sizeof *r->t->events,
                 (uint32_t)events, 256))
    tensor_room(r, (uint32_t)tensors);
}

/* Gives back what reader_reserve reserved and the trace does not use. */
static void trace_shrink(sim_trace *t) {
  if (t->n_events) {
    trace_ev *e = realloc(t->events, (size_t)t->n_events * sizeof *e);
    if (e) t->events = e;
  }
  if (t->n_tensors) {
    trace_tensor *x = realloc(t->tensors, (size_t)t->n_tensors * sizeof *x);
    if (x) t->tensors = x;
  }
}

/* Ends the reader: the trace in *out on success (rc 0), else freed. */
int reader_done(reader *r, int rc, sim_trace **out) {
  sim_trace *t = r->t;
  if (!rc) rc = parse_end(r);
  rc = reader_finish(r, rc);
  /* Recorded traces carry time in t_us; synthesized ones in compute events. */
  if (!rc && t->has_compute && r->has_gap)
    for (uint32_t i = 0; i < t->n_events; i++)
      if (t->events[i].type != TEV_COMPUTE) t->events[i].gap_us = 0;
  if (rc) {
    sim_trace_free(t);
    return rc;
  }
  trace_shrink(t);
  *out = t;
  return FERRY_OK;
}
