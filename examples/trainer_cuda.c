/*
 * trainer_cuda.c — a C training loop that embeds ferry on the cuda backend.
 *
 * The CUDA counterpart of trainer_host.c, against the CUDA runtime API in
 * plain C (no kernels, no nvcc). Each "layer" computes its output on the
 * host and uploads it to the device on the trainer's compute stream (a real
 * trainer launches its kernels there instead). Forward saves each layer's
 * input with ferry_pack; backward takes it back with ferry_unpack on the same
 * stream and checks it is bit-identical to what was saved (where a real
 * backward would run its gradient kernels). The first --offload-layers layers
 * are offloaded to ferry's pinned host arena.
 *
 *   trainer_cuda [--layers L] [--floats N] [--steps S] [--offload-layers K]
 *                [--device D]
 *
 * Started by `ferry run`, it honours FERRY_POLICY, FERRY_TRACE,
 * FERRY_CHROME_TRACE and FERRY_HOST_CAP (see apply_launcher_env;
 * docs/embedding.md).
 *
 * It calls only CUDA entry points that the CUDA test double
 * (tests/cuda_double) models, so CI also runs it, end to end, over the double
 * (trainer_cuda_double); on a machine with a GPU it runs on the real one.
 *
 * Exit status: 0 every tensor came back identical and every buffer was
 * freed; 1 a mismatch or an error; 2 bad usage; 3 no usable CUDA driver or
 * device (FERRY_ENODEV, with CUDA's own message) — what a machine without a
 * GPU gives, and what CI checks (examples/check_trainer_cuda.cmake).
 */
#include <cuda_runtime_api.h>
#include <getopt.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

#define EXIT_NODEV 3

/* Every CUDA call of the trainer is checked; a failure ends the example. */
#define CUDA_OK(call)                                                                   \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      fprintf(stderr, "trainer_cuda: %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,  \
              cudaGetErrorString(err_), cudaGetErrorName(err_));                        \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* ---- device memory for the embedder callbacks ------------------------------
 * An owner token is a refcounted device buffer, as a framework tensor is.
 * cudaMalloc/cudaFree keep the example short. cudaFree waits for the device,
 * so a trainer that allocates per step wants a caching or stream-ordered
 * allocator (torch's; cudaMallocAsync, with the free ordered on the compute
 * stream): that is safe with ferry because it releases a buffer only after
 * its own copies of it have completed, so only compute-stream work can still
 * be using it. */
typedef struct dev_allocator {
  atomic_long live;  /* buffers allocated and not yet freed */
  atomic_int failed; /* a free failed (release cannot return an error) */
} dev_allocator;

typedef struct dev_tensor {
  atomic_int refs;
  dev_allocator *allocator;
  void *ptr;
} dev_tensor;

static dev_tensor *dev_tensor_new(dev_allocator *a, size_t bytes) {
  dev_tensor *t = malloc(sizeof *t);
  if (!t) return NULL;
  if (cudaMalloc(&t->ptr, bytes) != cudaSuccess) {
    (void)cudaGetLastError(); /* clear it: the caller reports the failure */
    free(t);
    return NULL;
  }
  atomic_init(&t->refs, 1);
  t->allocator = a;
  atomic_fetch_add(&a->live, 1);
  return t;
}

static void dev_tensor_unref(dev_tensor *t) {
  if (atomic_fetch_sub(&t->refs, 1) != 1) return;
  if (cudaFree(t->ptr) != cudaSuccess) atomic_store(&t->allocator->failed, 1);
  atomic_fetch_sub(&t->allocator->live, 1);
  free(t);
}

/* ferry_alloc_fn: `stream` is the compute stream passed to the ferry call
 * that needs the buffer (ferry_unpack, ferry_prefetch; NULL from
 * ferry_backward_begin, which may prefetch). */
static int on_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  dev_tensor *t = dev_tensor_new(ud, (size_t)bytes); /* cudaMalloc: usable on any stream */
  if (!t) return -1; /* ferry reports FERRY_EALLOC; the tensor stays on the host */
  *ptr = t->ptr;
  *owner = t;
  return 0;
}
/* ferry_release_fn: ferry gives back the one reference it held. */
static void on_release(void *ud, void *owner) { dev_tensor_unref(owner); }
/* ferry_retain_fn: lets ferry store a buffer packed twice only once. */
static void on_retain(void *ud, void *owner) {
  atomic_fetch_add(&((dev_tensor *)owner)->refs, 1);
}

/* ---- the decision: offload activations of the first K layers --------------- */
static int decide_first_layers(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                               ferry_decision *out) {
  const int *k = ud;
  out->action = d->kind == FERRY_KIND_ACTIVATION && d->layer >= 0 && d->layer < *k
                    ? FERRY_OFFLOAD
                    : FERRY_KEEP;
  out->reload = FERRY_RELOAD_PREFETCH; /* start the next reload while this layer runs */
  out->prefetch_distance = 1;
  out->cacheable = 1;
  return 0;
}

/* ---- settings from `ferry run` ------------------------------------------------
 * The launcher passes its options as environment variables; a C trainer
 * applies the ones it wants. Returns 0, or 2 after a message. */
static int apply_launcher_env(ferry_config *cfg) {
  const char *policy = getenv("FERRY_POLICY"), *trace = getenv("FERRY_TRACE");
  const char *cap = getenv("FERRY_HOST_CAP"), *chrome = getenv("FERRY_CHROME_TRACE");
  if (policy && *policy) cfg->policy_path = policy; /* replaces the decide callback */
  if (trace && *trace) cfg->trace_path = trace;
  if (chrome && *chrome) cfg->chrome_trace_path = chrome;
  if (cap && *cap) {
    char *end;
    if (cap[strlen(cap) - 1] == '%') {
      cfg->host_cap_pct = strtod(cap, &end);
      if (*end != '%' || !(cfg->host_cap_pct > 0 && cfg->host_cap_pct <= 100)) goto bad_cap;
    } else {
      cfg->host_cap_bytes = strtoull(cap, &end, 10);
      if (*end || !cfg->host_cap_bytes) goto bad_cap;
    }
  }
  return 0;
bad_cap:
  fprintf(stderr, "trainer_cuda: FERRY_HOST_CAP='%s' is neither bytes nor a percentage\n", cap);
  return 2;
}

/* ---- the model -------------------------------------------------------------------
 * Layer l maps x to y = x rotated left by shift(l) bytes with a small
 * layer-specific stripe written over it: distinct, deterministic
 * activations. It is computed on the host (on the host's copy of x) and
 * uploaded on the compute stream, from pinned staging buffers that take
 * turns: a buffer is refilled only after the event of its last upload. */
#define STAGING_SLOTS 2

static void layer_forward(int l, const unsigned char *x, unsigned char *y, size_t bytes) {
  size_t k = ((size_t)l * 4096 + 64) % bytes;
  memcpy(y, x + k, bytes - k);
  memcpy(y + bytes - k, x, k);
  size_t len = bytes < 256 ? bytes : 256, at = ((size_t)l * 65536) % bytes;
  if (at + len > bytes) at = bytes - len;
  memset(y + at, 0x40 + (l & 0x3f), len);
}

static uint64_t fnv1a(const unsigned char *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

typedef struct trainer {
  int layers;
  size_t bytes;
  cudaStream_t stream; /* the compute stream: the trainer's, not ferry's */
  dev_allocator *allocator;
  unsigned char *staging[STAGING_SLOTS]; /* pinned (cudaHostAlloc) */
  cudaEvent_t uploaded[STAGING_SLOTS];
  unsigned char *readback; /* pinned, for the checks in backward */
  cudaEvent_t read_done;
  uint64_t *saved_hash; /* hash of each layer input as packed */
  ferry_handle *handles;
} trainer;

/* Upload host bytes into a new device tensor on the compute stream. */
static dev_tensor *upload(trainer *t, int slot, const unsigned char *host) {
  dev_tensor *d = dev_tensor_new(t->allocator, t->bytes);
  if (!d) return NULL;
  CUDA_OK(cudaEventSynchronize(t->uploaded[slot])); /* its previous upload is done */
  memcpy(t->staging[slot], host, t->bytes);
  CUDA_OK(cudaMemcpyAsync(d->ptr, t->staging[slot], t->bytes, cudaMemcpyHostToDevice,
                          t->stream));
  CUDA_OK(cudaEventRecord(t->uploaded[slot], t->stream));
  return d;
}

/* Drop the trainer's reference to d on an error path: its upload may still
 * be running on the compute stream, which a free must wait for. */
static void drop_after_stream(trainer *t, dev_tensor *d) {
  CUDA_OK(cudaEventRecord(t->read_done, t->stream));
  CUDA_OK(cudaEventSynchronize(t->read_done));
  dev_tensor_unref(d);
}

/* One step: forward packs every layer input, backward unpacks them in
 * reverse. Returns the number of tensors that did not come back identical,
 * or -1 on an error. */
static int train_step(trainer *t, ferry_engine *e, int step, unsigned char *host_x,
                      unsigned char *host_y) {
  const size_t bytes = t->bytes;
  char path[64];
  int mismatches = 0;

  for (size_t i = 0; i < bytes; i++)
    host_x[i] = (unsigned char)(((i * 2654435761u) >> 13) ^ (unsigned)step); /* the batch */
  dev_tensor *x = upload(t, 0, host_x);
  if (!x) goto no_memory;

  if (ferry_step_begin(e) != FERRY_OK) {
    drop_after_stream(t, x); /* still ours: nothing was packed */
    goto ferry_error;
  }
  for (int l = 0; l < t->layers; l++) {
    layer_forward(l, host_x, host_y, bytes);
    dev_tensor *y = upload(t, (l + 1) % STAGING_SLOTS, host_y);
    if (!y) {
      drop_after_stream(t, x);
      goto no_memory;
    }

    /* Save the layer input for backward. ferry takes the trainer's
     * reference to x; `stream` is the stream whose work produced x, so
     * ferry's offload copy is ordered after it. */
    ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
    d.bytes = bytes;
    d.dtype = FERRY_DTYPE_U8;
    d.kind = FERRY_KIND_ACTIVATION;
    d.ndim = 1;
    d.shape[0] = (int64_t)bytes;
    d.flags = FERRY_FLAG_CONTIGUOUS;
    d.layer = l;
    d.layer_count = t->layers;
    d.phase = FERRY_PHASE_FORWARD;
    snprintf(path, sizeof path, "model.layers.%d", l);
    d.module_path = ferry_intern(e, path); /* interned: decisions cache per site */
    d.module_class = ferry_intern(e, "ShiftLayer");
    t->saved_hash[l] = fnv1a(host_x, bytes);
    if (ferry_pack(e, &d, x->ptr, x, t->stream, &t->handles[l]) != FERRY_OK) {
      drop_after_stream(t, x); /* on error ferry took nothing: the reference is ours */
      drop_after_stream(t, y);
      goto ferry_error;
    }
    x = y;
    unsigned char *swap = host_x;
    host_x = host_y;
    host_y = swap;
  }
  /* The output: a real trainer computes its loss here. Its upload may still
   * be running on the compute stream, and a stream-ordered allocator would
   * not wait for it, so wait before freeing. */
  CUDA_OK(cudaEventRecord(t->read_done, t->stream));
  CUDA_OK(cudaEventSynchronize(t->read_done));
  dev_tensor_unref(x);

  if (ferry_backward_begin(e) != FERRY_OK) goto ferry_error;
  for (int l = t->layers - 1; l >= 0; l--) {
    void *ptr, *owner;
    /* Work enqueued on the compute stream from now on sees the tensor's
     * bytes (ferry made the stream wait for any reload); the host is not
     * blocked by ferry here. */
    if (ferry_unpack(e, t->handles[l], t->stream, &ptr, &owner) != FERRY_OK) goto ferry_error;
    /* The check, which a trainer would not do: read back and compare. The
     * host wait is the example's, to read the bytes. */
    CUDA_OK(cudaMemcpyAsync(t->readback, ptr, bytes, cudaMemcpyDeviceToHost, t->stream));
    CUDA_OK(cudaEventRecord(t->read_done, t->stream));
    CUDA_OK(cudaEventSynchronize(t->read_done));
    if (fnv1a(t->readback, bytes) != t->saved_hash[l]) {
      fprintf(stderr, "trainer_cuda: step %d layer %d: tensor changed in ferry\n", step, l);
      mismatches++;
    }
    dev_tensor_unref(owner); /* the reference ferry handed back is ours */
  }
  if (ferry_backward_end(e) != FERRY_OK || ferry_step_end(e) != FERRY_OK) goto ferry_error;
  return mismatches;

no_memory:
  fprintf(stderr, "trainer_cuda: step %d: cudaMalloc failed\n", step);
  return -1;
ferry_error:
  fprintf(stderr, "trainer_cuda: step %d: %s\n", step, ferry_last_error(e));
  return -1;
}

static void print_stats(ferry_engine *e) {
  ferry_stats s;
  if (ferry_get_stats(e, &s, sizeof s) != FERRY_OK) {
    fprintf(stderr, "trainer_cuda: ferry_get_stats: %s\n", ferry_last_error(e));
    return;
  }
  printf("\nferry stats (%s backend, %s arena)\n", ferry_backend_name(e), ferry_arena_name(e));
#define ROW(name, v) printf("  %-30s %16llu\n", name, (unsigned long long)(v))
  ROW("steps", s.steps);
  ROW("tensors packed", s.tensors_packed);
  ROW("tensors offloaded", s.tensors_offloaded);
  ROW("unpacked from fwd stash", s.stash_hits);
  ROW("reloads prefetched", s.prefetches);
  ROW("bytes D2H", s.bytes_d2h);
  ROW("bytes H2D", s.bytes_h2d);
  ROW("device bytes held (peak)", s.device_bytes_held_peak);
  ROW("arena peak in use", s.arena_peak);
  ROW("host waits on events", s.waits);
  ROW("cap fallbacks", s.cap_fallbacks);
  ROW("policy errors", s.policy_errors);
#undef ROW
}

int main(int argc, char **argv) {
  int layers = 8, steps = 3, offload_layers = 6, device = -1;
  size_t floats = 1 << 20; /* 4 MiB activations */
  static const struct option opts[] = {{"layers", required_argument, 0, 'l'},
                                       {"floats", required_argument, 0, 'n'},
                                       {"steps", required_argument, 0, 's'},
                                       {"offload-layers", required_argument, 0, 'k'},
                                       {"device", required_argument, 0, 'd'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "l:n:s:k:d:h", opts, NULL)) != -1) {
    switch (c) {
    case 'l': layers = atoi(optarg); break;
    case 'n': floats = atol(optarg) > 0 ? (size_t)atol(optarg) : 0; break;
    case 's': steps = atoi(optarg); break;
    case 'k': offload_layers = atoi(optarg); break;
    case 'd': device = atoi(optarg); break;
    default:
      fprintf(c == 'h' ? stdout : stderr,
              "usage: %s [--layers L] [--floats N] [--steps S] [--offload-layers K] "
              "[--device D]\n", argv[0]);
      return c == 'h' ? 0 : 2;
    }
  }
  if (layers < 1 || floats < 1 || steps < 1 || device < -1) {
    fprintf(stderr, "trainer_cuda: layers, floats and steps must be positive, device >= -1\n");
    return 2;
  }

  /* The engine first: creating it is where a missing driver or device is
   * reported, as FERRY_ENODEV with CUDA's message, and nothing else has
   * touched CUDA yet. device -1 = the calling thread's current device. */
  dev_allocator allocator;
  atomic_init(&allocator.live, 0);
  atomic_init(&allocator.failed, 0);
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = FERRY_BACKEND_CUDA;
  cfg.device = device;
  cfg.device_alloc = on_alloc;
  cfg.release = on_release;
  cfg.retain = on_retain;
  cfg.callback_ud = &allocator;
  cfg.decide = decide_first_layers;
  cfg.decide_ud = &offload_layers;
  cfg.max_fwd_stash = 2; /* device buffers kept after their offload copy */
  if (apply_launcher_env(&cfg)) return 2;
  ferry_engine *e = NULL;
  char err[512];
  int rc = ferry_engine_create(&cfg, &e, err, sizeof err);
  if (rc == FERRY_ENODEV) {
    fprintf(stderr, "trainer_cuda: no usable CUDA device: %s: %s\n", ferry_err_name(rc), err);
    return EXIT_NODEV;
  }
  if (rc != FERRY_OK) {
    fprintf(stderr, "trainer_cuda: ferry_engine_create: %s: %s\n", ferry_err_name(rc), err);
    return 1;
  }

  /* The trainer's side of CUDA: its device, its compute stream, its pinned
   * staging buffers. */
  if (device >= 0) CUDA_OK(cudaSetDevice(device));
  else CUDA_OK(cudaGetDevice(&device));
  const size_t bytes = floats * sizeof(float);
  trainer t = {.layers = layers, .bytes = bytes, .allocator = &allocator};
  CUDA_OK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
  for (int i = 0; i < STAGING_SLOTS; i++) {
    CUDA_OK(cudaHostAlloc((void **)&t.staging[i], bytes, cudaHostAllocDefault));
    CUDA_OK(cudaEventCreateWithFlags(&t.uploaded[i], cudaEventDisableTiming));
  }
  CUDA_OK(cudaHostAlloc((void **)&t.readback, bytes, cudaHostAllocDefault));
  CUDA_OK(cudaEventCreateWithFlags(&t.read_done, cudaEventDisableTiming));
  t.saved_hash = calloc((size_t)layers, sizeof *t.saved_hash);
  t.handles = calloc((size_t)layers, sizeof *t.handles);
  unsigned char *host_x = malloc(bytes), *host_y = malloc(bytes);
  if (!t.saved_hash || !t.handles || !host_x || !host_y) {
    fprintf(stderr, "trainer_cuda: out of host memory\n");
    return 1;
  }
  printf("ferry %s, cuda backend on device %d: %d layers x %.2f MiB, %d steps, offloading "
         "the first %d layers\n",
         ferry_version_string(), device, layers, (double)bytes / (1 << 20), steps,
         offload_layers);

  int bad = 0;
  for (int s = 0; s < steps && bad >= 0; s++) {
    int m = train_step(&t, e, s, host_x, host_y);
    bad = m < 0 ? -1 : bad + m;
  }
  print_stats(e);
  /* The engine goes first: it gives back what it still holds, waiting for
   * its copies, before the trainer tears down its own CUDA objects. */
  ferry_engine_destroy(e);
  for (int i = 0; i < STAGING_SLOTS; i++) {
    CUDA_OK(cudaEventSynchronize(t.uploaded[i]));
    CUDA_OK(cudaEventDestroy(t.uploaded[i]));
    CUDA_OK(cudaFreeHost(t.staging[i]));
  }
  CUDA_OK(cudaEventDestroy(t.read_done));
  CUDA_OK(cudaFreeHost(t.readback));
  CUDA_OK(cudaStreamDestroy(t.stream));
  free(t.saved_hash);
  free(t.handles);
  free(host_x);
  free(host_y);

  long live = atomic_load(&allocator.live);
  printf("\ntensors not identical after ferry: %d\n", bad < 0 ? -1 : bad);
  printf("device buffers still allocated: %ld%s\n", live,
         atomic_load(&allocator.failed) ? " (a free failed)" : "");
  int ok = bad == 0 && live == 0 && !atomic_load(&allocator.failed);
  printf("every tensor came back bit-identical: %s\n", ok ? "yes" : "NO");
  return ok ? 0 : 1;
}
