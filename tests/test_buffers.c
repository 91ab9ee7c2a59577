/* test_buffers.c — refcounted test buffers used as owner tokens, and the
 * engine callbacks over them. Counters are atomic: pack and unpack run on
 * different threads in the threaded tests. */
#include <stdatomic.h>
#include <stdlib.h>

#include "test.h"
#include "test_device.h"

static atomic_long live_buffers;

long test_buffers_live(void) { return atomic_load(&live_buffers); }

test_buffer *test_buffer_new(size_t bytes) {
  test_buffer *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->ptr = test_dev_malloc(bytes);
  b->bytes = bytes;
  atomic_init(&b->refs, 1);
  atomic_fetch_add(&live_buffers, 1);
  return b;
}

/* Drop one reference; the buffer is freed with the last. Returns 1 then. */
int test_buffer_unref(test_buffer *b) {
  if (atomic_fetch_sub(&b->refs, 1) == 1) {
    test_dev_free(b->ptr);
    free(b);
    atomic_fetch_sub(&live_buffers, 1);
    return 1;
  }
  return 0;
}

int test_device_alloc_cb(void *ud, uint64_t bytes, void *stream, void **device_ptr,
                         void **owner) {
  test_device_stats *st = ud;
  if (st && atomic_load(&st->alloc_failures_to_inject) > 0) {
    atomic_fetch_sub(&st->alloc_failures_to_inject, 1);
    return -1;
  }
  test_buffer *b = test_buffer_new((size_t)bytes);
  if (!b) return -1;
  if (st) atomic_fetch_add(&st->allocs, 1);
  *device_ptr = b->ptr;
  *owner = b;
  return 0;
}

void test_device_release_cb(void *ud, void *owner) {
  test_device_stats *st = ud;
  if (st) atomic_fetch_add(&st->releases, 1);
  test_buffer_unref(owner);
}

void test_device_retain_cb(void *ud, void *owner) {
  test_device_stats *st = ud;
  test_buffer *b = owner;
  if (st) atomic_fetch_add(&st->retains, 1);
  atomic_fetch_add(&b->refs, 1);
}

ferry_config test_engine_config(test_device_stats *st) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.callback_ud = st;
  return c;
}
