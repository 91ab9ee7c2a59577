/* refuse_calls.c — linked into test builds of the examples with
 * -Wl,--wrap=<each ferry call below>: FERRY_TEST_REFUSE=NAME:K makes the
 * K-th call of NAME (e.g. ferry_pack:3) return an error without calling
 * ferry, as ferry would refuse it (taking nothing), so that the examples'
 * error paths run: every return code checked, nothing leaked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

/* 1 when this is the call of `name` that FERRY_TEST_REFUSE names */
static int refuse(const char *name, int *calls) {
  const char *spec = getenv("FERRY_TEST_REFUSE");
  size_t n = strlen(name);
  ++*calls;
  if (!spec || strncmp(spec, name, n) != 0 || spec[n] != ':') return 0;
  if (atoi(spec + n + 1) != *calls) return 0;
  fprintf(stderr, "refuse_calls: %s call %d refused\n", name, *calls);
  return 1;
}

#define WRAP(name, code, params, args)                     \
  int __real_##name params;                                \
  int __wrap_##name params;                                \
  int __wrap_##name params {                               \
    static int calls;                                      \
    if (refuse(#name, &calls)) return code;                \
    return __real_##name args;                             \
  }

WRAP(ferry_pack, FERRY_ENOMEM,
     (ferry_engine * e, const ferry_tensor_desc *d, void *p, void *o, void *s, ferry_handle *h),
     (e, d, p, o, s, h))
WRAP(ferry_unpack, FERRY_EALLOC, (ferry_engine * e, ferry_handle h, void *s, void **p, void **o),
     (e, h, s, p, o))
WRAP(ferry_step_begin, FERRY_ESTATE, (ferry_engine * e), (e))
WRAP(ferry_backward_begin, FERRY_ESTATE, (ferry_engine * e), (e))
WRAP(ferry_backward_end, FERRY_ESTATE, (ferry_engine * e), (e))
WRAP(ferry_step_end, FERRY_ELEAK, (ferry_engine * e), (e))
