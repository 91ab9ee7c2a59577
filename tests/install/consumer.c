/* consumer.c — builds against an installed ferry and round-trips a tensor. */
#include <ferry.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int on_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  *ptr = *owner = malloc(bytes);
  return *ptr ? 0 : -1;
}
static void on_release(void *ud, void *owner) { free(owner); }
static int offload_all(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                       ferry_decision *out) {
  memset(out, 0, sizeof *out);
  out->action = FERRY_OFFLOAD;
  return 0;
}

int main(void) {
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.device_alloc = on_alloc;
  cfg.release = on_release;
  cfg.decide = offload_all;
  cfg.max_fwd_stash = 0;
  ferry_engine *e;
  char err[256];
  if (ferry_engine_create(&cfg, &e, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  char *buf = malloc(4096);
  for (int i = 0; i < 4096; i++) buf[i] = (char)(i * 7);
  ferry_tensor_desc d = {.bytes = 4096, .dtype = FERRY_DTYPE_U8, .ndim = 1, .shape = {4096}, .layer = -1};
  ferry_handle h;
  void *ptr, *owner;
  if (ferry_pack(e, &d, buf, buf, NULL, &h) || ferry_unpack(e, h, NULL, &ptr, &owner)) {
    fprintf(stderr, "%s\n", ferry_last_error(e));
    return 1;
  }
  int ok = 1;
  for (int i = 0; i < 4096; i++) ok &= ((char *)ptr)[i] == (char)(i * 7);
  ferry_stats s;
  ferry_get_stats(e, &s, sizeof s);
  printf("ferry %s (%s/%s): offloaded %llu, round trip %s\n", ferry_version_string(),
         ferry_backend_name(e), ferry_arena_name(e), (unsigned long long)s.tensors_offloaded,
         ok ? "ok" : "CORRUPT");
  free(owner);
  ferry_engine_destroy(e);
  return ok && s.tensors_offloaded == 1 ? 0 : 1;
}
