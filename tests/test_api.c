/* test_api.c — error codes, version, config validation. */
#include "test.h"
#include "test_device.h"

TEST(errors_one_list) {
  /* Every code from the list has its own name and message; unknown codes
   * still give a string. */
  int codes[] = {
#define CODE_(name, c, msg) c,
      FERRY_ERRNO_MAP(CODE_)
#undef CODE_
  };
  size_t n = sizeof codes / sizeof codes[0];
  CHECK(n >= 10);
  for (size_t i = 0; i < n; i++) {
    CHECK(i == 0 ? codes[i] == 0 : codes[i] < 0);
    for (size_t j = 0; j < i; j++) {
      CHECK(codes[i] != codes[j]);
      CHECK(strcmp(ferry_err_name(codes[i]), ferry_err_name(codes[j])) != 0);
      CHECK(strcmp(ferry_strerror(codes[i]), ferry_strerror(codes[j])) != 0);
    }
  }
  CHECK(strcmp(ferry_err_name(FERRY_EHANDLE), "FERRY_EHANDLE") == 0);
  CHECK(strcmp(ferry_strerror(FERRY_ECAP), "pinned host memory cap reached") == 0);
  CHECK(strcmp(ferry_err_name(-9999), "FERRY_UNKNOWN") == 0);
  CHECK_STR_CONTAINS(ferry_strerror(12345), "unknown");
  return 0;
}

TEST(version_matches_header) {
  CHECK_EQ(ferry_version(), FERRY_VERSION_HEX);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", FERRY_VERSION_MAJOR, FERRY_VERSION_MINOR,
           FERRY_VERSION_PATCH);
  CHECK(strcmp(ferry_version_string(), want) == 0);
  return 0;
}

static ferry_config good_config(void) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  return c;
}

/* Creating with cfg must fail with code and a message containing needle. */
static int expect_create_fails(ferry_config c, int code, const char *needle) {
  ferry_engine *e = (ferry_engine *)0x1;
  char err[512] = "";
  CHECK_EQ(ferry_engine_create(&c, &e, err, sizeof err), code);
  CHECK(e == NULL);
  CHECK_STR_CONTAINS(err, needle);
  return 0;
}

TEST(config_rejects_bad_values) {
  ferry_config c = good_config();
  ferry_engine *e = NULL;
  char err[512] = "";
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  CHECK(e != NULL);
  ferry_engine_destroy(e);

  ferry_config init_fn;
  ferry_config_init(&init_fn);
  ferry_config init_macro = FERRY_CONFIG_INIT;
  CHECK(memcmp(&init_fn, &init_macro, sizeof init_fn) == 0);

  c = good_config(); c.struct_size = 8;
  if (expect_create_fails(c, FERRY_EVERSION, "struct_size")) return 1;
  c = good_config(); c.version = (FERRY_VERSION_MAJOR + 1) << 16;
  if (expect_create_fails(c, FERRY_EVERSION, "major version")) return 1;
  c = good_config(); c.backend = 7;
  if (expect_create_fails(c, FERRY_EINVAL, "config.backend")) return 1;
  c = good_config(); c.arena = -2;
  if (expect_create_fails(c, FERRY_EINVAL, "config.arena")) return 1;
  c = good_config(); c.device_alloc = NULL;
  if (expect_create_fails(c, FERRY_EINVAL, "config.device_alloc")) return 1;
  c = good_config(); c.release = NULL;
  if (expect_create_fails(c, FERRY_EINVAL, "config.release")) return 1;
  c = good_config(); c.host_cap_pct = 150;
  if (expect_create_fails(c, FERRY_EINVAL, "host_cap_pct")) return 1;
  c = good_config(); c.link.duplex = 0;
  if (expect_create_fails(c, FERRY_EINVAL, "duplex")) return 1;
  c = good_config(); c.link.h2d_bytes_per_s = -1;
  if (expect_create_fails(c, FERRY_EINVAL, "config.link")) return 1;
  c = good_config(); c.max_fwd_stash = 1u << 30;
  if (expect_create_fails(c, FERRY_EINVAL, "max_fwd_stash")) return 1;
  c = good_config(); c.trace_path = "/nonexistent-dir/trace.jsonl";
  if (expect_create_fails(c, FERRY_EIO, "/nonexistent-dir/trace.jsonl")) return 1;
  CHECK_EQ(ferry_engine_create(NULL, &e, err, sizeof err), FERRY_EINVAL);
  CHECK_EQ(ferry_engine_create(&c, NULL, err, sizeof err), FERRY_EINVAL);
  return 0;
}
