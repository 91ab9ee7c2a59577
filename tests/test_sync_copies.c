/* test_sync_copies.c — the policy knob sync_copies (ferry.h, FERRY_SYNC_*):
 * a synchronous copy blocks compute by exactly its copy time in the
 * simulator, and the engine really waits on the backend under test (the
 * host backend's calling thread; the CUDA test double's recorded stream
 * waits and event synchronizations). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_copy_knobs.h"
#include "test_device.h"
#include <time.h>

#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Two 100000-byte activations offloaded over a 1000 B/us link (100 us a
 * copy, no latency), 300 us of compute after each event, a 512-byte loss
 * kept. Asynchronous (stash 4, a buffer released once copied): the copies
 * [0,100] and [300,400] hide behind compute, backward reloads both on use,
 * 100 us of stall each: 6 x 300 + 200 = 2000 us. Synchronous: each offload
 * copy also stops compute for its 100 us (packs at 0 and 400), the reloads
 * stop it as before: 2200 us, exactly the two offload copies' time more;
 * "compute" counts all four waits as the compute stream's stall, "host" as
 * the host's waits. */
TEST(sim_sync_copy_blocks_compute_by_its_copy_time) {
  static const char text[] =
      TRACE_START PACK(1, 100000, 0) COMPUTE PACK(2, 100000, 1) COMPUTE PACK(3, 512, 1) COMPUTE
      BACKWARD_BEGIN UNPACK(3) COMPUTE UNPACK(2) COMPUTE UNPACK(1) COMPUTE TRACE_STOP;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("sync", text, strlen(text), &t, err, sizeof err));
  static const struct {
    const char *sync;
    double step, stall, host_wait;
  } cases[] = {{"", 2000, 200, 0}, {", sync_copies = 0", 2000, 200, 0},
               {", sync_copies = 1", 2200, 400, 0}, {", sync_copies = 2", 2200, 0, 400}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char src[512];
    snprintf(src, sizeof src,
             "return { api = 1, knobs = { max_fwd_stash = 4, release_when_copied = 1, "
             "min_offload_bytes = 1%s },\n decide = function(t, ctx)\n"
             " if t.bytes >= 65536 then return ferry.OFFLOAD, ferry.ON_USE end\n"
             " return ferry.KEEP end }",
             cases[k].sync);
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.policy_source = src;
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.tensors_offloaded, 2, 1e-6);
    CHECK_NEAR(r.bytes_h2d, 200000, 1e-6);
    CHECK_NEAR(r.step_us, cases[k].step, 1e-6);
    CHECK_NEAR(r.stall_us, cases[k].stall, 1e-6);
    CHECK_NEAR(r.host_wait_us, cases[k].host_wait, 1e-6);
    sim_result_free(&r);
  }
  /* save_on_cpu.lua's values: a bad one is refused at load, naming it */
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.policy_source = "return { api = 1,\n knobs = { sync_copies = 3 },\n"
                    " decide = function(t, ctx) return ferry.KEEP end }";
  sim_result r;
  CHECK(sim_replay(t, &c, &r, err, sizeof err) != 0);
  CHECK_STR_CONTAINS(err, "policy:2: knob 'sync_copies' must be within [0, 2], got 3");
  sim_trace_free(t);
  return 0;
}

/* An engine over the device under test whose policy offloads every tensor
 * (used on backward) with the knob sync_copies = mode; link_bytes_per_s,
 * when not 0, sets the link's speed both ways. */
static int sync_engine(int mode, test_device_stats *st, double link_bytes_per_s,
                       ferry_engine **e) {
  char src[256];
  snprintf(src, sizeof src,
           "return { api = 1, knobs = { max_fwd_stash = 4, sync_copies = %d },\n"
           " decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE end }", mode);
  return copy_knob_engine(src, st, link_bytes_per_s, e);
}

/* The engine itself waits, on the backend under test: a 2 MiB offload and
 * its reload with sync_copies 0, 1 and 2. Host backend (a 100 MB/s link):
 * the compute stream is the calling thread, so a synchronous pack returns
 * only after its copy, which cannot take less than 2 MiB / 100 MB/s. CUDA
 * double: the pack records its copy stream's wait on compute (all modes),
 * then 1 adds cudaStreamWaitEvent (compute waits for the copy) and 2
 * cudaEventSynchronize (the host waits). */
TEST(sync_copies_engine_waits_for_each_copy) {
  enum { SZ = 2 << 20 };
  for (int mode = 0; mode <= 2; mode++) {
    test_device_stats st = {0};
    ferry_engine *e = NULL;
    CHECK_OK(sync_engine(mode, &st, 100e6, &e));
    ferry_knobs k;
    CHECK_OK(ferry_get_knobs(e, &k, sizeof k));
    CHECK_EQ(k.sync_copies, (uint32_t)mode);
    test_buffer *b = test_buffer_new(SZ);
    CHECK(b);
    static unsigned char bytes[SZ], back[SZ];
    for (size_t i = 0; i < SZ; i++) bytes[i] = (unsigned char)(i * 131u + (unsigned)mode);
    test_dev_write(b->ptr, bytes, SZ);
    ferry_tensor_desc d = u8_activation(SZ);
    CHECK_OK(ferry_step_begin(e));
#ifdef FERRY_TEST_CUDA_DOUBLE
    long waits0 = cuda_double_calls("cudaStreamWaitEvent");
    long syncs0 = cuda_double_calls("cudaEventSynchronize");
#endif
    double t0 = now_us();
    ferry_handle h = 0;
    CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h));
    double took_us = now_us() - t0;
    ferry_stats s;
    CHECK_OK(ferry_get_stats(e, &s, sizeof s));
    CHECK_EQ(s.tensors_offloaded, 1);
#ifdef FERRY_TEST_CUDA_DOUBLE
    if (test_backend_kind() == FERRY_BACKEND_CUDA) {
      CHECK_EQ(cuda_double_calls("cudaStreamWaitEvent") - waits0, mode == 1 ? 2 : 1);
      CHECK_EQ(cuda_double_calls("cudaEventSynchronize") - syncs0, mode == 2 ? 1 : 0);
    }
#endif
    if (test_backend_kind() == FERRY_BACKEND_HOST && mode)
      CHECK(took_us >= SZ / 100e6 * 1e6 * 0.99); /* the copy's least time */
    CHECK_OK(ferry_backward_begin(e));
    void *dev = NULL, *owner = NULL;
    CHECK_OK(ferry_unpack(e, h, NULL, &dev, &owner));
    CHECK(dev != NULL);
    test_dev_read(back, dev, SZ);
    CHECK(!memcmp(back, bytes, SZ));
    test_device_release_cb(&st, owner);
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
    ferry_engine_destroy(e);
  }
  return 0;
}

/* What sync_copies 1 promises, checked by its effect on the CUDA double's
 * ordering rule (9: two copies touching the same bytes with nothing
 * ordering them): right after the pack, the trainer's next work on the
 * compute stream may overwrite the saved buffer, because that stream now
 * waits for the offload copy. The overwrite is an async copy on the compute
 * stream into the tensor's device buffer, issued while the double's streams
 * are paused (the offload copy still queued). With 0 it races the copy (a
 * violation, the check's own control); with 1 it is ordered after it. The
 * host backend has no streams: nothing to check there. */
TEST(sync_copies_compute_waits_before_overwriting_the_saved_buffer) {
#ifdef FERRY_TEST_CUDA_DOUBLE
  if (test_backend_kind() != FERRY_BACKEND_CUDA) return 0;
  enum { SZ = 1 << 16 };
  void *pinned = NULL;
  CHECK_EQ(cudaHostAlloc(&pinned, SZ, 0), cudaSuccess);
  memset(pinned, 0x5a, SZ);
  for (int mode = 0; mode <= 1; mode++) {
    test_device_stats st = {0};
    ferry_engine *e = NULL;
    CHECK_OK(sync_engine(mode, &st, 0, &e));
    test_buffer *b = test_buffer_new(SZ);
    CHECK(b);
    ferry_tensor_desc d = u8_activation(SZ);
    CHECK_OK(ferry_step_begin(e));
    cuda_double_clear_violations();
    cuda_double_pause_streams(1);
    ferry_handle h = 0;
    CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h));
    /* the trainer's next kernel reuses the tensor's memory, on compute */
    cudaError_t rc = cudaMemcpyAsync(b->ptr, pinned, SZ, cudaMemcpyHostToDevice, NULL);
    long violations = cuda_double_violations();
    cuda_double_pause_streams(0);
    cuda_double_drain();
    cuda_double_clear_violations();
    if (mode == 0) {
      CHECK(rc != cudaSuccess);
      CHECK(violations > 0);
    } else {
      CHECK_EQ(rc, cudaSuccess);
      CHECK_EQ(violations, 0);
    }
    CHECK_OK(ferry_discard(e, h));
    CHECK_OK(ferry_step_end(e));
    ferry_engine_destroy(e);
    test_buffer_unref(b);
  }
  CHECK_EQ(cudaFreeHost(pinned), cudaSuccess);
#endif
  return 0;
}
