/* cli.h — what the `ferry` subcommands share: flag parsing and the
 * conventions of docs/cli.md ("-" for stdin/stdout, -q/-v, colour,
 * progress). */
#ifndef FERRY_CLI_H
#define FERRY_CLI_H

#include <stdint.h>
#include <stdio.h>

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

/* ---- -q / -v ------------------------------------------------------------------------ */
/* -1 after -q (errors only), 0 by default, 1 after -v; the last one given wins. */
extern int cli_verbosity;
/* Back to the defaults (verbosity 0, stdin not read) for a subcommand called
 * again in one process (tests); a claimed stdout stays claimed. */
void cli_reset(void);

/* ---- colour ------------------------------------------------------------------------- */
/* Whether to colour what goes to fd: a terminal, NO_COLOR unset or empty
 * (https://no-color.org), TERM not "dumb". */
int cli_color(int fd);
/* The escape sequence "\033[<sgr>m" when fd is coloured, else "". */
const char *cli_sgr(int fd, const char *sgr);
#define CLI_RED "1;31"
#define CLI_GREEN "32"
#define CLI_BOLD "1"
#define CLI_RESET "0"
/* "ferry CMD: " (bold red on a colour terminal) and the message, on stderr. */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- "-": stdin and stdout ------------------------------------------------------------ */
/* A flag's value "-" reads stdin: once per command. 0, or 2 after "ferry CMD:
 * FLAG - and OTHER -: stdin can be read only once". No-op unless value is "-". */
int cli_claim_stdin(const char *cmd, const char *flag, const char *value);
/* The path to open for an input value: "/dev/stdin" for "-". */
const char *cli_input(const char *value);
/* All of stdin (NUL-terminated, malloc'd; *len without the NUL), NULL with
 * errno on failure or past max bytes (EFBIG). */
char *cli_read_stdin(size_t max, size_t *len);
/* A flag's value "-" writes stdout: one such flag per command, else 2 after
 * "ferry CMD: FLAG - and OTHER -: only one output can go to stdout". The
 * first claim moves everything the command prints for people (tables,
 * summaries) to stderr, so stdout carries the data alone. No-op unless
 * value is "-". */
int cli_claim_stdout(const char *cmd, const char *flag, const char *value);
/* Whether a flag has claimed stdout. */
int cli_stdout_claimed(void);
/* The real stdout after a claim, for writers that take a FILE. */
FILE *cli_stdout(void);
/* The path a writer that takes a path should open for value: value itself,
 * or for "-" a temporary file that cli_output_done copies to stdout. NULL
 * (errno set) if the temporary file cannot be made. */
const char *cli_output(const char *value);
/* Sends what was written for "-" to stdout and closes it: 0, or 1 after
 * "ferry CMD: cannot write stdout: ...". Call once, at the end. */
int cli_output_done(const char *cmd);
/* After a failed write, or from a signal handler: removes the temporary
 * file, so nothing half-written reaches stdout (async-signal-safe). */
void cli_output_abandon(void);

/* ---- progress ------------------------------------------------------------------------- */
/* One line on stderr, rewritten in place ("\r"), at most ten times a second
 * (force: now); only when stderr is a terminal and not -q. */
void cli_progress(int force, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Clears the line, if one was drawn. */
void cli_progress_end(void);

#endif
