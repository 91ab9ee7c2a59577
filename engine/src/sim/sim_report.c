/*
 * sim_report.c — presets, link syntax, tables, JSON and Chrome trace
 * of the simulator (declared in ferry_tools.h).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ferry_tools.h"
#include "sim/sim_format.h"
#include "util/chrome_trace.h"

#define GB 1e9

/* Published measurements (docs/sim-model.md gives the sources). latency is
 * the per-copy fixed cost: 3-7 us of host submission for cudaMemcpyAsync. */
/* Then dense BF16 peak (TFLOP/s) and HBM bandwidth, from the vendors'
 * datasheets (H100 SXM 3.35 TB/s, H200 4.8, A100 80GB SXM 2.039, GH200 96 GB
 * HBM3 4.0; docs/hardware.md); last, the capacity CUDA exposes, as torch's
 * out-of-memory message gives it: H100 80GB 79.11 GiB, H200 139.80 GiB,
 * A100 80GB 79.15 GiB, A100 40GB 39.39 GiB (the lowest seen: PCIe cards show
 * up to 39.59), GH200 480GB (96 GB HBM3) 94.50 GiB (vLLM issue #9630); sources
 * in docs/hardware.md. Then the collectives' bus bandwidth per GPU: NVLink
 * as NCCL measures it (H100/H200 360 GB/s: NVIDIA/nccl-tests issue #326,
 * NCCL's maintainer; A100 240 GB/s, NVLink 3's 300 GB/s a direction at
 * the same share), and the GPU's own NIC across nodes (DGX H100/H200: one
 * 400 Gb/s ConnectX-7 per GPU, 50 GB/s; DGX A100: 200 Gb/s HDR, 25 GB/s).
 * Last, the node (docs/hardware.md, "Node sharing"):
 * DGX H100/H200 have 8 GPUs, each behind its own ConnectX-7's PCIe switch,
 * and two Xeon 8480C sockets of 8 DDR5-4800 channels, ~300 GB/s each as
 * Intel MLC measures such a socket; DGX A100 has 8 GPUs, two per PCIe
 * switch, and two EPYC 7742 sockets of 8 DDR4-3200 channels (204.8 GB/s
 * each); a GH200 is one GPU with its own Grace (host memory not modelled). */
#define GIB_ 1073741824.0
static const sim_hw presets[] = {
    {"h100", "H100 SXM, PCIe Gen5 host link, pinned", {55 * GB, 55 * GB, 5.0, 50.0 / 55.0},
     50.0 / 55.0, 50.0 / 55.0, 80 * GB, "nvbandwidth v0.10 on 8x H100 / Xeon 8462Y+", 2000 * GB / 8,
     989, 3350 * GB, 79.11 * GIB_, 360 * GB, 50 * GB, 8, 1, 600 * GB},
    {"h200", "H200, PCIe Gen5 host link, pinned", {52.5 * GB, 54 * GB, 5.0, 50.0 / 55.0},
     50.0 / 55.0, 50.0 / 55.0, 141 * GB,
     "DeepSpeed PR #8283 (duplex not published: H100's figure)", 2000 * GB / 8, 989, 4800 * GB,
     139.80 * GIB_, 360 * GB, 50 * GB, 8, 1, 600 * GB},
    {"a100", "A100, PCIe Gen4 host link, pinned", {25 * GB, 25 * GB, 5.0, 0.72}, 24.0 / 25.0,
     12.0 / 25.0, 80 * GB, "NVIDIA/nvbandwidth issues #11 and #53", 2000 * GB / 8, 312, 2039 * GB,
     79.15 * GIB_, 240 * GB, 25 * GB, 8, 2, 409.6 * GB},
    /* the 40 GB A100 (SXM4): same host link; 1,555 GB/s HBM2 (A100
     * datasheet); torch reports "39.39 GiB total capacity" for it */
    {"a100-40", "A100 40GB, PCIe Gen4 host link, pinned", {25 * GB, 25 * GB, 5.0, 0.72}, 24.0 / 25.0,
     12.0 / 25.0, 40 * GB, "NVIDIA/nvbandwidth issues #11 and #53", 2000 * GB / 8, 312, 1555 * GB,
     39.39 * GIB_, 240 * GB, 25 * GB, 8, 2, 409.6 * GB},
    {"gh200", "GH200, NVLink-C2C", {290 * GB, 340 * GB, 5.0, 0.5}, 160.0 / 290.0, 160.0 / 340.0,
     96 * GB, "NVIDIA/nvbandwidth issues #23 and #41", 480 * GB, 989, 4000 * GB,
     94.50 * GIB_, 360 * GB, 50 * GB, 1, 1, 0},
};

const sim_hw *sim_hw_preset(const char *name) {
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
    if (name && !strcasecmp(name, presets[i].name)) return &presets[i];
  return NULL;
}

const char *sim_hw_names(void) { return "h100, h200, a100, a100-40, gh200"; }

double sim_hw_usable_bytes(const sim_hw *hw) {
  if (!hw) return 0;
  double cap = hw->capacity_bytes > 0 ? hw->capacity_bytes : hw->device_bytes;
  return cap > SIM_DEVICE_ALLOWANCE_BYTES ? cap - SIM_DEVICE_ALLOWANCE_BYTES : 0;
}

int sim_parse_link(const char *spec, sim_hw *hw, char *err, size_t errlen) {
  char *copy = strdup(spec ? spec : "");
  if (!copy) return -1;
  int rc = 0;
  for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(tok, '=');
    if (!eq) {
      snprintf(err, errlen, "--link: \"%s\" is not key=value (keys: h2d, d2h, latency, duplex, "
                            "duplex_h2d, duplex_d2h)", tok);
      rc = -1;
      break;
    }
    *eq = 0;
    const char *k = tok, *v = eq + 1;
    double x;
    char what[32];
    snprintf(what, sizeof what, "--link %s", k);
    /* 1 MB/s to 100 TB/s: outside it a link model means nothing */
    if (!strcmp(k, "h2d") || !strcmp(k, "d2h")) {
      if (ferry_parse_number(what, v, FERRY_NUMBER_BANDWIDTH, 1e6, 1e14, 0, &x, err, errlen)) {
        rc = -1;
        break;
      }
      if (k[0] == 'h') hw->link.h2d_bytes_per_s = x;
      else hw->link.d2h_bytes_per_s = x;
    } else if (!strcmp(k, "latency")) {
      if (ferry_parse_number(what, v, FERRY_NUMBER_DURATION, 0, 1e6, 0, &x, err, errlen)) {
        rc = -1;
        break;
      }
      hw->link.latency_us = x;
    } else if (!strcmp(k, "duplex") || !strcmp(k, "duplex_h2d") || !strcmp(k, "duplex_d2h")) {
      if (ferry_parse_number(what, v, FERRY_NUMBER_REAL, 0, 1, 1, &x, err, errlen)) {
        rc = -1;
        break;
      }
      if (!strcmp(k, "duplex")) hw->link.duplex = hw->duplex_d2h = hw->duplex_h2d = x;
      else if (k[7] == 'h') hw->duplex_h2d = x;
      else hw->duplex_d2h = x;
    } else {
      snprintf(err, errlen, "--link: unknown key \"%s\" (keys: h2d, d2h, latency, duplex, "
                            "duplex_h2d, duplex_d2h)", k);
      rc = -1;
      break;
    }
  }
  free(copy);
  return rc;
}

/* ---- tables ---------------------------------------------------------------------- */
static double pct(double v, double base) { return base > 0 ? 100.0 * (v - base) / base : 0; }

/* Runs with optimizer-state offload: what moves, what it frees and costs. */
static void sim_print_optimizer(FILE *f, const sim_result *rs, int n) {
  int any = 0;
  for (int i = 0; i < n; i++) any |= rs[i].opt_fraction > 0;
  if (!any) return;
  fprintf(f, "\noptimizer-state offload (docs/sim-model.md): the host steps a share of the "
             "parameters; per steady step:");
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    if (!(r->opt_fraction > 0)) continue;
    char fr[32], hb[32], d2h[32], h2d[32], cpu[32], ex[32];
    fmt_bytes(fr, sizeof fr, (double)r->opt_device_bytes);
    fmt_bytes(hb, sizeof hb, (double)r->opt_host_bytes);
    fmt_bytes(d2h, sizeof d2h, r->opt_bytes_d2h);
    fmt_bytes(h2d, sizeof h2d, r->opt_bytes_h2d);
    fmt_us(cpu, sizeof cpu, r->opt_cpu_us);
    fmt_us(ex, sizeof ex, r->opt_stall_us);
    fprintf(f, "\n  %-22.22s share %.2f (%.3g params at %.3g params/s, %s): device -%s, "
               "host +%s pinned; gradients D2H %s, parameters H2D %s, host step %s, "
               "exposed %s", r->label, r->opt_fraction, r->opt_params,
            r->opt_cpu_adam_params_per_s, r->opt_serial ? "serial" : "overlapped", fr, hb, d2h,
            h2d, cpu, ex);
  }
  fputc('\n', f);
}

/* Runs with weight offload: which blocks, what moves and what it costs. */
static void sim_print_weights(FILE *f, const sim_result *rs, int n) {
  int any = 0;
  for (int i = 0; i < n; i++) any |= rs[i].w_count > 0;
  if (!any) return;
  fprintf(f, "\nweights (docs/sim-model.md, \"Weight offload\"): blocks' weights D2H after their "
             "forward, H2D before their backward; per steady step, in D2H/H2D and stall above:");
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    if (!(r->w_count > 0)) continue;
    char each[32], dev[32], d2h[32], h2d[32], ex[32];
    fmt_bytes(each, sizeof each, (double)r->w_layer_bytes);
    fmt_bytes(dev, sizeof dev, (double)r->w_device_bytes);
    fmt_bytes(d2h, sizeof d2h, r->w_bytes_d2h);
    fmt_bytes(h2d, sizeof h2d, r->w_bytes_h2d);
    fmt_us(ex, sizeof ex, r->w_stall_us);
    fprintf(f, "\n  %-22.22s blocks %d..%d (%d x %s%s), %s: %s on the host (pinned); D2H %s, "
               "H2D %s, exposed %s", r->label, r->w_first, r->w_first + r->w_count - 1,
            r->w_count, each, r->w_estimated ? ", estimated: parameters / layers" : "",
            r->w_double_buffer ? "double-buffered" : "single-buffered", dev, d2h, h2d, ex);
  }
  fputc('\n', f);
}

/* Where the untracked device memory in every peak comes from. */
static void print_untracked(FILE *f, const sim_run_info *info) {
  char u[32], seen[32], rep[32];
  fmt_bytes(u, sizeof u, (double)info->untracked_bytes);
  fmt_bytes(seen, sizeof seen, (double)info->untracked_observed);
  fmt_bytes(rep, sizeof rep, (double)info->untracked_replayed);
  if (info->untracked_given)
    fprintf(f, "untracked device memory: %s (--untracked), counted in every peak\n", u);
  else if (info->untracked_bytes)
    fprintf(f, "untracked device memory: %s, counted in every peak: the recorded run peaked at "
               "%s, its own decisions replayed here at %s (memory never saved for backward: "
               "the loss's transients, workspaces)\n", u, seen, rep);
  else if (info->untracked_replayed)
    fprintf(f, "untracked device memory: none: the recorded run peaked at %s, its own decisions "
               "replayed here at %s\n", seen, rep);
}

static void print_sensitivity(FILE *f, const sim_run_info *info, const sim_result *rs, int n);

/* The link rate of direction h2d the runs priced: the node's when given. */
double sim_info_link(const sim_run_info *info, int h2d) {
  if (info->gpus_per_node > 0) return h2d ? info->h2d_bytes_per_s : info->d2h_bytes_per_s;
  return h2d ? info->hw->link.h2d_bytes_per_s : info->hw->link.d2h_bytes_per_s;
}

void sim_print_table(FILE *f, const sim_run_info *info, const sim_result *rs, int n) {
  const sim_trace *t = info->trace;
  const sim_hw *hw = info->hw;
  char res[32];
  fmt_bytes(res, sizeof res, (double)t->resident_bytes);
  fprintf(f, "trace %s: %d layers, %u step(s) in the trace, %s resident\n", info->trace_path,
          t->layers, t->n_steps, res);
  print_untracked(f, info);
  uint32_t w = rs[0].warmup < rs[0].steps ? rs[0].warmup : 0;
  fprintf(f, "link %s: H2D %.1f GB/s, D2H %.1f GB/s, %.1f us per copy, duplex H2D %.2f D2H %.2f; "
             "host RAM %.0f GB; %u steps replayed, per-step figures and peaks are the steady "
             "state: steps %u..%u (--warmup %u)\n\n",
          hw->name, sim_info_link(info, 1) / GB, sim_info_link(info, 0) / GB,
          hw->link.latency_us, hw->duplex_h2d, hw->duplex_d2h, (double)rs[0].host_ram_bytes / GB,
          rs[0].steps, w + 1, rs[0].steps, w);
  /* only off the presets' own case (one GPU, NUMA-local), where the link differs */
  if (info->gpus_per_node > 1 || (info->gpus_per_node > 0 && info->numa_far < 1)) {
    char mem[48] = "no host-memory cap";
    if (info->host_mem_bytes_per_s > 0)
      snprintf(mem, sizeof mem, "host memory %.1f GB/s a GPU", info->host_mem_bytes_per_s / GB);
    fprintf(f, "node: %d GPU%s copying at once, NUMA-far %.2f, %s; contention %s; host %.1f us "
               "per saved tensor\n\n",
            info->gpus_per_node, info->gpus_per_node == 1 ? "" : "s", info->numa_far, mem,
            info->contention ? "on" : "off", info->host_overhead_us);
  }
  fprintf(f, "%-22s %11s %7s %11s %8s %10s %10s %10s %10s %10s %8s %7s %6s\n", "policy",
          "peak dev", "reduct", "step", "overhead", "stall", "D2H/step", "H2D/step",
          "host peak", "host rsv", "offload", "kept", "errors");
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    sim_row_cells c;
    sim_row_format(r, &c);
    char red[16], ovh[16];
    if (i == 0) {
      snprintf(red, sizeof red, "-");
      snprintf(ovh, sizeof ovh, "-");
    } else {
      snprintf(red, sizeof red, "%.1f%%",
               0.0 - pct((double)r->peak_device_bytes, (double)rs[0].peak_device_bytes));
      snprintf(ovh, sizeof ovh, "%+.1f%%", pct(r->step_us, rs[0].step_us));
    }
    fprintf(f, "%-22.22s %11s %7s %11s %8s %10s %10s %10s %10s %10s %8.0f %7.0f %6llu\n", r->label,
            c.peak, red, c.step, ovh, c.stall, c.d2h, c.h2d, c.host_peak, c.host_reserved,
            r->tensors_offloaded, r->tensors_kept,
            (unsigned long long)r->policy_errors);
  }
  sim_print_bands(f, info, rs, n);
  fprintf(f, "\nfirst step (warm-up: caches, learning policies, the pinned arena growing):");
  for (int i = 0; i < n; i++) {
    char st[32], pk[32], pin[32];
    fmt_us(st, sizeof st, rs[i].first_step_us);
    fmt_bytes(pk, sizeof pk, (double)rs[i].first_step_peak_device_bytes);
    fmt_us(pin, sizeof pin, rs[i].pinned_alloc_us);
    fprintf(f, "\n  %-22.22s %11s, peak %s%s%s", rs[i].label, st, pk,
            rs[i].pinned_alloc_us > 0 ? "; steady steps pin host memory for " : "",
            rs[i].pinned_alloc_us > 0 ? pin : "");
    /* the arena's growth is paid once: the steady figures begin after it */
    if (rs[i].arena_still_growing)
      fprintf(f, "; the pinned arena still grew in step %u, the last: NOT STEADY, figures are "
                 "step %u's alone (replay more steps: --steps)", rs[i].arena_grew_step,
              rs[i].steady_from);
    else if (rs[i].steady_from > w + 1) /* later than the header's range says */
      fprintf(f, "; the pinned arena grew until step %u: steady from step %u", rs[i].arena_grew_step,
              rs[i].steady_from);
  }
  fputc('\n', f);
  fprintf(f, "\nwhere the device peak falls (last step: phase, the compute it is for, what raised it):");
  for (int i = 0; i < n; i++) {
    char where[256];
    sim_peak_where_text(&rs[i], where, sizeof where);
    fprintf(f, "\n  %-22.22s %s", rs[i].label, where);
  }
  fputc('\n', f);
  sim_print_optimizer(f, rs, n);
  sim_print_weights(f, rs, n);
  if (n > 0 && rs[0].comm_count > 0) {
    /* collectives run beside compute: only what the compute waited for
     * lengthens the step (docs/sim-model.md, "Collectives") */
    fprintf(f, "\ncollectives per step (FSDP gathers and reduce-scatters, tensor-parallel "
               "exchanges): exposed is the time compute waited for them, in the step time:");
    for (int i = 0; i < n; i++) {
      char ex[32], busy[32], by[32];
      fmt_us(ex, sizeof ex, rs[i].comm_exposed_us);
      fmt_us(busy, sizeof busy, rs[i].comm_us);
      fmt_bytes(by, sizeof by, rs[i].comm_bytes);
      fprintf(f, "\n  %-22.22s %.0f, %s per rank, lanes busy %s, exposed %s (%.1f%% of the step)",
              rs[i].label, rs[i].comm_count, by, busy, ex,
              rs[i].step_us > 0 ? 100.0 * rs[i].comm_exposed_us / rs[i].step_us : 0.0);
    }
    fputc('\n', f);
  }
  if (n > 1 && !strcmp(rs[0].backend, "sim")) {
    fprintf(f, "\nstall floor (the least stall any schedule of the same copies could expose "
               "at the same peak, the link at full speed; docs/sim-model.md):");
    for (int i = 1; i < n; i++) {
      char fl[32], sl[32];
      fmt_us(fl, sizeof fl, rs[i].stall_floor_us);
      fmt_us(sl, sizeof sl, rs[i].stall_us + rs[i].host_wait_us);
      fprintf(f, "\n  %-22.22s floor %s, stall %s", rs[i].label, fl, sl);
    }
    fputc('\n', f);
  }
  if (n > 0 && rs[0].compute_note[0]) fprintf(f, "compute: %s\n", rs[0].compute_note);
  print_sensitivity(f, info, rs, n);
  if (hw->device_bytes > 0) {
    double usable = sim_hw_usable_bytes(hw);
    fprintf(f, "\n%s has %.0f GB of device memory, %.2f GiB exposed, %.2f GiB usable (%.2f GiB kept "
               "for the CUDA context and allocator fragmentation):", hw->name, hw->device_bytes / GB,
            (hw->capacity_bytes > 0 ? hw->capacity_bytes : hw->device_bytes) / (1u << 30),
            usable / (1u << 30), SIM_DEVICE_ALLOWANCE_BYTES / (1u << 30));
    for (int i = 0; i < n; i++)
      fprintf(f, " %s %s%s", rs[i].label,
              (double)rs[i].peak_device_bytes <= usable ? "fits" : "DOES NOT FIT",
              i + 1 < n ? ";" : "\n");
  }
  for (int i = 1; i < n; i++)
    if (rs[i].policy_errors)
      fprintf(f, "policy %s: %llu error(s), last: %s\n", rs[i].label,
              (unsigned long long)rs[i].policy_errors, rs[i].policy_error);
}

/* The achieved rate as an MFU of hw's peak (or TFLOP/s without a peak). */
static void fmt_rate(char *buf, size_t n, const sim_hw *hw, double tflops) {
  if (hw && hw->peak_tflops > 0) snprintf(buf, n, "MFU %.2f", tflops / hw->peak_tflops);
  else snprintf(buf, n, "%.0f TFLOP/s", tflops);
}

/* Step and overhead of every run at the compute rate x (1 -+ f) beside
 * the rate used (sim_config.mfu_sensitivity): the rate is an input the
 * simulator cannot know, and overheads depend on it. Off (--mfu-sensitivity
 * off): a line that says so, since the reader expects the paragraph. */
static void print_sensitivity(FILE *f, const sim_run_info *info, const sim_result *rs, int n) {
  const sim_hw *hw = info->hw;
  if (n >= 1 && !(rs[0].sens_tflops[0] > 0) && info->mfu_sensitivity < 0) {
    fprintf(f, "\nsensitivity to the compute rate: off (--mfu-sensitivity off: no replays at "
               "other rates; docs/sim-model.md)\n");
    return;
  }
  if (n < 1 || !(rs[0].sens_tflops[0] > 0)) return;
  double mid = (rs[0].sens_tflops[0] + rs[0].sens_tflops[1]) / 2;
  char lo[32], md[32], hi[32];
  fmt_rate(lo, sizeof lo, hw, rs[0].sens_tflops[0]);
  fmt_rate(md, sizeof md, hw, mid);
  fmt_rate(hi, sizeof hi, hw, rs[0].sens_tflops[1]);
  fprintf(f, "\nsensitivity to the compute rate (an input, not a measurement: --mfu; "
             "docs/sim-model.md): step (overhead) at %s / %s / %s:", lo, md, hi);
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    if (!(r->sens_tflops[0] > 0)) continue;
    const double st[3] = {r->sens_step_us[0], r->step_us, r->sens_step_us[1]};
    const double bs[3] = {rs[0].sens_step_us[0], rs[0].step_us, rs[0].sens_step_us[1]};
    fprintf(f, "\n  %-22.22s", r->label);
    for (int k = 0; k < 3; k++) {
      char t[32];
      fmt_us(t, sizeof t, st[k]);
      if (i) fprintf(f, " %10s (%+6.1f%%)%s", t, pct(st[k], bs[k]), k < 2 ? " /" : "");
      else fprintf(f, " %10s%s", t, k < 2 ? " /" : "");
    }
  }
  fputc('\n', f);
}

void sim_print_layers(FILE *f, const sim_result *rs, int n) {
  if (n < 2) return;
  fprintf(f, "\nper layer, last step: saved bytes; for each policy the bytes offloaded and the "
             "exposed reload stall\n%-7s %10s", "layer", "saved");
  for (int i = 1; i < n; i++) fprintf(f, "  %-12.12s %8s", rs[i].label, "stall");
  fputc('\n', f);
  for (uint32_t k = 0; k < rs[0].n_layers; k++) {
    const sim_layer_row *b = &rs[0].layers[k];
    if (!b->packed) continue;
    char lab[16], sv[32];
    if (b->layer < 0) snprintf(lab, sizeof lab, "other");
    else snprintf(lab, sizeof lab, "%d", b->layer);
    fmt_bytes(sv, sizeof sv, (double)b->saved_bytes);
    fprintf(f, "%-7s %10s", lab, sv);
    for (int i = 1; i < n; i++) {
      char ob[32], st[32];
      const sim_layer_row *p = k < rs[i].n_layers ? &rs[i].layers[k] : NULL;
      fmt_bytes(ob, sizeof ob, p ? (double)p->offloaded_bytes : 0);
      fmt_us(st, sizeof st, p ? p->stall_us : 0);
      fprintf(f, "  %-12s %8s", ob, st);
    }
    fputc('\n', f);
  }
}

/* ---- JSON ---------------------------------------------------------------------------- */
static void add_metrics(cJSON *o, const sim_result *r, const sim_result *base) {
  cJSON_AddStringToObject(o, "name", r->label);
  cJSON_AddNumberToObject(o, "peak_device_bytes", (double)r->peak_device_bytes);
  cJSON_AddNumberToObject(o, "peak_device_bytes_baseline", (double)base->peak_device_bytes);
  cJSON_AddNumberToObject(o, "device_reduction_pct",
                          -pct((double)r->peak_device_bytes, (double)base->peak_device_bytes));
  cJSON_AddNumberToObject(o, "peak_saved_bytes", (double)r->peak_saved_bytes);
  cJSON_AddNumberToObject(o, "resident_bytes", (double)r->resident_bytes);
  cJSON_AddNumberToObject(o, "untracked_bytes", (double)r->untracked_bytes);
  cJSON_AddNumberToObject(o, "step_us", r->step_us);
  cJSON_AddNumberToObject(o, "step_us_baseline", base->step_us);
  cJSON_AddNumberToObject(o, "step_overhead_pct", pct(r->step_us, base->step_us));
  cJSON_AddNumberToObject(o, "first_step_us", r->first_step_us);
  cJSON_AddNumberToObject(o, "first_step_peak_device_bytes", (double)r->first_step_peak_device_bytes);
  cJSON *where = cJSON_AddObjectToObject(o, "peak_at");
  cJSON_AddStringToObject(where, "phase", sim_peak_phase_name(r->peak_phase));
  cJSON_AddNumberToObject(where, "layer", r->peak_layer);
  cJSON_AddStringToObject(where, "op", r->peak_op);
  cJSON_AddStringToObject(where, "what", r->peak_what);
  /* the --warmup steps left out: none when no more steps than that ran (the
   * text report's header says the same); steady_from_step can be later */
  cJSON_AddNumberToObject(o, "warmup_steps", r->warmup < r->steps ? r->warmup : 0);
  cJSON_AddNumberToObject(o, "arena_grew_step", r->arena_grew_step);
  cJSON_AddNumberToObject(o, "steady_from_step", r->steady_from);
  cJSON_AddBoolToObject(o, "arena_still_growing", r->arena_still_growing);
  cJSON_AddStringToObject(o, "compute_note", r->compute_note);
  cJSON_AddNumberToObject(o, "gaps_from_flops", r->gaps_from_flops);
  cJSON_AddNumberToObject(o, "gaps_as_recorded", r->gaps_as_recorded);
  cJSON_AddNumberToObject(o, "pinned_alloc_us", r->pinned_alloc_us);
  cJSON_AddNumberToObject(o, "contention_us", r->contention_us);
  cJSON_AddNumberToObject(o, "host_bound_us", r->host_bound_us);
  cJSON_AddNumberToObject(o, "host_ram_bytes", (double)r->host_ram_bytes);
  cJSON_AddNumberToObject(o, "replays", r->replays);
  if (r->sens_tflops[0] > 0 && base->sens_tflops[0] > 0) {
    /* the step at the compute rate x (1 -+ f): lower, then higher */
    cJSON *sa = cJSON_AddArrayToObject(o, "compute_sensitivity");
    for (int k = 0; k < 2; k++) {
      cJSON *e = cJSON_CreateObject();
      cJSON_AddNumberToObject(e, "tflops", r->sens_tflops[k]);
      cJSON_AddNumberToObject(e, "step_us", r->sens_step_us[k]);
      cJSON_AddNumberToObject(e, "step_us_baseline", base->sens_step_us[k]);
      cJSON_AddNumberToObject(e, "step_overhead_pct", pct(r->sens_step_us[k], base->sens_step_us[k]));
      cJSON_AddItemToArray(sa, e);
    }
  }
  cJSON_AddNumberToObject(o, "comm_collectives", r->comm_count);
  cJSON_AddNumberToObject(o, "comm_bytes", r->comm_bytes);
  cJSON_AddNumberToObject(o, "comm_us", r->comm_us);
  cJSON_AddNumberToObject(o, "comm_exposed_us", r->comm_exposed_us);
  cJSON_AddNumberToObject(o, "stall_us", r->stall_us + r->host_wait_us);
  cJSON_AddNumberToObject(o, "reload_stall_us", r->stall_us);
  cJSON_AddNumberToObject(o, "stall_floor_us", r->stall_floor_us);
  cJSON_AddNumberToObject(o, "host_wait_us", r->host_wait_us);
  cJSON_AddNumberToObject(o, "bytes_d2h", r->bytes_d2h);
  cJSON_AddNumberToObject(o, "bytes_h2d", r->bytes_h2d);
  cJSON_AddNumberToObject(o, "peak_host_bytes", (double)r->peak_host_bytes);
  cJSON_AddNumberToObject(o, "host_reserved_bytes", (double)r->host_reserved_bytes);
  cJSON_AddNumberToObject(o, "tensors_packed", r->tensors_packed);
  cJSON_AddNumberToObject(o, "tensors_offloaded", r->tensors_offloaded);
  cJSON_AddNumberToObject(o, "tensors_kept", r->tensors_kept);
  cJSON_AddNumberToObject(o, "prefetches", r->prefetches);
  cJSON_AddNumberToObject(o, "stash_hits", r->stash_hits);
  cJSON_AddNumberToObject(o, "cap_fallbacks", (double)r->cap_fallbacks);
  cJSON_AddNumberToObject(o, "policy_errors", (double)r->policy_errors);
  cJSON_AddStringToObject(o, "policy_last_error", r->policy_error);
  cJSON_AddNumberToObject(o, "policy_calls", (double)r->policy_calls);
  cJSON_AddNumberToObject(o, "policy_cache_hits", (double)r->policy_cache_hits);
  cJSON_AddNumberToObject(o, "steps", r->steps);
  cJSON_AddNumberToObject(o, "events", (double)r->events);
  cJSON_AddNumberToObject(o, "wall_s", r->wall_s);
  cJSON_AddNumberToObject(o, "optimizer_fraction", r->opt_fraction);
  if (r->opt_fraction > 0) {
    cJSON_AddBoolToObject(o, "optimizer_overlap", !r->opt_serial);
    cJSON_AddNumberToObject(o, "optimizer_params", r->opt_params);
    cJSON_AddNumberToObject(o, "cpu_adam_params_per_s", r->opt_cpu_adam_params_per_s);
    cJSON_AddNumberToObject(o, "optimizer_device_bytes", (double)r->opt_device_bytes);
    cJSON_AddNumberToObject(o, "optimizer_host_bytes", (double)r->opt_host_bytes);
    cJSON_AddNumberToObject(o, "optimizer_bytes_d2h", r->opt_bytes_d2h);
    cJSON_AddNumberToObject(o, "optimizer_bytes_h2d", r->opt_bytes_h2d);
    cJSON_AddNumberToObject(o, "optimizer_cpu_us", r->opt_cpu_us);
    cJSON_AddNumberToObject(o, "optimizer_stall_us", r->opt_stall_us);
  }
  if (r->w_count > 0) {
    cJSON *w = cJSON_AddObjectToObject(o, "weights");
    cJSON_AddNumberToObject(w, "first_layer", r->w_first);
    cJSON_AddNumberToObject(w, "layers", r->w_count);
    cJSON_AddNumberToObject(w, "layer_bytes", (double)r->w_layer_bytes);
    cJSON_AddStringToObject(w, "layer_bytes_from",
                            r->w_estimated ? "estimated: parameters / layers" : "trace");
    cJSON_AddBoolToObject(w, "double_buffer", r->w_double_buffer);
    cJSON_AddNumberToObject(w, "device_bytes", (double)r->w_device_bytes);
    cJSON_AddNumberToObject(w, "host_bytes", (double)r->w_host_bytes);
    cJSON_AddNumberToObject(w, "bytes_d2h", r->w_bytes_d2h);
    cJSON_AddNumberToObject(w, "bytes_h2d", r->w_bytes_h2d);
    cJSON_AddNumberToObject(w, "stall_us", r->w_stall_us);
  }
  cJSON *layers = cJSON_AddArrayToObject(o, "layers");
  for (uint32_t k = 0; layers && k < r->n_layers; k++) {
    const sim_layer_row *l = &r->layers[k];
    if (!l->packed) continue;
    cJSON *x = cJSON_CreateObject();
    cJSON_AddNumberToObject(x, "layer", l->layer);
    cJSON_AddNumberToObject(x, "saved_bytes", (double)l->saved_bytes);
    cJSON_AddNumberToObject(x, "offloaded_bytes", (double)l->offloaded_bytes);
    cJSON_AddNumberToObject(x, "tensors", l->packed);
    cJSON_AddNumberToObject(x, "tensors_offloaded", l->offloaded);
    cJSON_AddNumberToObject(x, "stall_us", l->stall_us);
    cJSON_AddItemToArray(layers, x);
  }
}

static int write_text(const char *path, const char *text, char *err, size_t errlen) {
  FILE *f = fopen(path, "w");
  if (!f) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    return -1;
  }
  fputs(text, f);
  return close_checked(f, path, err, errlen);
}

int sim_write_json(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                   char *err, size_t errlen) {
  cJSON *root = cJSON_CreateObject();
  cJSON_AddStringToObject(root, "format", "ferry-sim-report");
  cJSON_AddNumberToObject(root, "version", 1);
  cJSON_AddStringToObject(root, "trace", info->trace_path);
  cJSON_AddStringToObject(root, "hw", info->hw->name);
  cJSON *link = cJSON_AddObjectToObject(root, "link");
  cJSON_AddNumberToObject(link, "h2d_bytes_per_s", sim_info_link(info, 1));
  cJSON_AddNumberToObject(link, "d2h_bytes_per_s", sim_info_link(info, 0));
  cJSON_AddNumberToObject(link, "latency_us", info->hw->link.latency_us);
  cJSON_AddNumberToObject(link, "duplex_h2d", info->hw->duplex_h2d);
  cJSON_AddNumberToObject(link, "duplex_d2h", info->hw->duplex_d2h);
  if (info->gpus_per_node > 0) {
    cJSON *node = cJSON_AddObjectToObject(root, "node");
    cJSON_AddNumberToObject(node, "gpus_per_node", info->gpus_per_node);
    cJSON_AddNumberToObject(node, "numa_far", info->numa_far);
    cJSON_AddNumberToObject(node, "host_mem_bytes_per_s", info->host_mem_bytes_per_s);
    cJSON_AddBoolToObject(node, "contention", info->contention);
    cJSON_AddNumberToObject(node, "host_overhead_us", info->host_overhead_us);
  }
  cJSON_AddNumberToObject(root, "device_bytes", info->hw->device_bytes);
  cJSON_AddNumberToObject(root, "device_capacity_bytes", info->hw->capacity_bytes > 0 ? info->hw->capacity_bytes
                                                                                   : info->hw->device_bytes);
  cJSON_AddNumberToObject(root, "device_usable_bytes", sim_hw_usable_bytes(info->hw));
  cJSON_AddNumberToObject(root, "layers", info->trace->layers);
  /* the runs' compute_sensitivity factor, or "off": then no run has one */
  if (info->mfu_sensitivity < 0) cJSON_AddStringToObject(root, "mfu_sensitivity", "off");
  else if (info->mfu_sensitivity > 0)
    cJSON_AddNumberToObject(root, "mfu_sensitivity", info->mfu_sensitivity);
  /* The first policy's figures at the top level, for scripts comparing one. */
  const sim_result *first = n > 1 ? &rs[1] : &rs[0];
  cJSON *top = cJSON_CreateObject();
  add_metrics(top, first, &rs[0]);
  if (n > 1) sim_band_json(top, info, rs, 1);
  for (cJSON *x = top->child; x; x = x->next)
    if (strcmp(x->string, "layers")) cJSON_AddItemToObject(root, x->string, cJSON_Duplicate(x, 1));
  cJSON_Delete(top);
  cJSON *b = cJSON_AddObjectToObject(root, "baseline");
  add_metrics(b, &rs[0], &rs[0]);
  cJSON *arr = cJSON_AddArrayToObject(root, "policies");
  for (int i = 1; i < n; i++) {
    cJSON *o = cJSON_CreateObject();
    add_metrics(o, &rs[i], &rs[0]);
    sim_band_json(o, info, rs, i);
    cJSON_AddItemToArray(arr, o);
  }
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  if (!text) {
    snprintf(err, errlen, "out of memory writing %s", path);
    return -1;
  }
  int rc = write_text(path, text, err, errlen);
  free(text);
  return rc;
}

/* ---- Chrome trace events (Perfetto) ------------------------------------------------ */
/* Written through util/chrome_trace.h, the writer real runs use too
 * (core/chrome_recorder.c). A process per run (the baseline, then each
 * policy), a thread per lane: compute slices named by layer, or outside
 * the blocks by module (args: module, FLOPs, device-memory bytes, as the
 * trace gives them), copies by the
 * tensor's module path with its bytes, layer and trace index (resident
 * buffers' copies, category "other", by what they move), a flow arrow
 * from each offload to its reload, the device-memory counter, and instants
 * at backward's start and the step's end. Times: the last step, in µs from
 * its start. A run whose reloads went on the offloads' stream (the
 * one_copy_stream knob) draws them on that lane, named for both. */
int sim_write_chrome_trace(const char *path, const sim_result *rs, int n, char *err,
                           size_t errlen) {
  static const char *const lanes[3] = {"compute", "D2H copies", "H2D copies"};
  ct_writer w;
  if (ct_open(&w, path, err, errlen)) return -1;
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    const sim_timeline *tl = &r->tl;
    int pid = i + 1;
    ct_process(&w, pid, r->label, i);
    /* the knob names the lane, as in a real run's trace, reloads or not */
    int one_stream = tl->one_stream;
    for (size_t k = 0; k < tl->n_iv && !one_stream; k++) one_stream = tl->iv[k].one_stream;
    for (int k = 0; k < 3; k++)
      ct_thread(&w, pid, k + 1, k == 1 && one_stream ? CT_LANE_ONE_STREAM : lanes[k], -1);
    double t0 = tl->t_begin;
    char name[64];
    for (size_t k = 0; k < tl->n_iv; k++) {
      const sim_interval *iv = &tl->iv[k];
      if (iv->t1 < t0) continue;
      const char *what;
      if (iv->lane == 0) {
        /* a block's compute by its layer (the op in args), the rest by its
         * module: embedding, final norm, head, loss */
        if (iv->layer >= 0) snprintf(name, sizeof name, "layer %d", iv->layer);
        what = iv->layer >= 0                          ? name
               : iv->module_path && *iv->module_path ? iv->module_path
                                                       : "outside layers";
      } else {
        what = iv->module_path && *iv->module_path ? iv->module_path
               : iv->lane == 1                      ? "offload"
                                                    : "reload";
      }
      /* a copy of no trace tensor is a resident buffer's (weights, the
       * optimizer's): category "other", as in a real run's trace */
      const char *cat = iv->lane == 0 ? "compute" : !iv->tensor ? "other"
                        : iv->lane == 1 ? "offload" : "reload";
      const int tid = iv->one_stream ? 2 : iv->lane + 1; /* the stream it ran on */
      cJSON *e = ct_slice(what, cat, pid, tid, iv->t0 - t0, iv->t1 - iv->t0);
      cJSON *args = ct_args(e);
      if (iv->layer >= 0) cJSON_AddNumberToObject(args, "layer", iv->layer);
      if (iv->lane == 0) {
        if (iv->module_path && *iv->module_path)
          cJSON_AddStringToObject(args, "module", iv->module_path);
        if (iv->flops >= 0) cJSON_AddNumberToObject(args, "flops", iv->flops);
        if (iv->hbm_bytes >= 0) cJSON_AddNumberToObject(args, "bytes", iv->hbm_bytes);
      } else {
        cJSON_AddNumberToObject(args, "bytes", (double)iv->bytes);
        if (iv->tensor) cJSON_AddNumberToObject(args, "tensor", iv->tensor - 1);
      }
      ct_emit(&w, e);
      /* the arrow leaves the offload at its start and enters the reload */
      if (iv->lane != 0 && iv->flow)
        ct_flow(&w, iv->lane == 1, "offload -> reload", (double)pid * 1e7 + iv->flow, pid,
                tid, iv->t0 - t0);
    }
    for (size_t k = 0; k < tl->n_mem; k++)
      ct_counter(&w, "device memory", pid, tl->mem[k].t - t0, "GiB",
                 round((double)tl->mem[k].bytes / GIB * 1e4) / 1e4);
    struct {
      const char *name;
      double t;
    } marks[2] = {{"backward", tl->t_backward}, {"step end", tl->t_end}};
    for (int m = 0; m < 2; m++) {
      if (marks[m].t < t0 || marks[m].t <= 0) continue;
      /* across the process's lanes */
      ct_emit(&w, ct_instant(marks[m].name, pid, 1, marks[m].t - t0, 'p'));
    }
  }
  return ct_close(&w, err, errlen);
}
