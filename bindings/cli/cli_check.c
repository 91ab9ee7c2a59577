/*
 * cli_check.c — `ferry check [options] POLICY`: load a policy, print its
 * API version, name and knobs, run it over the tensors a transformer
 * training step saves (or over the pack events of a trace, --trace) and
 * print each decision with its reason: the rule that made it and its
 * file:line. How it works: docs/internals.md#cli_checkc.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "cli.h"
#include "ferry_tools.h"

/* Text output: stdout, or nowhere when the JSON report goes to stdout. */
static FILE *check_out;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  if (!check_out) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(check_out, fmt, ap);
  va_end(ap);
}

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
  say("  %sfault:%s %s\n", cli_sgr(fileno(check_out), CLI_RED),
      cli_sgr(fileno(check_out), CLI_RESET), msg);
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
          "decision for each tensor a transformer training step saves, with its\n"
          "reason: the rule that made it and the file:line where it is written.\n"
          "\n"
          "  -t, --trusted        allow the FFI (as an embedder marking it trusted)\n"
          "  -l, --layers N       transformer layers of the model (default 4)\n"
          "      --trace T        decide on the pack events of the ferry trace T\n"
          "                       instead (docs/trace-format.md); --steps caps its steps\n"
          "  -s, --steps N        training steps to run (default 2, with --trace every\n"
          "                       step of the trace; later steps show which answers\n"
          "                       came from the site cache)\n"
          "  -r, --ram-pct P      host RAM used %% the context reports (default 30)\n"
          "      --why PATTERN    only the decisions whose rule, its file:line or the\n"
          "                       module path contains PATTERN (rows and totals)\n"
          "      --json FILE      also write the decisions, reasons and totals as JSON\n"
          "                       (- = stdout, and the text goes to stderr)\n"
          "  -q, --quiet          print only the header, faults and the summary (no\n"
          "                       rows, no ferry.log lines)\n"
          "  -v, --verbose        also print after each step the offloads per layer\n"
          "                       (the counts layer-aware rules see)\n"
          "  -h, --help           this help\n"
          "\n"
          "POLICY - and --trace - read stdin (one of them). Decisions and the summary's\n"
          "faults are coloured on a terminal (not with NO_COLOR).\n"
          "\n"
          "Exit status: 0 policy loaded and decided without a fault; 1 load error\n"
          "(policy or trace) or fault (printed with file:line); 2 usage error.\n"
          "\n"
          "examples:\n"
          "  ferry check default\n"
          "  ferry check --trace run.jsonl --why min_bytes mine.lua\n"
          "  ferry check -q --json - budget | jq .summary\n");
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

/* One row of totals: the decisions a reason (rule and where) made. */
typedef struct reason_total {
  char *rule, *where;
  uint64_t tensors, offloaded, offloaded_bytes, kept, kept_bytes;
} reason_total;

/* What a run of `ferry check` accumulates. */
typedef struct check_run {
  ferry_policy *p;
  int quiet;
  const char *why;    /* --why PATTERN, or NULL */
  int module_width;   /* of the "module (class)" column */
  int layers;         /* layers the context tracks */
  uint32_t *per_layer;
  fault_log faults;
  uint64_t faults_seen, offloaded_total, kept_total;
  reason_total *totals;
  size_t n_totals, cap_totals;
  cJSON *rows;        /* --json: the decisions shown; NULL without --json */
} check_run;

static reason_total *total_for(check_run *r, const ferry_policy_reason *why) {
  for (size_t i = 0; i < r->n_totals; i++)
    if (!strcmp(r->totals[i].rule, why->rule) && !strcmp(r->totals[i].where, why->where))
      return &r->totals[i];
  if (r->n_totals == r->cap_totals) {
    size_t cap = r->cap_totals ? r->cap_totals * 2 : 16;
    reason_total *grown = realloc(r->totals, cap * sizeof *grown);
    if (!grown) return NULL;
    r->totals = grown;
    r->cap_totals = cap;
  }
  reason_total *t = &r->totals[r->n_totals];
  memset(t, 0, sizeof *t);
  t->rule = strdup(why->rule);
  t->where = strdup(why->where);
  if (!t->rule || !t->where) {
    free(t->rule);
    free(t->where);
    return NULL;
  }
  r->n_totals++;
  return t;
}

/* "min_bytes(1024) (policies/default.lua:36)", or the rule alone. */
static const char *reason_text(const ferry_policy_reason *why, char *buf, size_t n) {
  if (why->where[0])
    snprintf(buf, n, "%s (%s)", why->rule, why->where);
  else
    snprintf(buf, n, "%s", why->rule);
  return buf;
}

static int shown(const check_run *r, const ferry_tensor_desc *d, const ferry_policy_reason *why) {
  return !r->why || strstr(why->rule, r->why) || strstr(why->where, r->why) ||
         (d->module_path && strstr(d->module_path, r->why));
}

/* Width of a tensor's "module (class)" cell, at most 72 (longer ones
 * push their row's reason right). */
static int module_width_of(const ferry_tensor_desc *d) {
  size_t w = strlen(d->module_path ? d->module_path : "-") +
             strlen(d->module_class ? d->module_class : "-") + 3;
  return w > 72 ? 72 : (int)w;
}

static void print_columns(const check_run *r) {
  say("  %-8s %-13s %-6s %-10s %-5s %-10s %-24s %-*s %s\n", "decision", "reload", "cache",
      "kind", "dtype", "bytes", "shape", r->module_width, "module (class)", "reason");
}

/* Decides on one tensor through ferry_policy_explain, as an engine would
 * have at this point of the step (ctx), and prints, counts and records it. */
static void check_tensor(check_run *r, const ferry_tensor_desc *d, ferry_context *ctx,
                         uint64_t *off, uint64_t *off_bytes) {
  ferry_policy *p = r->p;
  ferry_decision dec;
  ferry_policy_reason why;
  ferry_policy_explain(p, d, ctx, &dec, &why);
  ferry_policy_stats after;
  ferry_policy_get_stats(p, &after);
  if (after.errors > r->faults_seen) {
    note_fault(&r->faults, ferry_policy_last_error(p));
    r->faults_seen = after.errors;
  }
  int offload = dec.action == FERRY_OFFLOAD;
  ctx->packed_this_step++;
  if (offload) {
    (*off)++;
    *off_bytes += d->bytes;
    ctx->offloaded_this_step++;
    ctx->bytes_offloaded_this_step += d->bytes;
    ctx->arena_in_use += d->bytes;
    if (d->layer >= 0 && d->layer < r->layers) r->per_layer[d->layer]++;
    r->offloaded_total++;
  } else {
    r->kept_total++;
  }
  if (!shown(r, d, &why)) return;
  reason_total *t = total_for(r, &why);
  if (t) {
    t->tensors++;
    if (offload) {
      t->offloaded++;
      t->offloaded_bytes += d->bytes;
    } else {
      t->kept++;
      t->kept_bytes += d->bytes;
    }
  }
  const char *cache = why.from_cache ? "hit" : dec.cacheable ? "stored" : "-";
  if (r->rows) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", (double)ctx->step);
    cJSON_AddStringToObject(o, "decision", offload ? "offload" : "keep");
    if (offload) {
      cJSON_AddStringToObject(o, "reload", dec.reload == FERRY_RELOAD_PREFETCH ? "prefetch" : "on_use");
      if (dec.reload == FERRY_RELOAD_PREFETCH && dec.prefetch_distance >= 0)
        cJSON_AddNumberToObject(o, "distance", dec.prefetch_distance);
      else
        cJSON_AddNullToObject(o, "distance");
    } else {
      cJSON_AddNullToObject(o, "reload");
      cJSON_AddNullToObject(o, "distance");
    }
    cJSON_AddStringToObject(o, "cache", why.from_cache ? "hit" : dec.cacheable ? "stored" : "no");
    cJSON_AddStringToObject(o, "kind", KIND_NAMES[d->kind & 3]);
    cJSON_AddStringToObject(o, "dtype", ferry_dtype_name(d->dtype));
    cJSON_AddNumberToObject(o, "bytes", (double)d->bytes);
    cJSON *shape = cJSON_AddArrayToObject(o, "shape");
    for (int k = 0; k < d->ndim && k < FERRY_MAX_DIMS; k++)
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)d->shape[k]));
    if (d->module_path) cJSON_AddStringToObject(o, "module", d->module_path);
    else cJSON_AddNullToObject(o, "module");
    if (d->module_class) cJSON_AddStringToObject(o, "class", d->module_class);
    else cJSON_AddNullToObject(o, "class");
    cJSON_AddNumberToObject(o, "layer", d->layer);
    cJSON_AddStringToObject(o, "rule", why.rule);
    cJSON_AddStringToObject(o, "where", why.where);
    cJSON_AddItemToArray(r->rows, o);
  }
  if (r->quiet) return;
  char reload[32], shape[64], bytes[32], module[256], reason[1100];
  if (!offload)
    snprintf(reload, sizeof reload, "-");
  else if (dec.reload == FERRY_RELOAD_PREFETCH && dec.prefetch_distance >= 0)
    snprintf(reload, sizeof reload, "prefetch %d", dec.prefetch_distance);
  else if (dec.reload == FERRY_RELOAD_PREFETCH)
    snprintf(reload, sizeof reload, "prefetch dflt");
  else
    snprintf(reload, sizeof reload, "on use");
  int w = snprintf(shape, sizeof shape, "[");
  for (int k = 0; k < d->ndim && w < (int)sizeof shape - 24; k++)
    w += snprintf(shape + w, sizeof shape - (size_t)w, k ? ",%lld" : "%lld",
                  (long long)d->shape[k]);
  snprintf(shape + w, sizeof shape - (size_t)w, "]");
  snprintf(module, sizeof module, "%.120s (%.120s)", d->module_path ? d->module_path : "-",
           d->module_class ? d->module_class : "-");
  say("  %s%-8s%s %-13s %-6s %-10s %-5s %-10s %-24s %-*s %s\n",
      offload ? cli_sgr(fileno(check_out), CLI_GREEN) : "", offload ? "offload" : "keep",
      offload ? cli_sgr(fileno(check_out), CLI_RESET) : "", reload, cache, KIND_NAMES[d->kind & 3], ferry_dtype_name(d->dtype),
      human_bytes(d->bytes, bytes, sizeof bytes), shape, r->module_width, module,
      reason_text(&why, reason, sizeof reason));
}

/* The totals by reason: tensors, bytes offloaded and kept, all steps. */
static void print_totals(const check_run *r) {
  if (!r->n_totals) return;
  say("\nby reason%s:\n", r->why ? " (the decisions --why shows)" : "");
  say("  %8s %10s %10s %10s %10s  %s\n", "tensors", "offloaded", "bytes", "kept", "bytes",
      "reason");
  for (size_t i = 0; i < r->n_totals; i++) {
    const reason_total *t = &r->totals[i];
    char ob[32], kb[32], reason[1100];
    ferry_policy_reason why;
    memset(&why, 0, sizeof why);
    snprintf(why.rule, sizeof why.rule, "%s", t->rule);
    snprintf(why.where, sizeof why.where, "%s", t->where);
    say("  %8llu %10llu %10s %10llu %10s  %s\n", (unsigned long long)t->tensors,
        (unsigned long long)t->offloaded,
        t->offloaded ? human_bytes(t->offloaded_bytes, ob, sizeof ob) : "-",
        (unsigned long long)t->kept, t->kept ? human_bytes(t->kept_bytes, kb, sizeof kb) : "-",
        reason_text(&why, reason, sizeof reason));
  }
}

static cJSON *totals_json(const check_run *r) {
  cJSON *a = cJSON_CreateArray();
  for (size_t i = 0; i < r->n_totals; i++) {
    const reason_total *t = &r->totals[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "rule", t->rule);
    cJSON_AddStringToObject(o, "where", t->where);
    cJSON_AddNumberToObject(o, "tensors", (double)t->tensors);
    cJSON_AddNumberToObject(o, "offloaded", (double)t->offloaded);
    cJSON_AddNumberToObject(o, "offloaded_bytes", (double)t->offloaded_bytes);
    cJSON_AddNumberToObject(o, "kept", (double)t->kept);
    cJSON_AddNumberToObject(o, "kept_bytes", (double)t->kept_bytes);
    cJSON_AddItemToArray(a, o);
  }
  return a;
}

static void print_header(const char *path, ferry_policy *p, int trusted) {
  ferry_policy_knobs k;
  ferry_policy_get_knobs(p, &k);
  say("policy   %s\n", path);
  say("name     %s\n", ferry_policy_name(p));
  say("api      %d\n", FERRY_POLICY_API_VERSION);
  say("trusted  %s\n", trusted ? "yes (FFI allowed)" : "no");
  say("knobs   ");
  if (!k.has_max_fwd_stash && !k.has_prefetch_distance && !k.has_min_offload_bytes &&
      !k.has_max_fwd_stash_bytes && !k.has_release_when_copied && !k.has_max_tail_prefetch &&
      !k.has_sync_copies && !k.has_one_copy_stream)
    say(" none (engine defaults)");
  if (k.has_max_fwd_stash) say(" max_fwd_stash=%u", k.max_fwd_stash);
  if (k.has_prefetch_distance) say(" prefetch_distance=%u", k.prefetch_distance);
  if (k.has_min_offload_bytes)
    say(" min_offload_bytes=%llu", (unsigned long long)k.min_offload_bytes);
  if (k.has_max_fwd_stash_bytes)
    say(" max_fwd_stash_bytes=%llu", (unsigned long long)k.max_fwd_stash_bytes);
  if (k.has_release_when_copied) say(" release_when_copied=%u", k.release_when_copied);
  if (k.has_max_tail_prefetch) say(" max_tail_prefetch=%u", k.max_tail_prefetch);
  if (k.has_sync_copies) say(" sync_copies=%u", k.sync_copies);
  if (k.has_one_copy_stream) say(" one_copy_stream=%u", k.one_copy_stream);
  say("\n");
}

static cJSON *knobs_json(const ferry_policy *p) {
  ferry_policy_knobs k;
  ferry_policy_get_knobs(p, &k);
  cJSON *o = cJSON_CreateObject();
  if (k.has_max_fwd_stash) cJSON_AddNumberToObject(o, "max_fwd_stash", k.max_fwd_stash);
  if (k.has_prefetch_distance)
    cJSON_AddNumberToObject(o, "prefetch_distance", k.prefetch_distance);
  if (k.has_min_offload_bytes)
    cJSON_AddNumberToObject(o, "min_offload_bytes", (double)k.min_offload_bytes);
  if (k.has_max_fwd_stash_bytes)
    cJSON_AddNumberToObject(o, "max_fwd_stash_bytes", (double)k.max_fwd_stash_bytes);
  if (k.has_release_when_copied)
    cJSON_AddNumberToObject(o, "release_when_copied", k.release_when_copied);
  if (k.has_max_tail_prefetch)
    cJSON_AddNumberToObject(o, "max_tail_prefetch", k.max_tail_prefetch);
  if (k.has_sync_copies) cJSON_AddNumberToObject(o, "sync_copies", k.sync_copies);
  if (k.has_one_copy_stream)
    cJSON_AddNumberToObject(o, "one_copy_stream", k.one_copy_stream);
  return o;
}

/* Writes the report; 0, or 1 with the error printed. */
static int write_json(const char *file, cJSON *root) {
  char *text = cJSON_Print(root);
  if (!text) {
    fprintf(stderr, "ferry check: out of memory writing the JSON report\n");
    return 1;
  }
  int to_stdout = !strcmp(file, "-");
  FILE *f = to_stdout ? cli_stdout() : fopen(file, "w");
  int bad = !f;
  if (f) {
    bad = fputs(text, f) < 0 || fputc('\n', f) < 0;
    bad = (to_stdout ? cli_output_done("check") : fclose(f)) || bad;
  }
  free(text);
  if (bad) fprintf(stderr, "ferry check: cannot write %s\n", file);
  return bad;
}

/* Starts a step: the context an engine would keep while packing it. */
static void begin_step(check_run *r, ferry_context *ctx, uint64_t step, int ram_pct) {
  memset(ctx, 0, sizeof *ctx);
  ctx->step = step;
  ctx->phase = FERRY_PHASE_FORWARD;
  ctx->host_ram_used_pct = ram_pct;
  ctx->offloaded_per_layer = r->per_layer;
  ctx->layers_tracked = (uint32_t)r->layers;
  memset(r->per_layer, 0, (size_t)r->layers * sizeof *r->per_layer);
  ferry_policy_step_begin(r->p, ctx);
  if (!r->quiet) {
    say("\nstep %llu\n", (unsigned long long)step);
    print_columns(r);
  }
}

static void end_step(const check_run *r, uint64_t step, uint64_t n, uint64_t off,
                     uint64_t off_bytes, int quiet, cJSON *steps) {
  char ob[32];
  if (cli_verbosity > 0 && r->layers > 0) {
    say("  offloaded per layer:");
    for (int l = 0; l < r->layers; l++) say(" %d:%u", l, r->per_layer[l]);
    say("\n");
  }
  say("%sstep %llu: %llu tensors, %llu offloaded (%s), %llu kept\n", quiet ? "" : "  ",
      (unsigned long long)step, (unsigned long long)n, (unsigned long long)off,
      human_bytes(off_bytes, ob, sizeof ob), (unsigned long long)(n - off));
  if (!steps) return;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "step", (double)step);
  cJSON_AddNumberToObject(o, "tensors", (double)n);
  cJSON_AddNumberToObject(o, "offloaded", (double)off);
  cJSON_AddNumberToObject(o, "offloaded_bytes", (double)off_bytes);
  cJSON_AddNumberToObject(o, "kept", (double)(n - off));
  cJSON_AddItemToArray(steps, o);
}

/* The synthetic model's steps (build_sites). */
static int run_model(check_run *r, const model_shape *m, int steps, int ram_pct, cJSON *jsteps) {
  int n = 0;
  site *sites = build_sites(m, &n);
  if (!sites) return -1;
  for (int i = 0; i < n; i++) {
    ferry_tensor_desc d;
    site_to_desc(&sites[i], m, FERRY_PHASE_FORWARD, &d);
    int w = module_width_of(&d);
    if (w > r->module_width) r->module_width = w;
  }
  for (int step = 1; step <= steps; step++) {
    ferry_context ctx;
    begin_step(r, &ctx, (uint64_t)step, ram_pct);
    uint64_t off = 0, off_bytes = 0;
    for (int i = 0; i < n; i++) {
      ferry_tensor_desc d;
      site_to_desc(&sites[i], m, FERRY_PHASE_FORWARD, &d);
      check_tensor(r, &d, &ctx, &off, &off_bytes);
    }
    end_step(r, (uint64_t)step, (uint64_t)n, off, off_bytes, r->quiet, jsteps);
  }
  free(sites);
  return 0;
}

/* ---- optimizer states and weights: the policy's resident(r) --------------- */
typedef struct candidate {
  char name[112], module[96];
  int layer;
  uint64_t bytes;
} candidate;

static void add_param(candidate *v, int *n, int layer, const char *module, const char *param,
                      uint64_t elems) {
  candidate *c = &v[(*n)++];
  snprintf(c->module, sizeof c->module, "%s", module);
  snprintf(c->name, sizeof c->name, "%s.%s", module, param);
  c->layer = layer;
  c->bytes = elems * 2; /* bf16 */
}

/* The synthetic model's parameters, in model order (Llama-style: grouped
 * K/V with a quarter of the heads, untied embedding and head). */
static candidate *model_params(const model_shape *m, int *count) {
  candidate *v = calloc((size_t)m->layers * 9 + 3, sizeof *v);
  if (!v) return NULL;
  int n = 0;
  const uint64_t h = (uint64_t)m->hidden, I = (uint64_t)m->intermediate, kv = h / 4;
  add_param(v, &n, -1, "model.embed_tokens", "weight", (uint64_t)m->vocab * h);
  static const struct { const char *module; int shape; } P[] = {
      {"input_layernorm", 0}, {"self_attn.q_proj", 1}, {"self_attn.k_proj", 2},
      {"self_attn.v_proj", 2}, {"self_attn.o_proj", 1}, {"post_attention_layernorm", 0},
      {"mlp.gate_proj", 3}, {"mlp.up_proj", 3}, {"mlp.down_proj", 3}};
  for (int l = 0; l < m->layers; l++)
    for (size_t i = 0; i < sizeof P / sizeof P[0]; i++) {
      char mod[96];
      snprintf(mod, sizeof mod, "model.layers.%d.%s", l, P[i].module);
      const uint64_t elems[] = {h, h * h, h * kv, h * I};
      add_param(v, &n, l, mod, "weight", elems[P[i].shape]);
    }
  add_param(v, &n, -1, "model.norm", "weight", h);
  add_param(v, &n, -1, "lm_head", "weight", (uint64_t)m->vocab * h);
  *count = n;
  return v;
}

/* Each layer's parameters as one candidate (weights offload moves layers). */
static candidate *model_layers(const candidate *params, int n, int layers) {
  candidate *v = calloc((size_t)layers, sizeof *v);
  if (!v) return NULL;
  for (int l = 0; l < layers; l++) {
    snprintf(v[l].module, sizeof v[l].module, "model.layers.%d", l);
    snprintf(v[l].name, sizeof v[l].name, "%s", v[l].module);
    v[l].layer = l;
  }
  for (int i = 0; i < n; i++)
    if (params[i].layer >= 0) v[params[i].layer].bytes += params[i].bytes;
  return v;
}

static int by_bytes_desc(const void *a, const void *b) {
  const candidate *x = *(const candidate *const *)a, *y = *(const candidate *const *)b;
  if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
  return x < y ? -1 : x > y; /* ties in model order */
}

/* Asks resident(r) about each candidate of kind, largest first (the order
 * ferry.torch.offload_optimizer and offload_weights ask in); prints a row
 * per candidate (--why filters them) and the host share. */
static int check_kind(check_run *r, int kind, candidate *c, int n, int layers, cJSON *out) {
  const candidate **order = malloc((size_t)n * sizeof *order);
  if (!order) return -1;
  uint64_t total = 0, host_bytes = 0;
  for (int i = 0; i < n; i++) {
    order[i] = &c[i];
    total += c[i].bytes;
  }
  qsort(order, (size_t)n, sizeof *order, by_bytes_desc);
  say("\n%s (resident(r), largest first):\n",
      kind == FERRY_RESIDENT_OPTIMIZER ? "optimizer states" : "weights");
  if (!r->quiet) say("  %-7s %-10s %-*s %s\n", "place", "bytes", 48, "parameter", "reason");
  cJSON *rows = out ? cJSON_AddArrayToObject(out, kind == FERRY_RESIDENT_OPTIMIZER ? "optimizer"
                                                                                    : "weights")
                    : NULL;
  int hosted = 0;
  for (int i = 0; i < n; i++) {
    const candidate *x = order[i];
    ferry_resident_entry e = {.kind = kind, .dtype = FERRY_DTYPE_BF16, .name = x->name,
                              .module = x->module, .layer = x->layer, .layer_count = layers,
                              .bytes = x->bytes, .total_bytes = total, .index = i, .count = n};
    ferry_policy_reason why;
    int host = ferry_policy_resident(r->p, &e, &why);
    ferry_policy_stats st;
    ferry_policy_get_stats(r->p, &st);
    if (st.errors > r->faults_seen) {
      note_fault(&r->faults, ferry_policy_last_error(r->p));
      r->faults_seen = st.errors;
    }
    hosted += host;
    if (host) host_bytes += x->bytes;
    if (r->why && !strstr(why.rule, r->why) && !strstr(why.where, r->why) &&
        !strstr(x->name, r->why))
      continue;
    char b[32], reason[1100];
    if (!r->quiet)
      say("  %s%-7s%s %-10s %-*s %s\n", cli_sgr(fileno(check_out), host ? CLI_GREEN : ""),
          host ? "host" : "device", cli_sgr(fileno(check_out), host ? CLI_RESET : ""),
          human_bytes(x->bytes, b, sizeof b), 48, x->name, reason_text(&why, reason, sizeof reason));
    if (rows) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddStringToObject(o, "name", x->name);
      cJSON_AddNumberToObject(o, "layer", x->layer);
      cJSON_AddNumberToObject(o, "bytes", (double)x->bytes);
      cJSON_AddStringToObject(o, "place", host ? "host" : "device");
      cJSON_AddStringToObject(o, "rule", why.rule);
      cJSON_AddStringToObject(o, "where", why.where);
      cJSON_AddItemToArray(rows, o);
    }
  }
  char hb[32], tb[32];
  say("  on the host: %d of %d, %s of %s (%.1f%%)\n", hosted, n,
      human_bytes(host_bytes, hb, sizeof hb), human_bytes(total, tb, sizeof tb),
      total ? 100.0 * (double)host_bytes / (double)total : 0.0);
  free(order);
  return 0;
}

/* The policy's answers for the synthetic model's optimizer states and
 * layer weights, when it has resident(r). */
static int check_resident(check_run *r, const model_shape *m, cJSON *root) {
  if (!ferry_policy_has_resident(r->p)) return 0;
  int n = 0;
  candidate *params = model_params(m, &n);
  candidate *layers = params ? model_layers(params, n, m->layers) : NULL;
  cJSON *out = root ? cJSON_AddObjectToObject(root, "resident") : NULL;
  int rc = !layers || check_kind(r, FERRY_RESIDENT_OPTIMIZER, params, n, m->layers, out) ||
           check_kind(r, FERRY_RESIDENT_WEIGHTS, layers, m->layers, m->layers, out);
  free(params);
  free(layers);
  return rc ? -1 : 0;
}

/* The pack events of a trace's first `steps` steps, in order; the phase
 * turns to backward at backward_begin (recompute packs). Alias packs (the
 * same buffer as an earlier live pack) are skipped: the engine stores the
 * buffer once and asks the policy about the first pack only. */
static void run_trace(check_run *r, const sim_trace *t, uint32_t steps, int ram_pct,
                      cJSON *jsteps) {
  for (uint32_t i = 0; i < t->n_tensors; i++) {
    int w = module_width_of(&t->tensors[i].desc);
    if (w > r->module_width) r->module_width = w;
  }
  for (uint32_t s = 0; s < steps && s < t->n_steps; s++) {
    const trace_step *st = &t->steps[s];
    ferry_context ctx;
    begin_step(r, &ctx, st->number, ram_pct);
    uint64_t n = 0, off = 0, off_bytes = 0;
    for (uint32_t e = st->first; e < st->end; e++) {
      const trace_ev *ev = &t->events[e];
      if (ev->type == TEV_BACKWARD_BEGIN) ctx.phase = FERRY_PHASE_BACKWARD;
      if (ev->type == TEV_BACKWARD_END) ctx.phase = FERRY_PHASE_FORWARD;
      if (ev->type != TEV_PACK || t->tensors[ev->tensor].alias_of >= 0) continue;
      n++;
      check_tensor(r, &t->tensors[ev->tensor].desc, &ctx, &off, &off_bytes);
    }
    end_step(r, st->number, n, off, off_bytes, r->quiet, jsteps);
  }
}

enum { OPT_TRACE = 256, OPT_WHY, OPT_JSON };

int ferry_cli_check(int argc, char **argv) {
  static const struct option longopts[] = {
      {"trusted", no_argument, NULL, 't'}, {"layers", required_argument, NULL, 'l'},
      {"steps", required_argument, NULL, 's'}, {"ram-pct", required_argument, NULL, 'r'},
      {"quiet", no_argument, NULL, 'q'},   {"verbose", no_argument, NULL, 'v'},
      {"help", no_argument, NULL, 'h'},
      {"trace", required_argument, NULL, OPT_TRACE}, {"why", required_argument, NULL, OPT_WHY},
      {"json", required_argument, NULL, OPT_JSON}, {NULL, 0, NULL, 0}};
  int trusted = 0, quiet = 0, steps = 2, steps_given = 0, layers_given = 0, ram_pct = 30;
  const char *trace_path = NULL, *why = NULL, *json = NULL;
  model_shape m = {.layers = 4, .batch = 1, .seq = 2048, .hidden = 4096, .heads = 32,
                   .intermediate = 14336, .vocab = 128256};
  optind = 1; /* callable more than once in one process (tests) */
  cli_reset();
  opterr = 0; /* cli_bad_option names the flag and a close one */
  int c;
  while ((c = getopt_long(argc, argv, ":tl:s:r:qvh", longopts, NULL)) != -1) {
    switch (c) {
    case 't': trusted = 1; break;
    case 'q': quiet = 1; cli_verbosity = -1; break;
    case 'v': quiet = 0; cli_verbosity = 1; break;
    case 'l':
      if (parse_int(optarg, 1, 1024, "--layers", &m.layers)) return 2;
      layers_given = 1;
      break;
    case 's':
      if (parse_int(optarg, 1, 100, "--steps", &steps)) return 2;
      steps_given = 1;
      break;
    case 'r':
      if (parse_int(optarg, 0, 100, "--ram-pct", &ram_pct)) return 2;
      break;
    case OPT_TRACE: trace_path = optarg; break;
    case OPT_WHY:
      if (!*optarg) {
        fprintf(stderr, "ferry check: --why needs a non-empty PATTERN\n");
        return 2;
      }
      why = optarg;
      break;
    case OPT_JSON: json = optarg; break;
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
  if (trace_path && layers_given) {
    fprintf(stderr, "ferry check: --layers is the synthetic model's; a trace has its own\n");
    return 2;
  }
  /* "-": stdin once (POLICY or --trace), the JSON on stdout with the text on stderr */
  int dash = cli_claim_stdin("check", "POLICY", argv[optind]);
  if (!dash) dash = cli_claim_stdin("check", "--trace", trace_path);
  if (!dash) dash = cli_claim_stdout("check", "--json", json);
  if (dash) return dash;
  check_out = stdout;
  if (quiet) ferry_log_level(FERRY_LOG_ERROR); /* a policy's ferry.log lines too */
  char path[PATH_MAX], err[1024];
  char *source = NULL; /* POLICY -: the text read from stdin */
  if (!strcmp(argv[optind], "-")) {
    if (!(source = cli_read_stdin(16u << 20, NULL))) {
      fprintf(stderr, "ferry check: POLICY -: cannot read stdin: %s\n", strerror(errno));
      return 1;
    }
    snprintf(path, sizeof path, "-");
  } else if (ferry_policy_find(argv[optind], path, sizeof path, err, sizeof err)) {
    fprintf(stderr, "ferry check: %s\n", err);
    return 2;
  }
  sim_trace *trace = NULL;
  if (trace_path && sim_trace_load(cli_input(trace_path), &trace, err, sizeof err)) {
    fprintf(stderr, "ferry check: %s\n", err);
    free(source);
    return 1;
  }
  ferry_policy *p = NULL;
  int rc = ferry_policy_create(source ? NULL : path, source, trusted, &p, err, sizeof err);
  free(source);
  if (rc != FERRY_OK) {
    fprintf(stderr, "ferry check: %s\n", err);
    sim_trace_free(trace);
    return 1;
  }
  print_header(path, p, trusted);
  if (trace) say("trace    %s\n", trace_path);
  if (why) say("why      %s\n", why);

  check_run run;
  memset(&run, 0, sizeof run);
  run.p = p;
  run.quiet = quiet;
  run.why = why;
  run.module_width = (int)strlen("module (class)");
  run.layers = trace ? (trace->layers > 0 ? trace->layers : 0) : m.layers;
  run.per_layer = calloc((size_t)run.layers + 1, sizeof *run.per_layer);
  cJSON *root = NULL, *jsteps = NULL;
  if (json) {
    root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "format", "ferry-check");
    cJSON_AddNumberToObject(root, "version", 1);
    cJSON_AddStringToObject(root, "policy", path);
    cJSON_AddStringToObject(root, "name", ferry_policy_name(p));
    cJSON_AddNumberToObject(root, "api", FERRY_POLICY_API_VERSION);
    cJSON_AddBoolToObject(root, "trusted", trusted);
    cJSON_AddItemToObject(root, "knobs", knobs_json(p));
    if (trace) cJSON_AddStringToObject(root, "trace", trace_path);
    else cJSON_AddNullToObject(root, "trace");
    if (why) cJSON_AddStringToObject(root, "why", why);
    else cJSON_AddNullToObject(root, "why");
    jsteps = cJSON_AddArrayToObject(root, "steps");
    run.rows = cJSON_AddArrayToObject(root, "decisions");
  }
  int failed = !run.per_layer;
  if (!failed && trace)
    run_trace(&run, trace, steps_given ? (uint32_t)steps : trace->n_steps, ram_pct, jsteps);
  else if (!failed)
    failed = run_model(&run, &m, steps, ram_pct, jsteps) != 0;
  if (failed) {
    fprintf(stderr, "ferry check: out of memory\n");
    rc = 1;
  }
  print_totals(&run);
  /* a trace names no parameters: resident(r) is asked about the synthetic model's */
  if (!failed && check_resident(&run, &m, root)) {
    fprintf(stderr, "ferry check: out of memory\n");
    rc = 1;
  }
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  say("\nsummary: %llu decisions (%llu offload, %llu keep), %llu Lua calls, %llu cache hits, "
      "%s%llu faults%s%s\n",
      (unsigned long long)(run.offloaded_total + run.kept_total),
      (unsigned long long)run.offloaded_total, (unsigned long long)run.kept_total,
      (unsigned long long)s.calls, (unsigned long long)s.cache_hits,
      cli_sgr(fileno(check_out), s.errors ? CLI_RED : CLI_GREEN), (unsigned long long)s.errors,
      cli_sgr(fileno(check_out), CLI_RESET),
      s.disabled ? " (policy disabled by its error budget)" : "");
  for (int i = 0; i < run.faults.n; i++) {
    if (run.faults.count[i] > 1)
      say("fault repeated %llu times: %s\n", (unsigned long long)run.faults.count[i],
          run.faults.msg[i]);
    free(run.faults.msg[i]);
  }
  if (s.errors) cli_error("check", "%s: last fault: %s\n", path, ferry_policy_last_error(p));
  if (root) {
    cJSON_AddItemToObject(root, "reasons", totals_json(&run));
    cJSON *sum = cJSON_AddObjectToObject(root, "summary");
    cJSON_AddNumberToObject(sum, "decisions", (double)(run.offloaded_total + run.kept_total));
    cJSON_AddNumberToObject(sum, "offloaded", (double)run.offloaded_total);
    cJSON_AddNumberToObject(sum, "kept", (double)run.kept_total);
    cJSON_AddNumberToObject(sum, "lua_calls", (double)s.calls);
    cJSON_AddNumberToObject(sum, "cache_hits", (double)s.cache_hits);
    cJSON_AddNumberToObject(sum, "faults", (double)s.errors);
    cJSON_AddBoolToObject(sum, "disabled", s.disabled);
    if (s.errors) cJSON_AddStringToObject(sum, "last_fault", ferry_policy_last_error(p));
    if (write_json(json, root)) rc = 1;
    cJSON_Delete(root);
  }
  for (size_t i = 0; i < run.n_totals; i++) {
    free(run.totals[i].rule);
    free(run.totals[i].where);
  }
  free(run.totals);
  free(run.per_layer);
  sim_trace_free(trace);
  ferry_policy_destroy(p);
  return rc ? rc : s.errors ? 1 : 0;
}

#ifdef FERRY_CHECK_MAIN
int main(int argc, char **argv) { return ferry_cli_check(argc, argv); }
#endif
