/* test_trace_recorder.c — the engine's trace recorder (every event of a
 * run in the trace file) and its Chrome trace (chrome_recorder.c): copies
 * timed and joined, one file per engine. */
#include <cjson/cJSON.h>
#include <unistd.h>

#include "test.h"
#include "test_device.h"
#include "test_stash_fixture.h"

/* ---- trace recorder ------------------------------------------------------------------------ */
TEST(trace_records_every_event) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  char path[] = "/tmp/ferry-trace-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.trace_path = path;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 20 };
  ferry_handle hs[M];
  uint64_t sums[M];
  CHECK_OK(ferry_step_begin(f.e));
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, 1000 + (size_t)i, (uint64_t)i, &sums[i])));
  CHECK_OK(ferry_backward_begin(f.e));
  for (int i = M - 1; i >= 1; i--)
    if (unpack_check(&f, hs[i], 1000 + (size_t)i, sums[i])) return 1;
  CHECK_OK(ferry_discard(f.e, hs[0]));
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  ferry_engine_destroy(f.e);

  FILE *in = fopen(path, "r");
  CHECK(in);
  char line[4096];
  int n = 0, packs = 0, unpacks = 0, discards = 0, offl = 0, steps = 0, bw = 0;
  double last_t = -1;
  while (fgets(line, sizeof line, in)) {
    cJSON *o = cJSON_Parse(line);
    CHECK(o);
    const char *ev = cJSON_GetStringValue(cJSON_GetObjectItem(o, "ev"));
    CHECK(ev);
    double t = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "t_us"));
    CHECK(t >= last_t);
    last_t = t;
    if (n == 0) {
      CHECK(strcmp(ev, "header") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "format")), "ferry-trace") == 0);
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "version")), 1);
    } else if (!strcmp(ev, "pack")) {
      packs++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), packs);
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "bytes")), 1000 + packs - 1);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "module")), "model.layers.0.mlp") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "kind")), "activation") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "dtype")), "u8") == 0);
      CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(o, "shape")) == 1);
      offl += !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "decision")), "offload");
    } else if (!strcmp(ev, "unpack")) {
      unpacks++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), M - unpacks + 1);
    } else if (!strcmp(ev, "discard")) {
      discards++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), 1);
    } else if (!strcmp(ev, "step_begin") || !strcmp(ev, "step_end")) {
      steps++;
    } else if (!strcmp(ev, "backward_begin") || !strcmp(ev, "backward_end")) {
      bw++;
    } else {
      CHECK(!"unexpected event");
    }
    cJSON_Delete(o);
    n++;
  }
  fclose(in);
  unlink(path);
  CHECK_EQ(packs, M);
  CHECK_EQ(unpacks, M - 1);
  CHECK_EQ(discards, 1);
  CHECK_EQ(steps, 2);
  CHECK_EQ(bw, 2);
  CHECK_EQ(offl, (int)s.tensors_offloaded);
  return 0;
}

/* ---- Chrome trace of the run (chrome_recorder.c) ------------------------------------------- */
/* The trace file parsed (NULL if it does not parse); the caller frees it. */
static cJSON *chrome_load(const char *path) {
  FILE *in = fopen(path, "r");
  if (!in) return NULL;
  fseek(in, 0, SEEK_END);
  long n = ftell(in);
  fseek(in, 0, SEEK_SET);
  char *text = malloc((size_t)n + 1);
  size_t got = text ? fread(text, 1, (size_t)n, in) : 0;
  fclose(in);
  if (!text) return NULL;
  text[got] = 0;
  cJSON *root = cJSON_Parse(text);
  free(text);
  return root;
}

static const char *ev_str(const cJSON *e, const char *key) {
  return cJSON_GetStringValue(cJSON_GetObjectItem(e, key));
}
static double ev_num(const cJSON *e, const char *key) {
  return cJSON_GetNumberValue(cJSON_GetObjectItem(e, key));
}
static double ev_arg(const cJSON *e, const char *key) {
  return cJSON_GetNumberValue(cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), key));
}

/* Counts events with phase ph (and name, when not NULL). */
static int chrome_count(const cJSON *events, const char *ph, const char *name) {
  int n = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, events)
    n += !strcmp(ev_str(e, "ph"), ph) && (!name || !strcmp(ev_str(e, "name"), name));
  return n;
}

/* Two steps of offloads over a slow host link (the CUDA double's copies are
 * slow too): the trace parses after each step end; its copies are the
 * engine's (count, bytes each way); a stream's copies do not overlap and, on
 * the host link, each lasts at least its bytes at the link's rate (the
 * worker's times, not the issuing call's); every arrow joins an offload to
 * the reload of the same tensor. An unwritable path fails creation. */
TEST(chrome_trace_times_copies_and_joins_them) {
  enum { STEPS = 2, M = 24 };
  const double rate = 200e6; /* B/s */
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  char path[] = "/tmp/ferry-chrome-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.chrome_trace_path = path;
  c.link = (ferry_link){rate, rate, 0, 1.0};
  CHECK_OK(fixture_open(&f, &c));
  for (int step = 0; step < STEPS; step++) {
    ferry_handle hs[M];
    uint64_t sums[M];
    CHECK_OK(ferry_step_begin(f.e));
    for (int i = 0; i < M; i++)
      CHECK((hs[i] = pack_new(&f, 4096 + 64 * (size_t)i, (uint64_t)(step * M + i), &sums[i])));
    CHECK_OK(ferry_backward_begin(f.e));
    for (int i = M - 1; i >= 1; i--)
      if (unpack_check(&f, hs[i], 4096 + 64 * (size_t)i, sums[i])) return 1;
    CHECK_OK(ferry_discard(f.e, hs[0]));
    CHECK_OK(ferry_step_end(f.e));
    cJSON *mid = chrome_load(path); /* whole at every step end */
    CHECK(mid);
    CHECK_EQ(chrome_count(cJSON_GetObjectItem(mid, "traceEvents"), "i", "step end"), step + 1);
    cJSON_Delete(mid);
  }
  if (check_quiescent(&f)) return 1;
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  ferry_engine_destroy(f.e);

  cJSON *root = chrome_load(path);
  CHECK(root);
  const cJSON *events = cJSON_GetObjectItem(root, "traceEvents"), *e;
  double bytes[2] = {0, 0}, end[2] = {0, 0};
  int copies[2] = {0, 0}, slow = 0, overlap = 0, joined = 0;
  cJSON_ArrayForEach(e, events) {
    const char *cat = ev_str(e, "cat");
    if (strcmp(ev_str(e, "ph"), "X") || !cat) continue;
    int dir = !strcmp(cat, "offload") ? 0 : !strcmp(cat, "reload") ? 1 : -1;
    if (dir < 0) continue;
    double ts = ev_num(e, "ts"), dur = ev_num(e, "dur"), b = ev_arg(e, "bytes");
    CHECK_EQ(ev_num(e, "tid"), dir + 1); /* "D2H copies", "H2D copies" */
    CHECK(strcmp(ev_str(e, "name"), "model.layers.0.mlp") == 0);
    copies[dir]++;
    bytes[dir] += b;
    overlap += ts + 0.002 < end[dir]; /* written in completion order */
    end[dir] = ts + dur;
    slow += test_backend_kind() == FERRY_BACKEND_HOST && dur < b / rate * 1e6 * 0.95;
    if (dir == 0) continue;
    /* the arrow into this reload starts on the offload of its tensor */
    const cJSON *g, *h;
    cJSON_ArrayForEach(g, events) {
      if (strcmp(ev_str(g, "ph"), "f") || ev_num(g, "ts") != ts) continue;
      cJSON_ArrayForEach(h, events) {
        if (strcmp(ev_str(h, "ph"), "s") || ev_num(h, "id") != ev_num(g, "id")) continue;
        const cJSON *o;
        cJSON_ArrayForEach(o, events)
          joined += !strcmp(ev_str(o, "ph"), "X") && ev_str(o, "cat") &&
                    !strcmp(ev_str(o, "cat"), "offload") && ev_num(o, "ts") == ev_num(h, "ts") &&
                    ev_arg(o, "tensor") == ev_arg(e, "tensor") &&
                    ev_num(o, "ts") + ev_num(o, "dur") <= ts + 0.002;
      }
    }
  }
  CHECK_EQ(copies[0], s.tensors_offloaded);
  CHECK_EQ(bytes[0], s.bytes_d2h);
  CHECK_EQ(bytes[1], s.bytes_h2d);
  CHECK(copies[1] > 0);
  CHECK_EQ(overlap, 0);
  CHECK_EQ(slow, 0);
  CHECK_EQ(joined, copies[1]); /* every reload here follows its offload */
  CHECK_EQ(chrome_count(events, "s", NULL), copies[1]);
  CHECK_EQ(chrome_count(events, "f", NULL), copies[1]);
  CHECK_EQ(chrome_count(events, "X", "pack"), STEPS * M);
  CHECK_EQ(chrome_count(events, "i", "backward"), STEPS);
  cJSON_Delete(root);
  unlink(path);

  c = fixture_config(&f, 1);
  c.chrome_trace_path = "/nonexistent-dir/trace.json";
  char err[512] = "";
  ferry_engine *e2 = NULL;
  CHECK_RC(ferry_engine_create(&c, &e2, err, sizeof err), FERRY_EIO);
  CHECK_STR_CONTAINS(err, "/nonexistent-dir/trace.json");
  return 0;
}

/* Two engines on one thread, calls interleaved: each file has one lane for
 * the thread (not one per switch). A second engine given a file another
 * engine is writing is refused (it would truncate it); once that engine is
 * gone the file may be used again. */
TEST(chrome_trace_one_file_per_engine) {
  fixture f, g;
  ferry_config c = fixture_config(&f, 1), d = fixture_config(&g, 1);
  char p1[] = "/tmp/ferry-chrome-XXXXXX", p2[] = "/tmp/ferry-chrome-XXXXXX";
  int fd1 = mkstemp(p1), fd2 = mkstemp(p2);
  CHECK(fd1 >= 0 && fd2 >= 0);
  close(fd1);
  close(fd2);
  c.chrome_trace_path = p1;
  d.chrome_trace_path = p2;
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(fixture_open(&g, &d));
  enum { M = 6 };
  ferry_handle hf[M], hg[M];
  uint64_t sf[M], sg[M];
  for (int i = 0; i < M; i++) {
    CHECK((hf[i] = pack_new(&f, 2048, (uint64_t)i, &sf[i])));
    CHECK((hg[i] = pack_new(&g, 2048, (uint64_t)i + 100, &sg[i])));
  }
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hf[i], 2048, sf[i]) || unpack_check(&g, hg[i], 2048, sg[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  CHECK_OK(ferry_step_end(g.e));
  fixture h;
  ferry_config twice = fixture_config(&h, 1);
  twice.chrome_trace_path = p1;
  char err[512] = "";
  ferry_engine *e3 = NULL;
  CHECK_RC(ferry_engine_create(&twice, &e3, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "another engine");
  ferry_engine_destroy(f.e);
  ferry_engine_destroy(g.e);
  for (int k = 0; k < 2; k++) {
    cJSON *root = chrome_load(k ? p2 : p1);
    CHECK(root);
    const cJSON *events = cJSON_GetObjectItem(root, "traceEvents");
    CHECK_EQ(chrome_count(events, "M", "thread_name"), 3); /* D2H, H2D, this thread */
    CHECK_EQ(chrome_count(events, "X", "pack"), M);
    cJSON_Delete(root);
  }
  CHECK_OK(ferry_engine_create(&twice, &e3, err, sizeof err)); /* free again */
  ferry_engine_destroy(e3);
  unlink(p1);
  unlink(p2);
  return 0;
}
