/*
 * decide.c: the decide and snapshot calls: string interning, the per-site
 * decision cache, answer checking and fault accounting. The hot path
 * (ferry_policy_decide with a cache hit) stays in this one file.
 */
#include "policy/policy_internal.h"

/* ---- interning ---------------------------------------------------------- */
static uint64_t hash_bytes(const char *s, size_t *len) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  const char *c = s;
  for (; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
  *len = (size_t)(c - s);
  return h | 1; /* never 0 */
}

static int grow_content_index(ferry_policy *p) {
  uint32_t cap = (p->by_content_mask + 1) * 2;
  uint32_t *idx = calloc(cap, sizeof *idx);
  if (!idx) return -1;
  for (uint32_t id = STR_FIRST; id < p->n_strings; id++) {
    uint32_t s = (uint32_t)p->strings[id].hash & (cap - 1);
    while (idx[s]) s = (s + 1) & (cap - 1);
    idx[s] = id;
  }
  free(p->by_content);
  p->by_content = idx;
  p->by_content_mask = cap - 1;
  return 0;
}

/* The id of string s, interning it on first sight. scratch is the slot used
 * when the table is full (then the Lua string is pushed for this call). */
static uint32_t intern_content(ferry_policy *p, const char *s, uint32_t scratch) {
  size_t len;
  uint64_t h = hash_bytes(s, &len);
  uint32_t slot = (uint32_t)h & p->by_content_mask;
  for (uint32_t id; (id = p->by_content[slot]); slot = (slot + 1) & p->by_content_mask) {
    const interned *e = &p->strings[id];
    if (e->hash == h && e->len == len && !memcmp(e->str, s, len)) return id;
  }
  lua_State *L = p->L;
  int full = p->n_strings >= MAX_STRINGS;
  if (!full) {
    void *strings = p->strings;
    if (util_grow(&strings, &p->cap_strings, sizeof *p->strings, p->n_strings + 1, 0) == 0)
      p->strings = strings;
    else
      full = 1;
  }
  char *copy = full ? NULL : malloc(len + 1);
  if (full || !copy || ((p->n_strings + 1) * 2 > p->by_content_mask + 1 && grow_content_index(p))) {
    free(copy);
    lua_pushlstring(L, s, len);
    lua_rawseti(L, SLOT_STRINGS, (int)scratch);
    return scratch;
  }
  memcpy(copy, s, len + 1);
  uint32_t id = p->n_strings++;
  p->strings[id] = (interned){copy, len, h};
  slot = (uint32_t)h & p->by_content_mask;
  while (p->by_content[slot]) slot = (slot + 1) & p->by_content_mask;
  p->by_content[slot] = id;
  lua_pushlstring(L, s, len);
  lua_rawseti(L, SLOT_STRINGS, (int)id);
  return id;
}

/* Pointers from ferry_intern() are stable, so a pointer cache answers most
 * lookups; the content is still compared, since any pointer may be passed
 * and a freed string's address may be reused for another. Two slots per
 * pointer: the first by one multiply-shift (strings strdup'd one after
 * another spread over it perfectly, mostly), the second by a full mix (for
 * the address strides where one multiply-shift packs many strings into a
 * few slots: util_ptr_slot). A string goes into its first slot when that
 * is free, else into its second. */
static inline uint32_t ptr_first_slot(const char *s) {
  return (uint32_t)(((uint64_t)(uintptr_t)s * 0x9e3779b97f4a7c15ull) >> (64 - PTR_CACHE_BITS));
}

static __attribute__((noinline)) uint32_t intern_miss(ferry_policy *p, const char *s,
                                                      uint32_t scratch, ptr_cache_entry *c) {
  ptr_cache_entry *second = &p->ptr_cache[util_ptr_slot(s, PTR_CACHE_BITS)];
  if (second->ptr == s && !strcmp(s, p->strings[second->id].str)) return second->id;
  uint32_t id = intern_content(p, s, scratch);
  if (id >= STR_FIRST) {
    if (c->ptr && c->ptr != s) c = second; /* (s itself there: its old content) */
    c->ptr = s;
    c->id = id;
  }
  return id;
}

/* Inlined into the cache's hit path: two per decision. */
static inline __attribute__((always_inline)) uint32_t intern(ferry_policy *p, const char *s,
                                                             uint32_t scratch) {
  if (!s || !*s) return STR_EMPTY;
  ptr_cache_entry *c = &p->ptr_cache[ptr_first_slot(s)];
  if (c->ptr == s && !strcmp(s, p->strings[c->id].str)) return c->id;
  return intern_miss(p, s, scratch, c);
}

/* ---- site cache --------------------------------------------------------- */
/* One multiply per word and one full mix at the end (this runs on every
 * cached answer): a product's high bits depend on all of both words' bits,
 * and the final mix brings them down to the slot bits. */
static inline __attribute__((always_inline)) uint64_t site_hash(const site_key *k) {
  const uint64_t m = 0x9e3779b97f4a7c15ull;
  uint64_t h = (((uint64_t)k->path_id << 32) | k->class_id) * m;
  h = (h ^ (((uint64_t)(uint32_t)k->dtype << 40) | ((uint64_t)(uint32_t)k->phase << 32) |
            ((uint64_t)(uint32_t)k->kind << 8) | (uint32_t)k->ndim)) * m;
  for (int i = 0; i < k->ndim; i++) h = (h ^ (uint64_t)k->shape[i]) * m;
  return util_mix64(h) | 1;
}

static inline __attribute__((always_inline)) int site_equal(const site_key *a,
                                                             const site_key *b) {
  if (a->path_id != b->path_id || a->class_id != b->class_id || a->dtype != b->dtype ||
      a->kind != b->kind || a->ndim != b->ndim || a->phase != b->phase)
    return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static inline __attribute__((always_inline)) const site_entry *
site_find(const ferry_policy *p, const site_key *k, uint64_t h) {
  if (!p->sites) return NULL;
  for (uint32_t s = (uint32_t)h & p->sites_mask;; s = (s + 1) & p->sites_mask) {
    const site_entry *e = &p->sites[s];
    if (!e->hash) return NULL;
    if (e->hash == h && site_equal(&e->key, k)) return e;
  }
}

static void site_insert(ferry_policy *p, const site_key *k, uint64_t h, const ferry_decision *d) {
  if (p->n_sites >= SITE_CACHE_MAX) return;
  if (!p->sites || (p->n_sites + 1) * 2 > p->sites_mask + 1) {
    uint32_t cap = p->sites ? (p->sites_mask + 1) * 2 : 256;
    site_entry *grown = calloc(cap, sizeof *grown);
    if (!grown) return;
    for (uint32_t i = 0; p->sites && i <= p->sites_mask; i++) {
      if (!p->sites[i].hash) continue;
      uint32_t s = (uint32_t)p->sites[i].hash & (cap - 1);
      while (grown[s].hash) s = (s + 1) & (cap - 1);
      grown[s] = p->sites[i];
    }
    free(p->sites);
    p->sites = grown;
    p->sites_mask = cap - 1;
  }
  uint32_t s = (uint32_t)h & p->sites_mask;
  while (p->sites[s].hash) s = (s + 1) & p->sites_mask;
  p->sites[s] = (site_entry){h, *k, *d};
  p->n_sites++;
}

/* ---- reasons of cached answers (ferry_policy_explain only) --------------- */
#define MAX_REASONS 4096 /* distinct reasons remembered; past it: "site cache" */

static void set_reason(ferry_policy_reason *why, const char *rule, const char *where) {
  copy_str(why->rule, sizeof why->rule, rule);
  copy_str(why->where, sizeof why->where, where);
}

/* The index of why in p->reasons, added on first sight; UINT32_MAX if full. */
static uint32_t reason_id(ferry_policy *p, const ferry_policy_reason *why) {
  for (uint32_t i = 0; i < p->n_reasons; i++)
    if (!strcmp(p->reasons[i].rule, why->rule) && !strcmp(p->reasons[i].where, why->where))
      return i;
  void *grown = p->reasons;
  if (p->n_reasons >= MAX_REASONS ||
      util_grow(&grown, &p->cap_reasons, sizeof *p->reasons, p->n_reasons + 1, 16))
    return UINT32_MAX;
  p->reasons = grown;
  p->reasons[p->n_reasons] = *why;
  return p->n_reasons++;
}

/* Remembers why as the reason of the site cached under key. */
static void reason_store(ferry_policy *p, const site_key *k, uint64_t h,
                         const ferry_policy_reason *why) {
  uint32_t id = reason_id(p, why);
  if (id == UINT32_MAX) return;
  if (!p->reason_sites || (p->n_reason_sites + 1) * 2 > p->reason_sites_mask + 1) {
    if (p->n_reason_sites >= SITE_CACHE_MAX) return;
    uint32_t cap = p->reason_sites ? (p->reason_sites_mask + 1) * 2 : 256;
    reason_entry *grown = calloc(cap, sizeof *grown);
    if (!grown) return;
    for (uint32_t i = 0; p->reason_sites && i <= p->reason_sites_mask; i++) {
      if (!p->reason_sites[i].hash) continue;
      uint32_t s = (uint32_t)p->reason_sites[i].hash & (cap - 1);
      while (grown[s].hash) s = (s + 1) & (cap - 1);
      grown[s] = p->reason_sites[i];
    }
    free(p->reason_sites);
    p->reason_sites = grown;
    p->reason_sites_mask = cap - 1;
  }
  uint32_t s = (uint32_t)h & p->reason_sites_mask;
  for (; p->reason_sites[s].hash; s = (s + 1) & p->reason_sites_mask)
    if (p->reason_sites[s].hash == h && site_equal(&p->reason_sites[s].key, k)) {
      p->reason_sites[s].reason = id;
      return;
    }
  p->reason_sites[s] = (reason_entry){h, *k, id};
  p->n_reason_sites++;
}

/* The reason stored for the cached site key, or "site cache" if none. */
static void reason_of_site(const ferry_policy *p, const site_key *k, uint64_t h,
                           ferry_policy_reason *why) {
  for (uint32_t s = (uint32_t)h & p->reason_sites_mask; p->reason_sites && p->reason_sites[s].hash;
       s = (s + 1) & p->reason_sites_mask)
    if (p->reason_sites[s].hash == h && site_equal(&p->reason_sites[s].key, k)) {
      *why = p->reasons[p->reason_sites[s].reason];
      return;
    }
  set_reason(why, "site cache", "");
}

/* A fault's reason: "fault" at the message's "file:line", else the chunk. */
static void fault_reason(const ferry_policy *p, const char *msg, ferry_policy_reason *why) {
  copy_str(why->rule, sizeof why->rule, "fault");
  if (has_position(msg)) {
    const char *colon = strchr(msg, ':');
    colon = strchr(colon + 1, ':');
    snprintf(why->where, sizeof why->where, "%.*s", (int)(colon - msg), msg);
  } else {
    copy_str(why->where, sizeof why->where, p->chunk);
  }
}

/* ---- deciding ----------------------------------------------------------- */
static void count_fault(ferry_policy *p, const char *msg) {
  p->stats.errors++;
  if (p->stats.errors >= p->error_budget) {
    p->stats.disabled = 1;
    snprintf(p->last_error, sizeof p->last_error,
             "%.400s (policy disabled after %u faults: every tensor is now kept)", msg,
             p->error_budget);
  } else {
    copy_str(p->last_error, sizeof p->last_error, msg);
  }
}

/* fn: "decide" or "explain", the function that answered; where: its file:line. */
static void nonsense(ferry_policy *p, const char *fn, const char *where, const char *what,
                     const char *expected, int idx) {
  char vb[96], msg[MSG_LEN];
  snprintf(msg, sizeof msg, "%.300s: %s returned a nonsense %s: %s (expected %s); the tensor was kept",
           where, fn, what, describe_value(p->L, idx, vb, sizeof vb), expected);
  count_fault(p, msg);
}

/* Read the answer of fn (decide: action, reload, distance, cache at stack
 * slots first..first+3; explain: action at first, the other three at
 * first+3..first+5) into *d. */
static int read_answer(ferry_policy *p, const char *fn, const char *where, int first, int rest,
                       ferry_decision *d) {
  lua_State *L = p->L;
  int a = first, r = rest, dist = rest + 1, c = rest + 2;
  lua_Number v;
  if (lua_type(L, a) != LUA_TNUMBER || ((v = lua_tonumber(L, a)) != FERRY_KEEP && v != FERRY_OFFLOAD))
    return nonsense(p, fn, where, "action", "ferry.KEEP or ferry.OFFLOAD", a), -1;
  d->action = (int32_t)v;
  /* one lua_type per value: each API call costs an index lookup */
  int tr = lua_type(L, r), tdist = lua_type(L, dist), tc = lua_type(L, c);
  if (tr == LUA_TNIL) {
    d->reload = FERRY_RELOAD_ON_USE;
  } else if (tr != LUA_TNUMBER ||
             ((v = lua_tonumber(L, r)) != FERRY_RELOAD_ON_USE && v != FERRY_RELOAD_PREFETCH)) {
    return nonsense(p, fn, where, "reload", "ferry.ON_USE or ferry.PREFETCH", r), -1;
  } else {
    d->reload = (int32_t)v;
  }
  if (tdist == LUA_TNIL) {
    d->prefetch_distance = -1; /* the engine's default */
  } else if (tdist != LUA_TNUMBER || !((v = lua_tonumber(L, dist)) >= 0) ||
             v > MAX_PREFETCH_DISTANCE || v != floor(v)) {
    return nonsense(p, fn, where, "prefetch distance", "an integer in [0, 4096] or nil", dist), -1;
  } else {
    d->prefetch_distance = (int32_t)v;
  }
  if (tc == LUA_TNIL || tc == LUA_TBOOLEAN)
    d->cacheable = lua_toboolean(L, c);
  else
    return nonsense(p, fn, where, "cache flag", "true, false or nil", c), -1;
  return 0;
}

/* Writes the numbers t or ctx show (names[i] = v[i]) into its fields table
 * at slot, those that changed since the last call: most stay the same from
 * one tensor to the next, and a table write costs more than the check. The
 * values are compared as the engine's integers (no conversion to a double
 * for a field that did not change); signed: the bits of the fields that are
 * signed (int32 in the structs), the others are uint64. *valid is 0 until
 * every field has been written once. */
static inline __attribute__((always_inline)) void
show(lua_State *L, int slot, const char *const *names, const uint64_t *v, uint64_t *seen,
     int *valid, unsigned signed_bits, int n) {
  int all = !*valid;
  for (int i = 0; i < n; i++) {
    if (!all && v[i] == seen[i]) continue;
    seen[i] = v[i];
    lua_pushnumber(L, signed_bits >> i & 1 ? (lua_Number)(int64_t)v[i] : (lua_Number)v[i]);
    lua_setfield(L, slot, names[i]);
  }
  *valid = 1;
}

/* sandbox.lua's field names, in the order of tensor_seen and ctx_seen, and
 * which of them are signed */
static const char *const TENSOR_NAMES[TENSOR_FIELDS] = {
    "bytes", "kind", "dtype", "ndim", "flags", "layer", "layer_count", "phase", "step"};
static const char *const CTX_NAMES[CTX_FIELDS] = {
    "step",           "phase",           "arena_in_use",
    "arena_cap",      "stash_depth",     "bytes_in_flight",     "packed_this_step",
    "offloaded_this_step", "bytes_offloaded_this_step"};
/* (ctx.host_ram_used_pct is read through sandbox_host_ram, sandbox.c) */
enum { TENSOR_SIGNED = 0xfe /* kind .. phase */, CTX_SIGNED = 0x2 /* phase */ };

/* The `ctx` Lua sees: the engine's context, or only the step without one. */
static void set_ctx_view(ferry_policy *p, const ferry_context *ctx) {
  const ferry_context none = {.step = p->step};
  if (!ctx) ctx = &none;
  const uint64_t v[CTX_FIELDS] = {ctx->step,
                                  (uint64_t)(int64_t)ctx->phase,
                                  ctx->arena_in_use,
                                  ctx->arena_cap,
                                  ctx->stash_depth,
                                  ctx->bytes_in_flight,
                                  ctx->packed_this_step,
                                  ctx->offloaded_this_step,
                                  ctx->bytes_offloaded_this_step};
  show(p->L, SLOT_CTX_FIELDS, CTX_NAMES, v, p->ctx_seen, &p->ctx_seen_valid, CTX_SIGNED,
       CTX_FIELDS);
}

/* ferry.forget_cached() asked for it: later decisions run Lua again. */
static void forget_sites(ferry_policy *p) {
  p->forget = 0;
  if (p->n_reason_sites) {
    memset(p->reason_sites, 0, (p->reason_sites_mask + 1) * sizeof *p->reason_sites);
    p->n_reason_sites = 0;
  }
  if (!p->n_sites) return;
  memset(p->sites, 0, (p->sites_mask + 1) * sizeof *p->sites);
  p->n_sites = 0;
}

/* The site-cache key of desc; whether its strings could be interned (else
 * the answer cannot be cached). */
static inline __attribute__((always_inline)) int
site_key_of(ferry_policy *p, const ferry_tensor_desc *desc, site_key *key) {
  key->path_id = intern(p, desc->module_path, STR_SCRATCH_PATH);
  key->class_id = intern(p, desc->module_class, STR_SCRATCH_CLASS);
  key->dtype = desc->dtype;
  key->kind = desc->kind;
  key->phase = desc->phase;
  key->ndim = desc->ndim < 0 ? 0 : desc->ndim > FERRY_MAX_DIMS ? FERRY_MAX_DIMS : desc->ndim;
  for (int i = 0; i < key->ndim; i++) key->shape[i] = desc->shape[i];
  return key->path_id != STR_SCRATCH_PATH && key->class_id != STR_SCRATCH_CLASS;
}

/* decide and explain in one body. why is NULL for the engine's decide: the
 * function is inlined into ferry_policy_decide with why a constant NULL, so
 * every reason branch below folds away and decide pays nothing for them. */
static inline __attribute__((always_inline)) void
decide_or_explain(ferry_policy *p, const ferry_tensor_desc *desc, const ferry_context *ctx,
                  ferry_decision *out, ferry_policy_reason *why) {
  static const ferry_decision keep = {FERRY_KEEP, FERRY_RELOAD_ON_USE, -1, 0};
  *out = keep;
  if (why) {
    memset(why, 0, sizeof *why);
    if (p && p->stats.disabled) set_reason(why, "disabled", "");
  }
  if (!p || !desc || p->stats.disabled) return;

  site_key key;
  int site_cacheable = site_key_of(p, desc, &key);
  uint64_t h = 0;
  if (site_cacheable && p->n_sites) {
    h = site_hash(&key);
    const site_entry *e = site_find(p, &key, h);
    if (e) {
      *out = e->decision;
      p->stats.cache_hits++;
      if (why) {
        reason_of_site(p, &key, h, why);
        why->from_cache = 1;
      }
      return;
    }
  }

  lua_State *L = p->L;
  const uint64_t t[TENSOR_FIELDS] = {desc->bytes,
                                     (uint64_t)(int64_t)desc->kind,
                                     (uint64_t)(int64_t)desc->dtype,
                                     (uint64_t)(int64_t)key.ndim,
                                     (uint64_t)(int64_t)(int32_t)desc->flags,
                                     (uint64_t)(int64_t)desc->layer,
                                     (uint64_t)(int64_t)desc->layer_count,
                                     (uint64_t)(int64_t)desc->phase,
                                     ctx ? ctx->step : p->step};
  show(L, SLOT_TENSOR_FIELDS, TENSOR_NAMES, t, p->tensor_seen, &p->tensor_seen_valid,
       TENSOR_SIGNED, TENSOR_FIELDS);
  set_ctx_view(p, ctx);
  p->cur_ctx = ctx;
  p->cur_path_id = key.path_id;
  p->cur_class_id = key.class_id;
  for (int i = 0; i < key.ndim; i++) {
    lua_pushnumber(L, (lua_Number)desc->shape[i]);
    lua_rawseti(L, SLOT_SHAPE, i);
  }
  for (int i = key.ndim; i < p->shape_len; i++) {
    lua_pushnil(L);
    lua_rawseti(L, SLOT_SHAPE, i);
  }
  p->shape_len = key.ndim;

  /* explain(t, ctx) -> action, rule, where, reload, distance, cache */
  int via_explain = why && p->has_explain;
  const char *fn = via_explain ? "explain" : "decide";
  const char *fn_where = via_explain ? p->explain_where : p->decide_where;
  p->stats.calls++;
  if (via_explain)
    lua_getfield(L, LUA_REGISTRYINDEX, "ferry.explain");
  else
    lua_pushvalue(L, SLOT_DECIDE);
  lua_pushvalue(L, SLOT_TENSOR);
  lua_pushvalue(L, SLOT_CTX);
  p->running = fn_where;
  int status = run_protected(p, 2, via_explain ? 6 : 4, SLOT_MSGH, 0);
  p->running = NULL;
  p->cur_ctx = NULL;
  if (p->forget) forget_sites(p);
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
    if (why) fault_reason(p, msg, why);
  } else {
    ferry_decision d;
    int first = SLOT_COUNT_ + 1;
    if (read_answer(p, fn, fn_where, first, via_explain ? first + 3 : first + 1, &d) == 0) {
      *out = d;
      if (why && via_explain) {
        int has_rule = lua_type(L, first + 1) == LUA_TSTRING;
        set_reason(why, has_rule ? lua_tostring(L, first + 1) : "explain",
                   lua_type(L, first + 2) == LUA_TSTRING ? lua_tostring(L, first + 2)
                   : has_rule                            ? p->table_where
                                                         : p->explain_where);
      } else if (why) {
        set_reason(why, "decide", p->decide_where);
      }
      if (d.cacheable && site_cacheable) {
        if (!h) h = site_hash(&key);
        site_insert(p, &key, h, &d);
        if (why) reason_store(p, &key, h, why);
      }
    } else if (why) {
      fault_reason(p, p->last_error, why);
    }
  }
  lua_settop(L, SLOT_COUNT_);
}

void ferry_policy_decide(ferry_policy *p, const ferry_tensor_desc *desc, const ferry_context *ctx,
                         ferry_decision *out) {
  decide_or_explain(p, desc, ctx, out, NULL);
}

int ferry_policy_cached(ferry_policy *p, const ferry_tensor_desc *desc, ferry_decision *out) {
  if (!p || !desc || p->stats.disabled || !p->n_sites) return 0;
  site_key key;
  if (!site_key_of(p, desc, &key)) return 0;
  const site_entry *e = site_find(p, &key, site_hash(&key));
  if (!e) return 0;
  *out = e->decision;
  p->stats.cache_hits++;
  return 1;
}

void ferry_policy_explain(ferry_policy *p, const ferry_tensor_desc *desc, const ferry_context *ctx,
                          ferry_decision *out, ferry_policy_reason *why) {
  ferry_policy_reason scratch;
  decide_or_explain(p, desc, ctx, out, why ? why : &scratch);
}

/* The policy's step(ctx), when it has one: once per step, before the
 * step's first decision, with the context sampled at its begin (host RAM).
 * A fault counts like a decision's. */
void ferry_policy_step_begin(ferry_policy *p, const ferry_context *ctx) {
  if (!p || !ctx) return;
  p->step = ctx->step;
  if (!p->has_step || p->stats.disabled) return;
  lua_State *L = p->L;
  set_ctx_view(p, ctx);
  p->cur_ctx = ctx;
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.step");
  lua_pushvalue(L, SLOT_CTX);
  p->running = p->step_where;
  int status = run_protected(p, 1, 0, SLOT_MSGH, 0);
  p->running = NULL;
  p->cur_ctx = NULL;
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
  }
  if (p->forget) forget_sites(p);
  lua_settop(L, SLOT_COUNT_);
}

/* ---- checkpoint snapshots ----------------------------------------------- */
int ferry_policy_has_snapshot(const ferry_policy *p) { return p && p->has_snapshot; }

static void snapshot_nonsense(ferry_policy *p, const char *what, const char *expected, int idx) {
  char vb[96], msg[MSG_LEN];
  snprintf(msg, sizeof msg,
           "%.300s: snapshot returned a nonsense %s: %s (expected %s); the entry was staged",
           p->snapshot_where, what, describe_value(p->L, idx, vb, sizeof vb), expected);
  count_fault(p, msg);
}

static void set_string_field(lua_State *L, const char *name, const char *value) {
  lua_pushstring(L, value ? value : "");
  lua_setfield(L, -2, name);
}

static void set_number_field(lua_State *L, const char *name, lua_Number value) {
  lua_pushnumber(L, value);
  lua_setfield(L, -2, name);
}

void ferry_policy_snapshot(ferry_policy *p, const ferry_snapshot_entry *e,
                           ferry_snapshot_choice *out) {
  if (!out) return;
  out->stage = 1;
  out->order = e ? (double)e->index : 0;
  if (!p || !e || !p->has_snapshot || p->stats.disabled) return;
  lua_State *L = p->L;
  /* Snapshots are rare (every N steps) and have few entries: a fresh table
   * per call keeps the Lua side simple. */
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.snapshot");
  lua_createtable(L, 0, 6); /* stack: ..., snapshot, e */
  set_string_field(L, "key", e->key);
  set_string_field(L, "path", e->path);
  set_number_field(L, "bytes", (lua_Number)e->bytes);
  set_number_field(L, "index", e->index);
  set_number_field(L, "dtype", e->dtype);
  lua_pushboolean(L, e->on_device != 0);
  lua_setfield(L, -2, "device");
  p->stats.calls++;
  p->running = p->snapshot_where;
  int status = run_protected(p, 1, 2, SLOT_MSGH, 0);
  p->running = NULL;
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
  } else {
    int st = SLOT_COUNT_ + 1, ord = SLOT_COUNT_ + 2;
    if (!lua_isnil(L, st) && lua_type(L, st) != LUA_TBOOLEAN) {
      snapshot_nonsense(p, "stage flag", "true, false or nil", st);
    } else if (!lua_isnil(L, ord) &&
               (lua_type(L, ord) != LUA_TNUMBER || !isfinite(lua_tonumber(L, ord)))) {
      snapshot_nonsense(p, "order", "a finite number or nil", ord);
    } else {
      out->stage = lua_isnil(L, st) || lua_toboolean(L, st);
      if (!lua_isnil(L, ord)) out->order = lua_tonumber(L, ord);
    }
  }
  lua_settop(L, SLOT_COUNT_);
}

/* ---- optimizer states and weights on the host ------------------------------ */
int ferry_policy_has_resident(const ferry_policy *p) { return p && p->has_resident; }

static const char *const RESIDENT_KINDS[] = {"optimizer", "weights"};

int ferry_policy_resident(ferry_policy *p, const ferry_resident_entry *e,
                          ferry_policy_reason *why) {
  ferry_policy_reason scratch;
  if (!why) why = &scratch;
  set_reason(why, "no resident function", "");
  why->from_cache = 0;
  if (!p || !e || e->kind < FERRY_RESIDENT_OPTIMIZER || e->kind > FERRY_RESIDENT_WEIGHTS)
    return 0;
  if (!p->has_resident) return 0;
  if (p->stats.disabled) {
    set_reason(why, "disabled", "");
    return 0;
  }
  lua_State *L = p->L;
  /* Asked once per parameter or layer when an optimizer or model is
   * wrapped: a fresh table per call keeps the Lua side simple. */
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.resident");
  lua_createtable(L, 0, 10); /* stack: ..., resident, r */
  set_string_field(L, "kind", RESIDENT_KINDS[e->kind]);
  set_string_field(L, "name", e->name);
  set_string_field(L, "module", e->module);
  set_number_field(L, "layer", e->layer);
  set_number_field(L, "layer_count", e->layer_count);
  set_number_field(L, "bytes", (lua_Number)e->bytes);
  set_number_field(L, "total_bytes", (lua_Number)e->total_bytes);
  set_number_field(L, "index", e->index);
  set_number_field(L, "count", e->count);
  set_number_field(L, "dtype", e->dtype);
  p->stats.calls++;
  p->running = p->resident_where;
  int status = run_protected(p, 1, 3, SLOT_MSGH, 0);
  p->running = NULL;
  int host = 0;
  const int ans = SLOT_COUNT_ + 1, rule = ans + 1, where = ans + 2;
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
    fault_reason(p, msg, why);
  } else if (!lua_isnil(L, ans) && lua_type(L, ans) != LUA_TBOOLEAN) {
    char vb[96], msg[MSG_LEN];
    snprintf(msg, sizeof msg,
             "%.300s: resident returned a nonsense answer: %s (expected true, false or nil); "
             "kept on the device",
             p->resident_where, describe_value(L, ans, vb, sizeof vb));
    count_fault(p, msg);
    fault_reason(p, msg, why);
  } else {
    host = lua_toboolean(L, ans);
    int named = lua_type(L, rule) == LUA_TSTRING;
    set_reason(why, named ? lua_tostring(L, rule) : "resident",
               lua_type(L, where) == LUA_TSTRING ? lua_tostring(L, where)
               : named                           ? p->table_where
                                                 : p->resident_where);
  }
  lua_settop(L, SLOT_COUNT_);
  return host;
}
