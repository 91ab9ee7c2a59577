/* backend_internal.h — what the backends (host, cuda, sim) share. Private
 * to engine/src/backend/. */
#ifndef FERRY_BACKEND_INTERNAL_H
#define FERRY_BACKEND_INTERNAL_H

#include <stdbool.h>

#include "ferry_tools.h"

/* ferry_backend_thread_runs_waited_copies(0) was called on this thread. */
extern _Thread_local bool backend_thread_waits_only;

/* Writes the message into b->err and returns code. */
int backend_fail(ferry_backend *b, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
