/*
 * cuda_double_control.c — the TEST DOUBLE's own API (cuda_double.h):
 * violations, reset, the knobs, injected failures, call counts, leak
 * checks and the exit check.
 *
 * Included at the end of cuda_double.c, not compiled on its own: one
 * translation unit, so the double's state and helpers stay static.
 */
/* ---- the double's own API -------------------------------------------------- */
long cuda_double_violations(void) {
  lock();
  long n = g_violations;
  unlock();
  return n;
}

const char *cuda_double_last_violation(void) {
  static _Thread_local char copy[sizeof g_last_violation];
  lock();
  memcpy(copy, g_last_violation, sizeof copy);
  unlock();
  return copy;
}

void cuda_double_clear_violations(void) {
  lock();
  g_violations = 0;
  g_last_violation[0] = '\0';
  unlock();
}

void cuda_double_reset(void) {
  pthread_once(&g_once, init_once);
  lock();
  g_no_driver = 0;
  g_device_count = 1;
  memset(g_primary, 0, sizeof g_primary);
  g_register_supported = 1;
  g_delay_us = g_default_delay_us;
  g_paused = 0;
  memset(g_inject, 0, sizeof g_inject);
  wake_all();
  unlock();
  t_device = 0;
  t_last_error = cudaSuccess;
}

void cuda_double_set_no_driver(int on) {
  lock();
  g_no_driver = on;
  unlock();
}

void cuda_double_set_device_count(int n) {
  lock();
  g_device_count = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
  unlock();
}

void cuda_double_set_host_register_supported(int on) {
  lock();
  g_register_supported = on;
  unlock();
}

void cuda_double_set_copy_delay_us(unsigned us) {
  lock();
  g_delay_us = us;
  unlock();
}

void cuda_double_pause_streams(int paused) {
  lock();
  g_paused = paused;
  wake_all();
  unlock();
}

void cuda_double_drain(void) {
  lock();
  for (;;) {
    int busy = 0;
    for (struct CUstream_st *s = g_streams; s && !busy; s = s->next_all)
      busy = s->head != NULL;
    if (!busy) break;
    pthread_cond_wait(&g_done, &g_lock);
  }
  unlock();
}

void cuda_double_fail_call(const char *entry_point, int nth, cudaError_t err) {
  lock();
  for (int i = 0; i < MAX_INJECTIONS; i++)
    if (g_inject[i].countdown <= 0) {
      snprintf(g_inject[i].name, sizeof g_inject[i].name, "%s", entry_point);
      g_inject[i].countdown = nth < 1 ? 1 : nth;
      g_inject[i].err = err;
      break;
    }
  unlock();
}

long cuda_double_calls(const char *entry_point) {
  long n = 0;
  lock();
  for (int i = 0; i < MAX_COUNTED_CALLS && g_calls[i].name; i++)
    if (strcmp(g_calls[i].name, entry_point) == 0) n = g_calls[i].count;
  unlock();
  return n;
}

int cuda_double_stream_device(cudaStream_t h) {
  int device = -1;
  lock();
  if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread)
    device = t_device;
  else if (handle_known(h, H_STREAM) && !h->destroyed)
    device = h->device;
  unlock();
  return device;
}

int cuda_double_event_device(cudaEvent_t h) {
  int device = -1;
  lock();
  if (h && handle_known(h, H_EVENT) && !h->destroyed) device = h->device;
  unlock();
  return device;
}

void cuda_double_get_counts(cuda_double_counts *out) {
  memset(out, 0, sizeof *out);
  lock();
  for (struct CUstream_st *s = g_streams; s; s = s->next_all) {
    if (!s->internal && !s->destroyed) out->streams++;
    for (op *o = s->head; o; o = o->next) out->ops_queued++;
  }
  for (struct CUevent_st *e = g_events; e; e = e->next_all)
    if (!e->destroyed) out->events++;
  for (region *r = g_regions; r; r = r->next) {
    if (r->kind == REG_DEVICE) {
      out->device_blocks++;
      out->device_bytes += r->size;
    } else {
      out->pinned_blocks++;
      out->pinned_bytes += r->size;
      if (r->kind == REG_REGISTERED)
        out->registered_ranges++;
      else
        out->hostalloc_blocks++;
    }
  }
  unlock();
}

/* Rule 12: record a violation for each stream, event and pinned range still
 * held. Does not fail a call; the exit handler runs it. */
void cuda_double_check_leaks(void) {
  lock();
  for (struct CUstream_st *s = g_streams; s; s = s->next_all)
    if (!s->internal && !s->destroyed)
      violation(cudaSuccess, "stream #%d was never destroyed", s->id);
  for (struct CUevent_st *e = g_events; e; e = e->next_all)
    if (!e->destroyed) violation(cudaSuccess, "event %p was never destroyed", (void *)e);
  for (region *r = g_regions; r; r = r->next)
    if (r->kind != REG_DEVICE)
      violation(cudaSuccess, "pinned host memory %p (%zu bytes, %s) was never released",
                (void *)r->base, r->size,
                r->kind == REG_REGISTERED ? "cudaHostRegister" : "cudaHostAlloc");
  unlock();
}

/* Stop the workers, report what was never released, and make the process
 * fail if violations were left uncleared. */
static void at_exit(void) {
  lock();
  g_shutdown = 1;
  g_paused = 0;
  wake_all();
  unlock();
  for (struct CUstream_st *s = g_streams; s; s = s->next_all) {
    if (s->joined) continue;
    pthread_join(s->thread, NULL);
    s->joined = 1;
  }
  cuda_double_check_leaks();
  lock();
  long n = g_violations;
  unlock();
  if (n > 0) {
    fflush(stdout);
    fprintf(stderr,
            "cuda double: %ld rule violation(s) not cleared by a test; the last: %s\n",
            n, g_last_violation);
    fflush(stderr);
    _exit(1);
  }
}
