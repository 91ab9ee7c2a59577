/*
 * breakdown.c — saved tensors counted by the rule that decided them and by
 * layer (config.count_reasons, ferry_get_breakdown). Only engines created
 * with count_reasons pay for it: their decisions go through the policy's
 * explain (OBS_REASONS: the stash writes each reason in e->why), and each
 * pack this observer is told of adds its bytes to one row. Under the engine
 * lock.
 */
#include <stdlib.h>
#include <string.h>

#include "core/engine_internal.h"

typedef struct bd_row {
  const char *rule, *where; /* interned in e->interned */
  int32_t layer;
  uint64_t tensors_offloaded, bytes_offloaded, tensors_kept, bytes_kept;
} bd_row;

struct breakdown {
  bd_row *rows;
  uint32_t n, cap;
  u64map index; /* row key -> row; equal keys of different rows fall back to a scan */
};

static void breakdown_close(void *self, ferry_engine *e) {
  (void)e;
  struct breakdown *b = self;
  free(b->rows);
  u64map_free(&b->index);
  free(b);
}

static void breakdown_on(void *self, ferry_engine *e, const obs_event *ev);

int breakdown_open(ferry_engine *e) {
  struct breakdown *b = calloc(1, sizeof *b);
  if (!b || engine_observe(e, breakdown_on, breakdown_close, b, OBS_REASONS)) {
    free(b);
    return engine_fail(e, FERRY_ENOMEM, "out of memory for config.count_reasons");
  }
  return FERRY_OK;
}

/* interned strings compare by pointer, so the key hashes the pointers */
static uint64_t row_key(const char *rule, const char *where, int32_t layer) {
  uint64_t k = util_mix64((uintptr_t)rule) ^ util_mix64((uintptr_t)where * 31u + 7u);
  k = util_mix64(k ^ (uint64_t)(uint32_t)layer);
  return k ? k : 1;
}

static bd_row *row_find(struct breakdown *b, const char *rule, const char *where, int32_t layer,
                        uint64_t key) {
  uint32_t i;
  if (u64map_find(&b->index, key, &i)) {
    bd_row *r = &b->rows[i];
    if (r->rule == rule && r->where == where && r->layer == layer) return r;
    for (i = 0; i < b->n; i++) { /* a key shared by two rows */
      r = &b->rows[i];
      if (r->rule == rule && r->where == where && r->layer == layer) return r;
    }
  }
  return NULL;
}

/* Counts a pack of `bytes` in layer, decided by e->why, that ended
 * offloaded or kept. Out of memory: the pack is not counted. */
static void breakdown_count(struct breakdown *b, ferry_engine *e, int32_t layer, uint64_t bytes,
                            int offloaded) {
  const char *rule = intern_get(&e->interned, e->why.rule);
  const char *where = intern_get(&e->interned, e->why.where);
  if (!rule || !where) return;
  uint64_t key = row_key(rule, where, layer);
  bd_row *r = row_find(b, rule, where, layer, key);
  if (!r) {
    void *rows = b->rows;
    if (util_grow(&rows, &b->cap, sizeof *b->rows, b->n + 1, 16)) return;
    b->rows = rows;
    r = &b->rows[b->n];
    *r = (bd_row){.rule = rule, .where = where, .layer = layer};
    uint32_t ignored;
    if (!u64map_find(&b->index, key, &ignored) && u64map_insert(&b->index, key, b->n)) return;
    b->n++;
  }
  if (offloaded) {
    r->tensors_offloaded++;
    r->bytes_offloaded += bytes;
  } else {
    r->tensors_kept++;
    r->bytes_kept += bytes;
  }
}

int ferry_get_breakdown(ferry_engine *e, ferry_breakdown_fn fn, void *ud) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  struct breakdown *b = engine_observer(e, breakdown_on);
  if (!fn) rc = engine_fail(e, FERRY_EINVAL, "ferry_get_breakdown: fn is NULL");
  else if (!b)
    rc = engine_fail(e, FERRY_ESTATE,
                     "ferry_get_breakdown: the engine counts no reasons (create it with "
                     "config.count_reasons = 1)");
  if (rc) {
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  /* A copy, so fn runs unlocked and may call into the engine. */
  uint32_t n = b->n;
  bd_row *copy = n ? malloc(n * sizeof *copy) : NULL;
  if (n && !copy) {
    rc = engine_fail(e, FERRY_ENOMEM, "ferry_get_breakdown: out of memory");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  if (n) memcpy(copy, b->rows, n * sizeof *copy);
  pthread_mutex_unlock(&e->lock);
  for (uint32_t i = 0; i < n; i++) {
    const bd_row *r = &copy[i];
    ferry_breakdown_row row = {.rule = r->rule, .where = r->where, .layer = r->layer,
                               .tensors_offloaded = r->tensors_offloaded,
                               .bytes_offloaded = r->bytes_offloaded,
                               .tensors_kept = r->tensors_kept, .bytes_kept = r->bytes_kept};
    fn(ud, &row);
  }
  free(copy);
  return FERRY_OK;
}

/* Counts each new entry by its reason: an offload the engine could not
 * make is kept for an engine-level reason. An alias adds no bytes. */
static void breakdown_on(void *self, ferry_engine *e, const obs_event *ev) {
  if (ev->kind != OBS_PACK || ev->aliased) return;
  const stash_entry *s = &e->entries[ev->idx];
  const int offloaded = s->state != ENTRY_KEPT;
  if (ev->decision->action == FERRY_OFFLOAD && !offloaded) {
    const char *why =
        e->stats.cap_fallbacks > ev->cap_fallbacks_before ? "host cap" : "copy failed";
    snprintf(e->why.rule, sizeof e->why.rule, "%s", why);
    e->why.where[0] = 0;
  }
  breakdown_count(self, e, s->layer, s->bytes, offloaded);
}
