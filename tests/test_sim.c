/* test_sim.c — the dry-run simulator's sim backend (its clock and link
 * model against hand-computed times) and its trace reader (errors, the
 * fast and cJSON paths, streaming loads). The synthesizer, the replays and
 * the simulated offloads are tested in the other test_sim_*.c files. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test_device.h"
#include <valgrind/valgrind.h>

#include "test.h"
#include "test_sim_trace.h"

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
#define PACK(id, bytes)                                                                  \
  "{\"ev\":\"pack\",\"t_us\":1,\"id\":" #id ",\"step\":1,\"bytes\":" #bytes              \
  ",\"dtype\":\"f32\",\"shape\":[4],\"kind\":\"activation\",\"phase\":\"forward\","      \
  "\"layer\":0,\"layers\":2,\"decision\":\"offload\"}\n"
#define UNPACK(id) "{\"ev\":\"unpack\",\"t_us\":5,\"id\":" #id "}\n"

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

/* Transient device memory ("alloc" .. "free", docs/trace-format.md): the
 * reader's errors, and on replay the bytes count on the device for exactly
 * their lifetime while no policy can offload them. */
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
