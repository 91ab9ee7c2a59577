/*
 * cli_sim_args.c — `ferry sim`'s usage text and the parsers of its
 * structured option values (--pinned, --optimizer-fraction,
 * --weight-layers); the command itself is cli_sim.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_sim.h"

void sim_usage(FILE *f) {
  fprintf(f,
          "usage: ferry sim --policy P[,P2...] --trace T [--hw %s] [options]\n"
          "       ferry sim --demo DIR\n"
          "\n"
          "Replays trace T through the real engine on a virtual clock, once without\n"
          "offloading and once per policy, and compares them.\n"
          "\n"
          "  --policy LIST       policy files, comma-separated (a bare name is looked up in\n"
          "                      policies/, e.g. default, layers, budget; - reads stdin)\n"
          "  --trace FILE        trace (docs/trace-format.md; `ferry trace synth` writes one;\n"
          "                      - reads stdin)\n"
          "  --hw NAME           link preset (default h100)\n"
          "  --link SPEC         override it: h2d=55GB/s,d2h=55GB/s,latency=5us,duplex=0.9\n"
          "                      (also duplex_h2d=, duplex_d2h=)\n"
          "  --steps N           steps to replay, cycling the trace's (default 3)\n"
          "  --sweep KNOB=A..B[:STEP]  run each policy with `local KNOB = v` for v in A..B\n"
          "  --recorded          also replay the decisions recorded in the trace\n"
          "  --host-cap BYTES    pinned host cap (suffixes K, M, G)\n"
          "  --host-ram BYTES    host RAM this rank counts on (policies' host_ram_used_pct);\n"
          "                      default: the preset's (node RAM / GPUs), never this machine's\n"
          "  --mfu F             sustained fraction of the preset's BF16 peak for compute that\n"
          "                      carries FLOPs in the trace, synthesized traces included\n"
          "                      (default 0.40: Llama 3 on H100)\n"
          "  --tflops X          achieved TFLOP/s instead (overrides --mfu)\n"
          "  --mfu-sensitivity on|off|F  on (default): each run is replayed twice more, at\n"
          "                      the compute rate x 0.75 and x 1.25, for the reports'\n"
          "                      sensitivity (three times the cost); F: at x (1 -+ F),\n"
          "                      0 < F <= 0.9; off: once (the reports say so)\n"
          "  --hbm GBPS          achieved device-memory bandwidth, GB/s, for the memory-bound\n"
          "                      ops of synthesized traces (default: 0.60 of the preset's)\n"
          "  --nodes N           the data-parallel (FSDP) group spans N nodes: its collectives\n"
          "                      go through each GPU's NIC, which shares the PCIe link with\n"
          "                      the offload copies (default 1: NVLink within the node)\n"
          "  --nvlink GBPS       collectives' bus bandwidth within a node, GB/s per GPU\n"
          "                      (default: the preset's, 360 on h100; 0: untimed)\n"
          "  --nic GBPS          across nodes, the GPU's NIC, GB/s (default: the preset's,\n"
          "                      50 on h100: 400 Gb/s); the group's NICs on a node add up,\n"
          "                      to at most --nvlink\n"
          "  --release-copied    the engine frees a forward-stash buffer once its copy is done\n"
          "                      (config.release_when_copied), not only when pushed out\n"
          "  --prefetch-at-backward  start the policy's first reloads at backward_begin\n"
          "                      (config.prefetch_at_backward_begin), not the first unpack\n"
          "  --warmup N          steps left out of the steady figures (default 1), and\n"
          "                      those up to the last in which the pinned arena grew;\n"
          "                      0: every step counts\n"
          "  --untracked auto|off|BYTES  device memory the trace does not hold (never saved\n"
          "                      for backward: the loss's transients, workspaces), added to\n"
          "                      every peak; auto (default): the peak a trace recorded on a\n"
          "                      GPU measured (device_peak) less its own decisions' peak here\n"
          "  --pinned SPEC       pinned allocation cost: pool=on|off,alloc=3ms,touch=2.5GB/s\n"
          "                      (pool=on: the engine's arena pays once, when it grows; off:\n"
          "                      every offload pays a fresh allocation; alloc=0 touch=0: free)\n"
          "  --gpus-per-node N   GPUs of the node copying at once (default 1): each gets its\n"
          "                      link over the GPUs sharing its PCIe switch and 1/N of the\n"
          "                      node's host memory bandwidth (the preset's; docs/hardware.md)\n"
          "  --numa-far F        link bandwidth factor for pinned memory on the far socket,\n"
          "                      0 < F <= 1 (default 1: NUMA-local)\n"
          "  --contention on|off  on (default): copies take their bytes/s as a share of the\n"
          "                      preset's HBM bandwidth from memory-bound kernels beside them\n"
          "  --host-overhead US|torch1|torch2  the host's cost per saved tensor of the\n"
          "                      pack/unpack path, on the host's own timeline: it delays the\n"
          "                      GPU only when the host falls behind it (default torch2: 10)\n"
          "  --optimizer-fraction F[,F2...]  also step this share of the optimizer on the\n"
          "                      host (ferry.torch.offload_optimizer): its states leave the\n"
          "                      device; gradients D2H, a CPU Adam step, parameters H2D. One\n"
          "                      run per policy and share (without --policy: no activation\n"
          "                      offload), against the plain baseline\n"
          "  --cpu-adam RATE     host Adam rate, parameters/s per rank (default %.3g:\n"
          "                      DeepSpeed's CPU-Adam on a node shared by 8 GPUs)\n"
          "  --optimizer-overlap on|off  on (default): the host step overlaps the device\n"
          "                      share's, the parameters' copies the next forward; off: serial\n"
          "  --weight-layers L[,L2...]  also offload the weights of repeated blocks\n"
          "                      (ferry.torch.offload_weights): N = the first N blocks,\n"
          "                      A..B = blocks A to B; D2H after each one's forward, H2D\n"
          "                      before its backward. One run per policy and item\n"
          "                      (without --policy: no activation offload)\n"
          "  --weight-double-buffer on|off  on (default): a block's reload issues its\n"
          "                      neighbour's behind it (double_buffer=True)\n"
          "  --json FILE         the report as JSON (keys in docs/sim-outputs.md)\n"
          "  --chrome-trace FILE compute, D2H and H2D lanes of the last step (Perfetto)\n"
          "  --svg FILE          memory over the last step: device (baseline and each\n"
          "                      policy), pinned host, exposed stalls, backward's start, peaks\n"
          "  --html FILE         one self-contained page (opens offline): the table, the SVG\n"
          "                      and per-layer bars of bytes offloaded and kept per policy\n"
          "  --no-layers         skip the per-layer table\n"
          "  --max-line BYTES    longest trace line read (default 1M; longer is an error)\n"
          "  -q, --quiet         errors only on stderr: no progress, policy log lines or\n"
          "                      warnings (FERRY_LOG_FILE still gets errors; the report prints)\n"
          "  -v, --verbose       also on stderr: each policy's file and each replay's wall\n"
          "                      time and steps\n"
          "  --fit DEVICE_BYTES  search policies/host_budget.lua's knobs (host bytes, layers\n"
          "                      kept, stash, prefetch) for the lowest-overhead setting whose\n"
          "                      steady peak fits DEVICE_BYTES; writes it as a policy.\n"
          "                      --fit device: the --hw preset's exposed memory less\n"
          "                      2.8 GiB (CUDA context, allocator fragmentation)\n"
          "  --fit-host BYTES    host budget per rank for --fit (default: half --host-ram)\n"
          "  --fit-out FILE      where --fit writes the policy (default fit.lua)\n"
          "  --demo DIR          synthesize a Qwen3-14B fine-tune (seq 8192, FSDP over 8) that\n"
          "                      does not fit an H100, dry-run default, layers and budget on\n"
          "                      h100, find the policy that fits (--fit device); outputs in DIR\n"
          "  -h, --help          this help\n"
          "\n"
          "An output FILE of - is stdout (one at a time; the table then goes to stderr).\n"
          "Progress shows on stderr when it is a terminal.\n"
          "\n"
          "examples:\n"
          "  ferry sim --policy default,layers,budget --trace llama3-8b.jsonl --hw h100\n"
          "  ferry trace synth -o - | ferry sim --policy default --trace -\n"
          "  ferry sim --policy default --trace t.jsonl --json - | jq '.policies[].step_us'\n"
          "  ferry sim --policy budget --sweep FWD_STASH=1..8 --trace t.jsonl --no-layers\n"
          "  ferry sim --fit device --trace t.jsonl --hw h100 --fit-out fit.lua\n",
          sim_hw_names(), SIM_DEFAULT_CPU_ADAM);
}

/* --mfu-sensitivity on|off|F: the factor of the extra replays, 0 = off.
 * 0, or -1 after a message naming the flag and the value. */
int sim_parse_mfu_sensitivity(const char *spec, double *out) {
  if (!strcmp(spec, "on")) *out = SIM_MFU_SENSITIVITY;
  else if (!strcmp(spec, "off")) *out = 0;
  else if (*spec && strspn(spec, "0123456789.+-eE") != strlen(spec)) {
    /* a word: name the words it takes, not only "a number" */
    fprintf(stderr, "ferry sim: --mfu-sensitivity %s: expected on, off or a factor F "
                    "(0 < F <= 0.9: replays at the compute rate x (1 -+ F))\n", spec);
    return -1;
  } else if (cli_number("sim", "--mfu-sensitivity", spec, FERRY_NUMBER_REAL, 0, 0.9, 1, out)) {
    return -1;
  }
  return 0;
}

/* "pool=on|off,alloc=3ms,touch=2.5GB/s" over *o. 0, or -1 with a message. */
int sim_parse_pinned(const char *spec, sim_opts *o) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", spec);
  for (char *save = NULL, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq) goto bad;
    *eq = 0;
    const char *v = eq + 1;
    if (!strcmp(kv, "pool")) {
      if (!strcmp(v, "on")) o->no_pool = 0;
      else if (!strcmp(v, "off")) o->no_pool = 1;
      else goto bad;
    } else if ((!strcmp(kv, "alloc") || !strcmp(kv, "touch")) && !strcmp(v, "0")) {
      if (!strcmp(kv, "alloc")) o->pin_alloc_us = 0;
      else o->pin_touch_bytes_per_s = 0;
    } else if (!strcmp(kv, "alloc") || !strcmp(kv, "touch")) {
      int alloc = !strcmp(kv, "alloc");
      char what[32];
      snprintf(what, sizeof what, "--pinned %s", kv);
      double x; /* up to 1 s per allocation; 1 MB/s to 100 TB/s */
      if (cli_number("sim", what, v, alloc ? FERRY_NUMBER_DURATION : FERRY_NUMBER_BANDWIDTH,
                     alloc ? 0 : 1e6, alloc ? 1e6 : 1e14, 0, &x))
        return -1;
      if (alloc) o->pin_alloc_us = x;
      else o->pin_touch_bytes_per_s = x;
    } else {
      goto bad;
    }
  }
  return 0;
bad:
  fprintf(stderr, "ferry sim: --pinned %s: expected pool=on|off,alloc=TIME,touch=RATE "
                  "(e.g. pool=off,alloc=3ms,touch=2.5GB/s)\n", spec);
  return -1;
}

/* "0,0.25,1": shares of the optimizer stepped on the host, each 0..1. The
 * count, or -1 after a message naming the flag and the value. */
int sim_parse_fractions(const char *spec, double *out) {
  int n = 0;
  const char *p = spec;
  for (;;) {
    size_t len = strcspn(p, ",");
    char elem[64];
    snprintf(elem, sizeof elem, "%.*s", (int)(len < sizeof elem ? len : sizeof elem - 1), p);
    if (n == MAX_FRACTIONS) {
      fprintf(stderr, "ferry sim: --optimizer-fraction %s: at most %d shares\n", spec,
              MAX_FRACTIONS);
      return -1;
    }
    if (len >= sizeof elem ||
        cli_number("sim", "--optimizer-fraction", len >= sizeof elem ? spec : elem,
                   FERRY_NUMBER_REAL, 0, 1, 0, &out[n]))
      return -1;
    n++;
    if (!p[len]) return n;
    p += len + 1;
  }
}

/* "0,8,0..7": items of --weight-layers, each N (the first N blocks) or A..B
 * (blocks A to B, A <= B). The count, or -1 after a message naming the flag
 * and the value. */
int sim_parse_weight_layers(const char *spec, weight_item *out) {
  const char *flag = "--weight-layers";
  int n = 0;
  const char *p = spec;
  for (;;) {
    size_t len = strcspn(p, ",");
    char elem[64];
    if (len >= sizeof elem) {
      fprintf(stderr, "ferry sim: %s %s: an item is too long\n", flag, spec);
      return -1;
    }
    snprintf(elem, sizeof elem, "%.*s", (int)len, p);
    if (n == MAX_WEIGHT_ITEMS) {
      fprintf(stderr, "ferry sim: %s %s: at most %d items\n", flag, spec, MAX_WEIGHT_ITEMS);
      return -1;
    }
    char *dots = strstr(elem, "..");
    long a, b;
    if (dots) {
      char why[256];
      double x, y;
      *dots = 0;
      if (ferry_parse_number(flag, elem, FERRY_NUMBER_COUNT, 0, MAX_BLOCK, 0, &x, why, sizeof why) ||
          ferry_parse_number(flag, dots + 2, FERRY_NUMBER_COUNT, 0, MAX_BLOCK, 0, &y, why,
                             sizeof why)) {
        fprintf(stderr, "ferry sim: %s %s..%s: in the range, %s\n", flag, elem, dots + 2, why);
        return -1;
      }
      a = (long)x;
      b = (long)y;
      if (b < a) {
        fprintf(stderr, "ferry sim: %s %s..%s: expected A..B with A <= B\n", flag, elem, dots + 2);
        return -1;
      }
      out[n].first = (int32_t)a;
      out[n].count = (int32_t)(b - a + 1);
      snprintf(out[n].text, sizeof out[n].text, "%ld..%ld", a, b);
    } else {
      if (cli_int("sim", flag, elem, 0, MAX_BLOCK, &a)) return -1;
      out[n].first = 0;
      out[n].count = (int32_t)a;
      snprintf(out[n].text, sizeof out[n].text, "%ld", a);
    }
    n++;
    if (!p[len]) return n;
    p += len + 1;
  }
}
