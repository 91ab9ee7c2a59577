/*
 * trace_reader_internal.h — the trace reader's state, shared by what reads
 * the lines (trace_reader.c) and what brings the bytes (trace_load.c).
 */
#ifndef FERRY_TRACE_READER_INTERNAL_H
#define FERRY_TRACE_READER_INTERNAL_H

#include <cjson/cJSON.h>
#include <errno.h>
#include <unistd.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/json_line.h"
#include "util/errbuf.h"
#include "ferry_tools.h"
#include "core/core.h"
#include "util/intern.h"
#include "util/u64map.h"
#include "util/util.h"

#define MAX_TENSOR_BYTES (1ull << 50) /* the engine's own bound (stash.c) */
#define MAX_LAYERS 1000000
#define MAX_COMPUTE_US 3.6e9 /* an hour of compute in one event is a broken trace */
#define MAX_ID 9007199254740992.0 /* 2^53: ids and steps are exact in a double */

enum { TS_PACKED = 1, TS_DONE = 2 };

/* A string the reader owns, found again by its bytes (trace_strings.c). */
#define READER_STR_SLOTS 1024
typedef struct reader_str_slot {
  const char *owned; /* NULL: empty */
  uint32_t len;
} reader_str_slot;

/* The last text given for one member (dtype, kind, phase) and its code. */
typedef struct reader_name_memo {
  char text[16];
  uint32_t len; /* 0 with no text yet: no name is empty */
  int code;
} reader_name_memo;

typedef struct reader {
  const char *name;
  sim_trace *t;
  char *err;
  size_t errlen;
  uint32_t line;
  u64map ids; /* trace id -> tensor index, for ids past by_id */
  uint32_t *by_id; /* id -> tensor index + 1 (0: none), for small ids */
  size_t cap_by_id;
  intern_table strs; /* owned strings, deduplicated */
  uint8_t *state; /* per tensor: TS_* */
  u64map alloc_ids;    /* alloc id -> index into t->allocs */
  u64map coll_ids;     /* collective id -> index into t->collectives */
  uint32_t cap_colls;
  uint32_t step_first_coll; /* the open step's first collective */
  uint8_t *alloc_live; /* per alloc: not freed yet */
  uint32_t cap_events, cap_tensors, cap_steps, cap_resident, cap_allocs;
  uint32_t live_allocs; /* allocs of the open step not freed yet */
  int seen_header;
  double flops; /* the current line's "flops", -1 if none */
  int in_step, in_backward;
  uint64_t step_number;
  uint32_t step_first;
  uint32_t live_in_step;
  double last_t; /* t_us of the previous line */
  int has_gap;   /* t_us moved at least once */
  int max_depth; /* deepest nesting a line may have */
  size_t max_line; /* longest line, in bytes */
  json_fast fast;  /* the first path (json_line_fast.c) */
  json_simd *simd; /* the second; NULL: cJSON reads what the first passes on */
  json_line obj;   /* the line being read */
  reader_str_slot str_slots[READER_STR_SLOTS];
  reader_name_memo dtype_memo, kind_memo, phase_memo;
} reader;


/* Writes "name:line: message" into the caller's buffer; FERRY_EPARSE. */
int reader_fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A reader of a trace named name (in messages) within lim; FERRY_OK, or
 * FERRY_ENOMEM with the message in err. */
int reader_start(reader *r, const char *name, const sim_trace_limits *lim, char *err,
                 size_t errlen);
/* Sizes r's tables for a trace of about len bytes (a hint: without it the
 * arrays grow as needed). */
void reader_reserve(reader *r, uint64_t len);
/* The complete lines in data[0, len) in turn (blank ones skipped); the
 * buffer stays readable up to end, which lets simdjson read past a line. */
int reader_parse_lines(reader *r, const char *data, size_t len, const char *end);
/* Ends the reader: the trace in *out on success (rc 0), else freed. */
int reader_done(reader *r, int rc, sim_trace **out);
/* The owned copy of string v (interned in r->strs); NULL out of memory. */
const char *reader_own(reader *r, const json_value *v);
/* parse(v->str), or the code it gave for the same text last time. */
int reader_name_code(reader_name_memo *m, const json_value *v, int (*parse)(const char *));
/* sim_bands.c: the run a header line of n bytes describes (its "seq",
 * "cp", "shard", "tp", "checkpoint_impl") into t->run_*; what it lacks or
 * cannot be read stays 0. */
void sim_trace_read_run(sim_trace *t, const char *line, size_t n);

#endif
