/* test_device.c — "device" memory for the engine tests on the host backend:
 * ordinary heap memory, which is what device memory is on that backend.
 * (The cuda double build replaces this file with one over its cudaMalloc.) */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "test_device.h"

int test_device_ready(char *why, size_t len) {
  (void)why, (void)len;
  return 1;
}

void *test_dev_malloc(size_t bytes) { return malloc(bytes ? bytes : 1); }
void test_dev_free(void *p) { free(p); }
void test_dev_write(void *dev, const void *src, size_t bytes) { memcpy(dev, src, bytes); }
void test_dev_read(void *dst, const void *dev, size_t bytes) { memcpy(dst, dev, bytes); }
