/*
 * sim_report.h — what the simulator shows: hardware presets, the link
 * syntax, the comparison and per-layer tables, the JSON report, the Chrome
 * trace-event file and the SVG of device memory (docs/simulator.md).
 */
#ifndef FERRY_SIM_REPORT_H
#define FERRY_SIM_REPORT_H

#include <stddef.h>
#include <stdio.h>

#include "sim/trace_replayer.h"

typedef struct sim_hw {
  const char *name;
  const char *description;
  ferry_link link;
  double duplex_d2h, duplex_h2d; /* per direction, as measured */
  double device_bytes;           /* HBM capacity */
  const char *source;
} sim_hw;

/* NULL if unknown. */
const sim_hw *sim_hw_preset(const char *name);
const char *sim_hw_names(void);
/* "h2d=55GB/s,d2h=55GB/s,latency=5us,duplex=0.9" over *hw (fields not
 * named keep their values). 0, or -1 with a message. */
int sim_parse_link(const char *spec, sim_hw *hw, char *err, size_t errlen);

typedef struct sim_run_info {
  const char *trace_path;
  const sim_trace *trace;
  const sim_hw *hw;
} sim_run_info;

/* rs[0] is the baseline (no offload), rs[1..n-1] the policies. */
void sim_print_table(FILE *f, const sim_run_info *info, const sim_result *rs, int n);
void sim_print_layers(FILE *f, const sim_result *rs, int n);
int sim_write_json(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                   char *err, size_t errlen);
int sim_write_chrome_trace(const char *path, const sim_result *rs, int n, char *err,
                           size_t errlen);
int sim_write_svg(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                  char *err, size_t errlen);

#endif
