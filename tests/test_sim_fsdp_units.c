/* test_sim_fsdp_units.c — issue 34: one description of FSDP's units drives
 * both the gathered parameters' memory and the communication lane, the
 * root module's units (embedding; final norm with the head) included, each
 * against a hand computation on the tiny Llama. docs/sim-model.md,
 * "Collectives" and "Gradients, gathered parameters and the optimizer's
 * transients". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"

/* The tiny Llama: T = 256 tokens, h 256, 4 heads of 64, 2 KV heads, ffn
 * 512, vocab 1024, bf16, 2 layers, untied. Its units in bf16 (as
 * test_sim_model's sim_synth_fsdp_gathers_per_unit_and_frees_unsharded_gradients
 * computes them): embedding 1024 x 256 = 524288 B; a block 589824 + 512
 * parameters = 1180672 B; final norm (RMSNorm: a weight, h) and head
 * 1024 x 256: 524800 B. */
#define EMBED 524288ull
#define BLOCK 1180672ull
#define HEAD 524800ull

static void tiny2(synth_model *m) {
  synth_preset("tiny", m);
  m->layers = 2, m->seq = 256, m->micro_batch = 1, m->shard = 2;
}

/* One side of a gather or a reduce-scatter, in step 1's event order: its
 * bytes, its layer (the lane's; -1 for the root's units), how many compute
 * events came before it (its timing position) and whether in backward. */
typedef struct side {
  uint64_t bytes;
  int layer, computes_before, backward;
} side;

static int is_gather_alloc(const sim_trace *t, const trace_ev *ev) {
  return ev->type == TEV_ALLOC && !strncmp(t->allocs[ev->tensor].what, "gathered parameters", 19);
}

static int is_shard_alloc(const sim_trace *t, const trace_ev *ev) {
  return ev->type == TEV_ALLOC && !strcmp(t->allocs[ev->tensor].what, "gradient: weights (sharded)");
}

static int is_coll(const sim_trace *t, const trace_ev *ev, int kind) {
  return ev->type == TEV_COLLECTIVE && t->collectives[ev->tensor].kind == kind &&
         t->collectives[ev->tensor].group == SIM_GROUP_SHARD;
}

/* Collects step 1's memory side (mem: the gathered copies' allocs, or the
 * sharded gradients') and lane side (lane: the data-parallel collectives)
 * of the all-gathers or the reduce-scatters (kind), how many of each in
 * *n_mem, *n_lane. */
static void collect(const sim_trace *t, int kind, side *mem, int *n_mem, side *lane, int *n_lane) {
  int computes = 0, bwd = 0;
  *n_mem = *n_lane = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_BACKWARD_BEGIN) bwd = 1;
    if (ev->type == TEV_COMPUTE) computes++;
    const int mem_side = kind == SIM_COLL_ALL_GATHER ? is_gather_alloc(t, ev) : is_shard_alloc(t, ev);
    if (mem_side)
      mem[(*n_mem)++] = (side){t->allocs[ev->tensor].bytes, 0, computes, bwd};
    if (is_coll(t, ev, kind))
      lane[(*n_lane)++] = (side){t->collectives[ev->tensor].bytes, t->collectives[ev->tensor].layer,
                                 computes, bwd};
  }
}

/* Where each unit's gather and reduce-scatter fall, both sides. By hand,
 * FSDP2 as torchtitan wraps the model (embedding, blocks reshard after
 * forward; [norm, output] does not), 2 blocks, 2 ranks:
 *   all-gathers, in order: embedding (step start), block 0 (prefetched
 *   before the embedding runs), block 1 (as block 0 starts), head (as block
 *   1 starts), then in backward block 1 (the head unit's pre-backward, after
 *   the loss's backward), block 0 (as block 1's backward starts), the
 *   embedding (as block 0's starts): 7, the head's none in backward;
 *   reduce-scatters: head, block 1, block 0, embedding: 4, each the unit's
 *   unsharded gradients in bf16 while the memory keeps half.
 * Memory and lane agree one to one: the same count, the same bytes, the same
 * number of computes before each (the same position in the step). */
TEST(sim_fsdp_units_memory_and_lane_agree) {
  synth_model m;
  tiny2(&m);
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  side mem[32], lane[32];
  int n_mem, n_lane;
  collect(t, SIM_COLL_ALL_GATHER, mem, &n_mem, lane, &n_lane);
  CHECK_EQ(n_mem, 7);
  CHECK_EQ(n_lane, 7);
  static const uint64_t ag_bytes[7] = {EMBED, BLOCK, BLOCK, HEAD, BLOCK, BLOCK, EMBED};
  static const int ag_layer[7] = {-1, 0, 1, -1, 1, 0, -1};
  static const int ag_bwd[7] = {0, 0, 0, 0, 1, 1, 1};
  for (int i = 0; i < 7; i++) {
    CHECK_EQ(mem[i].bytes, ag_bytes[i]);
    CHECK_EQ(lane[i].bytes, ag_bytes[i]);
    CHECK_EQ(lane[i].layer, ag_layer[i]);
    CHECK_EQ(mem[i].computes_before, lane[i].computes_before);
    CHECK_EQ(mem[i].backward, ag_bwd[i]);
    CHECK_EQ(lane[i].backward, ag_bwd[i]);
  }
  /* the first three before any compute; the head's before block 1's first */
  CHECK_EQ(lane[0].computes_before, 0);
  CHECK_EQ(lane[1].computes_before, 0);
  CHECK(lane[3].computes_before > lane[2].computes_before);
  collect(t, SIM_COLL_REDUCE_SCATTER, mem, &n_mem, lane, &n_lane);
  CHECK_EQ(n_mem, 4);
  CHECK_EQ(n_lane, 4);
  static const uint64_t rs_bytes[4] = {HEAD, BLOCK, BLOCK, EMBED};
  static const int rs_layer[4] = {-1, 1, 0, -1};
  for (int i = 0; i < 4; i++) {
    CHECK_EQ(lane[i].bytes, rs_bytes[i]);
    CHECK_EQ(mem[i].bytes, rs_bytes[i] / 2);
    CHECK_EQ(lane[i].layer, rs_layer[i]);
    CHECK_EQ(mem[i].computes_before, lane[i].computes_before);
    CHECK_EQ(lane[i].backward, 1);
  }
  sim_trace_free(t);
  return 0;
}

/* Every all-gather is waited for before its unit's first compute, and the
 * reduce-scatters at the end of backward: the root's too. The embedding's
 * forward gather is waited for before model.embed_tokens runs, the head's
 * before model.norm, the embedding's backward gather before its backward;
 * the lane carries the root's 3 gathers and 2 reduce-scatters (EMBED x 2 +
 * HEAD gathered, HEAD + EMBED reduce-scattered) beside the blocks' 4 and 2:
 * dropped, this test fails on the count and the replayed bytes. */
TEST(sim_fsdp_units_root_on_the_lane) {
  synth_model m;
  tiny2(&m);
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  int root_ag = 0, root_rs = 0, block_ag = 0, block_rs = 0, waited_before_embed = 0;
  int waited_before_norm = 0, pending_root = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_COLLECTIVE && t->collectives[ev->tensor].group == SIM_GROUP_SHARD) {
      const trace_collective *c = &t->collectives[ev->tensor];
      if (c->kind == SIM_COLL_ALL_GATHER) {
        if (c->layer < 0) root_ag++, pending_root++;
        else block_ag++;
      } else if (c->layer < 0) root_rs++;
      else block_rs++;
    }
    if (ev->type == TEV_COLLECTIVE_WAIT && t->collectives[ev->tensor].layer < 0 &&
        t->collectives[ev->tensor].kind == SIM_COLL_ALL_GATHER)
      pending_root--;
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "model.embed_tokens") && !waited_before_embed)
      waited_before_embed = pending_root == 0 && root_ag == 1;
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "model.norm") && !waited_before_norm)
      waited_before_norm = pending_root == 0 && root_ag == 2;
  }
  CHECK_EQ(root_ag, 3);
  CHECK_EQ(root_rs, 2);
  CHECK_EQ(block_ag, 4);
  CHECK_EQ(block_rs, 2);
  CHECK(waited_before_embed);
  CHECK(waited_before_norm);
  CHECK_EQ(pending_root, 0);
  /* replayed: the lane moves every buffer's (n - 1) / n = half */
  sim_config c = h100_node_config();
  sim_result r;
  char err[512];
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.comm_count, 11, 0);
  CHECK_NEAR(r.comm_bytes, (2.0 * EMBED + 4.0 * BLOCK + HEAD + HEAD + 2.0 * BLOCK + EMBED) / 2, 0.5);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}
