/* test_policy_files.c — policies by shipped name (ferry_policy_find) and the
 * "did you mean" suggester. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

static int ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

TEST(policy_found_by_shipped_name) {
  char path[PATH_MAX], err[512] = "";
  unsetenv("FERRY_POLICY_DIR");
  CHECK_OK(ferry_policy_find("default", path, sizeof path, err, sizeof err));
  CHECK(ends_with(path, "/policies/default.lua") && access(path, R_OK) == 0);
  /* a path is taken as it is, and must exist */
  CHECK_OK(ferry_policy_find(path, path, sizeof path, err, sizeof err));
  CHECK_RC(ferry_policy_find("/nonexistent/p.lua", path, sizeof path, err, sizeof err),
           FERRY_ENOENT);
  CHECK_STR_CONTAINS(err, "policy /nonexistent/p.lua: no such file");
  /* a typo names the closest shipped policy and lists them */
  CHECK_RC(ferry_policy_find("defualt", path, sizeof path, err, sizeof err), FERRY_ENOENT);
  CHECK_STR_CONTAINS(err, "unknown policy 'defualt'; did you mean 'default'?");
  CHECK_STR_CONTAINS(err, "budget, checkpointed_inputs, default, ");
  CHECK_RC(ferry_policy_find("zzzzzzzz", path, sizeof path, err, sizeof err), FERRY_ENOENT);
  CHECK(!strstr(err, "did you mean"));
  CHECK_RC(ferry_policy_find("", path, sizeof path, err, sizeof err), FERRY_EINVAL);
  return 0;
}

TEST(policy_dir_env_comes_first) {
  char dir[] = "/tmp/ferry-policy-dir-XXXXXX", file[PATH_MAX], path[PATH_MAX], err[512];
  CHECK(mkdtemp(dir) != NULL);
  snprintf(file, sizeof file, "%s/default.lua", dir);
  FILE *f = fopen(file, "w");
  CHECK(f != NULL);
  fputs("return { api = 1, name = 'mine', decide = function() return 0 end }\n", f);
  fclose(f);
  char env[PATH_MAX + 16];
  snprintf(env, sizeof env, "/nonexistent:%s", dir);
  setenv("FERRY_POLICY_DIR", env, 1);
  int rc = ferry_policy_find("default", path, sizeof path, err, sizeof err);
  /* an engine takes the name too */
  ferry_config c = test_engine_config(NULL);
  c.policy_path = "default";
  ferry_engine *e = NULL;
  int rc_engine = ferry_engine_create(&c, &e, err, sizeof err);
  unsetenv("FERRY_POLICY_DIR");
  unlink(file);
  rmdir(dir);
  CHECK_OK(rc);
  CHECK(strcmp(path, file) == 0);
  CHECK_OK(rc_engine);
  ferry_engine_destroy(e);
  c.policy_path = "no-such-policy";
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_ENOENT);
  CHECK_STR_CONTAINS(err, "unknown policy 'no-such-policy'");
  return 0;
}

TEST(suggest_finds_typos_only) {
  static const char *const cmds[] = {"check", "sim", "trace", "run"};
  CHECK(strcmp(ferry_suggest("chek", cmds, 4), "check") == 0);
  CHECK(strcmp(ferry_suggest("sm", cmds, 4), "sim") == 0);
  CHECK(strcmp(ferry_suggest("trcae", cmds, 4), "trace") == 0);
  CHECK(ferry_suggest("deploy", cmds, 4) == NULL);
  CHECK(ferry_suggest("", cmds, 4) == NULL);
  return 0;
}
