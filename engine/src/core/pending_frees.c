/*
 * pending_frees.c — arena buffers whose last copy may still run: given back
 * once its event completes (polled on every call, drained at step end).
 * Moved out of stash.c, which calls it with the engine lock held.
 */
#include "core/engine_internal.h"
#include "util/util.h"

#define PENDING_POLL_MAX 8 /* retire at most this many copies per call */

static int pending_push(ferry_engine *e, void *host, uint64_t bytes, bk_event *ev) {
  if (util_grow((void **)&e->pending, &e->cap_pending, sizeof *e->pending, e->n_pending + 1, 64))
    return -1;
  e->pending[e->n_pending++] = (pending_free){host, bytes, ev};
  e->bytes_in_flight += bytes;
  return 0;
}

static void pending_retire(ferry_engine *e, uint32_t i) {
  pending_free *p = &e->pending[i];
  ferry_arena_free(e->arena, p->host, p->bytes);
  e->ctx.arena_in_use -= p->bytes;
  e->bytes_in_flight -= p->bytes;
  event_put(e, p->ev);
  e->pending[i] = e->pending[--e->n_pending];
}

/* Retire a few completed copies; cheap enough for every call. */
void pending_poll(ferry_engine *e) {
  uint32_t checked = 0;
  for (uint32_t i = 0; i < e->n_pending && checked < PENDING_POLL_MAX; checked++) {
    if (e->bk->ops->event_query(e->bk, e->pending[i].ev) == 1)
      pending_retire(e, i); /* moves the last one into i */
    else
      i++;
  }
}

void pending_drain(ferry_engine *e) {
  while (e->n_pending) {
    uint32_t i = e->n_pending - 1;
    if (e->bk->ops->event_query(e->bk, e->pending[i].ev) != 1) {
      double t0 = obs_calls(e) ? util_now_us() : 0;
      e->stats.waits++;
      e->bk->ops->event_synchronize(e->bk, e->pending[i].ev);
      if (obs_calls(e)) obs_wait(e, "wait for copies", t0);
    }
    pending_retire(e, i);
  }
}

/* Give an entry's arena buffer back, now or once its last copy completed. */
void host_buffer_drop(ferry_engine *e, stash_entry *s, int copy_may_run) {
  if (!s->host) {
    if (s->ev) event_put(e, s->ev);
    s->ev = NULL;
    return;
  }
  if (copy_may_run && s->ev && e->bk->ops->event_query(e->bk, s->ev) != 1 &&
      pending_push(e, s->host, s->bytes, s->ev) == 0) {
    s->host = NULL;
    s->ev = NULL;
    return;
  }
  if (copy_may_run && s->ev && e->bk->ops->event_query(e->bk, s->ev) != 1) {
    e->stats.waits++; /* no memory for the pending list: wait instead */
    e->bk->ops->event_synchronize(e->bk, s->ev);
  }
  ferry_arena_free(e->arena, s->host, s->bytes);
  e->ctx.arena_in_use -= s->bytes;
  event_put(e, s->ev);
  s->host = NULL;
  s->ev = NULL;
}
