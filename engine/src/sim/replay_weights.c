/*
 * replay_weights.c — weight offload in a replay (docs/sim-model.md,
 * "Weight offload").
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/replay_internal.h"

/* ---- weight offload (weight_model above) ------------------------------------------ */

/* The engine's last error as the replay's, naming the weight offload. */
static int w_fail(replay *r, int rc, const char *what) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: weight offload: %s: %s", r->res->label, what,
                      ferry_last_error(r->e));
}

static int w_backend_fail(replay *r, int rc) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: weight offload: %s", r->res->label,
                      engine_backend(r->e)->err);
}

/* Validates the settings and, with blocks chosen, takes their weights out of
 * resident memory and pins their host copies (offload_weights copies them
 * to the host when it wraps the model: step 1 starts with them there). */
int w_open(replay *r) {
  const sim_config *c = r->c;
  const sim_trace *t = r->t;
  sim_result *out = r->res;
  if (c->weight_count == 0) return 0;
  if (c->weight_count < 0 || c->weight_first < 0)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "weight layers: first %d and count %d must be >= 0", c->weight_first,
                        c->weight_count);
  if (!r->sim)
    return ferry_errbuf(r->err, r->errlen, FERRY_EUNSUPPORTED,
                        "weight offload is modeled on the sim backend only");
  int32_t last = (int32_t)((int64_t)c->weight_first + c->weight_count - 1);
  if (t->layers <= 0 || (int64_t)c->weight_first + c->weight_count > t->layers)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight layers %d..%d: the trace has %d repeated block(s)%s", t->name,
                        c->weight_first, last, t->layers,
                        t->layers > 0 ? "" : " (its packs name no \"layers\")");
  const trace_resident *params = resident_named(t, "parameters");
  if (!params || !params->bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight offload needs the trace's resident \"parameters\" (%s; "
                        "ferry_trace_resident declares them, synthesized traces have them)",
                        t->name, params ? "0 bytes" : "missing");
  uint64_t each = params->layer_bytes;
  int estimated = each == 0;
  if (estimated) each = params->bytes / (uint64_t)t->layers;
  if (!each || each * (uint64_t)c->weight_count > params->bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight offload: %d block(s) of %llu bytes are more than the %llu "
                        "bytes of \"parameters\"", t->name, c->weight_count,
                        (unsigned long long)each, (unsigned long long)params->bytes);
  weight_model *w = calloc(1, sizeof *w);
  if (!w) return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  r->w = w;
  w->first = c->weight_first;
  w->count = c->weight_count;
  w->bytes = each;
  w->dbl = !c->weight_single_buffer;
  size_t n = (size_t)w->count;
  w->l = calloc(n, sizeof *w->l);
  w->dev = malloc(n);
  w->fwd_first = malloc(n * sizeof *w->fwd_first);
  w->fwd_last = malloc(n * sizeof *w->fwd_last);
  w->bwd_first = malloc(n * sizeof *w->bwd_first);
  w->bwd_after_gap = calloc(n, 1);
  if (!w->l || !w->dev || !w->fwd_first || !w->fwd_last || !w->bwd_first || !w->bwd_after_gap)
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if ((rc = b->ops->stream_create(b, &w->lane)) || (rc = b->ops->event_create(b, &w->now_ev)))
    return w_backend_fail(r, rc);
  for (size_t i = 0; i < n; i++) {
    if ((rc = ferry_resident_create(r->e, each, &w->l[i].buf)))
      return w_fail(r, rc, "a host buffer");
    if ((rc = b->ops->event_create(b, &w->l[i].d2h)) || (rc = b->ops->event_create(b, &w->l[i].h2d)))
      return w_backend_fail(r, rc);
  }
  r->resident -= each * n;
  out->w_first = w->first;
  out->w_count = w->count;
  out->w_double_buffer = w->dbl;
  out->w_estimated = estimated;
  out->w_layer_bytes = each;
  out->w_device_bytes = out->w_host_bytes = each * n;
  return 0;
}

void w_close(replay *r) {
  weight_model *w = r->w;
  if (!w) return;
  ferry_backend *b = r->e ? engine_backend(r->e) : NULL;
  for (int32_t i = 0; w->l && i < w->count; i++) {
    if (w->l[i].buf) ferry_resident_destroy(w->l[i].buf);
    if (b && w->l[i].d2h) b->ops->event_destroy(b, w->l[i].d2h);
    if (b && w->l[i].h2d) b->ops->event_destroy(b, w->l[i].h2d);
  }
  if (b && w->now_ev) b->ops->event_destroy(b, w->now_ev);
  if (b && w->lane) b->ops->stream_destroy(b, w->lane);
  free(w->l);
  free(w->dev);
  free(w->fwd_first);
  free(w->fwd_last);
  free(w->bwd_first);
  free(w->bwd_after_gap);
  free(w);
  r->w = NULL;
}

/* The block an event belongs to: a compute event's, a pack's or unpack's
 * tensor's; -1 for the others. */
static int32_t event_layer(const replay *r, const trace_ev *ev) {
  if (ev->type == TEV_COMPUTE) return ev->layer;
  if (ev->type == TEV_PACK || ev->type == TEV_UNPACK) return r->t->tensors[ev->tensor].desc.layer;
  return -1;
}

/* The chosen block's index of an event, or -1. */
static int32_t w_index(const replay *r, const trace_ev *ev) {
  int32_t l = event_layer(r, ev);
  return l >= r->w->first && l - r->w->first < r->w->count ? l - r->w->first : -1;
}

/* Where trace step `tsi`'s chosen blocks begin and end forward and begin
 * backward. */
void w_tables(replay *r, uint32_t tsi) {
  weight_model *w = r->w;
  if (w->table_step == tsi + 1) return;
  w->table_step = tsi + 1;
  for (int32_t i = 0; i < w->count; i++) {
    w->fwd_first[i] = w->fwd_last[i] = w->bwd_first[i] = -1;
    w->bwd_after_gap[i] = 0;
  }
  const trace_step *ts = &r->t->steps[tsi];
  int phase = 0;
  for (uint32_t k = ts->first; k < ts->end; k++) {
    const trace_ev *ev = &r->t->events[k];
    int32_t i = w_index(r, ev);
    if (i >= 0 && phase == 0) {
      if (w->fwd_first[i] < 0) w->fwd_first[i] = k;
      w->fwd_last[i] = k;
    } else if (i >= 0 && phase == 1 && w->bwd_first[i] < 0) {
      w->bwd_first[i] = k;
      w->bwd_after_gap[i] = ev->type != TEV_COMPUTE;
    }
    if (ev->type == TEV_BACKWARD_BEGIN) phase = 1;
    else if (ev->type == TEV_BACKWARD_END) phase = 2;
  }
}

/* Offloads whose copy has completed free their device copy. */
static int w_poll(replay *r) {
  weight_model *w = r->w;
  if (!w->n_leaving) return 0;
  ferry_backend *b = engine_backend(r->e);
  for (int32_t i = 0; i < w->count && w->n_leaving; i++) {
    if (!w->l[i].leaving) continue;
    int q = b->ops->event_query(b, w->l[i].d2h);
    if (q < 0) return w_backend_fail(r, q);
    if (!q) continue;
    w->l[i].leaving = 0;
    w->n_leaving--;
    live_sub(r, w->bytes);
  }
  return 0;
}

/* The compute stream waited d µs from a for block i's weights: a reload
 * stall, on the timeline and the block's row. */
static void w_waited(replay *r, int32_t i, double a, double d) {
  int32_t layer = r->w->first + i;
  r->w->stall += d;
  if (r->last) r->res->layers[layer + 1].stall_us += d;
  if (!r->recording) return;
  sim_timeline *tl = &r->res->tl;
  if (tl->n_waits == tl->cap_waits) {
    sim_wait *p = realloc(tl->waits, grown(tl->cap_waits) * sizeof *p);
    if (!p) return;
    tl->waits = p;
    tl->cap_waits = grown(tl->cap_waits);
  }
  tl->waits[tl->n_waits++] = (sim_wait){a, a + d, SIM_WAIT_RELOAD, layer};
}

/* Block i's weights onto the device (a reload from now on, unless there),
 * and with `wait` the compute waits for them. */
static int w_load(replay *r, int32_t i, int wait) {
  weight_model *w = r->w;
  w_layer *x = &w->l[i];
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if (!x->on) {
    if ((rc = b->ops->event_record(b, w->now_ev, NULL)) ||
        (rc = b->ops->stream_wait_event(b, w->lane, w->now_ev)))
      return w_backend_fail(r, rc);
    if ((rc = ferry_resident_to_device(x->buf, w->dev + i, w->lane)))
      return w_fail(r, rc, "weights to the device");
    if ((rc = b->ops->event_record(b, x->h2d, engine_h2d_stream(r->e))))
      return w_backend_fail(r, rc);
    live_add(r, w->bytes); /* the reload's destination is allocated now */
    x->on = x->loading = 1;
    w->h2d += (double)w->bytes;
  }
  if (wait && x->loading) {
    double a = replay_now(r);
    if ((rc = b->ops->stream_wait_event(b, NULL, x->h2d))) return w_backend_fail(r, rc);
    x->loading = 0;
    double d = replay_now(r) - a;
    if (d > 0) w_waited(r, i, a, d);
  }
  return 0;
}

/* Block i's weights to the host after the compute so far; its device copy
 * is freed when the copy completes (w_poll). */
static int w_offload(replay *r, int32_t i) {
  weight_model *w = r->w;
  w_layer *x = &w->l[i];
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if (!x->on) return 0;
  if ((rc = w_load(r, i, 1))) return rc; /* its reload first (offload_weights' wait()) */
  if ((rc = w_poll(r))) return rc;
  if (x->leaving) { /* the previous offload still copying: the host waits for it */
    if ((rc = b->ops->event_synchronize(b, x->d2h))) return w_backend_fail(r, rc);
    if ((rc = w_poll(r))) return rc;
  }
  if ((rc = ferry_resident_to_host(x->buf, w->dev + i, NULL)))
    return w_fail(r, rc, "weights to the host");
  if ((rc = b->ops->event_record(b, x->d2h, engine_d2h_stream(r->e)))) return w_backend_fail(r, rc);
  x->on = 0;
  x->leaving = 1;
  w->n_leaving++;
  w->d2h += (double)w->bytes;
  return 0;
}

/* A block's pre-forward (dir +1) or pre-backward (dir -1) hook: its weights
 * on the device and waited for; double-buffered, its neighbour's reload
 * (the next chosen block in forward, the previous in backward) issued. */
static int w_hook(replay *r, int32_t i, int dir) {
  int rc = w_poll(r);
  if (!rc) rc = w_load(r, i, 1);
  if (!rc && r->w->dbl && i + dir >= 0 && i + dir < r->w->count) rc = w_load(r, i + dir, 0);
  return rc;
}

/* Before event k's compute, in phase (0 forward, 1 backward). */
int w_before_gap(replay *r, uint32_t k, int phase) {
  weight_model *w = r->w;
  int32_t i = w_index(r, &r->t->events[k]);
  if (i < 0) return 0;
  if (phase == 0 && w->fwd_first[i] == (int64_t)k) return w_hook(r, i, +1);
  if (phase == 1 && w->bwd_first[i] == (int64_t)k && !w->bwd_after_gap[i]) return w_hook(r, i, -1);
  return 0;
}

/* After event k's compute, before the event: completed offloads free their
 * bytes before anything is allocated; a backward hook on a tensor event. */
int w_before_event(replay *r, uint32_t k, int phase) {
  weight_model *w = r->w;
  int rc = w_poll(r);
  if (rc) return rc;
  int32_t i = w_index(r, &r->t->events[k]);
  if (i >= 0 && phase == 1 && w->bwd_first[i] == (int64_t)k && w->bwd_after_gap[i])
    return w_hook(r, i, -1);
  return 0;
}

/* After event k: the end of a chosen block's forward offloads its weights. */
int w_after_event(replay *r, uint32_t k, int phase) {
  int32_t i = w_index(r, &r->t->events[k]);
  if (i >= 0 && phase == 0 && r->w->fwd_last[i] == (int64_t)k) return w_offload(r, i);
  return 0;
}
