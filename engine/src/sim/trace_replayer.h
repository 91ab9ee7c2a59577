/*
 * trace_replayer.h — reads a trace (docs/trace-format.md) and replays it
 * through a real engine: the same policy host, decision cache and stash
 * manager a trainer uses, on the sim backend (a virtual clock) or, for the
 * consistency check, on the host backend with real buffers and a throttled
 * link.
 *
 * Reading validates everything the replay relies on and names the first
 * problem as "FILE:LINE: message". A trace read without error replays
 * without engine misuse (unknown handles, double unpacks, leaks).
 */
#ifndef FERRY_TRACE_REPLAYER_H
#define FERRY_TRACE_REPLAYER_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

/* ---- the trace in memory ----------------------------------------------------- */
typedef enum trace_ev_type {
  TEV_STEP_BEGIN = 0,
  TEV_STEP_END,
  TEV_PACK,
  TEV_UNPACK,
  TEV_DISCARD,
  TEV_BACKWARD_BEGIN,
  TEV_BACKWARD_END,
  TEV_COMPUTE
} trace_ev_type;

typedef struct trace_ev {
  uint8_t type;    /* trace_ev_type */
  int32_t layer;   /* compute: its optional "layer", else -1 */
  uint32_t tensor; /* pack/unpack/discard: index into sim_trace.tensors */
  const char *op;  /* compute: its optional "op" name (owned by the trace) */
  double gap_us;   /* compute time before this event */
} trace_ev;

typedef struct trace_tensor {
  ferry_tensor_desc desc; /* strings are owned by the trace */
  uint64_t id;
  int32_t alias_of;    /* tensor whose buffer this pack shares, or -1 */
  int32_t last_alias;  /* last tensor that aliases this one, or -1 */
  uint8_t decision;    /* recorded: FERRY_KEEP or FERRY_OFFLOAD */
  uint32_t line;
} trace_tensor;

typedef struct trace_step {
  uint32_t first, end; /* events [first, end): step_begin .. step_end */
  uint64_t number;
} trace_step;

typedef struct trace_resident {
  char *what;
  uint64_t bytes;
} trace_resident;

typedef struct sim_trace {
  char *name;
  trace_ev *events;
  uint32_t n_events;
  trace_tensor *tensors;
  uint32_t n_tensors;
  trace_step *steps;
  uint32_t n_steps;
  trace_resident *resident;
  uint32_t n_resident;
  uint64_t resident_bytes;
  int has_compute; /* synthesized: time comes from compute events */
  int32_t layers;  /* largest `layers` seen, 0 if none */
  char **strings;  /* owned strings (module paths, classes) */
  size_t n_strings, cap_strings;
} sim_trace;

/* Read a trace file. On failure *out is NULL and err holds "FILE:LINE: ...". */
int sim_trace_load(const char *path, sim_trace **out, char *err, size_t errlen);
/* The same from memory; name is used in messages. data need not end in 0. */
int sim_trace_parse(const char *name, const char *data, size_t len, sim_trace **out, char *err,
                    size_t errlen);
void sim_trace_free(sim_trace *t);

/* ---- replay ------------------------------------------------------------------- */
typedef struct sim_config {
  ferry_link link;
  double duplex_d2h, duplex_h2d; /* sim: per-direction duplex, 0 = link.duplex */
  uint32_t steps;          /* steps to replay, cycling the trace's; 0 = the trace's */
  const char *policy_path; /* policy under test; both NULL = keep everything */
  const char *policy_source;
  const char *label;       /* name in reports; default: policy file name or "no offload" */
  int replay_decisions;    /* answer with the decisions recorded in the trace */
  uint64_t host_cap_bytes; /* 0 = none */
  int host_backend;        /* 0: the sim backend; 1: the host backend */
  /* host backend only: wall µs per trace µs of compute (e.g. 100 to slow
   * the trace down as the link was scaled down), and real buffers whose
   * contents are checked on every unpack */
  double host_time_scale;
  int timeline;            /* record the last step's timeline */
  int record_decisions;    /* record the last step's decision per pack */
  /* progress, called after each step (may be NULL) */
  void (*progress)(void *ud, uint32_t step, uint32_t steps);
  void *progress_ud;
} sim_config;

typedef struct sim_layer_row {
  int32_t layer;            /* -1: outside the repeated blocks */
  uint64_t saved_bytes;     /* activations and others packed in the step */
  uint64_t offloaded_bytes;
  uint32_t packed, offloaded;
  double stall_us;          /* compute waits on its reloads */
} sim_layer_row;

typedef struct sim_interval {
  double t0, t1;
  uint64_t bytes; /* copies */
  int32_t lane;   /* 0 compute, 1 D2H, 2 H2D */
  int32_t layer;  /* compute: layer of the next tensor event, -1 if none */
} sim_interval;

typedef struct sim_mem_sample {
  double t;
  uint64_t bytes; /* device bytes in use (resident + saved) */
} sim_mem_sample;

typedef struct sim_timeline {
  double t_begin, t_end; /* the recorded step */
  sim_interval *iv;
  size_t n_iv, cap_iv;
  sim_mem_sample *mem;
  size_t n_mem, cap_mem;
} sim_timeline;

typedef struct sim_result {
  char label[128];
  char backend[16];
  uint32_t steps;
  /* peaks over all steps */
  uint64_t peak_device_bytes;  /* resident + saved tensors on device */
  uint64_t resident_bytes;
  uint64_t peak_saved_bytes;   /* saved tensors alone */
  uint64_t peak_host_bytes;    /* pinned arena in use */
  uint64_t host_reserved_bytes;
  /* per step: the mean over steps 2..N (step 1 warms caches and learns) */
  double step_us, stall_us, host_wait_us;
  double first_step_us;
  double bytes_d2h, bytes_h2d;
  double tensors_packed, tensors_offloaded, tensors_kept;
  double prefetches, stash_hits;
  uint64_t policy_errors, policy_calls, policy_cache_hits, cap_fallbacks;
  char policy_error[256];
  /* the last step, per layer: index 0 is layer -1, then layer k at k + 1 */
  sim_layer_row *layers;
  uint32_t n_layers;
  sim_timeline tl;
  uint8_t *decisions; /* last step, per pack event, if record_decisions */
  uint32_t n_decisions;
  uint64_t events;    /* trace events replayed */
  double wall_s;      /* wall time of the replay loop */
} sim_result;

/* Replay t under c. On failure err names the problem. */
int sim_replay(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
               size_t errlen);
void sim_result_free(sim_result *r);

#endif
