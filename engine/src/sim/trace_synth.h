/*
 * trace_synth.h — the trace synthesizer: the trace a decoder-only
 * transformer's training step would record, from the model's shape alone
 * (docs/simulator.md lists every saved tensor and the compute model).
 *
 * Two architectures:
 *   - llama: RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP,
 *     no dropout, untied head (Llama 3);
 *   - gpt: LayerNorm, multi-head attention, GeLU MLP, dropout (the model of
 *     Korthikanti et al. 2022, whose per-layer activation formula the gpt
 *     architecture reproduces; see synth_layer_activation_bytes()).
 */
#ifndef FERRY_TRACE_SYNTH_H
#define FERRY_TRACE_SYNTH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { SYNTH_LLAMA = 0, SYNTH_GPT = 1 };
enum { SYNTH_CKPT_OFF = 0, SYNTH_CKPT_FULL = 1, SYNTH_CKPT_SELECTIVE = 2 };
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
} synth_model;

/* Fill *m with a preset ("llama3-8b", "llama3-70b", "gpt3-1.3b", "tiny")
 * and the defaults (seq 8192, micro-batch 1, bf16, flash on, no
 * checkpointing, shard 8, 400 TFLOP/s, 2000 GB/s, 1 step). -1 if unknown. */
int synth_preset(const char *name, synth_model *m);
/* Names of the presets, for help texts. */
const char *synth_preset_names(void);
/* 0, or -1 with a message naming the bad field. */
int synth_validate(const synth_model *m, char *err, size_t errlen);
/* Write the trace; 0, or -1 with a message (I/O error). */
int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen);

/* Bytes of the distinct activation buffers one layer saves in the forward
 * pass (no parameters; a buffer saved by several ops counts once). */
uint64_t synth_layer_activation_bytes(const synth_model *m);
/* Parameters of the model, and the resident bytes per GPU (parameters,
 * gradients, optimizer states, sharded by m->shard). */
uint64_t synth_param_count(const synth_model *m);
uint64_t synth_resident_bytes(const synth_model *m);

#endif
