/* test_contract.c — the embedding API's contract (docs/embedding.md): a
 * config is read and written only within its struct_size, a refused call
 * changes nothing, FERRY_ELEAK counts this step's handles, callbacks may
 * call back into the engine where ferry.h says so, returned strings live as
 * long as ferry.h says, and destroyed engines are refused. */
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "test_device.h"

/* ---- helpers ---------------------------------------------------------------- */
/* `size` bytes that end right before an inaccessible page: touching a byte
 * past them faults. map and maplen: what to munmap. */
static void *before_guard_page(size_t size, void **map, size_t *maplen) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t pages = (size + page - 1) / page + 1;
  char *m = mmap(NULL, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return NULL;
  if (mprotect(m + (pages - 1) * page, page, PROT_NONE)) {
    munmap(m, pages * page);
    return NULL;
  }
  *map = m;
  *maplen = pages * page;
  return m + (pages - 1) * page - size;
}

static int offload_all(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                       ferry_decision *out) {
  (void)d, (void)ctx;
  const int *distance = ud;
  out->action = FERRY_OFFLOAD;
  out->reload = distance ? FERRY_RELOAD_PREFETCH : FERRY_RELOAD_ON_USE;
  out->prefetch_distance = distance ? *distance : -1;
  out->cacheable = 0;
  return 0;
}

static ferry_tensor_desc desc_of(uint64_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = (int64_t)bytes;
  return d;
}

/* A config that offloads every tensor and keeps none in the stash. */
static ferry_config offload_config(test_device_stats *st) {
  ferry_config c = test_engine_config(st);
  c.retain = test_device_retain_cb;
  c.decide = offload_all;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 0;
  return c;
}

/* Runs fn(arg) on a thread; 0 when it returned within `seconds`, else 1 (a
 * hang: the thread is left behind, the test fails). */
static int runs_within(void *(*fn)(void *), void *arg, int seconds) {
  pthread_t t;
  if (pthread_create(&t, NULL, fn, arg)) return 1;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += seconds;
  if (pthread_timedjoin_np(t, NULL, &until) == 0) return 0;
  fprintf(stderr, "the call did not return within %d s (a deadlock)\n", seconds);
  return 1;
}

/* ---- config: read and written within its struct_size ------------------------ */
TEST(contract_config_init_writes_only_the_callers_size) {
  /* an older header's config: this one without its last two fields */
  const size_t older = offsetof(ferry_config, count_reasons);
  void *map;
  size_t maplen;
  ferry_config *c = before_guard_page(older, &map, &maplen);
  CHECK(c != NULL);
  memset(c, 0x5a, older);
  CHECK_OK(ferry_config_init_sized(c, older)); /* faults if it writes past */
  CHECK_EQ(c->struct_size, older);
  CHECK_EQ(c->max_fwd_stash, 4);
  CHECK_EQ(c->device, -1);
  CHECK(c->device_alloc == NULL && c->chrome_trace_path == NULL);
  /* below any release's size, or NULL: refused, nothing written */
  memset(c, 0x5a, older);
  CHECK_RC(ferry_config_init_sized(c, 8), FERRY_EINVAL);
  CHECK_EQ(((unsigned char *)c)[0], 0x5a);
  CHECK_RC(ferry_config_init_sized(NULL, sizeof(ferry_config)), FERRY_EINVAL);
  /* a newer header's config: the tail this library does not know is zeroed
   * and accepted while it stays zero */
  unsigned char newer[sizeof(ferry_config) + 16];
  memset(newer, 0x5a, sizeof newer);
  ferry_config *n = (ferry_config *)(void *)newer;
  CHECK_OK(ferry_config_init_sized(n, sizeof newer));
  CHECK_EQ(n->struct_size, sizeof newer);
  CHECK_EQ(newer[sizeof newer - 1], 0);
  test_device_stats st = {0};
  n->device_alloc = test_device_alloc_cb;
  n->release = test_device_release_cb;
  n->callback_ud = &st;
  ferry_engine *e = NULL;
  char err[512] = "";
  CHECK_OK(ferry_engine_create(n, &e, err, sizeof err));
  ferry_engine_destroy(e);
  newer[sizeof newer - 3] = 1; /* a field this library cannot honour */
  CHECK_RC(ferry_engine_create(n, &e, err, sizeof err), FERRY_EVERSION);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, "does not know");
  munmap(map, maplen);
  return 0;
}

TEST(contract_config_read_only_within_struct_size) {
  /* An older caller's config that ends after callback_ud: the policy, trace
   * and later fields are not there, and are not read. */
  test_device_stats st = {0};
  ferry_config full = offload_config(&st);
  const size_t older = offsetof(ferry_config, decide);
  void *map;
  size_t maplen;
  ferry_config *c = before_guard_page(older, &map, &maplen);
  CHECK(c != NULL);
  memcpy(c, &full, older);
  c->struct_size = (uint32_t)older;
  ferry_engine *e = NULL;
  char err[512] = "";
  CHECK_OK(ferry_engine_create(c, &e, err, sizeof err)); /* faults if it reads past */
  ferry_tensor_desc d = desc_of(4096);
  test_buffer *b = test_buffer_new(4096);
  ferry_handle h;
  void *ptr, *owner;
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h));
  CHECK_OK(ferry_unpack(e, h, NULL, &ptr, &owner));
  CHECK(owner == b);
  test_device_release_cb(&st, owner);
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  munmap(map, maplen);
  return 0;
}

/* ---- refused calls change nothing ------------------------------------------- */
TEST(contract_refused_phase_call_changes_nothing) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  ferry_engine *e = NULL;
  CHECK_OK(ferry_engine_create(&c, &e, NULL, 0));
  ferry_stats s;
  /* on a fresh engine: no step is started by the refusal */
  CHECK_RC(ferry_backward_end(e), FERRY_ESTATE);
  CHECK_STR_CONTAINS(ferry_last_error(e), "without ferry_backward_begin");
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.steps, 0);
  CHECK_OK(ferry_set_policy(e, NULL, "return { api = 1, decide = function() end }", 0));
  CHECK_OK(ferry_step_begin(e));
  /* in backward: a second backward_begin is refused, backward goes on */
  CHECK_OK(ferry_backward_begin(e));
  CHECK_RC(ferry_backward_begin(e), FERRY_ESTATE);
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  /* between steps: refused again, still between steps */
  CHECK_RC(ferry_backward_end(e), FERRY_ESTATE);
  CHECK_OK(ferry_set_policy(e, NULL, "return { api = 1, decide = function() return nil end }", 0));
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.steps, 1);
  /* backward_begin between steps is no refusal: it starts a step */
  CHECK_OK(ferry_backward_begin(e));
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  return 0;
}

/* ---- FERRY_ELEAK counts this step's handles ---------------------------------- */
TEST(contract_leak_counts_only_this_steps_handles) {
  test_device_stats st = {0};
  ferry_config c = offload_config(&st);
  c.max_fwd_stash = 64; /* stashed: each holds its arena bytes */
  ferry_engine *e = NULL;
  CHECK_OK(ferry_engine_create(&c, &e, NULL, 0));
  ferry_tensor_desc d = desc_of(4096);
  test_buffer *b[5];
  ferry_handle h[5];
  for (int i = 0; i < 5; i++) b[i] = test_buffer_new(4096);
  /* step 1 leaks two */
  CHECK_OK(ferry_pack(e, &d, b[0]->ptr, b[0], NULL, &h[0]));
  CHECK_OK(ferry_pack(e, &d, b[1]->ptr, b[1], NULL, &h[1]));
  CHECK_RC(ferry_step_end(e), FERRY_ELEAK);
  CHECK_STR_CONTAINS(ferry_last_error(e), "with 2 handle(s)");
  CHECK_STR_CONTAINS(ferry_last_error(e), "hold 8192 arena bytes");
  /* step 2 discards one of them and leaks a new one: still a leak, of one
   * handle (step 1's other one is not this step's) */
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_discard(e, h[0]));
  CHECK_OK(ferry_pack(e, &d, b[2]->ptr, b[2], NULL, &h[2]));
  CHECK_RC(ferry_step_end(e), FERRY_ELEAK);
  CHECK_STR_CONTAINS(ferry_last_error(e), "with 1 handle(s)");
  CHECK_STR_CONTAINS(ferry_last_error(e), "hold 4096 arena bytes");
  /* step 3 discards it and leaks two: their bytes, not a difference */
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_discard(e, h[2]));
  CHECK_OK(ferry_pack(e, &d, b[3]->ptr, b[3], NULL, &h[3]));
  CHECK_OK(ferry_pack(e, &d, b[4]->ptr, b[4], NULL, &h[4]));
  CHECK_RC(ferry_step_end(e), FERRY_ELEAK);
  CHECK_STR_CONTAINS(ferry_last_error(e), "with 2 handle(s)");
  CHECK_STR_CONTAINS(ferry_last_error(e), "hold 8192 arena bytes");
  /* step 4 uses up the old ones: no leak of its own */
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_discard(e, h[1]));
  CHECK_OK(ferry_discard(e, h[3]));
  CHECK_OK(ferry_discard(e, h[4]));
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  CHECK_EQ(atomic_load(&st.releases), 5);
  return 0;
}

/* ---- device_alloc may discard other handles --------------------------------- */
typedef struct reentry {
  ferry_engine *e;
  test_device_stats st;
  uint64_t discard_at_bytes; /* device_alloc for this size discards `victim` */
  ferry_handle victim, unpacked;
  int discard_rc, unpack_rc, discards;
  void *ptr, *owner;
} reentry;

static int discarding_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  reentry *r = ud;
  if (bytes == r->discard_at_bytes && !r->discards++) r->discard_rc = ferry_discard(r->e, r->victim);
  return test_device_alloc_cb(&r->st, bytes, stream, ptr, owner);
}
static void reentry_release(void *ud, void *owner) {
  test_device_release_cb(&((reentry *)ud)->st, owner);
}
static void reentry_retain(void *ud, void *owner) {
  test_device_retain_cb(&((reentry *)ud)->st, owner);
}

static void *unpack_thread(void *arg) {
  reentry *r = arg;
  r->unpack_rc = ferry_unpack(r->e, r->unpacked, NULL, &r->ptr, &r->owner);
  return NULL;
}

TEST(contract_device_alloc_may_discard_an_alias) {
  /* A framework frees the other saved copy of the buffer being reloaded
   * from inside device_alloc. */
  reentry r = {.discard_at_bytes = 4096};
  const long buffers_before = test_buffers_live();
  ferry_config c = offload_config(NULL);
  c.max_fwd_stash = 1;
  c.device_alloc = discarding_alloc;
  c.release = reentry_release;
  c.retain = reentry_retain;
  c.callback_ud = &r;
  CHECK_OK(ferry_engine_create(&c, &r.e, NULL, 0));
  ferry_tensor_desc d = desc_of(4096), dc = desc_of(2048);
  test_buffer *b = test_buffer_new(4096), *other = test_buffer_new(2048);
  memset(b->ptr, 0x3c, 4096);
  atomic_fetch_add(&b->refs, 1); /* one reference for each pack */
  ferry_handle h1, h2, hc;
  CHECK_OK(ferry_pack(r.e, &d, b->ptr, b, NULL, &h1));
  CHECK_OK(ferry_pack(r.e, &d, b->ptr, b, NULL, &h2)); /* an alias: one copy */
  CHECK_OK(ferry_pack(r.e, &dc, other->ptr, other, NULL, &hc)); /* pushes b out */
  ferry_stats s;
  CHECK_OK(ferry_get_stats(r.e, &s, sizeof s));
  CHECK_EQ(s.tensors_aliased, 1);
  CHECK_OK(ferry_backward_begin(r.e));
  r.victim = h2;
  r.unpacked = h1;
  CHECK_OK(runs_within(unpack_thread, &r, 20));
  CHECK_EQ(r.discards, 1); /* h1 was reloaded */
  CHECK_OK(r.discard_rc);
  CHECK_OK(r.unpack_rc);
  unsigned char got[4096];
  test_dev_read(got, r.ptr, sizeof got);
  CHECK_EQ(got[0], 0x3c);
  CHECK_EQ(got[4095], 0x3c);
  test_device_release_cb(&r.st, r.owner);
  CHECK_RC(ferry_discard(r.e, h2), FERRY_EHANDLE);
  CHECK_OK(ferry_discard(r.e, hc));
  CHECK_OK(ferry_step_end(r.e));
  CHECK_OK(ferry_get_stats(r.e, &s, sizeof s));
  CHECK_EQ(s.live_handles, 0);
  ferry_engine_destroy(r.e);
  CHECK_EQ(test_buffers_live(), buffers_before);
  return 0;
}

TEST(contract_device_alloc_may_discard_what_it_prefetches) {
  /* The unpack of t2 prefetches t1; the framework frees t1 from inside
   * that device_alloc. */
  reentry r = {.discard_at_bytes = 8192};
  const long buffers_before = test_buffers_live();
  int distance = 1;
  ferry_config c = offload_config(NULL);
  c.decide_ud = &distance;
  c.device_alloc = discarding_alloc;
  c.release = reentry_release;
  c.retain = reentry_retain;
  c.callback_ud = &r;
  CHECK_OK(ferry_engine_create(&c, &r.e, NULL, 0));
  ferry_tensor_desc d1 = desc_of(8192), d2 = desc_of(4096);
  test_buffer *b1 = test_buffer_new(8192), *b2 = test_buffer_new(4096);
  ferry_handle h1, h2;
  CHECK_OK(ferry_pack(r.e, &d1, b1->ptr, b1, NULL, &h1));
  CHECK_OK(ferry_pack(r.e, &d2, b2->ptr, b2, NULL, &h2));
  CHECK_OK(ferry_backward_begin(r.e));
  r.victim = h1;
  r.unpacked = h2;
  CHECK_OK(runs_within(unpack_thread, &r, 20));
  CHECK_EQ(r.discards, 1); /* the prefetch of t1 ran */
  CHECK_OK(r.discard_rc);
  CHECK_OK(r.unpack_rc);
  unsigned char first;
  test_dev_read(&first, r.ptr, 1); /* the free after the reload's copy: the
                                    * legacy stream was made to wait for it */
  test_device_release_cb(&r.st, r.owner);
  void *p, *o;
  CHECK_RC(ferry_unpack(r.e, h1, NULL, &p, &o), FERRY_EHANDLE);
  CHECK_OK(ferry_step_end(r.e));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(r.e, &s, sizeof s));
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.device_bytes_held, 0);
  CHECK_EQ(s.arena_in_use, 0);
  ferry_engine_destroy(r.e);
  CHECK_EQ(test_buffers_live(), buffers_before);
  return 0;
}

/* ---- host_reserve runs without the engine lock ------------------------------ */
typedef struct reserve_probe {
  ferry_engine *_Atomic e;
  atomic_int calls, stats_ok;
} reserve_probe;

static int stats_reading_reserve(void *ud, uint64_t bytes, int release) {
  (void)bytes, (void)release;
  reserve_probe *p = ud;
  atomic_fetch_add(&p->calls, 1);
  ferry_engine *e = atomic_load(&p->e);
  ferry_stats s;
  if (e && ferry_get_stats(e, &s, sizeof s) == FERRY_OK) atomic_fetch_add(&p->stats_ok, 1);
  return 0;
}

typedef struct pack_job {
  ferry_engine *e;
  test_buffer *b;
  ferry_handle h;
  int rc;
} pack_job;

static void *pack_thread(void *arg) {
  pack_job *j = arg;
  ferry_tensor_desc d = desc_of(j->b->bytes);
  j->rc = ferry_pack(j->e, &d, j->b->ptr, j->b, NULL, &j->h);
  return NULL;
}

TEST(contract_host_reserve_runs_without_the_engine_lock) {
  reserve_probe probe = {0};
  test_device_stats st = {0};
  ferry_config c = offload_config(&st);
  c.host_reserve = stats_reading_reserve;
  c.host_reserve_ud = &probe;
  ferry_engine *e = NULL;
  CHECK_OK(ferry_engine_create(&c, &e, NULL, 0));
  atomic_store(&probe.e, e);
  pack_job j = {.e = e, .b = test_buffer_new(1 << 20)};
  CHECK_OK(runs_within(pack_thread, &j, 20)); /* a hook that calls ferry: no deadlock */
  CHECK_OK(j.rc);
  CHECK(atomic_load(&probe.calls) > 0);
  CHECK_EQ(atomic_load(&probe.stats_ok), atomic_load(&probe.calls));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_offloaded, 1);
  CHECK_OK(ferry_discard(e, j.h));
  CHECK_OK(ferry_step_end(e));
  atomic_store(&probe.e, NULL);
  ferry_engine_destroy(e);
  return 0;
}

/* ---- returned strings ---------------------------------------------------------- */
TEST(contract_last_policy_error_outlives_set_policy) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.min_offload_bytes = 0;
  c.policy_source = "return { api = 1, decide = function(t, ctx) error('boom') end }";
  ferry_engine *e = NULL;
  CHECK_OK(ferry_engine_create(&c, &e, NULL, 0));
  ferry_tensor_desc d = desc_of(4096);
  test_buffer *b = test_buffer_new(4096);
  ferry_handle h;
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h)); /* the fault keeps it */
  CHECK_OK(ferry_discard(e, h));
  CHECK_OK(ferry_step_end(e));
  const char *msg = ferry_last_policy_error(e);
  CHECK_STR_CONTAINS(msg, "boom");
  /* five swaps destroy the faulting policy (four are parked) */
  for (int i = 0; i < 5; i++) {
    char src[128];
    snprintf(src, sizeof src, "return { api = 1, decide = function() end } -- %d", i);
    CHECK_OK(ferry_set_policy(e, NULL, src, 0));
  }
  CHECK_STR_CONTAINS(msg, "boom"); /* still readable (ASan: no use after free) */
  CHECK_EQ(strcmp(ferry_last_policy_error(e), ""), 0);
  ferry_engine_destroy(e);
  return 0;
}

typedef struct error_race {
  ferry_engine *e;
  atomic_int stop;
  int bad;
} error_race;

static void *fail_calls(void *arg) {
  error_race *r = arg;
  for (uint64_t i = 1; !atomic_load(&r->stop); i++) ferry_discard(r->e, (i << 32) | 77777);
  return NULL;
}

TEST(contract_last_error_read_by_threads) {
  /* one thread fails calls (each writes the message), another reads it */
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  error_race r = {0};
  CHECK_OK(ferry_engine_create(&c, &r.e, NULL, 0));
  pthread_t t;
  CHECK_OK(pthread_create(&t, NULL, fail_calls, &r));
  for (int i = 0; i < 20000; i++) {
    const char *m = ferry_last_error(r.e);
    if (*m && !(strstr(m, "ferry_discard: handle 0x") && strstr(m, "unknown, stale or already used")))
      r.bad++;
  }
  atomic_store(&r.stop, 1);
  pthread_join(t, NULL);
  CHECK_EQ(r.bad, 0);
  ferry_engine_destroy(r.e);
  return 0;
}

/* ---- destroyed engines ---------------------------------------------------------- */
TEST(contract_destroyed_engine_is_refused) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  ferry_engine *e1 = NULL, *e2 = NULL;
  CHECK_OK(ferry_engine_create(&c, &e1, NULL, 0));
  ferry_engine_destroy(e1);
  ferry_engine_destroy(e1); /* a second destroy is a no-op */
  /* the next engines do not get e1's address: the stale pointer is refused
   * instead of acting on them */
  ferry_engine *later[8];
  for (int i = 0; i < 8; i++) {
    CHECK_OK(ferry_engine_create(&c, &later[i], NULL, 0));
    CHECK(later[i] != e1);
  }
  e2 = later[7];
  ferry_stats s;
  CHECK_RC(ferry_get_stats(e1, &s, sizeof s), FERRY_ESTATE);
  CHECK_RC(ferry_step_begin(e1), FERRY_ESTATE);
  CHECK_EQ(strcmp(ferry_last_error(e1), "not a live ferry engine"), 0);
  ferry_engine_destroy(e1);
  CHECK_OK(ferry_step_begin(e2)); /* untouched by the stale calls */
  CHECK_OK(ferry_step_end(e2));
  CHECK_OK(ferry_get_stats(e2, &s, sizeof s));
  CHECK_EQ(s.steps, 1);
  for (int i = 0; i < 8; i++) ferry_engine_destroy(later[i]);
  return 0;
}
