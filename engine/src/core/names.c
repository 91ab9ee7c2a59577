/* names.c — see names.h. */
#include "core/names.h"

#include <string.h>

#include "ferry.h"

static const char *const dtype_names[FERRY_DTYPE_COUNT_] = {
    [FERRY_DTYPE_UNKNOWN] = "unknown", [FERRY_DTYPE_F32] = "f32",
    [FERRY_DTYPE_F16] = "f16",         [FERRY_DTYPE_BF16] = "bf16",
    [FERRY_DTYPE_F64] = "f64",         [FERRY_DTYPE_F8E4M3] = "f8e4m3",
    [FERRY_DTYPE_F8E5M2] = "f8e5m2",   [FERRY_DTYPE_I64] = "i64",
    [FERRY_DTYPE_I32] = "i32",         [FERRY_DTYPE_I16] = "i16",
    [FERRY_DTYPE_I8] = "i8",           [FERRY_DTYPE_U8] = "u8",
    [FERRY_DTYPE_BOOL] = "bool"};
static const int dtype_sizes[FERRY_DTYPE_COUNT_] = {
    [FERRY_DTYPE_F32] = 4, [FERRY_DTYPE_F16] = 2,    [FERRY_DTYPE_BF16] = 2,
    [FERRY_DTYPE_F64] = 8, [FERRY_DTYPE_F8E4M3] = 1, [FERRY_DTYPE_F8E5M2] = 1,
    [FERRY_DTYPE_I64] = 8, [FERRY_DTYPE_I32] = 4,    [FERRY_DTYPE_I16] = 2,
    [FERRY_DTYPE_I8] = 1,  [FERRY_DTYPE_U8] = 1,     [FERRY_DTYPE_BOOL] = 1};
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
int ferry_dtype_parse(const char *s) { return parse(dtype_names, FERRY_DTYPE_COUNT_, s); }
int ferry_dtype_size(int d) { return d >= 0 && d < FERRY_DTYPE_COUNT_ ? dtype_sizes[d] : 0; }
const char *ferry_kind_name(int k) { return k >= 0 && k < 4 ? kind_names[k] : "other"; }
int ferry_kind_parse(const char *s) { return parse(kind_names, 4, s); }
const char *ferry_phase_name(int p) { return p >= 0 && p < 3 ? phase_names[p] : "forward"; }
int ferry_phase_parse(const char *s) { return parse(phase_names, 3, s); }
