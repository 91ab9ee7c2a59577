/* sim_backend_same.c — one random sequence of sim backend calls (copies
 * both ways on three streams, events recorded, queried, synchronized and
 * waited for, the clock moved plain and memory-bound, the link shared,
 * duplex and node rates changed, the counters read), printing every
 * result, every finished copy and the counters in hex floats: built
 * against two libferry builds by sim_backend_same.sh, which compares the
 * prints byte for byte. Arguments: SEED CALLS. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ferry.h"
#include "ferry_tools.h"

static unsigned long long state;
static unsigned pick(unsigned n) {
  state = state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (unsigned)(state >> 33) % n;
}

static char dev[16], host[16]; /* never read by the sim */

static void print_stats(ferry_backend *b, int k) {
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  printf("%d %a %a %a %a %a %llu %llu %llu %llu %a\n", k, st.now_us, st.stall_us,
         st.host_wait_us, st.busy_us[0], st.busy_us[1], (unsigned long long)st.copies[0],
         (unsigned long long)st.copies[1], (unsigned long long)st.bytes[0],
         (unsigned long long)st.bytes[1], st.contention_us);
}

static void print_waits(ferry_backend *b) {
  double stall, host_wait;
#ifdef HAVE_SIM_BACKEND_WAITS
  sim_backend_waits(b, &stall, &host_wait);
#else
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  stall = st.stall_us, host_wait = st.host_wait_us;
#endif
  printf("w %a %a\n", stall, host_wait);
}

static void on_copy(void *ud, int dir, double start, double end, uint64_t bytes, const void *d,
                    const void *h) {
  (void)ud, (void)d, (void)h;
  printf("copy %d %a %a %llu\n", dir, start, end, (unsigned long long)bytes);
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  state = strtoull(argv[1], NULL, 10);
  int calls = atoi(argv[2]);
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = FERRY_BACKEND_SIM;
  c.arena = FERRY_ARENA_POOL;
  c.link.d2h_bytes_per_s = 1e9 * (1 + pick(50));
  c.link.h2d_bytes_per_s = 1e9 * (1 + pick(50));
  c.link.latency_us = pick(3) ? pick(10) : 0;
  c.link.duplex = 0.5 + 0.1 * pick(6);
  ferry_backend *b = NULL;
  char err[256];
  if (ferry_backend_sim_create(&c, &b, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 2;
  }
  sim_backend_set_listener(b, on_copy, NULL);
  if (pick(2)) sim_backend_set_node(b, 1e9 * (1 + pick(60)), pick(2) ? 1e9 * (100 + pick(3000)) : 0);
  bk_stream s[3];
  bk_event *ev[4];
  int recorded[4] = {0};
  for (int i = 0; i < 3; i++) b->ops->stream_create(b, &s[i]);
  for (int i = 0; i < 4; i++) b->ops->event_create(b, &ev[i]);
  for (int k = 0; k < calls; k++) {
    unsigned op = pick(16), i = pick(3), j = pick(4);
    size_t bytes = pick(4) ? (1 + pick(1000)) * 4096 : pick(3); /* a few empty or tiny */
    switch (op) {
    case 0: case 1: b->ops->copy_d2h(b, host, dev, bytes, s[i]); break;
    case 2: case 3: b->ops->copy_h2d(b, dev, host, bytes, s[i]); break;
    case 4: b->ops->event_record(b, ev[j], pick(3) ? s[i] : NULL); recorded[j] = 1; break;
    case 5: printf("q %d\n", b->ops->event_query(b, ev[j])); break;
    case 6: if (recorded[j]) b->ops->event_synchronize(b, ev[j]); break;
    case 7: if (recorded[j]) b->ops->stream_wait_event(b, pick(2) ? s[i] : NULL, ev[j]); break;
    case 8: sim_backend_advance(b, pick(3) ? pick(200) * 0.37 : 0); break;
    case 9: sim_backend_advance_memory_bound(b, pick(300) * 0.53); break;
    case 10: {
      unsigned active[2];
      double now = sim_backend_now(b), until = pick(3) ? now + pick(100) * 0.7 : pick(2) ? INFINITY : now;
      sim_backend_share_link(b, pick(3), until, active);
      printf("a %u %u\n", active[0], active[1]);
      break;
    }
    case 11: if (!pick(4)) sim_backend_set_duplex(b, 0.3 + 0.1 * pick(7), 0.3 + 0.1 * pick(7)); break;
    case 12:
      if (!pick(4)) sim_backend_set_node(b, pick(2) ? 1e9 * (1 + pick(60)) : 0, pick(2) ? 1e9 * (100 + pick(3000)) : 0);
      break;
    case 13: print_waits(b); break;
    case 14: if (!pick(3)) b->ops->stream_synchronize(b, s[i]); break;
    case 15: printf("n %a\n", sim_backend_now(b)); break;
    }
    if (!pick(8)) print_stats(b, k);
  }
  print_stats(b, -1);
  b->ops->destroy(b);
  return 0;
}
