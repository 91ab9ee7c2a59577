/* test_sim_synth_checkpoint.c — the synthesizer's activation checkpointing
 * modes and their recompute time, the presets' parameter counts, and MoE's
 * router and experts. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"
#include "test_synth.h"

/* ---- checkpointing, Qwen3 and MoE --------------------------------------------- */
/* Compute time of layer `layer` in the first step: forward (before
 * backward_begin) or backward, of the events named op (NULL: all). */
static double layer_us(const sim_trace *t, int layer, int backward, const char *op) {
  double us = 0;
  int in_backward = 0;
  for (uint32_t i = t->steps[0].first; i < t->steps[0].end; i++) {
    const trace_ev *ev = &t->events[i];
    if (ev->type == TEV_BACKWARD_BEGIN) in_backward = 1;
    if (ev->type != TEV_COMPUTE || ev->layer != layer || in_backward != backward) continue;
    if (!op || (ev->op && !strcmp(ev->op, op))) us += ev->gap_us;
  }
  return us;
}

/* The packs (distinct buffers) of layer `layer` in `phase` (one-step traces):
 * how many, and whether they are all one class. */
static int layer_packs(const sim_trace *t, int layer, int phase, const char **cls) {
  int n = 0;
  *cls = NULL;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer != layer || x->desc.phase != phase || x->alias_of >= 0 ||
        x->desc.kind != FERRY_KIND_ACTIVATION)
      continue;
    if (n++ == 0 || (*cls && !strcmp(*cls, x->desc.module_class))) *cls = x->desc.module_class;
    else *cls = NULL;
  }
  return n;
}

/* Activation bytes of the trace's recompute packs in layer `layer`. */
static uint64_t trace_layer_recompute_bytes(const sim_trace *t, int layer) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer == layer && x->desc.kind == FERRY_KIND_ACTIVATION && x->alias_of < 0 &&
        x->desc.phase == FERRY_PHASE_RECOMPUTE)
      total += x->desc.bytes;
  }
  return total;
}

/* Per mode, what a Llama/Qwen3 layer keeps from forward to backward, by hand
 * (T = b s tokens, qd = heads x head_dim, kvd = kv_heads x head_dim, bf16):
 *   none: 8Th (block input, normed input, attention-residual input, normed
 *     MLP input) + 4T qd (q, attention output) + 4T kvd (k, v) + 8Tf (gate,
 *     SiLU output, up, product) + 8T (two rstd) + 4aT (log-sum-exp); Qwen3's
 *     QK-norm adds its inputs 2T qd + 2T kvd and rstd 4aT + 4 kv T.
 *   full: the block input, 2Th.
 *   selective-op (torchtitan): the block input 2Th; the outputs of the 1st,
 *     3rd, 5th, 7th matmul (q_proj 2T qd, v_proj 2T kvd, gate_proj 2Tf,
 *     down_proj 2Th); flash attention's output 2T qd and log-sum-exp 4aT.
 *     With --flash off the eager attention's matmuls are bmm, not in the
 *     save list: no attention output kept.
 *   selective:mlp_act (Megatron): none less the SiLU output, 2Tf.
 * The rotary tables (cos, sin: 4 s d) are packed by the first layer that
 * saves its ops' tensors in forward (layer 0 unless it is checkpointed) and
 * aliased by the others; a recomputed block packs its own.
 * gpt with flash, selective-op: input 2Th, qkv_proj 6Th, fc1 2Tf (the 1st
 * and 3rd Linear), attention output 2Th and lse 4aT. Each checked through
 * synth_layer_saved_bytes and in the written trace (forward packs), and the
 * recompute packs carry everything the backward needs (none's bytes). */
TEST(sim_synth_checkpoint_modes_save_what_the_formulas_say) {
  for (int qwen = 0; qwen <= 1; qwen++) {
    synth_model m;
    CHECK_EQ(synth_preset("tiny", &m), 0);
    m.seq = 512, m.micro_batch = 2, m.layers = 4;
    if (qwen) m.qk_norm = 1, m.head_dim = 48; /* qd = 192 != hidden 256 */
    const double T = 1024, h = m.hidden, a = m.heads, kv = m.kv_heads, f = m.ffn;
    const double d = qwen ? 48 : h / a, qd = a * d, kvd = kv * d;
    const double none = 8 * T * h + 4 * T * qd + 4 * T * kvd + 8 * T * f + 8 * T + 4 * a * T +
                        (qwen ? 2 * T * qd + 2 * T * kvd + 4 * a * T + 4 * kv * T : 0);
    const double sac = 4 * T * h + 4 * T * qd + 2 * T * kvd + 2 * T * f + 4 * a * T;
    const double sac_eager = 4 * T * h + 2 * T * qd + 2 * T * kvd + 2 * T * f;
    struct {
      int mode, every, flash;
      unsigned recompute;
      double ckpt, plain; /* bytes of a checkpointed layer, of the others */
    } cases[] = {
        {SYNTH_CKPT_OFF, 1, 1, 0, none, none},
        {SYNTH_CKPT_FULL, 1, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_FULL, 2, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_FULL, 4, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_SELECTIVE_OP, 1, 1, 0, sac, sac},
        {SYNTH_CKPT_SELECTIVE_OP, 1, 0, 0, sac_eager, sac_eager},
        {SYNTH_CKPT_SELECTIVE, 1, 1, SYNTH_RECOMPUTE_MLP_ACT, none - 2 * T * f, none - 2 * T * f},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      m.checkpoint = cases[c].mode, m.ckpt_every = cases[c].every, m.flash = cases[c].flash;
      /* packs for what a checkpoint keeps: reentrant (full, Megatron's selective), compiled
       * (selective-op, whose recomputed tensors no hook sees then) */
      m.ckpt_impl = cases[c].mode == SYNTH_CKPT_OFF          ? SYNTH_CKPT_IMPL_AUTO
                    : cases[c].mode == SYNTH_CKPT_SELECTIVE_OP ? SYNTH_CKPT_IMPL_COMPILED
                                                               : SYNTH_CKPT_IMPL_REENTRANT;
      m.recompute = cases[c].recompute ? cases[c].recompute : SYNTH_RECOMPUTE_ATTN_CORE;
      sim_trace *t = NULL;
      CHECK_OK(synth_to_trace(&m, &t));
      const double rope = 4 * m.seq * d;
      for (int L = 0; L < m.layers; L++) {
        /* torchtitan's ac_freq: blocks K, 2K, ... counted from 1 */
        int ckpt = cases[c].mode != SYNTH_CKPT_FULL || (L + 1) % cases[c].every == 0;
        double want = ckpt ? cases[c].ckpt : cases[c].plain;
        int saves_ops = cases[c].mode == SYNTH_CKPT_OFF || cases[c].mode == SYNTH_CKPT_SELECTIVE ||
                        (cases[c].mode == SYNTH_CKPT_FULL && !ckpt);
        if (L == 0 && saves_ops) want += rope;
        CHECK_EQ(synth_layer_saved_bytes(&m, L), (uint64_t)want);
        CHECK_EQ(trace_layer_bytes(t, L), (uint64_t)want);
        if (cases[c].mode == SYNTH_CKPT_FULL && ckpt) {
          const char *cls;
          CHECK_EQ(layer_packs(t, L, FERRY_PHASE_FORWARD, &cls), 1); /* only the block input */
          CHECK(cls && !strcmp(cls, qwen ? "Qwen3DecoderLayer" : "LlamaDecoderLayer"));
        }
        /* recomputation packs again what the backward needs: all of it
         * (full, selective-op), the dropped SiLU output (selective) */
        uint64_t rec = trace_layer_recompute_bytes(t, L);
        if (cases[c].mode == SYNTH_CKPT_OFF || !ckpt) CHECK_EQ(rec, 0);
        else if (cases[c].mode == SYNTH_CKPT_SELECTIVE) CHECK_EQ(rec, (uint64_t)(2 * T * f));
        else if (cases[c].mode == SYNTH_CKPT_SELECTIVE_OP) CHECK_EQ(rec, 0);
        else CHECK_EQ(rec, synth_layer_activation_bytes(&m));
        /* what one layer's ops save, the rotary tables included */
        if (cases[c].flash) CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(none + rope));
      }
      CHECK_EQ(synth_checkpointed_layers(&m), cases[c].mode == SYNTH_CKPT_OFF ? 0
                                              : cases[c].mode == SYNTH_CKPT_FULL
                                                  ? m.layers / cases[c].every
                                                  : m.layers);
      sim_trace_free(t);
    }
  }
  /* GPT-2 (fused qkv) under torchtitan's policy, with flash */
  synth_model g;
  CHECK_EQ(synth_preset("gpt3-1.3b", &g), 0);
  g.seq = 512, g.micro_batch = 2, g.layers = 2, g.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  g.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
  const double T = 1024, h = g.hidden, a = g.heads, f = g.ffn;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK_EQ(trace_layer_bytes(t, 1), (uint64_t)(10 * T * h + 2 * T * f + 4 * a * T));
  CHECK_EQ(synth_layer_saved_bytes(&g, 1), (uint64_t)(10 * T * h + 2 * T * f + 4 * a * T));
  sim_trace_free(t);
  /* the header names the mode */
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  char err[512] = "";
  const struct {
    int mode, every;
    unsigned rc;
    const char *name;
  } names[] = {{SYNTH_CKPT_OFF, 1, 0, "\"checkpoint\":\"none\","},
               {SYNTH_CKPT_FULL, 1, 0, "\"checkpoint\":\"full\",\"checkpointed_layers\":4,"},
               {SYNTH_CKPT_FULL, 2, 0, "\"checkpoint\":\"full:2\",\"checkpointed_layers\":2,"},
               {SYNTH_CKPT_SELECTIVE_OP, 1, 0, "\"checkpoint\":\"selective-op\",\"checkpointed_layers\":4,"},
               {SYNTH_CKPT_SELECTIVE, 1, SYNTH_RECOMPUTE_MLP_ACT, "\"checkpoint\":\"selective:mlp_act\","}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    m.checkpoint = names[i].mode, m.ckpt_every = names[i].every;
    m.recompute = names[i].rc ? names[i].rc : SYNTH_RECOMPUTE_ATTN_CORE;
    char *text = synth_text_of(&m, err, sizeof err);
    CHECK(text != NULL);
    char *nl = strchr(text, '\n');
    CHECK(nl != NULL);
    *nl = 0;
    int found = strstr(text, names[i].name) != NULL;
    if (!found) fprintf(stderr, "header: %s\nwanted: %s\n", text, names[i].name);
    free(text);
    CHECK(found);
  }
  return 0;
}

/* Recomputation costs what the recomputed ops cost in the forward pass, as
 * compute events ("recompute") of the layer's backward, and nothing else
 * changes: with torchtitan's per-op policy on a Qwen3 block, the ops
 * recomputed are the norms, k_proj, o_proj, up_proj (the 2nd, 4th, 6th
 * matmul), QK-norm, rotary, SiLU and the product; q_proj, v_proj, gate_proj,
 * down_proj and attention are not. Full checkpointing recomputes the whole
 * block (one "forward" event in the forward pass); full:2 only on layers 1
 * and 3; Megatron's attn_core (flash off) recomputes scores, softmax,
 * dropout and context of a GPT block. */
TEST(sim_synth_recompute_time_goes_to_backward) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.qk_norm = 1, m.head_dim = 48;
  m.tflops = 5, m.hbm_gbps = 50; /* slow enough that no op sits at the 4 us floor */
  sim_trace *t0 = NULL, *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t0));
  static const char *const recomputed[] = {
      "input_layernorm", "self_attn.k_proj", "self_attn.q_norm", "self_attn.k_norm",
      "self_attn.rotary_emb", "self_attn.o_proj", "post_attention_layernorm", "mlp.up_proj",
      "mlp.act_fn", "mlp.mul"};
  static const char *const kept[] = {"self_attn.q_proj", "self_attn.v_proj", "self_attn.attention",
                                     "mlp.gate_proj", "mlp.down_proj"};
  double want = 0, kept_us = 0;
  for (size_t i = 0; i < sizeof recomputed / sizeof *recomputed; i++) {
    double us = layer_us(t0, 0, 0, recomputed[i]);
    CHECK(us > 4.5);
    want += us;
  }
  for (size_t i = 0; i < sizeof kept / sizeof *kept; i++) kept_us += layer_us(t0, 0, 0, kept[i]);
  const double fwd = layer_us(t0, 0, 0, NULL), bwd = layer_us(t0, 0, 1, NULL);
  CHECK(fabs(want + kept_us - fwd) < 0.01); /* the lists name every op */
  /* backward: twice the forward, but FlashAttention's 2.5x (compute-bound here) */
  const double attn = layer_us(t0, 0, 0, "self_attn.attention");
  CHECK(fabs(layer_us(t0, 0, 1, "self_attn.attention") - 2.5 * attn) < 0.01);
  CHECK(fabs(bwd - 2 * fwd - 0.5 * attn) < 0.01);
  CHECK_EQ(layer_us(t0, 0, 1, "recompute"), 0);

  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  CHECK_OK(synth_to_trace(&m, &t));
  for (int L = 0; L < m.layers; L++) {
    double rec = layer_us(t, L, 1, "recompute");
    CHECK(fabs(rec - want) < 0.01);
    CHECK(fabs(layer_us(t, L, 1, NULL) - rec - bwd) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, NULL) - fwd) < 0.01);
  }
  sim_trace_free(t);

  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_every = 2;
  CHECK_OK(synth_to_trace(&m, &t));
  for (int L = 0; L < m.layers; L++) {
    int ckpt = L % 2 == 1;
    CHECK(fabs(layer_us(t, L, 1, "recompute") - (ckpt ? fwd : 0)) < 0.01);
    CHECK(fabs(layer_us(t, L, 1, NULL) - (ckpt ? fwd + bwd : bwd)) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, "forward") - (ckpt ? fwd : 0)) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, NULL) - fwd) < 0.01);
  }
  sim_trace_free(t);
  sim_trace_free(t0);

  /* Megatron's selective: the attention core of a GPT block, flash off */
  synth_model g;
  CHECK_EQ(synth_preset("gpt3-1.3b", &g), 0);
  g.seq = 512, g.micro_batch = 2, g.layers = 2, g.flash = 0;
  CHECK_OK(synth_to_trace(&g, &t0));
  static const char *const core[] = {"self_attn.scores", "self_attn.softmax",
                                     "self_attn.attention_dropout", "self_attn.context"};
  want = 0;
  for (size_t i = 0; i < 4; i++) want += layer_us(t0, 1, 0, core[i]);
  g.checkpoint = SYNTH_CKPT_SELECTIVE, g.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK(want > 0 && fabs(layer_us(t, 1, 1, "recompute") - want) < 0.01);
  CHECK(fabs(layer_us(t, 1, 1, NULL) - want - layer_us(t0, 1, 1, NULL)) < 0.01);
  sim_trace_free(t);
  /* and the MLP activation alone: GELU */
  g.recompute = SYNTH_RECOMPUTE_MLP_ACT;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK(fabs(layer_us(t, 1, 1, "recompute") - layer_us(t0, 1, 0, "mlp.act")) < 0.01);
  sim_trace_free(t);
  sim_trace_free(t0);
  return 0;
}

/* Megatron's selective recomputation drops the attention core's s^2
 * tensors; FlashAttention has none, so it would change nothing: refused,
 * saying so and pointing to selective-op. So are the other modes that
 * would change nothing: full:K with K above the layers, a frequency without
 * full, a group that drops nothing. */
TEST(sim_synth_selective_with_flash_is_refused) {
  synth_model m;
  char err[512] = "";
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.checkpoint = SYNTH_CKPT_SELECTIVE;
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "FlashAttention has no s^2 tensor to drop, so it would change nothing");
  CHECK_STR_CONTAINS(err, "use selective-op (torchtitan's per-op policy), full or full:K, or --flash off");
  CHECK(strlen(err) < 255); /* whole in the CLI's message */
  FILE *f = fopen("/dev/null", "w");
  CHECK(f != NULL);
  err[0] = 0;
  int rc = synth_write(&m, f, err, sizeof err);
  fclose(f);
  CHECK_EQ(rc, -1);
  CHECK_STR_CONTAINS(err, "no s^2 tensor");
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE | SYNTH_RECOMPUTE_MLP_ACT; /* half a no-op: refused too */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  m.flash = 0; /* eager attention has the s^2 tensors */
  CHECK_OK(synth_validate(&m, err, sizeof err));
  m.flash = 1, m.recompute = SYNTH_RECOMPUTE_MLP_ACT; /* the activation exists with flash */
  CHECK_OK(synth_validate(&m, err, sizeof err));
  m.recompute = 0;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_every = 33;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "full:33: K must be within 1..layers (32)");
  m.ckpt_every = 32;
  CHECK_OK(synth_validate(&m, err, sizeof err));
  CHECK_EQ(synth_checkpointed_layers(&m), 1);
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs full checkpointing");
  return 0;
}

/* Each preset's parameter count against the published figure (within 1%),
 * and the shapes read from the models' config.json (sources in
 * trace_synth.c): Llama 3 8B 8.03B, 70B 70.6B (Meta's model cards); Qwen3-8B
 * 8.19B (card: 8.2B), Qwen3-14B 14.8B (card; 13.2B without embeddings),
 * Qwen3-30B-A3B 30.5B in total (29.9B without embeddings) and 3.3B
 * activated (Qwen's model cards); Mixtral 8x7B 46.7B in total, 12.9B per
 * token (Mistral AI). Qwen3-30B-A3B's activated count is 3.353B exactly
 * (the total less the 120 unrouted experts' 27.18B, embedding and head
 * included), 1.6% above the card's two-digit "3.3B" (what the count
 * without the router, 3.340B, would round to, though every token uses the
 * router): checked within 2%, and its exact formula in
 * sim_synth_moe_router_and_experts. */
TEST(sim_synth_presets_match_published_parameter_counts) {
  static const struct {
    const char *name;
    double total, active, active_tol, non_embedding;
  } pub[] = {{"llama3-8b", 8.03e9, 0, 0, 0},
             {"llama3-70b", 70.6e9, 0, 0, 0},
             {"qwen3-8b", 8.19e9, 0, 0, 6.95e9},
             {"qwen3-14b", 14.8e9, 0, 0, 13.2e9},
             {"qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02, 29.9e9},
             {"mixtral-8x7b", 46.7e9, 12.9e9, 0.01, 0}};
  for (size_t i = 0; i < sizeof pub / sizeof pub[0]; i++) {
    synth_model m;
    CHECK_EQ(synth_preset(pub[i].name, &m), 0);
    double P = (double)synth_param_count(&m), A = (double)synth_active_param_count(&m);
    double emb = 2.0 * m.vocab * m.hidden;
    fprintf(stderr, "  %-14s %.4g parameters (published %.4g), active %.4g\n", pub[i].name, P,
            pub[i].total, A);
    CHECK(fabs(P - pub[i].total) / pub[i].total < 0.01);
    if (pub[i].non_embedding) CHECK(fabs(P - emb - pub[i].non_embedding) / pub[i].non_embedding < 0.01);
    if (pub[i].active) CHECK(fabs(A - pub[i].active) / pub[i].active < pub[i].active_tol);
    else CHECK_EQ(A, P);
  }
  synth_model m;
  CHECK_EQ(synth_preset("qwen3-8b", &m), 0);
  CHECK(m.layers == 36 && m.hidden == 4096 && m.heads == 32 && m.kv_heads == 8 &&
        m.head_dim == 128 && m.ffn == 12288 && m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  CHECK_EQ(synth_preset("qwen3-14b", &m), 0);
  CHECK(m.layers == 40 && m.hidden == 5120 && m.heads == 40 && m.kv_heads == 8 &&
        m.head_dim == 128 && m.ffn == 17408 && m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  CHECK_EQ(synth_preset("qwen3-30b-a3b", &m), 0);
  CHECK(m.layers == 48 && m.hidden == 2048 && m.heads == 32 && m.kv_heads == 4 &&
        m.head_dim == 128 && m.experts == 128 && m.top_k == 8 && m.expert_ffn == 768 &&
        m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  /* tying the head to the embedding takes V h off */
  uint64_t untied = synth_param_count(&m);
  m.tie_embeddings = 1;
  CHECK_EQ(untied - synth_param_count(&m), (uint64_t)m.vocab * (uint64_t)m.hidden);
  return 0;
}

/* A small MoE (4 experts, top-2, QK-norm, head_dim 48): what a layer saves,
 * by hand (T tokens, t = T k / E = 256 per expert, fe the expert FFN):
 * attention as Qwen3 (6Th + 6T qd + 6T kvd + 8T + 8aT + 4 kv T), then the
 * router: its input 2Th, fp32 softmax 4TE, top-k indices 8Tk, top-k weights
 * 4Tk and their sums 4T; each expert: token indices 8t and slots 8t, its
 * input 2th, gate/SiLU/up/product 8t fe, output 2th, routing weight 2t.
 * torchtitan's policy: the matmuls count on across experts (q 1, k 2, v 3,
 * o 4; expert 0: gate 5, up 6, down 7; expert 1: gate 8, up 9, down 10...),
 * the router's gate forced to recompute and not counted: experts 0 and 2
 * keep gate and down (2t fe + 2th), 1 and 3 keep up (2t fe). */
TEST(sim_synth_moe_router_and_experts) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.layers = 2, m.qk_norm = 1, m.head_dim = 48;
  m.experts = 4, m.top_k = 2, m.expert_ffn = 128;
  const double T = 1024, h = m.hidden, a = m.heads, kv = m.kv_heads, E = 4, k = 2, fe = 128;
  const double qd = a * 48, kvd = kv * 48, t = T * k / E;
  const double attn = 6 * T * h + 6 * T * qd + 6 * T * kvd + 8 * T + 8 * a * T + 4 * kv * T;
  const double router = 2 * T * h + 4 * T * E + 8 * T * k + 4 * T * k + 4 * T;
  const double experts = E * (16 * t + 4 * t * h + 8 * t * fe + 2 * t);
  sim_trace *tr = NULL;
  CHECK_OK(synth_to_trace(&m, &tr));
  const double rope = 4 * m.seq * 48.0; /* cos, sin: packed by layer 0, aliased by layer 1 */
  CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(attn + router + experts + rope));
  CHECK_EQ(trace_layer_bytes(tr, 0), (uint64_t)(attn + router + experts + rope));
  CHECK_EQ(trace_layer_bytes(tr, 1), (uint64_t)(attn + router + experts));
  /* the experts' modules, each with its share of the tokens */
  int expert_inputs = 0;
  for (uint32_t i = 0; i < tr->n_tensors; i++) {
    const trace_tensor *x = &tr->tensors[i];
    if (x->desc.layer == 1 && x->alias_of < 0 && x->desc.phase == FERRY_PHASE_FORWARD &&
        strstr(x->desc.module_path, ".mlp.experts.") && strstr(x->desc.module_path, "gate_proj") &&
        x->desc.kind == FERRY_KIND_ACTIVATION) {
      CHECK_EQ(x->desc.shape[0], (int64_t)t);
      CHECK_EQ(x->desc.shape[1], (int64_t)h);
      expert_inputs++;
    }
  }
  CHECK_EQ(expert_inputs, 4);
  sim_trace_free(tr);
  /* parameters: attention, two norms, QK-norm, router, experts */
  const uint64_t per_layer_attn = (uint64_t)(h * qd + 2 * h * kvd + qd * h + 2 * h + 2 * 48 + h * E);
  const uint64_t base = 2 * (uint64_t)m.vocab * (uint64_t)h + (uint64_t)h; /* final RMSNorm: h */
  CHECK_EQ(synth_param_count(&m), base + 2 * (per_layer_attn + (uint64_t)(E * 3 * h * fe)));
  CHECK_EQ(synth_active_param_count(&m), base + 2 * (per_layer_attn + (uint64_t)(k * 3 * h * fe)));
  /* torchtitan's per-op policy (compiled: what it keeps is packed) */
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP, m.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
  const double sac = 2 * T * h + 2 * T * qd + 2 * T * kvd + 2 * T * qd + 4 * a * T +
                     2 * (2 * t * fe + 2 * t * h) + 2 * (2 * t * fe);
  CHECK_OK(synth_to_trace(&m, &tr));
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)sac);
  CHECK_EQ(trace_layer_bytes(tr, 0), (uint64_t)sac);
  sim_trace_free(tr);
  /* an uneven split: T k mod E tokens go one each to the first experts */
  m.checkpoint = SYNTH_CKPT_OFF, m.ckpt_impl = SYNTH_CKPT_IMPL_AUTO, m.seq = 511, m.micro_batch = 1, m.experts = 3;
  CHECK_OK(synth_to_trace(&m, &tr));
  int64_t rows = 0;
  for (uint32_t i = 0; i < tr->n_tensors; i++) {
    const trace_tensor *x = &tr->tensors[i];
    if (x->desc.layer == 0 && x->alias_of < 0 && x->desc.phase == FERRY_PHASE_FORWARD &&
        strstr(x->desc.module_path, "gate_proj") && x->desc.kind == FERRY_KIND_ACTIVATION) {
      CHECK(x->desc.shape[0] == 340 || x->desc.shape[0] == 341); /* 1022 = 341 + 341 + 340 */
      rows += x->desc.shape[0];
    }
  }
  CHECK_EQ(rows, 511 * 2);
  sim_trace_free(tr);
  return 0;
}
