/* meminfo.c — host RAM from /proc/meminfo (the default ferry_host_ram_fn). */
#include <stdio.h>

#include "ferry_tools.h"

int ferry_host_ram_proc(void *ud, uint64_t *total_bytes, uint64_t *available_bytes) {
  const char *path = ud ? (const char *)ud : "/proc/meminfo";
  FILE *f = fopen(path, "r");
  if (!f) return FERRY_EIO;
  char line[256];
  unsigned long long kib, total = 0, avail = 0;
  int have_avail = 0;
  while (fgets(line, sizeof line, f)) {
    if (sscanf(line, "MemTotal: %llu kB", &kib) == 1) total = kib;
    else if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) avail = kib, have_avail = 1;
  }
  fclose(f);
  if (!total || !have_avail || avail > total) return FERRY_EPARSE;
  *total_bytes = (uint64_t)total * 1024;
  *available_bytes = (uint64_t)avail * 1024;
  return FERRY_OK;
}
