/* test_trace_reader_memo.c — what the trace reader remembers between lines
 * (trace_strings.c: dtype, kind and phase codes by their last text, owned
 * strings by a hash of their bytes) never stands for another text: near
 * names still fail with their file:line, module paths that differ only in
 * the middle or the length stay apart, equal ones share one copy. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

#define HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"

/* A pack line of tensor id with the given dtype, kind, phase and module. */
static int pack(char *out, size_t n, int id, const char *dtype, const char *kind,
                const char *phase, const char *module) {
  return snprintf(out, n,
                  "{\"ev\":\"pack\",\"t_us\":1,\"id\":%d,\"step\":1,\"bytes\":16,\"dtype\":\"%s\","
                  "\"shape\":[4],\"kind\":\"%s\",\"phase\":\"%s\",\"layer\":0,\"layers\":2,"
                  "\"module\":\"%s\",\"class\":\"Linear\",\"decision\":\"keep\"}\n",
                  id, dtype, kind, phase, module);
}

/* HDR BEGIN, a good pack (id 1), then a pack (id 2) with one field
 * changed: the error must name line 4 and the text given. */
static int second_pack_fails(const char *dtype, const char *kind, const char *phase,
                             const char *want) {
  char text[2048], err[512] = "";
  int n = snprintf(text, sizeof text, HDR BEGIN);
  n += pack(text + n, sizeof text - (size_t)n, 1, "bf16", "activation", "forward", "m");
  n += pack(text + n, sizeof text - (size_t)n, 2, dtype, kind, phase, "m");
  sim_trace *t = NULL;
  int rc = sim_trace_parse("memo.jsonl", text, (size_t)n, &t, err, sizeof err);
  sim_trace_free(t);
  if (rc != FERRY_EPARSE || !strstr(err, want)) {
    fprintf(stderr, "  want \"%s\", got rc %d \"%s\"\n", want, rc, err);
    return -1;
  }
  return 0;
}

TEST(trace_reader_remembered_names_are_exact) {
  /* a prefix, an extension, one letter off, the empty text, after a good one */
  CHECK_EQ(second_pack_fails("bf1", "activation", "forward", "memo.jsonl:4: unknown dtype \"bf1\""), 0);
  CHECK_EQ(second_pack_fails("bf16x", "activation", "forward", "memo.jsonl:4: unknown dtype \"bf16x\""), 0);
  CHECK_EQ(second_pack_fails("bf17", "activation", "forward", "memo.jsonl:4: unknown dtype \"bf17\""), 0);
  CHECK_EQ(second_pack_fails("", "activation", "forward", "memo.jsonl:4: unknown dtype \"\""), 0);
  CHECK_EQ(second_pack_fails("bf16", "activatioN", "forward", "memo.jsonl:4: unknown kind \"activatioN\""), 0);
  CHECK_EQ(second_pack_fails("bf16", "", "forward", "memo.jsonl:4: unknown kind \"\""), 0);
  CHECK_EQ(second_pack_fails("bf16", "activation", "forwards", "memo.jsonl:4: unknown phase \"forwards\""), 0);
  CHECK_EQ(second_pack_fails("bf16", "activation", "Forward", "memo.jsonl:4: unknown phase \"Forward\""), 0);
  return 0;
}

/* Module paths of every layer (they differ only in the middle), of every
 * length around the 8-byte words hashed, and ones that differ only in the
 * last byte (enough of them that some share a remembered slot), each packed
 * twice: each tensor keeps its own text, and equal texts one copy. */
TEST(trace_reader_owned_strings_stay_apart) {
  enum { LAYERS = 100, LENGTHS = 40, LASTS = 20 * 62 };
  static const char last[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  size_t cap = 4 << 20, n = 0;
  char *text = malloc(cap);
  CHECK(text != NULL);
  static char module[LAYERS + LENGTHS + LASTS][96];
  n += (size_t)snprintf(text + n, cap - n, HDR BEGIN);
  int id = 1;
  for (int k = 0; k < LAYERS + LENGTHS + LASTS; k++) {
    if (k < LAYERS) {
      snprintf(module[k], sizeof module[k], "model.layers.%d.self_attn.q_proj", k);
    } else if (k >= LAYERS + LENGTHS) {
      int j = k - LAYERS - LENGTHS;
      snprintf(module[k], sizeof module[k], "model.layers.%02d.mlp_%c", j / 62, last[j % 62]);
    } else { /* "a", "ab", ... : lengths 1 to 40 */
      int len = k - LAYERS + 1;
      for (int i = 0; i < len; i++) module[k][i] = (char)('a' + i % 26);
      module[k][len] = 0;
    }
    for (int twice = 0; twice < 2; twice++)
      n += (size_t)pack(text + n, cap - n, id++, "f32", "activation", "forward", module[k]);
  }
  for (int i = 1; i < id; i++)
    n += (size_t)snprintf(text + n, cap - n, "{\"ev\":\"unpack\",\"t_us\":5,\"id\":%d}\n", i);
  n += (size_t)snprintf(text + n, cap - n, "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n");
  CHECK(n < cap);
  sim_trace *t = NULL;
  char err[512] = "";
  int rc = sim_trace_parse("memo.jsonl", text, n, &t, err, sizeof err);
  if (rc) fprintf(stderr, "  %s\n", err);
  CHECK_EQ(rc, 0);
  CHECK_EQ(t->n_tensors, (uint32_t)(2 * (LAYERS + LENGTHS + LASTS)));
  for (int k = 0; k < LAYERS + LENGTHS + LASTS; k++) {
    const trace_tensor *a = &t->tensors[2 * k], *b = &t->tensors[2 * k + 1];
    CHECK(a->desc.module_path && !strcmp(a->desc.module_path, module[k]));
    CHECK(a->desc.module_path == b->desc.module_path); /* one copy */
    CHECK(a->desc.module_class && !strcmp(a->desc.module_class, "Linear"));
  }
  sim_trace_free(t);
  free(text);
  return 0;
}
