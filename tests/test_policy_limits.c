/* test_policy_limits.c — the policy host's bounds: runaway loops, wall
 * clock and C functions, the environment's limits, the memory cap and the
 * error budget. */
#include <time.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
/* Runaway loops are interrupted whatever their form, including a loop that
 * ran hot many times (would be JIT-compiled) before a later tensor made it
 * endless. */
TEST(policy_runaway_loops_interrupted) {
  char path[256];
  /* the instruction budget is under test: the wall clock must not win,
   * even under valgrind */
  setenv("FERRY_POLICY_DECISION_MS", "600000", 1);
  setenv("FERRY_POLICY_LOAD_MS", "600000", 1);
  ferry_policy *p = load_file("loops.lua",
      "local function spin(n) local s = 0 for i = 1, n do s = s + i end return s end\n" /* 1 */
      "local function tail(n) return tail(n + 1) end\n" /* 2 */
      "local function deep(n) return 1 + deep(n + 1) end\n" /* 3 */
      "local function swallow()\n" /* 4 */
      "  while true do pcall(function() while true do end end) end\n" /* 5 */
      "end\n"
      "local function handler() while true do end end\n" /* 7 */
      "return { api = 1, decide = function(t)\n" /* 8 */
      "  local p = t:path()\n"
      "  if p == 'while' then while true do end end\n" /* 10 */
      "  if p == 'repeat' then repeat until false end\n" /* 11 */
      "  if p == 'hot' then spin(t.bytes) end\n" /* 12 */
      "  if p == 'tail' then tail(0) end\n" /* 13 */
      "  if p == 'deep' then deep(0) end\n" /* 14 */
      "  if p == 'swallow' then swallow() end\n" /* 15 */
      "  if p == 'xpcall' then xpcall(function() while true do end end, handler) end\n" /* 16 */
      "  if p == 'gsub' then local function f(s) return (s:gsub('.', f)) end f('ab') end\n" /* 17 */
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  const char *budget = "interrupted after 10000000 VM instructions (runaway loop?)";
  /* 2000 calls of a 300-iteration loop: hot by any JIT threshold */
  ferry_tensor_desc hot = desc_of("hot", "X", FERRY_KIND_ACTIVATION, 300);
  for (int i = 0; i < 2000; i++) {
    ferry_decision out;
    ferry_policy_decide(p, &hot, NULL, &out);
    CHECK_EQ(out.action, FERRY_OFFLOAD);
  }
  static const struct {
    const char *site;
    uint64_t bytes;
    int line;
    int budget;
    const char *msg;
  } cases[] = {
      {"while", 1, 10, 1, NULL},
      {"repeat", 1, 11, 1, NULL},
      {"hot", 1ull << 50, 1, 1, NULL},
      {"tail", 1, 2, 1, NULL},
      {"deep", 1, 3, 0, "stack overflow"},
      {"swallow", 1, 5, 1, NULL},
      {"xpcall", 1, 16, 1, NULL},
      {"gsub", 1, 17, 0, "string.gsub nested too deeply (limit 64)"},
  };
  uint64_t n = sizeof cases / sizeof cases[0];
  for (uint64_t i = 0; i < n; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, cases[i].bytes);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    double t0 = now_ms();
    ferry_policy_decide(p, &d, NULL, &out);
    double ms = now_ms() - t0;
    CHECK_EQ(out.action, FERRY_KEEP);
    if (expect_fault(p, path, cases[i].line, cases[i].budget ? budget : cases[i].msg)) {
      fprintf(stderr, "runaway case '%s'\n", cases[i].site);
      return 1;
    }
    printf("  %-8s stopped after %.1f ms\n", cases[i].site, ms);
  }
  /* Still usable afterwards, the hot loop included. */
  ferry_decision out;
  ferry_policy_decide(p, &hot, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, n);
  ferry_policy_destroy(p);

  /* At load time too, with the load budget. */
  int rc = expect_load_error("loadloop.lua", "local x = 0\nwhile true do x = x + 1 end\n", 0, 2,
                             "interrupted after 100000000 VM instructions (runaway loop?)");
  unsetenv("FERRY_POLICY_DECISION_MS");
  unsetenv("FERRY_POLICY_LOAD_MS");
  return rc;
}

/* Time spent where the instruction count does not grow fast (a loop on
 * os.clock, ~0.5 s for the instruction budget) is stopped by the wall-clock
 * budget; the C functions the hook cannot interrupt (the pattern matcher,
 * table.sort) refuse work they could not finish quickly, with the caller's
 * file:line; ordinary patterns are untouched. */
TEST(policy_wall_clock_and_c_functions_bounded) {
  char path[256];
  setenv("FERRY_POLICY_DECISION_MS", "30", 1);
  ferry_policy *p = load_file("bounded.lua",
      "local big = string.rep('a', 3000)\n" /* 1 */
      "local bomb = string.rep('a*', 12) .. 'b' local x70k = {} for i = 1, 70000 do x70k[i] = -i end local ab2m = string.rep('ab', 1e6)\n" /* 2: built at load, slow under valgrind */
      "return { api = 1, decide = function(t)\n" /* 3 */
      "  local p = t:path()\n" /* 4 */
      "  if p == 'clock' then local t0 = os.clock() while os.clock() - t0 < 60 do end end\n" /* 5 */
      "  if p == 'find' then string.find(big, bomb) end\n" /* 6 */
      "  if p == 'method' then big:match(bomb) end\n" /* 7 */
      "  if p == 'gmatch' then for _ in big:gmatch('(a*)(a*)(a*)b') do end end\n" /* 8 */
      "  if p == 'gsub' then big:gsub('a-a-a-a-b', '') end\n" /* 9 */
      "  if p == 'plain' then string.find(ab2m, string.rep('ab', 100), 1, true) end\n" /* 10 */
      "  if p == 'sort' then table.sort(x70k) end\n" /* 11 */
      "  assert(('model.layers.12.mlp'):match('^model%.layers%.(%d+)%.') == '12')\n"
      "  assert(select(2, ('a.b.c'):gsub('%.', '/')) == 2)\n"
      "  assert(('x(y)'):find('(', 1, true) == 2 and ('a.b'):find('.', 2, true) == 2)\n"
      "  local n = 0 for w in ('decoder.layers.3.self_attn'):gmatch('[^.]+') do n = n + 1 end\n"
      "  assert(n == 4)\n"
      "  assert(('%s'):rep(3, '-') == '%s-%s-%s')\n"
      "  local s = {3, 1, 2} table.sort(s) assert(s[1] == 1 and s[3] == 3)\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  unsetenv("FERRY_POLICY_DECISION_MS");
  CHECK(p != NULL);
  static const struct {
    const char *site;
    int line;
    const char *msg;
  } cases[] = {
      {"clock", 5, "interrupted after 30 ms, the wall-clock budget of a decision "
                   "(FERRY_POLICY_DECISION_MS)"},
      {"find", 6, "string.find: pattern 'a*a*a*a*a*a*a*a*a*a*a*a*b' is too costly for a "
                  "3000-byte subject (up to 6.8e+37 matcher steps, the limit is 8e+06): "
                  "anchor it with '^', match a shorter string or use a shorter pattern with "
                  "fewer repetitions (*, +, -, ?)"},
      {"method", 7, "string.match: pattern 'a*a*a*a*a*a*a*a*a*a*a*a*b' is too costly for a "
                    "3000-byte subject (up to 6.8e+37 matcher steps, the limit is 8e+06): "
                    "anchor it with '^', match a shorter string or use a shorter pattern with "
                    "fewer repetitions (*, +, -, ?)"},
      {"gmatch", 8, "string.gmatch: pattern '(a*)(a*)(a*)b' is too costly for a 3000-byte "
                    "subject (up to 1.6e+14 matcher steps, the limit is 8e+06): anchor it "
                    "with '^', match a shorter string or use a shorter pattern with fewer "
                    "repetitions (*, +, -, ?)"},
      {"gsub", 9, "string.gsub: pattern 'a-a-a-a-b' is too costly for a 3000-byte subject "
                  "(up to 1.5e+17 matcher steps, the limit is 8e+06): anchor it with '^', "
                  "match a shorter string or use a shorter pattern with fewer repetitions "
                  "(*, +, -, ?)"},
      {"plain", 10, "string.find: pattern 'abababababababababababababababababababababababababab"
                    "abababab...' is too costly for a 2000000-byte subject (up to 4e+08 "
                    "byte comparisons, the limit is 4e+07): search a shorter string or for a "
                    "shorter one"},
      {"sort", 11, "table.sort: 70000 items, more than the limit of 65536"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    double t0 = now_ms();
    ferry_policy_decide(p, &d, NULL, &out);
    printf("  %-7s stopped after %.1f ms\n", cases[i].site, now_ms() - t0);
    CHECK_EQ(out.action, FERRY_KEEP);
    if (expect_fault(p, path, cases[i].line, cases[i].msg)) {
      fprintf(stderr, "bounded case '%s'\n", cases[i].site);
      return 1;
    }
  }
  ferry_tensor_desc ok = desc_of("ordinary", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &ok, NULL, &out);
  if (out.action != FERRY_OFFLOAD) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);

  /* a load has its own budget */
  setenv("FERRY_POLICY_LOAD_MS", "40", 1);
  int rc = expect_load_error("slowload.lua",
                             "local t0 = os.clock()\nwhile os.clock() - t0 < 60 do end\n", 0, 2,
                             "interrupted after 40 ms, the wall-clock budget of a policy load "
                             "(FERRY_POLICY_LOAD_MS)");
  unsetenv("FERRY_POLICY_LOAD_MS");
  return rc;
}

/* The policy host's environment variables go through the one strict
 * parser: a bad value fails the load with the variable, the value and what
 * was expected, instead of being ignored. */
TEST(policy_env_limits_are_strict) {
  static const struct {
    const char *var, *value, *msg;
  } cases[] = {
      {"FERRY_POLICY_DECISION_MS", "abc", "FERRY_POLICY_DECISION_MS abc: not a number; expected a whole number"},
      {"FERRY_POLICY_DECISION_MS", "0", "FERRY_POLICY_DECISION_MS 0: must be between 1 and 3600000"},
      {"FERRY_POLICY_DECISION_MS", "2.5", "FERRY_POLICY_DECISION_MS 2.5: must be a whole number"},
      {"FERRY_POLICY_LOAD_MS", "inf", "FERRY_POLICY_LOAD_MS inf: not a number; expected a whole number"},
      {"FERRY_POLICY_MEM_MB", "3", "FERRY_POLICY_MEM_MB 3: must be between 4 and 1048576"},
      {"FERRY_POLICY_MEM_MB", "64x", "FERRY_POLICY_MEM_MB 64x: unexpected \"x\"; expected a whole number"},
      {"FERRY_POLICY_ERROR_BUDGET", "-1", "FERRY_POLICY_ERROR_BUDGET -1: must be between 1 and 1073741824"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv(cases[i].var, cases[i].value, 1);
    ferry_policy *p = NULL;
    char err[512] = "";
    int rc = ferry_policy_create(NULL, "return { api = 1, decide = function() return 0 end }", 0,
                                 &p, err, sizeof err);
    unsetenv(cases[i].var);
    if (rc != FERRY_EINVAL || p || strcmp(err, cases[i].msg) != 0) {
      fprintf(stderr, "%s=%s: rc %d\n  got  \"%s\"\n  want \"%s\"\n", cases[i].var,
              cases[i].value, rc, err, cases[i].msg);
      ferry_policy_destroy(p);
      return 1;
    }
  }
  return 0;
}

/* An allocation bomb is stopped by the memory cap, counted, and the state
 * recovers its memory. */
TEST(policy_memory_bomb_stopped) {
  setenv("FERRY_POLICY_MEM_MB", "16", 1);
  setenv("FERRY_POLICY_DECISION_MS", "600000", 1); /* the memory cap is under test */
  char path[256];
  ferry_policy *p = load_file("bomb.lua",
      "local keep = {}\n"
      "return { api = 1, decide = function(t)\n"
      "  local p = t:path()\n"
      "  if p == 'table' then local x = {} for i = 1, 1e9 do x[i] = i end end\n" /* 4 */
      "  if p == 'strings' then for i = 1, 1e9 do keep[i] = ('x'):rep(64) .. i end end\n" /* 5 */
      "  if p == 'rep' then local s = ('x'):rep(2^30) end\n" /* 6 */
      "  if p == 'swallow' then pcall(function() local x = {} for i = 1, 1e9 do x[i] = {} end end) end\n" /* 7 */
      "  if p == 'clear' then keep = {} end\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  unsetenv("FERRY_POLICY_MEM_MB");
  unsetenv("FERRY_POLICY_DECISION_MS");
  CHECK(p != NULL);
  static const struct {
    const char *site;
    int line;
  } cases[] = {{"table", 4}, {"rep", 6}, {"swallow", 7}, {"strings", 5}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    ferry_policy_decide(p, &d, NULL, &out);
    CHECK_EQ(out.action, FERRY_KEEP);
    const char *e = ferry_policy_last_error(p);
    char want[300];
    snprintf(want, sizeof want, "%s:%d: policy memory limit of 16 MiB exceeded", path,
             cases[i].line);
    if (strncmp(e, want, strlen(want)) != 0) {
      fprintf(stderr, "bomb '%s':\n  got  \"%s\"\n  want \"%s...\"\n", cases[i].site, e, want);
      return 1;
    }
  }
  /* 'strings' left its garbage reachable: until the policy drops it, calls
   * that allocate may fail, but the host keeps answering. */
  ferry_tensor_desc clear = desc_of("clear", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &clear, NULL, &out);
  ferry_tensor_desc fine = desc_of("fine", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_policy_decide(p, &fine, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 4);
  ferry_policy_destroy(p);

  setenv("FERRY_POLICY_MEM_MB", "16", 1);
  int rc = expect_load_error("loadbomb.lua", "local t = {}\nfor i = 1, 1e9 do t[i] = i end\n", 0, 2,
                             "policy memory limit of 16 MiB exceeded (allocation of 16777224 bytes "
                             "refused)");
  unsetenv("FERRY_POLICY_MEM_MB");
  return rc;
}

/* After the error budget (100 faults) the policy is disabled: everything is
 * kept without calling Lua, and last_error says so. */
TEST(policy_error_budget_disables) {
  char path[256];
  ferry_policy *p = load_file("budget.lua",
      "return { api = 1, decide = function(t)\n"
      "  if t:path() == 'bad' then error('always wrong') end\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc bad = desc_of("bad", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc good = desc_of("good", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  for (int i = 0; i < 99; i++) ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 99);
  CHECK_EQ(s.disabled, 0);
  ferry_policy_decide(p, &good, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 100);
  CHECK_EQ(s.disabled, 1);
  char want[512];
  snprintf(want, sizeof want,
           "%s:2: always wrong (policy disabled after 100 faults: every tensor is now kept)", path);
  CHECK(strcmp(ferry_policy_last_error(p), want) == 0);
  uint64_t calls = s.calls;
  ferry_policy_decide(p, &good, NULL, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, calls);
  ferry_policy_destroy(p);

  /* The budget can be lowered from the environment. */
  setenv("FERRY_POLICY_ERROR_BUDGET", "3", 1);
  p = load_file("budget.lua", "return { api = 1, decide = function() error('x') end }\n", 0, path,
                sizeof path);
  unsetenv("FERRY_POLICY_ERROR_BUDGET");
  CHECK(p != NULL);
  for (int i = 0; i < 5; i++) ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 3);
  CHECK_EQ(s.disabled, 1);
  ferry_policy_destroy(p);
  return 0;
}
