/* test_cuda_double.c — only in ferry_tests_cuda_double:
 *   - each rule of the CUDA test double is enforced: a deliberate violation
 *     fails the call and is counted (cuda_double.h lists the rules);
 *   - the cuda backend over the double: error mapping and clearing under
 *     injected failures, the engine's device versus the thread's, the two
 *     ways of pinning, and a whole engine round trip with no violation.
 * Tests that violate on purpose clear the count before returning: an
 * uncleared violation fails the process at exit. */
#include <pthread.h>
#include <stdint.h>

#include "ferry_tools.h"
#include "cuda_double.h"
#include "test.h"
#include "test_device.h"

/* Expect the last call to have been refused as a violation mentioning needle. */
#define CHECK_VIOLATION(expr, code, needle)                                 \
  do {                                                                      \
    long before_ = cuda_double_violations();                                \
    CHECK_EQ((expr), (code));                                               \
    CHECK_EQ(cuda_double_violations(), before_ + 1);                        \
    CHECK_STR_CONTAINS(cuda_double_last_violation(), (needle));             \
    (void)cudaGetLastError();                                               \
  } while (0)

#define CUDA_OK(expr) CHECK_EQ((expr), cudaSuccess)

static void fresh(void) {
  cuda_double_reset();
  cuda_double_clear_violations();
}

static int finish(void) {
  cuda_double_clear_violations();
  cuda_double_reset();
  return 0;
}

/* ---- the rules ------------------------------------------------------------ */
TEST(cuda_double_rule_unpinned_async_copy) {
  fresh();
  enum { N = 8192 };
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev, *pinned;
  CUDA_OK(cudaMalloc(&dev, N));
  CUDA_OK(cudaHostAlloc(&pinned, N, 0));
  char *pageable = malloc(N);
  CHECK(pageable);
  CHECK_VIOLATION(cudaMemcpyAsync(pageable, dev, N, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidValue, "is not pinned");
  CHECK_VIOLATION(cudaMemcpyAsync(dev, pageable, N, cudaMemcpyHostToDevice, s),
                  cudaErrorInvalidValue, "host source");
  /* Running past the end of a pinned block is unpinned too. */
  CHECK_VIOLATION(cudaMemcpyAsync((char *)pinned + 1, dev, N, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidValue, "is not pinned");
  /* Registered memory is pinned until unregistered. */
  CUDA_OK(cudaHostRegister(pageable, N, cudaHostRegisterPortable));
  CUDA_OK(cudaMemcpyAsync(pageable, dev, N, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaMemcpyAsync(pinned, dev, N, cudaMemcpyDeviceToHost, s));
  cuda_double_drain();
  CUDA_OK(cudaHostUnregister(pageable));
  CHECK_VIOLATION(cudaMemcpyAsync(pageable, dev, N, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidValue, "is not pinned");
  /* Synchronous copies may use pageable memory. */
  CUDA_OK(cudaMemcpy(pageable, dev, N, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFree(dev));
  free(pageable);
  return finish();
}

TEST(cuda_double_rule_device_memory_from_cudamalloc) {
  fresh();
  enum { N = 4096 };
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev, *pinned, *pinned2;
  CUDA_OK(cudaMalloc(&dev, N));
  CUDA_OK(cudaHostAlloc(&pinned, N, 0));
  CUDA_OK(cudaHostAlloc(&pinned2, N, 0));
  CHECK_VIOLATION(cudaMemcpyAsync(pinned, pinned2, N, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidValue, "not inside a cudaMalloc block");
  CHECK_VIOLATION(cudaMemcpyAsync(pinned, (char *)dev + N / 2, N, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidValue, "device source");
  CHECK_VIOLATION(cudaMemcpyAsync(pinned2, pinned, 16, cudaMemcpyHostToDevice, s),
                  cudaErrorInvalidValue, "device destination");
  char host[16];
  CHECK_VIOLATION(cudaMemcpy(host, host, 16, cudaMemcpyDeviceToHost), cudaErrorInvalidValue,
                  "not inside a cudaMalloc block");
  CHECK_VIOLATION(cudaFree(pinned), cudaErrorInvalidValue, "not a block from cudaMalloc");
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFreeHost(pinned2));
  CUDA_OK(cudaFree(dev));
  return finish();
}

TEST(cuda_double_rule_copy_direction) {
  fresh();
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev, *dev2;
  CUDA_OK(cudaMalloc(&dev, 64));
  CUDA_OK(cudaMalloc(&dev2, 64));
  CHECK_VIOLATION(cudaMemcpyAsync(dev2, dev, 64, cudaMemcpyDeviceToDevice, s),
                  cudaErrorInvalidMemcpyDirection, "direction");
  CHECK_VIOLATION(cudaMemcpyAsync(dev2, dev, 64, cudaMemcpyDefault, s),
                  cudaErrorInvalidMemcpyDirection, "direction");
  CUDA_OK(cudaMemcpy(dev2, dev, 64, cudaMemcpyDeviceToDevice)); /* tests may */
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFree(dev2));
  return finish();
}

TEST(cuda_double_rule_stream_after_destroy) {
  fresh();
  cudaStream_t s;
  cudaEvent_t ev;
  void *dev, *pinned;
  CUDA_OK(cudaMalloc(&dev, 64));
  CUDA_OK(cudaHostAlloc(&pinned, 64, 0));
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, NULL));
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamDestroy(s));
  CHECK_VIOLATION(cudaMemcpyAsync(pinned, dev, 64, cudaMemcpyDeviceToHost, s),
                  cudaErrorInvalidResourceHandle, "used after cudaStreamDestroy");
  CHECK_VIOLATION(cudaEventRecord(ev, s), cudaErrorInvalidResourceHandle,
                  "used after cudaStreamDestroy");
  CHECK_VIOLATION(cudaStreamWaitEvent(s, ev, 0), cudaErrorInvalidResourceHandle,
                  "used after cudaStreamDestroy");
  CHECK_VIOLATION(cudaStreamDestroy(s), cudaErrorInvalidResourceHandle,
                  "used after cudaStreamDestroy");
  int not_a_stream;
  CHECK_VIOLATION(cudaStreamDestroy((cudaStream_t)(void *)&not_a_stream),
                  cudaErrorInvalidResourceHandle, "is not a stream");
  CHECK_VIOLATION(cudaStreamDestroy(NULL), cudaErrorInvalidResourceHandle,
                  "default stream cannot be destroyed");
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFreeHost(pinned));
  return finish();
}

TEST(cuda_double_rule_event_after_destroy) {
  fresh();
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, NULL));
  CUDA_OK(cudaEventDestroy(ev));
  CHECK_VIOLATION(cudaEventQuery(ev), cudaErrorInvalidResourceHandle,
                  "used after cudaEventDestroy");
  CHECK_VIOLATION(cudaEventRecord(ev, NULL), cudaErrorInvalidResourceHandle,
                  "used after cudaEventDestroy");
  CHECK_VIOLATION(cudaEventSynchronize(ev), cudaErrorInvalidResourceHandle,
                  "used after cudaEventDestroy");
  CHECK_VIOLATION(cudaStreamWaitEvent(NULL, ev, 0), cudaErrorInvalidResourceHandle,
                  "used after cudaEventDestroy");
  CHECK_VIOLATION(cudaEventDestroy(ev), cudaErrorInvalidResourceHandle,
                  "used after cudaEventDestroy");
  int not_an_event;
  CHECK_VIOLATION(cudaEventQuery((cudaEvent_t)(void *)&not_an_event),
                  cudaErrorInvalidResourceHandle, "is not an event");
  return finish();
}

/* Memory a queued copy still reads or writes may not be given back. */
TEST(cuda_double_rule_free_during_copy) {
  fresh();
  enum { N = 4096 };
  cudaStream_t s;
  cudaEvent_t done;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  void *dev, *pinned;
  CUDA_OK(cudaMalloc(&dev, N));
  CUDA_OK(cudaHostAlloc(&pinned, N, 0));
  char *registered = aligned_alloc(4096, N);
  CHECK(registered);
  CUDA_OK(cudaHostRegister(registered, N, 0));

  cuda_double_pause_streams(1); /* the copies stay queued: deterministic */
  CUDA_OK(cudaMemcpyAsync(pinned, dev, N, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaMemcpyAsync(dev, registered, N, cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaEventRecord(done, s));
  CHECK_EQ(cudaEventQuery(done), cudaErrorNotReady);
  (void)cudaGetLastError();
  CHECK_VIOLATION(cudaFreeHost(pinned), cudaErrorIllegalState, "still writes these bytes");
  CHECK_VIOLATION(cudaHostUnregister(registered), cudaErrorIllegalState,
                  "still reads these bytes");
  CHECK_VIOLATION(cudaFree(dev), cudaErrorIllegalState, "free only after an event");
  cuda_double_pause_streams(0);
  CUDA_OK(cudaEventSynchronize(done));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaHostUnregister(registered));
  CUDA_OK(cudaFree(dev));
  free(registered);
  CUDA_OK(cudaEventDestroy(done));
  CUDA_OK(cudaStreamDestroy(s));
  return finish();
}

TEST(cuda_double_rule_pinned_pairs) {
  fresh();
  void *pinned;
  CUDA_OK(cudaHostAlloc(&pinned, 8192, 0));
  char *registered = aligned_alloc(4096, 8192);
  CHECK(registered);
  CUDA_OK(cudaHostRegister(registered, 8192, 0));
  CHECK_VIOLATION(cudaHostRegister(registered + 4096, 4096, 0),
                  cudaErrorHostMemoryAlreadyRegistered, "already pinned");
  CHECK_VIOLATION(cudaHostRegister(pinned, 4096, 0), cudaErrorHostMemoryAlreadyRegistered,
                  "already pinned");
  CHECK_VIOLATION(cudaFreeHost(registered), cudaErrorInvalidValue, "cudaHostUnregister");
  CHECK_VIOLATION(cudaHostUnregister(pinned), cudaErrorHostMemoryNotRegistered,
                  "not the start of a range");
  CHECK_VIOLATION(cudaHostUnregister(registered + 4096), cudaErrorHostMemoryNotRegistered,
                  "not the start of a range");
  CHECK_VIOLATION(cudaFreeHost((char *)pinned + 64), cudaErrorInvalidValue,
                  "not a block from cudaHostAlloc");
  CUDA_OK(cudaHostUnregister(registered));
  CUDA_OK(cudaFreeHost(pinned));
  free(registered);
  return finish();
}

/* Real CUDA makes this a no-op; the double calls it an engine bug. */
TEST(cuda_double_rule_wait_on_unrecorded_event) {
  fresh();
  cudaStream_t s;
  cudaEvent_t ev;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CHECK_EQ(cudaEventQuery(ev), cudaSuccess); /* never recorded = complete */
  CHECK_VIOLATION(cudaStreamWaitEvent(s, ev, 0), cudaErrorIllegalState, "never recorded");
  CUDA_OK(cudaEventRecord(ev, NULL));
  CUDA_OK(cudaStreamWaitEvent(s, ev, 0));
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaStreamDestroy(s));
  return finish();
}

/* Two streams touching the same bytes need an event between them. */
TEST(cuda_double_rule_unordered_copies) {
  fresh();
  enum { N = 4096 };
  cudaStream_t s1, s2;
  cudaEvent_t ev;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  void *dev_a, *dev_b, *pinned, *pinned2;
  CUDA_OK(cudaMalloc(&dev_a, N));
  CUDA_OK(cudaMalloc(&dev_b, N));
  CUDA_OK(cudaHostAlloc(&pinned, N, 0));
  CUDA_OK(cudaHostAlloc(&pinned2, N, 0));
  char readback[64];

  cuda_double_pause_streams(1);
  CUDA_OK(cudaMemcpyAsync(pinned, dev_a, N, cudaMemcpyDeviceToHost, s1));
  /* s2 reads what s1 is writing, with nothing in between */
  CHECK_VIOLATION(cudaMemcpyAsync(dev_b, pinned, N, cudaMemcpyHostToDevice, s2),
                  cudaErrorIllegalState, "missing cudaStreamWaitEvent");
  /* reading the source of s1's copy on s2 is fine: both only read it */
  CUDA_OK(cudaMemcpyAsync(pinned2, dev_a, N, cudaMemcpyDeviceToHost, s2));
  /* the default stream (the embedder) writes what s1 reads */
  CHECK_VIOLATION(cudaMemcpy(dev_a, readback, sizeof readback, cudaMemcpyHostToDevice),
                  cudaErrorIllegalState, "races with copy");
  /* ordered by an event: fine */
  CUDA_OK(cudaEventRecord(ev, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, ev, 0));
  CUDA_OK(cudaMemcpyAsync(dev_b, pinned, N, cudaMemcpyHostToDevice, s2));
  /* and transitively: the default stream waits on s2, which waited on s1 */
  CUDA_OK(cudaEventRecord(ev, s2));
  CUDA_OK(cudaStreamWaitEvent(NULL, ev, 0));
  cuda_double_pause_streams(0);
  CUDA_OK(cudaMemcpy(dev_a, readback, sizeof readback, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(readback, dev_b, sizeof readback, cudaMemcpyDeviceToHost));
  cuda_double_drain();
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  CUDA_OK(cudaFree(dev_a));
  CUDA_OK(cudaFree(dev_b));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFreeHost(pinned2));
  return finish();
}

TEST(cuda_double_rule_record_on_other_device) {
  fresh();
  cuda_double_set_device_count(2);
  cudaEvent_t ev;
  cudaStream_t s1;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)); /* device 0 */
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK_VIOLATION(cudaEventRecord(ev, s1), cudaErrorInvalidResourceHandle,
                  "event of device 0 recorded on stream");
  CHECK_VIOLATION(cudaEventRecord(ev, NULL), cudaErrorInvalidResourceHandle,
                  "of device 1");
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaEventRecord(ev, NULL));
  CUDA_OK(cudaStreamWaitEvent(s1, ev, 0)); /* waits may cross devices */
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaStreamDestroy(s1));
  return finish();
}

TEST(cuda_double_rule_ferry_conventions) {
  fresh();
  cudaStream_t s;
  cudaEvent_t ev;
  CHECK_VIOLATION(cudaStreamCreateWithFlags(&s, cudaStreamDefault), cudaErrorInvalidValue,
                  "cudaStreamNonBlocking");
  CHECK_VIOLATION(cudaEventCreateWithFlags(&ev, cudaEventDefault), cudaErrorInvalidValue,
                  "cudaEventDisableTiming");
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, NULL));
  CHECK_VIOLATION(cudaStreamWaitEvent(NULL, ev, 1), cudaErrorInvalidValue, "flags");
  CUDA_OK(cudaEventDestroy(ev));
  return finish();
}

TEST(cuda_double_rule_leaks_reported) {
  fresh();
  cuda_double_check_leaks(); /* what the exit handler runs */
  long baseline = cuda_double_violations();
  cuda_double_clear_violations();
  cudaStream_t s;
  cudaEvent_t ev;
  void *pinned;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaHostAlloc(&pinned, 100, 0));
  cuda_double_check_leaks();
  CHECK_EQ(cuda_double_violations(), baseline + 3);
  CHECK_STR_CONTAINS(cuda_double_last_violation(), "(100 bytes, cudaHostAlloc) was never released");
  cuda_double_clear_violations();
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaFreeHost(pinned));
  cuda_double_check_leaks();
  CHECK_EQ(cuda_double_violations(), baseline);
  return finish();
}

/* ---- the double's machinery ------------------------------------------------ */
/* Copies run later, on the stream's worker; events complete after them. */
TEST(cuda_double_streams_are_asynchronous) {
  fresh();
  enum { N = 1 << 16 };
  cudaStream_t s;
  cudaEvent_t ev;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  void *dev;
  unsigned char *pinned;
  CUDA_OK(cudaMalloc(&dev, N));
  CUDA_OK(cudaHostAlloc((void **)&pinned, N, 0));
  unsigned char pattern[N];
  for (int i = 0; i < N; i++) pattern[i] = (unsigned char)(i * 7 + 1);
  CUDA_OK(cudaMemcpy(dev, pattern, N, cudaMemcpyHostToDevice));
  memset(pinned, 0, N);
  cuda_double_pause_streams(1);
  CUDA_OK(cudaMemcpyAsync(pinned, dev, N, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaEventRecord(ev, s));
  CHECK_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  /* Like the real runtime, "not ready" lands in the last-error slot. */
  CHECK_EQ(cudaPeekAtLastError(), cudaErrorNotReady);
  CHECK_EQ(cudaGetLastError(), cudaErrorNotReady);
  CHECK_EQ(cudaGetLastError(), cudaSuccess);
  CHECK_EQ(pinned[1], 0); /* not copied yet */
  cuda_double_counts c;
  cuda_double_get_counts(&c);
  CHECK_EQ(c.ops_queued, 2);
  cuda_double_pause_streams(0);
  CUDA_OK(cudaEventSynchronize(ev));
  CHECK(memcmp(pinned, pattern, N) == 0);
  CUDA_OK(cudaEventQuery(ev));
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFreeHost(pinned));
  return finish();
}

TEST(cuda_double_no_driver_and_injected_failures) {
  fresh();
  int n = -1;
  cuda_double_set_no_driver(1);
  void *p = NULL;
  CHECK_EQ(cudaGetDeviceCount(&n), cudaErrorInsufficientDriver);
  CHECK_EQ(cudaMalloc(&p, 16), cudaErrorInsufficientDriver);
  CHECK_EQ(cudaHostAlloc(&p, 16, 0), cudaErrorInsufficientDriver);
  CHECK_EQ(cudaGetLastError(), cudaErrorInsufficientDriver);
  CHECK_STR_CONTAINS(cudaGetErrorString(cudaErrorInsufficientDriver),
                     "driver version is insufficient");
  cuda_double_set_no_driver(0);
  CUDA_OK(cudaGetDeviceCount(&n));
  CHECK_EQ(n, 1);
  cuda_double_set_device_count(0);
  CHECK_EQ(cudaGetDeviceCount(&n), cudaErrorNoDevice);
  cuda_double_set_device_count(3);
  CUDA_OK(cudaGetDeviceCount(&n));
  CHECK_EQ(n, 3);
  CHECK_EQ(cudaSetDevice(3), cudaErrorInvalidDevice);

  cuda_double_fail_call("cudaMalloc", 2, cudaErrorMemoryAllocation);
  void *a = NULL, *b = NULL;
  CUDA_OK(cudaMalloc(&a, 16));
  CHECK_EQ(cudaMalloc(&b, 16), cudaErrorMemoryAllocation);
  CHECK(b == NULL);
  CHECK_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  CUDA_OK(cudaMalloc(&b, 16)); /* injected once */
  long calls = cuda_double_calls("cudaMalloc");
  CHECK(calls >= 3);
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(b));
  CHECK_EQ(cuda_double_violations(), 0);
  return finish();
}

/* ---- the cuda backend over the double -------------------------------------- */
static ferry_backend *cuda_backend(int device) {
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = FERRY_BACKEND_CUDA;
  cfg.device = device;
  ferry_backend *b = NULL;
  char err[256] = "";
  if (ferry_backend_cuda_create(&cfg, &b, err, sizeof err) != FERRY_OK)
    fprintf(stderr, "ferry_backend_cuda_create: %s\n", err);
  return b;
}

/* Each CUDA failure becomes the right ferry code and the message
 * "cudaXxx: <text> (<name>)", and is not left in the last-error slot. */
TEST(cuda_backend_maps_and_clears_errors) {
  fresh();
  ferry_backend *b = cuda_backend(-1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  cuda_double_counts before, after;
  cuda_double_get_counts(&before);

  void *p = NULL;
  cuda_double_fail_call("cudaHostRegister", 1, cudaErrorMemoryAllocation);
  CHECK_RC(o->host_alloc(b, 1 << 20, 0, &p), FERRY_ENOMEM);
  CHECK(strcmp(b->err, "cudaHostRegister: out of memory (cudaErrorMemoryAllocation)") == 0);
  CHECK(p == NULL);
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
  cuda_double_get_counts(&after);
  CHECK_EQ(after.pinned_blocks, before.pinned_blocks);

  bk_stream s;
  cuda_double_fail_call("cudaStreamCreateWithFlags", 1, cudaErrorMemoryAllocation);
  CHECK_RC(o->stream_create(b, &s), FERRY_ENOMEM);
  CHECK(s == NULL);
  CHECK_OK(o->stream_create(b, &s));

  uint8_t *pinned;
  void *dev;
  CHECK_OK(o->host_alloc(b, 4096, 0, (void **)&pinned));
  CUDA_OK(cudaMalloc(&dev, 4096));
  cuda_double_fail_call("cudaMemcpyAsync", 1, cudaErrorIllegalAddress);
  CHECK_RC(o->copy_d2h(b, pinned, dev, 4096, s), FERRY_EBACKEND);
  CHECK_STR_CONTAINS(b->err, "cudaMemcpyAsync: an illegal memory access was encountered "
                             "(cudaErrorIllegalAddress)");
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);

  bk_event *ev;
  cuda_double_fail_call("cudaEventCreateWithFlags", 1, cudaErrorInitializationError);
  CHECK_RC(o->event_create(b, &ev), FERRY_ENODEV);
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->event_record(b, ev, s));
  cuda_double_fail_call("cudaEventQuery", 1, cudaErrorLaunchFailure);
  CHECK_RC(o->event_query(b, ev), FERRY_EBACKEND);
  CHECK_STR_CONTAINS(b->err, "cudaEventQuery: unspecified launch failure");
  cuda_double_fail_call("cudaEventSynchronize", 1, cudaErrorLaunchFailure);
  CHECK_RC(o->event_synchronize(b, ev), FERRY_EBACKEND);
  cuda_double_fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);
  CHECK_RC(o->stream_wait_event(b, NULL, ev), FERRY_EBACKEND);
  CHECK_STR_CONTAINS(b->err, "cudaStreamWaitEvent: unknown error (cudaErrorUnknown)");
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
  CHECK_OK(o->event_synchronize(b, ev));

  /* "Not ready" is an answer, not an error, and is not left behind. */
  cuda_double_pause_streams(1);
  CHECK_OK(o->copy_d2h(b, pinned, dev, 4096, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_EQ(o->event_query(b, ev), 0);
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
  cuda_double_pause_streams(0);
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK_EQ(o->event_query(b, ev), 1);

  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_OK(o->host_free(b, pinned, 4096));
  CUDA_OK(cudaFree(dev));
  o->destroy(b);

  /* At creation: no device, a busy device. */
  char err[256];
  ferry_config cfg = FERRY_CONFIG_INIT;
  cuda_double_fail_call("cudaGetDeviceCount", 1, cudaErrorNoDevice);
  CHECK_RC(ferry_backend_cuda_create(&cfg, &b, err, sizeof err), FERRY_ENODEV);
  CHECK(strcmp(err, "cudaGetDeviceCount: no CUDA-capable device is detected "
                    "(cudaErrorNoDevice)") == 0);
  cuda_double_fail_call("cudaSetDevice", 1, cudaErrorDevicesUnavailable);
  CHECK_RC(ferry_backend_cuda_create(&cfg, &b, err, sizeof err), FERRY_ENODEV);
  CHECK_STR_CONTAINS(err, "cudaSetDevice: CUDA-capable device(s) is/are busy");
  cfg.device = 1;
  CHECK_RC(ferry_backend_cuda_create(&cfg, &b, err, sizeof err), FERRY_ENODEV);
  CHECK_STR_CONTAINS(err, "config.device 1 does not exist: 1 CUDA device is visible");
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
  CHECK_EQ(cuda_double_violations(), 0);
  return finish();
}

typedef struct device_probe {
  ferry_backend *b;
  bk_stream s;
  bk_event *ev;
  int device_after;
  int rc;
} device_probe;

static void *use_from_new_thread(void *arg) {
  device_probe *p = arg;
  /* A new thread starts on device 0; the backend works on its device 1. */
  p->rc = p->b->ops->event_record(p->b, p->ev, NULL);
  if (!p->rc) p->rc = p->b->ops->stream_wait_event(p->b, p->s, p->ev);
  if (!p->rc) p->rc = p->b->ops->event_synchronize(p->b, p->ev);
  cudaGetDevice(&p->device_after);
  return NULL;
}

/* The engine works on its device whichever device the calling thread is
 * on, and leaves the thread's current device as it found it. */
TEST(cuda_backend_uses_its_device_and_restores_the_threads) {
  fresh();
  cuda_double_set_device_count(2);
  CUDA_OK(cudaSetDevice(0));
  ferry_backend *b = cuda_backend(1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  CHECK_EQ(current, 0);
  bk_stream s;
  bk_event *ev;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(o->event_create(b, &ev));
  CHECK_EQ(cuda_double_stream_device((cudaStream_t)s), 1);
  CHECK_EQ(cuda_double_event_device((cudaEvent_t)(void *)ev), 1);
  /* NULL = the default stream of the engine's device (the double refuses a
   * record of a device-1 event on device 0's stream). */
  CHECK_OK(o->event_record(b, ev, NULL));
  CHECK_OK(o->stream_wait_event(b, s, ev));
  CUDA_OK(cudaGetDevice(&current));
  CHECK_EQ(current, 0);

  device_probe p = {b, s, ev, -1, -1};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, use_from_new_thread, &p) == 0);
  pthread_join(t, NULL);
  CHECK_OK(p.rc);
  CHECK_EQ(p.device_after, 0);

  /* On its own device, no device switching at all. */
  CUDA_OK(cudaSetDevice(1));
  long sets = cuda_double_calls("cudaSetDevice");
  CHECK_OK(o->event_record(b, ev, NULL));
  CHECK_OK(o->stream_wait_event(b, NULL, ev));
  CHECK_EQ(o->event_query(b, ev) >= 0, 1);
  CHECK_EQ(cuda_double_calls("cudaSetDevice"), sets);
  CUDA_OK(cudaSetDevice(0));

  /* -1 = the creating thread's device at creation */
  CUDA_OK(cudaSetDevice(1));
  ferry_backend *b2 = cuda_backend(-1);
  CHECK(b2);
  CUDA_OK(cudaSetDevice(0));
  bk_stream s2;
  CHECK_OK(b2->ops->stream_create(b2, &s2));
  CHECK_EQ(cuda_double_stream_device((cudaStream_t)s2), 1);
  CHECK_OK(b2->ops->stream_destroy(b2, s2));
  b2->ops->destroy(b2);

  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->stream_destroy(b, s));
  o->destroy(b);
  CHECK_EQ(cuda_double_violations(), 0);
  return finish();
}

/* Issue 36 item 9: every rank touched GPU 0. A thread that never used its
 * device (device 0, by default) works the engine's device 1: no primary
 * context appears on device 0 (cudaSetDevice back to it would make one), the
 * thread is left on device 1, and records and waits on the engine's streams
 * switch no device at all. */
typedef struct fresh_thread_probe {
  ferry_backend *b;
  bk_stream s;
  bk_event *ev;
  long sets_for_streams; /* cudaSetDevice calls by records/waits on s */
  int device_after, rc;
} fresh_thread_probe;

static void *use_from_fresh_thread(void *arg) {
  fresh_thread_probe *p = arg;
  const ferry_backend_ops *o = p->b->ops;
  long sets = cuda_double_calls("cudaSetDevice");
  p->rc = o->event_record(p->b, p->ev, p->s);
  if (!p->rc) p->rc = o->stream_wait_event(p->b, p->s, p->ev);
  p->sets_for_streams = cuda_double_calls("cudaSetDevice") - sets;
  bk_event *ev2 = NULL; /* guarded: made on the engine's device */
  if (!p->rc) p->rc = o->event_create(p->b, &ev2);
  if (!p->rc) p->rc = o->event_record(p->b, ev2, NULL);
  if (!p->rc) p->rc = o->event_synchronize(p->b, ev2);
  if (ev2 && o->event_destroy(p->b, ev2) && !p->rc) p->rc = -1;
  cudaGetDevice(&p->device_after);
  return NULL;
}

TEST(cuda_backend_makes_no_context_on_another_device) {
  fresh();
  cuda_double_set_device_count(2);
  ferry_backend *b = cuda_backend(1); /* from a thread on device 0, unused */
  CHECK(b);
  CHECK(!cuda_double_primary_context(0));
  CHECK(cuda_double_primary_context(1));
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  CHECK_EQ(current, 1); /* left on the engine's device, not set back */
  fresh_thread_probe p = {b, NULL, NULL, -1, -1, -1};
  CHECK_OK(b->ops->stream_create(b, &p.s));
  CHECK_OK(b->ops->event_create(b, &p.ev));
  pthread_t t;
  CHECK(pthread_create(&t, NULL, use_from_fresh_thread, &p) == 0);
  pthread_join(t, NULL);
  CHECK_OK(p.rc);
  CHECK_EQ(p.sets_for_streams, 0);
  CHECK_EQ(p.device_after, 1);
  CHECK(!cuda_double_primary_context(0));
  CHECK_OK(b->ops->event_destroy(b, p.ev));
  CHECK_OK(b->ops->stream_destroy(b, p.s));
  b->ops->destroy(b);
  CHECK_EQ(cuda_double_violations(), 0);
  return finish();
}

/* Pinned memory by cudaHostRegister where the device supports it, else by
 * cudaHostAlloc; both aligned as asked and released by host_free. */
TEST(cuda_backend_pins_by_register_or_hostalloc) {
  for (int registered = 1; registered >= 0; registered--) {
    fresh();
    cuda_double_set_host_register_supported(registered);
    ferry_backend *b = cuda_backend(-1);
    CHECK(b);
    const ferry_backend_ops *o = b->ops;
    cuda_double_counts c0, c1, c2;
    cuda_double_get_counts(&c0);
    static const size_t sizes[] = {1, 4096, 100000, (size_t)5 << 20};
    static const size_t aligns[] = {0, 64, 65536, (size_t)2 << 20};
    void *p[4][4];
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 4; j++) {
        CHECK_OK(o->host_alloc(b, sizes[i], aligns[j], &p[i][j]));
        size_t a = aligns[j] < 4096 ? 4096 : aligns[j];
        CHECK(((uintptr_t)p[i][j] & (a - 1)) == 0);
        memset(p[i][j], 0x5A, sizes[i]); /* all of it is usable */
      }
    cuda_double_get_counts(&c1);
    CHECK_EQ(c1.pinned_blocks - c0.pinned_blocks, 16);
    CHECK_EQ(c1.registered_ranges - c0.registered_ranges, registered ? 16 : 0);
    CHECK_EQ(c1.hostalloc_blocks - c0.hostalloc_blocks, registered ? 0 : 16);
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 4; j++) CHECK_OK(o->host_free(b, p[i][j], sizes[i]));
    cuda_double_get_counts(&c2);
    CHECK_EQ(c2.pinned_blocks, c0.pinned_blocks);
    if (!registered) {
      char *heap = aligned_alloc(4096, 8192);
      CHECK(heap);
      memset(heap, 0, 8192);
      CHECK_RC(o->host_free(b, heap + 4096, 64), FERRY_EINVAL);
      CHECK_STR_CONTAINS(b->err, "not allocated by host_alloc");
      free(heap);
    } else {
      char *unpinned = aligned_alloc(4096, 4096);
      CHECK(unpinned);
      long before = cuda_double_violations();
      CHECK_RC(o->host_free(b, unpinned, 4096), FERRY_EBACKEND);
      CHECK_STR_CONTAINS(b->err, "cudaHostUnregister: pointer does not correspond to a "
                                 "registered memory region");
      CHECK_EQ(cuda_double_violations(), before + 1); /* the double saw it too */
      free(unpinned);
    }
    o->destroy(b);
    finish();
  }
  return 0;
}

static int offload_everything(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                              ferry_decision *out) {
  memset(out, 0, sizeof *out);
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  return 0;
}

/* A whole engine over the double: packs, offloads, unpacks bit-identical,
 * with every rule checked on every call, and releases all it took. */
TEST(cuda_engine_round_trip_over_double) {
  fresh();
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = FERRY_BACKEND_CUDA;
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.retain = test_device_retain_cb;
  c.min_offload_bytes = 1;
  c.max_fwd_stash = 1;
  c.decide = offload_everything;
  test_device_stats st;
  memset(&st, 0, sizeof st);
  c.callback_ud = &st;
  ferry_engine *e = NULL;
  char err[512] = "";
  int rc = ferry_engine_create(&c, &e, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK(strcmp(ferry_backend_name(e), "cuda") == 0);
  enum { M = 6, SZ = 300000 };
  ferry_handle h[M];
  unsigned char *want[M];
  for (int i = 0; i < M; i++) {
    test_buffer *b = test_buffer_new(SZ);
    CHECK(b);
    want[i] = malloc(SZ);
    CHECK(want[i]);
    for (size_t k = 0; k < SZ; k++) want[i][k] = (unsigned char)(k * 13 + (size_t)i);
    test_dev_write(b->ptr, want[i], SZ);
    ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
    d.bytes = SZ;
    d.dtype = FERRY_DTYPE_U8;
    d.ndim = 1;
    d.shape[0] = SZ;
    d.layer = i;
    CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h[i]));
  }
  ferry_stats s;
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_offloaded, M);
  unsigned char *got = malloc(SZ);
  CHECK(got);
  for (int i = M - 1; i >= 0; i--) {
    void *dev = NULL, *owner = NULL;
    CHECK_OK(ferry_unpack(e, h[i], NULL, &dev, &owner));
    test_dev_read(got, dev, SZ);
    CHECK(memcmp(got, want[i], SZ) == 0);
    test_device_release_cb(&st, owner);
    free(want[i]);
  }
  free(got);
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK(s.bytes_h2d >= (uint64_t)(M - 1) * SZ);
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  cuda_double_counts cnt;
  cuda_double_get_counts(&cnt);
  CHECK_EQ(cnt.streams, 0);
  CHECK_EQ(cnt.events, 0);
  CHECK_EQ(cnt.pinned_blocks, 0);
  CHECK_EQ(test_buffers_live(), 0);
  CHECK_EQ(cuda_double_violations(), 0);
  return finish();
}
