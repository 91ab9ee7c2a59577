/*
 * bench_policy.c — cost of a policy decision: one Lua call per tensor
 * (decide_uncached_ns) and an answer from the per-site cache
 * (decide_cached_ns), measured in the same run on the same descriptors.
 *
 * The policy is policies/default.lua when the source tree has it (found from
 * FERRY_POLICY_DIR, else relative to this file), else an inline policy with
 * the same rules; the note of each metric says which one ran.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <valgrind/callgrind.h>

#include "bench.h"
#include "ferry_tools.h"

/* The same rules as default.lua, written out, when it cannot be found. */
static const char INLINE_DEFAULT[] =
    "local find, lower = string.find, string.lower\n"
    "local memo = {}\n"
    "local HEAD = { 'lm_head', 'output', 'head', 'ln_f', 'final_layer_norm' }\n"
    "local function excluded(path, class)\n"
    "  local v = memo[path]\n"
    "  if v == nil then\n"
    "    v = find(lower(path .. ' ' .. class), 'liger', 1, true) ~= nil\n"
    "    local last = path:match('([^.]+)$') or ''\n"
    "    for i = 1, #HEAD do if last == HEAD[i] then v = true end end\n"
    "    memo[path] = v\n"
    "  end\n"
    "  return v\n"
    "end\n"
    "return { api = 1, name = 'default-inline', knobs = { max_fwd_stash = 5 },\n"
    "  decide = function(t, ctx)\n"
    "    if t.bytes < 1024 then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
    "    if t.kind == ferry.PARAMETER or t.kind == ferry.BUFFER then\n"
    "      return ferry.KEEP, ferry.ON_USE, nil, true end\n"
    "    if excluded(t:path(), t:class()) then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
    "    return ferry.OFFLOAD, ferry.ON_USE, nil, true\n"
    "  end }\n";

#define N_SITES 8

static void bench_fill(ferry_tensor_desc *d) {
  static const char *paths[N_SITES] = {
      "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
      "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
      "model.layers.0.mlp.gate_proj",    "model.layers.0.mlp.up_proj",
      "model.layers.0.mlp.down_proj",    "lm_head"};
  for (int i = 0; i < N_SITES; i++) {
    d[i] = (ferry_tensor_desc)FERRY_TENSOR_DESC_INIT;
    d[i].dtype = FERRY_DTYPE_BF16;
    d[i].kind = FERRY_KIND_ACTIVATION;
    d[i].ndim = 3;
    d[i].shape[0] = 8;
    d[i].shape[1] = 2048;
    d[i].shape[2] = 4096;
    d[i].bytes = 8ull * 2048 * 4096 * 2;
    d[i].flags = FERRY_FLAG_CONTIGUOUS;
    d[i].layer = i == N_SITES - 1 ? -1 : 0;
    d[i].layer_count = 32;
    d[i].module_path = paths[i];
    d[i].module_class = "Linear";
  }
}

static char *find_default_policy(void) {
  const char *dir = getenv("FERRY_POLICY_DIR");
  char path[1024];
  if (dir && *dir) {
    snprintf(path, sizeof path, "%s/default.lua", dir);
  } else {
    /* __FILE__ is .../bench/bench_policy.c in CMake builds */
    const char *slash = strrchr(__FILE__, '/');
    if (!slash) return NULL;
    snprintf(path, sizeof path, "%.*s/../policies/default.lua", (int)(slash - __FILE__), __FILE__);
  }
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  fclose(f);
  return strdup(path);
}

/* ns per decision of p on sites never seen before (Lua runs each time). */
static double uncached_ns(ferry_policy *p, ferry_tensor_desc *d, long iters) {
  ferry_context ctx = {0};
  ferry_decision out;
  double t0 = bench_now_ns();
  for (long i = 0; i < iters; i++) {
    d[i % N_SITES].shape[0] = 2000000 + i;
    ferry_policy_decide(p, &d[i % N_SITES], &ctx, &out);
  }
  return (bench_now_ns() - t0) / (double)iters;
}

/* A step as a model packs it: LAYERS layers of the N_SITES - 1 linear
 * sites, then the head. */
#define LAYERS 32
#define STEP_SITES (LAYERS * (N_SITES - 1) + 1)

static void fill_step(ferry_tensor_desc *step, char (*paths)[64]) {
  ferry_tensor_desc site[N_SITES];
  bench_fill(site);
  for (int l = 0, k = 0; l < LAYERS; l++)
    for (int i = 0; i < N_SITES - 1; i++, k++) {
      step[k] = site[i];
      snprintf(paths[k], 64, "model.layers.%d%s", l, strchr(strchr(site[i].module_path, '.') + 1, '.') + 2);
      step[k].module_path = paths[k];
      step[k].layer = l;
    }
  step[STEP_SITES - 1] = site[N_SITES - 1];
}

/* ns per decision of p in steady state: the same STEP_SITES sites every
 * step, the step's begin (the policy's step hook) included, after 4 steps of
 * warm-up (a policy that learns in its first steps and then caches is
 * measured on its cache; one that must ask Lua every step is measured on
 * Lua). */
static double steady_ns(ferry_policy *p, long steps) {
  static ferry_tensor_desc d[STEP_SITES];
  static char paths[STEP_SITES][64];
  fill_step(d, paths);
  ferry_context ctx = {0};
  ferry_decision out;
  uint64_t step = 0;
  for (int w = 0; w < 4; w++) {
    ctx.step = ++step;
    ferry_policy_step_begin(p, &ctx);
    for (int i = 0; i < STEP_SITES; i++) ferry_policy_decide(p, &d[i], &ctx, &out);
  }
  double t0 = bench_now_ns();
  for (long s = 0; s < steps; s++) {
    ctx.step = ++step;
    ferry_policy_step_begin(p, &ctx);
    for (int i = 0; i < STEP_SITES; i++) ferry_policy_decide(p, &d[i], &ctx, &out);
  }
  return (bench_now_ns() - t0) / (double)(steps * STEP_SITES);
}

int bench_policy_step_sites(void) { return STEP_SITES; }

/* Under callgrind (ferry_bench --instr decide:NAME N or steady:NAME N):
 * only the measured loop is collected, uncached decisions (N of them) or
 * steady steps (N steps of STEP_SITES decisions, begins included). */
int bench_policy_instr(const char *name, long iters, int steady) {
  char path[1024], err[512];
  ferry_policy *p = NULL;
  if (ferry_policy_find(name, path, sizeof path, err, sizeof err) ||
      ferry_policy_create(path, NULL, 0, &p, err, sizeof err)) {
    fprintf(stderr, "bench_policy: %s: %s\n", name, err);
    return 1;
  }
  ferry_tensor_desc d[N_SITES];
  bench_fill(d);
  steady_ns(p, 20); /* the state bench_shipped_policies measures in */
  CALLGRIND_TOGGLE_COLLECT;
  if (steady)
    steady_ns(p, iters);
  else
    uncached_ns(p, d, iters);
  CALLGRIND_TOGGLE_COLLECT;
  ferry_policy_destroy(p);
  return 0;
}

/* Every shipped policy, by name: decide_{uncached,steady}_ns_NAME and the
 * slowest of each (decide_uncached_ns_max, decide_cached_ns_max). */
static void bench_shipped_policies(bench_report *r) {
  static const char *const names[] = {"default", "budget", "layers", "fraction", "ramcap",
                                      "host_budget"};
  double worst_uncached = 0, worst_steady = 0;
  const char *slowest_uncached = "-", *slowest_steady = "-";
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
    char path[1024], err[512], metric[96];
    ferry_policy *p = NULL;
    if (ferry_policy_find(names[k], path, sizeof path, err, sizeof err) ||
        ferry_policy_create(path, NULL, 0, &p, err, sizeof err)) {
      fprintf(stderr, "bench_policy: %s: %s\n", names[k], err);
      continue;
    }
    ferry_tensor_desc d[N_SITES];
    bench_fill(d);
    double steady = steady_ns(p, 2000);
    double uncached = uncached_ns(p, d, 50000);
    ferry_policy_stats st;
    ferry_policy_get_stats(p, &st);
    if (st.errors) fprintf(stderr, "bench_policy: %s faulted: %s\n", names[k], ferry_policy_last_error(p));
    snprintf(metric, sizeof metric, "decide_uncached_ns_%s", names[k]);
    bench_metric(r, metric, uncached, "ns", "new site every call");
    snprintf(metric, sizeof metric, "decide_steady_ns_%s", names[k]);
    char what[96];
    snprintf(what, sizeof what, "the same %d sites every step, its begin included", STEP_SITES);
    bench_metric(r, metric, steady, "ns", what);
    if (uncached > worst_uncached) worst_uncached = uncached, slowest_uncached = names[k];
    if (steady > worst_steady) worst_steady = steady, slowest_steady = names[k];
    ferry_policy_destroy(p);
  }
  char note[128];
  snprintf(note, sizeof note, "slowest shipped policy: %s; target <= 1000", slowest_uncached);
  bench_metric(r, "decide_uncached_ns_max", worst_uncached, "ns", note);
  snprintf(note, sizeof note, "slowest shipped policy in steady state: %s; target <= 50",
           slowest_steady);
  bench_metric(r, "decide_cached_ns_max", worst_steady, "ns", note);
}

void bench_policy(bench_report *r) {
  char err[512], note[256];
  char *path = find_default_policy();
  ferry_policy *p = NULL;
  if (!path || ferry_policy_create(path, NULL, 0, &p, err, sizeof err) != FERRY_OK) {
    if (path) fprintf(stderr, "bench_policy: %s; using the inline policy\n", err);
    free(path);
    path = NULL;
    if (ferry_policy_create(NULL, INLINE_DEFAULT, 0, &p, err, sizeof err) != FERRY_OK) {
      fprintf(stderr, "bench_policy: %s\n", err);
      return;
    }
  }
  ferry_tensor_desc d[N_SITES];
  bench_fill(d);
  ferry_context ctx = {0};
  ferry_decision out;
  const long iters = 200000;

  /* Warm up (the policy's own memo of module paths fills here). */
  for (long i = 0; i < 1000; i++) ferry_policy_decide(p, &d[i % N_SITES], &ctx, &out);
  ferry_policy_stats before;
  ferry_policy_get_stats(p, &before);

  /* Uncached: shape[0] differs on every call, so every call is a site never
   * seen before and runs Lua (the cost includes the cache miss and, for the
   * first SITE_CACHE_MAX sites, storing the answer). */
  double t0 = bench_now_ns();
  for (long i = 0; i < iters; i++) {
    ferry_tensor_desc *di = &d[i % N_SITES];
    di->shape[0] = 1000000 + i; /* a new site each call */
    ferry_policy_decide(p, di, &ctx, &out);
  }
  double uncached = (bench_now_ns() - t0) / (double)iters;
  ferry_policy_stats mid;
  ferry_policy_get_stats(p, &mid);

  bench_fill(d);
  for (int i = 0; i < N_SITES; i++) ferry_policy_decide(p, &d[i], &ctx, &out);
  t0 = bench_now_ns();
  for (long i = 0; i < iters * 10; i++) ferry_policy_decide(p, &d[i % N_SITES], &ctx, &out);
  double cached = (bench_now_ns() - t0) / (double)(iters * 10);
  ferry_policy_stats after;
  ferry_policy_get_stats(p, &after);

  const char *which = path ? "policies/default.lua" : "inline default-equivalent policy";
  snprintf(note, sizeof note, "%s, %llu Lua calls, JIT off + count hook; target <= 1000", which,
           (unsigned long long)(mid.calls - before.calls));
  bench_metric(r, "decide_uncached_ns", uncached, "ns", note);
  snprintf(note, sizeof note, "%s, %llu cache hits; target <= 50", which,
           (unsigned long long)(after.cache_hits - mid.cache_hits));
  bench_metric(r, "decide_cached_ns", cached, "ns", note);
  if (mid.errors || after.errors)
    fprintf(stderr, "bench_policy: the policy faulted: %s\n", ferry_policy_last_error(p));
  ferry_policy_destroy(p);
  free(path);
  bench_shipped_policies(r);
}
