/* cli.h — what the `ferry` subcommands share. */
#ifndef FERRY_CLI_H
#define FERRY_CLI_H

#include <stdint.h>

/* Parses a flag's value with ferry_parse_number; on failure prints
 * "ferry CMD: message" and returns 2 (the usage exit code). */
int cli_number(const char *cmd, const char *flag, const char *text, int kind, double min,
               double max, int min_open, double *out);
/* The same for a whole number of bytes, a count or an int. */
int cli_bytes(const char *cmd, const char *flag, const char *text, uint64_t min, uint64_t *out);
int cli_int(const char *cmd, const char *flag, const char *text, long min, long max, long *out);

struct option;
/* Prints "ferry CMD: unknown option '--stpes'; did you mean '--steps'?" (or
 * "option '--x' needs a value" when missing_value) for the getopt_long
 * error at argv[optind - 1], with opterr = 0. */
void cli_bad_option(const char *cmd, const struct option *opts, char **argv, int optind,
                    int optopt, int missing_value);

#endif
