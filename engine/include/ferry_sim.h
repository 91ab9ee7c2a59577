/*
 * ferry_sim.h — the simulator's part of ferry_tools.h (which includes it):
 * traces, replay, the synthesizer, "what fits?" and the reports. Installed,
 * with the same promise as ferry_tools.h: none.
 */
#ifndef FERRY_SIM_H
#define FERRY_SIM_H

#include "ferry_tools.h"

/* The trace format version the reader takes (docs/trace-format.md): 2 adds
 * `transient` on resident lines and the `collective` and `collective_wait`
 * events, which the synthesizer writes; a reader of version 1 would count
 * transient gradients twice, so it must refuse them. The recorder's lines
 * are version 1's and it still writes 1. */
#define SIM_TRACE_VERSION 2

#ifdef __cplusplus
extern "C" {
#endif

/* ---- traces (docs/trace-format.md): reading, validated with "FILE:LINE: message", and replay through a real engine on the sim or host backend
 */

/* ---- the trace in memory ----------------------------------------------------- */
typedef enum trace_ev_type {
  TEV_STEP_BEGIN = 0,
  TEV_STEP_END,
  TEV_PACK,
  TEV_UNPACK,
  TEV_DISCARD,
  TEV_BACKWARD_BEGIN,
  TEV_BACKWARD_END,
  TEV_COMPUTE,
  TEV_ALLOC, /* transient device memory: allocated... */
  TEV_FREE,  /* ...and freed (docs/trace-format.md, "alloc") */
  TEV_COLLECTIVE,     /* a collective issued on its group's lane (trace_collective) */
  TEV_COLLECTIVE_WAIT /* the compute stream waits for that collective */
} trace_ev_type;

typedef struct trace_ev {
  uint8_t type;    /* trace_ev_type */
  int32_t layer;   /* compute: its optional "layer", else -1 */
  uint32_t tensor; /* pack/unpack/discard: index into sim_trace.tensors;
                      alloc/free: index into sim_trace.allocs;
                      collective and its wait: into sim_trace.collectives */
  const char *op;  /* compute: its optional "op" name (owned by the trace) */
  double gap_us;   /* compute time before this event */
  double flops;    /* floating-point operations of that compute, -1 unknown */
  double hbm_bytes; /* compute: bytes it reads and writes in device memory, -1 unknown */
  double min_us;   /* compute: the least it takes on any GPU (kernel launches), 0 none */
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
  int dtype; /* its optional "dtype": the element type; FERRY_DTYPE_UNKNOWN if not given */
  /* its optional "layer_bytes": of these bytes, what each repeated block
   * holds (the "parameters" line: a block's weights, what weight offload
   * moves per layer); 0 if not given */
  uint64_t layer_bytes;
  /* its optional "transient": true: the step's allocs hold these bytes
   * (synthesized gradients), so they are not in resident_bytes */
  int transient;
} trace_resident;

/* Transient device memory of a step (an "alloc" event to its "free"):
 * counted in the device's bytes in use, never packed, so no policy can
 * offload it. */
typedef struct trace_alloc {
  uint64_t id;
  uint64_t bytes;
  const char *what; /* owned by the trace */
  uint32_t line;
} trace_alloc;

/* A collective of the step (docs/trace-format.md, "collective"): FSDP's
 * all-gather of a block's parameters and reduce-scatter of its gradients,
 * tensor parallelism's all-reduces. bytes is the whole buffer (the gathered
 * or unsharded one); each rank moves bytes x (ranks - 1) / ranks (all-reduce:
 * twice that), NCCL's bus-bandwidth factor. */
enum { SIM_COLL_ALL_GATHER = 0, SIM_COLL_REDUCE_SCATTER, SIM_COLL_ALL_REDUCE, SIM_COLL_ALL_TO_ALL };
/* data-parallel (FSDP) or within a node: tensor parallelism's exchanges and
 * Ulysses' all-to-alls ("what" "tp" or "cp") share the intra-node lane */
enum { SIM_GROUP_SHARD = 0, SIM_GROUP_TP = 1 };
typedef struct trace_collective {
  uint64_t id;
  uint64_t bytes;
  int32_t ranks, layer;
  uint8_t kind;   /* SIM_COLL_* */
  uint8_t group;  /* SIM_GROUP_* */
  uint8_t waited; /* a collective_wait names it */
  uint32_t line;
} trace_collective;

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
  trace_alloc *allocs;
  uint32_t n_allocs;
  trace_collective *collectives;
  uint32_t n_collectives;
  int has_compute; /* synthesized: time comes from compute events */
  char backend[16]; /* the header's "backend": where it was recorded */
  uint32_t n_flops; /* events that carry "flops" */
  uint32_t n_hbm;   /* compute events that carry "hbm_bytes" */
  int32_t layers;  /* largest `layers` seen, 0 if none */
  /* "device_peak" events (recorded on a GPU): how many, and the largest */
  uint32_t n_device_peaks;
  uint64_t device_peak;
  char **strings;  /* owned strings (module paths, classes) */
  size_t n_strings, cap_strings;
  /* the run the header describes (the synthesizer writes it; 0 where not
   * given): "seq", "cp", "shard", "tp", and "checkpoint_impl" as 1 eager
   * (reentrant, non-reentrant) or 2 compiled. The error bands use them
   * (sim_run_class_of). */
  int32_t run_seq, run_cp, run_shard, run_tp, run_ckpt_impl;
} sim_trace;

/* Read a trace file. On failure *out is NULL and err holds "FILE:LINE: ...". */
FERRY_API int sim_trace_load(const char *path, sim_trace **out, char *err, size_t errlen);
/* What the reader takes before it gives up with "FILE:LINE: ..." (limits in
 * docs/trace-format.md): the longest line, the deepest nesting of a line,
 * the largest file. sim_trace_load uses SIM_TRACE_LIMITS_DEFAULT. */
typedef struct sim_trace_limits {
  size_t max_line_bytes;
  int max_depth;
  uint64_t max_file_bytes;
} sim_trace_limits;
#define SIM_TRACE_LIMITS_DEFAULT {(size_t)1 << 20, 32, (uint64_t)1 << 34}
FERRY_API int sim_trace_load_limited(const char *path, const sim_trace_limits *limits,
                                     sim_trace **out, char *err, size_t errlen);
/* The same from memory; name is used in messages. data need not end in 0. */
FERRY_API int sim_trace_parse(const char *name, const char *data, size_t len, sim_trace **out, char *err,
                    size_t errlen);
FERRY_API void sim_trace_free(sim_trace *t);
/* For tests: the reader's first line parser (json_line_fast.c) against
 * simdjson's on the n bytes at s: 1 if it took the line and read every
 * member as simdjson does (numbers bit for bit), 0 if it passed the line
 * on, -1 if it read it otherwise or took a line simdjson refuses. max_depth
 * is the first parser's (simdjson's is 64); -2 out of memory. */
typedef struct sim_line_check sim_line_check;
FERRY_API sim_line_check *sim_line_check_new(void);
FERRY_API int sim_line_check_run(sim_line_check *c, const char *s, size_t n, int max_depth);
FERRY_API void sim_line_check_free(sim_line_check *c);

/* ---- replay ------------------------------------------------------------------- */
/* A DGX H100's 2 TB of system memory (NVIDIA DGX H100 datasheet) */
#define SIM_DEFAULT_HOST_RAM 2000000000000ull
/* DeepSpeed's CPU-Adam: 11.6e9 parameters stepped in 8.2 s by one process
 * on a node (DeepSpeed PR #735, docs/hardware.md), shared by the node's 8
 * GPUs: parameters per second per rank */
#define SIM_DEFAULT_CPU_ADAM (11.6e9 / 8.2 / 8)

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
  /* steps left out of the steady-state figures (step time, stall, bytes,
   * peak): 0 = the default, 1; negative = none */
  int32_t warmup;
  /* achieved TFLOP/s of the simulated GPU: compute that carries FLOPs in
   * the trace takes flops / this (a synthesized event, which also carries
   * its device-memory bytes and a least time, takes the largest of
   * flops / this, hbm_bytes / hbm_bytes_per_s and min_us: a roofline);
   * 0 = the trace's own times (a synthesized trace: the synthesizer's) */
  double tflops;
  /* achieved device-memory bandwidth for that roofline, bytes/s; 0 =
   * SIM_DEFAULT_HBM_BYTES_PER_S. Unused while tflops is 0. */
  double hbm_bytes_per_s;
  /* the simulated host's RAM for host_cap_pct and the policies'
   * host_ram_used_pct (available = this less the pinned bytes the sim
   * reserved); 0 = SIM_DEFAULT_HOST_RAM. Never the machine running it. */
  uint64_t host_ram_bytes;
  /* sim: the cost of pinning host memory (sim_backend_set_pinned_cost),
   * both 0 = free; and whether the trainer has a pinned pool (the engine's
   * arena: pays once, when it grows) or not (pinned_no_pool: every offload
   * pays a fresh allocation of its bytes, every step) */
  double pinned_alloc_us, pinned_touch_bytes_per_s;
  int pinned_no_pool;
  int release_when_copied; /* ferry_config.release_when_copied */
  int prefetch_at_backward_begin; /* ferry_config.prefetch_at_backward_begin */
  /* sim: optimizer-state offload (docs/sim-model.md, "Optimizer-state
   * offload"), as ferry.torch.offload_optimizer does it: the share of the
   * trace's resident "optimizer states" (and "master weights") kept on the
   * host, 0..1 (0 = none); the host's Adam rate in parameters per second
   * per rank (0 = SIM_DEFAULT_CPU_ADAM); optimizer_serial: the host step
   * after the device share's and the updated parameters waited for before
   * the step ends (overlap=False), else overlapped (the default) */
  double optimizer_fraction;
  double cpu_adam_params_per_s;
  int optimizer_serial;
  /* sim: weight offload (docs/sim-model.md, "Weight offload"), as
   * ferry.torch.offload_weights does it: the weights of the repeated blocks
   * weight_first .. weight_first + weight_count - 1 (weight_count 0 = none)
   * go to the host after each forward and come back before their backward,
   * the next forward keeping them; weight_single_buffer: no reload of the
   * neighbour ahead (double_buffer=False), else double-buffered */
  int32_t weight_first, weight_count;
  int weight_single_buffer;
  /* device memory the trace does not hold (never saved for backward: the
   * loss's transients, workspaces), counted in every peak as resident
   * memory is; sim_untracked_bytes learns it from a recorded run */
  uint64_t untracked_bytes;
  /* sim: the communication lane (docs/sim-model.md, "Collectives"): the
   * data-parallel group spans comm_nodes nodes (0 or 1: one node, its
   * collectives on NVLink; more: on the NIC, whose traffic crosses the
   * GPU's PCIe link with the offload copies); the bus bandwidths per GPU,
   * bytes/s (0 = none: collectives take no time) */
  uint32_t comm_nodes;
  double nvlink_bytes_per_s, nic_bytes_per_s;
  /* the step's sensitivity to the compute rate: when > 0 (and compute is
   * timed from FLOPs: tflops > 0), the replay is run twice more with tflops
   * x (1 - this) and x (1 + this), and sim_result.sens_* get their steady
   * step times (docs/sim-model.md, "Sensitivity to the compute rate") */
  double mfu_sensitivity;
  /* sim: node sharing (docs/sim-model.md, "Time model"): this GPU's share
   * of the host's memory bandwidth, which its copies of both directions
   * share, bytes/s (0 = unlimited); and copy/compute contention: the
   * device-memory bandwidth a copy takes its share of from a memory-bound
   * kernel beside it, bytes/s (0 = no contention) */
  double host_mem_bytes_per_s;
  double contention_hbm_bytes_per_s;
  /* sim: the host's cost per saved tensor of the pack/unpack path (the
   * saved-tensor hooks, the engine's calls, a copy's launch), µs, half at
   * its pack and half at its unpack, on the host's own timeline: it delays
   * the GPU only when the host cannot stay ahead of it (0 = free) */
  double host_overhead_us;
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
  int32_t layer;  /* compute: layer of the next tensor event, -1 if none;
                     copies: the tensor's */
  uint32_t tensor; /* copies: the trace's tensor index + 1, 0 = unknown */
  uint32_t flow;   /* an offload and its reload share a nonzero id */
  const char *module_path; /* copies: the tensor's (the trace's string);
                              compute: the op of a compute event, else the
                              module of the next tensor event; NULL if none */
  double flops, hbm_bytes; /* compute: its work as the trace gives it, -1 unknown */
  /* an H2D copy (lane 2) that ran on the D2H stream, behind the offloads:
   * a reload under the one_copy_stream knob; drawn on that stream's lane */
  int32_t one_stream;
} sim_interval;

typedef struct sim_mem_sample {
  double t;
  uint64_t bytes; /* device bytes in use (resident + saved) */
} sim_mem_sample;

/* What the trainer waited for (sim backend): the compute stream for a
 * reload (the unpack's exposed stall), the host for copies (the forward
 * stash bound, the step end draining them), the host pinning memory. */
enum { SIM_WAIT_RELOAD = 0, SIM_WAIT_COPIES = 1, SIM_WAIT_PINNING = 2 };

typedef struct sim_wait {
  double t0, t1; /* the clock stood still for compute meanwhile */
  int32_t kind;  /* SIM_WAIT_* */
  int32_t layer; /* the layer of the event that waited, -1 outside blocks */
} sim_wait;

typedef struct sim_timeline {
  double t_begin, t_end; /* the recorded step */
  double t_backward;     /* its backward_begin, 0 if none */
  sim_interval *iv;
  size_t n_iv, cap_iv;
  sim_mem_sample *mem;
  size_t n_mem, cap_mem;
  /* the exposed waits, in time order (their sum is the step's stall_us +
   * host_wait_us), and the pinned host memory in use (the arena's, resident
   * buffers included) after each event that changed it */
  sim_wait *waits;
  size_t n_waits, cap_waits;
  sim_mem_sample *host;
  size_t n_host, cap_host;
  /* the policy's one_copy_stream knob: its reloads run on the D2H stream,
   * whose Chrome-trace lane is named for both directions (as a real run's,
   * reloads or not) */
  int one_stream;
} sim_timeline;

/* sim_result.peak_phase */
enum { SIM_PEAK_FORWARD = 0, SIM_PEAK_BACKWARD, SIM_PEAK_OPTIMIZER, SIM_PEAK_NONE };
/* "forward", "backward", "optimizer step", "step start" */
FERRY_API const char *sim_peak_phase_name(int phase);

typedef struct sim_result {
  char label[128];
  char backend[16];
  uint32_t steps;
  /* peaks over all steps */
  uint64_t peak_device_bytes;  /* resident + saved tensors on device */
  uint64_t resident_bytes;     /* untracked_bytes included */
  uint64_t untracked_bytes;    /* sim_config.untracked_bytes */
  uint64_t peak_saved_bytes;   /* saved tensors alone */
  uint64_t peak_host_bytes;    /* pinned arena in use */
  uint64_t host_reserved_bytes;
  /* where the last step's device peak fell: its phase (SIM_PEAK_*), the
   * layer and op of the compute it is for (the next compute event; for a
   * pack, its own layer and the compute before it there; layer -1: outside
   * the blocks, op "" none), and what raised it (an alloc's what, a pack's
   * module path, "" none) */
  int peak_phase;
  int32_t peak_layer;
  char peak_op[64], peak_what[96];
  /* per step: the mean over the steady steps (after the warmup ones; step 1
   * warms caches and learns); the peaks above are over the steady steps too
   * (over all when no step is steady) */
  double step_us, stall_us, host_wait_us;
  double first_step_us;
  uint64_t first_step_peak_device_bytes; /* step 1 alone */
  uint32_t warmup;                       /* steps left out */
  /* steady state begins once the pinned arena stopped growing: the last
   * step (1-based) in which it grew (0: none), the first step counted in
   * the steady figures, and whether the arena still grew in the last step
   * (then only the last step is counted, and it is not steady: replay more
   * steps) */
  uint32_t arena_grew_step, steady_from;
  int arena_still_growing;
  double pinned_alloc_us;                /* per steady step: pinning host memory */
  /* per steady step: compute time added by copies beside memory-bound
   * kernels (sim_config.contention_hbm_bytes_per_s; in step_us) */
  double contention_us;
  /* per steady step: the GPU idle because the host, paying
   * sim_config.host_overhead_us per saved tensor, had not yet issued its
   * work (in step_us) */
  double host_bound_us;
  /* per steady step: the least exposed stall any schedule of the same
   * copies could have at this peak, the link at full speed (replayer.c,
   * link_floor); 0 on the host backend */
  double stall_floor_us;
  uint64_t host_ram_bytes;               /* the simulated host's RAM */
  /* compute time: gaps (per replayed trace pass) timed from FLOPs at
   * sim_config.tflops, gaps kept as the trace has them; and a plain
   * sentence saying where the compute times come from */
  uint32_t gaps_from_flops, gaps_as_recorded;
  char compute_note[256];
  double bytes_d2h, bytes_h2d;
  /* per steady step, the collectives (trace_collective): their number and
   * bytes per rank on the wire, the time their lanes were busy, and the
   * part of it the compute stream waited for (exposed: in step_us, not in
   * stall_us) */
  double comm_count, comm_bytes, comm_us, comm_exposed_us;
  /* sim_config.mfu_sensitivity: the achieved TFLOP/s of the two extra
   * replays (lower, higher) and their steady step times; 0 when not run */
  double sens_tflops[2], sens_step_us[2];
  /* full replays of the trace this result took: 1, and 2 more when the
   * sensitivity replays ran (a run's cost; `ferry sim --mfu-sensitivity
   * off` keeps it at 1) */
  uint32_t replays;
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
  /* optimizer-state offload (all 0 when off): the share, the parameters
   * stepped on the host per rank, the device memory it frees (in
   * resident_bytes and the peaks already), the pinned host memory it holds
   * (states, gradient and parameter buffers: in peak_host_bytes too), the
   * host's rate, whether serial; per steady step: the share's gradients
   * D2H and updated parameters H2D, the host step, and the time the step
   * is longer for it (waiting for gradients, for the host step, for
   * parameters; not in stall_us) */
  double opt_fraction, opt_params, opt_cpu_adam_params_per_s;
  uint64_t opt_device_bytes, opt_host_bytes;
  int opt_serial;
  double opt_bytes_d2h, opt_bytes_h2d, opt_cpu_us, opt_stall_us;
  /* weight offload (all 0 when off): the blocks (first, count), each one's
   * weight bytes (the trace's "layer_bytes", or estimated: w_estimated 1,
   * the "parameters" bytes over the layers), double-buffered or not, the
   * device bytes taken out of resident_bytes (w_count x w_layer_bytes; on
   * the device they count in peak_saved_bytes while there), the pinned host
   * bytes (in peak_host_bytes too); per steady step the bytes each way and
   * the exposed wait for them (all three also in bytes_d2h, bytes_h2d and
   * stall_us) */
  int32_t w_first, w_count;
  int w_double_buffer, w_estimated;
  uint64_t w_layer_bytes, w_device_bytes, w_host_bytes;
  double w_bytes_d2h, w_bytes_h2d, w_stall_us;
} sim_result;

/* Replay t under c. On failure err names the problem. */
FERRY_API int sim_replay(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
               size_t errlen);
/* The device memory a recorded trace does not hold: its "device_peak" (the
 * trainer's own peak) less the peak of a replay of its recorded decisions
 * under c, 0 if that is larger or the trace has no device_peak. *replayed
 * (may be NULL) gets that replay's peak. */
FERRY_API int sim_untracked_bytes(const sim_trace *t, const sim_config *c, uint64_t *out,
                                  uint64_t *replayed, char *err, size_t errlen);
FERRY_API void sim_result_free(sim_result *r);


/* ---- the trace synthesizer: a decoder-only transformer's training step from its shape (docs/sim-synth.md)
 */

enum { SYNTH_LLAMA = 0, SYNTH_GPT = 1 };
/* Activation checkpointing (docs/sim-synth.md, "Activation checkpointing"):
 * none; full (every ckpt_every-th block keeps only its input and is
 * recomputed before its backward); selective (Megatron-LM's: the groups in
 * `recompute` are dropped and recomputed); selective-op (torchtitan's
 * per-op policy: matmul outputs except every second one and attention's
 * outputs kept, the rest recomputed). */
enum {
  SYNTH_CKPT_OFF = 0,
  SYNTH_CKPT_FULL = 1,
  SYNTH_CKPT_SELECTIVE = 2,
  SYNTH_CKPT_SELECTIVE_OP = 3
};
/* Which checkpoint implementation runs it, which decides what a saved-tensor
 * hook (ferry) receives (docs/sim-synth.md, "What a policy can see"):
 * reentrant (torch.utils.checkpoint use_reentrant=True, Hugging Face's
 * default, Megatron's): the block input and every recomputed tensor;
 * non-reentrant (use_reentrant=False, torchtitan's): none of the checkpoint's
 * own (its input, per-op SAC's kept outputs, the recomputed tensors live in
 * its storage); compiled (torch.compile over checkpointed blocks): what the
 * compiled graph saves (the input, SAC's kept outputs), not what its backward
 * recomputes. auto: selective-op and full non-reentrant, selective reentrant. */
enum {
  SYNTH_CKPT_IMPL_AUTO = 0,
  SYNTH_CKPT_IMPL_REENTRANT = 1,
  SYNTH_CKPT_IMPL_NON_REENTRANT = 2,
  SYNTH_CKPT_IMPL_COMPILED = 3
};
/* The loss (docs/sim-synth.md, "The loss working set"): full is Hugging
 * Face's (lm_head's bf16 logits, their fp32 copy, log-softmax + NLL);
 * chunked a fused linear cross-entropy (Liger's): the logits exist a chunk
 * of tokens at a time and the gradients are computed in forward. */
enum { SYNTH_LOSS_FULL = 0, SYNTH_LOSS_CHUNKED = 1 };
/* Training state on the device (docs/sim-synth.md, "Resident memory"):
 * the optimizer's state bytes per trainable parameter and whether an fp32
 * master copy is kept (auto: when the parameters are 16-bit). */
enum {
  SYNTH_OPT_ADAMW = 0,    /* two states in the stepped copy's dtype: 8 B with fp32 */
  SYNTH_OPT_ADAMW_8BIT,   /* bitsandbytes: two uint8 states + fp32 absmax per 256 */
  SYNTH_OPT_SGD,          /* none */
  SYNTH_OPT_SGD_MOMENTUM, /* one, in the stepped copy's dtype */
  SYNTH_OPT_NONE          /* no optimizer step at all */
};
enum { SYNTH_MASTER_AUTO = 0, SYNTH_MASTER_ON = 1, SYNTH_MASTER_OFF = 2 };
/* What an RMSNorm saves (docs/sim-synth.md, "Saved tensors per op"): fused,
 * one kernel (torch's _fused_rms_norm, Liger's RMSNorm: the input, its rstd
 * and the weight); eager, Hugging Face's LlamaRMSNorm as written, op by op
 * (the fp32 input, rstd, the normalized tensor: what a CPU run or a GPU run
 * without fused kernels saves). */
enum { SYNTH_NORM_FUSED = 0, SYNTH_NORM_EAGER = 1 };
/* How --cp splits the sequence (docs/sim-synth.md, "Long context"): ring
 * attention (each rank's queries over every rank's K/V chunks) or
 * DeepSpeed-Ulysses (all-to-alls around attention turn seq / cp tokens of
 * every head into the whole sequence of heads / cp). */
enum { SYNTH_CP_RING = 0, SYNTH_CP_ULYSSES = 1 };
/* What selective checkpointing recomputes (bit mask). */
enum {
  SYNTH_RECOMPUTE_ATTN_CORE = 1u << 0, /* softmax & co: the s^2 tensors */
  SYNTH_RECOMPUTE_MLP_ACT = 1u << 1    /* the MLP activation's output */
};

typedef struct synth_model {
  char name[64];
  int arch;        /* SYNTH_LLAMA or SYNTH_GPT */
  int layers, hidden, heads, kv_heads, ffn, vocab;
  int seq, micro_batch;
  int dtype;       /* ferry_dtype of activations and weights */
  int flash;       /* FlashAttention: no s^2 tensors */
  int checkpoint;  /* SYNTH_CKPT_* */
  unsigned recompute; /* SYNTH_RECOMPUTE_* for selective */
  int shard;       /* data-parallel sharding degree (FSDP / ZeRO-3), >= 1 */
  double tflops;   /* achieved matmul throughput, TFLOP/s */
  double hbm_gbps; /* achieved memory bandwidth of element-wise kernels, GB/s */
  int steps;       /* steps in the trace */
  int ckpt_every;  /* full:K: the blocks whose 1-based index is a multiple of K (1: all) */
  int head_dim;    /* 0: hidden / heads */
  int qk_norm;     /* Qwen3: RMSNorm over head_dim on q and k */
  int experts, top_k, expert_ffn; /* MoE (llama arch): 0 = dense; expert_ffn 0 = ffn */
  int tie_embeddings; /* the head shares the embedding's weight */
  int loss;           /* SYNTH_LOSS_* */
  int loss_chunk;     /* chunked: tokens per chunk; 0 = Liger's rule (synth_loss_chunk) */
  int param_dtype;    /* stored parameters; FERRY_DTYPE_UNKNOWN (0) = dtype */
  int grad_dtype;     /* gradients; 0 = the parameters' */
  int master_weights; /* SYNTH_MASTER_* */
  int optimizer;      /* SYNTH_OPT_* */
  double lora;        /* trainable share of the parameters (LoRA); 0 = all */
  int tp;             /* Megatron tensor parallelism degree; 0 or 1 = none */
  int sp;             /* sequence parallelism (needs tp > 1) */
  int cp;             /* context parallelism (ring attention) degree; 0 or 1 = none: each
                         rank holds seq / cp tokens and attends over all keys */
  int cp_impl;        /* SYNTH_CP_*: ring attention (default) or Ulysses */
  int norm;           /* SYNTH_NORM_*: the RMSNorms' kernels (llama arch) */
  int ckpt_impl;      /* SYNTH_CKPT_IMPL_* */
  int positions;      /* learned position embeddings (GPT): rows of hidden; 0 = none (rotary) */
} synth_model;

/* The resident bytes per GPU, by part (synth_resident_parts). */
typedef struct synth_resident {
  uint64_t local_params; /* parameters per tensor-parallel rank, before sharding */
  uint64_t trainable;    /* of them, trained (LoRA: the share) */
  uint64_t params, grads, master, states, gathered; /* bytes per GPU */
  /* held all step: params + master + states (the trace's resident lines);
   * grads (during backward and the optimizer step) and gathered (the most
   * FSDP holds gathered at once) come and go within it; total: all five */
  uint64_t whole_step;
  uint64_t total;
  /* of params, one repeated block's (its linears and norms; the trace's
   * "layer_bytes", what weight offload moves per layer) */
  uint64_t layer_params;
} synth_resident;

/* Fill *m with a preset (synth_preset_names()) and the defaults (seq 8192,
 * micro-batch 1, bf16, flash on, no checkpointing, shard 8, 400 TFLOP/s,
 * 2000 GB/s, 1 step). -1 if unknown. */
FERRY_API int synth_preset(const char *name, synth_model *m);
/* Names of the presets, for help texts. */
FERRY_API const char *synth_preset_names(void);
/* 0, or -1 with a message naming the bad field (or the checkpointing mode
 * that would change nothing: selective with FlashAttention). */
FERRY_API int synth_validate(const synth_model *m, char *err, size_t errlen);
/* Write the trace; 0, or -1 with a message (I/O error). */
FERRY_API int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen);

/* Bytes of the distinct activation buffers one layer's ops save in the
 * forward pass without checkpointing (no parameters; a buffer saved by
 * several ops counts once; the model-wide rotary tables included, which
 * only the first layer that saves packs: synth_layer_saved_bytes). */
FERRY_API uint64_t synth_layer_activation_bytes(const synth_model *m);
/* What layer `layer` keeps from its forward pass to its backward under
 * m's checkpointing (the trace's forward-phase activation packs). */
FERRY_API uint64_t synth_layer_saved_bytes(const synth_model *m, int layer);
/* Tokens per chunk of the chunked loss: m->loss_chunk, or Liger's rule
 * next_pow2(ceil(tokens / ceil(vocab / hidden))); at most the tokens. */
FERRY_API int64_t synth_loss_chunk(const synth_model *m);
/* m's checkpoint implementation with auto resolved (SYNTH_CKPT_IMPL_*), and
 * its name ("reentrant", "non-reentrant", "compiled"). */
FERRY_API int synth_checkpoint_impl(const synth_model *m);
FERRY_API const char *synth_checkpoint_impl_name(int impl);
/* The layers m's checkpointing applies to (full:K: layers / K). */
FERRY_API int synth_checkpointed_layers(const synth_model *m);
/* Parameters of the model (MoE: all experts; active: the router and top_k
 * experts per layer), and the resident bytes per GPU (parameters,
 * gradients, optimizer states, sharded by m->shard). */
FERRY_API uint64_t synth_param_count(const synth_model *m);
FERRY_API uint64_t synth_active_param_count(const synth_model *m);
FERRY_API uint64_t synth_resident_bytes(const synth_model *m);
/* The same by part: stored parameters (all, sharded), gradients, fp32
 * master weights and optimizer states (the trainable ones), the gathered
 * blocks of sharded training; per tensor-parallel rank. */
FERRY_API void synth_resident_parts(const synth_model *m, synth_resident *out);
/* Bytes an optimizer keeps per trainable parameter (the 8-bit states'
 * block scales apart: synth_resident_parts counts them). */
FERRY_API double synth_optimizer_state_bytes(const synth_model *m);
/* "adamw", "adamw8bit", "sgd", "sgd-momentum", "none"; parse: -1 if unknown. */
FERRY_API const char *synth_optimizer_name(int optimizer);
FERRY_API int synth_optimizer_parse(const char *name);


/* ---- "what fits?" (sim_fit.c): a policy template's knobs searched for the
 * lowest step time whose steady peak fits the device and whose pinned host
 * memory fits the host budget (docs/sim-model.md, `ferry sim --fit`) */
typedef struct sim_fit_setting {
  uint64_t host_bytes;  /* HOST_BYTES: offloaded bytes per step, at most */
  int keep_last;        /* KEEP_LAST: layers kept on device */
  int fwd_stash;        /* FWD_STASH: forward stash depth */
  int prefetch_layers;  /* PREFETCH_LAYERS: reload distance in backward */
  double step_us;       /* steady-state step time */
  uint64_t peak_device_bytes, host_reserved_bytes;
  int fits;
} sim_fit_setting;

typedef struct sim_fit_config {
  const char *policy_template; /* Lua source with those four `local` lines
                                  (policies/host_budget.lua) */
  sim_config replay;           /* link, steps, warmup, host RAM, pinned cost */
  uint64_t device_bytes;       /* the device memory to fit in */
  uint64_t host_bytes;         /* pinned host budget per rank */
} sim_fit_config;

typedef struct sim_fit_result {
  sim_fit_setting *settings; /* every setting tried, in search order */
  uint32_t n;
  int best; /* index of the chosen one, -1 if none fits */
  uint64_t span_bytes; /* HOST_BYTES goes 0..this in sixteenths: the budget,
                          or the step's offloadable bytes if fewer */
} sim_fit_result;

FERRY_API int sim_fit(const sim_trace *t, const sim_fit_config *c, sim_fit_result *out, char *err,
                      size_t errlen);
FERRY_API void sim_fit_result_free(sim_fit_result *r);
/* The template with the setting's knobs written in (malloc'd; NULL if a
 * knob line is missing). */
FERRY_API char *sim_fit_source(const char *tmpl, const sim_fit_setting *s);
/* src with its line `local KNOB = ...` set to value; NULL if none. */
FERRY_API char *sim_policy_set_knob(const char *src, const char *knob, const char *value);

/* ---- simulator reports: hardware presets, link syntax, tables, JSON, Chrome trace, SVG
 */

typedef struct sim_hw {
  const char *name;
  const char *description;
  ferry_link link;
  double duplex_d2h, duplex_h2d; /* per direction, as measured */
  double device_bytes;           /* HBM capacity */
  const char *source;
  double host_ram_bytes;         /* host RAM per GPU: the node's / GPUs per node */
  double peak_tflops;            /* dense BF16 tensor-core peak, TFLOP/s */
  double hbm_bytes_per_s;        /* device-memory (HBM) bandwidth, datasheet */
  /* what the device exposes to CUDA (torch.cuda's "total capacity", less
   * than the marketed size: ECC and the driver's reserve); 0 = device_bytes */
  double capacity_bytes;
  /* collectives' bus bandwidth per GPU, bytes/s: within a node (NVLink,
   * NCCL's measured busbw) and across nodes (the GPU's NIC) */
  double nvlink_bytes_per_s, nic_bytes_per_s;
  /* the node (docs/hardware.md, "Node sharing"): its GPUs, how many share
   * one PCIe uplink to the host (a switch's), and the host memory bandwidth
   * of all its sockets, bytes/s (0 = not modelled) */
  int gpus_per_node, gpus_per_switch;
  double node_host_mem_bytes_per_s;
} sim_hw;
/* What `ferry sim --gpus-per-node N --numa-far F --contention on|off` sets
 * in c for hw (sim_node.c): with N GPUs copying at once, each gets its
 * link's bandwidth over the GPUs sharing its switch (at most N) and 1/N of
 * the node's host memory bandwidth for both directions; times F (0 < F <=
 * 1) when its pinned memory sits on the far socket; contention on: copies
 * take their share of the preset's datasheet HBM bandwidth from memory-bound
 * kernels. 0, or -1 with a message. */
FERRY_API int sim_node_apply(const sim_hw *hw, int gpus, double numa_far, int contention,
                             sim_config *c, char *err, size_t errlen);
/* The default sustained fraction of peak (--mfu): 0.40; torchtitan's eager
 * Llama 3.1 8B on 8 H100s needs 0.38 to reproduce, Llama 3's 405B reports
 * 38-43% (docs/hardware.md, "Compute rate"). */
#define SIM_DEFAULT_MFU 0.40
/* `ferry sim` shows every run's step and overhead at the compute rate x
 * (1 -+ 0.25) beside it (sim_config.mfu_sensitivity): MFU 0.30 and 0.50
 * around the default, the spread of the published rates (hardware.md). */
#define SIM_MFU_SENSITIVITY 0.25
/* The fraction of the datasheet HBM bandwidth memory-bound ops reach
 * (--hbm overrides): 0.60, the synthesizer's 2000 GB/s on H100's 3.35 TB/s
 * (docs/hardware.md: a modelling choice, not a measurement). */
#define SIM_DEFAULT_HBM_FRACTION 0.60
/* The host's cost per saved tensor of ferry's pack/unpack path (`ferry sim
 * --host-overhead`): ferry's benchmark of the Python hooks' keep path
 * (bench/bench_torch.py, torch_ferry_keep_overhead_us: saved-tensor hooks,
 * the binding, the engine call), measured per torch version on the
 * project's build machine (docs/hardware.md, "Host cost per tensor"). */
#define SIM_HOST_OVERHEAD_TORCH2_US 10.0
#define SIM_HOST_OVERHEAD_TORCH1_US 9.0
/* sim_config.hbm_bytes_per_s when 0: the synthesizer's default, 2000 GB/s. */
#define SIM_DEFAULT_HBM_BYTES_PER_S 2e12

/* The device memory a training run cannot count on: the CUDA context
 * (~0.3 GiB with lazy module loading, over 1 GiB before CUDA 11.7) and the
 * caching allocator's reserved-but-unallocated blocks (1.83 GiB with 78.09
 * GiB in use in one published OOM), which the sim does not model: 2.8 GiB,
 * the top of docs/hardware.md's 2.1-2.8 GiB ("Device memory headroom"). */
#define SIM_DEVICE_ALLOWANCE_BYTES (2.8 * 1073741824.0)
/* What a run may peak at on hw: the capacity the device exposes less
 * SIM_DEVICE_ALLOWANCE_BYTES (`ferry sim`'s "fits", `--fit device`). */
FERRY_API double sim_hw_usable_bytes(const sim_hw *hw);

/* NULL if unknown. */
FERRY_API const sim_hw *sim_hw_preset(const char *name);
FERRY_API const char *sim_hw_names(void);
/* "h2d=55GB/s,d2h=55GB/s,latency=5us,duplex=0.9" over *hw (fields not
 * named keep their values). 0, or -1 with a message. */
FERRY_API int sim_parse_link(const char *spec, sim_hw *hw, char *err, size_t errlen);

typedef struct sim_run_info {
  const char *trace_path;
  const sim_trace *trace;
  const sim_hw *hw;
  /* device memory the trace does not hold, in every run's peak
   * (sim_config.untracked_bytes): given (ferry sim --untracked BYTES), or
   * the trace's device_peak (observed) less its recorded decisions'
   * replayed peak */
  uint64_t untracked_bytes, untracked_observed, untracked_replayed;
  int untracked_given;
  /* the node the runs were priced on (ferry sim --gpus-per-node, --numa-far,
   * --contention, --host-overhead; sim_node_apply): the reports show this
   * link, not the preset's, and name the settings. gpus_per_node 0: not
   * given (the preset's link, no node line). gpus_given: --gpus-per-node was
   * given, so the error bands take it for the run's GPUs (its default of 1
   * says nothing about the run). */
  int gpus_per_node, contention, gpus_given;
  double numa_far, host_overhead_us, host_mem_bytes_per_s;
  double h2d_bytes_per_s, d2h_bytes_per_s; /* the link each GPU gets */
  /* ferry sim --mfu-sensitivity: the factor of the runs' replays at the
   * compute rate x (1 -+ it) (sim_config.mfu_sensitivity), which the JSON
   * names; -1: off, which every report says; 0: not stated (the reports
   * show the sensitivity where the results carry it) */
  double mfu_sensitivity;
} sim_run_info;

/* rs[0] is the baseline (no offload), rs[1..n-1] the policies. */
FERRY_API void sim_print_table(FILE *f, const sim_run_info *info, const sim_result *rs, int n);
FERRY_API void sim_print_layers(FILE *f, const sim_result *rs, int n);
FERRY_API int sim_write_json(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                   char *err, size_t errlen);
FERRY_API int sim_write_chrome_trace(const char *path, const sim_result *rs, int n, char *err,
                           size_t errlen);
/* Device memory over the last step per run (left axis), pinned host memory
 * in use (right axis), the exposed waits, backward's start and the peaks
 * (sim_plot.c; docs/sim-outputs.md, "Outputs"). Needs sim_config.timeline. */
FERRY_API int sim_write_svg(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                  char *err, size_t errlen);
/* ---- error bands (sim_bands.c; docs/sim-validation.md, "Validation: memory and cost") ---- */
/* A row of the validation table: a published run, how it was set up (its
 * class) and the simulator's error on it, simulated - published in points.
 * The table in docs/sim-validation.md is the source; tests/check_band_docs.py
 * fails when these rows disagree with it. */
enum { SIM_BAND_NONE = 0, SIM_BAND_NUMBER = 1, SIM_BAND_BOUND = 2 };
typedef struct sim_band_row {
  const char *source; /* "owner/repo#PR" */
  const char *label;  /* which of the publication's runs */
  int32_t gpus;       /* GPUs of the run */
  int32_t compiled;   /* 1 compiled, 0 eager */
  int32_t seq, cp;    /* sequence length (the one taken where not given), context parallel */
  double sim_overhead_pct; /* the simulated overhead: copy-bound at SIM_BAND_COPY_BOUND_PCT */
  int32_t memory_kind;     /* SIM_BAND_NUMBER or SIM_BAND_NONE (not published) */
  double memory_points;
  /* SIM_BAND_NUMBER: overhead_points is the error; SIM_BAND_BOUND: the
   * publication gave only an upper bound, overhead_points % */
  int32_t overhead_kind;
  double overhead_points;
  /* the publication the row counts as, for independence: its source, or
   * the first of a series of PRs that share one setting */
  const char *publication;
} sim_band_row;
/* A run whose simulated overhead is this or more is copy-bound: its copies
 * do not hide behind compute (the class the validation's large overhead
 * errors fall in). */
#define SIM_BAND_COPY_BOUND_PCT 5.0
/* Long context: this sequence length or more, or context parallelism. */
#define SIM_BAND_LONG_SEQ 16384
/* The rows; their number. */
FERRY_API int sim_band_rows(const sim_band_row **rows);

/* What a simulated run is, as far as the trace and the options say: GPUs
 * (0 not known), compiled (1), eager (0) or not known (-1), sequence length
 * (0 not known) and context parallelism, its simulated overhead, and
 * whether it offloads optimizer states or weights (no published run does). */
typedef struct sim_run_class {
  int gpus, compiled, seq, cp;
  double overhead_pct;
  int other_offload;
} sim_run_class;
/* The attributes, in the order they are given up when too few rows share
 * them all: compiled first, copy-bound last. */
enum {
  SIM_BAND_ATTR_COMPILED = 1,
  SIM_BAND_ATTR_GPUS = 2,
  SIM_BAND_ATTR_LONG = 4,
  SIM_BAND_ATTR_COPY = 8
};
/* The error band of one figure (SIM_BAND_MEMORY: memory saved;
 * SIM_BAND_OVERHEAD: step overhead) over the published runs like this one:
 * the rows that share every attribute in matched with the run, lo..hi the
 * least and most error in points over the runs that gave a number, bounds
 * the runs that gave only a bound (bounds_inside: the simulated figure
 * within it). all: fewer than two publications were alike even on
 * copy-bound alone, so every row counts. like: the shared attributes in words. */
enum { SIM_BAND_MEMORY = 0, SIM_BAND_OVERHEAD = 1 };
typedef struct sim_band {
  /* publications: the distinct publications among the runs (the rows'
   * publication): a publication's runs share its hardware and harness, so
   * they are not independent; two publications, not two runs, make a band */
  int runs, publications, bounds, bounds_inside, all;
  double lo, hi;
  unsigned matched;
  uint32_t rows;     /* bit i: row i counted (a number or a bound) */
  uint32_t numbered; /* bit i: row i counted with a number */
  char like[128];
} sim_band;
/* The class of run i (rs[0] the baseline) of a report. */
FERRY_API void sim_run_class_of(const sim_run_info *info, const sim_result *rs, int i,
                                sim_run_class *c);
FERRY_API void sim_band_pick(const sim_run_class *c, int figure, sim_band *out);
/* "-0.6 to +2.7 points, 5 runs (8 GPUs, short context) -> 57.4% to 60.7%":
 * the band of figure value (memory saved %, or overhead %), where a real
 * run like those would have landed. */
FERRY_API void sim_band_text(const sim_band *b, int figure, double value, char *buf, size_t n);
/* The bands of every policy of a report, as a block of the text report. */
FERRY_API void sim_print_bands(FILE *f, const sim_run_info *info, const sim_result *rs, int n);

/* One self-contained page (no script, font or URL loaded): the comparison
 * table, the text report, the SVG inline and per-layer bars of bytes
 * offloaded and kept per policy. */
FERRY_API int sim_write_html(const char *path, const sim_run_info *info, const sim_result *rs,
                             int n, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
