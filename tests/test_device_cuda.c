/* test_device_cuda.c — "device" memory for the engine tests over the cuda
 * backend (replaces tests/test_device.c there): cudaMalloc/cudaFree and
 * synchronous cudaMemcpy, so every buffer the tests hand to ferry is device
 * memory. Two builds use it:
 *   - ferry_tests_cuda_double: the CUDA test double's runtime, whose rules
 *     check every call (a failure names the last rule broken);
 *   - ferry_tests_gpu: the real CUDA runtime on a real GPU.
 * A failure here is a broken test or a rule violation: it aborts loudly. */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "test_device.h"
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

static void must(cudaError_t e, const char *call) {
  if (e == cudaSuccess) return;
#ifdef FERRY_TEST_CUDA_DOUBLE
  fprintf(stderr, "test_device (cuda double): %s failed: %s (%s); last violation: %s\n",
          call, cudaGetErrorString(e), cudaGetErrorName(e),
          cuda_double_last_violation());
#else
  fprintf(stderr, "test_device (cuda): %s failed: %s (%s)\n", call, cudaGetErrorString(e),
          cudaGetErrorName(e));
#endif
  abort();
}

int test_device_ready(char *why, size_t len) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, len, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
    return 0;
  }
  if (count == 0) {
    snprintf(why, len, "cudaGetDeviceCount: 0 devices");
    return 0;
  }
  return 1;
}

void *test_dev_malloc(size_t bytes) {
  void *p = NULL;
  must(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  return p;
}

void test_dev_free(void *p) { must(cudaFree(p), "cudaFree"); }

void test_dev_write(void *dev, const void *src, size_t bytes) {
  must(cudaMemcpy(dev, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy(HostToDevice)");
}

void test_dev_read(void *dst, const void *dev, size_t bytes) {
  must(cudaMemcpy(dst, dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(DeviceToHost)");
}
