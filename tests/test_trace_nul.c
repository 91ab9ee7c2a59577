/* test_trace_nul.c — an escaped NUL (\u0000) in a trace line is refused
 * with the trace's file:line and where it is: the reader keeps strings as
 * C strings, which a NUL would cut short (a module path "a\u0000b" read as
 * "a"), so the line must not be taken. Other escapes still read. */
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"

#define NUL_HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define NUL_BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define NUL_END "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"
/* a pack whose module path is `module` (JSON text), then its unpack */
#define NUL_PACK(module)                                                                       \
  "{\"ev\":\"pack\",\"t_us\":1,\"id\":1,\"step\":1,\"bytes\":16,\"dtype\":\"f32\",\"shape\":[4]," \
  "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":2,"                    \
  "\"decision\":\"offload\",\"module\":\"" module "\"}\n"                                      \
  "{\"ev\":\"unpack\",\"t_us\":5,\"id\":1}\n"

/* The column (from 1) of the first "\u0000" text of the line (counted here,
 * apart from the reader's count). */
static long col_of(const char *line) { return (long)(strstr(line, "\\u0000") - line) + 1; }

/* text (its third line bad) must be refused with exactly want. */
static int refused(const char *text, const char *want) {
  sim_trace *t = NULL;
  char err[512] = "";
  int rc = sim_trace_parse("bad.jsonl", text, strlen(text), &t, err, sizeof err);
  if (rc != FERRY_EPARSE || t || strcmp(err, want)) {
    fprintf(stderr, "input:\n%s\nexpected \"%s\"\n     got \"%s\" (rc %d)\n", text, want, err, rc);
    if (t && t->n_tensors && t->tensors[0].desc.module_path)
      fprintf(stderr, "  (read module path \"%s\")\n", t->tensors[0].desc.module_path);
    sim_trace_free(t);
    return 1;
  }
  return 0;
}

/* The third line of text. */
static const char *line3(const char *text) {
  const char *p = text;
  for (int i = 0; i < 2; i++) p = strchr(p, '\n') + 1;
  return p;
}

TEST(sim_trace_reader_refuses_escaped_nul) {
  char want[512];
  /* in a module path: the member named, its column */
  const char *text = NUL_HDR NUL_BEGIN NUL_PACK("model.layers.0\\u0000.mlp") NUL_END;
  snprintf(want, sizeof want,
           "bad.jsonl:3: \"module\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
           "cannot hold one",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  /* at the start of a string, and in the event's name */
  text = NUL_HDR NUL_BEGIN NUL_PACK("\\u0000") NUL_END;
  snprintf(want, sizeof want,
           "bad.jsonl:3: \"module\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
           "cannot hold one",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  text = NUL_HDR NUL_BEGIN "{\"ev\":\"step_end\\u0000\",\"t_us\":9,\"step\":1}\n";
  snprintf(want, sizeof want,
           "bad.jsonl:3: \"ev\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
           "cannot hold one",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  /* in a shape's string item: the array's member */
  text = NUL_HDR NUL_BEGIN
      "{\"ev\":\"pack\",\"t_us\":1,\"id\":1,\"step\":1,\"bytes\":16,\"shape\":[\"\\u0000\"]}\n";
  snprintf(want, sizeof want,
           "bad.jsonl:3: \"shape\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
           "cannot hold one",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  /* in a member's name, and in a string outside any member */
  text = NUL_HDR NUL_BEGIN "{\"ev\":\"step_end\",\"t_us\":9,\"st\\u0000ep\":1}\n";
  snprintf(want, sizeof want, "bad.jsonl:3: a member's name holds an escaped NUL (\\u0000) at column %ld",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  text = NUL_HDR NUL_BEGIN "[\"\\u0000\"]\n";
  snprintf(want, sizeof want, "bad.jsonl:3: a string holds an escaped NUL (\\u0000) at column %ld",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  /* on a line only cJSON reads (text that is not UTF-8) */
  text = NUL_HDR NUL_BEGIN NUL_PACK("m\xff\\u0000") NUL_END;
  snprintf(want, sizeof want,
           "bad.jsonl:3: \"module\" holds an escaped NUL (\\u0000) at column %ld: a trace string "
           "cannot hold one",
           col_of(line3(text)));
  CHECK_EQ(refused(text, want), 0);
  return 0;
}

/* sim_trace_load (the file, read in blocks) refuses it the same way, named
 * by the file's path. */
TEST(sim_trace_load_refuses_escaped_nul) {
  const char *text = NUL_HDR NUL_BEGIN NUL_PACK("a\\u0000b") NUL_END;
  char path[] = "/tmp/ferry-test-nul-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK_EQ(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
  sim_trace *t = NULL;
  char err[1024] = "", want[1024];
  int rc = sim_trace_load(path, &t, err, sizeof err);
  unlink(path);
  snprintf(want, sizeof want,
           "%s:3: \"module\" holds an escaped NUL (\\u0000) at column %ld: a trace string cannot "
           "hold one",
           path, col_of(line3(text)));
  if (strcmp(err, want)) fprintf(stderr, "expected \"%s\"\n     got \"%s\"\n", want, err);
  CHECK_EQ(rc, FERRY_EPARSE);
  CHECK(t == NULL);
  CHECK(strcmp(err, want) == 0);
  return 0;
}

/* Other escapes read as before: \u0041 is "A"; an escaped backslash before
 * "u0000" is that text, no NUL. */
TEST(sim_trace_reader_takes_other_escapes) {
  static const struct {
    const char *json, *read;
  } cases[] = {
      {"a\\u0041b", "aAb"},
      {"a\\\\u0000b", "a\\u0000b"},
      {"\\\"q\\\"\\u0000x", NULL}, /* a NUL after other escapes: refused */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[1024];
    snprintf(text, sizeof text,
             NUL_HDR NUL_BEGIN
             "{\"ev\":\"pack\",\"t_us\":1,\"id\":1,\"step\":1,\"bytes\":16,\"dtype\":\"f32\","
             "\"shape\":[4],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"
             "\"layers\":2,\"decision\":\"offload\",\"module\":\"%s\"}\n"
             "{\"ev\":\"unpack\",\"t_us\":5,\"id\":1}\n" NUL_END,
             cases[i].json);
    sim_trace *t = NULL;
    char err[512] = "";
    int rc = sim_trace_parse("ok.jsonl", text, strlen(text), &t, err, sizeof err);
    if (!cases[i].read) {
      CHECK_EQ(rc, FERRY_EPARSE);
      CHECK(strstr(err, "ok.jsonl:3: \"module\" holds an escaped NUL") == err);
      continue;
    }
    if (rc) fprintf(stderr, "%s: %s\n", cases[i].json, err);
    CHECK_OK(rc);
    CHECK_EQ(t->n_tensors, 1);
    CHECK(strcmp(t->tensors[0].desc.module_path, cases[i].read) == 0);
    sim_trace_free(t);
  }
  return 0;
}
