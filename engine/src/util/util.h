/* util.h — small helpers every room uses: growing arrays, a 64-bit hash
 * mixer, the monotonic clock. Header-only: each is a few lines, inlined. */
#ifndef FERRY_UTIL_H
#define FERRY_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Makes room for need elements of elem bytes in *arr (capacity *cap,
 * doubled from first, at least 1); 0, or -1 out of memory or past 2^31. */
static inline int util_grow(void **arr, uint32_t *cap, size_t elem, uint32_t need,
                            uint32_t first) {
  if (need <= *cap) return 0;
  uint32_t ncap = *cap ? *cap : (first ? first : 1);
  while (ncap < need) {
    if (ncap > UINT32_MAX / 2) return -1;
    ncap *= 2;
  }
  void *n = realloc(*arr, (size_t)ncap * elem);
  if (!n) return -1;
  *arr = n;
  *cap = ncap;
  return 0;
}

/* As util_grow, the array aligned to align bytes (a power of two, a multiple
 * of sizeof(void *)): realloc keeps only malloc's 16 (glibc gives a large
 * block page + 16), so 64-byte records would each straddle two cache lines.
 * The old contents (*cap elements) are copied. */
static inline int util_grow_aligned(void **arr, uint32_t *cap, size_t elem, uint32_t need,
                                    uint32_t first, size_t align) {
  if (need <= *cap) return 0;
  uint32_t ncap = *cap ? *cap : (first ? first : 1);
  while (ncap < need) {
    if (ncap > UINT32_MAX / 2) return -1;
    ncap *= 2;
  }
  void *n = NULL;
  if (posix_memalign(&n, align, (size_t)ncap * elem)) return -1;
  if (*arr) memcpy(n, *arr, (size_t)*cap * elem);
  free(*arr);
  *arr = n;
  *cap = ncap;
  return 0;
}

/* murmur3's 64-bit finalizer: every input bit affects every output bit, so
 * the low bits index an open-addressing table well. */
static inline uint64_t util_mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* CLOCK_MONOTONIC in nanoseconds. */
/* An address's slot in a direct-mapped table of 2^bits slots. One
 * multiply-shift alone maps addresses in arithmetic progression (strdup'd
 * strings 48 bytes apart, as ferry_intern makes them) onto a few slots for
 * many strides, and then every lookup misses; the xor-shift between two
 * multiplies spreads them as util_mix64 does, for fewer instructions. */
static inline uint32_t util_ptr_slot(const void *ptr, unsigned bits) {
  uint64_t x = (uint64_t)(uintptr_t)ptr * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return (uint32_t)((x * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

static inline uint64_t util_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CLOCK_MONOTONIC in microseconds. */
static inline double util_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

#endif
