/*
 * decide_replay.c: prints every decision a policy makes over a fixed,
 * varied stream of tensor facts (sizes, kinds, dtypes, phases, module paths
 * and classes, layers, steps that repeat and steps that change, host RAM
 * crossing 60%, arena and in-flight bytes), one line per call. Built
 * against libferry.so, so that two builds of the policy host (and two trees
 * of policies) can be run on the same stream and their outputs compared
 * byte for byte: tests/replay/compare.sh.
 *
 *   decide_replay POLICY.lua [explain]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_rand(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng >> 33);
}

static const char *const SUFFIX[][2] = {
    {"self_attn.q_proj", "Linear"},         {"self_attn.k_proj", "Linear"},
    {"self_attn.v_proj", "Linear"},         {"self_attn.core_attention", "DotProductAttention"},
    {"self_attn.o_proj", "Linear"},         {"mlp.gate_proj", "Linear"},
    {"mlp.up_proj", "Linear"},              {"mlp.fc1", "Linear"},
    {"mlp.down_proj", "Linear"},            {"input_layernorm", "LigerRMSNorm"},
    {"mlp.act", "SiLU"},                    {"self_attn.linear_proj", "RowParallelLinear"},
};
#define N_SUFFIX (sizeof SUFFIX / sizeof SUFFIX[0])
static const char *const OUTSIDE[][2] = {{"model.embed_tokens", "Embedding"}, {"lm_head", "Linear"},
                                         {"model.norm", "RMSNorm"},            {"loss", "CrossEntropyLoss"},
                                         {"", "Tensor"},                        {NULL, NULL},
                                         {"transformer.ln_f", "LayerNorm"},    {"output", "Linear"}};
#define N_OUTSIDE (sizeof OUTSIDE / sizeof OUTSIDE[0])

#define MAX_SITES 4096
static ferry_tensor_desc sites[MAX_SITES];
static char paths[MAX_SITES][96];
static int n_sites;

/* A model of `layers` layers: each layer's sites, then some outside ones. */
static void make_model(int layers, int variant) {
  n_sites = 0;
  for (int o = 0; o < 2; o++) {
    ferry_tensor_desc *d = &sites[n_sites];
    *d = (ferry_tensor_desc)FERRY_TENSOR_DESC_INIT;
    d->dtype = FERRY_DTYPE_BF16;
    d->ndim = 2;
    d->shape[0] = 4 + variant;
    d->shape[1] = 4096;
    d->bytes = (uint64_t)d->shape[0] * 4096 * 2;
    d->layer = -1;
    d->layer_count = layers;
    d->module_path = OUTSIDE[o][0];
    d->module_class = OUTSIDE[o][1];
    n_sites++;
  }
  for (int l = 0; l < layers; l++)
    for (size_t s = 0; s < N_SUFFIX; s++) {
      if ((s + (size_t)variant) % 5 == 4 && l % 3 == 1) continue; /* not every layer alike */
      ferry_tensor_desc *d = &sites[n_sites];
      *d = (ferry_tensor_desc)FERRY_TENSOR_DESC_INIT;
      uint32_t r = next_rand();
      d->dtype = r % 7 == 0 ? FERRY_DTYPE_F32 : FERRY_DTYPE_BF16;
      d->kind = r % 23 == 0 ? FERRY_KIND_PARAMETER : r % 29 == 0 ? FERRY_KIND_BUFFER
                : r % 31 == 0 ? FERRY_KIND_OTHER : FERRY_KIND_ACTIVATION;
      d->ndim = 1 + (int)(r % 4);
      uint64_t elems = 1;
      for (int k = 0; k < d->ndim; k++) {
        d->shape[k] = k == 0 ? 1 + (int64_t)(next_rand() % 8) : 16 << (next_rand() % 9);
        elems *= (uint64_t)d->shape[k];
      }
      d->bytes = elems * (d->dtype == FERRY_DTYPE_F32 ? 4 : 2);
      if (next_rand() % 11 == 0) d->bytes = 512; /* under min_bytes */
      d->flags = FERRY_FLAG_CONTIGUOUS;
      d->layer = l;
      d->layer_count = variant == 2 ? 0 : layers; /* 0: unknown */
      snprintf(paths[n_sites], sizeof paths[0], "model.layers.%d.%s", l, SUFFIX[s][0]);
      d->module_path = paths[n_sites];
      d->module_class = SUFFIX[s][1];
      n_sites++;
    }
  for (size_t o = 2; o < N_OUTSIDE; o++) {
    ferry_tensor_desc *d = &sites[n_sites];
    *d = (ferry_tensor_desc)FERRY_TENSOR_DESC_INIT;
    d->dtype = o == 3 ? FERRY_DTYPE_F32 : FERRY_DTYPE_BF16;
    d->ndim = 3;
    d->shape[0] = 2;
    d->shape[1] = 512 + 64 * variant;
    d->shape[2] = o == 3 ? 32000 : 4096;
    d->bytes = 2ull * (uint64_t)d->shape[1] * (uint64_t)d->shape[2] * (o == 3 ? 4 : 2);
    d->layer = -1;
    d->layer_count = layers;
    d->module_path = OUTSIDE[o][0];
    d->module_class = OUTSIDE[o][1];
    n_sites++;
  }
}

static int ram_reading(void *ud, uint64_t *total, uint64_t *avail) {
  double pct = *(double *)ud;
  *total = 1000000;
  *avail = (uint64_t)(1000000 * (1 - pct / 100));
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: decide_replay POLICY.lua [explain]\n");
    return 2;
  }
  int explain = argc > 2 && !strcmp(argv[2], "explain");
  char err[512];
  ferry_policy *p = NULL;
  if (ferry_policy_create(argv[1], NULL, 0, &p, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "decide_replay: %s\n", err);
    return 1;
  }
  double ram = 50;
  ferry_policy_set_host_ram(p, ram_reading, &ram);
  ferry_context ctx = {0};
  uint64_t step = 0;
  char copy[96];
  /* phases of the run: (model variant, layers, steps) */
  static const int plan[][3] = {{0, 6, 5}, {1, 6, 3}, {0, 6, 4}, {2, 4, 3}, {0, 9, 4}, {3, 6, 6}};
  for (size_t k = 0; k < sizeof plan / sizeof plan[0]; k++) {
    make_model(plan[k][1], plan[k][0]);
    for (int s = 0; s < plan[k][2]; s++) {
      ctx = (ferry_context){0};
      ctx.step = ++step;
      /* host RAM: NaN (the policy samples it) or a reading around 60% */
      ram = 45 + (double)(next_rand() % 30);
      ctx.host_ram_used_pct = step % 3 ? ram : __builtin_nan("");
      ctx.arena_cap = step % 4 == 0 ? 0 : 8ull << 30;
      ferry_policy_step_begin(p, &ctx);
      ctx.phase = FERRY_PHASE_FORWARD;
      for (int i = 0; i < n_sites; i++) {
        ferry_tensor_desc d = sites[i];
        /* a recompute pass in some steps, an extra site now and then */
        if (plan[k][0] == 3 && i % 4 == 0) d.phase = FERRY_PHASE_RECOMPUTE;
        if (d.module_path && next_rand() % 5 == 0) { /* same content, another pointer */
          snprintf(copy, sizeof copy, "%s", d.module_path);
          d.module_path = copy;
        }
        if (s == 2 && i == n_sites / 2) d.shape[0] += 1000; /* a site new this step */
        ctx.packed_this_step++;
        ctx.bytes_in_flight = (next_rand() % 4) * (256ull << 20);
        ctx.arena_in_use = (next_rand() % 10) * (1ull << 30);
        ctx.stash_depth = next_rand() % 6;
        ferry_decision out;
        ferry_policy_reason why;
        if (explain)
          ferry_policy_explain(p, &d, &ctx, &out, &why);
        else
          ferry_policy_decide(p, &d, &ctx, &out);
        if (out.action == FERRY_OFFLOAD) {
          ctx.offloaded_this_step++;
          ctx.bytes_offloaded_this_step += d.bytes;
        }
        printf("%llu %d %s %d %d %d %d", (unsigned long long)step, i,
               d.module_path ? d.module_path : "(null)", out.action, out.reload,
               out.prefetch_distance, out.cacheable);
        if (explain) printf(" %s %s %d", why.rule, why.where, why.from_cache);
        printf("\n");
      }
    }
  }
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  printf("calls %llu hits %llu errors %llu disabled %d\n", (unsigned long long)st.calls,
         (unsigned long long)st.cache_hits, (unsigned long long)st.errors, st.disabled);
  ferry_policy_destroy(p);
  return 0;
}
