/* cli_common.c — flag parsing and the conventions (docs/cli.md) shared by
 * the subcommands (cli.h). */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "ferry_tools.h"

#define MAX_EXACT 9007199254740992.0 /* 2^53: larger doubles skip integers */

int cli_number(const char *cmd, const char *flag, const char *text, int kind, double min,
               double max, int min_open, double *out) {
  char err[256];
  if (ferry_parse_number(flag, text, kind, min, max, min_open, out, err, sizeof err)) {
    cli_error(cmd, "%s\n", err);
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
    cli_error(cmd, "option '%s' needs a value\n", arg);
    return;
  }
  if (optopt) {
    cli_error(cmd, "unknown option '-%c'\n", optopt);
    return;
  }
  const char *names[64];
  size_t n = 0;
  for (; opts[n].name && n < 64; n++) names[n] = opts[n].name;
  char word[64];
  snprintf(word, sizeof word, "%.*s", (int)strcspn(arg + 2, "="), arg + 2);
  const char *close = arg[0] == '-' && arg[1] == '-' ? ferry_suggest(word, names, n) : NULL;
  if (close)
    cli_error(cmd, "unknown option '%s'; did you mean '%s--%s%s'?\n", arg, cli_sgr(2, CLI_BOLD),
              close, cli_sgr(2, CLI_RESET));
  else cli_error(cmd, "unknown option '%s'\n", arg);
}

/* ---- -q / -v ------------------------------------------------------------------------ */

int cli_verbosity;

/* ---- colour ------------------------------------------------------------------------- */

int cli_color(int fd) {
  const char *no = getenv("NO_COLOR");
  const char *term = getenv("TERM");
  return isatty(fd) && !(no && *no) && !(term && !strcmp(term, "dumb"));
}

const char *cli_sgr(int fd, const char *sgr) {
  static char buf[4][16];
  static int next;
  if (!cli_color(fd)) return "";
  char *b = buf[next++ & 3]; /* a few in one printf */
  snprintf(b, sizeof buf[0], "\033[%sm", sgr);
  return b;
}

void cli_error(const char *cmd, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%sferry %s:%s ", cli_sgr(2, CLI_RED), cmd, cli_sgr(2, CLI_RESET));
  vfprintf(stderr, fmt, ap);
  va_end(ap);
}

/* ---- "-": stdin and stdout ------------------------------------------------------------ */

static const char *stdin_flag, *stdout_flag;
static int data_fd = -1;     /* the real stdout once claimed */
static FILE *data_file;      /* cli_stdout()'s stream on data_fd */
static char temp_path[4096]; /* cli_output's file for "-", "" if none */

void cli_reset(void) {
  cli_verbosity = 0;
  stdin_flag = NULL;
}

int cli_claim_stdin(const char *cmd, const char *flag, const char *value) {
  if (!value || strcmp(value, "-")) return 0;
  if (stdin_flag) {
    cli_error(cmd, "%s - and %s -: stdin can be read only once\n", stdin_flag, flag);
    return 2;
  }
  stdin_flag = flag;
  return 0;
}

const char *cli_input(const char *value) {
  return value && !strcmp(value, "-") ? "/dev/stdin" : value;
}

char *cli_read_stdin(size_t max, size_t *len) {
  size_t cap = 65536, n = 0;
  char *b = malloc(cap + 1);
  while (b) {
    if (n == cap) {
      if (cap >= max) {
        free(b);
        errno = EFBIG;
        return NULL;
      }
      cap = cap * 2 > max ? max : cap * 2;
      char *g = realloc(b, cap + 1);
      if (!g) break;
      b = g;
    }
    ssize_t got = read(STDIN_FILENO, b + n, cap - n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) break;
    if (got == 0) {
      b[n] = 0;
      if (len) *len = n;
      return b;
    }
    n += (size_t)got;
  }
  int e = errno;
  free(b);
  errno = e;
  return NULL;
}

int cli_claim_stdout(const char *cmd, const char *flag, const char *value) {
  if (!value || strcmp(value, "-")) return 0;
  if (stdout_flag) {
    cli_error(cmd, "%s - and %s -: only one output can go to stdout\n", stdout_flag, flag);
    return 2;
  }
  fflush(stdout);
  data_fd = fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  if (data_fd < 0) {
    cli_error(cmd, "%s -: %s\n", flag, strerror(errno));
    return 1;
  }
  /* what is printed for people goes where stderr goes, a line at a time */
  dup2(STDERR_FILENO, STDOUT_FILENO);
  setvbuf(stdout, NULL, _IOLBF, 0);
  stdout_flag = flag;
  return 0;
}

int cli_stdout_claimed(void) { return stdout_flag != NULL; }

FILE *cli_stdout(void) {
  if (!data_file && data_fd >= 0) data_file = fdopen(data_fd, "w");
  return data_file;
}

const char *cli_output(const char *value) {
  if (!value || strcmp(value, "-")) return value;
  if (temp_path[0]) return temp_path;
  const char *dir = getenv("TMPDIR");
  char path[sizeof temp_path];
  snprintf(path, sizeof path, "%s/ferry-stdout-XXXXXX", dir && *dir ? dir : "/tmp");
  int fd = mkstemp(path);
  if (fd < 0) return NULL;
  close(fd);
  memcpy(temp_path, path, sizeof temp_path);
  return temp_path;
}

void cli_output_abandon(void) {
  if (temp_path[0]) unlink(temp_path);
}

int cli_output_done(const char *cmd) {
  int bad = 0, err = 0;
  if (temp_path[0]) {
    FILE *out = cli_stdout();
    int fd = open(temp_path, O_RDONLY | O_CLOEXEC);
    bad = !out || fd < 0;
    err = errno;
    char buf[65536];
    ssize_t got;
    while (!bad && (got = read(fd, buf, sizeof buf)) != 0) {
      if (got < 0 && errno == EINTR) continue;
      bad = got < 0 || fwrite(buf, 1, (size_t)got, out) != (size_t)got;
      err = errno;
    }
    if (fd >= 0) close(fd);
    unlink(temp_path);
    temp_path[0] = 0;
  }
  if (data_file) {
    if (fclose(data_file) && !bad) {
      bad = 1;
      err = errno;
    }
    data_file = NULL;
    data_fd = -1;
  } else if (data_fd >= 0) {
    close(data_fd);
    data_fd = -1;
  }
  if (bad) cli_error(cmd, "cannot write stdout: %s\n", strerror(err));
  return bad;
}

/* ---- progress ------------------------------------------------------------------------- */

static int progress_width; /* of the line drawn, 0 if none */
static double progress_last;

void cli_progress(int force, const char *fmt, ...) {
  if (cli_verbosity < 0 || !isatty(STDERR_FILENO)) return;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
  if (!force && progress_width && now - progress_last < 0.1) return;
  progress_last = now;
  char line[160];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n >= (int)sizeof line) n = (int)sizeof line - 1;
  /* spaces over what a longer line before left */
  fprintf(stderr, "\r%s%*s", line, progress_width > n ? progress_width - n : 0, "");
  fflush(stderr);
  if (n > progress_width) progress_width = n;
}

void cli_progress_end(void) {
  if (!progress_width) return;
  fprintf(stderr, "\r%*s\r", progress_width, "");
  fflush(stderr);
  progress_width = 0;
}
