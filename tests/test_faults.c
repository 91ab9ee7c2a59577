/* test_faults.c — seeded fault injection (config.faults): copies, events,
 * stream waits, pinned allocations and the policy fail at random, and every
 * tensor still comes back bit-identical or the caller gets an error with a
 * message (and the tensor on retry), with nothing leaked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <valgrind/valgrind.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

#define TENSORS 8
#define MAX_RETRIES 64

typedef struct rng {
  uint64_t s;
} rng;

static uint64_t next(rng *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  return r->s;
}

/* A decide callback that offloads, and at random faults or answers nonsense. */
static int chaotic_decide(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                          ferry_decision *out) {
  rng *r = ud;
  uint64_t x = next(r) % 100;
  if (x < 3) return FERRY_EPOLICY;                     /* a failing policy */
  out->action = x < 6 ? 7 : FERRY_OFFLOAD;             /* nonsense, or offload */
  out->reload = x % 2 ? FERRY_RELOAD_PREFETCH : FERRY_RELOAD_ON_USE;
  out->prefetch_distance = (int32_t)(x % 3);
  out->cacheable = 0;
  return FERRY_OK;
}

/* One engine, two steps of packing random tensors and getting them back. */
static int one_round(uint64_t seed, uint64_t *injected) {
  test_device_stats st = {0};
  rng policy_rng = {seed * 7919 + 1}, r = {seed * 104729 + 3};
  char spec[96];
  snprintf(spec, sizeof spec, "seed=%llu,copy=0.05,event=0.05,alloc=0.05",
           (unsigned long long)seed);
  ferry_config c = test_engine_config(&st);
  c.decide = chaotic_decide;
  c.decide_ud = &policy_rng;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 1; /* real reloads */
  c.host_cap_bytes = 192u << 10; /* the cap refuses some too */
  c.faults = spec;
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  for (int step = 0; step < 2; step++) {
    ferry_handle h[TENSORS] = {0};
    unsigned char *want[TENSORS];
    size_t bytes[TENSORS];
    CHECK_OK(ferry_step_begin(e));
    for (int i = 0; i < TENSORS; i++) {
      bytes[i] = 1 + next(&r) % (48u << 10);
      want[i] = malloc(bytes[i]);
      for (size_t k = 0; k < bytes[i]; k++) want[i][k] = (unsigned char)next(&r);
      test_buffer *b = test_buffer_new(bytes[i]);
      test_dev_write(b->ptr, want[i], bytes[i]);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = bytes[i];
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = (int64_t)bytes[i];
      int rc = ferry_pack(e, &d, b->ptr, b, NULL, &h[i]);
      CHECK_OK(rc); /* faults below the decision never fail a pack; b is the engine's now */
    }
    CHECK_OK(ferry_backward_begin(e));
    for (int i = TENSORS - 1; i >= 0; i--) {
      if (next(&r) % 8 == 0) { /* the saved tensor was freed unused */
        CHECK_OK(ferry_discard(e, h[i]));
        free(want[i]);
        continue;
      }
      void *p = NULL, *o = NULL;
      int rc = -1, tries = 0;
      while (rc && tries++ < MAX_RETRIES) {
        rc = ferry_unpack(e, h[i], NULL, &p, &o);
        if (rc) CHECK(ferry_last_error(e)[0] != 0); /* a clear error */
      }
      CHECK_OK(rc);
      unsigned char *got = malloc(bytes[i]);
      test_dev_read(got, p, bytes[i]);
      int same = memcmp(got, want[i], bytes[i]) == 0;
      if (!same) fprintf(stderr, "seed %llu step %d tensor %d differs\n",
                         (unsigned long long)seed, step, i);
      CHECK(same);
      free(got);
      free(want[i]);
      test_buffer_unref(o);
    }
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
  }
  *injected += ferry_faults_injected(e);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

TEST(faults_lose_nothing) {
  /* FERRY_FAULT_ROUNDS: more for soak runs; valgrind and sanitizers fewer */
  const char *env = getenv("FERRY_FAULT_ROUNDS"), *one = getenv("FERRY_FAULT_SEED");
  long rounds = env ? atol(env) : RUNNING_ON_VALGRIND ? 40 : 1500;
  long first = one ? atol(one) : 1;
  if (one) rounds = 1;
  uint64_t injected = 0;
  for (long seed = first; seed < first + rounds; seed++)
    if (one_round((uint64_t)seed, &injected)) {
      fprintf(stderr, "failed at seed %ld (FERRY_FAULT_ROUNDS to reproduce)\n", seed);
      return 1;
    }
  printf("  %ld rounds, %llu faults injected\n", rounds, (unsigned long long)injected);
  CHECK(one || injected > (uint64_t)rounds); /* the faults really happened */
  return 0;
}

TEST(faults_spec_is_checked) {
  ferry_config c = test_engine_config(NULL);
  ferry_engine *e = NULL;
  char err[256];
  c.faults = "copy=2";
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "config.faults copy 2: must be between 0 and 1");
  c.faults = "cpy=0.1";
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "unknown key \"cpy\"");
  c.faults = "seed=3,copy=1";
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ferry_engine_destroy(e);
  return 0;
}
