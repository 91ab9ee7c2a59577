/* cli_common.c — flag parsing shared by the subcommands (cli.h). */
#include <math.h>
#include <stdio.h>

#include "cli.h"
#include "ferry_tools.h"

#define MAX_EXACT 9007199254740992.0 /* 2^53: larger doubles skip integers */

int cli_number(const char *cmd, const char *flag, const char *text, int kind, double min,
               double max, int min_open, double *out) {
  char err[256];
  if (ferry_parse_number(flag, text, kind, min, max, min_open, out, err, sizeof err)) {
    fprintf(stderr, "ferry %s: %s\n", cmd, err);
    return 2;
  }
  return 0;
}

int cli_bytes(const char *cmd, const char *flag, const char *text, uint64_t min, uint64_t *out) {
  double v;
  int rc = cli_number(cmd, flag, text, FERRY_NUMBER_BYTES, (double)min, MAX_EXACT, 0, &v);
  if (!rc) *out = (uint64_t)v;
  return rc;
}

int cli_int(const char *cmd, const char *flag, const char *text, long min, long max, long *out) {
  double v;
  int rc = cli_number(cmd, flag, text, FERRY_NUMBER_COUNT, (double)min, (double)max, 0, &v);
  if (!rc) *out = (long)v;
  return rc;
}
