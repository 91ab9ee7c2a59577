/* meminfo.c — host RAM from /proc/meminfo (the default ferry_host_ram_fn).
 * Every step begin asks for it, so it is cheap: one read of the file's
 * head (MemTotal and MemAvailable are its first and third lines), and the
 * real /proc/meminfo is read again only once its last reading is 10 ms old
 * (the kernel's own formatting of the file costs microseconds; RAM use
 * does not change meaningfully in 10 ms). A file named by ud is read every
 * time. */
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"

#define REUSE_NS 10000000ull /* a /proc/meminfo reading is reused this long */

/* The kB value after "key" at a line's start in buf, or -1. */
static long long field_kib(const char *buf, const char *key) {
  size_t n = strlen(key);
  for (const char *p = buf; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (strncmp(p, key, n)) continue;
    char *end;
    long long v = strtoll(p + n, &end, 10);
    while (*end == ' ') end++;
    return end > p + n && !strncmp(end, "kB", 2) && v >= 0 ? v : -1;
  }
  return -1;
}

static int read_meminfo(const char *path, uint64_t *total, uint64_t *avail) {
  char buf[1024];
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return FERRY_EIO;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n < 0) return FERRY_EIO;
  buf[n] = '\0';
  long long t = field_kib(buf, "MemTotal:"), a = field_kib(buf, "MemAvailable:");
  if (t <= 0 || a < 0 || a > t) return FERRY_EPARSE;
  *total = (uint64_t)t * 1024;
  *avail = (uint64_t)a * 1024;
  return FERRY_OK;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct {
  pthread_mutex_t lock;
  uint64_t at_ns, total, avail; /* at_ns 0: no reading yet */
} proc = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0};

int ferry_host_ram_proc(void *ud, uint64_t *total_bytes, uint64_t *available_bytes) {
  if (ud) return read_meminfo((const char *)ud, total_bytes, available_bytes);
  uint64_t t = now_ns(), total, avail;
  pthread_mutex_lock(&proc.lock);
  int rc = FERRY_OK;
  if (!proc.at_ns || t - proc.at_ns >= REUSE_NS) {
    rc = read_meminfo("/proc/meminfo", &total, &avail);
    if (!rc) proc.at_ns = t ? t : 1, proc.total = total, proc.avail = avail;
  }
  total = proc.total, avail = proc.avail;
  pthread_mutex_unlock(&proc.lock);
  if (rc) return rc;
  *total_bytes = total;
  *available_bytes = avail;
  return FERRY_OK;
}
