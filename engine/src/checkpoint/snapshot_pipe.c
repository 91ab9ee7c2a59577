/*
 * snapshot_pipe.c — the threads of the snapshot writer: the writer's
 * priority (staging.c runs a snapshot whose copies were all issued at start
 * in the background), and the write thread that takes the file's windows
 * from it (snapshot_image.h; docs/internals.md#stagingc).
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "snapshot_image.h"

#define WRITER_NICE 10 /* added to the process's nice value for a background writer */

/* When start issued every staging copy (the state fits in the arena), no
 * caller waits for this thread except in poll/wait/free: it then runs at a
 * lower priority (nice +WRITER_NICE, normal scheduling), so that the file's
 * CRC-32 and write() calls yield to the training loop and to the staging
 * copies the next fence waits for (bench/README.md, "Checkpoint
 * benchmarks": on 2 cores, steps overlapping a snapshot ran 1.5-2x slower
 * with the writer at the training loop's priority). Not SCHED_IDLE, which
 * only ever runs on a core nothing else wants: with DataLoader workers
 * keeping every core busy a 64 MiB snapshot took 5.9 s to be durable
 * there against 174 ms niced (issue 37). A chunked snapshot keeps the
 * caller's priority: its fence waits for this thread to free buffers. */
void snap_thread_to_background(void) {
#if defined(__linux__)
  id_t tid = (id_t)syscall(SYS_gettid);
  errno = 0;
  int nice_now = getpriority(PRIO_PROCESS, tid); /* Linux: this thread's */
  if (nice_now != -1 || errno == 0) {
    int target = nice_now + WRITER_NICE;
    setpriority(PRIO_PROCESS, tid, target > 19 ? 19 : target); /* best effort */
  }
  /* A staging copy this thread ran at a lower priority while waiting for
   * it would hold up the training thread's fence, which waits for it too. */
  ferry_backend_thread_runs_waited_copies(0);
#endif
}

/* ---- the write thread ------------------------------------------------------
 * Measured on the 2-core development VM (bench/README.md, "Checkpoint
 * benchmarks"): of the writer's CPU for a 256 MiB snapshot (57-61 ms) the
 * CRC-32 is 76%, the kernel's work in the O_DIRECT pwrite()s 23%.
 * Written one after the other, that CPU time adds to the disk's; niced and
 * with every core busy it is stretched tenfold. On a thread of its own each
 * window's write waits for the disk while the writer checksums the next. */
static _Atomic int write_thread_on = 1;
static _Atomic(ferry_snapshot_window_hook) window_hook;
static void *_Atomic window_hook_ud;

void ferry_snapshot_set_write_thread(int on) { atomic_store(&write_thread_on, on != 0); }

void ferry_snapshot_set_window_hook(ferry_snapshot_window_hook fn, void *ud) {
  atomic_store(&window_hook_ud, ud);
  atomic_store(&window_hook, fn);
}

static int call_hook(int event, uint64_t off, size_t len) {
  ferry_snapshot_window_hook fn = atomic_load(&window_hook);
  return fn ? fn(atomic_load(&window_hook_ud), event, off, len) : 0;
}

/* One window to the file (either thread). */
static int write_window(snap_out *o, snap_write *w) {
  int err = call_hook(FERRY_SNAP_WINDOW_WRITE, w->off, w->len);
  if (err) {
    o->failed_op = "write to";
    return err;
  }
  return snap_out_write(o, w->buf, w->len, w->cap, w->off);
}

/* Writes the oldest queued window, or skips it after an earlier failure;
 * called and returns with p->mu held, which the write itself runs without. */
static void write_queued(snap_pipe *p, snap_write *w) {
  int skip = p->err;
  pthread_mutex_unlock(&p->mu);
  int err = skip ? skip : write_window(p->o, w);
  pthread_mutex_lock(&p->mu);
  w->err = err;
  if (err && !p->err) {
    p->err = err;
    p->failed_op = p->o->failed_op;
  }
  p->written++;
}

static void *pipe_main(void *arg) {
  snap_pipe *p = arg;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->written == p->submitted && !p->stopping) pthread_cond_wait(&p->cv, &p->mu);
    if (p->written == p->submitted || p->stopping) break; /* stop skips what is left */
    write_queued(p, &p->ring[p->written % p->n]);
    pthread_cond_broadcast(&p->cv);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int snap_pipe_start(snap_pipe *p, snap_out *o, uint32_t n) {
  memset(p, 0, sizeof *p);
  p->o = o;
  p->n = n ? n : 1;
  if (!(p->ring = calloc(p->n, sizeof *p->ring))) return ENOMEM;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  const char *env = getenv("FERRY_SNAPSHOT_WRITE_THREAD"); /* "0": none (docs/checkpoints.md) */
  if (!atomic_load(&write_thread_on) || (env && strcmp(env, "0") == 0) || p->n < 2)
    return 0; /* one slot: nothing to overlap */
  /* No signals of the embedder here (as the writer); it inherits the
   * writer's nice value, and so yields as the writer does. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  p->threaded = pthread_create(&p->thread, NULL, pipe_main, p) == 0; /* else: inline */
  pthread_sigmask(SIG_SETMASK, &old, NULL);
#if defined(__GLIBC__)
  if (p->threaded) pthread_setname_np(p->thread, "ferry-snapshot");
#endif
  return 0;
}

void snap_pipe_submit(snap_pipe *p, uint32_t slot, void *buf, size_t len, size_t cap,
                      uint64_t off) {
  call_hook(FERRY_SNAP_WINDOW_FILLED, off, len);
  pthread_mutex_lock(&p->mu);
  snap_write *w = &p->ring[p->submitted % p->n];
  *w = (snap_write){slot, buf, len, cap, off, 0};
  p->submitted++;
  if (p->threaded) {
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return;
  }
  write_queued(p, w);
  pthread_mutex_unlock(&p->mu);
}

int snap_pipe_reap(snap_pipe *p, int block, uint32_t *slot, int *err) {
  pthread_mutex_lock(&p->mu);
  while (block && p->threaded && p->reaped < p->submitted && p->reaped == p->written)
    pthread_cond_wait(&p->cv, &p->mu);
  int got = p->reaped < p->written;
  if (got) {
    const snap_write *w = &p->ring[p->reaped % p->n];
    *slot = w->slot;
    *err = w->err;
    p->reaped++;
  }
  pthread_mutex_unlock(&p->mu);
  return got;
}

int snap_pipe_in_flight(snap_pipe *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->reaped < p->submitted;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int snap_pipe_stop(snap_pipe *p) {
  if (p->threaded) {
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    p->threaded = 0;
  }
  int err = p->err;
  free(p->ring);
  p->ring = NULL;
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  return err;
}
