/* chrome_trace.h — the Chrome trace-event writer (Perfetto, chrome://tracing)
 * that `ferry sim --chrome-trace` and real runs (ferry_config.
 * chrome_trace_path) share: the object form
 *   {"displayTimeUnit":"ms","traceEvents":[ ...events... ]}
 * with every event built as a cJSON object and appended. Times are in µs.
 * After each ct_flush the file is valid JSON: the closing "]}" follows the
 * events written so far and the next flush writes over it, so a process that
 * dies or never closes the writer leaves a trace that loads up to its last
 * flush (a pipe or other non-seekable file gets the closing only at
 * ct_close). Not thread-safe: a caller with several threads locks. */
#ifndef FERRY_CHROME_TRACE_H
#define FERRY_CHROME_TRACE_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ct_writer {
  int fd;              /* -1 when closed */
  int seekable;        /* regular file: the trailer is rewritten at each flush */
  int error;           /* errno of the first failed write, 0 if none */
  int pid;             /* the process that opened it: a forked child writes nothing */
  uint64_t off;        /* file offset of the next event (the trailer's) */
  char *buf;           /* events not yet written */
  size_t len, cap;
  uint64_t events;     /* events appended, ever */
  size_t flush_bytes;  /* ct_emit flushes once buf holds this much */
  char *scratch;       /* one event printed */
  size_t scratch_len;
} ct_writer;

/* Creates (truncates) path and writes the header. 0, or -1 with a message. */
int ct_open(ct_writer *w, const char *path, char *err, size_t errlen);
/* Writes what is buffered and the closing; 0, or -1 with a message naming
 * the file's first write error (err may be NULL). */
int ct_flush(ct_writer *w, char *err, size_t errlen);
/* Flushes, closes and frees; 0, or -1 with a message. Safe on a writer
 * that failed to open or is closed. */
int ct_close(ct_writer *w, char *err, size_t errlen);

/* A new event (not yet appended): ph, name (NULL: none), pid, tid (0: none),
 * ts in µs, rounded to the ns. NULL when out of memory. */
cJSON *ct_event(const char *ph, const char *name, int pid, int tid, double ts_us);
/* Numbers, the same values cJSON_AddNumberToObject writes, printed without
 * its sprintf/sscanf round trip: a time in µs to the ns (rounded), a count
 * (a whole number; any other value goes to cJSON). o may be NULL; key is
 * a string constant (not copied). */
void ct_add_us(cJSON *o, const char *key, double us);
void ct_add_count(cJSON *o, const char *key, double v);
/* A string member (value copied; key a constant, as above). */
void ct_add_str(cJSON *o, const char *key, const char *value);
/* The event's "args" object, added when missing (NULL if e is NULL). */
cJSON *ct_args(cJSON *e);
/* Appends e and frees it (NULL: nothing). */
void ct_emit(ct_writer *w, cJSON *e);

/* Metadata: a process's name and sort position; a lane's (thread's) name and
 * sort position (sort < 0: none). */
void ct_process(ct_writer *w, int pid, const char *name, int sort);
void ct_thread(ct_writer *w, int pid, int tid, const char *name, int sort);
/* The D2H copies' lane when reloads ran on it too (the one_copy_stream
 * knob: one side stream carries both directions), in both writers. */
#define CT_LANE_ONE_STREAM "copies (one stream)"
/* A complete slice ("X") of dur µs in category cat (NULL: none); append it
 * with ct_emit after adding its args. */
cJSON *ct_slice(const char *name, const char *cat, int pid, int tid, double ts_us,
                double dur_us);
/* One end of a flow arrow (category "flow"): start = 1 at the source slice
 * ("s"), 0 at the destination ("f", bound to the enclosing slice: "bp":"e").
 * Both ends share name and id, and sit at a slice's start on its lane. */
void ct_flow(ct_writer *w, int start, const char *name, double id, int pid, int tid,
             double ts_us);
/* A counter ("C") sample: series key = value on the process's track name. */
void ct_counter(ct_writer *w, const char *name, int pid, double ts_us, const char *key,
                double value);
/* An instant ("i"); scope 'p' (process), 't' (thread) or 'g' (global).
 * Returns it for args, to be appended with ct_emit. */
cJSON *ct_instant(const char *name, int pid, int tid, double ts_us, char scope);

#endif
