/* bench_policy_bounds.c — the measured worst cases that docs/policy-api.md
 * ("Limits") states for the policy sandbox's C functions:
 *
 * 1. the worst single call the sandbox accepts: for each family of
 *    pathological pattern, the largest subject it accepts (a binary search
 *    on the subject's length; above it the call is refused as too costly)
 *    and the time of one such call (policy_call_<family>_ms, the largest
 *    as policy_call_max_ms);
 * 2. the overrun of a decision that repeats a hostile operation until the
 *    budget stops it, at the default 50 ms budget: how long the decision
 *    took over its budget (policy_overrun_<case>_x, the largest as
 *    policy_overrun_max_x; the target is 2). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ferry_tools.h"

typedef struct family {
  const char *name;
  const char *setup; /* Lua with `n` defined: builds S (and P) */
  const char *call;  /* the call, in decide */
  long max_n;
} family;

static const family FAMILIES[] = {
    {"dots", "local S = ('.'):rep(n) .. '%z' local P = S", "S:find(P)", 1 << 15},
    {"dots_gsub", "local S = ('x'):rep(n) local P = ('.'):rep(n / 2) .. '%z'", "S:gsub(P, '')",
     1 << 15},
    {"class", "local S = ('a'):rep(n) local P = ('%a'):rep(n / 2) .. '%z'", "S:find(P)", 1 << 15},
    {"set", "local S = ('a'):rep(n) local P = ('[bcdefghijklmnopqrstuvwxyza]'):rep(n / 20) .. '%z'",
     "S:find(P)", 1 << 16},
    {"star3", "local S = ('a'):rep(n) local P = 'a*a*a*b'", "S:find(P)", 1 << 14},
    {"lazy3", "local S = ('a'):rep(n) local P = 'a-a-a-b'", "S:find(P)", 1 << 14},
    {"star2_gmatch", "local S = ('a'):rep(n) local P = '(a*)(a*)b'",
     "for _ in S:gmatch(P) do end", 1 << 14},
    {"optional", "local S = ('a'):rep(n) local P = ('a?'):rep(n) .. ('a'):rep(n) .. 'b'",
     "S:find(P)", 64},
    {"balance", "local S = ('('):rep(n) local P = '%b()'", "S:find(P)", 1 << 24},
    {"backref", "local S = ('a'):rep(n) local P = '(a*)%1b'", "S:find(P)", 1 << 16},
    {"plain", "local S = ('a'):rep(n) local P = ('a'):rep(n / 2) .. 'b'", "S:find(P, 1, true)",
     1 << 24},
};

/* ms of one decide running call with S, P built for n at load; -1 if the
 * sandbox refused the call (or anything else failed). */
static double call_ms(const family *f, long n) {
  char src[2048], err[512];
  snprintf(src, sizeof src,
           "local n = %ld\n%s\nreturn { api = 1, decide = function() %s return ferry.OFFLOAD end }",
           n, f->setup, f->call);
  ferry_policy *p = NULL;
  if (ferry_policy_create(NULL, src, 0, &p, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "bench_policy_bounds: %s: %s\n", f->name, err);
    return -1;
  }
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 4096;
  double best = -1;
  for (int rep = 0; rep < 3; rep++) {
    ferry_decision out;
    d.shape[0] = rep; /* a new site: no cached answer */
    d.ndim = 1;
    double t0 = bench_now_ns();
    ferry_policy_decide(p, &d, NULL, &out);
    double ms = (bench_now_ns() - t0) / 1e6;
    if (out.action != FERRY_OFFLOAD) break;
    if (best < 0 || ms > best) best = ms; /* the worst of three */
  }
  ferry_policy_destroy(p);
  return best;
}

typedef struct overrun_case {
  const char *name;
  const char *setup;
  const char *loop_body;
} overrun_case;

static const overrun_case OVERRUNS[] = {
    {"clock", "", "local _ = os.clock()"},
    {"pattern", "local X = ('.'):rep(900) .. '%z'", "X:find(X)"},
    {"strcmp_16MB", "local a = ('x'):rep(16e6) .. 'a' local b = ('x'):rep(16e6) .. 'b'",
     "local _ = a < b"},
    {"concat_16MB", "local a = ('x'):rep(16e6) local b = a .. 'y'", "local _ = a .. 'y'"},
    {"upper_16MB", "local a = ('x'):rep(16e6) local b = a:upper()", "local _ = a:upper()"},
    {"rep_16MB", "local a = ('x'):rep(16e6)", "local _ = ('x'):rep(16e6)"},
    {"table_concat_1M", "local t = {} for i = 1, 1e6 do t[i] = '' end", "local _ = table.concat(t)"},
    {"insert_front_1M", "local t = {} for i = 1, 1e6 do t[i] = i end", "table.insert(t, 1, 0)"},
    {"tonumber_16MB", "local s = (' '):rep(16e6)", "local _ = tonumber(s)"},
    {"sort_64K", "local x = {} for i = 1, 65536 do x[i] = -i end",
     "local y = {} for i = 1, #x do y[i] = x[i] end table.sort(y)"},
};

static double overrun_x(const overrun_case *c) {
  char src[2048], err[512];
  snprintf(src, sizeof src,
           "%s\nreturn { api = 1, decide = function() while true do %s end end }", c->setup,
           c->loop_body);
  ferry_policy *p = NULL;
  if (ferry_policy_create(NULL, src, 0, &p, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "bench_policy_bounds: %s: %s\n", c->name, err);
    return -1;
  }
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 4096;
  double worst = 0;
  for (int rep = 0; rep < 3; rep++) {
    ferry_decision out;
    double t0 = bench_now_ns();
    ferry_policy_decide(p, &d, NULL, &out);
    double x = (bench_now_ns() - t0) / 50e6;
    if (x > worst) worst = x;
  }
  if (!strstr(ferry_policy_last_error(p), "interrupted after"))
    fprintf(stderr, "bench_policy_bounds: %s: %s\n", c->name, ferry_policy_last_error(p));
  ferry_policy_destroy(p);
  return worst;
}

void bench_policy_bounds(bench_report *r) {
  char name[96], note[256];
  /* the single calls are measured whole: no wall-clock budget in the way */
  setenv("FERRY_POLICY_DECISION_MS", "600000", 1);
  double max_ms = 0;
  for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++) {
    const family *f = &FAMILIES[i];
    long lo = 1, hi = f->max_n; /* lo accepted, hi refused (or the cap) */
    if (call_ms(f, hi) >= 0) lo = hi;
    while (hi - lo > 1 && hi - lo > lo / 64) {
      long mid = lo + (hi - lo) / 2;
      if (call_ms(f, mid) >= 0) lo = mid;
      else hi = mid;
    }
    double ms = call_ms(f, lo);
    if (ms > max_ms) max_ms = ms;
    snprintf(name, sizeof name, "policy_call_%s_ms", f->name);
    snprintf(note, sizeof note, "largest accepted subject: %ld bytes%s", lo,
             lo == f->max_n ? " (the family's cap, not refused)" : "");
    bench_metric(r, name, ms, "ms", note);
  }
  bench_metric(r, "policy_call_max_ms", max_ms, "ms",
               "slowest single pattern call the sandbox accepts; the limit is 20 ms");
  unsetenv("FERRY_POLICY_DECISION_MS");
  double max_x = 0;
  for (size_t i = 0; i < sizeof OVERRUNS / sizeof OVERRUNS[0]; i++) {
    double x = overrun_x(&OVERRUNS[i]);
    if (x > max_x) max_x = x;
    snprintf(name, sizeof name, "policy_overrun_%s_x", OVERRUNS[i].name);
    bench_metric(r, name, x, "x", "a decision repeating it, over the 50 ms budget (worst of 3)");
  }
  bench_metric(r, "policy_overrun_max_x", max_x, "x",
               "slowest hostile decision over its 50 ms budget; target <= 2");
}
