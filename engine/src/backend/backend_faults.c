/* backend_faults.c — a backend that wraps another and makes its calls fail
 * at random, from a seed, the way a runtime reports a failure it recovered
 * from: a copy, an event record or a stream wait that is not enqueued, a
 * pinned allocation refused. For tests and soak runs (ferry_config.faults),
 * never for training. Waits, queries and synchronizations are never
 * failed: in CUDA those are sticky device errors after which nothing is safe. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend_internal.h"
#include "util/errbuf.h"

typedef struct faulty {
  ferry_backend base;
  ferry_backend_ops ops; /* faulty_ops with the inner backend's flags */
  ferry_backend *inner;
  uint64_t rng;
  double p_copy, p_event, p_alloc;
  uint64_t injected;
} faulty;

static faulty *as_faulty(ferry_backend *b) { return (faulty *)b; }

/* xorshift64*: cheap, seeded, reproducible. */
static double next_uniform(faulty *f) {
  f->rng ^= f->rng >> 12;
  f->rng ^= f->rng << 25;
  f->rng ^= f->rng >> 27;
  return (double)((f->rng * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}

/* Whether to fail this call; if so its message is in b->err. */
static int inject(faulty *f, double p, const char *what) {
  if (!(p > 0) || next_uniform(f) >= p) return 0;
  f->injected++;
  backend_fail(&f->base, FERRY_EBACKEND, "injected fault #%llu: %s failed",
               (unsigned long long)f->injected, what);
  return 1;
}

/* The inner backend's result, its message copied on failure. */
static int pass(faulty *f, int rc) {
  return rc ? backend_fail(&f->base, rc, "%s", f->inner->err) : rc;
}

static void faulty_destroy(ferry_backend *b) {
  faulty *f = as_faulty(b);
  f->inner->ops->destroy(f->inner);
  free(f);
}

static int faulty_host_alloc(ferry_backend *b, size_t bytes, size_t align, void **out) {
  faulty *f = as_faulty(b);
  if (inject(f, f->p_alloc, "host_alloc")) return FERRY_ENOMEM;
  return pass(f, f->inner->ops->host_alloc(f->inner, bytes, align, out));
}

static int faulty_host_free(ferry_backend *b, void *p, size_t bytes) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->host_free(f->inner, p, bytes));
}

static int faulty_stream_create(ferry_backend *b, bk_stream *out) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->stream_create(f->inner, out));
}

static int faulty_stream_destroy(ferry_backend *b, bk_stream s) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->stream_destroy(f->inner, s));
}

static int faulty_copy_d2h(ferry_backend *b, void *dst, const void *src, size_t n, bk_stream s) {
  faulty *f = as_faulty(b);
  if (inject(f, f->p_copy, "copy_d2h")) return FERRY_EBACKEND;
  return pass(f, f->inner->ops->copy_d2h(f->inner, dst, src, n, s));
}

static int faulty_copy_h2d(ferry_backend *b, void *dst, const void *src, size_t n, bk_stream s) {
  faulty *f = as_faulty(b);
  if (inject(f, f->p_copy, "copy_h2d")) return FERRY_EBACKEND;
  return pass(f, f->inner->ops->copy_h2d(f->inner, dst, src, n, s));
}

static int faulty_event_create(ferry_backend *b, bk_event **out) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->event_create(f->inner, out));
}

static int faulty_event_destroy(ferry_backend *b, bk_event *ev) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->event_destroy(f->inner, ev));
}

static int faulty_event_record(ferry_backend *b, bk_event *ev, bk_stream s) {
  faulty *f = as_faulty(b);
  if (inject(f, f->p_event, "event_record")) return FERRY_EBACKEND;
  return pass(f, f->inner->ops->event_record(f->inner, ev, s));
}

static int faulty_event_query(ferry_backend *b, bk_event *ev) {
  faulty *f = as_faulty(b);
  int rc = f->inner->ops->event_query(f->inner, ev);
  return rc < 0 ? pass(f, rc) : rc;
}

static int faulty_event_synchronize(ferry_backend *b, bk_event *ev) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->event_synchronize(f->inner, ev));
}

static int faulty_stream_synchronize(ferry_backend *b, bk_stream s) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->stream_synchronize(f->inner, s));
}

static int faulty_stream_wait_event(ferry_backend *b, bk_stream s, bk_event *ev) {
  faulty *f = as_faulty(b);
  if (inject(f, f->p_event, "stream_wait_event")) return FERRY_EBACKEND;
  return pass(f, f->inner->ops->stream_wait_event(f->inner, s, ev));
}

/* Copies are the inner backend's, so is their timing (never failed; only set
 * when the inner backend has it). */
static int faulty_set_copy_listener(ferry_backend *b, bk_copy_listener fn, void *ud) {
  faulty *f = as_faulty(b);
  return pass(f, f->inner->ops->set_copy_listener(f->inner, fn, ud));
}

static const ferry_backend_ops faulty_ops = {
    .name = "faults",
    .destroy = faulty_destroy,
    .host_alloc = faulty_host_alloc,
    .host_free = faulty_host_free,
    .stream_create = faulty_stream_create,
    .stream_destroy = faulty_stream_destroy,
    .copy_d2h = faulty_copy_d2h,
    .copy_h2d = faulty_copy_h2d,
    .event_create = faulty_event_create,
    .event_destroy = faulty_event_destroy,
    .event_record = faulty_event_record,
    .event_query = faulty_event_query,
    .event_synchronize = faulty_event_synchronize,
    .stream_wait_event = faulty_stream_wait_event,
    .stream_synchronize = faulty_stream_synchronize,
    .set_copy_listener = faulty_set_copy_listener,
};

/* "seed=N,copy=P,event=P,alloc=P" (any subset; probabilities in [0, 1]). */
static int parse_spec(faulty *f, const char *spec, char *err, size_t errlen) {
  char copy[256];
  if (snprintf(copy, sizeof copy, "%s", spec) >= (int)sizeof copy)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "config.faults: longer than 255 bytes");
  for (char *save = NULL, *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(t, '=');
    if (!eq)
      return ferry_errbuf(err, errlen, FERRY_EINVAL,
                          "config.faults: \"%s\" is not key=value (seed, copy, event, alloc)", t);
    *eq = 0;
    double v;
    char what[64];
    snprintf(what, sizeof what, "config.faults %s", t);
    int seed = !strcmp(t, "seed");
    double *slot = !strcmp(t, "copy")    ? &f->p_copy
                   : !strcmp(t, "event") ? &f->p_event
                   : !strcmp(t, "alloc") ? &f->p_alloc
                                         : NULL;
    if (!seed && !slot)
      return ferry_errbuf(err, errlen, FERRY_EINVAL,
                          "config.faults: unknown key \"%s\" (seed, copy, event, alloc)", t);
    int rc = seed ? ferry_parse_number(what, eq + 1, FERRY_NUMBER_COUNT, 0, 9007199254740992.0,
                                       0, &v, err, errlen)
                  : ferry_parse_number(what, eq + 1, FERRY_NUMBER_REAL, 0, 1, 0, &v, err, errlen);
    if (rc) return rc;
    if (seed) f->rng = (uint64_t)v * 0x9E3779B97F4A7C15ull + 1;
    else *slot = v;
  }
  return FERRY_OK;
}

int ferry_backend_faults_wrap(ferry_backend *inner, const char *spec, ferry_backend **out,
                              char *err, size_t errlen) {
  faulty *f = calloc(1, sizeof *f);
  if (!f) return ferry_errbuf(err, errlen, FERRY_ENOMEM, "out of memory");
  f->ops = faulty_ops;
  f->ops.flags = inner->ops->flags;
  if (!inner->ops->set_copy_listener) f->ops.set_copy_listener = NULL;
  f->base.ops = &f->ops;
  f->inner = inner;
  f->rng = 0x9E3779B97F4A7C15ull;
  int rc = parse_spec(f, spec, err, errlen);
  if (rc) {
    free(f);
    return rc;
  }
  *out = &f->base;
  return FERRY_OK;
}

uint64_t ferry_backend_faults_injected(const ferry_backend *b) {
  return b && b->ops->destroy == faulty_destroy ? ((const faulty *)b)->injected : 0;
}
