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

#endif
