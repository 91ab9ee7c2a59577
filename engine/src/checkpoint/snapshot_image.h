/*
 * snapshot_image.h — a snapshot's file laid out ahead (where each record's
 * data lands in the zip archive) and the output of the staged file image:
 * O_DIRECT writes of aligned windows where the file system takes them,
 * buffered writes where it does not (docs/internals.md#stagingc).
 */
#ifndef FERRY_SNAPSHOT_IMAGE_H
#define FERRY_SNAPSHOT_IMAGE_H

#include <stddef.h>
#include <stdint.h>

/* The file offset and the memory address of every O_DIRECT write are
 * multiples of this: the logical block size of every common disk (512 or
 * 4096) divides it. A file system that wants more refuses the write
 * (EINVAL) and the snapshot goes on buffered. */
#define SNAP_IMAGE_ALIGN ((size_t)4096)

typedef struct snap_record {
  char *name;
  void *host;      /* our copy of host_data */
  const void *dev; /* device bytes, staged through the arena */
  uint64_t bytes;
  uint64_t data_off; /* where the data lands in the file (snap_layout) */
  const void *src;   /* the caller's host_data, during start only */
  int placed;        /* host bytes copied into the image at start */
} snap_record;

/* Fills rec[i].data_off and *file_size: the layout zip_writer produces for
 * these records (the same code, run without data). 0 or an errno. */
int snap_layout(snap_record *rec, size_t n, uint64_t *file_size);

typedef struct snap_out {
  int fd;
  int direct;   /* O_DIRECT is set on fd */
  int wrote_direct; /* a direct write went through (FERRY_SNAP_DIO_REFUSED refuses the first) */
  int extended; /* a padded direct write may have grown the file past its size */
  uint64_t bytes_direct, bytes_buffered;
  const char *failed_op;
} snap_out;

/* Sets O_DIRECT on fd where it can help: not on tmpfs or ramfs (their
 * pages are the file: O_DIRECT is a copy there too, and kernels before 6.6
 * refuse it), not when ferry_snapshot_set_direct_io or the environment
 * (FERRY_SNAPSHOT_DIRECT=0) turned it off. */
void snap_out_init(snap_out *o, int fd);
/* Writes the window buf[0, len) at file offset off; buf holds cap bytes
 * (cap >= len rounded up to SNAP_IMAGE_ALIGN, for the padding of the last
 * window). A direct write the kernel refuses (EINVAL) turns O_DIRECT off and
 * is written again buffered, as every later window. 0 or an errno. */
int snap_out_write(snap_out *o, void *buf, size_t len, size_t cap, uint64_t off);
/* The file is file_size bytes long (cuts a padded last block). */
int snap_out_end(snap_out *o, uint64_t file_size);

/* snapshot_files.c: fsync of path's directory (0 or an errno); the
 * process's umask, read without changing it; "a directory", "a FIFO", ...
 * for a file that is not regular. */
#include <sys/types.h>
int snap_fsync_parent_dir(const char *path);
mode_t snap_process_umask(void);
const char *snap_file_type(mode_t m);

/* snapshot_pipe.c: lowers the calling writer thread's priority (nice
 * +10, normal scheduling; best effort). */
void snap_thread_to_background(void);

#endif
