/* test_crc32.c — the archives' CRC-32 (zipw_crc32): libdeflate's where
 * libdeflate.so.0 is found, zlib's otherwise. Whichever runs must give
 * zlib's crc32 for any bytes, length, alignment and split into pieces (the
 * writer checksums a piece at a time); the data descriptor of every entry
 * holds it, and torch.load checks it. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <zlib.h>

#include "ferry_tools.h"
#include "test.h"

static uint64_t next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TEST(zip_crc32_matches_zlib) {
  void *lib = dlopen("libdeflate.so.0", RTLD_NOW | RTLD_LOCAL);
  const char *impl = zipw_crc32_impl();
  printf("  CRC-32 by %s\n", impl);
  const char *forced = getenv("FERRY_CRC32");
  /* Found where installed: the faster one is not silently lost. A
   * libdeflate.so.0 without the symbol (another ABI) falls back to zlib. */
  int usable = lib && dlsym(lib, "libdeflate_crc32");
  if (usable && !(forced && strcmp(forced, "zlib") == 0)) CHECK(strcmp(impl, "libdeflate") == 0);
  if (lib && !usable) CHECK(strcmp(impl, "zlib") == 0);
  if (lib) dlclose(lib);

  enum { MAX = (1 << 20) + 77 };
  unsigned char *buf = malloc(MAX + 64);
  CHECK(buf);
  uint64_t s = 42;
  for (size_t i = 0; i < MAX + 64; i++) buf[i] = (unsigned char)next(&s);
  CHECK_EQ(zipw_crc32(0, buf, 0), 0);
  /* Every length up to 300 at every alignment in a cache line... */
  for (size_t off = 0; off < 64; off++)
    for (size_t n = 0; n <= 300; n++)
      CHECK_EQ(zipw_crc32(0, buf + off, n), (uint32_t)crc32_z(0, buf + off, n));
  /* ...odd and large lengths, whole and in random pieces. */
  for (int round = 0; round < 200; round++) {
    size_t off = next(&s) % 64, n = next(&s) % (round < 100 ? 70000 : MAX);
    uint32_t want = (uint32_t)crc32_z(0, buf + off, n);
    CHECK_EQ(zipw_crc32(0, buf + off, n), want);
    uint32_t crc = 0;
    for (size_t done = 0; done < n;) {
      size_t piece = 1 + next(&s) % (n / 3 + 1);
      if (piece > n - done) piece = n - done;
      crc = zipw_crc32(crc, buf + off + done, piece);
      done += piece;
    }
    CHECK_EQ(crc, want);
  }
  /* All zeros and all ones (a table slip often shows only there). */
  memset(buf, 0, MAX);
  CHECK_EQ(zipw_crc32(0, buf, MAX), (uint32_t)crc32_z(0, buf, MAX));
  memset(buf, 0xff, MAX);
  CHECK_EQ(zipw_crc32(0, buf, MAX), (uint32_t)crc32_z(0, buf, MAX));
  free(buf);
  return 0;
}
