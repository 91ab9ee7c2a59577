/* test_sim_compute.c — compute time in replays: recorded FLOPs and resident
 * memory, the simulated GPU's roofline, and synthesized compute timed on
 * the simulated GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test_device.h"
#include <valgrind/valgrind.h>

#include "test.h"
#include "test_sim_trace.h"

/* A recorded trace carries resident memory and FLOPs (ferry_trace_resident,
 * ferry_trace_flops); replayed with a GPU's achieved TFLOP/s its compute
 * takes flops / rate whatever the recording machine's speed; without FLOPs
 * the report says the times are the recording machine's. */
TEST(sim_recorded_trace_flops_and_resident) {
  test_device_stats st = {0};
  char path[32], err[512];
  ferry_engine *e;
  CHECK_OK(recording_engine(&st, path, &e));
  CHECK_OK(ferry_trace_resident(e, "parameters", 1000000));
  CHECK_OK(ferry_trace_resident(e, "optimizer states", 2000000));
  CHECK_EQ(ferry_trace_flops(e, -1), FERRY_EINVAL);
  enum { M = 4 };
  test_buffer *bufs[M];
  ferry_handle hs[M];
  CHECK_OK(ferry_step_begin(e));
  for (int i = 0; i < M; i++) {
    CHECK_OK(ferry_trace_flops(e, 1e12)); /* 1 TFLOP before each pack */
    bufs[i] = test_buffer_new(4096);
    ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
    d.bytes = 4096;
    d.dtype = FERRY_DTYPE_U8;
    d.ndim = 1;
    d.shape[0] = 4096;
    d.layer = i;
    d.layer_count = M;
    CHECK_OK(ferry_pack(e, &d, bufs[i]->ptr, bufs[i], NULL, &hs[i])); /* the engine's now */
  }
  CHECK_OK(ferry_trace_flops(e, 2e12));
  CHECK_OK(ferry_backward_begin(e));
  for (int i = M - 1; i >= 0; i--) {
    void *dev = NULL, *owner = NULL;
    CHECK_OK(ferry_unpack(e, hs[i], NULL, &dev, &owner));
    if (owner) test_buffer_unref(owner);
  }
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  CHECK_EQ(ferry_trace_resident(e, "late", 1), FERRY_OK); /* between steps: allowed */
  ferry_engine_destroy(e);

  sim_trace *t = NULL;
  int rc = sim_trace_load(path, &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK_EQ(t->resident_bytes, 3000001);
  CHECK_EQ(t->n_flops, M + 1);
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config sc = {0};
  sc.link = hw->link;
  sc.tflops = 400;
  sim_result r;
  CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
  /* 6 TFLOP at 400 TFLOP/s = 15 ms, plus the gaps without FLOPs (tiny: a
   * few recorded microseconds) */
  CHECK(r.step_us >= 15000);
  /* the recorded gaps are real time: tiny, except under valgrind */
  CHECK(RUNNING_ON_VALGRIND || r.step_us < 15000 + 5000);
  CHECK_EQ(r.gaps_from_flops, M + 1);
  CHECK(strstr(r.compute_note, "FLOPs at 400 TFLOP/s") != NULL);
  CHECK_EQ(r.peak_device_bytes, 3000001 + M * 4096);
  sim_result_free(&r);
  /* no rate: the recording machine's times, said plainly */
  sc.tflops = 0;
  CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
  CHECK(RUNNING_ON_VALGRIND || r.step_us < 15000);
  CHECK_EQ(r.gaps_from_flops, 0);
  CHECK(strstr(r.compute_note, "recording machine's") != NULL);
  sim_result_free(&r);
  sim_trace_free(t);
  unlink(path);
  return 0;
}

/* The sim_config `ferry sim --hw NAME --mfu MFU` builds (cli_sim.c's
 * opts_config): the preset's peak x MFU, its HBM x SIM_DEFAULT_HBM_FRACTION. */
static sim_config gpu_config(const char *hw_name, double mfu) {
  const sim_hw *hw = sim_hw_preset(hw_name);
  sim_config c = {0};
  c.link = hw->link;
  c.steps = 1;
  c.tflops = hw->peak_tflops * mfu;
  c.hbm_bytes_per_s = hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION;
  return c;
}

/* A synthesized compute event carries its work (FLOPs, device-memory bytes,
 * a least time), timed on the simulated GPU as a roofline. By hand, from
 * the datasheets (docs/hardware.md): h100 989 TFLOP/s x 0.40 = 395.6,
 * 3350 GB/s x 0.60 = 2010 GB/s; a100 312 x 0.40 = 124.8, 2039 x 0.60 =
 * 1223.4 GB/s.
 *   matmul, 1e12 FLOP and 1e9 B: h100 1e12 / 395.6e12 s = 2527.806 us (its
 *     bytes: 497.5 us), a100 8012.821 us (817.4 us): 989/312 = 3.170x;
 *   norm, 0 FLOP and 4.02e9 B: h100 2000 us, a100 3285.925 us;
 *   launch-bound, 1e6 FLOP, 1e3 B, min_us 8: 8 us on both.
 * Without a GPU speed the events keep the synthesizer's `us`. */
TEST(sim_compute_roofline_hand_computed) {
#define COMPUTE(us, flops, bytes, min)                                                     \
  "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us ",\"flops\":" #flops ",\"hbm_bytes\":" #bytes \
  ",\"min_us\":" #min "}\n"
  static const char matmul[] = HDR BEGIN COMPUTE(10, 1e12, 1e9, 4) END;
  static const char three[] = HDR BEGIN COMPUTE(10, 1e12, 1e9, 4) COMPUTE(20, 0, 4.02e9, 4)
      COMPUTE(30, 1e6, 1e3, 8) END;
#undef COMPUTE
  sim_trace *t1 = NULL, *t3 = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("matmul", matmul, strlen(matmul), &t1, err, sizeof err));
  CHECK_OK(sim_trace_parse("three", three, strlen(three), &t3, err, sizeof err));
  CHECK_EQ(t3->n_hbm, 3);
  static const struct {
    const char *hw;
    double mfu, matmul_us, three_us;
  } want[] = {
      {"h100", 0.40, 2527.805864, 2527.805864 + 2000 + 8},
      {"a100", 0.40, 8012.820513, 8012.820513 + 3285.924473 + 8},
      {"h100", 0.20, 2 * 2527.805864, 2 * 2527.805864 + 2000 + 8}, /* MFU halved */
      {"a100", 0.80, 8012.820513 / 2, 8012.820513 / 2 + 3285.924473 + 8}, /* doubled */
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    sim_config c = gpu_config(want[i].hw, want[i].mfu);
    sim_result r;
    CHECK_OK(sim_replay(t1, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want[i].matmul_us, 1e-3);
    sim_result_free(&r);
    CHECK_OK(sim_replay(t3, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want[i].three_us, 1e-3);
    CHECK_EQ(r.gaps_from_flops, 3);
    CHECK(strstr(r.compute_note, "roofline") != NULL);
    sim_result_free(&r);
  }
  /* the FLOP-bound event: a100 over h100 is exactly the ratio of peaks */
  sim_result h, a;
  sim_config ch = gpu_config("h100", SIM_DEFAULT_MFU), ca = gpu_config("a100", SIM_DEFAULT_MFU);
  CHECK_OK(sim_replay(t1, &ch, &h, err, sizeof err));
  CHECK_OK(sim_replay(t1, &ca, &a, err, sizeof err));
  CHECK_NEAR(a.step_us / h.step_us, 989.0 / 312.0, 1e-9);
  sim_result_free(&h);
  sim_result_free(&a);
  /* no GPU speed: the synthesizer's times */
  sim_config none = {0};
  none.steps = 1;
  sim_result r;
  CHECK_OK(sim_replay(t3, &none, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, 60, 1e-9);
  CHECK_EQ(r.gaps_from_flops, 0);
  CHECK(strstr(r.compute_note, "as synthesized") != NULL);
  sim_result_free(&r);
  sim_trace_free(t1);
  sim_trace_free(t3);
  return 0;
}

/* The synthesized Llama-3-8B-like trace (seq 8192) on h100 and a100: with
 * a GPU speed, every compute event is timed on it, so the no-offload step
 * is the sum over the step's events of max(flops / rate, hbm_bytes / bw,
 * min_us) at that GPU's rates (hand-written here from the datasheets), not
 * the synthesizer's 400 TFLOP/s on both; without one, the sum of `us`. */
TEST(sim_synth_compute_follows_the_simulated_gpu) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK(t->n_hbm > 0);
  static const struct {
    const char *hw;
    double mfu, rate, bw; /* FLOP/s, B/s */
  } gpu[] = {
      {"h100", 0.40, 989e12 * 0.40, 3350e9 * 0.60},
      {"a100", 0.40, 312e12 * 0.40, 2039e9 * 0.60},
      {"h100", 0.20, 989e12 * 0.20, 3350e9 * 0.60},
  };
  const trace_step *st = &t->steps[0];
  double step[3], synth_us = 0, flop_bound_h100 = 0;
  char err[512];
  for (int g = 0; g < 3; g++) {
    double want = 0;
    for (uint32_t k = st->first; k < st->end; k++) {
      const trace_ev *ev = &t->events[k];
      if (ev->type != TEV_COMPUTE) continue;
      CHECK(ev->flops >= 0 && ev->hbm_bytes >= 0);
      double f = ev->flops / gpu[g].rate * 1e6, b = ev->hbm_bytes / gpu[g].bw * 1e6;
      double us = fmax(fmax(f, b), ev->min_us);
      want += us;
      if (g == 0) {
        synth_us += ev->gap_us;
        if (us == f) flop_bound_h100 += us;
      }
    }
    sim_config c = gpu_config(gpu[g].hw, gpu[g].mfu);
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want, 1e-6 * want);
    CHECK(strstr(r.compute_note, "roofline") != NULL);
    step[g] = r.step_us;
    sim_result_free(&r);
  }
  printf("  no offload: h100 %.1f ms, a100 %.1f ms (%.2fx), h100 at MFU 0.2 %.1f ms; "
         "FLOP-bound on h100 %.1f ms; as synthesized %.1f ms\n",
         step[0] / 1e3, step[1] / 1e3, step[1] / step[0], step[2] / 1e3, flop_bound_h100 / 1e3,
         synth_us / 1e3);
  /* most of the step is matmuls: a100 is slower by nearly 989/312 */
  CHECK(flop_bound_h100 > 0.8 * step[0]);
  CHECK(step[1] > 2.5 * step[0]);
  /* halving the MFU doubles exactly the FLOP-bound part (the memory-bound
   * ops stay memory-bound or become FLOP-bound: at least that much) */
  CHECK(step[2] >= step[0] + flop_bound_h100 - 1e-3);
  sim_config none = {0};
  none.steps = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &none, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, synth_us, 1e-6 * synth_us);
  CHECK(strstr(r.compute_note, "as synthesized") != NULL);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* ferry_trace_flops_all: the trainer counts all its compute, so every event
 * carries "flops" (0 where none were added) and a replay times the whole
 * step from FLOPs: exactly the FLOPs / rate, whatever the recording
 * machine's gaps (here made long with sleeps), and the note says so. Off,
 * the events without FLOPs keep their recorded gaps. */
TEST(sim_recorded_trace_flops_all) {
  for (int all = 0; all <= 1; all++) {
    test_device_stats st = {0};
    char path[32], err[512];
    ferry_engine *e;
    CHECK_OK(recording_engine(&st, path, &e));
    CHECK_OK(ferry_trace_flops_all(e, all));
    CHECK_OK(ferry_trace_resident(e, "parameters", 1000));
    enum { M = 3 };
    test_buffer *bufs[M];
    ferry_handle hs[M];
    CHECK_OK(ferry_step_begin(e));
    for (int i = 0; i < M; i++) {
      usleep(2000); /* recorded compute nobody counted */
      if (i) CHECK_OK(ferry_trace_flops(e, 4e11)); /* before the 2nd and 3rd packs */
      bufs[i] = test_buffer_new(4096);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = 4096;
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = 4096;
      d.layer = i;
      d.layer_count = M;
      CHECK_OK(ferry_pack(e, &d, bufs[i]->ptr, bufs[i], NULL, &hs[i]));
    }
    CHECK_OK(ferry_backward_begin(e));
    for (int i = M - 1; i >= 0; i--) {
      void *dev = NULL, *owner = NULL;
      usleep(2000);
      CHECK_OK(ferry_unpack(e, hs[i], NULL, &dev, &owner));
      if (owner) test_buffer_unref(owner);
      CHECK_OK(ferry_trace_flops(e, 8e11)); /* after each unpack: its backward */
    }
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
    ferry_engine_destroy(e);

    sim_trace *t = NULL;
    int rc = sim_trace_load(path, &t, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    /* on: every event of the step (begin, 3 packs, backward begin, 3
     * unpacks, backward end, end); off: the 2 packs and 3 events after a
     * ferry_trace_flops */
    CHECK_EQ(t->n_flops, all ? 10 : 5);
    sim_config sc = {0};
    sc.link = sim_hw_preset("h100")->link;
    sc.tflops = 400;
    sim_result r;
    CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
    double flops_us = (2 * 4e11 + 3 * 8e11) / (400 * 1e6); /* 8 ms */
    if (all) {
      CHECK_NEAR(r.step_us, flops_us, 1e-6);
      CHECK_EQ(r.gaps_as_recorded, 0);
      CHECK(strstr(r.compute_note, "compute timed from the trace's FLOPs at 400 TFLOP/s") != NULL);
    } else {
      /* the sleeps before the first pack and the first unpack have no FLOPs */
      CHECK(r.step_us >= flops_us + 2 * 2000);
      CHECK(r.gaps_as_recorded >= 2);
      CHECK(strstr(r.compute_note, "as recorded") != NULL);
    }
    sim_result_free(&r);
    sim_trace_free(t);
    unlink(path);
  }
  return 0;
}
