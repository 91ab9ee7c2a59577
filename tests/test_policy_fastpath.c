/* test_policy_fastpath.c — what the policy host's and ferry.rules's fast
 * paths must keep: the site cache keys the whole site and a string's
 * content (not its address), the fields t and ctx show keep their signs and
 * follow every change, keep_recompute (checked inline by R.policy) keeps
 * recompute packs, and frozen answers decode to the live ones. */
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

static ferry_policy *from_source(const char *src) {
  char err[512];
  ferry_policy *p = NULL;
  if (ferry_policy_create(NULL, src, 0, &p, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "policy: %s\n", err);
    return NULL;
  }
  return p;
}

static ferry_tensor_desc site(const char *path, int64_t dim0) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.dtype = FERRY_DTYPE_BF16;
  d.ndim = 2;
  d.shape[0] = dim0;
  d.shape[1] = 4096;
  d.bytes = 1 << 20;
  d.layer = 0;
  d.layer_count = 4;
  d.module_path = path;
  d.module_class = "Linear";
  return d;
}

/* Sites that differ only in a high bit of one dimension, or only in a
 * string's content at the same address, are different sites. */
TEST(policy_fast_site_cache_keys_whole_site) {
  ferry_policy *p = from_source(
      "return { api = 1, decide = function(t)\n"
      "  local off = t.shape[0] > 2^40 or t:path() == 'a.c'\n"
      "  return off and ferry.OFFLOAD or ferry.KEEP, nil, nil, true\n"
      "end }\n");
  CHECK(p);
  char path[16] = "a.b";
  ferry_tensor_desc small = site(path, 1), big = site(path, 1 + (1ll << 41));
  ferry_context ctx = {0};
  ferry_decision out;
  for (int pass = 0; pass < 2; pass++) { /* Lua, then the cache */
    ferry_policy_decide(p, &small, &ctx, &out);
    CHECK_EQ(out.action, FERRY_KEEP);
    ferry_policy_decide(p, &big, &ctx, &out);
    CHECK_EQ(out.action, FERRY_OFFLOAD);
  }
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.calls, 2);
  CHECK_EQ(st.cache_hits, 2);
  /* the same address, another path: not the cached "a.b" */
  strcpy(path, "a.c");
  ferry_policy_decide(p, &small, &ctx, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  strcpy(path, "a.b");
  ferry_policy_decide(p, &small, &ctx, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_destroy(p);
  return 0;
}

/* The fields are compared as the engine's integers before they are shown:
 * signed ones stay negative, and every change reaches Lua. The distance
 * reports what Lua saw. */
TEST(policy_fast_fields_keep_their_signs) {
  ferry_policy *p = from_source(
      "return { api = 1, decide = function(t, ctx)\n"
      "  local d = 0\n"
      "  if t.layer == -1 then d = d + 1 end\n"
      "  if t.flags == -2147483647 then d = d + 2 end\n"
      "  if t.kind == -5 then d = d + 4 end\n"
      "  if ctx.phase == -3 then d = d + 8 end\n"
      "  if t.bytes == 3 * 2^40 then d = d + 16 end\n"
      "  if ctx.stash_depth == 7 then d = d + 32 end\n"
      "  if t.step == 2^40 and ctx.step == 2^40 then d = d + 64 end\n"
      "  return ferry.KEEP, ferry.PREFETCH, d, false\n"
      "end }\n");
  CHECK(p);
  ferry_tensor_desc d = site("x", 1);
  ferry_context ctx = {0};
  ferry_decision out;
  ferry_policy_decide(p, &d, &ctx, &out);
  CHECK_EQ(out.prefetch_distance, 0);
  d.layer = -1;
  d.flags = 0x80000001u;
  d.kind = -5;
  d.bytes = 3ull << 40;
  ctx.phase = -3;
  ctx.stash_depth = 7;
  ctx.step = 1ull << 40;
  ferry_policy_decide(p, &d, &ctx, &out);
  CHECK_EQ(out.prefetch_distance, 127);
  /* each back to its old value, one at a time */
  int bit = 1;
  int32_t *fields[] = {&d.layer, NULL, &d.kind, &ctx.phase};
  for (int i = 0; i < 4; i++, bit <<= 1) {
    if (fields[i]) *fields[i] = 0;
    else d.flags = 0;
    ferry_policy_decide(p, &d, &ctx, &out);
    CHECK_EQ(out.prefetch_distance, 127 - (2 * bit - 1));
  }
  d.bytes = 1;
  ctx.stash_depth = 0;
  ferry_policy_decide(p, &d, &ctx, &out);
  CHECK_EQ(out.prefetch_distance, 64);
  ferry_policy_destroy(p);
  return 0;
}

static int explain_of(ferry_policy *p, ferry_tensor_desc *d, ferry_decision *out, char *rule) {
  ferry_context ctx = {.step = 1};
  ferry_policy_reason why;
  ferry_policy_explain(p, d, &ctx, out, &why);
  strcpy(rule, why.rule);
  return 0;
}

/* keep_recompute() is the first rule unless recompute = "decide": R.policy
 * checks it inline, with the rule's name and cacheability. */
TEST(policy_fast_recompute_kept_inline) {
  ferry_policy *keep = from_source("local R = require 'ferry.rules'\n"
                                   "return R.policy { R.min_bytes(1024) }\n");
  ferry_policy *decide = from_source("local R = require 'ferry.rules'\n"
                                     "return R.policy { recompute = 'decide', R.min_bytes(1024) }\n");
  CHECK(keep && decide);
  char rule[128];
  ferry_decision out;
  ferry_tensor_desc fwd = site("m.a", 1), rec = site("m.b", 1), small = site("m.c", 1);
  rec.phase = FERRY_PHASE_RECOMPUTE;
  small.bytes = 512;
  explain_of(keep, &rec, &out, rule);
  CHECK_EQ(out.action, FERRY_KEEP);
  CHECK(!strcmp(rule, "keep_recompute()"));
  CHECK_EQ(out.cacheable, 1);
  explain_of(keep, &fwd, &out, rule);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  explain_of(keep, &small, &out, rule);
  CHECK_EQ(out.action, FERRY_KEEP);
  CHECK(!strcmp(rule, "min_bytes(1024)"));
  rec.module_path = "m.d";
  explain_of(decide, &rec, &out, rule);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  small.phase = FERRY_PHASE_RECOMPUTE;
  explain_of(decide, &small, &out, rule);
  CHECK_EQ(out.action, FERRY_KEEP);
  CHECK(!strcmp(rule, "min_bytes(1024)"));
  ferry_policy_destroy(keep);
  ferry_policy_destroy(decide);
  return 0;
}

/* A fraction policy freezes after two equal steps; a site the engine has not
 * cached (another shape, the same Lua site) is then answered from the
 * frozen codes: the same action and distance as the live step gave. */
TEST(policy_fast_frozen_answers_match_live) {
  ferry_policy *p = from_source("local R = require 'ferry.rules'\n"
                                "return R.policy { R.fraction(0.5), reload = R.prefetch(3) }\n");
  CHECK(p);
  enum { N = 12 };
  static char paths[N][32];
  ferry_tensor_desc d[N];
  for (int i = 0; i < N; i++) {
    snprintf(paths[i], sizeof paths[i], "model.layers.%d.mlp", i);
    d[i] = site(paths[i], 2);
  }
  ferry_decision live[N], out;
  ferry_context ctx = {0};
  int offloads = 0;
  for (int s = 1; s <= 4; s++) {
    ctx.step = (uint64_t)s;
    ferry_policy_step_begin(p, &ctx);
    for (int i = 0; i < N; i++) ferry_policy_decide(p, &d[i], &ctx, &live[i]);
  }
  for (int i = 0; i < N; i++) offloads += live[i].action == FERRY_OFFLOAD;
  CHECK_EQ(offloads, N / 2);
  ferry_policy_stats before, after;
  ferry_policy_get_stats(p, &before);
  ctx.step = 5;
  ferry_policy_step_begin(p, &ctx);
  for (int i = 0; i < N; i++) {
    d[i].shape[0] = 3; /* not in the engine's cache: Lua answers */
    ferry_policy_decide(p, &d[i], &ctx, &out);
    CHECK_EQ(out.action, live[i].action);
    CHECK_EQ(out.reload, live[i].reload);
    CHECK_EQ(out.prefetch_distance, live[i].prefetch_distance);
    CHECK_EQ(out.cacheable, 1);
  }
  ferry_policy_get_stats(p, &after);
  CHECK_EQ(after.calls - before.calls, N);
  ferry_policy_destroy(p);
  return 0;
}
