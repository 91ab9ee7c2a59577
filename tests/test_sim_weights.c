/* test_sim_weights.c — weight offload in replays (sim_config.weight_first,
 * weight_count) and the "parameters" line's layer_bytes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"

/* ---- weight offload (sim_config.weight_first, weight_count) ------------------------- */

/* The "parameters" line's optional "layer_bytes" (each repeated block's
 * weights): read, 0 when absent, refused when it is not an integer within
 * the line's bytes; the synthesizer writes a block's linears and norms per
 * GPU (Llama 3 8B under FSDP over 8: (2 x 4096^2 + 2 x 4096 x 1024 + 3 x
 * 4096 x 14336 + 2 x 4096) x 2 bytes / 8 = 54528000). */
TEST(sim_trace_resident_layer_bytes) {
#define RES(extra) "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":5000,\"what\":\"parameters\"" extra "}\n"
  const char *text = HDR RES(",\"dtype\":\"bf16\",\"layer_bytes\":1200") BEGIN END;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("lb", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->n_resident, 1);
  CHECK_EQ(t->resident[0].bytes, 5000);
  CHECK_EQ(t->resident[0].layer_bytes, 1200);
  CHECK_EQ(t->resident[0].dtype, FERRY_DTYPE_BF16);
  sim_trace_free(t);
  text = HDR RES("") BEGIN END;
  CHECK_OK(sim_trace_parse("lb", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->resident[0].layer_bytes, 0);
  sim_trace_free(t);
  BAD(HDR RES(",\"layer_bytes\":5001") BEGIN END, "bad.jsonl:2: \"layer_bytes\" = 5001 is absurd");
  BAD(HDR RES(",\"layer_bytes\":-1") BEGIN END, "bad.jsonl:2: \"layer_bytes\" = -1 is negative");
  BAD(HDR RES(",\"layer_bytes\":1.5") BEGIN END, "\"layer_bytes\" must be an integer");
  BAD(HDR RES(",\"layer_bytes\":\"1\"") BEGIN END, "\"layer_bytes\" must be a number");
#undef RES
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  synth_resident parts;
  synth_resident_parts(&m, &parts);
  CHECK_EQ(parts.layer_params, 54528000);
  m.steps = 1;
  m.seq = 256;
  CHECK_OK(synth_to_trace(&m, &t));
  int found = 0;
  for (uint32_t i = 0; i < t->n_resident; i++) {
    if (strcmp(t->resident[i].what, "parameters")) {
      CHECK_EQ(t->resident[i].layer_bytes, 0);
      continue;
    }
    found = 1;
    CHECK_EQ(t->resident[i].layer_bytes, 54528000);
    CHECK(32 * t->resident[i].layer_bytes < t->resident[i].bytes); /* embeddings and head */
  }
  CHECK(found);
  sim_trace_free(t);
  return 0;
}

/* A step to follow by hand: 4 blocks of 1 MB of weights (the "parameters"
 * line's layer_bytes; 1 MB outside them), each saving a 3 MB activation
 * (kept); forward 2000 us per block, the head 500, its backward 1000,
 * 4000 per block's backward (its unpack first, then its compute), the
 * optimizer 100: 25600 us. */
static const char *w_trace(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s",
                   HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":5000000,\"what\":\"parameters\","
                       "\"dtype\":\"bf16\",\"layer_bytes\":1000000}\n" BEGIN);
  for (int l = 0; l < 4; l++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":2000,\"layer\":%d}\n"
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":3000000,\"dtype\":"
                  "\"u8\",\"shape\":[3000000],\"kind\":\"activation\",\"phase\":\"forward\","
                  "\"layer\":%d,\"layers\":4,\"module\":\"m.layers.%d\",\"decision\":\"keep\"}\n",
                  l, l + 1, l, l);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":500,\"layer\":-1}\n"
                "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":1000,\"layer\":-1}\n");
  for (int l = 3; l >= 0; l--)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n"
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":4000,\"layer\":%d}\n", l + 1, l);
  snprintf(buf + n, sizeof buf - (size_t)n,
           "{\"ev\":\"backward_end\",\"t_us\":0}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":100,\"op\":\"optimizer\"}\n" END);
  return buf;
}

/* 1 GB/s each way, no latency, no duplex slowdown: 1000 us per block's
 * weights, 3000 per activation; 3 steps, 2 and 3 steady. */
static sim_config w_config(int32_t first, int32_t count, int single) {
  sim_config c = hand_config(3);
  c.weight_first = first;
  c.weight_count = count;
  c.weight_single_buffer = single;
  return c;
}

/* Computed by hand (W = 1 MB of weights a block, copies of 1000 us):
 * baseline 25600 us, peak 5 MB resident + 12 MB of activations at the
 * start of backward.
 *  - blocks 0..3, double-buffered. Steady: every block's weights are on
 *    the device from the previous backward; each goes D2H after its
 *    forward (block k: 2000(k+1) .. +1000, freed then). Backward: block 3's
 *    hook at 9500 reloads it (9500..10500, a 1000 us stall) and issues
 *    block 2's behind it (..11500), each next hook issues the one before
 *    it, 4000 us ahead of its use: 26600 us, stall 1000. The peak is at
 *    that hook: 12 MB of activations + blocks 3 and 2 = 14 MB, + 1 MB of
 *    resident = 15 MB: 2 MB below the baseline, the 4 blocks' 4 MB less the
 *    double buffer's 2. Step 1 (every block on the host): block 0's reload
 *    stalls 1000 us, the next ones arrive while the one before computes,
 *    then backward as above: 27600.
 *  - single-buffered: every block's reload is exposed, 4 x 1000: 29600 us;
 *    the peak at block 3's hook is 12 + 1 MB + 1 MB resident = 14 MB (3 MB
 *    below: 4 blocks less 1); step 1 adds forward's 4 reloads: 33600.
 *  - blocks 1..2: the peak is at the start of backward, both off the
 *    device: 12 MB + 3 MB resident, 2 MB (both blocks) below; block 2's
 *    hook (at 13500) stalls 1000 us, double-buffered block 1 arrives
 *    meanwhile: 26600; single-buffered both stall: 27600. Step 1 adds
 *    block 1's forward reload (double) or both (single): 27600, 29600. */
TEST(sim_weight_offload_hand_computed_steps) {
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result base, r;
  sim_config c = w_config(0, 0, 0);
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  CHECK_NEAR(base.step_us, 25600, 1e-6);
  CHECK_EQ(base.peak_device_bytes, 17000000);
  CHECK_EQ(base.w_count, 0);
  static const struct {
    int32_t first, count;
    int single;
    double step, first_step, stall;
    uint64_t drop;
  } cases[] = {
      {0, 4, 0, 26600, 27600, 1000, 2000000},
      {0, 4, 1, 29600, 33600, 4000, 3000000},
      {1, 2, 0, 26600, 27600, 1000, 2000000},
      {1, 2, 1, 27600, 29600, 2000, 2000000},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    c = w_config(cases[i].first, cases[i].count, cases[i].single);
    c.timeline = 1;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    double moved = 1e6 * cases[i].count;
    CHECK_NEAR(r.step_us, cases[i].step, 1e-6);
    CHECK_NEAR(r.first_step_us, cases[i].first_step, 1e-6);
    CHECK_NEAR(r.stall_us + r.host_wait_us, cases[i].stall, 1e-6);
    CHECK_NEAR(r.w_stall_us, cases[i].stall, 1e-6); /* all of it the weights' */
    CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - cases[i].drop);
    CHECK_EQ(r.resident_bytes, 5000000 - (uint64_t)moved);
    CHECK_NEAR(r.bytes_d2h, moved, 0); /* the weights' copies, in the step's bytes */
    CHECK_NEAR(r.bytes_h2d, moved, 0);
    CHECK_NEAR(r.w_bytes_d2h, moved, 0);
    CHECK_NEAR(r.w_bytes_h2d, moved, 0);
    CHECK_EQ(r.w_layer_bytes, 1000000);
    CHECK_EQ(r.w_estimated, 0);
    CHECK_EQ(r.w_double_buffer, !cases[i].single);
    CHECK_EQ(r.w_device_bytes, (uint64_t)moved);
    CHECK(r.peak_host_bytes >= (uint64_t)moved); /* the pinned host copies */
    /* the last step's copies on the timeline, named, one each way a block;
     * the waits drawn add up to the stall, on the blocks' rows */
    int d2h = 0, h2d = 0;
    double waits = 0, rows = 0;
    for (size_t k = 0; k < r.tl.n_iv; k++) {
      const sim_interval *iv = &r.tl.iv[k];
      if (!iv->lane) continue;
      CHECK(iv->module_path && !strcmp(iv->module_path, "weights"));
      CHECK(iv->layer >= cases[i].first && iv->layer < cases[i].first + cases[i].count);
      CHECK_NEAR(iv->t1 - iv->t0, 1000, 1e-6);
      d2h += iv->lane == 1;
      h2d += iv->lane == 2;
    }
    CHECK_EQ(d2h, cases[i].count);
    CHECK_EQ(h2d, cases[i].count);
    for (size_t k = 0; k < r.tl.n_waits; k++) waits += r.tl.waits[k].t1 - r.tl.waits[k].t0;
    for (uint32_t k = 0; k < r.n_layers; k++) rows += r.layers[k].stall_us;
    CHECK_NEAR(waits, cases[i].stall, 1e-6);
    CHECK_NEAR(rows, cases[i].stall, 1e-6);
    sim_result_free(&r);
  }
  /* blocks 0..3 double-buffered, the last step's memory: every block's
   * weights go after its forward copy ends (k: at 2000(k+1) + 1000), so at
   * block 3's pack (8000) only block 3's are on the device with the 12 MB
   * of activations; freeing before the copy ends would show 12 MB there */
  c = w_config(0, 4, 0);
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  uint64_t at_8000 = 0, at_2500 = 0;
  for (size_t k = 0; k < r.tl.n_mem; k++) {
    double dt = r.tl.mem[k].t - r.tl.t_begin;
    if (dt <= 8000 + 1e-6) at_8000 = r.tl.mem[k].bytes;
    if (dt <= 2500 + 1e-6) at_2500 = r.tl.mem[k].bytes;
  }
  CHECK_EQ(at_8000, 1000000 + 12000000 + 1000000);
  CHECK_EQ(at_2500, 1000000 + 3000000 + 4000000); /* block 0's copy still going */
  sim_result_free(&r);
  sim_result_free(&base);
  sim_trace_free(t);
  return 0;
}

/* With activation offload on the same link: a policy offloads block 3's
 * activation (3000 us each way; no forward stash, so its pack waits for
 * the copy), its reload on use. By hand:
 *  - activations alone: the pack waits 3000 us, the reload at block 3's
 *    unpack (12500) 3000: 31600 us;
 *  - with blocks 0..3's weights, double-buffered: block 3's weights leave
 *    after that pack (11000..12000, behind the activation's D2H); at its
 *    backward hook (12500) block 3's reload (..13500, waited for) and
 *    block 2's (..14500) go first on the H2D stream and the activation's
 *    reload queues behind them: 14500..17500, a 4000 us stall; 33600 us,
 *    1000 more than if the streams were apart (the activation's copy would
 *    start at 13500). Bytes: 7 MB each way. Peak: at that reload, 9 MB of
 *    activations + 2 blocks + the 3 MB coming back + 1 MB resident = 15 MB.
 * And with the optimizer offload as well, the peak drops by its share on
 * top, the weights' figures unchanged. */
TEST(sim_weight_offload_composes_with_activations) {
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  if t.layer == 3 then return ferry.OFFLOAD end\n"
      "  return ferry.KEEP end }\n";
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result act, both;
  sim_config c = w_config(0, 0, 0);
  c.policy_source = policy;
  int rc = sim_replay(t, &c, &act, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK_NEAR(act.step_us, 31600, 1e-6);
  CHECK_NEAR(act.stall_us, 3000, 1e-6);
  CHECK_NEAR(act.host_wait_us, 3000, 1e-6);
  CHECK_NEAR(act.bytes_d2h, 3e6, 0);
  c = w_config(0, 4, 0);
  c.policy_source = policy;
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &both, err, sizeof err));
  CHECK_NEAR(both.step_us, 33600, 1e-6);
  CHECK_NEAR(both.stall_us, 5000, 1e-6); /* the reloads': 1000 weights + 4000 activation */
  CHECK_NEAR(both.host_wait_us, 3000, 1e-6);
  CHECK_NEAR(both.w_stall_us, 1000, 1e-6);
  CHECK_NEAR(both.bytes_d2h, 7e6, 0);
  CHECK_NEAR(both.bytes_h2d, 7e6, 0);
  CHECK_NEAR(both.w_bytes_h2d, 4e6, 0);
  CHECK_EQ(both.peak_device_bytes, 15000000);
  /* on the timeline (from the last step's start): the activation's reload
   * starts when block 2's weights arrive, and its offload ends where block
   * 3's weights' begins, each on its stream */
  int seen = 0;
  for (size_t k = 0; k < both.tl.n_iv; k++) {
    const sim_interval *iv = &both.tl.iv[k];
    double t0 = iv->t0 - both.tl.t_begin, t1 = iv->t1 - both.tl.t_begin;
    int weights = iv->module_path && !strcmp(iv->module_path, "weights");
    if (iv->lane == 2 && !weights) {
      CHECK_NEAR(t0, 14500, 1e-6);
      CHECK_NEAR(t1, 17500, 1e-6);
      seen++;
    } else if (iv->lane == 2 && iv->layer == 2) {
      CHECK_NEAR(t0, 13500, 1e-6);
      CHECK_NEAR(t1, 14500, 1e-6);
      seen++;
    } else if (iv->lane == 1 && !weights) {
      CHECK_NEAR(t0, 8000, 1e-6);
      CHECK_NEAR(t1, 11000, 1e-6);
      seen++;
    } else if (iv->lane == 1 && iv->layer == 3) {
      CHECK_NEAR(t0, 11000, 1e-6);
      CHECK_NEAR(t1, 12000, 1e-6);
      seen++;
    }
  }
  CHECK_EQ(seen, 4);
  sim_result_free(&both);
  /* and the optimizer's share on top (a trace with its resident parts) */
  sim_result_free(&act);
  sim_trace_free(t);
  synth_model m;
  synth_preset("tiny", &m);
  CHECK_OK(synth_to_trace(&m, &t));
  uint64_t lb = 0;
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, "parameters")) lb = t->resident[i].layer_bytes;
  CHECK(lb > 0);
  sim_result w_only, w_opt, opt_only;
  c = w_config(0, m.layers, 0);
  c.link = sim_hw_preset("h100")->link;
  CHECK_OK(sim_replay(t, &c, &w_only, err, sizeof err));
  c.optimizer_fraction = 0.5;
  CHECK_OK(sim_replay(t, &c, &w_opt, err, sizeof err));
  c.weight_count = 0;
  CHECK_OK(sim_replay(t, &c, &opt_only, err, sizeof err));
  CHECK_EQ(w_only.w_device_bytes, (uint64_t)m.layers * lb);
  CHECK_EQ(w_opt.resident_bytes, w_only.resident_bytes - w_opt.opt_device_bytes);
  CHECK_EQ(w_opt.resident_bytes, opt_only.resident_bytes - w_opt.w_device_bytes);
  CHECK_NEAR(w_opt.w_bytes_d2h, (double)m.layers * (double)lb, 0);
  CHECK_NEAR(w_opt.w_bytes_h2d, (double)m.layers * (double)lb, 0);
  /* the optimizer's copies are its own, the weights' are not in them */
  CHECK_NEAR(w_opt.opt_bytes_d2h, opt_only.opt_bytes_d2h, 0);
  CHECK_NEAR(w_opt.opt_bytes_h2d, opt_only.opt_bytes_h2d, 0);
  CHECK_NEAR(w_opt.bytes_d2h, (double)m.layers * (double)lb, 0);
  sim_result_free(&w_only);
  sim_result_free(&w_opt);
  sim_result_free(&opt_only);
  sim_trace_free(t);
  return 0;
}

/* text without the "parameters" line's layer_bytes. */
static const char *w_text_without_layer_bytes(const char *text) {
  static char buf[4096];
  static const char cut[] = ",\"layer_bytes\":1000000";
  const char *at = strstr(text, cut);
  if (!at) return NULL;
  snprintf(buf, sizeof buf, "%.*s%s", (int)(at - text), text, at + strlen(cut));
  return buf;
}

/* What weight offload needs and refuses; without "layer_bytes" a block's
 * weights are estimated as the parameters over the layers (said). */
TEST(sim_weight_offload_refusals_and_estimate) {
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result r;
  sim_config c = w_config(2, 3, 0); /* blocks 2..4 of 4 */
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "weight layers 2..4: the trace has 4 repeated block(s)");
  c = w_config(-1, 2, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  c = w_config(0, 2, 0);
  c.host_backend = 1;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EUNSUPPORTED);
  sim_trace_free(t);
  /* no layer_bytes: 5 MB / 4 layers */
  const char *copy = w_text_without_layer_bytes(text);
  CHECK(copy != NULL);
  CHECK_OK(sim_trace_parse("w", copy, strlen(copy), &t, err, sizeof err));
  c = w_config(0, 2, 0);
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.w_estimated, 1);
  CHECK_EQ(r.w_layer_bytes, 1250000);
  CHECK_NEAR(r.w_bytes_d2h, 2500000, 0);
  sim_result_free(&r);
  sim_trace_free(t);
  /* no resident parameters */
  text = six_tensors();
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  c = w_config(0, 1, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "\"parameters\"");
  sim_trace_free(t);
  return 0;
}
