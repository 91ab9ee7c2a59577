/* test_list.h — the central list of C tests. X(name) registers test_name,
 * defined with TEST(name) in one of the tests/test_*.c files. ctest runs
 * each one as `ferry_tests NAME`. Keep each area's tests in its block. */
#define FERRY_TEST_LIST(X)                                                 \
  /* api: errors, version, config */                                       \
  X(errors_one_list)                                                       \
  X(version_matches_header)                                                \
  X(config_rejects_bad_values)                                             \
  /* host backend (test_backend_host.c) */                                 \
  /* @@backend_host */                                                     \
  /* arena (test_arena.c) */                                               \
  /* @@arena */                                                            \
  /* stash manager (test_stash.c) */                                       \
  /* @@stash */                                                            \
  /* trace recorder (test_trace.c) */                                      \
  /* @@trace */                                                            \
  /* cuda backend (test_backend_cuda.c) */                                 \
  /* @@cuda */                                                             \
  /* policy host (test_policy.c) */                                        \
  /* @@policy */
