/*
 * trainer_host.c — a C training loop that embeds ferry on the host backend.
 *
 * The "model" is a stack of L elementwise layers, y = tanh(a_l * x + b_l),
 * on activations of N floats. Forward saves each layer's input through
 * ferry_pack; backward gets it back with ferry_unpack and computes the
 * gradients of a_l and b_l. The same steps run once with every tensor kept
 * and once with ferry offloading the first `--offload-layers` layers over an
 * emulated PCIe link; the gradients must be bit-identical, and the stats show
 * what moved. Every ferry call's return code is checked: a refused pack
 * leaves the tensor with the loop, which keeps it as the baseline does; any
 * other failure stops the run with ferry's message.
 *
 *   trainer_host [--layers L] [--floats N] [--steps S] [--offload-layers K]
 *                [--link-gbps G] [--trace FILE] [--policy FILE]
 */
#include <getopt.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry.h"

/* ---- device memory for the embedder callbacks ----------------------------
 * On the host backend "device" memory is ordinary memory. An owner token is
 * a refcounted buffer, as a framework tensor would be. */
typedef struct tensor {
  atomic_int refs;
  size_t bytes;
  float *data;
} tensor;

static atomic_long live_tensors;

static tensor *tensor_new(size_t bytes) {
  tensor *t = malloc(sizeof *t);
  if (!t) return NULL;
  t->data = malloc(bytes);
  if (!t->data) {
    free(t);
    return NULL;
  }
  atomic_init(&t->refs, 1);
  t->bytes = bytes;
  atomic_fetch_add(&live_tensors, 1);
  return t;
}

static void tensor_unref(tensor *t) {
  if (atomic_fetch_sub(&t->refs, 1) == 1) {
    free(t->data);
    free(t);
    atomic_fetch_sub(&live_tensors, 1);
  }
}

/* Errors that end the run: what failed and ferry's message (e NULL: none). */
static _Noreturn void die(const char *what, ferry_engine *e) {
  fprintf(stderr, "trainer_host: %s: %s\n", what, e ? ferry_last_error(e) : "out of memory");
  exit(1);
}

static tensor *tensor_or_die(size_t bytes) {
  tensor *t = tensor_new(bytes);
  if (!t) die("tensor_new", NULL);
  return t;
}

static int on_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  tensor *t = tensor_new(bytes);
  if (!t) return -1;
  *ptr = t->data;
  *owner = t;
  return 0;
}
static void on_release(void *ud, void *owner) { tensor_unref(owner); }
static void on_retain(void *ud, void *owner) { atomic_fetch_add(&((tensor *)owner)->refs, 1); }

/* ---- the decision: offload activations of the first K layers ------------- */
typedef struct first_layers {
  int k;
} first_layers;

static int decide_first_layers(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                               ferry_decision *out) {
  const first_layers *p = ud;
  out->action = d->kind == FERRY_KIND_ACTIVATION && d->layer >= 0 && d->layer < p->k
                    ? FERRY_OFFLOAD
                    : FERRY_KEEP;
  out->reload = FERRY_RELOAD_PREFETCH;
  out->prefetch_distance = 1;
  out->cacheable = 1;
  return 0;
}

/* ---- the model ------------------------------------------------------------- */
typedef struct model {
  int layers;
  size_t n;
  float *a, *b;   /* per-layer parameters */
  double *ga, *gb; /* their gradients */
} model;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One training step. With e == NULL every activation is kept by the loop
 * itself (the baseline); otherwise they go through ferry. Returns the loss. */
static double train_step(model *m, ferry_engine *e, int step, double *compute_s) {
  const size_t bytes = m->n * sizeof(float);
  tensor **saved = calloc((size_t)m->layers, sizeof *saved);
  ferry_handle *handles = calloc((size_t)m->layers, sizeof *handles);
  if (!saved || !handles) die("calloc", NULL);
  char path[64];
  tensor *x = tensor_or_die(bytes);
  for (size_t i = 0; i < m->n; i++) x->data[i] = (float)((double)((i * 2654435761u + (size_t)step) % 1000) / 1000.0 - 0.5);

  if (e && ferry_step_begin(e) != FERRY_OK) die("ferry_step_begin", e);
  double t0 = now_s(), copy_wait = 0;
  for (int l = 0; l < m->layers; l++) {
    tensor *y = tensor_or_die(bytes);
    for (size_t i = 0; i < m->n; i++) y->data[i] = tanhf(m->a[l] * x->data[i] + m->b[l]);
    if (e) {
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = bytes;
      d.dtype = FERRY_DTYPE_F32;
      d.kind = FERRY_KIND_ACTIVATION;
      d.ndim = 1;
      d.shape[0] = (int64_t)m->n;
      d.flags = FERRY_FLAG_CONTIGUOUS;
      d.layer = l;
      d.layer_count = m->layers;
      snprintf(path, sizeof path, "model.layers.%d", l);
      d.module_path = ferry_intern(e, path);
      d.module_class = ferry_intern(e, "TanhLayer");
      /* refused: ferry took nothing, the loop keeps x as the baseline does */
      if (ferry_pack(e, &d, x->data, x, NULL, &handles[l]) != FERRY_OK) saved[l] = x;
    } else {
      saved[l] = x; /* the baseline keeps its reference */
    }
    x = y;
  }
  double loss = 0;
  tensor *grad = tensor_or_die(bytes);
  for (size_t i = 0; i < m->n; i++) {
    loss += x->data[i];
    grad->data[i] = 1.0f;
  }
  if (e && ferry_backward_begin(e) != FERRY_OK) die("ferry_backward_begin", e);
  for (int l = m->layers - 1; l >= 0; l--) {
    tensor *in;
    if (saved[l]) { /* the baseline, or a pack ferry refused */
      in = saved[l];
    } else {
      void *ptr, *owner; /* set only when ferry_unpack succeeds */
      double w0 = now_s();
      if (ferry_unpack(e, handles[l], NULL, &ptr, &owner) != FERRY_OK) die("ferry_unpack", e);
      copy_wait += now_s() - w0;
      in = owner;
    }
    /* y = tanh(a*in + b): dy/dpre = 1 - y^2, recomputed from the input */
    double ga = 0, gb = 0;
    for (size_t i = 0; i < m->n; i++) {
      float y = tanhf(m->a[l] * in->data[i] + m->b[l]);
      float g = grad->data[i] * (1.0f - y * y);
      ga += (double)g * in->data[i];
      gb += g;
      grad->data[i] = g * m->a[l];
    }
    m->ga[l] += ga;
    m->gb[l] += gb;
    tensor_unref(in);
  }
  if (e && ferry_backward_end(e) != FERRY_OK) die("ferry_backward_end", e);
  if (e && ferry_step_end(e) != FERRY_OK) die("ferry_step_end", e);
  *compute_s += now_s() - t0 - copy_wait;
  tensor_unref(grad);
  tensor_unref(x);
  free(saved);
  free(handles);
  return loss;
}

static model model_new(int layers, size_t n) {
  model m = {layers, n, calloc((size_t)layers, sizeof(float)), calloc((size_t)layers, sizeof(float)),
             calloc((size_t)layers, sizeof(double)), calloc((size_t)layers, sizeof(double))};
  if (!m.a || !m.b || !m.ga || !m.gb) die("calloc", NULL);
  for (int l = 0; l < layers; l++) {
    m.a[l] = 0.9f + 0.01f * (float)l;
    m.b[l] = 0.05f * (float)(l % 3);
  }
  return m;
}

static void model_free(model *m) {
  free(m->a);
  free(m->b);
  free(m->ga);
  free(m->gb);
}

static void print_stats(ferry_engine *e) {
  ferry_stats s;
  if (ferry_get_stats(e, &s, sizeof s) != FERRY_OK) die("ferry_get_stats", e);
  printf("\n%-32s %16s\n", "ferry stats", "value");
  printf("%-32s %16s\n", "backend / arena", "");
  printf("  %-30s %16s\n", ferry_backend_name(e), ferry_arena_name(e));
#define ROW(name, v) printf("%-32s %16llu\n", name, (unsigned long long)(v))
  ROW("steps", s.steps);
  ROW("tensors packed", s.tensors_packed);
  ROW("tensors offloaded", s.tensors_offloaded);
  ROW("tensors kept", s.tensors_kept);
  ROW("unpacked from fwd stash", s.stash_hits);
  ROW("reloads prefetched", s.prefetches);
  ROW("bytes D2H", s.bytes_d2h);
  ROW("bytes H2D", s.bytes_h2d);
  ROW("device bytes held (peak)", s.device_bytes_held_peak);
  ROW("arena in use now", s.arena_in_use);
  ROW("arena peak in use", s.arena_peak);
  ROW("arena reserved", s.arena_reserved);
  ROW("backend pinned allocations", s.backend_pinned_allocs);
  ROW("host waits on events", s.waits);
  ROW("cap fallbacks", s.cap_fallbacks);
  ROW("policy errors", s.policy_errors);
  ROW("live handles", s.live_handles);
#undef ROW
}

int main(int argc, char **argv) {
  int layers = 12, steps = 5, offload_layers = 8;
  size_t n = 1 << 20; /* 4 MiB activations */
  double link_gbps = 8.0;
  const char *trace = NULL, *policy = NULL;
  static const struct option opts[] = {{"layers", required_argument, 0, 'l'},
                                       {"floats", required_argument, 0, 'n'},
                                       {"steps", required_argument, 0, 's'},
                                       {"offload-layers", required_argument, 0, 'k'},
                                       {"link-gbps", required_argument, 0, 'g'},
                                       {"trace", required_argument, 0, 't'},
                                       {"policy", required_argument, 0, 'p'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "l:n:s:k:g:t:p:h", opts, NULL)) != -1) {
    switch (c) {
    case 'l': layers = atoi(optarg); break;
    case 'n': n = (size_t)atol(optarg); break;
    case 's': steps = atoi(optarg); break;
    case 'k': offload_layers = atoi(optarg); break;
    case 'g': link_gbps = atof(optarg); break;
    case 't': trace = optarg; break;
    case 'p': policy = optarg; break;
    default:
      fprintf(stderr, "usage: %s [--layers L] [--floats N] [--steps S] [--offload-layers K] "
                      "[--link-gbps G] [--trace FILE] [--policy FILE]\n", argv[0]);
      return c == 'h' ? 0 : 2;
    }
  }
  if (layers < 1 || n < 1 || steps < 1) {
    fprintf(stderr, "layers, floats and steps must be positive\n");
    return 2;
  }
  printf("ferry %s — %d layers x %zu floats (%.1f MiB activations), %d steps, link %.1f GB/s\n",
         ferry_version_string(), layers, n, (double)n * 4 / (1 << 20), steps, link_gbps);

  /* Baseline: keep everything in the loop itself. */
  model base = model_new(layers, n);
  double base_compute = 0, base_loss = 0;
  double t0 = now_s();
  for (int s = 0; s < steps; s++) base_loss += train_step(&base, NULL, s, &base_compute);
  double base_s = now_s() - t0;

  /* With ferry. */
  first_layers fl = {offload_layers};
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = FERRY_BACKEND_HOST;
  cfg.device_alloc = on_alloc;
  cfg.release = on_release;
  cfg.retain = on_retain;
  cfg.decide = decide_first_layers;
  cfg.decide_ud = &fl;
  cfg.max_fwd_stash = 2;
  cfg.link.d2h_bytes_per_s = link_gbps * 1e9;
  cfg.link.h2d_bytes_per_s = link_gbps * 1e9;
  cfg.link.latency_us = 5;
  cfg.link.duplex = 0.9;
  cfg.trace_path = trace;
  cfg.policy_path = policy;
  ferry_engine *e = NULL;
  char err[512];
  if (ferry_engine_create(&cfg, &e, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "ferry_engine_create: %s\n", err);
    return 1;
  }
  model m = model_new(layers, n);
  double compute = 0, loss = 0;
  t0 = now_s();
  for (int s = 0; s < steps; s++) loss += train_step(&m, e, s, &compute);
  double ferry_s = now_s() - t0;
  print_stats(e);
  ferry_engine_destroy(e);

  int identical = loss == base_loss && !memcmp(m.ga, base.ga, (size_t)layers * sizeof(double)) &&
                  !memcmp(m.gb, base.gb, (size_t)layers * sizeof(double));
  printf("\n%-32s %16s %16s\n", "", "baseline", "ferry");
  printf("%-32s %16.3f %16.3f\n", "wall time (s)", base_s, ferry_s);
  printf("%-32s %16.3f %16.3f\n", "loss (sum over steps)", base_loss, loss);
  printf("%-32s %16.6g %16.6g\n", "grad a[0]", base.ga[0], m.ga[0]);
  printf("gradients and losses bit-identical: %s\n", identical ? "yes" : "NO");
  printf("tensors still alive: %ld\n", atomic_load(&live_tensors));
  model_free(&base);
  model_free(&m);
  return identical && atomic_load(&live_tensors) == 0 ? 0 : 1;
}
