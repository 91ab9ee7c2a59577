/*
 * replay_result.c — a replay's result: the link floor under its stalls,
 * the steady steps' means and where its compute times come from.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/replay_internal.h"

void floor_compute(link_floor *f, double us) {
  if (f->in_backward) f->bwd_compute += us;
  else if (f->offloaded > 0) f->fwd_compute += us;
}

/* After a pack, unpack or discard of a tensor of bytes: counted (it takes
 * device memory of its own), out (offloaded when it was packed), reloaded
 * (an unpack that copied it back; a stash hit does not). */
void floor_tensor(link_floor *f, int type, int out, int reloaded, int counted,
                         double bytes) {
  if (type == TEV_PACK && out) {
    if (!f->in_backward) f->offloaded += bytes; /* (backward's own offloads: not counted) */
  } else if (counted && !out) {
    f->kept += type == TEV_PACK ? bytes : -bytes;
  }
  double fast = f->d2h_per_us > f->h2d_per_us ? f->d2h_per_us : f->h2d_per_us;
  if (f->in_backward && type == TEV_UNPACK && out) f->bwd_out_unpacks++;
  if (type == TEV_PACK && f->offloaded > 0 && f->d2h_per_us > 0 && !f->no_instant) {
    double b = (f->offloaded + f->kept) / f->d2h_per_us - f->fwd_compute - f->bwd_compute;
    double *bound = f->in_backward ? &f->late_bound : &f->fwd_bound;
    if (b > *bound) *bound = b;
    /* less the reloads before x: their copies took link time before x,
     * but none of the stall this anchor's pack bound (floor_us) */
    double a = b + f->bwd_compute - f->h2d_bytes / fast;
    if (f->in_backward && a > f->late_anchor) f->late_anchor = a;
  }
  if (f->in_backward && type == TEV_UNPACK && reloaded && f->h2d_per_us > 0) {
    f->h2d_bytes += bytes;
    double b = f->h2d_bytes / f->h2d_per_us - f->bwd_compute;
    if (b > f->h2d_bound) f->h2d_bound = b;
    double c = f->late_anchor + f->h2d_bytes / fast - f->bwd_compute;
    if (c > f->late_reload) f->late_reload = c;
  }
}

/* Forward's stall and backward's reload stall happen at different times and
 * add up. At a backward instant x the offloads not yet copied plus the
 * reloads made but not yet unpacked (R, prefetches) fit under the peak, so
 * the stall before x is at least late(x) + R / d2h link; the reloads after
 * x up to an unpack u, what the unpacks between x and u need less R, take
 * the stall after x beyond the compute between them. Added, R drops out
 * with both links at the faster one's speed: late(x) + (reloads unpacked
 * between x and u) / faster link - compute between them bounds the total
 * too. Reloads unpacked before x are in neither term: the room they took
 * was given back before x. */
double floor_us(const link_floor *f, double peak) {
  if (f->d2h_per_us <= 0) return f->h2d_bound > 0 ? f->h2d_bound : 0;
  double fwd = f->fwd_bound - peak / f->d2h_per_us;
  double late = f->late_bound - peak / f->d2h_per_us;
  double late_r = f->late_reload - peak / f->d2h_per_us;
  double sum = (fwd > 0 ? fwd : 0) + (f->h2d_bound > 0 ? f->h2d_bound : 0);
  if (late_r > late) late = late_r;
  return sum > late ? sum : late;
}

/* Adds a steady step's time, stall and engine counters to the sums. */
void add_step(step_sums *s, double step_us, double stall, double wait, const ferry_stats *s0,
                     const ferry_stats *s1) {
  s->n_steady++;
  s->step += step_us;
  s->stall += stall;
  s->wait += wait;
  s->d2h += (double)(s1->bytes_d2h - s0->bytes_d2h);
  s->h2d += (double)(s1->bytes_h2d - s0->bytes_h2d);
  s->packed += (double)(s1->tensors_packed - s0->tensors_packed);
  s->off += (double)(s1->tensors_offloaded - s0->tensors_offloaded);
  s->kept += (double)(s1->tensors_kept - s0->tensors_kept);
  s->pf += (double)(s1->prefetches - s0->prefetches);
  s->hits += (double)(s1->stash_hits - s0->stash_hits);
}

/* Says where the compute times come from, plainly when they are not the
 * simulated GPU's. */
static void compute_note(replay *r) {
  sim_result *out = r->res;
  const sim_trace *t = r->t;
  const char *where = t->backend[0] ? t->backend : "unknown";
  double bw = r->c->hbm_bytes_per_s > 0 ? r->c->hbm_bytes_per_s : SIM_DEFAULT_HBM_BYTES_PER_S;
  if (out->gaps_as_recorded == 0 && out->gaps_from_flops > 0 && t->n_hbm > 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "each op timed on the simulated GPU (roofline): its FLOPs at %.1f TFLOP/s, its "
             "bytes at %.0f GB/s of device memory", r->c->tflops, bw / 1e9);
  else if (out->gaps_as_recorded == 0 && out->gaps_from_flops > 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute timed from the trace's FLOPs at %.0f TFLOP/s", r->c->tflops);
  else if (t->has_compute && out->gaps_from_flops == 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute times as synthesized (the synthesizer's --tflops and --hbm: no GPU speed "
             "given)");
  else if (out->gaps_from_flops == 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute times are the recording machine's (backend %s), not the simulated GPU's: "
             "the trace has no FLOPs%s", where,
             !strcmp(where, "host") ? "; recorded on a CPU, so step times and overheads are "
                                      "not this GPU's" : "");
  else
    snprintf(out->compute_note, sizeof out->compute_note,
             "%u compute gaps timed from FLOPs at %.0f TFLOP/s, %u as recorded (backend %s)",
             out->gaps_from_flops, r->c->tflops, out->gaps_as_recorded, where);
}

/* The steady steps: after the warmup ones and after the last step in which
 * the pinned arena grew (its pinning is paid once, so a mean over such a
 * step depends on how many steps were replayed); all steps with warmup < 0
 * (counted from the first) or when fewer steps than warmup ran. If the arena
 * grew in the last step, that step alone is counted and the result says the
 * arena still grew. Sums them into *s. */
void steady_sums(replay *r, uint32_t steps, step_sums *s) {
  sim_result *out = r->res;
  memset(s, 0, sizeof *s);
  uint32_t from = steps <= r->warmup ? 0 : r->warmup;
  for (uint32_t i = 0; i < steps; i++)
    if (r->per_step[i].grew) out->arena_grew_step = i + 1;
  if (r->c->warmup >= 0 && out->arena_grew_step > from) from = out->arena_grew_step;
  if (from >= steps) {
    from = steps - 1;
    out->arena_still_growing = 1;
  }
  out->steady_from = from + 1;
  for (uint32_t i = from; i < steps; i++) {
    const step_sums *p = &r->per_step[i];
    s->n_steady++;
    s->step += p->step, s->stall += p->stall, s->wait += p->wait, s->d2h += p->d2h;
    s->h2d += p->h2d, s->packed += p->packed, s->off += p->off, s->kept += p->kept;
    s->pf += p->pf, s->hits += p->hits, s->pinned += p->pinned, s->floor += p->floor;
    s->contention += p->contention;
    s->host_bound += p->host_bound;
    s->opt_d2h += p->opt_d2h, s->opt_h2d += p->opt_h2d, s->opt_stall += p->opt_stall;
    s->w_d2h += p->w_d2h, s->w_h2d += p->w_h2d, s->w_stall += p->w_stall;
    s->comm_n += p->comm_n, s->comm_bytes += p->comm_bytes, s->comm_us += p->comm_us;
    s->comm_exposed += p->comm_exposed;
    if (p->peak > r->peak_steady) r->peak_steady = p->peak;
  }
}

/* The result: the steady steps' means, peaks, and the engine's counters. */
void finish_result(replay *r, const step_sums *s) {
  sim_result *out = r->res;
  double n = s->n_steady ? s->n_steady : 1;
  out->step_us = s->step / n;
  out->stall_us = s->stall / n;
  out->host_wait_us = s->wait / n;
  out->bytes_d2h = s->d2h / n;
  out->bytes_h2d = s->h2d / n;
  out->tensors_packed = s->packed / n;
  out->tensors_offloaded = s->off / n;
  out->tensors_kept = s->kept / n;
  out->prefetches = s->pf / n;
  out->stash_hits = s->hits / n;
  out->pinned_alloc_us = s->pinned / n;
  out->contention_us = s->contention / n;
  out->host_bound_us = s->host_bound / n;
  out->stall_floor_us = s->floor / n;
  if (r->opt) {
    out->opt_bytes_d2h = s->opt_d2h / n;
    out->opt_bytes_h2d = s->opt_h2d / n;
    out->opt_stall_us = s->opt_stall / n;
    out->opt_cpu_us = r->opt->cpu_us;
  }
  if (r->w) {
    out->w_bytes_d2h = s->w_d2h / n;
    out->w_bytes_h2d = s->w_h2d / n;
    out->w_stall_us = s->w_stall / n;
  }
  out->comm_count = s->comm_n / n;
  out->comm_bytes = s->comm_bytes / n;
  out->comm_us = s->comm_us / n;
  out->comm_exposed_us = s->comm_exposed / n;
  compute_note(r);
  out->warmup = r->warmup;
  out->peak_saved_bytes = r->peak_steady;
  out->peak_device_bytes = r->resident + r->peak_steady;
  out->first_step_peak_device_bytes = r->resident + r->peak_first;
  ferry_stats fs;
  ferry_get_stats(r->e, &fs, sizeof fs);
  out->peak_host_bytes = fs.arena_peak;
  out->host_reserved_bytes = fs.arena_reserved;
  out->policy_errors = fs.policy_errors;
  out->policy_calls = fs.policy_calls;
  out->policy_cache_hits = fs.policy_cache_hits;
  out->cap_fallbacks = fs.cap_fallbacks;
  snprintf(out->policy_error, sizeof out->policy_error, "%s", ferry_last_policy_error(r->e));
}

const char *sim_peak_phase_name(int phase) {
  switch (phase) {
  case SIM_PEAK_FORWARD: return "forward";
  case SIM_PEAK_BACKWARD: return "backward";
  case SIM_PEAK_OPTIMIZER: return "optimizer step";
  default: return "step start";
  }
}

/* Names the last step's peak: the phase it fell in, what raised it, and
 * the compute it is there for: for an alloc or an unpack the next compute
 * event (they come just before the op that uses them); for a pack, the
 * tensor's own layer and the compute before it in that layer (a
 * synthesized op's packs follow its compute event). */
void peak_where(replay *r) {
  sim_result *out = r->res;
  const sim_trace *t = r->t;
  out->peak_phase = SIM_PEAK_NONE;
  out->peak_layer = -1;
  out->peak_op[0] = out->peak_what[0] = 0;
  if (r->peak_ev == UINT32_MAX || r->peak_ev >= t->n_events) return;
  const trace_ev *ev = &t->events[r->peak_ev];
  out->peak_phase = r->peak_phase == 0 ? SIM_PEAK_FORWARD : r->peak_phase == 1 ? SIM_PEAK_BACKWARD
                                                                                : SIM_PEAK_OPTIMIZER;
  const char *what = NULL;
  if (ev->type == TEV_ALLOC) what = t->allocs[ev->tensor].what;
  else if (ev->type == TEV_PACK) {
    what = t->tensors[ev->tensor].desc.module_path;
    out->peak_layer = t->tensors[ev->tensor].desc.layer;
  }
  snprintf(out->peak_what, sizeof out->peak_what, "%s", what ? what : "");
  if (ev->type == TEV_PACK) {
    for (uint32_t k = r->peak_ev; k-- > 0 && t->events[k].type != TEV_STEP_BEGIN;)
      if (t->events[k].type == TEV_COMPUTE) {
        if (t->events[k].layer == out->peak_layer)
          snprintf(out->peak_op, sizeof out->peak_op, "%s", t->events[k].op ? t->events[k].op : "");
        break;
      }
    return;
  }
  for (uint32_t k = r->peak_ev; k < t->n_events && t->events[k].type != TEV_STEP_END; k++)
    if (t->events[k].type == TEV_COMPUTE) {
      out->peak_layer = t->events[k].layer;
      snprintf(out->peak_op, sizeof out->peak_op, "%s", t->events[k].op ? t->events[k].op : "");
      break;
    }
}
