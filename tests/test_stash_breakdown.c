/* test_stash_breakdown.c — config.count_reasons: the saved tensors
 * counted by rule and layer. */
#include "test.h"
#include "test_device.h"
#include "test_stash_fixture.h"

/* ---- config.count_reasons: saved tensors by rule and layer -------------- */

typedef struct bd_rows {
  int n;
  char rule[8][64], where[8][64];
  ferry_breakdown_row row[8];
} bd_rows;

static void collect_row(void *ud, const ferry_breakdown_row *r) {
  bd_rows *b = ud;
  if (b->n >= 8) return;
  snprintf(b->rule[b->n], sizeof b->rule[0], "%s", r->rule);
  snprintf(b->where[b->n], sizeof b->where[0], "%s", r->where);
  b->row[b->n++] = *r;
}

/* the row of (rule, where, layer); fails the test when absent */
static const ferry_breakdown_row *bd_row(const bd_rows *b, const char *rule, const char *where,
                                         int layer) {
  for (int i = 0; i < b->n; i++)
    if (!strcmp(b->rule[i], rule) && !strcmp(b->where[i], where) && b->row[i].layer == layer)
      return &b->row[i];
  fprintf(stderr, "  no row (%s, %s, layer %d) among %d:\n", rule, where, layer, b->n);
  for (int i = 0; i < b->n; i++)
    fprintf(stderr, "    (%s, %s, layer %d)\n", b->rule[i], b->where[i], b->row[i].layer);
  return NULL;
}

#define CHECK_ROW(b, rule, where, layer, t_off, b_off, t_kept, b_kept)      \
  do {                                                                     \
    const ferry_breakdown_row *r_ = bd_row((b), (rule), (where), (layer)); \
    CHECK(r_ != NULL);                                                     \
    CHECK_EQ(r_->tensors_offloaded, (uint64_t)(t_off));                    \
    CHECK_EQ(r_->bytes_offloaded, (uint64_t)(b_off));                      \
    CHECK_EQ(r_->tensors_kept, (uint64_t)(t_kept));                        \
    CHECK_EQ(r_->bytes_kept, (uint64_t)(b_kept));                          \
  } while (0)

TEST(stash_breakdown_by_rule_and_layer) {
  enum { BIG = 8192, SMALL = 3000, TINY = 100 };
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.decide = NULL;
  c.policy_source = "local R = require 'ferry.rules'\n"
                    "return R.policy {\n"
                    "  R.when(function(t) return t.bytes >= 4096 end, { name = 'big' }),\n"
                    "  R.first_layers(2),\n"
                    "}\n";
  c.min_offload_bytes = 1024;
  c.max_fwd_stash = 0;
  c.host_cap_bytes = 3 * BIG; /* the fourth offload finds the arena full */
  c.count_reasons = 1;
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(ferry_step_begin(f.e));
  /* (bytes, layer): what the policy and the engine make of each */
  const struct { size_t bytes; int layer; } packs[] = {
      {BIG, 0}, {BIG, 1}, {BIG, 1}, /* offloaded: every rule passed */
      {BIG, 0},                     /* offload asked, the arena is full */
      {BIG, 5}, {BIG, 7},           /* first_layers(2) keeps */
      {SMALL, 0},                   /* the policy's 'big' keeps */
      {SMALL, 5},                   /* first_layers runs first (rule stages) */
      {TINY, 1},                    /* under min_offload_bytes: Lua is not asked */
  };
  enum { N = sizeof packs / sizeof packs[0] };
  ferry_handle hs[N];
  uint64_t sums[N];
  for (int i = 0; i < N; i++) {
    test_buffer *b = test_buffer_new(packs[i].bytes);
    fill(b, (uint64_t)i);
    sums[i] = dev_checksum(b->ptr, packs[i].bytes);
    ferry_tensor_desc d = desc_in_layer(packs[i].bytes, packs[i].layer);
    CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &hs[i]));
  }
  CHECK_OK(ferry_backward_begin(f.e));
  for (int i = N - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], packs[i].bytes, sums[i])) return 1;
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  bd_rows b = {0};
  CHECK_OK(ferry_get_breakdown(f.e, collect_row, &b));
  CHECK_EQ(b.n, 7);
  CHECK_ROW(&b, "all rules passed", "policy:2", 0, 1, BIG, 0, 0);
  CHECK_ROW(&b, "all rules passed", "policy:2", 1, 2, 2 * BIG, 0, 0);
  CHECK_ROW(&b, "host cap", "", 0, 0, 0, 1, BIG);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 5, 0, 0, 2, BIG + SMALL);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 7, 0, 0, 1, BIG);
  CHECK_ROW(&b, "when(big)", "policy:3", 0, 0, 0, 1, SMALL);
  CHECK_ROW(&b, "min_offload_bytes", "", 1, 0, 0, 1, TINY);
  /* a second step: the site cache answers, with the same reasons */
  CHECK_OK(ferry_step_begin(f.e));
  test_buffer *again = test_buffer_new(BIG);
  fill(again, 99);
  uint64_t sum = dev_checksum(again->ptr, BIG);
  ferry_tensor_desc d = desc_in_layer(BIG, 5);
  ferry_handle h;
  CHECK_OK(ferry_pack(f.e, &d, again->ptr, again, NULL, &h));
  if (unpack_check(&f, h, BIG, sum)) return 1;
  CHECK_OK(ferry_step_end(f.e));
  memset(&b, 0, sizeof b);
  CHECK_OK(ferry_get_breakdown(f.e, collect_row, &b));
  CHECK_EQ(b.n, 7);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 5, 0, 0, 3, 2 * BIG + SMALL);
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);

  /* without count_reasons: refused, naming the field */
  c = fixture_config(&f, 1);
  CHECK_OK(fixture_open(&f, &c));
  CHECK_EQ(ferry_get_breakdown(f.e, collect_row, &b), FERRY_ESTATE);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "config.count_reasons");
  ferry_engine_destroy(f.e);
  return 0;
}
