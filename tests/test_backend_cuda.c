/* test_backend_cuda.c — the cuda backend, in every build:
 *   - ferry_tests (real libcudart): on a machine without a driver (CI),
 *     creation fails with FERRY_ENODEV and the CUDA error text; on a machine
 *     with a GPU the vtable tests run on it;
 *   - ferry_tests_cuda_double (the CUDA test double): the vtable tests run
 *     over the double, whose rules (tests/cuda_double/cuda_double.h) check
 *     every call, and the no-driver case is the double's switch;
 *   - a build without the toolkit: the backend says it was left out.
 * Tests of the double's rules and of the backend's error and device handling
 * under injected failures are in tests/cuda_double/test_cuda_double.c. */
#include <stdint.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

#ifdef FERRY_HAVE_CUDA
static void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1664525u + 1013904223u;
    p[i] = (uint8_t)(x >> 24);
  }
}
#endif

/* Create a cuda backend on `device`. *b is NULL afterwards when this build
 * or machine has no usable CUDA; the way creation failed is checked then. */
static int open_cuda(int device, ferry_backend **b) {
  *b = NULL;
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = FERRY_BACKEND_CUDA;
  cfg.device = device;
  char err[256] = "";
  int rc = ferry_backend_cuda_create(&cfg, b, err, sizeof err);
#ifndef FERRY_HAVE_CUDA
  CHECK_RC(rc, FERRY_EUNSUPPORTED);
  CHECK(*b == NULL);
  CHECK_STR_CONTAINS(err, "built without the cuda backend");
  printf("no CUDA toolkit in this build: checked that the cuda backend says so\n");
  return 0;
#else
  if (rc == FERRY_OK) {
    CHECK(*b != NULL);
    CHECK(strcmp((*b)->ops->name, "cuda") == 0);
    return 0;
  }
  /* Creation may only fail when CUDA itself has no device for us. */
  int count = 0;
  cudaError_t probe = cudaGetDeviceCount(&count);
  if (cudaPeekAtLastError() == probe) (void)cudaGetLastError();
  CHECK(probe != cudaSuccess);
  CHECK_RC(rc, FERRY_ENODEV);
  CHECK(*b == NULL);
  CHECK_STR_CONTAINS(err, cudaGetErrorString(probe));
  printf("no usable CUDA device (%s): checked that creation fails with FERRY_ENODEV\n",
         cudaGetErrorName(probe));
  return 0;
#endif
}

static void engine_config(ferry_config *c) {
  ferry_config d = FERRY_CONFIG_INIT;
  *c = d;
  c->backend = FERRY_BACKEND_CUDA;
  c->device_alloc = test_device_alloc_cb;
  c->release = test_device_release_cb;
}

/* What CI machines have: the toolkit, no driver. The engine refuses to be
 * created, with FERRY_ENODEV and the CUDA runtime's own words. */
TEST(cuda_create_without_driver_is_enodev) {
  ferry_config c;
  engine_config(&c);
  ferry_engine *e = (ferry_engine *)0x1;
  char err[512] = "";
#ifndef FERRY_HAVE_CUDA
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EUNSUPPORTED);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, "ferry was built without the cuda backend (no CUDA toolkit");
  return 0;
#else
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_reset();
  cuda_double_set_no_driver(1);
#endif
  int count = 0;
  cudaError_t probe = cudaGetDeviceCount(&count);
  if (cudaPeekAtLastError() == probe) (void)cudaGetLastError();
  if (probe == cudaSuccess) {
    /* A machine with a driver: a device that does not exist is the
     * no-device case we can still provoke. */
    c.device = count;
    CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_ENODEV);
    CHECK(e == NULL);
    CHECK_STR_CONTAINS(err, "does not exist");
    printf("a CUDA driver is present: checked device %d (absent) instead\n", count);
    return 0;
  }
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_ENODEV);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, "cudaGetDeviceCount: ");
  CHECK_STR_CONTAINS(err, cudaGetErrorString(probe));
  CHECK_STR_CONTAINS(err, cudaGetErrorName(probe));
  /* The backend constructor alone says the same. */
  ferry_backend *b = (ferry_backend *)0x1;
  char berr[256] = "";
  CHECK_RC(ferry_backend_cuda_create(&c, &b, berr, sizeof berr), FERRY_ENODEV);
  CHECK(b == NULL);
  char want[256];
  snprintf(want, sizeof want, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(probe),
           cudaGetErrorName(probe));
  CHECK(strcmp(berr, want) == 0);
#ifdef FERRY_TEST_CUDA_DOUBLE
  CHECK(probe == cudaErrorInsufficientDriver);
  /* ferry's failure is not left behind for the embedder's next check. */
  CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
  cuda_double_reset();
#endif
  return 0;
#endif
}

/* Pinned memory, two engine streams, a device -> host -> device round trip
 * ordered by an event, and the result read on the default stream. */
TEST(cuda_backend_round_trip) {
  ferry_backend *b;
  CHECK_OK(open_cuda(-1, &b));
  if (!b) return 0;
#ifdef FERRY_HAVE_CUDA
  const ferry_backend_ops *o = b->ops;
  enum { N = 3 * 1024 * 1024 + 5 };
  uint8_t *src = malloc(N), *back = malloc(N);
  CHECK(src && back);
  fill_pattern(src, N, 11);
  void *dev_a = NULL, *dev_b = NULL;
  CHECK_EQ(cudaMalloc(&dev_a, N), cudaSuccess);
  CHECK_EQ(cudaMalloc(&dev_b, N), cudaSuccess);
  CHECK_EQ(cudaMemcpy(dev_a, src, N, cudaMemcpyHostToDevice), cudaSuccess);

  uint8_t *pinned = NULL;
  CHECK_OK(o->host_alloc(b, N, (size_t)2 << 20, (void **)&pinned));
  CHECK(((uintptr_t)pinned & (((uintptr_t)2 << 20) - 1)) == 0);
  bk_stream d2h, h2d;
  bk_event *copied_out, *copied_in;
  CHECK_OK(o->stream_create(b, &d2h));
  CHECK_OK(o->stream_create(b, &h2d));
  CHECK(d2h && h2d && d2h != h2d);
  CHECK_OK(o->event_create(b, &copied_out));
  CHECK_OK(o->event_create(b, &copied_in));

  /* Split into chunks so several copies are queued at once. */
  for (size_t off = 0; off < N; off += 1 << 20) {
    size_t n = N - off < (1u << 20) ? N - off : 1u << 20;
    CHECK_OK(o->copy_d2h(b, pinned + off, (uint8_t *)dev_a + off, n, d2h));
  }
  CHECK_OK(o->event_record(b, copied_out, d2h));
  CHECK_OK(o->stream_wait_event(b, h2d, copied_out));
  for (size_t off = 0; off < N; off += 1 << 20) {
    size_t n = N - off < (1u << 20) ? N - off : 1u << 20;
    CHECK_OK(o->copy_h2d(b, (uint8_t *)dev_b + off, pinned + off, n, h2d));
  }
  CHECK_OK(o->event_record(b, copied_in, h2d));
  /* The default stream (the embedder's compute) waits; a synchronous
   * cudaMemcpy on it then sees the copied bytes without a host wait. */
  CHECK_OK(o->stream_wait_event(b, NULL, copied_in));
  CHECK_EQ(cudaMemcpy(back, dev_b, N, cudaMemcpyDeviceToHost), cudaSuccess);
  CHECK(memcmp(back, src, N) == 0);
  CHECK(memcmp(pinned, src, N) == 0);
  CHECK_EQ(o->event_query(b, copied_in), 1);
  CHECK_EQ(o->event_query(b, copied_out), 1);

  CHECK_OK(o->event_destroy(b, copied_out));
  CHECK_OK(o->event_destroy(b, copied_in));
  CHECK_OK(o->stream_destroy(b, d2h));
  CHECK_OK(o->stream_destroy(b, h2d));
  CHECK_OK(o->host_free(b, pinned, N));
  CHECK_EQ(cudaFree(dev_a), cudaSuccess);
  CHECK_EQ(cudaFree(dev_b), cudaSuccess);
  free(src);
  free(back);
#ifdef FERRY_TEST_CUDA_DOUBLE
  /* The whole path went without a host wait on the device or a stream. */
  CHECK_EQ(cuda_double_calls("cudaEventSynchronize"), 0);
  CHECK_EQ(cuda_double_violations(), 0);
#endif
  o->destroy(b);
#endif
  return 0;
}

/* Event semantics: never recorded = complete; record captures the work so
 * far; re-recording re-arms; synchronize waits; external streams (the
 * legacy default stream, the per-thread stream) can record and wait. */
TEST(cuda_backend_events_and_waits) {
  ferry_backend *b;
  CHECK_OK(open_cuda(-1, &b));
  if (!b) return 0;
#ifdef FERRY_HAVE_CUDA
  const ferry_backend_ops *o = b->ops;
  enum { N = 1 << 20 };
  bk_event *ev, *on_default;
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->event_create(b, &on_default));
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_OK(o->event_synchronize(b, ev));

  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  uint8_t *pinned, *src = malloc(N), *back = malloc(N);
  CHECK(src && back);
  CHECK_OK(o->host_alloc(b, N, 0, (void **)&pinned));
  void *dev = NULL, *dev2 = NULL;
  CHECK_EQ(cudaMalloc(&dev, N), cudaSuccess);
  CHECK_EQ(cudaMalloc(&dev2, N), cudaSuccess);
  for (int round = 0; round < 3; round++) {
    fill_pattern(src, N, 100 + (uint32_t)round);
    /* The producer of dev is the default stream: the engine stream waits. */
    CHECK_EQ(cudaMemcpy(dev, src, N, cudaMemcpyHostToDevice), cudaSuccess);
    CHECK_OK(o->event_record(b, on_default, NULL));
    CHECK_OK(o->stream_wait_event(b, s, on_default));
    CHECK_OK(o->copy_d2h(b, pinned, dev, N, s));
    CHECK_OK(o->event_record(b, ev, s)); /* re-arms each round */
    int q = o->event_query(b, ev);
    CHECK(q == 0 || q == 1);
    CHECK_OK(o->event_synchronize(b, ev));
    CHECK_EQ(o->event_query(b, ev), 1);
    CHECK(memcmp(pinned, src, N) == 0);
  }
  /* The per-thread default stream as the compute stream. */
  CHECK_OK(o->copy_h2d(b, dev2, pinned, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->stream_wait_event(b, cudaStreamPerThread, ev));
  CHECK_OK(o->event_record(b, on_default, cudaStreamPerThread));
  CHECK_OK(o->event_synchronize(b, on_default));
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_EQ(cudaMemcpy(back, dev2, N, cudaMemcpyDeviceToHost), cudaSuccess);
  CHECK(memcmp(back, src, N) == 0);

  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->event_destroy(b, on_default));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_OK(o->host_free(b, pinned, N));
  CHECK_EQ(cudaFree(dev), cudaSuccess);
  CHECK_EQ(cudaFree(dev2), cudaSuccess);
  free(src);
  free(back);
#ifdef FERRY_TEST_CUDA_DOUBLE
  CHECK_EQ(cuda_double_violations(), 0);
#endif
  o->destroy(b);
#endif
  return 0;
}

/* Bad arguments are refused by ferry, before CUDA, with a message. */
TEST(cuda_backend_rejects_bad_arguments) {
  ferry_backend *b;
  CHECK_OK(open_cuda(-1, &b));
  if (!b) return 0;
#ifdef FERRY_HAVE_CUDA
  const ferry_backend_ops *o = b->ops;
  void *p = NULL;
  CHECK_RC(o->host_alloc(b, 0, 0, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "size is 0");
  CHECK_RC(o->host_alloc(b, 4096, 3000, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "not a power of two");
  CHECK_RC(o->host_alloc(b, 4096, (size_t)4 << 20, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "2 MiB maximum");
  CHECK_RC(o->host_alloc(b, 4096, 0, NULL), FERRY_EINVAL);
  CHECK_RC(o->host_alloc(b, SIZE_MAX - 100, 0, &p), FERRY_ENOMEM);
  CHECK(p == NULL);
  CHECK_RC(o->host_free(b, (char *)&p + 1, 4096), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "not page aligned");
  CHECK_RC(o->host_free(b, NULL, 4096), FERRY_EINVAL);

  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  uint8_t *pinned;
  CHECK_OK(o->host_alloc(b, 4096, 0, (void **)&pinned));
  void *dev = NULL;
  CHECK_EQ(cudaMalloc(&dev, 4096), cudaSuccess);
  CHECK_RC(o->copy_d2h(b, pinned, dev, 16, NULL), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "engine stream");
  CHECK_RC(o->copy_h2d(b, NULL, pinned, 16, s), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "destination pointer is NULL");
  CHECK_RC(o->copy_d2h(b, pinned, NULL, 16, s), FERRY_EINVAL);
  CHECK_OK(o->copy_d2h(b, pinned, dev, 0, s)); /* nothing to do */
  CHECK_RC(o->stream_destroy(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_query(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_record(b, NULL, s), FERRY_EINVAL);
  CHECK_RC(o->stream_wait_event(b, s, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_create(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->stream_create(b, NULL), FERRY_EINVAL);

  ferry_config cfg = FERRY_CONFIG_INIT;
  ferry_backend *none = (ferry_backend *)0x1;
  char err[128] = "";
  CHECK_RC(ferry_backend_cuda_create(NULL, &none, err, sizeof err), FERRY_EINVAL);
  CHECK(none == NULL);
  CHECK_STR_CONTAINS(err, "config is NULL");
  CHECK_RC(ferry_backend_cuda_create(&cfg, NULL, err, sizeof err), FERRY_EINVAL);

  CHECK_OK(o->stream_destroy(b, s));
  CHECK_OK(o->host_free(b, pinned, 4096));
  CHECK_EQ(cudaFree(dev), cudaSuccess);
#ifdef FERRY_TEST_CUDA_DOUBLE
  CHECK_EQ(cuda_double_violations(), 0);
#endif
  o->destroy(b);
#endif
  return 0;
}
