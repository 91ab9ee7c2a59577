/* test_trace_reader_memo.c — what the trace reader remembers between lines
 * (trace_strings.c: dtype, kind and phase codes by their last text, owned
 * strings by a hash of their bytes) never stands for another text: near
 * names still fail with their file:line, module paths that differ only in
 * the middle or the length stay apart, equal ones share one copy. And the
 * checks rewritten beside it (names by length and one comparison, numbers
 * in one range test) refuse near misses with their old messages. */
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

/* The reader's rewritten checks (events and decisions told apart by length
 * and one comparison; integers, shape items and flops taken in one range
 * test) still refuse near misses with the messages they had: a name of the
 * same first letter and length as a real one, numbers just outside. */
static int line_fails(const char *line, const char *want) {
  char text[2048], err[512] = "";
  int n = snprintf(text, sizeof text, HDR BEGIN "%s\n", line);
  sim_trace *t = NULL;
  int rc = sim_trace_parse("near.jsonl", text, (size_t)n, &t, err, sizeof err);
  sim_trace_free(t);
  if (rc != FERRY_EPARSE || strcmp(err, want)) {
    fprintf(stderr, "  %s\n  want \"%s\", got rc %d \"%s\"\n", line, want, rc, err);
    return -1;
  }
  return 0;
}

#define PACK_WITH(id, shape, decision)                                                         \
  "{\"ev\":\"pack\",\"t_us\":1,\"id\":" id ",\"step\":1,\"bytes\":16,\"dtype\":\"bf16\","      \
  "\"shape\":" shape ",\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"              \
  "\"layers\":2,\"decision\":\"" decision "\"}"

TEST(trace_reader_near_names_and_numbers_keep_their_errors) {
  /* every event's name with its last letter changed: same length, same first letter */
  static const char *const events[] = {
      "pack", "unpack", "discard", "device_peak", "compute", "collective", "collective_wait",
      "step_begin", "step_end", "backward_begin", "backward_end", "resident", "alloc", "free",
      "header"};
  char line[256], want[256];
  for (size_t i = 0; i < sizeof events / sizeof events[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "%s", events[i]);
    name[strlen(name) - 1] ^= 0x01;
    snprintf(line, sizeof line, "{\"ev\":\"%s\",\"t_us\":1}", name);
    snprintf(want, sizeof want, "near.jsonl:3: unknown event \"%s\"", name);
    CHECK_EQ(line_fails(line, want), 0);
  }
  CHECK_EQ(line_fails(PACK_WITH("1", "[4]", "kept"),
                      "near.jsonl:3: decision must be \"keep\" or \"offload\", got \"kept\""), 0);
  CHECK_EQ(line_fails(PACK_WITH("1", "[4]", "offlaod"),
                      "near.jsonl:3: decision must be \"keep\" or \"offload\", got \"offlaod\""), 0);
  CHECK_EQ(line_fails(PACK_WITH("1.5", "[4]", "keep"), "near.jsonl:3: \"id\" must be an integer, got 1.5"), 0);
  CHECK_EQ(line_fails(PACK_WITH("9007199254740994", "[4]", "keep"),
                      "near.jsonl:3: \"id\" = 9007199254740994 is absurd (allowed 1 .. 9007199254740992)"), 0);
  CHECK_EQ(line_fails(PACK_WITH("0", "[4]", "keep"),
                      "near.jsonl:3: \"id\" = 0 is too small (allowed 1 .. 9007199254740992)"), 0);
  static const char *const shapes[] = {"[4.5]", "[-1]", "[1e300]", "[9007199254740994]", "[\"4\"]"};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    snprintf(line, sizeof line, PACK_WITH("1", "%s", "keep"), shapes[i]);
    CHECK_EQ(line_fails(line, "near.jsonl:3: \"shape\"[0] must be a non-negative integer"), 0);
  }
  static const char *const flops[] = {"-1", "-1e-300", "1.0000001e21", "1e400", "\"1\""};
  for (size_t i = 0; i < sizeof flops / sizeof flops[0]; i++) {
    snprintf(line, sizeof line, "{\"ev\":\"compute\",\"t_us\":1,\"us\":1,\"flops\":%s}", flops[i]);
    CHECK_EQ(line_fails(line, "near.jsonl:3: \"flops\" must be a number within [0, 1e21]"), 0);
  }
  return 0;
}
