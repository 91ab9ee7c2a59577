/*
 * bench_sim.c — the simulator's speed: a synthesized 32-layer (Llama-3-8B
 * shape), 100-step trace, read once and replayed through the real engine
 * with default.lua on the h100 link. sim_events_per_s counts trace events
 * (packs, unpacks, compute, step and backward marks) replayed per second of
 * wall time, engine, policy host and sim backend included.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ferry_tools.h"


void bench_sim(bench_report *r) {
  synth_model m;
  synth_preset("llama3-8b", &m);
  m.steps = 100;
  char *buf = NULL;
  size_t len = 0;
  char err[512];
  FILE *f = open_memstream(&buf, &len);
  if (!f || synth_write(&m, f, err, sizeof err)) {
    fprintf(stderr, "bench_sim: cannot synthesize the trace\n");
    return;
  }
  fclose(f);
  double t0 = bench_now_ns();
  sim_trace *t = NULL;
  int rc = sim_trace_parse("llama3-8b x100", buf, len, &t, err, sizeof err);
  double parse_s = (bench_now_ns() - t0) / 1e9;
  free(buf);
  if (rc) {
    fprintf(stderr, "bench_sim: %s\n", err);
    return;
  }
  char policy[1024];
  snprintf(policy, sizeof policy, "%s", __FILE__);
  char *slash = strrchr(policy, '/');
  if (slash) *slash = 0;
  strncat(policy, "/../policies/default.lua", sizeof policy - strlen(policy) - 1);
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config c = {0};
  c.link = hw->link;
  c.duplex_d2h = hw->duplex_d2h;
  c.duplex_h2d = hw->duplex_h2d;
  c.policy_path = policy;
  sim_result res;
  if (sim_replay(t, &c, &res, err, sizeof err)) {
    fprintf(stderr, "bench_sim: %s\n", err);
    sim_trace_free(t);
    return;
  }
  bench_metric(r, "sim_events_per_s", (double)res.events / res.wall_s, "ev/s",
               "32 layers x 100 steps, default.lua, h100; target >= 2e6");
  bench_metric(r, "sim_replay_wall_s", res.wall_s, "s", "replay of those 100 steps");
  bench_metric(r, "sim_trace_parse_events_per_s", (double)t->n_events / parse_s, "ev/s",
               "reading the JSONL trace");
  sim_result_free(&res);
  c.policy_path = NULL; /* baseline: no policy, no copies */
  if (sim_replay(t, &c, &res, err, sizeof err) == 0) {
    bench_metric(r, "sim_events_per_s_no_offload", (double)res.events / res.wall_s, "ev/s",
                 "the same trace, keeping everything");
    sim_result_free(&res);
  }
  sim_trace_free(t);
}
