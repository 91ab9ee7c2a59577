/* bench.h — shared by ferry's benchmarks. */
#ifndef FERRY_BENCH_H
#define FERRY_BENCH_H
#include <stdint.h>
typedef struct bench_report bench_report;
/* Record a metric for build/bench.json and the printed table. baseline may be NULL. */
void bench_metric(bench_report *r, const char *name, double value, const char *unit, const char *note);
double bench_now_ns(void);
#endif
