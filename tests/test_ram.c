/* test_ram.c — the engine's view of host RAM comes from config.host_ram (a
 * fixed reading here), so RAM-percent rules and caps are checked on both
 * sides of known numbers, and the meminfo reader against files we write. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

typedef struct fake_ram {
  uint64_t total, avail;
  int reads; /* how often the engine or a policy asked */
} fake_ram;

static int fake_host_ram(void *ud, uint64_t *total, uint64_t *avail) {
  fake_ram *r = ud;
  r->reads++;
  *total = r->total;
  *avail = r->avail;
  return FERRY_OK;
}

/* `steps` steps of 4 packs under policy source src: the tensors offloaded,
 * and how often host RAM was read (from the engine's creation on). */
static int steps_under(const char *src, fake_ram *ram, int steps, uint64_t *offloaded,
                       int *reads) {
  ferry_config c = test_engine_config(NULL);
  c.min_offload_bytes = 0;
  c.policy_source = src;
  c.host_ram = fake_host_ram;
  c.host_ram_ud = ram;
  ferry_engine *e = NULL;
  char err[512];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ram->reads = 0;
  for (int s = 0; s < steps; s++) {
    CHECK_OK(ferry_step_begin(e));
    ferry_handle h[4];
    for (int i = 0; i < 4; i++) {
      test_buffer *b = test_buffer_new(4096);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = 4096;
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = 4096;
      CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h[i]));
    }
    void *owners[4];
    for (int i = 3; i >= 0; i--) {
      void *p;
      CHECK_OK(ferry_unpack(e, h[i], NULL, &p, &owners[i]));
    }
    CHECK_OK(ferry_step_end(e)); /* the copies are over: the buffers may go */
    for (int i = 0; i < 4; i++) test_buffer_unref(owners[i]);
  }
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  if (offloaded) *offloaded = st.tensors_offloaded;
  if (reads) *reads = ram->reads;
  ferry_engine_destroy(e);
  return 0;
}

static int offloads_under(const char *src, fake_ram *ram, uint64_t *offloaded) {
  return steps_under(src, ram, 1, offloaded, NULL);
}

TEST(ram_rules_see_the_host_ram_reading) {
  fake_ram ram = {.total = 64ull << 30, .avail = 40ull << 30}; /* 37.5% used */
  uint64_t n;
  CHECK(offloads_under("local R = require 'ferry.rules'\n"
                       "return R.policy { R.min_bytes(0), R.ram_cap(38) }\n",
                       &ram, &n) == 0);
  CHECK_EQ(n, 4); /* 37.5 < 38: offload */
  CHECK(offloads_under("local R = require 'ferry.rules'\n"
                       "return R.policy { R.min_bytes(0), R.ram_cap(37) }\n",
                       &ram, &n) == 0);
  CHECK_EQ(n, 0); /* 37.5 >= 37: keep */
  ram.avail = 60ull << 30; /* 6.25% used: now 37 lets everything through */
  CHECK(offloads_under("local R = require 'ferry.rules'\n"
                       "return R.policy { R.min_bytes(0), R.ram_cap(37) }\n",
                       &ram, &n) == 0);
  CHECK_EQ(n, 4);
  return 0;
}

/* Host RAM is read (/proc/meminfo, tens of microseconds on a VM) only for
 * whom reads it: never for a policy that does not look at
 * ctx.host_ram_used_pct, once per step for one that does (its first read
 * samples it; from then on the engine samples it at each step's begin). */
static int ram_reads_over_steps(const char *src, fake_ram *ram, int steps) {
  int reads = -1;
  return steps_under(src, ram, steps, NULL, &reads) ? -1 : reads;
}

TEST(ram_read_only_for_policies_that_read_it) {
  fake_ram ram = {.total = 64ull << 30, .avail = 40ull << 30};
  CHECK_EQ(ram_reads_over_steps("local R = require 'ferry.rules'\n"
                                "return R.policy { R.min_bytes(0) }\n", &ram, 4), 0);
  CHECK_EQ(ram_reads_over_steps("return { api = 1, decide = function(t, ctx)\n"
                                "  return ferry.KEEP, ferry.ON_USE, nil, true end }\n", &ram, 4), 0);
  CHECK_EQ(ram_reads_over_steps("local R = require 'ferry.rules'\n"
                                "return R.policy { R.min_bytes(0), R.ram_cap(90) }\n", &ram, 4), 4);
  /* a policy reading it per tensor, uncached: still once per step */
  CHECK_EQ(ram_reads_over_steps("return { api = 1, decide = function(t, ctx)\n"
                                "  if ctx.host_ram_used_pct < 90 then return ferry.OFFLOAD end\n"
                                "  return ferry.KEEP end }\n", &ram, 4), 4);
  return 0;
}

/* ram_cap's answers are cached within a step (the reading is taken once, at
 * the step's begin) and forgotten at the begin of a step where the reading
 * has crossed the cap: one engine, the RAM use changing between steps. */
TEST(ram_cap_cached_until_the_reading_crosses) {
  fake_ram ram = {.total = 64ull << 30};
  ferry_config c = test_engine_config(NULL);
  c.min_offload_bytes = 0;
  c.policy_source = "local R = require 'ferry.rules'\n"
                    "return R.policy { R.min_bytes(0), R.ram_cap(37) }\n";
  c.host_ram = fake_host_ram;
  c.host_ram_ud = &ram;
  ferry_engine *e = NULL;
  char err[512];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  /* GiB available each step: 37.5% used, the same, 6.25%, 37.5% again */
  static const uint64_t avail_gib[] = {40, 40, 60, 40, 40};
  static const uint64_t want_offloaded[] = {0, 0, 4, 0, 0};
  uint64_t offloaded_before = 0, hits_before = 0;
  for (int step = 0; step < 5; step++) {
    ram.avail = avail_gib[step] << 30;
    CHECK_OK(ferry_step_begin(e));
    ferry_handle h[4];
    for (int i = 0; i < 4; i++) {
      char path[32];
      snprintf(path, sizeof path, "model.layers.%d.mlp", i);
      test_buffer *b = test_buffer_new(4096);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = 4096;
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = 4096;
      d.module_path = path;
      d.module_class = "Linear";
      CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h[i]));
    }
    CHECK_OK(ferry_backward_begin(e));
    void *owners[4];
    for (int i = 3; i >= 0; i--) {
      void *p;
      CHECK_OK(ferry_unpack(e, h[i], NULL, &p, &owners[i]));
    }
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
    for (int i = 0; i < 4; i++) test_buffer_unref(owners[i]);
    ferry_stats st;
    CHECK_OK(ferry_get_stats(e, &st, sizeof st));
    CHECK_EQ(st.tensors_offloaded - offloaded_before, want_offloaded[step]);
    /* the second step of each reading is answered from the cache */
    if (step == 1 || step == 4) CHECK_EQ(st.policy_cache_hits - hits_before, 4);
    offloaded_before = st.tensors_offloaded;
    hits_before = st.policy_cache_hits;
  }
  ferry_engine_destroy(e);
  return 0;
}

TEST(ram_percent_cap_is_of_the_reading) {
  fake_ram ram = {.total = 1ull << 30, .avail = 1ull << 29};
  ferry_config c = test_engine_config(NULL);
  c.host_ram = fake_host_ram;
  c.host_ram_ud = &ram;
  c.host_cap_pct = 25;
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.arena_cap, 256ull << 20); /* 25% of the 1 GiB reading */
  ferry_engine_destroy(e);
  c.host_cap_bytes = 100ull << 20; /* the smaller of the two wins */
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.arena_cap, 100ull << 20);
  ferry_engine_destroy(e);
  return 0;
}

TEST(meminfo_reader_parses_and_refuses) {
  char path[] = "/tmp/ferry-meminfo-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  FILE *f = fdopen(fd, "w");
  fputs("MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    4096000 kB\n", f);
  fclose(f);
  uint64_t total = 0, avail = 0;
  CHECK_OK(ferry_host_ram_proc(path, &total, &avail));
  CHECK_EQ(total, 16384000ull * 1024);
  CHECK_EQ(avail, 4096000ull * 1024);
  f = fopen(path, "w");
  fputs("MemTotal:       16384000 kB\n", f); /* no MemAvailable */
  fclose(f);
  CHECK_RC(ferry_host_ram_proc(path, &total, &avail), FERRY_EPARSE);
  f = fopen(path, "w"); /* fields in another order, one without its unit */
  fputs("MemAvailable:    4096000 kB\nMemTotal:       16384000\n", f);
  fclose(f);
  CHECK_RC(ferry_host_ram_proc(path, &total, &avail), FERRY_EPARSE);
  f = fopen(path, "w");
  fputs("MemAvailable:    4096000 kB\nMemTotal:       16384000 kB\n", f);
  fclose(f);
  CHECK_OK(ferry_host_ram_proc(path, &total, &avail));
  CHECK_EQ(total, 16384000ull * 1024);
  CHECK_EQ(avail, 4096000ull * 1024);
  unlink(path);
  CHECK_RC(ferry_host_ram_proc(path, &total, &avail), FERRY_EIO);
  CHECK_OK(ferry_host_ram_proc(NULL, &total, &avail)); /* this machine */
  CHECK(total > (64ull << 20) && avail <= total);
  return 0;
}
