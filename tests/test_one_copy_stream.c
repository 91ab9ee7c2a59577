/* test_one_copy_stream.c — the policy knob one_copy_stream (ferry.h,
 * ferry_knobs.one_copy_stream): the peers that offload on one side stream
 * (torchtune's and TRL's OffloadActivations, axolotl's hidden_states
 * offload, PyTorch's ao::offload/reload ops) put a reload behind the
 * offloads issued before it. The simulator replays the real engine on the
 * sim backend, so the reload's stream is the engine's choice. */
#include <stdio.h>
#include <stddef.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"
#include "test_copy_knobs.h"
#include "test_device.h"

/* A 1000 B/us link each way, no latency, no duplex loss; 300 us of compute
 * after each event. Pack 1 (100000 B) copies over [0, 100]; pack 2 (400000
 * B) at 300 over [300, 700], and pushes 1's buffer (copied) out of the
 * one-deep stash. Backward
 * begins at 600 and unpacks 1: its reload is 100 us. Two streams: it runs
 * beside 2's offload, [600, 700], 100 us of stall. One stream: it waits for
 * 2's offload, [700, 800], 200 us of stall. Then 300 us of compute, 2 is
 * still in the stash (no reload), 300 more: 1300 us against 1400. */
TEST(sim_one_copy_stream_queues_a_reload_behind_the_offloads) {
  static const char text[] =
      TRACE_START PACK(1, 100000, 0) COMPUTE PACK(2, 400000, 1) COMPUTE BACKWARD_BEGIN UNPACK(1)
      COMPUTE UNPACK(2) COMPUTE TRACE_STOP;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("one_stream", text, strlen(text), &t, err, sizeof err));
  static const struct {
    const char *knob;
    double step, stall;
  } cases[] = {{"", 1300, 100}, {", one_copy_stream = 0", 1300, 100},
               {", one_copy_stream = 1", 1400, 200}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char src[512];
    snprintf(src, sizeof src,
             "return { api = 1, knobs = { max_fwd_stash = 1, min_offload_bytes = 1%s },\n"
             " decide = function(t, ctx)\n"
             " return ferry.OFFLOAD, ferry.ON_USE end }",
             cases[k].knob);
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.policy_source = src;
    sim_result r;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_NEAR(r.tensors_offloaded, 2, 1e-6);
    CHECK_NEAR(r.bytes_h2d, 100000, 1e-6); /* 2 was a stash hit */
    CHECK_NEAR(r.step_us, cases[k].step, 1e-6);
    CHECK_NEAR(r.stall_us, cases[k].stall, 1e-6);
    sim_result_free(&r);
  }
  /* a bad value is refused at load, naming the knob and its range */
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.policy_source = "return { api = 1,\n knobs = { one_copy_stream = 2 },\n"
                    " decide = function(t, ctx) return ferry.KEEP end }";
  sim_result r;
  CHECK(sim_replay(t, &c, &r, err, sizeof err) != 0);
  CHECK_STR_CONTAINS(err, "policy:2: knob 'one_copy_stream' must be within [0, 1], got 2");
  sim_trace_free(t);
  return 0;
}

/* policies/hidden_states.lua, axolotl's two implementations: the same
 * tensors (each block's own input, the last block's too: tiny has 4 layers,
 * T = 256, h 256, bf16, 2Th = 131072 B an input), one copy stream, two
 * copies held; the
 * non-reentrant one reloads each input when backward unpacks it, the
 * reentrant one reloads the next one ahead (prefetches) and drops a device
 * input once its copy is done (release_when_copied). */
TEST(sim_policy_hidden_states_mirrors_axolotl) {
  char path[1200];
  snprintf(path, sizeof path, "%s", __FILE__);
  char *slash = strrchr(path, '/');
  if (slash) *slash = 0;
  strncat(path, "/../policies/hidden_states.lua", sizeof path - strlen(path) - 1);
  /* the peers' knobs: one copy stream, 2 copies held while they run */
  ferry_policy *pol = NULL;
  char perr[512];
  CHECK_OK(ferry_policy_create(path, NULL, 0, &pol, perr, sizeof perr));
  ferry_policy_knobs k;
  ferry_policy_get_knobs(pol, &k);
  CHECK(k.has_one_copy_stream && k.one_copy_stream == 1);
  CHECK(k.has_max_fwd_stash && k.max_fwd_stash == 2);
  ferry_policy_destroy(pol);
  for (int reentrant = 0; reentrant <= 1; reentrant++) {
    synth_model m;
    synth_preset("tiny", &m);
    m.checkpoint = SYNTH_CKPT_FULL;
    m.ckpt_impl = reentrant ? SYNTH_CKPT_IMPL_REENTRANT : SYNTH_CKPT_IMPL_AUTO;
    sim_trace *t = NULL;
    CHECK_OK(trace_of(&m, &t));
    char err[512];
    char src[8192];
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    size_t n = fread(src, 1, sizeof src - 1, f);
    fclose(f);
    CHECK(n < sizeof src - 1); /* the whole file */
    src[n] = 0;
    if (reentrant) {
      char *knob = strstr(src, "local REENTRANT = false");
      CHECK(knob != NULL);
      memcpy(knob + strlen("local REENTRANT = "), "true; ", 6);
    }
    CHECK_OK(ferry_policy_create(NULL, src, 0, &pol, perr, sizeof perr));
    ferry_policy_get_knobs(pol, &k);
    CHECK_EQ(k.has_release_when_copied && k.release_when_copied, reentrant);
    ferry_policy_destroy(pol);
    sim_config c = {0};
    c.link = sim_hw_preset("h100")->link;
    c.steps = 3;
    c.policy_source = src;
    c.label = "hidden_states";
    sim_result r;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_EQ(r.policy_errors, 0);
    CHECK_NEAR(r.tensors_offloaded, 4, 1e-9);
    CHECK_NEAR(r.bytes_d2h, 4 * 131072.0, 1e-6);
    CHECK(reentrant ? r.prefetches > 0 : r.prefetches == 0);
    /* the non-reentrant one keeps its 2 newest inputs on the device, copied
     * or not, and uses them as they are at unpack; the reentrant one drops
     * each input once its copy is done: only the last one (no pack after
     * it) is still there when backward begins */
    CHECK_NEAR(r.bytes_h2d, (reentrant ? 3 : 2) * 131072.0, 1e-6);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

/* On the device under test (the host backend's threads, or the CUDA test
 * double with its ordering checks), a reload issued on the offloads'
 * stream still brings the bytes back, and ferry_get_knobs reports the
 * knob: two 1 MiB activations offloaded, the first's buffer pushed out of a
 * one-deep stash by the second, both unpacked in backward. */
TEST(one_copy_stream_engine_round_trips_the_bytes) {
  enum { SZ = 1 << 20 };
  for (int one = 0; one <= 1; one++) {
    char src[256];
    snprintf(src, sizeof src,
             "return { api = 1, knobs = { max_fwd_stash = 1, one_copy_stream = %d },\n"
             " decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE end }", one);
    test_device_stats st = {0};
    ferry_engine *e = NULL;
    CHECK_OK(copy_knob_engine(src, &st, 0, &e));
    ferry_knobs k;
    CHECK_OK(ferry_get_knobs(e, &k, sizeof k));
    CHECK_EQ(k.one_copy_stream, (uint32_t)one);
    static unsigned char bytes[2][SZ], back[SZ];
    test_buffer *b[2];
    ferry_handle h[2] = {0, 0};
    CHECK_OK(ferry_step_begin(e));
    for (int i = 0; i < 2; i++) {
      b[i] = test_buffer_new(SZ);
      CHECK(b[i]);
      for (size_t j = 0; j < SZ; j++) bytes[i][j] = (unsigned char)(j * 7u + (unsigned)(i + one));
      test_dev_write(b[i]->ptr, bytes[i], SZ);
      ferry_tensor_desc d = u8_activation(SZ);
      CHECK_OK(ferry_pack(e, &d, b[i]->ptr, b[i], NULL, &h[i]));
    }
    CHECK_OK(ferry_backward_begin(e));
    for (int i = 1; i >= 0; i--) {
      void *dev = NULL, *owner = NULL;
      CHECK_OK(ferry_unpack(e, h[i], NULL, &dev, &owner));
      CHECK(dev != NULL);
      test_dev_read(back, dev, SZ);
      CHECK(!memcmp(back, bytes[i], SZ));
      test_device_release_cb(&st, owner);
    }
    ferry_stats s;
    CHECK_OK(ferry_get_stats(e, &s, sizeof s));
    CHECK_EQ(s.tensors_offloaded, 2);
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
    /* ferry_pack took the test's reference to each buffer: the engine has
     * released both by now (over the stash bound, or at destroy). */
    ferry_engine_destroy(e);
  }
  return 0;
}

/* Fill the stack below the caller with a pattern, so a struct the next
 * call leaves partly unwritten shows it. */
static __attribute__((noinline)) void dirty_stack(void) {
  volatile unsigned char junk[8192];
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = 0xA5;
}

/* ferry_knobs grew to 44 bytes of fields in 48: the caller gets every byte
 * of its size defined (the tail padding zero, not the engine's stack), and
 * a caller of the previous layout (40 bytes, up to sync_copies) gets only
 * its own bytes written. */
TEST(get_knobs_fills_every_byte_of_the_callers_size) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.policy_source = "return { api = 1, knobs = { one_copy_stream = 1 },\n"
                    " decide = function(t, ctx) return ferry.KEEP end }";
  ferry_engine *e = NULL;
  char err[512] = "";
  int rc = ferry_engine_create(&c, &e, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  unsigned char raw[sizeof(ferry_knobs)];
  memset(raw, 0x5A, sizeof raw);
  dirty_stack();
  CHECK_OK(ferry_get_knobs(e, (ferry_knobs *)(void *)raw, sizeof raw));
  ferry_knobs k;
  memcpy(&k, raw, sizeof k);
  CHECK_EQ(k.one_copy_stream, 1);
  for (size_t i = offsetof(ferry_knobs, one_copy_stream) + sizeof k.one_copy_stream;
       i < sizeof raw; i++)
    CHECK_EQ(raw[i], 0);
  /* the previous ferry_knobs ended at sync_copies */
  memset(raw, 0x5A, sizeof raw);
  CHECK_OK(ferry_get_knobs(e, (ferry_knobs *)(void *)raw, offsetof(ferry_knobs, one_copy_stream)));
  for (size_t i = offsetof(ferry_knobs, one_copy_stream); i < sizeof raw; i++)
    CHECK_EQ(raw[i], 0x5A);
  ferry_engine_destroy(e);
  return 0;
}
