/* test_sim_model.c — what the simulator models of an eager trainer (issue
 * 42): which tensors a saved-tensor hook receives under each checkpoint
 * implementation, and the costs and memory of the synthesized step, each
 * against a hand-computed small case. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"

/* Distinct activation bytes (alias packs once) of layer's packs in phase
 * (layer -2: every layer and none). */
static uint64_t pack_bytes(const sim_trace *t, int layer, int phase) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if ((layer == -2 || x->desc.layer == layer) && x->desc.kind == FERRY_KIND_ACTIVATION &&
        x->alias_of < 0 && x->desc.phase == phase)
      total += x->desc.bytes;
  }
  return total;
}

/* Bytes and count of the allocs whose what is `what`. */
static uint64_t alloc_bytes(const sim_trace *t, const char *what, int *count) {
  uint64_t total = 0;
  int n = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++)
    if (!strcmp(t->allocs[i].what, what)) total += t->allocs[i].bytes, n++;
  if (count) *count = n;
  return total;
}

static int packs_in_layers(const sim_trace *t) {
  int n = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) n += t->tensors[i].desc.layer >= 0;
  return n;
}

/* The tiny Llama of these tests: T = 256 tokens, h 256, 4 heads of 64, 2 KV
 * heads, ffn 512, bf16, 2 layers, flash, fused norms. */
static void tiny(synth_model *m) {
  synth_preset("tiny", m);
  m->layers = 2, m->seq = 256, m->micro_batch = 1;
}

/* Issue 42 item 1. What a saved-tensor hook receives, per checkpoint
 * implementation, by hand for the tiny model:
 *   block input 2Th = 131072 B;
 *   a block's saves without checkpointing (rotary tables apart), 8Th + 4T·qd
 *   + 4T·kvd + 8Tf + 8T + 4aT = 524288 + 262144 + 131072 + 1048576 + 2048 +
 *   4096 = 1972224 B;
 *   per-op SAC's kept outputs (q, v, gate, down projections; attention's
 *   output and lse) 2T·qd + 2T·kvd + 2Th + 2Tf + 2T·qd... = sac - input:
 *   4Th + 4T·qd + 2T·kvd + 2Tf + 4aT - 2Th = 856064 - 131072 = 724992 B.
 * reentrant: the input is a pack, the recomputed tensors are packs (phase
 * recompute). non-reentrant (torchtitan's; the default for full and
 * selective-op): the input is a pack (torch saves it through
 * _NoopSaveInputs, outside the checkpoint's own hooks: an outer
 * saved_tensors_hooks counted it, torch 2.15), the kept outputs and the
 * recomputed tensors are not; the checkpoint holds them (allocs).
 * compiled: the input and the kept outputs are packs, the recomputed
 * tensors are not. A replay's policy is offered the packs only: under
 * non-reentrant full checkpointing a block's input alone. */
TEST(sim_synth_hook_sees_per_checkpoint_impl) {
  const uint64_t input = 131072, block = 1972224, kept_outs = 724992, rope = 4 * 256 * 64;
  synth_model m;
  sim_trace *t = NULL;
  int n = 0;
  /* full, reentrant (Hugging Face's default) */
  tiny(&m);
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_impl = SYNTH_CKPT_IMPL_REENTRANT;
  CHECK_OK(trace_of(&m, &t));
  for (int L = 0; L < 2; L++) {
    CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_FORWARD), input);
    CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_RECOMPUTE), block + rope);
  }
  CHECK_EQ(alloc_bytes(t, "checkpoint: block input", &n), 0);
  CHECK_EQ(alloc_bytes(t, "checkpoint: recomputed", &n), 0);
  sim_trace_free(t);
  /* full, non-reentrant: the default */
  for (int given = 0; given <= 1; given++) {
    tiny(&m);
    m.checkpoint = SYNTH_CKPT_FULL;
    if (given) m.ckpt_impl = SYNTH_CKPT_IMPL_NON_REENTRANT;
    CHECK_OK(trace_of(&m, &t));
    CHECK_EQ(packs_in_layers(t), 2);
    for (int L = 0; L < 2; L++) {
      CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_FORWARD), input);
      CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_RECOMPUTE), 0);
    }
    CHECK_EQ(alloc_bytes(t, "checkpoint: block input", &n), 0);
    CHECK_EQ(alloc_bytes(t, "checkpoint: recomputed", &n), 2 * block);
    /* the replay offers the policy only the packs: the 2 block inputs; the
     * embedding ids; model.norm's input, rstd, weight; lm_head's input,
     * weight; the loss's log-probabilities, their alias, labels,
     * total_weight: 12 */
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.policy_source = "return { api = 1, name = 'all', knobs = { min_offload_bytes = 1 },\n"
                      "  decide = function(t, ctx) return ferry.OFFLOAD end }";
    sim_result r;
    char err[512];
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_EQ(r.tensors_packed, 12);
    for (uint32_t i = 0; i < r.n_layers; i++)
      if (r.layers[i].layer >= 0) CHECK_EQ(r.layers[i].offloaded_bytes, input);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  /* selective-op, compiled: the input and the kept outputs are packs, the
   * recomputed tensors held by the compiled backward */
  tiny(&m);
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP, m.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
  CHECK_OK(trace_of(&m, &t));
  for (int L = 0; L < 2; L++) {
    CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_FORWARD), input + kept_outs);
    CHECK_EQ(pack_bytes(t, L, FERRY_PHASE_RECOMPUTE), 0);
  }
  CHECK_EQ(alloc_bytes(t, "checkpoint: recomputed", &n), 2 * block);
  sim_trace_free(t);
  /* selective-op, non-reentrant (torchtitan's, the default): the input only */
  tiny(&m);
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(packs_in_layers(t), 2);
  CHECK_EQ(pack_bytes(t, 0, FERRY_PHASE_FORWARD), input);
  CHECK_EQ(alloc_bytes(t, "checkpoint: block input", &n), 0);
  CHECK_EQ(alloc_bytes(t, "checkpoint: kept output", &n), 2 * kept_outs);
  CHECK_EQ(alloc_bytes(t, "checkpoint: recomputed", &n), 2 * block);
  sim_trace_free(t);
  /* Megatron's selective (its own reentrant checkpoint): the recomputed
   * attention core is packed; non-reentrant, held */
  tiny(&m);
  m.checkpoint = SYNTH_CKPT_SELECTIVE, m.flash = 0, m.recompute = SYNTH_RECOMPUTE_MLP_ACT;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(pack_bytes(t, 0, FERRY_PHASE_RECOMPUTE), 2 * 256 * 512); /* the SiLU output 2Tf */
  sim_trace_free(t);
  m.ckpt_impl = SYNTH_CKPT_IMPL_NON_REENTRANT;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(pack_bytes(t, -2, FERRY_PHASE_RECOMPUTE), 0);
  CHECK_EQ(alloc_bytes(t, "checkpoint: recomputed", &n), 2 * 2 * 256 * 512);
  sim_trace_free(t);
  /* refusals, and the header names the implementation */
  char err[512] = "";
  tiny(&m);
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP, m.ckpt_impl = SYNTH_CKPT_IMPL_REENTRANT;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "use_reentrant=False");
  m.checkpoint = SYNTH_CKPT_OFF;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs checkpointing");
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_impl = 7;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  m.ckpt_impl = SYNTH_CKPT_IMPL_AUTO;
  char *text = synth_text_of(&m, err, sizeof err);
  CHECK(text != NULL);
  char *nl = strchr(text, '\n');
  *nl = 0;
  int named = strstr(text, "\"checkpoint_impl\":\"non-reentrant\"") != NULL;
  free(text);
  CHECK(named);
  return 0;
}

/* ---- steady state after the arena's growth ----------------------------------------- */
#define T_HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define T_PACK(id, step, bytes)                                                                  \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":" #step ",\"bytes\":" #bytes              \
  ",\"dtype\":\"u8\",\"shape\":[" #bytes "],\"kind\":\"activation\",\"phase\":\"forward\","      \
  "\"layer\":0,\"layers\":1,\"decision\":\"offload\"}\n"
#define T_UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"
#define T_WORK(us) "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us "}\n"
#define T_EV(name) "{\"ev\":\"" name "\",\"t_us\":0}\n"
#define T_BEGIN(step) "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":" #step "}\n"
#define T_END(step) "{\"ev\":\"step_end\",\"t_us\":0,\"step\":" #step "}\n"
/* one tensor A out and back around 1000 us of compute; step 2 also B */
#define ONE_STEP(s, a)                                                                           \
  T_BEGIN(s) T_PACK(a, s, 100000) T_WORK(1000) T_EV("backward_begin") T_UNPACK(a)                \
      T_EV("backward_end") T_END(s)
#define GROW_STEP(s, a, b)                                                                       \
  T_BEGIN(s) T_PACK(a, s, 100000) T_PACK(b, s, 5000000) T_WORK(1000) T_EV("backward_begin")      \
      T_UNPACK(b) T_UNPACK(a) T_EV("backward_end") T_END(s)

static const char *const offload_all =
    "return { api = 1, name = 'all', knobs = { min_offload_bytes = 1 },\n"
    "  decide = function(t, ctx) return ferry.OFFLOAD end }";

/* Issue 42 item 3. Pinning costs 1000 us a call plus 1 us per 2000 B
 * touched; the pool arena takes a 4 MiB chunk for A in step 1 and a chunk of
 * B's own (5 MB: more than the chunk has left) in step 2: step 2 pays
 * 1000 + 2500 us once. Steps 3 and 4 grow nothing. The steady figures begin
 * at step 3 and equal step 3's alone (a three-step replay) or the mean of
 * 3 and 4 (four steps), whatever the step count; the old mean over steps 2..N
 * counted step 2's pinning (3500 us) / (N - 1). The arena growing in the
 * last step is said, and with warmup < 0 (none) every step counts. */
TEST(sim_steady_state_begins_after_the_arena_stopped_growing) {
  static const char text[] = T_HDR ONE_STEP(1, 1) GROW_STEP(2, 2, 3) ONE_STEP(3, 4) ONE_STEP(4, 5);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("grow", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.policy_source = offload_all;
  c.pinned_alloc_us = 1000, c.pinned_touch_bytes_per_s = 2e9;
  sim_result three, four, plain;
  c.steps = 3;
  CHECK_OK(sim_replay(t, &c, &three, err, sizeof err));
  c.steps = 4;
  CHECK_OK(sim_replay(t, &c, &four, err, sizeof err));
  /* the same steps without pinning cost: what step 3 takes */
  c.pinned_alloc_us = 0, c.pinned_touch_bytes_per_s = 0;
  CHECK_OK(sim_replay(t, &c, &plain, err, sizeof err));
  CHECK_EQ(three.arena_grew_step, 2);
  CHECK_EQ(three.steady_from, 3);
  CHECK_EQ(three.arena_still_growing, 0);
  CHECK_EQ(four.steady_from, 3);
  /* step 3: A's copy out (100 us) hides under the compute and its unpack is
   * served from the forward stash: the compute alone, 1000 us (and so the
   * same replay without pinning cost) */
  CHECK_NEAR(three.step_us, 1000.0, 1e-6);
  CHECK_NEAR(four.step_us, 1000.0, 1e-6);
  CHECK_NEAR(plain.step_us, 1000.0, 1e-6);
  CHECK_NEAR(three.pinned_alloc_us, 0, 0);
  CHECK_NEAR(three.bytes_d2h, 100000, 0);
  CHECK_EQ(three.peak_saved_bytes, 100000);
  sim_result_free(&three);
  sim_result_free(&four);
  sim_result_free(&plain);
  /* two steps: the arena grew in the last one */
  c.pinned_alloc_us = 1000, c.pinned_touch_bytes_per_s = 2e9;
  c.steps = 2;
  sim_result two;
  CHECK_OK(sim_replay(t, &c, &two, err, sizeof err));
  CHECK_EQ(two.arena_still_growing, 1);
  CHECK_EQ(two.steady_from, 2);
  CHECK(two.step_us >= 1000.0 + 3500.0);
  sim_result_free(&two);
  /* every step counted: warmup < 0 */
  c.steps = 4, c.warmup = -1;
  sim_result all;
  CHECK_OK(sim_replay(t, &c, &all, err, sizeof err));
  CHECK_EQ(all.steady_from, 1);
  sim_result_free(&all);
  sim_trace_free(t);
  return 0;
}

/* Review of item 3: more warmup steps than steps replayed. The arena grows
 * in step 1 only (A pinned once, reused after): with --steps 2 --warmup 3
 * the figures are step 2's (steady_from 2), and the report must say so, not
 * "steps 1..2". */
TEST(sim_report_names_the_steady_steps_when_warmup_exceeds_steps) {
  static const char text[] = T_HDR ONE_STEP(1, 1) ONE_STEP(2, 2) ONE_STEP(3, 3);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("grow1", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.policy_source = offload_all;
  c.pinned_alloc_us = 1000, c.pinned_touch_bytes_per_s = 2e9;
  c.steps = 2, c.warmup = 3;
  sim_result rs[2];
  sim_config base = c;
  base.policy_source = NULL;
  CHECK_OK(sim_replay(t, &base, &rs[0], err, sizeof err));
  CHECK_OK(sim_replay(t, &c, &rs[1], err, sizeof err));
  CHECK_EQ(rs[1].arena_grew_step, 1);
  CHECK_EQ(rs[1].steady_from, 2);
  CHECK_EQ(rs[1].arena_still_growing, 0);
  sim_run_info info = {0};
  info.trace_path = "grow1", info.trace = t, info.hw = sim_hw_preset("h100");
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  CHECK(f != NULL);
  sim_print_table(f, &info, rs, 2);
  fclose(f);
  int says = strstr(buf, "steady from step 2") != NULL;
  if (!says) fprintf(stderr, "%s\n", buf);
  free(buf);
  CHECK(says);
  /* the JSON: no --warmup step was left out (3 asked, 2 ran), the steady
   * figures begin at step 2 */
  char dir[] = "/tmp/ferry-steady-XXXXXX";
  CHECK(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/r.json", dir);
  CHECK_EQ(sim_write_json(path, &info, rs, 2, err, sizeof err), 0);
  FILE *j = fopen(path, "r");
  CHECK(j != NULL);
  char json[1 << 14];
  size_t n = fread(json, 1, sizeof json - 1, j);
  json[n] = 0;
  fclose(j);
  remove(path);
  rmdir(dir);
  CHECK_STR_CONTAINS(json, "\"warmup_steps\":\t0,");
  CHECK_STR_CONTAINS(json, "\"steady_from_step\":\t2,");
  sim_result_free(&rs[0]);
  sim_result_free(&rs[1]);
  sim_trace_free(t);
  return 0;
}

/* Issue 42 item 5. FlashAttention's backward runs five matmuls against the
 * forward's two: 2.5x the FLOPs. The tiny model's causal attention forward,
 * 2·T·s·qd = 2 · 256 · 256 · 256 = 33554432 FLOPs (4Tsqd halved by the mask);
 * its backward 83886080; a Linear's backward stays twice its forward
 * (q_proj: 2·T·h·qd = 33554432 forward, 67108864 backward). */
TEST(sim_synth_flash_backward_is_2_5x_forward) {
  synth_model m;
  tiny(&m);
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  int in_bwd = 0, seen_f = 0, seen_b = 0, seen_q = 0;
  for (uint32_t k = 0; k < t->n_events; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_STEP_BEGIN) in_bwd = 0;
    if (ev->type == TEV_BACKWARD_BEGIN) in_bwd = 1;
    if (ev->type != TEV_COMPUTE || !ev->op) continue;
    if (!strcmp(ev->op, "self_attn.attention")) {
      CHECK_NEAR(ev->flops, in_bwd ? 83886080.0 : 33554432.0, 0);
      if (in_bwd) seen_b++;
      else seen_f++;
    }
    if (in_bwd && !strcmp(ev->op, "self_attn.q_proj")) {
      CHECK_NEAR(ev->flops, 67108864.0, 0);
      seen_q++;
    }
  }
  CHECK_EQ(seen_f, 2);
  CHECK_EQ(seen_b, 2);
  CHECK_EQ(seen_q, 2);
  sim_trace_free(t);
  return 0;
}

/* Issue 42 item 8. "Fits" is the capacity CUDA exposes less the allowance
 * for the context and fragmentation (docs/hardware.md: 2.1-2.8 GiB; 2.8):
 * h100 79.11 - 2.80 = 76.31 GiB, h200 139.80 - 2.80 = 137.00 GiB, a100
 * 79.15 - 2.80 = 76.35 GiB (it was 80e9 x 0.95 = 70.78 GiB on the 80 GB
 * parts and 124.8 GiB on the H200). A run peaking at 75 GiB fits an H100. */
TEST(sim_fits_is_exposed_capacity_less_the_allowance) {
  const double GiB = 1073741824.0;
  CHECK_NEAR(sim_hw_usable_bytes(sim_hw_preset("h100")) / GiB, 76.31, 1e-9);
  CHECK_NEAR(sim_hw_usable_bytes(sim_hw_preset("h200")) / GiB, 137.00, 1e-9);
  CHECK_NEAR(sim_hw_usable_bytes(sim_hw_preset("a100")) / GiB, 76.35, 1e-9);
  /* the 40 GB A100: 39.39 GiB exposed, 36.59 usable (not the 80 GB one's) */
  CHECK(sim_hw_preset("a100-40") != NULL);
  CHECK_NEAR(sim_hw_usable_bytes(sim_hw_preset("a100-40")) / GiB, 36.59, 1e-9);
  CHECK_NEAR(sim_hw_preset("a100-40")->device_bytes, 40e9, 0);
  /* GH200 480GB: vLLM #9630's 94.50 GiB, not H100's ratio (94.93) */
  CHECK_NEAR(sim_hw_usable_bytes(sim_hw_preset("gh200")) / GiB, 91.70, 1e-9);
  CHECK(75 * GiB <= sim_hw_usable_bytes(sim_hw_preset("h100")));
  /* a preset without a published capacity takes its nominal bytes */
  sim_hw custom = *sim_hw_preset("h100");
  custom.capacity_bytes = 0, custom.device_bytes = 10 * GiB;
  CHECK_NEAR(sim_hw_usable_bytes(&custom) / GiB, 7.2, 1e-9);
  custom.device_bytes = 1 * GiB;
  CHECK_NEAR(sim_hw_usable_bytes(&custom), 0, 0);
  return 0;
}

/* Issue 42 item 7. Memory inside a block's backward. (a) A saved tensor
 * lives until its op's backward ran (autograd releases it after the node),
 * not only until it is unpacked: A (1000 B) kept, then in backward unpacked
 * before an op whose backward allocates 500 B: 1500 B live at once (it was
 * 1000, A freed at the unpack). (b) The synthesized block's backward writes
 * the gradient of its input, 2Th = 131072 B per layer, and under sharding
 * the unsharded gradients of its weights, freed after the block (FSDP's
 * reduce-scatter): tiny's matrices h·qd + 2h·kvd + qd·h + 3h·f = 589824 and
 * two norms 2h = 512 parameters, bf16: 1180672 B per layer; and (issue 42
 * item 6) the head's unit's (final norm h + lm_head V·h = 262400 parameters,
 * 524800 B) and the embedding's (V·h, 524288 B). Unsharded, the same bytes
 * are the gradients themselves (kept to the optimizer step), none of them
 * "unsharded". */
TEST(sim_block_backward_holds_saved_tensors_and_gradients) {
  static const char text[] =
      T_HDR T_BEGIN(1) "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":1000,\"dtype\":\"u8\","
      "\"shape\":[1000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,"
      "\"decision\":\"keep\"}\n" T_WORK(10) T_EV("backward_begin") T_UNPACK(1)
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":2,\"bytes\":500,\"what\":\"grad\"}\n" T_WORK(10)
      "{\"ev\":\"free\",\"t_us\":0,\"id\":2}\n" T_EV("backward_end") T_END(1);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("bwd", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.peak_saved_bytes, 1500);
  sim_result_free(&r);
  sim_trace_free(t);

  synth_model m;
  tiny(&m);
  m.shard = 8;
  CHECK_OK(trace_of(&m, &t));
  int n = 0;
  CHECK_EQ(alloc_bytes(t, "gradient: block input", &n), 2 * 131072);
  CHECK_EQ(n, 2);
  CHECK_EQ(alloc_bytes(t, "gradient: weights (unsharded)", &n), 2 * 1180672 + 524800 + 524288);
  sim_trace_free(t);
  m.shard = 1;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(alloc_bytes(t, "gradient: weights (unsharded)", &n), 0);
  CHECK_EQ(alloc_bytes(t, "gradient: weights", &n), 2 * 1180672 + 524800 + 524288);
  CHECK_EQ(alloc_bytes(t, "gradient: block input", &n), 2 * 131072);
  sim_trace_free(t);
  return 0;
}

/* Issue 42 item 10. (a) The optimizer step as torch's foreach AdamW runs it,
 * after gradient clipping: per stepped parameter, clipping 3g = 6 B (bf16
 * gradients), AdamW's eight passes 21 x 4 = 84 B over the fp32 master copy,
 * the gradient's cast to fp32 2 + 4 and the copy back 4 + 2: 102 B (it was
 * 2 x 16 = 32). (b) gpt3-1.3b ties its head and learns 2048 positions:
 * V·h + 2048·h + 24 (4h² + 2hf + 4h) + 2h = 102926336 + 4194304 +
 * 1208156160 + 4096 = 1315280896 parameters (the paper's 1.3B; untied and
 * without positions it was 1.41B). */
TEST(sim_synth_optimizer_traffic_and_gpt3_preset) {
  synth_model m;
  tiny(&m);
  m.shard = 2;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  const double per_rank = (double)synth_param_count(&m) / 2;
  int seen = 0;
  for (uint32_t k = 0; k < t->n_events; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "optimizer")) {
      CHECK_NEAR(ev->hbm_bytes, 102 * per_rank, 1e-6 * per_rank);
      seen++;
    }
  }
  CHECK_EQ(seen, 1);
  sim_trace_free(t);
  /* fp32 gradients beside bf16 parameters and fp32 masters (FSDP's
   * reduce_dtype=float32): no cast before AdamW; clipping 3 x 4, AdamW 21 x
   * 4, the master copied back 4 + 2: 102 again (110 if a cast were counted) */
  m.grad_dtype = FERRY_DTYPE_F32;
  CHECK_OK(trace_of(&m, &t));
  seen = 0;
  for (uint32_t k = 0; k < t->n_events; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "optimizer")) {
      CHECK_NEAR(ev->hbm_bytes, 102 * per_rank, 1e-6 * per_rank);
      seen++;
    }
  }
  CHECK_EQ(seen, 1);
  sim_trace_free(t);
  m.grad_dtype = 0;
  /* SGD (no state, no master: fp32 parameters): clipping 3 x 4 plus each
   * kept byte read and written once, 2 (4 + 4) */
  m.optimizer = SYNTH_OPT_SGD, m.param_dtype = FERRY_DTYPE_F32;
  CHECK_OK(trace_of(&m, &t));
  for (uint32_t k = 0; k < t->n_events; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "optimizer"))
      CHECK_NEAR(ev->hbm_bytes, 28 * per_rank, 1e-6 * per_rank);
  }
  sim_trace_free(t);
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  CHECK_EQ(synth_param_count(&m), 1315280896ull);
  CHECK_EQ(m.tie_embeddings, 1);
  return 0;
}

/* ---- issue 42 item 6 / issue 34 item 3: gradients and gathered parameters ---- */

/* Live bytes of the allocs whose what begins with prefix, at the first
 * compute event named op in phase (0 forward, 1 backward, 2 after it) of
 * step 1, at its n-th such event (0: the first); UINT64_MAX if none. */
static uint64_t live_at(const sim_trace *t, const char *prefix, const char *op, int phase, int nth) {
  uint8_t *on = calloc(t->n_allocs ? t->n_allocs : 1, 1);
  uint64_t live = 0, found = UINT64_MAX;
  int ph = 0, seen = 0;
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end && found == UINT64_MAX; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type == TEV_BACKWARD_BEGIN) ph = 1;
    if (ev->type == TEV_BACKWARD_END) ph = 2;
    if ((ev->type == TEV_ALLOC || ev->type == TEV_FREE) &&
        !strncmp(t->allocs[ev->tensor].what, prefix, strlen(prefix))) {
      live = ev->type == TEV_ALLOC ? live + t->allocs[ev->tensor].bytes : live - t->allocs[ev->tensor].bytes;
      on[ev->tensor] = ev->type == TEV_ALLOC;
    }
    if (ev->type == TEV_COMPUTE && ph == phase && ev->op && !strcmp(ev->op, op) && seen++ == nth)
      found = live;
  }
  free(on);
  return found;
}

/* Without sharding the weights' gradients appear as each op's backward
 * writes them (zero_grad(set_to_none=True)) and stay to the optimizer step;
 * on 338c69c they were resident all step (none in a step). Tiny, 2 layers,
 * bf16, by hand: a block's parameters 589824 + 512 = 590336, 1180672 B; the
 * head's unit (final norm 256 + lm_head 1024 x 256) 524800 B; the
 * embedding's 524288 B. Live gradient bytes: none in forward; at block 1's
 * first backward op (its down_proj) the head's and down_proj's own
 * (2 x 512 x 256 = 262144); at block 0's down_proj the head's, block 1's
 * and that op's; at the optimizer step all 2 x 1180672 + 524800 + 524288;
 * and the trace's resident bytes hold none of them. */
TEST(sim_synth_gradients_appear_per_layer) {
  synth_model m;
  tiny(&m);
  m.optimizer = SYNTH_OPT_SGD;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  const uint64_t block = 1180672, head = 524800, embed = 524288, down = 262144;
  CHECK_EQ(live_at(t, "gradient: weights", "self_attn.q_proj", 0, 0), 0);
  CHECK_EQ(live_at(t, "gradient: weights", "mlp.down_proj", 1, 0), head + down);
  CHECK_EQ(live_at(t, "gradient: weights", "mlp.down_proj", 1, 1), head + block + down);
  CHECK_EQ(live_at(t, "gradient: weights", "optimizer", 2, 0), head + 2 * block + embed);
  synth_resident r;
  synth_resident_parts(&m, &r);
  /* the parameter count's final RMSNorm is the h its backward writes */
  CHECK_EQ(r.grads, head + 2 * block + embed);
  CHECK_EQ(t->resident_bytes, r.params + r.master + r.states);
  sim_trace_free(t);
  return 0;
}

/* FSDP2 (reshard_after_forward=True, one unit prefetched each way; the
 * head's unit kept from its forward to its backward, as torchtitan shards
 * it): the gathered copies live as the units run, and each unit's unsharded
 * gradients go at its reduce-scatter, leaving the rank's shard. Tiny, 2
 * layers, shard 2, bf16 (sizes above): at the embedding's forward it and
 * block 0 are gathered (524288 + 1180672); at block 0's q_proj blocks 0 and
 * 1; at block 1's blocks 1 and the head's unit; at lm_head's forward the
 * head's unit alone, its unsharded size (the parameter count's final norm
 * h (RMSNorm: a weight) + lm_head: 524800 B; on 338c69c a flat 2 blocks'
 * linears, 2359296 B, all step); in backward at the loss the head's unit and
 * block 1; the most at once (synth_resident_parts' gathered) two blocks.
 * Gradients: at block
 * 0's down_proj backward the unsharded ones are down_proj's alone (262144;
 * block 1's and the head's were freed at their reduce-scatters) and the
 * sharded ones the head's and block 1's halves (262400 + 590336). At the
 * optimizer step foreach AdamW's sqrt of the fp32 states and the fp32 cast
 * of the gradients: 4 x 1705216 / 2 = 3410432 each (P = 1705216, the
 * final norm's h included). */
TEST(sim_synth_fsdp_gathers_per_unit_and_frees_unsharded_gradients) {
  synth_model m;
  tiny(&m);
  m.shard = 2;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  /* the head's unit: the final RMSNorm's h and lm_head */
  const uint64_t block = 1180672, head = 524800, embed = 524288;
  const char *g = "gathered parameters";
  CHECK_EQ(live_at(t, g, "model.embed_tokens", 0, 0), embed + block);
  CHECK_EQ(live_at(t, g, "self_attn.q_proj", 0, 0), 2 * block);
  CHECK_EQ(live_at(t, g, "self_attn.q_proj", 0, 1), block + head);
  CHECK_EQ(live_at(t, g, "lm_head", 0, 0), head);
  /* FSDP2 prefetches block 1 from the head unit's pre-backward hook, on the
   * gradient of lm_head's output: after the loss's backward, not before */
  CHECK_EQ(live_at(t, g, "loss.log_softmax", 1, 0), head);
  CHECK_EQ(live_at(t, g, "lm_head", 1, 0), head + block);
  CHECK_EQ(live_at(t, g, "model.embed_tokens", 1, 0), embed);
  CHECK_EQ(live_at(t, g, "optimizer", 2, 0), 0);
  synth_resident r;
  synth_resident_parts(&m, &r);
  CHECK_EQ(r.gathered, 2 * block); /* tiny's blocks outweigh its head */
  CHECK_EQ(live_at(t, "gradient: weights (unsharded)", "mlp.down_proj", 1, 1), 262144);
  CHECK_EQ(live_at(t, "gradient: weights (sharded)", "mlp.down_proj", 1, 1), head / 2 + block / 2);
  CHECK_EQ(live_at(t, "gradient: weights (unsharded)", "optimizer", 2, 0), 0);
  CHECK_EQ(live_at(t, "gradient: weights (sharded)", "optimizer", 2, 0), (head + 2 * block + embed) / 2);
  CHECK_EQ(live_at(t, "optimizer: foreach sqrt(exp_avg_sq)", "optimizer", 2, 0), 3410432);
  CHECK_EQ(live_at(t, "optimizer: gradients cast to fp32", "optimizer", 2, 0), 3410432);
  /* replayed without offloading, with SGD (AdamW's transients put tiny's
   * peak at its optimizer step), the step peaks at log_softmax's backward:
   * every forward pack (F) but what nll_loss alone saved, released after
   * its backward ran (the labels 8T and total_weight 4 B), nll_loss's and
   * log_softmax's fp32 gradients (2 x 4TV, T = 256, V = 1024) and the
   * head's unit alone gathered (block 1 comes at lm_head's backward), no
   * weight gradient yet */
  sim_trace_free(t);
  t = NULL;
  m.optimizer = SYNTH_OPT_SGD;
  CHECK_OK(trace_of(&m, &t));
  sim_config c = {0};
  c.link = sim_hw_preset("h100")->link;
  c.steps = 2;
  sim_result r2;
  char err[512];
  CHECK_OK(sim_replay(t, &c, &r2, err, sizeof err));
  const uint64_t F = pack_bytes(t, -2, FERRY_PHASE_FORWARD);
  CHECK_EQ(r2.peak_device_bytes,
           t->resident_bytes + F - (8 * 256 + 4) + 2 * 4 * 256 * 1024 + head);
  CHECK_EQ(r2.peak_phase, SIM_PEAK_BACKWARD);
  CHECK_EQ(r2.peak_layer, -1);
  CHECK(!strcmp(r2.peak_op, "loss.log_softmax"));
  CHECK(!strcmp(r2.peak_what, "loss: grad of the fp32 logits (log_softmax backward)"));
  sim_result_free(&r2);
  sim_trace_free(t);
  return 0;
}

/* Where the peak falls: a hand-made step whose device bytes peak in
 * backward at an alloc before layer 3's op "mlp.down_proj" (1000 saved +
 * 400 + 900 = 2300 B, above forward's 1000 + 400 and the optimizer's 1500),
 * named in the result and the JSON report; a "transient" resident line
 * (bytes the step's allocs hold) is not resident. */
TEST(sim_report_says_where_the_peak_falls) {
  static const char text[] =
      T_HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":5000,\"what\":\"parameters\"}\n"
      "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":7000,\"what\":\"gradients\",\"transient\":true}\n"
      T_BEGIN(1) "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":1000,\"dtype\":\"u8\","
      "\"shape\":[1000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":3,\"layers\":4,"
      "\"decision\":\"keep\"}\n"
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":2,\"bytes\":400,\"what\":\"fwd tmp\"}\n" T_WORK(10)
      "{\"ev\":\"free\",\"t_us\":0,\"id\":2}\n" T_EV("backward_begin")
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":3,\"bytes\":400,\"what\":\"grad a\"}\n"
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":4,\"bytes\":900,\"what\":\"grad b\"}\n"
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10,\"layer\":3,\"op\":\"mlp.down_proj\"}\n" T_UNPACK(1)
      "{\"ev\":\"free\",\"t_us\":0,\"id\":4}\n" T_WORK(10) T_EV("backward_end")
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":5,\"bytes\":1100,\"what\":\"opt tmp\"}\n"
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10,\"layer\":-1,\"op\":\"optimizer\"}\n"
      "{\"ev\":\"free\",\"t_us\":0,\"id\":5}\n{\"ev\":\"free\",\"t_us\":0,\"id\":3}\n" T_END(1);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("peak", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->resident_bytes, 5000);
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = 2;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.peak_device_bytes, 5000 + 2300);
  CHECK_EQ(r.peak_phase, SIM_PEAK_BACKWARD);
  CHECK_EQ(r.peak_layer, 3);
  CHECK(!strcmp(r.peak_op, "mlp.down_proj"));
  CHECK(!strcmp(r.peak_what, "grad b"));
  char path[] = "/tmp/ferry_peak_XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  sim_run_info info = {0};
  info.trace = t;
  info.trace_path = "peak";
  info.hw = sim_hw_preset("h100");
  CHECK_OK(sim_write_json(path, &info, &r, 1, err, sizeof err));
  FILE *f = fopen(path, "rb");
  CHECK(f);
  char buf[8192];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  buf[n] = 0;
  CHECK_STR_CONTAINS(buf, "\"peak_at\"");
  CHECK_STR_CONTAINS(buf, "\"phase\":\t\"backward\"");
  CHECK_STR_CONTAINS(buf, "\"what\":\t\"grad b\"");
  sim_result_free(&r);
  sim_trace_free(t);
  static const char bad[] = T_HDR
      "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":7,\"what\":\"gradients\",\"transient\":1}\n";
  CHECK_EQ(sim_trace_parse("bad", bad, strlen(bad), &t, err, sizeof err) != 0, 1);
  CHECK_STR_CONTAINS(err, "\"transient\" must be true or false");
  return 0;
}

/* Sharded with fp32 gradients (torchtitan's MixedPrecisionPolicy: fp32
 * parameters, bf16 compute, fp32 reduce): autograd writes the unsharded
 * gradients of the bf16 gathered parameters in bf16, and the shard after
 * the reduce-scatter is fp32. Tiny, 2 layers, shard 2: down_proj's
 * 512 x 256 weight gradient 262144 B (not 524288), the kept shards
 * (head + 2 blocks + embedding) x 4 B / 2 at the optimizer step. */
TEST(sim_synth_fsdp_unsharded_gradients_in_the_compute_dtype) {
  synth_model m;
  tiny(&m);
  m.shard = 2;
  m.param_dtype = FERRY_DTYPE_F32;
  m.grad_dtype = FERRY_DTYPE_F32;
  m.master_weights = SYNTH_MASTER_OFF;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(live_at(t, "gradient: weights (unsharded)", "mlp.down_proj", 1, 1), 262144);
  const uint64_t params = (1180672 * 2 + 524800 + 524288) / 2; /* elements */
  CHECK_EQ(live_at(t, "gradient: weights (sharded)", "optimizer", 2, 0), params * 4 / 2);
  sim_trace_free(t);
  return 0;
}

/* A peak raised by a forward pack is named after the op that saved it: the
 * synthesizer writes an op's packs after its compute event, so the compute
 * after the pack is the next op's (here layer 1's down_proj, which saves
 * nothing), and the pack's own layer 0 is the peak's. */
TEST(sim_peak_at_a_forward_pack_names_the_op_that_saved_it) {
  static const char text[] =
      T_HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"parameters\"}\n" T_BEGIN(1)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10,\"layer\":0,\"op\":\"mlp.up_proj\"}\n"
      "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":5000,\"dtype\":\"u8\","
      "\"shape\":[5000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":2,"
      "\"module\":\"model.layers.0.mlp.up_proj\",\"decision\":\"keep\"}\n"
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10,\"layer\":1,\"op\":\"mlp.down_proj\"}\n"
      T_EV("backward_begin")
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10,\"layer\":1,\"op\":\"mlp.down_proj\"}\n" T_UNPACK(1)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":20,\"layer\":0,\"op\":\"mlp.up_proj\"}\n"
      T_EV("backward_end") T_END(1);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("pack_peak", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = 2;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.peak_device_bytes, 1000 + 5000);
  CHECK_EQ(r.peak_phase, SIM_PEAK_FORWARD);
  CHECK_EQ(r.peak_layer, 0);
  CHECK(!strcmp(r.peak_op, "mlp.up_proj"));
  CHECK(!strcmp(r.peak_what, "model.layers.0.mlp.up_proj"));
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* Issue 34 item 4: --cp 4 (ring attention) on tiny at seq 1024 against cp 1
 * at seq 1024, by hand: each rank holds 1024 / 4 = 256 tokens, so every
 * forward pack of the blocks, the embedding and the loss is a quarter (the
 * same as cp 1 at seq 256, all shapes in tokens, but nll_loss's 4-byte
 * total_weight); the attention's FLOPs are
 * this rank's queries over all keys, causal: 2 x 256 x 1024 x qd (qd 256)
 * = 134217728 per layer, the total at seq 1024 (2 x 1024² x 256) / 4; and
 * around each attention compute (forward and backward: 2 a layer) the K/V
 * receive buffers, K and V of one 256-token chunk double-buffered: 2 x 2 x
 * 256 x kvd (128) x 2 B = 262144 B. */
TEST(sim_synth_cp_quarters_activations_and_keeps_attention_flops) {
  synth_model m;
  tiny(&m);
  m.seq = 1024;
  sim_trace *full = NULL, *cp = NULL, *short_seq = NULL;
  CHECK_OK(trace_of(&m, &full));
  m.cp = 4;
  CHECK_OK(trace_of(&m, &cp));
  m.cp = 1, m.seq = 256;
  CHECK_OK(trace_of(&m, &short_seq));
  const uint64_t act_full = pack_bytes(full, -2, FERRY_PHASE_FORWARD);
  const uint64_t act_cp = pack_bytes(cp, -2, FERRY_PHASE_FORWARD);
  CHECK(act_full > 0);
  /* all of it per token but nll_loss's total_weight, one fp32 scalar */
  CHECK_EQ((act_cp - 4) * 4, act_full - 4);
  CHECK_EQ(act_cp, pack_bytes(short_seq, -2, FERRY_PHASE_FORWARD));
  double attn_cp = 0, attn_full = 0;
  int n_fwd = 0;
  for (int pass = 0; pass < 2; pass++) {
    const sim_trace *t = pass ? cp : full;
    for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++) {
      const trace_ev *ev = &t->events[k];
      if (ev->type == TEV_BACKWARD_BEGIN) break;
      if (ev->type == TEV_COMPUTE && ev->op && !strcmp(ev->op, "self_attn.attention")) {
        if (pass) attn_cp += ev->flops, n_fwd++;
        else attn_full += ev->flops;
      }
    }
  }
  CHECK_EQ(n_fwd, 2);
  CHECK_NEAR(attn_cp, 2 * 134217728.0, 0.5);
  CHECK_NEAR(attn_cp * 4, attn_full, 0.5);
  int n = 0;
  CHECK_EQ(alloc_bytes(cp, "ring attention: K/V receive buffers", &n), (uint64_t)(2 * 2) * 262144);
  CHECK_EQ(n, 4);
  CHECK_EQ(alloc_bytes(full, "ring attention: K/V receive buffers", &n), 0);
  CHECK_EQ(live_at(cp, "ring attention", "self_attn.attention", 0, 0), 262144);
  CHECK_EQ(live_at(cp, "ring attention", "self_attn.attention", 1, 0), 262144);
  CHECK_EQ(live_at(cp, "ring attention", "self_attn.o_proj", 0, 0), 0);
  sim_trace_free(full);
  sim_trace_free(cp);
  sim_trace_free(short_seq);
  char err[256];
  tiny(&m);
  m.cp = 3; /* 2 x 3 does not divide 256 */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "2 x cp must divide seq");
  m.cp = 4, m.flash = 0;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs --flash on");
  return 0;
}

/* Issue 34 item 4: policies/checkpointed_inputs.lua offloads only what full
 * checkpointing keeps of a block, its input, and keeps the last block's.
 * Tiny (4 layers, T = 256, h 256, bf16) under --checkpoint full: 3 inputs
 * of 2Th = 131072 B each go per step (393216 B D2H), nothing else; under
 * the reentrant implementation (the recomputed tensors are packs too, kept
 * by R.policy) the same; without checkpointing nothing is a block's own
 * pack, so nothing goes. */
TEST(sim_policy_checkpointed_inputs_offloads_block_inputs_only) {
  char path[1200];
  snprintf(path, sizeof path, "%s", __FILE__);
  char *slash = strrchr(path, '/');
  if (slash) *slash = 0;
  strncat(path, "/../policies/checkpointed_inputs.lua", sizeof path - strlen(path) - 1);
  static const int modes[3][2] = {{SYNTH_CKPT_FULL, SYNTH_CKPT_IMPL_AUTO},
                                  {SYNTH_CKPT_FULL, SYNTH_CKPT_IMPL_REENTRANT},
                                  {SYNTH_CKPT_OFF, SYNTH_CKPT_IMPL_AUTO}};
  for (int i = 0; i < 3; i++) {
    synth_model m;
    synth_preset("tiny", &m);
    m.checkpoint = modes[i][0], m.ckpt_impl = modes[i][1];
    sim_trace *t = NULL;
    CHECK_OK(trace_of(&m, &t));
    sim_config c = {0};
    c.link = sim_hw_preset("h100")->link;
    c.steps = 3;
    c.policy_path = path;
    sim_result r;
    char err[512];
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_EQ(r.policy_errors, 0);
    CHECK_NEAR(r.tensors_offloaded, i < 2 ? 3 : 0, 1e-9);
    CHECK_NEAR(r.bytes_d2h, i < 2 ? 3 * 131072.0 : 0, 1e-6);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

/* The optimizer step's transients ("optimizer: ..." allocs) are the device's
 * step: with --optimizer-fraction F the host steps F of it, so the device
 * allocates (1 - F) of them: a 4000 B transient after backward, F = 0.75:
 * 1000 B at the peak (a 100 B pack before it), 4000 without the offload. */
TEST(sim_optimizer_offload_shrinks_the_steps_transients) {
  static const char text[] =
      T_HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"parameters\",\"dtype\":\"bf16\"}\n"
      "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"gradients\",\"transient\":true}\n"
      "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2000,\"what\":\"optimizer states\"}\n"
      T_BEGIN(1) "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100,\"dtype\":\"u8\","
      "\"shape\":[100],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,"
      "\"decision\":\"keep\"}\n" T_WORK(10) T_EV("backward_begin") T_UNPACK(1) T_WORK(10)
      T_EV("backward_end")
      "{\"ev\":\"alloc\",\"t_us\":0,\"id\":2,\"bytes\":4000,\"what\":\"optimizer: foreach sqrt(exp_avg_sq)\"}\n"
      T_WORK(10) "{\"ev\":\"free\",\"t_us\":0,\"id\":2}\n" T_END(1);
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("opt", text, strlen(text), &t, err, sizeof err));
  for (int off = 0; off <= 1; off++) {
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 2;
    c.optimizer_fraction = off ? 0.75 : 0;
    sim_result r;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_EQ(r.peak_saved_bytes, off ? 1000 : 4000);
    sim_result_free(&r);
  }
  sim_trace_free(t);
  return 0;
}
