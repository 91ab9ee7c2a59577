/*
 * resident.c — long-lived host-resident buffers (ferry.h, "resident
 * buffers"): state that lives in the pinned arena between uses and moves to
 * and from the device at points the caller chooses (optimizer states,
 * offloaded weights), beside the saved-tensor path of the stash.
 * How it works: docs/internals.md#residentc.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ferry_tools.h"


struct ferry_resident {
  ferry_engine *e;                   /* NULL once the engine was destroyed */
  ferry_resident *gprev, *gnext;     /* the process-wide registry */
  ferry_resident *prev, *next;       /* the engine's list */
  void *host;                        /* arena memory; NULL once detached */
  size_t bytes;
  bk_event *ev;  /* recorded after the last copy; NULL until the first */
  int recorded;
};

typedef struct resident_list {
  ferry_resident *head;
} resident_list;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static ferry_resident *g_head;

/* 1 if r is a live handle; call with g_mu held. */
static int live_locked(const ferry_resident *r) {
  if (!r) return 0;
  for (const ferry_resident *o = g_head; o; o = o->gnext)
    if (o == r) return 1;
  return 0;
}

static void resident_engine_shutdown(ferry_engine *e, void *ud);

static int create_fail(ferry_engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int create_fail(ferry_engine *e, int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  engine_lock(e);
  engine_fail(e, code, "ferry_resident_create: %s", msg);
  engine_unlock(e);
  return code;
}

int ferry_resident_create(ferry_engine *e, uint64_t bytes, ferry_resident **out) {
  int rc = engine_check(e);
  if (rc) return rc;
  if (!out) return create_fail(e, FERRY_EINVAL, "out is NULL");
  *out = NULL;
  if (bytes == 0) return create_fail(e, FERRY_EINVAL, "bytes is 0");
  if (bytes > SIZE_MAX / 2)
    return create_fail(e, FERRY_EINVAL, "%llu bytes is absurd", (unsigned long long)bytes);
  ferry_resident *r = calloc(1, sizeof *r);
  if (!r) return create_fail(e, FERRY_ENOMEM, "out of host memory for the handle");
  r->e = e;
  r->bytes = (size_t)bytes;
  r->host = ferry_arena_alloc(engine_arena(e), r->bytes);
  if (!r->host) {
    free(r);
    ferry_arena_stats a;
    ferry_arena_get_stats(engine_arena(e), &a);
    return create_fail(e, FERRY_ECAP,
                       "the pinned arena has no room for a resident buffer of %llu bytes "
                       "(cap %llu, reserved %llu, in use %llu); free arena memory, offload "
                       "less or raise the cap",
                       (unsigned long long)bytes, (unsigned long long)a.cap,
                       (unsigned long long)a.reserved, (unsigned long long)a.in_use);
  }
  pthread_mutex_lock(&g_mu);
  engine_lock(e);
  resident_list *l = engine_shutdown_data(e, resident_engine_shutdown);
  if (!l) {
    if (!(l = calloc(1, sizeof *l)) || engine_on_shutdown(e, resident_engine_shutdown, l)) {
      free(l);
      rc = FERRY_ENOMEM;
    }
  }
  if (!rc) rc = event_get(e, &r->ev);
  if (rc) {
    engine_fail(e, rc, "ferry_resident_create: out of host memory for its bookkeeping");
    engine_unlock(e);
    pthread_mutex_unlock(&g_mu);
    ferry_arena_free(engine_arena(e), r->host, r->bytes);
    free(r);
    return rc;
  }
  r->next = l->head;
  if (l->head) l->head->prev = r;
  l->head = r;
  ferry_stats *st = engine_stats(e);
  st->resident_buffers++;
  st->resident_bytes += r->bytes;
  engine_unlock(e);
  r->gnext = g_head;
  if (g_head) g_head->gprev = r;
  g_head = r;
  pthread_mutex_unlock(&g_mu);
  *out = r;
  return FERRY_OK;
}

/* Look r up and return its engine with the engine lock held (g_mu released),
 * or an error: EHANDLE for a handle that is not live, ESTATE once detached. */
static int enter(ferry_resident *r, ferry_engine **out) {
  pthread_mutex_lock(&g_mu);
  if (!live_locked(r)) {
    pthread_mutex_unlock(&g_mu);
    return FERRY_EHANDLE;
  }
  ferry_engine *e = r->e;
  if (!e) {
    pthread_mutex_unlock(&g_mu);
    return FERRY_ESTATE;
  }
  engine_lock(e);
  pthread_mutex_unlock(&g_mu);
  *out = e;
  return FERRY_OK;
}

/* One copy: stream waits on compute_stream and on r's previous copy, copies,
 * records r's event. Called with the engine lock held. */
static int issue_copy(ferry_engine *e, ferry_resident *r, int to_host, void *dev,
                      void *compute_stream) {
  const char *fn = to_host ? "ferry_resident_to_host" : "ferry_resident_to_device";
  ferry_backend *b = engine_backend(e);
  const ferry_backend_ops *o = b->ops;
  bk_stream s = to_host ? engine_d2h_stream(e) : engine_h2d_stream(e);
  int rc;
  if ((rc = o->event_record(b, engine_scratch_event(e), compute_stream)) ||
      (rc = o->stream_wait_event(b, s, engine_scratch_event(e))) ||
      (r->recorded && (rc = o->stream_wait_event(b, s, r->ev))))
    return engine_fail(e, rc, "%s: ordering after the compute stream failed: %s", fn, b->err);
  rc = to_host ? o->copy_d2h(b, r->host, dev, r->bytes, s)
               : o->copy_h2d(b, dev, r->host, r->bytes, s);
  /* Recorded even after a failed copy: it covers whatever was issued. */
  int rc2 = o->event_record(b, r->ev, s);
  if (!rc2) r->recorded = 1;
  if (!rc) rc = rc2;
  if (!rc && !to_host) rc = o->stream_wait_event(b, compute_stream, r->ev);
  if (rc) return engine_fail(e, rc, "%s: copy of %zu bytes failed: %s", fn, r->bytes, b->err);
  ferry_stats *st = engine_stats(e);
  if (to_host) {
    st->resident_to_host++;
    st->resident_bytes_d2h += r->bytes;
  } else {
    st->resident_to_device++;
    st->resident_bytes_h2d += r->bytes;
  }
  return FERRY_OK;
}

static int copy(ferry_resident *r, int to_host, void *dev, void *compute_stream) {
  ferry_engine *e;
  int rc = enter(r, &e);
  if (rc) return rc;
  if (!dev)
    rc = engine_fail(e, FERRY_EINVAL, "%s: device_ptr is NULL",
                     to_host ? "ferry_resident_to_host" : "ferry_resident_to_device");
  else
    rc = issue_copy(e, r, to_host, dev, compute_stream);
  engine_unlock(e);
  return rc;
}

int ferry_resident_to_host(ferry_resident *r, const void *device_ptr, void *compute_stream) {
  return copy(r, 1, (void *)device_ptr, compute_stream);
}

int ferry_resident_to_device(ferry_resident *r, void *device_ptr, void *compute_stream) {
  return copy(r, 0, device_ptr, compute_stream);
}

/* Wait for r's last copy (no lock held: r is used by one thread at a time,
 * and its event stays r's until destroy or engine teardown detaches it). */
static int wait_copies(ferry_engine *e, ferry_resident *r) {
  if (!r->recorded) return FERRY_OK;
  return engine_backend(e)->ops->event_synchronize(engine_backend(e), r->ev);
}

int ferry_resident_wait(ferry_resident *r) {
  ferry_engine *e;
  int rc = enter(r, &e);
  if (rc) return rc;
  engine_unlock(e);
  rc = wait_copies(e, r);
  if (rc) {
    engine_lock(e);
    engine_fail(e, rc, "ferry_resident_wait: %s", engine_backend(e)->err);
    engine_unlock(e);
  }
  return rc;
}

void *ferry_resident_host_ptr(ferry_resident *r) {
  pthread_mutex_lock(&g_mu);
  void *p = live_locked(r) && r->e ? r->host : NULL;
  pthread_mutex_unlock(&g_mu);
  return p;
}

uint64_t ferry_resident_bytes(ferry_resident *r) {
  pthread_mutex_lock(&g_mu);
  uint64_t n = live_locked(r) && r->e ? r->bytes : 0;
  pthread_mutex_unlock(&g_mu);
  return n;
}

/* Wait for r's copies, give its memory and event back and take it off the
 * engine's list. Called with g_mu held and the engine lock not held. */
static void detach(ferry_engine *e, ferry_resident *r, resident_list *l) {
  wait_copies(e, r);
  ferry_arena_free(engine_arena(e), r->host, r->bytes);
  engine_lock(e);
  event_put(e, r->ev);
  if (r->prev) r->prev->next = r->next;
  else if (l->head == r) l->head = r->next;
  if (r->next) r->next->prev = r->prev;
  ferry_stats *st = engine_stats(e);
  st->resident_buffers--;
  st->resident_bytes -= r->bytes;
  engine_unlock(e);
  r->prev = r->next = NULL;
  r->ev = NULL;
  r->host = NULL;
  r->e = NULL;
}

int ferry_resident_destroy(ferry_resident *r) {
  pthread_mutex_lock(&g_mu);
  if (!live_locked(r)) {
    pthread_mutex_unlock(&g_mu);
    return FERRY_EHANDLE;
  }
  if (r->e) {
    engine_lock(r->e);
    resident_list *l = engine_shutdown_data(r->e, resident_engine_shutdown);
    engine_unlock(r->e);
    detach(r->e, r, l);
  }
  if (r->gprev) r->gprev->gnext = r->gnext;
  else g_head = r->gnext;
  if (r->gnext) r->gnext->gprev = r->gprev;
  pthread_mutex_unlock(&g_mu);
  free(r);
  return FERRY_OK;
}

/* Engine teardown: detach every buffer; the handles stay valid for destroy. */
static void resident_engine_shutdown(ferry_engine *e, void *ud) {
  resident_list *l = ud;
  pthread_mutex_lock(&g_mu);
  while (l->head) detach(e, l->head, l);
  pthread_mutex_unlock(&g_mu);
  free(l);
}
