/*
 * trace_synth.c — the trace synthesizer (declared in ferry_tools.h).
 * How it works: docs/internals.md#trace_synthc; the model, the presets and
 * the checkpointing modes with their sources: docs/sim-synth.md.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/synth_internal.h"

/* ---- writing -------------------------------------------------------------------- */
typedef struct writer {
  const synth_model *m;
  FILE *f;
  uint64_t next_id;
  uint64_t step;
  uint64_t model_bufid[2]; /* this step's first forward packs of the rotary tables (B_COS, B_SIN) */
  uint64_t resid_grad;     /* backward: the gradient of the residual stream coming down */
  synth_comm *comm;        /* the collectives, and FSDP's units' gathers (synth_comm.c) */
  uint64_t *grads;         /* the gradients written this step, freed after the optimizer */
  size_t n_grads, cap_grads;
  int oom;
} writer;

static double op_us(const synth_model *m, const op *o) {
  double t_flops = o->flops / (m->tflops * 1e12);
  double t_bytes = o->bytes / (m->hbm_gbps * 1e9);
  double us = (t_flops > t_bytes ? t_flops : t_bytes) * 1e6;
  /* an eager op is at least a kernel launch or two */
  return us > SYNTH_MIN_OP_US ? us : SYNTH_MIN_OP_US;
}

/* An op's backward: twice its forward, or its own cost. */
static double bwd_us(const synth_model *m, const op *o) {
  if (!o->own_bwd) return 2 * op_us(m, o);
  op b = {.flops = o->bwd_flops, .bytes = o->bwd_bytes};
  return op_us(m, &b);
}

static const char *op_label(const op *o) { return o->label ? o->label : o->suffix; }

/* A compute event: us at the synthesizer's rates, and the work it stands
 * for (FLOPs, bytes through device memory, the least time: kernel
 * launches), so that `ferry sim` can time it on the simulated GPU instead. */
static void w_compute(writer *w, double us, int layer, const char *opname, double flops,
                      double bytes, double min_us) {
  if (us <= 0) return;
  fprintf(w->f,
          "{\"ev\":\"compute\",\"t_us\":0,\"us\":%.3f,\"flops\":%.9g,\"hbm_bytes\":%.9g,"
          "\"min_us\":%g,\"layer\":%d,\"op\":\"%s\"}\n",
          us, flops, bytes, min_us, layer, opname);
}

/* Op o run `times` times back to back (backward: twice its forward), as
 * one compute event named name (NULL: the op's own). */
static uint64_t w_alloc(writer *w, uint64_t bytes, const char *what);
static void w_free(writer *w, uint64_t id);

/* Allocs around an op's compute (TMP_RING), into ids[MAX_TMPS]. */
static void w_ring(writer *w, const op *o, uint64_t *ids) {
  for (int k = 0; k < MAX_TMPS; k++)
    ids[k] = k < o->n_tmps && o->tmps[k].life == TMP_RING ? w_alloc(w, o->tmps[k].bytes, o->tmps[k].what) : 0;
}
static void w_ring_free(writer *w, const uint64_t *ids) {
  for (int k = MAX_TMPS; k-- > 0;) w_free(w, ids[k]);
}

static void w_op(writer *w, const op *o, int times, int layer, const char *name) {
  uint64_t ring[MAX_TMPS];
  w_ring(w, o, ring);
  w_compute(w, times * op_us(w->m, o), layer, name ? name : o->suffix, times * o->flops,
            times * o->bytes, times * SYNTH_MIN_OP_US);
  w_ring_free(w, ring);
}

static void module_path(int layer, const char *suffix, char *buf, size_t n) {
  if (layer < 0) snprintf(buf, n, "%s", suffix);
  else if (!suffix[0]) snprintf(buf, n, "model.layers.%d", layer);
  else snprintf(buf, n, "model.layers.%d.%s", layer, suffix);
}

/* One pack line; alias_of 0 = a buffer of its own. Returns its id. */
static uint64_t w_pack(writer *w, const saved *x, int layer, int phase, const char *path,
                       const char *cls, uint64_t alias_of) {
  uint64_t id = ++w->next_id;
  fprintf(w->f,
          "{\"ev\":\"pack\",\"t_us\":0,\"id\":%llu,\"step\":%llu,\"bytes\":%llu,\"dtype\":\"%s\","
          "\"shape\":[",
          (unsigned long long)id, (unsigned long long)w->step, (unsigned long long)saved_bytes(x),
          ferry_dtype_name(x->dtype));
  for (int i = 0; i < x->ndim; i++) fprintf(w->f, i ? ",%lld" : "%lld", (long long)x->shape[i]);
  fprintf(w->f,
          "],\"kind\":\"%s\",\"phase\":\"%s\",\"layer\":%d,\"layers\":%d,\"flags\":2,"
          "\"module\":\"%s\",\"class\":\"%s\",\"decision\":\"keep\"",
          ferry_kind_name(x->kind), ferry_phase_name(phase), layer, w->m->layers, path, cls);
  if (alias_of) fprintf(w->f, ",\"alias\":true,\"alias_of\":%llu", (unsigned long long)alias_of);
  fputs("}\n", w->f);
  return id;
}

static void w_unpack(writer *w, uint64_t id) {
  if (id) fprintf(w->f, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

/* Transient device memory (docs/trace-format.md): an alloc line; its id. */
static uint64_t w_alloc(writer *w, uint64_t bytes, const char *what) {
  uint64_t id = ++w->next_id;
  fprintf(w->f, "{\"ev\":\"alloc\",\"t_us\":0,\"id\":%llu,\"bytes\":%llu,\"what\":\"%s\"}\n",
          (unsigned long long)id, (unsigned long long)bytes, what);
  return id;
}

static void w_free(writer *w, uint64_t id) {
  if (id) fprintf(w->f, "{\"ev\":\"free\",\"t_us\":0,\"id\":%llu}\n", (unsigned long long)id);
}

/* Allocates op o's transients of the given life into ids[MAX_TMPS] (0 for
 * the others). */
static void w_alloc_tmps(writer *w, const op *o, int life, uint64_t *ids) {
  memset(ids, 0, MAX_TMPS * sizeof *ids);
  for (int k = 0; k < o->n_tmps; k++)
    if (o->tmps[k].life == life) ids[k] = w_alloc(w, o->tmps[k].bytes, o->tmps[k].what);
}

/* Which of an op's saves to pack. */
enum { P_ALL = 0, P_KEPT = 1 /* not dropped by drop */, P_DROPPED = 2 /* dropped, of group g */ };

/* Pack the saves of op o selected by which into ids[]; bufid[] maps
 * layer-local buffers to their first pack's id for aliases. */
static void w_pack_op(writer *w, const op *o, int layer, int phase, int which, unsigned drop,
                      uint64_t *ids, uint64_t *bufid) {
  char path[160];
  module_path(layer, op_module(o), path, sizeof path);
  for (int k = 0; k < o->n_saves; k++) {
    const saved *x = &o->saves[k];
    int dropped = (x->group & drop) != 0;
    if ((which == P_KEPT && dropped) || (which == P_DROPPED && !dropped)) continue;
    /* a buffer saved again is an alias of its first pack: within the layer,
     * or (a model-wide tensor in the forward pass) of the step's first */
    uint64_t *first = x->buf >= 0 && x->kind != PARAM ? &bufid[x->buf] : NULL;
    if (first && x->model_wide && phase == FERRY_PHASE_FORWARD) first = &w->model_bufid[x->buf - B_COS];
    ids[k] = w_pack(w, x, layer, phase, path, o->cls, first ? *first : 0);
    if (first && !*first) *first = ids[k];
  }
}

static void w_unpack_op(writer *w, const op *o, const uint64_t *ids) {
  for (int k = o->n_saves; k-- > 0;) w_unpack(w, ids[k]);
}

/* ids of a block's packs */
typedef struct block_ids {
  uint64_t *ids;  /* [op][MAX_SAVES] */
  uint64_t *outs; /* [op][MAX_OUTS]: per-op SAC's saved outputs */
  uint64_t ckpt;  /* checkpointing: the block's input */
} block_ids;

typedef struct layer_ctx {
  const op_list *l;
  const unsigned char *keep; /* per-op SAC's choice */
  uint64_t *bufid;           /* [l->n_bufs] */
  uint64_t *held;            /* [l->n_bufs]: alloc ids of what a checkpoint holds unseen */
  const int *first_saver;    /* [l->n_bufs]: the first op (forward order) saving each buffer */
  uint64_t *wgrad;           /* [l->n]: backward: each op's weight gradients' alloc id */
  const char *block_cls;
} layer_ctx;

#define IDS(bi, i) (&(bi)->ids[(size_t)(i) * MAX_SAVES])
#define OUTS(bi, i) (&(bi)->outs[(size_t)(i) * MAX_OUTS])

/* What a checkpoint keeps of a block: its input, a pack under every
 * implementation (hook_sees_kept: of SAC's kept outputs only), unpacked as
 * its recomputation begins. */
static void w_pack_block_input(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  saved in = sv(B_X, m->dtype, ACT, 0, 3, m->micro_batch, seq_region_of(m), m->hidden, 0);
  char path[64];
  module_path(layer, "", path, sizeof path);
  bi->ckpt = w_pack(w, &in, layer, FERRY_PHASE_FORWARD, path, c->block_cls, 0);
}

/* Recomputed tensors no hook sees: the checkpoint's storage holds one alloc
 * per distinct buffer of op o's saves (which/drop as w_pack_op; parameters
 * and the model-wide rotary tables are held anyway), each freed after the
 * backward of the first op that saves it (w_release_held), when autograd
 * releases its last saved reference. */
static void w_hold_op(writer *w, const layer_ctx *c, const op *o, int which, unsigned drop) {
  for (int k = 0; k < o->n_saves; k++) {
    const saved *x = &o->saves[k];
    int dropped = (x->group & drop) != 0;
    if ((which == P_KEPT && dropped) || (which == P_DROPPED && !dropped)) continue;
    if (x->buf < 0 || x->kind == PARAM || x->model_wide || c->held[x->buf]) continue;
    c->held[x->buf] = w_alloc(w, saved_bytes(x), "checkpoint: recomputed");
  }
}

static void w_release_held(writer *w, const layer_ctx *c, int i) {
  const op *o = &c->l->ops[i];
  for (int k = 0; k < o->n_saves; k++) {
    const int b = o->saves[k].buf;
    if (b < 0 || c->first_saver[b] != i || !c->held[b]) continue;
    w_free(w, c->held[b]);
    c->held[b] = 0;
  }
}

static void w_block_forward_ops(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  const op_list *l = c->l;
  const int mode = layer_mode(m, layer);
  memset(c->bufid, 0, (size_t)l->n_bufs * sizeof *c->bufid);
  memset(bi->ids, 0, (size_t)l->n * MAX_SAVES * sizeof *bi->ids);
  memset(bi->outs, 0, (size_t)l->n * MAX_OUTS * sizeof *bi->outs);
  bi->ckpt = 0;
  if (mode == SYNTH_CKPT_FULL) {
    /* one event per op, all named "forward": each has its own roofline */
    for (int i = 0; i < l->n; i++) w_op(w, &l->ops[i], 1, layer, "forward");
    /* checkpoint saves the block's input only */
    w_pack_block_input(w, c, layer, bi);
    return;
  }
  if (mode == SYNTH_CKPT_SELECTIVE_OP) {
    /* the checkpoint keeps the block's input; SAC the outputs it saves */
    w_pack_block_input(w, c, layer, bi);
    for (int i = 0; i < l->n; i++) {
      const op *o = &l->ops[i];
      w_op(w, o, 1, layer, NULL);
      if (!c->keep[i]) continue;
      char path[160];
      module_path(layer, op_module(o), path, sizeof path);
      for (int k = 0; k < o->n_outs; k++)
        OUTS(bi, i)[k] = hook_sees_kept(m)
                             ? w_pack(w, &o->outs[k], layer, FERRY_PHASE_FORWARD, path, o->cls, 0)
                             : w_alloc(w, saved_bytes(&o->outs[k]), "checkpoint: kept output");
    }
    return;
  }
  unsigned drop = mode == SYNTH_CKPT_SELECTIVE ? m->recompute : 0;
  for (int i = 0; i < l->n; i++) {
    w_op(w, &l->ops[i], 1, layer, NULL);
    w_pack_op(w, &l->ops[i], layer, FERRY_PHASE_FORWARD, P_KEPT, drop, IDS(bi, i), c->bufid);
  }
}

/* Op o's backward as one compute event: twice its forward, or its own cost
 * (FlashAttention's 2.5x, the loss's). */
static void w_op_backward(writer *w, const op *o, int layer, const char *name) {
  uint64_t ring[MAX_TMPS];
  w_ring(w, o, ring);
  w_compute(w, bwd_us(w->m, o), layer, name ? name : o->suffix, o->own_bwd ? o->bwd_flops : 2 * o->flops,
            o->own_bwd ? o->bwd_bytes : 2 * o->bytes, o->own_bwd ? SYNTH_MIN_OP_US : 2 * SYNTH_MIN_OP_US);
  w_ring_free(w, ring);
}

/* Megatron selective: group g (the attention core, the MLP activation) is
 * recomputed as a whole before the backward of the last op (in forward
 * order) that saved one of its dropped tensors. */
static int last_consumer(const op_list *l, unsigned g) {
  for (int i = l->n; i-- > 0;)
    for (int k = 0; k < l->ops[i].n_saves; k++)
      if (l->ops[i].saves[k].group & g) return i;
  return -1;
}

/* ---- gradients and gathered parameters ------------------------------------------ */
/* A gradient that stays until the optimizer step has run (zero_grad's
 * set_to_none=True, torch 2's default, frees it then). */
static void w_keep_grad(writer *w, uint64_t id) {
  if (!id) return;
  if (w->n_grads == w->cap_grads) {
    size_t cap = w->cap_grads ? 2 * w->cap_grads : 64;
    uint64_t *p = realloc(w->grads, cap * sizeof *p);
    if (!p) {
      w->oom = 1;
      return;
    }
    w->grads = p, w->cap_grads = cap;
  }
  w->grads[w->n_grads++] = id;
}

/* The gradients of op o's weights, allocated by its backward (one alloc for
 * them; 0 if none). Unsharded training: they are the gradients, kept until
 * the optimizer step. Sharded (FSDP, ZeRO-3): the unsharded ones, which the
 * unit's reduce-scatter replaces by the rank's shard (w_unit_backward_end). */
static uint64_t w_weight_grads(writer *w, const op *o) {
  const uint64_t n = trained_of(w->m, op_weight_elems(o));
  if (!n) return 0;
  if (w->m->shard <= 1) {
    uint64_t id = w_alloc(w, n * (uint64_t)ferry_dtype_size(grad_dtype_of(w->m)), "gradient: weights");
    w_keep_grad(w, id);
    return 0;
  }
  /* autograd writes them in the gathered parameters' dtype, the compute
   * one (FSDP2's MixedPrecisionPolicy.param_dtype); the gradient dtype is
   * the shard's, after the reduce-scatter */
  return w_alloc(w, n * (uint64_t)ferry_dtype_size(w->m->dtype), "gradient: weights (unsharded)");
}

/* After a unit's backward, sharded: the reduce-scatter writes the rank's
 * shard of its gradients (kept), then the unsharded ones are freed (FSDP2's
 * post-backward), and the unit's gathered copy goes. */
static void w_unit_backward_end(writer *w, int unit, uint64_t *unsharded, int n) {
  if (w->m->shard <= 1) return;
  w_keep_grad(w, fsdp_reduce_scatter(w->comm, unit, unsharded, n));
  fsdp_reshard(w->comm, unit);
}

/* foreach AdamW's transients at the step (torch.optim.adamw, _multi_tensor_adam):
 * torch._foreach_sqrt(exp_avg_sqs) makes a new tensor per state (the stepped
 * copy's dtype) that div_, add_ eps and addcdiv_ then use; with master
 * weights a 16-bit gradient is cast to fp32 first (the cast
 * optimizer_step_bytes costs). The other optimizers step in place. */
static void optimizer_transients(const synth_model *m, const synth_resident *r, uint64_t *sqrt_bytes,
                                 uint64_t *cast_bytes) {
  *sqrt_bytes = *cast_bytes = 0;
  if (m->optimizer != SYNTH_OPT_ADAMW) return;
  const uint64_t n = r->trainable / (uint64_t)m->shard;
  const uint64_t e = master_of(m) ? 4 : (uint64_t)ferry_dtype_size(param_dtype_of(m));
  *sqrt_bytes = n * e;
  if (master_of(m) && ferry_dtype_size(grad_dtype_of(m)) != 4) *cast_bytes = n * 4;
}

/* A block's forward under FSDP2 (reshard_after_forward=True): its
 * parameters gathered (prefetched by the unit before), the next unit's
 * all-gather issued as it runs (forward prefetch of one unit), its own
 * freed when it returns. */
static void w_block_forward(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  fsdp_unshard(w->comm, UNIT_BLOCK(layer));
  fsdp_prefetch(w->comm, UNIT_BLOCK(layer + 1)); /* past the last block: the head's unit */
  w_block_forward_ops(w, c, layer, bi);
  synth_comm_ulysses_exchange(w->comm, layer);
  synth_comm_tp_exchange(w->comm, layer);
  fsdp_post_forward(w->comm, UNIT_BLOCK(layer));
}

static void w_block_backward(writer *w, const layer_ctx *c, int layer, block_ids *bi) {
  const synth_model *m = w->m;
  const op_list *l = c->l;
  const int mode = layer_mode(m, layer);
  /* FSDP2's backward prefetch: the unit below is gathered as this one's
   * backward begins */
  fsdp_unshard(w->comm, UNIT_BLOCK(layer));
  fsdp_prefetch(w->comm, layer > 0 ? UNIT_BLOCK(layer - 1) : UNIT_EMBED);
  /* a full checkpoint's forward again, its exchanges included */
  if (mode == SYNTH_CKPT_FULL) {
    synth_comm_ulysses_exchange(w->comm, layer);
    synth_comm_tp_exchange(w->comm, layer);
  }
  /* the gradient of the block's input, written as its backward runs; the
   * one of its output (from the block above, or the head) lives until it ends */
  const uint64_t grad_in = w_alloc(w, (uint64_t)m->micro_batch * (uint64_t)seq_region_of(m) *
                                          (uint64_t)m->hidden * (uint64_t)ferry_dtype_size(m->dtype),
                                   "gradient: block input");

  memset(c->bufid, 0, (size_t)l->n_bufs * sizeof *c->bufid);
  memset(c->held, 0, (size_t)l->n_bufs * sizeof *c->held);
  const int kept_seen = hook_sees_kept(m), rec_seen = hook_sees_recomputed(m);
  if (mode == SYNTH_CKPT_FULL || mode == SYNTH_CKPT_SELECTIVE_OP) {
    /* recomputation: the block runs again from its input before its
     * backward; per-op SAC takes the outputs it saved instead of running
     * those ops. Every tensor the backward needs is saved again: packed
     * where a hook sees it, else held by the checkpoint. */
    w_unpack(w, bi->ckpt);
    for (int i = 0; i < l->n; i++) {
      const op *o = &l->ops[i];
      if (mode == SYNTH_CKPT_SELECTIVE_OP && c->keep[i])
        for (int k = 0; k < o->n_outs; k++) {
          if (kept_seen) w_unpack(w, OUTS(bi, i)[k]);
          else w_free(w, OUTS(bi, i)[k]); /* popped from the SAC cache, used as the output */
        }
      else w_op(w, o, 1, layer, "recompute");
      if (rec_seen) w_pack_op(w, o, layer, FERRY_PHASE_RECOMPUTE, P_ALL, 0, IDS(bi, i), c->bufid);
      else w_hold_op(w, c, o, P_ALL, 0);
    }
  }
  static const unsigned groups[2] = {SYNTH_RECOMPUTE_ATTN_CORE, SYNTH_RECOMPUTE_MLP_ACT};
  int at[2] = {-1, -1};
  if (mode == SYNTH_CKPT_SELECTIVE)
    for (int g = 0; g < 2; g++)
      if (m->recompute & groups[g]) at[g] = last_consumer(l, groups[g]);
  for (int i = l->n; i-- > 0;) {
    const op *o = &l->ops[i];
    for (int g = 0; g < 2; g++) {
      if (at[g] != i) continue;
      for (int j = 0; j < l->n; j++)
        if (l->ops[j].rgroup & groups[g]) w_op(w, &l->ops[j], 1, layer, "recompute");
      for (int j = 0; j < l->n; j++) {
        if (rec_seen)
          w_pack_op(w, &l->ops[j], layer, FERRY_PHASE_RECOMPUTE, P_DROPPED, groups[g], IDS(bi, j),
                    c->bufid);
        else w_hold_op(w, c, &l->ops[j], P_DROPPED, groups[g]);
      }
    }
    w_unpack_op(w, o, IDS(bi, i));
    c->wgrad[i] = w_weight_grads(w, o);
    w_op_backward(w, o, layer, NULL);
    w_release_held(w, c, i);
  }
  synth_comm_ulysses_exchange(w->comm, layer);
  synth_comm_tp_exchange(w->comm, layer);
  w_unit_backward_end(w, UNIT_BLOCK(layer), c->wgrad, l->n);
  w_free(w, w->resid_grad);
  w->resid_grad = grad_in;
}

/* The ops after the blocks (final norm, head, loss), forward: an op's
 * workspaces live around its compute and are freed before it saves; its
 * transient output lives until the loss returns, the end of forward.
 * out[] gets the outputs' alloc ids ([op][MAX_TMPS]). */
static void w_head_forward(writer *w, const op_list *l, block_ids *bi, uint64_t *bufid,
                           uint64_t *out) {
  /* torchtitan shards the final norm with the head, not resharded after
   * forward (backward needs it at once) */
  fsdp_unshard(w->comm, UNIT_HEAD(w->m));
  for (int i = 0; i < l->n; i++) {
    const op *o = &l->ops[i];
    uint64_t work[MAX_TMPS];
    w_alloc_tmps(w, o, TMP_WORK, work);
    w_compute(w, op_us(w->m, o), -1, op_label(o), o->flops, o->bytes, SYNTH_MIN_OP_US);
    for (int k = MAX_TMPS; k-- > 0;) w_free(w, work[k]);
    w_pack_op(w, o, -1, FERRY_PHASE_FORWARD, P_ALL, 0, IDS(bi, i), bufid);
    w_alloc_tmps(w, o, TMP_OUT, &out[(size_t)i * MAX_TMPS]);
  }
  for (size_t j = (size_t)l->n * MAX_TMPS; j-- > 0;) w_free(w, out[j]);
  fsdp_post_forward(w->comm, UNIT_HEAD(w->m));
}

/* Their backward, last op first: the gradient of an op's input is
 * allocated before the op takes its saved tensors back (autograd allocates
 * the output of a backward kernel while its inputs live), and the gradient
 * it consumed is freed once it ran. */
static void w_head_backward(writer *w, const op_list *l, block_ids *bi) {
  uint64_t incoming[MAX_TMPS] = {0}, wgrad[8] = {0};
  for (int i = l->n; i-- > 0;) {
    const op *o = &l->ops[i];
    uint64_t grad[MAX_TMPS];
    /* FSDP2's backward prefetch of the last block comes from the head
     * unit's pre-backward hook, on the gradient of the unit's output: after
     * the loss's backward (the loss is no module of the unit) */
    if (strcmp(o->suffix, "loss")) {
      fsdp_unshard(w->comm, UNIT_HEAD(w->m)); /* kept from forward: nothing to gather */
      fsdp_prefetch(w->comm, UNIT_BLOCK(w->m->layers - 1));
    }
    w_alloc_tmps(w, o, TMP_GRAD, grad);
    w_unpack_op(w, o, IDS(bi, i));
    if (i < 8 && !o->wgrad_handed) wgrad[i] = w_weight_grads(w, o);
    w_op_backward(w, o, -1, op_label(o));
    if (i < 8 && o->wgrad_handed) wgrad[i] = w_weight_grads(w, o);
    for (int k = 0; k < MAX_TMPS; k++) w_free(w, incoming[k]);
    memcpy(incoming, grad, sizeof grad);
  }
  w_unit_backward_end(w, UNIT_HEAD(w->m), wgrad, l->n < 8 ? l->n : 8);
  /* the gradient of the final norm's input flows into the last block */
  w->resid_grad = 0;
  for (int k = 0; k < MAX_TMPS; k++)
    if (!w->resid_grad && incoming[k]) w->resid_grad = incoming[k];
    else w_free(w, incoming[k]);
}

static const char *checkpoint_name(const synth_model *m, char *buf, size_t n) {
  switch (m->checkpoint) {
  case SYNTH_CKPT_FULL:
    if (m->ckpt_every > 1) snprintf(buf, n, "full:%d", m->ckpt_every);
    else snprintf(buf, n, "full");
    break;
  case SYNTH_CKPT_SELECTIVE:
    snprintf(buf, n, "selective:%s%s%s", m->recompute & SYNTH_RECOMPUTE_ATTN_CORE ? "attn_core" : "",
             (m->recompute & SYNTH_RECOMPUTE_ATTN_CORE) && (m->recompute & SYNTH_RECOMPUTE_MLP_ACT) ? "+" : "",
             m->recompute & SYNTH_RECOMPUTE_MLP_ACT ? "mlp_act" : "");
    break;
  case SYNTH_CKPT_SELECTIVE_OP: snprintf(buf, n, "selective-op"); break;
  default: snprintf(buf, n, "none");
  }
  return buf;
}

/* A resident line; dtype (optional, 0: none) is the element type, which
 * lets a replayer count the parameters from their bytes; layer_bytes
 * (optional, 0: none) each repeated block's part, which weight offload
 * moves. */
static void w_resident(FILE *f, uint64_t bytes, const char *what, int dtype, uint64_t layer_bytes) {
  fprintf(f, "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":%llu,\"what\":\"%s\"",
          (unsigned long long)bytes, what);
  if (dtype) fprintf(f, ",\"dtype\":\"%s\"", ferry_dtype_name(dtype));
  if (layer_bytes) fprintf(f, ",\"layer_bytes\":%llu", (unsigned long long)layer_bytes);
  fputs("}\n", f);
}

/* A resident line whose bytes a step allocates itself (docs/trace-format.md:
 * "transient": named for what reads it by name, not held all step). */
static void w_resident_transient(FILE *f, uint64_t bytes, const char *what, int dtype) {
  fprintf(f, "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":%llu,\"what\":\"%s\",\"dtype\":\"%s\","
             "\"transient\":true}\n",
          (unsigned long long)bytes, what, ferry_dtype_name(dtype));
}

int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen) {
  if (synth_validate(m, err, errlen)) return -1;
  writer w = {.m = m, .f = f};
  op_list layer = {0}, pre = {0}, post = {0};
  block_ids *blocks = calloc((size_t)m->layers, sizeof *blocks);
  uint64_t pre_store[MAX_SAVES], post_store[8 * MAX_SAVES], post_out[8 * MAX_TMPS];
  block_ids pre_ids = {.ids = pre_store}, post_ids = {.ids = post_store};
  uint64_t *bufid = NULL, *held = NULL, *wgrad = NULL;
  int *first_saver = NULL;
  unsigned char *keep = NULL;
  layer_ctx ctx = {.l = &layer,
                   .block_cls = m->arch != SYNTH_LLAMA      ? "GPTBlock"
                                : m->experts && m->qk_norm ? "Qwen3MoeDecoderLayer"
                                : m->experts               ? "MixtralDecoderLayer"
                                : m->qk_norm               ? "Qwen3DecoderLayer"
                                                           : "LlamaDecoderLayer"};
  char ckpt[48];
  size_t n = 0;
  int rc = -1;
  if (!blocks || layer_ops(m, &layer) || pre_ops(m, &pre) || post_ops(m, &post)) goto oom;
  n = (size_t)layer.n;
  if (!(bufid = calloc((size_t)layer.n_bufs, sizeof *bufid)) || !(keep = calloc(n, 1)) ||
      !(held = calloc((size_t)layer.n_bufs, sizeof *held)) || !(wgrad = calloc(n, sizeof *wgrad)) ||
      !(first_saver = malloc((size_t)layer.n_bufs * sizeof *first_saver)))
    goto oom;
  for (int b = 0; b < layer.n_bufs; b++) first_saver[b] = -1;
  for (int i = layer.n; i-- > 0;)
    for (int k = 0; k < layer.ops[i].n_saves; k++)
      if (layer.ops[i].saves[k].buf >= 0) first_saver[layer.ops[i].saves[k].buf] = i;
  for (int L = 0; L < m->layers; L++)
    if (!(blocks[L].ids = malloc(n * MAX_SAVES * sizeof(uint64_t))) ||
        !(blocks[L].outs = malloc(n * MAX_OUTS * sizeof(uint64_t))))
      goto oom;
  sac_keep(&layer, keep);
  ctx.keep = keep, ctx.bufid = bufid, ctx.held = held, ctx.first_saver = first_saver;
  ctx.wgrad = wgrad;
  fprintf(f,
          "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":%d,\"ferry\":\"%s\","
          "\"backend\":\"synth\",\"model\":\"%s\",\"arch\":\"%s\",\"layers\":%d,\"hidden\":%d,"
          "\"heads\":%d,\"kv_heads\":%d,",
          SIM_TRACE_VERSION, ferry_version_string(), m->name, m->arch == SYNTH_LLAMA ? "llama" : "gpt", m->layers,
          m->hidden, m->heads, m->kv_heads);
  if (m->head_dim) fprintf(f, "\"head_dim\":%d,", m->head_dim);
  if (m->qk_norm) fprintf(f, "\"qk_norm\":true,");
  fprintf(f, "\"ffn\":%d,", m->ffn);
  if (m->experts)
    fprintf(f, "\"experts\":%d,\"top_k\":%d,\"expert_ffn\":%d,", m->experts, m->top_k,
            (int)expert_ffn_of(m));
  fprintf(f, "\"vocab\":%d,\"seq\":%d,\"micro_batch\":%d,\"dtype\":\"%s\",\"flash\":%s,", m->vocab,
          m->seq, m->micro_batch, ferry_dtype_name(m->dtype), m->flash ? "true" : "false");
  if (m->arch == SYNTH_LLAMA) fprintf(f, "\"norm\":\"%s\",", m->norm == SYNTH_NORM_EAGER ? "eager" : "fused");
  fprintf(f, "\"checkpoint\":\"%s\",", checkpoint_name(m, ckpt, sizeof ckpt));
  if (m->checkpoint != SYNTH_CKPT_OFF)
    fprintf(f, "\"checkpointed_layers\":%d,\"checkpoint_impl\":\"%s\",", synth_checkpointed_layers(m),
            ckpt_impl_name(ckpt_impl_of(m)));
  if (m->loss == SYNTH_LOSS_CHUNKED) fprintf(f, "\"loss\":\"chunked:%lld\",", (long long)synth_loss_chunk(m));
  else fprintf(f, "\"loss\":\"full\",");
  fprintf(f,
          "\"param_dtype\":\"%s\",\"grad_dtype\":\"%s\",\"master_weights\":%s,"
          "\"optimizer\":\"%s\",",
          ferry_dtype_name(param_dtype_of(m)), ferry_dtype_name(grad_dtype_of(m)),
          master_of(m) ? "true" : "false", synth_optimizer_name(m->optimizer));
  if (m->lora > 0) fprintf(f, "\"lora\":%g,", m->lora);
  if (tp_of(m) > 1) fprintf(f, "\"tp\":%d,\"sp\":%s,", m->tp, m->sp ? "true" : "false");
  if (cp_of(m) > 1)
    fprintf(f, "\"cp\":%d,\"cp_impl\":\"%s\",", m->cp, ulysses_of(m) ? "ulysses" : "ring");
  fprintf(f, "\"shard\":%d,\"tflops\":%g,\"hbm_gbps\":%g}\n", m->shard, m->tflops, m->hbm_gbps);
  synth_resident res;
  synth_resident_parts(m, &res);
  w_resident(f, res.params, "parameters", param_dtype_of(m), res.layer_params);
  /* the gradients are declared for the optimizer offload's sizes but come
   * and go within a step (allocs); the gathered parameters are allocs only */
  w_resident_transient(f, res.grads, "gradients", grad_dtype_of(m));
  if (res.master) w_resident(f, res.master, "master weights", F32, 0);
  w_resident(f, res.states, "optimizer states", 0, 0);
  const double opt_bytes = optimizer_step_bytes(m, &res);
  uint64_t opt_sqrt_bytes, opt_cast_bytes;
  optimizer_transients(m, &res, &opt_sqrt_bytes, &opt_cast_bytes);
  synth_comm comm;
  w.comm = &comm;
  if (synth_comm_init(&comm, m, f, &w.next_id)) {
    synth_comm_free(&comm);
    goto oom;
  }
  for (int st = 1; st <= m->steps; st++) {
    w.step = (uint64_t)st;
    memset(w.model_bufid, 0, sizeof w.model_bufid);
    fprintf(f, "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":%d}\n", st);
    uint64_t small_bufid[POST_BUFS] = {0};
    memset(pre_store, 0, sizeof pre_store);
    memset(post_store, 0, sizeof post_store);
    fsdp_unshard(&comm, UNIT_EMBED);
    fsdp_prefetch(&comm, UNIT_BLOCK(0));
    for (int i = 0; i < pre.n; i++) {
      w_op(&w, &pre.ops[i], 1, -1, NULL);
      w_pack_op(&w, &pre.ops[i], -1, FERRY_PHASE_FORWARD, P_ALL, 0, IDS(&pre_ids, i), small_bufid);
    }
    fsdp_post_forward(&comm, UNIT_EMBED);
    for (int L = 0; L < m->layers; L++) w_block_forward(&w, &ctx, L, &blocks[L]);
    memset(small_bufid, 0, sizeof small_bufid);
    w_head_forward(&w, &post, &post_ids, small_bufid, post_out);
    fprintf(f, "{\"ev\":\"backward_begin\",\"t_us\":0}\n");
    w_head_backward(&w, &post, &post_ids);
    for (int L = m->layers; L-- > 0;) w_block_backward(&w, &ctx, L, &blocks[L]);
    uint64_t pre_grad[MAX_SAVES] = {0};
    fsdp_unshard(&comm, UNIT_EMBED);
    for (int i = pre.n; i-- > 0;) {
      w_unpack_op(&w, &pre.ops[i], IDS(&pre_ids, i));
      if (i < MAX_SAVES) pre_grad[i] = w_weight_grads(&w, &pre.ops[i]);
      w_op(&w, &pre.ops[i], 2, -1, NULL);
    }
    w_free(&w, w.resid_grad); /* the embedding's backward consumed it */
    w.resid_grad = 0;
    w_unit_backward_end(&w, UNIT_EMBED, pre_grad, pre.n < MAX_SAVES ? pre.n : MAX_SAVES);
    synth_comm_backward_end(&comm);
    fprintf(f, "{\"ev\":\"backward_end\",\"t_us\":0}\n");
    /* the optimizer step: its transients around it, then zero_grad frees
     * the gradients */
    uint64_t opt_sqrt = opt_sqrt_bytes ? w_alloc(&w, opt_sqrt_bytes, "optimizer: foreach sqrt(exp_avg_sq)") : 0;
    uint64_t opt_cast = opt_cast_bytes ? w_alloc(&w, opt_cast_bytes, "optimizer: gradients cast to fp32") : 0;
    w_compute(&w, opt_bytes / (m->hbm_gbps * 1e9) * 1e6, -1, "optimizer", 0, opt_bytes, 0);
    w_free(&w, opt_cast);
    w_free(&w, opt_sqrt);
    for (size_t g = w.n_grads; g-- > 0;) w_free(&w, w.grads[g]);
    w.n_grads = 0;
    fprintf(f, "{\"ev\":\"step_end\",\"t_us\":0,\"step\":%d}\n", st);
  }
  synth_comm_free(&comm);
  rc = 0;
  if (w.oom) goto oom;
  if (ferror(f)) {
    if (err && errlen) snprintf(err, errlen, "write error");
    rc = -1;
  }
  goto done;
oom:
  if (err && errlen) snprintf(err, errlen, "out of memory");
done:
  if (blocks)
    for (int L = 0; L < m->layers; L++) {
      free(blocks[L].ids);
      free(blocks[L].outs);
    }
  free(blocks);
  free(w.grads);
  free(bufid);
  free(held);
  free(wgrad);
  free(first_saver);
  free(keep);
  op_list_free(&layer);
  op_list_free(&pre);
  op_list_free(&post);
  return rc;
}
