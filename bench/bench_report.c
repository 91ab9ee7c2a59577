/* bench_report.c — the benchmarks' reporting (bench.h): a printed table row
 * and a JSON member per metric. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench.h"

struct bench_report {
  cJSON *json;
};

void bench_metric(bench_report *r, const char *name, double value, const char *unit,
                  const char *note) {
  printf("  %-40s %14.4g %-8s %s\n", name, value, unit ? unit : "", note ? note : "");
  fflush(stdout);
  cJSON_DeleteItemFromObject(r->json, name);
  cJSON_AddNumberToObject(r->json, name, value);
}

double bench_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The JSON object in path, or NULL when there is none (or not an object). */
static cJSON *read_json_object(const char *path) {
  FILE *old = fopen(path, "r");
  if (!old) return NULL;
  cJSON *prev = NULL;
  fseek(old, 0, SEEK_END);
  long n = ftell(old);
  rewind(old);
  char *buf = malloc((size_t)n + 1);
  if (buf && fread(buf, 1, (size_t)n, old) == (size_t)n) {
    buf[n] = 0;
    prev = cJSON_Parse(buf);
    if (!cJSON_IsObject(prev)) {
      cJSON_Delete(prev);
      prev = NULL;
    }
  }
  free(buf);
  fclose(old);
  return prev;
}

bench_report *bench_report_open(const char *json_path) {
  bench_report *r = malloc(sizeof *r);
  if (!r) return NULL;
  r->json = read_json_object(json_path);
  if (!r->json) r->json = cJSON_CreateObject();
  return r;
}

int bench_report_close(bench_report *r, const char *json_path) {
  char *text = cJSON_Print(r->json);
  FILE *f = fopen(json_path, "w");
  int rc = 0;
  if (!f || !text) {
    fprintf(stderr, "ferry_bench: cannot write %s\n", json_path);
    rc = -1;
  } else {
    fputs(text, f);
    fputc('\n', f);
  }
  if (f) fclose(f);
  free(text);
  cJSON_Delete(r->json);
  free(r);
  return rc;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
