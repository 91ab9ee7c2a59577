/*
 * bench_main.c — `ferry_bench [--json FILE] [--only NAME]`: runs every
 * benchmark in one process, prints a table (each ratio is measured against a
 * baseline taken in the same run) and writes a flat JSON object of metric
 * name to number. Where valgrind is installed it also re-runs the
 * pack/unpack loops under callgrind and reports instructions per pair,
 * which, unlike nanoseconds, do not move with machine load. It runs the
 * benchmarks through bench_table (bench.h); they report through
 * bench_report.c.
 */
#include <getopt.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

extern char **environ;

/* Instructions per iteration of `which`, from two callgrind runs of
 * different lengths (their difference cancels start-up costs). -1 if
 * valgrind is not available. */
static double callgrind_per_iter_of(const char *self, const char *which, long lo, long hi) {
  long iters[2] = {lo, hi};
  double total[2];
  for (int k = 0; k < 2; k++) {
    char out[] = "/tmp/ferry-callgrind-XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0) return -1;
    close(fd);
    char outarg[64], itarg[32];
    snprintf(outarg, sizeof outarg, "--callgrind-out-file=%s", out);
    snprintf(itarg, sizeof itarg, "%ld", iters[k]);
    char *argv[] = {"valgrind", "--tool=callgrind", "--collect-atstart=no", outarg, "-q",
                    (char *)self, "--instr", (char *)which, itarg, NULL};
    pid_t pid;
    if (posix_spawnp(&pid, "valgrind", NULL, NULL, argv, environ) != 0) return -1;
    int st = 0;
    waitpid(pid, &st, 0);
    total[k] = -1;
    FILE *f = fopen(out, "r");
    char line[512];
    while (f && fgets(line, sizeof line, f))
      if (!strncmp(line, "totals:", 7) || !strncmp(line, "summary:", 8))
        total[k] = atof(strchr(line, ':') + 1);
    if (f) fclose(f);
    unlink(out);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || total[k] < 0) return -1;
  }
  return (total[1] - total[0]) / (double)(iters[1] - iters[0]);
}

static double callgrind_per_iter(const char *self, const char *which) {
  return callgrind_per_iter_of(self, which, 20000, 60000);
}

int main(int argc, char **argv) {
  const char *json_path = "build/bench.json", *only = NULL;
  static const struct option opts[] = {{"json", required_argument, 0, 'j'},
                                       {"only", required_argument, 0, 'o'},
                                       {"instr", required_argument, 0, 'i'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "j:o:i:h", opts, NULL)) != -1) {
    switch (c) {
    case 'j': json_path = optarg; break;
    case 'o': only = optarg; break;
    case 'i': {
      long n = optind < argc ? atol(argv[optind]) : 10000;
      if (!strncmp(optarg, "decide:", 7)) return bench_policy_instr(optarg + 7, n, 0);
      if (!strncmp(optarg, "steady:", 7)) return bench_policy_instr(optarg + 7, n, 1);
      if (!strncmp(optarg, "sim:", 4)) return bench_sim_instr(optarg + 4, n);
      return bench_engine_instr(optarg, n);
    }
    default:
      fprintf(stderr, "usage: ferry_bench [--json FILE] [--only engine|host_copy|cuda_copy|arena|policy|sim|snapshot|prefetch|stress]\n");
      return c == 'h' ? 0 : 2;
    }
  }
  bench_report *r = bench_report_open(json_path);
  if (!r) {
    fprintf(stderr, "ferry_bench: out of memory\n");
    return 1;
  }
  printf("  %-40s %14s %-8s %s\n", "metric", "value", "unit", "note");
  for (size_t i = 0; i < bench_table_len; i++) {
    if (only && strcmp(only, bench_table[i].name)) continue;
    printf("[%s]\n", bench_table[i].name);
    bench_table[i].fn(r);
  }
  if (!only || !strcmp(only, "engine")) {
    printf("[callgrind]\n");
    double keep = callgrind_per_iter(argv[0], "keep");
    double offl = callgrind_per_iter(argv[0], "offload");
    if (keep > 0) {
      bench_metric(r, "pack_unpack_keep_instr", keep, "instr", "callgrind, per pack+unpack");
      bench_metric(r, "pack_unpack_offload_instr", offl, "instr",
                   "callgrind, per pack+unpack, engine thread only");
    } else {
      printf("  (valgrind not available: no instruction counts)\n");
    }
  }
  if (!only || !strcmp(only, "policy")) {
    /* instructions do not move with the load of a shared machine as ns do */
    static const char *const shipped[] = {"default", "budget", "layers", "fraction", "ramcap",
                                          "host_budget"};
    for (size_t k = 0; k < sizeof shipped / sizeof shipped[0]; k++) {
      char which[64], metric[96];
      snprintf(which, sizeof which, "decide:%s", shipped[k]);
      double un = callgrind_per_iter_of(argv[0], which, 5000, 15000);
      snprintf(which, sizeof which, "steady:%s", shipped[k]);
      double st = callgrind_per_iter_of(argv[0], which, 20, 60) / bench_policy_step_sites();
      if (un <= 0 || st <= 0) break; /* no valgrind */
      snprintf(metric, sizeof metric, "decide_uncached_instr_%s", shipped[k]);
      bench_metric(r, metric, un, "instr", "callgrind, per uncached decision, as measured in ns");
      snprintf(metric, sizeof metric, "decide_steady_instr_%s", shipped[k]);
      bench_metric(r, metric, st, "instr", "callgrind, per steady decision, its begin included");
    }
  }
  if (!only || !strcmp(only, "sim")) {
    /* per trace event, over the steps between a 2- and a 6-step trace */
    static const char *const parts[3][2] = {{"parse", "sim_parse_instr_per_event"},
                                            {"replay", "sim_replay_instr_per_event"},
                                            {"whole", "sim_instr_per_event"}};
    double per_step = bench_sim_events_per_step();
    for (int k = 0; k < 3 && per_step > 0; k++) {
      char which[32];
      snprintf(which, sizeof which, "sim:%s", parts[k][0]);
      double instr = callgrind_per_iter_of(argv[0], which, 2, 6);
      if (instr > 0)
        bench_metric(r, parts[k][1], instr / per_step, "instr",
                     k == 0   ? "callgrind, sim_trace_load per trace event (llama3-8b)"
                     : k == 1 ? "callgrind, sim_replay per trace event, default.lua, h100"
                              : "callgrind, both: what sim_events_per_s times");
    }
  }
  if (bench_report_close(r, json_path)) return 1;
  printf("wrote %s\n", json_path);
  return 0;
}
