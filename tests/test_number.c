/* test_number.c — the strict number parser behind every flag, environment
 * variable and keyword (ferry_parse_number). */
#include <math.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

typedef struct number_case {
  const char *text;
  int kind;
  double min, max;
  int min_open;
  double want;          /* when ok */
  const char *message;  /* NULL: accepted; else a part of the error */
} number_case;

#define BIG 9007199254740992.0 /* 2^53 */
static const number_case cases[] = {
    /* counts */
    {"8", FERRY_NUMBER_COUNT, 0, 100, 0, 8, NULL},
    {"+8", FERRY_NUMBER_COUNT, 0, 100, 0, 8, NULL},
    {"0", FERRY_NUMBER_COUNT, 0, 100, 1, 0, "must be above 0 and at most 100"},
    {"101", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "must be between 0 and 100"},
    {"-1", FERRY_NUMBER_COUNT, 0, INFINITY, 0, 0, "must be at least 0"},
    {"2.5", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "must be a whole number"},
    {"8x", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "unexpected \"x\""},
    {"", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "empty value"},
    {" 8", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "not a number"},
    {"nan", FERRY_NUMBER_REAL, 0, 1, 0, 0, "not a number"},
    {"inf", FERRY_NUMBER_REAL, 0, INFINITY, 0, 0, "not a number"},
    {"-inf", FERRY_NUMBER_REAL, -INFINITY, INFINITY, 0, 0, "not a number"},
    {"0x10", FERRY_NUMBER_COUNT, 0, 100, 0, 0, "not a number"},
    {"1e400", FERRY_NUMBER_REAL, 0, INFINITY, 0, 0, "out of range"},
    {"0.25", FERRY_NUMBER_REAL, 0, 1, 1, 0.25, NULL},
    /* bytes */
    {"4096", FERRY_NUMBER_BYTES, 1, BIG, 0, 4096, NULL},
    {"512M", FERRY_NUMBER_BYTES, 1, BIG, 0, 512.0 * 1048576, NULL},
    {"16GiB", FERRY_NUMBER_BYTES, 1, BIG, 0, 16.0 * 1073741824, NULL},
    {"16gib", FERRY_NUMBER_BYTES, 1, BIG, 0, 16.0 * 1073741824, NULL},
    {"1.5T", FERRY_NUMBER_BYTES, 1, BIG, 0, 1.5 * 1099511627776.0, NULL},
    {"2GB", FERRY_NUMBER_BYTES, 1, BIG, 0, 2e9, NULL},
    {"0.4", FERRY_NUMBER_BYTES, 1, BIG, 0, 0, "must be between 1 B and 8 PiB"},
    {"1.5", FERRY_NUMBER_BYTES, 1, BIG, 0, 0, "whole number of bytes"},
    {"1e30", FERRY_NUMBER_BYTES, 1, BIG, 0, 0, "must be between 1 B and 8 PiB"},
    {"64Q", FERRY_NUMBER_BYTES, 1, BIG, 0, 0, "unexpected \"Q\""},
    {"40%", FERRY_NUMBER_BYTES, 1, BIG, 0, 0, "unexpected \"%\""},
    /* percents */
    {"40%", FERRY_NUMBER_PERCENT, 0, 100, 1, 40, NULL},
    {"12.5%", FERRY_NUMBER_PERCENT, 0, 100, 1, 12.5, NULL},
    {"0%", FERRY_NUMBER_PERCENT, 0, 100, 1, 0, "must be above 0"},
    {"101%", FERRY_NUMBER_PERCENT, 0, 100, 1, 0, "at most 100%"},
    {"40", FERRY_NUMBER_PERCENT, 0, 100, 1, 0, "expected a percentage"},
    /* bandwidths */
    {"55GB/s", FERRY_NUMBER_BANDWIDTH, 0, 1e15, 1, 55e9, NULL},
    {"12GiB/s", FERRY_NUMBER_BANDWIDTH, 0, 1e15, 1, 12.0 * 1073741824, NULL},
    {"1e-300GB/s", FERRY_NUMBER_BANDWIDTH, 1e3, 1e15, 0, 0, "must be between 1e-06 GB/s and"},
    {"55GB", FERRY_NUMBER_BANDWIDTH, 0, 1e15, 1, 0, "expected a bandwidth"},
    /* durations */
    {"5us", FERRY_NUMBER_DURATION, 0, 1e6, 0, 5, NULL},
    {"2ms", FERRY_NUMBER_DURATION, 0, 1e6, 0, 2000, NULL},
    {"1s", FERRY_NUMBER_DURATION, 0, 1e6, 0, 1e6, NULL},
    {"300ns", FERRY_NUMBER_DURATION, 0, 1e6, 0, 0.3, NULL},
    {"5", FERRY_NUMBER_DURATION, 0, 1e6, 0, 0, "expected a duration"},
    {"2min", FERRY_NUMBER_DURATION, 0, 1e6, 0, 0, "unexpected \"min\""},
};

TEST(number_parser_is_strict) {
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const number_case *c = &cases[i];
    double v = -12345;
    char err[256] = "";
    int rc = ferry_parse_number("--flag", c->text, c->kind, c->min, c->max, c->min_open, &v, err,
                                sizeof err);
    if (!c->message) {
      if (rc != FERRY_OK || v != c->want) {
        fprintf(stderr, "case %zu \"%s\": rc %d value %.17g (want %.17g) %s\n", i, c->text, rc,
                v, c->want, err);
        return 1;
      }
      continue;
    }
    CHECK_RC(rc, FERRY_EINVAL);
    CHECK(v == -12345); /* untouched on failure */
    if (!strstr(err, c->message) || !strstr(err, "--flag")) {
      fprintf(stderr, "case %zu \"%s\": message \"%s\" lacks \"%s\"\n", i, c->text, err,
              c->message);
      return 1;
    }
  }
  return 0;
}
