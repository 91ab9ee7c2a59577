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

/* snapshot_pipe.c: the windows' writes on a thread of their own (the
 * "write thread"), so that the writer fills and checksums window k+1 while
 * the disk takes window k; the writer's CPU then overlaps the disk's time
 * instead of adding to it (issue 37: niced, the writer gets a tenth of a
 * core when every core is busy). Writes finish in the order they were
 * submitted; after a failed one the rest are not written. Without a write
 * thread (it could not be created, FERRY_SNAPSHOT_WRITE_THREAD=0,
 * ferry_snapshot_set_write_thread(0)) each submit writes at once. */
#include <pthread.h>
typedef struct snap_write {
  uint32_t slot;
  void *buf;
  size_t len, cap;
  uint64_t off;
  int err;
} snap_write;

typedef struct snap_pipe {
  snap_out *o; /* the write thread's while it runs */
  snap_write *ring; /* n entries: at most one write per slot in flight */
  uint32_t n;
  uint64_t submitted, written, reaped; /* counts; ring index = count % n */
  int threaded, stopping;
  int err; /* the first failed write's errno; later ones are skipped */
  const char *failed_op;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* a write submitted or done, or stopping */
} snap_pipe;

/* n: how many writes may be in flight (the snapshot's slots). 0 or ENOMEM. */
int snap_pipe_start(snap_pipe *p, snap_out *o, uint32_t n);
/* Hands the window buf[0, len) (buf holds cap bytes) at file offset off to
 * the write thread; the slot is not touched again until it is reaped. */
void snap_pipe_submit(snap_pipe *p, uint32_t slot, void *buf, size_t len, size_t cap,
                      uint64_t off);
/* The oldest write not yet reaped, once it is done: 1, its slot in *slot and
 * its errno (0: written) in *err. 0 when none is done yet (block: waits for
 * one, unless none is in flight). */
int snap_pipe_reap(snap_pipe *p, int block, uint32_t *slot, int *err);
/* Writes submitted and not yet reaped. */
int snap_pipe_in_flight(snap_pipe *p);
/* Waits for the write in progress, skips the ones not started, ends the
 * write thread. The first failed write's errno (and p->failed_op), or 0. */
int snap_pipe_stop(snap_pipe *p);

#endif
