/* names.c — the text names of ferry's enums (ferry.h, ferry_tools.h). */
#include "ferry_tools.h"

#include <string.h>

#include "ferry.h"

#define NAME_(e, name, bytes, torch, np) [FERRY_DTYPE_##e] = name,
#define SIZE_(e, name, bytes, torch, np) [FERRY_DTYPE_##e] = bytes,
#define TORCH_(e, name, bytes, torch, np) [FERRY_DTYPE_##e] = torch,
static const char *const dtype_names[FERRY_DTYPE_COUNT_] = {
    [FERRY_DTYPE_UNKNOWN] = "unknown", FERRY_DTYPE_LIST(NAME_)};
static const int dtype_sizes[FERRY_DTYPE_COUNT_] = {FERRY_DTYPE_LIST(SIZE_)};
static const char *const dtype_torch_names[FERRY_DTYPE_COUNT_] = {FERRY_DTYPE_LIST(TORCH_)};
static const char *const kind_names[] = {"activation", "parameter", "buffer", "other"};
static const char *const phase_names[] = {"forward", "recompute", "backward"};

static int parse(const char *const *names, int n, const char *s) {
  if (!s) return -1;
  for (int i = 0; i < n; i++)
    if (names[i] && strcmp(names[i], s) == 0) return i;
  return -1;
}

const char *ferry_dtype_name(int d) {
  return d >= 0 && d < FERRY_DTYPE_COUNT_ ? dtype_names[d] : "unknown";
}
int ferry_dtype_from_name(const char *s) {
  int d = parse(dtype_names, FERRY_DTYPE_COUNT_, s);
  return d >= 0 ? d : parse(dtype_torch_names, FERRY_DTYPE_COUNT_, s);
}
int ferry_dtype_size(int d) { return d >= 0 && d < FERRY_DTYPE_COUNT_ ? dtype_sizes[d] : 0; }
const char *ferry_kind_name(int k) { return k >= 0 && k < 4 ? kind_names[k] : "other"; }
int ferry_kind_parse(const char *s) { return parse(kind_names, 4, s); }
const char *ferry_phase_name(int p) { return p >= 0 && p < 3 ? phase_names[p] : "forward"; }
int ferry_phase_parse(const char *s) { return parse(phase_names, 3, s); }
