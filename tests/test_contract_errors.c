/* test_contract_errors.c — every failing call writes the engine's message
 * under the engine lock, which ferry_last_error copies under (ferry.h): a
 * reader in another thread sees one whole message, never a mix (and TSan,
 * tests/run_all.sh, sees no race). */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "test.h"
#include "test_device.h"

typedef struct {
  ferry_engine *e;
  atomic_int stop;
} trace_fail_job;

/* the ferry_trace_* calls' refusals, two different messages in turn */
static void *fail_trace_calls(void *arg) {
  trace_fail_job *j = arg;
  while (!atomic_load(&j->stop)) {
    ferry_trace_flops(j->e, -1.0);
    ferry_trace_device_peak(j->e, 1ull << 60);
  }
  return NULL;
}

TEST(contract_trace_call_errors_read_by_threads) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  trace_fail_job j = {0};
  CHECK_OK(ferry_engine_create(&c, &j.e, NULL, 0));
  CHECK_RC(ferry_trace_flops(j.e, -1.0), FERRY_EINVAL);
  char flops_msg[256], peak_msg[256];
  snprintf(flops_msg, sizeof flops_msg, "%s", ferry_last_error(j.e));
  CHECK_RC(ferry_trace_device_peak(j.e, 1ull << 60), FERRY_EINVAL);
  snprintf(peak_msg, sizeof peak_msg, "%s", ferry_last_error(j.e));
  CHECK_STR_CONTAINS(flops_msg, "ferry_trace_flops");
  CHECK_STR_CONTAINS(peak_msg, "ferry_trace_device_peak");
  pthread_t t;
  CHECK_OK(pthread_create(&t, NULL, fail_trace_calls, &j));
  int mixed = 0;
  for (int i = 0; i < 200000; i++) {
    const char *m = ferry_last_error(j.e);
    if (strcmp(m, flops_msg) && strcmp(m, peak_msg)) mixed++;
  }
  atomic_store(&j.stop, 1);
  pthread_join(t, NULL);
  CHECK_EQ(mixed, 0);
  ferry_engine_destroy(j.e);
  return 0;
}
