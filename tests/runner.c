/* runner.c — ferry's C test runner. `ferry_tests` runs every test,
 * `ferry_tests NAME...` runs those, `ferry_tests --list` prints the names. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "test_device.h"
#include "test_list.h"

#define DECLARE_(name) int test_##name(void);
FERRY_TEST_LIST(DECLARE_)
#undef DECLARE_

typedef struct {
  const char *name;
  int (*fn)(void);
} test_entry;

static const test_entry tests[] = {
#define ENTRY_(name) {#name, test_##name},
    FERRY_TEST_LIST(ENTRY_)
#undef ENTRY_
};
static const size_t n_tests = sizeof tests / sizeof tests[0];

int test_backend_kind(void) {
  const char *b = getenv("FERRY_TEST_BACKEND");
  if (b && strcmp(b, "cuda") == 0) return FERRY_BACKEND_CUDA;
  return FERRY_BACKEND_HOST;
}

int test_arena_kind(void) {
  const char *a = getenv("FERRY_TEST_ARENA");
  if (a && strcmp(a, "jemalloc") == 0) return FERRY_ARENA_JEMALLOC;
  if (a && strcmp(a, "pool") == 0) return FERRY_ARENA_POOL;
  return FERRY_ARENA_AUTO;
}

/* The policy host's limits as the suite was started with (valgrind's run
 * raises the wall-clock ones): each test starts from them, so a test that
 * sets and then unsets one does not hand the default to the tests after. */
static const char *const POLICY_ENV[] = {"FERRY_POLICY_DECISION_MS", "FERRY_POLICY_LOAD_MS",
                                         "FERRY_POLICY_MEM_MB", "FERRY_POLICY_ERROR_BUDGET"};
#define N_POLICY_ENV (sizeof POLICY_ENV / sizeof POLICY_ENV[0])
static char *policy_env_start[N_POLICY_ENV];

static void policy_env_save(void) {
  for (size_t i = 0; i < N_POLICY_ENV; i++) {
    const char *v = getenv(POLICY_ENV[i]);
    policy_env_start[i] = v ? strdup(v) : NULL;
  }
}

static void policy_env_restore(void) {
  for (size_t i = 0; i < N_POLICY_ENV; i++) {
    if (policy_env_start[i]) setenv(POLICY_ENV[i], policy_env_start[i], 1);
    else unsetenv(POLICY_ENV[i]);
  }
}

static int run_one(const test_entry *t) {
  policy_env_restore();
  int rc = t->fn();
  printf("%s %s\n", rc == 0 ? "ok  " : "FAIL", t->name);
  fflush(stdout);
  return rc != 0;
}

/* ctest's SKIP_RETURN_CODE for a suite whose device is absent here. */
#define EXIT_SKIPPED 77

int main(int argc, char **argv) {
  size_t failed = 0, ran = 0;
  policy_env_save();
  if (argc > 1 && strcmp(argv[1], "--list") == 0) {
    for (size_t i = 0; i < n_tests; i++) printf("%s\n", tests[i].name);
    return 0;
  }
  char why[256] = "";
  if (!test_device_ready(why, sizeof why)) {
    printf("skipped: this suite needs a device and %s\n", why);
    return EXIT_SKIPPED;
  }
  if (argc == 1) {
    for (size_t i = 0; i < n_tests; i++, ran++) failed += run_one(&tests[i]);
  } else {
    for (int a = 1; a < argc; a++) {
      size_t i = 0;
      while (i < n_tests && strcmp(tests[i].name, argv[a]) != 0) i++;
      if (i == n_tests) {
        fprintf(stderr, "ferry_tests: no test named '%s' (see --list)\n", argv[a]);
        return 2;
      }
      ran++;
      failed += run_one(&tests[i]);
    }
  }
  printf("%zu passed, %zu failed\n", ran - failed, failed);
  return failed ? 1 : 0;
}
