/* test_trace_fast_lines.c — the trace reader's first parser
 * (json_line_fast.c) against simdjson's: a line it takes, simdjson takes
 * too, with the same members, types, numbers (bit for bit) and strings; and
 * it does take the lines trace writers emit (else it would be no path). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

/* 1 taken (and read as simdjson reads it), 0 passed on, -1 read otherwise */
static int compare(sim_line_check *c, const char *s, size_t n) {
  int rc = sim_line_check_run(c, s, n, 64);
  if (rc < 0) fprintf(stderr, "  the fast parser read differently: %.*s\n", (int)(n > 200 ? 200 : n), s);
  return rc;
}

static int compare_str(sim_line_check *c, const char *s) { return compare(c, s, strlen(s)); }

/* Every line of a synthesized trace: taken, and read as simdjson reads it. */
TEST(trace_fast_parser_takes_written_lines) {
  synth_model m;
  synth_preset("tiny", &m);
  m.steps = 2;
  char *buf = NULL, err[256];
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  CHECK(out != NULL);
  CHECK_EQ(synth_write(&m, out, err, sizeof err), 0);
  fclose(out);
  sim_line_check *f = sim_line_check_new();
  CHECK(f != NULL);
  int lines = 0, taken = 0, wrong = 0;
  for (char *s = buf, *nl; (nl = memchr(s, '\n', len - (size_t)(s - buf))); s = nl + 1) {
    int rc = compare(f, s, (size_t)(nl - s));
    lines++;
    taken += rc == 1;
    wrong += rc < 0;
  }
  free(buf);
  sim_line_check_free(f);
  CHECK(lines > 100);
  CHECK_EQ(wrong, 0);
  CHECK_EQ(taken, lines);
  return 0;
}

/* Lines near what the fast parser takes: each is taken with simdjson's
 * reading or passed on, never read otherwise; the plain ones are taken. */
TEST(trace_fast_parser_agrees_or_passes_on) {
  static const char *const taken[] = {
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":33.587,\"flops\":6.87194767e+10}",
      "{\"ev\":\"pack\",\"bytes\":1E3,\"us\":1e-3,\"flops\":2.5E+2,\"t_us\":-0}",
      "{\"t_us\":-0.0,\"us\":0.1,\"flops\":0.3,\"id\":9007199254740993}",
      "{\"id\":999999999999999999,\"step\":-999999999999999999,\"us\":123456789.123456}",
      "{\"us\":900719925474099.2,\"flops\":9007199254740992e22,\"bytes\":1e-22}",
      " { \"ev\" : \"pack\" ,\t\"shape\" : [ 1 , 2.5 , \"x\" , true , null ] }\r",
      "{\"shape\":[],\"module\":\"a.b.c.d.e.f.g.h.i.j.k.l\",\"class\":\"\"}",
      "{\"shape\":[1,2,3,4,5,6,7,8,9,10,11,12],\"ev\":\"pack\"}",
      "{\"ev\":\"first\",\"ev\":\"second\",\"shape\":[1],\"shape\":[2,3]}",
      "{\"unknown\":[1,2],\"other\":\"x\",\"more\":false,\"ev\":\"header\"}",
      "{}",
  };
  static const char *const near[] = {
      "{\"module\":\"caf\xc3\xa9\"}", "{\"module\":\"a\\\"b\"}", "{\"module\":\"a\\u0041\"}",
      "{\"module\":\"tab\there\"}", "{\"id\":01}", "{\"id\":1.}", "{\"id\":.5}", "{\"id\":+1}",
      "{\"id\":1e}", "{\"id\":1e+}", "{\"id\":-}", "{\"id\":1.5e400}", "{\"id\":1e-400}",
      "{\"id\":12345678901234567890}", "{\"id\":18446744073709551616}",
      "{\"us\":1.2345678901234567890}", "{\"us\":1e23}", "{\"us\":9007199254740993.5}",
      "{\"us\":0.30000000000000004}",
      "{\"shape\":[[1]]}", "{\"shape\":[{}]}", "{\"x\":{}}", "{\"id\":1,}", "{,}",
      "{\"id\":1}x", "{\"id\":1}{}", "[1]", "\"x\"", "1", "{\"id\":tru}", "{\"id\":nul}",
      "{\"id\":truex}", "{\"id\" 1}", "{\"id\":}", "{\"id\":1", "{\"id", "{\"\\u0069d\":1}",
      "{\"id\":1\x01}", "\xef\xbb\xbf{\"id\":1}", "{\"id\":[1,]}", "{\"id\":[,1]}", "",
  };
  sim_line_check *f = sim_line_check_new();
  CHECK(f != NULL);
  for (size_t i = 0; i < sizeof taken / sizeof taken[0]; i++) {
    if (compare_str(f, taken[i]) != 1) fprintf(stderr, "  not taken: %s\n", taken[i]);
    CHECK_EQ(compare_str(f, taken[i]), 1);
  }
  for (size_t i = 0; i < sizeof near / sizeof near[0]; i++) CHECK(compare_str(f, near[i]) >= 0);
  /* depth: an array needs two levels, a flat object one */
  CHECK_EQ(sim_line_check_run(f, taken[5], strlen(taken[5]), 1), 0);
  CHECK_EQ(sim_line_check_run(f, taken[0], strlen(taken[0]), 1), 1);
  CHECK_EQ(sim_line_check_run(f, taken[0], strlen(taken[0]), 0), 0);
  sim_line_check_free(f);
  return 0;
}

/* Strings of every length around the 8-byte steps of the scan, with a stop
 * byte (quote, backslash, control, UTF-8) at every place, and very long
 * lines: the scan neither reads past the line nor misses a stop. */
TEST(trace_fast_parser_strings_of_every_length) {
  sim_line_check *f = sim_line_check_new();
  CHECK(f != NULL);
  static const char stops[] = {'"', '\\', '\x01', '\x1f', (char)0x80, (char)0xff, 'a'};
  char line[300];
  for (int len = 0; len < 40; len++)
    for (int at = 0; at <= len; at++)
      for (size_t k = 0; k < sizeof stops; k++) {
        int n = snprintf(line, sizeof line, "{\"module\":\"");
        for (int i = 0; i < len; i++) line[n++] = i == at ? stops[k] : (char)('a' + i % 26);
        n += snprintf(line + n, sizeof line - (size_t)n, "\",\"id\":%d}", len);
        /* the exact length: no terminator the scan could lean on */
        char *exact = malloc((size_t)n);
        CHECK(exact != NULL);
        memcpy(exact, line, (size_t)n);
        int rc = compare(f, exact, (size_t)n);
        free(exact);
        CHECK(rc >= 0);
        if (at == len || stops[k] == 'a') CHECK_EQ(rc, 1); /* no stop inside: taken */
      }
  size_t big = 1 << 20;
  char *longline = malloc(big + 64);
  CHECK(longline != NULL);
  int n = snprintf(longline, 64, "{\"module\":\"");
  memset(longline + n, 'x', big);
  n += (int)big;
  n += snprintf(longline + n, 64, "\",\"shape\":[1,2]}");
  CHECK_EQ(compare(f, longline, (size_t)n), 1);
  free(longline);
  sim_line_check_free(f);
  return 0;
}

/* Decimals of 1 to 20 digits, the point anywhere, exponents either side of
 * the fast range: each read bit for bit as simdjson reads it (correctly
 * rounded) or passed on; the short ones are taken. */
TEST(trace_fast_parser_numbers_read_exactly) {
  sim_line_check *f = sim_line_check_new();
  CHECK(f != NULL);
  uint64_t x = 88172645463325252ull; /* xorshift64 */
  int taken = 0, tried = 0;
  char line[128], digits[32];
  for (int i = 0; i < 200000; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    int nd = 1 + (int)(x % 20), point = (int)((x >> 8) % (uint64_t)(nd + 1));
    int exp10 = (int)((x >> 16) % 61) - 30, form = (int)((x >> 24) % 3);
    uint64_t y = x * 0x9E3779B97F4A7C15ull;
    for (int d = 0; d < nd; d++, y = y * 6364136223846793005ull + 1442695040888963407ull)
      digits[d] = (char)('0' + (y >> 60) % 10);
    if (digits[0] == '0' && nd > 1) digits[0] = '1';
    int n = snprintf(line, sizeof line, "{\"us\":%s", (x >> 32) & 1 ? "-" : "");
    if (point == 0 || point == nd) {
      n += snprintf(line + n, sizeof line - (size_t)n, "%.*s", nd, digits);
    } else {
      n += snprintf(line + n, sizeof line - (size_t)n, "%.*s.%.*s", point, digits, nd - point,
                    digits + point);
    }
    if (form) n += snprintf(line + n, sizeof line - (size_t)n, "%s%d", form == 1 ? "e" : "E", exp10);
    n += snprintf(line + n, sizeof line - (size_t)n, "}");
    int rc = compare(f, line, (size_t)n);
    CHECK(rc >= 0);
    tried++;
    taken += rc == 1;
  }
  CHECK(taken > tried / 4);
  sim_line_check_free(f);
  return 0;
}
