/* bench_table.c — the benchmarks ferry_bench runs, by --only name. */
#include "bench.h"

const bench_entry bench_table[] = {
    {"engine", bench_engine},
    {"host_copy", bench_host_copy},
    {"cuda_copy", bench_cuda_copy},
    {"arena", bench_arena},
    {"policy", bench_policy},
    {"policy_bounds", bench_policy_bounds},
    {"sim", bench_sim},
    {"snapshot", bench_snapshot},
    {"prefetch", bench_prefetch},
    {"stress", bench_stress},
};
const size_t bench_table_len = sizeof bench_table / sizeof bench_table[0];
