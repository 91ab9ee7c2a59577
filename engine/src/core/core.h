/*
 * core.h — what the rooms above the engine core (sim/, checkpoint/) may use
 * of an engine. They never read struct ferry_engine (core-private, in
 * engine_internal.h): the parts below are fixed once the engine is created.
 */
#ifndef FERRY_CORE_H
#define FERRY_CORE_H

#include "ferry_tools.h"
#include "ferry.h"

int engine_check(ferry_engine *e); /* FERRY_OK if e is a live engine */
/* Records the detailed message of ferry_last_error; returns code. Call with
 * the engine lock held. */
int engine_fail(ferry_engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void engine_lock(ferry_engine *e);
void engine_unlock(ferry_engine *e);

ferry_backend *engine_backend(ferry_engine *e);
ferry_arena *engine_arena(ferry_engine *e);
int engine_backend_kind(ferry_engine *e); /* the config's FERRY_BACKEND_* */
bk_stream engine_d2h_stream(ferry_engine *e);
bk_stream engine_h2d_stream(ferry_engine *e);
/* The engine's counters (ferry_get_stats copies them); under the lock. */
ferry_stats *engine_stats(ferry_engine *e);
/* Recorded on a compute stream and waited on at once; under the lock. */
bk_event *engine_scratch_event(ferry_engine *e);
/* The engine's pool of events; under the lock. */
int event_get(ferry_engine *e, bk_event **out);
void event_put(ferry_engine *e, bk_event *ev);

/* A room that keeps per-engine state registers a shutdown hook: hooks run
 * first in ferry_engine_destroy, newest first, without the lock. ud is the
 * room's state, found again with engine_shutdown_data. Under the lock. */
typedef void (*engine_shutdown_fn)(ferry_engine *e, void *ud);
int engine_on_shutdown(ferry_engine *e, engine_shutdown_fn fn, void *ud);
void *engine_shutdown_data(ferry_engine *e, engine_shutdown_fn fn);

#endif
