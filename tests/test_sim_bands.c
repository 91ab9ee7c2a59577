/* test_sim_bands.c — the error bands (sim_bands.c; docs/sim-validation.md,
 * "Validation: memory and cost"): a run's band comes from the published
 * runs like it, falls back to all of them when fewer than two are alike,
 * and the trace's header says what the run is. The expected rows and
 * ranges are read off the validation table by hand. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

/* The row index of source + label, -1 if none. */
static int row_of(const char *source, const char *label) {
  const sim_band_row *rows;
  int n = sim_band_rows(&rows);
  for (int i = 0; i < n; i++)
    if (!strcmp(rows[i].source, source) && !strcmp(rows[i].label, label)) return i;
  return -1;
}

static uint32_t bit(const char *source, const char *label) {
  int i = row_of(source, label);
  return i < 0 ? 0x80000000u : 1u << i;
}

#define AX3733 "axolotl-ai-cloud/axolotl#3733"
#define AX3776 "axolotl-ai-cloud/axolotl#3776"
#define TT "pytorch/torchtitan#3521"

/* 1 GPU, eager, seq 16384, copies hidden: axolotl #3733's two long rows
 * are one publication, so GPUs are given up: with accelerate's CP 8 run,
 * -2.9 .. +17.6 for memory; for overhead only #3733's 16k row gives a
 * number: that row and accelerate's (-0.4). */
TEST(sim_band_one_gpu_eager_long_context_picks_the_axolotl_rows) {
  sim_run_class c = {.gpus = 1, .compiled = 0, .seq = 16384, .cp = 1, .overhead_pct = 0.5};
  sim_band b;
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  CHECK_EQ(b.runs, 3);
  CHECK_EQ(b.publications, 2);
  CHECK_EQ(b.all, 0);
  CHECK_EQ(b.rows, bit(AX3733, "hidden_states, seq 16k") | bit(AX3733, "hidden_states, seq 32k") |
                       bit("huggingface/accelerate#4175", "Qwen3-0.6B, 1M tokens over CP 8"));
  CHECK_NEAR(b.lo, -2.9, 1e-9);
  CHECK_NEAR(b.hi, 17.6, 1e-9);
  CHECK_STR_CONTAINS(b.like, "long context, copies hidden");
  CHECK(!strstr(b.like, "GPU"));
  char text[384];
  /* a real run saved 10 - 17.6 .. 10 - (-2.9) */
  sim_band_text(&b, SIM_BAND_MEMORY, 10.0, text, sizeof text);
  CHECK_STR_CONTAINS(text, "-2.9 to +17.6 points on 3 published runs from 2 publications");
  CHECK_STR_CONTAINS(text, "a real run: -7.6% to 12.9%");
  sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
  CHECK_EQ(b.runs, 2);
  CHECK_EQ(b.rows, bit(AX3733, "hidden_states, seq 16k") |
                       bit("huggingface/accelerate#4175", "Qwen3-0.6B, 1M tokens over CP 8"));
  CHECK_NEAR(b.lo, -3.7, 1e-9);
  CHECK_NEAR(b.hi, -0.4, 1e-9);
  CHECK_EQ(b.matched, (unsigned)(SIM_BAND_ATTR_LONG | SIM_BAND_ATTR_COPY));
  CHECK_STR_CONTAINS(b.like, "long context, copies hidden");
  CHECK(!strstr(b.like, "GPU"));
  return 0;
}

/* 8 GPUs, compiled, seq 8192: with copies hidden, torchtitan's sweep (one
 * publication) and Megatron's row for memory (-0.6 .. +2.7); its overheads
 * are bounds only, so the overhead band gives up compiled and GPUs (axolotl's two short hidden rows and
 * Megatron: -5.9 .. +3.1) and still counts the four bounds, all kept. A
 * copy-bound one: DeepSpeed's two rows and PyTorch #186161 for overhead. */
TEST(sim_band_eight_gpu_compiled_picks_the_compiled_rows) {
  sim_run_class c = {.gpus = 8, .compiled = 1, .seq = 8192, .cp = 1, .overhead_pct = 0.1};
  sim_band b;
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  CHECK_EQ(b.runs, 5);
  CHECK_EQ(b.rows, bit(TT, "budget 5 GB") | bit(TT, "budget 8 GB") | bit(TT, "budget 10 GB") |
                       bit("pytorch/torchtitan#3522", "budget 100 GB") |
                       bit("NVIDIA/Megatron-LM#1752", "QKV input only"));
  CHECK_NEAR(b.lo, -0.6, 1e-9);
  CHECK_NEAR(b.hi, 2.7, 1e-9);
  CHECK_STR_CONTAINS(b.like, "several GPUs, short context, copies hidden");
  sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
  CHECK_EQ(b.runs, 3);
  CHECK_EQ(b.bounds, 4);
  CHECK_EQ(b.bounds_inside, 4);
  CHECK_NEAR(b.lo, -5.9, 1e-9);
  CHECK_NEAR(b.hi, 3.1, 1e-9);
  CHECK_EQ(b.matched, (unsigned)(SIM_BAND_ATTR_LONG | SIM_BAND_ATTR_COPY));
  char text[384];
  /* an overhead does not go below 0: 1 - 3.1 .. 1 + 5.9 */
  sim_band_text(&b, SIM_BAND_OVERHEAD, 1.0, text, sizeof text);
  CHECK_STR_CONTAINS(text, "-5.9 to +3.1 points on 3 published runs");
  /* the bounds were met by the simulator's figures for those runs, not by
   * this run's: the words must not read as if this figure were inside them */
  CHECK_STR_CONTAINS(text, "4 more gave only an upper bound, which the simulator met on those 4");
  CHECK(!strstr(text, "the simulated figure inside"));
  CHECK_STR_CONTAINS(text, "a real run: +0.0% to +6.9%");
  c.overhead_pct = 30;
  sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
  CHECK_EQ(b.runs, 3);
  CHECK_EQ(b.rows, bit("deepspeedai/DeepSpeed#8255", "forced-all, seq 2048") |
                       bit("deepspeedai/DeepSpeed#8255", "forced-all, seq 3072") |
                       bit("pytorch/pytorch#186161", "with the pool"));
  CHECK_NEAR(b.lo, -13.9, 1e-9);
  CHECK_NEAR(b.hi, 66.2, 1e-9);
  CHECK_STR_CONTAINS(b.like, "copy-bound");
  return 0;
}

/* Fewer than two alike even on copy-bound alone: every row that gives the
 * figure, said so. A copy-bound run's memory (only trl_all is copy-bound
 * and gives memory). */
TEST(sim_band_falls_back_to_all_rows_when_none_alike) {
  sim_run_class c = {.gpus = 8, .compiled = 1, .seq = 8192, .cp = 1, .overhead_pct = 30};
  sim_band b;
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  CHECK_EQ(b.all, 1);
  CHECK_EQ(b.runs, 11);
  CHECK_NEAR(b.lo, -2.9, 1e-9);
  CHECK_NEAR(b.hi, 89.4, 1e-9);
  CHECK_STR_CONTAINS(b.like, "none like this one");
  char text[384];
  sim_band_text(&b, SIM_BAND_MEMORY, 50.0, text, sizeof text);
  CHECK_STR_CONTAINS(text, "on all 11 published runs from 5 publications (none like this one)");
  /* attributes not known match any row: no GPUs, no compile, no seq */
  sim_run_class u = {.gpus = 0, .compiled = -1, .seq = 0, .cp = 0, .overhead_pct = 0};
  sim_band_pick(&u, SIM_BAND_MEMORY, &b);
  CHECK_EQ(b.all, 0);
  CHECK_EQ(b.runs, 10); /* every memory row but trl_all, the copy-bound one */
  CHECK_STR_CONTAINS(b.like, "copies hidden");
  return 0;
}

/* The header's seq, cp, shard, tp and checkpoint_impl make the class;
 * --gpus-per-node, when given, raises the GPUs; a header without them
 * leaves them unknown. */
TEST(sim_band_class_from_the_trace_header) {
  static const char *with =
      "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":2,\"backend\":\"synth\","
      "\"seq\":32768,\"checkpoint\":\"full\",\"checkpoint_impl\":\"compiled\",\"cp\":4,"
      "\"shard\":2,\"tp\":1}\n"
      "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n{\"ev\":\"step_end\",\"t_us\":1,\"step\":1}\n";
  static const char *without =
      "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
      "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n{\"ev\":\"step_end\",\"t_us\":1,\"step\":1}\n";
  char err[512];
  sim_trace *t = NULL;
  CHECK_OK(sim_trace_parse("with", with, strlen(with), &t, err, sizeof err));
  sim_run_info info = {.trace = t};
  sim_run_class c;
  sim_run_class_of(&info, NULL, 0, &c);
  CHECK_EQ(c.gpus, 4);
  CHECK_EQ(c.compiled, 1);
  CHECK_EQ(c.seq, 32768);
  CHECK_EQ(c.cp, 4);
  info.gpus_per_node = 8;
  info.gpus_given = 1;
  sim_run_class_of(&info, NULL, 0, &c);
  CHECK_EQ(c.gpus, 8);
  sim_trace_free(t);
  t = NULL;
  CHECK_OK(sim_trace_parse("without", without, strlen(without), &t, err, sizeof err));
  /* --gpus-per-node's default, not given: still not known */
  info = (sim_run_info){.trace = t, .gpus_per_node = 1};
  sim_run_class_of(&info, NULL, 0, &c);
  CHECK_EQ(c.gpus, 0);
  CHECK_EQ(c.compiled, -1);
  CHECK_EQ(c.seq, 0);
  sim_trace_free(t);
  return 0;
}

/* Every row's band is ordered and each row counts in some band: lo <= hi
 * for every class there is. */
TEST(sim_band_lo_never_above_hi) {
  for (int g = 0; g < 2; g++)
    for (int k = 0; k < 2; k++)
      for (int l = 0; l < 2; l++)
        for (int o = 0; o < 2; o++)
          for (int fig = 0; fig < 2; fig++) {
            sim_run_class c = {.gpus = g ? 8 : 1, .compiled = k, .seq = l ? 65536 : 4096,
                               .cp = 1, .overhead_pct = o ? 50 : 0};
            sim_band b;
            sim_band_pick(&c, fig, &b);
            CHECK(b.runs >= 2);
            CHECK(b.lo <= b.hi);
            CHECK(b.bounds_inside <= b.bounds);
          }
  return 0;
}

/* The publication row i counts as. */
static const char *publication_of(int i) {
  const sim_band_row *rows;
  sim_band_rows(&rows);
  return rows[i].publication;
}

/* A band stands on two publications, never on one publication's runs
 * (axolotl #3733's 16k and 32k rows are one benchmark at two lengths):
 * in every class, the rows with a number come from two publications or
 * more, and publications counts them. A row's publication is its source
 * but for torchtitan #3522, which carries #3521's sweep on. */
TEST(sim_band_needs_two_publications_not_two_runs) {
  const sim_band_row *rows;
  int n = sim_band_rows(&rows);
  for (int g = 0; g < 2; g++)
    for (int k = 0; k < 2; k++)
      for (int l = 0; l < 2; l++)
        for (int o = 0; o < 2; o++)
          for (int fig = 0; fig < 2; fig++) {
            sim_run_class c = {.gpus = g ? 8 : 1, .compiled = k, .seq = l ? 65536 : 4096,
                               .cp = 1, .overhead_pct = o ? 50 : 0};
            sim_band b;
            sim_band_pick(&c, fig, &b);
            int sources = 0;
            for (int i = 0; i < n; i++) {
              int kind = fig == SIM_BAND_MEMORY ? rows[i].memory_kind : rows[i].overhead_kind;
              if (!(b.rows >> i & 1u) || kind != SIM_BAND_NUMBER) continue;
              int seen = 0;
              for (int j = 0; j < i; j++) {
                int kj = fig == SIM_BAND_MEMORY ? rows[j].memory_kind : rows[j].overhead_kind;
                seen |= (b.rows >> j & 1u) && kj == SIM_BAND_NUMBER &&
                        !strcmp(publication_of(j), publication_of(i));
              }
              sources += !seen;
            }
            CHECK(sources >= 2);
            CHECK_EQ(b.publications, sources);
          }
  return 0;
}

/* No row offloads optimizer states or weights: such a run gets no band
 * (activation offloads' errors are no measure of a CPU optimizer step),
 * and the text says so rather than give a range a real run "landed" in. */
TEST(sim_band_none_for_optimizer_or_weight_offload) {
  sim_run_class o = {.gpus = 1, .compiled = 0, .seq = 16384, .cp = 1, .overhead_pct = 1100,
                     .other_offload = 1};
  for (int fig = 0; fig < 2; fig++) {
    sim_band b;
    sim_band_pick(&o, fig, &b);
    CHECK_EQ(b.runs, 0);
    CHECK_EQ(b.rows, 0u);
    CHECK_EQ(b.all, 0);
    char text[384];
    sim_band_text(&b, fig, 1100.0, text, sizeof text);
    CHECK(!strstr(text, "a real run"));
    CHECK_STR_CONTAINS(text, "no band: no published run offloads optimizer states or weights");
  }
  return 0;
}

/* The copy-bound line flips a band at 5%, but only ever to a wider one that
 * holds the narrower (docs/sim-validation.md, "How sure"): on either side of
 * the line, for every class, the error points and the real run's range
 * of the copy-bound side hold those of the copies-hidden side. */
TEST(sim_band_copy_bound_line_only_widens) {
  const double below = SIM_BAND_COPY_BOUND_PCT - 0.01, at = SIM_BAND_COPY_BOUND_PCT;
  for (int g = 0; g < 3; g++)
    for (int k = -1; k < 2; k++)
      for (int l = 0; l < 3; l++)
        for (int fig = 0; fig < 2; fig++) {
          sim_run_class c = {.gpus = g == 2 ? 0 : g ? 8 : 1, .compiled = k,
                             .seq = l == 2 ? 0 : l ? 65536 : 4096, .cp = l == 2 ? 0 : 1};
          sim_band lo_side, hi_side;
          c.overhead_pct = below;
          sim_band_pick(&c, fig, &lo_side);
          c.overhead_pct = at;
          sim_band_pick(&c, fig, &hi_side);
          CHECK(hi_side.lo <= lo_side.lo + 1e-9);
          CHECK(hi_side.hi >= lo_side.hi - 1e-9);
        }
  return 0;
}

/* torchtitan's four budget rows are one sweep over two PRs: one
 * publication, so an 8-GPU compiled run's memory band does not stand on
 * them alone: compiled is given up and Megatron's row joins them. */
TEST(sim_band_torchtitan_sweep_is_one_publication) {
  const sim_band_row *rows;
  int n = sim_band_rows(&rows);
  int i3521 = row_of(TT, "budget 5 GB"), i3522 = row_of("pytorch/torchtitan#3522", "budget 100 GB");
  CHECK(i3521 >= 0 && i3522 >= 0 && i3522 < n);
  CHECK(!strcmp(rows[i3522].publication, rows[i3521].publication));
  sim_run_class c = {.gpus = 8, .compiled = 1, .seq = 8192, .cp = 1, .overhead_pct = 0.1};
  sim_band b;
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  CHECK_EQ(b.publications, 2);
  CHECK(b.rows & bit("NVIDIA/Megatron-LM#1752", "QKV input only"));
  CHECK(!(b.matched & SIM_BAND_ATTR_COMPILED));
  return 0;
}
