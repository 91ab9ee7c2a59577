/* test_policy_explain.c — the reasons of ferry_policy_explain: a
 * hand-written decide's and the rules library's, with their lines. */
#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

/* ---- reasons: ferry_policy_explain ---------------------------------------- */

/* A hand-written decide: the reason is "decide" at its first line, also
 * for an answer from the site cache; explain and decide give the same
 * answers and share the cache; a fault's reason is its position; a
 * policy's own explain is used by explain only, never by decide. */
TEST(policy_explain_hand_written) {
  char path[256];
  ferry_policy *p = load_file("why_decide.lua",
      "-- a hand-written decide\n"
      "return { api = 1,\n"
      "  decide = function(t)\n"
      "    if t.bytes < 1024 then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "    if t:path() == 'bad' then error('no bad here') end\n"
      "    return ferry.OFFLOAD, ferry.PREFETCH, 3\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_context c = {.step = 1};
  ferry_tensor_desc big = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc small = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 512);
  ferry_tensor_desc bad = desc_of("bad", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision d, e;
  ferry_policy_reason why;
  ferry_policy_explain(p, &big, &c, &e, &why);
  ferry_policy_decide(p, &big, &c, &d);
  CHECK(memcmp(&d, &e, sizeof d) == 0);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK_EQ(e.prefetch_distance, 3);
  CHECK_EQ(why.from_cache, 0);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK_EQ(why.from_cache, 0);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &small, &c, &e, &why); /* from the cache, same reason */
  CHECK_EQ(why.from_cache, 1);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &bad, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fault", path, 5));
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 4);
  CHECK_EQ(s.cache_hits, 1);
  CHECK_EQ(s.errors, 1);
  ferry_policy_explain(p, &big, &c, &e, NULL); /* why is optional */
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);

  /* A policy's own explain: its rule, at its where or, without one, at
   * the policy's return; a nonsense answer is a fault at explain's line. */
  p = load_file("why_own.lua",
      "local n = 0\n"
      "return { api = 1,\n"
      "  decide = function() return ferry.KEEP end,\n"
      "  explain = function(t)\n"
      "    n = n + 1\n"
      "    if n == 1 then return ferry.OFFLOAD, 'mine' end\n"
      "    if n == 2 then return ferry.KEEP, 'theirs', 'elsewhere.lua:9' end\n"
      "    if n == 3 then return ferry.KEEP end\n"
      "    return 7\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_policy_decide(p, &big, &c, &d);
  CHECK_EQ(d.action, FERRY_KEEP); /* decide never runs explain */
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK_EQ(e.reload, FERRY_RELOAD_ON_USE);
  CHECK(!expect_reason(&why, "mine", path, 2));
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK(strcmp(why.rule, "theirs") == 0 && strcmp(why.where, "elsewhere.lua:9") == 0);
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK(!expect_reason(&why, "explain", path, 4));
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fault", path, 4));
  CHECK(!expect_fault(p, path, 4,
                      "explain returned a nonsense action: 7 (expected ferry.KEEP or "
                      "ferry.OFFLOAD); the tensor was kept"));
  ferry_policy_destroy(p);
  return expect_load_error("why_notfn.lua",
                           "return { api = 1, decide = function() end,\n  explain = 42 }\n", 0, 2,
                           "explain must be a function (explain = function(t, ctx) ... end), got "
                           "number");
}

/* A rules-library policy: each decision's reason is the rule that made it,
 * at the line of the policy file where the rule is written (a rule built
 * in a helper: the helper's line, unless the helper returns the rule's
 * constructor call, a tail call that leaves the helper's caller's line; a
 * call over two lines: its first); an
 * offload a selector chose is the selector's; one no rule kept, without a
 * selector, is "all rules passed" at the policy's return. */
TEST(policy_explain_rules_lines) {
  char path[256];
  ferry_policy *p = load_file("why_rules.lua",
      "local R = require 'ferry.rules'\n"
      "local function big() local r = R.min_bytes(2048); return r end\n"
      "\n"
      "return R.policy {\n"
      "  name = 'why',\n"
      "  R.exclude_params_and_buffers(),\n"
      "  big(),\n"
      "  R.exclude_modules(\n"
      "    'lm_head'),\n"
      "  R.fraction(0.5),\n"
      "}\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_context c = {.step = 1};
  ferry_tensor_desc param = desc_of("model.a", "Linear", FERRY_KIND_PARAMETER, 4096);
  ferry_tensor_desc small = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 1024);
  ferry_tensor_desc head = desc_of("lm_head", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc act = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision e;
  ferry_policy_reason why;
  ferry_policy_step_begin(p, &c);
  ferry_policy_explain(p, &param, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "exclude_params_and_buffers()", path, 6));
  ferry_policy_explain(p, &param, &c, &e, &why);
  CHECK_EQ(why.from_cache, 1);
  CHECK(!expect_reason(&why, "exclude_params_and_buffers()", path, 6));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK(!expect_reason(&why, "min_bytes(2048)", path, 2));
  ferry_policy_explain(p, &head, &c, &e, &why);
  CHECK(!expect_reason(&why, "exclude_modules({under=lm_head})", path, 8));
  ferry_policy_explain(p, &act, &c, &e, &why); /* spread: the 1st of 2 goes */
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK(!expect_reason(&why, "fraction(0.5, first)", path, 10));
  ferry_policy_explain(p, &act, &c, &e, &why); /* the 2nd stays */
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fraction(0.5, first)", path, 10));
  ferry_policy_destroy(p);

  p = load_file("why_passed.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy { R.min_bytes(2048) }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_policy_explain(p, &act, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK(!expect_reason(&why, "all rules passed", path, 2));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK(!expect_reason(&why, "min_bytes(2048)", path, 2));
  ferry_policy_destroy(p);
  return 0;
}
