/* test_sim_options.c — the replay's options: policy quality on Llama-3-8B,
 * the simulated host's RAM, the pinned pool, warmup steps and the first
 * step, and sim_fit's search. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"

/* The policy-quality figures of the closing note, pinned on the virtual
 * clock (deterministic): on the Llama-3-8B-like trace at seq 8192 on h100,
 * budget.lua reaches at least default.lua's peak reduction with well under
 * half its exposed stall. (The 1/5 is below what the link allows
 * here: docs/sim-validation.md, "Policy quality".) */
TEST(sim_budget_beats_default_on_llama3_8b) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  CHECK_EQ(m.seq, 8192);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  CHECK(hw);
  static const char *const names[] = {"default", "budget"};
  sim_result rs[2];
  char err[512];
  for (int i = 0; i < 2; i++) {
    sim_config c = {0};
    c.link = hw->link;
    c.duplex_d2h = hw->duplex_d2h;
    c.duplex_h2d = hw->duplex_h2d;
    c.steps = 3;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.lua", policy_dir(), names[i]);
    c.policy_path = path;
    int rc = sim_replay(t, &c, &rs[i], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_EQ(rs[i].policy_errors, 0);
  }
  /* exposed stall = reload waits of the compute stream + host waits */
  double stall[2];
  for (int i = 0; i < 2; i++) stall[i] = rs[i].stall_us + rs[i].host_wait_us;
  printf("  default: peak %.2f GiB, stall %.1f ms; budget: peak %.2f GiB, stall %.1f ms\n",
         rs[0].peak_device_bytes / 1073741824.0, stall[0] / 1e3,
         rs[1].peak_device_bytes / 1073741824.0, stall[1] / 1e3);
  CHECK(rs[1].peak_device_bytes <= rs[0].peak_device_bytes);
  CHECK(stall[1] < 0.5 * stall[0]);
  /* the link-bound floor: the forward copies 40 GiB at 55 GB/s against a
   * 0.4 s forward pass, so it is hundreds of ms, and below both stalls */
  for (int i = 0; i < 2; i++) {
    CHECK(rs[i].stall_floor_us > 1e5);
    CHECK(stall[i] >= rs[i].stall_floor_us);
  }
  for (int i = 0; i < 2; i++) sim_result_free(&rs[i]);
  sim_trace_free(t);
  return 0;
}

/* Replays the tiny synthesized model on h100 under c (link filled in). */
static int replay_tiny(sim_config *c, sim_result *out) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *t = NULL;
  if (synth_to_trace(&m, &t)) return -1;
  const sim_hw *hw = sim_hw_preset("h100");
  c->link = hw->link;
  char err[512];
  int rc = sim_replay(t, c, out, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  sim_trace_free(t);
  return rc;
}

/* Host RAM in a simulation is the simulated host's (host_ram_bytes), read
 * through the engine's host_ram callback: a policy that offloads only while
 * host RAM is under 50% in use sees 0% on a big host and 100% on one smaller
 * than what the arena pinned in step 1 — whatever the machine running it. */
TEST(sim_host_ram_is_the_simulated_hosts) {
  static const char src[] =
      "return { api = 1, decide = function(t, ctx)\n"
      "  if t.bytes >= 1024 and t.kind == ferry.ACTIVATION and ctx.host_ram_used_pct < 50 then\n"
      "    return ferry.OFFLOAD end\n"
      "  return ferry.KEEP end }\n";
  sim_result big, small, again;
  sim_config c = {0};
  c.steps = 3;
  c.policy_source = src;
  c.host_ram_bytes = 1ull << 40;
  CHECK_OK(replay_tiny(&c, &big));
  CHECK_OK(replay_tiny(&c, &again));
  c.host_ram_bytes = 1 << 20;
  CHECK_OK(replay_tiny(&c, &small));
  CHECK_EQ(big.host_ram_bytes, 1ull << 40);
  CHECK_EQ(small.host_ram_bytes, 1 << 20);
  CHECK(big.bytes_d2h > 0);
  CHECK_EQ(small.bytes_d2h, 0); /* steps 2..3: the 1 MiB host is full */
  CHECK_EQ(big.bytes_d2h, again.bytes_d2h);
  CHECK_EQ(big.peak_device_bytes, again.peak_device_bytes);
  /* no size given: the documented default, not /proc/meminfo */
  c.host_ram_bytes = 0;
  sim_result_free(&again);
  CHECK_OK(replay_tiny(&c, &again));
  CHECK_EQ(again.host_ram_bytes, SIM_DEFAULT_HOST_RAM);
  CHECK_EQ(again.bytes_d2h, big.bytes_d2h);
  sim_result_free(&big);
  sim_result_free(&small);
  sim_result_free(&again);
  return 0;
}

/* Pinned allocation cost: with the pool (the engine's arena) step 1 pays
 * for the arena's growth (allocation + first touch) and steady steps pay
 * nothing; without one every offload pays an allocation, every step. */
TEST(sim_pinned_pool_vs_no_pool) {
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result free_, pool, nopool;
  sim_config c = {0};
  c.steps = 3;
  c.policy_path = path;
  CHECK_OK(replay_tiny(&c, &free_));
  c.pinned_alloc_us = 3000;
  c.pinned_touch_bytes_per_s = 2.5e9;
  CHECK_OK(replay_tiny(&c, &pool));
  c.pinned_no_pool = 1;
  CHECK_OK(replay_tiny(&c, &nopool));
  CHECK_EQ(free_.pinned_alloc_us, 0);
  CHECK_EQ(pool.pinned_alloc_us, 0);            /* steady steps reuse the pool */
  CHECK(pool.first_step_us >= free_.first_step_us + 3000); /* step 1 grew it */
  CHECK_NEAR(pool.step_us, free_.step_us, 1e-6 * free_.step_us);
  CHECK(pool.bytes_d2h > 0);
  double want = nopool.tensors_offloaded * 3000; /* per call; first touch is the pool's */
  CHECK_NEAR(nopool.pinned_alloc_us, want, 1e-6 * want);
  CHECK(nopool.step_us >= free_.step_us + 0.5 * want);
  sim_result_free(&free_);
  sim_result_free(&pool);
  sim_result_free(&nopool);
  return 0;
}

/* --warmup: the steady figures leave out the warmup steps, the first step
 * is reported alone, and the peak is the steady steps'. */
TEST(sim_warmup_steps_and_first_step) {
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result w1, w3, none;
  sim_config c = {0};
  c.steps = 4;
  c.policy_path = path;
  c.pinned_alloc_us = 3000; /* makes step 1 distinctly slower */
  CHECK_OK(replay_tiny(&c, &w1));
  c.warmup = 3;
  CHECK_OK(replay_tiny(&c, &w3));
  c.warmup = -1;
  CHECK_OK(replay_tiny(&c, &none));
  CHECK_EQ(w1.warmup, 1);
  CHECK_EQ(w3.warmup, 3);
  CHECK_EQ(none.warmup, 0);
  CHECK_NEAR(w1.step_us, w3.step_us, 1e-6 * w1.step_us);
  CHECK(w1.first_step_us > w1.step_us + 3000);
  /* with no warmup step 1 is in the mean */
  CHECK_NEAR(none.step_us, (w1.first_step_us + 3 * w1.step_us) / 4, 1e-6 * w1.step_us);
  CHECK(w1.first_step_peak_device_bytes > 0);
  CHECK(none.peak_device_bytes >= w1.peak_device_bytes);
  CHECK(none.peak_device_bytes >= w1.first_step_peak_device_bytes);
  sim_result_free(&w1);
  sim_result_free(&w3);
  sim_result_free(&none);
  return 0;
}

/* sim_fit on the tiny model: the chosen setting fits (checked again by
 * replaying the policy it writes), and no setting in the search space with
 * a lower step time fits. */
TEST(sim_fit_picks_the_cheapest_setting_that_fits) {
  synth_model m;
  synth_preset("tiny", &m);
  m.optimizer = SYNTH_OPT_SGD; /* the peak where policies act (as above) */
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  char path[1200];
  snprintf(path, sizeof path, "%s/host_budget.lua", policy_dir());
  FILE *f = fopen(path, "rb");
  CHECK(f);
  static char tmpl[16384];
  size_t n = fread(tmpl, 1, sizeof tmpl - 1, f);
  fclose(f);
  tmpl[n] = 0;
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config base = {0};
  base.link = hw->link;
  base.steps = 4;
  base.warmup = 2;
  sim_result none;
  char err[512];
  CHECK_OK(sim_replay(t, &base, &none, err, sizeof err));
  /* a device 5% smaller than the no-offload peak: offloading is needed */
  sim_fit_config fc = {0};
  fc.policy_template = tmpl;
  fc.replay = base;
  fc.device_bytes = none.peak_device_bytes - none.peak_device_bytes / 20;
  fc.host_bytes = 64u << 20;
  sim_fit_result fr;
  int rc = sim_fit(t, &fc, &fr, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK(fr.n > 100);
  CHECK(fr.best >= 0);
  const sim_fit_setting *b = &fr.settings[fr.best];
  CHECK(b->fits && b->host_bytes > 0);
  CHECK(b->peak_device_bytes <= fc.device_bytes && b->host_reserved_bytes <= fc.host_bytes);
  int fitting = 0;
  for (uint32_t i = 0; i < fr.n; i++) {
    const sim_fit_setting *s = &fr.settings[i];
    fitting += s->fits;
    if (s->step_us < b->step_us) CHECK(!s->fits);
    CHECK_EQ(s->fits, s->peak_device_bytes <= fc.device_bytes &&
                          s->host_reserved_bytes <= fc.host_bytes);
  }
  CHECK(fitting > 1 && fitting < (int)fr.n); /* the target separates the grid */
  /* the written policy replays to the same figures */
  char *src = sim_fit_source(tmpl, b);
  CHECK(src);
  sim_config c = base;
  c.policy_source = src;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.peak_device_bytes, b->peak_device_bytes);
  CHECK_NEAR(r.step_us, b->step_us, 1e-9 * b->step_us);
  /* a device smaller than anything reachable: nothing fits */
  fc.device_bytes = t->resident_bytes;
  sim_fit_result none_fits;
  CHECK_OK(sim_fit(t, &fc, &none_fits, err, sizeof err));
  CHECK_EQ(none_fits.best, -1);
  free(src);
  sim_result_free(&r);
  sim_result_free(&none);
  sim_fit_result_free(&fr);
  sim_fit_result_free(&none_fits);
  sim_trace_free(t);
  return 0;
}
