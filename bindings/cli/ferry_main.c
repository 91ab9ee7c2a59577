/*
 * ferry_main.c — the `ferry` command: one binary, one subcommand per job.
 * Each subcommand lives in its own file (cli_*.c) and is declared here.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
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
  fprintf(to, "\n`ferry <command> --help` (or `ferry help <command>`) for each; `ferry -V`\n"
              "(--version).\n"
              "\nconventions (docs/cli.md): a file name \"-\" is stdin or stdout (one output\n"
              "on stdout at a time; the report for people then goes to stderr); -q, --quiet\n"
              "and -v, --verbose in every command; colour only on a terminal and never with\n"
              "NO_COLOR set; progress on stderr when it is a terminal.\n"
              "\nexit status: 0 ok; 1 a policy, trace, file or run error; 2 usage (a bad flag\n"
              "or value); 3 `ferry sim`: a policy faulted in a replay; 4 `ferry sim --fit`:\n"
              "nothing fits; 130 interrupted (143 terminated). `ferry run` passes the\n"
              "trainer's status through and uses 125-127 for its own failures.\n"
              "\nexamples:\n"
              "  ferry check default\n"
              "  ferry trace synth -o - | ferry sim --policy default,layers --trace -\n"
              "  ferry run --policy budget -- python train.py\n");
}

/* Ctrl-C ends every subcommand within moments with the shell's 128 + SIGINT,
 * also while a C call that cannot be interrupted runs (a policy in the
 * pattern matcher, a blocked read): async-signal-safe write and _exit, no
 * cleanup that could itself hang. `ferry run` execs its trainer, which gets
 * its own default handling. */
static void on_interrupt(int sig) {
  static const char msg[] = "\nferry: interrupted\n";
  cli_output_abandon(); /* the temporary file of an output "-" */
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
  if (argc > 2 && !strcmp(argv[1], "help")) { /* ferry help sim = ferry sim --help */
    static char help_flag[] = "--help";
    char *sub[] = {argv[2], help_flag, NULL};
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
      if (!strcmp(argv[2], commands[i].name) && commands[i].fn) return commands[i].fn(2, sub);
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
  const char *red = cli_sgr(2, CLI_RED), *bold = cli_sgr(2, CLI_BOLD), *off = cli_sgr(2, CLI_RESET);
  if (close)
    fprintf(stderr, "%sferry:%s unknown command '%s'; did you mean '%s%s%s'?\n\n", red, off,
            argv[1], bold, close, off);
  else fprintf(stderr, "%sferry:%s unknown command '%s'\n\n", red, off, argv[1]);
  usage(stderr);
  return 2;
}
