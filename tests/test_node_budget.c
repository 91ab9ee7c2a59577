/* test_node_budget.c — ferry_node_budget_*: a host cap shared by processes
 * through POSIX shared memory, reclaimed from processes that die. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

/* A segment name of this test process, unlinked before use. */
static const char *budget_name(const char *what) {
  static char name[96];
  snprintf(name, sizeof name, "ferry-test-%s-%d", what, (int)getpid());
  ferry_node_budget_unlink(name, NULL, 0);
  return name;
}

TEST(node_budget_two_handles_share_the_cap) {
  const char *name = budget_name("share");
  ferry_node_budget *a = NULL, *b = NULL;
  char err[256] = "";
  CHECK_OK(ferry_node_budget_open(name, 1000, &a, err, sizeof err));
  CHECK_OK(ferry_node_budget_open(name, 1000, &b, err, sizeof err));
  CHECK_EQ(ferry_node_budget_reserve(a, 600, 0), 0);
  CHECK_EQ(ferry_node_budget_reserve(b, 500, 0), 1); /* 1100 > 1000 */
  CHECK_EQ(ferry_node_budget_reserve(b, 400, 0), 0);
  ferry_node_budget_stats st;
  int32_t pids[4];
  uint64_t bytes[4];
  CHECK_OK(ferry_node_budget_get_stats(a, &st, pids, bytes, 4));
  CHECK_EQ(st.cap, 1000);
  CHECK_EQ(st.total, 1000);
  CHECK_EQ(st.mine, 600);
  CHECK_EQ(st.refusals, 1);
  CHECK_EQ(st.processes, 2);
  CHECK_EQ(pids[0], getpid());
  CHECK_EQ(bytes[0] + bytes[1], 1000);
  ferry_node_budget_reserve(a, 600, 1); /* released: b may grow */
  CHECK_EQ(ferry_node_budget_reserve(b, 500, 0), 0);
  /* a different cap on the same name is refused, naming both caps */
  ferry_node_budget *c = (ferry_node_budget *)1;
  CHECK_RC(ferry_node_budget_open(name, 2000, &c, err, sizeof err), FERRY_EINVAL);
  CHECK(c == NULL);
  CHECK_STR_CONTAINS(err, "created with 1000");
  ferry_node_budget_close(b); /* its 900 bytes go back */
  CHECK_OK(ferry_node_budget_get_stats(a, &st, NULL, NULL, 0));
  CHECK_EQ(st.total, 0);
  CHECK_EQ(st.processes, 1);
  ferry_node_budget_close(a);
  CHECK_OK(ferry_node_budget_unlink(name, err, sizeof err));
  return 0;
}

/* With 500 of 1000 held by the parent, children reserve and release 300 in
 * a loop (two at once would pass the cap); each checks the live total it
 * sees never passes the cap, and that 600 more is always refused. */
TEST(node_budget_cap_is_never_exceeded) {
  enum { KIDS = 4, ROUNDS = 300, CAP = 1000 };
  const char *name = budget_name("hard");
  ferry_node_budget *b = NULL;
  CHECK_OK(ferry_node_budget_open(name, CAP, &b, NULL, 0));
  CHECK_EQ(ferry_node_budget_reserve(b, 500, 0), 0);
  pid_t kids[KIDS];
  for (int k = 0; k < KIDS; k++) {
    kids[k] = fork();
    CHECK(kids[k] >= 0);
    if (kids[k] == 0) {
      ferry_node_budget *mine = NULL;
      if (ferry_node_budget_open(name, CAP, &mine, NULL, 0)) _exit(2);
      int bad = ferry_node_budget_reserve(mine, 600, 0) != 1;
      for (int r = 0; r < ROUNDS; r++) {
        int got = ferry_node_budget_reserve(mine, 300, 0) == 0;
        ferry_node_budget_stats st;
        if (ferry_node_budget_get_stats(mine, &st, NULL, NULL, 0) || st.total > CAP) bad = 1;
        if (got) ferry_node_budget_reserve(mine, 300, 1);
      }
      ferry_node_budget_close(mine);
      _exit(bad);
    }
  }
  int failed = 0;
  for (int k = 0; k < KIDS; k++) {
    int status = 0;
    waitpid(kids[k], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
  }
  CHECK_EQ(failed, 0);
  ferry_node_budget_stats st;
  CHECK_OK(ferry_node_budget_get_stats(b, &st, NULL, NULL, 0));
  CHECK_EQ(st.total, 500);
  CHECK(st.refusals >= KIDS); /* the 600s at least */
  ferry_node_budget_close(b);
  ferry_node_budget_unlink(name, NULL, 0);
  return 0;
}

TEST(node_budget_reclaims_a_killed_process) {
  const char *name = budget_name("kill");
  ferry_node_budget *b = NULL;
  CHECK_OK(ferry_node_budget_open(name, 1000, &b, NULL, 0));
  int ready[2];
  CHECK(pipe(ready) == 0);
  pid_t kid = fork();
  CHECK(kid >= 0);
  if (kid == 0) {
    ferry_node_budget *mine = NULL;
    char c = ferry_node_budget_open(name, 1000, &mine, NULL, 0) == 0 &&
                     ferry_node_budget_reserve(mine, 800, 0) == 0
                 ? 'y'
                 : 'n';
    if (write(ready[1], &c, 1) != 1) _exit(3);
    for (;;) pause();
  }
  char c = 0;
  CHECK(read(ready[0], &c, 1) == 1);
  CHECK_EQ(c, 'y');
  CHECK_EQ(ferry_node_budget_reserve(b, 500, 0), 1); /* the child holds 800 */
  kill(kid, SIGKILL);
  waitpid(kid, NULL, 0);
  CHECK_EQ(ferry_node_budget_reserve(b, 500, 0), 0); /* its share came back */
  ferry_node_budget_stats st;
  CHECK_OK(ferry_node_budget_get_stats(b, &st, NULL, NULL, 0));
  CHECK_EQ(st.reclaimed, 800);
  CHECK_EQ(st.total, 500);
  CHECK_EQ(st.processes, 1);
  close(ready[0]);
  close(ready[1]);
  ferry_node_budget_close(b);
  ferry_node_budget_unlink(name, NULL, 0);
  return 0;
}

TEST(node_budget_rejects_bad_arguments) {
  ferry_node_budget *b = (ferry_node_budget *)1;
  char err[256] = "";
  CHECK_RC(ferry_node_budget_open("a/b", 100, &b, err, sizeof err), FERRY_EINVAL);
  CHECK(b == NULL);
  CHECK_STR_CONTAINS(err, "'a/b' must be 1-100 characters without '/'");
  CHECK_RC(ferry_node_budget_open("", 100, &b, err, sizeof err), FERRY_EINVAL);
  CHECK_RC(ferry_node_budget_open(NULL, 100, &b, err, sizeof err), FERRY_EINVAL);
  char longname[160];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = 0;
  CHECK_RC(ferry_node_budget_open(longname, 100, &b, err, sizeof err), FERRY_EINVAL);
  CHECK_RC(ferry_node_budget_open("ferry-test-zero", 0, &b, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "cap_bytes must be > 0");
  CHECK_RC(ferry_node_budget_open("ferry-test-null", 100, NULL, NULL, 0), FERRY_EINVAL);
  CHECK_RC(ferry_node_budget_unlink("a/b", err, sizeof err), FERRY_EINVAL);
  CHECK_EQ(ferry_node_budget_reserve(NULL, 1, 0), 1);
  ferry_node_budget_close(NULL);
  return 0;
}
