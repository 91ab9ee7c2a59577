/*
 * log.c — where the engine's messages go (ferry_log_open, ferry.h): stderr,
 * or a file capped in size and rotated (path, path.1 ... path.keep), with a
 * level filter and identical consecutive messages counted, not repeated.
 * Process-wide, one mutex: messages are rare (policy ferry.log lines,
 * warnings, errors), never on the per-tensor path.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "util/errbuf.h"
#include "util/log.h"

#define LOG_LINE_MAX 1024
#define LOG_DEFAULT_MAX_BYTES (16ull << 20)
#define LOG_DEFAULT_KEEP 3
#define LOG_MIN_BYTES 4096
#define LOG_MAX_KEEP 100

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int fd;             /* 2 = stderr */
  char path[PATH_MAX];
  uint64_t max_bytes; /* the file's cap */
  uint64_t size;      /* bytes in the current file */
  uint32_t keep;      /* rotated files kept */
  int level;
  int configured;     /* by ferry_log_open or the environment, once */
  int env_rc;         /* the environment's verdict, kept for every engine */
  char env_err[256];
  char last[LOG_LINE_MAX]; /* the last message written, for repeats */
  int last_level;
  unsigned long repeats;
} lg = {.fd = 2, .max_bytes = LOG_DEFAULT_MAX_BYTES, .keep = LOG_DEFAULT_KEEP,
        .level = FERRY_LOG_INFO};

static const char *level_name(int level) {
  return level == FERRY_LOG_ERROR ? "error" : level == FERRY_LOG_WARNING ? "warning" : "info";
}

static void write_all(int fd, const char *s, size_t n) {
  while (n) {
    ssize_t w = write(fd, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return; /* a log that cannot be written must not stop training */
    s += w, n -= (size_t)w;
  }
}

/* path with "%p" replaced by the pid (one file per rank); -1 if too long */
static int expand_path(const char *path, char *out, size_t n) {
  size_t o = 0;
  for (const char *s = path; *s; s++) {
    if (s[0] == '%' && s[1] == 'p') {
      int w = snprintf(out + o, n - o, "%d", (int)getpid());
      if (w < 0 || (size_t)w >= n - o) return -1;
      o += (size_t)w, s++;
    } else {
      if (o + 1 >= n) return -1;
      out[o++] = *s;
    }
  }
  out[o] = 0;
  return 0;
}

/* Opens path for appending; refuses what is not a regular file (a device,
 * FIFO or directory would block, fill up or fail). */
static int open_file(const char *path, int truncate, uint64_t *size, char *err, size_t errlen) {
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK |
                          (truncate ? O_TRUNC : 0),
                0644);
  if (fd < 0 && (errno == EISDIR || errno == ENXIO)) /* ENXIO: a FIFO nobody reads */
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "log file %s: not a regular file", path);
  if (fd < 0)
    return ferry_errbuf(err, errlen, FERRY_EIO, "log file %s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "log file %s: not a regular file", path);
  }
  *size = (uint64_t)st.st_size;
  return fd;
}

/* path -> path.1 -> ... -> path.keep (dropped), then a fresh path. */
static void rotate(void) {
  char from[PATH_MAX + 16], to[PATH_MAX + 16];
  close(lg.fd);
  lg.fd = 2;
  for (uint32_t k = lg.keep; k >= 1; k--) {
    if (k == 1)
      snprintf(from, sizeof from, "%s", lg.path);
    else
      snprintf(from, sizeof from, "%s.%u", lg.path, k - 1);
    snprintf(to, sizeof to, "%s.%u", lg.path, k);
    rename(from, to); /* absent: nothing to move */
  }
  uint64_t size = 0;
  int fd = open_file(lg.path, 1, &size, NULL, 0);
  if (fd >= 0) lg.fd = fd, lg.size = size;
  else
    lg.path[0] = 0; /* stderr from now on */
}

/* With log_mu held: one line, "ferry: msg" on stderr, time, pid and level
 * in a file. */
static void emit(int level, const char *msg) {
  char line[LOG_LINE_MAX + 96];
  int n;
  if (lg.fd == 2) {
    n = snprintf(line, sizeof line, "ferry: %s\n", msg);
  } else {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    localtime_r(&tv.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    n = snprintf(line, sizeof line, "%s.%03ld ferry[%d] %s: %s\n", when,
                 (long)(tv.tv_usec / 1000), (int)getpid(), level_name(level), msg);
  }
  if (n < 0) return;
  size_t len = (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
  if (lg.fd != 2 && lg.size > 0 && lg.size + len > lg.max_bytes) rotate();
  write_all(lg.fd, line, len);
  if (lg.fd != 2) lg.size += len;
}

static void flush_repeats(void) {
  if (!lg.repeats) return;
  char msg[96];
  snprintf(msg, sizeof msg, "the previous message repeated %lu more time%s", lg.repeats,
           lg.repeats == 1 ? "" : "s");
  lg.repeats = 0;
  emit(lg.last_level, msg);
}

static void at_exit(void) {
  pthread_mutex_lock(&log_mu);
  flush_repeats();
  pthread_mutex_unlock(&log_mu);
}

/* With log_mu held. */
static int configure(const char *path, uint64_t max_bytes, uint32_t keep, int level, char *err,
                     size_t errlen) {
  if (level < FERRY_LOG_ERROR || level > FERRY_LOG_INFO)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "log level %d: expected 0 (errors), "
                        "1 (warnings) or 2 (info)", level);
  if (max_bytes < LOG_MIN_BYTES)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "log max_bytes %llu: expected at least %d",
                        (unsigned long long)max_bytes, LOG_MIN_BYTES);
  if (keep > LOG_MAX_KEEP)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "log keep %u: expected 0 to %d", keep,
                        LOG_MAX_KEEP);
  int fd = 2;
  uint64_t size = 0;
  char full[PATH_MAX];
  full[0] = 0;
  if (path && *path) {
    if (expand_path(path, full, sizeof full))
      return ferry_errbuf(err, errlen, FERRY_EINVAL, "log file %.200s: path too long", path);
    fd = open_file(full, 0, &size, err, errlen);
    if (fd < 0) return fd;
  }
  flush_repeats();
  if (lg.fd != 2) close(lg.fd);
  lg.fd = fd;
  lg.size = size;
  memcpy(lg.path, full, sizeof full);
  lg.max_bytes = max_bytes;
  lg.keep = keep;
  lg.level = level;
  lg.last[0] = 0;
  if (!lg.configured) atexit(at_exit);
  lg.configured = 1;
  return FERRY_OK;
}

static int level_parse(const char *s) {
  static const char *names[] = {"error", "warning", "info"};
  for (int i = 0; i < 3; i++)
    if (!strcmp(s, names[i])) return i;
  return -1;
}

/* With log_mu held: FERRY_LOG_FILE, FERRY_LOG_MAX_BYTES, FERRY_LOG_KEEP,
 * FERRY_LOG_LEVEL, read once; the verdict is kept. */
static int configure_from_env(void) {
  if (lg.configured) return lg.env_rc;
  char *err = lg.env_err;
  size_t errlen = sizeof lg.env_err;
  double max_bytes = LOG_DEFAULT_MAX_BYTES, keep = LOG_DEFAULT_KEEP;
  int level = FERRY_LOG_INFO, rc = FERRY_OK;
  const char *s;
  if ((s = getenv("FERRY_LOG_MAX_BYTES")) && *s)
    rc = ferry_parse_number("FERRY_LOG_MAX_BYTES", s, FERRY_NUMBER_BYTES, LOG_MIN_BYTES,
                            (double)(1ull << 50), 0, &max_bytes, err, errlen);
  if (!rc && (s = getenv("FERRY_LOG_KEEP")) && *s)
    rc = ferry_parse_number("FERRY_LOG_KEEP", s, FERRY_NUMBER_COUNT, 0, LOG_MAX_KEEP, 0, &keep,
                            err, errlen);
  if (!rc && (s = getenv("FERRY_LOG_LEVEL")) && *s && (level = level_parse(s)) < 0)
    rc = ferry_errbuf(err, errlen, FERRY_EINVAL,
                      "FERRY_LOG_LEVEL '%.40s': expected error, warning or info", s);
  if (!rc)
    rc = configure(getenv("FERRY_LOG_FILE"), (uint64_t)max_bytes, (uint32_t)keep, level, err,
                   errlen);
  if (rc) { /* messages still go somewhere: stderr, all levels */
    configure(NULL, LOG_DEFAULT_MAX_BYTES, LOG_DEFAULT_KEEP, FERRY_LOG_INFO, NULL, 0);
    lg.env_rc = rc;
    char msg[300];
    snprintf(msg, sizeof msg, "%s; messages go to stderr", err);
    emit(FERRY_LOG_ERROR, msg);
  }
  return rc;
}

int ferry_log_open(const char *path, uint64_t max_bytes, uint32_t keep, int level, char *errbuf,
                   size_t errlen) {
  pthread_mutex_lock(&log_mu);
  int rc = configure(path, max_bytes, keep, level, errbuf, errlen);
  if (rc == FERRY_OK) lg.env_rc = FERRY_OK; /* the caller's choice replaces the environment's */
  pthread_mutex_unlock(&log_mu);
  return rc;
}

int ferry_log_level(int level) {
  if (level < FERRY_LOG_ERROR || level > FERRY_LOG_INFO) return -1;
  pthread_mutex_lock(&log_mu);
  configure_from_env();
  int old = lg.level;
  lg.level = level;
  pthread_mutex_unlock(&log_mu);
  return old;
}

int util_log_check_env(char *err, size_t errlen) {
  pthread_mutex_lock(&log_mu);
  int rc = configure_from_env();
  if (rc) ferry_errbuf(err, errlen, rc, "%s", lg.env_err);
  pthread_mutex_unlock(&log_mu);
  return rc;
}

static _Thread_local int thread_quiet;

int util_log_quiet(int on) {
  int old = thread_quiet;
  thread_quiet = on != 0;
  return old;
}

void util_log(int level, const char *fmt, ...) {
  if (thread_quiet && level > FERRY_LOG_ERROR) return;
  char msg[LOG_LINE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&log_mu);
  configure_from_env();
  if (level <= lg.level) {
    if (lg.last[0] && level == lg.last_level && !strcmp(msg, lg.last)) {
      lg.repeats++;
    } else {
      flush_repeats();
      emit(level, msg);
      memcpy(lg.last, msg, sizeof msg);
      lg.last_level = level;
    }
  }
  pthread_mutex_unlock(&log_mu);
}
