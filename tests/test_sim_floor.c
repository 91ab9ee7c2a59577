/* test_sim_floor.c — the stall floor's instants in backward (docs/sim-model.md,
 * "Stall floor"), against a hand-computed trace. */
#include <stdio.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_four_offloads.h"

#define HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define END "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"

/* Every trace here replays one step over a 1000 B/us link, no latency. */
static sim_config floor_config(const char *policy_source) {
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = 1;
  c.policy_source = policy_source;
  return c;
}

/* Parses text and replays it under c, printing either step's error. */
static int parse_and_replay(const char *name, const char *text, const sim_config *c, sim_result *r) {
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse(name, text, strlen(text), &t, err, sizeof err);
  if (rc) {
    fprintf(stderr, "%s\n", err);
    return rc;
  }
  rc = sim_replay(t, c, r, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  sim_trace_free(t);
  return rc;
}

/* Four 100000-byte offloads with 50 us of compute after each, then the
 * loss's 4-byte scalar, which the policy keeps; a forward stash of one
 * buffer. Backward unpacks the kept scalar first (nll_loss's backward
 * reads it, as the synthesized loss does), then allocates a 300000-byte
 * transient (log_softmax's gradient) for bwd_us of compute before the
 * offloaded unpacks. Link 1000 B/us, no latency. As in test_sim.c's
 * sim_floor_holds_at_backwards_transients, copy 4 is in flight when forward
 * ends, so the step peaks at the transient: 100000 + 4 + 300000. Any
 * schedule at that peak must have copied D + K - P = 400000 + 300000 -
 * 400004 B by then (the floor takes the scalar out of K at its unpack,
 * though the replayer lets it go after the next compute: 4 bytes on the
 * safe side), with 200 us of compute since the first offload to hide it:
 * 99.996 us, plus max(0, 300 - bwd_us) for the three reloads after it. The
 * scalar's unpack before the transient changes none of this: a kept
 * tensor's bytes are in K, and nothing offloaded has come back or been let
 * go yet. A floor that stops its instants at backward's first unpack of
 * any tensor misses the transient: max(0, 300 - bwd_us). */
static const char *kept_unpack_then_transient(int bwd_us) {
  static char buf[4096];
  int n = four_offloads_50us_apart(buf, sizeof buf);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"pack\",\"t_us\":0,\"id\":5,\"step\":1,\"bytes\":4,\"dtype\":\"f32\","
                "\"shape\":[],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":-1,"
                "\"layers\":4,\"module\":\"loss\",\"decision\":\"keep\"}\n"
                "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
                "{\"ev\":\"unpack\",\"t_us\":0,\"id\":5}\n"
                "{\"ev\":\"alloc\",\"t_us\":0,\"id\":9,\"bytes\":300000,\"what\":\"loss grad\"}\n"
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":%d}\n"
                "{\"ev\":\"free\",\"t_us\":0,\"id\":9}\n",
                bwd_us);
  for (int i = 4; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n", i);
  snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_holds_past_backwards_kept_unpacks) {
  static const struct { int bwd_us; double floor; } cases[] = {{400, 99.996}, {100, 299.996}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    sim_config c = floor_config(
        "return { api = 1, name = 'stash1', knobs = { max_fwd_stash = 1, min_offload_bytes = 1 },\n"
        "  decide = function(t, ctx)\n"
        "    if t.bytes < 100000 then return ferry.KEEP end\n"
        "    return ferry.OFFLOAD, ferry.ON_USE, nil, true end }");
    sim_result r;
    CHECK_OK(parse_and_replay("kept", kept_unpack_then_transient(cases[k].bwd_us), &c, &r));
    CHECK_NEAR(r.tensors_offloaded, 4, 0);
    CHECK_NEAR(r.tensors_kept, 1, 0);
    CHECK_EQ(r.peak_saved_bytes, 400004);
    CHECK_NEAR(r.host_wait_us, 150.0, 1e-6);
    CHECK_NEAR(r.stall_us, 300.0, 1e-6);
    CHECK_NEAR(r.stall_floor_us, cases[k].floor, 1e-6);
    CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
    sim_result_free(&r);
  }
  return 0;
}

/* A checkpointed block's recompute packs a kept tensor in backward after a
 * reload. Tensor 1 (100000 B) is offloaded, a 4-byte tensor kept, tensor 2
 * (10000 B) offloaded, 110 us of compute in all; the engine frees a stash
 * buffer once its copy is done (release_when_copied), so the step peaks
 * near 110004 B. Backward reloads 1 on use (100 us of stall, no compute
 * before it), recomputes a kept 99999-byte tensor after 1 us, and reloads 2
 * (10 us) 2 us into backward: 110 us of stall. Any schedule: 1's reload
 * needs 100 us before the first unpack and both 110 us before the second,
 * 2 us into backward: 108 us. The recompute pack bounds nothing beyond
 * that: the reloads after it are 2's alone. A floor that counts the reloads
 * before such a pack twice (once as the room they took at it, once again
 * among the reloads after it) says 198 us, above the engine's own stall. */
static const char *recompute_after_reload(void) {
  static char buf[4096];
  snprintf(buf, sizeof buf, "%s",
           HDR BEGIN
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\",\"shape\":[100000],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":2,\"decision\":\"offload\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":5,\"step\":1,\"bytes\":4,\"dtype\":\"u8\",\"shape\":[4],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":2,\"decision\":\"keep\"}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":2,\"step\":1,\"bytes\":10000,\"dtype\":\"u8\",\"shape\":[10000],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":1,\"layers\":2,\"decision\":\"offload\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n"
           "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":1}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":3,\"step\":1,\"bytes\":99999,\"dtype\":\"u8\",\"shape\":[99999],"
           "\"kind\":\"activation\",\"phase\":\"recompute\",\"layer\":1,\"layers\":2,\"decision\":\"keep\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":3}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":2}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":5}\n"
           "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_counts_reloads_before_a_recompute_pack_once) {
  sim_config c = floor_config(
      "return { api = 1, name = 'stash1', knobs = { max_fwd_stash = 1, min_offload_bytes = 1 },\n"
      "  decide = function(t, ctx)\n"
      "    if t.bytes == 4 or t.bytes == 99999 then return ferry.KEEP end\n"
      "    return ferry.OFFLOAD, ferry.ON_USE, nil, true end }");
  c.release_when_copied = 1;
  sim_result r;
  CHECK_OK(parse_and_replay("recompute", recompute_after_reload(), &c, &r));
  CHECK_NEAR(r.tensors_offloaded, 2, 0);
  CHECK_NEAR(r.bytes_h2d, 110000, 0);
  CHECK_NEAR(r.stash_hits, 0, 0);
  CHECK_EQ(r.peak_saved_bytes, 110004);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 110.0, 1e-6);
  CHECK_NEAR(r.stall_floor_us, 108.0, 1e-6);
  CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
  sim_result_free(&r);
  return 0;
}

/* The GPU idles while the host catches up (sim_config.host_overhead_us:
 * 100 us a call, half before and half after it), and the link copies on.
 * Tensor 1 (100000 B) is offloaded, a 4-byte tensor kept 100 us later, by
 * when 1's copy is done and its stash buffer let go (release_when_copied);
 * then a 100000-byte transient peaks the step at 100004 B. Backward
 * prefetches 1 at its start, behind 200 us of compute. The engine stalls
 * nowhere: the copy ran while the GPU waited for the host. Any schedule at
 * that peak must have copied 1 by the transient, within the 100 us the GPU
 * spent not stalled since the offload: 0 us. A floor that hides copies
 * behind compute alone says 100 us, above the engine's stall. */
static const char *copy_behind_the_hosts_lag(void) {
  static char buf[4096];
  snprintf(buf, sizeof buf, "%s",
           HDR BEGIN
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\",\"shape\":[100000],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,\"decision\":\"offload\"}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":2,\"step\":1,\"bytes\":4,\"dtype\":\"u8\",\"shape\":[4],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,\"decision\":\"keep\"}\n"
           "{\"ev\":\"alloc\",\"t_us\":0,\"id\":9,\"bytes\":100000,\"what\":\"logits\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"free\",\"t_us\":0,\"id\":9}\n"
           "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":200}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":1}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":2}\n"
           "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_counts_the_gpus_wait_for_the_host_as_hiding_time) {
  sim_config c = floor_config(
      "return { api = 1, name = 'prefetch', knobs = { max_fwd_stash = 1, min_offload_bytes = 1 },\n"
      "  decide = function(t, ctx)\n"
      "    if t.bytes < 100000 then return ferry.KEEP end\n"
      "    return ferry.OFFLOAD, ferry.PREFETCH, 1, true end }");
  c.release_when_copied = 1;
  c.prefetch_at_backward_begin = 1;
  c.host_overhead_us = 200;
  sim_result r;
  CHECK_OK(parse_and_replay("host lag", copy_behind_the_hosts_lag(), &c, &r));
  CHECK_NEAR(r.tensors_offloaded, 1, 0);
  CHECK_NEAR(r.bytes_h2d, 100000, 0);
  CHECK_EQ(r.peak_saved_bytes, 100004);
  CHECK(r.host_bound_us >= 100.0 - 1e-6);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 0.0, 1e-6);
  CHECK_NEAR(r.stall_floor_us, 0.0, 1e-6);
  sim_result_free(&r);
  return 0;
}

/* With the optimizer offload (sim_config.optimizer_fraction) the optimizer
 * step's own transients ("optimizer: ..." allocations) hold only the
 * device's share on the device. Tensor 1 (100000 B) is offloaded and let go
 * unused (a discard: backward unpacks no offloaded tensor, so allocations
 * stay instants of the bound through the optimizer step), two 8-byte
 * tensors kept; after backward a 1000000-byte optimizer transient, half of
 * it on the device, peaks the step at 500000 B. That instant asks the
 * device to have had room for 100000 + 500000 B less the peak: 1's copy,
 * which ran long before (the engine's stall: 98 us of host waits). A
 * floor that counts the transient's full bytes sees 1000000 B where the
 * device held 500000 and says 397 us, above the engine's 98 us. */
static const char *optimizer_transient_after_a_discard(void) {
  static char buf[4096];
  snprintf(buf, sizeof buf, "%s",
           HDR
           "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":400000,\"what\":\"parameters\",\"dtype\":\"bf16\","
           "\"layer_bytes\":100000}\n"
           "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":400000,\"what\":\"gradients\",\"dtype\":\"bf16\","
           "\"transient\":true}\n"
           "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":800000,\"what\":\"master weights\",\"dtype\":\"f32\"}\n"
           "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1600000,\"what\":\"optimizer states\"}\n"
           BEGIN
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\",\"shape\":[100000],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,\"decision\":\"offload\"}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":5,\"step\":1,\"bytes\":8,\"dtype\":\"u8\",\"shape\":[8],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,\"decision\":\"keep\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"pack\",\"t_us\":0,\"id\":6,\"step\":1,\"bytes\":8,\"dtype\":\"u8\",\"shape\":[8],"
           "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":1,\"decision\":\"keep\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"discard\",\"t_us\":0,\"id\":1}\n"
           "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":6}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":5}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"backward_end\",\"t_us\":0}\n"
           "{\"ev\":\"alloc\",\"t_us\":0,\"id\":9,\"bytes\":1000000,\"what\":\"optimizer: gradients cast to fp32\"}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"free\",\"t_us\":0,\"id\":9}\n" END);
  return buf;
}

TEST(sim_floor_counts_an_optimizer_transient_at_its_device_share) {
  sim_config c = floor_config(
      "return { api = 1, name = 'out', knobs = { max_fwd_stash = 1, min_offload_bytes = 1 },\n"
      "  decide = function(t, ctx)\n"
      "    if t.bytes < 100000 then return ferry.KEEP end\n"
      "    return ferry.OFFLOAD, ferry.ON_USE, nil, true end }");
  c.optimizer_fraction = 0.5;
  sim_result r;
  CHECK_OK(parse_and_replay("optimizer", optimizer_transient_after_a_discard(), &c, &r));
  CHECK_NEAR(r.tensors_offloaded, 1, 0);
  CHECK_EQ(r.peak_saved_bytes, 500000);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 98.0, 1e-6);
  CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
  CHECK(r.stall_floor_us < 98.0);
  sim_result_free(&r);
  return 0;
}

/* One pack line of recompute_between_reloads' trace. */
static int pack_line(char *buf, size_t cap, int id, int bytes, const char *phase, const char *dec) {
  return snprintf(buf, cap,
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":%d,\"dtype\":\"u8\","
                  "\"shape\":[%d],\"kind\":\"activation\",\"phase\":\"%s\",\"layer\":0,\"layers\":1,"
                  "\"decision\":\"%s\"}\n",
                  id, bytes, bytes, phase, dec);
}

/* Tensors 1 and 2 (100000 B each) offloaded, three 4-byte ones kept, 10 us
 * of forward compute; backward computes 100 us, reloads 1 (the 4-byte
 * recompute packs let the engine free copied stash buffers, as
 * release_when_copied does at its calls), recomputes a kept 200000-byte
 * tensor, then reloads 2. The engine's stall: both reloads, 200 us; its
 * peak 300012 B. At the recompute pack the device holds 200000 B of
 * offloads plus 200012 kept, less the peak: 100 us of copies against 111
 * us of compute, nothing; with 2's reload after it (100 us, 1 us of
 * compute), 88 us. The reloads alone: 200 us by 2's unpack, 102 us into
 * backward: 98 us, the floor. 1's reload came and went before the pack,
 * so it is in neither of the pack's terms: counted once among the reloads
 * after it the floor says 188 us, twice 288 us (above the engine's 200). */
static const char *recompute_between_reloads(void) {
  static char buf[8192];
  size_t cap = sizeof buf;
  int n = snprintf(buf, cap, "%s", HDR BEGIN);
  n += pack_line(buf + n, cap - (size_t)n, 1, 100000, "forward", "offload");
  n += pack_line(buf + n, cap - (size_t)n, 2, 100000, "forward", "offload");
  for (int id = 5; id <= 7; id++) n += pack_line(buf + n, cap - (size_t)n, id, 4, "forward", "keep");
  n += snprintf(buf + n, cap - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n"
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n");
  n += pack_line(buf + n, cap - (size_t)n, 8, 4, "recompute", "keep");
  n += snprintf(buf + n, cap - (size_t)n,
                "{\"ev\":\"unpack\",\"t_us\":0,\"id\":7}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":1}\n"
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n");
  n += pack_line(buf + n, cap - (size_t)n, 9, 4, "recompute", "keep");
  n += snprintf(buf + n, cap - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":6}\n");
  n += pack_line(buf + n, cap - (size_t)n, 3, 200000, "recompute", "keep");
  snprintf(buf + n, cap - (size_t)n,
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":3}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":2}\n{\"ev\":\"compute\",\"t_us\":0,\"us\":1}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":5}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":8}\n"
           "{\"ev\":\"unpack\",\"t_us\":0,\"id\":9}\n{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_takes_only_the_reloads_after_a_recompute_pack) {
  sim_config c = floor_config(
      "return { api = 1, name = 'stash2', knobs = { max_fwd_stash = 2, min_offload_bytes = 1 },\n"
      "  decide = function(t, ctx)\n"
      "    if t.bytes ~= 100000 then return ferry.KEEP end\n"
      "    return ferry.OFFLOAD, ferry.ON_USE, nil, true end }");
  c.release_when_copied = 1;
  sim_result r;
  CHECK_OK(parse_and_replay("recompute2", recompute_between_reloads(), &c, &r));
  CHECK_NEAR(r.bytes_h2d, 200000, 0);
  CHECK_NEAR(r.stash_hits, 0, 0);
  CHECK_EQ(r.peak_saved_bytes, 300012);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 200.0, 1e-6);
  CHECK_NEAR(r.stall_floor_us, 98.0, 1e-6);
  sim_result_free(&r);
  return 0;
}
