/* test_policy_snapshot.c — checkpoint snapshots: the policy's snapshot(e)
 * function, its faults and the rules library's answers. */
#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

/* ---- checkpoint snapshots: the policy's snapshot(e) function ------------- */
static ferry_snapshot_entry snap_entry(const char *key, const char *path, uint64_t bytes,
                                       int32_t index) {
  ferry_snapshot_entry e = {key, path, bytes, index, FERRY_DTYPE_F32, 1};
  return e;
}

/* The entry arrives intact; the answer (stage flag, order) comes back as
 * given; without the function everything is staged in traversal order. */
TEST(policy_snapshot_answers) {
  char path[256];
  ferry_policy *p = load_file("nosnap.lua",
      "return { api = 1, decide = function() return ferry.KEEP end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_snapshot(p), 0);
  ferry_snapshot_entry e = snap_entry("state_dict", "state_dict.w", 4096, 7);
  ferry_snapshot_choice c;
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 7.0);
  ferry_policy_destroy(p);

  p = load_file("snap.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  snapshot = function(e)\n"
      "    assert(e.path == e.key .. '.w', 'path ' .. e.path)\n"
      "    assert(e.dtype == ferry.DTYPE_F32 and e.device == true)\n"
      "    if e.key == 'optimizer_states' then return false, -e.index end\n"
      "    if e.bytes < 100 then return false end\n"
      "    return true, 1000 + e.index\n"
      "  end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_snapshot(p), 1);
  e = snap_entry("state_dict", "state_dict.w", 4096, 3);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 1003.0);
  e = snap_entry("optimizer_states", "optimizer_states.w", 1 << 20, 4);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == -4.0);
  e = snap_entry("lr_schedulers", "lr_schedulers.w", 8, 5);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == 5.0); /* no order given: the index */
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  if (s.errors) fprintf(stderr, "  %s\n", ferry_policy_last_error(p));
  CHECK_EQ(s.errors, 0);
  ferry_policy_destroy(p);
  return 0;
}

/* Faults and nonsense stage the entry in traversal order (nothing is left
 * out of a checkpoint) and are reported with file:line. */
TEST(policy_snapshot_faults_stage) {
  char path[256];
  ferry_policy *p = load_file("snapbad.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  snapshot = function(e)\n"
      "    if e.key == 'boom' then error('no such key') end\n"
      "    if e.key == 'yes' then return 'yes' end\n"
      "    if e.key == 'nan' then return false, 0/0 end\n"
      "    while e.key == 'loop' do end\n"
      "    return false, 1\n"
      "  end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  ferry_snapshot_choice c;
  ferry_snapshot_entry e = snap_entry("boom", "boom.w", 64, 2);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 2.0);
  CHECK(expect_fault(p, path, 3, "no such key") == 0);
  e = snap_entry("yes", "yes.w", 64, 3);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 3.0);
  CHECK(expect_fault(p, path, 2,
                     "snapshot returned a nonsense stage flag: string \"yes\" (expected true, "
                     "false or nil); the entry was staged") == 0);
  e = snap_entry("nan", "nan.w", 64, 4);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 4.0);
  CHECK(expect_fault(p, path, 2,
                     "snapshot returned a nonsense order: nan (expected a finite number or "
                     "nil); the entry was staged") == 0);
  e = snap_entry("loop", "loop.w", 64, 5);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK_STR_CONTAINS(ferry_policy_last_error(p), "interrupted after");
  e = snap_entry("fine", "fine.w", 64, 6);
  ferry_policy_snapshot(p, &e, &c); /* the state is usable after a fault */
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == 1.0);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 4);
  ferry_policy_destroy(p);
  return expect_load_error("snapnotfn.lua",
                           "return { api = 1, decide = function() return 0 end,\n"
                           "  snapshot = 42 }\n",
                           0, 2, "snapshot must be a function (snapshot = function(e) ... end), "
                           "got number");
}

/* R.snapshot in the rules library, and the shipped default's snapshot. */
TEST(policy_snapshot_rules_and_default) {
  char path[1024];
  ferry_policy *p = load_file("snaprules.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy { name = 'snaprules', R.min_bytes(1024),\n"
      "  snapshot = R.snapshot { keys = { 'state_dict', 'optimizer_states' },\n"
      "                          exclude_keys = 'lr_schedulers', min_bytes = 512,\n"
      "                          order = { 'optimizer_states', 'state_dict' } } }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_snapshot_choice sd, opt, small, other;
  ferry_snapshot_entry e = snap_entry("state_dict", "state_dict.w", 4096, 0);
  ferry_policy_snapshot(p, &e, &sd);
  e = snap_entry("optimizer_states", "optimizer_states.w", 4096, 1);
  ferry_policy_snapshot(p, &e, &opt);
  e = snap_entry("state_dict", "state_dict.b", 100, 2);
  ferry_policy_snapshot(p, &e, &small);
  e = snap_entry("callbacks", "callbacks.x", 4096, 3);
  ferry_policy_snapshot(p, &e, &other);
  CHECK_EQ(sd.stage, 1);
  CHECK_EQ(opt.stage, 1);
  CHECK_EQ(small.stage, 0);  /* under min_bytes */
  CHECK_EQ(other.stage, 0);  /* not among keys */
  CHECK(opt.order < sd.order); /* optimizer_states first */
  CHECK(sd.order < small.order);
  CHECK(small.order < other.order); /* keys not in order come last */
  ferry_policy_destroy(p);

  char err[1024];
  write_file(path, sizeof path, "snaprulesbad.lua",
             "local R = require 'ferry.rules'\n"
             "return R.policy { snapshot = R.snapshot { min_byte = 3 } }\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "snaprulesbad.lua:2: ferry.rules.snapshot: unknown option 'min_byte'");

  const char *slash = strrchr(__FILE__, '/');
  CHECK(slash != NULL);
  snprintf(path, sizeof path, "%.*s/../policies/default.lua", (int)(slash - __FILE__), __FILE__);
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_OK);
  CHECK_EQ(ferry_policy_has_snapshot(p), 1);
  /* documented default: every key staged, in traversal order */
  ferry_snapshot_choice a, b;
  e = snap_entry("optimizer_states", "optimizer_states.0.state.0.exp_avg", 4, 0);
  ferry_policy_snapshot(p, &e, &a);
  e = snap_entry("anything", "anything", 1, 1);
  ferry_policy_snapshot(p, &e, &b);
  CHECK_EQ(a.stage, 1);
  CHECK_EQ(b.stage, 1);
  CHECK(a.order < b.order);
  ferry_policy_destroy(p);
  return 0;
}
