/*
 * breakdown.c — saved tensors counted by the rule that decided them and by
 * layer (config.count_reasons, ferry_get_breakdown). Only engines created
 * with count_reasons pay for it: their decisions go through the policy's
 * explain, and each pack adds its bytes to one row. Under the engine lock.
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
  ferry_policy_reason why; /* the reason of the decision being counted */
  bd_row *rows;
  uint32_t n, cap;
  u64map index; /* row key -> row; equal keys of different rows fall back to a scan */
};

int breakdown_open(ferry_engine *e) {
  e->bd = calloc(1, sizeof *e->bd);
  return e->bd ? FERRY_OK : FERRY_ENOMEM;
}

void breakdown_close(ferry_engine *e) {
  if (!e->bd) return;
  free(e->bd->rows);
  u64map_free(&e->bd->index);
  free(e->bd);
  e->bd = NULL;
}

ferry_policy_reason *breakdown_reason(ferry_engine *e) { return &e->bd->why; }

void breakdown_set(ferry_engine *e, const char *rule, const char *where) {
  ferry_policy_reason *w = &e->bd->why;
  snprintf(w->rule, sizeof w->rule, "%s", rule);
  snprintf(w->where, sizeof w->where, "%s", where);
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

/* Counts a pack of `bytes` in layer, decided by bd->why, that ended
 * offloaded or kept. Out of memory: the pack is not counted. */
void breakdown_count(ferry_engine *e, int32_t layer, uint64_t bytes, int offloaded) {
  struct breakdown *b = e->bd;
  const char *rule = intern_get(&e->interned, b->why.rule);
  const char *where = intern_get(&e->interned, b->why.where);
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
  if (!fn) rc = engine_fail(e, FERRY_EINVAL, "ferry_get_breakdown: fn is NULL");
  else if (!e->bd)
    rc = engine_fail(e, FERRY_ESTATE,
                     "ferry_get_breakdown: the engine counts no reasons (create it with "
                     "config.count_reasons = 1)");
  if (rc) {
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  /* A copy, so fn runs unlocked and may call into the engine. */
  uint32_t n = e->bd->n;
  bd_row *copy = n ? malloc(n * sizeof *copy) : NULL;
  if (n && !copy) {
    rc = engine_fail(e, FERRY_ENOMEM, "ferry_get_breakdown: out of memory");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  if (n) memcpy(copy, e->bd->rows, n * sizeof *copy);
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

/* (engine_internal.h) */
void count_reason(ferry_engine *e, const stash_entry *s, const ferry_decision *d,
                  uint64_t cap_fallbacks_before) {
  const int offloaded = s->state != ENTRY_KEPT;
  if (d->action == FERRY_OFFLOAD && !offloaded)
    breakdown_set(e, e->stats.cap_fallbacks > cap_fallbacks_before ? "host cap" : "copy failed",
                  "");
  breakdown_count(e, s->layer, s->bytes, offloaded);
}
