/*
 * synth_comm.c — the synthesizer's collectives (docs/sim-model.md,
 * "Collectives"; docs/trace-format.md, "collective"): where FSDP2 and
 * Megatron's tensor parallelism communicate in a step, with their bytes.
 *  - FSDP (shard > 1): one list of units, as torchtitan's apply_fsdp wraps
 *    the model (fully_shard on tok_embeddings, on each block, on [norm,
 *    output]; the root module's fully_shard holds no parameter of its own),
 *    drives both sides of a gather: the gathered copy's alloc line and the
 *    all-gather on the data-parallel lane are written by one call, its free
 *    by another, so memory and time see the same gathers at the same
 *    places. A unit is gathered before its forward and its backward;
 *    the next one's gather is issued as a unit starts (FSDP2's prefetch: it
 *    runs during this one's compute) and a unit's compute waits for its
 *    own. The embedding and the blocks reshard after forward (torchtitan's
 *    default); norm and head do not (reshard_after_forward only under the
 *    "always" policy: backward needs them at once), so their backward
 *    gathers nothing. After a unit's backward its gradients are
 *    reduce-scattered and the unsharded ones replaced by the rank's shard;
 *    the reduce-scatters are waited for at the end of backward (the
 *    optimizer needs them).
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

static const char *const coll_op[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"};

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

static uint64_t mem_alloc(synth_comm *c, uint64_t bytes, const char *what) {
  uint64_t id = ++*c->alloc_id;
  fprintf(c->f, "{\"ev\":\"alloc\",\"t_us\":0,\"id\":%llu,\"bytes\":%llu,\"what\":\"%s\"}\n",
          (unsigned long long)id, (unsigned long long)bytes, what);
  return id;
}

static void mem_free(synth_comm *c, uint64_t id) {
  if (id) fprintf(c->f, "{\"ev\":\"free\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

int synth_comm_init(synth_comm *c, const synth_model *m, FILE *f, uint64_t *alloc_id) {
  *c = (synth_comm){.m = m, .f = f, .alloc_id = alloc_id};
  if (m->shard > 1) {
    unit_sizes u;
    unit_sizes_of(m, &u);
    c->n_units = m->layers + 2;
    if (!(c->units = calloc((size_t)c->n_units, sizeof *c->units))) return -1;
    const uint64_t e = (uint64_t)ferry_dtype_size(m->dtype); /* gathered in the compute dtype */
    for (int k = 0; k < c->n_units; k++) {
      fsdp_unit *x = &c->units[k];
      if (k == UNIT_EMBED && m->tie_embeddings) {
        /* one group: its post-forward runs after its last module (the head),
         * which keeps it for backward as torchtitan keeps [norm, output] */
        *x = (fsdp_unit){.what = "gathered parameters: embedding, norm and head (tied)", .layer = -1,
                         .gather_bytes = u.embed * e, .grad_params = u.embed_grad, .reshard_after_forward = 0};
      } else if (k == UNIT_EMBED) {
        *x = (fsdp_unit){.what = "gathered parameters: embedding", .layer = -1, .gather_bytes = u.embed * e,
                         .grad_params = u.embed_grad, .reshard_after_forward = 1};
      } else if (k == UNIT_HEAD(m) && m->tie_embeddings) {
        *x = (fsdp_unit){.layer = -1, .tied = 1};
      } else if (k == UNIT_HEAD(m)) {
        /* torchtitan: reshard_after_forward=(policy == "always") for [norm, output] */
        *x = (fsdp_unit){.what = "gathered parameters: norm and head", .layer = -1, .gather_bytes = u.head * e,
                         .grad_params = u.head_grad, .reshard_after_forward = 0};
      } else {
        *x = (fsdp_unit){.what = "gathered parameters: block", .layer = k - 1, .gather_bytes = u.block * e,
                         .grad_params = u.block_grad, .reshard_after_forward = 1};
      }
    }
  }
  if (ulysses_of(m)) {
    /* a rank's s tokens of its tensor-parallel heads, the all-to-all's buffer */
    const uint64_t tokens = (uint64_t)m->micro_batch * (uint64_t)seq_local_of(m),
                   d = (uint64_t)head_dim_of(m), e = (uint64_t)ferry_dtype_size(m->dtype);
    c->ulysses_q = tokens * (uint64_t)(m->heads / tp_of(m)) * d * e;
    c->ulysses_kv = tokens * (uint64_t)(m->kv_heads / tp_of(m)) * d * e;
  }
  if (m->tp > 1)
    c->tp_bytes = (uint64_t)m->micro_batch * (uint64_t)m->seq * (uint64_t)m->hidden *
                  (uint64_t)ferry_dtype_size(m->dtype);
  return 0;
}

void synth_comm_free(synth_comm *c) { free(c->units); }

/* A unit by number; the tied head's is the embedding's. */
static fsdp_unit *unit_of(synth_comm *c, int unit) {
  if (!c->units || unit < 0 || unit >= c->n_units) return NULL;
  return c->units[unit].tied ? &c->units[UNIT_EMBED] : &c->units[unit];
}

static int is_tied_head(const synth_comm *c, int unit) {
  return c->units && unit >= 0 && unit < c->n_units && c->units[unit].tied;
}

void fsdp_prefetch(synth_comm *c, int unit) {
  fsdp_unit *x = unit_of(c, unit);
  if (!x || x->mem) return;
  x->mem = mem_alloc(c, x->gather_bytes, x->what);
  x->ag = issue(c, SIM_COLL_ALL_GATHER, x->gather_bytes, c->m->shard, "shard", x->layer);
}

void fsdp_unshard(synth_comm *c, int unit) {
  fsdp_unit *x = unit_of(c, unit);
  if (!x) return;
  fsdp_prefetch(c, unit);
  wait_for(c, x->ag);
  x->ag = 0;
}

void fsdp_reshard(synth_comm *c, int unit) {
  fsdp_unit *x = unit_of(c, unit);
  if (!x || is_tied_head(c, unit)) return; /* the embedding's backward still needs it */
  mem_free(c, x->mem);
  x->mem = 0;
}

void fsdp_post_forward(synth_comm *c, int unit) {
  fsdp_unit *x = unit_of(c, unit);
  if (x && x->reshard_after_forward) fsdp_reshard(c, unit);
}

uint64_t fsdp_reduce_scatter(synth_comm *c, int unit, uint64_t *unsharded, int n) {
  fsdp_unit *x = unit_of(c, unit);
  if (!x) return 0;
  if (is_tied_head(c, unit)) {
    /* the table's gradient is complete after the embedding's backward adds
     * to it: held until the unit's one reduce-scatter there */
    for (int i = 0; i < n; i++) {
      if (unsharded[i] && x->n_deferred < (int)(sizeof x->deferred / sizeof *x->deferred))
        x->deferred[x->n_deferred++] = unsharded[i], unsharded[i] = 0;
    }
    return 0;
  }
  uint64_t shard_id = 0;
  const uint64_t trained = trained_of(c->m, x->grad_params);
  if (trained) {
    /* the collective's buffer: the unsharded gradients in the reduce dtype */
    x->rs = issue(c, SIM_COLL_REDUCE_SCATTER, trained * (uint64_t)ferry_dtype_size(grad_dtype_of(c->m)),
                  c->m->shard, "shard", x->layer);
    shard_id = mem_alloc(c, sharded_grad_bytes(c->m, x->grad_params), "gradient: weights (sharded)");
  }
  for (int i = 0; i < n; i++) {
    mem_free(c, unsharded[i]);
    unsharded[i] = 0;
  }
  for (int i = 0; i < x->n_deferred; i++) mem_free(c, x->deferred[i]);
  x->n_deferred = 0;
  return shard_id;
}

/* Two synchronous tensor-parallel exchanges of the activations. */
void synth_comm_tp_exchange(synth_comm *c, int layer) {
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

void synth_comm_ulysses_exchange(synth_comm *c, int layer) {
  if (!c->ulysses_q) return;
  const uint64_t bytes[4] = {c->ulysses_q, c->ulysses_kv, c->ulysses_kv, c->ulysses_q};
  for (int k = 0; k < 4; k++)
    wait_for(c, issue(c, SIM_COLL_ALL_TO_ALL, bytes[k], c->m->cp, "cp", layer));
}

/* The optimizer needs every gradient: the reduce-scatters in flight are
 * waited for, in issue order (head, blocks top down, embedding). */
void synth_comm_backward_end(synth_comm *c) {
  for (int k = c->n_units; k-- > 0;) {
    wait_for(c, c->units[k].rs);
    c->units[k].rs = 0;
  }
}
