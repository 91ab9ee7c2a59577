/*
 * cuda_double_runtime.c — the CUDA runtime entry points of the TEST DOUBLE
 * (cuda_double.c): devices, errors, host and device memory, streams,
 * copies and events.
 *
 * Included at the end of cuda_double.c, not compiled on its own: one
 * translation unit, so the double's state and helpers stay static.
 */
/* ---- devices --------------------------------------------------------------- */
cudaError_t CUDARTAPI cudaGetDeviceCount(int *count) {
  ENTER("cudaGetDeviceCount");
  if (!count) return leave(fail(cudaErrorInvalidValue));
  *count = g_device_count;
  if (g_device_count == 0) return leave(fail(cudaErrorNoDevice));
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaGetDevice(int *device) {
  ENTER("cudaGetDevice");
  if (!device) return leave(fail(cudaErrorInvalidValue));
  if (g_device_count == 0) return leave(fail(cudaErrorNoDevice));
  *device = t_device;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  ENTER("cudaSetDevice");
  if (device < 0 || device >= g_device_count)
    return leave(fail(cudaErrorInvalidDevice));
  t_device = device;
  g_primary[device] = 1;
  return leave(cudaSuccess);
}

/* The driver's cuDevicePrimaryCtxGetState over the double's state
 * (CUresult 0 = CUDA_SUCCESS, 101 = CUDA_ERROR_INVALID_DEVICE). */
static int double_primary_ctx_state(int device, unsigned int *flags, int *active) {
  lock();
  int ok = device >= 0 && device < g_device_count && flags && active;
  if (ok) {
    *flags = 0;
    *active = g_primary[device];
  }
  unlock();
  return ok ? 0 : 101;
}

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus) {
  ENTER("cudaGetDriverEntryPointByVersion");
  (void)cudaVersion;
  (void)flags;
  if (!symbol || !funcPtr) return leave(fail(cudaErrorInvalidValue));
  int found = strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0;
  *funcPtr = found ? (void *)double_primary_ctx_state : NULL;
  if (driverStatus) *driverStatus = found ? cudaDriverEntryPointSuccess
                                          : cudaDriverEntryPointSymbolNotFound;
  return leave(cudaSuccess);
}

int cuda_double_primary_context(int device) {
  unsigned int flags;
  int active = 0;
  return double_primary_ctx_state(device, &flags, &active) == 0 && active;
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr,
                                             int device) {
  ENTER("cudaDeviceGetAttribute");
  if (!value) return leave(fail(cudaErrorInvalidValue));
  if (device < 0 || device >= g_device_count)
    return leave(fail(cudaErrorInvalidDevice));
  if (attr != cudaDevAttrHostRegisterSupported)
    return leave(fail(cudaErrorInvalidValue)); /* not modeled */
  *value = g_register_supported;
  return leave(cudaSuccess);
}

/* ---- errors ---------------------------------------------------------------- */
cudaError_t CUDARTAPI cudaGetLastError(void) {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) { return t_last_error; }

/* The runtime's own texts for the codes the double produces or tests inject. */
static const struct {
  cudaError_t code;
  const char *name, *text;
} error_texts[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorDevicesUnavailable, "cudaErrorDevicesUnavailable",
     "CUDA-capable device(s) is/are busy or unavailable"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle",
     "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState",
     "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const char *CUDARTAPI cudaGetErrorString(cudaError_t error) {
  for (size_t i = 0; i < sizeof error_texts / sizeof error_texts[0]; i++)
    if (error_texts[i].code == error) return error_texts[i].text;
  return "unrecognized error code";
}

const char *CUDARTAPI cudaGetErrorName(cudaError_t error) {
  for (size_t i = 0; i < sizeof error_texts / sizeof error_texts[0]; i++)
    if (error_texts[i].code == error) return error_texts[i].name;
  return "cudaErrorUnknown";
}

/* ---- host memory ----------------------------------------------------------- */
static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

cudaError_t CUDARTAPI cudaHostAlloc(void **ptr, size_t size, unsigned int flags) {
  ENTER("cudaHostAlloc");
  if (!ptr || size == 0) return leave(fail(cudaErrorInvalidValue));
  *ptr = NULL;
  void *p = aligned_alloc(HOST_PAGE, round_up(size, HOST_PAGE));
  if (!p) return leave(fail(cudaErrorMemoryAllocation));
  if (!region_add(p, size, REG_HOSTALLOC)) {
    free(p);
    return leave(fail(cudaErrorMemoryAllocation));
  }
  *ptr = p;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaFreeHost(void *ptr) {
  ENTER("cudaFreeHost");
  if (!ptr) return leave(cudaSuccess);
  region *r = region_containing(ptr, 1, PINNED_KINDS);
  if (!r || r->base != ptr)
    return leave(violation(cudaErrorInvalidValue,
                           "cudaFreeHost(%p): not a block from cudaHostAlloc", ptr));
  if (r->kind == REG_REGISTERED)
    return leave(violation(cudaErrorInvalidValue,
                           "cudaFreeHost(%p): the range was registered with "
                           "cudaHostRegister; release it with cudaHostUnregister",
                           ptr));
  cudaError_t e = check_free_while_copying("cudaFreeHost", r);
  if (e != cudaSuccess) return leave(e);
  region_remove(r);
  free(ptr);
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
  ENTER("cudaHostRegister");
  if (!ptr || size == 0) return leave(fail(cudaErrorInvalidValue));
  if (region_overlapping(ptr, size, PINNED_KINDS))
    return leave(violation(cudaErrorHostMemoryAlreadyRegistered,
                           "cudaHostRegister(%p, %zu): part of the range is "
                           "already pinned",
                           ptr, size));
  if (region_overlapping(ptr, size, KIND_BIT(REG_DEVICE)))
    return leave(violation(cudaErrorInvalidValue,
                           "cudaHostRegister(%p, %zu): the range is device memory",
                           ptr, size));
  if (!region_add(ptr, size, REG_REGISTERED))
    return leave(fail(cudaErrorMemoryAllocation));
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaHostUnregister(void *ptr) {
  ENTER("cudaHostUnregister");
  region *r = ptr ? region_containing(ptr, 1, KIND_BIT(REG_REGISTERED)) : NULL;
  if (!r || r->base != ptr)
    return leave(violation(cudaErrorHostMemoryNotRegistered,
                           "cudaHostUnregister(%p): not the start of a range "
                           "registered with cudaHostRegister",
                           ptr));
  cudaError_t e = check_free_while_copying("cudaHostUnregister", r);
  if (e != cudaSuccess) return leave(e);
  region_remove(r);
  return leave(cudaSuccess);
}

/* ---- device memory --------------------------------------------------------- */
cudaError_t CUDARTAPI cudaMalloc(void **devPtr, size_t size) {
  ENTER("cudaMalloc");
  if (!devPtr) return leave(fail(cudaErrorInvalidValue));
  *devPtr = NULL;
  if (size == 0) return leave(cudaSuccess);
  g_primary[t_device] = 1;
  void *p = aligned_alloc(DEVICE_ALIGN, round_up(size, DEVICE_ALIGN));
  if (!p) return leave(fail(cudaErrorMemoryAllocation));
  memset(p, UNINITIALIZED_DEVICE_BYTE, round_up(size, DEVICE_ALIGN));
  if (!region_add(p, size, REG_DEVICE)) {
    free(p);
    return leave(fail(cudaErrorMemoryAllocation));
  }
  *devPtr = p;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaFree(void *devPtr) {
  ENTER("cudaFree");
  if (!devPtr) return leave(cudaSuccess);
  region *r = region_containing(devPtr, 1, KIND_BIT(REG_DEVICE));
  if (!r || r->base != devPtr)
    return leave(violation(cudaErrorInvalidValue,
                           "cudaFree(%p): not a block from cudaMalloc", devPtr));
  cudaError_t e = check_free_while_copying("cudaFree", r);
  if (e != cudaSuccess) return leave(e);
  region_remove(r);
  free(devPtr);
  return leave(cudaSuccess);
}

/* ---- streams --------------------------------------------------------------- */
cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t *pStream,
                                                unsigned int flags) {
  ENTER("cudaStreamCreateWithFlags");
  if (!pStream) return leave(fail(cudaErrorInvalidValue));
  *pStream = NULL;
  if (flags != cudaStreamNonBlocking)
    return leave(violation(cudaErrorInvalidValue,
                           "cudaStreamCreateWithFlags: flags 0x%x; ferry's streams "
                           "are cudaStreamNonBlocking (a blocking stream "
                           "serializes with the embedder's legacy default stream)",
                           flags));
  join_finished_streams();
  g_primary[t_device] = 1;
  struct CUstream_st *s = stream_new(t_device, 0);
  if (!s) return leave(fail(cudaErrorMemoryAllocation));
  *pStream = s;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  ENTER("cudaStreamDestroy");
  if (stream == NULL || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return leave(violation(cudaErrorInvalidResourceHandle,
                           "cudaStreamDestroy: a default stream cannot be destroyed"));
  struct CUstream_st *s;
  cudaError_t e = resolve_stream(stream, "cudaStreamDestroy", &s);
  if (e != cudaSuccess) return leave(e);
  /* Like CUDA: returns at once; the queued work still runs. */
  s->destroyed = 1;
  pthread_cond_signal(&s->work);
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                      enum cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER("cudaMemcpyAsync");
  struct CUstream_st *s;
  cudaError_t e = resolve_stream(stream, "cudaMemcpyAsync", &s);
  if (e != cudaSuccess) return leave(e);
  if (count == 0) return leave(cudaSuccess);
  if ((e = check_copy_sides("cudaMemcpyAsync", dst, src, count, kind, 1)) ||
      (e = check_unordered(s, "cudaMemcpyAsync", dst, src, count)))
    return leave(e);
  op *o = enqueue(s, OP_COPY);
  if (!o) return leave(fail(cudaErrorMemoryAllocation));
  o->dst = dst;
  o->src = src;
  o->bytes = count;
  o->delay_us = g_delay_us;
  return leave(cudaSuccess);
}

/* A host function in stream order (CUDA 10): it must not call CUDA. */
cudaError_t CUDARTAPI cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  ENTER("cudaLaunchHostFunc");
  struct CUstream_st *s;
  cudaError_t e = resolve_stream(stream, "cudaLaunchHostFunc", &s);
  if (e != cudaSuccess) return leave(e);
  if (!fn) return leave(fail(cudaErrorInvalidValue));
  op *o = enqueue(s, OP_HOST_FUNC);
  if (!o) return leave(fail(cudaErrorMemoryAllocation));
  o->fn = fn;
  o->fn_ud = userData;
  return leave(cudaSuccess);
}

static marker *marker_new(const struct CUstream_st *s) {
  marker *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->clock = malloc((size_t)s->clock_len * sizeof *m->clock);
  if (!m->clock) {
    free(m);
    return NULL;
  }
  memcpy(m->clock, s->clock, (size_t)s->clock_len * sizeof *m->clock);
  m->clock_len = s->clock_len;
  return m;
}

/* Queue a record of a new marker on s; the caller holds one reference. */
static marker *record_marker(struct CUstream_st *s) {
  marker *m = marker_new(s);
  if (!m) return NULL;
  op *o = enqueue(s, OP_RECORD);
  if (!o) {
    m->refs = 1;
    marker_release(m);
    return NULL;
  }
  m->clock[s->id] = o->seq; /* the record itself is part of what it covers */
  m->refs = 2;              /* the op's and the caller's */
  o->m = m;
  return m;
}

static void wait_marker(marker *m) {
  while (!m->done) pthread_cond_wait(&g_done, &g_lock);
}

cudaError_t CUDARTAPI cudaMemcpy(void *dst, const void *src, size_t count,
                                 enum cudaMemcpyKind kind) {
  ENTER("cudaMemcpy");
  struct CUstream_st *s = legacy_stream(t_device);
  if (!s) return leave(fail(cudaErrorMemoryAllocation));
  if (count == 0) return leave(cudaSuccess);
  cudaError_t e;
  if ((e = check_copy_sides("cudaMemcpy", dst, src, count, kind, 0)) ||
      (e = check_unordered(s, "cudaMemcpy", dst, src, count)))
    return leave(e);
  /* Synchronous, in the order of the legacy default stream: queued there
   * (after the waits queued before it), then waited for. On an idle stream
   * the calling thread moves the bytes itself, with the op at the head of
   * the queue so the stream's later work still comes after it. */
  int idle = s->head == NULL;
  op *o = enqueue(s, OP_COPY);
  if (!o) return leave(fail(cudaErrorMemoryAllocation));
  o->dst = dst;
  o->src = src;
  o->bytes = count;
  if (idle) {
    o->by_caller = 1;
    unlock();
    memcpy(dst, src, count);
    lock();
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    free(o);
    pthread_cond_broadcast(&g_done);
    return leave(cudaSuccess);
  }
  marker *m = record_marker(s);
  if (!m) return leave(fail(cudaErrorMemoryAllocation));
  wait_marker(m);
  marker_release(m);
  return leave(cudaSuccess);
}

/* ---- events ---------------------------------------------------------------- */
cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  ENTER("cudaEventCreateWithFlags");
  if (!event) return leave(fail(cudaErrorInvalidValue));
  *event = NULL;
  if (!(flags & cudaEventDisableTiming))
    return leave(violation(cudaErrorInvalidValue,
                           "cudaEventCreateWithFlags: flags 0x%x; ferry's events "
                           "are cudaEventDisableTiming (timing costs and is never "
                           "read)",
                           flags));
  g_primary[t_device] = 1;
  struct CUevent_st *ev = calloc(1, sizeof *ev);
  if (!ev || !handle_add(ev, H_EVENT)) {
    free(ev);
    return leave(fail(cudaErrorMemoryAllocation));
  }
  ev->device = t_device;
  ev->next_all = g_events;
  g_events = ev;
  *event = ev;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  ENTER("cudaEventDestroy");
  cudaError_t e = resolve_event(event, "cudaEventDestroy");
  if (e != cudaSuccess) return leave(e);
  event->destroyed = 1;
  marker_release(event->latest);
  event->latest = NULL;
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  ENTER("cudaEventRecord");
  struct CUstream_st *s;
  cudaError_t e = resolve_event(event, "cudaEventRecord");
  if (e != cudaSuccess || (e = resolve_stream(stream, "cudaEventRecord", &s)))
    return leave(e);
  if (event->device != s->device)
    return leave(violation(cudaErrorInvalidResourceHandle,
                           "cudaEventRecord: event of device %d recorded on "
                           "stream #%d of device %d",
                           event->device, s->id, s->device));
  marker *m = record_marker(s);
  if (!m) return leave(fail(cudaErrorMemoryAllocation));
  marker_release(event->latest);
  event->latest = m; /* re-arms: queries now see this record only */
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  ENTER("cudaEventQuery");
  cudaError_t e = resolve_event(event, "cudaEventQuery");
  if (e != cudaSuccess) return leave(e);
  if (event->latest && !event->latest->done) return leave(fail(cudaErrorNotReady));
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  ENTER("cudaEventSynchronize");
  cudaError_t e = resolve_event(event, "cudaEventSynchronize");
  if (e != cudaSuccess) return leave(e);
  marker *m = event->latest;
  if (m) {
    m->refs++;
    wait_marker(m);
    marker_release(m);
  }
  return leave(cudaSuccess);
}

cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                          unsigned int flags) {
  ENTER("cudaStreamWaitEvent");
  struct CUstream_st *s;
  cudaError_t e = resolve_event(event, "cudaStreamWaitEvent");
  if (e != cudaSuccess || (e = resolve_stream(stream, "cudaStreamWaitEvent", &s)))
    return leave(e);
  if (flags != 0)
    return leave(violation(cudaErrorInvalidValue,
                           "cudaStreamWaitEvent: flags 0x%x (ferry waits with 0)",
                           flags));
  marker *m = event->latest;
  if (!m)
    return leave(violation(cudaErrorIllegalState,
                           "cudaStreamWaitEvent: event %p was never recorded "
                           "(CUDA makes this a no-op; in ferry it is a wait on a "
                           "copy that was never issued)",
                           (void *)event));
  if (!clock_grow(&s->clock, &s->clock_len, m->clock_len))
    return leave(fail(cudaErrorMemoryAllocation));
  op *o = enqueue(s, OP_WAIT);
  if (!o) return leave(fail(cudaErrorMemoryAllocation));
  m->refs++;
  o->m = m;
  /* Everything queued on s from now on is ordered after the record. */
  for (int i = 0; i < m->clock_len; i++)
    if (m->clock[i] > s->clock[i] && i != s->id) s->clock[i] = m->clock[i];
  return leave(cudaSuccess);
}
