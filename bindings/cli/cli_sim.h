/*
 * cli_sim.h — what `ferry sim`'s command (cli_sim.c) shares with its
 * option parsers and usage text (cli_sim_args.c).
 */
#ifndef FERRY_CLI_SIM_H
#define FERRY_CLI_SIM_H

#include <stdint.h>
#include <stdio.h>

#include "ferry_tools.h"

/* Run settings common to every replay of a `ferry sim` command. */
typedef struct sim_opts {
  uint32_t steps;
  int32_t warmup;
  uint64_t host_cap, host_ram;
  double pin_alloc_us, pin_touch_bytes_per_s;
  int no_pool;
  double mfu, tflops; /* compute from FLOPs: tflops, else peak x mfu */
  double hbm;         /* device-memory bytes/s; 0: the preset's x SIM_DEFAULT_HBM_FRACTION */
  int release_copied, prefetch_bwd;
  double cpu_adam;     /* params/s per rank, 0 = the default */
  int opt_serial;      /* --optimizer-overlap off */
  int w_single;        /* --weight-double-buffer off */
  /* --untracked: learned from a recorded run's device_peak, off, or the
   * bytes given in untracked */
  enum { UNTRACKED_AUTO = 0, UNTRACKED_OFF, UNTRACKED_GIVEN } untracked_mode;
  uint64_t untracked;
  /* collectives (docs/sim-model.md, "Collectives"): the nodes the
   * data-parallel group spans, and bus bandwidths per GPU in bytes/s
   * overriding the preset's (-1: the preset's; 0: collectives take no time) */
  uint32_t nodes;
  double nvlink, nic;
  /* the node (sim_node_apply): GPUs copying at once, the NUMA-far factor,
   * --contention off */
  int gpus;
  double numa_far;
  int contention_off;
  double host_overhead_us; /* per saved tensor, on the host's timeline */
  int gpus_given;          /* --gpus-per-node given (else 1, not the run's GPUs) */
  double mfu_sensitivity;  /* --mfu-sensitivity: 0 off, else F (replays at x (1 -+ F)) */
  int mfu_sensitivity_given; /* ... given on the command line (else the default) */
} sim_opts;

#define SIM_OPTS_INIT                                                                      \
  {3, 0, 0, 0, 3000.0, 2.5e9, 0, SIM_DEFAULT_MFU, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, -1, -1,    \
   1, 1.0, 0, SIM_HOST_OVERHEAD_TORCH2_US, 0, SIM_MFU_SENSITIVITY, 0}
#define MAX_FRACTIONS 16
#define MAX_WEIGHT_ITEMS 16
#define MAX_BLOCK 1000000 /* a block index or count no trace reaches */

/* One item of --weight-layers: blocks first .. first + count - 1, and how
 * the item was written (N or A..B) for the run's label. */
typedef struct weight_item {
  int32_t first, count;
  char text[32];
} weight_item;

void sim_usage(FILE *f);
int sim_parse_pinned(const char *spec, sim_opts *o);
int sim_parse_fractions(const char *spec, double *out);
int sim_parse_weight_layers(const char *spec, weight_item *out);
int sim_parse_mfu_sensitivity(const char *spec, double *out);

#endif
