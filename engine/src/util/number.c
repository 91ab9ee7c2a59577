/* number.c — the one strict parser of sizes, percents, bandwidths,
 * durations and counts behind every flag, environment variable and keyword
 * (ferry_parse_number in ferry_tools.h; units in docs/cli.md). */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ferry_tools.h"
#include "util/errbuf.h"

typedef struct unit {
  const char *suffix; /* compared without case, except the b/B of bytes */
  double scale;
} unit;

#define KI 1024.0
static const unit byte_units[] = {
    {"", 1},         {"B", 1},           {"K", KI},          {"KiB", KI},
    {"M", KI * KI},  {"MiB", KI * KI},   {"G", KI * KI * KI}, {"GiB", KI * KI * KI},
    {"T", KI * KI * KI * KI}, {"TiB", KI * KI * KI * KI},    {"KB", 1e3},
    {"MB", 1e6},     {"GB", 1e9},        {"TB", 1e12},       {NULL, 0}};
static const unit bandwidth_units[] = {
    {"B/s", 1},      {"KB/s", 1e3},      {"MB/s", 1e6},      {"GB/s", 1e9},
    {"TB/s", 1e12},  {"KiB/s", KI},      {"MiB/s", KI * KI}, {"GiB/s", KI * KI * KI},
    {NULL, 0}};
static const unit duration_units[] = {
    {"ns", 1e-3}, {"us", 1}, {"ms", 1e3}, {"s", 1e6}, {NULL, 0}};
static const unit percent_units[] = {{"%", 1}, {NULL, 0}};
static const unit plain_units[] = {{"", 1}, {NULL, 0}};

static const struct kind_info {
  const unit *units;
  int integral; /* the value after scaling must be a whole number */
  const char *expected;
} kinds[] = {
    [FERRY_NUMBER_COUNT] = {plain_units, 1, "a whole number"},
    [FERRY_NUMBER_REAL] = {plain_units, 0, "a number"},
    [FERRY_NUMBER_BYTES] = {byte_units, 1,
                            "a size in bytes (e.g. 4096, 512M, 16GiB; K/M/G/T and KiB.. are "
                            "1024-based, KB/MB/GB/TB 1000-based)"},
    [FERRY_NUMBER_PERCENT] = {percent_units, 0, "a percentage (e.g. 40%)"},
    [FERRY_NUMBER_BANDWIDTH] = {bandwidth_units, 0,
                                "a bandwidth (e.g. 55GB/s, 12GiB/s, 800MB/s)"},
    [FERRY_NUMBER_DURATION] = {duration_units, 0, "a duration (e.g. 300ns, 5us, 2ms, 1s)"},
};

/* The scale of suffix in units, or 0 when it is none of them. */
static double unit_scale(const unit *units, const char *suffix) {
  for (const unit *u = units; u->suffix; u++)
    if (!strcasecmp(suffix, u->suffix)) return u->scale;
  return 0;
}

/* v as the kind writes it: "8 PiB", "1 s", "55 GB/s", "40%", "3". */
static void format_value(char *b, size_t n, int kind, double v) {
  static const char *const bin[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  switch (kind) {
  case FERRY_NUMBER_BYTES:
    while (i < 5 && fabs(v) >= 1024) v /= 1024, i++;
    snprintf(b, n, "%.4g %s", v, bin[i]);
    break;
  case FERRY_NUMBER_BANDWIDTH: snprintf(b, n, "%.4g GB/s", v / 1e9); break;
  case FERRY_NUMBER_DURATION:
    if (fabs(v) >= 1e6) snprintf(b, n, "%.4g s", v / 1e6);
    else if (fabs(v) >= 1e3) snprintf(b, n, "%.4g ms", v / 1e3);
    else snprintf(b, n, "%.4g us", v);
    break;
  case FERRY_NUMBER_PERCENT: snprintf(b, n, "%.6g%%", v); break;
  default: snprintf(b, n, "%.15g", v);
  }
}

/* "between 1 and 100", "at least 1", "above 0 and at most 1" for messages. */
static void describe_range(char *b, size_t n, int kind, double min, double max, int min_open) {
  char lo[40], hi[40];
  format_value(lo, sizeof lo, kind, min);
  format_value(hi, sizeof hi, kind, max);
  if (isinf(max)) snprintf(b, n, "%s %s", min_open ? "above" : "at least", lo);
  else if (min_open) snprintf(b, n, "above %s and at most %s", lo, hi);
  else snprintf(b, n, "between %s and %s", lo, hi);
}

int ferry_parse_number(const char *what, const char *text, int kind, double min, double max,
                       int min_open, double *out, char *err, size_t errlen) {
  if (kind < 0 || kind > FERRY_NUMBER_DURATION || !out)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s: bad parser call", what ? what : "?");
  const struct kind_info *k = &kinds[kind];
  what = what ? what : "value";
  if (!text || !*text)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s: empty value; expected %s", what,
                        k->expected);
  /* strtod would take "nan", "inf", hex floats and leading blanks: allow
   * only [+-]digits[.digits][e[+-]digits] */
  const char *p = text;
  if (*p == '+' || *p == '-') p++;
  if (!isdigit((unsigned char)*p) && !(*p == '.' && isdigit((unsigned char)p[1])))
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: not a number; expected %s", what,
                        text, k->expected);
  char *end;
  errno = 0;
  double x = strtod(text, &end);
  if (strspn(text, "0123456789.+-eE") < (size_t)(end - text)) /* hex floats */
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: not a number; expected %s", what,
                        text, k->expected);
  double scale = unit_scale(k->units, end);
  if (scale == 0 && !*end)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: needs a unit; expected %s", what,
                        text, k->expected);
  if (scale == 0)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: unexpected \"%s\"; expected %s", what,
                        text, end, k->expected);
  x *= scale;
  if (errno == ERANGE || !isfinite(x))
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: out of range; expected %s",
                        what, text, k->expected);
  char range[128];
  describe_range(range, sizeof range, kind, min, max, min_open);
  if (x < min || (min_open && x == min) || x > max)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: must be %s", what, text, range);
  if (k->integral && x != floor(x))
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "%s %s: must be a whole number%s", what, text,
                        kind == FERRY_NUMBER_BYTES ? " of bytes" : "");
  *out = x;
  return FERRY_OK;
}
