/*
 * snapshot_image.c — a snapshot's file image: its layout, computed when the
 * snapshot starts, and the writes of its windows (snapshot_image.h).
 */
#include "snapshot_image.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "ferry_tools.h"

#define TMPFS_MAGIC_ 0x01021994
#define RAMFS_MAGIC_ 0x858458f6

static _Atomic int dio_mode = FERRY_SNAP_DIO_AUTO;

void ferry_snapshot_set_direct_io(int mode) { atomic_store(&dio_mode, mode); }

int snap_layout(snap_record *rec, size_t n, uint64_t *file_size) {
  zip_writer z;
  int err = zipw_init(&z, -1);
  for (size_t i = 0; i < n && !err; i++) {
    err = zipw_begin_entry(&z, rec[i].name, rec[i].bytes);
    rec[i].data_off = z.offset;
    if (!err) err = zipw_place(&z, NULL, (size_t)rec[i].bytes);
    if (!err) err = zipw_end_entry(&z);
    z.buf_len = 0; /* the bytes are not wanted, only where they go */
  }
  if (!err) err = zipw_finish(&z);
  *file_size = z.offset;
  zipw_free(&z);
  return err;
}

void snap_out_init(snap_out *o, int fd) {
  memset(o, 0, sizeof *o);
  o->fd = fd;
  if (atomic_load(&dio_mode) == FERRY_SNAP_DIO_OFF) return;
  const char *env = getenv("FERRY_SNAPSHOT_DIRECT"); /* "0": buffered (docs/checkpoints.md) */
  if (env && strcmp(env, "0") == 0) return;
  struct statfs sf;
  if (fstatfs(fd, &sf) == 0 &&
      ((unsigned long)sf.f_type == TMPFS_MAGIC_ || (unsigned long)sf.f_type == RAMFS_MAGIC_))
    return;
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0) o->direct = 1;
}

static int pwrite_all(int fd, const unsigned char *p, size_t n, uint64_t off) {
  while (n) {
    ssize_t w = pwrite(fd, p, n, (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO; /* cannot happen for a regular file; never spin */
    p += w;
    n -= (size_t)w;
    off += (uint64_t)w;
  }
  return 0;
}

static void direct_off(snap_out *o) {
  int fl = fcntl(o->fd, F_GETFL);
  if (fl >= 0) fcntl(o->fd, F_SETFL, fl & ~O_DIRECT);
  o->direct = 0;
}

int snap_out_write(snap_out *o, void *buf, size_t len, size_t cap, uint64_t off) {
  size_t padded = (len + SNAP_IMAGE_ALIGN - 1) & ~(SNAP_IMAGE_ALIGN - 1);
  if (o->direct && (off % SNAP_IMAGE_ALIGN || (uintptr_t)buf % SNAP_IMAGE_ALIGN || padded > cap))
    direct_off(o); /* not expected: the windows are laid out aligned */
  if (o->direct) {
    /* the last window ends in a partial block: padded with zeros, cut by
     * snap_out_end */
    memset((unsigned char *)buf + len, 0, padded - len);
    o->extended |= padded > len;
    int err = atomic_load(&dio_mode) == FERRY_SNAP_DIO_REFUSED && !o->wrote_direct
                  ? EINVAL
                  : pwrite_all(o->fd, buf, padded, off);
    if (!err) {
      o->wrote_direct = 1;
      o->bytes_direct += len;
      return 0;
    }
    if (err != EINVAL) {
      o->failed_op = "write to";
      return err;
    }
    direct_off(o); /* refused (alignment the file system wants, or none): buffered */
  }
  int err = pwrite_all(o->fd, buf, len, off);
  if (err) {
    o->failed_op = "write to";
    return err;
  }
  o->bytes_buffered += len;
  return 0;
}

int snap_out_end(snap_out *o, uint64_t file_size) {
  if (o->extended && ftruncate(o->fd, (off_t)file_size) != 0) {
    o->failed_op = "ftruncate of";
    return errno;
  }
  return 0;
}
