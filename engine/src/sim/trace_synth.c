/*
 * trace_synth.c — the trace synthesizer (declared in ferry_tools.h).
 * How it works: docs/internals.md#trace_synthc.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "ferry_tools.h"

#define MAX_SAVES 6
#define MAX_OPS 24
#define MAX_BUFS 32
#define SYNTH_MIN_OP_US 4.0

typedef struct saved {
  int buf;       /* layer-local buffer id: equal ids are one buffer */
  int ndim;
  int64_t shape[4];
  int dtype;
  int kind;
  unsigned group; /* SYNTH_RECOMPUTE_* that drops it under selective */
} saved;

typedef struct op {
  const char *suffix; /* module path below the layer ("self_attn.q_proj") */
  const char *cls;
  double flops, bytes; /* forward */
  int n_saves;
  saved saves[MAX_SAVES];
} op;

typedef struct op_list {
  op ops[MAX_OPS];
  int n;
} op_list;

/* ---- presets ------------------------------------------------------------------ */
static void defaults(synth_model *m) {
  memset(m, 0, sizeof *m);
  m->seq = 8192;
  m->micro_batch = 1;
  m->dtype = FERRY_DTYPE_BF16;
  m->flash = 1;
  m->checkpoint = SYNTH_CKPT_OFF;
  m->recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  m->shard = 8;
  m->tflops = 400;
  m->hbm_gbps = 2000;
  m->steps = 1;
}

int synth_preset(const char *name, synth_model *m) {
  defaults(m);
  snprintf(m->name, sizeof m->name, "%s", name ? name : "");
  /* Public shapes: Llama 3 model cards / config.json; GPT-3 paper table 2.1. */
  if (!strcmp(name, "llama3-8b")) {
    m->arch = SYNTH_LLAMA;
    m->layers = 32, m->hidden = 4096, m->heads = 32, m->kv_heads = 8, m->ffn = 14336;
    m->vocab = 128256;
  } else if (!strcmp(name, "llama3-70b")) {
    m->arch = SYNTH_LLAMA;
    m->layers = 80, m->hidden = 8192, m->heads = 64, m->kv_heads = 8, m->ffn = 28672;
    m->vocab = 128256;
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

const char *synth_preset_names(void) { return "llama3-8b, llama3-70b, gpt3-1.3b, tiny"; }

int synth_validate(const synth_model *m, char *err, size_t errlen) {
#define BAD(...) \
  do { \
    if (err && errlen) snprintf(err, errlen, __VA_ARGS__); \
    return -1; \
  } while (0)
  if (m->arch != SYNTH_LLAMA && m->arch != SYNTH_GPT) BAD("arch must be llama or gpt");
  if (m->layers < 1 || m->layers > 10000) BAD("layers %d must be within 1..10000", m->layers);
  if (m->hidden < 1 || m->hidden > 1 << 20) BAD("hidden %d must be within 1..1048576", m->hidden);
  if (m->heads < 1 || m->hidden % m->heads) BAD("heads %d must divide hidden %d", m->heads, m->hidden);
  if (m->kv_heads < 1 || m->heads % m->kv_heads)
    BAD("kv heads %d must divide heads %d", m->kv_heads, m->heads);
  if (m->arch == SYNTH_GPT && m->kv_heads != m->heads) BAD("gpt has kv heads = heads");
  if (m->ffn < 1 || m->ffn > 1 << 22) BAD("ffn %d must be within 1..4194304", m->ffn);
  if (m->vocab < 1 || m->vocab > 1 << 24) BAD("vocab %d must be within 1..16777216", m->vocab);
  if (m->seq < 1 || m->seq > 1 << 24) BAD("seq %d must be within 1..16777216", m->seq);
  if (m->micro_batch < 1 || m->micro_batch > 65536) BAD("micro-batch %d must be within 1..65536", m->micro_batch);
  if (ferry_dtype_size(m->dtype) < 1 || m->dtype == FERRY_DTYPE_BOOL ||
      m->dtype >= FERRY_DTYPE_I64)
    BAD("dtype must be a floating-point type");
  if (m->checkpoint < SYNTH_CKPT_OFF || m->checkpoint > SYNTH_CKPT_SELECTIVE) BAD("bad checkpoint mode");
  if (m->shard < 1 || m->shard > 1 << 20) BAD("shard %d must be >= 1", m->shard);
  if (!(m->tflops > 0 && m->tflops < 1e6)) BAD("tflops must be > 0");
  if (!(m->hbm_gbps > 0 && m->hbm_gbps < 1e7)) BAD("hbm bandwidth must be > 0");
  if (m->steps < 1 || m->steps > 1000000) BAD("steps %d must be within 1..1000000", m->steps);
  double per_tensor = (double)m->micro_batch * m->seq * (double)(m->ffn > m->vocab ? m->ffn : m->vocab) * 4;
  double s2 = (double)m->micro_batch * m->heads * (double)m->seq * m->seq * 4;
  if (per_tensor > 1e15 || (!m->flash && s2 > 1e15)) BAD("tensors would exceed 1 PB: shape too large");
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

static op *add_op(op_list *l, const char *suffix, const char *cls, double flops, double bytes) {
  op *o = &l->ops[l->n++];
  memset(o, 0, sizeof *o);
  o->suffix = suffix;
  o->cls = cls;
  o->flops = flops;
  o->bytes = bytes;
  return o;
}

static void save(op *o, saved s) { o->saves[o->n_saves++] = s; }

enum { /* layer-local buffers */
  B_X, B_XN1, B_Q, B_K, B_V, B_KREP, B_VREP, B_ATTN, B_H1, B_XN2, B_GATE, B_ACT, B_UP, B_PROD,
  B_QKV, B_SOFT32, B_PROBS, B_DMASK, B_DOUT, B_AMASK, B_FC1, B_GELU, B_MMASK, B_LSE, B_RSTD1,
  B_RSTD2, B_W = 100 /* parameters: B_W + op index, never aliased */
};

/* The sizes one block's ops are written in. */
typedef struct layer_shape {
  int64_t b, s, h, a, d, kvd, f; /* batch, sequence, hidden, heads, head dim, kv width, ffn */
  double tokens, e;              /* b * s; bytes per element */
  int dt, llama;                 /* the model's dtype; Llama (else GPT-2) */
  int w;                         /* the next parameter buffer (B_W + index) */
} layer_shape;

#define ACT FERRY_KIND_ACTIVATION
#define PARAM FERRY_KIND_PARAMETER
#define F32 FERRY_DTYPE_F32

/* The input norm and the q/k/v (Llama) or fused qkv (GPT-2) projections. */
static void attention_in_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int llama = ls->llama;
  const int64_t kvd = ls->kvd;
  const char *norm_cls = llama ? "LlamaRMSNorm" : "LayerNorm";
  /* norm: input, statistics (rstd; LayerNorm also the mean), weight */
  o = add_op(l, "input_layernorm", norm_cls, 0, 2 * tokens * h * e);
  save(o, sv(B_X, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(B_RSTD1, F32, ACT, 0, 3, b, s, llama ? 1 : 2, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 1, h, 0, 0, 0));
  if (llama) {
    o = add_op(l, "self_attn.q_proj", "Linear", 2 * tokens * h * h, (2 * tokens * h + h * h) * e);
    save(o, sv(B_XN1, dt, ACT, 0, 3, b, s, h, 0));
    save(o, sv(ls->w++, dt, PARAM, 0, 2, h, h, 0, 0));
    o = add_op(l, "self_attn.k_proj", "Linear", 2 * tokens * h * kvd, (tokens * h + h * kvd + tokens * kvd) * e);
    save(o, sv(B_XN1, dt, ACT, 0, 3, b, s, h, 0));
    save(o, sv(ls->w++, dt, PARAM, 0, 2, kvd, h, 0, 0));
    o = add_op(l, "self_attn.v_proj", "Linear", 2 * tokens * h * kvd, (tokens * h + h * kvd + tokens * kvd) * e);
    save(o, sv(B_XN1, dt, ACT, 0, 3, b, s, h, 0));
    save(o, sv(ls->w++, dt, PARAM, 0, 2, kvd, h, 0, 0));
    /* rotary embedding: element-wise, saves only the cos/sin constants */
    add_op(l, "self_attn.rotary_emb", "LlamaRotaryEmbedding", 0, 4 * tokens * (h + kvd) * e);
  } else {
    o = add_op(l, "self_attn.qkv_proj", "Linear", 2 * tokens * h * 3 * h, (4 * tokens * h + 3 * h * h) * e);
    save(o, sv(B_XN1, dt, ACT, 0, 3, b, s, h, 0));
    save(o, sv(ls->w++, dt, PARAM, 0, 2, 3 * h, h, 0, 0));
  }
}

/* Attention itself: flash (saves q, k, v, out, lse) or eager (scores,
 * softmax, context; the probabilities recomputable). */
static void attention_core_ops(layer_shape *ls, int flash, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int llama = ls->llama;
  const int64_t a = ls->a, d = ls->d, kvd = ls->kvd;
  if (flash) {
    /* SDPA flash: q, k, v, output and the log-sum-exp; recomputes the rest */
    o = add_op(l, "self_attn.attention", "FlashAttention", 2 * tokens * s * h, (2 * tokens * h + 2 * tokens * kvd) * e);
    save(o, sv(B_Q, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(B_K, dt, ACT, 0, 4, b, kvd / d, s, d));
    save(o, sv(B_V, dt, ACT, 0, 4, b, kvd / d, s, d));
    save(o, sv(B_ATTN, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(B_LSE, F32, ACT, 0, 3, b, a, s, 0));
  } else {
    int kbuf = kvd == h ? B_K : B_KREP, vbuf = kvd == h ? B_V : B_VREP;
    o = add_op(l, "self_attn.scores", "MatMul", 2 * tokens * s * h, (2 * tokens * h + b * a * s * s) * e);
    save(o, sv(B_Q, dt, ACT, 0, 4, b, a, s, d));
    save(o, sv(kbuf, dt, ACT, 0, 4, b, a, s, d));
    if (llama) {
      /* HF eager attention: softmax in fp32, then a copy to the model dtype */
      o = add_op(l, "self_attn.softmax", "Softmax", 0, (double)b * a * s * s * (e + 4 + 4 + e));
      save(o, sv(B_SOFT32, F32, ACT, SYNTH_RECOMPUTE_ATTN_CORE, 4, b, a, s, s));
      o = add_op(l, "self_attn.context", "MatMul", 2 * tokens * s * h, (2 * tokens * h + b * a * s * s) * e);
      save(o, sv(B_PROBS, dt, ACT, SYNTH_RECOMPUTE_ATTN_CORE, 4, b, a, s, s));
      save(o, sv(vbuf, dt, ACT, 0, 4, b, a, s, d));
    } else {
      o = add_op(l, "self_attn.softmax", "Softmax", 0, 2.0 * b * a * s * s * e);
      save(o, sv(B_PROBS, dt, ACT, SYNTH_RECOMPUTE_ATTN_CORE, 4, b, a, s, s));
      o = add_op(l, "self_attn.attention_dropout", "Dropout", 0, 3.0 * b * a * s * s * e);
      save(o, sv(B_DMASK, FERRY_DTYPE_BOOL, ACT, SYNTH_RECOMPUTE_ATTN_CORE, 4, b, a, s, s));
      o = add_op(l, "self_attn.context", "MatMul", 2 * tokens * s * h, (2 * tokens * h + b * a * s * s) * e);
      save(o, sv(B_DOUT, dt, ACT, SYNTH_RECOMPUTE_ATTN_CORE, 4, b, a, s, s));
      save(o, sv(B_V, dt, ACT, 0, 4, b, a, s, d));
    }
  }
}

/* The output projection, its dropout (GPT-2) and the post-attention norm. */
static void attention_out_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int llama = ls->llama;
  const char *norm_cls = llama ? "LlamaRMSNorm" : "LayerNorm";
  o = add_op(l, "self_attn.o_proj", "Linear", 2 * tokens * h * h, (2 * tokens * h + h * h) * e);
  save(o, sv(B_ATTN, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, h, h, 0, 0));
  if (!llama) {
    o = add_op(l, "self_attn.resid_dropout", "Dropout", 0, 3 * tokens * h * e);
    save(o, sv(B_AMASK, FERRY_DTYPE_BOOL, ACT, 0, 3, b, s, h, 0));
  }
  o = add_op(l, "post_attention_layernorm", norm_cls, 0, 3 * tokens * h * e);
  save(o, sv(B_H1, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(B_RSTD2, F32, ACT, 0, 3, b, s, llama ? 1 : 2, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 1, h, 0, 0, 0));
}

/* Llama's gated MLP: gate, up, SiLU, product, down. */
static void mlp_llama_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int64_t f = ls->f;
  o = add_op(l, "mlp.gate_proj", "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  save(o, sv(B_XN2, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, f, h, 0, 0));
  o = add_op(l, "mlp.up_proj", "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  save(o, sv(B_XN2, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, f, h, 0, 0));
  o = add_op(l, "mlp.act_fn", "SiLU", 0, 2 * tokens * f * e);
  save(o, sv(B_GATE, dt, ACT, 0, 3, b, s, f, 0));
  o = add_op(l, "mlp.mul", "Mul", 0, 3 * tokens * f * e);
  save(o, sv(B_ACT, dt, ACT, SYNTH_RECOMPUTE_MLP_ACT, 3, b, s, f, 0));
  save(o, sv(B_UP, dt, ACT, 0, 3, b, s, f, 0));
  o = add_op(l, "mlp.down_proj", "Linear", 2 * tokens * f * h, (tokens * f + f * h + tokens * h) * e);
  save(o, sv(B_PROD, dt, ACT, 0, 3, b, s, f, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, h, f, 0, 0));
}

/* GPT-2's MLP: fc1, GELU, fc2, dropout. */
static void mlp_gpt_ops(layer_shape *ls, op_list *l) {
  const int64_t b = ls->b, s = ls->s, h = ls->h;
  const double tokens = ls->tokens, e = ls->e;
  const int dt = ls->dt;
  op *o;
  const int64_t f = ls->f;
  o = add_op(l, "mlp.fc1", "Linear", 2 * tokens * h * f, (tokens * h + h * f + tokens * f) * e);
  save(o, sv(B_XN2, dt, ACT, 0, 3, b, s, h, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, f, h, 0, 0));
  o = add_op(l, "mlp.act", "GELU", 0, 2 * tokens * f * e);
  save(o, sv(B_FC1, dt, ACT, 0, 3, b, s, f, 0));
  o = add_op(l, "mlp.fc2", "Linear", 2 * tokens * f * h, (tokens * f + f * h + tokens * h) * e);
  save(o, sv(B_GELU, dt, ACT, SYNTH_RECOMPUTE_MLP_ACT, 3, b, s, f, 0));
  save(o, sv(ls->w++, dt, PARAM, 0, 2, h, f, 0, 0));
  o = add_op(l, "mlp.dropout", "Dropout", 0, 3 * tokens * h * e);
  save(o, sv(B_MMASK, FERRY_DTYPE_BOOL, ACT, 0, 3, b, s, h, 0));
}

/* One repeated block. */
static void layer_ops(const synth_model *m, op_list *l) {
  layer_shape ls;
  ls.b = m->micro_batch;
  ls.s = m->seq;
  ls.h = m->hidden;
  ls.a = m->heads;
  ls.d = ls.h / ls.a;
  ls.kvd = (int64_t)m->kv_heads * ls.d;
  ls.f = m->ffn;
  ls.tokens = (double)ls.b * (double)ls.s;
  ls.e = ferry_dtype_size(m->dtype);
  ls.dt = m->dtype;
  ls.llama = m->arch == SYNTH_LLAMA;
  ls.w = B_W;
  l->n = 0;
  attention_in_ops(&ls, l);
  attention_core_ops(&ls, m->flash, l);
  attention_out_ops(&ls, l);
  if (ls.llama) mlp_llama_ops(&ls, l);
  else mlp_gpt_ops(&ls, l);
}

/* Before and after the blocks: embedding; final norm, head and loss. */
static void pre_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = m->seq, h = m->hidden;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  l->n = 0;
  op *o = add_op(l, "model.embed_tokens", "Embedding", 0, tokens * h * e + tokens * 8);
  save(o, sv(0, FERRY_DTYPE_I64, FERRY_KIND_ACTIVATION, 0, 2, b, s, 0, 0));
}

static void post_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = m->seq, h = m->hidden, V = m->vocab;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  const int dt = m->dtype, A = FERRY_KIND_ACTIVATION, P = FERRY_KIND_PARAMETER;
  int llama = m->arch == SYNTH_LLAMA;
  l->n = 0;
  op *o = add_op(l, "model.norm", llama ? "LlamaRMSNorm" : "LayerNorm", 0, 2 * tokens * h * e);
  save(o, sv(1, dt, A, 0, 3, b, s, h, 0));
  save(o, sv(2, FERRY_DTYPE_F32, A, 0, 3, b, s, llama ? 1 : 2, 0));
  save(o, sv(B_W, dt, P, 0, 1, h, 0, 0, 0));
  o = add_op(l, "lm_head", "Linear", 2 * tokens * h * V, (tokens * h + h * V + tokens * V) * e);
  save(o, sv(3, dt, A, 0, 3, b, s, h, 0));
  save(o, sv(B_W + 1, dt, P, 0, 2, V, h, 0, 0));
  /* logits upcast to fp32; log-softmax saves its fp32 output, NLL the labels */
  o = add_op(l, "loss", "CrossEntropyLoss", 0, tokens * V * (e + 4 + 4));
  save(o, sv(4, FERRY_DTYPE_F32, A, 0, 3, b, s, V, 0));
  save(o, sv(5, FERRY_DTYPE_I64, A, 0, 2, b, s, 0, 0));
}

static uint64_t saved_bytes(const saved *x) {
  uint64_t n = (uint64_t)ferry_dtype_size(x->dtype);
  for (int i = 0; i < x->ndim; i++) n *= (uint64_t)x->shape[i];
  return n;
}

uint64_t synth_layer_activation_bytes(const synth_model *m) {
  op_list l;
  layer_ops(m, &l);
  int seen[MAX_BUFS] = {0};
  uint64_t total = 0;
  for (int i = 0; i < l.n; i++)
    for (int k = 0; k < l.ops[i].n_saves; k++) {
      const saved *x = &l.ops[i].saves[k];
      if (x->kind != FERRY_KIND_ACTIVATION || seen[x->buf]) continue;
      seen[x->buf] = 1;
      total += saved_bytes(x);
    }
  return total;
}

uint64_t synth_param_count(const synth_model *m) {
  const uint64_t h = (uint64_t)m->hidden, d = h / (uint64_t)m->heads;
  const uint64_t kvd = (uint64_t)m->kv_heads * d, f = (uint64_t)m->ffn, V = (uint64_t)m->vocab;
  uint64_t per_layer = m->arch == SYNTH_LLAMA ? 2 * h * h + 2 * h * kvd + 3 * h * f + 2 * h
                                              : 4 * h * h + 2 * h * f + 4 * h;
  return V * h /* embedding */ + (uint64_t)m->layers * per_layer + 2 * h /* final norm */ +
         V * h /* untied head */;
}

/* Mixed-precision Adam (ZeRO paper): 16-bit parameters and gradients, fp32
 * master weights, momentum and variance: 2 + 2 + 12 bytes per parameter,
 * divided by the sharding degree. Sharded training also holds the gathered
 * parameters of two blocks (the one computing, the one prefetched). */
static void resident_parts(const synth_model *m, uint64_t part[4]) {
  uint64_t P = synth_param_count(m), e = (uint64_t)ferry_dtype_size(m->dtype);
  uint64_t sh = (uint64_t)m->shard;
  part[0] = P * e / sh;
  part[1] = P * e / sh;
  part[2] = P * 12 / sh;
  part[3] = 0;
  if (sh > 1) {
    const uint64_t h = (uint64_t)m->hidden, d = h / (uint64_t)m->heads;
    uint64_t per_layer = m->arch == SYNTH_LLAMA
                             ? 2 * h * h + 2 * h * (uint64_t)m->kv_heads * d + 3 * h * (uint64_t)m->ffn
                             : 4 * h * h + 2 * h * (uint64_t)m->ffn;
    part[3] = 2 * per_layer * e;
  }
}

uint64_t synth_resident_bytes(const synth_model *m) {
  uint64_t p[4];
  resident_parts(m, p);
  return p[0] + p[1] + p[2] + p[3];
}

/* ---- writing -------------------------------------------------------------------- */
typedef struct writer {
  const synth_model *m;
  FILE *f;
  uint64_t next_id;
  uint64_t step;
  const char *dtype_names[FERRY_DTYPE_COUNT_];
} writer;

static double op_us(const synth_model *m, const op *o) {
  double t_flops = o->flops / (m->tflops * 1e12);
  double t_bytes = o->bytes / (m->hbm_gbps * 1e9);
  double us = (t_flops > t_bytes ? t_flops : t_bytes) * 1e6;
  /* an eager op is at least a kernel launch or two */
  return us > SYNTH_MIN_OP_US ? us : SYNTH_MIN_OP_US;
}

static void w_compute(writer *w, double us, int layer, const char *opname) {
  if (us <= 0) return;
  fprintf(w->f, "{\"ev\":\"compute\",\"t_us\":0,\"us\":%.3f,\"layer\":%d,\"op\":\"%s\"}\n", us, layer,
          opname);
}

static void module_path(const synth_model *m, int layer, const char *suffix, char *buf, size_t n) {
  (void)m;
  if (layer < 0) snprintf(buf, n, "%s", suffix);
  else snprintf(buf, n, "model.layers.%d.%s", layer, suffix);
}

/* Pack the saves of op o (those in `which`: 1 = not dropped by selective
 * recompute, 2 = dropped ones) into ids[]; bufid[] maps layer-local buffers
 * to their first pack's id for aliases. */
static void w_pack_op(writer *w, const op *o, int layer, int phase, int which, uint64_t *ids,
                      uint64_t *bufid) {
  const synth_model *m = w->m;
  char path[160];
  module_path(m, layer, o->suffix, path, sizeof path);
  for (int k = 0; k < o->n_saves; k++) {
    const saved *x = &o->saves[k];
    int dropped = m->checkpoint == SYNTH_CKPT_SELECTIVE && (x->group & m->recompute);
    if ((which == 1 && dropped) || (which == 2 && !dropped)) continue;
    uint64_t id = ++w->next_id;
    ids[k] = id;
    fprintf(w->f,
            "{\"ev\":\"pack\",\"t_us\":0,\"id\":%llu,\"step\":%llu,\"bytes\":%llu,\"dtype\":\"%s\","
            "\"shape\":[",
            (unsigned long long)id, (unsigned long long)w->step,
            (unsigned long long)saved_bytes(x), ferry_dtype_name(x->dtype));
    for (int i = 0; i < x->ndim; i++) fprintf(w->f, i ? ",%lld" : "%lld", (long long)x->shape[i]);
    fprintf(w->f,
            "],\"kind\":\"%s\",\"phase\":\"%s\",\"layer\":%d,\"layers\":%d,\"flags\":2,"
            "\"module\":\"%s\",\"class\":\"%s\",\"decision\":\"keep\"",
            ferry_kind_name(x->kind), ferry_phase_name(phase), layer, m->layers, path, o->cls);
    if (x->buf < B_W && bufid[x->buf]) {
      fprintf(w->f, ",\"alias\":true,\"alias_of\":%llu", (unsigned long long)bufid[x->buf]);
    } else if (x->buf < B_W) {
      bufid[x->buf] = id;
    }
    fputs("}\n", w->f);
  }
}

static void w_unpack_op(writer *w, const op *o, const uint64_t *ids) {
  for (int k = o->n_saves; k-- > 0;)
    if (ids[k]) fprintf(w->f, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)ids[k]);
}

static int has_dropped(const synth_model *m, const op *o) {
  if (m->checkpoint != SYNTH_CKPT_SELECTIVE) return 0;
  for (int k = 0; k < o->n_saves; k++)
    if (o->saves[k].group & m->recompute) return 1;
  return 0;
}

/* ids of a block's packs: [op][save] */
typedef struct block_ids {
  uint64_t ids[MAX_OPS][MAX_SAVES];
  uint64_t ckpt; /* full checkpointing: the block input */
} block_ids;

static void w_block_forward(writer *w, const op_list *l, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  uint64_t bufid[B_W] = {0};
  memset(bi, 0, sizeof *bi);
  if (m->checkpoint == SYNTH_CKPT_FULL) {
    double us = 0;
    for (int i = 0; i < l->n; i++) us += op_us(m, &l->ops[i]);
    w_compute(w, us, layer, "forward");
    /* checkpoint saves the block's input only */
    op in = {.suffix = "", .cls = m->arch == SYNTH_LLAMA ? "LlamaDecoderLayer" : "GPTBlock", .n_saves = 1};
    in.saves[0] = sv(B_X, m->dtype, FERRY_KIND_ACTIVATION, 0, 3, m->micro_batch, m->seq, m->hidden, 0);
    char path[64];
    snprintf(path, sizeof path, "model.layers.%d", layer);
    uint64_t id = ++w->next_id;
    bi->ckpt = id;
    fprintf(w->f,
            "{\"ev\":\"pack\",\"t_us\":0,\"id\":%llu,\"step\":%llu,\"bytes\":%llu,\"dtype\":\"%s\","
            "\"shape\":[%d,%d,%d],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
            "\"layers\":%d,\"flags\":2,\"module\":\"%s\",\"class\":\"%s\",\"decision\":\"keep\"}\n",
            (unsigned long long)id, (unsigned long long)w->step,
            (unsigned long long)saved_bytes(&in.saves[0]), ferry_dtype_name(m->dtype),
            m->micro_batch, m->seq, m->hidden, layer, m->layers, path, in.cls);
    return;
  }
  for (int i = 0; i < l->n; i++) {
    w_compute(w, op_us(m, &l->ops[i]), layer, l->ops[i].suffix);
    w_pack_op(w, &l->ops[i], layer, FERRY_PHASE_FORWARD, 1, bi->ids[i], bufid);
  }
}

static void w_block_backward(writer *w, const op_list *l, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  uint64_t bufid[B_W] = {0};
  if (m->checkpoint == SYNTH_CKPT_FULL) {
    fprintf(w->f, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)bi->ckpt);
    for (int i = 0; i < l->n; i++) {
      w_compute(w, op_us(m, &l->ops[i]), layer, "recompute");
      w_pack_op(w, &l->ops[i], layer, FERRY_PHASE_RECOMPUTE, 0, bi->ids[i], bufid);
    }
  }
  for (int i = l->n; i-- > 0;) {
    const op *o = &l->ops[i];
    if (has_dropped(m, o)) {
      /* selective: recompute this op's dropped tensors just before use */
      w_compute(w, op_us(m, o), layer, "recompute");
      w_pack_op(w, o, layer, FERRY_PHASE_RECOMPUTE, 2, bi->ids[i], bufid);
    }
    w_unpack_op(w, o, bi->ids[i]);
    w_compute(w, 2 * op_us(m, o), layer, o->suffix);
  }
}

int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen) {
  if (synth_validate(m, err, errlen)) return -1;
  writer w = {.m = m, .f = f};
  op_list layer, pre, post;
  layer_ops(m, &layer);
  pre_ops(m, &pre);
  post_ops(m, &post);
  fprintf(f,
          "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1,\"ferry\":\"%s\","
          "\"backend\":\"synth\",\"model\":\"%s\",\"arch\":\"%s\",\"layers\":%d,\"hidden\":%d,"
          "\"heads\":%d,\"kv_heads\":%d,\"ffn\":%d,\"vocab\":%d,\"seq\":%d,\"micro_batch\":%d,"
          "\"dtype\":\"%s\",\"flash\":%s,\"checkpoint\":\"%s\",\"shard\":%d,\"tflops\":%g,"
          "\"hbm_gbps\":%g}\n",
          ferry_version_string(), m->name, m->arch == SYNTH_LLAMA ? "llama" : "gpt", m->layers,
          m->hidden, m->heads, m->kv_heads, m->ffn, m->vocab, m->seq, m->micro_batch,
          ferry_dtype_name(m->dtype), m->flash ? "true" : "false",
          m->checkpoint == SYNTH_CKPT_FULL ? "full" : m->checkpoint == SYNTH_CKPT_SELECTIVE ? "selective" : "off",
          m->shard, m->tflops, m->hbm_gbps);
  uint64_t part[4];
  resident_parts(m, part);
  static const char *const what[4] = {"parameters", "gradients", "optimizer states",
                                      "gathered parameters"};
  for (int i = 0; i < 4; i++)
    if (part[i] || i < 3)
      fprintf(f, "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":%llu,\"what\":\"%s\"}\n",
              (unsigned long long)part[i], what[i]);
  block_ids *blocks = malloc((size_t)m->layers * sizeof *blocks);
  block_ids pre_ids, post_ids;
  if (!blocks) {
    if (err && errlen) snprintf(err, errlen, "out of memory");
    return -1;
  }
  uint64_t adam_bytes = synth_param_count(m) * 32 / (uint64_t)m->shard;
  for (int st = 1; st <= m->steps; st++) {
    w.step = (uint64_t)st;
    fprintf(f, "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":%d}\n", st);
    uint64_t bufid[B_W] = {0};
    memset(&pre_ids, 0, sizeof pre_ids);
    memset(&post_ids, 0, sizeof post_ids);
    for (int i = 0; i < pre.n; i++) {
      w_compute(&w, op_us(m, &pre.ops[i]), -1, pre.ops[i].suffix);
      w_pack_op(&w, &pre.ops[i], -1, FERRY_PHASE_FORWARD, 0, pre_ids.ids[i], bufid);
    }
    for (int L = 0; L < m->layers; L++) w_block_forward(&w, &layer, L, &blocks[L]);
    memset(bufid, 0, sizeof bufid);
    for (int i = 0; i < post.n; i++) {
      w_compute(&w, op_us(m, &post.ops[i]), -1, post.ops[i].suffix);
      w_pack_op(&w, &post.ops[i], -1, FERRY_PHASE_FORWARD, 0, post_ids.ids[i], bufid);
    }
    fprintf(f, "{\"ev\":\"backward_begin\",\"t_us\":0}\n");
    for (int i = post.n; i-- > 0;) {
      w_unpack_op(&w, &post.ops[i], post_ids.ids[i]);
      w_compute(&w, 2 * op_us(m, &post.ops[i]), -1, post.ops[i].suffix);
    }
    for (int L = m->layers; L-- > 0;) w_block_backward(&w, &layer, L, &blocks[L]);
    for (int i = pre.n; i-- > 0;) {
      w_unpack_op(&w, &pre.ops[i], pre_ids.ids[i]);
      w_compute(&w, 2 * op_us(m, &pre.ops[i]), -1, pre.ops[i].suffix);
    }
    fprintf(f, "{\"ev\":\"backward_end\",\"t_us\":0}\n");
    w_compute(&w, (double)adam_bytes / (m->hbm_gbps * 1e9) * 1e6, -1, "optimizer");
    fprintf(f, "{\"ev\":\"step_end\",\"t_us\":0,\"step\":%d}\n", st);
  }
  free(blocks);
  if (ferror(f)) {
    if (err && errlen) snprintf(err, errlen, "write error");
    return -1;
  }
  return 0;
}
