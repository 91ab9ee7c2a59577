/*
 * sim_bands.c — how sure the simulator is: each simulated memory saving
 * and step overhead gets the error the simulator made on published runs
 * like this one (docs/sim-validation.md, "Validation: memory and cost"; declared
 * in ferry_sim.h). The rows below are that table's; tests/check_band_docs.py
 * fails when they disagree with it.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ferry_tools.h"
#include "sim/sim_format.h"
#include "sim/trace_reader_internal.h"

/* docs/sim-validation.md's table, row for row: source, which run, GPUs,
 * compiled, seq (the one taken where the publication gives none), CP, the
 * simulated overhead (%), then memory saved and overhead as simulated -
 * published in points (or a published bound, or not published), and the
 * publication it counts as: its source, but torchtitan's #3522 is #3521's
 * budget sweep carried on (same GPUs, model, pass and harness). */
#define NUM SIM_BAND_NUMBER
#define BOUND SIM_BAND_BOUND
#define NONE SIM_BAND_NONE
static const sim_band_row rows[] = {
    {"huggingface/accelerate#4175", "Qwen3-0.6B, 1M tokens over CP 8", 8, 0, 1048576, 8, 0.2, NUM, 17.6, NUM, -0.4, "huggingface/accelerate#4175"},
    {"axolotl-ai-cloud/axolotl#3776", "checkpoint_hs", 1, 0, 8192, 1, 2.6, NUM, -0.4, NUM, 3.1, "axolotl-ai-cloud/axolotl#3776"},
    {"axolotl-ai-cloud/axolotl#3776", "alst", 1, 0, 8192, 1, 0.0, NUM, 0.3, NUM, -5.9, "axolotl-ai-cloud/axolotl#3776"},
    {"axolotl-ai-cloud/axolotl#3776", "trl_all", 1, 0, 8192, 1, 64.1, NUM, 89.4, NUM, -21.0, "axolotl-ai-cloud/axolotl#3776"},
    {"axolotl-ai-cloud/axolotl#3733", "hidden_states, seq 16k", 1, 0, 16384, 1, 0.0, NUM, -0.1, NUM, -3.7, "axolotl-ai-cloud/axolotl#3733"},
    {"axolotl-ai-cloud/axolotl#3733", "hidden_states, seq 32k", 1, 0, 32768, 1, 0.0, NUM, -2.9, NONE, 0, "axolotl-ai-cloud/axolotl#3733"},
    {"pytorch/torchtitan#3521", "budget 5 GB", 8, 1, 8192, 1, 0.0, NUM, 0.0, BOUND, 1, "pytorch/torchtitan#3521"},
    {"pytorch/torchtitan#3521", "budget 8 GB", 8, 1, 8192, 1, 0.0, NUM, 0.6, BOUND, 5, "pytorch/torchtitan#3521"},
    {"pytorch/torchtitan#3521", "budget 10 GB", 8, 1, 8192, 1, 0.0, NUM, 1.6, BOUND, 7, "pytorch/torchtitan#3521"},
    {"pytorch/torchtitan#3522", "budget 100 GB", 8, 1, 8192, 1, 0.1, NUM, 2.7, BOUND, 23, "pytorch/torchtitan#3521"},
    {"deepspeedai/DeepSpeed#8255", "forced-all, seq 2048", 8, 1, 2048, 1, 108.2, NONE, 0, NUM, 66.2, "deepspeedai/DeepSpeed#8255"},
    {"deepspeedai/DeepSpeed#8255", "forced-all, seq 3072", 8, 1, 3072, 1, 107.8, NONE, 0, NUM, 64.8, "deepspeedai/DeepSpeed#8255"},
    {"pytorch/pytorch#186161", "with the pool", 8, 1, 4096, 1, 14.3, NONE, 0, NUM, -13.9, "pytorch/pytorch#186161"},
    {"NVIDIA/Megatron-LM#1752", "QKV input only", 8, 0, 8192, 1, 0.0, NUM, -0.6, NUM, -0.3, "NVIDIA/Megatron-LM#1752"},
};
#undef NUM
#undef BOUND
#undef NONE
#define N_ROWS (int)(sizeof rows / sizeof rows[0])

int sim_band_rows(const sim_band_row **out) {
  if (out) *out = rows;
  return N_ROWS;
}

void sim_trace_read_run(sim_trace *t, const char *line, size_t n) {
  cJSON *o = cJSON_ParseWithLength(line, n);
  if (!o) return; /* the reader's own parse names the problem */
  static const char *const keys[4] = {"seq", "cp", "shard", "tp"};
  int32_t *dst[4] = {&t->run_seq, &t->run_cp, &t->run_shard, &t->run_tp};
  for (int k = 0; k < 4; k++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[k]);
    if (cJSON_IsNumber(v) && v->valuedouble >= 1 && v->valuedouble < 1e9)
      *dst[k] = (int32_t)v->valuedouble;
  }
  const cJSON *impl = cJSON_GetObjectItemCaseSensitive(o, "checkpoint_impl");
  if (cJSON_IsString(impl)) t->run_ckpt_impl = strcmp(impl->valuestring, "compiled") ? 1 : 2;
  cJSON_Delete(o);
}

static double overhead_of(const sim_result *rs, int i) {
  return rs[0].step_us > 0 ? 100.0 * (rs[i].step_us - rs[0].step_us) / rs[0].step_us : 0;
}

static double saved_of(const sim_result *rs, int i) {
  double b = (double)rs[0].peak_device_bytes;
  return b > 0 ? 100.0 * (b - (double)rs[i].peak_device_bytes) / b : 0;
}

void sim_run_class_of(const sim_run_info *info, const sim_result *rs, int i, sim_run_class *c) {
  memset(c, 0, sizeof *c);
  c->compiled = -1;
  const sim_trace *t = info ? info->trace : NULL;
  if (t) {
    int ranks = (t->run_shard > 0 ? t->run_shard : 1) * (t->run_tp > 0 ? t->run_tp : 1);
    if (t->run_cp > ranks) ranks = t->run_cp;
    /* a header that gives none of them says nothing about the GPUs */
    if (t->run_shard > 0 || t->run_tp > 0 || t->run_cp > 0) c->gpus = ranks;
    for (uint32_t k = 0; k < t->n_collectives; k++)
      if (t->collectives[k].ranks > c->gpus) c->gpus = t->collectives[k].ranks;
    if (t->run_ckpt_impl) c->compiled = t->run_ckpt_impl == 2;
    c->seq = t->run_seq;
    c->cp = t->run_cp;
  }
  /* --gpus-per-node's default (1) is no word on the run: a recorded trace
   * of one rank of an 8-GPU job replays with it */
  if (info && info->gpus_given && info->gpus_per_node > c->gpus) c->gpus = info->gpus_per_node;
  if (rs && i > 0) {
    c->overhead_pct = overhead_of(rs, i);
    c->other_offload = rs[i].opt_fraction > 0 || rs[i].w_count > 0;
  }
}

/* The attributes of a row and of a run as SIM_BAND_ATTR_* bits (set: many
 * GPUs, compiled, long context, copy-bound). */
static unsigned row_bits(const sim_band_row *r) {
  return (r->gpus > 1 ? SIM_BAND_ATTR_GPUS : 0) | (r->compiled ? SIM_BAND_ATTR_COMPILED : 0) |
         (r->seq >= SIM_BAND_LONG_SEQ || r->cp > 1 ? SIM_BAND_ATTR_LONG : 0) |
         (r->sim_overhead_pct >= SIM_BAND_COPY_BOUND_PCT ? SIM_BAND_ATTR_COPY : 0);
}

static unsigned run_bits(const sim_run_class *c, unsigned *known) {
  *known = SIM_BAND_ATTR_COPY; /* the replay gives the overhead */
  if (c->gpus > 0) *known |= SIM_BAND_ATTR_GPUS;
  if (c->compiled >= 0) *known |= SIM_BAND_ATTR_COMPILED;
  if (c->seq > 0 || c->cp > 1) *known |= SIM_BAND_ATTR_LONG;
  return (c->gpus > 1 ? SIM_BAND_ATTR_GPUS : 0) | (c->compiled > 0 ? SIM_BAND_ATTR_COMPILED : 0) |
         (c->seq >= SIM_BAND_LONG_SEQ || c->cp > 1 ? SIM_BAND_ATTR_LONG : 0) |
         (c->overhead_pct >= SIM_BAND_COPY_BOUND_PCT ? SIM_BAND_ATTR_COPY : 0);
}

/* The attributes in words, those in mask, as the run has them. */
static void like_words(unsigned bits, unsigned mask, char *b, size_t n) {
  b[0] = 0;
  static const struct {
    unsigned bit;
    const char *yes, *no;
  } words[4] = {{SIM_BAND_ATTR_GPUS, "several GPUs", "1 GPU"},
                {SIM_BAND_ATTR_COMPILED, "compiled", "eager"},
                {SIM_BAND_ATTR_LONG, "long context", "short context"},
                {SIM_BAND_ATTR_COPY, "copy-bound", "copies hidden"}};
  for (int k = 0; k < 4; k++) {
    if (!(mask & words[k].bit)) continue;
    size_t l = strlen(b);
    snprintf(b + l, n - l, "%s%s", l ? ", " : "", bits & words[k].bit ? words[k].yes : words[k].no);
  }
}

/* The rows of figure that share mask's bits of bits into *out; the count of
 * the publications among those with a number (a publication's runs share
 * one setup: they are not independent). */
static int gather(unsigned bits, unsigned mask, int figure, sim_band *out) {
  memset(out, 0, sizeof *out);
  for (int i = 0; i < N_ROWS; i++) {
    const sim_band_row *r = &rows[i];
    int kind = figure == SIM_BAND_MEMORY ? r->memory_kind : r->overhead_kind;
    double v = figure == SIM_BAND_MEMORY ? r->memory_points : r->overhead_points;
    if (kind == SIM_BAND_NONE || ((row_bits(r) ^ bits) & mask)) continue;
    out->rows |= 1u << i;
    if (kind == SIM_BAND_BOUND) {
      out->bounds++;
      out->bounds_inside += r->sim_overhead_pct < v;
      continue;
    }
    if (!out->runs || v < out->lo) out->lo = v;
    if (!out->runs || v > out->hi) out->hi = v;
    out->runs++;
    int seen = 0;
    for (int k = 0; k < i && !seen; k++)
      seen = (out->numbered >> k & 1u) && !strcmp(rows[k].publication, r->publication);
    out->numbered |= 1u << i;
    out->publications += !seen;
  }
  out->matched = mask;
  return out->publications;
}

void sim_band_pick(const sim_run_class *c, int figure, sim_band *out) {
  unsigned known, bits = run_bits(c, &known);
  /* give up compiled, then GPUs, then long context, keeping copy-bound the
   * longest: the validation's large overhead errors are the copy-bound runs'.
   * Two publications make a band: one publication's runs are one setup. */
  static const unsigned drop[4] = {0, SIM_BAND_ATTR_COMPILED,
                                   SIM_BAND_ATTR_COMPILED | SIM_BAND_ATTR_GPUS,
                                   SIM_BAND_ATTR_COMPILED | SIM_BAND_ATTR_GPUS | SIM_BAND_ATTR_LONG};
  if (c->other_offload) {
    /* no row moves optimizer states or weights: activation offloads' errors
     * say nothing of a CPU optimizer step or a weight stream, so no band */
    memset(out, 0, sizeof *out);
    snprintf(out->like, sizeof out->like, "no published run offloads optimizer states or weights");
    return;
  }
  for (int k = 0; k < 4; k++) {
    unsigned mask = known & ~drop[k];
    if (gather(bits, mask, figure, out) >= 2) {
      like_words(bits, mask, out->like, sizeof out->like);
      return;
    }
  }
  gather(bits, 0, figure, out);
  out->all = 1;
  snprintf(out->like, sizeof out->like, "none like this one");
}

/* "+2.7" / "-0.6" / "+0.0": a signed figure with one decimal. */
static void signed1(char *b, size_t n, double v) {
  snprintf(b, n, "%+.1f", fabs(v) < 0.05 ? 0.0 : v);
}

/* Where a real run like those would land: published = simulated - error;
 * a saving no more than 100%, an overhead no less than 0 (offloading does
 * not make a step faster: the table's -0.4% is noise). */
static void real_range(const sim_band *b, int figure, double value, double *lo, double *hi) {
  *lo = value - b->hi;
  *hi = value - b->lo;
  if (figure == SIM_BAND_MEMORY) {
    if (*lo > 100) *lo = 100;
    if (*hi > 100) *hi = 100;
  } else {
    if (*lo < 0) *lo = 0;
    if (*hi < 0) *hi = 0;
  }
}

void sim_band_text(const sim_band *b, int figure, double value, char *buf, size_t n) {
  if (!b->runs) {
    snprintf(buf, n, "no band: %s (the validation table cannot say how sure)",
             b->like[0] ? b->like : "no published run gives this figure");
    return;
  }
  char lo[16], hi[16], bounds[128] = "", a[16], z[16];
  signed1(lo, sizeof lo, b->lo);
  signed1(hi, sizeof hi, b->hi);
  /* the simulator's figures for those runs met their bounds, not this one */
  if (b->bounds && b->bounds == b->bounds_inside)
    snprintf(bounds, sizeof bounds,
             "; %d more gave only an upper bound, which the simulator met on those %d", b->bounds,
             b->bounds);
  else if (b->bounds)
    snprintf(bounds, sizeof bounds,
             "; %d more gave only an upper bound, which the simulator met on %d of those %d", b->bounds,
             b->bounds_inside, b->bounds);
  double rl, rh;
  real_range(b, figure, value, &rl, &rh);
  if (figure == SIM_BAND_MEMORY) {
    snprintf(a, sizeof a, "%.1f%%", rl);
    snprintf(z, sizeof z, "%.1f%%", rh);
  } else {
    snprintf(a, sizeof a, "%+.1f%%", rl);
    snprintf(z, sizeof z, "%+.1f%%", rh);
  }
  snprintf(buf, n,
           "%s to %s points on %s%d published run%s from %d publication%s (%s%s) -> a real "
           "run: %s to %s",
           lo, hi, b->all ? "all " : "", b->runs, b->runs == 1 ? "" : "s", b->publications,
           b->publications == 1 ? "" : "s", b->like, bounds, a, z);
}

/* The run's class as the report's header line says it. */
static void class_words(const sim_run_class *c, char *b, size_t n) {
  char g[48], s[64];
  if (c->gpus > 0) snprintf(g, sizeof g, "%d GPU%s", c->gpus, c->gpus == 1 ? "" : "s");
  else snprintf(g, sizeof g, "GPUs not given (--gpus-per-node)");
  if (c->seq > 0 && c->cp > 1) snprintf(s, sizeof s, "seq %d over CP %d (long context)", c->seq, c->cp);
  else if (c->seq > 0)
    snprintf(s, sizeof s, "seq %d (%s context)", c->seq, c->seq >= SIM_BAND_LONG_SEQ ? "long" : "short");
  else snprintf(s, sizeof s, "sequence length not given");
  snprintf(b, n, "%s, %s, %s", g,
           c->compiled > 0 ? "compiled" : c->compiled == 0 ? "eager" : "eager or compiled not given", s);
}

void sim_print_bands(FILE *f, const sim_run_info *info, const sim_result *rs, int n) {
  if (n < 2) return;
  sim_run_class c;
  sim_run_class_of(info, rs, 0, &c);
  char cls[192];
  class_words(&c, cls, sizeof cls);
  fprintf(f, "\nhow sure (docs/sim-validation.md, \"Validation: memory and cost\"): the simulator's error "
             "(simulated - published, points) on published runs like this one, and where a real "
             "run like them landed\n  this trace: %s; a policy is copy-bound at a simulated "
             "overhead of %.0f%% or more\n", cls, SIM_BAND_COPY_BOUND_PCT);
  for (int i = 1; i < n; i++) {
    sim_run_class_of(info, rs, i, &c);
    sim_band b;
    char t[384];
    sim_band_pick(&c, SIM_BAND_MEMORY, &b);
    sim_band_text(&b, SIM_BAND_MEMORY, saved_of(rs, i), t, sizeof t);
    fprintf(f, "  %-22.22s memory saved %.1f%%: %s\n", rs[i].label, saved_of(rs, i), t);
    sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
    sim_band_text(&b, SIM_BAND_OVERHEAD, c.overhead_pct, t, sizeof t);
    fprintf(f, "  %-22s step overhead %+.1f%%: %s\n", "", c.overhead_pct, t);
  }
}

/* One figure's band as JSON. */
static void band_json(cJSON *o, const char *name, const sim_band *b, int figure, double value) {
  cJSON *x = cJSON_AddObjectToObject(o, name);
  double rl, rh;
  real_range(b, figure, value, &rl, &rh);
  cJSON_AddNumberToObject(x, "value_pct", value);
  cJSON *p = cJSON_AddArrayToObject(x, "points");
  cJSON *r = cJSON_AddArrayToObject(x, "real_pct");
  if (b->runs) {
    cJSON_AddItemToArray(p, cJSON_CreateNumber(b->lo));
    cJSON_AddItemToArray(p, cJSON_CreateNumber(b->hi));
    cJSON_AddItemToArray(r, cJSON_CreateNumber(rl));
    cJSON_AddItemToArray(r, cJSON_CreateNumber(rh));
  }
  cJSON_AddNumberToObject(x, "runs", b->runs);
  cJSON_AddNumberToObject(x, "publications", b->publications);
  if (figure == SIM_BAND_OVERHEAD) {
    cJSON_AddNumberToObject(x, "bounds", b->bounds);
    cJSON_AddNumberToObject(x, "bounds_inside", b->bounds_inside);
  }
  cJSON_AddStringToObject(x, "like", b->like);
  cJSON_AddBoolToObject(x, "all", b->all);
  cJSON *names = cJSON_AddArrayToObject(x, "rows");
  for (int i = 0; i < N_ROWS; i++)
    if (b->rows & (1u << i)) {
      char s[160];
      snprintf(s, sizeof s, "%s %s", rows[i].source, rows[i].label);
      cJSON_AddItemToArray(names, cJSON_CreateString(s));
    }
}

void sim_band_json(cJSON *o, const sim_run_info *info, const sim_result *rs, int i) {
  sim_run_class c;
  sim_run_class_of(info, rs, i, &c);
  cJSON *band = cJSON_AddObjectToObject(o, "band");
  cJSON_AddStringToObject(band, "source", "docs/sim-validation.md, Validation: memory and cost");
  cJSON *run = cJSON_AddObjectToObject(band, "run");
  unsigned known, bits = run_bits(&c, &known);
  if (c.gpus > 0) cJSON_AddNumberToObject(run, "gpus", c.gpus);
  else cJSON_AddNullToObject(run, "gpus");
  if (c.compiled >= 0) cJSON_AddBoolToObject(run, "compiled", c.compiled);
  else cJSON_AddNullToObject(run, "compiled");
  if (c.seq > 0) cJSON_AddNumberToObject(run, "seq", c.seq);
  else cJSON_AddNullToObject(run, "seq");
  cJSON_AddNumberToObject(run, "cp", c.cp > 0 ? c.cp : 1);
  if (known & SIM_BAND_ATTR_LONG) cJSON_AddBoolToObject(run, "long_context", !!(bits & SIM_BAND_ATTR_LONG));
  else cJSON_AddNullToObject(run, "long_context");
  cJSON_AddBoolToObject(run, "copy_bound", !!(bits & SIM_BAND_ATTR_COPY));
  cJSON_AddBoolToObject(run, "other_offload", c.other_offload);
  sim_band b;
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  band_json(band, "memory", &b, SIM_BAND_MEMORY, saved_of(rs, i));
  sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
  band_json(band, "overhead", &b, SIM_BAND_OVERHEAD, c.overhead_pct);
}
