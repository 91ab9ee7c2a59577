/*
 * engine_base.c — what every part of the core uses of an engine, at the
 * bottom of core/ (it calls nothing else there): the live-engine registry
 * that engine_check reads, engine_fail, the pool of backend events and the
 * list of the stash's observers (the recorders).
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/engine_internal.h"

/* ---- registry of live engines --------------------------------------------
 * A call on a destroyed engine must fail with an error instead of touching
 * freed memory, so every API entry checks its engine against this list. It is
 * lock-free to read: a handful of atomic loads on the hot path. */
static _Atomic(ferry_engine *) live_engines[MAX_ENGINES];
static atomic_uint live_engines_hi; /* slots [0, hi) may be in use */

int registry_add(ferry_engine *e) {
  for (unsigned i = 0; i < MAX_ENGINES; i++) {
    ferry_engine *expected = NULL;
    if (atomic_compare_exchange_strong(&live_engines[i], &expected, e)) {
      unsigned hi = atomic_load(&live_engines_hi);
      while (hi < i + 1 && !atomic_compare_exchange_weak(&live_engines_hi, &hi, i + 1)) {
      }
      return 0;
    }
  }
  return -1;
}

/* 1 when e was live and this call took it off the list: of two destroys of
 * one engine, only one gets 1. */
int registry_remove(ferry_engine *e) {
  for (unsigned i = 0; i < MAX_ENGINES; i++) {
    ferry_engine *expected = e;
    if (atomic_compare_exchange_strong(&live_engines[i], &expected, NULL)) return 1;
  }
  return 0;
}

/* ---- quarantine of destroyed engines -------------------------------------
 * The memory of the last QUARANTINED_ENGINES destroyed engines is held back
 * from malloc, so a new engine does not get a destroyed one's address at
 * once: a call (or a second destroy) through a stale pointer then finds it
 * off the registry and is refused, instead of acting on the new engine. */
#define QUARANTINED_ENGINES 16
static pthread_mutex_t quarantine_lock = PTHREAD_MUTEX_INITIALIZER;
static void *quarantine[QUARANTINED_ENGINES];
static unsigned quarantine_next;

void quarantine_push(void *mem) {
  pthread_mutex_lock(&quarantine_lock);
  void *oldest = quarantine[quarantine_next];
  quarantine[quarantine_next] = mem;
  quarantine_next = (quarantine_next + 1) % QUARANTINED_ENGINES;
  pthread_mutex_unlock(&quarantine_lock);
  free(oldest);
}

int engine_check(ferry_engine *e) {
  if (!e) return FERRY_EINVAL;
  unsigned hi = atomic_load_explicit(&live_engines_hi, memory_order_acquire);
  for (unsigned i = 0; i < hi; i++)
    if (atomic_load_explicit(&live_engines[i], memory_order_acquire) == e) return FERRY_OK;
  return FERRY_ESTATE;
}

/* ---- errors --------------------------------------------------------------- */
int engine_fail(ferry_engine *e, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->last_error, sizeof e->last_error, fmt, ap);
  va_end(ap);
  return code;
}

/* ---- events ------------------------------------------------------------------ */
int event_get(ferry_engine *e, bk_event **out) {
  if (e->n_event_pool) {
    *out = e->event_pool[--e->n_event_pool];
    return FERRY_OK;
  }
  int rc = e->bk->ops->event_create(e->bk, out);
  if (rc) engine_fail(e, rc, "event_create: %s", e->bk->err);
  return rc;
}

void event_put(ferry_engine *e, bk_event *ev) {
  if (!ev) return;
  if (e->n_event_pool == e->cap_event_pool) {
    uint32_t ncap = e->cap_event_pool ? e->cap_event_pool * 2 : 64;
    bk_event **n = realloc(e->event_pool, ncap * sizeof *n);
    if (!n) {
      e->bk->ops->event_destroy(e->bk, ev);
      return;
    }
    e->event_pool = n;
    e->cap_event_pool = ncap;
  }
  e->event_pool[e->n_event_pool++] = ev;
}


/* ---- observers of the stash (engine_internal.h) ------------------------------ */
int engine_observe(ferry_engine *e, obs_fn on, void (*close)(void *, ferry_engine *), void *self,
                   unsigned wants) {
  stash_observer *n = realloc(e->obs, (e->n_obs + 1) * sizeof *n);
  if (!n) return FERRY_ENOMEM;
  e->obs = n;
  n[e->n_obs++] = (stash_observer){.on = on, .close = close, .self = self, .wants = wants};
  e->obs_wants |= wants;
  return FERRY_OK;
}

void *engine_observer(const ferry_engine *e, obs_fn on) {
  for (uint32_t i = 0; i < e->n_obs; i++)
    if (e->obs[i].on == on) return e->obs[i].self;
  return NULL;
}

void engine_observers_close(ferry_engine *e) {
  for (uint32_t i = e->n_obs; i-- > 0;) e->obs[i].close(e->obs[i].self, e);
  free(e->obs);
  e->obs = NULL;
  e->n_obs = 0;
  e->obs_wants = 0;
}
