/*
 * staging.c — checkpoint staging: copy training state into the pinned
 * arena on the engine's D2H stream and write it to disk as a zip archive on
 * a writer thread while training goes on (ferry.h, "checkpoint staging").
 * How it works: docs/internals.md#stagingc.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "ferry_tools.h"
#include "snapshot_image.h"

#define SNAP_CHUNK_MAX ((size_t)16 << 20) /* largest staging buffer */
#define SNAP_CHUNK_MIN ((size_t)256 << 10) /* smallest, unless the state is smaller */
#define SNAP_MAX_RECORD_BYTES (1ull << 50)
#define SNAP_MSG 768

typedef struct snap_slot {
  void *buf; /* in arena memory, SNAP_IMAGE_ALIGN-aligned; NULL once given back */
  size_t cap;
  bk_event *ev; /* recorded after the copies of the slot's current batch */
  void *mem;    /* the arena allocation holding buf */
  size_t mem_bytes; /* 0: mem is heap memory (the image's tail, take_slots) */
} snap_slot;

typedef struct snap_batch { /* a window of the file image */
  uint32_t slot;
  uint64_t len, start; /* the file's bytes [start, start + len) */
} snap_batch;

struct ferry_snapshot {
  ferry_engine *e; /* NULL once the engine was destroyed */
  ferry_snapshot *prev, *next; /* the engine's list, under the engine lock */
  /* path as given (messages name it, a busy path is told by it); the file
   * it replaces (itself, or the file its link names) and the temporary file
   * beside that: both set by the writer thread */
  char *path, *target, *tmp_path;
  snap_record *rec;
  size_t n;
  uint64_t dev_total; /* bytes of all device records */
  uint64_t file_size; /* of the archive (snap_layout), when dev_total */
  int fd;

  /* Staging. Owned by start, then by the writer thread alone, except that
   * issuing copies takes the engine lock. */
  snap_slot *slots;
  uint32_t n_slots;
  snap_batch *queue; /* ring of n_slots: batches issued, not yet written */
  uint32_t q_head, q_count;
  uint64_t issued;  /* bytes of the file image handed to slots so far */
  uint64_t dev_issued; /* bytes of device records whose copies were issued */
  size_t issue_rec; /* the next device bytes to copy */
  uint64_t issue_off;
  bk_event *last_issued_ev;

  struct snapshot_list *list; /* the engine's, for its writer threads */
  int to_idle;        /* every copy was issued at start: the writer runs niced */
  int thread_started; /* handed to a writer thread */

  pthread_mutex_t mu; /* guards what follows */
  pthread_cond_t cv;
  int issue_done;    /* no copy will be issued any more */
  bk_event *last_ev; /* event after the last copy, once issue_done */
  int done; /* the writer thread touches the snapshot no more */
  int rc;
  char msg[SNAP_MSG]; /* written once, before done is set */
};

/* ---- helpers ------------------------------------------------------------- */
static int start_fail(ferry_engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int start_fail(ferry_engine *e, int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  engine_lock(e);
  engine_fail(e, code, "ferry_snapshot_start: %s", msg);
  engine_unlock(e);
  return code;
}

/* Record the snapshot's failure (the first one wins; none after done). */
static int snap_fail(ferry_snapshot *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int snap_fail(ferry_snapshot *s, int code, const char *fmt, ...) {
  pthread_mutex_lock(&s->mu);
  if (s->rc == FERRY_OK && !s->done) {
    s->rc = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->msg, sizeof s->msg, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}

static int failed(ferry_snapshot *s) {
  pthread_mutex_lock(&s->mu);
  int rc = s->rc;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void snapshot_free_memory(ferry_snapshot *s) {
  for (size_t i = 0; i < s->n; i++) {
    free(s->rec[i].name);
    free(s->rec[i].host);
  }
  free(s->rec);
  free(s->slots);
  free(s->queue);
  free(s->path);
  free(s->target);
  free(s->tmp_path);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

/* ---- staging -------------------------------------------------------------- */
/* Take staging buffers from the arena: the whole file image if it fits,
 * else as much as the cap gives, halving the request on each refusal. Every
 * buffer is a multiple of SNAP_IMAGE_ALIGN, so every window of the file
 * starts aligned (O_DIRECT). A snapshot of host records only takes none. */
static int take_slots(ferry_snapshot *s) {
  ferry_engine *e = s->e;
  uint64_t remaining =
      s->dev_total ? (s->file_size + SNAP_IMAGE_ALIGN - 1) & ~(uint64_t)(SNAP_IMAGE_ALIGN - 1) : 0;
  size_t want = SNAP_CHUNK_MAX;
  uint32_t cap = 0;
  uint64_t arena_taken = 0;
  int heap_tail = engine_backend_kind(e) != FERRY_BACKEND_CUDA;
  while (remaining && !(heap_tail && arena_taken >= s->dev_total)) {
    size_t size = remaining < want ? (size_t)remaining : want;
    if (heap_tail && size > s->dev_total - arena_taken) /* no more than the device bytes */
      size = (size_t)((s->dev_total - arena_taken + SNAP_IMAGE_ALIGN - 1) & ~(uint64_t)(SNAP_IMAGE_ALIGN - 1));
    /* a power of two, which every arena's size classes hold exactly (4 MiB
     * and 2 KiB of headers would take jemalloc's 5 MiB class); the tail
     * under SNAP_CHUNK_MIN as it is */
    while (size > SNAP_CHUNK_MIN && (size & (size - 1))) size &= size - 1;
    void *p = ferry_arena_alloc(engine_arena(e), size);
    size_t mem_bytes = size, usable = size;
    if (p && (uintptr_t)p % SNAP_IMAGE_ALIGN) {
      /* pool blocks are 256-byte aligned, O_DIRECT wants 4096: stage a
       * block less from the next boundary (a block more may pass the cap) */
      if (size >= 2 * SNAP_IMAGE_ALIGN) {
        usable = size - SNAP_IMAGE_ALIGN;
      } else {
        ferry_arena_free(engine_arena(e), p, size);
        mem_bytes = size + SNAP_IMAGE_ALIGN;
        p = ferry_arena_alloc(engine_arena(e), mem_bytes);
      }
    }
    if (!p) {
      if (size <= SNAP_CHUNK_MIN) break;
      want = size / 2;
      continue;
    }
    if (s->n_slots == cap) {
      uint32_t ncap = cap ? cap * 2 : 16;
      snap_slot *n = realloc(s->slots, ncap * sizeof *n);
      if (!n) {
        ferry_arena_free(engine_arena(e), p, mem_bytes);
        return FERRY_ENOMEM;
      }
      s->slots = n;
      cap = ncap;
    }
    uintptr_t aligned = ((uintptr_t)p + SNAP_IMAGE_ALIGN - 1) & ~(uintptr_t)(SNAP_IMAGE_ALIGN - 1);
    s->slots[s->n_slots++] = (snap_slot){(void *)aligned, usable, NULL, p, mem_bytes};
    remaining -= usable;
    arena_taken += mem_bytes;
  }
  /* The arena holds as much as the device records' bytes, as before the
   * image was staged (a cap, reserve() or a trim's keep sized to the state
   * still fit); the rest (headers, host records, blocks lost to alignment)
   * goes to the heap. Not on CUDA: a copy into pageable memory returns when
   * done, which would block start until the GPU; there the arena holds all. */
  if (remaining && s->n_slots && heap_tail && arena_taken >= s->dev_total) {
    void *p = NULL;
    if (posix_memalign(&p, SNAP_IMAGE_ALIGN, (size_t)remaining)) p = NULL; /* then streamed */
    snap_slot *n = p ? realloc(s->slots, (s->n_slots + 1) * sizeof *n) : NULL;
    if (p && !n) free(p);
    if (p && !n) return FERRY_ENOMEM;
    if (n) s->slots = n;
    if (n) s->slots[s->n_slots++] = (snap_slot){p, (size_t)remaining, NULL, p, 0};
  }
  if (s->n_slots) {
    s->queue = calloc(s->n_slots, sizeof *s->queue);
    if (!s->queue) return FERRY_ENOMEM;
  }
  return FERRY_OK;
}

static void slot_free(ferry_engine *e, snap_slot *slot) {
  if (slot->mem_bytes) ferry_arena_free(engine_arena(e), slot->mem, slot->mem_bytes);
  else free(slot->mem); /* the heap tail */
  slot->buf = NULL;
}

/* Issue the next window of the file image into slot i: the copies of the
 * device bytes that land in it, at their file offsets (the writer fills in
 * the rest), then its event. Called with the engine lock held. */
static int issue_batch(ferry_snapshot *s, uint32_t i) {
  ferry_engine *e = s->e;
  const ferry_backend_ops *o = engine_backend(e)->ops;
  snap_slot *slot = &s->slots[i];
  uint64_t w0 = s->issued, left = s->file_size - w0;
  uint64_t len = left < slot->cap ? left : slot->cap, w1 = w0 + len;
  int rc = FERRY_OK;
  while (!rc && s->issue_rec < s->n) {
    snap_record *r = &s->rec[s->issue_rec];
    if (!r->dev || s->issue_off == r->bytes) { /* host record or exhausted */
      s->issue_rec++;
      s->issue_off = 0;
      continue;
    }
    uint64_t from = r->data_off + s->issue_off; /* >= w0: windows are issued in order */
    if (from >= w1) break;
    uint64_t piece = r->bytes - s->issue_off;
    if (piece > w1 - from) piece = w1 - from;
    rc = o->copy_d2h(engine_backend(e), (char *)slot->buf + (from - w0),
                     (const char *)r->dev + s->issue_off, (size_t)piece, engine_d2h_stream(e));
    s->issue_off += piece;
    s->dev_issued += piece;
  }
  /* Recorded even after a failed copy: it then covers whatever was issued,
   * so waiting on it makes the buffer safe to give back. If the record
   * fails too, nothing covers the copies: drain the stream now. */
  int rc2 = o->event_record(engine_backend(e), slot->ev, engine_d2h_stream(e));
  if (!rc) rc = rc2;
  if (rc2 == FERRY_OK) s->last_issued_ev = slot->ev;
  else o->stream_synchronize(engine_backend(e), engine_d2h_stream(e));
  if (rc) return rc;
  s->issued = w1;
  s->queue[(s->q_head + s->q_count) % s->n_slots] = (snap_batch){i, len, w0};
  s->q_count++;
  if (s->dev_issued == s->dev_total) { /* later windows (the end records) copy nothing */
    pthread_mutex_lock(&s->mu);
    if (!s->issue_done) {
      s->issue_done = 1;
      s->last_ev = slot->ev;
      pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
  }
  return FERRY_OK;
}

/* No more copies: let fence go on with what was issued. */
static void stop_issuing(ferry_snapshot *s) {
  pthread_mutex_lock(&s->mu);
  if (!s->issue_done) {
    s->issue_done = 1;
    s->last_ev = s->last_issued_ev;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
}

/* Wait for every copy into the slots, then give the buffers back. */
static void release_slots(ferry_snapshot *s) {
  ferry_engine *e = s->e;
  for (uint32_t i = 0; i < s->n_slots; i++) {
    snap_slot *slot = &s->slots[i];
    if (!slot->buf) continue;
    if (slot->ev) engine_backend(e)->ops->event_synchronize(engine_backend(e), slot->ev);
    slot_free(e, slot);
  }
}

/* The caller's host records are copied before start returns: into the
 * windows issued at start where they lie wholly inside them (the image
 * holds them: no second copy), else into memory of their own. */
static int keep_host_records(ferry_snapshot *s) {
  for (size_t i = 0; i < s->n; i++) {
    snap_record *r = &s->rec[i];
    if (!r->src) continue;
    const unsigned char *src = r->src;
    r->src = NULL;
    if (s->n_slots && r->data_off + r->bytes <= s->issued) {
      uint64_t off = r->data_off, n = r->bytes;
      for (uint32_t k = 0; k < s->q_count && n; k++) {
        const snap_batch *b = &s->queue[(s->q_head + k) % s->n_slots];
        if (off < b->start || off >= b->start + b->len) continue;
        uint64_t take = b->start + b->len - off < n ? b->start + b->len - off : n;
        memcpy((char *)s->slots[b->slot].buf + (off - b->start), src, (size_t)take);
        off += take;
        src += take;
        n -= take;
      }
      r->placed = 1;
    } else {
      if (!(r->host = malloc((size_t)r->bytes))) return FERRY_ENOMEM;
      memcpy(r->host, src, (size_t)r->bytes);
    }
  }
  return FERRY_OK;
}

/* ---- the writer thread ---------------------------------------------------- */
typedef struct batch_cursor {
  int have;
  uint32_t slot;
  uint64_t len, off, start;
} batch_cursor;

static int io_fail(ferry_snapshot *s, const char *what, int err) {
  return snap_fail(s, FERRY_EIO,
                   "snapshot %s: %s %s failed: %s; the previous file at that path (if any) "
                   "is untouched",
                   s->path, what, s->tmp_path, strerror(err));
}

static int zip_fail(ferry_snapshot *s, const zip_writer *z, int err) {
  char what[96];
  snprintf(what, sizeof what, "%s to", z->failed_op ? z->failed_op : "write");
  return io_fail(s, what, err);
}

static int reap_writes(ferry_snapshot *s, snap_pipe *p, int block);

/* Make the oldest issued batch current once its copies are complete (none
 * queued: once a write gives its slot back for the next window). */
static int next_batch(ferry_snapshot *s, batch_cursor *c, snap_pipe *p) {
  ferry_engine *e = s->e;
  int rc = s->q_count ? FERRY_OK : reap_writes(s, p, 1);
  if (rc) return rc;
  if (!s->q_count)
    return snap_fail(s, FERRY_ESTATE, "snapshot %s: internal error: no staged data left",
                     s->path);
  snap_batch b = s->queue[s->q_head];
  s->q_head = (s->q_head + 1) % s->n_slots;
  s->q_count--;
  rc = engine_backend(e)->ops->event_synchronize(engine_backend(e), s->slots[b.slot].ev);
  if (rc) {
    char bk_msg[256];
    engine_lock(e);
    snprintf(bk_msg, sizeof bk_msg, "%s", engine_backend(e)->err);
    engine_unlock(e);
    return snap_fail(s, rc, "snapshot %s: waiting for a staging copy failed: %s", s->path,
                     bk_msg);
  }
  *c = (batch_cursor){1, b.slot, b.len, 0, b.start};
  return FERRY_OK;
}

/* A window is written: reuse its slot for the next window, or give the
 * buffer back when the whole stream has been issued. */
static int batch_written(ferry_snapshot *s, uint32_t slot_index) {
  ferry_engine *e = s->e;
  if (s->issued < s->file_size) {
    engine_lock(e);
    int rc = issue_batch(s, slot_index);
    char bk_msg[256] = "";
    if (rc) snprintf(bk_msg, sizeof bk_msg, "%s", engine_backend(e)->err);
    engine_unlock(e);
    if (rc)
      return snap_fail(s, rc, "snapshot %s: staging copy failed: %s", s->path, bk_msg);
    return FERRY_OK;
  }
  slot_free(e, &s->slots[slot_index]);
  return FERRY_OK;
}

/* The slots of the windows written so far (block: at least one, unless no
 * write is in flight) are reused or given back. */
static int reap_writes(ferry_snapshot *s, snap_pipe *p, int block) {
  uint32_t slot;
  int err, rc = FERRY_OK;
  while (!rc && snap_pipe_reap(p, block, &slot, &err)) {
    rc = err ? io_fail(s, p->failed_op, err) : batch_written(s, slot);
    block = 0;
  }
  return rc;
}

/* A snapshot of host records only: streamed through the zip writer. */
static int write_host_records(ferry_snapshot *s, zip_writer *z) {
  int err;
  for (size_t i = 0; i < s->n; i++) {
    snap_record *r = &s->rec[i];
    if ((err = zipw_begin_entry(z, r->name, r->bytes))) return zip_fail(s, z, err);
    if (r->bytes && (err = zipw_write(z, r->host, (size_t)r->bytes))) return zip_fail(s, z, err);
    if ((err = zipw_end_entry(z))) return zip_fail(s, z, err);
  }
  if ((err = zipw_finish(z))) return zip_fail(s, z, err);
  return FERRY_OK;
}

/* The current window is complete: hand it to the write thread; the slots
 * of windows written meanwhile are reused or given back. */
static int window_done(ferry_snapshot *s, batch_cursor *c, snap_pipe *p) {
  snap_slot *slot = &s->slots[c->slot];
  c->have = 0;
  snap_pipe_submit(p, c->slot, slot->buf, (size_t)c->len, slot->cap, c->start);
  return reap_writes(s, p, 0);
}

/* n bytes of the file at the cursor: copied from src, or (src NULL) staged
 * there already; z: the bytes are an entry's data, checksummed. */
static int image_put(ferry_snapshot *s, batch_cursor *c, snap_pipe *p, zip_writer *z,
                     const unsigned char *src, uint64_t n) {
  while (n) {
    int rc, err;
    if (!c->have && (rc = next_batch(s, c, p))) return rc;
    uint64_t take = c->len - c->off < n ? c->len - c->off : n;
    unsigned char *dst = (unsigned char *)s->slots[c->slot].buf + c->off;
    if (src) {
      memcpy(dst, src, (size_t)take);
      src += take;
    }
    if (z && (err = zipw_place(z, dst, (size_t)take))) return zip_fail(s, z, err);
    c->off += take;
    n -= take;
    if (c->off == c->len && (rc = window_done(s, c, p))) return rc;
  }
  return FERRY_OK;
}

/* What the zip writer produced (headers, descriptors, end records). */
static int image_put_meta(ferry_snapshot *s, batch_cursor *c, snap_pipe *p, zip_writer *z) {
  int rc = image_put(s, c, p, NULL, z->buf, z->buf_len);
  z->buf_len = 0;
  return rc;
}

/* The file image, window by window in file order: the staging copies put
 * the device records' data at their offsets; this thread adds the rest,
 * checksums the data where it lies and hands each window whole to the
 * write thread (O_DIRECT where it can: no copy into the page cache). */
static int write_image(ferry_snapshot *s, snap_out *o) {
  zip_writer z;
  batch_cursor c = {0};
  snap_pipe pipe, *p = &pipe;
  int err = zipw_init(&z, -1), rc = FERRY_OK;
  if (!err && (err = snap_pipe_start(p, o, s->n_slots))) zipw_free(&z);
  if (err) return io_fail(s, "allocating the writer for", err);
  for (size_t i = 0; i < s->n && !rc; i++) {
    snap_record *r = &s->rec[i];
    if ((err = zipw_begin_entry(&z, r->name, r->bytes))) rc = zip_fail(s, &z, err);
    else if (z.offset != r->data_off)
      rc = snap_fail(s, FERRY_ESTATE, "snapshot %s: internal error: record %s is not where "
                     "its layout put it", s->path, r->name);
    if (!rc) rc = image_put_meta(s, &c, p, &z);
    if (!rc) rc = image_put(s, &c, p, &z, r->placed ? NULL : r->host, r->bytes);
    if (!rc && (err = zipw_end_entry(&z))) rc = zip_fail(s, &z, err);
    if (!rc) rc = image_put_meta(s, &c, p, &z);
    if (!rc) rc = failed(s);
  }
  if (!rc && (err = zipw_finish(&z))) rc = zip_fail(s, &z, err);
  if (!rc) rc = image_put_meta(s, &c, p, &z);
  while (!rc && snap_pipe_in_flight(p)) rc = reap_writes(s, p, 1);
  err = snap_pipe_stop(p); /* after a failure: the slots are idle once it returns */
  if (!rc && err) rc = io_fail(s, p->failed_op, err);
  if (!rc && (z.offset != s->file_size || c.have))
    rc = snap_fail(s, FERRY_ESTATE, "snapshot %s: internal error: the file is not its layout's "
                   "size", s->path);
  if (!rc && (err = snap_out_end(o, s->file_size))) rc = io_fail(s, o->failed_op, err);
  zipw_free(&z);
  return rc;
}

/* The file a snapshot to path replaces: path itself when it does not exist,
 * is a regular file or is a symbolic link (the link is replaced by the new
 * file, as TorchCheckpointIO's rename does; the file it named is never
 * written through: Lightning's save_last="link" points last.ckpt at the best
 * checkpoint). Anything else that exists is refused, never replaced. On the
 * writer thread, as the temporary file below: even this lstat took 35 us of
 * the caller's time right after a training step (the kernel's path walk
 * runs cache-cold; docs/checkpoints.md), and a round trip on a network file
 * system. A refused target is the handle's error, as every I/O error. */
static int resolve_target(ferry_snapshot *s) {
  const char *path = s->path;
  struct stat st;
  if (lstat(path, &st) != 0) {
    /* not there, or not reachable: creating the temporary file beside it
     * fails the same way, and reports it */
  } else if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
    return snap_fail(s, FERRY_EINVAL, "%s exists and is %s; refusing to replace it", path,
                     snap_file_type(st.st_mode));
  }
  size_t len = strlen(path);
  if (!(s->target = malloc(len + 1)) || !(s->tmp_path = malloc(len + 24)))
    return snap_fail(s, FERRY_ENOMEM, "snapshot %s: out of memory for its file names", s->path);
  memcpy(s->target, path, len + 1);
  /* "<dir>/.<name>.ferry-XXXXXX": hidden, beside the target (same file
   * system for the rename), unique per writer (mkostemp) */
  const char *slash = strrchr(path, '/');
  size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
  snprintf(s->tmp_path, len + 24, "%.*s.%s.ferry-XXXXXX", (int)dir_len, path, path + dir_len);
  return FERRY_OK;
}

/* The temporary file, created on the writer thread rather than in start:
 * creating a file (a journal update on most file systems) and reading the
 * umask took 0.1-0.6 ms of the caller's time on the development VM. Errors
 * are the handle's, as every I/O error. */
static int create_tmp(ferry_snapshot *s) {
  size_t len = strlen(s->tmp_path);
  char *template_path = malloc(len + 1);
  if (!template_path) return io_fail(s, "allocating the name of", ENOMEM);
  memcpy(template_path, s->tmp_path, len + 1);
  int fd = mkostemp(s->tmp_path, O_CLOEXEC);
  int err = errno;
  if (fd < 0) /* mkostemp may leave a name it tried in the template: not ours */
    memcpy(s->tmp_path, template_path, len + 1);
  free(template_path);
  if (fd < 0) return io_fail(s, "creating", err);
  fchmod(fd, 0666 & ~snap_process_umask()); /* as open(0666) would */
  s->fd = fd;
  return FERRY_OK;
}

/* One snapshot, start to end; the caller's thread then leaves it alone. */
static void write_snapshot(ferry_snapshot *s) {
  int rc = resolve_target(s), err;
  if (rc == FERRY_OK) rc = create_tmp(s);
  if (rc == FERRY_OK && s->n_slots) {
    snap_out o;
    snap_out_init(&o, s->fd);
    rc = write_image(s, &o);
    engine_lock(s->e);
    engine_stats(s->e)->snapshot_bytes_direct += o.bytes_direct;
    engine_stats(s->e)->snapshot_bytes_buffered += o.bytes_buffered;
    engine_unlock(s->e);
  } else if (rc == FERRY_OK) {
    zip_writer z;
    err = zipw_init(&z, s->fd);
    rc = err ? io_fail(s, "allocating the writer for", err) : write_host_records(s, &z);
    if (rc == FERRY_OK) {
      engine_lock(s->e);
      engine_stats(s->e)->snapshot_bytes_buffered += z.offset;
      engine_unlock(s->e);
    }
    zipw_free(&z);
  }
  /* Whatever happened, no copy may still target the slots when they go. */
  stop_issuing(s);
  release_slots(s);
  int created = s->fd >= 0;
  if (created) {
    if (rc == FERRY_OK && fsync(s->fd) != 0) rc = io_fail(s, "fsync of", errno);
    if (close(s->fd) != 0 && rc == FERRY_OK) rc = io_fail(s, "close of", errno);
    s->fd = -1;
  }
  if (rc == FERRY_OK && rename(s->tmp_path, s->target) != 0)
    rc = snap_fail(s, FERRY_EIO, "snapshot %s: rename of %s to %s failed: %s", s->path,
                   s->tmp_path, s->target, strerror(errno));
  if (rc != FERRY_OK) {
    if (created) unlink(s->tmp_path);
  } else if ((err = snap_fsync_parent_dir(s->target))) {
    snap_fail(s, FERRY_EIO,
              "snapshot %s: the file is complete and renamed into place, but the fsync of "
              "its directory failed: %s; the rename may not survive a crash",
              s->path, strerror(err));
  }
  pthread_mutex_lock(&s->mu);
  s->done = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* ---- writer threads -------------------------------------------------------- */
/* Writer threads outlive their snapshot: each then waits, parked, for the
 * engine's next one, and all are joined when the engine is destroyed.
 * Creating a thread took 50-100 us of ferry_snapshot_start on a 2-core VM
 * (docs/checkpoints.md), time the training loop is blocked; handing a
 * snapshot to a parked thread is a condition signal. A thread that was
 * niced cannot come back unprivileged (setpriority(2)): it only takes
 * snapshots that run there too; a chunked one gets a normal-priority
 * thread, parked or new. There are as many threads as snapshots that ever
 * ran at once (of each priority). */
typedef struct writer {
  pthread_t thread;
  struct snapshot_list *l;
  struct writer *next;
  pthread_cond_t cv; /* a job, or the engine closing */
  ferry_snapshot *job;
  int idle; /* niced: a background writer */
} writer;

typedef struct snapshot_list {
  ferry_snapshot *head; /* under the engine lock */
  pthread_mutex_t mu;   /* guards what follows */
  writer *writers;      /* every thread, parked or not */
  int closing;
} snapshot_list;

static void *writer_main(void *arg) {
  writer *w = arg;
  snapshot_list *l = w->l;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    while (!w->job && !l->closing) pthread_cond_wait(&w->cv, &l->mu);
    ferry_snapshot *s = w->job;
    if (!s) break;
    int lower = s->to_idle && !w->idle;
    w->idle |= lower;
    pthread_mutex_unlock(&l->mu);
    if (lower) snap_thread_to_background();
    write_snapshot(s); /* s is its owner's again */
    pthread_mutex_lock(&l->mu);
    w->job = NULL;
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* Give s to a parked writer of a suitable priority, else to a new one. */
static int hand_to_writer(ferry_snapshot *s) {
  snapshot_list *l = s->list;
  pthread_mutex_lock(&l->mu);
  writer *pick = NULL;
  for (writer *w = l->writers; w; w = w->next)
    if (!w->job && (s->to_idle || !w->idle) && (!pick || w->idle > pick->idle)) pick = w;
  if (pick) {
    pick->job = s;
    s->thread_started = 1;
    pthread_cond_signal(&pick->cv);
    pthread_mutex_unlock(&l->mu);
    return 0;
  }
  writer *w = calloc(1, sizeof *w);
  int prc = ENOMEM;
  if (w) {
    pthread_cond_init(&w->cv, NULL);
    w->l = l;
    w->job = s;
    /* The writer must not take the embedder's signals (as the streams). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    prc = pthread_create(&w->thread, NULL, writer_main, w);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
  }
  if (prc) {
    if (w) pthread_cond_destroy(&w->cv);
    free(w);
    pthread_mutex_unlock(&l->mu);
    return prc;
  }
#if defined(__GLIBC__)
  pthread_setname_np(w->thread, "ferry-snapshot");
#endif
  w->next = l->writers;
  l->writers = w;
  s->thread_started = 1;
  pthread_mutex_unlock(&l->mu);
  return 0;
}

/* Engine teardown, once no snapshot is left running: the parked writers end. */
static void writers_join(snapshot_list *l) {
  pthread_mutex_lock(&l->mu);
  l->closing = 1;
  for (writer *w = l->writers; w; w = w->next) pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&l->mu);
  while (l->writers) {
    writer *w = l->writers;
    l->writers = w->next;
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    free(w);
  }
}

/* ---- start ---------------------------------------------------------------- */
static int validate(ferry_engine *e, const char *path, const ferry_snapshot_record *records,
                    size_t n, ferry_snapshot **out) {
  if (!out) return start_fail(e, FERRY_EINVAL, "out is NULL");
  *out = NULL;
  if (!path || !*path) return start_fail(e, FERRY_EINVAL, "path is NULL or empty");
  if (strlen(path) + 24 > PATH_MAX)
    return start_fail(e, FERRY_EINVAL, "path is too long for its temporary file (PATH_MAX)");
  if (n && !records) return start_fail(e, FERRY_EINVAL, "records is NULL but n is %zu", n);
  if (n >= (size_t)UINT32_MAX)
    return start_fail(e, FERRY_EINVAL, "%zu records is absurd (max 2^32 - 1)", n);
  for (size_t i = 0; i < n; i++) {
    const ferry_snapshot_record *r = &records[i];
    if (!r->name || !*r->name)
      return start_fail(e, FERRY_EINVAL, "record %zu has no name", i);
    size_t len = strlen(r->name);
    if (len > ZIP_MAX_NAME)
      return start_fail(e, FERRY_EINVAL, "record %zu: name is %zu bytes (zip allows %d)", i,
                        len, ZIP_MAX_NAME);
    if (r->bytes > SNAP_MAX_RECORD_BYTES)
      return start_fail(e, FERRY_EINVAL, "record %zu (%s): %llu bytes is absurd (max 2^50)", i,
                        r->name, (unsigned long long)r->bytes);
    if (r->bytes && !!r->host_data == !!r->device_ptr)
      return start_fail(e, FERRY_EINVAL,
                        "record %zu (%s): exactly one of host_data and device_ptr must be set "
                        "(both are %s)",
                        i, r->name, r->host_data ? "set" : "NULL");
  }
  if (n > 1) {
    const char **names = malloc(n * sizeof *names);
    if (!names) return start_fail(e, FERRY_ENOMEM, "out of memory checking record names");
    for (size_t i = 0; i < n; i++) names[i] = records[i].name;
    qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 1; i < n; i++)
      if (strcmp(names[i - 1], names[i]) == 0) {
        int rc = start_fail(e, FERRY_EINVAL, "two records are named \"%s\"", names[i]);
        free(names);
        return rc;
      }
    free(names);
  }
  return FERRY_OK;
}

static ferry_snapshot *snapshot_new(ferry_engine *e, const char *path,
                                    const ferry_snapshot_record *records, size_t n) {
  ferry_snapshot *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->e = e;
  s->fd = -1;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  size_t plen = strlen(path);
  s->path = malloc(plen + 1);
  s->rec = calloc(n ? n : 1, sizeof *s->rec);
  if (!s->path || !s->rec) goto oom;
  memcpy(s->path, path, plen + 1);
  s->n = n;
  for (size_t i = 0; i < n; i++) {
    const ferry_snapshot_record *in = &records[i];
    snap_record *r = &s->rec[i];
    size_t len = strlen(in->name);
    if (!(r->name = malloc(len + 1))) goto oom;
    memcpy(r->name, in->name, len + 1);
    r->bytes = in->bytes;
    if (!in->bytes) continue;
    if (in->device_ptr) {
      r->dev = in->device_ptr;
      s->dev_total += in->bytes;
    } else {
      if (in->bytes > SIZE_MAX) goto oom;
      r->src = in->host_data; /* copied by keep_host_records before start returns */
    }
  }
  return s;
oom:
  snapshot_free_memory(s);
  return NULL;
}

/* The engine's snapshots not yet freed (snapshot_list, above): registered
 * with the engine as the data of its shutdown hook (core.h), under the
 * engine lock. */
static void snapshot_engine_shutdown(ferry_engine *e, void *ud);

/* Add s to the engine's list unless a snapshot to the same path (as given)
 * is still running there: two renames racing to one path leave the file of
 * whichever came last. (A path and a symbolic link to it are not told apart:
 * the target is resolved later, on the writer thread.) */
static int register_snapshot(ferry_engine *e, ferry_snapshot *s) {
  engine_lock(e);
  snapshot_list *l = engine_shutdown_data(e, snapshot_engine_shutdown);
  if (!l) {
    if (!(l = calloc(1, sizeof *l)) || engine_on_shutdown(e, snapshot_engine_shutdown, l)) {
      free(l);
      engine_unlock(e);
      return FERRY_ENOMEM;
    }
    pthread_mutex_init(&l->mu, NULL);
  }
  for (ferry_snapshot *o = l->head; o; o = o->next) {
    pthread_mutex_lock(&o->mu);
    int busy = !o->done && strcmp(o->path, s->path) == 0;
    pthread_mutex_unlock(&o->mu);
    if (busy) {
      engine_fail(e, FERRY_ESTATE,
                  "ferry_snapshot_start: a snapshot to %s is still in progress; wait for it "
                  "first",
                  s->path);
      engine_unlock(e);
      return FERRY_ESTATE;
    }
  }
  s->next = l->head;
  if (l->head) l->head->prev = s;
  l->head = s;
  s->list = l;
  engine_unlock(e);
  return FERRY_OK;
}

/* Called with the engine lock held. */
static void unlink_snapshot_locked(ferry_engine *e, ferry_snapshot *s) {
  snapshot_list *l = engine_shutdown_data(e, snapshot_engine_shutdown);
  if (s->prev) s->prev->next = s->next;
  else if (l && l->head == s) l->head = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
}

/* Give the slots' events back to the pool. Called with the engine lock. */
static void put_events_locked(ferry_engine *e, ferry_snapshot *s) {
  for (uint32_t i = 0; i < s->n_slots; i++) {
    event_put(e, s->slots[i].ev);
    s->slots[i].ev = NULL;
  }
}

/* Undo a start that failed after the snapshot was registered (before the
 * writer thread, which creates the file). */
static void abandon(ferry_engine *e, ferry_snapshot *s) {
  release_slots(s);
  engine_lock(e);
  put_events_locked(e, s);
  unlink_snapshot_locked(e, s);
  engine_unlock(e);
  snapshot_free_memory(s);
}

int ferry_snapshot_start(ferry_engine *e, const char *path, const ferry_snapshot_record *records,
                         size_t n, void *compute_stream, ferry_snapshot **out) {
  int rc = engine_check(e);
  if (rc) return rc;
  if ((rc = validate(e, path, records, n, out))) return rc;
  ferry_snapshot *s = snapshot_new(e, path, records, n);
  if (!s) return start_fail(e, FERRY_ENOMEM, "out of host memory copying the records");
  if (s->dev_total && snap_layout(s->rec, s->n, &s->file_size)) {
    snapshot_free_memory(s);
    return start_fail(e, FERRY_ENOMEM, "out of host memory laying out the file");
  }
  if ((rc = register_snapshot(e, s))) {
    snapshot_free_memory(s);
    return rc;
  }

  /* The target is resolved and the temporary file created by the writer
   * thread (resolve_target, create_tmp). */
  if ((rc = take_slots(s))) {
    abandon(e, s);
    return start_fail(e, rc, "out of host memory for the staging list");
  }
  if (s->dev_total && !s->n_slots) {
    ferry_arena_stats a;
    ferry_arena_get_stats(engine_arena(e), &a);
    uint64_t need = s->file_size;
    abandon(e, s);
    return start_fail(e, FERRY_ECAP,
                      "the pinned arena has no room to stage %llu bytes (cap %llu, reserved "
                      "%llu, in use %llu); free arena memory or raise the cap",
                      (unsigned long long)need, (unsigned long long)a.cap,
                      (unsigned long long)a.reserved, (unsigned long long)a.in_use);
  }

  const ferry_backend_ops *o = engine_backend(e)->ops;
  engine_lock(e);
  for (uint32_t i = 0; i < s->n_slots && !rc; i++) rc = event_get(e, &s->slots[i].ev);
  if (!rc && s->n_slots &&
      ((rc = o->event_record(engine_backend(e), engine_scratch_event(e), compute_stream)) ||
       (rc = o->stream_wait_event(engine_backend(e), engine_d2h_stream(e), engine_scratch_event(e)))))
    engine_fail(e, rc, "ferry_snapshot_start: ordering after the compute stream failed: %s",
                engine_backend(e)->err);
  for (uint32_t i = 0; i < s->n_slots && !rc; i++)
    if ((rc = issue_batch(s, i)))
      engine_fail(e, rc, "ferry_snapshot_start: staging copy failed: %s", engine_backend(e)->err);
  if (!s->n_slots) stop_issuing(s); /* nothing on the device: no copies */
  engine_unlock(e);
  if (rc) {
    abandon(e, s);
    return rc;
  }

  if (keep_host_records(s)) {
    abandon(e, s);
    return start_fail(e, FERRY_ENOMEM, "out of host memory copying the records");
  }
  pthread_mutex_lock(&s->mu);
  s->to_idle = s->issue_done;
  pthread_mutex_unlock(&s->mu);
  int prc = hand_to_writer(s);
  if (prc) {
    abandon(e, s);
    return start_fail(e, FERRY_ENOMEM, "cannot start the writer thread: %s", strerror(prc));
  }
  *out = s;
  return FERRY_OK;
}

/* ---- completion ------------------------------------------------------------ */
int ferry_snapshot_fence(ferry_snapshot *s, void *compute_stream) {
  if (!s) return FERRY_EINVAL;
  pthread_mutex_lock(&s->mu);
  while (!s->issue_done) pthread_cond_wait(&s->cv, &s->mu);
  bk_event *last = s->last_ev;
  ferry_engine *e = s->e;
  pthread_mutex_unlock(&s->mu);
  if (!last || !e) return FERRY_OK; /* nothing on the device, or all done */
  /* The event is the snapshot's until ferry_snapshot_free and is not
   * recorded again after issue_done: no engine lock needed to wait on it. */
  int rc = engine_backend(e)->ops->stream_wait_event(engine_backend(e), compute_stream, last);
  if (rc) snap_fail(s, rc, "snapshot %s: ordering the compute stream after it failed", s->path);
  return rc;
}

int ferry_snapshot_poll(ferry_snapshot *s) {
  if (!s) return FERRY_EINVAL;
  pthread_mutex_lock(&s->mu);
  int rc = s->done ? s->rc : 1;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int ferry_snapshot_wait(ferry_snapshot *s) {
  if (!s) return FERRY_EINVAL;
  pthread_mutex_lock(&s->mu);
  while (!s->done) pthread_cond_wait(&s->cv, &s->mu);
  int rc = s->rc;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

const char *ferry_snapshot_error(ferry_snapshot *s) {
  if (!s) return "snapshot is NULL";
  pthread_mutex_lock(&s->mu);
  const char *m = s->done ? s->msg : ""; /* immutable once done */
  pthread_mutex_unlock(&s->mu);
  return m;
}

/* Until the writer thread leaves s alone (it goes on to the next snapshot). */
static void wait_writer(ferry_snapshot *s) {
  pthread_mutex_lock(&s->mu);
  while (s->thread_started && !s->done) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

void ferry_snapshot_free(ferry_snapshot *s) {
  if (!s) return;
  wait_writer(s);
  pthread_mutex_lock(&s->mu);
  ferry_engine *e = s->e;
  pthread_mutex_unlock(&s->mu);
  if (e) {
    engine_lock(e);
    put_events_locked(e, s);
    unlink_snapshot_locked(e, s);
    engine_unlock(e);
  }
  snapshot_free_memory(s);
}

/* Engine teardown (a shutdown hook): let every snapshot finish (its file is
 * written), then detach it; the handles stay valid for poll/wait/error/free. */
static void snapshot_engine_shutdown(ferry_engine *e, void *ud) {
  snapshot_list *l = ud;
  for (;;) {
    engine_lock(e);
    ferry_snapshot *s = l->head;
    if (s) unlink_snapshot_locked(e, s);
    engine_unlock(e);
    if (!s) break;
    wait_writer(s);
    engine_lock(e);
    put_events_locked(e, s);
    engine_unlock(e);
    pthread_mutex_lock(&s->mu);
    s->e = NULL;
    s->list = NULL;
    pthread_mutex_unlock(&s->mu);
  }
  writers_join(l);
  pthread_mutex_destroy(&l->mu);
  free(l);
}
