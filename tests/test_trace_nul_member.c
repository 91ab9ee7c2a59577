/* test_trace_nul_member.c — the member an escaped NUL (\u0000) is refused
 * in is the one whose value holds the string, however the line nests: an
 * object closed before the string (in an array, or at the top) does not
 * lend it its last member's name. */
#include <string.h>

#include "ferry_tools.h"
#include "test.h"

#define NUL_MEMBER_HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define NUL_MEMBER_BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"

/* line (the trace's third) refused as where holding the NUL at the column
 * of the line's "\u0000" text, counted here */
static int refused_as(const char *line, const char *where) {
  char text[1024], err[512] = "", want[512];
  snprintf(text, sizeof text, NUL_MEMBER_HDR NUL_MEMBER_BEGIN "%s\n", line);
  long col = (long)(strstr(line, "\\u0000") - line) + 1;
  snprintf(want, sizeof want, "nest.jsonl:3: %s holds an escaped NUL (\\u0000) at column %ld%s",
           where, col, where[0] == '"' ? ": a trace string cannot hold one" : "");
  sim_trace *t = NULL;
  int rc = sim_trace_parse("nest.jsonl", text, strlen(text), &t, err, sizeof err);
  sim_trace_free(t);
  if (rc == FERRY_EPARSE && !strcmp(err, want)) return 0;
  fprintf(stderr, "line %s\nexpected \"%s\"\n     got \"%s\" (rc %d)\n", line, want, err, rc);
  return 1;
}

TEST(sim_trace_escaped_nul_names_the_member_holding_it) {
  /* after an object inside the member's array: the array's member */
  CHECK_EQ(refused_as("{\"ev\":\"step_end\",\"t_us\":9,\"step\":1,\"extra\":[{\"k\":1},\"\\u0000\"]}",
                      "\"extra\""), 0);
  /* after a nested object's members: the outer member again */
  CHECK_EQ(refused_as("{\"ev\":\"step_end\",\"t_us\":9,\"step\":1,"
                      "\"extra\":[{\"k\":{\"deep\":\"x\"}},[\"y\"],\"\\u0000\"]}",
                      "\"extra\""), 0);
  /* inside an object in an array: that object's member */
  CHECK_EQ(refused_as("{\"ev\":\"step_end\",\"t_us\":9,\"step\":1,\"extra\":[{\"k\":\"\\u0000\"}]}",
                      "\"k\""), 0);
  /* a top-level array: after an object, no member holds it */
  CHECK_EQ(refused_as("[{\"k\":1},\"\\u0000\"]", "a string"), 0);
  /* a member's name after a closed object */
  CHECK_EQ(refused_as("{\"ev\":\"step_end\",\"run\":{\"k\":1},\"r\\u0000\":2}", "a member's name"), 0);
  /* deeper than the levels kept: the deepest member kept, never a wrong one */
  char deep[900] = "{\"outer\":";
  for (int i = 0; i < 70; i++) strcat(deep, "[");
  strcat(deep, "{\"k\":1},\"\\u0000\"");
  for (int i = 0; i < 70; i++) strcat(deep, "]");
  strcat(deep, "}");
  CHECK_EQ(refused_as(deep, "\"outer\""), 0);
  return 0;
}
