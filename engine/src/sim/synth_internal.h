/*
 * synth_internal.h — what the trace synthesizer's files share: a block as ops
 * (saved tensors, transients), the buffer ids and the model's derived sizes.
 * synth_model.c: presets, validation, parameters; synth_ops.c: the model as
 * ops and checkpointing; trace_synth.c: the writer (docs/internals.md).
 */
#ifndef FERRY_SYNTH_INTERNAL_H
#define FERRY_SYNTH_INTERNAL_H

#include <stdint.h>
#include <stdio.h>

#include "ferry.h"
#include "ferry_tools.h"

#define MAX_SAVES 6
#define MAX_OUTS 2
#define MAX_TMPS 4
#define SYNTH_MIN_OP_US 4.0

typedef struct saved {
  int buf;       /* layer-local activation buffer (equal ids are one buffer); -1: a parameter */
  int ndim;
  int64_t shape[4];
  int dtype;
  int kind;
  unsigned group; /* SYNTH_RECOMPUTE_* that drops it under selective */
  int model_wide; /* one tensor of the whole model (the rotary tables): packed by the first
                     layer that saves it, an alias in the later ones */
} saved;

/* How torchtitan's per-op selective checkpointing treats an op's output
 * (torchtitan/distributed/activation_checkpoint.py, _save_list in
 * models/llama3/infra/parallelize.py; see docs/sim-synth.md). */
enum {
  SAC_NONE = 0,     /* not in the save list: recomputed */
  SAC_MM,           /* aten.mm (a bias-free Linear): saved unless it is an even one */
  SAC_SAVE,         /* SDPA flash/efficient attention: saved */
  SAC_FORCE_RECOMP  /* the MoE router's gate: forced to recompute, not counted */
};

/* Device memory an op allocates that autograd does not save (an `alloc`
 * event to its `free`), by when it lives. */
enum {
  TMP_WORK = 1, /* during its forward compute (a workspace, or a tensor it saves after) */
  TMP_OUT,      /* its output, from its forward to the end of forward (the loss returns) */
  TMP_GRAD,     /* backward: the gradient of its input, until the op below consumed it */
  TMP_RING      /* around each of its computes, forward, recompute and backward (ring
                   attention's K/V receive buffers) */
};

typedef struct transient {
  int life; /* TMP_* */
  uint64_t bytes;
  const char *what;
} transient;

typedef struct op {
  char suffix[96];    /* its name: its compute events' ("self_attn.q_proj") */
  char mod[96];       /* the module path below the layer its packs carry (has_mod; else
                         the suffix): an op that runs in its module's own forward, such as
                         attention in "self_attn" or the MLP's product in "mlp" */
  int has_mod;
  const char *cls;
  const char *label;  /* its compute events' name, if not the suffix */
  double flops, bytes; /* forward */
  int own_bwd;        /* backward costs bwd_flops/bwd_bytes, not twice the forward */
  double bwd_flops, bwd_bytes;
  int n_tmps;
  transient tmps[MAX_TMPS];
  unsigned rgroup;    /* SYNTH_RECOMPUTE_* region it belongs to (Megatron selective) */
  int sac;            /* SAC_* */
  int n_outs;
  saved outs[MAX_OUTS]; /* what it returns: what per-op SAC keeps when it saves the op */
  int n_saves;
  saved saves[MAX_SAVES]; /* what autograd saves for its backward */
  int64_t extra_wgrad; /* weight-gradient elements its backward writes beyond its saved
                          parameters' (the embedding's table, Liger's grad_weight) */
  int wgrad_handed;    /* its weight gradient is a saved tensor handed over (Liger's
                          grad_weight): it appears as that is released, after the op */
} op;

typedef struct op_list {
  op *ops;
  int n, cap;
  int n_bufs; /* activation buffer ids are < n_bufs */
} op_list;

static inline int64_t head_dim_of(const synth_model *m) {
  return m->head_dim > 0 ? m->head_dim : (m->heads > 0 ? m->hidden / m->heads : 0);
}
static inline int64_t expert_ffn_of(const synth_model *m) { return m->expert_ffn > 0 ? m->expert_ffn : m->ffn; }

static inline int64_t tp_of(const synth_model *m) { return m->tp > 1 ? m->tp : 1; }
static inline int param_dtype_of(const synth_model *m) { return m->param_dtype ? m->param_dtype : m->dtype; }
static inline int grad_dtype_of(const synth_model *m) { return m->grad_dtype ? m->grad_dtype : param_dtype_of(m); }
/* An fp32 master copy: asked for, or by default when the parameters are 16-bit
 * (fp32 parameters are their own master copy). */
static inline int master_of(const synth_model *m) {
  if (m->master_weights == SYNTH_MASTER_AUTO) return ferry_dtype_size(param_dtype_of(m)) < 4;
  return m->master_weights == SYNTH_MASTER_ON;
}

/* Tokens per rank outside the tensor-parallel region (norms, dropouts, the
 * region's inputs): all of them, or 1/t with sequence parallelism. */
static inline int64_t cp_of(const synth_model *m) { return m->cp > 1 ? m->cp : 1; }
/* Tokens of the sequence one context-parallel rank holds (ring attention:
 * seq / cp; all of them without). */
static inline int64_t seq_local_of(const synth_model *m) { return m->seq / cp_of(m); }
static inline int64_t seq_region_of(const synth_model *m) {
  return m->sp ? seq_local_of(m) / tp_of(m) : seq_local_of(m);
}
static inline int ulysses_of(const synth_model *m) { return m->cp > 1 && m->cp_impl == SYNTH_CP_ULYSSES; }
static inline int64_t vocab_local_of(const synth_model *m) { return (m->vocab + tp_of(m) - 1) / tp_of(m); }

enum { /* layer-local activation buffers */
  B_X, B_XN1, B_Q, B_K, B_V, B_KREP, B_VREP, B_ATTN, B_H1, B_XN2, B_GATE, B_ACT, B_UP, B_PROD,
  B_QKV, B_SOFT32, B_PROBS, B_DMASK, B_DOUT, B_AMASK, B_FC1, B_GELU, B_MMASK, B_LSE, B_RSTD1,
  B_RSTD2, B_QP, B_KP, B_QRSTD, B_KRSTD, B_OP, B_DOWN, B_FC2, B_SCORES, B_RLOGITS, B_RPROBS,
  B_RIDX, B_RW, B_RDEN, B_COS, B_SIN, B_X32_1, B_NRM1, B_X32_2, B_NRM2, B_QX32, B_QNRM, B_KX32,
  B_KNRM, B_UOUT, B_DENSE_END,
  /* expert e's buffers: B_DENSE_END + e * EB_N + EB_* */
  EB_IDX = 0, EB_SLOT, EB_IN, EB_GATE, EB_ACT, EB_UP, EB_PROD, EB_DOWN, EB_RW, EB_N
};
#define B_PARAM (-1)

/* The sizes one block's ops are written in. */
typedef struct layer_shape {
  int64_t b, s, h, a, d, kv, qd, kvd, f; /* batch, sequence, hidden, heads, head dim, kv heads,
                                            q width (a d), kv width, ffn */
  int64_t E, k, fe;                      /* experts, top-k, expert ffn */
  int64_t ss;                            /* sequence outside the TP region (sp: s / t) */
  int64_t skv, cp;                       /* keys each query attends over (cp: all of the
                                            sequence, s x cp); the context-parallel degree */
  int ulysses;                           /* cp by Ulysses' all-to-alls, not a ring */
  double tokens, stokens, e;             /* b * s; b * ss; bytes per element */
  int dt, llama, qwen, mixtral;          /* the model's dtype; Llama (else GPT-2); Hugging
                                            Face's Qwen3 or Mixtral class and module names */
  int moe, norm;                         /* experts; SYNTH_NORM_* */
} layer_shape;

#define ACT FERRY_KIND_ACTIVATION
#define PARAM FERRY_KIND_PARAMETER
#define F32 FERRY_DTYPE_F32
#define I64 FERRY_DTYPE_I64

/* Hugging Face class names (hf_class). */
enum { CLS_NORM, CLS_ATTN, CLS_MLP, CLS_EXPERT, CLS_MOE, CLS_LM };

/* Buffer ids of the ops after the blocks (model.norm, head, loss). */
#define POST_BUFS 16

/* synth_ops.c */
saved sv(int buf, int dtype, int kind, unsigned group, int ndim, int64_t a, int64_t b, int64_t c, int64_t d);
saved svd(int buf, int dtype, int kind, unsigned group, int nd, const int64_t *dims);
const char *hf_class(int arch, int qk_norm, int experts, int what);
const char *op_module(const op *o);
int layer_ops(const synth_model *m, op_list *l);
int pre_ops(const synth_model *m, op_list *l);
int post_ops(const synth_model *m, op_list *l);
void op_list_free(op_list *l);
int group_drops_something(const op_list *l, unsigned g);
uint64_t saved_bytes(const saved *x);
int layer_mode(const synth_model *m, int L);
void sac_keep(const op_list *l, unsigned char *keep);
int ckpt_impl_of(const synth_model *m);
const char *ckpt_impl_name(int impl);
int hook_sees_kept(const synth_model *m);
int hook_sees_recomputed(const synth_model *m);
/* FSDP's units' sizes per tensor-parallel rank, as torchtitan wraps them
 * (fully_shard on the embedding, on each block, on the final norm with the
 * head): the parameters each all-gathers, and those whose gradients it
 * reduce-scatters. Tied embeddings: the embedding, the final norm and the
 * head are one unit (embed; head 0), FSDP2 keeping a shared parameter in
 * one group. */
typedef struct unit_sizes {
  uint64_t embed, block, head;                /* parameters gathered */
  uint64_t embed_grad, block_grad, head_grad; /* parameters with a gradient */
} unit_sizes;

/* synth_model.c */
void unit_sizes_of(const synth_model *m, unit_sizes *u);
uint64_t trained_of(const synth_model *m, uint64_t n);
uint64_t sharded_grad_bytes(const synth_model *m, uint64_t n);
uint64_t op_weight_elems(const op *o);
uint64_t layer_matrices(const synth_model *m, int active);
uint64_t layer_norms(const synth_model *m);
uint64_t final_norm_params(const synth_model *m);
double optimizer_step_bytes(const synth_model *m, const synth_resident *r);

/* FSDP's units (synth_comm.c): one list, as torchtitan wraps the model,
 * drives both the gathered parameters' memory (alloc and free lines) and the
 * communication lane's all-gathers and reduce-scatters, so the two cannot
 * disagree. Unit 0 is the embedding, 1 + L block L, 1 + layers the final
 * norm with the head. */
#define UNIT_EMBED 0
#define UNIT_BLOCK(L) (1 + (L))
#define UNIT_HEAD(m) (1 + (m)->layers)

typedef struct fsdp_unit {
  const char *what;          /* its gathered copy's alloc name */
  int layer;                 /* its collectives' layer: the block's; -1 for the root's units */
  uint64_t gather_bytes;     /* its parameters in the gather dtype (FSDP2's param_dtype: the
                                compute one), the tensor-parallel rank's share */
  uint64_t grad_params;      /* its parameters with a gradient, before sharding */
  int reshard_after_forward; /* freed when its forward returns (else kept for backward) */
  int tied;                  /* the head's unit with tied embeddings: the embedding's unit */
  uint64_t deferred[8];      /* the tied unit's head gradients, reduce-scattered with the
                                embedding's after its backward */
  int n_deferred;
  uint64_t mem;              /* in a step: its gathered copy's alloc id (0: sharded) */
  uint64_t ag, rs;           /* its all-gather issued and not waited for; its reduce-scatter */
} fsdp_unit;

/* The collectives of a step (synth_comm.c): FSDP's gathers and
 * reduce-scatters per unit, tensor parallelism's exchanges. */
typedef struct synth_comm {
  const synth_model *m;
  FILE *f;
  uint64_t next;      /* the last collective id written */
  uint64_t *alloc_id; /* the writer's id counter, for the units' alloc lines */
  uint64_t tp_bytes;  /* a TP exchange */
  uint64_t ulysses_q, ulysses_kv; /* Ulysses: a rank's q (or attention output), k or v */
  fsdp_unit *units;   /* [layers + 2] (NULL: not sharded) */
  int n_units;
} synth_comm;
int synth_comm_init(synth_comm *c, const synth_model *m, FILE *f, uint64_t *alloc_id);
void synth_comm_free(synth_comm *c);
void fsdp_prefetch(synth_comm *c, int unit);   /* gathered ahead: alloc, all-gather issued */
void fsdp_unshard(synth_comm *c, int unit);    /* needed now: the compute waits for its gather */
void fsdp_post_forward(synth_comm *c, int unit); /* freed if it reshards after forward */
void fsdp_reshard(synth_comm *c, int unit);
/* After a unit's backward: its gradients reduce-scattered, the rank's
 * shard allocated (its id returned, 0 if none), the unsharded ones
 * (unsharded[n]) freed. */
uint64_t fsdp_reduce_scatter(synth_comm *c, int unit, uint64_t *unsharded, int n);
void synth_comm_tp_exchange(synth_comm *c, int layer); /* two synchronous TP exchanges */
/* Ulysses' four synchronous all-to-alls around a block's attention (q, k,
 * v in, the output out; in backward their gradients the other way). */
void synth_comm_ulysses_exchange(synth_comm *c, int layer);
void synth_comm_backward_end(synth_comm *c);

#endif
