/* test_snapshot_fixture.h — the snapshot tests' fixture (an engine that
 * offloads everything), the state to snapshot and what the archive must
 * hold, the archive checked with standard tools (python3's zipfile, `unzip
 * -t`), the tensor sizes, and a stash round trip; shared by the
 * test_snapshot*.c files that test checkpoint staging through the public API.
 * Runs over whichever backend FERRY_TEST_BACKEND names. */
#ifndef FERRY_TEST_SNAPSHOT_FIXTURE_H
#define FERRY_TEST_SNAPSHOT_FIXTURE_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

/* ---- fixtures -------------------------------------------------------------- */
static inline uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline void fill_random(unsigned char *p, size_t n, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng_next(&s);
    size_t k = n - i < 8 ? n - i : 8;
    memcpy(p + i, &v, k);
  }
}

static inline int offload_all(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                       ferry_decision *out) {
  (void)ud, (void)d, (void)ctx;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 0;
  return 0;
}

typedef struct fixture {
  ferry_engine *e;
  test_device_stats dev;
} fixture;

static inline ferry_config fixture_config(fixture *f) {
  memset(f, 0, sizeof *f);
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.retain = test_device_retain_cb;
  c.callback_ud = &f->dev;
  c.decide = offload_all;
  c.min_offload_bytes = 1;
  return c;
}

static inline int fixture_open(fixture *f, ferry_config *c) {
  char err[512] = "";
  int rc = ferry_engine_create(c, &f->e, err, sizeof err);
  if (rc) fprintf(stderr, "engine create failed: %s\n", err);
  return rc;
}

static inline uint64_t arena_in_use(ferry_engine *e) {
  ferry_stats st;
  ferry_get_stats(e, &st, sizeof st);
  return st.arena_in_use;
}

/* A scratch directory under /tmp, removed by the test at the end. */
static inline int make_dir(char *dir, size_t len) {
  snprintf(dir, len, "/tmp/ferry-snapshot-XXXXXX");
  return mkdtemp(dir) ? 0 : -1;
}

static inline void remove_dir(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static inline int file_exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

/* The snapshots' temporary files in dir (".NAME.ferry-XXXXXX"): how many,
 * and the size of the largest in *bytes (-1 if none). */
static inline int temp_files(const char *dir, long long *bytes) {
  DIR *d = opendir(dir);
  int n = 0;
  if (bytes) *bytes = -1;
  for (struct dirent *ent; d && (ent = readdir(d));) {
    if (ent->d_name[0] != '.' || !strstr(ent->d_name, ".ferry-")) continue;
    n++;
    char p[512];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, ent->d_name);
    if (bytes && stat(p, &st) == 0 && st.st_size > *bytes) *bytes = st.st_size;
  }
  if (d) closedir(d);
  return n;
}

/* The child of fork() starts threads (a new engine), which ThreadSanitizer
 * refuses after fork, and the link model that slows copies down is the host
 * backend's. */
static inline int fork_tests_supported(void) {
#if defined(__SANITIZE_THREAD__)
  printf("  fork part skipped: ThreadSanitizer does not support threads after fork\n");
  return 0;
#else
  if (test_backend_kind() != FERRY_BACKEND_HOST) {
    printf("  fork part skipped: needs the host backend (link model, fork-safe streams)\n");
    return 0;
  }
  return 1;
#endif
}

/* ---- the state to snapshot and what the archive must hold ------------------ */
typedef struct state {
  size_t n;
  ferry_snapshot_record *rec;
  char **names;
  void **dev;             /* device buffers (NULL for host records) */
  unsigned char **expect; /* the bytes as of the snapshot */
} state;

/* n records; sizes from size_of(i); every host_every-th record is host data
 * (0 = none). Device contents random, seeded by seed. */
static inline int state_make(state *st, size_t n, uint64_t (*size_of)(size_t, uint64_t *),
                      size_t host_every, uint64_t seed) {
  memset(st, 0, sizeof *st);
  st->n = n;
  st->rec = calloc(n, sizeof *st->rec);
  st->names = calloc(n, sizeof *st->names);
  st->dev = calloc(n, sizeof *st->dev);
  st->expect = calloc(n, sizeof *st->expect);
  if (!st->rec || !st->names || !st->dev || !st->expect) return -1;
  uint64_t rng = seed;
  for (size_t i = 0; i < n; i++) {
    uint64_t bytes = size_of(i, &rng);
    st->names[i] = malloc(48);
    snprintf(st->names[i], 48, "archive/data/%zu", i);
    st->expect[i] = malloc(bytes ? bytes : 1);
    if (!st->names[i] || !st->expect[i]) return -1;
    fill_random(st->expect[i], bytes, seed * 1000003u + i);
    st->rec[i].name = st->names[i];
    st->rec[i].bytes = bytes;
    if (host_every && i % host_every == 0) {
      st->rec[i].host_data = bytes ? st->expect[i] : NULL;
    } else if (bytes) {
      st->dev[i] = test_dev_malloc(bytes);
      if (!st->dev[i]) return -1;
      test_dev_write(st->dev[i], st->expect[i], bytes);
      st->rec[i].device_ptr = st->dev[i];
    }
  }
  return 0;
}

static inline void state_free(state *st) {
  for (size_t i = 0; i < st->n; i++) {
    free(st->names[i]);
    free(st->expect[i]);
    if (st->dev[i]) test_dev_free(st->dev[i]);
  }
  free(st->rec);
  free(st->names);
  free(st->dev);
  free(st->expect);
  memset(st, 0, sizeof *st);
}

/* Overwrite every device buffer (what an optimizer step does). */
static inline void state_scribble(state *st, uint64_t seed) {
  for (size_t i = 0; i < st->n; i++) {
    if (!st->dev[i]) continue;
    size_t bytes = (size_t)st->rec[i].bytes;
    unsigned char *tmp = malloc(bytes);
    fill_random(tmp, bytes, seed + i);
    test_dev_write(st->dev[i], tmp, bytes);
    free(tmp);
  }
}

/* ---- checking archives with standard tools ---------------------------------- */
static const char check_py[] =
    "import struct, sys, zipfile\n"
    "path, manifest, blob = sys.argv[1:4]\n"
    "entries = []\n"
    "for line in open(manifest, encoding='utf-8').read().splitlines():\n"
    "    name, size = line.rsplit('\\t', 1)\n"
    "    entries.append((name, int(size)))\n"
    "data = open(blob, 'rb').read()\n"
    "with zipfile.ZipFile(path) as z, open(path, 'rb') as raw:\n"
    "    bad = z.testzip()\n"
    "    if bad is not None: sys.exit('CRC mismatch in ' + bad)\n"
    "    names = z.namelist()\n"
    "    if names != [n for n, _ in entries]:\n"
    "        sys.exit('names differ: %r... vs %r...' % (names[:3], entries[:3]))\n"
    "    off = 0\n"
    "    for name, size in entries:\n"
    "        info = z.getinfo(name)\n"
    "        if info.compress_type != zipfile.ZIP_STORED: sys.exit(name + ' is compressed')\n"
    "        if info.file_size != size: sys.exit('%s: %d bytes, want %d' % (name, info.file_size, size))\n"
    "        if z.read(name) != data[off:off + size]: sys.exit(name + ': contents differ')\n"
    "        raw.seek(info.header_offset)\n"
    "        h = raw.read(30)\n"
    "        nlen, xlen = struct.unpack('<HH', h[26:30])\n"
    "        start = info.header_offset + 30 + nlen + xlen\n"
    "        if start % 64: sys.exit(name + ': data not 64-byte aligned')\n"
    "        off += size\n"
    "print('zipfile ok: %d entries' % len(entries))\n";

/* Write the expected entries next to the archive and have Python compare. */
static inline int check_archive_bytes(const char *dir, const char *path, size_t n,
                               const ferry_snapshot_record *rec, unsigned char *const *expect) {
  char script[512], manifest[512], blob[512], cmd[2048];
  snprintf(script, sizeof script, "%s/check.py", dir);
  snprintf(manifest, sizeof manifest, "%s/expect.manifest", dir);
  snprintf(blob, sizeof blob, "%s/expect.blob", dir);
  FILE *f = fopen(script, "w");
  if (!f) return -1;
  fputs(check_py, f);
  fclose(f);
  FILE *m = fopen(manifest, "w"), *b = fopen(blob, "wb");
  if (!m || !b) return -1;
  for (size_t i = 0; i < n; i++) {
    fprintf(m, "%s\t%llu\n", rec[i].name, (unsigned long long)rec[i].bytes);
    if (rec[i].bytes) fwrite(expect[i], 1, (size_t)rec[i].bytes, b);
  }
  fclose(m);
  fclose(b);
  snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s' '%s'", script, path, manifest, blob);
  int rc = system(cmd);
  if (rc != 0) {
    fprintf(stderr, "python zipfile check of %s failed (status %d)\n", path, rc);
    return -1;
  }
  if (n == 0) return 0; /* unzip warns about an empty archive */
  if (system("command -v unzip >/dev/null 2>&1") == 0) {
    snprintf(cmd, sizeof cmd, "unzip -tq '%s' >/dev/null", path);
    if ((rc = system(cmd)) != 0) {
      fprintf(stderr, "unzip -t %s failed (status %d)\n", path, rc);
      return -1;
    }
  } else {
    printf("  (unzip not installed: only Python's zipfile checked the archive)\n");
  }
  return 0;
}

static inline int check_archive(const char *dir, const char *path, const state *st) {
  return check_archive_bytes(dir, path, st->n, st->rec, st->expect);
}

/* ---- sizes ------------------------------------------------------------------- */
static inline uint64_t size_random(size_t i, uint64_t *rng) {
  uint64_t r = rng_next(rng);
  if (i % 17 == 3) return 0;                      /* empty records */
  if (i % 5 == 0) return 1 + r % 64;              /* tiny (biases, pickles) */
  return 1 + r % (512 * 1024);                    /* up to half a megabyte */
}
static inline uint64_t size_1m(size_t i, uint64_t *rng) { (void)i, (void)rng; return 1u << 20; }
static inline uint64_t size_4m(size_t i, uint64_t *rng) { (void)i, (void)rng; return 4u << 20; }
static inline uint64_t size_tiny(size_t i, uint64_t *rng) { (void)rng; return 1 + i % 7; }
static inline uint64_t size_mixed_big(size_t i, uint64_t *rng) {
  (void)rng;
  return i == 3 ? (20u << 20) + 12345 : (3u << 20) + 77 * i; /* one far larger than the cap */
}

/* Pack/unpack round trip: the stash still works after a failed snapshot. */
static inline int stash_round_trip(ferry_engine *e, size_t bytes, uint64_t seed) {
  test_buffer *b = test_buffer_new(bytes);
  unsigned char *want = malloc(bytes), *got = malloc(bytes);
  fill_random(want, bytes, seed);
  test_dev_write(b->ptr, want, bytes);
  ferry_tensor_desc d = {.bytes = bytes, .dtype = FERRY_DTYPE_U8, .ndim = 1, .layer = -1};
  d.shape[0] = (int64_t)bytes;
  ferry_handle h;
  int rc = ferry_step_begin(e);
  if (!rc) rc = ferry_pack(e, &d, b->ptr, b, NULL, &h);
  void *ptr = NULL, *owner = NULL;
  if (!rc) rc = ferry_unpack(e, h, NULL, &ptr, &owner);
  if (!rc) {
    test_dev_read(got, ptr, bytes);
    if (memcmp(got, want, bytes) != 0) rc = -100;
    test_buffer_unref(owner);
  }
  if (!rc) rc = ferry_step_end(e);
  free(want);
  free(got);
  return rc;
}

#endif
