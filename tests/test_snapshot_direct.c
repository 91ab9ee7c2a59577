/* test_snapshot_direct.c — checkpoint staging's file image (issue 37, item
 * 10): the staged image is written with O_DIRECT on a disk file system and
 * buffered on tmpfs or when the kernel refuses O_DIRECT, and every way gives
 * the file the streaming zip writer gives (byte for byte; that writer's file
 * is torch.save's: tests/python/test_checkpoint_container.py). Odd sizes:
 * empty records, sizes not a multiple of the block, host records between
 * device ones, windows smaller than a record (a small cap). Runs over
 * whichever backend FERRY_TEST_BACKEND names. */
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#include "test_reference_zip.h"

#define TMPFS_MAGIC_ 0x01021994

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

typedef struct dstate {
  size_t n;
  ferry_snapshot_record rec[12];
  char names[12][32];
  void *dev[12];
  unsigned char *bytes[12];
} dstate;

/* Sizes that cross block and window edges: empty, 1 byte, a block less
 * one, a block plus one, megabytes plus odd bytes; records 2 and 7 host. */
static const uint64_t odd_sizes[12] = {0,        1,       4095,          4097,
                                       1 << 20, 0,       (3u << 20) + 77, 12345,
                                       64,      4096,    (5u << 20) + 1, 3};

static int dstate_make(dstate *st, uint64_t seed) {
  memset(st, 0, sizeof *st);
  st->n = 12;
  uint64_t rng = seed;
  for (size_t i = 0; i < st->n; i++) {
    uint64_t b = odd_sizes[i];
    snprintf(st->names[i], sizeof st->names[i], "ckpt/data/%zu", i);
    if (!(st->bytes[i] = malloc(b ? b : 1))) return -1;
    for (uint64_t k = 0; k < b; k++) st->bytes[i][k] = (unsigned char)splitmix(&rng);
    st->rec[i] = (ferry_snapshot_record){.name = st->names[i], .bytes = b};
    if (place_record(&st->rec[i], &st->dev[i], st->bytes[i], b, i == 2 || i == 7)) return -1;
  }
  return 0;
}

static void dstate_free(dstate *st) {
  for (size_t i = 0; i < st->n; i++) {
    free(st->bytes[i]);
    if (st->dev[i]) test_dev_free(st->dev[i]);
  }
}

/* The reference: the same records through the streaming zip writer. */
static int write_reference(const char *path, const dstate *st) {
  return write_reference_zip(path, st->rec, st->bytes, st->n);
}

typedef struct run_result {
  uint64_t direct, buffered; /* this snapshot's bytes, from the stats */
} run_result;

/* One snapshot of st to dir/name with the given cap (0: none), compared with
 * the reference file; the bytes written each way in *out. */
static int snapshot_once(const char *dir, const char *name, const dstate *st, uint64_t cap,
                         const char *reference, run_result *out) {
  test_device_stats dev = {0};
  ferry_config c = test_engine_config(&dev);
  c.retain = test_device_retain_cb;
  c.host_cap_bytes = cap;
  ferry_engine *e = NULL;
  char err[512], path[256];
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "engine: %s\n", err);
    return -1;
  }
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ferry_snapshot *s = NULL;
  int rc = ferry_snapshot_start(e, path, st->rec, st->n, NULL, &s);
  if (!rc) rc = ferry_snapshot_fence(s, NULL);
  if (!rc) rc = ferry_snapshot_wait(s);
  if (rc) fprintf(stderr, "snapshot %s: %s%s\n", path, s ? ferry_snapshot_error(s) : "",
                  s ? "" : ferry_last_error(e));
  ferry_snapshot_free(s);
  ferry_stats fs;
  ferry_get_stats(e, &fs, sizeof fs);
  out->direct = fs.snapshot_bytes_direct;
  out->buffered = fs.snapshot_bytes_buffered;
  uint64_t in_use = fs.arena_in_use;
  ferry_engine_destroy(e);
  if (rc || in_use) return -1;
  if (same_file(path, reference)) return -1;
  if ((uint64_t)file_size(path) != out->direct + out->buffered) {
    fprintf(stderr, "%s: %lld bytes, stats say %llu direct + %llu buffered\n", path,
            file_size(path), (unsigned long long)out->direct,
            (unsigned long long)out->buffered);
    return -1;
  }
  return 0;
}

static int is_tmpfs(const char *dir) {
  struct statfs sf;
  return statfs(dir, &sf) == 0 && (unsigned long)sf.f_type == TMPFS_MAGIC_;
}

static void remove_tree(const char *dir) {
  char cmd[320];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* On a disk file system (/tmp here; ext4 in CI) every window goes out with
 * O_DIRECT, whole image and windows smaller than records alike; the file is
 * the streaming writer's. The same with O_DIRECT turned off: buffered. */
TEST(snapshot_direct_on_disk) {
  char dir[] = "/var/tmp/ferry-direct-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  if (is_tmpfs(dir)) {
    printf("  skipped: %s is tmpfs here (no disk file system to write to)\n", dir);
    remove_tree(dir);
    return 0;
  }
  dstate st;
  CHECK(dstate_make(&st, 7) == 0);
  char ref[256];
  snprintf(ref, sizeof ref, "%s/reference.pt", dir);
  CHECK(write_reference(ref, &st) == 0);
  long long size = file_size(ref);
  CHECK(size > 0 && size % 4096 != 0); /* a partial last block: padded, then cut */

  run_result r;
  ferry_snapshot_set_direct_io(FERRY_SNAP_DIO_AUTO);
  CHECK(snapshot_once(dir, "whole.pt", &st, 0, ref, &r) == 0);
  CHECK_EQ(r.direct, size); /* every byte, none through the page cache */
  CHECK_EQ(r.buffered, 0);
  /* a 1 MiB cap: 256 KiB-1 MiB windows, records split over several */
  CHECK(snapshot_once(dir, "chunked.pt", &st, 1u << 20, ref, &r) == 0);
  CHECK_EQ(r.direct, size);
  CHECK_EQ(r.buffered, 0);

  ferry_snapshot_set_direct_io(FERRY_SNAP_DIO_OFF);
  int rc = snapshot_once(dir, "buffered.pt", &st, 0, ref, &r);
  ferry_snapshot_set_direct_io(FERRY_SNAP_DIO_AUTO);
  CHECK(rc == 0);
  CHECK_EQ(r.direct, 0);
  CHECK_EQ(r.buffered, size);
  dstate_free(&st);
  remove_tree(dir);
  return 0;
}

/* tmpfs (/dev/shm) is written buffered (its pages are the file); a kernel
 * that refuses O_DIRECT (EINVAL on the first write, simulated) makes the
 * snapshot go on buffered, from that window on, with the same file. */
TEST(snapshot_direct_falls_back) {
  dstate st;
  CHECK(dstate_make(&st, 8) == 0);
  char shm[] = "/dev/shm/ferry-direct-XXXXXX";
  int have_shm = mkdtemp(shm) != NULL && is_tmpfs(shm);
  if (have_shm) {
    char ref[256];
    snprintf(ref, sizeof ref, "%s/reference.pt", shm);
    CHECK(write_reference(ref, &st) == 0);
    run_result r;
    CHECK(snapshot_once(shm, "ckpt.pt", &st, 0, ref, &r) == 0);
    CHECK_EQ(r.direct, 0);
    CHECK_EQ(r.buffered, file_size(ref));
    remove_tree(shm);
  } else {
    printf("  tmpfs part skipped: no tmpfs at /dev/shm\n");
  }

  char dir[] = "/var/tmp/ferry-direct-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char ref[256];
  snprintf(ref, sizeof ref, "%s/reference.pt", dir);
  CHECK(write_reference(ref, &st) == 0);
  run_result r;
  ferry_snapshot_set_direct_io(FERRY_SNAP_DIO_REFUSED);
  int rc = snapshot_once(dir, "refused.pt", &st, 1u << 20, ref, &r);
  ferry_snapshot_set_direct_io(FERRY_SNAP_DIO_AUTO);
  CHECK(rc == 0);
  CHECK_EQ(r.direct, 0);
  CHECK_EQ(r.buffered, file_size(ref));
  dstate_free(&st);
  remove_tree(dir);
  return 0;
}

/* The layout computed at start (where the staging copies put the device
 * bytes) agrees with what the zip writer then writes around them, also
 * with ZIP64 fields in the headers (a lowered threshold) and for many
 * small records whose central directory spans windows. */
TEST(snapshot_direct_layouts) {
  char dir[] = "/var/tmp/ferry-direct-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  dstate st;
  CHECK(dstate_make(&st, 9) == 0);
  char ref[256];
  snprintf(ref, sizeof ref, "%s/reference.pt", dir);
  run_result r;
  zipw_set_zip64_threshold(4000);
  int rc = write_reference(ref, &st);
  if (!rc) rc = snapshot_once(dir, "zip64.pt", &st, 1u << 20, ref, &r);
  zipw_set_zip64_threshold(0);
  CHECK(rc == 0);
  dstate_free(&st);

  /* 6000 device records of 1-300 bytes: headers dominate the image */
  size_t n = 6000;
  ferry_snapshot_record *rec = calloc(n, sizeof *rec);
  char (*names)[24] = calloc(n, sizeof *names);
  unsigned char *bytes = malloc(n * 300);
  void *dev = test_dev_malloc(n * 300);
  CHECK(rec && names && bytes && dev);
  uint64_t rng = 5;
  for (size_t i = 0; i < n * 300; i++) bytes[i] = (unsigned char)splitmix(&rng);
  test_dev_write(dev, bytes, n * 300);
  unsigned char **data = calloc(n, sizeof *data);
  CHECK(data);
  for (size_t i = 0; i < n; i++) {
    snprintf(names[i], sizeof names[i], "m/data/%zu", i);
    rec[i] = (ferry_snapshot_record){.name = names[i], .bytes = 1 + i % 300,
                                     .device_ptr = (char *)dev + i * 300};
    data[i] = bytes + i * 300;
  }
  CHECK_EQ(write_reference_zip(ref, rec, data, n), 0);
  free(data);
  test_device_stats ds = {0};
  ferry_config c = test_engine_config(&ds);
  c.retain = test_device_retain_cb;
  c.host_cap_bytes = 1u << 20;
  ferry_engine *e = NULL;
  char msg[512], path[256];
  CHECK_OK(ferry_engine_create(&c, &e, msg, sizeof msg));
  snprintf(path, sizeof path, "%s/many.pt", dir);
  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(e, path, rec, n, NULL, &s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  rc = ferry_snapshot_wait(s);
  if (rc) fprintf(stderr, "%s\n", ferry_snapshot_error(s));
  ferry_snapshot_free(s);
  ferry_engine_destroy(e);
  CHECK_OK(rc);
  CHECK(same_file(path, ref) == 0);
  test_dev_free(dev);
  free(bytes);
  free(names);
  free(rec);
  remove_tree(dir);
  return 0;
}
