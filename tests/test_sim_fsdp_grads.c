/* test_sim_fsdp_grads.c — what a unit's reduce-scatter moves is what its
 * backward wrote: the unsharded weight gradients allocated since the unit
 * below's (or the loss's) last reduce-scatter, in the same dtype. A
 * Llama's final RMSNorm has a weight only (h), a GPT's LayerNorms a weight
 * and a bias (2h each). docs/simulator.md, "Collectives". */
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
