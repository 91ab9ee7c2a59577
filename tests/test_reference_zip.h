/* test_reference_zip.h — the reference a snapshot test compares its file
 * with (the same records written by the streaming zip writer), and the
 * byte-for-byte comparison of two files. */
#ifndef FERRY_TEST_REFERENCE_ZIP_H
#define FERRY_TEST_REFERENCE_ZIP_H

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test_device.h"

/* Writes rec[0..n) (names and sizes) with the bytes data[i] to path;
 * 0 on success. */
static inline int write_reference_zip(const char *path, const ferry_snapshot_record *rec,
                                      unsigned char *const *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  zip_writer z;
  int err = zipw_init(&z, fd);
  for (size_t i = 0; i < n && !err; i++) {
    err = zipw_begin_entry(&z, rec[i].name, rec[i].bytes);
    if (!err) err = zipw_write(&z, data[i], (size_t)rec[i].bytes);
    if (!err) err = zipw_end_entry(&z);
  }
  if (!err) err = zipw_finish(&z);
  zipw_free(&z);
  close(fd);
  return err ? -1 : 0;
}

/* Record i of a test state: its bytes as a host record, or copied to a
 * new device buffer (*dev) as a device record; an empty one is neither. */
static inline int place_record(ferry_snapshot_record *r, void **dev, unsigned char *bytes,
                               uint64_t b, int on_host) {
  if (on_host) {
    r->host_data = bytes;
  } else if (b) {
    if (!(*dev = test_dev_malloc(b))) return -1;
    test_dev_write(*dev, bytes, b);
    r->device_ptr = *dev;
  }
  return 0;
}

static inline long long file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (long long)sb.st_size : -1;
}

/* 0 when the two files hold the same bytes; else says where they differ. */
static inline int same_file(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int rc = fa && fb ? 0 : -1;
  long long at = 0;
  for (int ca, cb; rc == 0; at++) {
    ca = fgetc(fa);
    cb = fgetc(fb);
    if (ca != cb) {
      fprintf(stderr, "%s and %s differ at byte %lld (%d vs %d)\n", a, b, at, ca, cb);
      rc = -1;
    }
    if (ca == EOF) break;
  }
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return rc;
}

#endif
