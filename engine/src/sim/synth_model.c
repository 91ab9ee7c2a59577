/*
 * synth_model.c — the trace synthesizer's presets, validation and
 * parameter arithmetic (declared in ferry_tools.h; docs/sim-synth.md).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/synth_internal.h"

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
    /* GPT-3 follows GPT-2: the output layer is the token embedding
     * (tied) and positions are learned embeddings of n_ctx = 2048 rows
     * (Brown et al. 2020, section 2.1; Radford et al. 2019). */
    m->arch = SYNTH_GPT;
    m->layers = 24, m->hidden = 2048, m->heads = 16, m->kv_heads = 16, m->ffn = 8192;
    m->vocab = 50257, m->seq = 2048, m->tie_embeddings = 1, m->positions = 2048;
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


int64_t synth_loss_chunk(const synth_model *m) {
  const int64_t tokens = (int64_t)m->micro_batch * seq_local_of(m);
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


void op_list_free(op_list *l) {
  free(l->ops);
  l->ops = NULL;
  l->n = l->cap = 0;
}

/* Whether some save of the layer belongs to group g (a selective group that
 * drops nothing would be a silent no-op). */
int group_drops_something(const op_list *l, unsigned g) {
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
  if (m->positions < 0 || m->positions > 1 << 24) BAD("positions %d must be within 0..16777216", m->positions);
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
  if (m->sp && seq_local_of(m) % t) BAD("sp: tp %d must divide seq %d (per context-parallel rank)", t, (int)seq_local_of(m));
  return 0;
}

/* Ring attention's context parallelism: the sequence split evenly, with
 * load balancing two chunks per rank (seq divisible by 2 cp), FlashAttention
 * per K/V chunk. */
static int validate_cp(const synth_model *m, char *err, size_t errlen) {
  if (m->cp < 0 || m->cp > 1 << 16) BAD("cp %d must be within 1..65536", m->cp);
  if (m->cp_impl != SYNTH_CP_RING && m->cp_impl != SYNTH_CP_ULYSSES)
    BAD("cp_impl %d is not ring (0) or ulysses (1)", m->cp_impl);
  /* else nothing would use it: the trace would be ring's, or no CP's */
  if (m->cp_impl == SYNTH_CP_ULYSSES && m->cp <= 1)
    BAD("--cp-impl ulysses needs --cp N with N > 1 (context parallelism is off at cp %d)", m->cp);
  if (ulysses_of(m)) {
    /* each rank attends with heads / cp of the whole sequence: the heads,
     * the KV heads (per tensor-parallel rank) and the sequence split evenly */
    const int t = m->tp > 1 ? m->tp : 1;
    if ((m->heads / t) % m->cp || (m->kv_heads / t) % m->cp)
      BAD("--cp-impl ulysses: --cp %d must divide the heads (%d) and the KV heads (%d)%s: each rank "
          "attends with heads / cp", m->cp, m->heads / t, m->kv_heads / t, t > 1 ? " per --tp rank" : "");
    if (m->seq % m->cp) BAD("--cp-impl ulysses: --cp %d must divide seq %d", m->cp, m->seq);
    if (!m->flash)
      BAD("--cp-impl ulysses with --cp %d needs --flash on (eager attention would hold the whole "
          "sequence's s x s scores)", m->cp);
    return 0;
  }
  if (m->cp > 1 && m->seq % (2 * m->cp))
    BAD("cp %d: 2 x cp must divide seq %d (ring attention's load balancing gives each rank two "
        "chunks of seq / 2cp tokens)", m->cp, m->seq);
  if (m->cp > 1 && !m->flash)
    BAD("cp %d needs --flash on (ring attention runs FlashAttention per K/V chunk; eager attention "
        "would hold s x s scores)", m->cp);
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
  if (m->loss_chunk < 0 || (int64_t)m->loss_chunk > (int64_t)m->micro_batch * seq_local_of(m))
    BAD("chunked:%d: N must be within 1..tokens (micro-batch x seq%s = %lld)", m->loss_chunk,
        m->cp > 1 ? " / cp" : "", (long long)m->micro_batch * seq_local_of(m));
  if (m->shard < 1 || m->shard > 1 << 20) BAD("shard %d must be >= 1", m->shard);
  if (!(m->tflops > 0 && m->tflops < 1e6)) BAD("tflops must be > 0");
  if (!(m->hbm_gbps > 0 && m->hbm_gbps < 1e7)) BAD("hbm bandwidth must be > 0");
  if (m->steps < 1 || m->steps > 1000000) BAD("steps %d must be within 1..1000000", m->steps);
  if (m->norm != SYNTH_NORM_FUSED && m->norm != SYNTH_NORM_EAGER) BAD("norm must be fused or eager");
  if (m->arch == SYNTH_GPT && m->norm == SYNTH_NORM_EAGER)
    BAD("--norm eager is for RMSNorm (llama arch); gpt's LayerNorm is one native op "
        "(native_layer_norm) on every device");
  if (validate_training(m, err, errlen) || validate_cp(m, err, errlen) || validate_tp(m, err, errlen))
    return -1;
  double widest = m->ffn > m->vocab ? m->ffn : m->vocab;
  if ((double)m->heads * (double)head_dim_of(m) > widest) widest = (double)m->heads * (double)head_dim_of(m);
  double per_tensor = (double)m->micro_batch * m->seq * widest * 4;
  double s2 = (double)m->micro_batch * m->heads * (double)m->seq * m->seq * 4;
  if (per_tensor > 1e15 || (!m->flash && s2 > 1e15)) BAD("tensors would exceed 1 PB: shape too large");
  if (m->ckpt_impl < SYNTH_CKPT_IMPL_AUTO || m->ckpt_impl > SYNTH_CKPT_IMPL_COMPILED)
    BAD("bad checkpoint implementation");
  if (m->ckpt_impl != SYNTH_CKPT_IMPL_AUTO && m->checkpoint == SYNTH_CKPT_OFF)
    BAD("a checkpoint implementation (%s) needs checkpointing", ckpt_impl_name(m->ckpt_impl));
  if (m->checkpoint == SYNTH_CKPT_SELECTIVE_OP && m->ckpt_impl == SYNTH_CKPT_IMPL_REENTRANT)
    BAD("selective-op runs only non-reentrant (torch's selective checkpointing: context_fn "
        "needs use_reentrant=False) or compiled");
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

/* ---- parameters ------------------------------------------------------------------- */
/* The weight matrices of one block; with active, the router and top_k
 * experts only. */
uint64_t layer_matrices(const synth_model *m, int active) {
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
uint64_t layer_norms(const synth_model *m) {
  const uint64_t h = (uint64_t)m->hidden;
  uint64_t norms = m->arch == SYNTH_LLAMA ? 2 * h : 4 * h;
  if (m->qk_norm) norms += 2 * (uint64_t)head_dim_of(m);
  return norms;
}

/* The final norm's weights: RMSNorm a weight (h), LayerNorm a weight and a
 * bias (2h). */
uint64_t final_norm_params(const synth_model *m) {
  return (m->arch == SYNTH_LLAMA ? 1u : 2u) * (uint64_t)m->hidden;
}

static uint64_t layer_params(const synth_model *m, int active) {
  return layer_matrices(m, active) + layer_norms(m);
}

static uint64_t params(const synth_model *m, int active) {
  const uint64_t h = (uint64_t)m->hidden, V = (uint64_t)m->vocab;
  return V * h /* embedding */ + (uint64_t)m->positions * h /* learned positions */ +
         (uint64_t)m->layers * layer_params(m, active) +
         final_norm_params(m) + (m->tie_embeddings ? 0 : V * h) /* head */;
}

uint64_t synth_param_count(const synth_model *m) { return params(m, 0); }
uint64_t synth_active_param_count(const synth_model *m) { return params(m, 1); }

/* What one tensor-parallel rank holds (Megatron): the blocks' linears split
 * t ways (column- and row-parallel), the embedding and the head by
 * vocabulary (V / t rows, rounded up), the norms replicated. */
static uint64_t local_params(const synth_model *m) {
  const uint64_t h = (uint64_t)m->hidden, t = (uint64_t)tp_of(m), V = (uint64_t)vocab_local_of(m);
  return V * h + (uint64_t)m->positions * h + (uint64_t)m->layers * (layer_matrices(m, 0) / t + layer_norms(m)) +
         final_norm_params(m) + (m->tie_embeddings ? 0 : V * h);
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

void unit_sizes_of(const synth_model *m, unit_sizes *u) {
  const uint64_t h = (uint64_t)m->hidden, V = (uint64_t)vocab_local_of(m);
  const uint64_t table = V * h + (uint64_t)m->positions * h;
  u->embed = table;
  u->block = layer_matrices(m, 0) / (uint64_t)tp_of(m) + layer_norms(m);
  u->head = final_norm_params(m) + V * h;
  if (m->tie_embeddings) {
    /* one unit: FSDP2 lets a shared parameter live in one group only
     * (fully_shard([embedding, norm, head]), as Accelerate groups them) */
    u->embed = table + final_norm_params(m);
    u->head = 0;
  }
  u->embed_grad = u->embed;
  u->block_grad = u->block;
  u->head_grad = u->head;
}

/* Of n parameters, those trained (LoRA: the share, rounded). */
uint64_t trained_of(const synth_model *m, uint64_t n) {
  return m->lora > 0 ? (uint64_t)llround(m->lora * (double)n) : n;
}

/* The gradient a rank keeps of n parameters after the reduce-scatter (all
 * of it unsharded). */
uint64_t sharded_grad_bytes(const synth_model *m, uint64_t n) {
  return trained_of(m, n) * (uint64_t)ferry_dtype_size(grad_dtype_of(m)) / (uint64_t)m->shard;
}

/* Elements of the weight gradients op o's backward writes: its saved
 * parameters' and what it adds (extra_wgrad). */
uint64_t op_weight_elems(const op *o) {
  uint64_t n = (uint64_t)o->extra_wgrad;
  for (int k = 0; k < o->n_saves; k++) {
    const saved *x = &o->saves[k];
    if (x->kind != PARAM) continue;
    uint64_t el = 1;
    for (int d = 0; d < x->ndim; d++) el *= (uint64_t)x->shape[d];
    n += el;
  }
  return n;
}

/* Per GPU: the stored parameters (all of them), and for the trainable
 * share the gradients, the fp32 master weights and the optimizer states,
 * each divided by the sharding degree (FSDP / ZeRO-3). Parameters, master
 * weights and states are held all step (whole_step, the trace's resident
 * lines); the gradients appear during backward and go after the optimizer
 * step (zero_grad(set_to_none=True)), and sharded training holds gathered
 * compute copies of the units it runs: `gathered` is the most at once
 * (FSDP2's reshard_after_forward with a prefetch of one unit: a block and
 * the next, or the head with the last block in backward; the trace writes
 * them as they come and go). Mixed-precision AdamW by default: 2 + 2 + 4 +
 * 8 = 16 bytes per parameter (the ZeRO paper's 16). */
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
  if (sh > 1) {
    unit_sizes u;
    unit_sizes_of(m, &u);
    uint64_t most = 2 * u.block; /* a block and the one prefetched */
    if (m->layers < 2) most = u.block;
    if (m->tie_embeddings) most += u.embed; /* the tied unit is held from forward to backward */
    if (u.embed + u.block > most) most = u.embed + u.block;
    if (u.head + u.block > most) most = u.head + u.block;
    r->gathered = most * (uint64_t)ferry_dtype_size(m->dtype);
  }
  r->whole_step = r->params + r->master + r->states;
  r->total = r->whole_step + r->grads + r->gathered;
  r->layer_params = (layer_matrices(m, 0) / (uint64_t)tp_of(m) + layer_norms(m)) *
                    (uint64_t)ferry_dtype_size(param_dtype_of(m)) / sh;
}

uint64_t synth_resident_bytes(const synth_model *m) {
  synth_resident r;
  synth_resident_parts(m, &r);
  return r.total;
}

/* The optimizer step's device-memory traffic per trainable parameter this
 * rank steps, with gradient clipping before it (Hugging Face's Trainer and
 * torchtitan clip at max_norm 1.0 by default): torch.nn.utils.clip_grad_norm_
 * (foreach) reads every gradient for the norm, then scales them in place
 * (read and write): 3g, g the gradient's bytes. AdamW as torch runs it by
 * default (torch 2: Adam's _multi_tensor_adam, decoupled decay; foreach),
 * each op a pass over the stepped copy (e bytes an element: 4 with master
 * weights): weight decay mul_ (r p, w p: 2e), lerp_ of exp_avg toward the
 * gradient (3e), mul_ of exp_avg_sq (2e), addcmul_ grad x grad into it (4e),
 * sqrt into a new tensor (2e), div_ by the bias correction (2e), add_ eps
 * (2e), addcdiv_ into the parameter (4e): 21e; with master weights a
 * half-precision gradient is first cast to fp32 (g + 4; an fp32 one, FSDP's
 * reduce_dtype=float32, is used as it is) and the updated master copied back
 * to the parameter (4 + p): 102 bytes with bf16 parameters and bf16 or fp32
 * gradients, where reading and writing each kept byte once would be 32. The other
 * optimizers: every kept byte read and written once, plus clipping. */
double optimizer_step_bytes(const synth_model *m, const synth_resident *r) {
  if (m->optimizer == SYNTH_OPT_NONE) return 0;
  const double n = (double)r->trainable / (double)m->shard;
  const double g = ferry_dtype_size(grad_dtype_of(m)), p = ferry_dtype_size(param_dtype_of(m));
  const double clip = 3 * g * n;
  if (m->optimizer == SYNTH_OPT_ADAMW) {
    const double e = master_of(m) ? 4 : p;
    const double cast = master_of(m) && g != 4 ? g + 4 : 0;
    return clip + n * (21 * e + cast + (master_of(m) ? 4 + p : 0));
  }
  const double own = n * p;
  return clip + 2 * (own + (double)(r->grads + r->master + r->states));
}
