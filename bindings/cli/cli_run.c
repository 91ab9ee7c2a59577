/*
 * cli_run.c — `ferry run`: start a trainer with jemalloc preloaded and the
 * ferry settings in its environment.
 * How it works: docs/internals.md#cli_runc.
 */
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <link.h> /* ElfW */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "ferry_tools.h"

#define RUN_EXIT_FAILED 125
#define RUN_EXIT_CANNOT_EXECUTE 126
#define RUN_EXIT_NOT_FOUND 127

#define JEMALLOC_SONAME "libjemalloc.so.2"
#define INSTALL_HINT                                                                   \
  "install it (Debian/Ubuntu: apt-get install libjemalloc2; Fedora/RHEL: dnf install " \
  "jemalloc; conda: conda install jemalloc), or set FERRY_JEMALLOC to the path of "    \
  JEMALLOC_SONAME

/* Debian-style multiarch directory of this build's target. */
#if defined(__x86_64__)
#define MULTIARCH "x86_64-linux-gnu"
#elif defined(__aarch64__)
#define MULTIARCH "aarch64-linux-gnu"
#elif defined(__powerpc64__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define MULTIARCH "powerpc64le-linux-gnu"
#endif

static void usage(FILE *to) {
  fprintf(to,
          "usage: ferry run [options] [--] CMD [ARGS...]\n"
          "\n"
          "Runs CMD with jemalloc preloaded (so ferry's pinned arena can use it) and\n"
          "the ferry settings below in its environment. The command replaces this\n"
          "process: its exit status and signals pass through unchanged.\n"
          "\n"
          "options (each sets an environment variable read by the Python binding):\n"
          "  -p, --policy FILE     Lua policy file                    FERRY_POLICY\n"
          "  -t, --trace FILE      write a JSONL trace to FILE        FERRY_TRACE\n"
          "      --chrome-trace FILE\n"
          "                        write a Chrome trace (Perfetto) of FERRY_CHROME_TRACE\n"
          "                        the run: each copy with its real\n"
          "                        times, counters; %%p in FILE is the\n"
          "                        process id (one file per rank)\n"
          "      --trace-out FILE  the same as --chrome-trace\n"
          "  -c, --cap BYTES|PCT%%  pinned host memory cap, e.g. 16G,  FERRY_HOST_CAP\n"
          "                        1073741824 or 40%% of MemTotal\n"
          "  -b, --backend NAME    host, cuda or auto                 FERRY_BACKEND\n"
          "      --release-copied  free a forward-stash buffer once   FERRY_RELEASE_COPIED=1\n"
          "                        its copy to the host is done, not\n"
          "                        only when the stash bound pushes\n"
          "                        it out (release_when_copied)\n"
          "      --prefetch-at-backward\n"
          "                        start the policy's first reloads   FERRY_PREFETCH_AT_BACKWARD=1\n"
          "                        when backward begins, not at the\n"
          "                        first unpack\n"
          "                        (prefetch_at_backward_begin)\n"
          "  -n, --dry-run         print the environment and command, run nothing\n"
          "  -q, --quiet           the trainer's ferry messages: errors only\n"
          "                        (FERRY_LOG_LEVEL=error)\n"
          "  -v, --verbose         print the environment and command on stderr, then\n"
          "                        run it\n"
          "  -h, --help            this text\n"
          "\n"
          "jemalloc: $FERRY_JEMALLOC if set, else the jemalloc ferry was linked with,\n"
          "else " JEMALLOC_SONAME " in $LD_LIBRARY_PATH and the system library\n"
          "directories, else `ldconfig -p`. It is put first in LD_PRELOAD.\n"
          "\n"
          "Files are the trainer's to write: \"-\" (stdin/stdout) is refused, as the\n"
          "trainer's own streams are its own.\n"
          "\n"
          "exit status: CMD's; 125 if ferry run failed, 126 if CMD cannot be\n"
          "executed, 127 if CMD is not found.\n"
          "\n"
          "examples:\n"
          "  ferry run --policy default -- python train.py\n"
          "  ferry run -p budget --cap 40%% --chrome-trace run-%%p.json -- torchrun train.py\n"
          "  ferry run -n --policy layers -- python train.py\n");
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%sferry run:%s ", cli_sgr(2, CLI_RED), cli_sgr(2, CLI_RESET));
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return RUN_EXIT_FAILED;
}

static int usage_hint(void) {
  fputs("usage: ferry run [options] [--] CMD [ARGS...]; see 'ferry run --help'\n", stderr);
  return RUN_EXIT_FAILED;
}

/* ---- finding jemalloc -------------------------------------------------------- */

/* Why `path` cannot be preloaded here, or NULL when it can: an ELF shared
 * object of this process's class and machine. ld.so would only warn and go on
 * without a bad preload, so it is checked before exec. */
static const char *preload_problem(const char *path, char *why, size_t whylen) {
  unsigned char ident[EI_NIDENT];
  ElfW(Ehdr) hdr, self;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    snprintf(why, whylen, "%s", strerror(errno));
    return why;
  }
  ssize_t n = read(fd, &hdr, sizeof hdr);
  close(fd);
  memcpy(ident, hdr.e_ident, sizeof ident);
  if (n != (ssize_t)sizeof hdr || memcmp(ident, ELFMAG, SELFMAG) != 0) {
    snprintf(why, whylen, "not an ELF shared library");
    return why;
  }
  if (ident[EI_CLASS] != (sizeof(void *) == 8 ? ELFCLASS64 : ELFCLASS32)) {
    snprintf(why, whylen, "a %s-bit library, this is a %zu-bit process",
             ident[EI_CLASS] == ELFCLASS64 ? "64" : "32", sizeof(void *) * 8);
    return why;
  }
  if (hdr.e_type != ET_DYN) {
    snprintf(why, whylen, "an ELF file but not a shared library");
    return why;
  }
  /* Compare the machine with this executable's; skip if /proc is absent. */
  fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    n = read(fd, &self, sizeof self);
    close(fd);
    if (n == (ssize_t)sizeof self && self.e_machine != hdr.e_machine) {
      snprintf(why, whylen, "built for another machine (ELF e_machine %u, this is %u)",
               (unsigned)hdr.e_machine, (unsigned)self.e_machine);
      return why;
    }
  }
  return NULL;
}

static int try_candidate(const char *path, char *out, size_t outlen) {
  char why[160];
  if (!path || path[0] != '/' || preload_problem(path, why, sizeof why)) return 0;
  snprintf(out, outlen, "%s", path);
  return 1;
}

/* The jemalloc this program itself runs on (it is linked with jemalloc). */
static int find_linked(char *out, size_t outlen) {
  void *sym = dlsym(RTLD_DEFAULT, "mallctl");
  Dl_info info;
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return 0;
  if (!strstr(info.dli_fname, "jemalloc")) return 0; /* linked statically */
  return try_candidate(info.dli_fname, out, outlen);
}

static int find_in_dir(const char *dir, size_t dirlen, char *out, size_t outlen) {
  static const char *const names[] = {JEMALLOC_SONAME, "libjemalloc.so"};
  char path[PATH_MAX];
  if (!dirlen) return 0;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    if (snprintf(path, sizeof path, "%.*s/%s", (int)dirlen, dir, names[i]) >= (int)sizeof path)
      continue;
    if (try_candidate(path, out, outlen)) return 1;
  }
  return 0;
}

static int find_in_dirs(char *out, size_t outlen, char *looked, size_t lookedlen) {
  size_t used = 0;
#define NOTE(fmt, ...)                                                                  \
  do {                                                                                  \
    if (used < lookedlen)                                                               \
      used += (size_t)snprintf(looked + used, lookedlen - used, fmt, __VA_ARGS__);     \
  } while (0)
  const char *lp = getenv("LD_LIBRARY_PATH");
  while (lp && *lp) {
    size_t len = strcspn(lp, ":;");
    if (len) {
      NOTE("%.*s ", (int)len, lp);
      if (find_in_dir(lp, len, out, outlen)) return 1;
    }
    lp += len + (lp[len] != '\0');
  }
  const char *conda = getenv("CONDA_PREFIX");
  if (conda && *conda) {
    char dir[PATH_MAX];
    int len = snprintf(dir, sizeof dir, "%s/lib", conda);
    NOTE("%s ", dir);
    if (len < (int)sizeof dir && find_in_dir(dir, (size_t)len, out, outlen)) return 1;
  }
  static const char *const system_dirs[] = {
#ifdef MULTIARCH
      "/usr/lib/" MULTIARCH, "/lib/" MULTIARCH,
#endif
      "/usr/local/lib", "/usr/lib64", "/lib64", "/usr/lib", "/lib"};
  for (size_t i = 0; i < sizeof system_dirs / sizeof system_dirs[0]; i++) {
    NOTE("%s ", system_dirs[i]);
    if (find_in_dir(system_dirs[i], strlen(system_dirs[i]), out, outlen)) return 1;
  }
#undef NOTE
  if (used && used <= lookedlen) looked[used - 1] = '\0'; /* trailing space */
  return 0;
}

/* The dynamic linker's cache knows libraries in directories not listed above
 * (ld.so.conf.d entries). */
static int find_in_ldconfig(char *out, size_t outlen) {
  static const char *const tools[] = {"/sbin/ldconfig", "/usr/sbin/ldconfig"};
  for (size_t i = 0; i < sizeof tools / sizeof tools[0]; i++) {
    if (access(tools[i], X_OK) != 0) continue;
    char cmd[64];
    snprintf(cmd, sizeof cmd, "%s -p 2>/dev/null", tools[i]);
    FILE *p = popen(cmd, "r");
    if (!p) return 0;
    char line[1024];
    int found = 0;
    /* lines: "\tlibjemalloc.so.2 (libc6,x86-64) => /usr/lib/.../libjemalloc.so.2" */
    while (!found && fgets(line, sizeof line, p)) {
      char *arrow = strstr(line, "=> ");
      if (!strstr(line, "libjemalloc.so") || !arrow) continue;
      char *path = arrow + 3;
      path[strcspn(path, "\r\n")] = '\0';
      found = try_candidate(path, out, outlen);
    }
    pclose(p);
    return found;
  }
  return 0;
}

/* 0 and the path in out, or an exit status after a message naming what is
 * missing and how to install it. */
static int find_jemalloc(char *out, size_t outlen) {
  const char *forced = getenv("FERRY_JEMALLOC");
  if (forced && *forced) {
    char why[160];
    if (forced[0] != '/')
      return fail("FERRY_JEMALLOC=%s: not an absolute path; give the full path of %s", forced,
                  JEMALLOC_SONAME);
    if (preload_problem(forced, why, sizeof why))
      return fail("FERRY_JEMALLOC=%s cannot be preloaded: %s.\n"
                  "Unset FERRY_JEMALLOC to search the usual places, or %s.",
                  forced, why, INSTALL_HINT);
    snprintf(out, outlen, "%s", forced);
    return 0;
  }
  char looked[2048] = "";
  if (find_linked(out, outlen) || find_in_dirs(out, outlen, looked, sizeof looked) ||
      find_in_ldconfig(out, outlen))
    return 0;
  return fail("jemalloc not found: no usable %s in %s, nor in `ldconfig -p`.\n"
              "ferry run preloads jemalloc so that ferry's pinned arena can use it in the "
              "trainer;\n%s.",
              JEMALLOC_SONAME, looked[0] ? looked : "(no directories)", INSTALL_HINT);
}

/* ---- option values ------------------------------------------------------------ */

/* "40%" (of MemTotal) or a size in bytes ("16G", "512MiB") as the trainer's
 * FERRY_HOST_CAP value: "40%" or a byte count. */
static int parse_cap(const char *s, char *out, size_t outlen) {
  double v;
  size_t n = strlen(s);
  if (n && s[n - 1] == '%') {
    if (cli_number("run", "--cap", s, FERRY_NUMBER_PERCENT, 0, 100, 1, &v)) return RUN_EXIT_FAILED;
    snprintf(out, outlen, "%g%%", v);
    return 0;
  }
  uint64_t bytes;
  if (cli_bytes("run", "--cap", s, 1, &bytes)) return RUN_EXIT_FAILED;
  snprintf(out, outlen, "%llu", (unsigned long long)bytes);
  return 0;
}

/* The trainer may change directory: pass paths absolute. */
static int absolute_path(const char *opt, const char *path, char *out, size_t outlen) {
  char cwd[PATH_MAX];
  if (path[0] == '/') {
    if (snprintf(out, outlen, "%s", path) >= (int)outlen) return fail("%s: path too long", opt);
    return 0;
  }
  if (!getcwd(cwd, sizeof cwd)) return fail("%s: cannot get the working directory: %s", opt,
                                            strerror(errno));
  if (snprintf(out, outlen, "%s/%s", cwd, path) >= (int)outlen)
    return fail("%s: path too long", opt);
  return 0;
}

/* A policy file, or a shipped policy's name ("budget"). */
static int check_policy(const char *path, char *out, size_t outlen) {
  struct stat st;
  char found[PATH_MAX], err[512];
  if (!strchr(path, '/') && !strstr(path, ".lua") && stat(path, &st) != 0) {
    if (ferry_policy_find(path, found, sizeof found, err, sizeof err))
      return fail("--policy: %s", err);
    path = found;
  }
  if (stat(path, &st) != 0)
    return fail("--policy %s: %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode)) return fail("--policy %s: not a regular file", path);
  if (access(path, R_OK) != 0) return fail("--policy %s: %s", path, strerror(errno));
  char real[PATH_MAX];
  if (!realpath(path, real)) return fail("--policy %s: %s", path, strerror(errno));
  return absolute_path("--policy", real, out, outlen);
}

static int check_trace(const char *opt, const char *path, char *out, size_t outlen) {
  size_t len = strlen(path);
  if (!len || path[len - 1] == '/')
    return fail("%s '%s': names a directory, not a file", opt, path);
  int rc = absolute_path(opt, path, out, outlen);
  if (rc) return rc;
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", out);
  char *slash = strrchr(dir, '/');
  slash[slash == dir] = '\0'; /* "/a/b" -> "/a", "/b" -> "/" */
  if (access(dir, W_OK) != 0)
    return fail("%s %s: cannot write in %s: %s", opt, path, dir, strerror(errno));
  return 0;
}

/* ---- the environment ------------------------------------------------------------ */

/* LD_PRELOAD with jemalloc first (so it serves malloc), after dropping any
 * entry that already names the same file. ld.so splits on ':' and ' '. */
static int compose_preload(const char *jemalloc, char **out) {
  const char *old = getenv("LD_PRELOAD");
  size_t cap = strlen(jemalloc) + (old ? strlen(old) : 0) + 2;
  char *s = malloc(cap);
  if (!s) return fail("out of memory");
  char je_real[PATH_MAX], tok_real[PATH_MAX], tok[PATH_MAX];
  if (!realpath(jemalloc, je_real)) snprintf(je_real, sizeof je_real, "%s", jemalloc);
  size_t len = (size_t)snprintf(s, cap, "%s", jemalloc);
  while (old && *old) {
    size_t n = strcspn(old, ": ");
    int same = 0;
    if (n && n < sizeof tok) {
      memcpy(tok, old, n);
      tok[n] = '\0';
      same = !strcmp(tok, jemalloc) || (realpath(tok, tok_real) && !strcmp(tok_real, je_real));
    }
    if (n && !same) len += (size_t)snprintf(s + len, cap - len, ":%.*s", (int)n, old);
    old += n + (old[n] != '\0');
  }
  *out = s;
  return 0;
}

static void print_quoted(FILE *to, const char *arg) {
  if (*arg && strspn(arg, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                          "_-+=/.,:@%") == strlen(arg)) {
    fputs(arg, to);
    return;
  }
  fputc('\'', to);
  for (; *arg; arg++) {
    if (*arg == '\'') fputs("'\\''", to);
    else fputc(*arg, to);
  }
  fputc('\'', to);
}

int ferry_cli_run(int argc, char **argv) {
  static const struct option opts[] = {{"policy", required_argument, 0, 'p'},
                                       {"trace", required_argument, 0, 't'},
                                       {"chrome-trace", required_argument, 0, 'T'},
                                       {"trace-out", required_argument, 0, 'T'},
                                       {"cap", required_argument, 0, 'c'},
                                       {"backend", required_argument, 0, 'b'},
                                       {"release-copied", no_argument, 0, 'R'},
                                       {"prefetch-at-backward", no_argument, 0, 'B'},
                                       {"dry-run", no_argument, 0, 'n'},
                                       {"quiet", no_argument, 0, 'q'},
                                       {"verbose", no_argument, 0, 'v'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  const char *policy = NULL, *trace = NULL, *chrome = NULL, *cap = NULL, *backend = NULL;
  int dry_run = 0, release_copied = 0, prefetch_bwd = 0, c;
  opterr = 0; /* our own messages name "ferry run" */
  optind = 1;
  /* '+': stop at the first non-option, so the trainer's own options stay
   * its own even without "--". ':': report a missing argument as ':'. */
  while ((c = getopt_long(argc, argv, "+:p:t:c:b:nqvh", opts, NULL)) != -1) {
    switch (c) {
    case 'p': policy = optarg; break;
    case 't': trace = optarg; break;
    case 'T': chrome = optarg; break;
    case 'c': cap = optarg; break;
    case 'b': backend = optarg; break;
    case 'R': release_copied = 1; break;
    case 'B': prefetch_bwd = 1; break;
    case 'n': dry_run = 1; break;
    case 'q': cli_verbosity = -1; break;
    case 'v': cli_verbosity = 1; break;
    case 'h': usage(stdout); return 0;
    default: /* ':' a missing value; optopt: an unknown short option, 0 for a long one */
      cli_bad_option("run", opts, argv, optind, optopt, c == ':');
      usage_hint();
      return RUN_EXIT_FAILED;
    }
  }
  if (optind >= argc) {
    fail("no command to run");
    return usage_hint();
  }
  char **cmd = argv + optind;

  /* Check every value before touching the environment. */
  char policy_abs[PATH_MAX], trace_abs[PATH_MAX], chrome_abs[PATH_MAX], cap_value[64],
      jemalloc[PATH_MAX];
  int rc;
  if (backend && strcmp(backend, "host") && strcmp(backend, "cuda") && strcmp(backend, "auto"))
    return fail("--backend '%s': expected host, cuda or auto", backend);
  static const char *const dash_flags[] = {"--policy", "--trace", "--chrome-trace"};
  const char *dash_values[] = {policy, trace, chrome};
  for (int i = 0; i < 3; i++)
    if (dash_values[i] && !strcmp(dash_values[i], "-"))
      return fail("%s -: the trainer's stdin and stdout are its own; give a file", dash_flags[i]);
  if (policy && (rc = check_policy(policy, policy_abs, sizeof policy_abs))) return rc;
  if (trace && (rc = check_trace("--trace", trace, trace_abs, sizeof trace_abs))) return rc;
  if (chrome && (rc = check_trace("--chrome-trace", chrome, chrome_abs, sizeof chrome_abs)))
    return rc;
  if (cap && (rc = parse_cap(cap, cap_value, sizeof cap_value))) return rc;
  if ((rc = find_jemalloc(jemalloc, sizeof jemalloc))) return rc;
  char *preload = NULL;
  if ((rc = compose_preload(jemalloc, &preload))) return rc;

  struct {
    const char *name, *value;
  } env[] = {{"LD_PRELOAD", preload},
             /* what ferry run preloaded, so a binding can tell a preload that
              * did not take (it checks that jemalloc is really loaded) */
             {"FERRY_JEMALLOC_PRELOADED", jemalloc},
             {"FERRY_POLICY", policy ? policy_abs : NULL},
             {"FERRY_TRACE", trace ? trace_abs : NULL},
             {"FERRY_CHROME_TRACE", chrome ? chrome_abs : NULL},
             {"FERRY_HOST_CAP", cap ? cap_value : NULL},
             {"FERRY_BACKEND", backend},
             {"FERRY_RELEASE_COPIED", release_copied ? "1" : NULL},
             {"FERRY_PREFETCH_AT_BACKWARD", prefetch_bwd ? "1" : NULL},
             {"FERRY_LOG_LEVEL", cli_verbosity < 0 ? "error" : NULL}};
  FILE *show = dry_run ? stdout : cli_verbosity > 0 ? stderr : NULL;
  for (size_t i = 0; i < sizeof env / sizeof env[0]; i++) {
    if (!env[i].value) continue;
    if (show) fprintf(show, "%s=%s\n", env[i].name, env[i].value);
    if (dry_run) continue;
    if (setenv(env[i].name, env[i].value, 1) != 0) {
      free(preload);
      return fail("cannot set %s: %s", env[i].name, strerror(errno));
    }
  }
  free(preload);
  if (show) {
    fputs("exec", show);
    for (char **a = cmd; *a; a++) {
      fputc(' ', show);
      print_quoted(show, *a);
    }
    fputc('\n', show);
  }
  if (dry_run) return 0;
  fflush(stdout);
  fflush(stderr);
  execvp(cmd[0], cmd);
  int err = errno;
  fprintf(stderr, "ferry run: cannot run '%s': %s%s\n", cmd[0], strerror(err),
          err == ENOENT && !strchr(cmd[0], '/') ? " (not found in PATH)" : "");
  return err == ENOENT ? RUN_EXIT_NOT_FOUND : RUN_EXIT_CANNOT_EXECUTE;
}
