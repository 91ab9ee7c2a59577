/*
 * engine.c — engine lifecycle: config validation, backend/arena/policy
 * set-up, interning, errors and stats. The stash manager (pack/unpack) is in
 * stash.c; the registry, engine_fail and the event pool in engine_base.c.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "util/errbuf.h"
#include "util/log.h"
#include "core/engine_internal.h"

/* What ferry_last_error and ferry_last_policy_error return: a copy taken
 * under the engine lock into the calling thread's own buffer, so that
 * neither another thread's failure nor a policy freed by ferry_set_policy
 * can change or free it while the caller reads it. */
static _Thread_local char tls_last_error[sizeof ((ferry_engine *)0)->last_error];
static _Thread_local char tls_last_policy_error[512];

const char *ferry_last_error(ferry_engine *e) {
  if (engine_check(e) != FERRY_OK) return "not a live ferry engine";
  pthread_mutex_lock(&e->lock);
  memcpy(tls_last_error, e->last_error, sizeof tls_last_error);
  pthread_mutex_unlock(&e->lock);
  return tls_last_error;
}

/* engine_fail for a call that does not hold the lock. */
static int engine_fail_unlocked(ferry_engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int engine_fail_unlocked(ferry_engine *e, int code, const char *fmt, ...) {
  char msg[sizeof e->last_error];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&e->lock);
  memcpy(e->last_error, msg, sizeof msg);
  pthread_mutex_unlock(&e->lock);
  return code;
}

/* ---- config ----------------------------------------------------------------- */
/* The smallest ferry_config any release had: everything before the link. */
#define CONFIG_SIZE_MIN offsetof(ferry_config, link)
/* Every release's sizeof(ferry_config) is a multiple of its alignment: a
 * size that is not would end inside a field (half a pointer copied over a
 * default is a wild pointer). */
#define CONFIG_SIZE_ALIGN _Alignof(ferry_config)
/* Far above any release's size (248 bytes in 0.1): a larger struct_size is
 * an uninitialised config, refused before its "unknown tail" is read, which
 * would run off the caller's memory. */
#define CONFIG_SIZE_MAX 4096u

int ferry_config_init_sized(ferry_config *cfg, size_t size) {
  if (!cfg || size < CONFIG_SIZE_MIN || size > CONFIG_SIZE_MAX || size % CONFIG_SIZE_ALIGN)
    return FERRY_EINVAL;
  ferry_config d = FERRY_CONFIG_INIT;
  /* A caller's struct of another release: only its own bytes are written
   * (fields this library does not know, of a newer caller, are zeroed). */
  if (size > sizeof d) memset((char *)cfg + sizeof d, 0, size - sizeof d);
  memcpy(cfg, &d, size < sizeof d ? size : sizeof d);
  cfg->struct_size = (uint32_t)size;
  return FERRY_OK;
}

/* The entry point of binaries built before ferry_config_init took a size
 * (ferry.h now makes ferry_config_init a macro over ferry_config_init_sized):
 * their struct is 0.1.0's, which ended at reserved3; a later release's
 * fields are not written into it. */
#define CONFIG_SIZE_0_1_0 (offsetof(ferry_config, reserved3) + sizeof(uint32_t))
FERRY_API void(ferry_config_init)(ferry_config *cfg);
void(ferry_config_init)(ferry_config *cfg) { ferry_config_init_sized(cfg, CONFIG_SIZE_0_1_0); }

/* Copy the caller's config (which may be an older, shorter struct) over the
 * defaults and reject values that make no sense, naming the field. Only the
 * caller's struct_size bytes are read. The strings are copied as pointers:
 * ferry_engine_create uses them before it returns and keeps none. */
static int config_load(const ferry_config *in, ferry_config *out, char *errbuf,
                       size_t errlen) {
  ferry_config_init_sized(out, sizeof *out);
  if (!in) return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config is NULL");
  if (in->struct_size < CONFIG_SIZE_MIN || in->struct_size > CONFIG_SIZE_MAX ||
      in->struct_size % CONFIG_SIZE_ALIGN)
    return ferry_errbuf(errbuf, errlen, FERRY_EVERSION,
                   "config.struct_size %u is not a ferry_config size this library knows "
                   "(expected %zu); initialise it with FERRY_CONFIG_INIT or ferry_config_init()",
                   in->struct_size, sizeof *in);
  if ((in->version >> 16) != FERRY_VERSION_MAJOR)
    return ferry_errbuf(errbuf, errlen, FERRY_EVERSION,
                   "config.version %u.%u is from another major version than libferry %s",
                   in->version >> 16, (in->version >> 8) & 0xff, ferry_version_string());
  /* A newer caller's struct: fields this library does not know must be
   * unset (zero), or the caller asks for something it cannot do. */
  for (size_t i = sizeof *in; i < in->struct_size; i++)
    if (((const unsigned char *)in)[i])
      return ferry_errbuf(errbuf, errlen, FERRY_EVERSION,
                     "config.struct_size %u: the caller's header has fields this libferry %s "
                     "does not know (its ferry_config is %zu bytes), and byte %zu of them is "
                     "set; use a libferry at least as new as the header",
                     in->struct_size, ferry_version_string(), sizeof *in, i);
  memcpy(out, in, in->struct_size < sizeof *in ? in->struct_size : sizeof *in);
  out->struct_size = sizeof *out;
  if (!out->host_ram) out->host_ram = ferry_host_ram_proc, out->host_ram_ud = NULL;

  if (out->backend < FERRY_BACKEND_HOST || out->backend > FERRY_BACKEND_SIM)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config.backend %d is not a ferry_backend_kind",
                   out->backend);
  if (out->arena < FERRY_ARENA_AUTO || out->arena > FERRY_ARENA_POOL)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config.arena %d is not a ferry_arena_kind",
                   out->arena);
  if (!out->device_alloc)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.device_alloc is required: the engine never allocates device memory");
  if (!out->release)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.release is required: the engine must hand owner tokens back");
  if (out->max_fwd_stash > (1u << 20))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config.max_fwd_stash %u is absurd (max 1048576)",
                   out->max_fwd_stash);
  if (out->prefetch_distance > 4096)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.prefetch_distance %u is absurd (max 4096)", out->prefetch_distance);
  if (!(out->host_cap_pct >= 0.0 && out->host_cap_pct <= 100.0))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.host_cap_pct %g must be within [0, 100]", out->host_cap_pct);
  const ferry_link *l = &out->link;
  if (!(l->d2h_bytes_per_s >= 0) || !(l->h2d_bytes_per_s >= 0) || !(l->latency_us >= 0) ||
      !isfinite(l->d2h_bytes_per_s) || !isfinite(l->h2d_bytes_per_s) || !isfinite(l->latency_us))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.link: bandwidths and latency must be finite and >= 0");
  if (!(l->duplex > 0.0 && l->duplex <= 1.0))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config.link.duplex %g must be within (0, 1]",
                   l->duplex);
  if (out->policy_path && out->policy_source)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.policy_path and config.policy_source are exclusive");
  const uint32_t knob_bits = FERRY_KNOB_MAX_FWD_STASH | FERRY_KNOB_PREFETCH_DISTANCE |
                             FERRY_KNOB_MIN_OFFLOAD_BYTES | FERRY_KNOB_MAX_FWD_STASH_BYTES;
  if (out->knobs_fixed & ~knob_bits)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                   "config.knobs_fixed 0x%x has bits that are no FERRY_KNOB_*", out->knobs_fixed);
  return FERRY_OK;
}

static uint64_t cap_bytes(const ferry_config *c) {
  uint64_t cap = c->host_cap_bytes, total = 0, avail;
  if (c->host_cap_pct > 0) {
    if (c->host_ram(c->host_ram_ud, &total, &avail)) total = 0;
    if (total) {
      uint64_t pct = (uint64_t)((double)total * c->host_cap_pct / 100.0);
      if (!cap || pct < cap) cap = pct;
    }
  }
  return cap;
}

/* The config's knobs, then the policy's where it sets one and the config
 * did not fix it; a fixed knob the policy sets otherwise is remembered as
 * overruled, for the caller to report. */
static void apply_policy_knobs(ferry_engine *e) {
  const uint32_t fixed = e->cfg.knobs_fixed;
  e->max_fwd_stash = e->cfg.max_fwd_stash;
  e->prefetch_distance = e->cfg.prefetch_distance;
  e->min_offload_bytes = e->cfg.min_offload_bytes;
  e->max_fwd_stash_bytes = e->cfg.max_fwd_stash_bytes;
  e->release_when_copied = e->cfg.release_when_copied != 0;
  e->max_tail_prefetch = UINT32_MAX;
  e->sync_copies = FERRY_SYNC_ASYNC;
  e->one_copy_stream = 0;
  e->knobs_overruled = 0;
  if (!e->policy) return;
  ferry_policy_knobs k;
  ferry_policy_get_knobs(e->policy, &k);
  if (k.has_release_when_copied && k.release_when_copied) e->release_when_copied = 1;
  if (k.has_max_tail_prefetch) e->max_tail_prefetch = k.max_tail_prefetch;
  if (k.has_sync_copies) e->sync_copies = k.sync_copies;
  if (k.has_one_copy_stream) e->one_copy_stream = k.one_copy_stream;
#define KNOB(bit, name)                                          \
  if (k.has_##name) {                                            \
    if (!(fixed & (bit))) e->name = k.name;                      \
    else if (k.name != e->name) e->knobs_overruled |= (bit);     \
  }
  KNOB(FERRY_KNOB_MAX_FWD_STASH, max_fwd_stash)
  KNOB(FERRY_KNOB_PREFETCH_DISTANCE, prefetch_distance)
  KNOB(FERRY_KNOB_MIN_OFFLOAD_BYTES, min_offload_bytes)
  KNOB(FERRY_KNOB_MAX_FWD_STASH_BYTES, max_fwd_stash_bytes)
#undef KNOB
}

/* The key of a policy by file or by shipped name ("default",
 * ferry_policy_find), or by source text. */
static int policy_key_make(const char *path, const char *source, int trusted, policy_key *k,
                           char *msg, size_t msglen) {
  memset(k, 0, sizeof *k);
  k->trusted = trusted;
  if (path) {
    char found[PATH_MAX];
    int rc = ferry_policy_find(path, found, sizeof found, msg, msglen);
    if (rc) return rc;
    struct stat st; /* a file that cannot be stat'ed fails to load, saying why */
    if (stat(found, &st) == 0) {
      k->dev = (uint64_t)st.st_dev;
      k->ino = (uint64_t)st.st_ino;
      k->size = (uint64_t)st.st_size;
      k->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    }
    k->path = strdup(found);
  } else {
    k->source = strdup(source);
  }
  if (!k->path && !k->source)
    return ferry_errbuf(msg, msglen, FERRY_ENOMEM, "out of memory loading a policy");
  return FERRY_OK;
}

static int policy_key_equal(const policy_key *a, const policy_key *b) {
  if (a->trusted != b->trusted || !a->path != !b->path || !a->source != !b->source) return 0;
  if (a->source) return !strcmp(a->source, b->source);
  return a->path && !strcmp(a->path, b->path) && a->dev == b->dev && a->ino == b->ino &&
         a->size == b->size && a->mtime_ns == b->mtime_ns;
}

static void policy_key_free(policy_key *k) {
  free(k->path);
  free(k->source);
  memset(k, 0, sizeof *k);
}

static int load_policy(const policy_key *k, ferry_policy **out, char *msg, size_t msglen) {
  return ferry_policy_create(k->path, k->source, k->trusted, out, msg, msglen);
}

static void engine_free(ferry_engine *e, int handed_out);

/* Constructors by ferry_backend_kind (config_load checked the range). */
static int (*const backend_create[])(const ferry_config *, ferry_backend **, char *, size_t) = {
    [FERRY_BACKEND_HOST] = ferry_backend_host_create,
    [FERRY_BACKEND_CUDA] = ferry_backend_cuda_create,
    [FERRY_BACKEND_SIM] = ferry_backend_sim_create,
};

int ferry_engine_create(const ferry_config *cfg, ferry_engine **out, char *errbuf,
                        size_t errlen) {
  if (!out) return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "out is NULL");
  *out = NULL;
  ferry_config c;
  int rc = config_load(cfg, &c, errbuf, errlen);
  if (rc) return rc;
  if ((rc = util_log_check_env(errbuf, errlen))) return rc; /* a wrong FERRY_LOG_* */

  ferry_engine *e = calloc(1, sizeof *e);
  if (!e) return ferry_errbuf(errbuf, errlen, FERRY_ENOMEM, "out of memory creating the engine");
  e->cfg = c;
  /* Strings are not retained past creation (c has them, for below). */
  e->cfg.policy_path = e->cfg.policy_source = e->cfg.trace_path = e->cfg.chrome_trace_path = NULL;
  pthread_mutex_init(&e->lock, NULL);
  pthread_cond_init(&e->reload_done, NULL);
  e->decide = c.decide;
  e->decide_ud = c.decide_ud;
  e->phase = FERRY_PHASE_FORWARD;

  char msg[512] = "";
  rc = backend_create[c.backend](&c, &e->bk, msg, sizeof msg);
  if (rc) {
    ferry_errbuf(errbuf, errlen, rc, "backend: %s", msg[0] ? msg : ferry_strerror(rc));
    goto fail;
  }
  if (c.faults && *c.faults) {
    ferry_backend *wrapped;
    if ((rc = ferry_backend_faults_wrap(e->bk, c.faults, &wrapped, msg, sizeof msg))) {
      ferry_errbuf(errbuf, errlen, rc, "%s", msg);
      goto fail;
    }
    e->bk = wrapped;
  }
  if ((rc = e->bk->ops->stream_create(e->bk, &e->d2h)) ||
      (rc = e->bk->ops->stream_create(e->bk, &e->h2d)) ||
      (rc = e->bk->ops->event_create(e->bk, &e->ev_scratch))) {
    ferry_errbuf(errbuf, errlen, rc, "backend %s: %s", e->bk->ops->name, e->bk->err);
    goto fail;
  }
  /* A jemalloc arena writes into its extents: where host memory must not be
   * touched (sim), only the pool keeps its bookkeeping outside the blocks. */
  if (e->bk->ops->flags & BK_HOST_MEMORY_OPAQUE) {
    if (c.arena == FERRY_ARENA_JEMALLOC) {
      rc = ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                        "backend: %s backend: needs the pool arena (config.arena = "
                        "FERRY_ARENA_POOL): its host memory is address space only and the "
                        "jemalloc arena may touch it",
                        e->bk->ops->name);
      goto fail;
    }
    c.arena = FERRY_ARENA_POOL;
  }
  uint64_t cap = cap_bytes(&c);
  if ((rc = ferry_arena_create(e->bk, c.arena, cap, &e->arena, msg, sizeof msg))) {
    ferry_errbuf(errbuf, errlen, rc, "arena: %s", msg);
    goto fail;
  }
  if (c.host_reserve) ferry_arena_set_reserve_hook(e->arena, c.host_reserve, c.host_reserve_ud);
  e->ctx.arena_cap = cap;
  if ((rc = stash_init(e))) {
    ferry_errbuf(errbuf, errlen, rc, "out of memory creating the stash");
    goto fail;
  }
  if (c.policy_path || c.policy_source) {
    if ((rc = policy_key_make(c.policy_path, c.policy_source, c.policy_trusted,
                              &e->policy_from, msg, sizeof msg)) ||
        (rc = load_policy(&e->policy_from, &e->policy, msg, sizeof msg))) {
      ferry_errbuf(errbuf, errlen, rc, "%s", msg);
      goto fail;
    }
    ferry_policy_set_host_ram(e->policy, e->cfg.host_ram, e->cfg.host_ram_ud);
  }
  apply_policy_knobs(e);
  /* c, not the caller's struct: fields past an older caller's struct_size
   * are the defaults there */
  if (c.trace_path && (rc = trace_open(e, c.trace_path))) {
    ferry_errbuf(errbuf, errlen, rc, "%s", e->last_error);
    goto fail;
  }
  if (c.chrome_trace_path && (rc = ctrace_open(e, c.chrome_trace_path))) {
    ferry_errbuf(errbuf, errlen, rc, "%s", e->last_error);
    goto fail;
  }
  if (c.count_reasons && (rc = breakdown_open(e))) {
    ferry_errbuf(errbuf, errlen, rc, "%s", e->last_error);
    goto fail;
  }
  if (registry_add(e)) {
    rc = ferry_errbuf(errbuf, errlen, FERRY_ENOMEM, "too many live engines (max %d)", MAX_ENGINES);
    goto fail;
  }
  *out = e;
  return FERRY_OK;

fail:
  engine_free(e, 0);
  return rc;
}

/* A stale pointer (an engine destroyed already) is refused by the registry,
 * which only one of two destroys of the same engine gets past. */
void ferry_engine_destroy(ferry_engine *e) {
  if (!e || !registry_remove(e)) return;
  engine_free(e, 1);
}

/* Frees an engine off the registry, also a half-built one from
 * ferry_engine_create (handed_out 0): no caller has that one's address, so
 * it is not quarantined, where it would push a destroyed engine out. */
static void engine_free(ferry_engine *e, int handed_out) {
  for (uint32_t i = e->n_shutdown_hooks; i-- > 0;)
    e->shutdown_hooks[i].fn(e, e->shutdown_hooks[i].ud);
  free(e->shutdown_hooks);
  if (e->entries || e->fwd) stash_destroy(e);
  if (e->policy) ferry_policy_destroy(e->policy);
  policy_key_free(&e->policy_from);
  for (int i = 0; i < PARKED_POLICIES; i++) {
    if (e->parked[i].p) ferry_policy_destroy(e->parked[i].p);
    policy_key_free(&e->parked[i].key);
  }
  if (e->arena) ferry_arena_destroy(e->arena);
  if (e->bk) {
    for (uint32_t i = 0; i < e->n_event_pool; i++)
      e->bk->ops->event_destroy(e->bk, e->event_pool[i]);
    if (e->ev_scratch) e->bk->ops->event_destroy(e->bk, e->ev_scratch);
    if (e->d2h) e->bk->ops->stream_destroy(e->bk, e->d2h);
    if (e->h2d) e->bk->ops->stream_destroy(e->bk, e->h2d);
    e->bk->ops->destroy(e->bk);
  }
  /* the copy threads are gone: no copy listener call can come */
  engine_observers_close(e);
  free(e->event_pool);
  intern_clear(&e->interned);
  pthread_cond_destroy(&e->reload_done);
  pthread_mutex_destroy(&e->lock);
  if (handed_out)
    quarantine_push(e);
  else
    free(e);
}

/* ---- core.h: what sim/ and checkpoint/ use of an engine ---------------- */

void engine_lock(ferry_engine *e) { pthread_mutex_lock(&e->lock); }
void engine_unlock(ferry_engine *e) { pthread_mutex_unlock(&e->lock); }
ferry_backend *engine_backend(ferry_engine *e) { return e->bk; }
ferry_arena *engine_arena(ferry_engine *e) { return e->arena; }
int engine_backend_kind(ferry_engine *e) { return (int)e->cfg.backend; }
bk_stream engine_d2h_stream(ferry_engine *e) { return e->d2h; }
bk_stream engine_h2d_stream(ferry_engine *e) { return e->h2d; }
ferry_stats *engine_stats(ferry_engine *e) { return &e->stats; }
bk_event *engine_scratch_event(ferry_engine *e) { return e->ev_scratch; }

int engine_on_shutdown(ferry_engine *e, engine_shutdown_fn fn, void *ud) {
  struct shutdown_hook *h =
      realloc(e->shutdown_hooks, (e->n_shutdown_hooks + 1) * sizeof *e->shutdown_hooks);
  if (!h) return FERRY_ENOMEM;
  e->shutdown_hooks = h;
  h[e->n_shutdown_hooks++] = (struct shutdown_hook){fn, ud};
  return FERRY_OK;
}

void *engine_shutdown_data(ferry_engine *e, engine_shutdown_fn fn) {
  for (uint32_t i = 0; i < e->n_shutdown_hooks; i++)
    if (e->shutdown_hooks[i].fn == fn) return e->shutdown_hooks[i].ud;
  return NULL;
}

ferry_backend *ferry_engine_backend(ferry_engine *e) { return engine_check(e) ? NULL : e->bk; }

uint64_t ferry_faults_injected(ferry_engine *e) {
  return engine_check(e) ? 0 : ferry_backend_faults_injected(e->bk);
}

const char *ferry_backend_name(ferry_engine *e) {
  if (engine_check(e)) return "none";
  return e->bk->ops->name;
}

const char *ferry_arena_name(ferry_engine *e) {
  if (engine_check(e)) return "none";
  return ferry_arena_kind_name(e->arena);
}

int ferry_arena_trim(ferry_engine *e, uint64_t keep_bytes, uint64_t *released) {
  if (released) *released = 0;
  int rc = engine_check(e);
  if (rc) return rc;
  uint64_t n = ferry_arena_release_free(e->arena, keep_bytes);
  if (released) *released = n;
  return FERRY_OK;
}

/* ---- interning --------------------------------------------------------------- */
const char *ferry_intern(ferry_engine *e, const char *s) {
  if (engine_check(e) || !s) return NULL;
  pthread_mutex_lock(&e->lock);
  const char *r = intern_get(&e->interned, s);
  pthread_mutex_unlock(&e->lock);
  return r;
}

/* ---- policies ---------------------------------------------------------------- */
/* Makes p (loaded from k, taken) the engine's policy; the one in force is
 * parked, and what parking pushes out is returned to be destroyed unlocked.
 * Called locked. */
static ferry_policy *policy_swap_in(ferry_engine *e, ferry_policy *p, policy_key *k) {
  ferry_policy *out = NULL;
  if (e->policy) {
    int slot = 0; /* a free slot, else the one parked longest ago */
    for (int i = 0; i < PARKED_POLICIES; i++) {
      if (!e->parked[i].p) {
        slot = i;
        break;
      }
      if (e->parked[i].parked_at < e->parked[slot].parked_at) slot = i;
    }
    out = e->parked[slot].p;
    policy_key_free(&e->parked[slot].key);
    e->parked[slot] = (struct parked_policy){e->policy, e->policy_from, ++e->park_clock};
  } else {
    policy_key_free(&e->policy_from);
  }
  e->policy = p;
  ferry_policy_set_host_ram(p, e->cfg.host_ram, e->cfg.host_ram_ud);
  e->policy_from = *k;
  memset(k, 0, sizeof *k);
  apply_policy_knobs(e);
  return out;
}

static int set_policy_in_step(ferry_engine *e) {
  return engine_fail(e, FERRY_ESTATE,
                     "ferry_set_policy during step %llu: swap policies between steps",
                     (unsigned long long)e->step);
}

int ferry_set_policy(ferry_engine *e, const char *path, const char *source, int trusted) {
  int rc = engine_check(e);
  if (rc) return rc;
  if (!path && !source)
    return engine_fail_unlocked(e, FERRY_EINVAL, "ferry_set_policy: no path or source");
  char msg[512];
  policy_key k;
  if ((rc = policy_key_make(path, source, trusted, &k, msg, sizeof msg))) {
    policy_key_free(&k);
    return engine_fail_unlocked(e, rc, "%s (the previous policy stays in force)", msg);
  }
  /* A policy swapped out before, from the same unchanged file or source,
   * comes back as it was (its state and site cache too): alternating
   * contexts do not reload Lua at every entry. */
  pthread_mutex_lock(&e->lock);
  if (e->in_step) {
    rc = set_policy_in_step(e);
    pthread_mutex_unlock(&e->lock);
    policy_key_free(&k);
    return rc;
  }
  for (int i = 0; i < PARKED_POLICIES; i++) {
    if (!e->parked[i].p || !policy_key_equal(&e->parked[i].key, &k)) continue;
    ferry_policy *p = e->parked[i].p;
    policy_key pk = e->parked[i].key;
    e->parked[i] = (struct parked_policy){0};
    ferry_policy *out = policy_swap_in(e, p, &pk);
    pthread_mutex_unlock(&e->lock);
    policy_key_free(&k);
    if (out) ferry_policy_destroy(out);
    return FERRY_OK;
  }
  pthread_mutex_unlock(&e->lock);
  /* Load outside the lock: a slow or broken file must not stall training. */
  ferry_policy *p = NULL;
  rc = load_policy(&k, &p, msg, sizeof msg);
  pthread_mutex_lock(&e->lock);
  ferry_policy *out = NULL;
  if (rc) {
    rc = engine_fail(e, rc, "%s (the previous policy stays in force)", msg);
  } else if (e->in_step) {
    out = p;
    rc = set_policy_in_step(e);
  } else {
    out = policy_swap_in(e, p, &k);
  }
  pthread_mutex_unlock(&e->lock);
  policy_key_free(&k);
  if (out) ferry_policy_destroy(out);
  return rc;
}

const char *ferry_last_policy_error(ferry_engine *e) {
  if (engine_check(e)) return "";
  pthread_mutex_lock(&e->lock);
  const char *msg = e->policy ? ferry_policy_last_error(e->policy) : "";
  snprintf(tls_last_policy_error, sizeof tls_last_policy_error, "%s", msg);
  pthread_mutex_unlock(&e->lock);
  return tls_last_policy_error;
}

_Static_assert(offsetof(ferry_knobs, max_fwd_stash_bytes) == FERRY_KNOBS_SIZE_V1,
               "FERRY_KNOBS_SIZE_V1 is the size of the first ferry_knobs");

/* Copies the knobs in force into out, at most size bytes of them. */
int ferry_get_knobs(ferry_engine *e, ferry_knobs *out, size_t size) {
  int rc = engine_check(e);
  if (rc) return rc;
  if (!out) return engine_fail_unlocked(e, FERRY_EINVAL, "ferry_get_knobs: out is NULL");
  if (size < FERRY_KNOBS_SIZE_V1)
    return engine_fail_unlocked(e, FERRY_EINVAL, "ferry_get_knobs: size %zu is smaller than the first ferry_knobs (%zu bytes)",
                       size, (size_t)FERRY_KNOBS_SIZE_V1);
  ferry_knobs k;
  memset(&k, 0, sizeof k); /* the tail padding too: the caller gets every byte defined */
  pthread_mutex_lock(&e->lock);
  k.max_fwd_stash = e->max_fwd_stash;
  k.prefetch_distance = e->prefetch_distance;
  k.min_offload_bytes = e->min_offload_bytes;
  k.max_fwd_stash_bytes = e->max_fwd_stash_bytes;
  k.overruled = e->knobs_overruled;
  k.release_when_copied = (uint32_t)e->release_when_copied;
  k.max_tail_prefetch = e->max_tail_prefetch;
  k.sync_copies = e->sync_copies;
  k.one_copy_stream = e->one_copy_stream;
  pthread_mutex_unlock(&e->lock);
  memcpy(out, &k, size < sizeof k ? size : sizeof k);
  return FERRY_OK;
}

/* ---- stats ------------------------------------------------------------------- */
int ferry_get_stats(ferry_engine *e, ferry_stats *out, size_t size) {
  int rc = engine_check(e);
  if (rc) return rc;
  if (!out) return engine_fail_unlocked(e, FERRY_EINVAL, "ferry_get_stats: out is NULL");
  ferry_stats s;
  pthread_mutex_lock(&e->lock);
  s = e->stats;
  ferry_arena_stats a;
  ferry_arena_get_stats(e->arena, &a);
  s.arena_in_use = a.in_use;
  s.arena_peak = a.peak;
  s.arena_reserved = a.reserved;
  s.arena_cap = a.cap;
  s.backend_pinned_allocs = a.backend_allocs;
  if (e->policy) {
    ferry_policy_stats p;
    ferry_policy_get_stats(e->policy, &p);
    s.policy_calls = p.calls;
    s.policy_cache_hits = p.cache_hits;
    s.policy_errors += p.errors;
    s.policy_disabled = (uint64_t)p.disabled;
  }
  pthread_mutex_unlock(&e->lock);
  memcpy(out, &s, size < sizeof s ? size : sizeof s);
  return FERRY_OK;
}

/* The step flag lives in the stash (stash.c begins steps on its own). */
int ferry_in_step(ferry_engine *e) {
  if (!e) return 0;
  pthread_mutex_lock(&e->lock);
  int in = e->in_step;
  pthread_mutex_unlock(&e->lock);
  return in;
}
