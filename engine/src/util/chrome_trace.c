/*
 * chrome_trace.c — the Chrome trace-event writer shared by the simulator's
 * report and the engine's recorder of real runs (chrome_trace.h).
 */
#include "util/chrome_trace.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char HEADER[] = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
static const char TRAILER[] = "\n]}\n";
#define CT_FLUSH_BYTES ((size_t)1 << 20)

/* Writes all of n bytes at off (seekable) or at the end; 0 or an errno. */
static int write_all(ct_writer *w, const char *p, size_t n, uint64_t off) {
  while (n) {
    ssize_t k = w->seekable ? pwrite(w->fd, p, n, (off_t)off) : write(w->fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return 0;
}

int ct_open(ct_writer *w, const char *path, char *err, size_t errlen) {
  memset(w, 0, sizeof *w);
  w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (w->fd < 0) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    return -1;
  }
  struct stat st;
  w->seekable = fstat(w->fd, &st) == 0 && S_ISREG(st.st_mode);
  w->pid = getpid();
  w->flush_bytes = CT_FLUSH_BYTES;
  int rc = write_all(w, HEADER, sizeof HEADER - 1, 0);
  if (rc) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(rc));
    close(w->fd);
    w->fd = -1;
    return -1;
  }
  w->off = sizeof HEADER - 1;
  return ct_flush(w, err, errlen);
}

static int flush_events(ct_writer *w, int closing) {
  if (w->fd < 0) return 0;
  if (getpid() != w->pid) { /* a forked child: the file is its parent's */
    w->len = 0;
    return 0;
  }
  if (!w->error && w->len) {
    w->error = write_all(w, w->buf, w->len, w->off);
    w->off += w->len;
  }
  w->len = 0;
  if (!w->error && (w->seekable || closing))
    w->error = write_all(w, TRAILER, sizeof TRAILER - 1, w->off);
  return w->error;
}

int ct_flush(ct_writer *w, char *err, size_t errlen) {
  if (flush_events(w, 0)) {
    if (err && errlen) snprintf(err, errlen, "write error on the Chrome trace: %s", strerror(w->error));
    return -1;
  }
  return 0;
}

int ct_close(ct_writer *w, char *err, size_t errlen) {
  int rc = 0;
  if (w->fd >= 0) {
    flush_events(w, 1);
    if (close(w->fd) && !w->error) w->error = errno;
    w->fd = -1;
    if (w->error) {
      if (err && errlen) snprintf(err, errlen, "write error on the Chrome trace: %s", strerror(w->error));
      rc = -1;
    }
  }
  free(w->buf);
  free(w->scratch);
  w->buf = w->scratch = NULL;
  w->len = w->cap = w->scratch_len = 0;
  return rc;
}

/* ---- numbers -------------------------------------------------------------------
 * cJSON prints a number that is not a small integer with sprintf("%1.15g")
 * and reads it back with sscanf to check it: about 3,000 instructions, most
 * of an event's cost when every event has two times. Times (µs, to the ns)
 * and counts are written here as raw JSON text with integer arithmetic;
 * the values are the same. */

/* Adds item under key, a string constant the object does not copy. */
static void add(cJSON *o, const char *key, cJSON *item) {
  if (!item || !cJSON_AddItemToObjectCS(o, key, item)) cJSON_Delete(item);
}

/* Decimal digits of v into the end of buf (no terminator); returns the start. */
static char *digits(char *end, uint64_t v) {
  do *--end = (char)('0' + v % 10);
  while (v /= 10);
  return end;
}

void ct_add_us(cJSON *o, const char *key, double us) {
  double ns = round(us * 1000);
  if (!o) return;
  if (!(fabs(ns) < 9e15)) { /* not finite, or beyond exact integers */
    add(o, key, cJSON_CreateNumber(ns / 1000));
    return;
  }
  char buf[32], *end = buf + sizeof buf - 1, *p;
  *end = 0;
  uint64_t a = (uint64_t)fabs(ns), frac = a % 1000;
  if (frac) { /* ".5", ".25", ".125": no trailing zeros */
    int n = 3;
    while (frac % 10 == 0) frac /= 10, n--;
    p = end;
    for (int i = 0; i < n; i++, frac /= 10) *--p = (char)('0' + frac % 10);
    *--p = '.';
    end = p;
  }
  p = digits(end, a / 1000);
  if (ns < 0) *--p = '-';
  add(o, key, cJSON_CreateRaw(p));
}

void ct_add_count(cJSON *o, const char *key, double v) {
  if (!o) return;
  if (v != floor(v) || !(fabs(v) < 9e15)) {
    add(o, key, cJSON_CreateNumber(v));
    return;
  }
  char buf[32], *end = buf + sizeof buf - 1, *p;
  *end = 0;
  p = digits(end, (uint64_t)fabs(v));
  if (v < 0) *--p = '-';
  add(o, key, cJSON_CreateRaw(p));
}

void ct_add_str(cJSON *o, const char *key, const char *value) {
  if (o) add(o, key, cJSON_CreateString(value));
}

cJSON *ct_event(const char *ph, const char *name, int pid, int tid, double ts_us) {
  cJSON *e = cJSON_CreateObject();
  if (!e) return NULL;
  add(e, "ph", cJSON_CreateString(ph));
  if (name) add(e, "name", cJSON_CreateString(name));
  ct_add_count(e, "pid", pid);
  if (tid) ct_add_count(e, "tid", tid);
  ct_add_us(e, "ts", ts_us);
  return e;
}

cJSON *ct_args(cJSON *e) {
  if (!e) return NULL;
  cJSON *a = cJSON_GetObjectItemCaseSensitive(e, "args");
  if (a) return a;
  a = cJSON_CreateObject();
  if (a && !cJSON_AddItemToObjectCS(e, "args", a)) {
    cJSON_Delete(a);
    a = NULL;
  }
  return a;
}

void ct_emit(ct_writer *w, cJSON *e) {
  if (!e) return;
  /* printed into the writer's scratch buffer (grown when an event does not
   * fit), not into a fresh allocation per event */
  if (!w->scratch) w->scratch = malloc(w->scratch_len = 1024);
  while (w->scratch && !cJSON_PrintPreallocated(e, w->scratch, (int)w->scratch_len, 0)) {
    free(w->scratch);
    w->scratch = w->scratch_len < ((size_t)1 << 26) ? malloc(w->scratch_len *= 4) : NULL;
  }
  cJSON_Delete(e);
  const char *text = w->scratch;
  if (!text) {
    if (!w->error) w->error = ENOMEM;
    w->scratch_len = 0;
    return;
  }
  size_t n = strlen(text), need = w->len + n + 2;
  if (need > w->cap) {
    size_t ncap = w->cap ? w->cap : 4096;
    while (ncap < need) ncap *= 2;
    char *b = realloc(w->buf, ncap);
    if (!b) {
      if (!w->error) w->error = ENOMEM;
      return;
    }
    w->buf = b;
    w->cap = ncap;
  }
  if (w->events++) {
    w->buf[w->len++] = ',';
    w->buf[w->len++] = '\n';
  }
  memcpy(w->buf + w->len, text, n);
  w->len += n;
  if (w->len >= w->flush_bytes) flush_events(w, 0);
}

static void meta(ct_writer *w, const char *what, int pid, int tid, const char *key,
                 cJSON *value) {
  cJSON *e = ct_event("M", what, pid, tid, 0);
  if (e) cJSON_AddItemToObject(ct_args(e), key, value);
  else cJSON_Delete(value);
  ct_emit(w, e);
}

void ct_process(ct_writer *w, int pid, const char *name, int sort) {
  meta(w, "process_name", pid, 0, "name", cJSON_CreateString(name));
  if (sort >= 0) meta(w, "process_sort_index", pid, 0, "sort_index", cJSON_CreateNumber(sort));
}

void ct_thread(ct_writer *w, int pid, int tid, const char *name, int sort) {
  meta(w, "thread_name", pid, tid, "name", cJSON_CreateString(name));
  if (sort >= 0) meta(w, "thread_sort_index", pid, tid, "sort_index", cJSON_CreateNumber(sort));
}

cJSON *ct_slice(const char *name, const char *cat, int pid, int tid, double ts_us,
                double dur_us) {
  cJSON *e = ct_event("X", name, pid, tid, ts_us);
  if (!e) return NULL;
  ct_add_us(e, "dur", dur_us > 0 ? dur_us : 0);
  if (cat) add(e, "cat", cJSON_CreateString(cat));
  return e;
}

void ct_flow(ct_writer *w, int start, const char *name, double id, int pid, int tid,
             double ts_us) {
  cJSON *f = ct_event(start ? "s" : "f", name, pid, tid, ts_us);
  if (!f) return;
  add(f, "cat", cJSON_CreateString("flow"));
  ct_add_count(f, "id", id);
  if (!start) add(f, "bp", cJSON_CreateString("e"));
  ct_emit(w, f);
}

void ct_counter(ct_writer *w, const char *name, int pid, double ts_us, const char *key,
                double value) {
  cJSON *e = ct_event("C", name, pid, 0, ts_us);
  if (e) ct_add_count(ct_args(e), key, value);
  ct_emit(w, e);
}

cJSON *ct_instant(const char *name, int pid, int tid, double ts_us, char scope) {
  cJSON *e = ct_event("i", name, pid, tid, ts_us);
  char s[2] = {scope, 0};
  if (e) add(e, "s", cJSON_CreateString(s));
  return e;
}
