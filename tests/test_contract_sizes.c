/* test_contract_sizes.c — config struct_size values that no release's
 * ferry_config has are refused before the config is read past them or
 * copied half a field at a time (docs/embedding.md, ferry.h). */
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "test.h"
#include "test_device.h"

/* A struct_size that ends inside policy_source: copying its first byte
 * over the default (NULL) would make a wild pointer. */
TEST(contract_config_size_inside_a_field_is_refused) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.policy_source = "return { api = 1, decide = function(t, ctx) return { action = 'keep' } end }";
  c.struct_size = (uint32_t)(offsetof(ferry_config, policy_source) + 1);
  ferry_engine *e = NULL;
  char err[512] = "";
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EVERSION);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, "struct_size");
  /* ferry_config_init_sized: refused, nothing written */
  ferry_config d;
  memset(&d, 0x5a, sizeof d);
  CHECK_RC(ferry_config_init_sized(&d, offsetof(ferry_config, policy_source) + 1), FERRY_EINVAL);
  CHECK_EQ(((unsigned char *)&d)[0], 0x5a);
  return 0;
}

/* An uninitialised config's struct_size: huge. Its "unknown tail" is not
 * scanned (it would run off the caller's memory): refused at once. */
TEST(contract_config_huge_size_is_refused_unread) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char *m = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(m != MAP_FAILED);
  CHECK_OK(mprotect(m + page, page, PROT_NONE));
  /* the config ends a page: bytes past it are zero up to the guard page */
  test_device_stats st = {0};
  ferry_config full = test_engine_config(&st);
  ferry_config *c = (ferry_config *)(void *)(m + page - 2 * sizeof full);
  memcpy(c, &full, sizeof full);
  memset((char *)c + sizeof full, 0, sizeof full);
  ferry_engine *e = NULL;
  char err[512] = "";
  c->struct_size = 0x10000000u; /* faults if the tail is read */
  CHECK_RC(ferry_engine_create(c, &e, err, sizeof err), FERRY_EVERSION);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, "initialise it");
  /* the largest accepted: read, zero, accepted */
  c->struct_size = (uint32_t)(2 * sizeof full);
  CHECK_OK(ferry_engine_create(c, &e, err, sizeof err));
  ferry_engine_destroy(e);
  CHECK_RC(ferry_config_init_sized(c, 0x10000000u), FERRY_EINVAL);
  munmap(m, 2 * page);
  return 0;
}
