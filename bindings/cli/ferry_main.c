/*
 * ferry_main.c — the `ferry` command: one binary, one subcommand per job.
 * Each subcommand lives in its own file (cli_*.c) and is declared here.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"

/* Weak: a build without one of the cli_*.c files still links and says so. */
__attribute__((weak)) int ferry_cli_check(int argc, char **argv); /* cli_check.c */
__attribute__((weak)) int ferry_cli_sim(int argc, char **argv);   /* cli_sim.c */
__attribute__((weak)) int ferry_cli_trace(int argc, char **argv); /* cli_trace.c */
__attribute__((weak)) int ferry_cli_run(int argc, char **argv);   /* cli_run.c */

typedef struct {
  const char *name;
  int (*fn)(int, char **);
  const char *summary;
} subcommand;

static const subcommand commands[] = {
    {"check", ferry_cli_check, "load a policy and print its decisions, with their reasons"},
    {"sim", ferry_cli_sim, "dry-run policies over a trace on a simulated GPU link"},
    {"trace", ferry_cli_trace, "synthesize traces (ferry trace synth ...)"},
    {"run", ferry_cli_run, "run a trainer with jemalloc preloaded and ferry settings"},
};

static void usage(FILE *to) {
  fprintf(to, "usage: ferry <command> [args]\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(to, "  %-8s %s\n", commands[i].name, commands[i].summary);
  fprintf(to, "\n`ferry <command> --help` for each; `ferry -V` (--version).\n"
              "\nexit status: 0 ok; 1 a policy, trace or run error; 2 usage (a bad flag or\n"
              "value); 130 interrupted. `ferry run` passes the trainer's status through\n"
              "and uses 125-127 for its own failures.\n");
}

/* Ctrl-C ends every subcommand within moments with the shell's 128 + SIGINT,
 * also while a C call that cannot be interrupted runs (a policy in the
 * pattern matcher, a blocked read): async-signal-safe write and _exit, no
 * cleanup that could itself hang. `ferry run` execs its trainer, which gets
 * its own default handling. */
static void on_interrupt(int sig) {
  static const char msg[] = "\nferry: interrupted\n";
  ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)ignored;
  _exit(128 + sig);
}

int main(int argc, char **argv) {
  struct sigaction sa = {0}, old;
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  for (int sig = SIGINT; sig; sig = sig == SIGINT ? SIGTERM : 0) /* kept if ignored (nohup) */
    if (sigaction(sig, NULL, &old) == 0 && old.sa_handler != SIG_IGN) sigaction(sig, &sa, NULL);
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V") || !strcmp(argv[1], "version")) {
    printf("ferry %s\n", ferry_version_string());
    return 0;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) {
      if (!commands[i].fn) {
        fprintf(stderr, "ferry: '%s' is not part of this build\n", argv[1]);
        return 2;
      }
      return commands[i].fn(argc - 1, argv + 1);
    }
  const char *names[sizeof commands / sizeof commands[0]];
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) names[i] = commands[i].name;
  const char *close = ferry_suggest(argv[1], names, sizeof commands / sizeof commands[0]);
  if (close) fprintf(stderr, "ferry: unknown command '%s'; did you mean '%s'?\n\n", argv[1], close);
  else fprintf(stderr, "ferry: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
