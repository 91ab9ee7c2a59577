/* test_policy_rules_fields.c — ferry.rules's own tests read the tensor and
 * context from the tables behind the views t and ctx (no metamethod per
 * field: the cost of an uncached decision), while every function a policy
 * writes still gets the read-only views. */
#include <stdlib.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"

static ferry_policy *load_rules_policy(const char *text, char *path, size_t n) {
  snprintf(path, n, "/tmp/ferry-rules-fields-XXXXXX.lua");
  int fd = mkstemps(path, 4);
  if (fd < 0) return NULL;
  ssize_t len = (ssize_t)strlen(text);
  ssize_t wrote = write(fd, text, (size_t)len);
  close(fd);
  ferry_policy *p = NULL;
  char err[1024];
  if (wrote != len || ferry_policy_create(path, NULL, 0, &p, err, sizeof err) != FERRY_OK)
    fprintf(stderr, "unexpected load error: %s\n", err);
  return p;
}

static ferry_tensor_desc tensor(const char *path, int kind, uint64_t bytes, int layer) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_BF16;
  d.kind = kind;
  d.ndim = 1;
  d.shape[0] = (int64_t)(bytes / 2);
  d.layer = layer;
  d.layer_count = 8;
  d.phase = FERRY_PHASE_FORWARD;
  d.module_path = path;
  d.module_class = "Linear";
  return d;
}

/* A function the policy wrote (R.when, or put into a rule object in place
 * of the library's test) is given the views: assigning a field is an
 * error there, as everywhere in a policy. Each answers "offload" only if
 * its assignments were refused and it saw the tensor's fields. */
TEST(policy_rules_own_functions_get_the_views) {
  char path[256];
  ferry_policy *p = load_rules_policy(
      "local R = require 'ferry.rules'\n"
      "local function refused(t, ctx)\n"
      "  local okt = pcall(function() t.bytes = 0 end)\n"
      "  local okc = pcall(function() ctx.step = 0 end)\n"
      "  return not okt and not okc and t.bytes == 4096 and ctx.step == 3\n"
      "end\n"
      "local swapped = R.min_bytes(1)\n"
      "swapped.test = refused\n"
      "return R.policy { cache = false, R.when(refused), swapped }\n",
      path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc d = tensor("model.a", FERRY_KIND_ACTIVATION, 4096, 0);
  ferry_context c = {.step = 3};
  ferry_decision out;
  for (int i = 0; i < 3; i++) {
    ferry_policy_decide(p, &d, &c, &out);
    if (ferry_policy_last_error(p)[0]) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
    CHECK_EQ(out.action, FERRY_OFFLOAD);
  }
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 0);
  ferry_policy_destroy(p);
  unlink(path);
  return 0;
}

/* The library's own rules see each tensor's and each context's fields as
 * they are, decision after decision, though the host rewrites only the
 * fields that changed: size, kind, layer, path and the bytes in flight
 * all change from one tensor to the next and come back. */
TEST(policy_rules_fields_follow_every_tensor) {
  char path[256];
  ferry_policy *p = load_rules_policy(
      "local R = require 'ferry.rules'\n"
      "return R.policy { cache = false,\n"
      "  R.min_bytes(1024), R.exclude_params_and_buffers(), R.exclude_modules('lm_head'),\n"
      "  R.keep_last_layers(2), R.in_flight_cap(10000) }\n",
      path, sizeof path);
  CHECK(p != NULL);
  struct {
    const char *path;
    int kind;
    uint64_t bytes;
    int layer;
    uint64_t in_flight;
    int want;
  } rows[] = {
      {"model.a", FERRY_KIND_ACTIVATION, 4096, 0, 0, FERRY_OFFLOAD},
      {"model.a", FERRY_KIND_ACTIVATION, 512, 0, 0, FERRY_KEEP},     /* small */
      {"model.a", FERRY_KIND_ACTIVATION, 4096, 0, 0, FERRY_OFFLOAD}, /* back */
      {"model.a", FERRY_KIND_PARAMETER, 4096, 0, 0, FERRY_KEEP},     /* kind */
      {"lm_head", FERRY_KIND_ACTIVATION, 4096, 0, 0, FERRY_KEEP},    /* path */
      {"model.b", FERRY_KIND_ACTIVATION, 4096, 0, 0, FERRY_OFFLOAD},
      {"model.b", FERRY_KIND_ACTIVATION, 4096, 7, 0, FERRY_KEEP},    /* layer */
      {"model.b", FERRY_KIND_ACTIVATION, 4096, 1, 8000, FERRY_KEEP}, /* ctx */
      {"model.b", FERRY_KIND_ACTIVATION, 4096, 1, 0, FERRY_OFFLOAD},
      {"lm_head", FERRY_KIND_ACTIVATION, 4096, 1, 0, FERRY_KEEP},
      {"model.a", FERRY_KIND_ACTIVATION, 4096, 0, 5000, FERRY_OFFLOAD},
  };
  for (int round = 0; round < 2; round++)
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
      ferry_tensor_desc d = tensor(rows[i].path, rows[i].kind, rows[i].bytes, rows[i].layer);
      ferry_context c = {.step = 1, .bytes_in_flight = rows[i].in_flight};
      ferry_decision out;
      ferry_policy_decide(p, &d, &c, &out);
      if (out.action != rows[i].want) fprintf(stderr, "row %zu, round %d\n", i, round);
      CHECK_EQ(out.action, rows[i].want);
    }
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 0);
  ferry_policy_destroy(p);
  unlink(path);
  return 0;
}

/* A function the policy wrote may call the policy's own decide (to ask
 * about another tensor): the functions after it in the outer decision
 * still get the outer decision's t, not the tensor of the inner call. */
TEST(policy_rules_own_functions_reentrant_decide) {
  char path[256];
  ferry_policy *p = load_rules_policy(
      "local R = require 'ferry.rules'\n"
      "local P\n"
      "local function asks(t, ctx)\n"
      "  if rawget(t, 'fake') == nil then P.decide({ fake = true, bytes = 7 }, ctx) end\n"
      "  return true\n"
      "end\n"
      "local function real(t) return rawget(t, 'fake') == nil and t.bytes == 4096 end\n"
      "P = R.policy { cache = false, R.when(asks), R.when(real) }\n"
      "return P\n",
      path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc d = tensor("model.a", FERRY_KIND_ACTIVATION, 4096, 0);
  ferry_context c = {.step = 1};
  ferry_decision out;
  ferry_policy_decide(p, &d, &c, &out);
  if (ferry_policy_last_error(p)[0]) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);
  unlink(path);
  return 0;
}
