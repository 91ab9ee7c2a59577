/* test_stash_fixture.h — the stash tests' fixture (an engine over the test
 * device with a keep/offload/random decider), seeded buffers packed and
 * checked on unpack, and the quiescence check, shared by test_stash*.c and
 * test_trace_recorder.c. */
#ifndef FERRY_TEST_STASH_FIXTURE_H
#define FERRY_TEST_STASH_FIXTURE_H

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "test_device.h"

/* ---- fixtures ---------------------------------------------------------- */
typedef struct decider {
  uint64_t rng;
  int mode; /* 0 keep, 1 offload, 2 random */
  int reload;
  int distance;
  atomic_long calls;
} decider;

static inline uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline int decide_cb(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                     ferry_decision *out) {
  decider *x = ud;
  atomic_fetch_add(&x->calls, 1);
  out->action = x->mode == 2 ? (int)(rng_next(&x->rng) & 1) : x->mode;
  out->reload = x->reload;
  out->prefetch_distance = x->distance;
  out->cacheable = 0;
  return 0;
}

typedef struct fixture {
  ferry_engine *e;
  test_device_stats dev;
  decider dec;
} fixture;

static inline ferry_config fixture_config(fixture *f, int mode) {
  memset(f, 0, sizeof *f);
  f->dec.mode = mode;
  f->dec.rng = 42;
  f->dec.distance = -1;
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.retain = test_device_retain_cb;
  c.callback_ud = &f->dev;
  c.decide = decide_cb;
  c.decide_ud = &f->dec;
  c.min_offload_bytes = 1;
  return c;
}

static inline int fixture_open(fixture *f, ferry_config *c) {
  char err[512] = "";
  int rc = ferry_engine_create(c, &f->e, err, sizeof err);
  if (rc) fprintf(stderr, "engine create failed: %s\n", err);
  return rc;
}

/* FNV-1a over 64-bit words, then the tail bytes: fast enough for MBs. */
static inline uint64_t fnv(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull, w;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static inline void fill(test_buffer *b, uint64_t seed) {
  unsigned char *tmp = malloc(b->bytes);
  for (size_t i = 0; i < b->bytes; i += 8) {
    uint64_t r = rng_next(&seed);
    memcpy(tmp + i, &r, b->bytes - i < 8 ? b->bytes - i : 8);
  }
  test_dev_write(b->ptr, tmp, b->bytes);
  free(tmp);
}

static inline uint64_t dev_checksum(const void *dev, size_t bytes) {
  unsigned char *tmp = malloc(bytes);
  test_dev_read(tmp, dev, bytes);
  uint64_t h = fnv(tmp, bytes);
  free(tmp);
  return h;
}

static inline ferry_tensor_desc desc_of(size_t bytes, int layer) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.kind = FERRY_KIND_ACTIVATION;
  d.ndim = 1;
  d.shape[0] = (int64_t)bytes;
  d.layer = layer;
  d.layer_count = 8;
  d.module_path = "model.layers.0.mlp";
  d.module_class = "MLP";
  return d;
}

/* Pack a fresh buffer of `bytes` filled from seed; hands our reference to
 * the engine. Returns the handle (0 on failure) and its checksum. */
static inline ferry_handle pack_new(fixture *f, size_t bytes, uint64_t seed, uint64_t *sum) {
  test_buffer *b = test_buffer_new(bytes);
  fill(b, seed);
  *sum = dev_checksum(b->ptr, bytes);
  ferry_tensor_desc d = desc_of(bytes, (int)(seed % 8));
  ferry_handle h = 0;
  if (ferry_pack(f->e, &d, b->ptr, b, NULL, &h) != FERRY_OK) {
    fprintf(stderr, "pack failed: %s\n", ferry_last_error(f->e));
    test_buffer_unref(b);
    return 0;
  }
  return h;
}

/* Unpack h, compare with sum, drop the reference we get. */
static inline int unpack_check(fixture *f, ferry_handle h, size_t bytes, uint64_t sum) {
  void *dev = NULL, *owner = NULL;
  int rc = ferry_unpack(f->e, h, NULL, &dev, &owner);
  if (rc) {
    fprintf(stderr, "unpack failed: %s\n", ferry_last_error(f->e));
    return 1;
  }
  test_buffer *b = owner;
  CHECK(b->ptr == dev);
  CHECK(b->bytes >= bytes);
  CHECK(dev_checksum(dev, bytes) == sum);
  test_device_release_cb(&f->dev, owner);
  return 0;
}

static inline int check_quiescent(fixture *f) {
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f->e, &s, sizeof s));
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.arena_in_use, 0);
  CHECK_EQ(s.device_bytes_held, 0);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

/* desc_of's tensor in a module of its own layer, as real module paths are */
static inline ferry_tensor_desc desc_in_layer(size_t bytes, int layer) {
  static char paths[8][32];
  snprintf(paths[layer], sizeof paths[layer], "model.layers.%d.mlp", layer);
  ferry_tensor_desc d = desc_of(bytes, layer);
  d.module_path = paths[layer];
  return d;
}

#endif
