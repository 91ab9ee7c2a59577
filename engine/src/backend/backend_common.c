/* backend_common.c — helpers every backend uses (backend_internal.h). */
#include "backend/backend_internal.h"

#include <stdarg.h>
#include <stdio.h>

int backend_fail(ferry_backend *b, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b->err, sizeof b->err, fmt, ap);
  va_end(ap);
  return code;
}

_Thread_local bool backend_thread_waits_only;

void ferry_backend_thread_runs_waited_copies(int yes) { backend_thread_waits_only = !yes; }
