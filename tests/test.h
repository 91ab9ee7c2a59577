/* test.h — the tiny assertion layer of ferry's C test runner.
 * A test is `TEST(name) { ... return 0; }`; a failed CHECK prints file:line
 * and the expression and returns 1 from the test. Register each test once in
 * test_list.h. */
#ifndef FERRY_TEST_H
#define FERRY_TEST_H

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

#define TEST(name) int test_##name(void)

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__,     \
              #cond);                                                      \
      return 1;                                                            \
    }                                                                      \
  } while (0)

#define CHECK_EQ(a, b)                                                     \
  do {                                                                     \
    long long a_ = (long long)(a), b_ = (long long)(b);                    \
    if (a_ != b_) {                                                        \
      fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", \
              __FILE__, __LINE__, #a, #b, a_, b_);                         \
      return 1;                                                            \
    }                                                                      \
  } while (0)

/* Expect a ferry call to return a given code. */
#define CHECK_RC(expr, code) CHECK_EQ((expr), (code))
#define CHECK_OK(expr) CHECK_RC((expr), FERRY_OK)

/* Expect two doubles within tol of each other. */
#define CHECK_NEAR(a, b, tol)                                              \
  do {                                                                     \
    double a_ = (a), b_ = (b);                                             \
    if (!(fabs(a_ - b_) <= (tol))) {                                       \
      fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.6f, %s = %.6f "    \
              "(tol %g)\n", __FILE__, __LINE__, #a, a_, #b, b_,            \
              (double)(tol));                                              \
      return 1;                                                            \
    }                                                                      \
  } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                    \
  do {                                                                     \
    const char *h_ = (hay);                                                \
    if (!h_ || !strstr(h_, (needle))) {                                    \
      fprintf(stderr, "%s:%d: expected \"%s\" in \"%s\"\n", __FILE__,      \
              __LINE__, (needle), h_ ? h_ : "(null)");                     \
      return 1;                                                            \
    }                                                                      \
  } while (0)

/* Which backend the engine tests run over: FERRY_TEST_BACKEND=host (default)
 * or cuda (the cuda backend, linked against the CUDA test double). */
int test_backend_kind(void);
/* FERRY_TEST_ARENA=auto|jemalloc|pool, default auto. */
int test_arena_kind(void);

#endif
