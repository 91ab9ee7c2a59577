/*
 * snapshot_pipe.c — the threads of the snapshot writer: the writer's
 * priority (staging.c runs a snapshot whose copies were all issued at start
 * in the background).
 */
#include <errno.h>
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
