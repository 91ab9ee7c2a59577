/*
 * replay_opt.c — optimizer-state offload in a replay (docs/sim-model.md,
 * "Optimizer-state offload").
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/replay_internal.h"

/* ---- optimizer-state offload (opt_model above) ------------------------------------ */

/* The compute before ev as event_gap times it, without counting it. */
double gap_of(const replay *r, const trace_ev *ev) {
  if (timed_from_work(r, ev)) return work_us(r, ev);
  return ev->gap_us > 0 ? ev->gap_us : 0;
}

/* The trace's resident entry named what, or NULL. */
const trace_resident *resident_named(const sim_trace *t, const char *what) {
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, what)) return &t->resident[i];
  return NULL;
}

/* A share of x bytes, rounded to the byte. */
static uint64_t share_of(double f, uint64_t x) { return (uint64_t)(f * (double)x + 0.5); }

/* The device bytes of a transient allocation: the optimizer step's own
 * ("optimizer: ..." allocs, foreach AdamW's intermediates) shrink to the
 * device's share of the step when the host steps the rest. */
uint64_t opt_alloc_bytes(const replay *r, const trace_alloc *a) {
  if (!r->opt || strncmp(a->what, "optimizer:", 10)) return a->bytes;
  return share_of(1 - r->opt->fraction, a->bytes);
}

/* The engine's last error as the replay's, naming the optimizer offload. */
static int opt_fail(replay *r, int rc, const char *what) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: optimizer offload: %s: %s", r->res->label, what,
                      ferry_last_error(r->e));
}

/* A resident buffer of bytes (none for 0). */
static int opt_buffer(replay *r, uint64_t bytes, ferry_resident **out) {
  *out = NULL;
  if (!bytes) return 0;
  int rc = ferry_resident_create(r->e, bytes, out);
  return rc ? opt_fail(r, rc, "a host buffer") : 0;
}

/* Validates the settings and, for a share > 0, takes the share's states off
 * the device, pins the host buffers and sizes the host step. */
int opt_open(replay *r) {
  const sim_config *c = r->c;
  const sim_trace *t = r->t;
  sim_result *out = r->res;
  double f = c->optimizer_fraction;
  r->resident = t->resident_bytes + c->untracked_bytes;
  r->gap_scale = 1;
  if (!(f >= 0 && f <= 1))
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "optimizer fraction %g must be within 0..1", f);
  if (!(c->cpu_adam_params_per_s >= 0) || !isfinite(c->cpu_adam_params_per_s))
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "CPU Adam rate %g must be > 0 parameters/s (0: the default)",
                        c->cpu_adam_params_per_s);
  if (f == 0) return 0;
  if (!r->sim)
    return ferry_errbuf(r->err, r->errlen, FERRY_EUNSUPPORTED,
                        "optimizer offload is modeled on the sim backend only");
  const trace_resident *params = resident_named(t, "parameters");
  const trace_resident *grads = resident_named(t, "gradients");
  const trace_resident *states = resident_named(t, "optimizer states");
  const trace_resident *masters = resident_named(t, "master weights");
  if (!params || !grads || !states)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: optimizer offload needs the trace's resident memory named "
                        "\"parameters\", \"gradients\" and \"optimizer states\" (%s missing; "
                        "ferry_trace_resident declares them, synthesized traces have them)",
                        t->name, !params ? "\"parameters\"" : !grads ? "\"gradients\""
                                                                  : "\"optimizer states\"");
  opt_model *o = calloc(1, sizeof *o);
  if (!o) return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  r->opt = o;
  o->fraction = f;
  /* the parameters' element size: their resident line's dtype, else the
   * trace's parameter packs', else bf16 */
  int elem = params->dtype ? ferry_dtype_size(params->dtype) : 0;
  for (uint32_t i = 0; i < t->n_tensors && !elem; i++)
    if (t->tensors[i].desc.kind == FERRY_KIND_PARAMETER)
      elem = ferry_dtype_size(t->tensors[i].desc.dtype);
  if (elem <= 0) elem = 2;
  double rate = c->cpu_adam_params_per_s > 0 ? c->cpu_adam_params_per_s : SIM_DEFAULT_CPU_ADAM;
  out->opt_fraction = f;
  out->opt_params = f * (double)params->bytes / elem;
  out->opt_cpu_adam_params_per_s = rate;
  out->opt_serial = c->optimizer_serial != 0;
  o->cpu_us = out->opt_params / rate * 1e6;
  out->opt_device_bytes = share_of(f, states->bytes + (masters ? masters->bytes : 0));
  r->resident -= out->opt_device_bytes;
  uint64_t gbytes = share_of(f, grads->bytes), pbytes = share_of(f, params->bytes);
  out->opt_host_bytes = out->opt_device_bytes + gbytes + pbytes;
  o->k = t->layers > 0 ? (uint32_t)(t->layers < 1023 ? t->layers + 1 : 1024) : 1;
  o->grad = calloc(o->k, sizeof *o->grad);
  o->param = calloc(o->k, sizeof *o->param);
  o->pending = calloc(o->k, 1);
  o->dev = malloc(2 * (size_t)o->k);
  o->fwd_us = calloc(t->n_steps ? t->n_steps : 1, sizeof *o->fwd_us);
  o->bwd_us = calloc(t->n_steps ? t->n_steps : 1, sizeof *o->bwd_us);
  if (!o->grad || !o->param || !o->pending || !o->dev || !o->fwd_us || !o->bwd_us)
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  int rc = opt_buffer(r, out->opt_device_bytes, &o->state);
  for (uint32_t j = 0; j < o->k && !rc; j++) {
    uint64_t g = gbytes / o->k + (j + 1 == o->k ? gbytes % o->k : 0);
    uint64_t p = pbytes / o->k + (j + 1 == o->k ? pbytes % o->k : 0);
    if (!(rc = opt_buffer(r, g, &o->grad[j]))) rc = opt_buffer(r, p, &o->param[j]);
  }
  if (rc) return rc;
  ferry_backend *b = engine_backend(r->e);
  if ((rc = b->ops->stream_create(b, &o->lane)) || (rc = b->ops->event_create(b, &o->now_ev)))
    return ferry_errbuf(r->err, r->errlen, rc, "optimizer offload: %s", b->err);
  /* each trace step's forward and backward compute: the layers' shares */
  for (uint32_t s = 0; s < t->n_steps; s++) {
    int phase = 0;
    for (uint32_t k = t->steps[s].first; k < t->steps[s].end; k++) {
      const trace_ev *ev = &t->events[k];
      if (phase == 0) o->fwd_us[s] += gap_of(r, ev);
      else if (phase == 1) o->bwd_us[s] += gap_of(r, ev);
      if (ev->type == TEV_BACKWARD_BEGIN) phase = 1;
      else if (ev->type == TEV_BACKWARD_END) phase = 2;
    }
  }
  return 0;
}

void opt_close(replay *r) {
  opt_model *o = r->opt;
  if (!o) return;
  for (uint32_t j = 0; j < o->k; j++) {
    if (o->grad && o->grad[j]) ferry_resident_destroy(o->grad[j]);
    if (o->param && o->param[j]) ferry_resident_destroy(o->param[j]);
  }
  if (o->state) ferry_resident_destroy(o->state);
  ferry_backend *b = r->e ? engine_backend(r->e) : NULL;
  if (b && o->now_ev) b->ops->event_destroy(b, o->now_ev);
  if (b && o->lane) b->ops->stream_destroy(b, o->lane);
  free(o->grad);
  free(o->param);
  free(o->pending);
  free(o->dev);
  free(o->fwd_us);
  free(o->bwd_us);
  free(o);
  r->opt = NULL;
}

/* The host waits for buffer x's last copy; the wait is the optimizer's. */
static int opt_wait(replay *r, ferry_resident *x) {
  double a = replay_now(r);
  int rc = ferry_resident_wait(x);
  if (rc) return opt_fail(r, rc, "waiting for a copy");
  double d = replay_now(r) - a;
  r->opt->stall += d;
  r->opt->host_wait += d;
  return 0;
}

/* Chunk j's gradients D2H, after the compute so far (the hook's copy). */
static int opt_grad(replay *r, uint32_t j) {
  opt_model *o = r->opt;
  int rc = o->grad[j] ? ferry_resident_to_host(o->grad[j], o->dev + j, NULL) : 0;
  return rc ? opt_fail(r, rc, "gradients to the host") : 0;
}

/* Chunk j's updated parameters H2D from now on, without the compute stream
 * waiting for them (it does so when the forward needs them). */
static int opt_param(replay *r, uint32_t j) {
  opt_model *o = r->opt;
  if (!o->param[j]) return 0;
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if ((rc = b->ops->event_record(b, o->now_ev, NULL)) ||
      (rc = b->ops->stream_wait_event(b, o->lane, o->now_ev)))
    return ferry_errbuf(r->err, r->errlen, rc, "optimizer offload: %s", b->err);
  if ((rc = ferry_resident_to_device(o->param[j], o->dev + o->k + j, o->lane)))
    return opt_fail(r, rc, "parameters to the device");
  o->pending[j] = 1;
  return 0;
}

/* Before `gap` µs of forward compute, `done` µs into this step's `total`:
 * the parameters of the chunks it reaches must be on the device. */
int opt_forward(replay *r, double done, double gap, double total) {
  opt_model *o = r->opt;
  for (uint32_t j = 0; j < o->k; j++) {
    if (!o->pending[j]) continue;
    if ((double)j * total / o->k >= done + gap - 1e-9 * total) break;
    o->pending[j] = 0;
    int rc = opt_wait(r, o->param[j]);
    if (rc) return rc;
  }
  return 0;
}

/* Every parameter chunk still pending, waited for. */
int opt_params_all(replay *r) {
  for (uint32_t j = 0; j < r->opt->k; j++)
    if (r->opt->pending[j]) {
      r->opt->pending[j] = 0;
      int rc = opt_wait(r, r->opt->param[j]);
      if (rc) return rc;
    }
  return 0;
}

/* `done` µs into this step's backward of `total`: the chunks whose share of
 * backward has passed have their gradients; they go to the host. */
int opt_backward(replay *r, double done, double total) {
  opt_model *o = r->opt;
  while (o->grads_issued < o->k &&
         (double)(o->grads_issued + 1) * total / o->k <= done + 1e-9 * total) {
    int rc = opt_grad(r, o->grads_issued++);
    if (rc) return rc;
  }
  return 0;
}

/* step(): the remaining gradients go, the host waits for all of them, and
 * the host step starts (serial: runs now, before the device's). */
int opt_sync(replay *r) {
  opt_model *o = r->opt;
  int rc;
  while (o->grads_issued < o->k)
    if ((rc = opt_grad(r, o->grads_issued++))) return rc;
  for (uint32_t j = 0; j < o->k; j++)
    if (o->grad[j] && (rc = opt_wait(r, o->grad[j]))) return rc;
  o->synced = 1;
  if (r->c->optimizer_serial) {
    replay_compute(r, o->cpu_us);
    o->stall += o->cpu_us;
  } else {
    o->cpu_end = replay_now(r) + o->cpu_us;
  }
  return 0;
}

/* At step_end: step() returns once the host step is done; serial, the
 * updated parameters are on the device before the step ends. */
int opt_step_end(replay *r) {
  opt_model *o = r->opt;
  int rc;
  if ((rc = opt_params_all(r))) return rc; /* a step without backward_begin */
  if (!o->synced && (rc = opt_sync(r))) return rc;
  if (!r->c->optimizer_serial) {
    double d = o->cpu_end - replay_now(r);
    if (d > 0) {
      replay_compute(r, d);
      o->stall += d;
    }
    return 0;
  }
  for (uint32_t j = 0; j < o->k; j++)
    if ((rc = opt_param(r, j))) return rc;
  return opt_params_all(r);
}

/* After step_end (overlapped): the updated parameters start for the next
 * forward. */
int opt_after_step(replay *r) {
  int rc = 0;
  if (!r->c->optimizer_serial)
    for (uint32_t j = 0; j < r->opt->k && !rc; j++) rc = opt_param(r, j);
  return rc;
}
