/*
 * sim_format.h — sizes and durations as the simulator's reports print them
 * (tables in sim_report.c, labels and legends in sim_plot.c): one rule, so
 * the picture and the table show the same figures; and how they close a
 * report file.
 */
#ifndef FERRY_SIM_FORMAT_H
#define FERRY_SIM_FORMAT_H

#include <stddef.h>
#include <stdio.h>

#include "ferry_tools.h" /* sim_result */

#define GIB 1073741824.0

static inline void fmt_bytes(char *b, size_t n, double v) {
  if (v >= GIB) snprintf(b, n, "%.2f GiB", v / GIB);
  else if (v >= 1048576.0) snprintf(b, n, "%.1f MiB", v / 1048576.0);
  else if (v >= 1024.0) snprintf(b, n, "%.1f KiB", v / 1024.0);
  else snprintf(b, n, "%.0f B", v);
}

static inline void fmt_us(char *b, size_t n, double us) {
  if (us >= 1e6) snprintf(b, n, "%.3f s", us / 1e6);
  else if (us >= 1e3) snprintf(b, n, "%.1f ms", us / 1e3);
  else snprintf(b, n, "%.1f us", us);
}

/* One run's figures as the comparison tables print them (text and HTML). */
typedef struct sim_row_cells {
  char peak[32], step[32], stall[32], d2h[32], h2d[32], host_peak[32], host_reserved[32];
} sim_row_cells;

static inline void sim_row_format(const sim_result *r, sim_row_cells *c) {
  fmt_bytes(c->peak, sizeof c->peak, (double)r->peak_device_bytes);
  fmt_us(c->step, sizeof c->step, r->step_us);
  fmt_us(c->stall, sizeof c->stall, r->stall_us + r->host_wait_us);
  fmt_bytes(c->d2h, sizeof c->d2h, r->bytes_d2h);
  fmt_bytes(c->h2d, sizeof c->h2d, r->bytes_h2d);
  fmt_bytes(c->host_peak, sizeof c->host_peak, (double)r->peak_host_bytes);
  fmt_bytes(c->host_reserved, sizeof c->host_reserved, (double)r->host_reserved_bytes);
}

/* Where a run's last step peaked, as the reports say it: "backward, layer
 * 31 (lm_head), at gathered parameters: block" (the phase; the layer and op
 * of the compute it is for; what raised it). */
static inline void sim_peak_where_text(const sim_result *r, char *b, size_t n) {
  char layer[48];
  if (r->peak_layer >= 0) snprintf(layer, sizeof layer, "layer %d", (int)r->peak_layer);
  else snprintf(layer, sizeof layer, "outside the blocks");
  snprintf(b, n, "%s, %s%s%s%s%s%s", sim_peak_phase_name(r->peak_phase), layer,
           r->peak_op[0] ? " (" : "", r->peak_op, r->peak_op[0] ? ")" : "",
           r->peak_what[0] ? ", at " : "", r->peak_what);
}

/* Closes a report file: 0, or -1 with "write error on PATH" when a write
 * or the close failed. */
static inline int close_checked(FILE *f, const char *path, char *err, size_t errlen) {
  int bad = ferror(f);
  if (fclose(f) || bad) {
    snprintf(err, errlen, "write error on %s", path);
    return -1;
  }
  return 0;
}

/* sim_report.c: the link rate of one direction (h2d 1, d2h 0) the runs
 * priced: the node's (sim_run_info) when given, else the preset's. */
double sim_info_link(const sim_run_info *info, int h2d);

/* sim_bands.c: run i's error bands (i >= 1) as the JSON report's "band". */
struct cJSON;
void sim_band_json(struct cJSON *o, const sim_run_info *info, const sim_result *rs, int i);

#endif
