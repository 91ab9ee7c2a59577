/* test_four_offloads.h — the opening of the stall floor's hand traces
 * (test_sim_replay.c's loss_at_backward, test_sim_floor.c's
 * kept_unpack_then_transient). */
#ifndef FERRY_TEST_FOUR_OFFLOADS_H
#define FERRY_TEST_FOUR_OFFLOADS_H

#include <stdio.h>

/* Writes a trace's header and step 1's begin, then four 100000-byte
 * offloads (ids 1-4, layers 0-3 of 4) with 50 us of compute after each,
 * into buf; returns the characters written. */
static inline int four_offloads_50us_apart(char *buf, size_t cap) {
  int n = snprintf(buf, cap, "%s",
                   "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
                   "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n");
  for (int i = 1; i <= 4; i++)
    n += snprintf(buf + n, cap - (size_t)n,
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","
                  "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
                  "\"layers\":4,\"decision\":\"offload\"}\n{\"ev\":\"compute\",\"t_us\":0,\"us\":50}\n",
                  i, i - 1);
  return n;
}

#endif
