/*
 * stash_lifecycle.c — the stash's memory at an engine's create and destroy:
 * the entry tables, and at teardown every copy waited for, every owner
 * given back, every arena buffer freed. The stash itself is stash.c.
 */
#include <stdlib.h>

#include "core/engine_internal.h"
#include "util/util.h"

/* ---- lifecycle ----------------------------------------------------------------- */
int stash_init(ferry_engine *e) {
  if (util_grow_aligned((void **)&e->entries, &e->cap_entries, sizeof *e->entries, 256, 64, 64))
    return FERRY_ENOMEM;
  e->cold = malloc((size_t)e->cap_entries * sizeof *e->cold);
  e->free_slots = malloc((size_t)e->cap_entries * sizeof *e->free_slots);
  if (!e->cold || !e->free_slots || u64map_grow(&e->aliases)) return FERRY_ENOMEM;
  return FERRY_OK;
}

/* Engine teardown: wait for every copy, give every owner back, free the
 * arena buffers. Handles still live become invalid. */
void stash_destroy(ferry_engine *e) {
  for (uint32_t i = 0; i < e->n_entries; i++) {
    stash_entry *s = &e->entries[i];
    if (s->state == ENTRY_FREE || s->state == ENTRY_ALIAS) continue;
    if (s->ev) e->bk->ops->event_synchronize(e->bk, s->ev);
    if (e->cold[i].owner) e->cfg.release(e->cfg.callback_ud, e->cold[i].owner);
    if (s->host) ferry_arena_free(e->arena, s->host, s->bytes);
    if (s->ev) e->bk->ops->event_destroy(e->bk, s->ev);
  }
  for (uint32_t i = 0; i < e->n_pending; i++) {
    e->bk->ops->event_synchronize(e->bk, e->pending[i].ev);
    ferry_arena_free(e->arena, e->pending[i].host, e->pending[i].bytes);
    e->bk->ops->event_destroy(e->bk, e->pending[i].ev);
  }
  free(e->entries);
  free(e->cold);
  free(e->free_slots);
  u64map_free(&e->aliases);
  free(e->fwd);
  free(e->offload_order);
  free(e->pending);
  free(e->layer_counts);
  e->entries = NULL;
  e->cold = NULL;
  e->fwd = NULL;
}
