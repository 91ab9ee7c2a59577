/* test_device.h — "device" memory for the engine tests, whichever backend
 * they run over: plain host memory for the host backend; for the cuda backend
 * memory from cudaMalloc (the CUDA test double's, or a real GPU's). The
 * allocator/release callbacks the tests give the engine use these. */
#ifndef FERRY_TEST_DEVICE_H
#define FERRY_TEST_DEVICE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

/* 1 when this build's device memory can be had; else 0 and why (the GPU
 * build on a machine without a CUDA device: the runner skips the suite). */
int test_device_ready(char *why, size_t len);
void *test_dev_malloc(size_t bytes);
void test_dev_free(void *p);
/* Copy between device memory and ordinary host memory, synchronously. */
void test_dev_write(void *dev, const void *src, size_t bytes);
void test_dev_read(void *dst, const void *dev, size_t bytes);

/* An owner token as the tests hand it to the engine: a refcounted buffer. */
typedef struct test_buffer {
  void *ptr;
  size_t bytes;
  atomic_int refs;
} test_buffer;

/* A buffer with one reference; freed (device memory too) with the last. */
test_buffer *test_buffer_new(size_t bytes);
int test_buffer_unref(test_buffer *b); /* 1 when that freed it */
/* test_buffers not yet freed, in this process: 0 when nothing leaked. */
long test_buffers_live(void);
/* Engine callbacks over test_buffer owners; ud is a test_device_stats*. */
typedef struct test_device_stats {
  atomic_long allocs, releases, retains;
  atomic_long alloc_failures_to_inject;
} test_device_stats;
int test_device_alloc_cb(void *ud, uint64_t bytes, void *stream, void **device_ptr, void **owner);
void test_device_release_cb(void *ud, void *owner);
void test_device_retain_cb(void *ud, void *owner);
/* FERRY_CONFIG_INIT over the backend and arena under test, with the callbacks
 * above (callback_ud = st, which may be NULL). */
ferry_config test_engine_config(test_device_stats *st);

/* A decide callback that offloads every tensor, reloaded on use, cacheable. */
static inline int test_decide_offload_on_use(void *ud, const ferry_tensor_desc *d,
                                             const ferry_context *ctx, ferry_decision *out) {
  (void)ud, (void)d, (void)ctx;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = 0;
  out->cacheable = 1;
  return FERRY_OK;
}

#endif
