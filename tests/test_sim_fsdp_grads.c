/* test_sim_fsdp_grads.c — what a unit's reduce-scatter moves is what its
 * backward wrote: the unsharded weight gradients allocated since the unit
 * below's (or the loss's) last reduce-scatter, in the same dtype. A
 * Llama's final RMSNorm has a weight only (h), a GPT's LayerNorms a weight
 * and a bias (2h each). docs/sim-model.md, "Collectives". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"

/* Walks step 1's backward: for each data-parallel reduce-scatter, the
 * unsharded weight gradients written since the previous one; counts
 * those that differ from the collective's bytes into *bad, printing them. */
static int rs_against_writes(const synth_model *m, int *n_rs, int *bad) {
  sim_trace *t = NULL;
  if (trace_of(m, &t)) return -1;
  uint64_t written = 0;
  int bwd = 0;
  *n_rs = *bad = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_BACKWARD_BEGIN) bwd = 1;
    if (!bwd) continue;
    if (ev->type == TEV_ALLOC && !strcmp(t->allocs[ev->tensor].what, "gradient: weights (unsharded)"))
      written += t->allocs[ev->tensor].bytes;
    if (ev->type == TEV_COLLECTIVE && t->collectives[ev->tensor].kind == SIM_COLL_REDUCE_SCATTER &&
        t->collectives[ev->tensor].group == SIM_GROUP_SHARD) {
      const trace_collective *c = &t->collectives[ev->tensor];
      if (c->bytes != written) {
        fprintf(stderr, "%s: layer %d reduce-scatters %llu B, its backward wrote %llu B\n", m->name,
                c->layer, (unsigned long long)c->bytes, (unsigned long long)written);
        (*bad)++;
      }
      (*n_rs)++;
      written = 0;
    }
  }
  sim_trace_free(t);
  return 0;
}

/* The tiny Llama (RMSNorm: the final norm's h, not 2h), the tiny model as
 * a GPT (LayerNorm's bias in every norm), GPT-3 1.3B's shape cut to 2
 * layers (learned positions); each with every unit's reduce-scatter equal
 * to its writes: before the fix the Llama's head unit moved h x 2 bytes
 * more, the GPT's units h x 2 (head) and 2h x 2 (block) fewer than the
 * collectives. */
TEST(sim_fsdp_reduce_scatter_moves_what_backward_wrote) {
  synth_model m;
  int n_rs, bad;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.layers = 2, m.shard = 2;
  CHECK_OK(rs_against_writes(&m, &n_rs, &bad));
  CHECK_EQ(n_rs, 4);
  CHECK_EQ(bad, 0);
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.layers = 2, m.shard = 2, m.arch = SYNTH_GPT, m.kv_heads = m.heads, m.flash = 1;
  CHECK_OK(rs_against_writes(&m, &n_rs, &bad));
  CHECK_EQ(n_rs, 4);
  CHECK_EQ(bad, 0);
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  m.layers = 2, m.shard = 4, m.seq = 256, m.tie_embeddings = 0;
  CHECK_OK(rs_against_writes(&m, &n_rs, &bad));
  CHECK_EQ(n_rs, 4);
  CHECK_EQ(bad, 0);
  /* the parameter count agrees: Llama 3 8B's final RMSNorm is 4096 */
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  CHECK_EQ(synth_param_count(&m), 8030261248ull);
  return 0;
}

/* Tied embeddings under FSDP2: a shared parameter lives in one group
 * (torch's fully_shard refuses a parameter two groups manage, PyTorch PR
 * #179532; Accelerate groups [final norm, embedding, head], PR #4171), so
 * the embedding, the final norm and the head are one unit: gathered once
 * as the embedding starts, held through forward (the group's post-forward
 * runs after its last module, the head) into the head's backward, and
 * reduce-scattered once, after the embedding's backward has added its
 * part to the table's gradient. The tiny Llama tied, 2 layers, shard 2:
 * that unit is 1024 x 256 + 256 = 262400 parameters, 524800 B in bf16; 5
 * gathers (it, blocks 0 and 1, blocks 1 and 0 again) and 3 reduce-scatters
 * (block 1, block 0, it, last); the table's unsharded gradient (524288 B)
 * written by lm_head's backward lives until that last reduce-scatter, and
 * the gathered unit across the blocks. On the old code the table was
 * gathered twice (embedding, head) and its gradient reduce-scattered as
 * the head's backward ended, before the embedding's backward. */
TEST(sim_fsdp_tied_embedding_is_one_unit) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.layers = 2, m.shard = 2, m.tie_embeddings = 1;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  const uint64_t tied = 524800, block = 1180672, table_grad = 524288;
  uint64_t ag[8] = {0}, rs[8] = {0}, written = 0, moved = 0, live_grad = 0, live_gathered = 0;
  uint64_t grad_at_embed_bwd = 0, gathered_in_block1 = 0;
  int n_ag = 0, n_rs = 0, bwd = 0, computes_after_last_rs = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_BACKWARD_BEGIN) bwd = 1;
    if (ev->type == TEV_ALLOC && !strcmp(t->allocs[ev->tensor].what, "gradient: weights (unsharded)")) {
      written += t->allocs[ev->tensor].bytes;
      live_grad += t->allocs[ev->tensor].bytes;
    }
    if (ev->type == TEV_ALLOC && !strncmp(t->allocs[ev->tensor].what, "gathered parameters", 19))
      live_gathered += t->allocs[ev->tensor].bytes;
    if (ev->type == TEV_FREE && !strcmp(t->allocs[ev->tensor].what, "gradient: weights (unsharded)"))
      live_grad -= t->allocs[ev->tensor].bytes;
    if (ev->type == TEV_FREE && !strncmp(t->allocs[ev->tensor].what, "gathered parameters", 19))
      live_gathered -= t->allocs[ev->tensor].bytes;
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "model.embed_tokens") && bwd)
      grad_at_embed_bwd = live_grad;
    if (ev->type == TEV_COMPUTE && !bwd && ev->layer == 1 && !gathered_in_block1)
      gathered_in_block1 = live_gathered;
    if (ev->type == TEV_COMPUTE && n_rs == 3) computes_after_last_rs++;
    if (ev->type == TEV_COLLECTIVE && t->collectives[ev->tensor].group == SIM_GROUP_SHARD) {
      const trace_collective *c = &t->collectives[ev->tensor];
      if (c->kind == SIM_COLL_ALL_GATHER && n_ag < 8) ag[n_ag++] = c->bytes;
      if (c->kind == SIM_COLL_REDUCE_SCATTER && n_rs < 8) rs[n_rs++] = c->bytes, moved += c->bytes;
    }
  }
  CHECK_EQ(n_ag, 5);
  CHECK_EQ(ag[0], tied);
  for (int i = 1; i < 5; i++) CHECK_EQ(ag[i], block);
  CHECK_EQ(n_rs, 3);
  CHECK_EQ(rs[0], block);
  CHECK_EQ(rs[1], block);
  CHECK_EQ(rs[2], tied);
  CHECK_EQ(written, moved);
  /* the embedding's backward runs with the head's table gradient live */
  CHECK(grad_at_embed_bwd >= table_grad);
  /* block 1 runs with the tied unit, itself and nothing else gathered */
  CHECK_EQ(gathered_in_block1, tied + block);
  /* the tied unit's reduce-scatter is the backward's last: only the
   * optimizer's compute comes after it */
  CHECK(computes_after_last_rs <= 1);
  sim_trace_free(t);
  return 0;
}
