/*
 * synth_comm.c — the synthesizer's collectives (docs/simulator.md,
 * "Collectives"; docs/trace-format.md, "collective"): where FSDP2 and
 * Megatron's tensor parallelism communicate in a step, with their bytes.
 *  - FSDP (shard > 1): each block's parameters are all-gathered before its
 *    forward and again before its backward (resharded after forward); the
 *    gather of the next block is issued as a block starts (FSDP2's
 *    prefetch: block k+1's gather runs during block k's compute) and a
 *    block's compute waits for its own. After a block's backward its
 *    gradients are reduce-scattered, waited for at the end of backward (the
 *    optimizer needs them). The root module's parameters (embedding, final
 *    norm, head) are not gathered here.
 *  - Tensor parallelism (tp > 1): per block, two all-reduces of the
 *    activations (b, s, h) in forward (after attention's and the MLP's
 *    row-parallel linear) and two of their gradients in backward (before
 *    the column-parallel linears' input gradient leaves), each waited for at
 *    once (they are on the compute's critical path); with sequence
 *    parallelism each is a reduce-scatter and an all-gather of the same
 *    bytes (Korthikanti et al. 2022: the same traffic). Written at the end
 *    of the block's forward and backward: synchronous, their place in the
 *    block does not change the time. A fully checkpointed block runs its
 *    forward again before its backward, exchanges included (Megatron's full
 *    recompute, torchtitan's full AC: the collectives are inside the
 *    checkpointed region), so it has two more.
 */
#include <stdlib.h>

#include "sim/synth_internal.h"

static const char *const coll_op[] = {"all_gather", "reduce_scatter", "all_reduce"};

static uint64_t issue(synth_comm *c, int kind, uint64_t bytes, int ranks, const char *what,
                      int layer) {
  uint64_t id = ++c->next;
  fprintf(c->f,
          "{\"ev\":\"collective\",\"t_us\":0,\"id\":%llu,\"op\":\"%s\",\"bytes\":%llu,"
          "\"ranks\":%d,\"what\":\"%s\",\"layer\":%d}\n",
          (unsigned long long)id, coll_op[kind], (unsigned long long)bytes, ranks, what, layer);
  return id;
}

static void wait_for(synth_comm *c, uint64_t id) {
  if (id) fprintf(c->f, "{\"ev\":\"collective_wait\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

int synth_comm_init(synth_comm *c, const synth_model *m, FILE *f, uint64_t layer_param_bytes) {
  *c = (synth_comm){.m = m, .f = f};
  const int shard = m->shard > 1 ? m->shard : 1, tp = m->tp > 1 ? m->tp : 1;
  if (shard > 1) {
    /* the block's parameters per tensor-parallel rank, before sharding */
    const uint64_t n = layer_param_bytes * (uint64_t)shard /
                       (uint64_t)ferry_dtype_size(m->param_dtype ? m->param_dtype : m->dtype);
    const int g = m->grad_dtype ? m->grad_dtype : m->param_dtype ? m->param_dtype : m->dtype;
    c->ag_bytes = n * (uint64_t)ferry_dtype_size(m->dtype); /* gathered in the compute dtype */
    c->rs_bytes = n * (uint64_t)ferry_dtype_size(g);
    if (!(c->ag = calloc((size_t)m->layers, sizeof *c->ag)) ||
        !(c->rs = calloc((size_t)m->layers, sizeof *c->rs)))
      return -1;
  }
  if (tp > 1)
    c->tp_bytes = (uint64_t)m->micro_batch * (uint64_t)m->seq * (uint64_t)m->hidden *
                  (uint64_t)ferry_dtype_size(m->dtype);
  return 0;
}

void synth_comm_free(synth_comm *c) {
  free(c->ag);
  free(c->rs);
}

static void gather(synth_comm *c, int layer) {
  if (c->ag && layer >= 0 && layer < c->m->layers && !c->ag[layer])
    c->ag[layer] = issue(c, 0, c->ag_bytes, c->m->shard, "shard", layer);
}

static void gathered(synth_comm *c, int layer) {
  if (!c->ag) return;
  gather(c, layer);
  wait_for(c, c->ag[layer]);
  c->ag[layer] = 0;
}

/* Two synchronous tensor-parallel exchanges of the activations. */
static void tp_exchange(synth_comm *c, int layer) {
  if (!c->tp_bytes) return;
  for (int k = 0; k < 2; k++) {
    if (c->m->sp) {
      wait_for(c, issue(c, SIM_COLL_REDUCE_SCATTER, c->tp_bytes, c->m->tp, "tp", layer));
      wait_for(c, issue(c, SIM_COLL_ALL_GATHER, c->tp_bytes, c->m->tp, "tp", layer));
    } else {
      wait_for(c, issue(c, SIM_COLL_ALL_REDUCE, c->tp_bytes, c->m->tp, "tp", layer));
    }
  }
}

void synth_comm_step_begin(synth_comm *c) { gather(c, 0); }

void synth_comm_block_forward_begin(synth_comm *c, int layer) {
  gather(c, layer + 1);
  gathered(c, layer);
}

void synth_comm_block_forward_end(synth_comm *c, int layer) { tp_exchange(c, layer); }

void synth_comm_backward_begin(synth_comm *c) { gather(c, c->m->layers - 1); }

void synth_comm_block_backward_begin(synth_comm *c, int layer) {
  gather(c, layer - 1);
  gathered(c, layer);
}

void synth_comm_block_recompute(synth_comm *c, int layer) { tp_exchange(c, layer); }

void synth_comm_block_backward_end(synth_comm *c, int layer) {
  tp_exchange(c, layer);
  if (c->rs) c->rs[layer] = issue(c, SIM_COLL_REDUCE_SCATTER, c->rs_bytes, c->m->shard, "shard", layer);
}

void synth_comm_backward_end(synth_comm *c) {
  if (!c->rs) return;
  for (int L = c->m->layers; L-- > 0;) {
    wait_for(c, c->rs[L]);
    c->rs[L] = 0;
  }
}
