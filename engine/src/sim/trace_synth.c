/*
 * trace_synth.c — the trace synthesizer (declared in ferry_tools.h).
 * How it works: docs/internals.md#trace_synthc; the model, the presets and
 * the checkpointing modes with their sources: docs/simulator.md.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
 * models/llama3/infra/parallelize.py; see docs/simulator.md). */
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
  TMP_GRAD      /* backward: the gradient of its input, until the op below consumed it */
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
} op;

typedef struct op_list {
  op *ops;
  int n, cap;
  int n_bufs; /* activation buffer ids are < n_bufs */
} op_list;

/* ---- presets ------------------------------------------------------------------ */
static void defaults(synth_model *m) {
  memset(m, 0, sizeof *m);
  m->seq = 8192;
  m->micro_batch = 1;
  m->dtype = FERRY_DTYPE_BF16;
  m->flash = 1;
  m->checkpoint = SYNTH_CKPT_OFF;
  m->ckpt_every = 1;
  m->recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  m->shard = 8;
  m->tflops = 400;
  m->hbm_gbps = 2000;
  m->steps = 1;
  m->tp = 1;
}

int synth_preset(const char *name, synth_model *m) {
  defaults(m);
  snprintf(m->name, sizeof m->name, "%s", name ? name : "");
  if (!name) return -1;
  /* Public shapes: Llama 3 model cards / config.json; GPT-3 paper table 2.1. */
  if (!strcmp(name, "llama3-8b")) {
    m->arch = SYNTH_LLAMA;
    m->layers = 32, m->hidden = 4096, m->heads = 32, m->kv_heads = 8, m->ffn = 14336;
    m->vocab = 128256;
  } else if (!strcmp(name, "llama3-70b")) {
    m->arch = SYNTH_LLAMA;
    m->layers = 80, m->hidden = 8192, m->heads = 64, m->kv_heads = 8, m->ffn = 28672;
    m->vocab = 128256;
  } else if (!strcmp(name, "qwen3-8b")) {
    /* https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json: hidden_size 4096,
     * num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8,
     * head_dim 128, intermediate_size 12288, vocab_size 151936,
     * tie_word_embeddings false; QK-norm (Qwen3RMSNorm q_norm, k_norm over
     * head_dim). Model card: 8.2B parameters. */
    m->arch = SYNTH_LLAMA;
    m->layers = 36, m->hidden = 4096, m->heads = 32, m->kv_heads = 8, m->head_dim = 128;
    m->ffn = 12288, m->vocab = 151936, m->qk_norm = 1;
  } else if (!strcmp(name, "qwen3-14b")) {
    /* https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json: hidden_size 5120,
     * num_hidden_layers 40, num_attention_heads 40, num_key_value_heads 8,
     * head_dim 128, intermediate_size 17408, vocab_size 151936,
     * tie_word_embeddings false; QK-norm. Model card: 14.8B parameters. */
    m->arch = SYNTH_LLAMA;
    m->layers = 40, m->hidden = 5120, m->heads = 40, m->kv_heads = 8, m->head_dim = 128;
    m->ffn = 17408, m->vocab = 151936, m->qk_norm = 1;
  } else if (!strcmp(name, "qwen3-30b-a3b")) {
    /* https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: hidden_size
     * 2048, num_hidden_layers 48, num_attention_heads 32 (x head_dim 128 = 4096,
     * wider than hidden), num_key_value_heads 4, num_experts 128,
     * num_experts_per_tok 8, moe_intermediate_size 768, decoder_sparse_step 1
     * and mlp_only_layers [] (every layer MoE, no shared expert),
     * norm_topk_prob true, vocab_size 151936, tie_word_embeddings false;
     * QK-norm. Model card: 30.5B parameters in total, 3.3B activated. */
    m->arch = SYNTH_LLAMA;
    m->layers = 48, m->hidden = 2048, m->heads = 32, m->kv_heads = 4, m->head_dim = 128;
    m->ffn = 6144, m->vocab = 151936, m->qk_norm = 1;
    m->experts = 128, m->top_k = 8, m->expert_ffn = 768;
  } else if (!strcmp(name, "mixtral-8x7b")) {
    /* https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json:
     * hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
     * num_key_value_heads 8, intermediate_size 14336 (each expert),
     * num_local_experts 8, num_experts_per_tok 2, vocab_size 32000,
     * tie_word_embeddings false. https://mistral.ai/news/mixtral-of-experts/:
     * 46.7B parameters in total, 12.9B used per token. */
    m->arch = SYNTH_LLAMA;
    m->layers = 32, m->hidden = 4096, m->heads = 32, m->kv_heads = 8, m->ffn = 14336;
    m->vocab = 32000, m->experts = 8, m->top_k = 2;
  } else if (!strcmp(name, "gpt3-1.3b")) {
    m->arch = SYNTH_GPT;
    m->layers = 24, m->hidden = 2048, m->heads = 16, m->kv_heads = 16, m->ffn = 8192;
    m->vocab = 50257, m->seq = 2048;
  } else if (!strcmp(name, "tiny")) { /* for tests: small and fast */
    m->arch = SYNTH_LLAMA;
    m->layers = 4, m->hidden = 256, m->heads = 4, m->kv_heads = 2, m->ffn = 512;
    m->vocab = 1024, m->seq = 256, m->shard = 1;
  } else {
    return -1;
  }
  return 0;
}

const char *synth_preset_names(void) {
  return "llama3-8b, llama3-70b, qwen3-8b, qwen3-14b, qwen3-30b-a3b, mixtral-8x7b, gpt3-1.3b, tiny";
}

static int64_t head_dim_of(const synth_model *m) {
  return m->head_dim > 0 ? m->head_dim : (m->heads > 0 ? m->hidden / m->heads : 0);
}

int64_t synth_loss_chunk(const synth_model *m) {
  const int64_t tokens = (int64_t)m->micro_batch * m->seq;
  if (m->loss_chunk > 0) return m->loss_chunk < tokens ? m->loss_chunk : tokens;
  /* Liger's fused_linear_cross_entropy_forward: inc_factor = cdiv(V, H),
   * chunk_size = next_power_of_2(cdiv(BT, inc_factor)): a chunk's logits
   * about the size of the hidden states */
  const int64_t inc = ((int64_t)m->vocab + m->hidden - 1) / (m->hidden > 0 ? m->hidden : 1);
  const int64_t want = (tokens + inc - 1) / (inc > 0 ? inc : 1);
  int64_t p = 1;
  while (p < want) p <<= 1;
  return p < tokens ? p : tokens;
}

static int64_t expert_ffn_of(const synth_model *m) { return m->expert_ffn > 0 ? m->expert_ffn : m->ffn; }

static int64_t tp_of(const synth_model *m) { return m->tp > 1 ? m->tp : 1; }
static int param_dtype_of(const synth_model *m) { return m->param_dtype ? m->param_dtype : m->dtype; }
static int grad_dtype_of(const synth_model *m) { return m->grad_dtype ? m->grad_dtype : param_dtype_of(m); }
/* An fp32 master copy: asked for, or by default when the parameters are 16-bit
 * (fp32 parameters are their own master copy). */
static int master_of(const synth_model *m) {
  if (m->master_weights == SYNTH_MASTER_AUTO) return ferry_dtype_size(param_dtype_of(m)) < 4;
  return m->master_weights == SYNTH_MASTER_ON;
}

/* Tokens per rank outside the tensor-parallel region (norms, dropouts, the
 * region's inputs): all of them, or 1/t with sequence parallelism. */
static int64_t seq_region_of(const synth_model *m) { return m->sp ? m->seq / tp_of(m) : m->seq; }
static int64_t vocab_local_of(const synth_model *m) { return (m->vocab + tp_of(m) - 1) / tp_of(m); }

static int layer_ops(const synth_model *m, op_list *l);
static void op_list_free(op_list *l) {
  free(l->ops);
  l->ops = NULL;
  l->n = l->cap = 0;
}

/* Whether some save of the layer belongs to group g (a selective group that
 * drops nothing would be a silent no-op). */
static int group_drops_something(const op_list *l, unsigned g) {
  for (int i = 0; i < l->n; i++)
    for (int k = 0; k < l->ops[i].n_saves; k++)
      if (l->ops[i].saves[k].group & g) return 1;
  return 0;
}

#define BAD(...) \
  do { \
    if (err && errlen) snprintf(err, errlen, __VA_ARGS__); \
    return -1; \
  } while (0)

static int is_float_dtype(int dt) {
  return dt == FERRY_DTYPE_BF16 || dt == FERRY_DTYPE_F16 || dt == FERRY_DTYPE_F32;
}

/* The resident knobs: dtypes, master weights, optimizer, LoRA share. */
static int validate_training(const synth_model *m, char *err, size_t errlen) {
  if (m->param_dtype && !is_float_dtype(m->param_dtype)) BAD("param dtype must be bf16, f16 or f32");
  if (m->grad_dtype && !is_float_dtype(m->grad_dtype)) BAD("grad dtype must be bf16, f16 or f32");
  if (m->master_weights < SYNTH_MASTER_AUTO || m->master_weights > SYNTH_MASTER_OFF) BAD("bad master weights");
  if (m->master_weights == SYNTH_MASTER_ON && ferry_dtype_size(param_dtype_of(m)) >= 4)
    BAD("master weights on: the parameters are fp32 already (they are the master copy)");
  if (m->optimizer < SYNTH_OPT_ADAMW || m->optimizer > SYNTH_OPT_NONE) BAD("bad optimizer");
  if (!(m->lora >= 0 && m->lora <= 1)) BAD("lora %g must be a share within 0..1 (0: all trained)", m->lora);
  return 0;
}

/* Megatron tensor (and sequence) parallelism: heads, KV heads and the FFN
 * split evenly; MoE and the fused chunked loss are not modeled with it. */
static int validate_tp(const synth_model *m, char *err, size_t errlen) {
  const int t = m->tp;
  if (t < 0 || t > 1 << 16) BAD("tp %d must be within 1..65536", t);
  if (t > 1 && (m->heads % t || m->kv_heads % t))
    BAD("tp %d must divide heads %d and kv heads %d (Megatron splits attention by head; "
        "replicated KV heads are not modeled)", t, m->heads, m->kv_heads);
  if (t > 1 && m->ffn % t) BAD("tp %d must divide ffn %d", t, m->ffn);
  if (t > 1 && m->experts) BAD("tp with experts is not modeled (expert or tensor parallel MoE)");
  if (t > 1 && m->loss == SYNTH_LOSS_CHUNKED)
    BAD("tp with the chunked loss is not modeled (Megatron's loss is vocab-parallel: use --loss full)");
  if (m->sp && t < 2) BAD("sequence parallelism needs tp > 1");
  if (m->sp && m->seq % t) BAD("sp: tp %d must divide seq %d", t, m->seq);
  return 0;
}

int synth_validate(const synth_model *m, char *err, size_t errlen) {
  if (m->arch != SYNTH_LLAMA && m->arch != SYNTH_GPT) BAD("arch must be llama or gpt");
  if (m->layers < 1 || m->layers > 10000) BAD("layers %d must be within 1..10000", m->layers);
  if (m->hidden < 1 || m->hidden > 1 << 20) BAD("hidden %d must be within 1..1048576", m->hidden);
  if (m->head_dim < 0 || m->head_dim > 1 << 16) BAD("head dim %d must be within 1..65536", m->head_dim);
  if (m->heads < 1 || m->heads > 1 << 16) BAD("heads %d must be within 1..65536", m->heads);
  if (!m->head_dim && m->hidden % m->heads)
    BAD("heads %d must divide hidden %d (or give --head-dim)", m->heads, m->hidden);
  if ((int64_t)m->heads * head_dim_of(m) > 1 << 22) BAD("heads x head dim must be at most 4194304");
  if (m->kv_heads < 1 || m->heads % m->kv_heads)
    BAD("kv heads %d must divide heads %d", m->kv_heads, m->heads);
  if (m->arch == SYNTH_GPT && m->kv_heads != m->heads) BAD("gpt has kv heads = heads");
  if (m->arch == SYNTH_GPT && (m->qk_norm || m->experts))
    BAD("gpt has no QK-norm and no experts here (--arch llama has both)");
  if (m->ffn < 1 || m->ffn > 1 << 22) BAD("ffn %d must be within 1..4194304", m->ffn);
  if (m->experts < 0 || m->experts > 4096) BAD("experts %d must be within 0..4096", m->experts);
  if (m->experts && (m->top_k < 1 || m->top_k > m->experts))
    BAD("top-k %d must be within 1..experts (%d)", m->top_k, m->experts);
  if (!m->experts && (m->top_k || m->expert_ffn))
    BAD("%s %d needs experts (a dense model has none)", m->top_k ? "top-k" : "expert ffn",
        m->top_k ? m->top_k : m->expert_ffn);
  if (m->expert_ffn < 0 || m->expert_ffn > 1 << 22) BAD("expert ffn %d must be within 1..4194304", m->expert_ffn);
  if (m->vocab < 1 || m->vocab > 1 << 24) BAD("vocab %d must be within 1..16777216", m->vocab);
  if (m->seq < 1 || m->seq > 1 << 24) BAD("seq %d must be within 1..16777216", m->seq);
  if (m->micro_batch < 1 || m->micro_batch > 65536) BAD("micro-batch %d must be within 1..65536", m->micro_batch);
  if (ferry_dtype_size(m->dtype) < 1 || m->dtype == FERRY_DTYPE_BOOL ||
      m->dtype >= FERRY_DTYPE_I64)
    BAD("dtype must be a floating-point type");
  if (m->checkpoint < SYNTH_CKPT_OFF || m->checkpoint > SYNTH_CKPT_SELECTIVE_OP) BAD("bad checkpoint mode");
  if (m->checkpoint == SYNTH_CKPT_FULL && (m->ckpt_every < 1 || m->ckpt_every > m->layers))
    BAD("full:%d: K must be within 1..layers (%d); a larger K checkpoints no layer", m->ckpt_every,
        m->layers);
  if (m->checkpoint != SYNTH_CKPT_FULL && m->ckpt_every != 1)
    BAD("a checkpointing frequency (full:K) needs full checkpointing");
  if (m->loss != SYNTH_LOSS_FULL && m->loss != SYNTH_LOSS_CHUNKED) BAD("loss must be full or chunked");
  if (m->loss_chunk && m->loss != SYNTH_LOSS_CHUNKED) BAD("a chunk size (chunked:N) needs the chunked loss");
  if (m->loss_chunk < 0 || (int64_t)m->loss_chunk > (int64_t)m->micro_batch * m->seq)
    BAD("chunked:%d: N must be within 1..tokens (micro-batch x seq = %lld)", m->loss_chunk,
        (long long)m->micro_batch * m->seq);
  if (m->shard < 1 || m->shard > 1 << 20) BAD("shard %d must be >= 1", m->shard);
  if (!(m->tflops > 0 && m->tflops < 1e6)) BAD("tflops must be > 0");
  if (!(m->hbm_gbps > 0 && m->hbm_gbps < 1e7)) BAD("hbm bandwidth must be > 0");
  if (m->steps < 1 || m->steps > 1000000) BAD("steps %d must be within 1..1000000", m->steps);
  if (m->norm != SYNTH_NORM_FUSED && m->norm != SYNTH_NORM_EAGER) BAD("norm must be fused or eager");
  if (m->arch == SYNTH_GPT && m->norm == SYNTH_NORM_EAGER)
    BAD("--norm eager is for RMSNorm (llama arch); gpt's LayerNorm is one native op "
        "(native_layer_norm) on every device");
  if (validate_training(m, err, errlen) || validate_tp(m, err, errlen)) return -1;
  double widest = m->ffn > m->vocab ? m->ffn : m->vocab;
  if ((double)m->heads * (double)head_dim_of(m) > widest) widest = (double)m->heads * (double)head_dim_of(m);
  double per_tensor = (double)m->micro_batch * m->seq * widest * 4;
  double s2 = (double)m->micro_batch * m->heads * (double)m->seq * m->seq * 4;
  if (per_tensor > 1e15 || (!m->flash && s2 > 1e15)) BAD("tensors would exceed 1 PB: shape too large");
  if (m->checkpoint == SYNTH_CKPT_SELECTIVE) {
    if (!m->recompute || (m->recompute & ~(unsigned)(SYNTH_RECOMPUTE_ATTN_CORE | SYNTH_RECOMPUTE_MLP_ACT)))
      BAD("selective checkpointing needs groups to recompute (attn_core, mlp_act)");
    op_list l = {0};
    if (layer_ops(m, &l)) BAD("out of memory");
    int core_empty = (m->recompute & SYNTH_RECOMPUTE_ATTN_CORE) &&
                     !group_drops_something(&l, SYNTH_RECOMPUTE_ATTN_CORE);
    int act_empty = (m->recompute & SYNTH_RECOMPUTE_MLP_ACT) &&
                    !group_drops_something(&l, SYNTH_RECOMPUTE_MLP_ACT);
    op_list_free(&l);
    if (core_empty)
      BAD("selective checkpointing recomputes the attention core (Megatron-LM: its s^2 "
          "softmax and dropout tensors); FlashAttention has no s^2 tensor to drop, so it would "
          "change nothing: use selective-op (torchtitan's per-op policy), full or full:K, or "
          "--flash off");
    if (act_empty) BAD("selective:mlp_act drops nothing in this model");
  }
  return 0;
#undef BAD
}

/* ---- the model as ops ----------------------------------------------------------- */
static saved sv(int buf, int dtype, int kind, unsigned group, int ndim, int64_t a, int64_t b,
                int64_t c, int64_t d) {
  saved s = {.buf = buf, .ndim = ndim, .dtype = dtype, .kind = kind, .group = group};
  s.shape[0] = a, s.shape[1] = b, s.shape[2] = c, s.shape[3] = d;
  return s;
}

/* A saved tensor of nd (<= 4) dimensions given as an array. */
static saved svd(int buf, int dtype, int kind, unsigned group, int nd, const int64_t *dims) {
  saved s = {.buf = buf, .ndim = nd, .dtype = dtype, .kind = kind, .group = group};
  for (int i = 0; i < nd; i++) s.shape[i] = dims[i];
  return s;
}

static op *add_op(op_list *l, const char *suffix, const char *cls, double flops, double bytes) {
  op *o = &l->ops[l->n++]; /* layer_ops sized the list for the model */
  memset(o, 0, sizeof *o);
  snprintf(o->suffix, sizeof o->suffix, "%s", suffix);
  o->cls = cls;
  o->flops = flops;
  o->bytes = bytes;
  return o;
}

/* The op runs in module `mod`'s own forward (its packs carry that path,
 * class cls); its compute events keep the op's name. */
static void in_module(op *o, const char *mod, const char *cls) {
  snprintf(o->mod, sizeof o->mod, "%s", mod);
  o->has_mod = 1;
  o->cls = cls;
}

static const char *op_module(const op *o) { return o->has_mod ? o->mod : o->suffix; }

static void save(op *o, saved s) { o->saves[o->n_saves++] = s; }
static void out(op *o, int sac, saved s) {
  o->sac = sac;
  o->outs[o->n_outs++] = s;
}

enum { /* layer-local activation buffers */
  B_X, B_XN1, B_Q, B_K, B_V, B_KREP, B_VREP, B_ATTN, B_H1, B_XN2, B_GATE, B_ACT, B_UP, B_PROD,
  B_QKV, B_SOFT32, B_PROBS, B_DMASK, B_DOUT, B_AMASK, B_FC1, B_GELU, B_MMASK, B_LSE, B_RSTD1,
  B_RSTD2, B_QP, B_KP, B_QRSTD, B_KRSTD, B_OP, B_DOWN, B_FC2, B_SCORES, B_RLOGITS, B_RPROBS,
  B_RIDX, B_RW, B_RDEN, B_COS, B_SIN, B_X32_1, B_NRM1, B_X32_2, B_NRM2, B_QX32, B_QNRM, B_KX32,
  B_KNRM, B_DENSE_END,
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
  double tokens, stokens, e;             /* b * s; b * ss; bytes per element */
  int dt, llama, qwen, mixtral;          /* the model's dtype; Llama (else GPT-2); Hugging
                                            Face's Qwen3 or Mixtral class and module names */
  int moe, norm;                         /* experts; SYNTH_NORM_* */
} layer_shape;

#define ACT FERRY_KIND_ACTIVATION
#define PARAM FERRY_KIND_PARAMETER
#define F32 FERRY_DTYPE_F32
#define I64 FERRY_DTYPE_I64

/* Hugging Face's class names of the llama architecture's families: Llama,
 * Qwen3 (QK-norm), Qwen3Moe (QK-norm and experts), Mixtral (experts). */
enum { CLS_NORM, CLS_ATTN, CLS_MLP, CLS_EXPERT, CLS_MOE, CLS_LM };
static const char *hf_class(int arch, int qk_norm, int experts, int what) {
  static const char *const names[4][6] = {
      {"LlamaRMSNorm", "LlamaAttention", "LlamaMLP", "LlamaMLP", "LlamaMLP", "LlamaForCausalLM"},
      {"Qwen3RMSNorm", "Qwen3Attention", "Qwen3MLP", "Qwen3MLP", "Qwen3MLP", "Qwen3ForCausalLM"},
      {"Qwen3MoeRMSNorm", "Qwen3MoeAttention", "Qwen3MoeMLP", "Qwen3MoeMLP",
       "Qwen3MoeSparseMoeBlock", "Qwen3MoeForCausalLM"},
      {"MixtralRMSNorm", "MixtralAttention", "MixtralBlockSparseTop2MLP",
       "MixtralBlockSparseTop2MLP", "MixtralSparseMoeBlock", "MixtralForCausalLM"}};
  if (arch != SYNTH_LLAMA) return what == CLS_NORM ? "LayerNorm" : what == CLS_LM ? "GPTModel" : "GPTBlock";
  return names[qk_norm ? (experts ? 2 : 1) : (experts ? 3 : 0)][what];
}
static const char *ls_class(const layer_shape *ls, int what) {
  return hf_class(ls->llama ? SYNTH_LLAMA : SYNTH_GPT, ls->qwen, (int)ls->moe, what);
}
static const char *norm_cls(const layer_shape *ls) { return ls_class(ls, CLS_NORM); }

/* Bytes per element an eager RMSNorm moves beyond a fused one's read and
 * write (2e): the casts to fp32 and back (none in fp32), pow, mean, x * rstd,
 * weight * that. */
static double eager_norm_extra(double e) {
  const double casts = e < 4 ? 2 * (e + 4) : 0; /* to fp32 and back: read one, write the other */
  return casts + 8 /* pow */ + 4 /* mean */ + 8 /* x * rstd */;
}

/* What an RMSNorm over the last dimension of x (nd dims, model dtype dt)
 * saves. Fused, one kernel (torch's _fused_rms_norm, derivatives.yaml: input,
 * weight and result1, the rstd; Liger's LigerRMSNormFunction:
 * save_for_backward(X, W, RSTD)): x, its rstd (fp32, the last dim 1), the
 * weight. Eager, Hugging Face's LlamaRMSNorm.forward as written
 * (x.to(float32); pow(2) saves its input; mean saves nothing; rsqrt saves
 * its result; x * rstd saves both; .to(dtype) saves nothing; weight * that
 * saves both): the fp32 x (x itself when the model is fp32, else a copy),
 * rstd, the two again (aliases), the normalized tensor in the model dtype,
 * the weight. */
static void rms_norm_saves(op *o, int norm, int dt, int x, int x32, int nrm, int rstd, int nd,
                           const int64_t *dims) {
  int64_t sd[4];
  memcpy(sd, dims, (size_t)nd * sizeof *sd);
  sd[nd - 1] = 1;
  if (norm == SYNTH_NORM_EAGER) {
    const int xb = dt == F32 ? x : x32;
    save(o, svd(xb, F32, ACT, 0, nd, dims));    /* pow */
    save(o, svd(rstd, F32, ACT, 0, nd, sd));    /* rsqrt's result */
    save(o, svd(rstd, F32, ACT, 0, nd, sd));    /* x * rstd: both */
    save(o, svd(xb, F32, ACT, 0, nd, dims));
    save(o, svd(nrm, dt, ACT, 0, nd, dims));    /* weight * normalized: both */
    save(o, sv(B_PARAM, dt, PARAM, 0, 1, dims[nd - 1], 0, 0, 0));
    return;
  }
  save(o, svd(x, dt, ACT, 0, nd, dims));
  save(o, svd(rstd, F32, ACT, 0, nd, sd));
  save(o, sv(B_PARAM, dt, PARAM, 0, 1, dims[nd - 1], 0, 0, 0));
}

/* An RMSNorm op's forward bytes: fused, read x and write y (2e per
 * element, plus what the caller adds); eager, its six kernels. */
static double rms_norm_bytes(int norm, double elements, double e, double fused) {
  return fused + (norm == SYNTH_NORM_EAGER ? elements * eager_norm_extra(e) : 0);
}

/* A Linear (no bias: mm; with one: addmm, the same saves) on rows of x:
 * F.linear folds the batch into the rows, so autograd saves the input as the
 * 2-D matrix mm multiplies (tokens x in) and the weight as its transpose
 * (in x out, a view of the parameter): derivatives.yaml's mm saves self and
 * mat2. */
static void linear_saves(op *o, int dt, int in_buf, int64_t rows, int64_t in, int64_t out_w) {
  save(o, sv(in_buf, dt, ACT, 0, 2, rows, in, 0, 0));
  save(o, sv(B_PARAM, dt, PARAM, 0, 2, in, out_w, 0, 0));
}

/* Hugging Face's apply_rotary_pos_emb in the attention's forward:
 * q * cos + rotate_half(q) * sin, the same for k. mul saves the other
 * operand only where the gradient needs it: cos and sin (1, 1, s, d, model
 * dtype: LlamaRotaryEmbedding's tables, made once per forward by the model),
 * for q and again for k. One tensor for the whole model: the first layer
 * packs it, the others alias it. */
static void rotary_saves(op *o, const layer_shape *ls) {
  for (int k = 0; k < 2; k++) {
    saved c = sv(B_COS, ls->dt, ACT, 0, 4, 1, 1, ls->s, ls->d), n = c;
    n.buf = B_SIN;
    c.model_wide = n.model_wide = 1;
    save(o, c);
    save(o, n);
  }
}

/* The input norm and the q/k/v (Llama) or fused qkv (GPT-2) projections;
 * Qwen3's QK-norm: an RMSNorm over head_dim on q (after q_proj) and on k
 * (after k_proj), as Qwen3Attention.forward runs them. */
static void attention_in_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h, qd = ls->qd, kvd = ls->kvd, ss = ls->ss;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  const int64_t rows = b * ss; /* the TP region's input (sp: this rank's share, gathered in
                                  backward) */
  op *o;
  /* norm: input, statistics (rstd; LayerNorm also the mean), weight */
  o = add_op(l, "input_layernorm", norm_cls(ls), 0,
             rms_norm_bytes(ls->norm, ls->stokens * h, e, 2 * ls->stokens * h * e));
  if (ls->llama) {
    const int64_t dims[3] = {b, ss, h};
    rms_norm_saves(o, ls->norm, dt, B_X, B_X32_1, B_NRM1, B_RSTD1, 3, dims);
  } else {
    save(o, sv(B_X, dt, ACT, 0, 3, b, ss, h, 0));
    save(o, sv(B_RSTD1, F32, ACT, 0, 3, b, ss, 2, 0));
    save(o, sv(B_PARAM, dt, PARAM, 0, 1, h, 0, 0, 0));
  }
  if (ls->llama) {
    const int64_t qdims[4] = {b, s, ls->a, ls->d}, kdims[4] = {b, s, ls->kv, ls->d};
    o = add_op(l, "self_attn.q_proj", "Linear", 2 * tokens * h * qd, (tokens * h + h * qd + tokens * qd) * e);
    linear_saves(o, dt, B_XN1, rows, h, qd);
    out(o, SAC_MM, sv(B_QP, dt, ACT, 0, 3, b, s, qd, 0));
    if (ls->qwen) {
      /* q_norm over head_dim on q_proj's output seen as (b, s, heads, head_dim) */
      o = add_op(l, "self_attn.q_norm", norm_cls(ls), 0,
                 rms_norm_bytes(ls->norm, tokens * qd, e, 2 * tokens * qd * e));
      rms_norm_saves(o, ls->norm, dt, B_QP, B_QX32, B_QNRM, B_QRSTD, 4, qdims);
    }
    o = add_op(l, "self_attn.k_proj", "Linear", 2 * tokens * h * kvd, (tokens * h + h * kvd + tokens * kvd) * e);
    linear_saves(o, dt, B_XN1, rows, h, kvd);
    out(o, SAC_MM, sv(B_KP, dt, ACT, 0, 3, b, s, kvd, 0));
    if (ls->qwen) {
      o = add_op(l, "self_attn.k_norm", norm_cls(ls), 0,
                 rms_norm_bytes(ls->norm, tokens * kvd, e, 2 * tokens * kvd * e));
      rms_norm_saves(o, ls->norm, dt, B_KP, B_KX32, B_KNRM, B_KRSTD, 4, kdims);
    }
    o = add_op(l, "self_attn.v_proj", "Linear", 2 * tokens * h * kvd, (tokens * h + h * kvd + tokens * kvd) * e);
    linear_saves(o, dt, B_XN1, rows, h, kvd);
    out(o, SAC_MM, sv(B_V, dt, ACT, 0, 3, b, s, kvd, 0));
    /* rotary embedding: element-wise in the attention's forward; saves the
     * cos/sin tables */
    o = add_op(l, "self_attn.rotary_emb", "", 0, 4 * tokens * (qd + kvd) * e);
    in_module(o, "self_attn", ls_class(ls, CLS_ATTN));
    rotary_saves(o, ls);
  } else {
    /* fused q, k, v (GPT: kv width = q width, qd per tensor-parallel rank) */
    o = add_op(l, "self_attn.qkv_proj", "Linear", 2 * tokens * h * 3 * qd,
               (tokens * h + 3 * tokens * qd + 3 * h * qd) * e);
    linear_saves(o, dt, B_XN1, rows, h, 3 * qd);
    out(o, SAC_MM, sv(B_QKV, dt, ACT, 0, 3, b, s, 3 * qd, 0));
  }
}

/* Attention itself: flash (saves q, k, v, out, lse) or eager (scores,
 * softmax, context; the probabilities recomputable). The eager ops are
 * Megatron's "core attention" (group attn_core). */
static void attention_core_ops(layer_shape *ls, int flash, op_list *l) {
  const int64_t b = ls->b, s = ls->s, qd = ls->qd;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int llama = ls->llama;
  const int64_t a = ls->a, d = ls->d, kvd = ls->kvd;
  const unsigned CORE = SYNTH_RECOMPUTE_ATTN_CORE;
  if (flash) {
    /* SDPA flash: q, k, v, output and the log-sum-exp; recomputes the rest
     * (derivatives.yaml: _scaled_dot_product_flash_attention, and
     * _scaled_dot_product_flash_attention_for_cpu, which torch 2.x's SDPA
     * runs on the CPU; GQA's k and v keep their kv heads). The CUDA kernel
     * also keeps its rng state, a few bytes, not counted. */
    o = add_op(l, "self_attn.attention", "FlashAttention", 2 * tokens * s * qd, (2 * tokens * qd + 2 * tokens * kvd) * e);
    if (llama) in_module(o, "self_attn", ls_class(ls, CLS_ATTN));
    save(o, sv(B_Q, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(B_K, dt, ACT, 0, 4, b, kvd / d, s, d));
    save(o, sv(B_V, dt, ACT, 0, 4, b, kvd / d, s, d));
    save(o, sv(B_ATTN, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(B_LSE, F32, ACT, 0, 3, b, a, s, 0));
    out(o, SAC_SAVE, sv(B_ATTN, dt, ACT, 0, 4, b, a, s, d));
    out(o, SAC_SAVE, sv(B_LSE, F32, ACT, 0, 3, b, a, s, 0));
  } else if (llama) {
    /* Hugging Face's eager_attention_forward: repeat_kv copies k and v to
     * every head (GQA; itself when kv heads = heads), matmul(q, k^T) runs as
     * bmm on (b a) batches and saves both (q, s x d; k^T, d x s), the scaling
     * and the mask save nothing, softmax in fp32 saves its result, .to(dtype)
     * copies it (none in fp32: the same tensor), dropout with p = 0 saves
     * nothing, matmul(probs, v) saves both. */
    const char *acls = ls_class(ls, CLS_ATTN);
    const int kbuf = kvd == qd ? B_K : B_KREP, vbuf = kvd == qd ? B_V : B_VREP;
    const int64_t ba = b * a;
    o = add_op(l, "self_attn.scores", "MatMul", 2 * tokens * s * qd, (2 * tokens * qd + b * a * s * s) * e);
    in_module(o, "self_attn", acls);
    o->rgroup = CORE;
    save(o, sv(B_Q, dt, ACT, 0, 3, ba, s, d, 0));
    save(o, sv(kbuf, dt, ACT, 0, 3, ba, d, s, 0));
    o = add_op(l, "self_attn.softmax", "Softmax", 0, (double)b * a * s * s * (e + 4 + 4 + e));
    in_module(o, "self_attn", acls);
    o->rgroup = CORE;
    save(o, sv(B_SOFT32, F32, ACT, CORE, 4, b, a, s, s));
    o = add_op(l, "self_attn.context", "MatMul", 2 * tokens * s * qd, (2 * tokens * qd + b * a * s * s) * e);
    in_module(o, "self_attn", acls);
    o->rgroup = CORE;
    save(o, sv(dt == F32 ? B_SOFT32 : B_PROBS, dt, ACT, CORE, 3, ba, s, s, 0));
    save(o, sv(vbuf, dt, ACT, 0, 3, ba, s, d, 0));
  } else {
    o = add_op(l, "self_attn.scores", "MatMul", 2 * tokens * s * qd, (2 * tokens * qd + b * a * s * s) * e);
    o->rgroup = CORE;
    save(o, sv(B_Q, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(B_K, dt, ACT, 0, 4, b, a, s, d));
    o = add_op(l, "self_attn.softmax", "Softmax", 0, 2.0 * b * a * s * s * e);
    o->rgroup = CORE;
    save(o, sv(B_PROBS, dt, ACT, CORE, 4, b, a, s, s));
    o = add_op(l, "self_attn.attention_dropout", "Dropout", 0, 3.0 * b * a * s * s * e);
    o->rgroup = CORE;
    save(o, sv(B_DMASK, FERRY_DTYPE_BOOL, ACT, CORE, 4, b, a, s, s));
    o = add_op(l, "self_attn.context", "MatMul", 2 * tokens * s * qd, (2 * tokens * qd + b * a * s * s) * e);
    o->rgroup = CORE;
    save(o, sv(B_DOUT, dt, ACT, CORE, 4, b, a, s, s));
    save(o, sv(B_V, dt, ACT, 0, 4, b, a, s, d));
  }
}

/* The output projection, its dropout (GPT-2) and the post-attention norm. */
static void attention_out_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h, qd = ls->qd, ss = ls->ss;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  /* its input: the attention's output, (b, s, heads, d) to (b s, heads d);
   * flash's output is laid out so already (the same buffer), eager's is
   * copied (.transpose(1, 2).contiguous()), a buffer of its own */
  o = add_op(l, "self_attn.o_proj", "Linear", 2 * tokens * qd * h, (tokens * qd + qd * h + tokens * h) * e);
  linear_saves(o, dt, B_ATTN, b * s, qd, h);
  out(o, SAC_MM, sv(B_OP, dt, ACT, 0, 3, b, s, h, 0));
  if (!ls->llama) {
    o = add_op(l, "self_attn.resid_dropout", "Dropout", 0, 3 * ls->stokens * h * e);
    save(o, sv(B_AMASK, FERRY_DTYPE_BOOL, ACT, 0, 3, b, ss, h, 0));
  }
  o = add_op(l, "post_attention_layernorm", norm_cls(ls), 0,
             rms_norm_bytes(ls->llama ? ls->norm : SYNTH_NORM_FUSED, ls->stokens * h, e,
                            3 * ls->stokens * h * e));
  if (ls->llama) {
    const int64_t dims[3] = {b, ss, h};
    rms_norm_saves(o, ls->norm, dt, B_H1, B_X32_2, B_NRM2, B_RSTD2, 3, dims);
  } else {
    save(o, sv(B_H1, dt, ACT, 0, 3, b, ss, h, 0));
    save(o, sv(B_RSTD2, F32, ACT, 0, 3, b, ss, 2, 0));
    save(o, sv(B_PARAM, dt, PARAM, 0, 1, h, 0, 0, 0));
  }
}

/* A gated MLP on `tokens` rows, as Hugging Face's LlamaMLP.forward runs it:
 * down_proj(act_fn(gate_proj(x)) * up_proj(x)), so gate, SiLU, up, the
 * product (in the MLP module's own forward: its packs carry its path), down.
 * Llama's, or one expert's. buf[] names its buffers: input, gate, act, up,
 * product, down; lin[] its Linear modules: gate, up, down (Mixtral's
 * experts: w1, w3, w2); prefix is the MLP module's path with a dot, cls its
 * class. */
static const char *const LLAMA_LINEARS[3] = {"gate_proj", "up_proj", "down_proj"};
static const char *const MIXTRAL_LINEARS[3] = {"w1", "w3", "w2"};
static void gated_mlp_ops(layer_shape *ls, op_list *l, const char *prefix, const char *cls,
                          const int buf[6], const char *const lin[3], double tokens, int64_t f,
                          int ndim, int64_t d0, int64_t d1, int64_t d1_in) {
  const int64_t h = ls->h;
  const double e = ls->e;
  const int dt = ls->dt;
  char name[96], mod[96];
  op *o;
  /* a row shape: (b, s, n) for the dense MLP, (rows, n) for an expert */
#define ROWS_OF(d1_, buf_, n_, grp_) \
  sv(buf_, dt, ACT, grp_, ndim, d0, ndim == 3 ? (d1_) : (n_), ndim == 3 ? (n_) : 0, 0)
#define ROWS(buf_, n_, grp_) ROWS_OF(d1, buf_, n_, grp_)
  /* the Linears' inputs as mm sees them: (rows, n); the dense MLP's input
   * is the TP region's (sequence parallel: this rank's share) */
  const int64_t in_rows = ndim == 3 ? d0 * d1_in : d0, rows = ndim == 3 ? d0 * d1 : d0;
  snprintf(name, sizeof name, "%s%s", prefix, lin[0]);
  o = add_op(l, name, "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  linear_saves(o, dt, buf[0], in_rows, h, f);
  out(o, SAC_MM, ROWS(buf[1], f, 0));
  snprintf(name, sizeof name, "%sact_fn", prefix);
  o = add_op(l, name, "SiLU", 0, 2 * tokens * f * e);
  o->rgroup = SYNTH_RECOMPUTE_MLP_ACT;
  save(o, ROWS(buf[1], f, 0));
  snprintf(name, sizeof name, "%s%s", prefix, lin[1]);
  o = add_op(l, name, "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  linear_saves(o, dt, buf[0], in_rows, h, f);
  out(o, SAC_MM, ROWS(buf[3], f, 0));
  snprintf(name, sizeof name, "%smul", prefix);
  snprintf(mod, sizeof mod, "%.*s", (int)strlen(prefix) - 1, prefix);
  o = add_op(l, name, "Mul", 0, 3 * tokens * f * e);
  in_module(o, mod, cls);
  save(o, ROWS(buf[2], f, SYNTH_RECOMPUTE_MLP_ACT));
  save(o, ROWS(buf[3], f, 0));
  snprintf(name, sizeof name, "%s%s", prefix, lin[2]);
  o = add_op(l, name, "Linear", 2 * tokens * f * h, (tokens * f + f * h + tokens * h) * e);
  linear_saves(o, dt, buf[4], rows, f, h);
  out(o, SAC_MM, ROWS(buf[5], h, 0));
#undef ROWS
#undef ROWS_OF
}

/* Llama's gated MLP: gate, up, SiLU, product, down. */
static void mlp_llama_ops(layer_shape *ls, op_list *l) {
  static const int buf[6] = {B_XN2, B_GATE, B_ACT, B_UP, B_PROD, B_DOWN};
  gated_mlp_ops(ls, l, "mlp.", ls_class(ls, CLS_MLP), buf, LLAMA_LINEARS, ls->tokens, ls->f, 3, ls->b,
                ls->s, ls->ss);
}

/* A sparse MoE block as Hugging Face's Qwen3MoeSparseMoeBlock (transformers
 * 4.51; MixtralSparseMoeBlock is the same loop, module "block_sparse_moe",
 * experts' Linears w1, w3, w2) runs it: the router (gate Linear, softmax in
 * fp32, top-k, the top-k weights renormalized), then each expert on its
 * tokens (gathered by index), its output scaled by the routing weight and
 * index_add-ed back. The tokens are split evenly: T k / E per expert (the
 * first T k mod E experts one more). */
static void mlp_moe_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h, E = ls->E, k = ls->k, fe = ls->fe;
  const int64_t T = b * s;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  const char *moe = ls->mixtral ? "block_sparse_moe" : "mlp";
  /* the router's element-wise ops, the gathers, the scaling and index_add
   * run in the sparse block's own forward: its packs carry its path */
  const char *bcls = ls_class(ls, CLS_MOE), *ecls = ls_class(ls, CLS_EXPERT);
  char name[96];
  op *o;
  snprintf(name, sizeof name, "%s.gate", moe);
  o = add_op(l, name, "Linear", 2 * tokens * h * E, (tokens * h + h * E + tokens * E) * e);
  linear_saves(o, dt, B_XN2, T, h, E);
  out(o, SAC_FORCE_RECOMP, sv(B_RLOGITS, dt, ACT, 0, 2, T, E, 0, 0));
  snprintf(name, sizeof name, "%s.softmax", moe);
  o = add_op(l, name, "Softmax", 0, tokens * E * (e + 4));
  in_module(o, moe, bcls);
  save(o, sv(B_RPROBS, F32, ACT, 0, 2, T, E, 0, 0));
  snprintf(name, sizeof name, "%s.topk", moe);
  o = add_op(l, name, "TopK", 0, tokens * E * 4 + tokens * k * 12);
  in_module(o, moe, bcls);
  save(o, sv(B_RIDX, I64, ACT, 0, 2, T, k, 0, 0));
  snprintf(name, sizeof name, "%s.norm_topk", moe);
  o = add_op(l, name, "Div", 0, tokens * k * 12 + tokens * 4);
  in_module(o, moe, bcls);
  save(o, sv(B_RW, F32, ACT, 0, 2, T, k, 0, 0));
  save(o, sv(B_RDEN, F32, ACT, 0, 2, T, 1, 0, 0));
  const int64_t per = T * k / E, extra = T * k % E;
  for (int64_t x = 0; x < E; x++) {
    const int64_t t = per + (x < extra);
    const double rows = (double)t;
    const int base = B_DENSE_END + (int)x * EB_N;
    char prefix[48];
    snprintf(prefix, sizeof prefix, "%s.experts.%lld.", moe, (long long)x);
    /* current_state = hidden_states[top_x]: the index op keeps top_x */
    snprintf(name, sizeof name, "%s.experts.%lld", moe, (long long)x);
    o = add_op(l, name, "Index", 0, 2 * rows * h * e + 8 * rows);
    in_module(o, moe, bcls);
    save(o, sv(base + EB_IDX, I64, ACT, 0, 1, t, 0, 0, 0));
    const int buf[6] = {base + EB_IN, base + EB_GATE, base + EB_ACT, base + EB_UP, base + EB_PROD,
                        base + EB_DOWN};
    gated_mlp_ops(ls, l, prefix, ecls, buf, ls->mixtral ? MIXTRAL_LINEARS : LLAMA_LINEARS, rows, fe, 2,
                  t, 0, 0);
    /* * routing_weights[top_x, idx, None] (indices and the bf16 weights kept),
     * then final.index_add_(0, top_x, ...) (top_x kept) */
    snprintf(name, sizeof name, "%s.experts.%lld.scale", moe, (long long)x);
    o = add_op(l, name, "Mul", 0, 3 * rows * h * e + 16 * rows);
    in_module(o, moe, bcls);
    save(o, sv(base + EB_DOWN, dt, ACT, 0, 2, t, h, 0, 0));
    save(o, sv(base + EB_RW, dt, ACT, 0, 2, t, 1, 0, 0));
    save(o, sv(base + EB_IDX, I64, ACT, 0, 1, t, 0, 0, 0));
    save(o, sv(base + EB_SLOT, I64, ACT, 0, 1, t, 0, 0, 0));
    snprintf(name, sizeof name, "%s.experts.%lld.index_add", moe, (long long)x);
    o = add_op(l, name, "IndexAdd", 0, 3 * rows * h * e);
    in_module(o, moe, bcls);
    save(o, sv(base + EB_IDX, I64, ACT, 0, 1, t, 0, 0, 0));
  }
}

/* GPT-2's MLP: fc1, GELU, fc2, dropout. */
static void mlp_gpt_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h, ss = ls->ss;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int64_t f = ls->f;
  o = add_op(l, "mlp.fc1", "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  linear_saves(o, dt, B_XN2, b * ss, h, f);
  out(o, SAC_MM, sv(B_FC1, dt, ACT, 0, 3, b, s, f, 0));
  o = add_op(l, "mlp.act", "GELU", 0, 2 * tokens * f * e);
  o->rgroup = SYNTH_RECOMPUTE_MLP_ACT;
  save(o, sv(B_FC1, dt, ACT, 0, 3, b, s, f, 0));
  o = add_op(l, "mlp.fc2", "Linear", 2 * tokens * f * h, (tokens * f + f * h + tokens * h) * e);
  save(o, sv(B_GELU, dt, ACT, SYNTH_RECOMPUTE_MLP_ACT, 2, b * s, f, 0, 0));
  save(o, sv(B_PARAM, dt, PARAM, 0, 2, f, h, 0, 0));
  out(o, SAC_MM, sv(B_FC2, dt, ACT, 0, 3, b, s, h, 0));
  o = add_op(l, "mlp.dropout", "Dropout", 0, 3 * ls->stokens * h * e);
  save(o, sv(B_MMASK, FERRY_DTYPE_BOOL, ACT, 0, 3, b, ss, h, 0));
}

/* One repeated block (-1 out of memory). */
static int layer_ops(const synth_model *m, op_list *l) {
  layer_shape ls;
  const int64_t t = tp_of(m);
  /* one tensor-parallel rank's share (Megatron: heads and the FFN split by
   * t; with sequence parallelism the rest of the sequence too) */
  ls.b = m->micro_batch;
  ls.s = m->seq;
  ls.ss = seq_region_of(m);
  ls.h = m->hidden;
  ls.a = m->heads / t;
  ls.d = head_dim_of(m);
  ls.kv = m->kv_heads / t;
  ls.qd = ls.a * ls.d;
  ls.kvd = ls.kv * ls.d;
  ls.f = m->ffn / t;
  ls.E = m->experts;
  ls.k = m->top_k;
  ls.fe = expert_ffn_of(m);
  ls.tokens = (double)ls.b * (double)ls.s;
  ls.stokens = (double)ls.b * (double)ls.ss;
  ls.e = ferry_dtype_size(m->dtype);
  ls.dt = m->dtype;
  ls.llama = m->arch == SYNTH_LLAMA;
  ls.qwen = ls.llama && m->qk_norm;
  ls.mixtral = ls.llama && !m->qk_norm && m->experts;
  ls.moe = m->experts > 0;
  ls.norm = m->norm;
  l->n = 0;
  l->cap = 24 + (m->experts > 0 ? 4 + 8 * m->experts : 0);
  l->n_bufs = B_DENSE_END + (m->experts > 0 ? m->experts : 0) * EB_N;
  l->ops = malloc((size_t)l->cap * sizeof *l->ops);
  if (!l->ops) return -1;
  attention_in_ops(&ls, l);
  attention_core_ops(&ls, m->flash, l);
  attention_out_ops(&ls, l);
  if (!ls.llama) mlp_gpt_ops(&ls, l);
  else if (ls.E) mlp_moe_ops(&ls, l);
  else mlp_llama_ops(&ls, l);
  return 0;
}

/* Before and after the blocks: embedding; final norm, head and loss. */
static int pre_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = m->seq, h = m->hidden;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  l->n = 0, l->cap = 1, l->n_bufs = 1;
  if (!(l->ops = malloc(sizeof *l->ops))) return -1;
  op *o = add_op(l, "model.embed_tokens", "Embedding", 0, tokens * h * e + tokens * 8);
  save(o, sv(0, I64, ACT, 0, 2, b, s, 0, 0));
  return 0;
}

static void tmp(op *o, int life, uint64_t bytes, const char *what) {
  o->tmps[o->n_tmps++] = (transient){life, bytes, what};
}

/* Hugging Face's causal-LM loss (transformers' LlamaForCausalLM.forward and
 * loss_utils.ForCausalLMLoss): logits = lm_head(h) in the model dtype;
 * logits.float(); cross_entropy = log_softmax + nll_loss. Autograd saves
 * lm_head's input and weight, log_softmax's output (fp32) and nll_loss's
 * input (the same buffer) and labels; the logits and their fp32 copy are
 * not saved but live until the loss returns (end of forward). Backward:
 * nll_loss's gradient (fp32, dense), log_softmax's (fp32) while the saved
 * log-probabilities are still held, then the copy back to the model dtype.
 * With tensor parallelism each rank holds V / t of the vocabulary
 * (Megatron's column-parallel head and vocab-parallel cross-entropy, whose
 * saved softmax and labels have these sizes too).
 *
 * The loss runs in the model's own forward (LlamaForCausalLM.forward calls
 * self.loss_function), so its packs carry the model's root path "" and its
 * class. The labels are padded by one and shifted (loss_utils:
 * nn.functional.pad(labels, (0, 1)), labels[..., 1:]), then everything is
 * flattened: the log-probabilities are (T, V), the labels (T), and
 * nll_loss also saves its total_weight, an fp32 scalar (derivatives.yaml:
 * nll_loss_forward's backward takes self, target and total_weight). */
static void loss_full_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = m->seq, h = m->hidden, V = vocab_local_of(m), T = b * s;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  const uint64_t logits = (uint64_t)(tokens * (double)V);
  const int dt = m->dtype;
  const char *root = hf_class(m->arch, m->qk_norm, m->experts, CLS_LM);
  op *o = add_op(l, "lm_head", "Linear", 2 * tokens * h * V, (tokens * h + h * V + tokens * V) * e);
  linear_saves(o, dt, 3, b * seq_region_of(m), h, V);
  tmp(o, TMP_OUT, logits * (uint64_t)e, "lm_head: logits");
  o = add_op(l, "loss", "", 0, tokens * V * (e + 4));
  in_module(o, "", root);
  o->label = "loss.float";
  if (dt != F32) { /* in fp32, .float() returns the logits: no copy either way */
    tmp(o, TMP_OUT, logits * 4, "loss: logits.float()");
    tmp(o, TMP_GRAD, logits * (uint64_t)e, "loss: grad of the logits (model dtype)");
  }
  o = add_op(l, "loss", "", 0, tokens * V * 8);
  in_module(o, "", root);
  o->label = "loss.log_softmax";
  save(o, sv(4, F32, ACT, 0, 2, T, V, 0, 0));
  tmp(o, TMP_GRAD, logits * 4, "loss: grad of the fp32 logits (log_softmax backward)");
  o = add_op(l, "loss", "", 0, tokens * 12);
  in_module(o, "", root);
  o->label = "loss.nll_loss";
  save(o, sv(4, F32, ACT, 0, 2, T, V, 0, 0)); /* nll_loss saves its input: an alias */
  save(o, sv(5, I64, ACT, 0, 1, T, 0, 0, 0));
  if (tp_of(m) == 1) save(o, sv(9, F32, ACT, 0, 0, 0, 0, 0, 0)); /* total_weight */
  tmp(o, TMP_GRAD, logits * 4, "loss: grad of the log-probabilities (nll_loss backward)");
}

/* A fused linear cross-entropy as Liger's LigerFusedLinearCrossEntropyLoss
 * runs it: grad_input and grad_weight are allocated (zeros), then per chunk
 * of tokens the logits chunk (model dtype) is computed, the cross-entropy
 * kernel turns it into its gradient in place, and the chunk's share of both
 * gradients is accumulated; ctx.save_for_backward keeps the two gradients.
 * Backward only scales them by the loss's gradient (skipped when it is 1). */
static void loss_chunked_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = m->seq, h = m->hidden, V = m->vocab;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  const uint64_t chunk = (uint64_t)synth_loss_chunk(m), ue = (uint64_t)e;
  const int dt = m->dtype;
  op *o = add_op(l, "loss", "LigerFusedLinearCrossEntropyLoss", 6 * tokens * h * V,
                 (3 * h * V + 2 * tokens * h + 3 * tokens * V) * e);
  o->own_bwd = 1, o->bwd_flops = 0, o->bwd_bytes = 0;
  tmp(o, TMP_WORK, (uint64_t)(tokens * (double)h) * ue, "loss: grad_input (until saved)");
  tmp(o, TMP_WORK, (uint64_t)V * (uint64_t)h * ue, "loss: grad_weight (until saved)");
  tmp(o, TMP_WORK, (uint64_t)tokens * 4, "loss: per-token losses (fp32)");
  tmp(o, TMP_WORK, chunk * (uint64_t)V * ue, "loss: logits of one chunk of tokens");
  save(o, sv(6, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(7, dt, ACT, 0, 2, V, h, 0, 0));
}

/* Buffer ids of the ops after the blocks (model.norm, head, loss). */
#define POST_BUFS 16

static int post_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = seq_region_of(m), h = m->hidden;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  const int dt = m->dtype;
  int llama = m->arch == SYNTH_LLAMA;
  const char *ncls = hf_class(m->arch, m->qk_norm, m->experts, CLS_NORM);
  l->n = 0, l->cap = 5, l->n_bufs = POST_BUFS;
  if (!(l->ops = malloc((size_t)l->cap * sizeof *l->ops))) return -1;
  op *o = add_op(l, "model.norm", ncls, 0,
                 rms_norm_bytes(llama ? m->norm : SYNTH_NORM_FUSED, tokens * h, e, 2 * tokens * h * e));
  if (llama) {
    /* buffers: 1 its input, 2 rstd, 8 the fp32 input, 10 the normalized tensor */
    const int64_t dims[3] = {b, s, h};
    rms_norm_saves(o, m->norm, dt, 1, 8, 10, 2, 3, dims);
  } else {
    save(o, sv(1, dt, ACT, 0, 3, b, s, h, 0));
    save(o, sv(2, F32, ACT, 0, 3, b, s, 2, 0));
    save(o, sv(B_PARAM, dt, PARAM, 0, 1, h, 0, 0, 0));
  }
  if (m->loss == SYNTH_LOSS_CHUNKED) loss_chunked_ops(m, l);
  else loss_full_ops(m, l);
  return 0;
}

static uint64_t saved_bytes(const saved *x) {
  uint64_t n = (uint64_t)ferry_dtype_size(x->dtype);
  for (int i = 0; i < x->ndim; i++) n *= (uint64_t)x->shape[i];
  return n;
}

/* ---- checkpointing ---------------------------------------------------------------- */
/* The mode layer L runs under: full:K checkpoints the layers whose 1-based
 * index is a multiple of K (torchtitan's ac_freq counts its wrapped blocks
 * from 1 and wraps those with count % ac_freq == 0); the others save
 * everything. */
static int layer_mode(const synth_model *m, int L) {
  if (m->checkpoint == SYNTH_CKPT_FULL) {
    int k = m->ckpt_every > 0 ? m->ckpt_every : 1;
    return (L + 1) % k == 0 ? SYNTH_CKPT_FULL : SYNTH_CKPT_OFF;
  }
  return m->checkpoint;
}

int synth_checkpointed_layers(const synth_model *m) {
  int n = 0;
  for (int L = 0; L < m->layers; L++) n += layer_mode(m, L) != SYNTH_CKPT_OFF;
  return n;
}

/* torchtitan's per-op policy over one block: keep[i] = 1 when op i's
 * outputs are saved. It counts aten.mm calls per block and forward
 * (meta["forward_mm_count"] += 1) and saves a save-list op's output unless
 * it is an mm with an even count: the 1st, 3rd, 5th... Linear are saved,
 * the 2nd, 4th... recomputed; SDPA's outputs are saved; the router's gate
 * is forced to recompute and not counted
 * (per_op_sac_force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]). */
static void sac_keep(const op_list *l, unsigned char *keep) {
  int mm = 0;
  for (int i = 0; i < l->n; i++) {
    const op *o = &l->ops[i];
    keep[i] = 0;
    if (o->sac == SAC_MM) keep[i] = ++mm % 2 == 1;
    else if (o->sac == SAC_SAVE) keep[i] = 1;
  }
}

/* Bytes of distinct activation buffers among l's saves; with drop, those
 * whose group is in drop are left out; without model_wide, the model-wide
 * ones (the rotary tables: a layer that is not the first to save them
 * aliases them). */
static uint64_t distinct_bytes(const op_list *l, unsigned drop, int model_wide) {
  unsigned char *seen = calloc((size_t)l->n_bufs, 1);
  if (!seen) return 0;
  uint64_t total = 0;
  for (int i = 0; i < l->n; i++)
    for (int k = 0; k < l->ops[i].n_saves; k++) {
      const saved *x = &l->ops[i].saves[k];
      if (x->kind != ACT || x->buf < 0 || seen[x->buf] || (x->group & drop)) continue;
      if (x->model_wide && !model_wide) continue;
      seen[x->buf] = 1;
      total += saved_bytes(x);
    }
  free(seen);
  return total;
}

uint64_t synth_layer_activation_bytes(const synth_model *m) {
  op_list l = {0};
  if (layer_ops(m, &l)) return 0;
  uint64_t total = distinct_bytes(&l, 0, 1);
  op_list_free(&l);
  return total;
}

/* The first layer whose forward packs its ops' saves (not a checkpointed
 * one): it packs the model-wide tensors, the later layers alias them. */
static int first_saving_layer(const synth_model *m) {
  for (int L = 0; L < m->layers; L++) {
    int mode = layer_mode(m, L);
    if (mode == SYNTH_CKPT_OFF || mode == SYNTH_CKPT_SELECTIVE) return L;
  }
  return -1;
}

uint64_t synth_layer_saved_bytes(const synth_model *m, int layer) {
  op_list l = {0};
  if (layer < 0 || layer >= m->layers || layer_ops(m, &l)) return 0;
  uint64_t total = 0;
  const uint64_t input = (uint64_t)m->micro_batch * (uint64_t)seq_region_of(m) *
                         (uint64_t)m->hidden * (uint64_t)ferry_dtype_size(m->dtype);
  switch (layer_mode(m, layer)) {
  case SYNTH_CKPT_FULL: total = input; break;
  case SYNTH_CKPT_SELECTIVE: total = distinct_bytes(&l, m->recompute, layer == first_saving_layer(m)); break;
  case SYNTH_CKPT_SELECTIVE_OP: {
    unsigned char *keep = malloc((size_t)l.n);
    if (!keep) break;
    sac_keep(&l, keep);
    total = input;
    for (int i = 0; i < l.n; i++)
      for (int k = 0; keep[i] && k < l.ops[i].n_outs; k++) total += saved_bytes(&l.ops[i].outs[k]);
    free(keep);
    break;
  }
  default: total = distinct_bytes(&l, 0, layer == first_saving_layer(m));
  }
  op_list_free(&l);
  return total;
}

/* ---- parameters ------------------------------------------------------------------- */
/* The weight matrices of one block; with active, the router and top_k
 * experts only. */
static uint64_t layer_matrices(const synth_model *m, int active) {
  const uint64_t h = (uint64_t)m->hidden, qd = (uint64_t)m->heads * (uint64_t)head_dim_of(m);
  const uint64_t kvd = (uint64_t)m->kv_heads * (uint64_t)head_dim_of(m), f = (uint64_t)m->ffn;
  if (m->arch != SYNTH_LLAMA) return 4 * h * h + 2 * h * f;
  uint64_t attn = h * qd + 2 * h * kvd + qd * h;
  if (!m->experts) return attn + 3 * h * f;
  uint64_t n = active ? (uint64_t)m->top_k : (uint64_t)m->experts;
  return attn + h * (uint64_t)m->experts + n * 3 * h * (uint64_t)expert_ffn_of(m);
}

/* Per block, the norms' weights (two; QK-norm: two of head_dim; LayerNorm:
 * weight and bias); tensor parallelism replicates them. */
static uint64_t layer_norms(const synth_model *m) {
  const uint64_t h = (uint64_t)m->hidden;
  uint64_t norms = m->arch == SYNTH_LLAMA ? 2 * h : 4 * h;
  if (m->qk_norm) norms += 2 * (uint64_t)head_dim_of(m);
  return norms;
}

static uint64_t layer_params(const synth_model *m, int active) {
  return layer_matrices(m, active) + layer_norms(m);
}

static uint64_t params(const synth_model *m, int active) {
  const uint64_t h = (uint64_t)m->hidden, V = (uint64_t)m->vocab;
  return V * h /* embedding */ + (uint64_t)m->layers * layer_params(m, active) +
         2 * h /* final norm */ + (m->tie_embeddings ? 0 : V * h) /* head */;
}

uint64_t synth_param_count(const synth_model *m) { return params(m, 0); }
uint64_t synth_active_param_count(const synth_model *m) { return params(m, 1); }

/* What one tensor-parallel rank holds (Megatron): the blocks' linears split
 * t ways (column- and row-parallel), the embedding and the head by
 * vocabulary (V / t rows, rounded up), the norms replicated. */
static uint64_t local_params(const synth_model *m) {
  const uint64_t h = (uint64_t)m->hidden, t = (uint64_t)tp_of(m), V = (uint64_t)vocab_local_of(m);
  return V * h + (uint64_t)m->layers * (layer_matrices(m, 0) / t + layer_norms(m)) + 2 * h +
         (m->tie_embeddings ? 0 : V * h);
}

/* Optimizer state bytes per trainable parameter, whole bytes: the states
 * are in the dtype of the copy stepped (torch's AdamW and SGD keep
 * exp_avg, exp_avg_sq and momentum_buffer like their parameter): fp32 with
 * master weights, else the parameters'. 8-bit AdamW (bitsandbytes) keeps
 * two uint8 states whatever the copy; its block scales are apart. */
static uint64_t state_bytes(const synth_model *m) {
  const uint64_t el = master_of(m) ? 4 : (uint64_t)ferry_dtype_size(param_dtype_of(m));
  switch (m->optimizer) {
  case SYNTH_OPT_ADAMW: return 2 * el;
  case SYNTH_OPT_ADAMW_8BIT: return 2;
  case SYNTH_OPT_SGD_MOMENTUM: return el;
  default: return 0; /* sgd, none */
  }
}

double synth_optimizer_state_bytes(const synth_model *m) { return (double)state_bytes(m); }

const char *synth_optimizer_name(int optimizer) {
  static const char *const names[] = {"adamw", "adamw8bit", "sgd", "sgd-momentum", "none"};
  return optimizer >= 0 && optimizer <= SYNTH_OPT_NONE ? names[optimizer] : "unknown";
}

int synth_optimizer_parse(const char *name) {
  for (int i = 0; i <= SYNTH_OPT_NONE; i++)
    if (!strcmp(name, synth_optimizer_name(i))) return i;
  return -1;
}

/* bitsandbytes' blockwise 8-bit states: an fp32 absmax per block of 256
 * values, for each of the two states. */
#define BNB_BLOCK 256

/* Per GPU: the stored parameters (all of them), and for the trainable
 * share the gradients, the fp32 master weights and the optimizer states,
 * each divided by the sharding degree (FSDP / ZeRO-3); sharded training
 * also holds the gathered compute copies of two blocks (the one computing,
 * the one prefetched). Mixed-precision AdamW by default: 2 + 2 + 4 + 8 =
 * 16 bytes per parameter (the ZeRO paper's 16). */
void synth_resident_parts(const synth_model *m, synth_resident *r) {
  const uint64_t sh = (uint64_t)m->shard, P = local_params(m);
  const uint64_t T = m->lora > 0 ? (uint64_t)llround(m->lora * (double)P) : P;
  memset(r, 0, sizeof *r);
  r->local_params = P;
  r->trainable = T;
  r->params = P * (uint64_t)ferry_dtype_size(param_dtype_of(m)) / sh;
  r->grads = T * (uint64_t)ferry_dtype_size(grad_dtype_of(m)) / sh;
  r->master = master_of(m) ? T * 4 / sh : 0;
  uint64_t scales = m->optimizer == SYNTH_OPT_ADAMW_8BIT ? 2 * 4 * ((T + BNB_BLOCK - 1) / BNB_BLOCK) : 0;
  r->states = (T * state_bytes(m) + scales) / sh;
  r->gathered = sh > 1 ? 2 * (layer_matrices(m, 0) / (uint64_t)tp_of(m)) *
                             (uint64_t)ferry_dtype_size(m->dtype) : 0;
  r->total = r->params + r->grads + r->master + r->states + r->gathered;
  r->layer_params = (layer_matrices(m, 0) / (uint64_t)tp_of(m) + layer_norms(m)) *
                    (uint64_t)ferry_dtype_size(param_dtype_of(m)) / sh;
}

uint64_t synth_resident_bytes(const synth_model *m) {
  synth_resident r;
  synth_resident_parts(m, &r);
  return r.total;
}

/* The optimizer step reads and writes every byte the trainable share keeps
 * (parameters, gradients, master weights, states): 2 x 16 bytes per
 * parameter for mixed-precision AdamW; none without an optimizer. */
static double optimizer_step_bytes(const synth_model *m, const synth_resident *r) {
  if (m->optimizer == SYNTH_OPT_NONE) return 0;
  const double own = (double)r->trainable * ferry_dtype_size(param_dtype_of(m)) / (double)m->shard;
  return 2 * (own + (double)(r->grads + r->master + r->states));
}

/* ---- writing -------------------------------------------------------------------- */
typedef struct writer {
  const synth_model *m;
  FILE *f;
  uint64_t next_id;
  uint64_t step;
  uint64_t model_bufid[2]; /* this step's first forward packs of the rotary tables (B_COS, B_SIN) */
} writer;

static double op_us(const synth_model *m, const op *o) {
  double t_flops = o->flops / (m->tflops * 1e12);
  double t_bytes = o->bytes / (m->hbm_gbps * 1e9);
  double us = (t_flops > t_bytes ? t_flops : t_bytes) * 1e6;
  /* an eager op is at least a kernel launch or two */
  return us > SYNTH_MIN_OP_US ? us : SYNTH_MIN_OP_US;
}

/* An op's backward: twice its forward, or its own cost. */
static double bwd_us(const synth_model *m, const op *o) {
  if (!o->own_bwd) return 2 * op_us(m, o);
  op b = {.flops = o->bwd_flops, .bytes = o->bwd_bytes};
  return op_us(m, &b);
}

static const char *op_label(const op *o) { return o->label ? o->label : o->suffix; }

/* A compute event: us at the synthesizer's rates, and the work it stands
 * for (FLOPs, bytes through device memory, the least time: kernel
 * launches), so that `ferry sim` can time it on the simulated GPU instead. */
static void w_compute(writer *w, double us, int layer, const char *opname, double flops,
                      double bytes, double min_us) {
  if (us <= 0) return;
  fprintf(w->f,
          "{\"ev\":\"compute\",\"t_us\":0,\"us\":%.3f,\"flops\":%.9g,\"hbm_bytes\":%.9g,"
          "\"min_us\":%g,\"layer\":%d,\"op\":\"%s\"}\n",
          us, flops, bytes, min_us, layer, opname);
}

/* Op o run `times` times back to back (backward: twice its forward), as
 * one compute event named name (NULL: the op's own). */
static void w_op(writer *w, const op *o, int times, int layer, const char *name) {
  w_compute(w, times * op_us(w->m, o), layer, name ? name : o->suffix, times * o->flops,
            times * o->bytes, times * SYNTH_MIN_OP_US);
}

static void module_path(int layer, const char *suffix, char *buf, size_t n) {
  if (layer < 0) snprintf(buf, n, "%s", suffix);
  else if (!suffix[0]) snprintf(buf, n, "model.layers.%d", layer);
  else snprintf(buf, n, "model.layers.%d.%s", layer, suffix);
}

/* One pack line; alias_of 0 = a buffer of its own. Returns its id. */
static uint64_t w_pack(writer *w, const saved *x, int layer, int phase, const char *path,
                       const char *cls, uint64_t alias_of) {
  uint64_t id = ++w->next_id;
  fprintf(w->f,
          "{\"ev\":\"pack\",\"t_us\":0,\"id\":%llu,\"step\":%llu,\"bytes\":%llu,\"dtype\":\"%s\","
          "\"shape\":[",
          (unsigned long long)id, (unsigned long long)w->step, (unsigned long long)saved_bytes(x),
          ferry_dtype_name(x->dtype));
  for (int i = 0; i < x->ndim; i++) fprintf(w->f, i ? ",%lld" : "%lld", (long long)x->shape[i]);
  fprintf(w->f,
          "],\"kind\":\"%s\",\"phase\":\"%s\",\"layer\":%d,\"layers\":%d,\"flags\":2,"
          "\"module\":\"%s\",\"class\":\"%s\",\"decision\":\"keep\"",
          ferry_kind_name(x->kind), ferry_phase_name(phase), layer, w->m->layers, path, cls);
  if (alias_of) fprintf(w->f, ",\"alias\":true,\"alias_of\":%llu", (unsigned long long)alias_of);
  fputs("}\n", w->f);
  return id;
}

static void w_unpack(writer *w, uint64_t id) {
  if (id) fprintf(w->f, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

/* Transient device memory (docs/trace-format.md): an alloc line; its id. */
static uint64_t w_alloc(writer *w, uint64_t bytes, const char *what) {
  uint64_t id = ++w->next_id;
  fprintf(w->f, "{\"ev\":\"alloc\",\"t_us\":0,\"id\":%llu,\"bytes\":%llu,\"what\":\"%s\"}\n",
          (unsigned long long)id, (unsigned long long)bytes, what);
  return id;
}

static void w_free(writer *w, uint64_t id) {
  if (id) fprintf(w->f, "{\"ev\":\"free\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

/* Allocates op o's transients of the given life into ids[MAX_TMPS] (0 for
 * the others). */
static void w_alloc_tmps(writer *w, const op *o, int life, uint64_t *ids) {
  memset(ids, 0, MAX_TMPS * sizeof *ids);
  for (int k = 0; k < o->n_tmps; k++)
    if (o->tmps[k].life == life) ids[k] = w_alloc(w, o->tmps[k].bytes, o->tmps[k].what);
}

/* Which of an op's saves to pack. */
enum { P_ALL = 0, P_KEPT = 1 /* not dropped by drop */, P_DROPPED = 2 /* dropped, of group g */ };

/* Pack the saves of op o selected by which into ids[]; bufid[] maps
 * layer-local buffers to their first pack's id for aliases. */
static void w_pack_op(writer *w, const op *o, int layer, int phase, int which, unsigned drop,
                      uint64_t *ids, uint64_t *bufid) {
  char path[160];
  module_path(layer, op_module(o), path, sizeof path);
  for (int k = 0; k < o->n_saves; k++) {
    const saved *x = &o->saves[k];
    int dropped = (x->group & drop) != 0;
    if ((which == P_KEPT && dropped) || (which == P_DROPPED && !dropped)) continue;
    /* a buffer saved again is an alias of its first pack: within the layer,
     * or (a model-wide tensor in the forward pass) of the step's first */
    uint64_t *first = x->buf >= 0 && x->kind != PARAM ? &bufid[x->buf] : NULL;
    if (first && x->model_wide && phase == FERRY_PHASE_FORWARD) first = &w->model_bufid[x->buf - B_COS];
    ids[k] = w_pack(w, x, layer, phase, path, o->cls, first ? *first : 0);
    if (first && !*first) *first = ids[k];
  }
}

static void w_unpack_op(writer *w, const op *o, const uint64_t *ids) {
  for (int k = o->n_saves; k-- > 0;) w_unpack(w, ids[k]);
}

/* ids of a block's packs */
typedef struct block_ids {
  uint64_t *ids;  /* [op][MAX_SAVES] */
  uint64_t *outs; /* [op][MAX_OUTS]: per-op SAC's saved outputs */
  uint64_t ckpt;  /* checkpointing: the block's input */
} block_ids;

typedef struct layer_ctx {
  const op_list *l;
  const unsigned char *keep; /* per-op SAC's choice */
  uint64_t *bufid;           /* [l->n_bufs] */
  const char *block_cls;
} layer_ctx;

#define IDS(bi, i) (&(bi)->ids[(size_t)(i) * MAX_SAVES])
#define OUTS(bi, i) (&(bi)->outs[(size_t)(i) * MAX_OUTS])

/* What a checkpoint keeps of a block: its input. */
static void w_pack_block_input(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  saved in = sv(B_X, m->dtype, ACT, 0, 3, m->micro_batch, seq_region_of(m), m->hidden, 0);
  char path[64];
  module_path(layer, "", path, sizeof path);
  bi->ckpt = w_pack(w, &in, layer, FERRY_PHASE_FORWARD, path, c->block_cls, 0);
}

static void w_block_forward(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  const op_list *l = c->l;
  const int mode = layer_mode(m, layer);
  memset(c->bufid, 0, (size_t)l->n_bufs * sizeof *c->bufid);
  memset(bi->ids, 0, (size_t)l->n * MAX_SAVES * sizeof *bi->ids);
  memset(bi->outs, 0, (size_t)l->n * MAX_OUTS * sizeof *bi->outs);
  bi->ckpt = 0;
  if (mode == SYNTH_CKPT_FULL) {
    /* one event per op, all named "forward": each has its own roofline */
    for (int i = 0; i < l->n; i++) w_op(w, &l->ops[i], 1, layer, "forward");
    /* checkpoint saves the block's input only */
    w_pack_block_input(w, c, layer, bi);
    return;
  }
  if (mode == SYNTH_CKPT_SELECTIVE_OP) {
    /* the checkpoint keeps the block's input; SAC the outputs it saves */
    w_pack_block_input(w, c, layer, bi);
    for (int i = 0; i < l->n; i++) {
      const op *o = &l->ops[i];
      w_op(w, o, 1, layer, NULL);
      if (!c->keep[i]) continue;
      char path[160];
      module_path(layer, op_module(o), path, sizeof path);
      for (int k = 0; k < o->n_outs; k++)
        OUTS(bi, i)[k] = w_pack(w, &o->outs[k], layer, FERRY_PHASE_FORWARD, path, o->cls, 0);
    }
    return;
  }
  unsigned drop = mode == SYNTH_CKPT_SELECTIVE ? m->recompute : 0;
  for (int i = 0; i < l->n; i++) {
    w_op(w, &l->ops[i], 1, layer, NULL);
    w_pack_op(w, &l->ops[i], layer, FERRY_PHASE_FORWARD, P_KEPT, drop, IDS(bi, i), c->bufid);
  }
}

/* Megatron selective: group g (the attention core, the MLP activation) is
 * recomputed as a whole before the backward of the last op (in forward
 * order) that saved one of its dropped tensors. */
static int last_consumer(const op_list *l, unsigned g) {
  for (int i = l->n; i-- > 0;)
    for (int k = 0; k < l->ops[i].n_saves; k++)
      if (l->ops[i].saves[k].group & g) return i;
  return -1;
}

static void w_block_backward(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  const op_list *l = c->l;
  const int mode = layer_mode(m, layer);
  memset(c->bufid, 0, (size_t)l->n_bufs * sizeof *c->bufid);
  if (mode == SYNTH_CKPT_FULL || mode == SYNTH_CKPT_SELECTIVE_OP) {
    /* recomputation: the block runs again from its input before its
     * backward; per-op SAC takes the outputs it saved instead of running
     * those ops. Every tensor the backward needs is packed again. */
    w_unpack(w, bi->ckpt);
    for (int i = 0; i < l->n; i++) {
      const op *o = &l->ops[i];
      if (mode == SYNTH_CKPT_SELECTIVE_OP && c->keep[i])
        for (int k = 0; k < o->n_outs; k++) w_unpack(w, OUTS(bi, i)[k]);
      else w_op(w, o, 1, layer, "recompute");
      w_pack_op(w, o, layer, FERRY_PHASE_RECOMPUTE, P_ALL, 0, IDS(bi, i), c->bufid);
    }
  }
  static const unsigned groups[2] = {SYNTH_RECOMPUTE_ATTN_CORE, SYNTH_RECOMPUTE_MLP_ACT};
  int at[2] = {-1, -1};
  if (mode == SYNTH_CKPT_SELECTIVE)
    for (int g = 0; g < 2; g++)
      if (m->recompute & groups[g]) at[g] = last_consumer(l, groups[g]);
  for (int i = l->n; i-- > 0;) {
    const op *o = &l->ops[i];
    for (int g = 0; g < 2; g++) {
      if (at[g] != i) continue;
      for (int j = 0; j < l->n; j++)
        if (l->ops[j].rgroup & groups[g]) w_op(w, &l->ops[j], 1, layer, "recompute");
      for (int j = 0; j < l->n; j++)
        w_pack_op(w, &l->ops[j], layer, FERRY_PHASE_RECOMPUTE, P_DROPPED, groups[g], IDS(bi, j),
                  c->bufid);
    }
    w_unpack_op(w, o, IDS(bi, i));
    w_op(w, o, 2, layer, NULL);
  }
}

/* The ops after the blocks (final norm, head, loss), forward: an op's
 * workspaces live around its compute and are freed before it saves; its
 * transient output lives until the loss returns, the end of forward.
 * out[] gets the outputs' alloc ids ([op][MAX_TMPS]). */
static void w_head_forward(writer *w, const op_list *l, block_ids *bi, uint64_t *bufid,
                           uint64_t *out) {
  for (int i = 0; i < l->n; i++) {
    const op *o = &l->ops[i];
    uint64_t work[MAX_TMPS];
    w_alloc_tmps(w, o, TMP_WORK, work);
    w_compute(w, op_us(w->m, o), -1, op_label(o), o->flops, o->bytes, SYNTH_MIN_OP_US);
    for (int k = MAX_TMPS; k-- > 0;) w_free(w, work[k]);
    w_pack_op(w, o, -1, FERRY_PHASE_FORWARD, P_ALL, 0, IDS(bi, i), bufid);
    w_alloc_tmps(w, o, TMP_OUT, &out[(size_t)i * MAX_TMPS]);
  }
  for (size_t j = (size_t)l->n * MAX_TMPS; j-- > 0;) w_free(w, out[j]);
}

/* Their backward, last op first: the gradient of an op's input is
 * allocated before the op takes its saved tensors back (autograd allocates
 * the output of a backward kernel while its inputs live), and the gradient
 * it consumed is freed once it ran. */
static void w_head_backward(writer *w, const op_list *l, block_ids *bi) {
  uint64_t incoming[MAX_TMPS] = {0};
  for (int i = l->n; i-- > 0;) {
    const op *o = &l->ops[i];
    uint64_t grad[MAX_TMPS];
    w_alloc_tmps(w, o, TMP_GRAD, grad);
    w_unpack_op(w, o, IDS(bi, i));
    w_compute(w, bwd_us(w->m, o), -1, op_label(o), o->own_bwd ? o->bwd_flops : 2 * o->flops,
              o->own_bwd ? o->bwd_bytes : 2 * o->bytes,
              o->own_bwd ? SYNTH_MIN_OP_US : 2 * SYNTH_MIN_OP_US);
    for (int k = 0; k < MAX_TMPS; k++) w_free(w, incoming[k]);
    memcpy(incoming, grad, sizeof grad);
  }
  for (int k = 0; k < MAX_TMPS; k++) w_free(w, incoming[k]);
}

static const char *checkpoint_name(const synth_model *m, char *buf, size_t n) {
  switch (m->checkpoint) {
  case SYNTH_CKPT_FULL:
    if (m->ckpt_every > 1) snprintf(buf, n, "full:%d", m->ckpt_every);
    else snprintf(buf, n, "full");
    break;
  case SYNTH_CKPT_SELECTIVE:
    snprintf(buf, n, "selective:%s%s%s", m->recompute & SYNTH_RECOMPUTE_ATTN_CORE ? "attn_core" : "",
             (m->recompute & SYNTH_RECOMPUTE_ATTN_CORE) && (m->recompute & SYNTH_RECOMPUTE_MLP_ACT) ? "+" : "",
             m->recompute & SYNTH_RECOMPUTE_MLP_ACT ? "mlp_act" : "");
    break;
  case SYNTH_CKPT_SELECTIVE_OP: snprintf(buf, n, "selective-op"); break;
  default: snprintf(buf, n, "none");
  }
  return buf;
}

/* A resident line; dtype (optional, 0: none) is the element type, which
 * lets a replayer count the parameters from their bytes; layer_bytes
 * (optional, 0: none) each repeated block's part, which weight offload
 * moves. */
static void w_resident(FILE *f, uint64_t bytes, const char *what, int dtype, uint64_t layer_bytes) {
  fprintf(f, "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":%llu,\"what\":\"%s\"",
          (unsigned long long)bytes, what);
  if (dtype) fprintf(f, ",\"dtype\":\"%s\"", ferry_dtype_name(dtype));
  if (layer_bytes) fprintf(f, ",\"layer_bytes\":%llu", (unsigned long long)layer_bytes);
  fputs("}\n", f);
}

int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen) {
  if (synth_validate(m, err, errlen)) return -1;
  writer w = {.m = m, .f = f};
  op_list layer = {0}, pre = {0}, post = {0};
  block_ids *blocks = calloc((size_t)m->layers, sizeof *blocks);
  uint64_t pre_store[MAX_SAVES], post_store[8 * MAX_SAVES], post_out[8 * MAX_TMPS];
  block_ids pre_ids = {.ids = pre_store}, post_ids = {.ids = post_store};
  uint64_t *bufid = NULL;
  unsigned char *keep = NULL;
  layer_ctx ctx = {.l = &layer,
                   .block_cls = m->arch != SYNTH_LLAMA      ? "GPTBlock"
                                : m->experts && m->qk_norm ? "Qwen3MoeDecoderLayer"
                                : m->experts               ? "MixtralDecoderLayer"
                                : m->qk_norm               ? "Qwen3DecoderLayer"
                                                           : "LlamaDecoderLayer"};
  char ckpt[48];
  size_t n = 0;
  int rc = -1;
  if (!blocks || layer_ops(m, &layer) || pre_ops(m, &pre) || post_ops(m, &post)) goto oom;
  n = (size_t)layer.n;
  if (!(bufid = calloc((size_t)layer.n_bufs, sizeof *bufid)) || !(keep = calloc(n, 1))) goto oom;
  for (int L = 0; L < m->layers; L++)
    if (!(blocks[L].ids = malloc(n * MAX_SAVES * sizeof(uint64_t))) ||
        !(blocks[L].outs = malloc(n * MAX_OUTS * sizeof(uint64_t))))
      goto oom;
  sac_keep(&layer, keep);
  ctx.keep = keep, ctx.bufid = bufid;
  fprintf(f,
          "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1,\"ferry\":\"%s\","
          "\"backend\":\"synth\",\"model\":\"%s\",\"arch\":\"%s\",\"layers\":%d,\"hidden\":%d,"
          "\"heads\":%d,\"kv_heads\":%d,",
          ferry_version_string(), m->name, m->arch == SYNTH_LLAMA ? "llama" : "gpt", m->layers,
          m->hidden, m->heads, m->kv_heads);
  if (m->head_dim) fprintf(f, "\"head_dim\":%d,", m->head_dim);
  if (m->qk_norm) fprintf(f, "\"qk_norm\":true,");
  fprintf(f, "\"ffn\":%d,", m->ffn);
  if (m->experts)
    fprintf(f, "\"experts\":%d,\"top_k\":%d,\"expert_ffn\":%d,", m->experts, m->top_k,
            (int)expert_ffn_of(m));
  fprintf(f, "\"vocab\":%d,\"seq\":%d,\"micro_batch\":%d,\"dtype\":\"%s\",\"flash\":%s,", m->vocab,
          m->seq, m->micro_batch, ferry_dtype_name(m->dtype), m->flash ? "true" : "false");
  if (m->arch == SYNTH_LLAMA) fprintf(f, "\"norm\":\"%s\",", m->norm == SYNTH_NORM_EAGER ? "eager" : "fused");
  fprintf(f, "\"checkpoint\":\"%s\",", checkpoint_name(m, ckpt, sizeof ckpt));
  if (m->checkpoint != SYNTH_CKPT_OFF)
    fprintf(f, "\"checkpointed_layers\":%d,", synth_checkpointed_layers(m));
  if (m->loss == SYNTH_LOSS_CHUNKED) fprintf(f, "\"loss\":\"chunked:%lld\",", (long long)synth_loss_chunk(m));
  else fprintf(f, "\"loss\":\"full\",");
  fprintf(f,
          "\"param_dtype\":\"%s\",\"grad_dtype\":\"%s\",\"master_weights\":%s,"
          "\"optimizer\":\"%s\",",
          ferry_dtype_name(param_dtype_of(m)), ferry_dtype_name(grad_dtype_of(m)),
          master_of(m) ? "true" : "false", synth_optimizer_name(m->optimizer));
  if (m->lora > 0) fprintf(f, "\"lora\":%g,", m->lora);
  if (tp_of(m) > 1) fprintf(f, "\"tp\":%d,\"sp\":%s,", m->tp, m->sp ? "true" : "false");
  fprintf(f, "\"shard\":%d,\"tflops\":%g,\"hbm_gbps\":%g}\n", m->shard, m->tflops, m->hbm_gbps);
  synth_resident res;
  synth_resident_parts(m, &res);
  w_resident(f, res.params, "parameters", param_dtype_of(m), res.layer_params);
  w_resident(f, res.grads, "gradients", grad_dtype_of(m), 0);
  if (res.master) w_resident(f, res.master, "master weights", F32, 0);
  w_resident(f, res.states, "optimizer states", 0, 0);
  if (res.gathered) w_resident(f, res.gathered, "gathered parameters", m->dtype, 0);
  const double opt_bytes = optimizer_step_bytes(m, &res);
  for (int st = 1; st <= m->steps; st++) {
    w.step = (uint64_t)st;
    memset(w.model_bufid, 0, sizeof w.model_bufid);
    fprintf(f, "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":%d}\n", st);
    uint64_t small_bufid[POST_BUFS] = {0};
    memset(pre_store, 0, sizeof pre_store);
    memset(post_store, 0, sizeof post_store);
    for (int i = 0; i < pre.n; i++) {
      w_op(&w, &pre.ops[i], 1, -1, NULL);
      w_pack_op(&w, &pre.ops[i], -1, FERRY_PHASE_FORWARD, P_ALL, 0, IDS(&pre_ids, i), small_bufid);
    }
    for (int L = 0; L < m->layers; L++) w_block_forward(&w, &ctx, L, &blocks[L]);
    memset(small_bufid, 0, sizeof small_bufid);
    w_head_forward(&w, &post, &post_ids, small_bufid, post_out);
    fprintf(f, "{\"ev\":\"backward_begin\",\"t_us\":0}\n");
    w_head_backward(&w, &post, &post_ids);
    for (int L = m->layers; L-- > 0;) w_block_backward(&w, &ctx, L, &blocks[L]);
    for (int i = pre.n; i-- > 0;) {
      w_unpack_op(&w, &pre.ops[i], IDS(&pre_ids, i));
      w_op(&w, &pre.ops[i], 2, -1, NULL);
    }
    fprintf(f, "{\"ev\":\"backward_end\",\"t_us\":0}\n");
    w_compute(&w, opt_bytes / (m->hbm_gbps * 1e9) * 1e6, -1, "optimizer", 0, opt_bytes, 0);
    fprintf(f, "{\"ev\":\"step_end\",\"t_us\":0,\"step\":%d}\n", st);
  }
  rc = 0;
  if (ferror(f)) {
    if (err && errlen) snprintf(err, errlen, "write error");
    rc = -1;
  }
  goto done;
oom:
  if (err && errlen) snprintf(err, errlen, "out of memory");
done:
  if (blocks)
    for (int L = 0; L < m->layers; L++) {
      free(blocks[L].ids);
      free(blocks[L].outs);
    }
  free(blocks);
  free(bufid);
  free(keep);
  op_list_free(&layer);
  op_list_free(&pre);
  op_list_free(&post);
  return rc;
}
