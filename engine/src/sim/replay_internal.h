/*
 * replay_internal.h — what the replayer's files share: the replay's state
 * (replayer.c: the engine driver and steps; replay_engine.c: the device
 * buffers, callbacks and engine it drives), optimizer-state offload
 * (replay_opt.c), weight offload (replay_weights.c) and the result with its
 * link floor (replay_result.c); docs/internals.md.
 */
#ifndef FERRY_REPLAY_INTERNAL_H
#define FERRY_REPLAY_INTERNAL_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/errbuf.h"
#include "ferry_tools.h"
#include "core/core.h"
#include "util/u64map.h"
#include "util/util.h"


/* A device buffer of the replayed trainer; the owner token handed to ferry.
 * On the sim backend it has no memory (its address is the device pointer);
 * on the host backend it has real bytes, checked on every unpack. */
typedef struct sim_buf {
  uint64_t bytes;
  uint32_t refs;
  uint8_t counted; /* adds to device memory (not a parameter/buffer's own) */
  uint8_t *mem;
  struct sim_buf *next_free;
} sim_buf;

#define BUF_SLAB 1024

/* Optimizer-state offload (sim_config.optimizer_fraction; docs/sim-model.md,
 * "Optimizer-state offload"): what ferry.torch.offload_optimizer does per
 * step, through the engine's resident buffers, on the engine's streams:
 *  - backward: the share's gradients go D2H a layer's worth at a time as
 *    backward passes that share of its compute (post-accumulate hooks);
 *  - step(): the host waits for them, then steps the share for
 *    params / cpu_adam while the device steps the rest (the compute after
 *    backward_end, scaled by 1 - fraction), and step() returns when both
 *    are done (serial: the host step first, then the device's);
 *  - the updated parameters go H2D after it, a layer's worth at a time;
 *    the next forward waits for each before the compute that needs it
 *    (serial: all are waited for before the step ends).
 * The share's optimizer states leave the device's resident memory. */
typedef struct opt_model {
  double fraction;
  uint32_t k;                    /* chunks: about a layer's parameters each */
  ferry_resident *state;         /* the share's optimizer states (host only) */
  ferry_resident **grad, **param; /* per chunk; NULL for a 0-byte chunk */
  char *dev;                     /* fake device addresses: grad j at dev + j,
                                    param j at dev + k + j (never touched) */
  bk_stream lane;                /* orders the H2D copies after `now` */
  bk_event *now_ev;
  double cpu_us;                 /* the host step */
  double *fwd_us, *bwd_us;       /* per trace step: forward, backward compute */
  uint8_t *pending;              /* per chunk: its H2D not waited for yet */
  uint32_t grads_issued;         /* this step */
  int synced;                    /* step() reached this step */
  double cpu_end;                /* when the host step ends (overlapped) */
  double stall, host_wait;       /* this step: exposed; of it, host waits */
} opt_model;

/* Weight offload (sim_config.weight_count; docs/sim-model.md, "Weight
 * offload"): what ferry.torch.offload_weights does, through the engine's
 * resident buffers on its D2H and H2D streams, for the blocks first ..
 * first + count - 1, each `bytes` of weights:
 *  - after a block's forward (its last event of forward) its weights go D2H
 *    after the compute so far; the device bytes are freed when the copy
 *    completes;
 *  - before its backward (its first event of backward: before that event's
 *    compute when it is a compute event of the block, else right before the
 *    event) they come back H2D and the compute waits for them; double
 *    buffered, the previous chosen block's reload is issued then too, behind
 *    it on the H2D stream;
 *  - after backward they stay until the block's next forward ends; a block
 *    not on the device at its forward (step 1: offload_weights starts with
 *    every chosen block on the host) is reloaded before it, the next chosen
 *    block's reload issued behind it when double-buffered.
 * The chosen blocks' weights leave resident memory and count with the live
 * bytes while on the device, from a reload's issue to an offload's end. */
typedef struct w_layer {
  ferry_resident *buf;   /* the block's host copy */
  bk_event *d2h, *h2d;   /* recorded after its last offload, its last reload */
  uint8_t on;            /* its device copy is allocated (in live_bytes) */
  uint8_t loading;       /* a reload the compute has not waited for yet */
  uint8_t leaving;       /* an offload whose end frees the old device copy */
} w_layer;

typedef struct weight_model {
  int32_t first, count;  /* the chosen blocks */
  uint64_t bytes;        /* each one's weights */
  int dbl;               /* double-buffered */
  w_layer *l;            /* count entries */
  char *dev;             /* fake device addresses: block first + i at dev + i */
  bk_stream lane;        /* orders the H2D copies after `now` */
  bk_event *now_ev;
  uint32_t n_leaving;
  /* this trace step's events, per chosen block (-1: none): the first and
   * last of forward, the first of backward and whether that one is a
   * tensor event (its compute is the previous op's: the hook comes after it) */
  int64_t *fwd_first, *fwd_last, *bwd_first;
  uint8_t *bwd_after_gap;
  uint32_t table_step;   /* the trace step the tables are for, + 1 (0: none) */
  double stall, d2h, h2d; /* this step: exposed waits, bytes each way */
} weight_model;

/* The communication lanes (replay_comm.c; docs/sim-model.md,
 * "Collectives"): per group (SIM_GROUP_*) a queue of issued collectives,
 * the head's wire bytes left; per collective when it ended (-1: not yet);
 * running sums for the steps. */
typedef struct comm_lane {
  uint32_t *q, head, n;
  double left;
} comm_lane;

typedef struct comm_model {
  comm_lane lane[2];
  double *done;
  double t;                          /* the lanes have run up to here */
  double count, bytes, busy_us, exposed_us; /* so far */
} comm_model;

typedef struct replay {
  const sim_trace *t;
  const sim_config *c;
  ferry_engine *e;
  ferry_backend *sim; /* NULL on the host backend */
  double host_t0_us, host_scale;
  double host_excluded_us; /* wall time spent filling and checking buffers */
  ferry_handle *handles;
  sim_buf **bufs;       /* per tensor, while packed */
  /* unpacked buffers the op's backward still reads: autograd releases a
   * saved tensor after the node's backward ran, so they are let go after
   * the next compute */
  sim_buf **pending;
  uint32_t n_pending, cap_pending;
  sim_buf **slabs;
  uint32_t n_slabs;
  sim_buf *free_bufs;
  uint64_t live_bytes, peak_live;
  uint64_t peak_steady, peak_first; /* over the steady steps; over step 1 */
  uint64_t step_peak;   /* over the step being replayed */
  int first;            /* replaying step 1 */
  struct step_sums *per_step; /* [steps]: each step's sums, chosen from at the end */
  uint32_t warmup;
  double pinned_us;     /* pinning cost so far (sim) */
  int recording;
  sim_result *res;
  int alloc_failed;
  int bad_bytes;        /* host backend: an unpack gave different bytes */
  int host;             /* on the host backend */
  int last;             /* replaying the last step: it fills the layer rows */
  int32_t cur_layer;    /* the layer of the latest pack or unpack */
  double host_stall, host_wait; /* host backend: wall time inside ferry */
  char *err;            /* the caller's error buffer */
  size_t errlen;
  int err_written;      /* err holds the message already (not an engine error) */
  /* recording: which tensor a copy moves, and which offload a reload undoes */
  u64map dev_tensor;    /* a packed buffer's address -> tensor index + 1 */
  u64map host_offload;  /* an offload's host address -> its interval index + 1 */
  uint8_t *went;        /* per tensor: offloaded when packed; once unpacked, reloaded */
  uint64_t offloaded;   /* the engine's tensors_offloaded after the last ferry_pack */
  uint64_t resident;    /* the trace's resident bytes less what the optimizer offload frees */
  double gap_scale;     /* compute multiplier (the device's share of the optimizer step) */
  int mem_bound;        /* the compute being replayed is a memory-bound kernel (contention) */
  /* sim: the host's own timeline (docs/sim-model.md, "The host's lead"):
   * where the trainer's thread is, which runs ahead of the GPU's `now`
   * while the GPU has work queued; and the GPU's time idle waiting for it
   * so far */
  double host_clock, host_bound_us;
  /* the host's cost per saved tensor: sim_config.host_overhead_us with
   * ferry's hooks in place (a policy, recorded decisions), 0 for the
   * baseline, which trains without them */
  double host_overhead_us;
  opt_model *opt;       /* optimizer-state offload, NULL when off */
  weight_model *w;      /* weight offload, NULL when off */
  /* where the last step's peak fell (peak_where): the event being replayed
   * and its phase (0 forward, 1 backward, 2 after backward_end); the event
   * at the peak (UINT32_MAX: none rose above the step's start) */
  uint32_t cur_ev, peak_ev;
  int cur_phase, peak_phase;
  comm_model *comm;     /* collectives, NULL when the trace has none */
  /* the policy's one_copy_stream knob: the stash's reloads run on the
   * offloads' stream, and the timeline draws them there */
  int one_copy_stream;
} replay;

/* The least exposed stall any schedule of a step's copies could have with
 * the link at full speed, the engine's way: reloads start when backward
 * begins (reloading earlier would raise the peak the offloads lowered).
 *  - forward: at each pack the saved bytes on device, kept (K) plus
 *    offloaded (D) less those copied, are at most the step's peak P, so
 *    D + K - P bytes were copied within the compute since the first offload;
 *  - the same holds at backward's packs and at its transient allocations
 *    until it unpacks an offloaded tensor (the loss's gradients, where a step
 *    with offloading peaks): offloads still in flight when backward begins
 *    are on the device there, reloads not counted;
 *  - backward: the reloads a prefix of backward's unpacks needs (stash hits
 *    need none) arrive within the backward compute before the last of them.
 * A real schedule adds queueing, latency per copy, the duplex slowdown and
 * the stash bounds to it. */
typedef struct link_floor {
  double h2d_per_us, d2h_per_us;
  int in_backward;
  /* µs the GPU was not stalled on the offloads (compute, its waits for the
   * host or collectives: the link copies on): since the first offload;
   * since backward began */
  double fwd_compute, bwd_compute;
  double offloaded, kept;          /* forward bytes: offloaded; kept and still held */
  double fwd_bound;                /* max over forward packs of (D + K) / link - compute */
  double h2d_bytes, h2d_bound;     /* reloaded so far; max over unpacks */
  double late_bound;               /* max over backward's packs and allocations of
                                    * (D + K) / link - compute since the first offload */
  /* the same instants x with the reloads after them (floor_us): the max over
   * x of bound + backward compute by x - reloads by x / the faster link
   * (-inf before the first x), and the max over unpacks u of that + reloads
   * by u / the faster link - backward compute by u */
  double late_anchor, late_reload;
  /* backward's unpacks of offloaded tensors so far, and whether the tensor
   * now counted is an allocation after them: from there on a block's
   * gradients come and go beside reloaded and stash-held buffers, whose
   * bytes the bound cannot place, so such allocations count in K without
   * being instants of it. Unpacks of kept tensors do not end the instants:
   * their bytes are in K (taken out at the unpack, before the replayer lets
   * them go), so the loss's backward, which reads its kept scalar and
   * targets before log_softmax's backward allocates at the step's peak,
   * still bounds the stall there. */
  uint32_t bwd_out_unpacks;
  int no_instant;
} link_floor;
/* Per-step sums over the steady steps (all but the first, unless one). */
typedef struct step_sums {
  double step, stall, wait, d2h, h2d, packed, off, kept, pf, hits, pinned, floor, contention;
  double host_bound;
  double opt_d2h, opt_h2d, opt_stall;
  double w_d2h, w_h2d, w_stall;
  double comm_n, comm_bytes, comm_us, comm_exposed;
  uint32_t n_steady;
  uint64_t peak;  /* one step's: its peak of saved bytes */
  int grew;       /* one step's: the pinned arena grew in it */
} step_sums;



double replay_now(replay *r);
void replay_compute(replay *r, double us);
void live_add(replay *r, uint64_t bytes);
void live_sub(replay *r, uint64_t bytes);
/* replay_engine.c: the timeline, device buffers and the engine a replay drives. */
int timeline_push(sim_timeline *tl, sim_interval iv);
void mem_sample(replay *r);
int map_set(u64map *m, const void *key, uint32_t val);
sim_buf *buf_new(replay *r, uint64_t bytes, int counted);
void buf_unref(replay *r, sim_buf *b);
void *buf_ptr(sim_buf *b);
int replay_open_engine(replay *r);
int timed_from_work(const replay *r, const trace_ev *ev);
double work_us(const replay *r, const trace_ev *ev);
size_t grown(size_t cap);
double gap_of(const replay *r, const trace_ev *ev);
const trace_resident *resident_named(const sim_trace *t, const char *what);
int opt_open(replay *r);
uint64_t opt_alloc_bytes(const replay *r, const trace_alloc *a);
void opt_close(replay *r);
int opt_forward(replay *r, double done, double gap, double total);
int opt_params_all(replay *r);
int opt_backward(replay *r, double done, double total);
int opt_sync(replay *r);
int opt_step_end(replay *r);
int opt_after_step(replay *r);
int w_open(replay *r);
void w_close(replay *r);
void w_tables(replay *r, uint32_t tsi);
int w_before_gap(replay *r, uint32_t k, int phase);
int w_before_event(replay *r, uint32_t k, int phase);
int w_after_event(replay *r, uint32_t k, int phase);
int comm_open(replay *r);
void comm_close(replay *r);
void comm_compute(replay *r, double us);
void comm_issue(replay *r, uint32_t idx);
void comm_wait(replay *r, uint32_t idx);
void comm_drain(replay *r);
void floor_compute(link_floor *f, double us);
void floor_tensor(link_floor *f, int type, int out, int reloaded, int counted, double bytes);
double floor_us(const link_floor *f, double peak);
void add_step(step_sums *s, double step_us, double stall, double wait, const ferry_stats *s0, const ferry_stats *s1);
void finish_result(replay *r, const step_sums *s);
void peak_where(replay *r);
void steady_sums(replay *r, uint32_t steps, step_sums *s);

#endif
