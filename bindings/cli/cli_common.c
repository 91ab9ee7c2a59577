/* cli_common.c — flag parsing shared by the subcommands (cli.h). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

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

void cli_bad_option(const char *cmd, const struct option *opts, char **argv, int optind,
                    int optopt, int missing_value) {
  const char *arg = argv[optind - 1];
  if (missing_value) {
    fprintf(stderr, "ferry %s: option '%s' needs a value\n", cmd, arg);
    return;
  }
  if (optopt) {
    fprintf(stderr, "ferry %s: unknown option '-%c'\n", cmd, optopt);
    return;
  }
  const char *names[64];
  size_t n = 0;
  for (; opts[n].name && n < 64; n++) names[n] = opts[n].name;
  char word[64];
  snprintf(word, sizeof word, "%.*s", (int)strcspn(arg + 2, "="), arg + 2);
  const char *close = arg[0] == '-' && arg[1] == '-' ? ferry_suggest(word, names, n) : NULL;
  if (close)
    fprintf(stderr, "ferry %s: unknown option '%s'; did you mean '--%s'?\n", cmd, arg, close);
  else fprintf(stderr, "ferry %s: unknown option '%s'\n", cmd, arg);
}
