#include <stdio.h>
#include <time.h>
#include "bench.h"
struct bench_report { int n; };
void bench_metric(bench_report *r, const char *name, double value, const char *unit, const char *note){ printf("%-42s %12.4f %-6s %s\n", name, value, unit, note?note:""); }
double bench_now_ns(void){ struct timespec ts; clock_gettime(CLOCK_MONOTONIC,&ts); return ts.tv_sec*1e9+ts.tv_nsec; }
void bench_arena(bench_report *r);
int main(void){ struct bench_report r={0}; bench_arena(&r); return 0; }
