/*
 * bench_sim.c — the simulator's speed and budget.lua's stall against the
 * link-bound floor.
 *
 * Speed: a synthesized 32-layer (Llama-3-8B shape), 100-step trace, written
 * to a file, read from it as `ferry sim --trace` does (sim_trace_load) and
 * replayed through the real engine with default.lua on the h100 link.
 * sim_events_per_s counts trace events (packs, unpacks, compute, step and
 * backward marks) per second of wall time from the file to the result:
 * reading, parsing and replay (engine, policy host, sim backend) together;
 * each is also reported alone, and parsing the same text from memory.
 *
 * Floor: the run of docs/sim-validation.md's "Policy quality" (the same preset,
 * one step replayed 3 times, h100 with `ferry sim`'s default GPU speed:
 * peak x MFU 0.40 and 0.60 of its HBM): budget.lua's exposed stall (reload waits + host
 * waits per steady step) / the floor the simulator reports for the bytes it
 * moved (sim_result.stall_floor_us), beside both policies' peaks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

#include "bench.h"
#include "ferry_tools.h"


static void policy_path(const char *name, char *out, size_t n) {
  snprintf(out, n, "%s", __FILE__);
  char *slash = strrchr(out, '/');
  if (slash) *slash = 0;
  snprintf(out + strlen(out), n - strlen(out), "/../policies/%s.lua", name);
}

/* The preset's JSONL text (malloc'd), written as `ferry trace synth` would. */
static char *synth_text(const synth_model *m, size_t *len) {
  char *buf = NULL, err[256];
  FILE *f = open_memstream(&buf, len);
  if (!f) return NULL;
  int rc = synth_write(m, f, err, sizeof err);
  fclose(f);
  if (rc) {
    fprintf(stderr, "bench_sim: %s\n", err);
    free(buf);
    return NULL;
  }
  return buf;
}

/* stall_vs_floor on the Llama-3-8B-like trace, h100 as `ferry sim --hw h100` sets it. */
static void bench_floor(bench_report *r) {
  synth_model m;
  synth_preset("llama3-8b", &m);
  sim_trace *t = NULL;
  char err[512], path[1200];
  size_t len = 0;
  char *text = synth_text(&m, &len);
  snprintf(err, sizeof err, "no text");
  int rc = text ? sim_trace_parse("llama3-8b", text, len, &t, err, sizeof err) : -1;
  free(text);
  if (rc) {
    fprintf(stderr, "bench_sim: cannot synthesize the llama3-8b trace: %s\n", err);
    return;
  }
  const sim_hw *hw = sim_hw_preset("h100");
  static const char *const names[2] = {"default", "budget"};
  sim_result res[2];
  for (int i = 0; i < 2; i++) {
    sim_config c = {0};
    c.link = hw->link;
    c.duplex_d2h = hw->duplex_d2h;
    c.duplex_h2d = hw->duplex_h2d;
    c.tflops = hw->peak_tflops * SIM_DEFAULT_MFU;
    c.hbm_bytes_per_s = hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION;
    c.steps = 3;
    policy_path(names[i], path, sizeof path);
    c.policy_path = path;
    if (sim_replay(t, &c, &res[i], err, sizeof err)) {
      fprintf(stderr, "bench_sim: %s\n", err);
      if (i) sim_result_free(&res[0]);
      sim_trace_free(t);
      return;
    }
  }
  double stall = res[1].stall_us + res[1].host_wait_us;
  char note[160];
  snprintf(note, sizeof note, "budget.lua %.1f ms / floor %.1f ms, llama3-8b trace, h100; target <= 1.1",
           stall / 1e3, res[1].stall_floor_us / 1e3);
  bench_metric(r, "stall_vs_floor", stall / res[1].stall_floor_us, "x", note);
  bench_metric(r, "stall_vs_floor_default",
               (res[0].stall_us + res[0].host_wait_us) / res[0].stall_floor_us, "x",
               "default.lua's stall / its floor, the same run");
  bench_metric(r, "stall_budget_peak_vs_default",
               (double)res[1].peak_device_bytes / (double)res[0].peak_device_bytes, "x",
               "budget.lua's peak / default.lua's (<= 1: at least its memory reduction)");
  for (int i = 0; i < 2; i++) sim_result_free(&res[i]);
  sim_trace_free(t);
}

/* The preset's trace of `steps` steps written to a temporary file (its path
 * in path); 0, or -1 with the reason printed. */
static int synth_file(int steps, char *path, size_t n) {
  synth_model m;
  synth_preset("llama3-8b", &m);
  m.steps = steps;
  size_t len = 0;
  char *buf = synth_text(&m, &len);
  if (!buf) return -1;
  const char *tmp = getenv("TMPDIR");
  snprintf(path, n, "%s/ferry-bench-sim-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  int fd = mkstemp(path);
  int wrote = fd >= 0 && write(fd, buf, len) == (ssize_t)len;
  if (fd >= 0) close(fd);
  free(buf);
  if (!wrote) {
    fprintf(stderr, "bench_sim: cannot write the trace to %s\n", path);
    if (fd >= 0) unlink(path);
    return -1;
  }
  return 0;
}

/* Trace events per step of the preset (the difference of two lengths, so
 * the lines before the first step do not count). */
double bench_sim_events_per_step(void) {
  uint32_t events[2] = {0, 0};
  for (int k = 0; k < 2; k++) {
    synth_model m;
    synth_preset("llama3-8b", &m);
    m.steps = 1 + k;
    size_t len = 0;
    char *buf = synth_text(&m, &len), err[256];
    sim_trace *t = NULL;
    if (!buf || sim_trace_parse("llama3-8b", buf, len, &t, err, sizeof err)) {
      free(buf);
      return -1;
    }
    events[k] = t->n_events;
    sim_trace_free(t);
    free(buf);
  }
  return (double)(events[1] - events[0]);
}

/* Instruction-count mode (bench_main's --instr sim:WHICH STEPS, under
 * callgrind): a trace of `steps` steps read from its file (parse: only
 * sim_trace_load is counted), replayed (replay: only sim_replay), or both
 * (whole), as bench_sim times them. */
/* The replay's configuration on h100's link, as `ferry sim --hw h100` sets
 * it (compute and HBM rates left to the caller). */
static sim_config h100_config(const char *policy) {
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config c = {0};
  c.link = hw->link;
  c.duplex_d2h = hw->duplex_d2h;
  c.duplex_h2d = hw->duplex_h2d;
  c.policy_path = policy;
  return c;
}

int bench_sim_instr(const char *which, long steps) {
  char path[1200], err[512], policy[1200];
  int parse = !strcmp(which, "parse"), replay = !strcmp(which, "replay");
  if (!parse && !replay && strcmp(which, "whole")) {
    fprintf(stderr, "bench_sim: --instr sim:parse|replay|whole, not sim:%s\n", which);
    return 1;
  }
  if (synth_file((int)steps, path, sizeof path)) return 1;
  policy_path("default", policy, sizeof policy);
  sim_config c = h100_config(policy);
  sim_trace *t = NULL;
  sim_result res;
  if (!replay) CALLGRIND_TOGGLE_COLLECT;
  int rc = sim_trace_load(path, &t, err, sizeof err);
  if (!replay) CALLGRIND_TOGGLE_COLLECT;
  unlink(path);
  if (!rc) {
    if (!parse) CALLGRIND_TOGGLE_COLLECT;
    rc = sim_replay(t, &c, &res, err, sizeof err);
    if (!parse) CALLGRIND_TOGGLE_COLLECT;
    if (!rc) sim_result_free(&res);
  }
  sim_trace_free(t);
  if (rc) fprintf(stderr, "bench_sim: %s\n", err);
  return rc ? 1 : 0;
}

void bench_sim(bench_report *r) {
  synth_model m;
  synth_preset("llama3-8b", &m);
  m.steps = 100;
  size_t len = 0;
  char err[512];
  char *buf = synth_text(&m, &len);
  if (!buf) return;
  /* the file ferry sim --trace would read (in the page cache, as a trace
   * just written or read before is) */
  const char *tmp = getenv("TMPDIR");
  char path[1200];
  snprintf(path, sizeof path, "%s/ferry-bench-sim-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  int fd = mkstemp(path);
  int wrote = fd >= 0 && write(fd, buf, len) == (ssize_t)len;
  if (fd >= 0) close(fd);
  /* the file first, as a fresh `ferry sim` process meets it */
  double t0 = bench_now_ns();
  sim_trace *t = NULL;
  int rc = wrote ? sim_trace_load(path, &t, err, sizeof err) : -1;
  double parse_s = (bench_now_ns() - t0) / 1e9;
  sim_trace *t_mem = NULL;
  t0 = bench_now_ns();
  if (!rc) rc = sim_trace_parse("llama3-8b x100", buf, len, &t_mem, err, sizeof err);
  double mem_parse_s = (bench_now_ns() - t0) / 1e9;
  free(buf);
  sim_trace_free(t_mem);
  if (fd >= 0) unlink(path);
  if (!wrote) {
    fprintf(stderr, "bench_sim: cannot write the trace to %s\n", path);
    return;
  }
  if (rc) {
    sim_trace_free(t);
    fprintf(stderr, "bench_sim: %s\n", err);
    return;
  }
  char policy[1200];
  policy_path("default", policy, sizeof policy);
  sim_config c = h100_config(policy);
  sim_result res;
  if (sim_replay(t, &c, &res, err, sizeof err)) {
    fprintf(stderr, "bench_sim: %s\n", err);
    sim_trace_free(t);
    return;
  }
  bench_metric(r, "sim_events_per_s", (double)res.events / (parse_s + res.wall_s), "ev/s",
               "32 layers x 100 steps, default.lua, h100, from the file; target >= 2e6");
  bench_metric(r, "sim_replay_events_per_s", (double)res.events / res.wall_s, "ev/s",
               "the replay alone");
  bench_metric(r, "sim_replay_wall_s", res.wall_s, "s", "replay of those 100 steps");
  bench_metric(r, "sim_trace_load_events_per_s", (double)t->n_events / parse_s, "ev/s",
               "reading and parsing the JSONL file (sim_trace_load)");
  bench_metric(r, "sim_trace_parse_events_per_s", (double)t->n_events / mem_parse_s, "ev/s",
               "parsing the same text from memory (sim_trace_parse)");
  sim_result_free(&res);
  c.policy_path = NULL; /* baseline: no policy, no copies */
  if (sim_replay(t, &c, &res, err, sizeof err) == 0) {
    bench_metric(r, "sim_events_per_s_no_offload", (double)res.events / res.wall_s, "ev/s",
                 "the same trace, keeping everything");
    sim_result_free(&res);
  }
  sim_trace_free(t);
  bench_floor(r);
}
