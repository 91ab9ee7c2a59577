/* test_policy_loading.c — the site cache, what a policy may load (the FFI
 * when trusted, ferry's library modules), a failed reload, the shipped
 * default policy and `ferry check`'s exit codes. */
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

/* cache=true answers are reused per site (path, class, shape, dtype, kind);
 * a hit gives exactly the uncached answer and does not call Lua. */
TEST(policy_site_cache) {
  char path[256];
  ferry_policy *p = load_file("cache.lua",
      "return { api = 1, decide = function(t)\n"
      "  if t:path() == 'nocache' then return ferry.OFFLOAD, ferry.ON_USE, nil, false end\n"
      "  if t:path():find('keep') then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, t.shape[1] % 7, true\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc a = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision first, again;
  ferry_policy_decide(p, &a, NULL, &first);
  ferry_policy_decide(p, &a, NULL, &again);
  CHECK_EQ(first.action, FERRY_OFFLOAD);
  CHECK_EQ(first.reload, FERRY_RELOAD_PREFETCH);
  CHECK_EQ(first.prefetch_distance, 512 % 7);
  CHECK_EQ(first.cacheable, 1);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 1);
  CHECK_EQ(s.cache_hits, 1);

  /* Same content at another address: the same site. */
  char copy[32];
  strcpy(copy, "model.a");
  ferry_tensor_desc a2 = a;
  a2.module_path = copy;
  ferry_policy_decide(p, &a2, NULL, &again);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.cache_hits, 2);

  /* The same address with other content is another site, not a stale hit. */
  strcpy(copy, "model.keep");
  ferry_policy_decide(p, &a2, NULL, &again);
  CHECK_EQ(again.action, FERRY_KEEP);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 2);

  /* Any key field changing is another site. */
  ferry_tensor_desc v[4];
  for (int i = 0; i < 4; i++) v[i] = a;
  v[0].shape[1] = 9;
  v[1].dtype = FERRY_DTYPE_F32;
  v[2].kind = FERRY_KIND_OTHER;
  v[3].module_class = "Conv";
  for (int i = 0; i < 4; i++) ferry_policy_decide(p, &v[i], NULL, &again);
  CHECK_EQ(again.action, FERRY_OFFLOAD);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 6);
  CHECK_EQ(s.cache_hits, 2);
  /* ... while fields outside the key (layer, bytes) are not. */
  ferry_tensor_desc same = a;
  same.layer = 7;
  ferry_policy_decide(p, &same, NULL, &again);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  /* The phase is in the key: a recompute pack of the same op asks Lua
   * (a policy may keep it where it offloads the forward pack), then hits. */
  same.phase = FERRY_PHASE_RECOMPUTE;
  ferry_policy_decide(p, &same, NULL, &again);
  ferry_policy_decide(p, &same, NULL, &again);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 7);
  CHECK_EQ(s.cache_hits, 4);

  /* cache=false is never cached */
  ferry_tensor_desc nc = desc_of("nocache", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_policy_decide(p, &nc, NULL, &again);
  ferry_policy_decide(p, &nc, NULL, &again);
  CHECK_EQ(again.cacheable, 0);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 9);
  CHECK_EQ(s.cache_hits, 4);
  ferry_policy_destroy(p);
  return 0;
}

TEST(policy_trusted_gets_ffi) {
  const char *text =
      "local ffi = require 'ffi'\n"
      "ffi.cdef 'int abs(int);'\n"
      "assert(ffi.C.abs(-3) == 3)\n"
      "return { api = 1, decide = function() return ferry.OFFLOAD end }\n";
  char path[256];
  ferry_policy *p = load_file("trusted.lua", text, 1, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc d = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &d, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);
  return expect_load_error("trusted.lua", text, 0, 1,
                           "module 'ffi' is only available to trusted policies");
}

/* require loads ferry's modules from the library dir, into the same
 * sandbox; errors inside a module carry the module's file:line. */
TEST(policy_require_library_modules) {
  char dir[256], mod[300], path[256];
  snprintf(dir, sizeof dir, "%s/ferry", temp_dir());
  mkdir(dir, 0700);
  snprintf(mod, sizeof mod, "ferry/helper.lua");
  write_file(path, sizeof path, mod,
             "local M = {}\nfunction M.big(t) return t.bytes >= 1024 end\n"
             "M.loads = (M.loads or 0) + 1\nreturn M\n");
  write_file(path, sizeof path, "ferry/evil.lua", "local M = {}\nio.write('x')\nreturn M\n");
  char evil[256];
  snprintf(evil, sizeof evil, "%s", path);
  write_file(path, sizeof path, "ferry/loop_a.lua", "local M = require 'ferry.loop_a'\nreturn M\n");
  setenv("FERRY_POLICY_LIBDIR", temp_dir(), 1);
  ferry_policy *p = load_file("usesmod.lua",
      "local H = require 'ferry.helper'\n"
      "assert(require 'ferry.helper' == H)\n"
      "return { api = 1, decide = function(t)\n"
      "  return H.big(t) and ferry.OFFLOAD or ferry.KEEP\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc big = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc small = desc_of("m", "M", FERRY_KIND_ACTIVATION, 16);
  ferry_decision out;
  ferry_policy_decide(p, &big, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &small, NULL, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_destroy(p);

  char err[1024], want[1024];
  write_file(path, sizeof path, "usesevil.lua",
             "local E = require 'ferry.evil'\nreturn { api = 1, decide = E }\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  snprintf(want, sizeof want, "%s:2: unknown global 'io'", evil);
  CHECK(strcmp(err, want) == 0);
  write_file(path, sizeof path, "usesloop.lua", "\nlocal L = require 'ferry.loop_a'\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  snprintf(want, sizeof want,
           "%s/ferry/loop_a.lua:1: module 'ferry.loop_a' requires itself (a require loop)",
           temp_dir());
  unsetenv("FERRY_POLICY_LIBDIR");
  if (strcmp(err, want) != 0) {
    fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", err, want);
    return 1;
  }
  return 0;
}

/* Reloading: a policy that fails to load leaves the running one intact. */
TEST(policy_failed_reload_keeps_old) {
  char path[256], err[512];
  ferry_policy *p = load_file("reload.lua",
      "return { api = 1, decide = function() return ferry.OFFLOAD end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  write_file(path, sizeof path, "reload.lua", "return { api = 1, decide = function() return\n");
  ferry_policy *next = NULL;
  CHECK_RC(ferry_policy_create(path, NULL, 0, &next, err, sizeof err), FERRY_EPOLICY);
  CHECK(next == NULL);
  CHECK_STR_CONTAINS(err, "reload.lua:2:");
  ferry_tensor_desc d = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &d, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);
  return 0;
}

/* The shipped default policy loads in the host and keeps what today's
 * offloaders keep (its rules are covered in detail by the busted specs). */
TEST(policy_shipped_default_loads) {
  char path[1024];
  const char *slash = strrchr(__FILE__, '/');
  CHECK(slash != NULL);
  snprintf(path, sizeof path, "%.*s/../policies/default.lua", (int)(slash - __FILE__), __FILE__);
  if (access(path, R_OK) != 0) {
    printf("  (no %s yet; skipped)\n", path);
    return 0;
  }
  char err[1024];
  ferry_policy *p = NULL;
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_OK);
  CHECK(strcmp(ferry_policy_name(p), "default") == 0);
  ferry_tensor_desc mlp = desc_of("model.layers.0.mlp.up_proj", "Linear", FERRY_KIND_ACTIVATION,
                                  1 << 20);
  ferry_tensor_desc head = desc_of("lm_head", "Linear", FERRY_KIND_ACTIVATION, 1 << 20);
  ferry_tensor_desc param = desc_of("model.layers.0.mlp.up_proj", "Linear",
                                    FERRY_KIND_PARAMETER, 1 << 20);
  ferry_tensor_desc tiny = desc_of("model.layers.0.mlp.up_proj", "Linear", FERRY_KIND_ACTIVATION,
                                   512);
  ferry_tensor_desc liger = desc_of("model.loss", "LigerFusedLinearCrossEntropy",
                                    FERRY_KIND_ACTIVATION, 1 << 20);
  ferry_context c = {.step = 1};
  ferry_decision out;
  ferry_policy_decide(p, &mlp, &c, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &head, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &param, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &tiny, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &liger, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  if (s.errors) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(s.errors, 0);
  ferry_policy_destroy(p);
  return 0;
}

/* `ferry check`: the CLI entry point, compiled into this runner. */
#include "../bindings/cli/cli_check.c"

TEST(policy_cli_check_exit_codes) {
  char good[256], bad[256], faulty[256];
  write_file(good, sizeof good, "check_good.lua",
             "return { api = 1, name = 'good', knobs = { max_fwd_stash = 2 },\n"
             "  decide = function(t) return t.bytes >= 1024 and ferry.OFFLOAD or ferry.KEEP,\n"
             "    ferry.ON_USE, nil, true end }\n");
  write_file(bad, sizeof bad, "check_bad.lua", "return { api = 1,\n  decide = function( }\n");
  write_file(faulty, sizeof faulty, "check_faulty.lua",
             "return { api = 1, decide = function(t)\n"
             "  if t:class() == 'SiLU' then error('no SiLU here') end\n"
             "  return ferry.KEEP end }\n");
  char *argv_good[] = {"check", "--quiet", "--layers", "2", good, NULL};
  CHECK_EQ(ferry_cli_check(5, argv_good), 0);
  char *argv_bad[] = {"check", "-q", bad, NULL};
  CHECK_EQ(ferry_cli_check(3, argv_bad), 1);
  char *argv_faulty[] = {"check", "-q", "-s", "1", faulty, NULL};
  CHECK_EQ(ferry_cli_check(5, argv_faulty), 1);
  char *argv_usage[] = {"check", NULL};
  CHECK_EQ(ferry_cli_check(1, argv_usage), 2);
  char *argv_badopt[] = {"check", "--layers", "0", good, NULL};
  CHECK_EQ(ferry_cli_check(4, argv_badopt), 2);
  return 0;
}
