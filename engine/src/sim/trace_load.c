/*
 * trace_load.c — where a trace's bytes come from: a string (sim_trace_parse)
 * or a file read a buffer at a time (sim_trace_load), handed to the reader
 * (trace_reader.c) line by line.
 */
#include "sim/trace_reader_internal.h"

int sim_trace_parse(const char *name, const char *data, size_t len, sim_trace **out, char *err,
                    size_t errlen) {
  sim_trace_limits lim = SIM_TRACE_LIMITS_DEFAULT;
  *out = NULL;
  reader r;
  int rc = reader_start(&r, name, &lim, err, errlen);
  if (rc) return rc;
  if (!data || len == 0) rc = reader_fail(&r, "empty trace (no header line)");
  else {
    reader_reserve(&r, len);
    rc = reader_parse_lines(&r, data, len, data + len);
  }
  return reader_done(&r, rc, out);
}

/* Reads a whole trace file (at most 16 GiB) and parses it. */
/* Opens path for reading without blocking on a FIFO that has no writer (it
 * then reads as empty) and refuses a directory. -1 with err written. */
static int open_trace(const char *path, char *err, size_t errlen) {
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (err && errlen) snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    if (err && errlen)
      snprintf(err, errlen, "%s: %s", path, S_ISDIR(st.st_mode) ? "is a directory, not a trace"
                                                                 : strerror(errno));
    close(fd);
    return -1;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK); /* a writer's data: wait for it */
  return fd;
}

/* The 1-based line of data[at] (data: the unread lines, after line done). */
static uint32_t line_at(const char *data, size_t at, uint32_t done) {
  uint32_t line = done + 1;
  for (const char *p = data; (p = memchr(p, '\n', (size_t)(data + at - p))); p++) line++;
  return line;
}

/* Reads the file through a buffer of a few MiB, parsing its complete lines
 * as they come: memory stays bounded by the longest line whatever the file
 * (a FIFO fed forever, /dev/zero), and a NUL byte or an endless line fails
 * on the chunk that shows it. */
static int load_lines(reader *r, int fd, const sim_trace_limits *lim) {
  size_t cap = lim->max_line_bytes + 1 > (4u << 20) ? lim->max_line_bytes + 1 : (4u << 20);
  /* zeroed, with the padding simdjson reads past a line's end */
  char *buf = calloc(1, cap + JSON_LINE_PADDING);
  if (!buf) return reader_fail(r, "out of memory");
  size_t have = 0; /* unparsed bytes at buf: the start of a line */
  uint64_t total = 0;
  int rc = 0;
  while (!rc) {
    ssize_t got = read(fd, buf + have, cap - have);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      rc = reader_fail(r, "read error: %s", strerror(errno));
      rc = FERRY_EIO;
      break;
    }
    if (got == 0) break;
    total += (uint64_t)got;
    if (total > lim->max_file_bytes) {
      rc = reader_fail(r, "larger than %llu bytes", (unsigned long long)lim->max_file_bytes);
      break;
    }
    const char *nul = memchr(buf + have, 0, (size_t)got);
    have += (size_t)got;
    if (nul) {
      r->line = line_at(buf, (size_t)(nul - buf), r->line);
      rc = reader_fail(r, "a NUL byte: not a JSON-lines trace (a binary file?)");
      break;
    }
    const char *last = memrchr(buf, '\n', have);
    size_t complete = last ? (size_t)(last - buf) + 1 : 0;
    if (have - complete > lim->max_line_bytes) {
      r->line = line_at(buf, complete, r->line);
      rc = reader_fail(r, "a line longer than %zu bytes (no trace line is; --max-line)",
                       lim->max_line_bytes);
      break;
    }
    if (!complete) continue;
    rc = reader_parse_lines(r, buf, complete, buf + cap + JSON_LINE_PADDING);
    memmove(buf, buf + complete, have - complete);
    have -= complete;
  }
  if (!rc && have) {
    r->line++;
    rc = reader_fail(r, "truncated: the last line has no newline");
  } else if (!rc && !total) {
    rc = reader_fail(r, "empty trace (no header line)");
  }
  free(buf);
  return rc;
}

int sim_trace_load_limited(const char *path, const sim_trace_limits *limits, sim_trace **out,
                           char *err, size_t errlen) {
  *out = NULL;
  sim_trace_limits lim = SIM_TRACE_LIMITS_DEFAULT;
  if (limits) lim = *limits;
  int fd = open_trace(path, err, errlen);
  if (fd < 0) return FERRY_EIO;
  reader r;
  int rc = reader_start(&r, path, &lim, err, errlen);
  struct stat st;
  if (!rc && fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) reader_reserve(&r, (uint64_t)st.st_size);
  if (!rc) rc = reader_done(&r, load_lines(&r, fd, &lim), out);
  close(fd);
  return rc;
}

int sim_trace_load(const char *path, sim_trace **out, char *err, size_t errlen) {
  return sim_trace_load_limited(path, NULL, out, err, errlen);
}
