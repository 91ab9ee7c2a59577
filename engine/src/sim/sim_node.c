/*
 * sim_node.c — sim_node_apply (ferry_sim.h): what the GPUs of a node
 * copying at once, NUMA-far pinned memory and copy/compute contention do to
 * one GPU's replay settings (docs/sim-model.md, "Time model"; the figures:
 * docs/hardware.md, "Node sharing").
 */
#include <math.h>
#include <stdio.h>

#include "ferry_tools.h"

int sim_node_apply(const sim_hw *hw, int gpus, double numa_far, int contention, sim_config *c,
                   char *err, size_t errlen) {
  if (!hw || !c) {
    if (err && errlen) snprintf(err, errlen, "sim_node_apply: NULL argument");
    return -1;
  }
  int node = hw->gpus_per_node > 0 ? hw->gpus_per_node : 1;
  if (gpus < 1 || gpus > node) {
    if (err && errlen)
      snprintf(err, errlen, "--gpus-per-node %d: %s has %d GPU(s) per node (1..%d)", gpus,
               hw->name, node, node);
    return -1;
  }
  if (!(numa_far > 0 && numa_far <= 1)) {
    if (err && errlen)
      snprintf(err, errlen, "--numa-far %g: expected a bandwidth factor within (0, 1]", numa_far);
    return -1;
  }
  /* GPUs behind one switch share its uplink when they copy at once */
  int per_switch = hw->gpus_per_switch > 1 ? hw->gpus_per_switch : 1;
  double share = (double)(gpus < per_switch ? gpus : per_switch);
  c->link.d2h_bytes_per_s *= numa_far / share;
  c->link.h2d_bytes_per_s *= numa_far / share;
  /* all GPUs copying in step (data parallel: the same schedule) */
  c->host_mem_bytes_per_s = hw->node_host_mem_bytes_per_s / gpus;
  c->contention_hbm_bytes_per_s = contention ? hw->hbm_bytes_per_s : 0;
  return 0;
}
