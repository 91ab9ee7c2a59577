/* test_sim.c — the dry-run simulator: the sim backend's clock and link
 * model against hand-computed times, the trace reader's errors, the
 * synthesizer against Korthikanti et al.'s formula, replays with known
 * answers, and the consistency of the sim with the host backend. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test_device.h"
#include <valgrind/valgrind.h>

#include "test.h"
#include "test_four_offloads.h"
#include "test_synth.h"

/* ---- the sim backend alone ------------------------------------------------------- */
static ferry_backend *make_sim(double bytes_per_s, double latency_us, double duplex) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = FERRY_BACKEND_SIM;
  c.arena = FERRY_ARENA_POOL;
  c.link.d2h_bytes_per_s = c.link.h2d_bytes_per_s = bytes_per_s;
  c.link.latency_us = latency_us;
  c.link.duplex = duplex;
  ferry_backend *b = NULL;
  char err[256];
  if (ferry_backend_sim_create(&c, &b, err, sizeof err)) fprintf(stderr, "%s\n", err);
  return b;
}

static char fake_dev[16], fake_host[16]; /* never dereferenced by the sim */

TEST(sim_copy_takes_latency_plus_bytes_over_bandwidth) {
  ferry_backend *b = make_sim(1e9, 5.0, 1.0); /* 1000 bytes per us */
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  bk_stream s;
  bk_event *ev;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->copy_d2h(b, fake_host, fake_dev, 100000, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_EQ(o->event_query(b, ev), 0); /* clock at 0: not done */
  sim_backend_advance(b, 104.0);
  CHECK_EQ(o->event_query(b, ev), 0); /* 5 + 100 us */
  sim_backend_advance(b, 1.0);
  CHECK_EQ(o->event_query(b, ev), 1);
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  CHECK_EQ(st.copies[0], 1);
  CHECK_EQ(st.bytes[0], 100000);
  CHECK_NEAR(st.busy_us[0], 105.0, 1e-6);
  CHECK_NEAR(st.stall_us, 0, 0);
  o->event_destroy(b, ev);
  o->stream_destroy(b, s);
  o->destroy(b);
  return 0;
}

/* Both directions at once: each runs at duplex x bandwidth while the other
 * is busy, at full bandwidth after. */
TEST(sim_duplex_slows_both_directions_exactly) {
  ferry_backend *b = make_sim(1e9, 0.0, 0.5);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  bk_stream d2h, h2d;
  bk_event *e1, *e2;
  CHECK_OK(o->stream_create(b, &d2h));
  CHECK_OK(o->stream_create(b, &h2d));
  CHECK_OK(o->event_create(b, &e1));
  CHECK_OK(o->event_create(b, &e2));
  CHECK_OK(o->copy_d2h(b, fake_host, fake_dev, 1000000, d2h)); /* 1000 us alone */
  CHECK_OK(o->copy_h2d(b, fake_dev, fake_host, 500000, h2d));  /* 500 us alone */
  CHECK_OK(o->event_record(b, e1, d2h));
  CHECK_OK(o->event_record(b, e2, h2d));
  /* both at 500 B/us: H2D ends at 1000; D2H has 500000 left, at 1000 B/us: 1500 */
  CHECK_OK(o->event_synchronize(b, e2));
  CHECK_NEAR(sim_backend_now(b), 1000.0, 1e-6);
  CHECK_EQ(o->event_query(b, e1), 0);
  CHECK_OK(o->stream_wait_event(b, NULL, e1)); /* the compute stream waits: a stall */
  CHECK_NEAR(sim_backend_now(b), 1500.0, 1e-6);
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  CHECK_NEAR(st.host_wait_us, 1000.0, 1e-6);
  CHECK_NEAR(st.stall_us, 500.0, 1e-6);
  /* per-direction factors: D2H keeps 0.9, H2D gets 0.1 */
  CHECK_OK(sim_backend_set_duplex(b, 0.9, 0.1));
  CHECK_OK(o->copy_d2h(b, fake_host, fake_dev, 90000, d2h));  /* 100 us at 900 B/us */
  CHECK_OK(o->copy_h2d(b, fake_dev, fake_host, 200000, h2d)); /* 10000 B in 100 us, then 190 us */
  CHECK_OK(o->event_record(b, e1, d2h));
  CHECK_OK(o->event_record(b, e2, h2d));
  CHECK_OK(o->event_synchronize(b, e1));
  CHECK_NEAR(sim_backend_now(b), 1600.0, 1e-6);
  CHECK_OK(o->event_synchronize(b, e2));
  CHECK_NEAR(sim_backend_now(b), 1790.0, 1e-6);
  CHECK_RC(sim_backend_set_duplex(b, 0, 1), FERRY_EINVAL);
  o->event_destroy(b, e1);
  o->event_destroy(b, e2);
  o->stream_destroy(b, d2h);
  o->stream_destroy(b, h2d);
  o->destroy(b);
  return 0;
}

/* A wait that completes on a stream later in the backend's list lets an
 * earlier stream go at that instant: A copies (0..100 us), B waits for it,
 * A then waits for B and copies again: 100..200 us. (The link used to skip
 * ahead to the next look before noticing A could go: 150..250.) */
TEST(sim_wait_on_a_later_stream_starts_at_once) {
  ferry_backend *b = make_sim(1e9, 0.0, 1.0); /* 1000 bytes per us */
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  bk_stream a, s2;
  bk_event *ea, *eb, *done;
  CHECK_OK(o->stream_create(b, &a));
  CHECK_OK(o->stream_create(b, &s2));
  CHECK_OK(o->event_create(b, &ea));
  CHECK_OK(o->event_create(b, &eb));
  CHECK_OK(o->event_create(b, &done));
  CHECK_OK(o->copy_d2h(b, fake_host, fake_dev, 100000, a));
  CHECK_OK(o->event_record(b, ea, a));
  CHECK_OK(o->stream_wait_event(b, s2, ea));
  CHECK_OK(o->event_record(b, eb, s2));
  CHECK_OK(o->stream_wait_event(b, a, eb));
  CHECK_OK(o->copy_d2h(b, fake_host, fake_dev, 100000, a));
  CHECK_OK(o->event_record(b, done, a));
  sim_backend_advance(b, 150.0);
  CHECK_EQ(o->event_query(b, eb), 1);
  CHECK_EQ(o->event_query(b, done), 0);
  sim_backend_advance(b, 50.0);
  CHECK_EQ(o->event_query(b, done), 1);
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  CHECK_NEAR(st.busy_us[0], 200.0, 1e-6);
  o->event_destroy(b, ea);
  o->event_destroy(b, eb);
  o->event_destroy(b, done);
  o->stream_destroy(b, s2);
  o->stream_destroy(b, a);
  o->destroy(b);
  return 0;
}

TEST(sim_stream_waits_for_compute_event) {
  ferry_backend *b = make_sim(1e9, 0.0, 1.0);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  bk_stream s;
  bk_event *at_compute, *done, *never;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(o->event_create(b, &at_compute));
  CHECK_OK(o->event_create(b, &done));
  CHECK_OK(o->event_create(b, &never));
  CHECK_EQ(o->event_query(b, never), 1); /* never recorded = complete */
  sim_backend_advance(b, 250.0);
  CHECK_OK(o->event_record(b, at_compute, NULL)); /* compute work so far: ends now */
  CHECK_EQ(o->event_query(b, at_compute), 1);
  CHECK_OK(o->stream_wait_event(b, s, at_compute));
  CHECK_OK(o->copy_h2d(b, fake_dev, fake_host, 10000, s));
  CHECK_OK(o->event_record(b, done, s));
  CHECK_OK(o->event_synchronize(b, done));
  CHECK_NEAR(sim_backend_now(b), 260.0, 1e-6); /* started at 250, not 0 */
  /* a copy needs an engine stream; events are checked */
  CHECK_RC(o->copy_d2h(b, fake_host, fake_dev, 10, NULL), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "engine stream");
  CHECK_RC(o->event_query(b, (bk_event *)fake_dev), FERRY_EINVAL);
  o->event_destroy(b, at_compute);
  o->event_destroy(b, done);
  o->event_destroy(b, never);
  o->stream_destroy(b, s);
  o->destroy(b);
  return 0;
}

/* Host memory is address space only: a 64 GiB "pinned" allocation costs
 * nothing, and the jemalloc arena (which may touch it) is refused. */
TEST(sim_host_memory_is_address_space_only) {
  ferry_backend *b = make_sim(1e9, 0, 1);
  CHECK(b);
  void *p = NULL;
  /* valgrind caps a process's address space well below 64 GiB */
  const size_t big = RUNNING_ON_VALGRIND ? (size_t)1 << 30 : (size_t)64 << 30;
  CHECK_OK(b->ops->host_alloc(b, big, 2 << 20, &p));
  CHECK(p && ((uintptr_t)p & ((2 << 20) - 1)) == 0);
  sim_backend_stats st;
  sim_backend_get_stats(b, &st);
  CHECK_EQ(st.host_reserved_bytes, (uint64_t)big);
  CHECK_OK(b->ops->host_free(b, p, big));
  CHECK_RC(b->ops->host_alloc(b, 4096, 3, &p), FERRY_EINVAL);
  b->ops->destroy(b);

  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = FERRY_BACKEND_SIM;
  c.arena = FERRY_ARENA_JEMALLOC;
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  char err[256] = "";
  ferry_engine *e = NULL;
  CHECK_RC(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "pool arena");
  c.arena = FERRY_ARENA_AUTO; /* AUTO picks the pool for the sim backend */
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  CHECK(strcmp(ferry_arena_name(e), "pool") == 0);
  ferry_engine_destroy(e);
  return 0;
}

/* ---- the trace reader ---------------------------------------------------------- */
#define HDR "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":1}\n"
#define PACK(id, bytes)                                                                  \
  "{\"ev\":\"pack\",\"t_us\":1,\"id\":" #id ",\"step\":1,\"bytes\":" #bytes              \
  ",\"dtype\":\"f32\",\"shape\":[4],\"kind\":\"activation\",\"phase\":\"forward\","      \
  "\"layer\":0,\"layers\":2,\"decision\":\"offload\"}\n"
#define BEGIN "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1}\n"
#define END "{\"ev\":\"step_end\",\"t_us\":9,\"step\":1}\n"
#define UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":5,\"id\":" #id "}\n"

static int expect_parse_error(const char *text, size_t len, const char *want) {
  sim_trace *t = NULL;
  char err[512] = "";
  int rc = sim_trace_parse("bad.jsonl", text, len, &t, err, sizeof err);
  if (rc != FERRY_EPARSE || t || !strstr(err, want)) {
    fprintf(stderr, "input:\n%.*s\nexpected error containing \"%s\", got rc %d \"%s\"\n",
            (int)len, text, want, rc, err);
    sim_trace_free(t);
    return 1;
  }
  return 0;
}
#define BAD(text, want) CHECK_EQ(expect_parse_error(text, strlen(text), want), 0)

/* The whole message, every number in it: blank lines (skipped by the
 * reader) still count as lines, in the error's own line and in the line it
 * points back to. */
static int expect_exact_error(const char *text, const char *want) {
  sim_trace *t = NULL;
  char err[512] = "";
  int rc = sim_trace_parse("bad.jsonl", text, strlen(text), &t, err, sizeof err);
  if (rc != FERRY_EPARSE || t || strcmp(err, want) != 0) {
    fprintf(stderr, "input:\n%s\nexpected \"%s\"\n     got \"%s\" (rc %d)\n", text, want, err, rc);
    sim_trace_free(t);
    return 1;
  }
  return 0;
}
#define EXACT(text, want) CHECK_EQ(expect_exact_error(text, want), 0)

TEST(sim_trace_errors_full_text_after_blank_lines) {
  EXACT("\n" HDR "\n\n" BEGIN "\n" PACK(3, 16) "\n\n" PACK(3, 16) END,
        "bad.jsonl:10: id 3 packed twice (first at line 7)");
  EXACT(HDR "\n" BEGIN PACK(4, 16) "\n" UNPACK(4) "\n\n\n" UNPACK(4) END,
        "bad.jsonl:10: unpack of id 4, which was already unpacked or discarded (line 4 packed "
        "it)");
  EXACT(HDR BEGIN "\n\n" PACK(5, 16) PACK(6, 16) UNPACK(6) "\n" END,
        "bad.jsonl:9: step 1 ends with 1 id(s) neither unpacked nor discarded (first: id 5 "
        "packed at line 5)");
  EXACT("\n\n\n" BEGIN, "bad.jsonl:4: the first line must be the header "
                         "({\"ev\":\"header\",...}), got \"step_begin\"");
  EXACT(HDR "\n\n" BEGIN "\n" "{\"ev\":\"fly\",\"t_us\":1}\n" END,
        "bad.jsonl:6: unknown event \"fly\"");
  EXACT(HDR BEGIN "\n\n\n" PACK(1, -16) END, "bad.jsonl:6: \"bytes\" = -16 is negative "
                                                "(allowed 1 .. 1125899906842624)");
  return 0;
}

TEST(sim_trace_reader_names_line_and_problem) {
  BAD("", "bad.jsonl: empty trace");
  BAD("\n\n", "bad.jsonl: empty trace");
  BAD(HDR BEGIN "{\"ev\":\"pack\",\n", "bad.jsonl:3: malformed JSON");
  BAD(HDR BEGIN "{\"ev\":\"fly\",\"t_us\":1}\n" END, "bad.jsonl:3: unknown event \"fly\"");
  /* events are told apart by first letter first: near misses and the empty name */
  BAD(HDR BEGIN "{\"ev\":\"packs\",\"t_us\":1}\n" END, "bad.jsonl:3: unknown event \"packs\"");
  BAD(HDR BEGIN "{\"ev\":\"step_middle\",\"t_us\":1}\n" END,
      "bad.jsonl:3: unknown event \"step_middle\"");
  BAD(HDR BEGIN "{\"ev\":\"\",\"t_us\":1}\n" END, "bad.jsonl:3: unknown event \"\"");
  BAD(HDR BEGIN HDR END, "bad.jsonl:3: a second header");
  BAD(HDR BEGIN UNPACK(7) END, "bad.jsonl:3: unpack of id 7 before its pack");
  BAD(HDR BEGIN PACK(1, 16) UNPACK(1) UNPACK(1) END, "bad.jsonl:5: unpack of id 1, which was already");
  BAD(HDR BEGIN PACK(1, -16) END, "bad.jsonl:3: \"bytes\" = -16 is negative");
  BAD(HDR BEGIN PACK(1, 0) END, "bad.jsonl:3: \"bytes\" = 0 is too small");
  BAD(HDR BEGIN PACK(1, 4000000000000000) END, "bad.jsonl:3: \"bytes\" = 4000000000000000 is absurd");
  BAD(HDR BEGIN PACK(1, 16) UNPACK(1) "{\"ev\":\"step_end\",\"t_us\":9,\"st", "bad.jsonl:5: truncated");
  BAD(HDR BEGIN PACK(1, 16) UNPACK(1), "bad.jsonl: truncated: ends inside step 1");
  BAD(HDR BEGIN PACK(1, 16) END, "bad.jsonl:4: step 1 ends with 1 id(s) neither unpacked");
  BAD(BEGIN END, "bad.jsonl:1: the first line must be the header");
  BAD(HDR PACK(1, 16), "bad.jsonl:2: pack outside a step");
  BAD(HDR BEGIN PACK(1, 16) PACK(1, 16), "bad.jsonl:4: id 1 packed twice");
  BAD(HDR "{\"ev\":\"step_begin\",\"t_us\":5,\"step\":1}\n{\"ev\":\"step_end\",\"t_us\":4,\"step\":1}\n",
      "bad.jsonl:3: t_us 4.0 goes back in time");
  BAD("{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":3}\n",
      "version 3 is newer than this reader (2)");
  BAD(HDR "[1,2]\n", "bad.jsonl:2: a line must be a JSON object");
  BAD(HDR BEGIN "{\"ev\":\"compute\",\"t_us\":0,\"us\":-3}\n" END, "bad.jsonl:3: \"us\" must be");
  BAD(HDR BEGIN "{\"ev\":\"compute\",\"t_us\":0,\"us\":3,\"hbm_bytes\":-1}\n" END,
      "bad.jsonl:3: \"hbm_bytes\" must be");
  BAD(HDR BEGIN "{\"ev\":\"compute\",\"t_us\":0,\"us\":3,\"min_us\":\"4\"}\n" END,
      "bad.jsonl:3: \"min_us\" must be");
  /* a NUL byte inside a line */
  static const char nul[] = HDR "{\"ev\":\"step_begin\"\0,\"t_us\":0}\n";
  CHECK_EQ(expect_parse_error(nul, sizeof nul - 1, "bad.jsonl:2: a NUL byte"), 0);

  /* a good one, with an alias, a discard and compute */
  const char *good = HDR
      "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"parameters\"}\n" BEGIN PACK(1, 16)
      "{\"ev\":\"pack\",\"t_us\":1,\"id\":2,\"step\":1,\"bytes\":16,\"dtype\":\"f32\",\"shape\":[4],"
      "\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,\"layers\":2,"
      "\"decision\":\"offload\",\"alias\":true}\n"
      "{\"ev\":\"compute\",\"t_us\":1,\"us\":7}\n" UNPACK(2) UNPACK(1) END;
  sim_trace *t = NULL;
  char err[256];
  CHECK_OK(sim_trace_parse("good", good, strlen(good), &t, err, sizeof err));
  CHECK_EQ(t->n_steps, 1);
  CHECK_EQ(t->n_tensors, 2);
  CHECK_EQ(t->tensors[1].alias_of, 0);
  CHECK_EQ(t->resident_bytes, 1000);
  CHECK(t->has_compute);
  sim_trace_free(t);
  CHECK_RC(sim_trace_load("/nonexistent/trace.jsonl", &t, err, sizeof err), FERRY_EIO);
  CHECK_STR_CONTAINS(err, "/nonexistent/trace.jsonl: cannot open");
  return 0;
}

/* The hand-computed runs' link: 1 GB/s each way (1000 us per MB), no
 * latency, no duplex slowdown; `steps` steps. */
static sim_config hand_config(int steps) {
  sim_config c = {0};
  c.link = (ferry_link){1e9, 1e9, 0, 1.0};
  c.steps = steps;
  return c;
}

/* Transient device memory ("alloc" .. "free", docs/trace-format.md): the
 * reader's errors, and on replay the bytes count on the device for exactly
 * their lifetime while no policy can offload them. */
#define ALLOC(id, bytes) "{\"ev\":\"alloc\",\"t_us\":0,\"id\":" #id ",\"bytes\":" #bytes ",\"what\":\"logits\"}\n"
#define FREE(id) "{\"ev\":\"free\",\"t_us\":0,\"id\":" #id "}\n"
TEST(sim_trace_transient_alloc_and_free) {
  BAD(HDR ALLOC(1, 64) BEGIN END, "bad.jsonl:2: alloc outside a step");
  BAD(HDR BEGIN FREE(3) END, "bad.jsonl:3: free of id 3 before its alloc");
  BAD(HDR BEGIN ALLOC(3, 64) FREE(3) FREE(3) END, "bad.jsonl:5: free of id 3, which was already freed (line 3");
  BAD(HDR BEGIN ALLOC(3, 64) ALLOC(3, 64) END, "bad.jsonl:4: alloc id 3 given twice (first at line 3)");
  BAD(HDR BEGIN ALLOC(3, 64) END, "bad.jsonl:4: step 1 ends with 1 alloc(s) not freed (first: id 3 at line 3)");
  BAD(HDR BEGIN ALLOC(3, 0) END, "bad.jsonl:3: \"bytes\" = 0 is too small");
  BAD(HDR BEGIN "{\"ev\":\"alloc\",\"t_us\":1,\"id\":1,\"bytes\":8}\n" END,
      "bad.jsonl:3: missing member \"what\"");
  /* a 100000-byte pack (offloaded) beside a 300000-byte transient (alloc
   * ids are apart from pack ids: 1 is both) */
  const char *text = HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"parameters\"}\n" BEGIN
      "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","
      "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"
      "\"layers\":1,\"decision\":\"offload\"}\n"
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n" ALLOC(1, 300000)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n" FREE(1)
      "{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n"
      "{\"ev\":\"unpack\",\"t_us\":0,\"id\":1}\n{\"ev\":\"backward_end\",\"t_us\":0}\n" END;
  sim_trace *t = NULL;
  char err[512];
  int prc = sim_trace_parse("transient", text, strlen(text), &t, err, sizeof err);
  if (prc) fprintf(stderr, "%s\n", err);
  CHECK_OK(prc);
  CHECK_EQ(t->n_allocs, 1);
  CHECK_EQ(t->allocs[0].bytes, 300000);
  CHECK_STR_CONTAINS(t->allocs[0].what, "logits");
  CHECK_EQ(t->n_tensors, 1);
  sim_config c = hand_config(1);
  c.timeline = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err)); /* no offload */
  CHECK_EQ(r.peak_saved_bytes, 400000);
  CHECK_EQ(r.peak_device_bytes, 401000);
  /* the memory curve: the transient's bytes from 100 us to 200 us */
  uint64_t at150 = 0, last = 1;
  for (size_t i = 0; i < r.tl.n_mem; i++) {
    if (r.tl.mem[i].t - r.tl.t_begin <= 150) at150 = r.tl.mem[i].bytes;
    last = r.tl.mem[i].bytes;
  }
  CHECK_EQ(at150, 401000);
  CHECK_EQ(last, 1000);
  sim_result_free(&r);
  c.replay_decisions = 1; /* the pack offloaded; the transient never crosses */
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.bytes_d2h, 100000, 0);
  CHECK_EQ(r.tensors_offloaded, 1);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* An engine with no policy recording its trace into a fresh temporary file,
 * whose name goes to path (at least 32 bytes): 0, or 1 (a test failure). */
static int recording_engine(test_device_stats *st, char *path, ferry_engine **e) {
  ferry_config c = test_engine_config(st);
  c.decide = NULL;
  snprintf(path, 32, "/tmp/ferry-trace-XXXXXX");
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.trace_path = path;
  char err[512];
  *e = NULL;
  CHECK_OK(ferry_engine_create(&c, e, err, sizeof err));
  return 0;
}

/* "device_peak" (ferry_trace_device_peak): the trainer's own peak of a
 * step, after it. The writer refuses it inside a step; the reader keeps the
 * largest and refuses one inside a step or for another step than the last
 * ended. sim_untracked_bytes: that peak less the peak of the recorded
 * decisions replayed (resident 1000 B + a kept 100000 B tensor = 101000 B),
 * which sim_config.untracked_bytes then adds to every peak. */
#define DPEAK(step, bytes) "{\"ev\":\"device_peak\",\"t_us\":9,\"step\":" #step ",\"bytes\":" #bytes "}\n"
TEST(sim_untracked_from_device_peak) {
  BAD(HDR BEGIN DPEAK(1, 5) END, "bad.jsonl:3: device_peak inside a step");
  BAD(HDR BEGIN END DPEAK(2, 5), "bad.jsonl:4: device_peak of step 2: not the step that ended last");
  BAD(HDR DPEAK(1, 5), "bad.jsonl:2: device_peak of step 1: not the step that ended last");
  BAD(HDR BEGIN END "{\"ev\":\"device_peak\",\"t_us\":9,\"step\":1}\n",
      "bad.jsonl:4: missing member \"bytes\"");

  /* the writer */
  test_device_stats st = {0};
  char path[32], err[512];
  ferry_engine *e;
  CHECK_OK(recording_engine(&st, path, &e));
  CHECK_OK(ferry_step_begin(e));
  CHECK_EQ(ferry_trace_device_peak(e, 7), FERRY_ESTATE);
  CHECK_STR_CONTAINS(ferry_last_error(e), "inside a step");
  CHECK_OK(ferry_step_end(e));
  CHECK_EQ(ferry_trace_device_peak(e, (1ull << 50) + 1), FERRY_EINVAL);
  CHECK_OK(ferry_trace_device_peak(e, 5000));
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_step_end(e));
  CHECK_OK(ferry_trace_device_peak(e, 7000));
  ferry_engine_destroy(e);
  sim_trace *t = NULL;
  int rc = sim_trace_load(path, &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  unlink(path);
  CHECK_OK(rc);
  CHECK_EQ(t->n_device_peaks, 2);
  CHECK_EQ(t->device_peak, 7000);
  sim_trace_free(t);

  /* what the replay does with it */
  static const char *const peaks[] = {DPEAK(1, 600000), DPEAK(1, 50000)};
  static const uint64_t want[] = {499000, 0};
  for (int k = 0; k < 2; k++) {
    char text[2048];
    snprintf(text, sizeof text, "%s%s%s%s%s%s", HDR,
             "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":1000,\"what\":\"parameters\"}\n", BEGIN,
             "{\"ev\":\"pack\",\"t_us\":0,\"id\":1,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","
             "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"
             "\"layers\":1,\"decision\":\"keep\"}\n{\"ev\":\"compute\",\"t_us\":0,\"us\":100}\n"
             "{\"ev\":\"backward_begin\",\"t_us\":0}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":1}\n"
             "{\"ev\":\"backward_end\",\"t_us\":0}\n",
             END, peaks[k]);
    CHECK_OK(sim_trace_parse("peak", text, strlen(text), &t, err, sizeof err));
    sim_config c = hand_config(1);
    uint64_t u = 1, replayed = 0;
    CHECK_OK(sim_untracked_bytes(t, &c, &u, &replayed, err, sizeof err));
    CHECK_EQ(replayed, 101000);
    CHECK_EQ(u, want[k]);
    c.untracked_bytes = u;
    c.policy_source = "return { api = 1, name = 'all', knobs = { min_offload_bytes = 1 },\n"
                      "  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }";
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_EQ(r.untracked_bytes, u);
    CHECK_EQ(r.resident_bytes, 1000 + u);
    CHECK_EQ(r.peak_device_bytes, 1000 + u + r.peak_saved_bytes);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  /* a trace without device_peak: nothing learned, nothing replayed */
  const char *plain = HDR BEGIN END;
  CHECK_OK(sim_trace_parse("plain", plain, strlen(plain), &t, err, sizeof err));
  sim_config c = hand_config(1);
  uint64_t u = 1, replayed = 1;
  CHECK_OK(sim_untracked_bytes(t, &c, &u, &replayed, err, sizeof err));
  CHECK_EQ(u, 0);
  CHECK_EQ(replayed, 0);
  sim_trace_free(t);
  return 0;
}

/* simdjson reads the lines it accepts and cJSON the rest (json_line.h):
 * what only cJSON can hold must still be read or refused the same way. */
TEST(sim_trace_reader_fast_and_cjson_paths_agree) {
  /* an integer past 2^64: simdjson refuses it, cJSON reads it, the reader
   * calls it absurd */
  BAD(HDR BEGIN PACK(1, 100000000000000000000000) END,
      "bad.jsonl:3: \"bytes\" = 99999999999999991611392 is absurd");
  /* a module path that is not UTF-8 (simdjson refuses it) is kept as is;
   * a member given twice counts once, the first, on both paths */
#define PACK_MODULE(id, module)                                                          \
  "{\"ev\":\"pack\",\"t_us\":1,\"id\":" #id ",\"step\":1,\"bytes\":16,\"bytes\":\"x\","  \
  "\"dtype\":\"f32\",\"shape\":[4],\"kind\":\"activation\",\"phase\":\"forward\","       \
  "\"layer\":0,\"layers\":2,\"decision\":\"offload\",\"module\":\"" module "\"}\n"
  const char *text = HDR BEGIN PACK_MODULE(1, "m\xff\xfe") PACK_MODULE(2, "mlp") UNPACK(2) UNPACK(1) END;
#undef PACK_MODULE
  sim_trace *t = NULL;
  char err[256] = "";
  CHECK_OK(sim_trace_parse("both", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->n_tensors, 2);
  CHECK(!strcmp(t->tensors[0].desc.module_path, "m\xff\xfe"));
  CHECK(!strcmp(t->tensors[1].desc.module_path, "mlp"));
  CHECK_EQ(t->tensors[0].desc.bytes, 16);
  CHECK_EQ(t->tensors[1].desc.bytes, 16);
  sim_trace_free(t);
  /* nesting: 32 levels pass, 33 do not, on either path (the second line of
   * each pair is not UTF-8, so cJSON reads it) */
  char deep[512];
  for (int depth = 32; depth <= 33; depth++)
    for (int slow = 0; slow <= 1; slow++) {
      char nest[80] = "", close[80] = "";
      for (int i = 1; i < depth; i++) strcat(nest, "["), strcat(close, "]");
      snprintf(deep, sizeof deep,
               HDR "{\"ev\":\"step_begin\",\"t_us\":0,\"step\":1,\"x\":%s\"%s\"%s}\n" END, nest,
               slow ? "\xff" : "a", close);
      t = NULL;
      int rc = sim_trace_parse("deep.jsonl", deep, strlen(deep), &t, err, sizeof err);
      sim_trace_free(t);
      if (depth == 32) CHECK_OK(rc);
      else CHECK(rc == FERRY_EPARSE && strstr(err, "deep.jsonl:2: nested deeper than 32 levels"));
    }
  return 0;
}

/* sim_trace_load reads a file through a buffer of a few MiB: a trace many
 * times that size, its lines cut at every chunk's end, reads the same as
 * the same text from memory; a line longer than the buffer (with a raised
 * --max-line) still reads. */
TEST(sim_trace_load_streams_what_parse_reads) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.steps = 30; /* about 9.6 MB */
  char *buf = NULL, err[512] = "";
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  CHECK(mem != NULL);
  CHECK_OK(synth_write(&m, mem, err, sizeof err));
  fclose(mem);
  char path[] = "/tmp/ferry-test-stream-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK_EQ(write(fd, buf, len), (ssize_t)len);
  close(fd);
  sim_trace *a = NULL, *b = NULL;
  CHECK_OK(sim_trace_parse("mem", buf, len, &a, err, sizeof err));
  int rc = sim_trace_load(path, &b, err, sizeof err);
  unlink(path);
  free(buf);
  CHECK_OK(rc);
  CHECK(len > 2 * (4u << 20));
  CHECK_EQ(a->n_events, b->n_events);
  CHECK_EQ(a->n_tensors, b->n_tensors);
  CHECK_EQ(a->n_steps, b->n_steps);
  CHECK_EQ(a->resident_bytes, b->resident_bytes);
  for (uint32_t i = 0; i < a->n_events; i++) {
    const trace_ev *x = &a->events[i], *y = &b->events[i];
    CHECK(x->type == y->type && x->tensor == y->tensor && x->layer == y->layer &&
          x->gap_us == y->gap_us && x->flops == y->flops);
    CHECK(!x->op == !y->op && (!x->op || !strcmp(x->op, y->op)));
  }
  for (uint32_t i = 0; i < a->n_tensors; i++) {
    const trace_tensor *x = &a->tensors[i], *y = &b->tensors[i];
    CHECK(x->id == y->id && x->desc.bytes == y->desc.bytes && x->alias_of == y->alias_of &&
          x->line == y->line && x->decision == y->decision && x->desc.ndim == y->desc.ndim &&
          !memcmp(x->desc.shape, y->desc.shape, sizeof x->desc.shape) &&
          !strcmp(x->desc.module_path, y->desc.module_path));
  }
  sim_trace_free(a);
  sim_trace_free(b);

  /* a 6 MiB line: refused at the default 1 MiB, read with --max-line 8 MiB */
  size_t big = 6u << 20;
  char *line = malloc(big + 1024);
  CHECK(line != NULL);
  int n = snprintf(line, 1024, HDR BEGIN
                   "{\"ev\":\"pack\",\"t_us\":1,\"id\":1,\"step\":1,\"bytes\":16,\"dtype\":\"f32\","
                   "\"shape\":[4],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":0,"
                   "\"layers\":2,\"decision\":\"offload\",\"module\":\"");
  memset(line + n, 'm', big);
  n += (int)big;
  n += snprintf(line + n, 1024, "\"}\n" UNPACK(1) END);
  char path2[] = "/tmp/ferry-test-long-XXXXXX";
  fd = mkstemp(path2);
  CHECK(fd >= 0);
  CHECK_EQ(write(fd, line, (size_t)n), n);
  close(fd);
  free(line);
  a = NULL;
  rc = sim_trace_load(path2, &a, err, sizeof err);
  int refused = rc == FERRY_EPARSE && strstr(err, ":3: a line longer than 1048576 bytes") != NULL;
  sim_trace_limits lim = SIM_TRACE_LIMITS_DEFAULT;
  lim.max_line_bytes = 8u << 20;
  int rc2 = sim_trace_load_limited(path2, &lim, &b, err, sizeof err);
  unlink(path2);
  CHECK(refused);
  CHECK_OK(rc2);
  CHECK_EQ(strlen(b->tensors[0].desc.module_path), big);
  sim_trace_free(b);
  return 0;
}

/* ---- the synthesizer ------------------------------------------------------------- */
static int synth_to_trace(const synth_model *m, sim_trace **t) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  char err[256];
  if (!f || synth_write(m, f, err, sizeof err)) return -1;
  fclose(f);
  int rc = sim_trace_parse("synth", buf, len, t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  free(buf);
  return rc;
}

/* Activation bytes of layer `layer` in the trace: distinct buffers (alias
 * packs count once), forward phase, activations only. */
static uint64_t trace_layer_bytes(const sim_trace *t, int layer) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer == layer && x->desc.kind == FERRY_KIND_ACTIVATION && x->alias_of < 0 &&
        x->desc.phase == FERRY_PHASE_FORWARD)
      total += x->desc.bytes;
  }
  return total;
}

/* Korthikanti et al. 2022, eq. 1: a GPT layer stores 34sbh + 5as^2b bytes
 * (16-bit). The gpt architecture saves exactly the tensors the paper counts,
 * plus LayerNorm statistics (mean and rstd in fp32: 2 x 8sb) and, with
 * FlashAttention, its log-sum-exp (fp32: 4asb), which the paper predates. */
TEST(sim_synth_matches_korthikanti_formula) {
  synth_model m;
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  m.seq = 512;
  m.micro_batch = 2;
  m.layers = 2;
  for (int flash = 0; flash <= 1; flash++) {
    m.flash = flash;
    double s = m.seq, b = m.micro_batch, h = m.hidden, a = m.heads;
    double formula = 34 * s * b * h + (flash ? 0 : 5 * a * s * s * b);
    double extras = 2 * 8 * s * b + (flash ? 4 * a * s * b : 0);
    uint64_t got = synth_layer_activation_bytes(&m);
    CHECK_EQ(got, (uint64_t)(formula + extras));
    CHECK(extras / formula < 0.005);
    sim_trace *t = NULL;
    CHECK_OK(synth_to_trace(&m, &t));
    CHECK_EQ(trace_layer_bytes(t, 0), got); /* the trace carries what the model says */
    CHECK_EQ(trace_layer_bytes(t, 1), got);
    sim_trace_free(t);
  }
  /* selective recompute drops exactly the s^2 term from the forward pass */
  m.flash = 0;
  m.checkpoint = SYNTH_CKPT_SELECTIVE;
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  double s = m.seq, b = m.micro_batch, h = m.hidden;
  CHECK_EQ(trace_layer_bytes(t, 0), (uint64_t)(34 * s * b * h + 16 * s * b));
  sim_trace_free(t);
  /* full checkpointing keeps only each block's input (reentrant: a pack) */
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_impl = SYNTH_CKPT_IMPL_REENTRANT;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK_EQ(trace_layer_bytes(t, 0), (uint64_t)(2 * s * b * h));
  sim_trace_free(t);
  return 0;
}

/* Llama: SwiGLU and GQA differ from the GPT formula; the per-layer total is
 * 12sbh (norm inputs, q, o, normed inputs) + 4sb*kv_dim (k, v) + 8sbf (gate,
 * up, SiLU output, product) + statistics and the log-sum-exp, + the rotary
 * tables cos and sin (1 x 1 x s x head_dim each, 4s*head_dim in bf16) that
 * the first layer packs and the others alias. */
TEST(sim_synth_llama_shapes_and_sizes) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  double P = (double)synth_param_count(&m);
  CHECK(fabs(P - 8.03e9) / 8.03e9 < 0.005); /* Meta: 8.03B */
  double s = m.seq, b = m.micro_batch, h = m.hidden, f = m.ffn, kvd = h / m.heads * m.kv_heads;
  double want = 12 * s * b * h + 4 * s * b * kvd + 8 * s * b * f + 2 * 4 * s * b + 4 * m.heads * s * b;
  const double rope = 4 * s * (h / m.heads);
  CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(want + rope));
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)(want + rope));
  CHECK_EQ(synth_layer_saved_bytes(&m, 1), (uint64_t)want);
  CHECK_EQ(synth_preset("llama3-70b", &m), 0);
  P = (double)synth_param_count(&m);
  CHECK(fabs(P - 70.6e9) / 70.6e9 < 0.005); /* Meta: 70.6B */
  /* resident: 16 bytes per parameter over the shards, plus two gathered blocks */
  CHECK(synth_resident_bytes(&m) > (uint64_t)(16 * P / m.shard));
  CHECK_EQ(synth_preset("no-such-model", &m), -1);
  char err[128];
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.heads = 3;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "heads 3 must divide hidden");
  return 0;
}

/* ---- what each op saves, fused and eager ------------------------------------------- */
static uint64_t alloc_bytes(const sim_trace *t, const char *what);

/* One expected pack: module path below the layer (the whole path outside),
 * dtype, kind, whether it is an alias of an earlier pack, its shape. */
typedef struct want_pack {
  const char *mod;
  int dtype, kind, alias, ndim;
  int64_t shape[4];
} want_pack;

typedef struct want_list {
  want_pack w[48];
  int n;
} want_list;

static void want(want_list *l, const char *mod, int dtype, int kind, int alias, int ndim, int64_t a,
                 int64_t b, int64_t c, int64_t d) {
  want_pack *p = &l->w[l->n++];
  *p = (want_pack){mod, dtype, kind, alias, ndim, {a, b, c, d}};
}

/* The forward packs of `layer` in t's first step (those whose module path
 * contains `only`, if given) are exactly `l`, as a multiset (printing what is
 * missing or extra). */
static int packs_are(const sim_trace *t, int layer, const char *only, const want_list *l) {
  unsigned char used[48] = {0};
  char prefix[48];
  snprintf(prefix, sizeof prefix, "model.layers.%d", layer);
  int extra = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer != layer || x->desc.phase != FERRY_PHASE_FORWARD) continue;
    const char *m = x->desc.module_path ? x->desc.module_path : "";
    if (only && !strstr(m, only)) continue;
    if (layer >= 0 && !strncmp(m, prefix, strlen(prefix))) {
      m += strlen(prefix);
      if (*m == '.') m++;
    }
    int found = -1;
    for (int k = 0; k < l->n && found < 0; k++) {
      const want_pack *w = &l->w[k];
      int same = !used[k] && !strcmp(w->mod, m) && w->dtype == x->desc.dtype &&
                 w->kind == x->desc.kind && w->alias == (x->alias_of >= 0) && w->ndim == x->desc.ndim;
      for (int d = 0; same && d < w->ndim; d++) same = w->shape[d] == x->desc.shape[d];
      if (same) found = k;
    }
    if (found >= 0) {
      used[found] = 1;
      continue;
    }
    extra++;
    fprintf(stderr, "  layer %d: unexpected pack %s %s %s%s ndim %d [%lld %lld %lld %lld]\n", layer,
            m, ferry_dtype_name(x->desc.dtype), ferry_kind_name(x->desc.kind),
            x->alias_of >= 0 ? " alias" : "", x->desc.ndim, (long long)x->desc.shape[0],
            (long long)x->desc.shape[1], (long long)x->desc.shape[2], (long long)x->desc.shape[3]);
  }
  int missing = 0;
  for (int k = 0; k < l->n; k++)
    if (!used[k]) {
      missing++;
      fprintf(stderr, "  layer %d: missing pack %s %s %s%s\n", layer, l->w[k].mod,
              ferry_dtype_name(l->w[k].dtype), ferry_kind_name(l->w[k].kind),
              l->w[k].alias ? " alias" : "");
    }
  return extra || missing;
}

/* An RMSNorm's packs: fused (one kernel: torch's _fused_rms_norm, Liger's
 * RMSNorm) x, rstd, weight; eager (Hugging Face's LlamaRMSNorm op by op) the
 * fp32 x (pow), rstd (rsqrt), both again (x * rstd), the normalized tensor
 * in the model dtype and the weight (weight * it). */
static void want_norm(want_list *l, const char *mod, int eager, int dt, int nd, int64_t a, int64_t b,
                      int64_t c, int64_t d) {
  int64_t dims[4] = {a, b, c, d}, one[4] = {a, b, c, d};
  one[nd - 1] = 1;
  const int64_t w = dims[nd - 1];
  if (!eager) {
    want(l, mod, dt, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
  } else {
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 1, nd, a, b, c, d);
    want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 1, nd, one[0], one[1], one[2], one[3]);
    want(l, mod, dt, FERRY_KIND_ACTIVATION, 0, nd, a, b, c, d);
  }
  want(l, mod, FERRY_DTYPE_F32, FERRY_KIND_ACTIVATION, 0, nd, one[0], one[1], one[2], one[3]);
  want(l, mod, dt, FERRY_KIND_PARAMETER, 0, 1, w, 0, 0, 0);
}

/* Every op of a Llama block (and outside the blocks), its saved tensors by
 * hand, for --norm fused|eager x --flash on|off x bf16|f32 (b = 2, s = 64,
 * h = 256, a = 4 heads of d = 64, 2 KV heads, f = 512, V = 1024, T = b s):
 *   norms: as want_norm above (input_layernorm, post_attention_layernorm,
 *     model.norm; Qwen3's q_norm and k_norm per head);
 *   Linears: the input as mm sees it, (T, in), k and v's an alias of q's
 *     and up's of gate's, and the weight's transpose (in, out);
 *   self_attn: the rotary tables cos, sin (1, 1, s, d) for q and for k
 *     (layer 0 packs them, layer 1 aliases all four); flash: q (b, a, s,
 *     d), k and v (b, kv, s, d), the output (b, a, s, d), the log-sum-exp
 *     fp32 (b, a, s), o_proj's input an alias of the output; eager: q (ba,
 *     s, d), k^T (ba, d, s), the fp32 softmax (b, a, s, s), the
 *     probabilities (ba, s, s; in fp32 an alias of the softmax), v (ba, s,
 *     d), o_proj's input a copy;
 *   mlp: act_fn's input (b, s, f), the product's operands (module mlp);
 *   outside: the token ids; model.norm; lm_head; the loss at the root:
 *     fp32 log-probabilities (T, V), an alias, the labels (T), total_weight;
 *     the fp32 copy of the logits and the gradient's copy back only below
 *     fp32.
 * And the layer's bytes against a closed form: 2 norms (fused eTh + 4T;
 * eager 4Th + 4T + eTh) + 2eTh (the two Linears' inputs) + attention (flash
 * 2eT qd + 2eT kvd + 4aT; eager 3eT qd + 4abs^2 + eabs^2 (none in fp32) +
 * eT qd) + 4eTf, + 2esd (cos, sin) on layer 0. */
TEST(sim_synth_saved_tensors_per_op_fused_and_eager) {
  const int ACTV = FERRY_KIND_ACTIVATION, PAR = FERRY_KIND_PARAMETER, F32 = FERRY_DTYPE_F32;
  for (int f32 = 0; f32 <= 1; f32++)
    for (int eager = 0; eager <= 1; eager++)
      for (int flash = 0; flash <= 1; flash++) {
        synth_model m;
        CHECK_EQ(synth_preset("tiny", &m), 0);
        m.layers = 2, m.seq = 64, m.micro_batch = 2, m.vocab = 1024;
        m.dtype = f32 ? FERRY_DTYPE_F32 : FERRY_DTYPE_BF16;
        m.norm = eager ? SYNTH_NORM_EAGER : SYNTH_NORM_FUSED, m.flash = flash;
        const int dt = m.dtype;
        const int64_t b = 2, s = 64, h = 256, a = 4, kv = 2, d = 64, f = 512, V = 1024, T = b * s;
        const int64_t qd = a * d, kvd = kv * d;
        const double e = f32 ? 4 : 2;
        fprintf(stderr, "  %s, norm %s, flash %s\n", f32 ? "f32" : "bf16", eager ? "eager" : "fused",
                flash ? "on" : "off");
        sim_trace *t = NULL;
        CHECK_OK(synth_to_trace(&m, &t));
        for (int L = 0; L < 2; L++) {
          want_list l = {.n = 0};
          want_norm(&l, "input_layernorm", eager, dt, 3, b, s, h, 0);
          want(&l, "self_attn.q_proj", dt, ACTV, 0, 2, T, h, 0, 0);
          want(&l, "self_attn.q_proj", dt, PAR, 0, 2, h, qd, 0, 0);
          want(&l, "self_attn.k_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "self_attn.k_proj", dt, PAR, 0, 2, h, kvd, 0, 0);
          want(&l, "self_attn.v_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "self_attn.v_proj", dt, PAR, 0, 2, h, kvd, 0, 0);
          for (int k = 0; k < 4; k++) want(&l, "self_attn", dt, ACTV, L > 0 || k >= 2, 4, 1, 1, s, d);
          if (flash) {
            want(&l, "self_attn", dt, ACTV, 0, 4, b, a, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, kv, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, kv, s, d);
            want(&l, "self_attn", dt, ACTV, 0, 4, b, a, s, d);
            want(&l, "self_attn", F32, ACTV, 0, 3, b, a, s, 0);
          } else {
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, s, d, 0);
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, d, s, 0);
            want(&l, "self_attn", F32, ACTV, 0, 4, b, a, s, s);
            want(&l, "self_attn", dt, ACTV, f32, 3, b * a, s, s, 0);
            want(&l, "self_attn", dt, ACTV, 0, 3, b * a, s, d, 0);
          }
          want(&l, "self_attn.o_proj", dt, ACTV, flash, 2, T, qd, 0, 0);
          want(&l, "self_attn.o_proj", dt, PAR, 0, 2, qd, h, 0, 0);
          want_norm(&l, "post_attention_layernorm", eager, dt, 3, b, s, h, 0);
          want(&l, "mlp.gate_proj", dt, ACTV, 0, 2, T, h, 0, 0);
          want(&l, "mlp.gate_proj", dt, PAR, 0, 2, h, f, 0, 0);
          want(&l, "mlp.act_fn", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp.up_proj", dt, ACTV, 1, 2, T, h, 0, 0);
          want(&l, "mlp.up_proj", dt, PAR, 0, 2, h, f, 0, 0);
          want(&l, "mlp", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp", dt, ACTV, 0, 3, b, s, f, 0);
          want(&l, "mlp.down_proj", dt, ACTV, 0, 2, T, f, 0, 0);
          want(&l, "mlp.down_proj", dt, PAR, 0, 2, f, h, 0, 0);
          CHECK_EQ(packs_are(t, L, NULL, &l), 0);
          const double norm = eager ? 4.0 * T * h + 4 * T + e * T * h : e * T * h + 4 * T;
          const double attn = flash ? 2 * e * T * qd + 2 * e * T * kvd + 4.0 * a * T
                                    : 3 * e * T * qd + 4.0 * a * b * s * s +
                                          (f32 ? 0 : e * a * b * s * s) + e * T * qd;
          const double bytes = 2 * norm + 2 * e * T * h + attn + 4 * e * T * f + (L == 0 ? 2 * e * s * d : 0);
          CHECK_EQ(trace_layer_bytes(t, L), (uint64_t)bytes);
          CHECK_EQ(synth_layer_saved_bytes(&m, L), (uint64_t)bytes);
        }
        want_list out = {.n = 0};
        want(&out, "model.embed_tokens", FERRY_DTYPE_I64, ACTV, 0, 2, b, s, 0, 0);
        want_norm(&out, "model.norm", eager, dt, 3, b, s, h, 0);
        want(&out, "lm_head", dt, ACTV, 0, 2, T, h, 0, 0);
        want(&out, "lm_head", dt, PAR, 0, 2, h, V, 0, 0);
        want(&out, "", F32, ACTV, 0, 2, T, V, 0, 0);
        want(&out, "", F32, ACTV, 1, 2, T, V, 0, 0);
        want(&out, "", FERRY_DTYPE_I64, ACTV, 0, 1, T, 0, 0, 0);
        want(&out, "", F32, ACTV, 0, 0, 0, 0, 0, 0);
        CHECK_EQ(packs_are(t, -1, NULL, &out), 0);
        /* in fp32, logits.float() is the logits: no copy, and none back */
        CHECK_EQ(alloc_bytes(t, "loss: logits.float()"), f32 ? 0 : 4 * T * V);
        CHECK_EQ(alloc_bytes(t, "loss: grad of the logits (model dtype)"), f32 ? 0 : 2 * T * V);
        /* the modules' classes are Hugging Face's */
        for (uint32_t i = 0; i < t->n_tensors; i++) {
          const ferry_tensor_desc *x = &t->tensors[i].desc;
          const char *p = x->module_path;
          if (!strcmp(p, "")) CHECK(!strcmp(x->module_class, "LlamaForCausalLM"));
          if (!strcmp(p, "model.layers.1.self_attn")) CHECK(!strcmp(x->module_class, "LlamaAttention"));
          if (!strcmp(p, "model.layers.1.mlp")) CHECK(!strcmp(x->module_class, "LlamaMLP"));
          if (strstr(p, "layernorm")) CHECK(!strcmp(x->module_class, "LlamaRMSNorm"));
        }
        sim_trace_free(t);
      }
  /* Qwen3's QK-norm, eager in bf16: per head, over head_dim, after q_proj
   * and after k_proj */
  synth_model q;
  CHECK_EQ(synth_preset("tiny", &q), 0);
  q.layers = 2, q.seq = 64, q.micro_batch = 2, q.qk_norm = 1, q.head_dim = 48, q.norm = SYNTH_NORM_EAGER;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&q, &t));
  want_list lq = {.n = 0}, lk = {.n = 0};
  want_norm(&lq, "self_attn.q_norm", 1, FERRY_DTYPE_BF16, 4, 2, 64, 4, 48);
  want_norm(&lk, "self_attn.k_norm", 1, FERRY_DTYPE_BF16, 4, 2, 64, 2, 48);
  CHECK_EQ(packs_are(t, 1, "self_attn.q_norm", &lq), 0);
  CHECK_EQ(packs_are(t, 1, "self_attn.k_norm", &lk), 0);
  sim_trace_free(t);
  /* the header says which; gpt's LayerNorm has no eager decomposition */
  char err[512] = "";
  char *text = synth_text_of(&q, err, sizeof err);
  CHECK(text != NULL);
  int named = strstr(text, "\"norm\":\"eager\",") != NULL;
  /* and the format version whose readers know transient gradients */
  int v2 = strncmp(text, "{\"ev\":\"header\",\"t_us\":0,\"format\":\"ferry-trace\",\"version\":2,",
                   59) == 0;
  free(text);
  CHECK(named);
  CHECK(v2);
  CHECK_EQ(synth_preset("gpt3-1.3b", &q), 0);
  q.norm = SYNTH_NORM_EAGER;
  CHECK_EQ(synth_validate(&q, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--norm eager is for RMSNorm");
  return 0;
}

/* ---- checkpointing, Qwen3 and MoE --------------------------------------------- */
/* Compute time of layer `layer` in the first step: forward (before
 * backward_begin) or backward, of the events named op (NULL: all). */
static double layer_us(const sim_trace *t, int layer, int backward, const char *op) {
  double us = 0;
  int in_backward = 0;
  for (uint32_t i = t->steps[0].first; i < t->steps[0].end; i++) {
    const trace_ev *ev = &t->events[i];
    if (ev->type == TEV_BACKWARD_BEGIN) in_backward = 1;
    if (ev->type != TEV_COMPUTE || ev->layer != layer || in_backward != backward) continue;
    if (!op || (ev->op && !strcmp(ev->op, op))) us += ev->gap_us;
  }
  return us;
}

/* The packs (distinct buffers) of layer `layer` in `phase` (one-step traces):
 * how many, and whether they are all one class. */
static int layer_packs(const sim_trace *t, int layer, int phase, const char **cls) {
  int n = 0;
  *cls = NULL;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer != layer || x->desc.phase != phase || x->alias_of >= 0 ||
        x->desc.kind != FERRY_KIND_ACTIVATION)
      continue;
    if (n++ == 0 || (*cls && !strcmp(*cls, x->desc.module_class))) *cls = x->desc.module_class;
    else *cls = NULL;
  }
  return n;
}

/* Activation bytes of the trace's recompute packs in layer `layer`. */
static uint64_t trace_layer_recompute_bytes(const sim_trace *t, int layer) {
  uint64_t total = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->desc.layer == layer && x->desc.kind == FERRY_KIND_ACTIVATION && x->alias_of < 0 &&
        x->desc.phase == FERRY_PHASE_RECOMPUTE)
      total += x->desc.bytes;
  }
  return total;
}

/* Per mode, what a Llama/Qwen3 layer keeps from forward to backward, by hand
 * (T = b s tokens, qd = heads x head_dim, kvd = kv_heads x head_dim, bf16):
 *   none: 8Th (block input, normed input, attention-residual input, normed
 *     MLP input) + 4T qd (q, attention output) + 4T kvd (k, v) + 8Tf (gate,
 *     SiLU output, up, product) + 8T (two rstd) + 4aT (log-sum-exp); Qwen3's
 *     QK-norm adds its inputs 2T qd + 2T kvd and rstd 4aT + 4 kv T.
 *   full: the block input, 2Th.
 *   selective-op (torchtitan): the block input 2Th; the outputs of the 1st,
 *     3rd, 5th, 7th matmul (q_proj 2T qd, v_proj 2T kvd, gate_proj 2Tf,
 *     down_proj 2Th); flash attention's output 2T qd and log-sum-exp 4aT.
 *     With --flash off the eager attention's matmuls are bmm, not in the
 *     save list: no attention output kept.
 *   selective:mlp_act (Megatron): none less the SiLU output, 2Tf.
 * The rotary tables (cos, sin: 4 s d) are packed by the first layer that
 * saves its ops' tensors in forward (layer 0 unless it is checkpointed) and
 * aliased by the others; a recomputed block packs its own.
 * gpt with flash, selective-op: input 2Th, qkv_proj 6Th, fc1 2Tf (the 1st
 * and 3rd Linear), attention output 2Th and lse 4aT. Each checked through
 * synth_layer_saved_bytes and in the written trace (forward packs), and the
 * recompute packs carry everything the backward needs (none's bytes). */
TEST(sim_synth_checkpoint_modes_save_what_the_formulas_say) {
  for (int qwen = 0; qwen <= 1; qwen++) {
    synth_model m;
    CHECK_EQ(synth_preset("tiny", &m), 0);
    m.seq = 512, m.micro_batch = 2, m.layers = 4;
    if (qwen) m.qk_norm = 1, m.head_dim = 48; /* qd = 192 != hidden 256 */
    const double T = 1024, h = m.hidden, a = m.heads, kv = m.kv_heads, f = m.ffn;
    const double d = qwen ? 48 : h / a, qd = a * d, kvd = kv * d;
    const double none = 8 * T * h + 4 * T * qd + 4 * T * kvd + 8 * T * f + 8 * T + 4 * a * T +
                        (qwen ? 2 * T * qd + 2 * T * kvd + 4 * a * T + 4 * kv * T : 0);
    const double sac = 4 * T * h + 4 * T * qd + 2 * T * kvd + 2 * T * f + 4 * a * T;
    const double sac_eager = 4 * T * h + 2 * T * qd + 2 * T * kvd + 2 * T * f;
    struct {
      int mode, every, flash;
      unsigned recompute;
      double ckpt, plain; /* bytes of a checkpointed layer, of the others */
    } cases[] = {
        {SYNTH_CKPT_OFF, 1, 1, 0, none, none},
        {SYNTH_CKPT_FULL, 1, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_FULL, 2, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_FULL, 4, 1, 0, 2 * T * h, none},
        {SYNTH_CKPT_SELECTIVE_OP, 1, 1, 0, sac, sac},
        {SYNTH_CKPT_SELECTIVE_OP, 1, 0, 0, sac_eager, sac_eager},
        {SYNTH_CKPT_SELECTIVE, 1, 1, SYNTH_RECOMPUTE_MLP_ACT, none - 2 * T * f, none - 2 * T * f},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      m.checkpoint = cases[c].mode, m.ckpt_every = cases[c].every, m.flash = cases[c].flash;
      /* packs for what a checkpoint keeps: reentrant (full, Megatron's selective), compiled
       * (selective-op, whose recomputed tensors no hook sees then) */
      m.ckpt_impl = cases[c].mode == SYNTH_CKPT_OFF          ? SYNTH_CKPT_IMPL_AUTO
                    : cases[c].mode == SYNTH_CKPT_SELECTIVE_OP ? SYNTH_CKPT_IMPL_COMPILED
                                                               : SYNTH_CKPT_IMPL_REENTRANT;
      m.recompute = cases[c].recompute ? cases[c].recompute : SYNTH_RECOMPUTE_ATTN_CORE;
      sim_trace *t = NULL;
      CHECK_OK(synth_to_trace(&m, &t));
      const double rope = 4 * m.seq * d;
      for (int L = 0; L < m.layers; L++) {
        /* torchtitan's ac_freq: blocks K, 2K, ... counted from 1 */
        int ckpt = cases[c].mode != SYNTH_CKPT_FULL || (L + 1) % cases[c].every == 0;
        double want = ckpt ? cases[c].ckpt : cases[c].plain;
        int saves_ops = cases[c].mode == SYNTH_CKPT_OFF || cases[c].mode == SYNTH_CKPT_SELECTIVE ||
                        (cases[c].mode == SYNTH_CKPT_FULL && !ckpt);
        if (L == 0 && saves_ops) want += rope;
        CHECK_EQ(synth_layer_saved_bytes(&m, L), (uint64_t)want);
        CHECK_EQ(trace_layer_bytes(t, L), (uint64_t)want);
        if (cases[c].mode == SYNTH_CKPT_FULL && ckpt) {
          const char *cls;
          CHECK_EQ(layer_packs(t, L, FERRY_PHASE_FORWARD, &cls), 1); /* only the block input */
          CHECK(cls && !strcmp(cls, qwen ? "Qwen3DecoderLayer" : "LlamaDecoderLayer"));
        }
        /* recomputation packs again what the backward needs: all of it
         * (full, selective-op), the dropped SiLU output (selective) */
        uint64_t rec = trace_layer_recompute_bytes(t, L);
        if (cases[c].mode == SYNTH_CKPT_OFF || !ckpt) CHECK_EQ(rec, 0);
        else if (cases[c].mode == SYNTH_CKPT_SELECTIVE) CHECK_EQ(rec, (uint64_t)(2 * T * f));
        else if (cases[c].mode == SYNTH_CKPT_SELECTIVE_OP) CHECK_EQ(rec, 0);
        else CHECK_EQ(rec, synth_layer_activation_bytes(&m));
        /* what one layer's ops save, the rotary tables included */
        if (cases[c].flash) CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(none + rope));
      }
      CHECK_EQ(synth_checkpointed_layers(&m), cases[c].mode == SYNTH_CKPT_OFF ? 0
                                              : cases[c].mode == SYNTH_CKPT_FULL
                                                  ? m.layers / cases[c].every
                                                  : m.layers);
      sim_trace_free(t);
    }
  }
  /* GPT-2 (fused qkv) under torchtitan's policy, with flash */
  synth_model g;
  CHECK_EQ(synth_preset("gpt3-1.3b", &g), 0);
  g.seq = 512, g.micro_batch = 2, g.layers = 2, g.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  g.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
  const double T = 1024, h = g.hidden, a = g.heads, f = g.ffn;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK_EQ(trace_layer_bytes(t, 1), (uint64_t)(10 * T * h + 2 * T * f + 4 * a * T));
  CHECK_EQ(synth_layer_saved_bytes(&g, 1), (uint64_t)(10 * T * h + 2 * T * f + 4 * a * T));
  sim_trace_free(t);
  /* the header names the mode */
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  char err[512] = "";
  const struct {
    int mode, every;
    unsigned rc;
    const char *name;
  } names[] = {{SYNTH_CKPT_OFF, 1, 0, "\"checkpoint\":\"none\","},
               {SYNTH_CKPT_FULL, 1, 0, "\"checkpoint\":\"full\",\"checkpointed_layers\":4,"},
               {SYNTH_CKPT_FULL, 2, 0, "\"checkpoint\":\"full:2\",\"checkpointed_layers\":2,"},
               {SYNTH_CKPT_SELECTIVE_OP, 1, 0, "\"checkpoint\":\"selective-op\",\"checkpointed_layers\":4,"},
               {SYNTH_CKPT_SELECTIVE, 1, SYNTH_RECOMPUTE_MLP_ACT, "\"checkpoint\":\"selective:mlp_act\","}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    m.checkpoint = names[i].mode, m.ckpt_every = names[i].every;
    m.recompute = names[i].rc ? names[i].rc : SYNTH_RECOMPUTE_ATTN_CORE;
    char *text = synth_text_of(&m, err, sizeof err);
    CHECK(text != NULL);
    char *nl = strchr(text, '\n');
    CHECK(nl != NULL);
    *nl = 0;
    int found = strstr(text, names[i].name) != NULL;
    if (!found) fprintf(stderr, "header: %s\nwanted: %s\n", text, names[i].name);
    free(text);
    CHECK(found);
  }
  return 0;
}

/* Recomputation costs what the recomputed ops cost in the forward pass, as
 * compute events ("recompute") of the layer's backward, and nothing else
 * changes: with torchtitan's per-op policy on a Qwen3 block, the ops
 * recomputed are the norms, k_proj, o_proj, up_proj (the 2nd, 4th, 6th
 * matmul), QK-norm, rotary, SiLU and the product; q_proj, v_proj, gate_proj,
 * down_proj and attention are not. Full checkpointing recomputes the whole
 * block (one "forward" event in the forward pass); full:2 only on layers 1
 * and 3; Megatron's attn_core (flash off) recomputes scores, softmax,
 * dropout and context of a GPT block. */
TEST(sim_synth_recompute_time_goes_to_backward) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.qk_norm = 1, m.head_dim = 48;
  m.tflops = 5, m.hbm_gbps = 50; /* slow enough that no op sits at the 4 us floor */
  sim_trace *t0 = NULL, *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t0));
  static const char *const recomputed[] = {
      "input_layernorm", "self_attn.k_proj", "self_attn.q_norm", "self_attn.k_norm",
      "self_attn.rotary_emb", "self_attn.o_proj", "post_attention_layernorm", "mlp.up_proj",
      "mlp.act_fn", "mlp.mul"};
  static const char *const kept[] = {"self_attn.q_proj", "self_attn.v_proj", "self_attn.attention",
                                     "mlp.gate_proj", "mlp.down_proj"};
  double want = 0, kept_us = 0;
  for (size_t i = 0; i < sizeof recomputed / sizeof *recomputed; i++) {
    double us = layer_us(t0, 0, 0, recomputed[i]);
    CHECK(us > 4.5);
    want += us;
  }
  for (size_t i = 0; i < sizeof kept / sizeof *kept; i++) kept_us += layer_us(t0, 0, 0, kept[i]);
  const double fwd = layer_us(t0, 0, 0, NULL), bwd = layer_us(t0, 0, 1, NULL);
  CHECK(fabs(want + kept_us - fwd) < 0.01); /* the lists name every op */
  /* backward: twice the forward, but FlashAttention's 2.5x (compute-bound here) */
  const double attn = layer_us(t0, 0, 0, "self_attn.attention");
  CHECK(fabs(layer_us(t0, 0, 1, "self_attn.attention") - 2.5 * attn) < 0.01);
  CHECK(fabs(bwd - 2 * fwd - 0.5 * attn) < 0.01);
  CHECK_EQ(layer_us(t0, 0, 1, "recompute"), 0);

  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  CHECK_OK(synth_to_trace(&m, &t));
  for (int L = 0; L < m.layers; L++) {
    double rec = layer_us(t, L, 1, "recompute");
    CHECK(fabs(rec - want) < 0.01);
    CHECK(fabs(layer_us(t, L, 1, NULL) - rec - bwd) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, NULL) - fwd) < 0.01);
  }
  sim_trace_free(t);

  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_every = 2;
  CHECK_OK(synth_to_trace(&m, &t));
  for (int L = 0; L < m.layers; L++) {
    int ckpt = L % 2 == 1;
    CHECK(fabs(layer_us(t, L, 1, "recompute") - (ckpt ? fwd : 0)) < 0.01);
    CHECK(fabs(layer_us(t, L, 1, NULL) - (ckpt ? fwd + bwd : bwd)) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, "forward") - (ckpt ? fwd : 0)) < 0.01);
    CHECK(fabs(layer_us(t, L, 0, NULL) - fwd) < 0.01);
  }
  sim_trace_free(t);
  sim_trace_free(t0);

  /* Megatron's selective: the attention core of a GPT block, flash off */
  synth_model g;
  CHECK_EQ(synth_preset("gpt3-1.3b", &g), 0);
  g.seq = 512, g.micro_batch = 2, g.layers = 2, g.flash = 0;
  CHECK_OK(synth_to_trace(&g, &t0));
  static const char *const core[] = {"self_attn.scores", "self_attn.softmax",
                                     "self_attn.attention_dropout", "self_attn.context"};
  want = 0;
  for (size_t i = 0; i < 4; i++) want += layer_us(t0, 1, 0, core[i]);
  g.checkpoint = SYNTH_CKPT_SELECTIVE, g.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK(want > 0 && fabs(layer_us(t, 1, 1, "recompute") - want) < 0.01);
  CHECK(fabs(layer_us(t, 1, 1, NULL) - want - layer_us(t0, 1, 1, NULL)) < 0.01);
  sim_trace_free(t);
  /* and the MLP activation alone: GELU */
  g.recompute = SYNTH_RECOMPUTE_MLP_ACT;
  CHECK_OK(synth_to_trace(&g, &t));
  CHECK(fabs(layer_us(t, 1, 1, "recompute") - layer_us(t0, 1, 0, "mlp.act")) < 0.01);
  sim_trace_free(t);
  sim_trace_free(t0);
  return 0;
}

/* Megatron's selective recomputation drops the attention core's s^2
 * tensors; FlashAttention has none, so it would change nothing: refused,
 * saying so and pointing to selective-op. So are the other modes that
 * would change nothing: full:K with K above the layers, a frequency without
 * full, a group that drops nothing. */
TEST(sim_synth_selective_with_flash_is_refused) {
  synth_model m;
  char err[512] = "";
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.checkpoint = SYNTH_CKPT_SELECTIVE;
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "FlashAttention has no s^2 tensor to drop, so it would change nothing");
  CHECK_STR_CONTAINS(err, "use selective-op (torchtitan's per-op policy), full or full:K, or --flash off");
  CHECK(strlen(err) < 255); /* whole in the CLI's message */
  FILE *f = fopen("/dev/null", "w");
  CHECK(f != NULL);
  err[0] = 0;
  int rc = synth_write(&m, f, err, sizeof err);
  fclose(f);
  CHECK_EQ(rc, -1);
  CHECK_STR_CONTAINS(err, "no s^2 tensor");
  m.recompute = SYNTH_RECOMPUTE_ATTN_CORE | SYNTH_RECOMPUTE_MLP_ACT; /* half a no-op: refused too */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  m.flash = 0; /* eager attention has the s^2 tensors */
  CHECK_OK(synth_validate(&m, err, sizeof err));
  m.flash = 1, m.recompute = SYNTH_RECOMPUTE_MLP_ACT; /* the activation exists with flash */
  CHECK_OK(synth_validate(&m, err, sizeof err));
  m.recompute = 0;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  m.checkpoint = SYNTH_CKPT_FULL, m.ckpt_every = 33;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "full:33: K must be within 1..layers (32)");
  m.ckpt_every = 32;
  CHECK_OK(synth_validate(&m, err, sizeof err));
  CHECK_EQ(synth_checkpointed_layers(&m), 1);
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs full checkpointing");
  return 0;
}

/* Each preset's parameter count against the published figure (within 1%),
 * and the shapes read from the models' config.json (sources in
 * trace_synth.c): Llama 3 8B 8.03B, 70B 70.6B (Meta's model cards); Qwen3-8B
 * 8.19B (card: 8.2B), Qwen3-14B 14.8B (card; 13.2B without embeddings),
 * Qwen3-30B-A3B 30.5B in total (29.9B without embeddings) and 3.3B
 * activated (Qwen's model cards); Mixtral 8x7B 46.7B in total, 12.9B per
 * token (Mistral AI). Qwen3-30B-A3B's activated count is 3.353B exactly
 * (the total less the 120 unrouted experts' 27.18B, embedding and head
 * included), 1.6% above the card's two-digit "3.3B" (what the count
 * without the router, 3.340B, would round to, though every token uses the
 * router): checked within 2%, and its exact formula in
 * sim_synth_moe_router_and_experts. */
TEST(sim_synth_presets_match_published_parameter_counts) {
  static const struct {
    const char *name;
    double total, active, active_tol, non_embedding;
  } pub[] = {{"llama3-8b", 8.03e9, 0, 0, 0},
             {"llama3-70b", 70.6e9, 0, 0, 0},
             {"qwen3-8b", 8.19e9, 0, 0, 6.95e9},
             {"qwen3-14b", 14.8e9, 0, 0, 13.2e9},
             {"qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02, 29.9e9},
             {"mixtral-8x7b", 46.7e9, 12.9e9, 0.01, 0}};
  for (size_t i = 0; i < sizeof pub / sizeof pub[0]; i++) {
    synth_model m;
    CHECK_EQ(synth_preset(pub[i].name, &m), 0);
    double P = (double)synth_param_count(&m), A = (double)synth_active_param_count(&m);
    double emb = 2.0 * m.vocab * m.hidden;
    fprintf(stderr, "  %-14s %.4g parameters (published %.4g), active %.4g\n", pub[i].name, P,
            pub[i].total, A);
    CHECK(fabs(P - pub[i].total) / pub[i].total < 0.01);
    if (pub[i].non_embedding) CHECK(fabs(P - emb - pub[i].non_embedding) / pub[i].non_embedding < 0.01);
    if (pub[i].active) CHECK(fabs(A - pub[i].active) / pub[i].active < pub[i].active_tol);
    else CHECK_EQ(A, P);
  }
  synth_model m;
  CHECK_EQ(synth_preset("qwen3-8b", &m), 0);
  CHECK(m.layers == 36 && m.hidden == 4096 && m.heads == 32 && m.kv_heads == 8 &&
        m.head_dim == 128 && m.ffn == 12288 && m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  CHECK_EQ(synth_preset("qwen3-14b", &m), 0);
  CHECK(m.layers == 40 && m.hidden == 5120 && m.heads == 40 && m.kv_heads == 8 &&
        m.head_dim == 128 && m.ffn == 17408 && m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  CHECK_EQ(synth_preset("qwen3-30b-a3b", &m), 0);
  CHECK(m.layers == 48 && m.hidden == 2048 && m.heads == 32 && m.kv_heads == 4 &&
        m.head_dim == 128 && m.experts == 128 && m.top_k == 8 && m.expert_ffn == 768 &&
        m.vocab == 151936 && m.qk_norm && !m.tie_embeddings);
  /* tying the head to the embedding takes V h off */
  uint64_t untied = synth_param_count(&m);
  m.tie_embeddings = 1;
  CHECK_EQ(untied - synth_param_count(&m), (uint64_t)m.vocab * (uint64_t)m.hidden);
  return 0;
}

/* A small MoE (4 experts, top-2, QK-norm, head_dim 48): what a layer saves,
 * by hand (T tokens, t = T k / E = 256 per expert, fe the expert FFN):
 * attention as Qwen3 (6Th + 6T qd + 6T kvd + 8T + 8aT + 4 kv T), then the
 * router: its input 2Th, fp32 softmax 4TE, top-k indices 8Tk, top-k weights
 * 4Tk and their sums 4T; each expert: token indices 8t and slots 8t, its
 * input 2th, gate/SiLU/up/product 8t fe, output 2th, routing weight 2t.
 * torchtitan's policy: the matmuls count on across experts (q 1, k 2, v 3,
 * o 4; expert 0: gate 5, up 6, down 7; expert 1: gate 8, up 9, down 10...),
 * the router's gate forced to recompute and not counted: experts 0 and 2
 * keep gate and down (2t fe + 2th), 1 and 3 keep up (2t fe). */
TEST(sim_synth_moe_router_and_experts) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.layers = 2, m.qk_norm = 1, m.head_dim = 48;
  m.experts = 4, m.top_k = 2, m.expert_ffn = 128;
  const double T = 1024, h = m.hidden, a = m.heads, kv = m.kv_heads, E = 4, k = 2, fe = 128;
  const double qd = a * 48, kvd = kv * 48, t = T * k / E;
  const double attn = 6 * T * h + 6 * T * qd + 6 * T * kvd + 8 * T + 8 * a * T + 4 * kv * T;
  const double router = 2 * T * h + 4 * T * E + 8 * T * k + 4 * T * k + 4 * T;
  const double experts = E * (16 * t + 4 * t * h + 8 * t * fe + 2 * t);
  sim_trace *tr = NULL;
  CHECK_OK(synth_to_trace(&m, &tr));
  const double rope = 4 * m.seq * 48.0; /* cos, sin: packed by layer 0, aliased by layer 1 */
  CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(attn + router + experts + rope));
  CHECK_EQ(trace_layer_bytes(tr, 0), (uint64_t)(attn + router + experts + rope));
  CHECK_EQ(trace_layer_bytes(tr, 1), (uint64_t)(attn + router + experts));
  /* the experts' modules, each with its share of the tokens */
  int expert_inputs = 0;
  for (uint32_t i = 0; i < tr->n_tensors; i++) {
    const trace_tensor *x = &tr->tensors[i];
    if (x->desc.layer == 1 && x->alias_of < 0 && x->desc.phase == FERRY_PHASE_FORWARD &&
        strstr(x->desc.module_path, ".mlp.experts.") && strstr(x->desc.module_path, "gate_proj") &&
        x->desc.kind == FERRY_KIND_ACTIVATION) {
      CHECK_EQ(x->desc.shape[0], (int64_t)t);
      CHECK_EQ(x->desc.shape[1], (int64_t)h);
      expert_inputs++;
    }
  }
  CHECK_EQ(expert_inputs, 4);
  sim_trace_free(tr);
  /* parameters: attention, two norms, QK-norm, router, experts */
  const uint64_t per_layer_attn = (uint64_t)(h * qd + 2 * h * kvd + qd * h + 2 * h + 2 * 48 + h * E);
  const uint64_t base = 2 * (uint64_t)m.vocab * (uint64_t)h + (uint64_t)h; /* final RMSNorm: h */
  CHECK_EQ(synth_param_count(&m), base + 2 * (per_layer_attn + (uint64_t)(E * 3 * h * fe)));
  CHECK_EQ(synth_active_param_count(&m), base + 2 * (per_layer_attn + (uint64_t)(k * 3 * h * fe)));
  /* torchtitan's per-op policy (compiled: what it keeps is packed) */
  m.checkpoint = SYNTH_CKPT_SELECTIVE_OP, m.ckpt_impl = SYNTH_CKPT_IMPL_COMPILED;
  const double sac = 2 * T * h + 2 * T * qd + 2 * T * kvd + 2 * T * qd + 4 * a * T +
                     2 * (2 * t * fe + 2 * t * h) + 2 * (2 * t * fe);
  CHECK_OK(synth_to_trace(&m, &tr));
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)sac);
  CHECK_EQ(trace_layer_bytes(tr, 0), (uint64_t)sac);
  sim_trace_free(tr);
  /* an uneven split: T k mod E tokens go one each to the first experts */
  m.checkpoint = SYNTH_CKPT_OFF, m.ckpt_impl = SYNTH_CKPT_IMPL_AUTO, m.seq = 511, m.micro_batch = 1, m.experts = 3;
  CHECK_OK(synth_to_trace(&m, &tr));
  int64_t rows = 0;
  for (uint32_t i = 0; i < tr->n_tensors; i++) {
    const trace_tensor *x = &tr->tensors[i];
    if (x->desc.layer == 0 && x->alias_of < 0 && x->desc.phase == FERRY_PHASE_FORWARD &&
        strstr(x->desc.module_path, "gate_proj") && x->desc.kind == FERRY_KIND_ACTIVATION) {
      CHECK(x->desc.shape[0] == 340 || x->desc.shape[0] == 341); /* 1022 = 341 + 341 + 340 */
      rows += x->desc.shape[0];
    }
  }
  CHECK_EQ(rows, 511 * 2);
  sim_trace_free(tr);
  return 0;
}

/* ---- the loss working set ------------------------------------------------------ */
/* Bytes of the trace's allocs whose what is `what` (first step). */
static uint64_t alloc_bytes(const sim_trace *t, const char *what) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++)
    if (!strcmp(t->allocs[i].what, what)) n += t->allocs[i].bytes;
  return n;
}

/* Bytes of the activation packs (not aliases) outside the blocks of module
 * mod, or of every activation pack but the head's and the loss's (mod
 * NULL: what the rest of the model holds at the loss). Hugging Face's loss
 * runs in the model's own forward (module ""); Liger's is a module, `loss`. */
static uint64_t outer_pack_bytes(const sim_trace *t, const char *mod) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    const trace_tensor *x = &t->tensors[i];
    if (x->alias_of >= 0 || x->desc.kind != FERRY_KIND_ACTIVATION) continue;
    const char *p = x->desc.module_path ? x->desc.module_path : "";
    int head = !strcmp(p, "lm_head") || !strcmp(p, "loss") || !p[0];
    if (mod ? !strcmp(p, mod) : !head) n += x->desc.bytes;
  }
  return n;
}

static int replay_no_offload(const sim_trace *t, sim_result *r) {
  sim_config c = {0};
  char err[512];
  c.link = sim_hw_preset("h100")->link;
  c.steps = 1;
  int rc = sim_replay(t, &c, r, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  return rc;
}

/* Hugging Face's loss (full) on a small model (T = sb = 256 tokens, V =
 * 1000, h = 256, bf16), by hand: lm_head saves its input 2Th; the logits
 * (2TV) and their fp32 copy (4TV) are transient until the end of forward;
 * log_softmax saves 4TV (nll_loss the same buffer again, an alias), the
 * labels 8T and its total_weight, an fp32 scalar (4 bytes), all in the
 * model's own forward (module "", class LlamaForCausalLM). Backward: nll_loss's gradient 4TV, log_softmax's 4TV while
 * the log-probabilities are held, the copy back 2TV. The peak is at
 * log_softmax's backward: the rest of the model (A) + 2Th + 3 x 4TV.
 * Chunked (Liger, chunk c = next_pow2(ceil(T / ceil(V / h))) = 64): during
 * its forward grad_input 2Th, grad_weight 2Vh, per-token losses 4T and a
 * chunk's logits 2cV; then it saves the two gradients. Its peak: A + 2Th +
 * 2Vh + 4T + 2cV, below full's by 12TV - 2Vh - 4T - 2cV. */
TEST(sim_synth_loss_working_set_full_and_chunked) {
  synth_model m;
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.vocab = 1000, m.seq = 128, m.micro_batch = 2, m.layers = 2;
  /* SGD steps in place: foreach AdamW's transients would put this small
   * model's peak at the optimizer step, past the loss */
  m.optimizer = SYNTH_OPT_SGD;
  /* a narrower MLP (ffn 256): with the weights' gradients written during
   * backward (issue 42 item 6), ffn 512 put the chunked loss's peak 1.5 KB
   * higher in the last block's backward (its down_proj's gradient beside
   * the head's), past the loss's own working set this compares */
  m.ffn = 256;
  const uint64_t T = 256, V = 1000, h = 256, c = 64;
  sim_trace *full = NULL, *chunked = NULL;
  CHECK_OK(synth_to_trace(&m, &full));
  CHECK_EQ(outer_pack_bytes(full, "lm_head"), 2 * T * h);
  CHECK_EQ(outer_pack_bytes(full, ""), 4 * T * V + 8 * T + 4);
  CHECK_EQ(outer_pack_bytes(full, "loss"), 0);
  CHECK_EQ(alloc_bytes(full, "lm_head: logits"), 2 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: logits.float()"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the log-probabilities (nll_loss backward)"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the fp32 logits (log_softmax backward)"), 4 * T * V);
  CHECK_EQ(alloc_bytes(full, "loss: grad of the logits (model dtype)"), 2 * T * V);
  /* and the two blocks' input gradients (2Th each), and (tiny: shard 1)
   * the weights' gradients as each op's backward writes them: 9 ops of each
   * block, the final norm, the head, the embedding */
  CHECK_EQ(alloc_bytes(full, "gradient: block input"), 2 * 2 * T * h);
  CHECK_EQ(full->n_allocs, 7 + 2 * 9 + 3);
  int aliases = 0;
  for (uint32_t i = 0; i < full->n_tensors; i++)
    aliases += full->tensors[i].alias_of >= 0 && !strcmp(full->tensors[i].desc.module_path, "") &&
               !strcmp(full->tensors[i].desc.module_class, "LlamaForCausalLM");
  CHECK_EQ(aliases, 1);
  m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_loss_chunk(&m), (int64_t)c);
  CHECK_OK(synth_to_trace(&m, &chunked));
  CHECK_EQ(outer_pack_bytes(chunked, "lm_head"), 0);
  CHECK_EQ(outer_pack_bytes(chunked, "loss"), 2 * T * h + 2 * V * h);
  CHECK_EQ(alloc_bytes(chunked, "loss: logits of one chunk of tokens"), 2 * c * V);
  CHECK_EQ(alloc_bytes(chunked, "loss: per-token losses (fp32)"), 4 * T);
  /* the rest of the model is the same in both */
  const uint64_t A = outer_pack_bytes(full, NULL);
  CHECK_EQ(outer_pack_bytes(chunked, NULL), A);
  sim_result rf, rc;
  CHECK_OK(replay_no_offload(full, &rf));
  CHECK_OK(replay_no_offload(chunked, &rc));
  CHECK_EQ(rf.peak_saved_bytes, A + 2 * T * h + 12 * T * V);
  CHECK_EQ(rc.peak_saved_bytes, A + 2 * T * h + 2 * V * h + 4 * T + 2 * c * V);
  CHECK_EQ(rf.peak_saved_bytes - rc.peak_saved_bytes, 12 * T * V - 2 * V * h - 4 * T - 2 * c * V);
  CHECK(rf.peak_saved_bytes - rc.peak_saved_bytes > 2 * T * V); /* at least the logits */
  sim_result_free(&rf);
  sim_result_free(&rc);
  sim_trace_free(full);
  sim_trace_free(chunked);
  /* a chunk size of one's own, at most the tokens; only for chunked */
  m.loss_chunk = 100;
  CHECK_EQ(synth_loss_chunk(&m), 100);
  char err[256];
  m.loss_chunk = 257;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "1..tokens");
  m.loss = SYNTH_LOSS_FULL, m.loss_chunk = 8;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  /* Liger's rule on Llama 3 8B at 8192 tokens: ceil(128256 / 4096) = 32, 256 tokens */
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_loss_chunk(&m), 256);
  return 0;
}

/* ---- resident memory from the training knobs --------------------------------------- */
/* The trace's resident bytes named what (0 if none). */
static uint64_t resident_of(const sim_trace *t, const char *what) {
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, what)) return t->resident[i].bytes;
  return 0;
}

/* Whether the trace's first step has a compute event named op. */
static int has_compute_op(const sim_trace *t, const char *op) {
  for (uint32_t k = t->steps[0].first; k < t->steps[0].end; k++)
    if (t->events[k].type == TEV_COMPUTE && t->events[k].op && !strcmp(t->events[k].op, op)) return 1;
  return 0;
}

/* One knob combination's parts against hand arithmetic (bytes per
 * parameter p, g, master, states of the trained share T; shard 1). */
static int check_parts(const synth_model *m, uint64_t P, uint64_t T, uint64_t p, uint64_t g,
                       uint64_t master, uint64_t states) {
  synth_resident r;
  synth_resident_parts(m, &r);
  CHECK_EQ(r.local_params, P);
  CHECK_EQ(r.trainable, T);
  CHECK_EQ(r.params, P * p);
  CHECK_EQ(r.grads, T * g);
  CHECK_EQ(r.master, T * master);
  CHECK_EQ(r.states, states);
  CHECK_EQ(r.gathered, 0);
  CHECK_EQ(r.whole_step, P * p + T * master + states);
  CHECK_EQ(r.total, P * p + T * (g + master) + states);
  CHECK_EQ(synth_resident_bytes(m), r.total);
  return 0;
}

/* Llama 3 8B (P = 8.03e9), shard 1, by hand:
 *  - bf16 parameters and gradients, fp32 master weights, AdamW: 2+2+4+8 = 16
 *    bytes per parameter (the ZeRO paper's mixed-precision Adam);
 *  - adamw8bit: 2+2+4+2, plus two fp32 absmax per 256 values (bitsandbytes'
 *    blockwise states): 8 ceil(P / 256) bytes;
 *  - sgd: 2+2+4; sgd-momentum 2+2+4+4; none 2+2+4 and no optimizer step;
 *  - master weights off: AdamW's states in bf16, 2+2+4;
 *  - fp32 parameters: no master copy (auto), 4+4+8; bf16 gradients 4+2+8;
 *  - LoRA 1%: T = round(0.01 P) trained: 2P + (2+4+8) T;
 *  - tp 2: the blocks' linears, the embedding and the head halved, the
 *    norms (2h per layer and the final RMSNorm's h) kept: P/2 + the norms/2;
 *  - shard 8: every part / 8; gathered, the most FSDP holds at once: the
 *    final norm with the head (h + V/2 h) and the last block (its linears
 *    / 2 + its norms 2h) in bf16, in the loss's backward. */
TEST(sim_synth_resident_knobs_match_hand_arithmetic) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1;
  const uint64_t P = synth_param_count(&m);
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 8 * P), 0);
  CHECK_EQ(synth_resident_bytes(&m), 16 * P);
  m.optimizer = SYNTH_OPT_ADAMW_8BIT;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 2 * P + 8 * ((P + 255) / 256)), 0);
  m.optimizer = SYNTH_OPT_SGD;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 0), 0);
  m.optimizer = SYNTH_OPT_SGD_MOMENTUM;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 4 * P), 0);
  m.optimizer = SYNTH_OPT_NONE;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 4, 0), 0);
  m.optimizer = SYNTH_OPT_ADAMW;
  m.master_weights = SYNTH_MASTER_OFF;
  CHECK_EQ(check_parts(&m, P, P, 2, 2, 0, 4 * P), 0);
  m.master_weights = SYNTH_MASTER_AUTO;
  m.param_dtype = FERRY_DTYPE_F32;
  CHECK_EQ(check_parts(&m, P, P, 4, 4, 0, 8 * P), 0);
  m.grad_dtype = FERRY_DTYPE_BF16;
  CHECK_EQ(check_parts(&m, P, P, 4, 2, 0, 8 * P), 0);
  char err[256];
  m.master_weights = SYNTH_MASTER_ON; /* fp32 parameters are their own master copy */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "master weights on");
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  m.shard = 1;
  m.lora = 0.01;
  const uint64_t T = (uint64_t)llround(0.01 * (double)P);
  CHECK_EQ(check_parts(&m, P, T, 2, 2, 4, 8 * T), 0);
  m.lora = 0;
  m.tp = 2;
  const uint64_t norms = (uint64_t)m.layers * 2 * (uint64_t)m.hidden + (uint64_t)m.hidden;
  const uint64_t P2 = (P - norms) / 2 + norms;
  CHECK_EQ(check_parts(&m, P2, P2, 2, 2, 4, 8 * P2), 0);
  /* sharded: each part over 8, and the head's unit with a block gathered
   * (tp 2: the head's vocabulary and the block's linears halved) */
  m.shard = 8;
  synth_resident r;
  synth_resident_parts(&m, &r);
  const uint64_t h = (uint64_t)m.hidden, kvd = 1024, f = (uint64_t)m.ffn;
  const uint64_t block = 2 * h * h + 2 * h * kvd + 3 * h * f;
  CHECK_EQ(r.params, P2 * 2 / 8);
  CHECK_EQ(r.states, P2 * 8 / 8);
  CHECK_EQ(r.gathered, ((h + 64128 * h) + (block / 2 + 2 * h)) * 2);
  /* the trace declares the parts, master weights apart from the states,
   * and skips the optimizer step without an optimizer */
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.optimizer = SYNTH_OPT_ADAMW_8BIT;
  m.lora = 0.25;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  synth_resident_parts(&m, &r);
  CHECK_EQ(resident_of(t, "parameters"), r.params);
  CHECK_EQ(resident_of(t, "gradients"), r.grads);
  CHECK_EQ(resident_of(t, "master weights"), r.master);
  CHECK_EQ(resident_of(t, "optimizer states"), r.states);
  /* the gradients line is transient: the step's allocs hold them */
  CHECK_EQ(t->resident_bytes, r.whole_step);
  CHECK(has_compute_op(t, "optimizer"));
  sim_trace_free(t);
  m.optimizer = SYNTH_OPT_NONE;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK(!has_compute_op(t, "optimizer"));
  sim_trace_free(t);
  m.lora = 1.5;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  return 0;
}

/* Korthikanti et al. 2022 with tensor parallelism t (section 4.2, Table
 * 2): a GPT layer stores sbh (10 + 24/t + 5as/(ht)) bytes: the layer
 * norms' inputs (4sbh), the QKV and first MLP linear's inputs (4sbh) and
 * the two dropout masks (2sbh) are outside the tensor-parallel region, the
 * rest split t ways. With sequence parallelism (4.2.2, Table 2) the 10sbh
 * are split along the sequence too: sbh/t (34 + 5as/h). Plus the synthesizer's extras: the
 * norms' statistics (16sb, split with sequence parallelism) and, with
 * FlashAttention, the log-sum-exp (4asb/t). Llama: every saved tensor is
 * split with tp and sp, so a layer keeps exactly 1/t, but for the rotary
 * tables (cos, sin: 4 s head_dim), which every rank holds whole. */
TEST(sim_synth_tensor_parallel_matches_korthikanti) {
  synth_model m;
  CHECK_EQ(synth_preset("gpt3-1.3b", &m), 0);
  m.seq = 512, m.micro_batch = 2, m.layers = 2, m.tp = 4;
  const double s = m.seq, b = m.micro_batch, h = m.hidden, a = m.heads, t = 4;
  for (int sp = 0; sp <= 1; sp++)
    for (int flash = 0; flash <= 1; flash++) {
      m.sp = sp, m.flash = flash;
      double eq = sp ? s * b * h / t * (34 + (flash ? 0 : 5 * a * s / h))
                     : s * b * h * (10 + 24 / t + (flash ? 0 : 5 * a * s / (h * t)));
      double extras = 16 * s * b / (sp ? t : 1) + (flash ? 4 * a * s * b / t : 0);
      CHECK_EQ(synth_layer_activation_bytes(&m), (uint64_t)(eq + extras));
      sim_trace *tr = NULL;
      CHECK_OK(synth_to_trace(&m, &tr));
      CHECK_EQ(trace_layer_bytes(tr, 1), (uint64_t)(eq + extras));
      sim_trace_free(tr);
    }
  /* full checkpointing keeps the block's input: its sequence share with sp */
  m.checkpoint = SYNTH_CKPT_FULL;
  CHECK_EQ(synth_layer_saved_bytes(&m, 0), (uint64_t)(2 * s * b * h / t));
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  const uint64_t whole = synth_layer_activation_bytes(&m), rope = 4 * 8192 * 128;
  m.tp = 8, m.sp = 1;
  CHECK_EQ((synth_layer_activation_bytes(&m) - rope) * 8, whole - rope);
  /* the head is vocab-parallel: the logits and the saved log-probabilities
   * are V/t per rank */
  CHECK_EQ(synth_preset("tiny", &m), 0);
  m.tp = 2;
  sim_trace *tr = NULL;
  CHECK_OK(synth_to_trace(&m, &tr));
  const uint64_t T = (uint64_t)m.seq, Vt = (uint64_t)m.vocab / 2;
  CHECK_EQ(alloc_bytes(tr, "lm_head: logits"), 2 * T * Vt);
  CHECK_EQ(outer_pack_bytes(tr, ""), 4 * T * Vt + 8 * T); /* no total_weight: Megatron's loss */
  sim_trace_free(tr);
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  char err[256];
  m.tp = 3; /* 32 heads */
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "must divide heads");
  m.tp = 1, m.sp = 1;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "needs tp > 1");
  m.tp = 2, m.sp = 0, m.loss = SYNTH_LOSS_CHUNKED;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "chunked loss");
  CHECK_EQ(synth_preset("mixtral-8x7b", &m), 0);
  m.tp = 2;
  CHECK_EQ(synth_validate(&m, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "experts");
  return 0;
}

/* ---- replays ------------------------------------------------------------------- */
/* Six 100000-byte tensors, all offloaded (recorded decisions), link 1000
 * B/us, no latency. D2H copies run back to back: [0,100] .. [500,600]. The
 * fifth and sixth packs push the stash past 4: the host waits for copies 1
 * and 2 (until 200: 200 us of host wait). 1000 us of compute, then backward
 * unpacks 6..3 from the stash and reloads 2 and 1: 100 us each, exposed. */
static const char *six_tensors(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s", HDR BEGIN);
  for (int i = 1; i <= 6; i++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","
                  "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
                  "\"layers\":6,\"decision\":\"offload\"}\n", i, i - 1);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":1000}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n");
  for (int i = 6; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n", i);
  snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

/* The floor at the peak a step with offloading reaches in backward
 * (docs/sim-model.md, "Stall floor"). Four 100000-byte offloads with 50 us
 * of compute after each, a forward stash of one buffer; backward begins
 * with a 300000-byte transient (the loss's gradients) for bwd_us of compute
 * before the unpacks. Link 1000 B/us, no latency. The engine: copies
 * [0,100] .. [300,400]; packs 2..4 wait 50 us each for the copy ahead of
 * them (150 us of host wait), forward ends at 350 with copy 4 in flight, so
 * the peak is 100000 + 300000 at the transient; backward unpacks 4 from
 * the stash and reloads 3, 2 and 1 on use, after the compute (300 us).
 * Any schedule at that peak must have copied D + T - P = 400000 + 300000 -
 * 400000 B (300 us) by the transient, with 200 us of compute since the
 * first offload to hide it: 100 us of stall before it. After it, the three
 * reloads (300 us) have bwd_us of compute to hide behind, and whatever was
 * reloaded before the transient took room that uncopied bytes would
 * otherwise have had: 100 + max(0, 300 - bwd_us). Forward's packs alone
 * (the peak is above D there) say 0, and reloads from backward's start,
 * ignoring the transient, max(0, 300 - bwd_us). */
static const char *loss_at_backward(int bwd_us) {
  static char buf[4096];
  int n = four_offloads_50us_apart(buf, sizeof buf);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"backward_begin\",\"t_us\":0}\n" ALLOC(9, 300000)
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":%d}\n" FREE(9), bwd_us);
  for (int i = 4; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n", i);
  snprintf(buf + n, sizeof buf - (size_t)n, "{\"ev\":\"backward_end\",\"t_us\":0}\n" END);
  return buf;
}

TEST(sim_floor_holds_at_backwards_transients) {
  static const struct { int bwd_us; double floor; } cases[] = {{400, 100.0}, {100, 300.0}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    const char *text = loss_at_backward(cases[k].bwd_us);
    sim_trace *t = NULL;
    char err[512];
    CHECK_OK(sim_trace_parse("loss", text, strlen(text), &t, err, sizeof err));
    sim_config c = hand_config(1);
    c.policy_source = "return { api = 1, name = 'stash1', knobs = { max_fwd_stash = 1 },\n"
                      "  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }";
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_EQ(r.peak_saved_bytes, 400000);
    CHECK_NEAR(r.host_wait_us, 150.0, 1e-6);
    CHECK_NEAR(r.stall_us, 300.0, 1e-6);
    CHECK_NEAR(r.bytes_h2d, 300000, 0);
    CHECK_NEAR(r.stall_floor_us, cases[k].floor, 1e-6);
    CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
    sim_result_free(&r);
    sim_trace_free(t);
  }
  return 0;
}

TEST(sim_replay_matches_hand_computed_times) {
  const char *text = six_tensors();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  /* one step: from the second on, the engine's forward-stash ring still holds
   * the previous step's unpacked slots (reported to the lead), which adds
   * host waits */
  sim_config c = hand_config(1);
  c.replay_decisions = 1;
  c.timeline = 1;
  c.record_decisions = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.host_wait_us, 200.0, 1e-6);
  CHECK_NEAR(r.stall_us, 200.0, 1e-6);
  CHECK_NEAR(r.step_us, 1400.0, 1e-6);
  CHECK_NEAR(r.bytes_d2h, 600000, 0);
  CHECK_NEAR(r.bytes_h2d, 200000, 0);
  CHECK_NEAR(r.stash_hits, 4, 0);
  CHECK_NEAR(r.tensors_offloaded, 6, 0);
  CHECK_EQ(r.n_decisions, 6);
  for (uint32_t i = 0; i < 6; i++) CHECK_EQ(r.decisions[i], 1);
  /* device memory: in forward the stash holds at most 4 + the one being
   * packed (500000); backward's six unpacks have no compute between them, so
   * they are one op's saved tensors, all held until it ran: 600000 */
  CHECK_EQ(r.peak_saved_bytes, 600000);
  /* per layer: the stall belongs to layers 1 and 0 (the reloaded ones) */
  CHECK_NEAR(r.layers[1].stall_us, 100.0, 1e-6);
  CHECK_NEAR(r.layers[2].stall_us, 100.0, 1e-6);
  CHECK_NEAR(r.layers[3].stall_us, 0, 1e-6);
  /* the floor: the sixth pack (no compute since the first offload) finds
   * 600000 B offloaded against the step's 600000 B peak (backward's), so
   * nothing had to be copied by then; backward's first two unpacks (the
   * four later ones were stash hits) need 200000 B (200 us) with no compute
   * to hide them */
  CHECK_NEAR(r.stall_floor_us, 200.0, 1e-6);
  CHECK(r.stall_us + r.host_wait_us >= r.stall_floor_us);
  /* the timeline: 6 D2H and 2 H2D copies, the compute interval */
  int d2h = 0, h2d = 0;
  for (size_t i = 0; i < r.tl.n_iv; i++) d2h += r.tl.iv[i].lane == 1, h2d += r.tl.iv[i].lane == 2;
  CHECK_EQ(d2h, 6);
  CHECK_EQ(h2d, 2);
  CHECK_NEAR(r.tl.t_end - r.tl.t_begin, 1400.0, 1e-6);
  /* the waits on it: the host's for copies 1 and 2 in forward ([0, 200]),
   * the compute stream's for the reloads of 2 and 1 after the compute
   * ([1200, 1400], layers 1 and 0) */
  double copies = 0, reloads = 0, t0 = r.tl.t_begin;
  for (size_t i = 0; i < r.tl.n_waits; i++) {
    const sim_wait *w = &r.tl.waits[i];
    CHECK(w->t1 > w->t0);
    if (w->kind == SIM_WAIT_COPIES) {
      copies += w->t1 - w->t0;
      CHECK(w->t0 >= t0 - 1e-6 && w->t1 <= t0 + 200 + 1e-6);
    } else {
      CHECK_EQ(w->kind, SIM_WAIT_RELOAD);
      reloads += w->t1 - w->t0;
      CHECK(w->t0 >= t0 + 1200 - 1e-6 && w->t1 <= t0 + 1400 + 1e-6);
      CHECK(w->layer == 0 || w->layer == 1);
    }
  }
  CHECK_NEAR(copies, 200.0, 1e-6);
  CHECK_NEAR(reloads, 200.0, 1e-6);
  /* pinned host memory: the largest sample is the arena's peak, and it is
   * back to none by the step's end */
  uint64_t most = 0;
  for (size_t i = 0; i < r.tl.n_host; i++)
    if (r.tl.host[i].bytes > most) most = r.tl.host[i].bytes;
  CHECK(r.tl.n_host >= 2);
  CHECK_EQ(most, r.peak_host_bytes);
  CHECK_EQ(r.tl.host[r.tl.n_host - 1].bytes, 0);
  sim_result_free(&r);

  /* the baseline keeps everything: no copies, no stall, compute only */
  c.replay_decisions = 0;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, 1000.0, 1e-6);
  CHECK_NEAR(r.stall_us + r.host_wait_us, 0, 0);
  CHECK_EQ(r.peak_saved_bytes, 600000);
  CHECK_STR_CONTAINS(r.label, "no offload");
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

static const char *policy_dir(void) {
  static char dir[1024];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *s = strrchr(dir, '/');
  if (s) *s = 0;
  else snprintf(dir, sizeof dir, ".");
  strncat(dir, "/../policies", sizeof dir - strlen(dir) - 1);
  return dir;
}

/* The shipped policies on a synthesized Llama: every policy reduces memory
 * against the baseline, results are deterministic, and reports are written. */
TEST(sim_replay_policies_on_synthesized_llama) {
  synth_model m;
  synth_preset("tiny", &m);
  /* SGD: foreach AdamW's transients would put tiny's peak at the optimizer
   * step, which no policy reaches */
  m.optimizer = SYNTH_OPT_SGD;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  CHECK(hw);
  static const char *const names[] = {"default", "layers", "budget"};
  sim_result rs[4];
  char err[512];
  for (int i = 0; i < 4; i++) {
    sim_config c = {0};
    c.link = hw->link;
    c.duplex_d2h = hw->duplex_d2h;
    c.duplex_h2d = hw->duplex_h2d;
    c.steps = 3;
    c.timeline = 1;
    char path[1200];
    if (i) {
      snprintf(path, sizeof path, "%s/%s.lua", policy_dir(), names[i - 1]);
      c.policy_path = path;
    }
    int rc = sim_replay(t, &c, &rs[i], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
  }
  CHECK_EQ(rs[0].bytes_d2h, 0);
  CHECK_EQ(rs[0].peak_device_bytes, t->resident_bytes + rs[0].peak_saved_bytes);
  for (int i = 1; i < 4; i++) {
    CHECK(rs[i].peak_device_bytes < rs[0].peak_device_bytes);
    CHECK(rs[i].bytes_d2h > 0);
    CHECK(rs[i].step_us >= rs[0].step_us);
    CHECK_EQ(rs[i].policy_errors, 0);
    CHECK(rs[i].peak_host_bytes > 0 && rs[i].host_reserved_bytes >= rs[i].peak_host_bytes);
    /* the floor is a lower bound of what the engine's schedule exposes */
    CHECK(rs[i].stall_us + rs[i].host_wait_us >= rs[i].stall_floor_us);
  }
  /* layers.lua offloads only its first layers */
  CHECK(rs[2].layers[1].offloaded_bytes > 0);
  CHECK_EQ(rs[2].layers[m.layers].offloaded_bytes, 0);
  /* deterministic */
  sim_config c = {0};
  c.link = hw->link;
  c.steps = 3;
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  c.policy_path = path;
  c.duplex_d2h = hw->duplex_d2h;
  c.duplex_h2d = hw->duplex_h2d;
  sim_result again;
  CHECK_OK(sim_replay(t, &c, &again, err, sizeof err));
  CHECK_NEAR(again.step_us, rs[1].step_us, 0);
  CHECK_NEAR(again.stall_us, rs[1].stall_us, 0);
  CHECK_EQ(again.peak_device_bytes, rs[1].peak_device_bytes);
  sim_result_free(&again);

  /* reports */
  char dir[] = "/tmp/ferry-sim-test-XXXXXX";
  CHECK(mkdtemp(dir));
  char json[128], chrome[128], svg[128], html[128];
  snprintf(json, sizeof json, "%s/r.json", dir);
  snprintf(chrome, sizeof chrome, "%s/c.json", dir);
  snprintf(svg, sizeof svg, "%s/m.svg", dir);
  snprintf(html, sizeof html, "%s/r.html", dir);
  sim_run_info info = {.trace_path = "tiny.jsonl", .trace = t, .hw = hw};
  CHECK_EQ(sim_write_json(json, &info, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_chrome_trace(chrome, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_svg(svg, &info, rs, 4, err, sizeof err), 0);
  CHECK_EQ(sim_write_html(html, &info, rs, 4, err, sizeof err), 0);
  FILE *f = fopen(json, "r");
  CHECK(f);
  char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  static const char *const keys[] = {"\"peak_device_bytes\"", "\"peak_device_bytes_baseline\"",
                                     "\"step_us\"", "\"step_us_baseline\"", "\"stall_us\"",
                                     "\"bytes_d2h\"", "\"bytes_h2d\"", "\"peak_host_bytes\"",
                                     "\"policy_errors\"", "\"policies\"", "\"layers\""};
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) CHECK_STR_CONTAINS(text, keys[k]);
  f = fopen(chrome, "r");
  CHECK(f);
  n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(text, "\"traceEvents\"");
  CHECK_STR_CONTAINS(text, "\"D2H copies\"");
  CHECK_STR_CONTAINS(text, "\"H2D copies\"");
  CHECK_STR_CONTAINS(text, "\"device memory\"");
  CHECK_STR_CONTAINS(text, "\"offload -> reload\""); /* flow arrows */
  /* the SVG and the HTML whole (tests/cli/test_sim_plots.py checks them
   * through the CLI) */
  static char big[1 << 20];
  f = fopen(svg, "r");
  CHECK(f);
  n = fread(big, 1, sizeof big - 1, f);
  CHECK(n < sizeof big - 1);
  big[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(big, "<svg");
  CHECK_STR_CONTAINS(big, "device memory in use (MiB)"); /* the tiny model's scale */
  CHECK_STR_CONTAINS(big, "pinned host memory in use (MiB)"); /* the right axis */
  CHECK_STR_CONTAINS(big, "time since the step's start (ms)");
  CHECK_STR_CONTAINS(big, ">backward starts"); /* the forward/backward boundary */
  CHECK_STR_CONTAINS(big, "class=\"backward\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"device-curve\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"host-curve\" data-run=\"budget\"");
  CHECK_STR_CONTAINS(big, "class=\"stall reload\" data-run=\"default\"");
  CHECK_STR_CONTAINS(big, "class=\"peak device\" data-run=\"no offload\"");
  f = fopen(html, "r");
  CHECK(f);
  n = fread(big, 1, sizeof big - 1, f);
  CHECK(n < sizeof big - 1);
  big[n] = 0;
  fclose(f);
  CHECK_STR_CONTAINS(big, "<!DOCTYPE html>");
  CHECK_STR_CONTAINS(big, "<tr data-run=\"layers\">");
  CHECK_STR_CONTAINS(big, "<svg width=");
  CHECK(!strstr(big, "http://") && !strstr(big, "https://"));
  unlink(json);
  unlink(chrome);
  unlink(svg);
  unlink(html);
  rmdir(dir);
  for (int i = 0; i < 4; i++) sim_result_free(&rs[i]);
  sim_trace_free(t);
  return 0;
}

TEST(sim_link_presets_and_syntax) {
  const sim_hw *h = sim_hw_preset("h100");
  CHECK(h && sim_hw_preset("H200") && sim_hw_preset("a100") && sim_hw_preset("gh200"));
  CHECK(!sim_hw_preset("tpu"));
  CHECK_NEAR(h->link.h2d_bytes_per_s, 55e9, 0);
  sim_hw x = *h;
  char err[256];
  CHECK_EQ(sim_parse_link("h2d=12.5GB/s,d2h=800MB/s,latency=2ms,duplex=0.5", &x, err, sizeof err), 0);
  CHECK_NEAR(x.link.h2d_bytes_per_s, 12.5e9, 1);
  CHECK_NEAR(x.link.d2h_bytes_per_s, 800e6, 1);
  CHECK_NEAR(x.link.latency_us, 2000, 1e-9);
  CHECK_NEAR(x.duplex_h2d, 0.5, 0);
  CHECK_EQ(sim_parse_link("h2d=fast", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link h2d fast: not a number; expected a bandwidth");
  CHECK_EQ(sim_parse_link("duplex=1.5", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link duplex 1.5: must be above 0 and at most 1");
  /* the shared parser's bounds: no absurd links, no bare numbers */
  CHECK_EQ(sim_parse_link("h2d=1e-300GB/s", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link h2d 1e-300GB/s: must be between 0.001 GB/s and 1e+05 GB/s");
  CHECK_EQ(sim_parse_link("d2h=55", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link d2h 55: needs a unit; expected a bandwidth");
  CHECK_EQ(sim_parse_link("latency=2s", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "--link latency 2s: must be between 0 us and 1 s");
  CHECK_EQ(sim_parse_link("duplex=nan", &x, err, sizeof err), -1);
  CHECK_EQ(sim_parse_link("warp=9", &x, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, "unknown key \"warp\"");
  return 0;
}

/* The same trace and policy through the host backend (real threads, real
 * bytes, the link throttled to the h100 figures slowed down SCALE times, and
 * compute slowed down as much) and through the sim: identical decisions and
 * bytes moved; step time within 30% and stall within 20% of the step time.
 * The host backend runs real threads, which the sim does not model: their
 * wake-ups, the engine's CPU time per call and, on a loaded machine,
 * preemption. Measured on 2 cores at load average 5.5: step +3..25%, stall
 * +3..17% of the step; idle: step +5%, stall +2%. */
TEST(sim_consistent_with_host_backend) {
  /* The host side runs on wall-clock time: under a sanitizer or valgrind
   * its threads run several times slower than the link model assumes, so
   * the timing comparison only means something in a plain build. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  printf("skipped: timing comparison is meaningless under a sanitizer\n");
  return 0;
#endif
  if (RUNNING_ON_VALGRIND) {
    printf("skipped: timing comparison is meaningless under valgrind\n");
    return 0;
  }
  const double SCALE = 400;
  synth_model m;
  synth_preset("tiny", &m);
  m.layers = 3;
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  char path[1200], err[512];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result r[2];
  for (int host = 0; host < 2; host++) {
    sim_config c = {0};
    c.link = hw->link;
    c.link.duplex = hw->duplex_h2d; /* the host backend has one duplex factor */
    c.steps = 2;
    c.policy_path = path;
    c.record_decisions = 1;
    if (host) {
      c.host_backend = 1;
      c.host_time_scale = SCALE;
      c.link.h2d_bytes_per_s /= SCALE;
      c.link.d2h_bytes_per_s /= SCALE;
      c.link.latency_us *= SCALE;
    }
    int rc = sim_replay(t, &c, &r[host], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
  }
  CHECK_STR_CONTAINS(r[1].backend, "host");
  CHECK_EQ(r[0].n_decisions, r[1].n_decisions);
  CHECK(r[0].n_decisions > 0);
  CHECK_EQ(memcmp(r[0].decisions, r[1].decisions, r[0].n_decisions), 0);
  CHECK_NEAR(r[0].bytes_d2h, r[1].bytes_d2h, 0);
  CHECK_NEAR(r[0].bytes_h2d, r[1].bytes_h2d, 0);
  fprintf(stderr, "sim: step %.1f us stall %.1f us; host: step %.1f us stall %.1f us\n",
          r[0].step_us, r[0].stall_us + r[0].host_wait_us, r[1].step_us,
          r[1].stall_us + r[1].host_wait_us);
  CHECK_NEAR(r[1].step_us, r[0].step_us, 0.30 * r[0].step_us);
  CHECK_NEAR(r[1].stall_us + r[1].host_wait_us, r[0].stall_us + r[0].host_wait_us,
             0.20 * r[0].step_us);
  sim_result_free(&r[0]);
  sim_result_free(&r[1]);
  sim_trace_free(t);
  return 0;
}

/* ---- the fuzz corpus, replayed in every run ---------------------------------------- */
#include <dirent.h>

#include "fuzz/fuzz_trace_reader.c"

TEST(sim_fuzz_corpus_replays_clean) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *s = strrchr(dir, '/');
  if (s) *s = 0;
  else snprintf(dir, sizeof dir, ".");
  strncat(dir, "/fuzz/corpus", sizeof dir - strlen(dir) - 1);
  DIR *d = opendir(dir);
  CHECK(d);
  int files = 0;
  for (struct dirent *de; (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *buf = malloc((size_t)n + 1);
    CHECK(buf);
    CHECK_EQ(fread(buf, 1, (size_t)n, f), n);
    fclose(f);
    CHECK_EQ(fuzz_trace_reader_one(buf, (size_t)n), 0); /* aborts on a bad outcome */
    free(buf);
    files++;
  }
  closedir(d);
  CHECK(files >= 10);
  return 0;
}

/* The policy-quality figures of the closing note, pinned on the virtual
 * clock (deterministic): on the Llama-3-8B-like trace at seq 8192 on h100,
 * budget.lua reaches at least default.lua's peak reduction with well under
 * half its exposed stall. (The issue's 1/5 is below what the link allows
 * here: docs/sim-validation.md, "Policy quality".) */
TEST(sim_budget_beats_default_on_llama3_8b) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  CHECK_EQ(m.seq, 8192);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  const sim_hw *hw = sim_hw_preset("h100");
  CHECK(hw);
  static const char *const names[] = {"default", "budget"};
  sim_result rs[2];
  char err[512];
  for (int i = 0; i < 2; i++) {
    sim_config c = {0};
    c.link = hw->link;
    c.duplex_d2h = hw->duplex_d2h;
    c.duplex_h2d = hw->duplex_h2d;
    c.steps = 3;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.lua", policy_dir(), names[i]);
    c.policy_path = path;
    int rc = sim_replay(t, &c, &rs[i], err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_EQ(rs[i].policy_errors, 0);
  }
  /* exposed stall = reload waits of the compute stream + host waits */
  double stall[2];
  for (int i = 0; i < 2; i++) stall[i] = rs[i].stall_us + rs[i].host_wait_us;
  printf("  default: peak %.2f GiB, stall %.1f ms; budget: peak %.2f GiB, stall %.1f ms\n",
         rs[0].peak_device_bytes / 1073741824.0, stall[0] / 1e3,
         rs[1].peak_device_bytes / 1073741824.0, stall[1] / 1e3);
  CHECK(rs[1].peak_device_bytes <= rs[0].peak_device_bytes);
  CHECK(stall[1] < 0.5 * stall[0]);
  /* the link-bound floor: the forward copies 40 GiB at 55 GB/s against a
   * 0.4 s forward pass, so it is hundreds of ms, and below both stalls */
  for (int i = 0; i < 2; i++) {
    CHECK(rs[i].stall_floor_us > 1e5);
    CHECK(stall[i] >= rs[i].stall_floor_us);
  }
  for (int i = 0; i < 2; i++) sim_result_free(&rs[i]);
  sim_trace_free(t);
  return 0;
}

/* Replays the tiny synthesized model on h100 under c (link filled in). */
static int replay_tiny(sim_config *c, sim_result *out) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *t = NULL;
  if (synth_to_trace(&m, &t)) return -1;
  const sim_hw *hw = sim_hw_preset("h100");
  c->link = hw->link;
  char err[512];
  int rc = sim_replay(t, c, out, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  sim_trace_free(t);
  return rc;
}

/* Host RAM in a simulation is the simulated host's (host_ram_bytes), read
 * through the engine's host_ram callback: a policy that offloads only while
 * host RAM is under 50% in use sees 0% on a big host and 100% on one smaller
 * than what the arena pinned in step 1 — whatever the machine running it. */
TEST(sim_host_ram_is_the_simulated_hosts) {
  static const char src[] =
      "return { api = 1, decide = function(t, ctx)\n"
      "  if t.bytes >= 1024 and t.kind == ferry.ACTIVATION and ctx.host_ram_used_pct < 50 then\n"
      "    return ferry.OFFLOAD end\n"
      "  return ferry.KEEP end }\n";
  sim_result big, small, again;
  sim_config c = {0};
  c.steps = 3;
  c.policy_source = src;
  c.host_ram_bytes = 1ull << 40;
  CHECK_OK(replay_tiny(&c, &big));
  CHECK_OK(replay_tiny(&c, &again));
  c.host_ram_bytes = 1 << 20;
  CHECK_OK(replay_tiny(&c, &small));
  CHECK_EQ(big.host_ram_bytes, 1ull << 40);
  CHECK_EQ(small.host_ram_bytes, 1 << 20);
  CHECK(big.bytes_d2h > 0);
  CHECK_EQ(small.bytes_d2h, 0); /* steps 2..3: the 1 MiB host is full */
  CHECK_EQ(big.bytes_d2h, again.bytes_d2h);
  CHECK_EQ(big.peak_device_bytes, again.peak_device_bytes);
  /* no size given: the documented default, not /proc/meminfo */
  c.host_ram_bytes = 0;
  sim_result_free(&again);
  CHECK_OK(replay_tiny(&c, &again));
  CHECK_EQ(again.host_ram_bytes, SIM_DEFAULT_HOST_RAM);
  CHECK_EQ(again.bytes_d2h, big.bytes_d2h);
  sim_result_free(&big);
  sim_result_free(&small);
  sim_result_free(&again);
  return 0;
}

/* Pinned allocation cost: with the pool (the engine's arena) step 1 pays
 * for the arena's growth (allocation + first touch) and steady steps pay
 * nothing; without one every offload pays an allocation, every step. */
TEST(sim_pinned_pool_vs_no_pool) {
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result free_, pool, nopool;
  sim_config c = {0};
  c.steps = 3;
  c.policy_path = path;
  CHECK_OK(replay_tiny(&c, &free_));
  c.pinned_alloc_us = 3000;
  c.pinned_touch_bytes_per_s = 2.5e9;
  CHECK_OK(replay_tiny(&c, &pool));
  c.pinned_no_pool = 1;
  CHECK_OK(replay_tiny(&c, &nopool));
  CHECK_EQ(free_.pinned_alloc_us, 0);
  CHECK_EQ(pool.pinned_alloc_us, 0);            /* steady steps reuse the pool */
  CHECK(pool.first_step_us >= free_.first_step_us + 3000); /* step 1 grew it */
  CHECK_NEAR(pool.step_us, free_.step_us, 1e-6 * free_.step_us);
  CHECK(pool.bytes_d2h > 0);
  double want = nopool.tensors_offloaded * 3000; /* per call; first touch is the pool's */
  CHECK_NEAR(nopool.pinned_alloc_us, want, 1e-6 * want);
  CHECK(nopool.step_us >= free_.step_us + 0.5 * want);
  sim_result_free(&free_);
  sim_result_free(&pool);
  sim_result_free(&nopool);
  return 0;
}

/* --warmup: the steady figures leave out the warmup steps, the first step
 * is reported alone, and the peak is the steady steps'. */
TEST(sim_warmup_steps_and_first_step) {
  char path[1200];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result w1, w3, none;
  sim_config c = {0};
  c.steps = 4;
  c.policy_path = path;
  c.pinned_alloc_us = 3000; /* makes step 1 distinctly slower */
  CHECK_OK(replay_tiny(&c, &w1));
  c.warmup = 3;
  CHECK_OK(replay_tiny(&c, &w3));
  c.warmup = -1;
  CHECK_OK(replay_tiny(&c, &none));
  CHECK_EQ(w1.warmup, 1);
  CHECK_EQ(w3.warmup, 3);
  CHECK_EQ(none.warmup, 0);
  CHECK_NEAR(w1.step_us, w3.step_us, 1e-6 * w1.step_us);
  CHECK(w1.first_step_us > w1.step_us + 3000);
  /* with no warmup step 1 is in the mean */
  CHECK_NEAR(none.step_us, (w1.first_step_us + 3 * w1.step_us) / 4, 1e-6 * w1.step_us);
  CHECK(w1.first_step_peak_device_bytes > 0);
  CHECK(none.peak_device_bytes >= w1.peak_device_bytes);
  CHECK(none.peak_device_bytes >= w1.first_step_peak_device_bytes);
  sim_result_free(&w1);
  sim_result_free(&w3);
  sim_result_free(&none);
  return 0;
}

/* sim_fit on the tiny model: the chosen setting fits (checked again by
 * replaying the policy it writes), and no setting in the search space with
 * a lower step time fits. */
TEST(sim_fit_picks_the_cheapest_setting_that_fits) {
  synth_model m;
  synth_preset("tiny", &m);
  m.optimizer = SYNTH_OPT_SGD; /* the peak where policies act (as above) */
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  char path[1200];
  snprintf(path, sizeof path, "%s/host_budget.lua", policy_dir());
  FILE *f = fopen(path, "rb");
  CHECK(f);
  static char tmpl[16384];
  size_t n = fread(tmpl, 1, sizeof tmpl - 1, f);
  fclose(f);
  tmpl[n] = 0;
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config base = {0};
  base.link = hw->link;
  base.steps = 4;
  base.warmup = 2;
  sim_result none;
  char err[512];
  CHECK_OK(sim_replay(t, &base, &none, err, sizeof err));
  /* a device 5% smaller than the no-offload peak: offloading is needed */
  sim_fit_config fc = {0};
  fc.policy_template = tmpl;
  fc.replay = base;
  fc.device_bytes = none.peak_device_bytes - none.peak_device_bytes / 20;
  fc.host_bytes = 64u << 20;
  sim_fit_result fr;
  int rc = sim_fit(t, &fc, &fr, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK(fr.n > 100);
  CHECK(fr.best >= 0);
  const sim_fit_setting *b = &fr.settings[fr.best];
  CHECK(b->fits && b->host_bytes > 0);
  CHECK(b->peak_device_bytes <= fc.device_bytes && b->host_reserved_bytes <= fc.host_bytes);
  int fitting = 0;
  for (uint32_t i = 0; i < fr.n; i++) {
    const sim_fit_setting *s = &fr.settings[i];
    fitting += s->fits;
    if (s->step_us < b->step_us) CHECK(!s->fits);
    CHECK_EQ(s->fits, s->peak_device_bytes <= fc.device_bytes &&
                          s->host_reserved_bytes <= fc.host_bytes);
  }
  CHECK(fitting > 1 && fitting < (int)fr.n); /* the target separates the grid */
  /* the written policy replays to the same figures */
  char *src = sim_fit_source(tmpl, b);
  CHECK(src);
  sim_config c = base;
  c.policy_source = src;
  sim_result r;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.peak_device_bytes, b->peak_device_bytes);
  CHECK_NEAR(r.step_us, b->step_us, 1e-9 * b->step_us);
  /* a device smaller than anything reachable: nothing fits */
  fc.device_bytes = t->resident_bytes;
  sim_fit_result none_fits;
  CHECK_OK(sim_fit(t, &fc, &none_fits, err, sizeof err));
  CHECK_EQ(none_fits.best, -1);
  free(src);
  sim_result_free(&r);
  sim_result_free(&none);
  sim_fit_result_free(&fr);
  sim_fit_result_free(&none_fits);
  sim_trace_free(t);
  return 0;
}

/* A recorded trace carries resident memory and FLOPs (ferry_trace_resident,
 * ferry_trace_flops); replayed with a GPU's achieved TFLOP/s its compute
 * takes flops / rate whatever the recording machine's speed; without FLOPs
 * the report says the times are the recording machine's. */
TEST(sim_recorded_trace_flops_and_resident) {
  test_device_stats st = {0};
  char path[32], err[512];
  ferry_engine *e;
  CHECK_OK(recording_engine(&st, path, &e));
  CHECK_OK(ferry_trace_resident(e, "parameters", 1000000));
  CHECK_OK(ferry_trace_resident(e, "optimizer states", 2000000));
  CHECK_EQ(ferry_trace_flops(e, -1), FERRY_EINVAL);
  enum { M = 4 };
  test_buffer *bufs[M];
  ferry_handle hs[M];
  CHECK_OK(ferry_step_begin(e));
  for (int i = 0; i < M; i++) {
    CHECK_OK(ferry_trace_flops(e, 1e12)); /* 1 TFLOP before each pack */
    bufs[i] = test_buffer_new(4096);
    ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
    d.bytes = 4096;
    d.dtype = FERRY_DTYPE_U8;
    d.ndim = 1;
    d.shape[0] = 4096;
    d.layer = i;
    d.layer_count = M;
    CHECK_OK(ferry_pack(e, &d, bufs[i]->ptr, bufs[i], NULL, &hs[i])); /* the engine's now */
  }
  CHECK_OK(ferry_trace_flops(e, 2e12));
  CHECK_OK(ferry_backward_begin(e));
  for (int i = M - 1; i >= 0; i--) {
    void *dev = NULL, *owner = NULL;
    CHECK_OK(ferry_unpack(e, hs[i], NULL, &dev, &owner));
    if (owner) test_buffer_unref(owner);
  }
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  CHECK_EQ(ferry_trace_resident(e, "late", 1), FERRY_OK); /* between steps: allowed */
  ferry_engine_destroy(e);

  sim_trace *t = NULL;
  int rc = sim_trace_load(path, &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK_EQ(t->resident_bytes, 3000001);
  CHECK_EQ(t->n_flops, M + 1);
  const sim_hw *hw = sim_hw_preset("h100");
  sim_config sc = {0};
  sc.link = hw->link;
  sc.tflops = 400;
  sim_result r;
  CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
  /* 6 TFLOP at 400 TFLOP/s = 15 ms, plus the gaps without FLOPs (tiny: a
   * few recorded microseconds) */
  CHECK(r.step_us >= 15000);
  /* the recorded gaps are real time: tiny, except under valgrind */
  CHECK(RUNNING_ON_VALGRIND || r.step_us < 15000 + 5000);
  CHECK_EQ(r.gaps_from_flops, M + 1);
  CHECK(strstr(r.compute_note, "FLOPs at 400 TFLOP/s") != NULL);
  CHECK_EQ(r.peak_device_bytes, 3000001 + M * 4096);
  sim_result_free(&r);
  /* no rate: the recording machine's times, said plainly */
  sc.tflops = 0;
  CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
  CHECK(RUNNING_ON_VALGRIND || r.step_us < 15000);
  CHECK_EQ(r.gaps_from_flops, 0);
  CHECK(strstr(r.compute_note, "recording machine's") != NULL);
  sim_result_free(&r);
  sim_trace_free(t);
  unlink(path);
  return 0;
}

/* The sim_config `ferry sim --hw NAME --mfu MFU` builds (cli_sim.c's
 * opts_config): the preset's peak x MFU, its HBM x SIM_DEFAULT_HBM_FRACTION. */
static sim_config gpu_config(const char *hw_name, double mfu) {
  const sim_hw *hw = sim_hw_preset(hw_name);
  sim_config c = {0};
  c.link = hw->link;
  c.steps = 1;
  c.tflops = hw->peak_tflops * mfu;
  c.hbm_bytes_per_s = hw->hbm_bytes_per_s * SIM_DEFAULT_HBM_FRACTION;
  return c;
}

/* A synthesized compute event carries its work (FLOPs, device-memory bytes,
 * a least time), timed on the simulated GPU as a roofline. By hand, from
 * the datasheets (docs/hardware.md): h100 989 TFLOP/s x 0.40 = 395.6,
 * 3350 GB/s x 0.60 = 2010 GB/s; a100 312 x 0.40 = 124.8, 2039 x 0.60 =
 * 1223.4 GB/s.
 *   matmul, 1e12 FLOP and 1e9 B: h100 1e12 / 395.6e12 s = 2527.806 us (its
 *     bytes: 497.5 us), a100 8012.821 us (817.4 us): 989/312 = 3.170x;
 *   norm, 0 FLOP and 4.02e9 B: h100 2000 us, a100 3285.925 us;
 *   launch-bound, 1e6 FLOP, 1e3 B, min_us 8: 8 us on both.
 * Without a GPU speed the events keep the synthesizer's `us`. */
TEST(sim_compute_roofline_hand_computed) {
#define COMPUTE(us, flops, bytes, min)                                                     \
  "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us ",\"flops\":" #flops ",\"hbm_bytes\":" #bytes \
  ",\"min_us\":" #min "}\n"
  static const char matmul[] = HDR BEGIN COMPUTE(10, 1e12, 1e9, 4) END;
  static const char three[] = HDR BEGIN COMPUTE(10, 1e12, 1e9, 4) COMPUTE(20, 0, 4.02e9, 4)
      COMPUTE(30, 1e6, 1e3, 8) END;
#undef COMPUTE
  sim_trace *t1 = NULL, *t3 = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("matmul", matmul, strlen(matmul), &t1, err, sizeof err));
  CHECK_OK(sim_trace_parse("three", three, strlen(three), &t3, err, sizeof err));
  CHECK_EQ(t3->n_hbm, 3);
  static const struct {
    const char *hw;
    double mfu, matmul_us, three_us;
  } want[] = {
      {"h100", 0.40, 2527.805864, 2527.805864 + 2000 + 8},
      {"a100", 0.40, 8012.820513, 8012.820513 + 3285.924473 + 8},
      {"h100", 0.20, 2 * 2527.805864, 2 * 2527.805864 + 2000 + 8}, /* MFU halved */
      {"a100", 0.80, 8012.820513 / 2, 8012.820513 / 2 + 3285.924473 + 8}, /* doubled */
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    sim_config c = gpu_config(want[i].hw, want[i].mfu);
    sim_result r;
    CHECK_OK(sim_replay(t1, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want[i].matmul_us, 1e-3);
    sim_result_free(&r);
    CHECK_OK(sim_replay(t3, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want[i].three_us, 1e-3);
    CHECK_EQ(r.gaps_from_flops, 3);
    CHECK(strstr(r.compute_note, "roofline") != NULL);
    sim_result_free(&r);
  }
  /* the FLOP-bound event: a100 over h100 is exactly the ratio of peaks */
  sim_result h, a;
  sim_config ch = gpu_config("h100", SIM_DEFAULT_MFU), ca = gpu_config("a100", SIM_DEFAULT_MFU);
  CHECK_OK(sim_replay(t1, &ch, &h, err, sizeof err));
  CHECK_OK(sim_replay(t1, &ca, &a, err, sizeof err));
  CHECK_NEAR(a.step_us / h.step_us, 989.0 / 312.0, 1e-9);
  sim_result_free(&h);
  sim_result_free(&a);
  /* no GPU speed: the synthesizer's times */
  sim_config none = {0};
  none.steps = 1;
  sim_result r;
  CHECK_OK(sim_replay(t3, &none, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, 60, 1e-9);
  CHECK_EQ(r.gaps_from_flops, 0);
  CHECK(strstr(r.compute_note, "as synthesized") != NULL);
  sim_result_free(&r);
  sim_trace_free(t1);
  sim_trace_free(t3);
  return 0;
}

/* The synthesized Llama-3-8B-like trace (seq 8192) on h100 and a100: with
 * a GPU speed, every compute event is timed on it, so the no-offload step
 * is the sum over the step's events of max(flops / rate, hbm_bytes / bw,
 * min_us) at that GPU's rates (hand-written here from the datasheets), not
 * the synthesizer's 400 TFLOP/s on both; without one, the sum of `us`. */
TEST(sim_synth_compute_follows_the_simulated_gpu) {
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  CHECK(t->n_hbm > 0);
  static const struct {
    const char *hw;
    double mfu, rate, bw; /* FLOP/s, B/s */
  } gpu[] = {
      {"h100", 0.40, 989e12 * 0.40, 3350e9 * 0.60},
      {"a100", 0.40, 312e12 * 0.40, 2039e9 * 0.60},
      {"h100", 0.20, 989e12 * 0.20, 3350e9 * 0.60},
  };
  const trace_step *st = &t->steps[0];
  double step[3], synth_us = 0, flop_bound_h100 = 0;
  char err[512];
  for (int g = 0; g < 3; g++) {
    double want = 0;
    for (uint32_t k = st->first; k < st->end; k++) {
      const trace_ev *ev = &t->events[k];
      if (ev->type != TEV_COMPUTE) continue;
      CHECK(ev->flops >= 0 && ev->hbm_bytes >= 0);
      double f = ev->flops / gpu[g].rate * 1e6, b = ev->hbm_bytes / gpu[g].bw * 1e6;
      double us = fmax(fmax(f, b), ev->min_us);
      want += us;
      if (g == 0) {
        synth_us += ev->gap_us;
        if (us == f) flop_bound_h100 += us;
      }
    }
    sim_config c = gpu_config(gpu[g].hw, gpu[g].mfu);
    sim_result r;
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.step_us, want, 1e-6 * want);
    CHECK(strstr(r.compute_note, "roofline") != NULL);
    step[g] = r.step_us;
    sim_result_free(&r);
  }
  printf("  no offload: h100 %.1f ms, a100 %.1f ms (%.2fx), h100 at MFU 0.2 %.1f ms; "
         "FLOP-bound on h100 %.1f ms; as synthesized %.1f ms\n",
         step[0] / 1e3, step[1] / 1e3, step[1] / step[0], step[2] / 1e3, flop_bound_h100 / 1e3,
         synth_us / 1e3);
  /* most of the step is matmuls: a100 is slower by nearly 989/312 */
  CHECK(flop_bound_h100 > 0.8 * step[0]);
  CHECK(step[1] > 2.5 * step[0]);
  /* halving the MFU doubles exactly the FLOP-bound part (the memory-bound
   * ops stay memory-bound or become FLOP-bound: at least that much) */
  CHECK(step[2] >= step[0] + flop_bound_h100 - 1e-3);
  sim_config none = {0};
  none.steps = 1;
  sim_result r;
  CHECK_OK(sim_replay(t, &none, &r, err, sizeof err));
  CHECK_NEAR(r.step_us, synth_us, 1e-6 * synth_us);
  CHECK(strstr(r.compute_note, "as synthesized") != NULL);
  sim_result_free(&r);
  sim_trace_free(t);
  return 0;
}

/* ferry_trace_flops_all: the trainer counts all its compute, so every event
 * carries "flops" (0 where none were added) and a replay times the whole
 * step from FLOPs: exactly the FLOPs / rate, whatever the recording
 * machine's gaps (here made long with sleeps), and the note says so. Off,
 * the events without FLOPs keep their recorded gaps. */
TEST(sim_recorded_trace_flops_all) {
  for (int all = 0; all <= 1; all++) {
    test_device_stats st = {0};
    char path[32], err[512];
    ferry_engine *e;
    CHECK_OK(recording_engine(&st, path, &e));
    CHECK_OK(ferry_trace_flops_all(e, all));
    CHECK_OK(ferry_trace_resident(e, "parameters", 1000));
    enum { M = 3 };
    test_buffer *bufs[M];
    ferry_handle hs[M];
    CHECK_OK(ferry_step_begin(e));
    for (int i = 0; i < M; i++) {
      usleep(2000); /* recorded compute nobody counted */
      if (i) CHECK_OK(ferry_trace_flops(e, 4e11)); /* before the 2nd and 3rd packs */
      bufs[i] = test_buffer_new(4096);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = 4096;
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = 4096;
      d.layer = i;
      d.layer_count = M;
      CHECK_OK(ferry_pack(e, &d, bufs[i]->ptr, bufs[i], NULL, &hs[i]));
    }
    CHECK_OK(ferry_backward_begin(e));
    for (int i = M - 1; i >= 0; i--) {
      void *dev = NULL, *owner = NULL;
      usleep(2000);
      CHECK_OK(ferry_unpack(e, hs[i], NULL, &dev, &owner));
      if (owner) test_buffer_unref(owner);
      CHECK_OK(ferry_trace_flops(e, 8e11)); /* after each unpack: its backward */
    }
    CHECK_OK(ferry_backward_end(e));
    CHECK_OK(ferry_step_end(e));
    ferry_engine_destroy(e);

    sim_trace *t = NULL;
    int rc = sim_trace_load(path, &t, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    /* on: every event of the step (begin, 3 packs, backward begin, 3
     * unpacks, backward end, end); off: the 2 packs and 3 events after a
     * ferry_trace_flops */
    CHECK_EQ(t->n_flops, all ? 10 : 5);
    sim_config sc = {0};
    sc.link = sim_hw_preset("h100")->link;
    sc.tflops = 400;
    sim_result r;
    CHECK_OK(sim_replay(t, &sc, &r, err, sizeof err));
    double flops_us = (2 * 4e11 + 3 * 8e11) / (400 * 1e6); /* 8 ms */
    if (all) {
      CHECK_NEAR(r.step_us, flops_us, 1e-6);
      CHECK_EQ(r.gaps_as_recorded, 0);
      CHECK(strstr(r.compute_note, "compute timed from the trace's FLOPs at 400 TFLOP/s") != NULL);
    } else {
      /* the sleeps before the first pack and the first unpack have no FLOPs */
      CHECK(r.step_us >= flops_us + 2 * 2000);
      CHECK(r.gaps_as_recorded >= 2);
      CHECK(strstr(r.compute_note, "as recorded") != NULL);
    }
    sim_result_free(&r);
    sim_trace_free(t);
    unlink(path);
  }
  return 0;
}

/* Hand traces of 100 kB tensors on a zero clock (t_us 0: compute events
 * only), for the prefetch tests below. */
#define PACK100K(id, layer, module, decision)                                              \
  "{\"ev\":\"pack\",\"t_us\":0,\"id\":" #id ",\"step\":1,\"bytes\":100000,\"dtype\":\"u8\","   \
  "\"shape\":[100000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":" #layer       \
  ",\"layers\":1,\"module\":\"" module "\",\"decision\":\"" decision "\"}\n"
#define UNPACK0(id) "{\"ev\":\"unpack\",\"t_us\":0,\"id\":" #id "}\n"
#define WORK(us) "{\"ev\":\"compute\",\"t_us\":0,\"us\":" #us "}\n"
#define EV0(name) "{\"ev\":\"" name "\",\"t_us\":0}\n"
#define END0 "{\"ev\":\"step_end\",\"t_us\":0,\"step\":1}\n"

/* prefetch_at_backward_begin: with compute between ferry_backward_begin and
 * the first unpack (the loss's backward), the policy's prefetch of the last
 * offloaded tensor starts at backward_begin and hides behind that compute;
 * without it the reload starts at the unpack and is a 100 us stall. */
TEST(sim_prefetch_starts_at_backward_begin) {
  static const char text[] = HDR BEGIN PACK100K(1, 0, "m.l0", "offload") WORK(200)
      EV0("backward_begin") WORK(150) UNPACK0(1) WORK(50) EV0("backward_end") END0;
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, 1 end }\n";
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("bwd", text, strlen(text), &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  sim_config c = hand_config(2); /* 100 us per copy */
  c.policy_source = policy;
  sim_result on_use, early;
  rc = sim_replay(t, &c, &on_use, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  c.prefetch_at_backward_begin = 1;
  CHECK_OK(sim_replay(t, &c, &early, err, sizeof err));
  CHECK_NEAR(on_use.bytes_h2d, 100000, 0);
  CHECK_NEAR(early.bytes_h2d, 100000, 0);
  CHECK_NEAR(on_use.stall_us, 100.0, 1e-6);
  CHECK_NEAR(early.stall_us, 0.0, 1e-6);
  /* 400 us of compute, plus 100 us the pack waits for its copy (stash 0) */
  CHECK_NEAR(on_use.step_us, 600.0, 1e-6);
  CHECK_NEAR(early.step_us, 500.0, 1e-6);
  CHECK(early.prefetches >= 1);
  sim_result_free(&on_use);
  sim_result_free(&early);
  sim_trace_free(t);
  return 0;
}

/* The replay packs as ferry.torch does: a site the policy keeps from its
 * cache (ferry_pack_cached_keep) gets no handle, so its unpack starts no
 * reload. Two offloaded tensors, then a kept one (the loss) whose answer is
 * cacheable; prefetch distance 2, no stash. Step 1 (nothing cached yet)
 * reloads both at the kept tensor's unpack; in step 2 that unpack starts
 * nothing, the first offloaded one is reloaded when unpacked and starts the
 * second's: one prefetch, not two. */
TEST(sim_cached_keep_starts_no_reload) {
  static const char text[] = HDR BEGIN PACK100K(1, 0, "m.a", "offload")
      PACK100K(2, 0, "m.b", "offload") PACK100K(3, -1, "loss", "keep") WORK(200)
      EV0("backward_begin") UNPACK0(3) WORK(50) UNPACK0(2) WORK(50) UNPACK0(1) WORK(50)
      EV0("backward_end") END0;
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  if t:path() == 'loss' then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, 2 end }\n";
  sim_trace *t = NULL;
  char err[512];
  int rc = sim_trace_parse("cached", text, strlen(text), &t, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  for (int steps = 1; steps <= 2; steps++) {
    sim_config c = hand_config(steps);
    c.warmup = steps - 1; /* the figures of the last step */
    c.policy_source = policy;
    sim_result r;
    rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    CHECK_NEAR(r.bytes_h2d, 200000, 0);
    CHECK_NEAR(r.prefetches, steps == 1 ? 2 : 1, 0);
    sim_result_free(&r);
  }
  sim_trace_free(t);
  return 0;
}
#undef PACK100K
#undef UNPACK0
#undef WORK
#undef EV0
#undef END0

/* ---- optimizer-state offload (sim_config.optimizer_fraction) ------------------------ */

/* A step whose times are easy to follow: 2 MB of parameters (1e6 bf16: no
 * parameter packs), 2 MB of gradients, 12 MB of optimizer states; forward
 * is 5 computes of 200 us (a tiny activation per layer of 4, so 5 chunks
 * of a layer's worth), backward 5 of 400 us, the device's optimizer step
 * 100 us. */
static const char *opt_trace(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s",
                   HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2000000,\"what\":\"parameters\"}\n"
                       "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":2000000,\"what\":\"gradients\"}\n"
                       "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":12000000,\"what\":"
                       "\"optimizer states\"}\n" BEGIN);
  for (int i = 1; i <= 4; i++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":200}\n"
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":1000,\"dtype\":\"u8\","
                  "\"shape\":[1000],\"kind\":\"activation\",\"phase\":\"forward\",\"layer\":%d,"
                  "\"layers\":4,\"decision\":\"keep\"}\n", i, i - 1);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":200}\n{\"ev\":\"backward_begin\",\"t_us\":0}\n");
  for (int i = 4; i >= 1; i--)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":400}\n{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n",
                  i);
  snprintf(buf + n, sizeof buf - (size_t)n,
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":400}\n{\"ev\":\"backward_end\",\"t_us\":0}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":100,\"op\":\"optimizer\"}\n" END);
  return buf;
}

/* The settings of the hand-computed runs: 1 GB/s each way, no latency,
 * 3 steps (2 and 3 steady: each waits for the previous step's parameters). */
static sim_config opt_config(double fraction, double rate, int serial) {
  sim_config c = hand_config(3);
  c.optimizer_fraction = fraction;
  c.cpu_adam_params_per_s = rate;
  c.optimizer_serial = serial;
  return c;
}

/* Fraction 0 is no optimizer offload at all, whatever the other knobs say:
 * every figure equal, on the hand trace and on a synthesized model with a
 * policy offloading activations. */
TEST(sim_optimizer_fraction_zero_is_no_offload) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *traces[2] = {NULL, NULL};
  char err[512];
  const char *text = opt_trace();
  CHECK_OK(sim_trace_parse("opt", text, strlen(text), &traces[0], err, sizeof err));
  CHECK_OK(synth_to_trace(&m, &traces[1]));
  char path[1100];
  snprintf(path, sizeof path, "%s/budget.lua", policy_dir());
  for (int i = 0; i < 2; i++) {
    sim_config plain = opt_config(0, 0, 0), zero = opt_config(0, 1e3, 1);
    plain.link = zero.link = sim_hw_preset("h100")->link;
    plain.policy_path = zero.policy_path = i ? path : NULL;
    sim_result a, b;
    CHECK_OK(sim_replay(traces[i], &plain, &a, err, sizeof err));
    CHECK_OK(sim_replay(traces[i], &zero, &b, err, sizeof err));
    CHECK(a.step_us == b.step_us);
    CHECK(a.stall_us == b.stall_us && a.host_wait_us == b.host_wait_us);
    CHECK(a.bytes_d2h == b.bytes_d2h && a.bytes_h2d == b.bytes_h2d);
    CHECK_EQ(a.peak_device_bytes, b.peak_device_bytes);
    CHECK_EQ(a.resident_bytes, b.resident_bytes);
    CHECK_EQ(a.peak_host_bytes, b.peak_host_bytes);
    CHECK_EQ(b.opt_device_bytes, 0);
    CHECK(b.opt_fraction == 0 && b.opt_stall_us == 0 && b.opt_bytes_d2h == 0);
    CHECK(i == 0 || a.bytes_d2h > 0); /* the policy did offload */
    sim_result_free(&a);
    sim_result_free(&b);
  }
  sim_trace_free(traces[0]);
  sim_trace_free(traces[1]);
  return 0;
}

/* The device's resident memory drops by exactly the share of the optimizer
 * states; the share of gradients and parameters crosses the link each way
 * per step; the host holds the three; the activations' figures are their
 * own (a policy offloading next to it on the synthesized model). */
TEST(sim_optimizer_offload_frees_exactly_the_share) {
  synth_model m;
  synth_preset("tiny", &m);
  sim_trace *t = NULL;
  CHECK_OK(synth_to_trace(&m, &t));
  uint64_t params = 0, grads = 0, states = 0;
  for (uint32_t i = 0; i < t->n_resident; i++) {
    if (!strcmp(t->resident[i].what, "parameters")) params = t->resident[i].bytes;
    if (!strcmp(t->resident[i].what, "gradients")) grads = t->resident[i].bytes;
    /* the fp32 master weights (4 bytes per parameter) are declared apart
     * from the states (AdamW's 8) and go to the host with them */
    if (!strcmp(t->resident[i].what, "optimizer states") ||
        !strcmp(t->resident[i].what, "master weights"))
      states += t->resident[i].bytes;
  }
  CHECK(params > 0 && grads > 0 && states == params / 2 * 12); /* bf16: 12 bytes per parameter */
  char err[512], path[1100];
  snprintf(path, sizeof path, "%s/default.lua", policy_dir());
  sim_result base, r;
  sim_config c = opt_config(0, 0, 0);
  c.link = sim_hw_preset("h100")->link;
  c.policy_path = path;
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  c.optimizer_fraction = 0.3;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  uint64_t freed = (uint64_t)(0.3 * (double)states + 0.5);
  CHECK_EQ(r.opt_device_bytes, freed);
  CHECK_EQ(r.resident_bytes, t->resident_bytes - freed);
  /* tiny peaks at its optimizer step (foreach AdamW's transients), whose
   * device share shrinks to 0.7 of each transient too */
  uint64_t shrunk = 0;
  for (uint32_t i = 0; i < t->n_allocs; i++)
    if (!strncmp(t->allocs[i].what, "optimizer:", 10))
      shrunk += t->allocs[i].bytes - (uint64_t)(0.7 * (double)t->allocs[i].bytes + 0.5);
  CHECK(shrunk > 0);
  CHECK_EQ(base.peak_phase, SIM_PEAK_OPTIMIZER);
  CHECK_EQ(r.peak_phase, SIM_PEAK_OPTIMIZER);
  CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - freed - shrunk);
  CHECK_EQ(r.first_step_peak_device_bytes, base.first_step_peak_device_bytes - freed - shrunk);
  CHECK_NEAR(r.opt_bytes_d2h, (double)(uint64_t)(0.3 * (double)grads + 0.5), 0);
  CHECK_NEAR(r.opt_bytes_h2d, (double)(uint64_t)(0.3 * (double)params + 0.5), 0);
  CHECK_NEAR(r.opt_params, 0.3 * (double)params / 2, 1e-6);
  CHECK_NEAR(r.opt_cpu_us, r.opt_params / SIM_DEFAULT_CPU_ADAM * 1e6, 1e-6);
  CHECK_EQ(r.opt_host_bytes, freed + (uint64_t)(0.3 * (double)grads + 0.5) +
                                 (uint64_t)(0.3 * (double)params + 0.5));
  CHECK(r.peak_host_bytes >= base.peak_host_bytes + r.opt_host_bytes);
  /* the activations' copies are the same tensors, counted apart */
  CHECK(r.bytes_d2h == base.bytes_d2h && r.bytes_h2d == base.bytes_h2d);
  CHECK(r.step_us > base.step_us);
  /* the copies on the timeline, named */
  int g = 0, p = 0;
  for (size_t i = 0; i < r.tl.n_iv; i++) {
    const char *mp = r.tl.iv[i].module_path;
    g += mp && !strcmp(mp, "optimizer: gradients") && r.tl.iv[i].lane == 1;
    p += mp && !strcmp(mp, "optimizer: parameters") && r.tl.iv[i].lane == 2;
  }
  CHECK_EQ(g, m.layers + 1); /* a chunk per layer and one for the rest */
  CHECK_EQ(p, m.layers + 1); /* the previous step's, waited for in this forward */
  sim_result_free(&base);
  sim_result_free(&r);
  /* what it needs and refuses */
  c.optimizer_fraction = 1.5;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "0..1");
  c.optimizer_fraction = 0.5;
  c.host_backend = 1;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EUNSUPPORTED);
  sim_trace_free(t);
  const char *text = six_tensors(); /* no resident memory */
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  c = opt_config(0.5, 0, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "\"parameters\"");
  sim_trace_free(t);
  return 0;
}

/* The step on the hand trace, half the optimizer on the host (5e5
 * parameters; chunks of 200000 bytes: 200 us each way), computed by hand.
 * Baseline 1000 + 2000 + 100 = 3100 us.
 *  - overlapped, the host step (40 us) within the device's (50 us): the
 *    forward waits for the first chunk of parameters (200 us; each next one
 *    arrives as the layer before it computes), step() for the last chunk of
 *    gradients (200 us; the others went while backward computed):
 *    200 + 1000 + 2000 + 200 + 50 = 3450 us, 400 of them exposed;
 *  - serial: the host step before the device's and every parameter before
 *    the step ends: 1000 + 2000 + 200 + 40 + 50 + 1000 = 4290 us;
 *  - overlapped with a slow host (1e6 parameters/s: 500000 us): the host
 *    step is exposed but for the device's 50 us: 200 + 3000 + 200 + 50 +
 *    499950 = 503400 us, 500300 more than the baseline;
 *  - everything on the host (chunks of 400 us each way, host step 80 us, no
 *    device step): the forward waits 400 us for the first chunk, then 200
 *    before each next one (its 400 us copy against 200 us of compute), so
 *    2200 us; backward 2000 plus the last gradients' 400; the host step's
 *    80 us, hidden by nothing: 4680 us, 1680 of them exposed. */
TEST(sim_optimizer_offload_hand_computed_steps) {
  const char *text = opt_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("opt", text, strlen(text), &t, err, sizeof err));
  sim_result base, r;
  sim_config c = opt_config(0, 0, 0);
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  CHECK_NEAR(base.step_us, 3100, 1e-6);
  static const struct {
    double fraction, rate;
    int serial;
    double step, exposed, cpu;
  } cases[] = {
      {0.5, 1.25e10, 0, 3450, 400, 40},
      {0.5, 1.25e10, 1, 4290, 1240, 40},
      {0.5, 1e6, 0, 503400, 500350, 500000},
      {1, 1.25e10, 0, 4680, 1680, 80},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    double f = cases[i].fraction;
    c = opt_config(f, cases[i].rate, cases[i].serial);
    CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
    CHECK_NEAR(r.opt_cpu_us, cases[i].cpu, 1e-6);
    CHECK_NEAR(r.step_us, cases[i].step, 1e-6);
    CHECK_NEAR(r.opt_stall_us, cases[i].exposed, 1e-6);
    CHECK_NEAR(r.stall_us + r.host_wait_us, 0, 1e-6); /* the activations' stall: none */
    CHECK_NEAR(r.opt_bytes_d2h, f * 2e6, 0);
    CHECK_NEAR(r.opt_bytes_h2d, f * 2e6, 0);
    CHECK_EQ(r.opt_device_bytes, (uint64_t)(f * 12e6));
    CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - (uint64_t)(f * 12e6));
    CHECK_EQ(r.opt_serial, cases[i].serial);
    sim_result_free(&r);
  }
  CHECK_NEAR(503400 - base.step_us, 500300, 1e-6);
  sim_result_free(&base);
  sim_trace_free(t);
  return 0;
}

/* ---- weight offload (sim_config.weight_first, weight_count) ------------------------- */

/* The "parameters" line's optional "layer_bytes" (each repeated block's
 * weights): read, 0 when absent, refused when it is not an integer within
 * the line's bytes; the synthesizer writes a block's linears and norms per
 * GPU (Llama 3 8B under FSDP over 8: (2 x 4096^2 + 2 x 4096 x 1024 + 3 x
 * 4096 x 14336 + 2 x 4096) x 2 bytes / 8 = 54528000). */
TEST(sim_trace_resident_layer_bytes) {
#define RES(extra) "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":5000,\"what\":\"parameters\"" extra "}\n"
  const char *text = HDR RES(",\"dtype\":\"bf16\",\"layer_bytes\":1200") BEGIN END;
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("lb", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->n_resident, 1);
  CHECK_EQ(t->resident[0].bytes, 5000);
  CHECK_EQ(t->resident[0].layer_bytes, 1200);
  CHECK_EQ(t->resident[0].dtype, FERRY_DTYPE_BF16);
  sim_trace_free(t);
  text = HDR RES("") BEGIN END;
  CHECK_OK(sim_trace_parse("lb", text, strlen(text), &t, err, sizeof err));
  CHECK_EQ(t->resident[0].layer_bytes, 0);
  sim_trace_free(t);
  BAD(HDR RES(",\"layer_bytes\":5001") BEGIN END, "bad.jsonl:2: \"layer_bytes\" = 5001 is absurd");
  BAD(HDR RES(",\"layer_bytes\":-1") BEGIN END, "bad.jsonl:2: \"layer_bytes\" = -1 is negative");
  BAD(HDR RES(",\"layer_bytes\":1.5") BEGIN END, "\"layer_bytes\" must be an integer");
  BAD(HDR RES(",\"layer_bytes\":\"1\"") BEGIN END, "\"layer_bytes\" must be a number");
#undef RES
  synth_model m;
  CHECK_EQ(synth_preset("llama3-8b", &m), 0);
  synth_resident parts;
  synth_resident_parts(&m, &parts);
  CHECK_EQ(parts.layer_params, 54528000);
  m.steps = 1;
  m.seq = 256;
  CHECK_OK(synth_to_trace(&m, &t));
  int found = 0;
  for (uint32_t i = 0; i < t->n_resident; i++) {
    if (strcmp(t->resident[i].what, "parameters")) {
      CHECK_EQ(t->resident[i].layer_bytes, 0);
      continue;
    }
    found = 1;
    CHECK_EQ(t->resident[i].layer_bytes, 54528000);
    CHECK(32 * t->resident[i].layer_bytes < t->resident[i].bytes); /* embeddings and head */
  }
  CHECK(found);
  sim_trace_free(t);
  return 0;
}

/* A step to follow by hand: 4 blocks of 1 MB of weights (the "parameters"
 * line's layer_bytes; 1 MB outside them), each saving a 3 MB activation
 * (kept); forward 2000 us per block, the head 500, its backward 1000,
 * 4000 per block's backward (its unpack first, then its compute), the
 * optimizer 100: 25600 us. */
static const char *w_trace(void) {
  static char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s",
                   HDR "{\"ev\":\"resident\",\"t_us\":0,\"bytes\":5000000,\"what\":\"parameters\","
                       "\"dtype\":\"bf16\",\"layer_bytes\":1000000}\n" BEGIN);
  for (int l = 0; l < 4; l++)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":2000,\"layer\":%d}\n"
                  "{\"ev\":\"pack\",\"t_us\":0,\"id\":%d,\"step\":1,\"bytes\":3000000,\"dtype\":"
                  "\"u8\",\"shape\":[3000000],\"kind\":\"activation\",\"phase\":\"forward\","
                  "\"layer\":%d,\"layers\":4,\"module\":\"m.layers.%d\",\"decision\":\"keep\"}\n",
                  l, l + 1, l, l);
  n += snprintf(buf + n, sizeof buf - (size_t)n,
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":500,\"layer\":-1}\n"
                "{\"ev\":\"backward_begin\",\"t_us\":0}\n"
                "{\"ev\":\"compute\",\"t_us\":0,\"us\":1000,\"layer\":-1}\n");
  for (int l = 3; l >= 0; l--)
    n += snprintf(buf + n, sizeof buf - (size_t)n,
                  "{\"ev\":\"unpack\",\"t_us\":0,\"id\":%d}\n"
                  "{\"ev\":\"compute\",\"t_us\":0,\"us\":4000,\"layer\":%d}\n", l + 1, l);
  snprintf(buf + n, sizeof buf - (size_t)n,
           "{\"ev\":\"backward_end\",\"t_us\":0}\n"
           "{\"ev\":\"compute\",\"t_us\":0,\"us\":100,\"op\":\"optimizer\"}\n" END);
  return buf;
}

/* 1 GB/s each way, no latency, no duplex slowdown: 1000 us per block's
 * weights, 3000 per activation; 3 steps, 2 and 3 steady. */
static sim_config w_config(int32_t first, int32_t count, int single) {
  sim_config c = hand_config(3);
  c.weight_first = first;
  c.weight_count = count;
  c.weight_single_buffer = single;
  return c;
}

/* Computed by hand (W = 1 MB of weights a block, copies of 1000 us):
 * baseline 25600 us, peak 5 MB resident + 12 MB of activations at the
 * start of backward.
 *  - blocks 0..3, double-buffered. Steady: every block's weights are on
 *    the device from the previous backward; each goes D2H after its
 *    forward (block k: 2000(k+1) .. +1000, freed then). Backward: block 3's
 *    hook at 9500 reloads it (9500..10500, a 1000 us stall) and issues
 *    block 2's behind it (..11500), each next hook issues the one before
 *    it, 4000 us ahead of its use: 26600 us, stall 1000. The peak is at
 *    that hook: 12 MB of activations + blocks 3 and 2 = 14 MB, + 1 MB of
 *    resident = 15 MB: 2 MB below the baseline, the 4 blocks' 4 MB less the
 *    double buffer's 2. Step 1 (every block on the host): block 0's reload
 *    stalls 1000 us, the next ones arrive while the one before computes,
 *    then backward as above: 27600.
 *  - single-buffered: every block's reload is exposed, 4 x 1000: 29600 us;
 *    the peak at block 3's hook is 12 + 1 MB + 1 MB resident = 14 MB (3 MB
 *    below: 4 blocks less 1); step 1 adds forward's 4 reloads: 33600.
 *  - blocks 1..2: the peak is at the start of backward, both off the
 *    device: 12 MB + 3 MB resident, 2 MB (both blocks) below; block 2's
 *    hook (at 13500) stalls 1000 us, double-buffered block 1 arrives
 *    meanwhile: 26600; single-buffered both stall: 27600. Step 1 adds
 *    block 1's forward reload (double) or both (single): 27600, 29600. */
TEST(sim_weight_offload_hand_computed_steps) {
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result base, r;
  sim_config c = w_config(0, 0, 0);
  CHECK_OK(sim_replay(t, &c, &base, err, sizeof err));
  CHECK_NEAR(base.step_us, 25600, 1e-6);
  CHECK_EQ(base.peak_device_bytes, 17000000);
  CHECK_EQ(base.w_count, 0);
  static const struct {
    int32_t first, count;
    int single;
    double step, first_step, stall;
    uint64_t drop;
  } cases[] = {
      {0, 4, 0, 26600, 27600, 1000, 2000000},
      {0, 4, 1, 29600, 33600, 4000, 3000000},
      {1, 2, 0, 26600, 27600, 1000, 2000000},
      {1, 2, 1, 27600, 29600, 2000, 2000000},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    c = w_config(cases[i].first, cases[i].count, cases[i].single);
    c.timeline = 1;
    int rc = sim_replay(t, &c, &r, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    double moved = 1e6 * cases[i].count;
    CHECK_NEAR(r.step_us, cases[i].step, 1e-6);
    CHECK_NEAR(r.first_step_us, cases[i].first_step, 1e-6);
    CHECK_NEAR(r.stall_us + r.host_wait_us, cases[i].stall, 1e-6);
    CHECK_NEAR(r.w_stall_us, cases[i].stall, 1e-6); /* all of it the weights' */
    CHECK_EQ(r.peak_device_bytes, base.peak_device_bytes - cases[i].drop);
    CHECK_EQ(r.resident_bytes, 5000000 - (uint64_t)moved);
    CHECK_NEAR(r.bytes_d2h, moved, 0); /* the weights' copies, in the step's bytes */
    CHECK_NEAR(r.bytes_h2d, moved, 0);
    CHECK_NEAR(r.w_bytes_d2h, moved, 0);
    CHECK_NEAR(r.w_bytes_h2d, moved, 0);
    CHECK_EQ(r.w_layer_bytes, 1000000);
    CHECK_EQ(r.w_estimated, 0);
    CHECK_EQ(r.w_double_buffer, !cases[i].single);
    CHECK_EQ(r.w_device_bytes, (uint64_t)moved);
    CHECK(r.peak_host_bytes >= (uint64_t)moved); /* the pinned host copies */
    /* the last step's copies on the timeline, named, one each way a block;
     * the waits drawn add up to the stall, on the blocks' rows */
    int d2h = 0, h2d = 0;
    double waits = 0, rows = 0;
    for (size_t k = 0; k < r.tl.n_iv; k++) {
      const sim_interval *iv = &r.tl.iv[k];
      if (!iv->lane) continue;
      CHECK(iv->module_path && !strcmp(iv->module_path, "weights"));
      CHECK(iv->layer >= cases[i].first && iv->layer < cases[i].first + cases[i].count);
      CHECK_NEAR(iv->t1 - iv->t0, 1000, 1e-6);
      d2h += iv->lane == 1;
      h2d += iv->lane == 2;
    }
    CHECK_EQ(d2h, cases[i].count);
    CHECK_EQ(h2d, cases[i].count);
    for (size_t k = 0; k < r.tl.n_waits; k++) waits += r.tl.waits[k].t1 - r.tl.waits[k].t0;
    for (uint32_t k = 0; k < r.n_layers; k++) rows += r.layers[k].stall_us;
    CHECK_NEAR(waits, cases[i].stall, 1e-6);
    CHECK_NEAR(rows, cases[i].stall, 1e-6);
    sim_result_free(&r);
  }
  /* blocks 0..3 double-buffered, the last step's memory: every block's
   * weights go after its forward copy ends (k: at 2000(k+1) + 1000), so at
   * block 3's pack (8000) only block 3's are on the device with the 12 MB
   * of activations; freeing before the copy ends would show 12 MB there */
  c = w_config(0, 4, 0);
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  uint64_t at_8000 = 0, at_2500 = 0;
  for (size_t k = 0; k < r.tl.n_mem; k++) {
    double dt = r.tl.mem[k].t - r.tl.t_begin;
    if (dt <= 8000 + 1e-6) at_8000 = r.tl.mem[k].bytes;
    if (dt <= 2500 + 1e-6) at_2500 = r.tl.mem[k].bytes;
  }
  CHECK_EQ(at_8000, 1000000 + 12000000 + 1000000);
  CHECK_EQ(at_2500, 1000000 + 3000000 + 4000000); /* block 0's copy still going */
  sim_result_free(&r);
  sim_result_free(&base);
  sim_trace_free(t);
  return 0;
}

/* With activation offload on the same link: a policy offloads block 3's
 * activation (3000 us each way; no forward stash, so its pack waits for
 * the copy), its reload on use. By hand:
 *  - activations alone: the pack waits 3000 us, the reload at block 3's
 *    unpack (12500) 3000: 31600 us;
 *  - with blocks 0..3's weights, double-buffered: block 3's weights leave
 *    after that pack (11000..12000, behind the activation's D2H); at its
 *    backward hook (12500) block 3's reload (..13500, waited for) and
 *    block 2's (..14500) go first on the H2D stream and the activation's
 *    reload queues behind them: 14500..17500, a 4000 us stall; 33600 us,
 *    1000 more than if the streams were apart (the activation's copy would
 *    start at 13500). Bytes: 7 MB each way. Peak: at that reload, 9 MB of
 *    activations + 2 blocks + the 3 MB coming back + 1 MB resident = 15 MB.
 * And with the optimizer offload as well, the peak drops by its share on
 * top, the weights' figures unchanged. */
TEST(sim_weight_offload_composes_with_activations) {
  static const char policy[] =
      "return { api = 1, knobs = { max_fwd_stash = 0 }, decide = function(t, ctx)\n"
      "  if t.layer == 3 then return ferry.OFFLOAD end\n"
      "  return ferry.KEEP end }\n";
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result act, both;
  sim_config c = w_config(0, 0, 0);
  c.policy_source = policy;
  int rc = sim_replay(t, &c, &act, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK_NEAR(act.step_us, 31600, 1e-6);
  CHECK_NEAR(act.stall_us, 3000, 1e-6);
  CHECK_NEAR(act.host_wait_us, 3000, 1e-6);
  CHECK_NEAR(act.bytes_d2h, 3e6, 0);
  c = w_config(0, 4, 0);
  c.policy_source = policy;
  c.timeline = 1;
  CHECK_OK(sim_replay(t, &c, &both, err, sizeof err));
  CHECK_NEAR(both.step_us, 33600, 1e-6);
  CHECK_NEAR(both.stall_us, 5000, 1e-6); /* the reloads': 1000 weights + 4000 activation */
  CHECK_NEAR(both.host_wait_us, 3000, 1e-6);
  CHECK_NEAR(both.w_stall_us, 1000, 1e-6);
  CHECK_NEAR(both.bytes_d2h, 7e6, 0);
  CHECK_NEAR(both.bytes_h2d, 7e6, 0);
  CHECK_NEAR(both.w_bytes_h2d, 4e6, 0);
  CHECK_EQ(both.peak_device_bytes, 15000000);
  /* on the timeline (from the last step's start): the activation's reload
   * starts when block 2's weights arrive, and its offload ends where block
   * 3's weights' begins, each on its stream */
  int seen = 0;
  for (size_t k = 0; k < both.tl.n_iv; k++) {
    const sim_interval *iv = &both.tl.iv[k];
    double t0 = iv->t0 - both.tl.t_begin, t1 = iv->t1 - both.tl.t_begin;
    int weights = iv->module_path && !strcmp(iv->module_path, "weights");
    if (iv->lane == 2 && !weights) {
      CHECK_NEAR(t0, 14500, 1e-6);
      CHECK_NEAR(t1, 17500, 1e-6);
      seen++;
    } else if (iv->lane == 2 && iv->layer == 2) {
      CHECK_NEAR(t0, 13500, 1e-6);
      CHECK_NEAR(t1, 14500, 1e-6);
      seen++;
    } else if (iv->lane == 1 && !weights) {
      CHECK_NEAR(t0, 8000, 1e-6);
      CHECK_NEAR(t1, 11000, 1e-6);
      seen++;
    } else if (iv->lane == 1 && iv->layer == 3) {
      CHECK_NEAR(t0, 11000, 1e-6);
      CHECK_NEAR(t1, 12000, 1e-6);
      seen++;
    }
  }
  CHECK_EQ(seen, 4);
  sim_result_free(&both);
  /* and the optimizer's share on top (a trace with its resident parts) */
  sim_result_free(&act);
  sim_trace_free(t);
  synth_model m;
  synth_preset("tiny", &m);
  CHECK_OK(synth_to_trace(&m, &t));
  uint64_t lb = 0;
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, "parameters")) lb = t->resident[i].layer_bytes;
  CHECK(lb > 0);
  sim_result w_only, w_opt, opt_only;
  c = w_config(0, m.layers, 0);
  c.link = sim_hw_preset("h100")->link;
  CHECK_OK(sim_replay(t, &c, &w_only, err, sizeof err));
  c.optimizer_fraction = 0.5;
  CHECK_OK(sim_replay(t, &c, &w_opt, err, sizeof err));
  c.weight_count = 0;
  CHECK_OK(sim_replay(t, &c, &opt_only, err, sizeof err));
  CHECK_EQ(w_only.w_device_bytes, (uint64_t)m.layers * lb);
  CHECK_EQ(w_opt.resident_bytes, w_only.resident_bytes - w_opt.opt_device_bytes);
  CHECK_EQ(w_opt.resident_bytes, opt_only.resident_bytes - w_opt.w_device_bytes);
  CHECK_NEAR(w_opt.w_bytes_d2h, (double)m.layers * (double)lb, 0);
  CHECK_NEAR(w_opt.w_bytes_h2d, (double)m.layers * (double)lb, 0);
  /* the optimizer's copies are its own, the weights' are not in them */
  CHECK_NEAR(w_opt.opt_bytes_d2h, opt_only.opt_bytes_d2h, 0);
  CHECK_NEAR(w_opt.opt_bytes_h2d, opt_only.opt_bytes_h2d, 0);
  CHECK_NEAR(w_opt.bytes_d2h, (double)m.layers * (double)lb, 0);
  sim_result_free(&w_only);
  sim_result_free(&w_opt);
  sim_result_free(&opt_only);
  sim_trace_free(t);
  return 0;
}

/* text without the "parameters" line's layer_bytes. */
static const char *w_text_without_layer_bytes(const char *text) {
  static char buf[4096];
  static const char cut[] = ",\"layer_bytes\":1000000";
  const char *at = strstr(text, cut);
  if (!at) return NULL;
  snprintf(buf, sizeof buf, "%.*s%s", (int)(at - text), text, at + strlen(cut));
  return buf;
}

/* What weight offload needs and refuses; without "layer_bytes" a block's
 * weights are estimated as the parameters over the layers (said). */
TEST(sim_weight_offload_refusals_and_estimate) {
  const char *text = w_trace();
  sim_trace *t = NULL;
  char err[512];
  CHECK_OK(sim_trace_parse("w", text, strlen(text), &t, err, sizeof err));
  sim_result r;
  sim_config c = w_config(2, 3, 0); /* blocks 2..4 of 4 */
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "weight layers 2..4: the trace has 4 repeated block(s)");
  c = w_config(-1, 2, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  c = w_config(0, 2, 0);
  c.host_backend = 1;
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EUNSUPPORTED);
  sim_trace_free(t);
  /* no layer_bytes: 5 MB / 4 layers */
  const char *copy = w_text_without_layer_bytes(text);
  CHECK(copy != NULL);
  CHECK_OK(sim_trace_parse("w", copy, strlen(copy), &t, err, sizeof err));
  c = w_config(0, 2, 0);
  CHECK_OK(sim_replay(t, &c, &r, err, sizeof err));
  CHECK_EQ(r.w_estimated, 1);
  CHECK_EQ(r.w_layer_bytes, 1250000);
  CHECK_NEAR(r.w_bytes_d2h, 2500000, 0);
  sim_result_free(&r);
  sim_trace_free(t);
  /* no resident parameters */
  text = six_tensors();
  CHECK_OK(sim_trace_parse("six", text, strlen(text), &t, err, sizeof err));
  c = w_config(0, 1, 0);
  CHECK_EQ(sim_replay(t, &c, &r, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "\"parameters\"");
  sim_trace_free(t);
  return 0;
}
