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
  w->buf = NULL;
  w->len = w->cap = 0;
  return rc;
}

cJSON *ct_event(const char *ph, const char *name, int pid, int tid, double ts_us) {
  cJSON *e = cJSON_CreateObject();
  if (!e) return NULL;
  cJSON_AddStringToObject(e, "ph", ph);
  if (name) cJSON_AddStringToObject(e, "name", name);
  cJSON_AddNumberToObject(e, "pid", pid);
  if (tid) cJSON_AddNumberToObject(e, "tid", tid);
  cJSON_AddNumberToObject(e, "ts", round(ts_us * 1000) / 1000);
  return e;
}

cJSON *ct_args(cJSON *e) {
  if (!e) return NULL;
  cJSON *a = cJSON_GetObjectItemCaseSensitive(e, "args");
  return a ? a : cJSON_AddObjectToObject(e, "args");
}

void ct_emit(ct_writer *w, cJSON *e) {
  if (!e) return;
  char *text = cJSON_PrintUnformatted(e);
  cJSON_Delete(e);
  if (!text) return;
  size_t n = strlen(text), need = w->len + n + 2;
  if (need > w->cap) {
    size_t ncap = w->cap ? w->cap : 4096;
    while (ncap < need) ncap *= 2;
    char *b = realloc(w->buf, ncap);
    if (!b) {
      free(text);
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
  free(text);
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
  cJSON_AddNumberToObject(e, "dur", round((dur_us > 0 ? dur_us : 0) * 1000) / 1000);
  if (cat) cJSON_AddStringToObject(e, "cat", cat);
  return e;
}

void ct_flow(ct_writer *w, int start, const char *name, double id, int pid, int tid,
             double ts_us) {
  cJSON *f = ct_event(start ? "s" : "f", name, pid, tid, ts_us);
  if (!f) return;
  cJSON_AddStringToObject(f, "cat", "flow");
  cJSON_AddNumberToObject(f, "id", id);
  if (!start) cJSON_AddStringToObject(f, "bp", "e");
  ct_emit(w, f);
}

void ct_counter(ct_writer *w, const char *name, int pid, double ts_us, const char *key,
                double value) {
  cJSON *e = ct_event("C", name, pid, 0, ts_us);
  if (e) cJSON_AddNumberToObject(ct_args(e), key, value);
  ct_emit(w, e);
}

cJSON *ct_instant(const char *name, int pid, int tid, double ts_us, char scope) {
  cJSON *e = ct_event("i", name, pid, tid, ts_us);
  char s[2] = {scope, 0};
  if (e) cJSON_AddStringToObject(e, "s", s);
  return e;
}
