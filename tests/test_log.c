/* test_log.c — the engine's message sink (ferry_log_open): a policy's
 * ferry.log() lines in a file capped in size and rotated, repeats counted,
 * the level filter, and paths that are not regular files refused. */
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"

/* Runs `decide` of a policy whose decide calls ferry.log(line(i)) for
 * i = 1..n, where line is given as Lua source. */
static int log_from_policy(const char *dir, const char *line_fn, int n) {
  char path[256], src[1024];
  snprintf(path, sizeof path, "%s/logger.lua", dir);
  snprintf(src, sizeof src,
           "local i = 0\n"
           "local line = %s\n"
           "return { api = 1, name = 'logger', decide = function(t, ctx)\n"
           "  i = i + 1\n"
           "  ferry.log(line(i))\n"
           "  return ferry.KEEP\n"
           "end }\n",
           line_fn);
  FILE *f = fopen(path, "w");
  if (!f) return 1;
  fputs(src, f);
  fclose(f);
  ferry_policy *p = NULL;
  char err[512];
  if (ferry_policy_create(path, NULL, 0, &p, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 1 << 20;
  d.module_path = "model.layers.0.mlp";
  ferry_context c;
  memset(&c, 0, sizeof c);
  for (int i = 0; i < n; i++) {
    ferry_decision out;
    ferry_policy_decide(p, &d, &c, &out);
  }
  ferry_policy_destroy(p);
  return 0;
}

static long file_size(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

/* The whole file in a static buffer ("" if absent). */
static const char *slurp(const char *path) {
  static char buf[1 << 16];
  buf[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return buf;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  return buf;
}

static void back_to_stderr(void) {
  ferry_log_open(NULL, 16 << 20, 3, FERRY_LOG_INFO, NULL, 0);
}

TEST(log_file_is_capped_and_rotated) {
  char dir[] = "/tmp/ferry-log-XXXXXX", path[128], old[160];
  CHECK(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/ferry-%%p.log", dir); /* %p: this pid */
  char err[256];
  CHECK_OK(ferry_log_open(path, 4096, 2, FERRY_LOG_INFO, err, sizeof err));
  /* 300 distinct lines of about 80 bytes: 24 KB through a 4 KB file */
  int rc = log_from_policy(dir, "function(i) return string.format('line %05d ', i) .. "
                                "string.rep('x', 30) end", 300);
  back_to_stderr();
  CHECK_EQ(rc, 0);
  snprintf(path, sizeof path, "%s/ferry-%d.log", dir, (int)getpid());
  for (int k = 0; k <= 2; k++) {
    if (k) snprintf(old, sizeof old, "%s.%d", path, k);
    long size = file_size(k ? old : path);
    CHECK(size > 0);
    CHECK(size <= 4096); /* never past the cap */
  }
  snprintf(old, sizeof old, "%s.3", path);
  CHECK_EQ(file_size(old), -1); /* keep = 2 */
  /* the newest line in the current file, older ones rotated in order */
  CHECK_STR_CONTAINS(slurp(path), "info: policy logger: line 00300 xxx");
  CHECK(!strstr(slurp(path), "line 00001 "));
  snprintf(old, sizeof old, "%s.1", path);
  const char *one = slurp(old);
  CHECK(strstr(one, "line 00") && !strstr(one, "line 00300"));
  int first_in_1 = atoi(strstr(one, "line ") + 5);
  snprintf(old, sizeof old, "%s.2", path);
  int first_in_2 = atoi(strstr(slurp(old), "line ") + 5);
  CHECK(first_in_2 < first_in_1);
  /* each line carries time, pid and level */
  char pid[32];
  snprintf(pid, sizeof pid, " ferry[%d] info: ", (int)getpid());
  CHECK_STR_CONTAINS(slurp(path), pid);
  return 0;
}

TEST(log_counts_repeats_and_filters_levels) {
  char dir[] = "/tmp/ferry-log-XXXXXX", path[128];
  CHECK(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/ferry.log", dir);
  char err[256];
  CHECK_OK(ferry_log_open(path, 1 << 20, 1, FERRY_LOG_INFO, err, sizeof err));
  /* 50 identical lines, then a different one */
  int rc = log_from_policy(dir, "function(i) return i <= 50 and 'same fault' or 'other' end", 51);
  back_to_stderr(); /* also writes out a pending count */
  CHECK_EQ(rc, 0);
  const char *text = slurp(path);
  CHECK_STR_CONTAINS(text, "policy logger: same fault\n");
  CHECK_STR_CONTAINS(text, "the previous message repeated 49 more times\n");
  CHECK_STR_CONTAINS(text, "policy logger: other\n");
  CHECK(!strstr(strstr(text, "same fault") + 1, "same fault")); /* written once */
  /* errors only: a policy's info lines are dropped */
  unlink(path);
  CHECK_OK(ferry_log_open(path, 1 << 20, 1, FERRY_LOG_ERROR, err, sizeof err));
  rc = log_from_policy(dir, "function(i) return 'chatter' end", 3);
  back_to_stderr();
  CHECK_EQ(rc, 0);
  CHECK_EQ(file_size(path), 0);
  return 0;
}

TEST(log_refuses_what_is_not_a_regular_file) {
  char err[256];
  CHECK_RC(ferry_log_open("/dev/null", 1 << 20, 1, FERRY_LOG_INFO, err, sizeof err),
           FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "log file /dev/null: not a regular file");
  CHECK_RC(ferry_log_open("/tmp", 1 << 20, 1, FERRY_LOG_INFO, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "log file /tmp: not a regular file");
  CHECK_RC(ferry_log_open("/tmp/x.log", 100, 1, FERRY_LOG_INFO, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "log max_bytes 100: expected at least 4096");
  CHECK_RC(ferry_log_open("/tmp/x.log", 1 << 20, 101, FERRY_LOG_INFO, err, sizeof err),
           FERRY_EINVAL);
  CHECK_RC(ferry_log_open(NULL, 1 << 20, 1, 7, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "log level 7");
  return 0;
}
