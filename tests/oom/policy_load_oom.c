/* policy_load_oom.c — loading a policy while the C allocator fails: the k-th
 * realloc (every allocation of a policy's Lua state is one) returns NULL,
 * for each k a load makes. The load must succeed or fail with a message;
 * the process must not crash (LuaJIT crashed inside lua_newstate and
 * lua_close, and aborted on an unprotected call). Each k runs in a child
 * process. Its own executable: it replaces realloc, which a sanitizer's
 * runtime also does (not built under FERRY_ASAN/FERRY_TSAN). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry.h"

extern void *__libc_realloc(void *p, size_t n);
static long reallocs = -1;  /* counted from 0 while >= 0 */
static long fail_at = -1;   /* the call that returns NULL */

/* (default visibility: the build hides symbols, and libferry must see it) */
__attribute__((visibility("default"))) void *realloc(void *p, size_t n) {
  if (reallocs >= 0 && ++reallocs == fail_at) return NULL;
  return __libc_realloc(p, n);
}

static int alloc_cb(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  (void)ud, (void)stream;
  *ptr = *owner = malloc(bytes);
  return *ptr ? 0 : -1;
}
static void release_cb(void *ud, void *owner) { (void)ud, free(owner); }

static const char *const POLICY =
    "local R = {}\n"
    "return { api = 1, decide = function(t, ctx)\n"
    "  if t.bytes > 4096 then return ferry.OFFLOAD end\n"
    "  return ferry.KEEP end }\n";

/* Loads POLICY into a new engine with realloc call `k` failing (0: none).
 * Exit status: 0 loaded, 1 refused with a message about memory, 2 other. */
static int load_once(long k, long *calls) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.device_alloc = alloc_cb;
  c.release = release_cb;
  c.arena = FERRY_ARENA_POOL;
  ferry_engine *e = NULL;
  char err[512] = "";
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "policy_load_oom: engine: %s\n", err);
    return 2;
  }
  fail_at = k;
  reallocs = 0;
  int rc = ferry_set_policy(e, NULL, POLICY, 0);
  *calls = reallocs;
  reallocs = -1;
  int status = 0;
  if (rc) {
    const char *m = ferry_last_error(e);
    status = strstr(m, "memory") ? 1 : 2;
    if (status == 2) fprintf(stderr, "policy_load_oom: k=%ld: %s\n", k, m);
  }
  /* the engine and its previous (no) policy still work */
  ferry_stats s;
  if (ferry_get_stats(e, &s, sizeof s)) status = 2;
  ferry_engine_destroy(e);
  return status;
}

int main(void) {
  long calls = 0;
  if (load_once(0, &calls) != 0 || calls < 10) {
    fprintf(stderr, "policy_load_oom: the policy does not load without failures (%ld reallocs)\n",
            calls);
    return 1;
  }
  int loaded = 0, refused = 0, bad = 0;
  for (long k = 1; k <= calls; k++) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return perror("fork"), 1;
    if (pid == 0) {
      long n;
      _exit(load_once(k, &n));
    }
    int st;
    if (waitpid(pid, &st, 0) != pid) return perror("waitpid"), 1;
    if (WIFSIGNALED(st)) {
      fprintf(stderr, "policy_load_oom: realloc %ld of %ld failing: killed by signal %d\n", k,
              calls, WTERMSIG(st));
      bad++;
    } else if (WEXITSTATUS(st) == 0) {
      loaded++;
    } else if (WEXITSTATUS(st) == 1) {
      refused++;
    } else {
      bad++;
    }
  }
  printf("policy_load_oom: %ld reallocs failed one at a time: %d loads succeeded, %d refused "
         "for lack of memory, %d crashed or failed otherwise\n", calls, loaded, refused, bad);
  return bad ? 1 : 0;
}
