/*
 * backend_sim.h — what the simulator (trace replayer, reports) reads from and
 * does to the sim backend beyond the vtable of backend.h: the virtual clock,
 * the stall counters and a listener for finished copies.
 *
 * Time model (docs/simulator.md):
 *   - One clock, `now`, for the embedder's thread and its compute stream
 *     (every external stream, NULL included): the replayer advances it by the
 *     compute time in the trace; a wait of the compute stream on a copy's
 *     event, or a host wait (event_synchronize), moves it forward to the
 *     copy's end and counts the difference as stall.
 *   - Engine streams are FIFO lanes on a modeled link: a copy starts when its
 *     stream reaches it and every wait before it is satisfied, pays
 *     link.latency_us, then moves its bytes at the direction's bandwidth,
 *     times link.duplex while a copy of the other direction is in progress
 *     (latency included), shared equally among copies of its direction in
 *     progress — the same model as the host backend's throttled link.
 *   - Host memory is address space only (PROT_NONE, never touched): the
 *     engine must use the pool arena, which keeps its bookkeeping out of
 *     the blocks.
 */
#ifndef FERRY_BACKEND_SIM_H
#define FERRY_BACKEND_SIM_H

#include <stdint.h>

#include "backend/backend.h"

typedef struct sim_backend_stats {
  double now_us;        /* the compute clock */
  double stall_us;      /* compute stream waited on a copy (reload not ready) */
  double host_wait_us;  /* the host waited on an event (stash bound, step end) */
  double busy_us[2];    /* time with a copy in progress, [0] D2H, [1] H2D */
  uint64_t copies[2];   /* copies finished, per direction */
  uint64_t bytes[2];    /* bytes of the finished copies */
  uint64_t host_reserved_bytes; /* address space handed out by host_alloc */
} sim_backend_stats;

/* dir: 0 = D2H, 1 = H2D; times in µs of the virtual clock. */
typedef void (*sim_copy_listener)(void *ud, int dir, double start_us, double end_us,
                                  uint64_t bytes);

/* Whether b is a sim backend (an engine's: engine_backend in core.h). */
int sim_backend_is(const ferry_backend *b);

/* The embedder's thread computes for us µs (us >= 0). */
void sim_backend_advance(ferry_backend *b, double us);
double sim_backend_now(ferry_backend *b);
/* Runs the link up to now, so that copies finished by now are counted. */
void sim_backend_get_stats(ferry_backend *b, sim_backend_stats *out);
void sim_backend_set_listener(ferry_backend *b, sim_copy_listener fn, void *ud);
/* Direction-dependent duplex (links where one direction suffers more when
 * both run, e.g. A100: H2D drops to ~48%, D2H to ~96%). */
int sim_backend_set_duplex(ferry_backend *b, double d2h, double h2d);

#endif
