/*
 * cli_sim.c — `ferry sim`: dry-run policies over a trace on a simulated
 * GPU link and print what each saves and costs (docs/simulator.md).
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "ferry_tools.h"
#include "cli_sim.h"

#define MAX_RUNS 256



static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
  if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    b = NULL;
  }
  if (b) b[n] = 0;
  fclose(f);
  return b;
}

/* The policy source with its line `local KNOB = ...` set to value. */
static char *with_knob(const char *src, const char *knob, long value) {
  char v[32];
  snprintf(v, sizeof v, "%ld", value);
  return sim_policy_set_knob(src, knob, v);
}

typedef struct progress_state {
  const char *label;
  int run, runs; /* runs 0: --fit, counted as they start */
} progress_state;

/* The line on stderr (cli_progress: a terminal, not -q). */
static void on_progress(void *ud, uint32_t step, uint32_t steps) {
  progress_state *p = ud;
  if (!p->runs) {
    if (step == 1) p->run++;
    cli_progress(step == 1, "ferry sim --fit: setting %d, step %u/%u", p->run, step, steps);
  } else {
    cli_progress(step == 1, "ferry sim: run %d/%d %.40s: step %u/%u", p->run, p->runs, p->label,
                 step, steps);
  }
}

/* -v: how long a replay took, on stderr. */
static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}


typedef struct sim_job {
  char label[128];
  char path[PATH_MAX]; /* "" with no source: no policy (keep everything) */
  char *source; /* sweep: the substituted source */
  int recorded;
  double opt_fraction; /* --optimizer-fraction: the share stepped on the host */
  int32_t w_first, w_count; /* --weight-layers: the blocks whose weights are offloaded */
} sim_job;

/* What the trace reader takes (--max-line). */
static sim_trace_limits trace_limits = SIM_TRACE_LIMITS_DEFAULT;

/* The replay settings of o for one run on hw. */
static sim_config opts_config(const sim_opts *o, const sim_hw *hw) {
  sim_config c = {0};
  c.link = hw->link;
  c.duplex_d2h = hw->duplex_d2h;
  c.duplex_h2d = hw->duplex_h2d;
  c.steps = o->steps;
  c.warmup = o->warmup;
  c.host_cap_bytes = o->host_cap;
  c.host_ram_bytes = o->host_ram ? o->host_ram : (uint64_t)hw->host_ram_bytes;
  c.pinned_alloc_us = o->pin_alloc_us;
  c.pinned_touch_bytes_per_s = o->pin_touch_bytes_per_s;
  c.pinned_no_pool = o->no_pool;
  c.release_when_copied = o->release_copied;
  c.prefetch_at_backward_begin = o->prefetch_bwd;
  c.tflops = o->tflops > 0 ? o->tflops : hw->peak_tflops * o->mfu;
  c.hbm_bytes_per_s = o->hbm > 0 ? o->hbm : hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION;
  c.cpu_adam_params_per_s = o->cpu_adam;
  c.optimizer_serial = o->opt_serial;
  c.weight_single_buffer = o->w_single;
  c.comm_nodes = o->nodes;
  c.nvlink_bytes_per_s = o->nvlink >= 0 ? o->nvlink : hw->nvlink_bytes_per_s;
  c.nic_bytes_per_s = o->nic >= 0 ? o->nic : hw->nic_bytes_per_s;
  /* checked when the options were read (ferry_cli_sim) */
  (void)sim_node_apply(hw, o->gpus, o->numa_far, !o->contention_off, &c, NULL, 0);
  c.host_overhead_us = o->host_overhead_us;
  return c;
}

/* The node the runs are priced on, for the reports (sim_run_info). */
static void node_info(const sim_opts *o, const sim_hw *hw, sim_run_info *info) {
  sim_config c = opts_config(o, hw);
  info->gpus_per_node = o->gpus;
  info->gpus_given = o->gpus_given;
  info->numa_far = o->numa_far;
  info->contention = !o->contention_off;
  info->host_overhead_us = o->host_overhead_us;
  info->host_mem_bytes_per_s = c.host_mem_bytes_per_s;
  info->h2d_bytes_per_s = c.link.h2d_bytes_per_s;
  info->d2h_bytes_per_s = c.link.d2h_bytes_per_s;
}

/* --untracked for trace t into info (and so into every run's config): 0, or
 * 1 with a message in err. */
static int resolve_untracked(const sim_trace *t, const sim_opts *o, const sim_hw *hw,
                             sim_run_info *info, char *err, size_t errlen) {
  info->untracked_observed = t->device_peak;
  if (o->untracked_mode == UNTRACKED_OFF) return 0;
  if (o->untracked_mode == UNTRACKED_GIVEN) {
    info->untracked_bytes = o->untracked;
    info->untracked_given = 1;
    return 0;
  }
  sim_config c = opts_config(o, hw);
  return sim_untracked_bytes(t, &c, &info->untracked_bytes, &info->untracked_replayed, err,
                             errlen) != 0;
}

/* Replays the trace without offload, then once per job, and reports. runs,
 * when not NULL, gets each run's peak and step (n_jobs + 1: the baseline
 * first). */
typedef struct run_summary {
  uint64_t peak_device_bytes;
  double step_us;
  sim_run_class cls; /* for the error bands */
} run_summary;

/* A run's memory saved and step overhead over base, each with its error
 * band on published runs like it (sim_bands.c), on two lines. */
static void print_bands(const char *name, const sim_run_class *cls, double peak, double step,
                        double base_peak, double base_step) {
  sim_run_class c = *cls;
  c.overhead_pct = base_step > 0 ? 100.0 * (step - base_step) / base_step : 0;
  double saved = base_peak > 0 ? 100.0 * (base_peak - peak) / base_peak : 0;
  sim_band b;
  char t[384];
  sim_band_pick(&c, SIM_BAND_MEMORY, &b);
  sim_band_text(&b, SIM_BAND_MEMORY, saved, t, sizeof t);
  printf("  %-11s memory saved %.1f%%: %s\n", name, saved, t);
  sim_band_pick(&c, SIM_BAND_OVERHEAD, &b);
  sim_band_text(&b, SIM_BAND_OVERHEAD, c.overhead_pct, t, sizeof t);
  printf("  %-11s step overhead %+.1f%%: %s\n", "", c.overhead_pct, t);
}

static int run_sim(const char *trace_path, sim_hw hw, sim_job *jobs, int n_jobs, const sim_opts *o,
                   const char *json, const char *chrome, const char *svg, const char *html,
                   int layers_table, run_summary *runs) {
  char err[1024];
  sim_trace *t = NULL;
  if (sim_trace_load_limited(cli_input(trace_path), &trace_limits, &t, err, sizeof err)) {
    fprintf(stderr, "ferry sim: %s\n", err);
    return 1;
  }
  if (o->nodes > 1) { /* say so when --nodes has nothing to act on */
    uint32_t shard = 0;
    for (uint32_t i = 0; i < t->n_collectives; i++) shard += t->collectives[i].group == SIM_GROUP_SHARD;
    if (!shard)
      fprintf(stderr,
              "ferry sim: --nodes %u: the trace has no data-parallel collectives (shard 1, or "
              "written before ferry modelled them): nothing is sent across nodes\n",
              o->nodes);
  }
  int want_tl = chrome || svg || html;
  sim_run_info info = {.trace_path = trace_path, .trace = t, .hw = &hw};
  node_info(o, &hw, &info);
  info.mfu_sensitivity = o->mfu_sensitivity > 0 ? o->mfu_sensitivity : -1;
  if (resolve_untracked(t, o, &hw, &info, err, sizeof err)) {
    fprintf(stderr, "ferry sim: %s\n", err);
    sim_trace_free(t);
    return 1;
  }
  sim_result *rs = calloc((size_t)n_jobs + 1, sizeof *rs);
  progress_state ps = {.runs = n_jobs + 1};
  int rc = 0;
  for (int i = 0; i <= n_jobs && !rc; i++) {
    sim_config c = opts_config(o, &hw);
    c.untracked_bytes = info.untracked_bytes;
    c.timeline = want_tl;
    c.progress = on_progress;
    c.progress_ud = &ps;
    c.mfu_sensitivity = o->mfu_sensitivity;
    if (i > 0) {
      sim_job *j = &jobs[i - 1];
      c.label = j->label;
      if (j->recorded) c.replay_decisions = 1;
      else if (j->source) c.policy_source = j->source;
      else if (j->path[0]) c.policy_path = j->path;
      c.optimizer_fraction = j->opt_fraction;
      c.weight_first = j->w_first;
      c.weight_count = j->w_count;
    }
    ps.label = i ? jobs[i - 1].label : "no offload";
    ps.run = i + 1;
    double t0 = now_s();
    if (sim_replay(t, &c, &rs[i], err, sizeof err)) {
      cli_progress_end();
      fprintf(stderr, "ferry sim: %s\n", err);
      rc = 1;
    } else if (cli_verbosity > 0) {
      cli_progress_end();
      fprintf(stderr, "ferry sim: %s: %u steps replayed in %.3f s\n", ps.label, rs[i].steps,
              now_s() - t0);
    }
  }
  cli_progress_end();
  /* asked for, yet no replay at other rates ran: say why rather than
   * leave the reports without the paragraph */
  if (!rc && o->mfu_sensitivity_given && o->mfu_sensitivity > 0 && !(rs[0].sens_tflops[0] > 0) &&
      cli_verbosity >= 0) /* a warning: -q keeps errors only */
    fprintf(stderr, "ferry sim: --mfu-sensitivity: not run: no compute in this trace is timed "
                    "from FLOPs at a compute rate (--mfu, --tflops), so the rate changes "
                    "nothing; its times are the trace's own\n");
  if (!rc) {
    sim_print_table(stdout, &info, rs, n_jobs + 1);
    if (layers_table && n_jobs <= 4) sim_print_layers(stdout, rs, n_jobs + 1);
    /* an output "-" is written to a temporary file, then to stdout */
    const char *jp = cli_output(json), *cp = cli_output(chrome), *sp = cli_output(svg),
               *hp = cli_output(html);
    if ((json && !jp) || (chrome && !cp) || (svg && !sp) || (html && !hp)) {
      snprintf(err, sizeof err, "a temporary file for stdout: %s", strerror(errno));
      rc = 1;
    }
    if (!rc && json && sim_write_json(jp, &info, rs, n_jobs + 1, err, sizeof err)) rc = 1;
    if (!rc && chrome && sim_write_chrome_trace(cp, rs, n_jobs + 1, err, sizeof err)) rc = 1;
    if (!rc && svg && sim_write_svg(sp, &info, rs, n_jobs + 1, err, sizeof err)) rc = 1;
    if (!rc && html && sim_write_html(hp, &info, rs, n_jobs + 1, err, sizeof err)) rc = 1;
    if (rc) fprintf(stderr, "ferry sim: %s\n", err);
    if (rc) cli_output_abandon(); /* no half-written output on stdout */
    else if (cli_stdout_claimed() && cli_output_done("sim")) rc = 1;
    for (int i = 1; i <= n_jobs && !rc; i++)
      if (rs[i].policy_errors) rc = 3; /* a policy that faulted is worth a non-zero exit */
    for (int i = 0; runs && i <= n_jobs; i++)
      runs[i] = (run_summary){rs[i].peak_device_bytes, rs[i].step_us, {0}};
    for (int i = 0; runs && i <= n_jobs; i++) sim_run_class_of(&info, rs, i, &runs[i].cls);
  }
  for (int i = 0; i <= n_jobs; i++) sim_result_free(&rs[i]);
  free(rs);
  sim_trace_free(t);
  return rc;
}

/* --fit: the search, its choice as a policy file, and the commands to use it.
 * from_device: device_bytes is the preset's usable memory (--fit device).
 * chosen, when not NULL, gets the setting written (host_bytes 0 and fits 0
 * when none). */
static int run_fit(const char *trace_path, const char *hw_arg, const sim_hw *hw, const sim_opts *o,
                   uint64_t device_bytes, int from_device, uint64_t host_bytes,
                   const char *out_path, sim_fit_setting *chosen) {
  if (chosen) memset(chosen, 0, sizeof *chosen);
  char err[1024], path[PATH_MAX], why[512];
  if (ferry_policy_find("host_budget", path, sizeof path, why, sizeof why)) {
    fprintf(stderr, "ferry sim --fit: %s\n", why);
    return 1;
  }
  char *tmpl = read_file(path);
  sim_trace *t = NULL;
  if (!tmpl || sim_trace_load_limited(cli_input(trace_path), &trace_limits, &t, err, sizeof err)) {
    fprintf(stderr, "ferry sim --fit: %s\n", tmpl ? err : "cannot read the policy template");
    free(tmpl);
    return 1;
  }
  sim_run_info info = {.trace_path = trace_path, .trace = t, .hw = hw};
  node_info(o, hw, &info);
  if (resolve_untracked(t, o, hw, &info, err, sizeof err)) {
    fprintf(stderr, "ferry sim --fit: %s\n", err);
    free(tmpl);
    sim_trace_free(t);
    return 1;
  }
  sim_fit_config fc = {0};
  fc.policy_template = tmpl;
  fc.replay = opts_config(o, hw);
  fc.replay.untracked_bytes = info.untracked_bytes;
  progress_state ps = {0};
  fc.replay.progress = on_progress;
  fc.replay.progress_ud = &ps;
  fc.device_bytes = device_bytes;
  fc.host_bytes = host_bytes ? host_bytes : fc.replay.host_ram_bytes / 2;
  sim_fit_result fr;
  int rc = sim_fit(t, &fc, &fr, err, sizeof err);
  cli_progress_end();
  if (rc) fprintf(stderr, "ferry sim --fit: %s\n", err);
  sim_config bc = opts_config(o, hw);
  bc.untracked_bytes = info.untracked_bytes;
  sim_result base;
  memset(&base, 0, sizeof base);
  if (!rc && (rc = sim_replay(t, &bc, &base, err, sizeof err)))
    fprintf(stderr, "ferry sim --fit: %s\n", err);
  if (!rc) {
    printf("ferry sim --fit: %u settings of %s (HOST_BYTES in sixteenths of %.2f GiB, "
           "KEEP_LAST 0/1/2/4, FWD_STASH 1/4/16, PREFETCH_LAYERS 1/2) on %s, %u steps "
           "(--warmup %u)\n", fr.n, path, (double)fr.span_bytes / (1u << 30), hw->name,
           base.steps, base.warmup);
    char headroom[160] = "";
    if (from_device)
      snprintf(headroom, sizeof headroom, " (%s's %.0f GB: %.2f GiB exposed less %.2f GiB for the "
               "CUDA context and fragmentation)", hw->name, hw->device_bytes / 1e9,
               (hw->capacity_bytes > 0 ? hw->capacity_bytes : hw->device_bytes) / (1u << 30),
               SIM_DEVICE_ALLOWANCE_BYTES / (1u << 30));
    uint32_t n_fit = 0;
    for (uint32_t i = 0; i < fr.n; i++) n_fit += fr.settings[i].fits != 0;
    printf("no offload: peak %.2f GiB, step %.1f ms; target: device %.2f GiB%s, host %.2f GiB\n"
           "%u of the %u settings fit\n",
           (double)base.peak_device_bytes / (1u << 30), base.step_us / 1e3,
           (double)device_bytes / (1u << 30), headroom, (double)fc.host_bytes / (1u << 30), n_fit,
           fr.n);
    if (getenv("FERRY_FIT_ALL"))
      for (uint32_t i = 0; i < fr.n; i++) {
        const sim_fit_setting *x = &fr.settings[i];
        printf("  %6.2f GiB keep %d stash %2d prefetch %d: peak %6.2f GiB host %6.2f GiB step "
               "%8.1f ms%s\n", (double)x->host_bytes / (1u << 30), x->keep_last, x->fwd_stash,
               x->prefetch_layers, (double)x->peak_device_bytes / (1u << 30),
               (double)x->host_reserved_bytes / (1u << 30), x->step_us / 1e3,
               x->fits ? " fits" : "");
      }
    if (fr.best < 0) {
      uint64_t low = UINT64_MAX;
      for (uint32_t i = 0; i < fr.n; i++)
        if (fr.settings[i].peak_device_bytes < low) low = fr.settings[i].peak_device_bytes;
      printf("nothing in the search space fits: the lowest peak is %.2f GiB (more host budget, "
             "checkpointing or sharding would be needed)\n", (double)low / (1u << 30));
      rc = 4;
    }
  }
  if (!rc) {
    const sim_fit_setting *b = &fr.settings[fr.best];
    printf("best: HOST_BYTES = %llu (%.2f GiB), KEEP_LAST = %d, FWD_STASH = %d, "
           "PREFETCH_LAYERS = %d\n      peak %.2f GiB, host reserved %.2f GiB, step %.1f ms "
           "(%+.1f%%)\n", (unsigned long long)b->host_bytes, (double)b->host_bytes / (1u << 30),
           b->keep_last, b->fwd_stash, b->prefetch_layers,
           (double)b->peak_device_bytes / (1u << 30), (double)b->host_reserved_bytes / (1u << 30),
           b->step_us / 1e3, 100.0 * (b->step_us - base.step_us) / base.step_us);
    sim_run_class cls;
    sim_run_class_of(&info, NULL, 0, &cls);
    printf("how sure (docs/sim-validation.md, \"Validation: memory and cost\": the simulator's error "
           "on published runs like this one):\n");
    print_bands("best", &cls, (double)b->peak_device_bytes, b->step_us,
                (double)base.peak_device_bytes, base.step_us);
    if (chosen) *chosen = *b;
    char *src = sim_fit_source(tmpl, b);
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "-- written by `ferry sim --fit %llu --fit-host %llu --trace %s --hw %s`:\n"
             "-- peak %.2f GiB, host %.2f GiB, step %+.1f%% over no offload (simulated)\n",
             (unsigned long long)device_bytes, (unsigned long long)fc.host_bytes, trace_path,
             hw_arg, (double)b->peak_device_bytes / (1u << 30),
             (double)b->host_reserved_bytes / (1u << 30),
             100.0 * (b->step_us - base.step_us) / base.step_us);
    int to_stdout = !strcmp(out_path, "-");
    FILE *f = !src ? NULL : to_stdout ? cli_stdout() : fopen(out_path, "w");
    int bad = !f || fputs(hdr, f) < 0 || fputs(src, f) < 0;
    if (f && (to_stdout ? cli_output_done("sim") : fclose(f))) bad = 1;
    if (bad) {
      fprintf(stderr, "ferry sim --fit: cannot write %s\n", out_path);
      if (chosen) memset(chosen, 0, sizeof *chosen);
      rc = 1;
    } else if (to_stdout) {
      printf("wrote the policy to stdout\n");
    } else {
      printf("wrote %s\n  check it:  ferry sim --policy %s --trace %s --hw %s --steps %u "
             "--warmup %u\n  train:     ferry run --policy %s -- python train.py   "
             "(or ferry.torch.offload(model, policy=\"%s\"))\n",
             out_path, out_path, trace_path, hw_arg, base.steps, base.warmup, out_path, out_path);
    }
    free(src);
  }
  sim_result_free(&base);
  sim_fit_result_free(&fr);
  sim_trace_free(t);
  free(tmpl);
  return rc;
}

/* The demo's scenario: what a user would run that does not fit without
 * offloading. Qwen3-14B (the qwen3-14b preset), seq 8192, no activation
 * checkpointing, FSDP over the 8 GPUs of one H100 node: 99.9 GiB at peak on
 * an 80 GB H100 (docs/sim-model.md, "The demo"). */
#define DEMO_PRESET "qwen3-14b"
#define DEMO_NAME "Qwen3-14B"
#define DEMO_HW "h100"

static int demo(const char *dir) {
  if (mkdir(dir, 0777) && errno != EEXIST) {
    fprintf(stderr, "ferry sim --demo: cannot create %s: %s\n", dir, strerror(errno));
    return 1;
  }
  char trace[PATH_MAX], json[PATH_MAX], chrome[PATH_MAX], svg[PATH_MAX], html[PATH_MAX], err[256];
  snprintf(trace, sizeof trace, "%s/" DEMO_PRESET ".jsonl", dir);
  snprintf(json, sizeof json, "%s/sim.json", dir);
  snprintf(chrome, sizeof chrome, "%s/sim-trace.json", dir);
  snprintf(svg, sizeof svg, "%s/memory.svg", dir);
  snprintf(html, sizeof html, "%s/report.html", dir);
  synth_model m;
  synth_preset(DEMO_PRESET, &m);
  FILE *f = fopen(trace, "w");
  if (!f || synth_write(&m, f, err, sizeof err) || fclose(f)) {
    fprintf(stderr, "ferry sim --demo: cannot write %s\n", trace);
    return 1;
  }
  const sim_hw *hw = sim_hw_preset(DEMO_HW);
  sim_opts o = SIM_OPTS_INIT;
  double usable = sim_hw_usable_bytes(hw);
  printf("synthesized %s: %s-like (%.2fB parameters), seq %d, micro-batch %d, bf16, flash "
         "attention, no activation checkpointing, FSDP over %d GPUs: a full fine-tune on one "
         "8-GPU node. Compute timed on %s: %.0f TFLOP/s x MFU %.2f, %.0f GB/s of HBM.\n\n",
         trace, DEMO_NAME, (double)synth_param_count(&m) / 1e9, m.seq, m.micro_batch, m.shard,
         hw->name, hw->peak_tflops, o.mfu,
         hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION / 1e9);
  static const char *const names[3] = {"default", "layers", "budget"};
  sim_job jobs[3];
  memset(jobs, 0, sizeof jobs);
  for (int i = 0; i < 3; i++) {
    snprintf(jobs[i].label, sizeof jobs[i].label, "%s", names[i]);
    char why[512];
    if (ferry_policy_find(names[i], jobs[i].path, sizeof jobs[i].path, why, sizeof why)) {
      fprintf(stderr, "ferry sim --demo: %s\n", why);
      return 1;
    }
  }
  run_summary runs[4];
  int rc = run_sim(trace, *hw, jobs, 3, &o, json, chrome, svg, html, 1, runs);
  if (rc == 0 || rc == 3)
    printf("\nwrote %s (the report: open it in a browser, it needs no network), %s, %s "
           "(open in https://ui.perfetto.dev), %s and the trace %s\n", html, json, chrome, svg,
           trace);
  if (rc) return rc;
  /* the cheapest host_budget.lua setting that fits the H100 with headroom,
   * host budget half the preset's RAM per GPU */
  char fit[PATH_MAX];
  snprintf(fit, sizeof fit, "%s/fit.lua", dir);
  printf("\n$ ferry sim --fit device --trace %s --hw %s --fit-out %s\n", trace, hw->name, fit);
  o.steps = 4;
  o.warmup = 2;
  sim_fit_setting best;
  rc = run_fit(trace, hw->name, hw, &o, (uint64_t)usable, 1, 0, fit, &best);
  if (rc && rc != 4) return rc;
  printf("\nin short, on %s (%.0f GB, %.2f GiB usable: %.2f GiB kept for the CUDA context and "
         "fragmentation):\n", hw->name, hw->device_bytes / 1e9, usable / (1u << 30),
         SIM_DEVICE_ALLOWANCE_BYTES / (1u << 30));
  const char *base_name = strrchr(fit, '/') ? strrchr(fit, '/') + 1 : fit;
  for (int i = 0; i <= 4; i++) {
    if (i == 4 && !best.fits) break;
    const char *name = i == 0 ? "no offload" : i < 4 ? names[i - 1] : base_name;
    double peak = i < 4 ? (double)runs[i].peak_device_bytes : (double)best.peak_device_bytes;
    double step = i < 4 ? runs[i].step_us : best.step_us;
    int fits = peak <= usable;
    printf("  %-11s peak %6.2f GiB", name, peak / (1u << 30));
    if (i) printf(", step %+6.1f%%", 100.0 * (step - runs[0].step_us) / runs[0].step_us);
    else printf("%14s", "");
    printf(": %s", fits ? "fits" : i == 0 ? "does NOT fit without offloading" : "does not fit");
    if (i == 4)
      printf("  <- recommended: host_budget.lua with HOST_BYTES %.2f GiB, KEEP_LAST %d, "
             "FWD_STASH %d, PREFETCH_LAYERS %d; %.2f GiB of pinned host memory",
             (double)best.host_bytes / (1u << 30), best.keep_last, best.fwd_stash,
             best.prefetch_layers, (double)best.host_reserved_bytes / (1u << 30));
    putchar('\n');
  }
  printf("how sure (docs/sim-validation.md, \"Validation: memory and cost\": the simulator's error "
         "on published runs like each, and where a real run like them landed):\n");
  for (int i = 1; i <= 4; i++) {
    if (i == 4 && !best.fits) break;
    const char *name = i < 4 ? names[i - 1] : base_name;
    print_bands(name, &runs[0].cls,
                i < 4 ? (double)runs[i].peak_device_bytes : (double)best.peak_device_bytes,
                i < 4 ? runs[i].step_us : best.step_us, (double)runs[0].peak_device_bytes,
                runs[0].step_us);
  }
  if (!best.fits) {
    printf("nothing in --fit's search fits: see above\n");
    return 4;
  }
  printf("check it:  ferry sim --policy %s --trace %s --hw %s --steps %u --warmup %d\n"
         "use it:    ferry run --policy %s -- python train.py\n",
         fit, trace, hw->name, o.steps, o.warmup, fit);
  return 0;
}

int ferry_cli_sim(int argc, char **argv) {
  static const struct option opts[] = {
      {"policy", required_argument, 0, 'p'},  {"trace", required_argument, 0, 't'},
      {"hw", required_argument, 0, 'w'},      {"link", required_argument, 0, 'l'},
      {"steps", required_argument, 0, 'n'},   {"json", required_argument, 0, 'j'},
      {"chrome-trace", required_argument, 0, 'c'}, {"svg", required_argument, 0, 's'},
      {"html", required_argument, 0, 'E'},
      {"sweep", required_argument, 0, 'S'},   {"recorded", no_argument, 0, 'r'},
      {"host-cap", required_argument, 0, 'C'}, {"no-layers", no_argument, 0, 'L'},
      {"demo", required_argument, 0, 'D'},    {"help", no_argument, 0, 'h'},
      {"host-ram", required_argument, 0, 'R'}, {"warmup", required_argument, 0, 'W'},
      {"pinned", required_argument, 0, 'P'},  {"fit", required_argument, 0, 'F'},
      {"fit-host", required_argument, 0, 'H'}, {"fit-out", required_argument, 0, 'O'},
      {"mfu", required_argument, 0, 'M'},     {"tflops", required_argument, 0, 'T'},
      {"hbm", required_argument, 0, 'G'},
      {"release-copied", no_argument, 0, 'X'}, {"prefetch-at-backward", no_argument, 0, 'B'},
      {"max-line", required_argument, 0, 'Y'}, {"quiet", no_argument, 0, 'q'},
      {"optimizer-fraction", required_argument, 0, 'o'}, {"cpu-adam", required_argument, 0, 'A'},
      {"optimizer-overlap", required_argument, 0, 'V'}, {"verbose", no_argument, 0, 'v'},
      {"weight-layers", required_argument, 0, 'K'},
      {"weight-double-buffer", required_argument, 0, 'U'},
      {"untracked", required_argument, 0, 'u'},
      {"nodes", required_argument, 0, 'N'},   {"nvlink", required_argument, 0, 'Z'},
      {"nic", required_argument, 0, 'I'},
      {"gpus-per-node", required_argument, 0, 'g'}, {"numa-far", required_argument, 0, 'J'},
      {"contention", required_argument, 0, 'Q'}, {"host-overhead", required_argument, 0, 'y'},
      {"mfu-sensitivity", required_argument, 0, 'e'},
      {0, 0, 0, 0}};
  const char *policies = NULL, *trace = NULL, *hw_name = "h100", *link = NULL, *json = NULL,
             *chrome = NULL, *svg = NULL, *html = NULL, *sweep = NULL, *demo_dir = NULL;
  long steps = 3, warmup = 1;
  int steps_given = 0, warmup_given = 0;
  int recorded = 0, layers_table = 1, c;
  sim_opts o = SIM_OPTS_INIT;
  uint64_t fit = 0, fit_host = 0, line_limit;
  int fit_device = 0, mfu_sensitivity_given = 0;
  const char *fit_host_arg = NULL, *fit_out_arg = NULL; /* given: --fit's own options */
  const char *fit_out = "fit.lua";
  double fractions[MAX_FRACTIONS];
  int n_fractions = 0;
  weight_item witems[MAX_WEIGHT_ITEMS];
  int n_witems = 0;
  optind = 1;
  opterr = 0; /* cli_bad_option names the flag and a close one */
  while ((c = getopt_long(argc, argv, ":hqv", opts, NULL)) != -1) {
    switch (c) {
    case 'p': policies = optarg; break;
    case 't': trace = optarg; break;
    case 'w': hw_name = optarg; break;
    case 'l': link = optarg; break;
    case 'n':
      if (cli_int("sim", "--steps", optarg, 1, 1000000, &steps)) return 2;
      steps_given = 1;
      break;
    case 'j': json = optarg; break;
    case 'c': chrome = optarg; break;
    case 's': svg = optarg; break;
    case 'E': html = optarg; break;
    case 'S': sweep = optarg; break;
    case 'r': recorded = 1; break;
    case 'C':
      if (cli_bytes("sim", "--host-cap", optarg, 1, &o.host_cap)) return 2;
      break;
    case 'R':
      if (cli_bytes("sim", "--host-ram", optarg, 1, &o.host_ram)) return 2;
      break;
    case 'W':
      if (cli_int("sim", "--warmup", optarg, 0, 1000000, &warmup)) return 2;
      warmup_given = 1;
      break;
    case 'P':
      if (sim_parse_pinned(optarg, &o)) return 2;
      break;
    case 'F': /* "device": the --hw preset's memory less the headroom */
      if (!strcmp(optarg, "device")) fit_device = 1;
      else if (cli_bytes("sim", "--fit", optarg, 1, &fit)) return 2;
      else fit_device = 0;
      break;
    case 'H':
      if (cli_bytes("sim", "--fit-host", optarg, 1, &fit_host)) return 2;
      fit_host_arg = optarg;
      break;
    case 'O': fit_out = fit_out_arg = optarg; break;
    case 'X': o.release_copied = 1; break;
    case 'B': o.prefetch_bwd = 1; break;
    case 'M':
    case 'T': {
      double x;
      if (cli_number("sim", c == 'M' ? "--mfu" : "--tflops", optarg, FERRY_NUMBER_REAL, 0,
                     c == 'M' ? 1 : 1e6, 1, &x))
        return 2;
      if (c == 'M') o.mfu = x;
      else o.tflops = x;
      break;
    }
    case 'N': {
      long nodes;
      if (cli_int("sim", "--nodes", optarg, 1, 100000, &nodes)) return 2;
      o.nodes = (uint32_t)nodes;
      break;
    }
    case 'Z':
    case 'I': /* GB/s per GPU, NCCL's bus bandwidth */
      if (cli_number("sim", c == 'Z' ? "--nvlink" : "--nic", optarg, FERRY_NUMBER_REAL, 0, 1e5, 0,
                     c == 'Z' ? &o.nvlink : &o.nic))
        return 2;
      *(c == 'Z' ? &o.nvlink : &o.nic) *= 1e9;
      break;
    case 'G': /* GB/s, as `ferry trace synth --hbm` takes it */
      if (cli_number("sim", "--hbm", optarg, FERRY_NUMBER_REAL, 0, 1e7, 1, &o.hbm)) return 2;
      o.hbm *= 1e9;
      break;
    case 'o':
      if ((n_fractions = sim_parse_fractions(optarg, fractions)) < 0) return 2;
      break;
    case 'A': /* 1000 params/s (a stalled host) to 10 T params/s (a generous bound) */
      if (cli_number("sim", "--cpu-adam", optarg, FERRY_NUMBER_REAL, 1e3, 1e13, 0, &o.cpu_adam))
        return 2;
      break;
    case 'V':
      if (strcmp(optarg, "on") && strcmp(optarg, "off")) {
        fprintf(stderr, "ferry sim: --optimizer-overlap %s: expected on or off\n", optarg);
        return 2;
      }
      o.opt_serial = !strcmp(optarg, "off");
      break;
    case 'K':
      if ((n_witems = sim_parse_weight_layers(optarg, witems)) < 0) return 2;
      break;
    case 'U':
      if (strcmp(optarg, "on") && strcmp(optarg, "off")) {
        fprintf(stderr, "ferry sim: --weight-double-buffer %s: expected on or off\n", optarg);
        return 2;
      }
      o.w_single = !strcmp(optarg, "off");
      break;
    case 'u': /* auto, off or a size */
      if (!strcmp(optarg, "auto")) o.untracked_mode = UNTRACKED_AUTO;
      else if (!strcmp(optarg, "off")) o.untracked_mode = UNTRACKED_OFF;
      else if (cli_bytes("sim", "--untracked", optarg, 0, &o.untracked)) return 2;
      else o.untracked_mode = UNTRACKED_GIVEN;
      break;
    case 'g': {
      long g;
      if (cli_int("sim", "--gpus-per-node", optarg, 1, 64, &g)) return 2;
      o.gpus = (int)g;
      o.gpus_given = 1;
      break;
    }
    case 'J':
      if (cli_number("sim", "--numa-far", optarg, FERRY_NUMBER_REAL, 0, 1, 1, &o.numa_far)) return 2;
      break;
    case 'Q':
      if (strcmp(optarg, "on") && strcmp(optarg, "off")) {
        fprintf(stderr, "ferry sim: --contention %s: expected on or off\n", optarg);
        return 2;
      }
      o.contention_off = !strcmp(optarg, "off");
      break;
    case 'y': /* µs per saved tensor, or a torch version's measured figure */
      if (!strcmp(optarg, "torch2")) o.host_overhead_us = SIM_HOST_OVERHEAD_TORCH2_US;
      else if (!strcmp(optarg, "torch1")) o.host_overhead_us = SIM_HOST_OVERHEAD_TORCH1_US;
      else if (*optarg && strspn(optarg, "0123456789.+-eE") != strlen(optarg)) {
        /* a word: name the words it takes, not only "a number" */
        fprintf(stderr, "ferry sim: --host-overhead %s: expected US (microseconds per saved "
                "tensor), torch1 or torch2\n", optarg);
        return 2;
      } else if (cli_number("sim", "--host-overhead", optarg, FERRY_NUMBER_REAL, 0, 1e6, 0,
                          &o.host_overhead_us))
        return 2;
      break;
    case 'e':
      if (sim_parse_mfu_sensitivity(optarg, &o.mfu_sensitivity)) return 2;
      mfu_sensitivity_given = o.mfu_sensitivity_given = 1;
      break;
    case 'L': layers_table = 0; break;
    case 'Y':
      if (cli_bytes("sim", "--max-line", optarg, 64, &line_limit)) return 2;
      trace_limits.max_line_bytes = (size_t)line_limit;
      break;
    case 'D': demo_dir = optarg; break;
    case 'q': cli_verbosity = -1; break;
    case 'v': cli_verbosity = 1; break;
    case 'h': sim_usage(stdout); return 0;
    case ':':
    case '?':
      cli_bad_option("sim", opts, argv, optind, optopt, c == ':');
      fprintf(stderr, "see 'ferry sim --help'\n");
      return 2;
    default: sim_usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "ferry sim: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (cli_verbosity < 0) ferry_log_level(FERRY_LOG_ERROR);
  /* "-": stdin read once, one output on stdout */
  int dash = cli_claim_stdin("sim", "--trace", trace);
  static const char *const out_flags[] = {"--json", "--chrome-trace", "--svg", "--html",
                                          "--fit-out"};
  const char *out_values[] = {json, chrome, svg, html, fit || fit_device ? fit_out : NULL};
  for (int i = 0; i < 5 && !dash; i++) dash = cli_claim_stdout("sim", out_flags[i], out_values[i]);
  if (dash) return dash;
  if (demo_dir) return demo(demo_dir);
  const sim_hw *preset = sim_hw_preset(hw_name);
  if (!preset) {
    fprintf(stderr, "ferry sim: unknown --hw %s (presets: %s)\n", hw_name, sim_hw_names());
    return 2;
  }
  sim_hw hw = *preset;
  char err[512];
  if (link && sim_parse_link(link, &hw, err, sizeof err)) {
    fprintf(stderr, "ferry sim: %s\n", err);
    return 2;
  }
  sim_config node_check = {0};
  if (sim_node_apply(&hw, o.gpus, o.numa_far, 1, &node_check, err, sizeof err)) {
    fprintf(stderr, "ferry sim: %s\n", err);
    return 2;
  }
  if (!trace) {
    fprintf(stderr, "ferry sim: --trace FILE is required (`ferry trace synth` writes one)\n");
    return 2;
  }
  if (fit_device) fit = (uint64_t)sim_hw_usable_bytes(&hw);
  o.steps = (uint32_t)steps;
  o.warmup = warmup ? (int32_t)warmup : -1;
  if (fit && !steps_given) o.steps = 4;
  if (fit && !warmup_given) o.warmup = 2; /* learning in step 1, arena growth in step 2 */
  if (fit && n_fractions) {
    fprintf(stderr, "ferry sim: --fit does not search --optimizer-fraction (yet): run --fit, "
                    "then check its policy with --optimizer-fraction\n");
    return 2;
  }
  if (fit && n_witems) {
    fprintf(stderr, "ferry sim: --fit does not search --weight-layers (yet): run --fit, "
                    "then check its policy with --weight-layers\n");
    return 2;
  }
  if (!fit && (fit_host_arg || fit_out_arg)) { /* else ignored: no search runs */
    fprintf(stderr, "ferry sim: %s %s: only with --fit (the search's %s); add --fit BYTES or "
                    "--fit device\n", fit_host_arg ? "--fit-host" : "--fit-out",
            fit_host_arg ? fit_host_arg : fit_out_arg,
            fit_host_arg ? "host budget" : "policy file");
    return 2;
  }
  if (fit && mfu_sensitivity_given) {
    fprintf(stderr, "ferry sim: --mfu-sensitivity with --fit: the search replays each setting "
                    "once and reports no sensitivity; check its policy with --mfu-sensitivity\n");
    return 2;
  }
  if (fit)
    return run_fit(trace, link ? "custom" : hw_name, &hw, &o, fit, fit_device, fit_host, fit_out,
                   NULL);
  if (!policies && !recorded && !n_fractions && !n_witems) {
    fprintf(stderr, "ferry sim: --policy is required (e.g. --policy default,budget)\n");
    return 2;
  }
  /* sweep range */
  char knob[64] = "";
  long lo = 0, hi = -1, step = 1;
  if (sweep) {
    const char *eq = strchr(sweep, '=');
    int ok = eq && eq > sweep && (size_t)(eq - sweep) < sizeof knob;
    if (ok) {
      snprintf(knob, sizeof knob, "%.*s", (int)(eq - sweep), sweep);
      char *end;
      lo = strtol(eq + 1, &end, 10);
      ok = end != eq + 1 && end[0] == '.' && end[1] == '.';
      if (ok) {
        const char *b = end + 2;
        hi = strtol(b, &end, 10);
        ok = end != b;
        if (ok && *end == ':') {
          b = end + 1;
          step = strtol(b, &end, 10);
          ok = end != b && step > 0;
        }
        /* bounded first: hi - lo must not overflow */
        ok = ok && !*end && labs(lo) < 1000000000 && labs(hi) < 1000000000 && hi >= lo &&
             (hi - lo) / step < MAX_RUNS;
      }
    }
    if (!ok) {
      fprintf(stderr, "ferry sim: --sweep %s: expected KNOB=A..B[:STEP] with A <= B, at most "
                      "%d values\n", sweep, MAX_RUNS);
      return 2;
    }
  }
  sim_job *jobs = calloc(MAX_RUNS + 1, sizeof *jobs);
  int n = 0, rc = 0;
  char *list = strdup(policies ? policies : ""), *stdin_src = NULL;
  for (char *save = NULL, *p = strtok_r(list, ",", &save); p && !rc; p = strtok_r(NULL, ",", &save)) {
    char path[PATH_MAX];
    char why[512];
    int from_stdin = !strcmp(p, "-");
    if (from_stdin) { /* the source itself: a label "stdin", chunk name "policy" */
      if ((rc = cli_claim_stdin("sim", "--policy", p))) break;
      if (!(stdin_src = cli_read_stdin(16u << 20, NULL))) {
        fprintf(stderr, "ferry sim: --policy -: cannot read stdin: %s\n", strerror(errno));
        rc = 1;
        break;
      }
      snprintf(path, sizeof path, "stdin");
    } else if (ferry_policy_find(p, path, sizeof path, why, sizeof why)) {
      fprintf(stderr, "ferry sim: --policy: %s\n", why);
      rc = 2;
      break;
    }
    if (cli_verbosity > 0) fprintf(stderr, "ferry sim: --policy %s: %s\n", p, path);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char name[100];
    snprintf(name, sizeof name, "%.99s", base);
    char *dot = strrchr(name, '.');
    if (dot && !strcmp(dot, ".lua")) *dot = 0;
    if (!sweep) {
      if (n >= MAX_RUNS) break;
      snprintf(jobs[n].label, sizeof jobs[n].label, "%s", name);
      if (from_stdin && !(jobs[n].source = strdup(stdin_src))) {
        fprintf(stderr, "ferry sim: out of memory\n");
        rc = 1;
        break;
      }
      if (!from_stdin) snprintf(jobs[n].path, sizeof jobs[n].path, "%s", path);
      n++;
      continue;
    }
    char *src = from_stdin ? strdup(stdin_src) : read_file(path);
    if (!src) {
      fprintf(stderr, "ferry sim: cannot read %s\n", path);
      rc = 2;
      break;
    }
    for (long v = lo; v <= hi && n < MAX_RUNS; v += step) {
      char *s = with_knob(src, knob, v);
      if (!s) {
        fprintf(stderr, "ferry sim: --sweep: %s has no line `local %s = ...` to set\n", path, knob);
        rc = 2;
        break;
      }
      snprintf(jobs[n].label, sizeof jobs[n].label, "%s %s=%ld", name, knob, v);
      snprintf(jobs[n].path, sizeof jobs[n].path, "%s", path);
      jobs[n].source = s;
      n++;
    }
    free(src);
  }
  free(list);
  free(stdin_src);
  if (!rc && recorded && n < MAX_RUNS) {
    snprintf(jobs[n].label, sizeof jobs[n].label, "recorded decisions");
    jobs[n++].recorded = 1;
  }
  if (!rc && n_fractions) { /* every run once per share; no policy: keep every tensor */
    if (n == 0) n = 1; /* jobs[0] is zeroed: no policy */
    if ((long)n * n_fractions > MAX_RUNS) {
      fprintf(stderr, "ferry sim: %d runs x %d optimizer shares is over %d runs\n", n,
              n_fractions, MAX_RUNS);
      rc = 2;
    } else {
      for (int i = n - 1; i >= 0; i--)
        for (int k = n_fractions - 1; k >= 0; k--) {
          sim_job *dst = &jobs[i * n_fractions + k];
          sim_job base = jobs[i];
          if (k) base.source = base.source ? strdup(base.source) : NULL;
          *dst = base;
          dst->opt_fraction = fractions[k];
          if (base.label[0])
            snprintf(dst->label, sizeof dst->label, "%.100s opt=%g", base.label, fractions[k]);
          else snprintf(dst->label, sizeof dst->label, "optimizer %g", fractions[k]);
        }
      n *= n_fractions;
    }
  }
  if (!rc && n_witems) { /* every run once per item; no policy: keep every tensor */
    if (n == 0) n = 1;
    if ((long)n * n_witems > MAX_RUNS) {
      fprintf(stderr, "ferry sim: %d runs x %d weight-layer items is over %d runs\n", n,
              n_witems, MAX_RUNS);
      rc = 2;
    } else {
      for (int i = n - 1; i >= 0; i--)
        for (int k = n_witems - 1; k >= 0; k--) {
          sim_job *dst = &jobs[i * n_witems + k];
          sim_job base = jobs[i];
          if (k) base.source = base.source ? strdup(base.source) : NULL;
          *dst = base;
          dst->w_first = witems[k].first;
          dst->w_count = witems[k].count;
          if (base.label[0])
            snprintf(dst->label, sizeof dst->label, "%.100s w=%s", base.label, witems[k].text);
          else snprintf(dst->label, sizeof dst->label, "weights %s", witems[k].text);
        }
      n *= n_witems;
    }
  }
  if (!rc) rc = run_sim(trace, hw, jobs, n, &o, json, chrome, svg, html, layers_table, NULL);
  for (int i = 0; i < n; i++) free(jobs[i].source);
  free(jobs);
  return rc;
}
