/* test_sim_synth_memory.c — the synthesizer's memory beyond the saved
 * activations: the loss working set (full and chunked), the resident
 * memory of the training knobs, and tensor parallelism. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"

/* ---- the loss working set ------------------------------------------------------ */

/* Bytes of the activation packs (not aliases) outside the blocks of module
 * mod, or of every activation pack but the head's and the loss's (mod
 * NULL: what the rest of the model holds at the loss). Hugging Face's loss
 * runs in the model's own forward (module ""); Liger's is a module, `loss`. */
static uint64_t outer_pack_bytes(const sim_trace *t, const char *mod) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->alias_of >= 0 || x->desc.kind != FERRY_KIND_ACTIVATION) continue;
    const char *p = x->desc.module_path ? x->desc.module_path : "";
    int head = !strcmp(p, "lm_head") || !strcmp(p, "loss") || !p[0];
    if (mod ? !strcmp(p, mod) : !head) n += x->desc.bytes;
  }
  return n;
}

static int replay_no_offload(const sim_trace *t, sim_result *r) {
  sim_config c = {0};
  char err[512];
  c.link = sim_hw_preset("h100")->link;
  c.steps = 1;
  int rc = sim_replay(t, &c, r, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  return rc;
}

/* Hugging Face's loss (full) on a small model (T = sb = 256 tokens, V =
 * 1000, h = 256, bf16), by hand: lm_head saves its input 2Th; the logits
 * (2TV) and their fp32 copy (4TV) are transient until the end of forward;
 * log_softmax saves 4TV (nll_loss the same buffer again, an alias), the
 * labels 8T and its total_weight, an fp32 scalar (4 bytes), all in the
 * model's own forward (module "", class LlamaForCausalLM). Backward: nll_loss's gradient 4TV, log_softmax's 4TV while
 * the log-probabilities are held, the copy back 2TV. The peak is at
 * log_softmax's backward: the rest of the model (A) + 2Th + 3 x 4TV.
 * Chunked (Liger, chunk c = next_pow2(ceil(T / ceil(V / h))) = 64): during
 * its forward grad_input 2Th, grad_weight 2Vh, per-token losses 4T and a
 * chunk's logits 2cV; then it saves the two gradients. Its peak: A + 2Th +
 * 2Vh + 4T + 2cV, below full's by 12TV - 2Vh - 4T - 2cV. */
TEST(sim_synth_loss_working_set_full_and_chunked) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.vocab = 1000, m.seq = 128, m.micro_batch = 2, m.layers = 2;
  /* SGD steps in place: foreach AdamW's transients would put this small
   * model's peak at the optimizer step, past the loss */
  m.optimizer = SYNTH_OPT_SGD;
  /* a narrower MLP (ffn 256): with the weights' gradients written during
   * backward (issue 42 item 6), ffn 512 put the chunked loss's peak 1.5 KB
   * higher in the last block's backward (its down_proj's gradient beside
   * the head's), past the loss's own working set this compares */
  m.ffn = 256;
  const uint64_t T = 256, V = 1000, h = 256, c = 64;
  sim_trace *full = NULL, *chunked = NULL;
  CHECK_OK(synth_to_trace(&m, &full));
  CHECK_EQ(outer_pack_bytes(full, "lm_head"), 2 * T * h);
  CHECK_EQ(outer_pack_bytes(full, ""), 4 * T * V + 8 * T + 4);
  CHECK_EQ(outer_pack_bytes(full, "loss"), 0);
  CHECK_EQ(alloc_bytes(full, "lm_head: logits"), 2 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: logits.float()"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the log-probabilities (nll_loss backward)"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the fp32 logits (log_softmax backward)"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the logits (model dtype)"), 2 * T * V);
  /* and the two blocks' input gradients (2Th each), and (tiny: shard 1)
   * the weights' gradients as each op's backward writes them: 9 ops of each
   * block, the final norm, the head, the embedding */
  CHECK_EQ(alloc_bytes(full, "gradient: block input"), 2 * 2 * T * h);
  CHECK_EQ(full->n_allocs, 7 + 2 * 9 + 3);
  int aliases = 0;
  for (uint32_t i = 0; i < full->n_tensors; i++)
    aliases += full->tensors[i].alias_of >= 0 && !strcmp(full->tensors[i].desc.module_path, "") &&
               !strcmp(full->tensors[i].desc.module_class, "LlamaForCausalLM");
  CHECK_EQ(aliases, 1);
  m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_loss_chunk(&m), (int64_t)c);
  CHECK_OK(synth_to_trace(&m, &chunked));
  CHECK_EQ(outer_pack_bytes(chunked, "lm_head"), 0);
  CHECK_EQ(outer_pack_bytes(chunked, "loss"), 2 * T * h + 2 * V * h);
  CHECK_EQ(alloc_bytes(chunked, "loss: logits of one chunk of tokens"), 2 * c * V);
  CHECK_EQ(alloc_bytes(chunked, "loss: per-token losses (fp32)"), 4 * T);
  /* the rest of the model is the same in both */
  const uint64_t A = outer_pack_bytes(full, NULL);
  CHECK_EQ(outer_pack_bytes(chunked, NULL), A);
  sim_result rf, rc;
  CHECK_OK(replay_no_offload(full, &rf));
  CHECK_OK(replay_no_offload(chunked, &rc));
  CHECK_EQ(rf.peak_saved_bytes, A + 2 * T * h + 12 * T * V);
  CHECK_EQ(rc.peak_saved_bytes, A + 2 * T * h + 2 * V * h + 4 * T + 2 * c * V);
  CHECK_EQ(rf.peak_saved_bytes - rc.peak_saved_bytes, 12 * T * V - 2 * V * h - 4 * T - 2 * c * V);
  CHECK(rf.peak_saved_bytes - rc.peak_saved_bytes > 2 * T * V); /* at least the logits */
  sim_result_free(&rf);
  sim_result_free(&rc);
  sim_trace_free(full);
  sim_trace_free(chunked);
  /* a chunk size of one's own, at most the tokens; only for chunked */
  m.loss_chunk = 100;
  CHECK_EQ(synth_loss_chunk(&m), 100);
  char err[256];
  m.loss_chunk = 257;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "1..tokens");
  m.loss = SYNTH_LOSS_FULL, m.loss_chunk = 8;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  /* Liger's rule on Llama 3 8B at 8192 tokens: ceil(128256 / 4096) = 32, 256 tokens */
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_loss_chunk(&m), 256);
  return 0;
}

/* ---- resident memory from the training knobs --------------------------------------- */
/* The trace's resident bytes named what (0 if none). */
static uint64_t resident_of(const sim_trace *t, const char *what) {
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, what)) return t->resident[i].bytes;
  return 0;
}

/* Whether the trace's first step has a compute event named op. */
static int has_compute_op(const sim_trace *t, const char *op) {
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++)
    if (t->events[k].type == TEV_COMPUTE && t->events[k].op && !strcmp(t->events[k].op, op)) return 1;
  return 0;
}

/* One knob combination's parts against hand arithmetic (bytes per
 * parameter p, g, master, states of the trained share T; shard 1). */
static int check_parts(const synth_model *m, uint64_t P, uint64_t T, uint64_t p, uint64_t g,
                       uint64_t master, uint64_t states) {
  synth_resident r;
  synth_resident_parts(m, &r);
  CHECK_EQ(r.local_params, P);
  CHECK_EQ(r.trainable, T);
  CHECK_EQ(r.params, P * p);
  CHECK_EQ(r.grads, T * g);
  CHECK_EQ(r.master, T * master);
  CHECK_EQ(r.states, states);
  CHECK_EQ(r.gathered, 0);
  CHECK_EQ(r.whole_step, P * p + T * master + states);
  CHECK_EQ(r.total, P * p + T * (g + master) + states);
  CHECK_EQ(synth_resident_bytes(m), r.total);
  return 0;
}

/* Llama 3 8B (P = 8.03e9), shard 1, by hand:
 *  - bf16 parameters and gradients, fp32 master weights, AdamW: 2+2+4+8 = 16
 *    bytes per parameter (the ZeRO paper's mixed-precision Adam);
 *  - adamw8bit: 2+2+4+2, plus two fp32 absmax per 256 values (bitsandbytes'
 *    blockwise states): 8 ceil(P / 256) bytes;
 *  - sgd: 2+2+4; sgd-momentum 2+2+4+4; none 2+2+4 and no optimizer step;
 *  - master weights off: AdamW's states in bf16, 2+2+4;
 *  - fp32 parameters: no master copy (auto), 4+4+8; bf16 gradients 4+2+8;
 *  - LoRA 1%: T = round(0.01 P) trained: 2P + (2+4+8) T;
 *  - tp 2: the blocks' linears, the embedding and the head halved, the
 *    norms (2h per layer and the final RMSNorm's h) kept: P/2 + the norms/2;
 *  - shard 8: every part / 8; gathered, the most FSDP holds at once: the
 *    final norm with the head (h + V/2 h) and the last block (its linears
 *    / 2 + its norms 2h) in bf16, in the loss's backward. */
TEST(sim_synth_resident_knobs_match_hand_arithmetic) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1;
  const uint64_t P = synth_param_count(&m);
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 8 * P), 0);
  CHECK_EQ(synth_resident_bytes(&m), 16 * P);
  m.optimizer = SYNTH_OPT_ADAMW_8BIT;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 2 * P + 8 * ((P + 255) / 256)), 0);
  m.optimizer = SYNTH_OPT_SGD;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 0), 0);
  m.optimizer = SYNTH_OPT_SGD_MOMENTUM;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 4 * P), 0);
  m.optimizer = SYNTH_OPT_NONE;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 0), 0);
  m.optimizer = SYNTH_OPT_ADAMW;
  m.master_weights = SYNTH_MASTER_OFF;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 0, 4 * P), 0);
  m.master_weights = SYNTH_MASTER_AUTO;
  m.param_dtype = FERRY_DTYPE_F32;
  CHECK_EQ(check_parts(&m, P, P, 4, 4, 0, 8 * P), 0);
  m.grad_dtype = FERRY_DTYPE_BF16;
  CHECK_EQ(check_parts(&m, P, P, 4, 2, 0, 8 * P), 0);
  char err[256];
  m.master_weights = SYNTH_MASTER_ON; /* fp32 parameters are their own master copy */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "master weights on");
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1;
  m.lora = 0.01;
  const uint64_t T = (uint64_t)llround(0.01 * (double)P);
  CHECK_EQ(check_parts(&m, P, T, 2, 2, 4, 8 * T), 0);
  m.lora = 0;
  m.tp = 2;
  const uint64_t norms = (uint64_t)m.layers * 2 * (uint64_t)m.hidden + (uint64_t)m.hidden;
  const uint64_t P2 = (P - norms) / 2 + norms;
  CHECK_EQ(check_parts(&m, P2, P2, 2, 2, 4, 8 * P2), 0);
  /* sharded: each part over 8, and the head's unit with a block gathered
   * (tp 2: the head's vocabulary and the block's linears halved) */
  m.shard = 8;
  synth_resident r;
  synth_resident_parts(&m, &r);
  const uint64_t h = (uint64_t)m.hidden, kvd = 1024, f = (uint64_t)m.ffn;
  const uint64_t block = 2 * h * h + 2 * h * kvd + 3 * h * f;
  CHECK_EQ(r.params, P2 * 2 / 8);
  CHECK_EQ(r.states, P2 * 8 / 8);
  CHECK_EQ(r.gathered, ((h + 64128 * h) + (block / 2 + 2 * h)) * 2);
  /* the trace declares the parts, master weights apart from the states,
   * and skips the optimizer step without an optimizer */
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.optimizer = SYNTH_OPT_ADAMW_8BIT;
  m.lora = 0.25;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  synth_resident_parts(&m, &r);
  CHECK_EQ(resident_of(t, "parameters"), r.params);
  CHECK_EQ(resident_of(t, "gradients"), r.grads);
  CHECK_EQ(resident_of(t, "master weights"), r.master);
  CHECK_EQ(resident_of(t, "optimizer states"), r.states);
  /* the gradients line is transient: the step's allocs hold them */
  CHECK_EQ(t->resident_bytes, r.whole_step);
  CHECK(has_compute_op(t, "optimizer"));
  sim_trace_free(t);
  m.optimizer = SYNTH_OPT_NONE;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK(!has_compute_op(t, "optimizer"));
  sim_trace_free(t);
  m.lora = 1.5;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  return 0;
}

/* Korthikanti et al. 2022 with tensor parallelism t (section 4.2, Table
 * 2): a GPT layer stores sbh (10 + 24/t + 5as/(ht)) bytes: the layer
 * norms' inputs (4sbh), the QKV and first MLP linear's inputs (4sbh) and
 * the two dropout masks (2sbh) are outside the tensor-parallel region, the
 * rest split t ways. With sequence parallelism (4.2.2, Table 2) the 10sbh
 * are split along the sequence too: sbh/t (34 + 5as/h). Plus the synthesizer's extras: the
 * norms' statistics (16sb, split with sequence parallelism) and, with
 * FlashAttention, the log-sum-exp (4asb/t). Llama: every saved tensor is
 * split with tp and sp, so a layer keeps exactly 1/t, but for the rotary
 * tables (cos, sin: 4 s head_dim), which every rank holds whole. */
TEST(sim_synth_tensor_parallel_matches_korthikanti) {
  synth_model m;
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.layers = 2, m.tp = 4;
  const double s = m.seq, b = m.micro_batch, h = m.hidden, a = m.heads, t = 4;
  for (int sp = 0; sp <= 1; sp++)
    for (int flash = 0; flash <= 1; flash++) {
      m.sp = sp, m.flash = flash;
      double eq = sp ? s * b * h / t * (34 + (flash ? 0 : 5 * a * s / h))
                     : s * b * h * (10 + 24 / t + (flash ? 0 : 5 * a * s / (h * t)));
      double extras = 16 * s * b / (sp ? t : 1) + (flash ? 4 * a * s * b / t : 0);
      CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(eq + extras));
      sim_trace *tr = NULL;
      CHECK_OK(synth_to_trace(&m, &tr));
      CHECK_EQ(trace_layer_bytes(tr, 1), (uint64_t)(eq + extras));
      sim_trace_free(tr);
    }
  /* full checkpointing keeps the block's input: its sequence share with sp */
  m.checkpoint = SYNTH_CKPT_FULL;
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)(2 * s * b * h / t));
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  const uint64_t whole = synth_layer_activation_bytes(&m), rope = 4 * 8192 * 128;
  m.tp = 8, m.sp = 1;
  CHECK_EQ((synth_layer_activation_bytes(&m) - rope) * 8, whole - rope);
  /* the head is vocab-parallel: the logits and the saved log-probabilities
   * are V/t per rank */
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.tp = 2;
  sim_trace *tr = NULL;
  CHECK_OK(synth_to_trace(&m, &tr));
  const uint64_t T = (uint64_t)m.seq, Vt = (uint64_t)m.vocab / 2;
  CHECK_EQ(alloc_bytes(tr, "lm_head: logits"), 2 * T * Vt);
  CHECK_EQ(outer_pack_bytes(tr, ""), 4 * T * Vt + 8 * T); /* no total_weight: Megatron's loss */
  sim_trace_free(tr);
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  char err[256];
  m.tp = 3; /* 32 heads */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "must divide heads");
  m.tp = 1, m.sp = 1;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs tp > 1");
  m.tp = 2, m.sp = 0, m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "chunked loss");
  CHECK_EQ(synth_preset("mixtral-8x7b", &m), 0);
  m.tp = 2;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "experts");
  return 0;
}
