/* test_sim_ulysses.c — issue 34 item 4: DeepSpeed-Ulysses sequence
 * parallelism in the synthesizer (--cp N --cp-impl ulysses), its saved
 * tensors, FLOPs and all-to-alls against a hand computation on the tiny
 * Llama, and its errors. docs/sim-synth.md, "Long context". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"

/* The tiny Llama (h 256, 4 heads of 64: qd 256; 2 KV heads: kvd 128;
 * bf16, flash, 2 layers) at seq 1024, micro-batch 1. */
static void tiny_long(synth_model *m) {
  synth_preset("tiny", m);
  m->layers = 2, m->seq = 1024, m->micro_batch = 1;
}

/* Distinct forward activation bytes of the packs (layer -2: all). */
static uint64_t fwd_packs(const sim_trace *t, int layer, int64_t dim2) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if ((layer == -2 || x->desc.layer == layer) && x->desc.kind == FERRY_KIND_ACTIVATION &&
        x->alias_of < 0 && x->desc.phase == FERRY_PHASE_FORWARD &&
        (dim2 < 0 || (x->desc.ndim >= 3 && x->desc.shape[2] == dim2)))
      total += x->desc.bytes;
  }
  return total;
}

/* Step 1's forward FLOPs of op, and its all-to-alls (count, bytes). */
static double fwd_flops(const sim_trace *t, const char *op) {
  double f = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_BACKWARD_BEGIN) break;
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, op)) f += ev->flops;
  }
  return f;
}

static int all_to_alls(const sim_trace *t, uint64_t *bytes, int *ranks) {
  int n = 0;
  *bytes = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type != TEV_COLLECTIVE) continue;
    const trace_collective *c = &t->collectives[ev->tensor];
    if (c->kind != SIM_COLL_ALL_TO_ALL) continue;
    n++, *bytes += c->bytes, *ranks = c->ranks;
    if (c->group != SIM_GROUP_TP) return -1;
  }
  return n;
}

static int count_allocs(const sim_trace *t, const char *prefix) {
  int n = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++) n += !strncmp(t->allocs[i].what, prefix, strlen(prefix));
  return n;
}

/* By hand, --cp 2 --cp-impl ulysses at seq 1024: each GPU holds s = 512
 * tokens outside attention; attention sees the whole S = 1024 with 2 of
 * the 4 heads and 1 of the 2 KV heads, and saves q (1, 2, 1024, 64), k and
 * v (1, 1, 1024, 64), its output (1, 2, 1024, 64) in bf16 and the lse
 * (1, 2, 1024) in fp32: 262144 + 2 x 131072 + 262144 + 8192 = 794624 B a
 * layer, of dimension 2 = 1024. o_proj saves the all-to-all's output back
 * in 512 tokens of every head, a tensor of its own: 512 x 256 x 2 = 262144
 * B more than ring attention at --cp 2 saves (where it is attention's own
 * output), which has no such tensor and holds the ring's K/V buffers
 * instead (Ulysses none). Attention's FLOPs: 2 x S² x qd / 2 =
 * 268435456 a layer, the full sequence's / 2. The all-to-alls: q and the
 * output 512 x 256 x 2 = 262144 B, k and v 512 x 128 x 2 = 131072 B, in
 * forward and backward: 16 a step over 2 ranks, 2 x 2 x 786432 = 3145728
 * B, on the intra-node lane; replayed, each moves half its buffer. */
TEST(sim_synth_ulysses_saves_flops_and_all_to_alls) {
  synth_model m;
  tiny_long(&m);
  sim_trace *full = NULL, *ring = NULL, *uly = NULL;
  CHECK_OK(trace_of(&m, &full));
  m.cp = 2;
  CHECK_OK(trace_of(&m, &ring));
  m.cp_impl = SYNTH_CP_ULYSSES;
  CHECK_OK(trace_of(&m, &uly));
  CHECK_EQ(fwd_packs(uly, 0, 1024), 794624);
  CHECK_EQ(fwd_packs(ring, 0, 1024), 0);
  CHECK_EQ(fwd_packs(uly, -2, -1), fwd_packs(ring, -2, -1) + 2 * 262144);
  CHECK_NEAR(fwd_flops(uly, "self_attn.attention"), 2 * 268435456.0, 0.5);
  CHECK_NEAR(fwd_flops(uly, "self_attn.attention") * 2, fwd_flops(full, "self_attn.attention"), 0.5);
  CHECK(count_allocs(ring, "ring attention") > 0);
  CHECK_EQ(count_allocs(uly, "ring attention"), 0);
  uint64_t bytes = 0;
  int ranks = 0;
  CHECK_EQ(all_to_alls(uly, &bytes, &ranks), 16);
  CHECK_EQ(bytes, 3145728);
  CHECK_EQ(ranks, 2);
  CHECK_EQ(all_to_alls(ring, &bytes, &ranks), 0);
  /* a fully checkpointed block runs its forward's all-to-alls again */
  m.checkpoint = SYNTH_CKPT_FULL;
  sim_trace *ckpt = NULL;
  CHECK_OK(trace_of(&m, &ckpt));
  CHECK_EQ(all_to_alls(ckpt, &bytes, &ranks), 24);
  sim_config c = h100_node_config();
  sim_result r;
  char err[512];
  CHECK_OK(sim_replay(uly, &c, &r, err, sizeof err));
  CHECK_NEAR(r.comm_count, 16, 0);
  CHECK_NEAR(r.comm_bytes, 3145728.0 / 2, 0.5);
  sim_result_free(&r);
  sim_trace_free(full);
  sim_trace_free(ring);
  sim_trace_free(uly);
  sim_trace_free(ckpt);
  return 0;
}

/* Heads or KV heads that --cp does not divide are refused, naming the flag
 * and the values: tiny's 2 KV heads at --cp 4 (its 4 heads would do). */
TEST(sim_synth_ulysses_needs_cp_to_divide_the_heads) {
  synth_model m;
  tiny_long(&m);
  m.cp = 4, m.cp_impl = SYNTH_CP_ULYSSES;
  char err[256];
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--cp-impl ulysses: --cp 4 must divide the heads (4) and the KV heads (2)");
  m.cp = 3; /* divides neither */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--cp 3 must divide the heads (4)");
  m.cp = 2, m.flash = 0;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs --flash on");
  m.flash = 1;
  CHECK_EQ(synth_validate(&m, err, sizeof err), 0);
  return 0;
}

/* Ulysses without context parallelism would be dropped silently (the trace
 * would be cp 1's, its header "ring"): refused, naming the flag. */
TEST(sim_synth_ulysses_without_cp_refused) {
  synth_model m;
  tiny_long(&m);
  m.cp_impl = SYNTH_CP_ULYSSES;
  char err[256];
  for (int cp = 0; cp <= 2; cp++) {
    m.cp = cp;
    CHECK_EQ(synth_validate(&m, err, sizeof err), cp == 2 ? 0 : -1);
    if (cp < 2) CHECK_STR_CONTAINS(err, "--cp-impl ulysses needs --cp N with N > 1");
  }
  return 0;
}
