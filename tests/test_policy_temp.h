/* test_policy_temp.h — the policy tests' files: policies written to a
 * temporary directory and loaded, so that every error message can be
 * checked for its exact "file:line: message"; a tensor descriptor to ask
 * about; and the checks of load errors, faults and reasons. Shared by the
 * test_policy*.c files. */
#ifndef FERRY_TEST_POLICY_TEMP_H
#define FERRY_TEST_POLICY_TEMP_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

/* ---- helpers ------------------------------------------------------------ */
static char tmp_dir[64];

static inline const char *temp_dir(void) {
  if (!tmp_dir[0]) {
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/ferry-policy-XXXXXX");
    if (!mkdtemp(tmp_dir)) {
      perror("mkdtemp");
      abort();
    }
  }
  return tmp_dir;
}

/* Write `text` to DIR/name and return the path (static buffer per call
 * site is not needed: callers copy it). */
/* Out of line, as it was in test_policy.c: inlined, GCC's format-truncation
 * check follows a 300-byte name into a 256-byte path. */
__attribute__((noinline, unused)) static void write_file(char *path, size_t n, const char *name,
                                                         const char *text) {
  snprintf(path, n, "%s/%s", temp_dir(), name);
  FILE *f = fopen(path, "wb");
  if (!f) {
    perror(path);
    abort();
  }
  fputs(text, f);
  fclose(f);
}

static inline ferry_tensor_desc desc_of(const char *path, const char *cls, int kind, uint64_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_BF16;
  d.kind = kind;
  d.ndim = 2;
  d.shape[0] = 4;
  d.shape[1] = (int64_t)(bytes / 8);
  d.flags = FERRY_FLAG_CONTIGUOUS;
  d.layer = 3;
  d.layer_count = 8;
  d.phase = FERRY_PHASE_FORWARD;
  d.module_path = path;
  d.module_class = cls;
  return d;
}

/* Load a policy file that must fail; compare the whole message. */
static inline int expect_load_error(const char *name, const char *text, int trusted, int line,
                             const char *msg) {
  char path[256], err[1024], want[1024];
  write_file(path, sizeof path, name, text);
  ferry_policy *p = NULL;
  int rc = ferry_policy_create(path, NULL, trusted, &p, err, sizeof err);
  if (line)
    snprintf(want, sizeof want, "%s:%d: %s", path, line, msg);
  else
    snprintf(want, sizeof want, "%s: %s", path, msg);
  if (rc != FERRY_EPOLICY || p != NULL || strcmp(err, want) != 0) {
    fprintf(stderr, "%s: rc %d\n  got  \"%s\"\n  want \"%s\"\n", name, rc, err, want);
    ferry_policy_destroy(p);
    return 1;
  }
  return 0;
}

static inline ferry_policy *load_file(const char *name, const char *text, int trusted, char *path,
                               size_t pathlen) {
  write_file(path, pathlen, name, text);
  char err[1024];
  ferry_policy *p = NULL;
  if (ferry_policy_create(path, NULL, trusted, &p, err, sizeof err) != FERRY_OK)
    fprintf(stderr, "%s: unexpected load error: %s\n", name, err);
  return p;
}

/* last_error must be exactly "path:line: msg" */
static inline int expect_fault(ferry_policy *p, const char *path, int line, const char *msg) {
  char want[1024];
  snprintf(want, sizeof want, "%s:%d: %s", path, line, msg);
  if (strcmp(ferry_policy_last_error(p), want) != 0) {
    fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", ferry_policy_last_error(p), want);
    return 1;
  }
  return 0;
}

/* why must name `rule`, at path:line (line 0: where must be ""). */
static inline int expect_reason(const ferry_policy_reason *why, const char *rule, const char *path,
                         int line) {
  char want[1024];
  if (line)
    snprintf(want, sizeof want, "%s:%d", path, line);
  else
    want[0] = '\0';
  if (strcmp(why->rule, rule) != 0 || strcmp(why->where, want) != 0) {
    fprintf(stderr, "  got  \"%s\" at \"%s\"\n  want \"%s\" at \"%s\"\n", why->rule, why->where,
            rule, want);
    return 1;
  }
  return 0;
}

#endif
