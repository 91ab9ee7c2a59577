/* older_caller.c — a trainer built against an older ferry.h (ferry_older.h:
 * a ferry_config without this release's last fields) and run against this
 * libferry. Its config ends right before an inaccessible page, so a library
 * that writes or reads past the caller's struct_size faults here. Exits 0
 * when the engine works with the older config. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ferry_older.h"

#define FAIL(...) (fprintf(stderr, "older_caller: " __VA_ARGS__), fputc('\n', stderr), exit(1))

static int alloc_cb(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  (void)ud, (void)stream;
  *ptr = *owner = malloc(bytes);
  return *ptr ? 0 : -1;
}
static void release_cb(void *ud, void *owner) { (void)ud, free(owner); }
static int offload_cb(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                      ferry_decision *out) {
  (void)ud, (void)d, (void)ctx;
  *out = (ferry_decision){.action = FERRY_OFFLOAD, .reload = FERRY_RELOAD_ON_USE,
                          .prefetch_distance = -1};
  return 0;
}

int main(void) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char *m = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED || mprotect(m + page, page, PROT_NONE)) FAIL("cannot map a guard page");
  ferry_config *cfg = (ferry_config *)(void *)(m + page - sizeof(ferry_config));

  ferry_config_init(cfg); /* this header's size: nothing past it is written */
  if (cfg->struct_size != sizeof(ferry_config))
    FAIL("struct_size %u, expected the caller's %zu", cfg->struct_size, sizeof(ferry_config));
  cfg->backend = FERRY_BACKEND_HOST;
  cfg->arena = FERRY_ARENA_POOL;
  cfg->device_alloc = alloc_cb;
  cfg->release = release_cb;
  cfg->decide = offload_cb;
  cfg->min_offload_bytes = 0;
  cfg->max_fwd_stash = 0; /* offloaded at once: unpack reloads */
  ferry_engine *e = NULL;
  char err[512] = "";
  int rc = ferry_engine_create(cfg, &e, err, sizeof err); /* nothing past it is read */
  if (rc) FAIL("ferry_engine_create: %s: %s", ferry_err_name(rc), err);

  enum { N = 1 << 16 };
  unsigned char *buf = malloc(N);
  if (!buf) FAIL("out of memory");
  for (int i = 0; i < N; i++) buf[i] = (unsigned char)(i * 7 + 1);
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = N;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = N;
  ferry_handle h;
  void *ptr, *owner;
  if ((rc = ferry_pack(e, &d, buf, buf, NULL, &h))) FAIL("ferry_pack: %s", ferry_last_error(e));
  if ((rc = ferry_backward_begin(e))) FAIL("ferry_backward_begin: %s", ferry_last_error(e));
  if ((rc = ferry_unpack(e, h, NULL, &ptr, &owner))) FAIL("ferry_unpack: %s", ferry_last_error(e));
  for (int i = 0; i < N; i++)
    if (((unsigned char *)ptr)[i] != (unsigned char)(i * 7 + 1)) FAIL("byte %d differs", i);
  release_cb(NULL, owner);
  if ((rc = ferry_step_end(e))) FAIL("ferry_step_end: %s", ferry_last_error(e));
  ferry_stats st;
  if ((rc = ferry_get_stats(e, &st, sizeof st))) FAIL("ferry_get_stats: %s", ferry_last_error(e));
  if (st.tensors_offloaded != 1 || st.bytes_h2d != N) FAIL("the tensor was not offloaded and reloaded");
  ferry_engine_destroy(e);
  munmap(m, 2 * page);
  printf("older_caller: a %zu-byte ferry_config (this release's is larger) works\n",
         sizeof(ferry_config));
  return 0;
}
