/* ---- registry of live engines --------------------------------------------
 * A call on a destroyed engine must fail with an error instead of touching
 * freed memory, so every API entry checks its engine against this list. It is
 * lock-free to read: a handful of atomic loads on the hot path. */
#define MAX_ENGINES 64
static _Atomic(ferry_engine *) live_engines[MAX_ENGINES];
static atomic_uint live_engines_hi; /* slots [0, hi) may be in use */

static int registry_add(ferry_engine *e) {
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
static int registry_remove(ferry_engine *e) {
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

static void quarantine_push(void *mem) {
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

