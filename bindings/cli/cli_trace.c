/*
 * cli_trace.c — `ferry trace synth ...`: write the trace of a decoder-only
 * transformer's training step from its shape (the synthesizer in ferry_tools.h).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "cli.h"
#include "ferry_tools.h"

static void synth_usage(FILE *f) {
  fprintf(f,
          "usage: ferry trace synth [--preset NAME] [options] -o FILE\n"
          "\n"
          "Writes the trace (docs/trace-format.md) of a decoder-only transformer's training\n"
          "steps, for `ferry sim --trace FILE`.\nPresets: %s.\n"
          "\n"
          "  --preset NAME        start from a preset (default llama3-8b)\n"
          "  --arch llama|gpt     llama: RMSNorm, GQA, SwiGLU; gpt: LayerNorm, GeLU, dropout\n"
          "  --layers N --hidden N --heads N --kv-heads N --ffn N --vocab N\n"
          "  --head-dim N         per-head width (default hidden / heads; Qwen3: 128)\n"
          "  --qk-norm on|off     RMSNorm on q and k per head, as Qwen3 (llama arch)\n"
          "  --experts N          MoE: N experts per layer (llama arch; 0 = dense), tokens\n"
          "                       split evenly among them\n"
          "  --top-k K            experts per token (MoE)\n"
          "  --expert-ffn N       an expert's FFN width (default --ffn)\n"
          "  --tie-embeddings on|off  the head shares the embedding (parameter count)\n"
          "  --seq N              sequence length (default 8192)\n"
          "  --micro-batch N      sequences per micro-batch (default 1)\n"
          "  --dtype T            bf16 (default), f16, f32\n"
          "  --flash on|off       FlashAttention (default on): no s^2 tensors; off: Hugging\n"
          "                       Face's eager attention (bmm, softmax in fp32)\n"
          "  --norm fused|eager   what an RMSNorm saves (llama arch): fused (default), one\n"
          "                       kernel: input, rstd; eager: Hugging Face's LlamaRMSNorm op\n"
          "                       by op: the fp32 input, rstd, the normalized tensor (a CPU\n"
          "                       run, or a GPU run without fused kernels)\n"
          "  --checkpoint MODE    activation checkpointing (docs/sim-synth.md):\n"
          "                       none (default; also off)\n"
          "                       full: every block keeps only its input, recomputed\n"
          "                         before its backward\n"
          "                       full:K: every K-th block (torchtitan's ac_freq: blocks\n"
          "                         K, 2K, ... counted from 1), the others save everything\n"
          "                       selective-op: torchtitan's per-op policy: keeps the\n"
          "                         outputs of the 1st, 3rd, 5th... matmul of a block and\n"
          "                         of flash attention, recomputes the rest\n"
          "                       selective[:attn_core+mlp_act]: Megatron-LM's: recomputes\n"
          "                         the attention core (the s^2 tensors; needs --flash\n"
          "                         off) and/or the MLP activation\n"
          "  --checkpoint-impl I  which checkpoint runs it, so what a saved-tensor hook\n"
          "                       (ferry's policy) receives: reentrant (Hugging Face's\n"
          "                       default; the block input and the recomputed tensors),\n"
          "                       non-reentrant (torchtitan's: none of them; the default\n"
          "                       for full and selective-op), compiled (the input and\n"
          "                       selective-op's kept outputs)\n"
          "  --loss MODE          the loss after lm_head (docs/sim-synth.md):\n"
          "                       full (default): Hugging Face's: bf16 logits, their fp32\n"
          "                         copy and log-softmax, the gradients in backward\n"
          "                       chunked[:N]: a fused linear cross-entropy (Liger's):\n"
          "                         logits N tokens at a time (default: Liger's chunk),\n"
          "                         gradients computed in forward and saved\n"
          "  --shard N            data-parallel sharding degree, FSDP/ZeRO-3 (default 8)\n"
          "  --param-dtype T      stored parameters: bf16, f16, fp32 (default --dtype)\n"
          "  --grad-dtype T       gradients: bf16, f16, fp32 (default the parameters')\n"
          "  --master-weights on|off  an fp32 copy of the trained parameters (default on\n"
          "                       with 16-bit parameters)\n"
          "  --optimizer NAME     adamw (default), adamw8bit, sgd, sgd-momentum, none\n"
          "  --lora FRACTION      the trained share of the parameters (LoRA): gradients,\n"
          "                       master weights and optimizer states for it only\n"
          "  --tp N               Megatron tensor parallelism: the blocks' linears, the\n"
          "                       embedding and head split N ways, so are the activations\n"
          "                       inside the tensor-parallel region (default 1)\n"
          "  --sp on|off          sequence parallelism with --tp: the norms', dropouts' and\n"
          "                       the region's inputs' activations split N ways too\n"
          "  --cp N               context parallelism (ring attention): each GPU holds seq/N\n"
          "                       tokens, attends over all keys (the causal work / N) and\n"
          "                       holds the ring's K/V receive buffers (default 1)\n"
          "  --cp-impl ring|ulysses  how --cp N (N > 1: refused without) splits attention:\n"
          "                       ring (default), or DeepSpeed-Ulysses: all-to-alls around\n"
          "                       attention give each GPU the whole sequence of heads/N\n"
          "                       (N must divide the heads and the KV heads)\n"
          "  --tflops X           achieved matmul throughput in TFLOP/s (default 400)\n"
          "  --hbm GBPS           achieved element-wise bandwidth in GB/s (default 2000)\n"
          "  --steps N            steps in the trace (default 1)\n"
          "  -o, --output FILE    where to write (\"-\" = stdout)\n"
          "  -q, --quiet          no summary line on stderr (errors only)\n"
          "  -v, --verbose        also print every dimension of the model on stderr\n"
          "  -h, --help           this help\n"
          "\n"
          "examples:\n"
          "  ferry trace synth -o llama3-8b.jsonl\n"
          "  ferry trace synth --preset tiny --steps 2 -o - | ferry sim --policy default --trace -\n"
          "  ferry trace synth --layers 48 --hidden 6144 --seq 4096 --checkpoint full -o big.jsonl\n"
          "  ferry trace synth --preset qwen3-8b --checkpoint selective-op -o qwen3-8b.jsonl\n"
          "  ferry trace synth --preset mixtral-8x7b --checkpoint full:4 -o mixtral.jsonl\n"
          "  ferry trace synth --preset llama3-8b --loss chunked -o llama3-8b-liger.jsonl\n"
          "  ferry trace synth --preset llama3-70b --tp 8 --sp on --shard 4 -o llama3-70b.jsonl\n"
          "  ferry trace synth --preset llama3-8b --lora 0.01 --optimizer adamw8bit -o lora.jsonl\n",
          synth_preset_names());
}

/* A model dimension or count: a whole number in [0, 2^30]. */
static int int_arg(const char *opt, const char *v, int *out) {
  long x;
  if (cli_int("trace synth", opt, v, 0, 1L << 30, &x)) return -1;
  *out = (int)x;
  return 0;
}

/* A throughput: a number above 0. */
static int num_arg(const char *opt, const char *v, double *out) {
  return cli_number("trace synth", opt, v, FERRY_NUMBER_REAL, 0, 1e9, 1, out) ? -1 : 0;
}

static int on_off(const char *opt, const char *v, int *out) {
  if (!strcmp(v, "on")) *out = 1;
  else if (!strcmp(v, "off")) *out = 0;
  else {
    fprintf(stderr, "ferry trace synth: %s %s: on or off\n", opt, v);
    return -1;
  }
  return 0;
}

static int parse_checkpoint(const char *v, synth_model *m) {
  m->ckpt_every = 1;
  if (!strcmp(v, "none") || !strcmp(v, "off")) m->checkpoint = SYNTH_CKPT_OFF;
  else if (!strcmp(v, "full")) m->checkpoint = SYNTH_CKPT_FULL;
  else if (!strncmp(v, "full:", 5)) {
    long k;
    if (cli_int("trace synth", "--checkpoint full:K", v + 5, 1, 1L << 20, &k)) return -1;
    m->checkpoint = SYNTH_CKPT_FULL;
    m->ckpt_every = (int)k;
  } else if (!strcmp(v, "selective-op")) m->checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  else if (!strncmp(v, "selective", 9) && (v[9] == 0 || v[9] == ':')) {
    m->checkpoint = SYNTH_CKPT_SELECTIVE;
    m->recompute = SYNTH_RECOMPUTE_ATTN_CORE;
    if (v[9] == ':') {
      m->recompute = 0;
      char buf[128];
      snprintf(buf, sizeof buf, "%s", v + 10);
      for (char *save = NULL, *t = strtok_r(buf, "+,", &save); t; t = strtok_r(NULL, "+,", &save)) {
        if (!strcmp(t, "attn_core")) m->recompute |= SYNTH_RECOMPUTE_ATTN_CORE;
        else if (!strcmp(t, "mlp_act")) m->recompute |= SYNTH_RECOMPUTE_MLP_ACT;
        else {
          fprintf(stderr, "ferry trace synth: unknown op group '%s' (attn_core, mlp_act)\n", t);
          return -1;
        }
      }
      if (!m->recompute) {
        fprintf(stderr, "ferry trace synth: --checkpoint %s: no group (attn_core, mlp_act)\n", v);
        return -1;
      }
    }
  } else {
    fprintf(stderr,
            "ferry trace synth: --checkpoint %s: none, full, full:K, selective-op or "
            "selective[:attn_core+mlp_act]\n",
            v);
    return -1;
  }
  return 0;
}

/* A stored dtype (--param-dtype, --grad-dtype): bf16, f16 or fp32 (f32). */
static int parse_dtype(const char *opt, const char *v, int *out) {
  int d = !strcmp(v, "fp32") ? FERRY_DTYPE_F32 : !strcmp(v, "fp16") ? FERRY_DTYPE_F16 : ferry_dtype_from_name(v);
  if (d != FERRY_DTYPE_BF16 && d != FERRY_DTYPE_F16 && d != FERRY_DTYPE_F32) {
    fprintf(stderr, "ferry trace synth: %s %s: bf16, f16 or fp32\n", opt, v);
    return -1;
  }
  *out = d;
  return 0;
}

static int parse_optimizer(const char *v, int *out) {
  int o = synth_optimizer_parse(v);
  if (o < 0) {
    fprintf(stderr, "ferry trace synth: --optimizer %s: adamw, adamw8bit, sgd, sgd-momentum or none\n", v);
    return -1;
  }
  *out = o;
  return 0;
}

/* --loss full | chunked | chunked:N */
static int parse_loss(const char *v, synth_model *m) {
  m->loss_chunk = 0;
  if (!strcmp(v, "full")) m->loss = SYNTH_LOSS_FULL;
  else if (!strcmp(v, "chunked")) m->loss = SYNTH_LOSS_CHUNKED;
  else if (!strncmp(v, "chunked:", 8)) {
    long n;
    if (cli_int("trace synth", "--loss chunked:N", v + 8, 1, 1L << 30, &n)) return -1;
    m->loss = SYNTH_LOSS_CHUNKED;
    m->loss_chunk = (int)n;
  } else {
    fprintf(stderr, "ferry trace synth: --loss %s: full, chunked or chunked:N\n", v);
    return -1;
  }
  return 0;
}

/* The resident memory per GPU by part, and the knobs behind it. */
static void print_resident(const synth_model *m) {
  const double GiB = 1073741824.0;
  synth_resident r;
  synth_resident_parts(m, &r);
  char lora[48] = "", tp[48] = "";
  if (m->lora > 0) snprintf(lora, sizeof lora, ", %.4g of them trained (LoRA)", m->lora);
  if (m->tp > 1) snprintf(tp, sizeof tp, ", tp %d%s", m->tp, m->sp ? " with sp" : "");
  fprintf(stderr,
          "ferry trace synth: resident per GPU: parameters %.2f GiB + master weights %.2f GiB + "
          "optimizer states %.2f GiB (%s) = %.2f GiB all step; besides, within the step: gradients up to %.2f GiB "
          "and gathered parameters up to %.2f GiB (%.3gB parameters per rank%s%s, shard %d)\n",
          (double)r.params / GiB, (double)r.master / GiB, (double)r.states / GiB,
          synth_optimizer_name(m->optimizer), (double)r.whole_step / GiB, (double)r.grads / GiB,
          (double)r.gathered / GiB, (double)r.local_params / 1e9, lora, tp, m->shard);
}

static const char *loss_name(const synth_model *m, char *buf, size_t n) {
  if (m->loss == SYNTH_LOSS_CHUNKED) snprintf(buf, n, "chunked:%lld", (long long)synth_loss_chunk(m));
  else snprintf(buf, n, "full");
  return buf;
}

static int trace_synth_main(int argc, char **argv) {
  synth_model m;
  synth_preset("llama3-8b", &m);
  /* --preset first, so the other options change it */
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--preset")) {
      if (synth_preset(argv[i + 1], &m)) {
        fprintf(stderr, "ferry trace synth: unknown preset '%s' (presets: %s)\n", argv[i + 1],
                synth_preset_names());
        return 2;
      }
    }
  static const struct option opts[] = {
      {"preset", required_argument, 0, 'P'}, {"arch", required_argument, 0, 'a'},
      {"layers", required_argument, 0, 'L'}, {"hidden", required_argument, 0, 'H'},
      {"heads", required_argument, 0, 'n'},  {"kv-heads", required_argument, 0, 'k'},
      {"ffn", required_argument, 0, 'f'},    {"vocab", required_argument, 0, 'V'},
      {"seq", required_argument, 0, 's'},    {"micro-batch", required_argument, 0, 'b'},
      {"dtype", required_argument, 0, 'd'},  {"flash", required_argument, 0, 'F'},
      {"checkpoint", required_argument, 0, 'c'}, {"shard", required_argument, 0, 'S'},
      {"tflops", required_argument, 0, 't'}, {"hbm", required_argument, 0, 'm'},
      {"steps", required_argument, 0, 'N'},  {"output", required_argument, 0, 'o'},
      {"head-dim", required_argument, 0, 'D'}, {"qk-norm", required_argument, 0, 'Q'},
      {"experts", required_argument, 0, 'E'}, {"top-k", required_argument, 0, 'K'},
      {"expert-ffn", required_argument, 0, 'X'}, {"tie-embeddings", required_argument, 0, 'T'},
      {"loss", required_argument, 0, 'l'},
      {"param-dtype", required_argument, 0, 'p'}, {"grad-dtype", required_argument, 0, 'g'},
      {"master-weights", required_argument, 0, 'M'}, {"optimizer", required_argument, 0, 'O'},
      {"lora", required_argument, 0, 'R'}, {"tp", required_argument, 0, 'x'}, {"cp", required_argument, 0, 'J'},
      {"cp-impl", required_argument, 0, 'U'},
      {"sp", required_argument, 0, 'y'},     {"norm", required_argument, 0, 'r'},
      {"checkpoint-impl", required_argument, 0, 'I'},
      {"quiet", no_argument, 0, 'q'},        {"verbose", no_argument, 0, 'v'},
      {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  const char *out = NULL, *cp_impl = NULL;
  int c, bad = 0;
  optind = 1;
  opterr = 0; /* cli_bad_option names the flag and a close one */
  while ((c = getopt_long(argc, argv, ":o:qvh", opts, NULL)) != -1) {
    switch (c) {
    case 'P': break;
    case 'a':
      if (!strcmp(optarg, "llama")) m.arch = SYNTH_LLAMA;
      else if (!strcmp(optarg, "gpt")) m.arch = SYNTH_GPT;
      else {
        fprintf(stderr, "ferry trace synth: --arch %s: llama or gpt\n", optarg);
        bad = 1;
      }
      break;
    case 'L': bad |= int_arg("--layers", optarg, &m.layers) != 0; break;
    case 'H': bad |= int_arg("--hidden", optarg, &m.hidden) != 0; break;
    case 'n': bad |= int_arg("--heads", optarg, &m.heads) != 0; break;
    case 'k': bad |= int_arg("--kv-heads", optarg, &m.kv_heads) != 0; break;
    case 'f': bad |= int_arg("--ffn", optarg, &m.ffn) != 0; break;
    case 'V': bad |= int_arg("--vocab", optarg, &m.vocab) != 0; break;
    case 's': bad |= int_arg("--seq", optarg, &m.seq) != 0; break;
    case 'b': bad |= int_arg("--micro-batch", optarg, &m.micro_batch) != 0; break;
    case 'S': bad |= int_arg("--shard", optarg, &m.shard) != 0; break;
    case 'N': bad |= int_arg("--steps", optarg, &m.steps) != 0; break;
    case 't': bad |= num_arg("--tflops", optarg, &m.tflops) != 0; break;
    case 'm': bad |= num_arg("--hbm", optarg, &m.hbm_gbps) != 0; break;
    case 'd':
      m.dtype = ferry_dtype_from_name(optarg);
      if (m.dtype != FERRY_DTYPE_BF16 && m.dtype != FERRY_DTYPE_F16 && m.dtype != FERRY_DTYPE_F32) {
        fprintf(stderr, "ferry trace synth: --dtype %s: bf16, f16 or f32\n", optarg);
        bad = 1;
      }
      break;
    case 'F': bad |= on_off("--flash", optarg, &m.flash) != 0; break;
    case 'Q': bad |= on_off("--qk-norm", optarg, &m.qk_norm) != 0; break;
    case 'T': bad |= on_off("--tie-embeddings", optarg, &m.tie_embeddings) != 0; break;
    case 'D': bad |= int_arg("--head-dim", optarg, &m.head_dim) != 0; break;
    case 'E': bad |= int_arg("--experts", optarg, &m.experts) != 0; break;
    case 'K': bad |= int_arg("--top-k", optarg, &m.top_k) != 0; break;
    case 'X': bad |= int_arg("--expert-ffn", optarg, &m.expert_ffn) != 0; break;
    case 'c': bad |= parse_checkpoint(optarg, &m) != 0; break;
    case 'I':
      if (!strcmp(optarg, "reentrant")) m.ckpt_impl = SYNTH_CKPT_IMPL_REENTRANT;
      else if (!strcmp(optarg, "non-reentrant")) m.ckpt_impl = SYNTH_CKPT_IMPL_NON_REENTRANT;
      else if (!strcmp(optarg, "compiled")) m.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
      else {
        fprintf(stderr, "ferry trace synth: --checkpoint-impl %s: reentrant, non-reentrant or compiled\n",
                optarg);
        bad = 1;
      }
      break;
    case 'l': bad |= parse_loss(optarg, &m) != 0; break;
    case 'p': bad |= parse_dtype("--param-dtype", optarg, &m.param_dtype) != 0; break;
    case 'g': bad |= parse_dtype("--grad-dtype", optarg, &m.grad_dtype) != 0; break;
    case 'M': {
      int on = 0;
      bad |= on_off("--master-weights", optarg, &on) != 0;
      m.master_weights = on ? SYNTH_MASTER_ON : SYNTH_MASTER_OFF;
      break;
    }
    case 'O': bad |= parse_optimizer(optarg, &m.optimizer) != 0; break;
    case 'R': bad |= cli_number("trace synth", "--lora", optarg, FERRY_NUMBER_REAL, 0, 1, 1, &m.lora) != 0; break;
    case 'x': bad |= int_arg("--tp", optarg, &m.tp) != 0; break;
    case 'J': bad |= int_arg("--cp", optarg, &m.cp) != 0; break;
    case 'y': bad |= on_off("--sp", optarg, &m.sp) != 0; break;
    case 'U':
      cp_impl = optarg;
      if (!strcmp(optarg, "ring")) m.cp_impl = SYNTH_CP_RING;
      else if (!strcmp(optarg, "ulysses")) m.cp_impl = SYNTH_CP_ULYSSES;
      else {
        fprintf(stderr, "ferry trace synth: --cp-impl %s: ring or ulysses\n", optarg);
        bad = 1;
      }
      break;
    case 'r':
      if (!strcmp(optarg, "fused")) m.norm = SYNTH_NORM_FUSED;
      else if (!strcmp(optarg, "eager")) m.norm = SYNTH_NORM_EAGER;
      else {
        fprintf(stderr, "ferry trace synth: --norm %s: fused or eager\n", optarg);
        bad = 1;
      }
      break;
    case 'o': out = optarg; break;
    case 'q': cli_verbosity = -1; break;
    case 'v': cli_verbosity = 1; break;
    case 'h': synth_usage(stdout); return 0;
    case ':':
    case '?':
      cli_bad_option("trace synth", opts, argv, optind, optopt, c == ':');
      fprintf(stderr, "see 'ferry trace synth --help'\n");
      return 2;
    default: synth_usage(stderr); return 2;
    }
  }
  if (bad) return 2;
  if (optind < argc) {
    fprintf(stderr, "ferry trace synth: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (!out) {
    fprintf(stderr, "ferry trace synth: -o FILE is required\n");
    return 2;
  }
  /* ring is the default: given without context parallelism it would be
   * ignored as silently as ulysses */
  if (cp_impl && m.cp <= 1) {
    fprintf(stderr, "ferry trace synth: --cp-impl %s: needs --cp N with N > 1 (without it there "
                    "is no context parallelism to split)\n", cp_impl);
    return 2;
  }
  char err[512];
  if (synth_validate(&m, err, sizeof err)) {
    fprintf(stderr, "ferry trace synth: %s\n", err);
    return 2;
  }
  int rc = cli_claim_stdout("trace synth", "--output", out);
  if (rc) return rc;
  FILE *f = strcmp(out, "-") ? fopen(out, "w") : cli_stdout();
  if (!f) {
    fprintf(stderr, "ferry trace synth: cannot write %s: %s\n", out, strerror(errno));
    return 1;
  }
  rc = synth_write(&m, f, err, sizeof err);
  if (strcmp(out, "-") && fclose(f) && !rc) {
    snprintf(err, sizeof err, "write error");
    rc = -1;
  }
  if (!strcmp(out, "-") && cli_output_done("trace synth") && !rc) return 1;
  if (rc) {
    fprintf(stderr, "ferry trace synth: %s: %s\n", out, err);
    return 1;
  }
  char ckpt[32], loss[32];
  if (m.checkpoint == SYNTH_CKPT_FULL && m.ckpt_every > 1) snprintf(ckpt, sizeof ckpt, "full:%d", m.ckpt_every);
  else snprintf(ckpt, sizeof ckpt, "%s", m.checkpoint == SYNTH_CKPT_FULL           ? "full"
                                         : m.checkpoint == SYNTH_CKPT_SELECTIVE    ? "selective"
                                         : m.checkpoint == SYNTH_CKPT_SELECTIVE_OP ? "selective-op"
                                                                                   : "none");
  if (cli_verbosity > 0)
    fprintf(stderr,
            "ferry trace synth: arch %s, layers %d, hidden %d, heads %d, kv-heads %d, head-dim %d, "
            "qk-norm %s, ffn %d, experts %d, top-k %d, expert-ffn %d, vocab %d, seq %d, "
            "micro-batch %d, dtype %s, flash %s, norm %s, checkpoint %s, loss %s, shard %d, "
            "tflops %g, hbm %g GB/s, steps %d\n",
            m.arch == SYNTH_GPT ? "gpt" : "llama", m.layers, m.hidden, m.heads, m.kv_heads,
            m.head_dim ? m.head_dim : m.hidden / m.heads, m.qk_norm ? "on" : "off", m.ffn,
            m.experts, m.top_k, m.experts ? (m.expert_ffn ? m.expert_ffn : m.ffn) : 0, m.vocab,
            m.seq, m.micro_batch, ferry_dtype_name(m.dtype), m.flash ? "on" : "off",
            m.norm == SYNTH_NORM_EAGER ? "eager" : "fused", ckpt,
            loss_name(&m, loss, sizeof loss), m.shard, m.tflops, m.hbm_gbps, m.steps);
  if (cli_verbosity >= 0) {
    char params[64], saved[256];
    if (m.experts)
      snprintf(params, sizeof params, "%.2fB parameters (%.2fB active)",
               (double)synth_param_count(&m) / 1e9, (double)synth_active_param_count(&m) / 1e9);
    else snprintf(params, sizeof params, "%.2fB parameters", (double)synth_param_count(&m) / 1e9);
    const double GiB = 1073741824.0, all = (double)synth_layer_activation_bytes(&m) / GiB;
    int ck = synth_checkpointed_layers(&m);
    if (!ck) snprintf(saved, sizeof saved, "%.2f GiB of activations per layer", all);
    else {
      int L = m.checkpoint == SYNTH_CKPT_FULL ? m.ckpt_every - 1 : 0; /* a checkpointed one */
      const int impl = synth_checkpoint_impl(&m);
      snprintf(saved, sizeof saved,
               "%.2f GiB of activations per layer, %.3f GiB kept by %d checkpointed layer(s) (%s, "
               "%s: a policy sees %s)",
               all, (double)synth_layer_saved_bytes(&m, L) / GiB, ck, ckpt,
               synth_checkpoint_impl_name(impl),
               impl == SYNTH_CKPT_IMPL_REENTRANT ? "what it keeps and what it recomputes"
               : impl == SYNTH_CKPT_IMPL_COMPILED ? "what it keeps, not what it recomputes"
                                                  : "its block inputs only");
    }
    synth_resident res;
    synth_resident_parts(&m, &res);
    fprintf(stderr, "ferry trace synth: %s: %s, %s, %.2f GiB resident per GPU (shard %d), %s, %d step(s)\n",
            out, m.name[0] ? m.name : "custom", params, (double)res.whole_step / GiB,
            m.shard, saved, m.steps);
    print_resident(&m);
  }
  return 0;
}

int ferry_cli_trace(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    fprintf(argc < 2 ? stderr : stdout,
            "usage: ferry trace synth [options] -o FILE\n"
            "       ferry trace synth --help\n"
            "\n"
            "Traces for `ferry sim`. Subcommands:\n"
            "  synth    write the trace of a transformer's training steps from its shape\n"
            "\n"
            "examples:\n"
            "  ferry trace synth --preset llama3-8b -o llama3-8b.jsonl\n");
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "synth")) return trace_synth_main(argc - 1, argv + 1);
  fprintf(stderr, "ferry trace: unknown subcommand '%s' (synth)\n", argv[1]);
  return 2;
}
