/*
 * node_budget.c — a pinned-host budget shared by the processes of one node
 * (ferry_node_budget_*, ferry.h), e.g. all DDP ranks of a machine.
 * How it works: docs/internals.md#node_budgetc.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry.h"
#include "util/errbuf.h"

#define NB_MAGIC 0x66657279636170ull /* "ferycap" */
#define NB_SLOTS 256
#define NB_NAME_MAX 100
#define NB_WAIT_MS 2000 /* how long a joiner waits for the creator */

typedef struct nb_slot {
  int32_t pid;
  int32_t reserved0;
  uint64_t start_time; /* /proc/<pid>/stat field 22 */
  uint64_t bytes;
  uint64_t peak;
} nb_slot;

typedef struct nb_shm {
  _Atomic uint64_t magic; /* set last by the creator */
  uint64_t cap;
  pthread_mutex_t lock;
  uint64_t reclaimed_bytes; /* from dead processes, ever */
  uint64_t refusals;
  nb_slot slots[NB_SLOTS];
} nb_shm;

struct ferry_node_budget {
  nb_shm *shm;
  int slot;
  char name[NB_NAME_MAX + 2]; /* "/" + name */
};

/* Field 22 (start time) of /proc/pid/stat; 0 if gone. *zombie: state Z. */
static uint64_t proc_start_time(int pid, int *zombie) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')'); /* comm may hold spaces */
  if (!p) return 0;
  if (zombie) *zombie = p[1] == ' ' && p[2] == 'Z';
  int field = 2;
  char *save = NULL;
  for (char *tok = strtok_r(p + 1, " ", &save); tok; tok = strtok_r(NULL, " ", &save))
    if (++field == 22) return strtoull(tok, NULL, 10);
  return 0;
}

static int slot_alive(const nb_slot *s) {
  if (!s->pid) return 0;
  if (kill(s->pid, 0) != 0 && errno == ESRCH) return 0;
  int zombie = 0;
  uint64_t st = proc_start_time(s->pid, &zombie);
  /* gone, or a zombie: it holds no memory any more */
  if (st == 0 || zombie) return 0;
  return st == s->start_time;
}

static int nb_lock(nb_shm *m) {
  int rc = pthread_mutex_lock(&m->lock);
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&m->lock);
    rc = 0;
  }
  return rc;
}

/* With the lock held: free dead slots, return the live total. */
static uint64_t nb_sweep(nb_shm *m) {
  uint64_t total = 0;
  for (int i = 0; i < NB_SLOTS; i++) {
    nb_slot *s = &m->slots[i];
    if (!s->pid) continue;
    if (!slot_alive(s)) {
      m->reclaimed_bytes += s->bytes;
      memset(s, 0, sizeof *s);
      continue;
    }
    total += s->bytes;
  }
  return total;
}

static void claim_slot(nb_slot *s) {
  s->pid = getpid();
  s->start_time = proc_start_time(s->pid, NULL);
}

int ferry_node_budget_reserve(void *budget, uint64_t bytes, int release) {
  ferry_node_budget *b = budget;
  if (!b || !b->shm) return 1;
  nb_shm *m = b->shm;
  if (nb_lock(m)) return 1;
  nb_slot *me = &m->slots[b->slot];
  int refused = 0;
  if (release) {
    me->bytes = bytes > me->bytes ? 0 : me->bytes - bytes;
  } else {
    uint64_t total = nb_sweep(m);
    if (me->pid != getpid()) claim_slot(me); /* swept by a confused peer */
    if (bytes > m->cap || total > m->cap - bytes) {
      refused = 1;
      m->refusals++;
    } else {
      me->bytes += bytes;
      if (me->bytes > me->peak) me->peak = me->bytes;
    }
  }
  pthread_mutex_unlock(&m->lock);
  return refused;
}

static int check_name(const char *name, char *errbuf, size_t errlen) {
  if (!name || !*name || strchr(name, '/') || strlen(name) > NB_NAME_MAX)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                        "node budget: name '%s' must be 1-%d characters without '/'",
                        name ? name : "(null)", NB_NAME_MAX);
  return FERRY_OK;
}

/* Opens (creator: creates and sizes) the segment; returns the fd or -1. */
static int open_segment(const char *full, int *creator, char *errbuf, size_t errlen) {
  *creator = 1;
  int fd = shm_open(full, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 && errno == EEXIST) {
    *creator = 0;
    fd = shm_open(full, O_RDWR, 0600);
  }
  if (fd < 0) {
    ferry_errbuf(errbuf, errlen, FERRY_EIO, "node budget: shm_open(%s): %s", full,
                 strerror(errno));
    return -1;
  }
  if (*creator && ftruncate(fd, sizeof(nb_shm)) != 0) {
    ferry_errbuf(errbuf, errlen, FERRY_EIO, "node budget: ftruncate(%s): %s", full,
                 strerror(errno));
    close(fd);
    shm_unlink(full);
    return -1;
  }
  if (!*creator) { /* wait for the creator's ftruncate */
    struct stat st;
    for (int i = 0; i < NB_WAIT_MS; i++) {
      if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(nb_shm)) break;
      usleep(1000);
    }
  }
  return fd;
}

static void init_segment(nb_shm *m, uint64_t cap) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&m->lock, &a);
  pthread_mutexattr_destroy(&a);
  m->cap = cap;
  atomic_store_explicit(&m->magic, NB_MAGIC, memory_order_release);
}

/* A joiner: the creator has initialised it, with the same cap. */
static int join_segment(nb_shm *m, const char *full, uint64_t cap, char *errbuf,
                        size_t errlen) {
  int i;
  for (i = 0; i < NB_WAIT_MS; i++) {
    if (atomic_load_explicit(&m->magic, memory_order_acquire) == NB_MAGIC) break;
    usleep(1000);
  }
  if (i == NB_WAIT_MS)
    return ferry_errbuf(errbuf, errlen, FERRY_ESTATE,
                        "node budget: segment %s was never initialised", full);
  if (m->cap != cap)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                        "node budget %s: this process asks for a cap of %llu bytes but the "
                        "node's segment was created with %llu; give every local rank the "
                        "same cap",
                        full, (unsigned long long)cap, (unsigned long long)m->cap);
  return FERRY_OK;
}

/* Sweeps the dead and takes a free slot for this process; -1 if none, -2
 * if the lock cannot be taken. */
static int take_slot(nb_shm *m) {
  if (nb_lock(m)) return -2;
  nb_sweep(m);
  int slot = -1;
  for (int i = 0; i < NB_SLOTS && slot < 0; i++)
    if (!m->slots[i].pid) slot = i;
  if (slot >= 0) {
    claim_slot(&m->slots[slot]);
    m->slots[slot].bytes = m->slots[slot].peak = 0;
  }
  pthread_mutex_unlock(&m->lock);
  return slot;
}

int ferry_node_budget_open(const char *name, uint64_t cap_bytes, ferry_node_budget **out,
                           char *errbuf, size_t errlen) {
  if (!out) return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "node budget: out is NULL");
  *out = NULL;
  int rc = check_name(name, errbuf, errlen);
  if (rc) return rc;
  if (!cap_bytes)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                        "node budget %s: cap_bytes must be > 0", name);
  char full[NB_NAME_MAX + 2];
  snprintf(full, sizeof full, "/%s", name);
  int creator;
  int fd = open_segment(full, &creator, errbuf, errlen);
  if (fd < 0) return FERRY_EIO;
  nb_shm *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED)
    return ferry_errbuf(errbuf, errlen, FERRY_EIO, "node budget: mmap(%s): %s", full,
                        strerror(errno));
  if (creator)
    init_segment(m, cap_bytes);
  else if ((rc = join_segment(m, full, cap_bytes, errbuf, errlen)) != FERRY_OK)
    goto fail;
  int slot = take_slot(m);
  if (slot == -2) {
    rc = ferry_errbuf(errbuf, errlen, FERRY_ESTATE, "node budget %s: cannot lock the segment",
                      full);
    goto fail;
  }
  if (slot < 0) {
    rc = ferry_errbuf(errbuf, errlen, FERRY_ECAP,
                      "node budget %s: all %d process slots are in use", full, NB_SLOTS);
    goto fail;
  }
  ferry_node_budget *b = calloc(1, sizeof *b);
  if (!b) {
    rc = ferry_errbuf(errbuf, errlen, FERRY_ENOMEM, "node budget %s: out of memory", full);
    goto fail;
  }
  b->shm = m;
  b->slot = slot;
  memcpy(b->name, full, sizeof full);
  *out = b;
  return FERRY_OK;
fail:
  munmap(m, sizeof *m);
  return rc;
}

void ferry_node_budget_close(ferry_node_budget *b) {
  if (!b) return;
  if (nb_lock(b->shm) == 0) {
    memset(&b->shm->slots[b->slot], 0, sizeof(nb_slot));
    pthread_mutex_unlock(&b->shm->lock);
  }
  munmap(b->shm, sizeof *b->shm);
  free(b);
}

int ferry_node_budget_get_stats(ferry_node_budget *b, ferry_node_budget_stats *out,
                                int32_t *pids, uint64_t *bytes, uint32_t max) {
  if (!b || !out) return FERRY_EINVAL;
  nb_shm *m = b->shm;
  if (nb_lock(m)) return FERRY_ESTATE;
  memset(out, 0, sizeof *out);
  out->total = nb_sweep(m);
  for (int i = 0; i < NB_SLOTS; i++) {
    if (!m->slots[i].pid) continue;
    if (out->processes < max) {
      if (pids) pids[out->processes] = m->slots[i].pid;
      if (bytes) bytes[out->processes] = m->slots[i].bytes;
    }
    out->processes++;
  }
  out->cap = m->cap;
  out->mine = m->slots[b->slot].bytes;
  out->mine_peak = m->slots[b->slot].peak;
  out->reclaimed = m->reclaimed_bytes;
  out->refusals = m->refusals;
  pthread_mutex_unlock(&m->lock);
  return FERRY_OK;
}

int ferry_node_budget_unlink(const char *name, char *errbuf, size_t errlen) {
  int rc = check_name(name, errbuf, errlen);
  if (rc) return rc;
  char full[NB_NAME_MAX + 2];
  snprintf(full, sizeof full, "/%s", name);
  if (shm_unlink(full) != 0 && errno != ENOENT)
    return ferry_errbuf(errbuf, errlen, FERRY_EIO, "node budget: shm_unlink(%s): %s", full,
                        strerror(errno));
  return FERRY_OK;
}
