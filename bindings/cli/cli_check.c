/*
 * ferry_check.c — `ferry check [options] POLICY`: load a policy, print its
 * API version, name and knobs, run it over the tensors a transformer
 * training step saves (every layer's q/k/v/o projections, attention scores,
 * How it works: docs/internals.md#cli_checkc.
 */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "cli.h"
#include "ferry_tools.h"

/* Faults as they happen, each distinct message printed once; repeats are
 * counted and summed up at the end (a fault in every decision would
 * otherwise print one identical line per tensor). */
#define MAX_DISTINCT_FAULTS 64
typedef struct {
  char *msg[MAX_DISTINCT_FAULTS];
  uint64_t count[MAX_DISTINCT_FAULTS];
  int n;
} fault_log;

static void note_fault(fault_log *f, const char *msg) {
  for (int i = 0; i < f->n; i++)
    if (!strcmp(f->msg[i], msg)) {
      f->count[i]++;
      return;
    }
  printf("  fault: %s\n", msg);
  if (f->n < MAX_DISTINCT_FAULTS && (f->msg[f->n] = strdup(msg))) f->count[f->n++] = 1;
}

int ferry_cli_check(int argc, char **argv);

typedef struct model_shape {
  int layers, batch, seq, hidden, heads, intermediate, vocab;
} model_shape;

typedef struct site {
  char path[96];
  const char *cls;
  int kind, dtype, layer, ndim;
  int64_t shape[4];
} site;

static const char *const KIND_NAMES[] = {"activation", "parameter", "buffer", "other"};

static void usage(FILE *to) {
  fprintf(to,
          "usage: ferry check [options] POLICY\n"
          "\n"
          "Load a Lua policy, print its API version, name and knobs, and print its\n"
          "decision for each tensor a transformer training step saves.\n"
          "\n"
          "  -t, --trusted        allow the FFI (as an embedder marking it trusted)\n"
          "  -l, --layers N       transformer layers of the model (default 4)\n"
          "  -s, --steps N        training steps to run (default 2; later steps show\n"
          "                       which answers came from the site cache)\n"
          "  -r, --ram-pct P      host RAM used %% the context reports (default 30)\n"
          "  -q, --quiet          print only the header, faults and the summary (no\n"
          "                       ferry.log lines)\n"
          "  -h, --help           this help\n"
          "\n"
          "Exit status: 0 policy loaded and decided without a fault; 1 load error or\n"
          "fault (printed with file:line); 2 usage error.\n");
}

static int parse_int(const char *s, int lo, int hi, const char *what, int *out) {
  long v;
  if (cli_int("check", what, s, lo, hi, &v)) return -1;
  *out = (int)v;
  return 0;
}

static site *add(site *v, int *n, const char *path, const char *cls, int kind, int dtype,
                 int layer, int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  site *s = &v[(*n)++];
  memset(s, 0, sizeof *s);
  snprintf(s->path, sizeof s->path, "%s", path);
  s->cls = cls;
  s->kind = kind;
  s->dtype = dtype;
  s->layer = layer;
  s->ndim = ndim;
  s->shape[0] = d0, s->shape[1] = d1, s->shape[2] = d2, s->shape[3] = d3;
  return s;
}

/* The saved tensors of one training step of a Llama-style model, in pack
 * order, plus what an embedder sees that is not an activation. */
static site *build_sites(const model_shape *m, int *count) {
  int per_layer = 12, cap = m->layers * per_layer + 16;
  site *v = calloc((size_t)cap, sizeof *v);
  if (!v) return NULL;
  int n = 0;
  const int A = FERRY_KIND_ACTIVATION, BF16 = FERRY_DTYPE_BF16;
  int64_t b = m->batch, s = m->seq, h = m->hidden;
  add(v, &n, "model.embed_tokens", "Embedding", A, FERRY_DTYPE_I64, -1, 2, b, s, 0, 0);
  add(v, &n, "model.rotary_emb", "LlamaRotaryEmbedding", FERRY_KIND_OTHER, FERRY_DTYPE_I64, -1,
      2, 1, 16, 0, 0); /* position ids: small */
  for (int l = 0; l < m->layers; l++) {
    char p[96];
#define LAYER(suffix) (snprintf(p, sizeof p, "model.layers.%d.%s", l, suffix), p)
    add(v, &n, LAYER("input_layernorm"), "LlamaRMSNorm", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("self_attn.q_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("self_attn.k_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("self_attn.v_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("self_attn"), "LlamaAttention", A, BF16, l, 4, b, m->heads, s, s);
    add(v, &n, LAYER("self_attn.o_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("post_attention_layernorm"), "LlamaRMSNorm", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("mlp.gate_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("mlp.up_proj"), "Linear", A, BF16, l, 3, b, s, h, 0);
    add(v, &n, LAYER("mlp.act_fn"), "SiLU", A, BF16, l, 3, b, s, m->intermediate, 0);
    add(v, &n, LAYER("mlp.down_proj"), "Linear", A, BF16, l, 3, b, s, m->intermediate, 0);
    add(v, &n, LAYER("self_attn.q_proj"), "Linear", FERRY_KIND_PARAMETER, BF16, l, 2, h, h, 0, 0);
#undef LAYER
  }
  add(v, &n, "model.norm", "LlamaRMSNorm", A, BF16, -1, 3, b, s, h, 0);
  add(v, &n, "lm_head", "Linear", A, BF16, -1, 3, b, s, h, 0);
  add(v, &n, "lm_head", "Linear", A, FERRY_DTYPE_F32, -1, 3, b, s, m->vocab, 0);
  add(v, &n, "loss_fn", "LigerFusedLinearCrossEntropyLoss", A, BF16, -1, 3, b, s, h, 0);
  add(v, &n, "model.rotary_emb", "LlamaRotaryEmbedding", FERRY_KIND_BUFFER, FERRY_DTYPE_F32, -1,
      1, h / m->heads / 2, 0, 0, 0);
  add(v, &n, "model.embed_tokens", "Embedding", FERRY_KIND_PARAMETER, BF16, -1, 2, m->vocab, h, 0,
      0);
  add(v, &n, "model.layers.0.self_attn", "LlamaAttention", A, FERRY_DTYPE_F32, 0, 0, 0, 0, 0, 0);
  add(v, &n, "", NULL, FERRY_KIND_OTHER, FERRY_DTYPE_BOOL, -1, 2, b, 64, 0, 0);
  *count = n;
  return v;
}

static void site_to_desc(const site *s, const model_shape *m, int phase, ferry_tensor_desc *d) {
  memset(d, 0, sizeof *d);
  uint64_t elems = 1;
  for (int i = 0; i < s->ndim; i++) {
    d->shape[i] = s->shape[i];
    elems *= (uint64_t)s->shape[i];
  }
  d->bytes = elems * (uint64_t)ferry_dtype_size(s->dtype);
  d->dtype = s->dtype;
  d->kind = s->kind;
  d->ndim = s->ndim;
  d->flags = FERRY_FLAG_CONTIGUOUS;
  d->layer = s->layer;
  d->layer_count = m->layers;
  d->phase = phase;
  d->module_path = s->path[0] ? s->path : NULL;
  d->module_class = s->cls;
}

static const char *human_bytes(uint64_t b, char *buf, size_t n) {
  if (b >= (1ull << 30))
    snprintf(buf, n, "%.1f GiB", (double)b / (double)(1ull << 30));
  else if (b >= (1ull << 20))
    snprintf(buf, n, "%.1f MiB", (double)b / (double)(1ull << 20));
  else if (b >= 1024)
    snprintf(buf, n, "%.1f KiB", (double)b / 1024.0);
  else
    snprintf(buf, n, "%llu B", (unsigned long long)b);
  return buf;
}

static void print_header(const char *path, ferry_policy *p, int trusted) {
  ferry_policy_knobs k;
  ferry_policy_get_knobs(p, &k);
  printf("policy   %s\n", path);
  printf("name     %s\n", ferry_policy_name(p));
  printf("api      %d\n", FERRY_POLICY_API_VERSION);
  printf("trusted  %s\n", trusted ? "yes (FFI allowed)" : "no");
  printf("knobs   ");
  if (!k.has_max_fwd_stash && !k.has_prefetch_distance && !k.has_min_offload_bytes &&
      !k.has_max_fwd_stash_bytes)
    printf(" none (engine defaults)");
  if (k.has_max_fwd_stash) printf(" max_fwd_stash=%u", k.max_fwd_stash);
  if (k.has_prefetch_distance) printf(" prefetch_distance=%u", k.prefetch_distance);
  if (k.has_min_offload_bytes)
    printf(" min_offload_bytes=%llu", (unsigned long long)k.min_offload_bytes);
  if (k.has_max_fwd_stash_bytes)
    printf(" max_fwd_stash_bytes=%llu", (unsigned long long)k.max_fwd_stash_bytes);
  printf("\n");
}

int ferry_cli_check(int argc, char **argv) {
  static const struct option longopts[] = {
      {"trusted", no_argument, NULL, 't'}, {"layers", required_argument, NULL, 'l'},
      {"steps", required_argument, NULL, 's'}, {"ram-pct", required_argument, NULL, 'r'},
      {"quiet", no_argument, NULL, 'q'},   {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int trusted = 0, quiet = 0, steps = 2, ram_pct = 30;
  model_shape m = {.layers = 4, .batch = 1, .seq = 2048, .hidden = 4096, .heads = 32,
                   .intermediate = 14336, .vocab = 128256};
  optind = 1; /* callable more than once in one process (tests) */
  opterr = 0; /* cli_bad_option names the flag and a close one */
  int c;
  while ((c = getopt_long(argc, argv, ":tl:s:r:qh", longopts, NULL)) != -1) {
    switch (c) {
    case 't': trusted = 1; break;
    case 'q':
      quiet = 1;
      ferry_log_level(FERRY_LOG_ERROR); /* a policy's ferry.log lines too */
      break;
    case 'l':
      if (parse_int(optarg, 1, 1024, "--layers", &m.layers)) return 2;
      break;
    case 's':
      if (parse_int(optarg, 1, 100, "--steps", &steps)) return 2;
      break;
    case 'r':
      if (parse_int(optarg, 0, 100, "--ram-pct", &ram_pct)) return 2;
      break;
    case 'h': usage(stdout); return 0;
    case ':':
    case '?':
      cli_bad_option("check", longopts, argv, optind, optopt, c == ':');
      fprintf(stderr, "see 'ferry check --help'\n");
      return 2;
    default: usage(stderr); return 2;
    }
  }
  if (optind != argc - 1) {
    fprintf(stderr, "ferry check: give exactly one POLICY (a shipped name or a .lua file)\n\n");
    usage(stderr);
    return 2;
  }
  char path[PATH_MAX], err[1024];
  if (ferry_policy_find(argv[optind], path, sizeof path, err, sizeof err)) {
    fprintf(stderr, "ferry check: %s\n", err);
    return 2;
  }
  ferry_policy *p = NULL;
  int rc = ferry_policy_create(path, NULL, trusted, &p, err, sizeof err);
  if (rc != FERRY_OK) {
    fprintf(stderr, "ferry check: %s\n", err);
    return 1;
  }
  print_header(path, p, trusted);

  int n = 0;
  site *sites = build_sites(&m, &n);
  uint32_t *per_layer = calloc((size_t)m.layers, sizeof *per_layer);
  if (!sites || !per_layer) {
    fprintf(stderr, "ferry check: out of memory\n");
    free(sites);
    free(per_layer);
    ferry_policy_destroy(p);
    return 1;
  }
  uint64_t faults_seen = 0, offloaded_total = 0, kept_total = 0;
  fault_log faults = {0};
  for (int step = 1; step <= steps; step++) {
    /* the context an engine would keep while packing this step */
    ferry_context ctx = {.step = (uint64_t)step, .phase = FERRY_PHASE_FORWARD,
                         .host_ram_used_pct = ram_pct, .offloaded_per_layer = per_layer,
                         .layers_tracked = (uint32_t)m.layers};
    memset(per_layer, 0, (size_t)m.layers * sizeof *per_layer);
    ferry_policy_step_begin(p, &ctx);
    uint64_t off = 0, off_bytes = 0;
    if (!quiet) {
      printf("\nstep %d\n", step);
      printf("  %-8s %-13s %-6s %-10s %-5s %-10s %-24s %s\n", "decision", "reload", "cache",
             "kind", "dtype", "bytes", "shape", "module (class)");
    }
    for (int i = 0; i < n; i++) {
      ferry_tensor_desc d;
      site_to_desc(&sites[i], &m, FERRY_PHASE_FORWARD, &d);
      ferry_policy_stats before, after;
      ferry_policy_get_stats(p, &before);
      ferry_decision dec;
      ferry_policy_decide(p, &d, &ctx, &dec);
      ferry_policy_get_stats(p, &after);
      int from_cache = after.cache_hits > before.cache_hits;
      if (after.errors > faults_seen) {
        note_fault(&faults, ferry_policy_last_error(p));
        faults_seen = after.errors;
      }
      ctx.packed_this_step++;
      if (dec.action == FERRY_OFFLOAD) {
        off++;
        off_bytes += d.bytes;
        ctx.offloaded_this_step++;
        ctx.bytes_offloaded_this_step += d.bytes;
        ctx.arena_in_use += d.bytes;
        if (d.layer >= 0 && d.layer < m.layers) per_layer[d.layer]++;
        offloaded_total++;
      } else {
        kept_total++;
      }
      if (quiet) continue;
      char reload[32], shape[64], bytes[32];
      if (dec.action != FERRY_OFFLOAD)
        snprintf(reload, sizeof reload, "-");
      else if (dec.reload == FERRY_RELOAD_PREFETCH && dec.prefetch_distance >= 0)
        snprintf(reload, sizeof reload, "prefetch %d", dec.prefetch_distance);
      else if (dec.reload == FERRY_RELOAD_PREFETCH)
        snprintf(reload, sizeof reload, "prefetch dflt");
      else
        snprintf(reload, sizeof reload, "on use");
      int w = snprintf(shape, sizeof shape, "[");
      for (int k = 0; k < d.ndim && w < (int)sizeof shape - 24; k++)
        w += snprintf(shape + w, sizeof shape - (size_t)w, k ? ",%lld" : "%lld",
                      (long long)d.shape[k]);
      snprintf(shape + w, sizeof shape - (size_t)w, "]");
      printf("  %-8s %-13s %-6s %-10s %-5s %-10s %-24s %s (%s)\n",
             dec.action == FERRY_OFFLOAD ? "offload" : "keep", reload,
             from_cache ? "hit" : dec.cacheable ? "stored" : "-", KIND_NAMES[d.kind & 3],
             ferry_dtype_name(d.dtype), human_bytes(d.bytes, bytes, sizeof bytes), shape,
             d.module_path ? d.module_path : "-", d.module_class ? d.module_class : "-");
    }
    char ob[32];
    printf("%sstep %d: %d tensors, %llu offloaded (%s), %llu kept\n", quiet ? "" : "  ", step, n,
           (unsigned long long)off, human_bytes(off_bytes, ob, sizeof ob),
           (unsigned long long)(n - (int)off));
  }
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  printf("\nsummary: %llu decisions (%llu offload, %llu keep), %llu Lua calls, %llu cache hits, "
         "%llu faults%s\n",
         (unsigned long long)(offloaded_total + kept_total), (unsigned long long)offloaded_total,
         (unsigned long long)kept_total, (unsigned long long)s.calls,
         (unsigned long long)s.cache_hits, (unsigned long long)s.errors,
         s.disabled ? " (policy disabled by its error budget)" : "");
  for (int i = 0; i < faults.n; i++) {
    if (faults.count[i] > 1)
      printf("fault repeated %llu times: %s\n", (unsigned long long)faults.count[i],
             faults.msg[i]);
    free(faults.msg[i]);
  }
  if (s.errors) fprintf(stderr, "ferry check: %s: last fault: %s\n", path, ferry_policy_last_error(p));
  free(sites);
  free(per_layer);
  ferry_policy_destroy(p);
  return s.errors ? 1 : 0;
}

#ifdef FERRY_CHECK_MAIN
int main(int argc, char **argv) { return ferry_cli_check(argc, argv); }
#endif
