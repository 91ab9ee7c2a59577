/* test_sim_comm.c — the simulator's communication lanes (issue 42 item 9):
 * the synthesizer's collectives and their bytes, and the replay's lanes
 * (exposed time within a node and across nodes, the NIC sharing the PCIe
 * link with an offload copy, tensor parallelism's synchronous exchanges),
 * each against a hand computation. docs/sim-model.md, "Collectives". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_synth.h"

/* Collectives of step 1 of kind/group: how many, and their bytes. */
static int count_colls(const sim_trace *t, int kind, int group, uint64_t *bytes) {
  int n = 0;
  *bytes = 0;
  const trace_step *s = &t->steps[0];
  for (uint32_t k = s->first; k < s->end; k++) {
    const trace_ev *ev = &t->events[k];
    if (ev->type != TEV_COLLECTIVE) continue;
    const trace_collective *c = &t->collectives[ev->tensor];
    if (c->kind != kind || c->group != group) continue;
    n++;
    *bytes += c->bytes;
  }
  return n;
}

/* Llama 3 8B's block: q and o 4096 x 4096, k and v 4096 x 1024, three MLP
 * linears 4096 x 14336, two norms of 4096: 218,112,000 parameters. The
 * root module's units (torchtitan wraps them apart): the embedding, 128256
 * x 4096 = 525,336,576; the final norm (RMSNorm: a weight of 4096) with
 * the head, 525,340,672 (the model 8,030,261,248 parameters, Meta's count). */
#define LLAMA8B_BLOCK_PARAMS 218112000ull
#define LLAMA8B_EMBED_PARAMS 525336576ull
#define LLAMA8B_HEAD_PARAMS 525340672ull

/* FSDP over 8 GPUs on one node (NVLink, 360 GB/s): the synthesizer gathers
 * every block twice (forward, backward: 436,224,000 B of bf16 each), the
 * embedding twice and the norm with the head once (not resharded after
 * forward: torchtitan's apply_fsdp), and reduce-scatters each unit's bf16
 * gradients once: 67 gathers and 34 reduce-scatters (on 3a2b73d 64 and 32:
 * the root's units were gathered in memory but missing from the lane).
 * Prefetched one unit ahead, the blocks' gathers hide under the blocks'
 * compute: a gather moves 7/8 of 436 MB, 1.06 ms at 360 GB/s, against a
 * block's forward of about 12 ms. Exposed: the embedding's gather at the
 * step's start (7/8 of 1.05 GB, 2.55 ms) and the last reduce-scatter:
 * under 1% of the step. */
TEST(sim_comm_fsdp_single_node_hides_gathers) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  uint64_t ag = 0, rs = 0;
  const uint64_t P = LLAMA8B_BLOCK_PARAMS, E = LLAMA8B_EMBED_PARAMS, H = LLAMA8B_HEAD_PARAMS;
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_GATHER, SIM_GROUP_SHARD, &ag), 2 * 32 + 3);
  CHECK_EQ(count_colls(t, SIM_COLL_REDUCE_SCATTER, SIM_GROUP_SHARD, &rs), 32 + 2);
  CHECK_EQ(ag, (2 * 32 * P + 2 * E + H) * 2);
  CHECK_EQ(rs, (32 * P + E + H) * 2);
  CHECK_EQ(t->collectives[0].ranks, 8);
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config c = {0};
  c.link = hw->link;
  c.tflops = hw->peak_tflops * SIM_DEFAULT_MFU;
  c.hbm_bytes_per_s = hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION;
  c.steps = 2;
  c.comm_nodes = 1;
  c.nvlink_bytes_per_s = hw->nvlink_bytes_per_s;
  c.nic_bytes_per_s = hw->nic_bytes_per_s;
  char err[512];
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.comm_count, 101, 0);
  const double moved = (double)(ag + rs) * 7 / 8;
  CHECK_NEAR(r.comm_bytes, moved, 1);
  /* the lanes were busy that many bytes at 360 GB/s */
  CHECK_NEAR(r.comm_us, moved / 360e3, 1);
  CHECK(r.comm_exposed_us < 0.01 * r.step_us);
  /* the embedding's gather, before anything runs, is exposed whole */
  CHECK(r.comm_exposed_us >= 2.0 * E * 7 / 8 / 360e3);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

#define T_HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define T_BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define T_END "{\"ev\":\"step_end\",\"t_us\":0,\"step\":1}\n"
#define T_EV(name) "{\"ev\":\"" name "\",\"t_us\":0}\n"
#define T_WORK(us) "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us "}\n"
#define T_COLL(id, op, bytes, ranks, what)                                                     \
  "{\"ev\":\"collective\",\"t_us\":0,\"id\":" #id ",\"op\":\"" op "\",\"bytes\":" #bytes        \
  ",\"ranks\":" #ranks ",\"what\":\"" what "\"}\n"
#define T_WAIT(id) "{\"ev\":\"collective_wait\",\"t_us\":0,\"id\":" #id "}\n"
#define T_PACK(id, bytes)                                                                        \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":1,\"bytes\":" #bytes                      \
  ",\"dtype\":\"u8\",\"shape\":[" #bytes "],\"kind\":\"activation\",\"phase\":\"forward\","      \
  "\"layer\":0,\"layers\":1,\"decision\":\"offload\"}\n"
#define T_UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"

static const char *const offload_all =
    "return { api = 1, name = 'all', knobs = { min_offload_bytes = 1 },\n"
    "  decide = function(t, ctx) return ferry.OFFLOAD end }";

static int replay_text(const char *text, const sim_config *c, sim_result *r) {
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("comm", text, strlen(text), &t, err, sizeof err);
  if (!rc) rc = sim_replay(t, c, r, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  sim_trace_free(t);
  return rc;
}

/* One gather of 4,000,000 B over 2 ranks (2,000,000 B on the wire) issued
 * at 0, 1000 us of compute, then the compute waits for it, then 1000 us
 * more. One node, NVLink 10 GB/s: 200 us, hidden: step 2000 us, nothing
 * exposed. Two nodes, NIC 1 GB/s (the PCIe link far faster): 2000 us, of
 * which the compute waits 1000: step 3000 us. Bandwidth 0: untimed. */
TEST(sim_comm_multi_node_exposes_computed_time) {
  static const char text[] = T_HDR T_BEGIN T_COLL(1, "all_gather", 4000000, 2, "shard")
      T_WORK(1000) T_WAIT(1) T_WORK(1000) T_EV("backward_begin") T_EV("backward_end") T_END;
  sim_config c = {0};
  c.link = (ferry_link){1e12, 1e12, 0, 1.0};
  c.warmup = -1;
  c.nvlink_bytes_per_s = 10e9, c.nic_bytes_per_s = 1e9;
  sim_result one, two, free_;
  c.comm_nodes = 1;
  CHECK_OK(replay_text(text, &c, &one));
  c.comm_nodes = 2;
  CHECK_OK(replay_text(text, &c, &two));
  c.nvlink_bytes_per_s = 0, c.nic_bytes_per_s = 0;
  /* an untimed NIC: no time, and no share of a (slow) PCIe link either */
  c.link = (ferry_link){1e6, 1e6, 0, 1.0};
  CHECK_OK(replay_text(text, &c, &free_));
  CHECK_NEAR(one.step_us, 2000, 1e-6);
  CHECK_NEAR(one.comm_exposed_us, 0, 1e-6);
  CHECK_NEAR(one.comm_us, 200, 1e-6);
  CHECK_NEAR(one.comm_bytes, 2000000, 0);
  CHECK_NEAR(two.step_us, 3000, 1e-6);
  CHECK_NEAR(two.comm_exposed_us, 1000, 1e-6);
  CHECK_NEAR(two.comm_us, 2000, 1e-6);
  CHECK_NEAR(two.stall_us, 0, 0); /* not an offload stall */
  CHECK_NEAR(free_.step_us, 2000, 1e-6);
  sim_result_free(&one);
  sim_result_free(&two);
  sim_result_free(&free_);
  return 0;
}

/* Across nodes the NIC's traffic crosses the GPU's PCIe link. The link is
 * 1 GB/s each way (duplex 1, no latency), the NIC 1 GB/s. A tensor of
 * 1,000,000 B is offloaded at 0 and a gather with 1,000,000 B on the wire
 * (2,000,000 over 2 ranks) is issued beside it: they share the D2H
 * direction, 0.5 GB/s each, and both end at 2000 us (alone, 1000 us each).
 * The compute runs 10 us and waits for the gather: 1990 us exposed. On one
 * node (NVLink 1 GB/s, no PCIe) each takes 1000 us: 990 exposed, and the
 * copy ends at 1000. */
TEST(sim_comm_nic_shares_pcie_with_offload_copies) {
  static const char text[] = T_HDR T_BEGIN T_PACK(1, 1000000)
      T_COLL(2, "all_gather", 2000000, 2, "shard") T_WORK(10) T_WAIT(2) T_WORK(5000)
          T_EV("backward_begin") T_UNPACK(1) T_EV("backward_end") T_END;
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.warmup = -1;
  c.policy_source = offload_all;
  c.timeline = 1;
  c.nvlink_bytes_per_s = 1e9, c.nic_bytes_per_s = 1e9;
  for (int nodes = 1; nodes <= 2; nodes++) {
    c.comm_nodes = (uint32_t)nodes;
    sim_result r;
    CHECK_OK(replay_text(text, &c, &r));
    const double both = nodes == 2 ? 2000 : 1000;
    CHECK_NEAR(r.comm_exposed_us, both - 10, 1e-6);
    int found = 0;
    for (size_t i = 0; i < r.tl.n_iv; i++) {
      const sim_interval *iv = &r.tl.iv[i];
      if (iv->lane != 1) continue; /* the D2H copy */
      CHECK_NEAR(iv->t1 - iv->t0, both, 1e-6);
      found++;
    }
    CHECK_EQ(found, 1);
    sim_result_free(&r);
  }
  return 0;
}

/* Tensor parallelism's exchanges are on the critical path. By hand: an
 * all-reduce of 1,000,000 B over 4 ranks moves 2 x 3/4 of it, 1,500,000 B,
 * at 1 GB/s: 1500 us on top of 1000 us of compute. And the synthesizer's
 * Llama 3 8B under tp 8 (no FSDP): per block two all-reduces in forward and
 * two in backward of (1, 8192, 4096) bf16 = 67,108,864 B, each moving
 * 2 x 7/8 of it at 360 GB/s: 128 x 117,440,512 B / 360 GB/s = 41.757 ms
 * more step than with the exchanges untimed. Sequence parallelism sends the
 * same bytes as a reduce-scatter and an all-gather. */
TEST(sim_comm_tensor_parallel_adds_its_time) {
  static const char text[] = T_HDR T_BEGIN T_WORK(1000) T_COLL(1, "all_reduce", 1000000, 4, "tp")
      T_WAIT(1) T_EV("backward_begin") T_EV("backward_end") T_END;
  sim_config c = {0};
  c.link = (ferry_link){1e12, 1e12, 0, 1.0};
  c.warmup = -1;
  c.nvlink_bytes_per_s = 1e9;
  c.comm_nodes = 2; /* tensor parallelism stays within a node: NVLink */
  sim_result r;
  CHECK_OK(replay_text(text, &c, &r));
  CHECK_NEAR(r.step_us, 2500, 1e-6);
  CHECK_NEAR(r.comm_exposed_us, 1500, 1e-6);
  sim_result_free(&r);

  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1, m.tp = 8;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  uint64_t ar = 0, ag = 0;
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_REDUCE, SIM_GROUP_TP, &ar), 4 * 32);
  CHECK_EQ(ar, 4 * 32 * 67108864ull);
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_GATHER, SIM_GROUP_SHARD, &ag), 0);
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config s = {0};
  s.link = hw->link;
  s.tflops = hw->peak_tflops * SIM_DEFAULT_MFU;
  s.steps = 1;
  s.warmup = -1;
  s.comm_nodes = 1;
  sim_result untimed, timed;
  char err[512];
  CHECK_OK(sim_replay(t, &s, &untimed, err, sizeof err));
  s.nvlink_bytes_per_s = 360e9;
  CHECK_OK(sim_replay(t, &s, &timed, err, sizeof err));
  const double hand_us = 128.0 * 117440512.0 / 360e3;
  CHECK_NEAR(timed.step_us - untimed.step_us, hand_us, 0.01);
  CHECK_NEAR(timed.comm_exposed_us, hand_us, 0.01);
  sim_result_free(&untimed);
  sim_result_free(&timed);
  sim_trace_free(t);
  /* sequence parallelism: a reduce-scatter and an all-gather for each */
  m.sp = 1;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(count_colls(t, SIM_COLL_REDUCE_SCATTER, SIM_GROUP_TP, &ar), 4 * 32);
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_GATHER, SIM_GROUP_TP, &ag), 4 * 32);
  sim_trace_free(t);
  return 0;
}

/* Full activation checkpointing runs a block's forward again before its
 * backward, its row-parallel linears included, so their two exchanges of the
 * activations happen again (Megatron's full recompute, torchtitan's full AC:
 * the collectives are inside the checkpointed region). By hand, Llama 3 8B,
 * tp 8: per checkpointed block 2 (forward) + 2 (recompute) + 2 (backward)
 * all-reduces of 67,108,864 B; --checkpoint full: 6 x 32 = 192; full:4
 * checkpoints blocks 4, 8, ..., 32: 4 x 32 + 2 x 8 = 144. With --sp on each
 * is a reduce-scatter and an all-gather. */
TEST(sim_comm_full_recompute_repeats_tensor_parallel_exchanges) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1, m.tp = 8;
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_every = 1;
  sim_trace *t = NULL;
  uint64_t bytes = 0;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_REDUCE, SIM_GROUP_TP, &bytes), 6 * 32);
  CHECK_EQ(bytes, 6 * 32 * 67108864ull);
  sim_trace_free(t);
  m.ckpt_every = 4;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_REDUCE, SIM_GROUP_TP, &bytes), 4 * 32 + 2 * 8);
  sim_trace_free(t);
  m.ckpt_every = 1, m.sp = 1;
  CHECK_OK(trace_of(&m, &t));
  CHECK_EQ(count_colls(t, SIM_COLL_REDUCE_SCATTER, SIM_GROUP_TP, &bytes), 6 * 32);
  CHECK_EQ(count_colls(t, SIM_COLL_ALL_GATHER, SIM_GROUP_TP, &bytes), 6 * 32);
  sim_trace_free(t);
  return 0;
}

/* Bad collectives are refused with the line and the problem. */
TEST(sim_comm_trace_errors) {
  static const struct {
    const char *text, *want;
  } cases[] = {
      {T_HDR T_BEGIN T_COLL(1, "broadcast", 10, 2, "shard") T_END, "is not all_gather"},
      {T_HDR T_BEGIN T_COLL(1, "all_gather", 10, 2, "dp") T_END, "is not shard, tp or cp"},
      {T_HDR T_BEGIN T_COLL(1, "all_gather", 10, 1, "shard") T_END, "ranks"},
      {T_HDR T_BEGIN T_WAIT(3) T_END, "before its collective"},
      {T_HDR T_BEGIN T_COLL(1, "all_gather", 10, 2, "shard") T_WAIT(1) T_WAIT(1) T_END,
       "given twice"},
      {T_HDR T_BEGIN T_COLL(1, "all_gather", 10, 2, "shard") T_COLL(1, "all_gather", 10, 2, "shard")
           T_END,
       "given twice"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sim_trace *t = NULL;
    char err[512] = "";
    CHECK(sim_trace_parse("bad", cases[i].text, strlen(cases[i].text), &t, err, sizeof err) != 0);
    CHECK_STR_CONTAINS(err, cases[i].want);
    CHECK_STR_CONTAINS(err, "bad:");
  }
  return 0;
}

/* Across nodes NCCL runs one ring per NIC, each entering and leaving a node
 * through its own NIC, so a node's NICs carry a collective together: its
 * bus bandwidth is the NICs of the group's GPUs on a node together, up to
 * NVLink's (sjeaugey in NVIDIA/nccl#412: more NICs, more bandwidth, "up to
 * 160GB/s which is the NVLink intra-node bandwidth" of an A100 node). By
 * hand, a gather of 16,000,000 B over 16 ranks (15,000,000 B on the wire),
 * NIC 1 GB/s a GPU, waited for at once:
 *  - 2 nodes, 8 GPUs each, NVLink 10 GB/s: 8 GB/s, 1875 us;
 *  - NVLink 4 GB/s: NVLink bounds it, 3750 us;
 *  - 16 nodes, one GPU each: one NIC, 15000 us;
 *  - 2 nodes, a PCIe link of 0.25 GB/s a direction: each GPU's NIC carries
 *    an eighth through its own link, 8 x 0.25 = 2 GB/s, 7500 us. */
TEST(sim_comm_across_nodes_uses_every_nic_of_a_node) {
  static const char text[] = T_HDR T_BEGIN T_COLL(1, "all_gather", 16000000, 16, "shard")
      T_WAIT(1) T_EV("backward_begin") T_EV("backward_end") T_END;
  static const struct {
    uint32_t nodes;
    double nvlink, pcie, want_us;
  } cases[] = {{2, 10e9, 1e12, 1875}, {2, 4e9, 1e12, 3750}, {16, 10e9, 1e12, 15000},
               {2, 10e9, 0.25e9, 7500}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sim_config c = {0};
    c.link = (ferry_link){cases[i].pcie, cases[i].pcie, 0, 1.0};
    c.warmup = -1;
    c.nic_bytes_per_s = 1e9;
    c.nvlink_bytes_per_s = cases[i].nvlink;
    c.comm_nodes = cases[i].nodes;
    sim_result r;
    CHECK_OK(replay_text(text, &c, &r));
    CHECK_NEAR(r.comm_exposed_us, cases[i].want_us, 1e-6);
    CHECK_NEAR(r.step_us, cases[i].want_us, 1e-6);
    sim_result_free(&r);
  }
  return 0;
}

/* The NIC's share of the PCIe link ends with its collective, also while the
 * engine is waiting for a copy (nothing in the trace happens meanwhile).
 * Link 1 GB/s each way, NIC 1 GB/s, one GPU a node. A tensor of 1,000,000 B
 * is offloaded at 0 beside a gather with 100,000 B on the wire: 0.5 GB/s
 * each until the gather ends at 200 us, then the copy alone at 1 GB/s, done
 * at 1100 us; the unpack right after backward_begin waits for it (the
 * buffer is still on the device: no reload), so the step is 1100 us.
 * (Sharing to the end of the wait would give the copy 0.5 GB/s throughout:
 * 2000 us.) */
TEST(sim_comm_nic_share_ends_with_its_collective) {
  static const char text[] = T_HDR T_BEGIN T_PACK(1, 1000000)
      T_COLL(2, "all_gather", 200000, 2, "shard") T_EV("backward_begin") T_UNPACK(1)
          T_EV("backward_end") T_WAIT(2) T_END;
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.warmup = -1;
  c.policy_source = offload_all;
  c.timeline = 1;
  c.nvlink_bytes_per_s = c.nic_bytes_per_s = 1e9;
  c.comm_nodes = 2;
  sim_result r;
  CHECK_OK(replay_text(text, &c, &r));
  int found = 0;
  for (size_t i = 0; i < r.tl.n_iv; i++) {
    const sim_interval *iv = &r.tl.iv[i];
    if (iv->lane != 1) continue; /* the D2H copy */
    CHECK_NEAR(iv->t1 - iv->t0, 1100, 1e-6);
    found++;
  }
  CHECK_EQ(found, 1);
  CHECK_NEAR(r.step_us, 1100, 1e-6);
  CHECK_NEAR(r.comm_exposed_us, 0, 1e-6);
  sim_result_free(&r);
  return 0;
}

/* A data-parallel group of 8 ranks cannot span 16 nodes: a replay told so
 * is refused with both numbers, not timed as if it could; 8 ranks on 8
 * nodes (one a node) is fine. */
TEST(sim_comm_more_nodes_than_ranks_refused) {
  static const char text[] = T_HDR T_BEGIN T_COLL(1, "all_gather", 4000000, 8, "shard") T_WAIT(1)
      T_EV("backward_begin") T_EV("backward_end") T_END;
  sim_trace *t = NULL;
  char err[512] = "";
  CHECK_OK(sim_trace_parse("comm", text, strlen(text), &t, err, sizeof err));
  sim_config c = {0};
  c.link = (ferry_link){1e12, 1e12, 0, 1.0};
  c.warmup = -1;
  c.nvlink_bytes_per_s = c.nic_bytes_per_s = 1e9;
  c.comm_nodes = 16;
  sim_result r;
  CHECK(sim_replay(t, &c, &r, err, sizeof err) != 0);
  CHECK_STR_CONTAINS(err, "16 nodes");
  CHECK_STR_CONTAINS(err, "8 ranks");
  c.comm_nodes = 8;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.comm_exposed_us, 3500, 1e-6); /* 7/8 of 4 MB at 1 GB/s */
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* ---- sensitivity to the compute rate (issue 42 item 4) ---------------------------- */
#define T_FLOPS(flops) "{\"ev\":\"compute\",\"t_us\":0,\"us\":1,\"flops\":" #flops "}\n"

/* By hand: 1e9 FLOPs at 1 TFLOP/s take 1000 us; at x 0.75 1333.33 us, at
 * x 1.25 800 us. With a policy the two extra replays are the same as
 * replays at those rates, and the report (text, JSON) says both runs'
 * steps and overheads at MFU 0.30 / 0.40 / 0.50 of h100's 989 TFLOP/s. */
TEST(sim_mfu_sensitivity_replays_at_both_rates) {
  static const char plain[] = T_HDR T_BEGIN T_FLOPS(1e9) T_EV("backward_begin")
      T_EV("backward_end") T_END;
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.warmup = -1;
  c.tflops = 1;
  c.mfu_sensitivity = 0.25;
  sim_result r;
  CHECK_OK(replay_text(plain, &c, &r));
  CHECK_NEAR(r.step_us, 1000, 1e-6);
  CHECK_NEAR(r.sens_tflops[0], 0.75, 1e-12);
  CHECK_NEAR(r.sens_tflops[1], 1.25, 1e-12);
  CHECK_NEAR(r.sens_step_us[0], 1000 / 0.75, 1e-6);
  CHECK_NEAR(r.sens_step_us[1], 800, 1e-6);
  sim_result_free(&r);
  /* without FLOPs (or without the option) nothing more is replayed */
  c.mfu_sensitivity = 0;
  CHECK_OK(replay_text(plain, &c, &r));
  CHECK_NEAR(r.sens_step_us[0], 0, 0);
  sim_result_free(&r);

  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.layers = 2, m.seq = 2048;
  sim_trace *t = NULL;
  CHECK_OK(trace_of(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config s = {0};
  s.link = hw->link;
  s.tflops = hw->peak_tflops * SIM_DEFAULT_MFU;
  s.steps = 3;
  sim_result rs[2], lo, hi;
  char err[512];
  s.mfu_sensitivity = 0.25;
  CHECK_OK(sim_replay(t, &s, &rs[0], err, sizeof err));
  s.policy_source = offload_all;
  s.label = "all";
  CHECK_OK(sim_replay(t, &s, &rs[1], err, sizeof err));
  s.mfu_sensitivity = 0;
  s.tflops = hw->peak_tflops * SIM_DEFAULT_MFU * 0.75;
  CHECK_OK(sim_replay(t, &s, &lo, err, sizeof err));
  s.tflops = hw->peak_tflops * SIM_DEFAULT_MFU * 1.25;
  CHECK_OK(sim_replay(t, &s, &hi, err, sizeof err));
  CHECK_NEAR(rs[1].sens_step_us[0], lo.step_us, 1e-9);
  CHECK_NEAR(rs[1].sens_step_us[1], hi.step_us, 1e-9);
  CHECK(lo.step_us > rs[1].step_us && rs[1].step_us > hi.step_us);

  sim_run_info info = {.trace_path = "llama3-8b x2", .trace = t, .hw = hw};
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  sim_print_table(f, &info, rs, 2);
  fclose(f);
  CHECK_STR_CONTAINS(text, "step (overhead) at MFU 0.30 / MFU 0.40 / MFU 0.50");
  char want[64];
  snprintf(want, sizeof want, "(%+6.1f%%)", 100.0 * (hi.step_us - rs[0].sens_step_us[1]) / rs[0].sens_step_us[1]);
  CHECK_STR_CONTAINS(text, want);
  free(text);
  char path[] = "/tmp/ferry_sens_XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  CHECK_OK(sim_write_json(path, &info, rs, 2, err, sizeof err));
  FILE *jf = fopen(path, "r");
  CHECK(jf != NULL);
  char buf[1 << 16];
  size_t got = fread(buf, 1, sizeof buf - 1, jf);
  buf[got] = 0;
  fclose(jf);
  unlink(path);
  CHECK_STR_CONTAINS(buf, "\"compute_sensitivity\"");
  CHECK_STR_CONTAINS(buf, "\"step_overhead_pct\"");
  sim_result_free(&rs[0]);
  sim_result_free(&rs[1]);
  sim_result_free(&lo);
  sim_result_free(&hi);
  sim_trace_free(t);
  return 0;
}
