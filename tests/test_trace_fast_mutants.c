/* test_trace_fast_mutants.c — the trace reader's first parser
 * (json_line_fast.c) against simdjson on lines near the ones trace writers
 * emit: every line of a synthesized trace and lines that name every member
 * the reader knows, each mutated many times (a byte replaced, inserted or
 * dropped by bytes that matter to JSON, a member name's letter changed, the
 * line cut short). Each mutant is taken with simdjson's reading or passed
 * on, never read otherwise. FERRY_FAST_MUTANTS sets how many (default
 * 300,000; a longer run: 10,000,000). */
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

/* Lines that give every member json_line.h names, some twice. */
static const char *const every_member[] = {
    "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":2,\"backend\":\"synth\"}",
    "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2007566336,\"what\":\"parameters\",\"dtype\":\"bf16\","
    "\"layer_bytes\":54528000,\"transient\":true}",
    "{\"ev\":\"pack\",\"t_us\":12.5,\"id\":10,\"step\":1,\"bytes\":67108864,\"dtype\":\"bf16\","
    "\"shape\":[8192,4096],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":32,"
    "\"flags\":2,\"module\":\"model.layers.0.self_attn.k_proj\",\"class\":\"Linear\","
    "\"decision\":\"keep\",\"alias\":true,\"alias_of\":8}",
    "{\"ev\":\"compute\",\"t_us\":0,\"us\":687.195,\"flops\":2.74877907e+11,\"hbm_bytes\":167772160,"
    "\"min_us\":4,\"layer\":0,\"op\":\"self_attn.q_proj\"}",
    "{\"ev\":\"collective\",\"t_us\":0,\"id\":1,\"op\":\"all_gather\",\"bytes\":436224000,\"ranks\":8,"
    "\"what\":\"shard\",\"layer\":0,\"layer\":1,\"layers\":-0,\"flops\":1E-3}",
    "{\"layer_bytesX\":1,\"hbm_byte\":2,\"transients\":3,\"decisions\":4,\"alias_o\":5,\"layer_byte\":6}",
};

/* Bytes a mutation puts in: JSON's punctuation, digits and letters of its
 * literals, whitespace, and the bytes this parser passes on. */
static const char alphabet[] = "\"\\:,{}[] \t\r\n0123456789-+.eEtrufalsn_xyz\x01\x1f\x7f\x80\xc3\xff";

static uint64_t next(uint64_t *x) {
  *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
  return *x;
}

/* One mutant of line (n bytes) into out (room for n + 8); its length. */
static size_t mutate(const char *line, size_t n, char *out, uint64_t *rng) {
  memcpy(out, line, n);
  int edits = 1 + (int)(next(rng) % 3);
  for (int k = 0; k < edits && n > 0; k++) {
    size_t at = (size_t)(next(rng) % n);
    char c = alphabet[next(rng) % (sizeof alphabet - 1)];
    switch (next(rng) % 6) {
    case 0: case 1: out[at] = c; break; /* replace */
    case 2: /* insert */
      memmove(out + at + 1, out + at, n - at);
      out[at] = c;
      n++;
      break;
    case 3: /* drop */
      memmove(out + at, out + at + 1, n - at - 1);
      n--;
      break;
    case 4: { /* a letter of a member name: the one after the nearest '{' or ',"' */
      const char *q = memchr(out + at, '"', n - at);
      if (q && (size_t)(q - out) + 2 < n) out[q - out + 1 + (int)(next(rng) % 2)] ^= (char)(1 << (next(rng) % 6));
      break;
    }
    default: n = at; break; /* cut short */
    }
  }
  return n;
}

TEST(trace_fast_parser_mutants_read_as_simdjson_reads) {
  synth_model m;
  synth_preset("tiny", &m);
  m.steps = 1;
  char *buf = NULL, err[256];
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  CHECK(f != NULL);
  CHECK_EQ(synth_write(&m, f, err, sizeof err), 0);
  for (size_t i = 0; i < sizeof every_member / sizeof every_member[0]; i++)
    fprintf(f, "%s\n", every_member[i]);
  fclose(f);
  /* the lines, each once */
  const char *lines[4096];
  size_t lens[4096], n_lines = 0;
  for (char *s = buf, *nl; n_lines < 4096 && (nl = memchr(s, '\n', len - (size_t)(s - buf)));
       s = nl + 1) {
    lines[n_lines] = s;
    lens[n_lines++] = (size_t)(nl - s);
  }
  CHECK(n_lines > 100);
  const char *env = getenv("FERRY_FAST_MUTANTS");
  long mutants = env && atol(env) > 0 ? atol(env) : 300000;
  sim_line_check *c = sim_line_check_new();
  CHECK(c != NULL);
  uint64_t rng = 0x2545F4914F6CDD1Dull;
  long taken = 0, passed = 0, wrong = 0;
  char *out = malloc(1 << 16);
  CHECK(out != NULL);
  for (long i = 0; i < mutants; i++) {
    /* the member lines a third of the time: they hold the rare names */
    size_t k = next(&rng) % 3 == 0 ? n_lines - 1 - next(&rng) % (sizeof every_member / sizeof every_member[0])
                                    : next(&rng) % n_lines;
    if (lens[k] + 8 > (1 << 16)) continue;
    size_t n = mutate(lines[k], lens[k], out, &rng);
    /* the exact length in its own block: a read past it is ASan's to see */
    char *exact = malloc(n ? n : 1);
    CHECK(exact != NULL);
    memcpy(exact, out, n);
    int rc = sim_line_check_run(c, exact, n, 1 + (int)(i % 3));
    if (rc < 0 && wrong++ < 5) fprintf(stderr, "  read otherwise: %.*s\n", (int)(n > 300 ? 300 : n), exact);
    free(exact);
    taken += rc == 1;
    passed += rc == 0;
  }
  free(out);
  free(buf);
  sim_line_check_free(c);
  CHECK_EQ(wrong, 0);
  /* both outcomes were met often: the mutants are near the line, not noise */
  CHECK(taken > mutants / 10);
  CHECK(passed > mutants / 10);
  return 0;
}

/* Every member name, alone and with one letter changed, added or dropped:
 * the key each is read as is simdjson's reading's. */
TEST(trace_fast_parser_member_names_exactly) {
  static const char *const names[] = {
      "ev", "t_us", "id", "step", "bytes", "dtype", "shape", "kind", "phase", "layer",
      "layers", "flags", "module", "class", "decision", "alias", "alias_of", "flops", "us",
      "op", "format", "version", "backend", "what", "hbm_bytes", "min_us", "layer_bytes",
      "transient", "ranks"};
  sim_line_check *c = sim_line_check_new();
  CHECK(c != NULL);
  char line[128], name[32];
  int taken = 0;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    size_t n = strlen(names[i]);
    for (size_t at = 0; at <= n; at++)
      for (int how = 0; how < 4; how++) {
        memcpy(name, names[i], n + 1);
        if (how == 1 && at < n) name[at] ^= 0x20; /* a letter's case */
        if (how == 2) { /* a letter added */
          memmove(name + at + 1, name + at, n - at + 1);
          name[at] = 's';
        }
        if (how == 3 && at < n) memmove(name + at, name + at + 1, n - at); /* dropped */
        int len = snprintf(line, sizeof line, "{\"%s\":7,\"%s\":\"x\"}", name, names[(i + 1) % 29]);
        int rc = sim_line_check_run(c, line, (size_t)len, 4);
        if (rc != 1) fprintf(stderr, "  %s: %d\n", line, rc);
        CHECK_EQ(rc, 1);
        taken++;
      }
  }
  sim_line_check_free(c);
  CHECK(taken > 29 * 4);
  return 0;
}
