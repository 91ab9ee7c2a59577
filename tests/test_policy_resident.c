/* test_policy_resident.c — optimizer states and weights: the policy's
 * resident(r) function, hand-written and from the rules library. */
#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

/* ---- optimizer states and weights: the policy's resident(r) -------------- */
static ferry_resident_entry res_entry(int kind, const char *name, int layer, uint64_t bytes,
                                      uint64_t total, int index, int count) {
  ferry_resident_entry e = {.kind = kind, .dtype = FERRY_DTYPE_BF16, .name = name,
                            .module = name, .layer = layer, .layer_count = 4, .bytes = bytes,
                            .total_bytes = total, .index = index, .count = count};
  return e;
}

/* A hand-written resident(r): its answers, the fields it sees, its reasons,
 * and faults (an error, a nonsense answer) that leave the tensor on device. */
TEST(policy_resident_hand_written) {
  char path[256];
  ferry_policy *p = load_file("resident_hand.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  resident = function(r)\n"
      "    if r.name == 'boom' then error('no') end\n"
      "    if r.name == 'odd' then return 42 end\n"
      "    if r.kind == 'weights' then return r.layer < r.layer_count / 2, 'half' end\n"
      "    return r.index + 1 == r.count and r.total_bytes == 300 and r.bytes == 100\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_resident(p), 1);
  ferry_policy_reason why;
  ferry_resident_entry e = res_entry(FERRY_RESIDENT_OPTIMIZER, "a", 0, 100, 300, 2, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 1);
  CHECK(!expect_reason(&why, "resident", path, 2));
  e.index = 1;
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  e = res_entry(FERRY_RESIDENT_WEIGHTS, "model.layers.1", 1, 10, 40, 0, 4);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 1);
  CHECK(!expect_reason(&why, "half", path, 1)); /* a name and no line: the table's */
  e.layer = 2;
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 0);
  e = res_entry(FERRY_RESIDENT_OPTIMIZER, "boom", 0, 100, 300, 2, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK(!expect_reason(&why, "fault", path, 3));
  e.name = "odd";
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK_EQ(strcmp(why.rule, "fault"), 0);
  CHECK_STR_CONTAINS(ferry_policy_last_error(p),
                     "resident returned a nonsense answer: 42 (expected true, false or nil)");
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 2);
  ferry_policy_destroy(p);

  /* without the function: the device, said so */
  p = load_file("resident_none.lua", "return { api = 1, decide = function() end }\n", 0, path,
                sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_resident(p), 0);
  e = res_entry(FERRY_RESIDENT_OPTIMIZER, "a", 0, 100, 300, 0, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK_EQ(strcmp(why.rule, "no resident function"), 0);
  ferry_policy_destroy(p);
  /* not a function: a load error naming the field */
  char err[512];
  write_file(path, sizeof path, "resident_bad.lua",
             "return { api = 1, decide = function() end, resident = 3 }\n");
  CHECK_EQ(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "resident must be a function (resident = function(r) ... end)");
  return 0;
}

/* The rules library's selectors: host_fraction picks, largest first, what
 * stays within the share (as ferry.torch.offload_optimizer's fraction=);
 * a list's first selector with an opinion decides; each names its line. */
TEST(policy_resident_rules) {
  char path[256];
  ferry_policy *p = load_file("resident_rules.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy {\n"
      "  optimizer = { R.device_below(64),\n"
      "                R.host_modules('mlp'),\n"
      "                R.host_fraction(0.5) },\n"
      "  weights = R.host_first_layers(1),\n"
      "}\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  /* largest first: 400 (attn), 300 (mlp), 200, 70, 60 (mlp, small); total 1030 */
  static const struct { const char *name; uint64_t bytes; int host; const char *rule; int line; }
      want[] = {{"model.layers.0.attn.q", 400, 1, "host_fraction(0.5)", 5},
                {"model.layers.0.mlp.up", 300, 1, "host_modules({under=mlp})", 4},
                {"model.layers.1.attn.k", 200, 0, "host_fraction(0.5)", 5},
                {"model.layers.1.attn.v", 70, 1, "host_fraction(0.5)", 5},
                {"model.layers.1.mlp.norm", 60, 0, "device_below(64)", 3}};
  for (int round = 0; round < 2; round++) /* the share starts again at index 0 */
    for (int i = 0; i < 5; i++) {
      ferry_resident_entry e =
          res_entry(FERRY_RESIDENT_OPTIMIZER, want[i].name, i < 2 ? 0 : 1, want[i].bytes, 1030, i, 5);
      ferry_policy_reason why;
      CHECK_EQ(ferry_policy_resident(p, &e, &why), want[i].host);
      CHECK(!expect_reason(&why, want[i].rule, path, want[i].line));
    }
  for (int l = 0; l < 3; l++) {
    char name[32];
    snprintf(name, sizeof name, "model.layers.%d", l);
    ferry_resident_entry e = res_entry(FERRY_RESIDENT_WEIGHTS, name, l, 100, 300, l, 3);
    ferry_policy_reason why;
    CHECK_EQ(ferry_policy_resident(p, &e, &why), l == 0);
    CHECK(!expect_reason(&why, l == 0 ? "host_first_layers(1)" : "device by default",
                         path, l == 0 ? 6 : 2));
  }
  ferry_policy_destroy(p);
  /* a misspelt selector list fails at load with the policy's line */
  char err[512];
  write_file(path, sizeof path, "resident_rules_bad.lua",
             "local R = require 'ferry.rules'\n"
             "return R.policy { optimizer = { R.host_fraction(2) } }\n");
  CHECK_EQ(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "resident_rules_bad.lua:2: ferry.rules.host_fraction: f must be within [0, 1]");
  return 0;
}
