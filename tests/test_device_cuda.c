/* test_device_cuda.c — "device" memory for the engine tests in the CUDA
 * double build (replaces tests/test_device.c there): cudaMalloc/cudaFree and
 * synchronous cudaMemcpy of the CUDA test double, so every buffer the tests
 * hand to ferry is device memory the double's rules apply to. A failure here
 * is a broken test or a rule violation: it aborts loudly. */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_double.h"
#include "test_device.h"

static void must(cudaError_t e, const char *call) {
  if (e == cudaSuccess) return;
  fprintf(stderr, "test_device (cuda double): %s failed: %s (%s); last violation: %s\n",
          call, cudaGetErrorString(e), cudaGetErrorName(e),
          cuda_double_last_violation());
  abort();
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
