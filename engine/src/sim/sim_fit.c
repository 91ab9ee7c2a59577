/*
 * sim_fit.c — "what fits?": replays a policy template over a grid of its
 * knobs and picks the lowest-overhead setting whose steady-state peak fits
 * the device and whose pinned host memory fits the host budget
 * (`ferry sim --fit`, docs/sim-model.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "util/errbuf.h"

/* src with its line `local KNOB = ...` set to value (a Lua expression); the
 * line's comment is kept. NULL if there is no such line (or no memory). */
char *sim_policy_set_knob(const char *src, const char *knob, const char *value) {
  size_t kl = strlen(knob);
  for (const char *line = src; line && *line;) {
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (!strncmp(p, "local", 5) && (p[5] == ' ' || p[5] == '\t')) {
      p += 5;
      while (*p == ' ' || *p == '\t') p++;
      if (!strncmp(p, knob, kl) && (p[kl] == ' ' || p[kl] == '\t' || p[kl] == '=')) {
        const char *eq = strchr(p, '=');
        const char *eol = strchr(p, '\n');
        if (!eol) eol = p + strlen(p);
        if (eq && eq < eol) {
          const char *tail = eol;
          for (const char *c = eq; c + 1 < eol; c++)
            if (c[0] == '-' && c[1] == '-') {
              tail = c;
              break;
            }
          size_t head = (size_t)(eq + 1 - src), n = strlen(src) + strlen(value) + 4;
          char *out = malloc(n);
          if (!out) return NULL;
          snprintf(out, n, "%.*s %s %s", (int)head, src, value, tail);
          return out;
        }
      }
    }
    line = strchr(line, '\n');
    if (line) line++;
  }
  return NULL;
}

char *sim_fit_source(const char *tmpl, const sim_fit_setting *s) {
  char v[4][64];
  snprintf(v[0], sizeof v[0], "%llu", (unsigned long long)s->host_bytes);
  snprintf(v[1], sizeof v[1], "%d", s->keep_last);
  snprintf(v[2], sizeof v[2], "%d", s->fwd_stash);
  snprintf(v[3], sizeof v[3], "%d", s->prefetch_layers);
  static const char *const knobs[4] = {"HOST_BYTES", "KEEP_LAST", "FWD_STASH", "PREFETCH_LAYERS"};
  char *cur = strdup(tmpl);
  for (int i = 0; i < 4 && cur; i++) {
    char *next = sim_policy_set_knob(cur, knobs[i], v[i]);
    free(cur);
    cur = next;
  }
  return cur;
}

/* The grid, in a fixed order: host bytes in sixteenths of what can be
 * offloaded (the host budget, or less when the step has fewer eligible
 * bytes; 0 = nothing offloaded), layers kept, stash depth, prefetch
 * distance. */
static const int KEEP[] = {0, 1, 2, 4};
static const int STASH[] = {1, 4, 16};
static const int PREFETCH[] = {1, 2};
#define N_PARTS 16
#define N_KEEP (int)(sizeof KEEP / sizeof KEEP[0])
#define N_STASH (int)(sizeof STASH / sizeof STASH[0])
#define N_PREFETCH (int)(sizeof PREFETCH / sizeof PREFETCH[0])

/* Whether a is cheaper than b: step time, then peak device memory. */
static int cheaper(const sim_fit_setting *a, const sim_fit_setting *b) {
  if (a->step_us != b->step_us) return a->step_us < b->step_us;
  return a->peak_device_bytes < b->peak_device_bytes;
}

int sim_fit(const sim_trace *t, const sim_fit_config *c, sim_fit_result *out, char *err,
            size_t errlen) {
  memset(out, 0, sizeof *out);
  out->best = -1;
  if (!t || !c || !c->policy_template)
    return ferry_errbuf(err, errlen, FERRY_EINVAL, "sim_fit: NULL trace, config or template");
  size_t cap = (size_t)(N_PARTS + 1) * N_KEEP * N_STASH * N_PREFETCH;
  out->settings = calloc(cap, sizeof *out->settings);
  if (!out->settings) return ferry_errbuf(err, errlen, FERRY_ENOMEM, "sim_fit: out of memory");
  /* what can be offloaded: the whole budget, no layer kept */
  uint64_t span = c->host_bytes;
  {
    sim_fit_setting all = {c->host_bytes, 0, STASH[0], PREFETCH[0], 0, 0, 0, 0};
    char *src = sim_fit_source(c->policy_template, &all);
    if (!src)
      return ferry_errbuf(err, errlen, FERRY_EINVAL,
                          "sim_fit: the policy template lacks a line `local HOST_BYTES`, "
                          "`KEEP_LAST`, `FWD_STASH` or `PREFETCH_LAYERS = ...`");
    sim_config rc = c->replay;
    rc.policy_path = NULL;
    rc.policy_source = src;
    rc.timeline = rc.record_decisions = 0;
    sim_result r;
    int e = sim_replay(t, &rc, &r, err, errlen);
    free(src);
    if (e) return e;
    if (r.bytes_d2h < (double)span) span = (uint64_t)r.bytes_d2h;
    sim_result_free(&r);
  }
  out->span_bytes = span;
  for (int h = 0; h <= N_PARTS; h++)
    for (int k = 0; k < N_KEEP; k++) {
      if (KEEP[k] > 0 && t->layers > 0 && KEEP[k] >= t->layers) continue;
      for (int s = 0; s < N_STASH; s++)
        for (int p = 0; p < N_PREFETCH; p++) {
          /* with nothing offloaded the other knobs change nothing */
          if (h == 0 && (k || s || p)) continue;
          sim_fit_setting *st = &out->settings[out->n];
          st->host_bytes = h == N_PARTS ? span : span / N_PARTS * (uint64_t)h;
          st->keep_last = KEEP[k];
          st->fwd_stash = STASH[s];
          st->prefetch_layers = PREFETCH[p];
          char *src = sim_fit_source(c->policy_template, st);
          if (!src)
            return ferry_errbuf(err, errlen, FERRY_EINVAL,
                                "sim_fit: the policy template lacks a line `local HOST_BYTES`, "
                                "`KEEP_LAST`, `FWD_STASH` or `PREFETCH_LAYERS = ...`");
          sim_config rc = c->replay;
          rc.policy_path = NULL;
          rc.policy_source = src;
          rc.timeline = 0;
          rc.record_decisions = 0;
          sim_result r;
          int e = sim_replay(t, &rc, &r, err, errlen);
          free(src);
          if (e) return e;
          st->step_us = r.step_us;
          st->peak_device_bytes = r.peak_device_bytes;
          st->host_reserved_bytes = r.host_reserved_bytes;
          st->fits = r.policy_errors == 0 && r.peak_device_bytes <= c->device_bytes &&
                     r.host_reserved_bytes <= c->host_bytes;
          sim_result_free(&r);
          if (st->fits && (out->best < 0 || cheaper(st, &out->settings[out->best])))
            out->best = (int)out->n;
          out->n++;
        }
    }
  return 0;
}

void sim_fit_result_free(sim_fit_result *r) {
  free(r->settings);
  memset(r, 0, sizeof *r);
  r->best = -1;
}
