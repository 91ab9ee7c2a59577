/* bench.h — what ferry's benchmarks share. Dependencies go one way:
 * bench_main.c drives the benchmarks through bench_table (bench_table.c);
 * each benchmark (bench_<name>.c) reports through bench_report.c's
 * functions and calls nothing in bench_main.c. */
#ifndef FERRY_BENCH_H
#define FERRY_BENCH_H
#include <stddef.h>
#include <stdint.h>

/* ---- reporting (bench_report.c) ---- */
typedef struct bench_report bench_report;
/* Record a metric for build/bench.json and the printed table; note may be NULL. */
void bench_metric(bench_report *r, const char *name, double value, const char *unit, const char *note);
/* CLOCK_MONOTONIC in nanoseconds. */
double bench_now_ns(void);
/* The median of v[0..n) (sorts v; the mean of the middle two for even n). */
double bench_median(double *v, int n);
/* A report that keeps the metrics json_path already holds (other runs,
 * e.g. Python's, write there too); NULL out of memory. */
bench_report *bench_report_open(const char *json_path);
/* Writes the report's metrics to json_path and frees it; 0, or -1. */
int bench_report_close(bench_report *r, const char *json_path);

/* ---- the benchmarks (bench_<name>.c), run in this order ---- */
typedef struct bench_entry {
  const char *name;
  void (*fn)(bench_report *);
} bench_entry;
extern const bench_entry bench_table[];
extern const size_t bench_table_len;

void bench_engine(bench_report *r);
void bench_host_copy(bench_report *r);
void bench_cuda_copy(bench_report *r);
void bench_arena(bench_report *r);
void bench_policy(bench_report *r);
void bench_policy_bounds(bench_report *r);
void bench_sim(bench_report *r);
void bench_snapshot(bench_report *r);
void bench_prefetch(bench_report *r);
void bench_stress(bench_report *r);
/* Instruction-count mode, run under callgrind (bench_engine.c). */
int bench_engine_instr(const char *which, long iters);
/* iters uncached decisions of the shipped policy `name`, after the steady
 * steps bench_policy runs first (for callgrind: bench_main's --instr). */
int bench_policy_instr(const char *name, long iters, int steady);
int bench_policy_step_sites(void); /* decisions per steady step */
/* A trace of `steps` steps read (which "parse"), replayed ("replay") or
 * both ("whole"), only that counted (bench_sim.c). */
int bench_sim_instr(const char *which, long steps);
/* Trace events per step of the trace bench_sim_instr reads; -1 on failure. */
double bench_sim_events_per_step(void);
#endif
