/* test_policy_ptr_cache.c — the policy host's pointer cache (module path
 * and class pointer -> string id, direct-mapped) keeps the strings of a
 * large model each in a slot of their own, whatever their addresses'
 * stride: ferry_intern strdup's them, so they lie in arithmetic progression
 * (48 bytes apart for "model.layers.12.self_attn.q_proj"). Two strings in
 * one slot evict each other on every decision (both go the slow way:
 * hash the bytes, probe the content index). */
#include <stdint.h>

#include "../engine/src/util/util.h"
#include "ferry_tools.h"
#include "test.h"

#define PTR_CACHE_BITS 12 /* policy_internal.h's */
#define PTR_CACHE_SIZE (1 << PTR_CACHE_BITS)

/* Of n strings stride bytes apart from base, how many share a slot with
 * another. */
static int sharing(uintptr_t base, uintptr_t stride, int n) {
  static int in_slot[PTR_CACHE_SIZE];
  memset(in_slot, 0, sizeof in_slot);
  for (int i = 0; i < n; i++)
    in_slot[util_ptr_slot((const void *)(base + stride * i), PTR_CACHE_BITS)]++;
  int shared = 0;
  for (int s = 0; s < PTR_CACHE_SIZE; s++)
    if (in_slot[s] > 1) shared += in_slot[s];
  return shared;
}

/* 1000 strings (an 80-layer model's paths) in a 4096-slot cache: placed at
 * random, about 21% would share a slot. Every stride malloc can give (16
 * .. 1 KiB) must stay near that, not thrash. */
TEST(policy_ptr_cache_spreads_strided_strings) {
  const uintptr_t bases[] = {0x55d0c3a41000u, 0x7f3a12c00010u, 0x602000000010u};
  int worst = 0;
  uintptr_t worst_stride = 0;
  for (size_t b = 0; b < sizeof bases / sizeof bases[0]; b++)
    for (uintptr_t stride = 16; stride <= 1024; stride += 16) {
      int shared = sharing(bases[b], stride, 1000);
      if (shared > worst) worst = shared, worst_stride = stride;
    }
  if (worst > 330)
    fprintf(stderr, "stride %zu: %d of 1000 strings share a slot\n", (size_t)worst_stride, worst);
  CHECK(worst <= 330);
  return 0;
}

/* The cache's two slots per string (first by multiply-shift, second by
 * util_ptr_slot) answer by content: 1000 paths 1008 bytes apart (a stride
 * whose first slots collide), decided, then rewritten in place (the same
 * addresses, other paths) and decided again, the answers cached. */
TEST(policy_ptr_cache_two_slots_answer_by_content) {
  char err[512];
  ferry_policy *p = NULL;
  CHECK_RC(ferry_policy_create(NULL,
                               "return { api = 1, decide = function(t)\n"
                               "  local n = tonumber(t:path():match('%d+$'))\n"
                               "  local off = n % 2 == 1\n"
                               "  return off and ferry.OFFLOAD or ferry.KEEP, nil, nil, true\n"
                               "end }\n",
                               0, &p, err, sizeof err),
           FERRY_OK);
  enum { N = 1000, STRIDE = 1008 };
  char *buf = calloc(N, STRIDE);
  CHECK(buf);
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.ndim = 1;
  d.shape[0] = 8;
  d.bytes = 1 << 20;
  d.module_class = "Linear";
  ferry_decision out;
  for (int round = 0; round < 3; round++) {
    /* round 1 shifts every number by one: each address, the other answer */
    for (int i = 0; i < N; i++)
      snprintf(buf + (size_t)i * STRIDE, STRIDE, "m.%d", i + (round == 1));
    for (int pass = 0; pass < 2; pass++)
      for (int i = 0; i < N; i++) {
        d.module_path = buf + (size_t)i * STRIDE;
        ferry_policy_decide(p, &d, NULL, &out);
        CHECK_EQ(out.action, (i + (round == 1)) % 2 ? FERRY_OFFLOAD : FERRY_KEEP);
      }
  }
  free(buf);
  ferry_policy_destroy(p);
  return 0;
}
