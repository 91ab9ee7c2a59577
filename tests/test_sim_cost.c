/* test_sim_cost.c — the simulator's cost terms beyond the link alone, each
 * against a hand-computed trace (docs/sim-model.md, "Time model"):
 * copy/compute contention on device memory, and node sharing of host
 * memory bandwidth. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

#define HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define END "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"
#define PACK(id, bytes)                                                                     \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":1,\"bytes\":" #bytes ",\"dtype\":\"u8\"," \
  "\"shape\":[" #bytes "],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"          \
  "\"layers\":1,\"decision\":\"offload\"}\n"
/* 1000 us of work at 1 TFLOP/s and 1000 B/us of device memory: a
 * memory-bound kernel (1e6 bytes, no FLOPs) or a compute-bound one */
#define MEM_KERNEL "{\"ev\":\"compute\",\"t_us\":0,\"us\":1,\"hbm_bytes\":1e6}\n"
#define FLOP_KERNEL "{\"ev\":\"compute\",\"t_us\":0,\"us\":1,\"flops\":1e9}\n"
#define UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"

static const char *offload_big =
    "return { api = 1, knobs = { min_offload_bytes = 1 },\n decide = function(t, ctx)\n"
    " if t.bytes >= 65536 then return ferry.OFFLOAD, ferry.ON_USE end\n"
    " return ferry.KEEP end }";

/* A 1e6-byte offload over a 1000 B/us link (1000 us, no latency) beside a
 * memory-bound kernel of 1000 us: with copies taking their bytes/s as a
 * share of 10000 B/us of device memory (10%), the kernel progresses at 0.9
 * while the copy runs ([0, 1000]: 900 us of its work) and does its last
 * 100 us alone, ending at 1100. The rest of the step (a kept pack, three
 * compute-bound kernels of 1000 us, the offloaded tensor a stash hit in
 * backward) adds 3000 us: 4100, against 4000 without contention, and 4000
 * with contention when the kernel beside the copy is compute-bound. A
 * memory-bound kernel that starts as the copy ends (after a compute-bound
 * one covering it) is not slowed: 5000, no contention. */
TEST(sim_copy_slows_a_concurrent_memory_bound_kernel) {
  static const char *first[3] = {MEM_KERNEL, FLOP_KERNEL, FLOP_KERNEL MEM_KERNEL};
  static const struct {
    int kernel;
    double hbm, step, contention;
  } cases[] = {{0, 1e10, 4100, 100}, {0, 0, 4000, 0}, {1, 1e10, 4000, 0}, {0, 2e10, 4050, 50},
                 {2, 1e10, 5000, 0}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char text[2048];
    snprintf(text, sizeof text,
             HDR BEGIN PACK(1, 1000000) "%s" PACK(2, 512) FLOP_KERNEL
             "{\"ev\":\"backward_begin\",\"t_us\":0}\n" UNPACK(2) FLOP_KERNEL UNPACK(1) FLOP_KERNEL
             "{\"ev\":\"backward_end\",\"t_us\":0}\n" END,
             first[cases[k].kernel]);
    sim_trace *t = NULL;
    char err[512];
    CHECK_OK(sim_trace_parse("contention", text, strlen(text), &t, err, sizeof err));
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.tflops = 1;
    c.hbm_bytes_per_s = 1e9;
    c.contention_hbm_bytes_per_s = cases[k].hbm;
    c.policy_source = offload_big;
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.tensors_offloaded, 1, 1e-6);
    CHECK_NEAR(r.stall_us, 0, 1e-6);
    CHECK_NEAR(r.step_us, cases[k].step, 1e-6);
    CHECK_NEAR(r.contention_us, cases[k].contention, 1e-6);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

/* Node sharing: a GPU's copies of both directions together get at most its
 * share of the host's memory bandwidth. Two 1e6-byte offloads over a 1000
 * B/us link each way (no latency, duplex 1), 1000 us of compute between
 * them, the first buffer released once copied: the first copy [0, 1000],
 * the second from 1000 while backward's first unpack reloads the first at
 * once. Alone on the node both take 1000 us (step 2000: 1000 of compute, a
 * 1000 us reload stall; the second tensor is then a stash hit). With 8
 * GPUs copying at once over 8000 B/us of host memory (1000 B/us each), the
 * two directions together get 1000 B/us, 500 each: both end at 3000. At
 * 2000 B/us each there is room for both: 2000 again. */
TEST(sim_gpus_of_a_node_share_host_memory_bandwidth) {
  static const char text[] =
      HDR BEGIN PACK(1, 1000000) "{\"ev\":\"compute\",\"t_us\":0,\"us\":1000}\n" PACK(2, 1000000)
      "{\"ev\":\"backward_begin\",\"t_us\":0}\n" UNPACK(1) UNPACK(2)
      "{\"ev\":\"backward_end\",\"t_us\":0}\n" END;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("node", text, strlen(text), &t, err, sizeof err));
  static const struct {
    double host_mem, step, stall;
  } cases[] = {{0, 2000, 1000}, {1e9, 3000, 2000}, {2e9, 2000, 1000}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.host_mem_bytes_per_s = cases[k].host_mem;
    c.policy_source = "return { api = 1, knobs = { min_offload_bytes = 1, release_when_copied = 1 },\n"
                      " decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE end }";
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.tensors_offloaded, 2, 1e-6);
    CHECK_NEAR(r.bytes_h2d, 1000000, 1e-6);
    CHECK_NEAR(r.step_us, cases[k].step, 1e-6);
    CHECK_NEAR(r.stall_us + r.host_wait_us, cases[k].stall, 1e-6);
    sim_result_free(&r);
  }
  sim_trace_free(t);
  return 0;
}

/* The host's cost per saved tensor (sim_config.host_overhead_us), on the
 * host's own timeline: 100 us per tensor, 50 at its pack and 50 at its
 * unpack. Two kept tensors, packed then unpacked with a kernel after each
 * call: with 1000 us kernels the host stays ahead and only the first
 * kernel waits for it (50 us: 4050 against 4000); with 10 us kernels the
 * GPU waits for the host at every kernel (50, then 40 three times: 210
 * against 40). The baseline (no policy: no hooks) pays nothing. */
TEST(sim_host_overhead_counts_only_when_the_host_falls_behind) {
  static const struct {
    int us;
    double overhead, step, bound;
    int baseline;
  } cases[] = {{1000, 100, 4050, 50, 0}, {1000, 0, 4000, 0, 0}, {10, 100, 210, 170, 0},
               {10, 0, 40, 0, 0}, {10, 100, 40, 0, 1}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char text[2048], kernel[96];
    snprintf(kernel, sizeof kernel, "{\"ev\":\"compute\",\"t_us\":0,\"us\":%d}\n", cases[k].us);
    snprintf(text, sizeof text,
             HDR BEGIN PACK(1, 512) "%s" PACK(2, 512) "%s{\"ev\":\"backward_begin\",\"t_us\":0}\n"
             UNPACK(2) "%s" UNPACK(1) "%s{\"ev\":\"backward_end\",\"t_us\":0}\n" END,
             kernel, kernel, kernel, kernel);
    sim_trace *t = NULL;
    char err[512];
    CHECK_OK(sim_trace_parse("host", text, strlen(text), &t, err, sizeof err));
    sim_config c = {0};
    c.link = (ferry_link){1e9, 1e9, 0, 1.0};
    c.steps = 1;
    c.host_overhead_us = cases[k].overhead;
    if (!cases[k].baseline) c.policy_source = offload_big;
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, cases[k].step, 1e-6);
    CHECK_NEAR(r.host_bound_us, cases[k].bound, 1e-6);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

/* A reload stall makes only the GPU wait (issue 42 item 2): the host, 50
 * us per call, runs on. Tensor 1 (1e6 bytes, 1000 us a copy) is offloaded
 * with no forward stash, so its pack waits for the copy (host and GPU at
 * 1000; the host then at 1050), tensor 2 is kept, 10 us kernels: the GPU
 * waits 50 and 40 for the host in forward (1110), backward's reload of 1
 * stalls the GPU 1000 us (2110) while the host stands at 1150, and the
 * last two kernels find the host ahead: 2130, 90 us of it the host's. One
 * clock for both would put the host at 2160 after that stall and the
 * step at 2230. */
TEST(sim_host_runs_ahead_through_a_reload_stall) {
  static const char text[] =
      HDR BEGIN PACK(1, 1000000) "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n" PACK(2, 512)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n"
      UNPACK(1) "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n" UNPACK(2)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":10}\n{\"ev\":\"backward_end\",\"t_us\":0}\n" END;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("lead", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = 1;
  c.host_overhead_us = 100;
  c.policy_source = "return { api = 1, knobs = { min_offload_bytes = 1, max_fwd_stash = 0 },\n"
                    " decide = function(t, ctx)\n"
                    " if t.bytes >= 65536 then return ferry.OFFLOAD, ferry.ON_USE end\n"
                    " return ferry.KEEP end }";
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.host_wait_us, 1000, 1e-6);
  CHECK_NEAR(r.stall_us, 1000, 1e-6);
  CHECK_NEAR(r.host_bound_us, 90, 1e-6);
  CHECK_NEAR(r.step_us, 2130, 1e-6);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* `ferry sim --gpus-per-node N --numa-far F --contention on|off` on the
 * presets (docs/hardware.md, "Node sharing"): h100's GPUs each have their
 * own switch and share 600 GB/s of host memory, 75 GB/s each with 8
 * copying; a100's two GPUs per switch halve its 25 GB/s link with 2 or
 * more; a NUMA-far factor multiplies the link; contention takes the
 * preset's datasheet HBM bandwidth; a count past the node is refused. */
TEST(sim_node_apply_shares_the_presets_node) {
  char err[256];
  sim_config c = {0};
  const sim_hw *h100 = sim_hw_preset("h100"), *a100 = sim_hw_preset("a100");
  CHECK(h100 && a100);
  c.link = h100->link;
  CHECK_OK(sim_node_apply(h100, 8, 1.0, 1, &c, err, sizeof err));
  CHECK_NEAR(c.link.h2d_bytes_per_s, 55e9, 1e-6);
  CHECK_NEAR(c.host_mem_bytes_per_s, 75e9, 1e-6);
  CHECK_NEAR(c.contention_hbm_bytes_per_s, 3350e9, 1e-6);
  c.link = a100->link;
  CHECK_OK(sim_node_apply(a100, 8, 0.5, 0, &c, err, sizeof err));
  CHECK_NEAR(c.link.d2h_bytes_per_s, 25e9 / 2 * 0.5, 1e-6);
  CHECK_NEAR(c.host_mem_bytes_per_s, 409.6e9 / 8, 1e-6);
  CHECK_NEAR(c.contention_hbm_bytes_per_s, 0, 1e-6);
  c.link = a100->link;
  CHECK_OK(sim_node_apply(a100, 1, 1.0, 1, &c, err, sizeof err));
  CHECK_NEAR(c.link.d2h_bytes_per_s, 25e9, 1e-6);
  CHECK(sim_node_apply(h100, 9, 1.0, 1, &c, err, sizeof err) != 0);
  CHECK_STR_CONTAINS(err, "--gpus-per-node 9: h100 has 8 GPU(s) per node");
  CHECK(sim_node_apply(h100, 1, 0.0, 1, &c, err, sizeof err) != 0);
  CHECK_STR_CONTAINS(err, "--numa-far 0");
  return 0;
}
