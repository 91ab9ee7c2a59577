/* test_sim_synth.c — the trace synthesizer against Korthikanti et al.'s
 * formula, Llama's shapes and sizes, and what each op saves, fused and
 * eager. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"
#include "test_synth.h"

/* ---- the synthesizer ------------------------------------------------------------- */

/* Korthikanti et al. 2022, eq. 1: a GPT layer stores 34sbh + 5as^2b bytes
 * (16-bit). The gpt architecture saves exactly the tensors the paper counts,
 * plus LayerNorm statistics (mean and rstd in fp32: 2 x 8sb) and, with
 * FlashAttention, its log-sum-exp (fp32: 4asb), which the paper predates. */
TEST(sim_synth_matches_korthikanti_formula) {
  synth_model m;
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  m.seq = 512;
  m.micro_batch = 2;
  m.layers = 2;
  for (int flash = 0; flash <= 1; flash++) {
    m.flash = flash;
    double s = m.seq, b = m.micro_batch, h = m.hidden, a = m.heads;
    double formula = 34 * s * b * h + (flash ? 0 : 5 * a * s * s * b);
    double extras = 2 * 8 * s * b + (flash ? 4 * a * s * b : 0);
    uint64_t got = synth_layer_activation_bytes(&m);
    CHECK_EQ(got, (uint64_t)(formula + extras));
    CHECK(extras / formula < 0.005);
    sim_trace *t = NULL;
    CHECK_OK(synth_to_trace(&m, &t));
    CHECK_EQ(trace_layer_bytes(t, 0), got); /* the trace carries what the model says */
    CHECK_EQ(trace_layer_bytes(t, 1), got);
    sim_trace_free(t);
  }
  /* selective recompute drops exactly the s^2 term from the forward pass */
  m.flash = 0;
  m.checkpoint = SYNTH_CKPT_SELECTIVE;
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  double s = m.seq, b = m.micro_batch, h = m.hidden;
  CHECK_EQ(trace_layer_bytes(t, 0), (uint64_t)(34 * s * b * h + 16 * s * b));
  sim_trace_free(t);
  /* full checkpointing keeps only each block's input (reentrant: a pack) */
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_impl = SYNTH_CKPT_IMPL_REENTRANT;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK_EQ(trace_layer_bytes(t, 0), (uint64_t)(2 * s * b * h));
  sim_trace_free(t);
  return 0;
}

/* Llama: SwiGLU and GQA differ from the GPT formula; the per-layer total is
 * 12sbh (norm inputs, q, o, normed inputs) + 4sb*kv_dim (k, v) + 8sbf (gate,
 * up, SiLU output, product) + statistics and the log-sum-exp, + the rotary
 * tables cos and sin (1 x 1 x s x head_dim each, 4s*head_dim in bf16) that
 * the first layer packs and the others alias. */
TEST(sim_synth_llama_shapes_and_sizes) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  double P = (double)synth_param_count(&m);
  CHECK(fabs(P - 8.03e9) / 8.03e9 < 0.005); /* Meta: 8.03B */
  double s = m.seq, b = m.micro_batch, h = m.hidden, f = m.ffn, kvd = h / m.heads * m.kv_heads;
  double want = 12 * s * b * h + 4 * s * b * kvd + 8 * s * b * f + 2 * 4 * s * b + 4 * m.heads * s * b;
  const double rope = 4 * s * (h / m.heads);
  CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(want + rope));
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)(want + rope));
  CHECK_EQ(synth_layer_saved_bytes(&m, 1), (uint64_t)want);
  CHECK_EQ(synth_preset("llama3-70b", &m), 0);
  P = (double)synth_param_count(&m);
  CHECK(fabs(P - 70.6e9) / 70.6e9 < 0.005); /* Meta: 70.6B */
  /* resident: 16 bytes per parameter over the shards, plus two gathered blocks */
  CHECK(synth_resident_bytes(&m) > (uint64_t)(16 * P / m.shard));
  CHECK_EQ(synth_preset("no-such-model", &m), -1);
  char err[128];
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.heads = 3;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "heads 3 must divide hidden");
  return 0;
}

/* ---- what each op saves, fused and eager ------------------------------------------- */

/* One expected pack: module path below the layer (the whole path outside),
 * dtype, kind, whether it is an alias of an earlier pack, its shape. */
typedef struct want_pack {
  const char *mod;
  int dtype, kind, alias, ndim;
  int64_t shape[4];
} want_pack;

typedef struct want_list {
  want_pack w[48];
  int n;
} want_list;

static void want(want_list *l, const char *mod, int dtype, int kind, int alias, int ndim, int64_t a,
                 int64_t b, int64_t c, int64_t d) {
  want_pack *p = &l->w[l->n++];
  *p = (want_pack){mod, dtype, kind, alias, ndim, {a, b, c, d}};
}

/* The forward packs of `layer` in t's first step (those whose module path
 * contains `only`, if given) are exactly `l`, as a multiset (printing what is
 * missing or extra). */
static int packs_are(const sim_trace *t, int layer, const char *only, const want_list *l) {
  unsigned char used[48] = {0};
  char prefix[48];
  snprintf(prefix, sizeof prefix, "model.layers.%d", layer);
  int extra = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer != layer || x->desc.phase != FERRY_PHASE_FORWARD) continue;
    const char *m = x->desc.module_path ? x->desc.module_path : "";
    if (only && !strstr(m, only)) continue;
    if (layer >= 0 && !strncmp(m, prefix, strlen(prefix))) {
      m += strlen(prefix);
      if (*m == '.') m++;
    }
    int found = -1;
    for (int k = 0; k < l->n && found < 0; k++) {
      const want_pack *w = &l->w[k];
      int same = !used[k] && !strcmp(w->mod, m) && w->dtype == x->desc.dtype &&
                 w->kind == x->desc.kind && w->alias == (x->alias_of >= 0) && w->ndim == x->desc.ndim;
      for (int d = 0; same && d < w->ndim; d++) same = w->shape[d] == x->desc.shape[d];
      if (same) found = k;
    }
    if (found >= 0) {
      used[found] = 1;
      continue;
    }
    extra++;
    fprintf(stderr, "  layer %d: unexpected pack %s %s %s%s ndim %d [%lld %lld %lld %lld]\n", layer,
            m, ferry_dtype_name(x->desc.dtype), ferry_kind_name(x->desc.kind),
            x->alias_of >= 0 ? " alias" : "", x->desc.ndim, (long long)x->desc.shape[0],
            (long long)x->desc.shape[1], (long long)x->desc.shape[2], (long long)x->desc.shape[3]);
  }
  int missing = 0;
  for (int k = 0; k < l->n; k++)
    if (!used[k]) {
      missing++;
      fprintf(stderr, "  layer %d: missing pack %s %s %s%s\n", layer, l->w[k].mod,
              ferry_dtype_name(l->w[k].dtype), ferry_kind_name(l->w[k].kind),
              l->w[k].alias ? " alias" : "");
    }
  return extra || missing;
}

/* An RMSNorm's packs: fused (one kernel: torch's _fused_rms_norm, Liger's
 * RMSNorm) x, rstd, weight; eager (Hugging Face's LlamaRMSNorm op by op) the
 * fp32 x (pow), rstd (rsqrt), both again (x * rstd), the normalized tensor
 * in the model dtype and the weight (weight * it). */
static void want_norm(want_list *l, const char *mod, int eager, int dt, int nd, int64_t a, int64_t b,
                      int64_t c, int64_t d) {
  int64_t dims[4] = {a, b, c, d}, one[4] = {a, b, c, d};
  one[nd - 1] = 1;
  const int64_t w = dims[nd - 1];
  if (!eager) {
    want(l, mod, dt, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
  } else {
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 1, nd, a, b, c, d);
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 1, nd, one[0], one[1], one[2], one[3]);
    want(l, mod, dt, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
  }
  want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 0, nd, one[0], one[1], one[2], one[3]);
  want(l, mod, dt, FERRY_KIND_PARAMETER, 0, 1, w, 0, 0, 0);
}

/* Every op of a Llama block (and outside the blocks), its saved tensors by
 * hand, for --norm fused|eager x --flash on|off x bf16|f32 (b = 2, s = 64,
 * h = 256, a = 4 heads of d = 64, 2 KV heads, f = 512, V = 1024, T = b s):
 *   norms: as want_norm above (input_layernorm, post_attention_layernorm,
 *     model.norm; Qwen3's q_norm and k_norm per head);
 *   Linears: the input as mm sees it, (T, in), k and v's an alias of q's
 *     and up's of gate's, and the weight's transpose (in, out);
 *   self_attn: the rotary tables cos, sin (1, 1, s, d) for q and for k
 *     (layer 0 packs them, layer 1 aliases all four); flash: q (b, a, s,
 *     d), k and v (b, kv, s, d), the output (b, a, s, d), the log-sum-exp
 *     fp32 (b, a, s), o_proj's input an alias of the output; eager: q (ba,
 *     s, d), k^T (ba, d, s), the fp32 softmax (b, a, s, s), the
 *     probabilities (ba, s, s; in fp32 an alias of the softmax), v (ba, s,
 *     d), o_proj's input a copy;
 *   mlp: act_fn's input (b, s, f), the product's operands (module mlp);
 *   outside: the token ids; model.norm; lm_head; the loss at the root:
 *     fp32 log-probabilities (T, V), an alias, the labels (T), total_weight;
 *     the fp32 copy of the logits and the gradient's copy back only below
 *     fp32.
 * And the layer's bytes against a closed form: 2 norms (fused eTh + 4T;
 * eager 4Th + 4T + eTh) + 2eTh (the two Linears' inputs) + attention (flash
 * 2eT qd + 2eT kvd + 4aT; eager 3eT qd + 4abs^2 + eabs^2 (none in fp32) +
 * eT qd) + 4eTf, + 2esd (cos, sin) on layer 0. */
TEST(sim_synth_saved_tensors_per_op_fused_and_eager) {
  const int ACTV = FERRY_KIND_ACTIVATION, PAR = FERRY_KIND_PARAMETER, F32 = FERRY_DTYPE_F32;
  for (int f32 = 0; f32 <= 1; f32++)
    for (int eager = 0; eager <= 1; eager++)
      for (int flash = 0; flash <= 1; flash++) {
        synth_model m;
        CHECK_EQ(synth_preset("tiny", &m), 0);
        m.layers = 2, m.seq = 64, m.micro_batch = 2, m.vocab = 1024;
        m.dtype = f32 ? FERRY_DTYPE_F32 : FERRY_DTYPE_BF16;
        m.norm = eager ? SYNTH_NORM_EAGER : SYNTH_NORM_FUSED, m.flash = flash;
        const int dt = m.dtype;
        const int64_t b = 2, s = 64, h = 256, a = 4, kv = 2, d = 64, f = 512, V = 1024, T = b * s;
        const int64_t qd = a * d, kvd = kv * d;
        const double e = f32 ? 4 : 2;
        fprintf(stderr, "  %s, norm %s, flash %s\n", f32 ? "f32" : "bf16", eager ? "eager" : "fused",
                flash ? "on" : "off");
        sim_trace *t = NULL;
        CHECK_OK(synth_to_trace(&m, &t));
        for (int L = 0; L < 2; L++) {
          want_list l = {.n = 0};
          want_norm(&l, "input_layernorm", eager, dt, 3, b, s, h, 0);
          want(&l, "self_attn.q_proj", dt, ACTV, 0, 2, T, h, 0, 0);
          want(&l, "self_attn.q_proj", dt, PAR, 0, 2, h, qd, 0, 0);
          want(&l, "self_attn.k_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "self_attn.k_proj", dt, PAR, 0, 2, h, kvd, 0, 0);
          want(&l, "self_attn.v_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "self_attn.v_proj", dt, PAR, 0, 2, h, kvd, 0, 0);
          for (int k = 0; k < 4; k++) want(&l, "self_attn", dt, ACTV, L > 0 || k >= 2, 4, 1, 1, s, d);
          if (flash) {
            want(&l, "self_attn", dt, ACTV, 0, 4, b, a, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, kv, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, kv, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, a, s, d);
            want(&l, "self_attn", F32, ACTV, 0, 3, b, a, s, 0);
          } else {
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, s, d, 0);
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, d, s, 0);
            want(&l, "self_attn", F32, ACTV, 0, 4, b, a, s, s);
            want(&l, "self_attn", dt, ACTV, f32, 3, b * a, s, s, 0);
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, s, d, 0);
          }
          want(&l, "self_attn.o_proj", dt, ACTV, flash, 2, T, qd, 0, 0);
          want(&l, "self_attn.o_proj", dt, PAR, 0, 2, qd, h, 0, 0);
          want_norm(&l, "post_attention_layernorm", eager, dt, 3, b, s, h, 0);
          want(&l, "mlp.gate_proj", dt, ACTV, 0, 2, T, h, 0, 0);
          want(&l, "mlp.gate_proj", dt, PAR, 0, 2, h, f, 0, 0);
          want(&l, "mlp.act_fn", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp.up_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "mlp.up_proj", dt, PAR, 0, 2, h, f, 0, 0);
          want(&l, "mlp", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp.down_proj", dt, ACTV, 0, 2, T, f, 0, 0);
          want(&l, "mlp.down_proj", dt, PAR, 0, 2, f, h, 0, 0);
          CHECK_EQ(packs_are(t, L, NULL, &l), 0);
          const double norm = eager ? 4.0 * T * h + 4 * T + e * T * h : e * T * h + 4 * T;
          const double attn = flash ? 2 * e * T * qd + 2 * e * T * kvd + 4.0 * a * T
                                    : 3 * e * T * qd + 4.0 * a * b * s * s +
                                          (f32 ? 0 : e * a * b * s * s) + e * T * qd;
          const double bytes = 2 * norm + 2 * e * T * h + attn + 4 * e * T * f + (L == 0 ? 2 * e * s * d : 0);
          CHECK_EQ(trace_layer_bytes(t, L), (uint64_t)bytes);
          CHECK_EQ(synth_layer_saved_bytes(&m, L), (uint64_t)bytes);
        }
        want_list out = {.n = 0};
        want(&out, "model.embed_tokens", FERRY_DTYPE_I64, ACTV, 0, 2, b, s, 0, 0);
        want_norm(&out, "model.norm", eager, dt, 3, b, s, h, 0);
        want(&out, "lm_head", dt, ACTV, 0, 2, T, h, 0, 0);
        want(&out, "lm_head", dt, PAR, 0, 2, h, V, 0, 0);
        want(&out, "", F32, ACTV, 0, 2, T, V, 0, 0);
        want(&out, "", F32, ACTV, 1, 2, T, V, 0, 0);
        want(&out, "", FERRY_DTYPE_I64, ACTV, 0, 1, T, 0, 0, 0);
        want(&out, "", F32, ACTV, 0, 0, 0, 0, 0, 0);
        CHECK_EQ(packs_are(t, -1, NULL, &out), 0);
        /* in fp32, logits.float() is the logits: no copy, and none back */
        CHECK_EQ(alloc_bytes(t, "loss: logits.float()"), f32 ? 0 : 4 * T * V);
        CHECK_EQ(alloc_bytes(t, "loss: grad of the logits (model dtype)"), f32 ? 0 : 2 * T * V);
        /* the modules' classes are Hugging Face's */
        for (uint32_t i = 0; i < t->n_tensors; i++) {
          const ferry_tensor_desc *x = &t->tensors[i].desc;
          const char *p = x->module_path;
          if (!strcmp(p, "")) CHECK(!strcmp(x->module_class, "LlamaForCausalLM"));
          if (!strcmp(p, "model.layers.1.self_attn")) CHECK(!strcmp(x->module_class, "LlamaAttention"));
          if (!strcmp(p, "model.layers.1.mlp")) CHECK(!strcmp(x->module_class, "LlamaMLP"));
          if (strstr(p, "layernorm")) CHECK(!strcmp(x->module_class, "LlamaRMSNorm"));
        }
        sim_trace_free(t);
      }
  /* Qwen3's QK-norm, eager in bf16: per head, over head_dim, after q_proj
   * and after k_proj */
  synth_model q;
  CHECK_EQ(synth_preset("tiny", &q), 0);
  q.layers = 2, q.seq = 64, q.micro_batch = 2, q.qk_norm = 1, q.head_dim = 48, q.norm = SYNTH_NORM_EAGER;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&q, &t));
  want_list lq = {.n = 0}, lk = {.n = 0};
  want_norm(&lq, "self_attn.q_norm", 1, FERRY_DTYPE_BF16, 4, 2, 64, 4, 48);
  want_norm(&lk, "self_attn.k_norm", 1, FERRY_DTYPE_BF16, 4, 2, 64, 2, 48);
  CHECK_EQ(packs_are(t, 1, "self_attn.q_norm", &lq), 0);
  CHECK_EQ(packs_are(t, 1, "self_attn.k_norm", &lk), 0);
  sim_trace_free(t);
  /* the header says which; gpt's LayerNorm has no eager decomposition */
  char err[512] = "";
  char *text = synth_text_of(&q, err, sizeof err);
  CHECK(text != NULL);
  int named = strstr(text, "\"norm\":\"eager\",") != NULL;
  /* and the format version whose readers know transient gradients */
  int v2 = strncmp(text, "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":2,",
                   59) == 0;
  free(text);
  CHECK(named);
  CHECK(v2);
  CHECK_EQ(synth_preset("gpt3-1.3b", &q), 0);
  q.norm = SYNTH_NORM_EAGER;
  CHECK_EQ(synth_validate(&q, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--norm eager is for RMSNorm");
  return 0;
}
