/*
 * load.c: loading a policy (file or source), reading its knobs, validating
 * the table it returns; ferry_policy_create/destroy and the getters.
 */
#include "policy/policy_internal.h"

/* ---- loading ------------------------------------------------------------ */
/* Line of the first occurrence of identifier `word` in src, 0 if none. */
static int source_line_of(const char *src, const char *word) {
  if (!src) return 0;
  size_t wl = strlen(word);
  int line = 1;
  for (const char *c = src; *c; c++) {
    if (*c == '\n') {
      line++;
      continue;
    }
    if (strncmp(c, word, wl) == 0) {
      char before = c == src ? ' ' : c[-1], after = c[wl];
      int ident_before = before == '_' || (before >= 'a' && before <= 'z') ||
                         (before >= 'A' && before <= 'Z') || (before >= '0' && before <= '9');
      int ident_after = after == '_' || (after >= 'a' && after <= 'z') ||
                        (after >= 'A' && after <= 'Z') || (after >= '0' && after <= '9');
      if (!ident_before && !ident_after) return line;
    }
  }
  return 0;
}

/* Line of the last statement starting with `return` (the policy table), 0 if none. */
static int last_return_line(const char *src) {
  int line = 1, found = 0;
  for (const char *c = src; c && *c; c++) {
    const char *s = c;
    while (*s == ' ' || *s == '\t') s++;
    if (!strncmp(s, "return", 6) && !(s[6] == '_' || (s[6] >= 'a' && s[6] <= 'z') ||
                                      (s[6] >= 'A' && s[6] <= 'Z') || (s[6] >= '0' && s[6] <= '9')))
      found = line;
    while (*c && *c != '\n') c++;
    if (!*c) break;
    line++;
  }
  return found;
}

/* Line of the last `return` at the start of a line, unindented (the main
 * chunk's, returning the policy table, not a function's); else the last
 * `return` anywhere; 0 if none. */
static int table_return_line(const char *src) {
  int line = 1, found = 0;
  for (const char *c = src; c && *c; c++) {
    if (!strncmp(c, "return", 6) && !(c[6] == '_' || (c[6] >= 'a' && c[6] <= 'z') ||
                                      (c[6] >= 'A' && c[6] <= 'Z') || (c[6] >= '0' && c[6] <= '9')))
      found = line;
    while (*c && *c != '\n') c++;
    if (!*c) break;
    line++;
  }
  return found ? found : last_return_line(src);
}

/* Write "chunk:line: msg" (or "chunk: msg" without a line) into errbuf. */
static int load_fail(ferry_policy *p, const char *src, const char *word, char *errbuf,
                     size_t errlen, const char *fmt, ...) {
  char msg[MSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  int line = !word ? 0 : !strcmp(word, "return") ? last_return_line(src) : source_line_of(src, word);
  if (!line && word) line = last_return_line(src);
  if (errbuf && errlen) {
    if (line)
      snprintf(errbuf, errlen, "%s:%d: %s", p->chunk, line, msg);
    else
      snprintf(errbuf, errlen, "%s: %s", p->chunk, msg);
  }
  return FERRY_EPOLICY;
}


typedef struct knob_spec {
  const char *name;
  double max;
} knob_spec;

static const knob_spec KNOBS[] = {
    {"max_fwd_stash", KNOB_MAX_FWD_STASH},
    {"prefetch_distance", KNOB_MAX_PREFETCH_DISTANCE},
    {"min_offload_bytes", (double)KNOB_MAX_MIN_OFFLOAD_BYTES},
    {"max_fwd_stash_bytes", (double)KNOB_MAX_MIN_OFFLOAD_BYTES},
    {"release_when_copied", 1},
    {"max_tail_prefetch", KNOB_MAX_PREFETCH_DISTANCE},
    {"sync_copies", FERRY_SYNC_HOST},
    {"one_copy_stream", 1},
};

/* "file:line" of the function at the top of the stack into where (MSG_LEN
 * bytes), the chunk's name when Lua does not know the line. */
static void function_where(ferry_policy *p, char *where) {
  lua_Debug ar;
  lua_pushvalue(p->L, -1);
  if (lua_getinfo(p->L, ">S", &ar) && ar.linedefined > 0)
    snprintf(where, MSG_LEN, "%s:%d", ar.short_src, ar.linedefined);
  else
    copy_str(where, MSG_LEN, p->chunk);
}

/* Reads the optional function field `name` of the policy table at tbl into
 * the registry as "ferry.<name>", its "file:line" into where. */
static int optional_function(ferry_policy *p, const char *src, int tbl, const char *name,
                             const char *example, char *where, char *errbuf, size_t errlen,
                             int *has) {
  lua_State *L = p->L;
  lua_pushstring(L, name);
  lua_rawget(L, tbl);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return 0;
  }
  if (!lua_isfunction(L, -1))
    return load_fail(p, src, name, errbuf, errlen, "%s must be a function (%s), got %s", name,
                     example, luaL_typename(L, -1));
  function_where(p, where);
  lua_pushfstring(L, "ferry.%s", name);
  lua_insert(L, -2);
  lua_settable(L, LUA_REGISTRYINDEX);
  *has = 1;
  return 0;
}

/* The policy table is at the top of the stack. Reads it with raw accesses
 * only (no policy code runs). */
static int validate_policy_table(ferry_policy *p, const char *src, char *errbuf, size_t errlen) {
  lua_State *L = p->L;
  int tbl = lua_gettop(L);
  char vb[96];
  if (!lua_istable(L, tbl))
    return load_fail(p, src, "return", errbuf, errlen,
                     "a policy must return a table { api = %d, decide = function(t, ctx) ... end }, "
                     "got %s", FERRY_POLICY_API_VERSION, luaL_typename(L, tbl));

  lua_pushliteral(L, "api");
  lua_rawget(L, tbl);
  if (lua_isnil(L, -1))
    return load_fail(p, src, "return", errbuf, errlen,
                     "the policy table has no 'api' field (this ferry provides API version %d: "
                     "return { api = %d, ... })", FERRY_POLICY_API_VERSION, FERRY_POLICY_API_VERSION);
  if (lua_type(L, -1) != LUA_TNUMBER || lua_tonumber(L, -1) != floor(lua_tonumber(L, -1)))
    return load_fail(p, src, "api", errbuf, errlen, "api must be an integer, got %s",
                     describe_value(L, -1, vb, sizeof vb));
  if (lua_tonumber(L, -1) != FERRY_POLICY_API_VERSION)
    return load_fail(p, src, "api", errbuf, errlen,
                     "policy requires API version %s, this ferry provides %d",
                     describe_value(L, -1, vb, sizeof vb), FERRY_POLICY_API_VERSION);
  lua_pop(L, 1);

  lua_pushliteral(L, "name");
  lua_rawget(L, tbl);
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TSTRING || lua_objlen(L, -1) == 0 || lua_objlen(L, -1) >= sizeof p->name)
      return load_fail(p, src, "name", errbuf, errlen,
                       "name must be a non-empty string shorter than %zu bytes, got %s",
                       sizeof p->name, describe_value(L, -1, vb, sizeof vb));
    copy_str(p->name, sizeof p->name, lua_tostring(L, -1));
  }
  lua_pop(L, 1);

  lua_pushliteral(L, "decide");
  lua_rawget(L, tbl);
  if (lua_isnil(L, -1))
    return load_fail(p, src, "return", errbuf, errlen,
                     "the policy table has no decide function (decide = function(t, ctx) ... end)");
  if (!lua_isfunction(L, -1))
    return load_fail(p, src, "decide", errbuf, errlen, "decide must be a function, got %s",
                     luaL_typename(L, -1));
  function_where(p, p->decide_where);
  lua_pop(L, 1);

  /* Optional snapshot(e) (checkpoint entries), step(ctx) (each step's
   * begin), explain(t, ctx) (decide with its reason, for tools) and
   * resident(r) (optimizer states and weights on the host): kept in
   * the registry, so the permanent stack of decide stays as it is. */
  if (optional_function(p, src, tbl, "snapshot", "snapshot = function(e) ... end",
                        p->snapshot_where, errbuf, errlen, &p->has_snapshot) ||
      optional_function(p, src, tbl, "step", "step = function(ctx) ... end", p->step_where,
                        errbuf, errlen, &p->has_step) ||
      optional_function(p, src, tbl, "explain", "explain = function(t, ctx) ... end",
                        p->explain_where, errbuf, errlen, &p->has_explain) ||
      optional_function(p, src, tbl, "resident", "resident = function(r) ... end",
                        p->resident_where, errbuf, errlen, &p->has_resident))
    return FERRY_EPOLICY;
  /* Where an explained reason without a line points: the policy table. */
  int table_line = table_return_line(src);
  if (table_line)
    snprintf(p->table_where, sizeof p->table_where, "%.400s:%d", p->chunk, table_line);
  else
    copy_str(p->table_where, sizeof p->table_where, p->chunk);

  lua_pushliteral(L, "knobs");
  lua_rawget(L, tbl);
  int knobs = lua_gettop(L);
  if (!lua_isnil(L, knobs)) {
    if (!lua_istable(L, knobs))
      return load_fail(p, src, "knobs", errbuf, errlen, "knobs must be a table, got %s",
                       luaL_typename(L, knobs));
    lua_pushnil(L);
    while (lua_next(L, knobs)) { /* stack: ..., key, value */
      if (lua_type(L, -2) != LUA_TSTRING)
        return load_fail(p, src, "knobs", errbuf, errlen, "knob names must be strings, got a %s key",
                         luaL_typename(L, -2));
      const char *k = lua_tostring(L, -2);
      size_t which = 0;
      while (which < sizeof KNOBS / sizeof KNOBS[0] && strcmp(KNOBS[which].name, k)) which++;
      if (which == sizeof KNOBS / sizeof KNOBS[0])
        return load_fail(p, src, k, errbuf, errlen,
                         "unknown knob '%s' (known: max_fwd_stash, prefetch_distance, "
                         "min_offload_bytes, max_fwd_stash_bytes, release_when_copied, "
                         "max_tail_prefetch, sync_copies, one_copy_stream)", k);
      double v = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : NAN;
      if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v))
        return load_fail(p, src, k, errbuf, errlen, "knob '%s' must be an integer, got %s", k,
                         describe_value(L, -1, vb, sizeof vb));
      if (v < 0 || v > KNOBS[which].max)
        return load_fail(p, src, k, errbuf, errlen, "knob '%s' must be within [0, %.0f], got %s",
                         k, KNOBS[which].max, describe_value(L, -1, vb, sizeof vb));
      if (which == 0) {
        p->knobs.has_max_fwd_stash = 1;
        p->knobs.max_fwd_stash = (uint32_t)v;
      } else if (which == 1) {
        p->knobs.has_prefetch_distance = 1;
        p->knobs.prefetch_distance = (uint32_t)v;
      } else if (which == 2) {
        p->knobs.has_min_offload_bytes = 1;
        p->knobs.min_offload_bytes = (uint64_t)v;
      } else if (which == 3) {
        p->knobs.has_max_fwd_stash_bytes = 1;
        p->knobs.max_fwd_stash_bytes = (uint64_t)v;
      } else if (which == 4) {
        p->knobs.has_release_when_copied = 1;
        p->knobs.release_when_copied = (uint32_t)v;
      } else if (which == 5) {
        p->knobs.has_max_tail_prefetch = 1;
        p->knobs.max_tail_prefetch = (uint32_t)v;
      } else if (which == 6) {
        p->knobs.has_sync_copies = 1;
        p->knobs.sync_copies = (uint32_t)v;
      } else {
        p->knobs.has_one_copy_stream = 1;
        p->knobs.one_copy_stream = (uint32_t)v;
      }
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  return FERRY_OK;
}

static char *read_policy_file(const char *path, size_t *len, char *err, size_t errlen) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "%s: cannot open the policy file: %s", path, strerror(errno));
    return NULL;
  }
  char *buf = malloc(MAX_POLICY_FILE + 1);
  size_t n = buf ? fread(buf, 1, MAX_POLICY_FILE + 1, f) : 0;
  int bad = !buf || ferror(f);
  fclose(f);
  if (bad || n > MAX_POLICY_FILE) {
    snprintf(err, errlen, "%s: %s", path,
             !buf ? "out of memory" : bad ? "cannot read the policy file" :
                                           "policy file larger than 16 MiB");
    free(buf);
    return NULL;
  }
  buf[n] = '\0';
  *len = n;
  return buf;
}



static void chunk_display_name(ferry_policy *p, const char *path) {
  if (!path) {
    copy_str(p->chunk, sizeof p->chunk, "policy");
    return;
  }
  /* what LuaJIT prints for "@path": the tail of long paths after "..." */
  size_t len = strlen(path), max = LUA_IDSIZE - 1;
  if (len <= max)
    copy_str(p->chunk, sizeof p->chunk, path);
  else
    snprintf(p->chunk, sizeof p->chunk, "...%s", path + len - (max - 3));
}

static void default_name(ferry_policy *p, const char *path) {
  if (!path) {
    copy_str(p->name, sizeof p->name, "policy");
    return;
  }
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  copy_str(p->name, sizeof p->name, base);
  size_t l = strlen(p->name);
  if (l > 4 && !strcmp(p->name + l - 4, ".lua")) p->name[l - 4] = '\0';
}

int ferry_policy_create(const char *path, const char *source, int trusted, ferry_policy **out,
                        char *errbuf, size_t errlen) {
  char scratch_err[8];
  if (!errbuf || !errlen) {
    errbuf = scratch_err;
    errlen = sizeof scratch_err;
  }
  errbuf[0] = '\0';
  if (!out || (!path && !source)) {
    snprintf(errbuf, errlen, "ferry_policy_create: no path or source given");
    return FERRY_EINVAL;
  }
  *out = NULL;
  ferry_policy *p = calloc(1, sizeof *p);
  if (!p) {
    snprintf(errbuf, errlen, "out of memory creating a policy");
    return FERRY_ENOMEM;
  }
  p->trusted = trusted != 0;
  unsigned long long mem_mb, errors, decide_ms, load_ms;
  if (env_count("FERRY_POLICY_MEM_MB", DEFAULT_MEM_CAP >> 20, 4, 1 << 20, &mem_mb, errbuf, errlen) ||
      env_count("FERRY_POLICY_ERROR_BUDGET", DEFAULT_ERROR_BUDGET, 1, 1u << 30, &errors, errbuf,
                errlen) ||
      env_count("FERRY_POLICY_DECISION_MS", DEFAULT_DECIDE_MS, 1, 3600000, &decide_ms, errbuf,
                errlen) ||
      env_count("FERRY_POLICY_LOAD_MS", DEFAULT_LOAD_MS, 1, 3600000, &load_ms, errbuf, errlen)) {
    free(p);
    return FERRY_EINVAL;
  }
  p->mem_cap = (size_t)mem_mb << 20;
  p->error_budget = (unsigned)errors;
  p->decide_budget_ns = decide_ms * 1000000;
  p->load_budget_ns = load_ms * 1000000;
  const char *libdir = getenv("FERRY_POLICY_LIBDIR");
  char found[PATH_MAX] = "";
  if ((!libdir || !*libdir) && ferry_policy_libdir(found, sizeof found) == FERRY_OK) libdir = found;
  copy_str(p->libdir, sizeof p->libdir, libdir);
  chunk_display_name(p, path);
  default_name(p, path);
  p->cap_strings = 64;
  p->strings = calloc(p->cap_strings, sizeof *p->strings);
  p->by_content_mask = 127;
  p->by_content = calloc(p->by_content_mask + 1, sizeof *p->by_content);
  p->n_strings = STR_FIRST;

  char *file_src = NULL;
  size_t src_len = 0;
  int rc = FERRY_EPOLICY;
  if (path) {
    file_src = read_policy_file(path, &src_len, errbuf, errlen);
    if (!file_src) goto fail;
  } else {
    src_len = strlen(source);
  }
  const char *src = file_src ? file_src : source;

  p->reserve = malloc(POLICY_SETUP_RESERVE);
  p->reserve_open = 1;
  if (!p->strings || !p->by_content || !p->reserve ||
      !(p->L = lua_newstate(policy_alloc, p))) {
    snprintf(errbuf, errlen, "%s: out of memory creating its Lua state", p->chunk);
    rc = FERRY_ENOMEM;
    goto fail;
  }
  lua_State *L = p->L;
  lua_atpanic(L, policy_panic);
  if (lua_cpcall(L, setup_state, p) != 0) {
    snprintf(errbuf, errlen, "%s: cannot set up the policy sandbox: %s", p->chunk,
               lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
    goto fail;
  }

  /* No trace may exist before policy code runs: see the top of this file. */
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  p->hook_period = HOOK_PERIOD;
  lua_sethook(L, policy_hook, LUA_MASKCOUNT, HOOK_PERIOD);

  lua_settop(L, 0);
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.msgh"); /* 1 */
  /* A '#' first line (shebang) is skipped, as lua does; the newline stays so
   * line numbers match the file. */
  const char *code = src;
  if (code[0] == '#')
    while (*code && *code != '\n') code++;
  char chunkname[1100];
  if (path)
    snprintf(chunkname, sizeof chunkname, "@%s", path);
  else
    copy_str(chunkname, sizeof chunkname, "=policy");
  /* the parse allocates under the cap, which reads the clock every MiB:
   * against the load's deadline (a 2 MB string literal was refused as
   * over a decision's budget) */
  p->loading = 1;
  p->alloc_unchecked = 0;
  p->interrupt = INTERRUPT_NONE;
  p->deadline_ns = util_now_ns() + p->load_budget_ns;
  p->enforce_cap = 1;
  int status = luaL_loadbufferx(L, code, src_len - (size_t)(code - src), chunkname, "t");
  p->enforce_cap = 0;
  if (status) {
    take_fault(p, status, errbuf, errlen);
    goto fail;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.env");
  lua_setfenv(L, -2);
  status = run_protected(p, 0, 1, 1, 1);
  if (status) {
    take_fault(p, status, errbuf, errlen);
    goto fail;
  }
  if ((rc = validate_policy_table(p, src, errbuf, errlen))) goto fail;

  /* the permanent stack: see SLOT_* */
  lua_pushliteral(L, "decide");
  lua_rawget(L, 2); /* stack: msgh, table, decide */
  lua_remove(L, 2);
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.tensor");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.ctx");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.tensor_fields");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.ctx_fields");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.shape");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.strings");
  if (lua_gettop(L) != SLOT_COUNT_) {
    snprintf(errbuf, errlen, "%s: internal error laying out the policy state", p->chunk);
    goto fail;
  }
  lua_gc(L, LUA_GCCOLLECT, 0); /* start decide calls with the load garbage gone */
  p->reserve_open = 0;
  if (!p->reserve_used) {
    free(p->reserve);
    p->reserve = NULL;
  }
  free(file_src);
  *out = p;
  return FERRY_OK;

fail:
  free(file_src);
  ferry_policy_destroy(p);
  return rc;
}

void ferry_policy_destroy(ferry_policy *p) {
  if (!p) return;
  if (p->L) lua_close(p->L);
  free(p->reserve); /* after the state: its blocks may be in it */
  for (uint32_t i = STR_FIRST; i < p->n_strings; i++) free(p->strings[i].str);
  free(p->strings);
  free(p->by_content);
  free(p->sites);
  free(p->reason_sites);
  free(p->reasons);
  free(p);
}

const char *ferry_policy_name(const ferry_policy *p) { return p ? p->name : ""; }

void ferry_policy_get_knobs(const ferry_policy *p, ferry_policy_knobs *out) {
  if (!out) return;
  if (!p) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = p->knobs;
}

void ferry_policy_get_stats(const ferry_policy *p, ferry_policy_stats *out) {
  if (!out) return;
  if (!p) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = p->stats;
}

const char *ferry_policy_last_error(const ferry_policy *p) { return p ? p->last_error : ""; }

static int compare_names(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

typedef struct global_names {
  char *names[1024];
  size_t count;
} global_names;

/* lua_cpcall body: the names of the env and of its libraries, read raw (a
 * policy may have replaced `string` by anything, or removed it: `string =
 * nil` is a raw set of an existing global, which __newindex never sees). */
static int collect_globals(lua_State *L) {
  static const char *const LIBS[] = {"string", "table", "math", "os"};
  global_names *g = lua_touserdata(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.env");
  int env = lua_gettop(L);
  for (lua_pushnil(L); lua_next(L, env) && g->count < 1024; lua_pop(L, 1))
    if (lua_type(L, -2) == LUA_TSTRING) g->names[g->count++] = strdup(lua_tostring(L, -2));
  for (size_t i = 0; i < sizeof LIBS / sizeof LIBS[0]; i++) {
    lua_pushstring(L, LIBS[i]);
    lua_rawget(L, env);
    int lib = lua_gettop(L);
    if (lua_istable(L, lib))
      for (lua_pushnil(L); lua_next(L, lib) && g->count < 1024; lua_pop(L, 1))
        if (lua_type(L, -2) == LUA_TSTRING) {
          char full[128];
          snprintf(full, sizeof full, "%s.%s", LIBS[i], lua_tostring(L, -2));
          g->names[g->count++] = strdup(full);
        }
    lua_settop(L, env);
  }
  return 0;
}

size_t ferry_policy_globals(const ferry_policy *p, char *out, size_t n) {
  if (n) out[0] = '\0';
  if (!p || !p->L) return 0;
  lua_State *L = p->L;
  int top = lua_gettop(L);
  global_names g = {.count = 0};
  int status = lua_cpcall(L, collect_globals, &g);
  lua_settop(L, top); /* the error message, if any: the names so far are listed */
  (void)status;
  char **names = g.names;
  size_t count = g.count;
  qsort(names, count, sizeof names[0], compare_names);
  size_t len = 0;
  int truncated = 0;
  for (size_t i = 0; i < count; i++) {
    const char *name = names[i] ? names[i] : "?";
    size_t need = strlen(name) + (len ? 1 : 0);
    truncated = truncated || len + need >= n;
    if (!truncated) snprintf(out + len, n - len, "%s%s", len ? "," : "", name);
    len += need;
    free(names[i]);
  }
  return len;
}
