/* test_contract_destroy.c — a destroyed engine's address is held back from
 * new engines (ferry.h, Threads): creations that fail do not use up that
 * quarantine. */
#include "test.h"
#include "test_device.h"

TEST(contract_failed_creates_keep_destroyed_engines_quarantined) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  ferry_config bad = c;
  bad.policy_source = "return {"; /* fails after the engine is allocated */
  ferry_engine *e1 = NULL, *e2 = NULL, *none = NULL;
  CHECK_OK(ferry_engine_create(&c, &e1, NULL, 0));
  ferry_engine_destroy(e1);
  /* as many failures as the quarantine has places: each used to push one
   * destroyed engine out, and malloc gave e1's memory to the next engine */
  char err[256];
  for (int i = 0; i < 16; i++) {
    CHECK(ferry_engine_create(&bad, &none, err, sizeof err) != FERRY_OK);
    CHECK(none == NULL);
  }
  CHECK_OK(ferry_engine_create(&c, &e2, NULL, 0));
  CHECK(e2 != e1);
  CHECK_RC(ferry_step_begin(e1), FERRY_ESTATE); /* not e2's step */
  ferry_stats s;
  CHECK_OK(ferry_get_stats(e2, &s, sizeof s));
  CHECK_EQ(s.steps, 0);
  ferry_engine_destroy(e2);
  return 0;
}
