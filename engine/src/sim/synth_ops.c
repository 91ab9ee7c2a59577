/*
 * synth_ops.c — a transformer block as ops (what each op saves, its
 * transients and cost) and checkpointing (docs/sim-synth.md).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/synth_internal.h"

/* ---- the model as ops ----------------------------------------------------------- */
saved sv(int buf, int dtype, int kind, unsigned group, int ndim, int64_t a, int64_t b,
                int64_t c, int64_t d) {
  saved s = {.buf = buf, .ndim = ndim, .dtype = dtype, .kind = kind, .group = group};
  s.shape[0] = a, s.shape[1] = b, s.shape[2] = c, s.shape[3] = d;
  return s;
}

/* A saved tensor of nd (<= 4) dimensions given as an array. */
saved svd(int buf, int dtype, int kind, unsigned group, int nd, const int64_t *dims) {
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

const char *op_module(const op *o) { return o->has_mod ? o->mod : o->suffix; }

static void save(op *o, saved s) { o->saves[o->n_saves++] = s; }
static void tmp(op *o, int life, uint64_t bytes, const char *what);
static void out(op *o, int sac, saved s) {
  o->sac = sac;
  o->outs[o->n_outs++] = s;
}


/* Hugging Face's class names of the llama architecture's families: Llama,
 * Qwen3 (QK-norm), Qwen3Moe (QK-norm and experts), Mixtral (experts). */
const char *hf_class(int arch, int qk_norm, int experts, int what) {
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
    o->extra_wgrad = h; /* LayerNorm's bias: a gradient, nothing saved */
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
    /* ring attention (cp > 1): this rank's queries over every rank's keys,
     * the K/V chunks read as they arrive; with load balancing (each rank two
     * mirrored chunks) the causal work is the total / cp */
    /* Ulysses (cp > 1): after the all-to-alls the rank attends over the
     * whole sequence (S = s x cp) with heads / cp: the same causal work,
     * its own q, k, v read once; what it saves is (b, heads / cp, S, d),
     * the same bytes as its s tokens of every head */
    o = add_op(l, "self_attn.attention", "FlashAttention", 2 * tokens * ls->skv * qd,
               (2 * tokens * qd + 2 * tokens * kvd * (ls->ulysses ? 1 : ls->cp)) * e);
    if (llama) in_module(o, "self_attn", ls_class(ls, CLS_ATTN));
    if (ls->cp > 1 && !ls->ulysses) /* K and V of one chunk, double-buffered: one computed on, one received */
      tmp(o, TMP_RING, (uint64_t)(2 * 2 * tokens * (double)kvd * e), "ring attention: K/V receive buffers");
    /* its backward runs 5 matmuls (recomputed scores, dV, dP, dQ, dK) for the
     * forward's 2: 2.5x the FLOPs (FlashAttention-2, Dao 2023, section 3.1;
     * torch's FLOP counter counts SDPA's backward so), twice the bytes */
    o->own_bwd = 1, o->bwd_flops = 2.5 * o->flops, o->bwd_bytes = 2 * o->bytes;
    const int64_t u = ls->ulysses ? ls->cp : 1, S = s * u, ah = a / u, kh = kvd / d / u;
    save(o, sv(B_Q, dt, ACT, 0, 4, b, ah, S, d));
    save(o, sv(B_K, dt, ACT, 0, 4, b, kh, S, d));
    save(o, sv(B_V, dt, ACT, 0, 4, b, kh, S, d));
    save(o, sv(B_ATTN, dt, ACT, 0, 4, b, ah, S, d));
    save(o, sv(B_LSE, F32, ACT, 0, 3, b, ah, S, 0));
    out(o, SAC_SAVE, sv(B_ATTN, dt, ACT, 0, 4, b, ah, S, d));
    out(o, SAC_SAVE, sv(B_LSE, F32, ACT, 0, 3, b, ah, S, 0));
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
  /* Ulysses: the all-to-all's output back in s tokens of every head, a
   * tensor apart from the attention's (b, heads / cp, S, d) one */
  linear_saves(o, dt, ls->ulysses ? B_UOUT : B_ATTN, b * s, qd, h);
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
    o->extra_wgrad = h; /* LayerNorm's bias */
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
int layer_ops(const synth_model *m, op_list *l) {
  layer_shape ls;
  const int64_t t = tp_of(m);
  /* one tensor-parallel rank's share (Megatron: heads and the FFN split by
   * t; with sequence parallelism the rest of the sequence too) */
  ls.b = m->micro_batch;
  ls.s = seq_local_of(m);
  ls.ss = seq_region_of(m);
  ls.cp = cp_of(m);
  ls.ulysses = ulysses_of(m);
  ls.skv = m->seq;
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
int pre_ops(const synth_model *m, op_list *l) {
  const int64_t b = m->micro_batch, s = seq_local_of(m), h = m->hidden;
  const double tokens = (double)b * s, e = ferry_dtype_size(m->dtype);
  l->n = 0, l->cap = 1, l->n_bufs = 1;
  if (!(l->ops = malloc(sizeof *l->ops))) return -1;
  op *o = add_op(l, "model.embed_tokens", "Embedding", 0, tokens * h * e + tokens * 8);
  save(o, sv(0, I64, ACT, 0, 2, b, s, 0, 0));
  /* its backward writes the table's gradient (dense: embedding_dense_backward);
   * a tied table's the head wrote first, the learned positions' here */
  o->extra_wgrad = (m->tie_embeddings ? 0 : vocab_local_of(m) * h) + (int64_t)m->positions * h;
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
  const int64_t b = m->micro_batch, s = seq_local_of(m), h = m->hidden, V = vocab_local_of(m), T = b * s;
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
  const int64_t b = m->micro_batch, s = seq_local_of(m), h = m->hidden, V = m->vocab;
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
  /* backward hands grad_weight to the head as its gradient */
  o->extra_wgrad = V * h;
  o->wgrad_handed = 1;
}


int post_ops(const synth_model *m, op_list *l) {
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
    o->extra_wgrad = h; /* LayerNorm's bias */
  }
  if (m->loss == SYNTH_LOSS_CHUNKED) loss_chunked_ops(m, l);
  else loss_full_ops(m, l);
  return 0;
}

uint64_t saved_bytes(const saved *x) {
  uint64_t n = (uint64_t)ferry_dtype_size(x->dtype);
  for (int i = 0; i < x->ndim; i++) n *= (uint64_t)x->shape[i];
  return n;
}

/* ---- checkpointing ---------------------------------------------------------------- */
/* The mode layer L runs under: full:K checkpoints the layers whose 1-based
 * index is a multiple of K (torchtitan's ac_freq counts its wrapped blocks
 * from 1 and wraps those with count % ac_freq == 0); the others save
 * everything. */
int layer_mode(const synth_model *m, int L) {
  if (m->checkpoint == SYNTH_CKPT_FULL) {
    int k = m->ckpt_every > 0 ? m->ckpt_every : 1;
    return (L + 1) % k == 0 ? SYNTH_CKPT_FULL : SYNTH_CKPT_OFF;
  }
  return m->checkpoint;
}

/* The checkpoint implementation, auto resolved: torchtitan's per-op
 * selective and its full mode run torch.utils.checkpoint with
 * use_reentrant=False (the one torch recommends, and the only one per-op SAC
 * works with); Megatron-LM's selective recomputation has its own reentrant
 * CheckpointFunction. */
int ckpt_impl_of(const synth_model *m) {
  if (m->ckpt_impl != SYNTH_CKPT_IMPL_AUTO) return m->ckpt_impl;
  return m->checkpoint == SYNTH_CKPT_SELECTIVE ? SYNTH_CKPT_IMPL_REENTRANT : SYNTH_CKPT_IMPL_NON_REENTRANT;
}

const char *ckpt_impl_name(int impl) {
  static const char *const names[] = {"auto", "reentrant", "non-reentrant", "compiled"};
  return impl >= 0 && impl <= SYNTH_CKPT_IMPL_COMPILED ? names[impl] : "unknown";
}

int synth_checkpoint_impl(const synth_model *m) { return ckpt_impl_of(m); }
const char *synth_checkpoint_impl_name(int impl) { return ckpt_impl_name(impl); }

/* Whether a saved-tensor hook receives per-op SAC's kept outputs: a compiled
 * graph saves them as its own; a non-reentrant checkpoint keeps them in SAC's
 * cache, past any outer hook (torch 2.15 warns that this will change; with
 * respect_saved_tensors_hooks=True they are packed). The block's input is
 * packed under every implementation: a reentrant checkpoint saves it with
 * ctx.save_for_backward, a non-reentrant one through _NoopSaveInputs (whose
 * save_for_backward runs outside the checkpoint's own hooks), a compiled
 * graph as its own (measured with an outer saved_tensors_hooks, torch 2.15;
 * torch 1.13's non-reentrant checkpoint did not save it). */
int hook_sees_kept(const synth_model *m) { return ckpt_impl_of(m) != SYNTH_CKPT_IMPL_NON_REENTRANT; }

/* Whether it receives the recomputed tensors: only a reentrant checkpoint
 * recomputes under autograd's ordinary saving (inside backward); a
 * non-reentrant one packs them with its own hooks into its frame, a compiled
 * backward recomputes them inside its graph. */
int hook_sees_recomputed(const synth_model *m) { return ckpt_impl_of(m) == SYNTH_CKPT_IMPL_REENTRANT; }

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
void sac_keep(const op_list *l, unsigned char *keep) {
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
