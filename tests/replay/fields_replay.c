/*
 * fields_replay.c: the decisions of one policy that mixes every field t and
 * ctx show (and the shape) into its answer, over a stream of extreme facts:
 * sizes and counters at and around 2^53 and 2^64, int32 fields at their
 * limits and changing sign, flags with the top bit set, ndim out of range,
 * no ctx, steps begun between decisions. One line per decision; compared
 * across two builds by tests/replay/compare.sh, like decide_replay.c.
 *
 *   fields_replay
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

/* Each field reduced on its own (a sum of them would lose their low bits
 * to rounding) and its sign and 2^53 neighbours told apart. */
static const char *const SRC =
    "local T = {'bytes','kind','dtype','ndim','flags','layer','layer_count','phase','step'}\n"
    "local C = {'step','phase','arena_in_use','arena_cap','stash_depth','bytes_in_flight',\n"
    "           'packed_this_step','offloaded_this_step','bytes_offloaded_this_step'}\n"
    "local function f(v) return v % 65521 + (v < 0 and 7 or 0) + (v == 2^53 and 11 or 0) end\n"
    "return { api = 1, decide = function(t, ctx)\n"
    "  local s = 0\n"
    "  for _, k in ipairs(T) do s = (s * 31 + f(t[k])) % 1000003 end\n"
    "  for _, k in ipairs(C) do s = (s * 17 + f(ctx[k])) % 1000003 end\n"
    "  for i = 0, t.ndim - 1 do s = (s * 13 + f(t.shape[i])) % 1000003 end\n"
    "  s = s % 4097\n"
    "  return s % 2 == 0 and ferry.OFFLOAD or ferry.KEEP, nil, s, false\n"
    "end }\n";

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

int main(void) {
  char err[256];
  ferry_policy *p = NULL;
  if (ferry_policy_create(NULL, SRC, 0, &p, err, sizeof err) != FERRY_OK) {
    printf("policy: %s\n", err);
    return 1;
  }
  static const uint64_t U[] = {0,           1,           2,           (1ull << 53) - 1,
                               1ull << 53,  (1ull << 53) + 1, (1ull << 53) + 2, 1ull << 63,
                               UINT64_MAX,  UINT64_MAX - 1,   4096,        (1ull << 63) + 1};
  static const int32_t S[] = {0, 1, -1, INT32_MIN, INT32_MAX, 2, -2, 7};
  static const uint32_t F[] = {0, 1, 0x80000000u, 0xffffffffu, 0x7fffffffu};
#define PICK(a) a[next_rand() % (sizeof a / sizeof a[0])]
  char path[64];
  for (int i = 0; i < 20000; i++) {
    ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
    d.bytes = PICK(U);
    d.kind = PICK(S);
    d.dtype = PICK(S);
    d.ndim = (int)(next_rand() % 11) - 2;
    d.flags = PICK(F);
    d.layer = PICK(S);
    d.layer_count = PICK(S);
    d.phase = PICK(S);
    for (int k = 0; k < FERRY_MAX_DIMS; k++) d.shape[k] = (int64_t)PICK(U);
    snprintf(path, sizeof path, "m.%d", (int)(next_rand() % 5));
    d.module_path = next_rand() % 3 ? path : NULL;
    d.module_class = "C";
    ferry_context c;
    memset(&c, 0, sizeof c);
    c.step = PICK(U);
    c.phase = PICK(S);
    c.host_ram_used_pct = 50;
    c.arena_in_use = PICK(U);
    c.arena_cap = PICK(U);
    c.stash_depth = PICK(U);
    c.bytes_in_flight = PICK(U);
    c.packed_this_step = PICK(U);
    c.offloaded_this_step = PICK(U);
    c.bytes_offloaded_this_step = PICK(U);
    if (next_rand() % 4 == 0) {
      ferry_context begun;
      memset(&begun, 0, sizeof begun);
      begun.step = PICK(U);
      ferry_policy_step_begin(p, &begun);
    }
    ferry_decision out;
    ferry_policy_decide(p, &d, next_rand() % 5 ? &c : NULL, &out);
    printf("%d %d %d %d\n", i, out.action, out.prefetch_distance, out.cacheable);
  }
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  printf("calls %llu errors %llu\n", (unsigned long long)st.calls, (unsigned long long)st.errors);
  ferry_policy_destroy(p);
  return 0;
}
