/* test_sim_replay.c — replays with known answers: hand-computed times, the
 * stall floor at backward's transients, the shipped policies on a
 * synthesized Llama, link presets, the sim against the host backend, the
 * fuzz corpus, and where prefetches start. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include <valgrind/valgrind.h>

#include "test.h"
#include "test_four_offloads.h"
#include "test_sim_trace.h"

/* ---- replays ------------------------------------------------------------------- */

/* The floor at the peak a step with offloading reaches in backward
 * (docs/sim-model.md, "Stall floor"). Four 100000-byte offloads with 50 us
 * of compute after each, a forward stash of one buffer; backward begins
 * with a 300000-byte transient (the loss's gradients) for bwd_us of compute
 * before the unpacks. Link 1000 B/us, no latency. The engine: copies
 * [0,100] .. [300,400]; packs 2..4 wait 50 us each for the copy ahead of
 * them (150 us of host wait), forward ends at 350 with copy 4 in flight, so
 * the peak is 100000 + 300000 at the transient; backward unpacks 4 from
 * the stash and reloads 3, 2 and 1 on use, after the compute (300 us).
 * Any schedule at that peak must have copied D + T - P = 400000 + 300000 -
 * 400000 B (300 us) by the transient, with 200 us of compute since the
 * first offload to hide it: 100 us of stall before it. After it, the three
 * reloads (300 us) have bwd_us of compute to hide behind, and whatever was
 * reloaded before the transient took room that uncopied bytes would
 * otherwise have had: 100 + max(0, 300 - bwd_us). Forward's packs alone
 * (the peak is above D there) say 0, and reloads from backward's start,
 * ignoring the transient, max(0, 300 - bwd_us). */
static const char *loss_at_backward(int bwd_us) {
  static char buf[4096];
  int n = four_offloads_50us_apart(buf, sizeof buf);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"backward_begin\",\"t_us\":0}\n" ALLOC(9, 300000)
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":%d}\n" FREE(9), bwd_us);
  for (int i = 4; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n", i);
  snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_holds_at_backwards_transients) {
  static const struct { int bwd_us; double floor; } cases[] = {{400, 100.0}, {100, 300.0}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    const char *text = loss_at_backward(cases[k].bwd_us);
    sim_trace *t = NULL;
    char err[512];
    CHECK_OK(sim_trace_parse("loss", text, strlen(text), &t, err, sizeof err));
    sim_config c = hand_config(1);
    c.policy_source = "return { api = 1, name = 'stash1', knobs = { max_fwd_stash = 1 },\n"
                      "  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }";
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_EQ(r.peak_saved_bytes, 400000);
    CHECK_NEAR(r.host_wait_us, 150.0, 1e-6);
    CHECK_NEAR(r.stall_us, 300.0, 1e-6);
    CHECK_NEAR(r.bytes_h2d, 300000, 0);
    CHECK_NEAR(r.stall_floor_us, cases[k].floor, 1e-6);
    CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

TEST(sim_replay_matches_hand_computed_times) {
  const char *text = six_tensors();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  /* one step: from the second on, the engine's forward-stash ring still holds
   * the previous step's unpacked slots (reported to the lead), which adds
   * host waits */
  sim_config c = hand_config(1);
  c.replay_decisions = 1;
  c.timeline = 1;
  c.record_decisions = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.host_wait_us, 200.0, 1e-6);
  CHECK_NEAR(r.stall_us, 200.0, 1e-6);
  CHECK_NEAR(r.step_us, 1400.0, 1e-6);
  CHECK_NEAR(r.bytes_d2h, 600000, 0);
  CHECK_NEAR(r.bytes_h2d, 200000, 0);
  CHECK_NEAR(r.stash_hits, 4, 0);
  CHECK_NEAR(r.tensors_offloaded, 6, 0);
  CHECK_EQ(r.n_decisions, 6);
  for (uint32_t i = 0; i < 6; i++) CHECK_EQ(r.decisions[i], 1);
  /* device memory: in forward the stash holds at most 4 + the one being
   * packed (500000); backward's six unpacks have no compute between them, so
   * they are one op's saved tensors, all held until it ran: 600000 */
  CHECK_EQ(r.peak_saved_bytes, 600000);
  /* per layer: the stall belongs to layers 1 and 0 (the reloaded ones) */
  CHECK_NEAR(r.layers[1].stall_us, 100.0, 1e-6);
  CHECK_NEAR(r.layers[2].stall_us, 100.0, 1e-6);
  CHECK_NEAR(r.layers[3].stall_us, 0, 1e-6);
  /* the floor: the sixth pack (no compute since the first offload) finds
   * 600000 B offloaded against the step's 600000 B peak (backward's), so
   * nothing had to be copied by then; backward's first two unpacks (the
   * four later ones were stash hits) need 200000 B (200 us) with no compute
   * to hide them */
  CHECK_NEAR(r.stall_floor_us, 200.0, 1e-6);
  CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
  /* the timeline: 6 D2H and 2 H2D copies, the compute interval */
  int d2h = 0, h2d = 0;
  for (size_t i = 0; i < r.tl.n_iv; i++) d2h += r.tl.iv[i].lane == 1, h2d += r.tl.iv[i].lane == 2;
  CHECK_EQ(d2h, 6);
  CHECK_EQ(h2d, 2);
  CHECK_NEAR(r.tl.t_end - r.tl.t_begin, 1400.0, 1e-6);
  /* the waits on it: the host's for copies 1 and 2 in forward ([0, 200]),
   * the compute stream's for the reloads of 2 and 1 after the compute
   * ([1200, 1400], layers 1 and 0) */
  double copies = 0, reloads = 0, t0 = r.tl.t_begin;
  for (size_t i = 0; i < r.tl.n_waits; i++) {
    const sim_wait *w = &r.tl.waits[i];
    CHECK(w->t1 > w->t0);
    if (w->kind == SIM_WAIT_COPIES) {
      copies += w->t1 - w->t0;
      CHECK(w->t0 >= t0 - 1e-6 && w->t1 <= t0 + 200 + 1e-6);
    } else {
      CHECK_EQ(w->kind, SIM_WAIT_RELOAD);
      reloads += w->t1 - w->t0;
      CHECK(w->t0 >= t0 + 1200 - 1e-6 && w->t1 <= t0 + 1400 + 1e-6);
      CHECK(w->layer == 0 || w->layer == 1);
    }
  }
  CHECK_NEAR(copies, 200.0, 1e-6);
  CHECK_NEAR(reloads, 200.0, 1e-6);
  /* pinned host memory: the largest sample is the arena's peak, and it is
   * back to none by the step's end */
  uint64_t most = 0;
  for (size_t i = 0; i < r.tl.n_host; i++)
    if (r.tl.host[i].bytes > most) most = r.tl.host[i].bytes;
  CHECK(r.tl.n_host >= 2);
  CHECK_EQ(most, r.peak_host_bytes);
  CHECK_EQ(r.tl.host[r.tl.n_host - 1].bytes, 0);
  sim_result_free(&r);

  /* the baseline keeps everything: no copies, no stall, compute only */
  c.replay_decisions = 0;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, 1000.0, 1e-6);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 0, 0);
  CHECK_EQ(r.peak_saved_bytes, 600000);
  CHECK_STR_CONTAINS(r.label, "no offload");
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* The shipped policies on a synthesized Llama: every policy reduces memory
 * against the baseline, results are deterministic, and reports are written. */
TEST(sim_replay_policies_on_synthesized_llama) {
  synth_model m;
  synth_preset("tiny", &m);
  /* SGD: foreach AdamW's transients would put tiny's peak at the optimizer
   * step, which no policy reaches */
  m.optimizer = SYNTH_OPT_SGD;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  CHECK(hw);
  static const char *const names[] = {"default", "layers", "budget"};
  sim_result rs[4];
  char err[512];
  for (int i = 0; i < 4; i++) {
    sim_config c = {0};
    c.link = hw->link;
    c.duplex_d2h = hw->duplex_d2h;
    c.duplex_h2d = hw->duplex_h2d;
    c.steps = 3;
    c.timeline = 1;
    char path[1200];
    if (i) {
      snprintf(path, sizeof path, "%s/%s.lua", policy_dir(), names[i - 1]);
      c.policy_path = path;
    }
    int rc = sim_replay(t, &c, &rs[i], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
  }
  CHECK_EQ(rs[0].bytes_d2h, 0);
  CHECK_EQ(rs[0].peak_device_bytes, t->resident_bytes + rs[0].peak_saved_bytes);
  for (int i = 1; i < 4; i++) {
    CHECK(rs[i].peak_device_bytes < rs[0].peak_device_bytes);
    CHECK(rs[i].bytes_d2h > 0);
    CHECK(rs[i].step_us >= rs[0].step_us);
    CHECK_EQ(rs[i].policy_errors, 0);
    CHECK(rs[i].peak_host_bytes > 0 && rs[i].host_reserved_bytes >= rs[i].peak_host_bytes);
    /* the floor is a lower bound of what the engine's schedule exposes */
    CHECK(rs[i].stall_us + rs[i].host_wait_us >= rs[i].stall_floor_us);
  }
  /* layers.lua offloads only its first layers */
  CHECK(rs[2].layers[1].offloaded_bytes > 0);
  CHECK_EQ(rs[2].layers[m.layers].offloaded_bytes, 0);
  /* deterministic */
  sim_config c = {0};
  c.link = hw->link;
  c.steps = 3;
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  c.policy_path = path;
  c.duplex_d2h = hw->duplex_d2h;
  c.duplex_h2d = hw->duplex_h2d;
  sim_result again;
  CHECK_OK(sim_replay(t, &c, &again, err, sizeof err));
  CHECK_NEAR(again.step_us, rs[1].step_us, 0);
  CHECK_NEAR(again.stall_us, rs[1].stall_us, 0);
  CHECK_EQ(again.peak_device_bytes, rs[1].peak_device_bytes);
  sim_result_free(&again);

  /* reports */
  char dir[] = "/tmp/ferry-sim-test-XXXXXX";
  CHECK(mkdtemp(dir));
  char json[128], chrome[128], svg[128], html[128];
  snprintf(json, sizeof json, "%s/r.json", dir);
  snprintf(chrome, sizeof chrome, "%s/c.json", dir);
  snprintf(svg, sizeof svg, "%s/m.svg", dir);
  snprintf(html, sizeof html, "%s/r.html", dir);
  sim_run_info info = {.trace_path = "tiny.jsonl", .trace = t, .hw = hw};
  CHECK_EQ(sim_write_json(json, &info, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_chrome_trace(chrome, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_svg(svg, &info, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_html(html, &info, rs, 4, err, sizeof err), 0);
  FILE *f = fopen(json, "r");
  CHECK(f);
  char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  static const char *const keys[] = {"\"peak_device_bytes\"", "\"peak_device_bytes_baseline\"",
                                     "\"step_us\"", "\"step_us_baseline\"", "\"stall_us\"",
                                     "\"bytes_d2h\"", "\"bytes_h2d\"", "\"peak_host_bytes\"",
                                     "\"policy_errors\"", "\"policies\"", "\"layers\""};
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) CHECK_STR_CONTAINS(text, keys[k]);
  f = fopen(chrome, "r");
  CHECK(f);
  n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(text, "\"traceEvents\"");
  CHECK_STR_CONTAINS(text, "\"D2H copies\"");
  CHECK_STR_CONTAINS(text, "\"H2D copies\"");
  CHECK_STR_CONTAINS(text, "\"device memory\"");
  CHECK_STR_CONTAINS(text, "\"offload -> reload\""); /* flow arrows */
  /* the SVG and the HTML whole (tests/cli/test_sim_plots.py checks them
   * through the CLI) */
  static char big[1 << 20];
  f = fopen(svg, "r");
  CHECK(f);
  n = fread(big, 1, sizeof big - 1, f);
  CHECK(n < sizeof big - 1);
  big[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(big, "<svg");
  CHECK_STR_CONTAINS(big, "device memory in use (MiB)"); /* the tiny model's scale */
  CHECK_STR_CONTAINS(big, "pinned host memory in use (MiB)"); /* the right axis */
  CHECK_STR_CONTAINS(big, "time since the step's start (ms)");
  CHECK_STR_CONTAINS(big, ">backward starts"); /* the forward/backward boundary */
  CHECK_STR_CONTAINS(big, "class=\"backward\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"device-curve\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"host-curve\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"stall reload\" data-run=\"default\"");
  CHECK_STR_CONTAINS(big, "class=\"peak device\" data-run=\"no offload\"");
  f = fopen(html, "r");
  CHECK(f);
  n = fread(big, 1, sizeof big - 1, f);
  CHECK(n < sizeof big - 1);
  big[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(big, "<!DOCTYPE html>");
  CHECK_STR_CONTAINS(big, "<tr data-run=\"layers\">");
  CHECK_STR_CONTAINS(big, "<svg width=");
  CHECK(!strstr(big, "http://") && !strstr(big, "https://"));
  unlink(json);
  unlink(chrome);
  unlink(svg);
  unlink(html);
  rmdir(dir);
  for (int i = 0; i < 4; i++) sim_result_free(&rs[i]);
  sim_trace_free(t);
  return 0;
}

TEST(sim_link_presets_and_syntax) {
  const sim_hw *h = sim_hw_preset("h100");
  CHECK(h && sim_hw_preset("H200") && sim_hw_preset("a100") && sim_hw_preset("gh200"));
  CHECK(!sim_hw_preset("tpu"));
  CHECK_NEAR(h->link.h2d_bytes_per_s, 55e9, 0);
  sim_hw x = *h;
  char err[256];
  CHECK_EQ(sim_parse_link("h2d=12.5GB/s,d2h=800MB/s,latency=2ms,duplex=0.5", &x, err, sizeof err), 0);
  CHECK_NEAR(x.link.h2d_bytes_per_s, 12.5e9, 1);
  CHECK_NEAR(x.link.d2h_bytes_per_s, 800e6, 1);
  CHECK_NEAR(x.link.latency_us, 2000, 1e-9);
  CHECK_NEAR(x.duplex_h2d, 0.5, 0);
  CHECK_EQ(sim_parse_link("h2d=fast", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link h2d fast: not a number; expected a bandwidth");
  CHECK_EQ(sim_parse_link("duplex=1.5", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link duplex 1.5: must be above 0 and at most 1");
  /* the shared parser's bounds: no absurd links, no bare numbers */
  CHECK_EQ(sim_parse_link("h2d=1e-300GB/s", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link h2d 1e-300GB/s: must be between 0.001 GB/s and 1e+05 GB/s");
  CHECK_EQ(sim_parse_link("d2h=55", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link d2h 55: needs a unit; expected a bandwidth");
  CHECK_EQ(sim_parse_link("latency=2s", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link latency 2s: must be between 0 us and 1 s");
  CHECK_EQ(sim_parse_link("duplex=nan", &x, err, sizeof err), -1);
  CHECK_EQ(sim_parse_link("warp=9", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "unknown key \"warp\"");
  return 0;
}

/* The same trace and policy through the host backend (real threads, real
 * bytes, the link throttled to the h100 figures slowed down SCALE times, and
 * compute slowed down as much) and through the sim: identical decisions and
 * bytes moved; step time within 30% and stall within 20% of the step time.
 * The host backend runs real threads, which the sim does not model: their
 * wake-ups, the engine's CPU time per call and, on a loaded machine,
 * preemption. Measured on 2 cores at load average 5.5: step +3..25%, stall
 * +3..17% of the step; idle: step +5%, stall +2%. */
TEST(sim_consistent_with_host_backend) {
  /* The host side runs on wall-clock time: under a sanitizer or valgrind
   * its threads run several times slower than the link model assumes, so
   * the timing comparison only means something in a plain build. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  printf("skipped: timing comparison is meaningless under a sanitizer\n");
  return 0;
#endif
  if (RUNNING_ON_VALGRIND) {
    printf("skipped: timing comparison is meaningless under valgrind\n");
    return 0;
  }
  const double SCALE = 400;
  synth_model m;
  synth_preset("tiny", &m);
  m.layers = 3;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  char path[1200], err[512];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result r[2];
  for (int host = 0; host < 2; host++) {
    sim_config c = {0};
    c.link = hw->link;
    c.link.duplex = hw->duplex_h2d; /* the host backend has one duplex factor */
    c.steps = 2;
    c.policy_path = path;
    c.record_decisions = 1;
    if (host) {
      c.host_backend = 1;
      c.host_time_scale = SCALE;
      c.link.h2d_bytes_per_s /= SCALE;
      c.link.d2h_bytes_per_s /= SCALE;
      c.link.latency_us *= SCALE;
    }
    int rc = sim_replay(t, &c, &r[host], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
  }
  CHECK_STR_CONTAINS(r[1].backend, "host");
  CHECK_EQ(r[0].n_decisions, r[1].n_decisions);
  CHECK(r[0].n_decisions > 0);
  CHECK_EQ(memcmp(r[0].decisions, r[1].decisions, r[0].n_decisions), 0);
  CHECK_NEAR(r[0].bytes_d2h, r[1].bytes_d2h, 0);
  CHECK_NEAR(r[0].bytes_h2d, r[1].bytes_h2d, 0);
  fprintf(stderr, "sim: step %.1f us stall %.1f us; host: step %.1f us stall %.1f us\n",
          r[0].step_us, r[0].stall_us + r[0].host_wait_us, r[1].step_us,
          r[1].stall_us + r[1].host_wait_us);
  CHECK_NEAR(r[1].step_us, r[0].step_us, 0.30 * r[0].step_us);
  CHECK_NEAR(r[1].stall_us + r[1].host_wait_us, r[0].stall_us + r[0].host_wait_us,
             0.20 * r[0].step_us);
  sim_result_free(&r[0]);
  sim_result_free(&r[1]);
  sim_trace_free(t);
  return 0;
}

/* Hand traces of 100 kB tensors on a zero clock (t_us 0: compute events
 * only), for the prefetch tests below. */
#define PACK100K(id, layer, module, decision)                                              \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","   \
  "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":" #layer       \
  ",\"layers\":1,\"module\":\"" module "\",\"decision\":\"" decision "\"}\n"
#define UNPACK0(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"
#define WORK(us) "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us "}\n"
#define EV0(name) "{\"ev\":\"" name "\",\"t_us\":0}\n"
#define END0 "{\"ev\":\"step_end\",\"t_us\":0,\"step\":1}\n"

/* prefetch_at_backward_begin: with compute between ferry_backward_begin and
 * the first unpack (the loss's backward), the policy's prefetch of the last
 * offloaded tensor starts at backward_begin and hides behind that compute;
 * without it the reload starts at the unpack and is a 100 us stall. */
TEST(sim_prefetch_starts_at_backward_begin) {
  static const char text[] = HDR BEGIN PACK100K(1, 0, "m.l0", "offload") WORK(200)
      EV0("backward_begin") WORK(150) UNPACK0(1) WORK(50) EV0("backward_end") END0;
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, 1 end }\n";
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("bwd", text, strlen(text), &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  sim_config c = hand_config(2); /* 100 us per copy */
  c.policy_source = policy;
  sim_result on_use, early;
  rc = sim_replay(t, &c, &on_use, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  c.prefetch_at_backward_begin = 1;
  CHECK_OK(sim_replay(t, &c, &early, err, sizeof err));
  CHECK_NEAR(on_use.bytes_h2d, 100000, 0);
  CHECK_NEAR(early.bytes_h2d, 100000, 0);
  CHECK_NEAR(on_use.stall_us, 100.0, 1e-6);
  CHECK_NEAR(early.stall_us, 0.0, 1e-6);
  /* 400 us of compute, plus 100 us the pack waits for its copy (stash 0) */
  CHECK_NEAR(on_use.step_us, 600.0, 1e-6);
  CHECK_NEAR(early.step_us, 500.0, 1e-6);
  CHECK(early.prefetches >= 1);
  sim_result_free(&on_use);
  sim_result_free(&early);
  sim_trace_free(t);
  return 0;
}

/* The replay packs as ferry.torch does: a site the policy keeps from its
 * cache (ferry_pack_cached_keep) gets no handle, so its unpack starts no
 * reload. Two offloaded tensors, then a kept one (the loss) whose answer is
 * cacheable; prefetch distance 2, no stash. Step 1 (nothing cached yet)
 * reloads both at the kept tensor's unpack; in step 2 that unpack starts
 * nothing, the first offloaded one is reloaded when unpacked and starts the
 * second's: one prefetch, not two. */
TEST(sim_cached_keep_starts_no_reload) {
  static const char text[] = HDR BEGIN PACK100K(1, 0, "m.a", "offload")
      PACK100K(2, 0, "m.b", "offload") PACK100K(3, -1, "loss", "keep") WORK(200)
      EV0("backward_begin") UNPACK0(3) WORK(50) UNPACK0(2) WORK(50) UNPACK0(1) WORK(50)
      EV0("backward_end") END0;
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  if t:path() == 'loss' then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, 2 end }\n";
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("cached", text, strlen(text), &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  for (int steps = 1; steps <= 2; steps++) {
    sim_config c = hand_config(steps);
    c.warmup = steps - 1; /* the figures of the last step */
    c.policy_source = policy;
    sim_result r;
    rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_NEAR(r.bytes_h2d, 200000, 0);
    CHECK_NEAR(r.prefetches, steps == 1 ? 2 : 1, 0);
    sim_result_free(&r);
  }
  sim_trace_free(t);
  return 0;
}
#undef PACK100K
#undef UNPACK0
#undef WORK
#undef EV0
#undef END0

/* ---- the fuzz corpus, replayed in every run ---------------------------------------- */
#include <dirent.h>

#include "fuzz/fuzz_trace_reader.c"

TEST(sim_fuzz_corpus_replays_clean) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *s = strrchr(dir, '/');
  if (s) *s = 0;
  else snprintf(dir, sizeof dir, ".");
  strncat(dir, "/fuzz/corpus", sizeof dir - strlen(dir) - 1);
  DIR *d = opendir(dir);
  CHECK(d);
  int files = 0;
  for (struct dirent *de; (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *buf = malloc((size_t)n + 1);
    CHECK(buf);
    CHECK_EQ(fread(buf, 1, (size_t)n, f), n);
    fclose(f);
    CHECK_EQ(fuzz_trace_reader_one(buf, (size_t)n), 0); /* aborts on a bad outcome */
    free(buf);
    files++;
  }
  closedir(d);
  CHECK(files >= 10);
  return 0;
}
