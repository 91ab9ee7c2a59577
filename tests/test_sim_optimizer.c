/* test_sim_optimizer.c — optimizer-state offload in replays
 * (sim_config.optimizer_fraction). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

#include "test.h"
#include "test_sim_trace.h"

/* ---- optimizer-state offload (sim_config.optimizer_fraction) ------------------------ */

/* A step whose times are easy to follow: 2 MB of parameters (1e6 bf16: no
 * parameter packs), 2 MB of gradients, 12 MB of optimizer states; forward
 * is 5 computes of 200 us (a tiny activation per layer of 4, so 5 chunks
 * of a layer's worth), backward 5 of 400 us, the device's optimizer step
 * 100 us. */
static const char *opt_trace(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s",
                   HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2000000,\"what\":\"parameters\"}\n"
                       "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2000000,\"what\":\"gradients\"}\n"
                       "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":12000000,\"what\":"
                       "\"optimizer states\"}\n" BEGIN);
  for (int i = 1; i <= 4; i++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":200}\n"
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":1000,\"dtype\":\"u8\","
                  "\"shape\":[1000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
                  "\"layers\":4,\"decision\":\"keep\"}\n", i, i - 1);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":200}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n");
  for (int i = 4; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":400}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n",
                  i);
  snprintf(buf + n, sizeof buf - (size_t)n,
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":400}\n{\"ev\":\"backward_end\",\"t_us\":0}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":100,\"op\":\"optimizer\"}\n" END);
  return buf;
}

/* The settings of the hand-computed runs: 1 GB/s each way, no latency,
 * 3 steps (2 and 3 steady: each waits for the previous step's parameters). */
static sim_config opt_config(double fraction, double rate, int serial) {
  sim_config c = hand_config(3);
  c.optimizer_fraction = fraction;
  c.cpu_adam_params_per_s = rate;
  c.optimizer_serial = serial;
  return c;
}

/* Fraction 0 is no optimizer offload at all, whatever the other knobs say:
 * every figure equal, on the hand trace and on a synthesized model with a
 * policy offloading activations. */
TEST(sim_optimizer_fraction_zero_is_no_offload) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *traces[2] = {NULL, NULL};
  char err[512];
  const char *text = opt_trace();
  CHECK_OK(sim_trace_parse("opt", text, strlen(text), &traces[0], err, sizeof err));
  CHECK_OK(synth_to_trace(&m, &traces[1]));
  char path[1100];
  snprintf(path, sizeof path, "%s/budget.lua", policy_dir());
  for (int i = 0; i < 2; i++) {
    sim_config plain = opt_config(0, 0, 0), zero = opt_config(0, 1e3, 1);
    plain.link = zero.link = sim_hw_preset("h100")->link;
    plain.policy_path = zero.policy_path = i ? path : NULL;
    sim_result a, b;
    CHECK_OK(sim_replay(traces[i], &plain, &a, err, sizeof err));
    CHECK_OK(sim_replay(traces[i], &zero, &b, err, sizeof err));
    CHECK(a.step_us == b.step_us);
    CHECK(a.stall_us == b.stall_us && a.host_wait_us == b.host_wait_us);
    CHECK(a.bytes_d2h == b.bytes_d2h && a.bytes_h2d == b.bytes_h2d);
    CHECK_EQ(a.peak_device_bytes, b.peak_device_bytes);
    CHECK_EQ(a.resident_bytes, b.resident_bytes);
    CHECK_EQ(a.peak_host_bytes, b.peak_host_bytes);
    CHECK_EQ(b.opt_device_bytes, 0);
    CHECK(b.opt_fraction == 0 && b.opt_stall_us == 0 && b.opt_bytes_d2h == 0);
    CHECK(i == 0 || a.bytes_d2h > 0); /* the policy did offload */
    sim_result_free(&a);
    sim_result_free(&b);
  }
  sim_trace_free(traces[0]);
  sim_trace_free(traces[1]);
  return 0;
}

/* The device's resident memory drops by exactly the share of the optimizer
 * states; the share of gradients and parameters crosses the link each way
 * per step; the host holds the three; the activations' figures are their
 * own (a policy offloading next to it on the synthesized model). */
TEST(sim_optimizer_offload_frees_exactly_the_share) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  uint64_t params = 0, grads = 0, states = 0;
  for (uint32_t i = 0; i < t->n_resident; i++) {
    if (!strcmp(t->resident[i].what, "parameters")) params = t->resident[i].bytes;
    if (!strcmp(t->resident[i].what, "gradients")) grads = t->resident[i].bytes;
    /* the fp32 master weights (4 bytes per parameter) are declared apart
     * from the states (AdamW's 8) and go to the host with them */
    if (!strcmp(t->resident[i].what, "optimizer states") ||
        !strcmp(t->resident[i].what, "master weights"))
      states += t->resident[i].bytes;
  }
  CHECK(params > 0 && grads > 0 && states == params / 2 * 12); /* bf16: 12 bytes per parameter */
  char err[512], path[1100];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result base, r;
  sim_config c = opt_config(0, 0, 0);
  c.link = sim_hw_preset("h100")->link;
  c.policy_path = path;
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  c.optimizer_fraction = 0.3;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  uint64_t freed = (uint64_t)(0.3 * (double)states + 0.5);
  CHECK_EQ(r.opt_device_bytes, freed);
  CHECK_EQ(r.resident_bytes, t->resident_bytes - freed);
  /* tiny peaks at its optimizer step (foreach AdamW's transients), whose
   * device share shrinks to 0.7 of each transient too */
  uint64_t shrunk = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++)
    if (!strncmp(t->allocs[i].what, "optimizer:", 10))
      shrunk += t->allocs[i].bytes - (uint64_t)(0.7 * (double)t->allocs[i].bytes + 0.5);
  CHECK(shrunk > 0);
  CHECK_EQ(base.peak_phase, SIM_PEAK_OPTIMIZER);
  CHECK_EQ(r.peak_phase, SIM_PEAK_OPTIMIZER);
  CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - freed - shrunk);
  CHECK_EQ(r.first_step_peak_device_bytes, base.first_step_peak_device_bytes - freed - shrunk);
  CHECK_NEAR(r.opt_bytes_d2h, (double)(uint64_t)(0.3 * (double)grads + 0.5), 0);
  CHECK_NEAR(r.opt_bytes_h2d, (double)(uint64_t)(0.3 * (double)params + 0.5), 0);
  CHECK_NEAR(r.opt_params, 0.3 * (double)params / 2, 1e-6);
  CHECK_NEAR(r.opt_cpu_us, r.opt_params / SIM_DEFAULT_CPU_ADAM * 1e6, 1e-6);
  CHECK_EQ(r.opt_host_bytes, freed + (uint64_t)(0.3 * (double)grads + 0.5) +
                                 (uint64_t)(0.3 * (double)params + 0.5));
  CHECK(r.peak_host_bytes >= base.peak_host_bytes + r.opt_host_bytes);
  /* the activations' copies are the same tensors, counted apart */
  CHECK(r.bytes_d2h == base.bytes_d2h && r.bytes_h2d == base.bytes_h2d);
  CHECK(r.step_us > base.step_us);
  /* the copies on the timeline, named */
  int g = 0, p = 0;
  for (size_t i = 0; i < r.tl.n_iv; i++) {
    const char *mp = r.tl.iv[i].module_path;
    g += mp && !strcmp(mp, "optimizer: gradients") && r.tl.iv[i].lane == 1;
    p += mp && !strcmp(mp, "optimizer: parameters") && r.tl.iv[i].lane == 2;
  }
  CHECK_EQ(g, m.layers + 1); /* a chunk per layer and one for the rest */
  CHECK_EQ(p, m.layers + 1); /* the previous step's, waited for in this forward */
  sim_result_free(&base);
  sim_result_free(&r);
  /* what it needs and refuses */
  c.optimizer_fraction = 1.5;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "0..1");
  c.optimizer_fraction = 0.5;
  c.host_backend = 1;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EUNSUPPORTED);
  sim_trace_free(t);
  const char *text = six_tensors(); /* no resident memory */
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  c = opt_config(0.5, 0, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "\"parameters\"");
  sim_trace_free(t);
  return 0;
}

/* The step on the hand trace, half the optimizer on the host (5e5
 * parameters; chunks of 200000 bytes: 200 us each way), computed by hand.
 * Baseline 1000 + 2000 + 100 = 3100 us.
 *  - overlapped, the host step (40 us) within the device's (50 us): the
 *    forward waits for the first chunk of parameters (200 us; each next one
 *    arrives as the layer before it computes), step() for the last chunk of
 *    gradients (200 us; the others went while backward computed):
 *    200 + 1000 + 2000 + 200 + 50 = 3450 us, 400 of them exposed;
 *  - serial: the host step before the device's and every parameter before
 *    the step ends: 1000 + 2000 + 200 + 40 + 50 + 1000 = 4290 us;
 *  - overlapped with a slow host (1e6 parameters/s: 500000 us): the host
 *    step is exposed but for the device's 50 us: 200 + 3000 + 200 + 50 +
 *    499950 = 503400 us, 500300 more than the baseline;
 *  - everything on the host (chunks of 400 us each way, host step 80 us, no
 *    device step): the forward waits 400 us for the first chunk, then 200
 *    before each next one (its 400 us copy against 200 us of compute), so
 *    2200 us; backward 2000 plus the last gradients' 400; the host step's
 *    80 us, hidden by nothing: 4680 us, 1680 of them exposed. */
TEST(sim_optimizer_offload_hand_computed_steps) {
  const char *text = opt_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("opt", text, strlen(text), &t, err, sizeof err));
  sim_result base, r;
  sim_config c = opt_config(0, 0, 0);
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  CHECK_NEAR(base.step_us, 3100, 1e-6);
  static const struct {
    double fraction, rate;
    int serial;
    double step, exposed, cpu;
  } cases[] = {
      {0.5, 1.25e10, 0, 3450, 400, 40},
      {0.5, 1.25e10, 1, 4290, 1240, 40},
      {0.5, 1e6, 0, 503400, 500350, 500000},
      {1, 1.25e10, 0, 4680, 1680, 80},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    double f = cases[i].fraction;
    c = opt_config(f, cases[i].rate, cases[i].serial);
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.opt_cpu_us, cases[i].cpu, 1e-6);
    CHECK_NEAR(r.step_us, cases[i].step, 1e-6);
    CHECK_NEAR(r.opt_stall_us, cases[i].exposed, 1e-6);
    CHECK_NEAR(r.stall_us + r.host_wait_us, 0, 1e-6); /* the activations' stall: none */
    CHECK_NEAR(r.opt_bytes_d2h, f * 2e6, 0);
    CHECK_NEAR(r.opt_bytes_h2d, f * 2e6, 0);
    CHECK_EQ(r.opt_device_bytes, (uint64_t)(f * 12e6));
    CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - (uint64_t)(f * 12e6));
    CHECK_EQ(r.opt_serial, cases[i].serial);
    sim_result_free(&r);
  }
  CHECK_NEAR(503400 - base.step_us, 500300, 1e-6);
  sim_result_free(&base);
  sim_trace_free(t);
  return 0;
}
