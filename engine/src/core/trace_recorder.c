/*
 * trace_recorder.c — writes the JSONL trace of docs/trace-format.md: one
 * object per line for every pack, unpack, discard, step and backward
 * boundary, with the descriptor, the decision and a timestamp. The simulator
 * replays it. Written with cJSON; an observer of the stash
 * (engine_internal.h), called with the engine lock held.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine_internal.h"
#include "util/util.h"
#include "ferry_tools.h"

#define TRACE_FORMAT_VERSION 1

typedef struct jsonl_trace {
  FILE *f;
  double t0_us;
  double flops; /* FLOPs since the last traced event (ferry_trace_flops) */
  int flops_all; /* every traced event carries "flops" (ferry_trace_flops_all) */
} jsonl_trace;

static void emit(jsonl_trace *tr, cJSON *o) {
  char *line = cJSON_PrintUnformatted(o);
  if (line) {
    fputs(line, tr->f);
    fputc('\n', tr->f);
    free(line);
  }
  cJSON_Delete(o);
}

/* An event object with its time; with_flops: it also carries the FLOPs
 * added since the last event that did ("flops"), when there are some or
 * the trainer counts all its compute (ferry_trace_flops_all). */
static cJSON *event_object_of(jsonl_trace *tr, const char *ev, int with_flops) {
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  cJSON_AddStringToObject(o, "ev", ev);
  /* microseconds since the trace opened, 0.1 us resolution */
  double t = util_now_us() - tr->t0_us;
  cJSON_AddNumberToObject(o, "t_us", (double)(long long)(t * 10.0) / 10.0);
  if (with_flops && (tr->flops > 0 || tr->flops_all)) {
    cJSON_AddNumberToObject(o, "flops", tr->flops);
    tr->flops = 0;
  }
  return o;
}

static cJSON *event_object(jsonl_trace *tr, const char *ev) {
  return event_object_of(tr, ev, 1);
}

static void trace_close(void *self, ferry_engine *e) {
  (void)e;
  jsonl_trace *tr = self;
  fclose(tr->f);
  free(tr);
}

static void trace_on(void *self, ferry_engine *e, const obs_event *ev);

int trace_open(ferry_engine *e, const char *path) {
  jsonl_trace *tr = calloc(1, sizeof *tr);
  if (!tr) return engine_fail(e, FERRY_ENOMEM, "out of memory opening the trace");
  tr->f = fopen(path, "w");
  if (!tr->f) {
    free(tr);
    return engine_fail(e, FERRY_EIO, "cannot open trace file %s: %s", path, strerror(errno));
  }
  if (engine_observe(e, trace_on, trace_close, tr, OBS_NUMBERS)) {
    trace_close(tr, e);
    return engine_fail(e, FERRY_ENOMEM, "out of memory opening the trace");
  }
  setvbuf(tr->f, NULL, _IOFBF, 1 << 20);
  tr->t0_us = util_now_us();
  cJSON *o = event_object(tr, "header");
  if (!o) return FERRY_ENOMEM;
  cJSON_AddStringToObject(o, "format", "ferry-trace");
  cJSON_AddNumberToObject(o, "version", TRACE_FORMAT_VERSION);
  cJSON_AddStringToObject(o, "ferry", ferry_version_string());
  cJSON_AddStringToObject(o, "backend", e->bk->ops->name);
  emit(tr, o);
  return FERRY_OK;
}

static void trace_pack(jsonl_trace *tr, ferry_engine *e, uint32_t idx,
                       const ferry_tensor_desc *d, int decision, int aliased) {
  uint64_t id = e->cold[idx].trace_id; /* numbered by the stash */
  cJSON *o = event_object(tr, "pack");
  if (!o) return;
  cJSON_AddNumberToObject(o, "id", (double)id);
  cJSON_AddNumberToObject(o, "step", (double)e->step);
  cJSON_AddNumberToObject(o, "bytes", (double)d->bytes);
  cJSON_AddStringToObject(o, "dtype", ferry_dtype_name(d->dtype));
  cJSON *shape = cJSON_AddArrayToObject(o, "shape");
  for (int i = 0; shape && i < d->ndim; i++)
    cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)d->shape[i]));
  cJSON_AddStringToObject(o, "kind", ferry_kind_name(d->kind));
  cJSON_AddStringToObject(o, "phase", ferry_phase_name(d->phase));
  cJSON_AddNumberToObject(o, "layer", d->layer);
  cJSON_AddNumberToObject(o, "layers", d->layer_count);
  if (d->flags) cJSON_AddNumberToObject(o, "flags", d->flags);
  if (d->module_path) cJSON_AddStringToObject(o, "module", d->module_path);
  if (d->module_class) cJSON_AddStringToObject(o, "class", d->module_class);
  cJSON_AddStringToObject(o, "decision", decision == FERRY_OFFLOAD ? "offload" : "keep");
  if (aliased) {
    cJSON_AddBoolToObject(o, "alias", 1);
    uint64_t primary_id = e->cold[e->entries[idx].primary].trace_id;
    if (primary_id) cJSON_AddNumberToObject(o, "alias_of", (double)primary_id);
  }
  emit(tr, o);
}

static void trace_event(jsonl_trace *tr, ferry_engine *e, const char *ev, uint64_t id,
                        int with_step) {
  cJSON *o = event_object(tr, ev);
  if (!o) return;
  if (id) cJSON_AddNumberToObject(o, "id", (double)id);
  if (with_step) cJSON_AddNumberToObject(o, "step", (double)e->step);
  emit(tr, o);
}

static void trace_on(void *self, ferry_engine *e, const obs_event *ev) {
  jsonl_trace *tr = self;
  switch (ev->kind) {
  case OBS_STEP_BEGIN: trace_event(tr, e, "step_begin", 0, 1); break;
  case OBS_STEP_END: trace_event(tr, e, "step_end", 0, 1); break;
  case OBS_PHASE: trace_event(tr, e, ev->what, 0, 0); break;
  case OBS_UNPACK: trace_event(tr, e, "unpack", ev->id, 0); break;
  case OBS_DISCARD: trace_event(tr, e, "discard", ev->id, 0); break;
  case OBS_PACK:
    trace_pack(tr, e, ev->idx, ev->desc,
               ev->entry->state == ENTRY_KEPT ? FERRY_KEEP : FERRY_OFFLOAD, ev->aliased);
    break;
  default: break;
  }
}

int ferry_trace_resident(ferry_engine *e, const char *what, uint64_t bytes) {
  int rc = engine_check(e);
  if (rc) return rc;
  /* the message is written under the lock: ferry_last_error reads it so */
  pthread_mutex_lock(&e->lock);
  if (!what || !*what) {
    rc = engine_fail(e, FERRY_EINVAL, "ferry_trace_resident: empty what");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  jsonl_trace *tr = engine_observer(e, trace_on);
  if (tr && e->in_step) {
    rc = engine_fail(e, FERRY_ESTATE, "ferry_trace_resident: inside a step (declare resident "
                                      "memory before the first step)");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  /* between steps: no compute of its own, the FLOPs wait for the next event */
  cJSON *o = tr ? event_object_of(tr, "resident", 0) : NULL;
  if (o) {
    cJSON_AddNumberToObject(o, "bytes", (double)bytes);
    cJSON_AddStringToObject(o, "what", what);
    emit(tr, o);
  }
  pthread_mutex_unlock(&e->lock);
  return FERRY_OK;
}

int ferry_trace_device_peak(ferry_engine *e, uint64_t bytes) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  if (bytes > (1ull << 50)) { /* the bound of a tensor's bytes (stash.c) */
    rc = engine_fail(e, FERRY_EINVAL, "ferry_trace_device_peak: %llu bytes is absurd (max 2^50)",
                     (unsigned long long)bytes);
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  jsonl_trace *tr = engine_observer(e, trace_on);
  if (tr && e->in_step) {
    rc = engine_fail(e, FERRY_ESTATE, "ferry_trace_device_peak: inside a step (give the "
                                      "step's peak after ferry_step_end)");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  cJSON *o = tr ? event_object_of(tr, "device_peak", 0) : NULL;
  if (o) {
    cJSON_AddNumberToObject(o, "step", (double)e->step);
    cJSON_AddNumberToObject(o, "bytes", (double)bytes);
    emit(tr, o);
  }
  pthread_mutex_unlock(&e->lock);
  return FERRY_OK;
}

int ferry_trace_flops(ferry_engine *e, double flops) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  if (!(flops >= 0) || !(flops <= 1e21)) {
    rc = engine_fail(e, FERRY_EINVAL, "ferry_trace_flops: %g is not within [0, 1e21]", flops);
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  jsonl_trace *tr = engine_observer(e, trace_on);
  if (tr) tr->flops += flops;
  pthread_mutex_unlock(&e->lock);
  return FERRY_OK;
}

int ferry_trace_flops_all(ferry_engine *e, int on) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  jsonl_trace *tr = engine_observer(e, trace_on);
  if (tr) tr->flops_all = on != 0;
  pthread_mutex_unlock(&e->lock);
  return FERRY_OK;
}
