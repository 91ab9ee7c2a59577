/*
 * sandbox.c: the sandboxed LuaJIT state a policy runs in: allocator cap,
 * instruction-count and wall-clock hook, the C functions policies may call
 * (pcall, xpcall, bounded string patterns and table.sort, log, require,
 * t:path(), ctx:offloaded_in_layer()) and state setup from sandbox.lua. See docs/policy-api.md, "How the host works".
 */
#include "policy/policy_internal.h"
#include "util/log.h"

#include <pthread.h>

/* ---- small helpers ------------------------------------------------------ */
void copy_str(char *dst, size_t n, const char *src) {
  if (!n) return;
  snprintf(dst, n, "%s", src ? src : "");
}

/* A whole number from the environment variable `name` (dflt when unset or
 * empty), through the one strict parser: -1 with the variable, its value
 * and what was expected in err when it is not one in [lo, hi]. */
int env_count(const char *name, unsigned long long dflt, unsigned long long lo,
              unsigned long long hi, unsigned long long *out, char *err, size_t errlen) {
  const char *s = getenv(name);
  *out = dflt;
  if (!s || !*s) return 0;
  double v;
  if (ferry_parse_number(name, s, FERRY_NUMBER_COUNT, (double)lo, (double)hi, 0, &v, err,
                         errlen) != FERRY_OK)
    return -1;
  *out = (unsigned long long)v;
  return 0;
}

/* Free C stack below the caller's frame on this thread: its bounds are
 * looked up once per thread. A frame outside them (a fiber's own stack)
 * is not checked. */
static _Thread_local uintptr_t thread_stack_low, thread_stack_high;

size_t stack_left(void) {
  char here;
  uintptr_t sp = (uintptr_t)&here;
  if (!thread_stack_high) {
    pthread_attr_t attr;
    void *addr = NULL;
    size_t size = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      pthread_attr_getstack(&attr, &addr, &size);
      pthread_attr_destroy(&attr);
    }
    thread_stack_low = addr && size ? (uintptr_t)addr : 0;
    thread_stack_high = addr && size ? (uintptr_t)addr + size : UINTPTR_MAX;
  }
  if (sp <= thread_stack_low || sp >= thread_stack_high) return SIZE_MAX / 2;
  return sp - thread_stack_low;
}

/* "file:line" of the innermost Lua function at or above `level` with a line. */
#define SORT_CHUNK "(sort)" /* table.sort's default comparator: not policy code */
static void where(lua_State *L, int level, char *buf, size_t n) {
  lua_Debug ar;
  for (int lv = level; lv < level + 64 && lua_getstack(L, lv, &ar); lv++) {
    if (lua_getinfo(L, "Sl", &ar) && ar.currentline > 0 && strcmp(ar.short_src, SORT_CHUNK)) {
      snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
      return;
    }
  }
  buf[0] = '\0';
}

/* Does msg already start with "something:<digits>:"? */
int has_position(const char *msg) {
  const char *c = msg;
  while (*c && *c != ':' && *c != '\n') c++;
  if (*c != ':' || c == msg) return 0;
  const char *d = ++c;
  while (*d >= '0' && *d <= '9') d++;
  return d > c && *d == ':';
}

/* ---- allocator and hook ------------------------------------------------- */
static int in_reserve(const ferry_policy *p, const void *ptr) {
  return p->reserve && (const char *)ptr >= p->reserve &&
         (const char *)ptr < p->reserve + POLICY_SETUP_RESERVE;
}

/* nsize bytes of the reserve (16-aligned), NULL when it has no more. */
static void *reserve_take(ferry_policy *p, size_t nsize) {
  size_t at = (p->reserve_used + 15) & ~(size_t)15;
  /* (policy code runs capped and protected: its allocations may fail) */
  if (!p->reserve_open || p->enforce_cap || nsize > POLICY_SETUP_RESERVE - at) return NULL;
  p->reserve_used = at + nsize;
  return p->reserve + at;
}

/* realloc, else (while the state is made) the reserve; its blocks are never
 * given to free or realloc */
static void *alloc_or_reserve(ferry_policy *p, void *ptr, size_t old, size_t nsize) {
  void *q = in_reserve(p, ptr) ? malloc(nsize) : realloc(ptr, nsize);
  if (!q && (q = reserve_take(p, nsize)) && ptr) {
    memcpy(q, ptr, old < nsize ? old : nsize);
    if (!in_reserve(p, ptr)) free(ptr);
    return q;
  }
  if (q && ptr && in_reserve(p, ptr)) memcpy(q, ptr, old < nsize ? old : nsize);
  return q;
}

static void set_budget_interrupt(ferry_policy *p, int over_time);

/* Size class of a block of BIG_BLOCK bytes or more: 0 for [64, 128) KiB... */
static int size_class(size_t n) {
  int c = 0;
  for (n >>= BIG_BLOCK_SHIFT + 1; n && c < BIG_CLASSES - 1; n >>= 1) c++;
  return c;
}

/* The hook period while the largest live block is of class c (-1: none):
 * a block of class c is under 2^(c + 1) BIG_BLOCKs. */
static int period_of_class(int c) {
  int period = c < 0 ? HOOK_PERIOD : HOOK_PERIOD >> (c + 1);
  return period > 0 ? period : 1;
}

void *policy_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  ferry_policy *p = ud;
  size_t old = ptr ? osize : 0;
  if (nsize == 0) {
    if (!in_reserve(p, ptr)) free(ptr);
    p->mem_used -= old;
    if (old >> BIG_BLOCK_SHIFT) {
      p->big_live[size_class(old)]--;
      p->big_total--;
    }
    return NULL;
  }
  if (p->enforce_cap && nsize > old && p->mem_used + (nsize - old) > p->mem_cap) {
    if (!p->interrupt) {
      /* The VM keeps its stack consistent across allocations (the GC walks
       * it), so the position of the allocating code can be read here. */
      char pos[MSG_LEN];
      where(p->L, 0, pos, sizeof pos);
      p->interrupt = INTERRUPT_MEMORY;
      snprintf(p->interrupt_msg, sizeof p->interrupt_msg,
               "%.400s: policy memory limit of %zu MiB exceeded (allocation of %zu bytes refused)",
               pos[0] ? pos : p->running ? p->running : p->chunk, p->mem_cap >> 20, nsize);
    }
    return NULL;
  }
  if (p->enforce_cap && nsize > old) {
    /* Work that allocates (string.rep, .., table.concat...) reads the clock
     * every ALLOC_CHECK_BYTES: past the deadline, growth is refused. */
    p->alloc_unchecked += nsize - old;
    if (p->interrupt == INTERRUPT_BUDGET) return NULL;
    if (p->alloc_unchecked >= ALLOC_CHECK_BYTES) {
      p->alloc_unchecked = 0;
      if (!p->interrupt && util_now_ns() > p->deadline_ns) {
        set_budget_interrupt(p, 1);
        return NULL;
      }
    }
  }
  void *q = alloc_or_reserve(p, ptr, old, nsize);
  if (!q) return NULL;
  p->mem_used += nsize - old;
  if (old >> BIG_BLOCK_SHIFT) {
    p->big_live[size_class(old)]--;
    p->big_total--;
  }
  if (nsize >> BIG_BLOCK_SHIFT) {
    int c = size_class(nsize);
    p->big_live[c]++;
    p->big_total++;
    if (p->enforce_cap && period_of_class(c) < p->hook_period) set_hook_period(p, c);
  }
  return q;
}

void set_hook_period(ferry_policy *p, int min_class) {
  int c = min_class;
  for (int i = BIG_CLASSES - 1; p->big_total && i > c; i--)
    if (p->big_live[i]) c = i;
  int period = period_of_class(c);
  if (min_class >= 0 && period >= p->hook_period) return;
  if (period != p->hook_period) {
    p->hook_period = period;
    lua_sethook(p->L, policy_hook, LUA_MASKCOUNT, period);
  }
}

/* Records the budget interrupt, at the running Lua code's position. */
static void set_budget_interrupt(ferry_policy *p, int over_time) {
  char pos[MSG_LEN];
  where(p->L, 0, pos, sizeof pos);
  p->interrupt = INTERRUPT_BUDGET;
  const char *at = pos[0] ? pos : p->running ? p->running : p->chunk;
  if (over_time)
    snprintf(p->interrupt_msg, sizeof p->interrupt_msg,
             "%.400s: interrupted after %" PRIu64 " ms, the wall-clock budget of %s", at,
             (p->loading ? p->load_budget_ns : p->decide_budget_ns) / 1000000,
             p->loading ? "a policy load (FERRY_POLICY_LOAD_MS)"
                        : "a decision (FERRY_POLICY_DECISION_MS)");
  else
    snprintf(p->interrupt_msg, sizeof p->interrupt_msg,
             "%.400s: interrupted after %" PRIu64 " VM instructions (runaway loop?)", at,
             p->tick_budget);
}

static int raise_interrupt(lua_State *L, ferry_policy *p) {
  /* Once interrupted, every hook raises again until the call is over. */
  p->enforce_cap = 0;
  lua_pushstring(L, p->interrupt_msg);
  return lua_error(L);
}

void policy_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  ferry_policy *p = policy_of(L);
  int over_time = 0;
  if (!p->interrupt && (p->ticks += (uint64_t)p->hook_period) <= p->tick_budget &&
      !(over_time = util_now_ns() > p->deadline_ns))
    return;
  if (!p->interrupt) set_budget_interrupt(p, over_time);
  raise_interrupt(L, p);
}

/* A sandbox C function is about to do about ns of work the hook cannot
 * see: read the clock once such work adds up to WORK_CHECK_NS. */
void charge_work(lua_State *L, ferry_policy *p, double ns) {
  if (p->interrupt) raise_interrupt(L, p);
  p->work_ns += ns;
  if (p->work_ns < WORK_CHECK_NS) return;
  p->work_ns = 0;
  if (util_now_ns() > p->deadline_ns) {
    set_budget_interrupt(p, 1);
    raise_interrupt(L, p);
  }
}

/* Error handler of every protected call into policy code: give the message
 * a "file:line:" prefix when it has none. */
static int policy_msgh(lua_State *L) {
  ferry_policy *p = policy_of(L);
  p->enforce_cap = 0;
  if (p->interrupt) {
    lua_pushstring(L, p->interrupt_msg);
    return 1;
  }
  char pos[MSG_LEN];
  const char *msg = lua_type(L, 1) == LUA_TSTRING || lua_type(L, 1) == LUA_TNUMBER
                        ? lua_tostring(L, 1) : NULL;
  /* an error of the default comparator (comparing a number with a string)
   * is the calling policy line's, as it was when sort compared in C */
  if (msg && !strncmp(msg, SORT_CHUNK ":1: ", sizeof SORT_CHUNK + 3))
    msg += sizeof SORT_CHUNK + 3;
  else if (msg && has_position(msg)) {
    lua_settop(L, 1);
    return 1;
  }
  where(L, 1, pos, sizeof pos);
  if (msg)
    lua_pushfstring(L, "%s: %s", pos[0] ? pos : p->chunk, msg);
  else
    lua_pushfstring(L, "%s: error object is a %s value", pos[0] ? pos : p->chunk,
                    luaL_typename(L, 1));
  return 1;
}

/* ---- sandbox functions -------------------------------------------------- */
/* Every sandbox C function that calls back into Lua from C is a level:
 * the levels are counted, and each needs NESTING_STACK_RESERVE of free C
 * stack (a level of gsub alone holds an 8 KiB buffer). */
int enter_nested(lua_State *L, ferry_policy *p, const char *what) {
  if (p->c_nesting >= MAX_C_NESTING)
    return luaL_error(L, "%s nested too deeply (limit %d)", what, MAX_C_NESTING);
  size_t left = stack_left();
  if (left < NESTING_STACK_RESERVE)
    return luaL_error(L, "%s nested too deeply for this thread's C stack (%d KiB left, each "
                      "level needs %d KiB)", what, (int)(left >> 10),
                      (int)(NESTING_STACK_RESERVE >> 10));
  p->c_nesting++;
  return 0;
}

/* pcall/xpcall for policies: like Lua's, except that an interrupt (budget or
 * memory) is raised again instead of being caught. */
static int finish_pcall(lua_State *L, ferry_policy *p, int status, int nesting, int base) {
  p->c_nesting = nesting;
  if (status != 0 && p->interrupt) return lua_error(L); /* error object on top */
  lua_pushboolean(L, status == 0);
  lua_insert(L, base);
  return lua_gettop(L) - base + 1;
}

static int sandbox_pcall(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checkany(L, 1);
  int nesting = p->c_nesting;
  enter_nested(L, p, "pcall");
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  return finish_pcall(L, p, status, nesting, 1);
}

/* The handler xpcall installs: the policy's handler, except during an
 * interrupt (LuaJIT calls the handler again for an error raised inside it,
 * so a looping handler would otherwise be re-entered without end). */
static int xpcall_handler(lua_State *L) {
  ferry_policy *p = policy_of(L);
  if (p->interrupt) return 1; /* the error object, unchanged */
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  return 1;
}

static int sandbox_xpcall(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checkany(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  int nesting = p->c_nesting;
  enter_nested(L, p, "xpcall");
  /* stack: f, handler, args... -> wrapped handler, f, args... */
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 2);
  lua_pushcclosure(L, xpcall_handler, 1);
  lua_replace(L, 1);
  lua_replace(L, 2);
  int status = lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 1);
  lua_remove(L, 1); /* the handler */
  return finish_pcall(L, p, status, nesting, 1);
}

/* ---- bounded C functions ------------------------------------------------ */
/* The count hook cannot fire inside a C function. Work linear in a string
 * or table is bounded by the memory cap and the hook's shorter period while
 * big blocks live (policy_alloc); Lua's pattern matcher backtracks
 * (string.find(string.rep("a", 3000), string.rep("a*", 12) .. "b") never
 * returns), so each call is estimated up front, refused above
 * C_CALL_MAX_NS and charged; table.sort compares through Lua code. See
 * docs/policy-api.md, "Limits". */
enum { PAT_FIND, PAT_MATCH, PAT_GMATCH, PAT_GSUB };
static const char *const PAT_NAMES[] = {"find", "match", "gmatch", "gsub"};

/* One item of a pattern, as the matcher reads it. */
#define ITEM_STEP_FACTOR 8
typedef struct pattern_item {
  size_t next;  /* index of the next item */
  double cost;  /* matcher steps of one test at one position, in a scan */
  char rep;     /* '*', '+', '-', '?' or 0 */
  int scans;    /* %b or %1-%9: up to the subject's length per test */
  int can_fail; /* else it always matches: captures, x*, x-, x? */
} pattern_item;

static pattern_item read_item(const char *pat, size_t plen, size_t i) {
  pattern_item it = {0, 1, 0, 0, 1};
  size_t item = i;
  char c = pat[i++];
  if (c == '(' || c == ')') {
    it.can_fail = 0;
    it.cost = 1.0 / ITEM_STEP_FACTOR; /* no test: a capture's bounds */
  } else if (c == '%' && i < plen && (pat[i] == 'b' || (pat[i] >= '0' && pat[i] <= '9'))) {
    it.scans = 1;
    i += pat[i] == 'b' ? 3 : 1;
  } else {
    int frontier = c == '%' && i < plen && pat[i] == 'f';
    if (frontier) i++;
    if (c == '%' && !frontier && i < plen) {
      if (isalpha((unsigned char)pat[i])) it.cost = 2; /* a class: a ctype call */
      i++;
    }
    if (frontier ? i < plen && pat[i] == '[' : c == '[') {
      if (frontier) i++;
      if (i < plen && pat[i] == '^') i++;
      do { /* a set is scanned whole at each test */
        if (i < plen && pat[i] == '%') i++;
        i++;
      } while (i < plen && pat[i] != ']');
      i++;
      it.cost = 1 + (double)(i - item);
    }
    if (!frontier && i < plen && strchr("*+-?", pat[i])) {
      it.rep = pat[i++];
      it.can_fail = it.rep == '+';
    }
  }
  it.next = i < plen ? i : plen;
  return it;
}

/* An upper bound of the matcher's steps (one item tested at one subject
 * position) for pattern pat on a subject of n bytes. From each start
 * position, an item is entered at most once per way the repeated items
 * before it can split the subject: C(n + q, q) for q items x*, x+, x-,
 * times 2 per x?; a repeated item then scans up to n + 1 positions, %b
 * and %1-%9 up to n + 1 bytes. A test in a scan costs 1 step, 2 for a
 * class (%a), 1 + its length for a set; a test of an item on its own
 * ITEM_STEP_FACTOR times that (the matcher's loop around it: measured, as
 * the step's cost, by bench/bench_policy_bounds.c). The items after the last one that can fail (captures, x*, x-, x?)
 * are entered once: entering them is a match. Every item counts, so a long
 * pattern of single characters costs its length per start. */
static double pattern_steps(const char *pat, size_t plen, size_t n, int can_anchor) {
  size_t first = can_anchor && plen && pat[0] == '^' ? 1 : 0, sure = first;
  for (size_t i = first; i < plen;) {
    pattern_item it = read_item(pat, plen, i);
    int dollar = pat[i] == '$' && it.next == plen;
    if (it.can_fail || dollar) sure = it.next;
    i = it.next;
  }
  double span = (double)n + 1, ways = 1, q = 0, per_start = 1; /* 1: the end */
  for (size_t i = first; i < plen;) {
    pattern_item it = read_item(pat, plen, i);
    int scan = it.scans || it.rep == '*' || it.rep == '+' || it.rep == '-';
    double w = i < sure ? ways : 1;
    per_start += w * (scan ? span * it.cost : ITEM_STEP_FACTOR * it.cost);
    if (i < sure && it.rep == '?') ways *= 2;
    else if (i < sure && it.rep) {
      q++;
      ways = ways * ((double)n + q) / q;
    }
    i = it.next;
  }
  return (first ? 1 : span) * per_start;
}

static int is_plain(const char *pat, size_t plen) {
  for (size_t i = 0; i < plen; i++)
    if (strchr("^$*+?.([%-", pat[i])) return 0;
  return 1;
}

/* string.find/match/gmatch/gsub: the real function (upvalue 1) after the
 * bound check; gsub also counts as a nesting level (its replacement
 * function calls back into Lua). */
static int sandbox_pattern(lua_State *L) {
  ferry_policy *p = policy_of(L);
  int kind = (int)lua_tointeger(L, lua_upvalueindex(2));
  size_t slen, plen;
  luaL_checklstring(L, 1, &slen);
  const char *pat = luaL_checklstring(L, 2, &plen);
  int plain = (kind == PAT_FIND && lua_toboolean(L, 4)) || is_plain(pat, plen);
  /* plain: lj_str_find compares up to the pattern's length at each position */
  double steps = plain ? (double)slen * (double)(plen ? plen : 1)
                       : pattern_steps(pat, plen, slen, kind != PAT_GMATCH);
  if (kind == PAT_GSUB && !plain) steps *= 1.25; /* its loop also copies to a buffer */
  double ns = steps * (plain ? PLAIN_NS_PER_BYTE : PATTERN_NS_PER_STEP);
  if (ns > C_CALL_MAX_NS) {
    char msg[MSG_LEN]; /* lua_pushfstring has no %g */
    snprintf(msg, sizeof msg,
             "string.%s: pattern '%.60s%s' is too costly for a %zu-byte subject (up to %.2g "
             "%s, the limit is %.2g): %s",
             PAT_NAMES[kind], pat, plen > 60 ? "..." : "", slen, steps,
             plain ? "byte comparisons" : "matcher steps",
             C_CALL_MAX_NS / (plain ? PLAIN_NS_PER_BYTE : PATTERN_NS_PER_STEP),
             plain ? "search a shorter string or for a shorter one"
                   : "anchor it with '^', match a shorter string or use a shorter pattern "
                     "with fewer repetitions (*, +, -, ?)");
    return luaL_error(L, "%s", msg);
  }
  /* gsub calls a replacement function or a table's __index from C */
  if (kind == PAT_GSUB && lua_type(L, 3) == LUA_TFUNCTION && lua_iscfunction(L, 3))
    return luaL_error(L, "string.gsub: the replacement must be a string, a table or a Lua "
                         "function, not a C function");
  /* Every match of gsub stores its replacement: a table lookup or a
   * string read, in C (gsub('', {}) on 6 MB took 466 ms in one call). A
   * string replacement's %0-%9 of empty captures add nothing to the
   * result, so no allocation reads the clock (("%1"):rep(4e6) over 1,000
   * empty matches ran for minutes). A function's calls are Lua code. */
  if (kind == PAT_GSUB && lua_type(L, 3) != LUA_TFUNCTION) {
    size_t rlen = 0, escapes = 0;
    const char *repl = lua_type(L, 3) == LUA_TSTRING ? lua_tolstring(L, 3, &rlen) : "";
    for (size_t i = 0; i + 1 < rlen; i++)
      if (repl[i] == '%') escapes++, i++;
    double matches = (double)slen + 1;
    if (lua_type(L, 4) == LUA_TNUMBER && lua_tonumber(L, 4) < matches)
      matches = lua_tonumber(L, 4) > 0 ? lua_tonumber(L, 4) : 0;
    double per_match = (double)escapes * GSUB_ESCAPE_NS +
                       (lua_type(L, 3) == LUA_TTABLE ? GSUB_TABLE_MATCH_NS : GSUB_STRING_MATCH_NS);
    double repl_ns = matches * per_match;
    if (repl_ns > C_CALL_MAX_NS)
      return luaL_error(L, "string.gsub: a %s replacement with %d escapes (%%0-%%9, %%%%) for "
                           "up to %f matches is too costly (about %f ms, the limit is %f): "
                           "match a shorter subject, pass gsub's 4th argument or use fewer "
                           "escapes", luaL_typename(L, 3), (int)escapes, (lua_Number)matches,
                        (lua_Number)(repl_ns / 1e6), (lua_Number)(C_CALL_MAX_NS / 1e6));
    ns += repl_ns;
  }
  charge_work(L, p, ns);
  int nesting = p->c_nesting;
  if (kind == PAT_GSUB) enter_nested(L, p, "string.gsub");
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  p->c_nesting = nesting;
  return lua_gettop(L);
}

/* table.sort: every comparison runs Lua code the hook sees: the policy's
 * comparator, which must be a Lua function (a C one, string.find say,
 * would compare in C for as long as it likes), or else the Lua function
 * `a < b` (upvalue 2), which also bounds Lua 5.1's quadratic worst case.
 * A sort is a nesting level (the comparator can sort again). */
static int sandbox_sort(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checktype(L, 1, LUA_TTABLE);
  size_t n = lua_objlen(L, 1);
  if (n > SORT_MAX_ITEMS)
    return luaL_error(L, "table.sort: %d items, more than the limit of %d", (int)n,
                      SORT_MAX_ITEMS);
  if (lua_isnoneornil(L, 2)) {
    lua_settop(L, 1);
    lua_pushvalue(L, lua_upvalueindex(2));
  } else if (lua_type(L, 2) != LUA_TFUNCTION || lua_iscfunction(L, 2)) {
    return luaL_error(L, "table.sort: the comparator must be a Lua function, got %s",
                      lua_iscfunction(L, 2) ? "a C function" : luaL_typename(L, 2));
  }
  lua_settop(L, 2);
  int nesting = p->c_nesting;
  enter_nested(L, p, "table.sort");
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, 2, 0);
  p->c_nesting = nesting;
  return 0;
}

/* ferry.forget_cached(): every cached answer is dropped when the running
 * call returns (a policy whose earlier answers no longer hold). */
static int sandbox_forget_cached(lua_State *L) {
  policy_of(L)->forget = 1;
  return 0;
}

static int sandbox_log(lua_State *L) {
  ferry_policy *p = policy_of(L);
  size_t len;
  const char *msg = luaL_checklstring(L, 1, &len);
  if (p->log_lines < MAX_LOG_LINES)
    util_log(FERRY_LOG_INFO, "policy %s: %.*s", p->name, (int)(len < 900 ? len : 900), msg);
  else if (p->log_lines == MAX_LOG_LINES)
    util_log(FERRY_LOG_WARNING, "policy %s: more than %d log lines, the rest are dropped",
             p->name, MAX_LOG_LINES);
  p->log_lines++;
  return 0;
}

static int tensor_path(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(2));
  lua_rawgeti(L, lua_upvalueindex(1), (int)p->cur_path_id);
  return 1;
}

static int tensor_class(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(2));
  lua_rawgeti(L, lua_upvalueindex(1), (int)p->cur_class_id);
  return 1;
}

/* ctx.host_ram_used_pct: the value the caller's ctx carries, else (NaN: the
 * engine did not sample it) sampled here once per step. */
static int ctx_host_ram_used_pct(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(1));
  const ferry_context *c = p->cur_ctx;
  double v = c ? c->host_ram_used_pct : 0;
  p->reads_ram = 1;
  if (isnan(v)) {
    uint64_t step = c ? c->step : p->step;
    if (p->ram_step != step || isnan(p->ram_pct)) {
      uint64_t total = 0, avail = 0;
      p->ram_pct = p->host_ram && !p->host_ram(p->host_ram_ud, &total, &avail) && total &&
                           avail <= total
                       ? 100.0 * (double)(total - avail) / (double)total
                       : 0;
      p->ram_step = step;
    }
    v = p->ram_pct;
  }
  lua_pushnumber(L, v);
  return 1;
}

void ferry_policy_set_host_ram(ferry_policy *p, ferry_host_ram_fn fn, void *ud) {
  if (!p) return;
  p->host_ram = fn;
  p->host_ram_ud = ud;
  p->ram_pct = NAN;
}

int ferry_policy_reads_host_ram(const ferry_policy *p) { return p && p->reads_ram; }

static int ctx_offloaded_in_layer(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(1));
  lua_Number i = luaL_checknumber(L, 2);
  const ferry_context *c = p->cur_ctx;
  double n = 0;
  if (c && c->offloaded_per_layer && i >= 0 && i < (lua_Number)c->layers_tracked &&
      i == floor(i))
    n = c->offloaded_per_layer[(uint32_t)i];
  lua_pushnumber(L, n);
  return 1;
}

/* The second argument a module of ferry's own gets (ferry.rules records
 * with it where each rule was written, for ferry_policy_explain): the
 * "file:line" of the innermost Lua code outside the calling module's file,
 * i.e. the line of the policy that called into the module; nil if none
 * (`return R.policy {...}` is a tail call: its caller's frame is gone). */
static int module_caller_where(lua_State *L) {
  lua_Debug ar;
  if (!lua_getstack(L, 1, &ar) || !lua_getinfo(L, "S", &ar)) {
    lua_pushnil(L);
    return 1;
  }
  const char *self = ar.source; /* the module's chunk name, kept alive by its code */
  for (int lv = 2; lv < 256 && lua_getstack(L, lv, &ar); lv++) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0 || !strcmp(ar.source, self)) continue;
    lua_pushfstring(L, "%s:%d", ar.short_src, ar.currentline);
    return 1;
  }
  lua_pushnil(L);
  return 1;
}

/* The third argument a module of ferry's own gets: { t, t_fields, ctx,
 * ctx_fields }, the views decide is given and the tables they read from
 * (ferry.rules's own tests read fields there: no metamethod per read). */
static void push_views(lua_State *L) {
  static const char *const keys[][2] = {{"t", "ferry.tensor"},
                                         {"t_fields", "ferry.tensor_fields"},
                                         {"ctx", "ferry.ctx"},
                                         {"ctx_fields", "ferry.ctx_fields"}};
  lua_createtable(L, 0, 4);
  for (int i = 0; i < 4; i++) {
    lua_getfield(L, LUA_REGISTRYINDEX, keys[i][1]);
    lua_setfield(L, -2, keys[i][0]);
  }
}

/* require, limited to ferry's own modules under the policy library dir
 * (and "ffi" for trusted policies). upvalues: loaded table, sandbox env. */
static int sandbox_require(lua_State *L) {
  ferry_policy *p = policy_of(L);
  size_t len;
  const char *name = luaL_checklstring(L, 1, &len);
  lua_settop(L, 1);
  lua_getfield(L, lua_upvalueindex(1), name); /* stack: name, loaded[name] */
  if (lua_toboolean(L, -1)) {
    if (lua_islightuserdata(L, -1))
      return luaL_error(L, "module '%s' requires itself (a require loop)", name);
    return 1;
  }
  lua_pop(L, 1);
  if (!strcmp(name, "ffi")) {
    if (!p->trusted) return luaL_error(L, "module 'ffi' is only available to trusted policies");
    lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
    lua_getfield(L, -1, "ffi");
    return 1;
  }
  int valid = len > 0 && len < 200 && name[0] != '.' && name[len - 1] != '.';
  for (size_t i = 0; valid && i < len; i++) {
    char c = name[i];
    valid = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '_' || (c == '.' && name[i + 1] != '.');
  }
  if (!valid) return luaL_error(L, "module name '%s' is not valid (use names like ferry.rules)", name);
  if (!p->libdir[0])
    return luaL_error(L, "module '%s' not found: ferry's policy library dir is not set "
                         "(FERRY_POLICY_LIBDIR)", name);
  char file[1400];
  int n = snprintf(file, sizeof file, "%s/", p->libdir);
  for (size_t i = 0; i < len && n < (int)sizeof file - 5; i++) file[n++] = name[i] == '.' ? '/' : name[i];
  snprintf(file + n, sizeof file - (size_t)n, ".lua");
  FILE *f = fopen(file, "rb");
  if (!f)
    return luaL_error(L, "module '%s' not found (policies may only require ferry's modules, "
                         "from %s)", name, p->libdir);
  fclose(f);
  if (luaL_loadfilex(L, file, "t") != 0) return lua_error(L); /* message has file:line */
  lua_pushvalue(L, lua_upvalueindex(2));
  lua_setfenv(L, -2);
  lua_pushlightuserdata(L, p); /* mark as loading, to catch loops */
  lua_setfield(L, lua_upvalueindex(1), name);
  lua_pushvalue(L, 1);
  lua_pushcfunction(L, module_caller_where);
  push_views(L);
  lua_call(L, 3, 1); /* stack: name, result */
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_pushboolean(L, 1);
  }
  lua_pushvalue(L, -1);
  lua_setfield(L, lua_upvalueindex(1), name);
  return 1;
}

/* ---- state setup -------------------------------------------------------- */
/* SANDBOX_LUA (policy/sandbox.lua, embedded at build time) runs once per state
 * with the full standard library, before any policy code, in a private
 * environment. Fills the sandbox env passed in. */
#include "policy/sandbox_lua.h"

typedef struct {
  const char *name;
  int value;
} named_const;

static const named_const FERRY_CONSTANTS[] = {
    {"API_VERSION", FERRY_POLICY_API_VERSION},
    {"KEEP", FERRY_KEEP},
    {"OFFLOAD", FERRY_OFFLOAD},
    {"ON_USE", FERRY_RELOAD_ON_USE},
    {"PREFETCH", FERRY_RELOAD_PREFETCH},
    {"ACTIVATION", FERRY_KIND_ACTIVATION},
    {"PARAMETER", FERRY_KIND_PARAMETER},
    {"BUFFER", FERRY_KIND_BUFFER},
    {"OTHER", FERRY_KIND_OTHER},
    {"FORWARD", FERRY_PHASE_FORWARD},
    {"RECOMPUTE", FERRY_PHASE_RECOMPUTE},
    {"BACKWARD", FERRY_PHASE_BACKWARD},
    {"VIEW", FERRY_FLAG_VIEW},
    {"CONTIGUOUS", FERRY_FLAG_CONTIGUOUS},
    {"RESIZABLE", FERRY_FLAG_RESIZABLE},
};

/* The dtypes, from the one dtype table in ferry.h; given to policies under
 * both spellings: ferry.BF16 and ferry.DTYPE_BF16. */
#define DTYPE_CONSTANT_(e, name, bytes, torch, np) {#e, FERRY_DTYPE_##e},
static const named_const DTYPE_CONSTANTS[] = {
    {"UNKNOWN", FERRY_DTYPE_UNKNOWN},
    FERRY_DTYPE_LIST(DTYPE_CONSTANT_)
};
#undef DTYPE_CONSTANT_

static void set_cfunc(lua_State *L, int table, const char *name, lua_CFunction f, int nup) {
  /* the nup upvalues are on top of the stack */
  lua_pushcclosure(L, f, nup);
  lua_setfield(L, table, name);
}

/* Pushes the ffi library (luaL_openlibs only preloads it); kept in
 * _LOADED.ffi for trusted policies' require. */
static void push_ffi(lua_State *L) {
  lua_pushcfunction(L, luaopen_ffi);
  lua_pushliteral(L, LUA_FFILIBNAME);
  lua_call(L, 1, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
  lua_pushvalue(L, -2);
  lua_setfield(L, -2, LUA_FFILIBNAME);
  lua_pop(L, 1);
}

/* Pushes the table sandbox.lua makes `ferry` of: the constants. */
static void push_constants(lua_State *L) {
  lua_newtable(L);     /* arg F */
  int F = lua_gettop(L);
  for (size_t i = 0; i < sizeof FERRY_CONSTANTS / sizeof FERRY_CONSTANTS[0]; i++) {
    lua_pushinteger(L, FERRY_CONSTANTS[i].value);
    lua_setfield(L, F, FERRY_CONSTANTS[i].name);
  }
  for (size_t i = 0; i < sizeof DTYPE_CONSTANTS / sizeof DTYPE_CONSTANTS[0]; i++) {
    lua_pushinteger(L, DTYPE_CONSTANTS[i].value);
    lua_setfield(L, F, DTYPE_CONSTANTS[i].name);
    lua_pushinteger(L, DTYPE_CONSTANTS[i].value);
    lua_pushfstring(L, "DTYPE_%s", DTYPE_CONSTANTS[i].name);
    lua_insert(L, -2);
    lua_settable(L, F);
  }
}

/* Pushes the C functions sandbox.lua hands to policies; stack slots 1
 * (strings), 2 (env) and 3 (loaded modules) are their upvalues. */
static void push_c_functions(lua_State *L, ferry_policy *p) {
  lua_newtable(L); /* arg C */
  int C = lua_gettop(L);
  lua_pushvalue(L, 1);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "path", tensor_path, 2);
  lua_pushvalue(L, 1);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "class", tensor_class, 2);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "offloaded_in_layer", ctx_offloaded_in_layer, 1);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "host_ram_used_pct", ctx_host_ram_used_pct, 1);
  set_cfunc(L, C, "pcall", sandbox_pcall, 0);
  set_cfunc(L, C, "xpcall", sandbox_xpcall, 0);
  set_cfunc(L, C, "log", sandbox_log, 0);
  set_cfunc(L, C, "forget_cached", sandbox_forget_cached, 0);
  for (int kind = PAT_FIND; kind <= PAT_GSUB; kind++) {
    lua_getglobal(L, "string");
    lua_getfield(L, -1, PAT_NAMES[kind]);
    lua_remove(L, -2);
    lua_pushinteger(L, kind);
    set_cfunc(L, C, PAT_NAMES[kind], sandbox_pattern, 2);
  }
  lua_getglobal(L, "table");
  lua_getfield(L, -1, "sort");
  lua_remove(L, -2);
  static const char LESS[] = "local a, b = ... return a < b";
  luaL_loadbuffer(L, LESS, sizeof LESS - 1, "=" SORT_CHUNK);
  set_cfunc(L, C, "sort", sandbox_sort, 2);
  push_bounded_functions(L, C);
  lua_pushvalue(L, 3);
  lua_pushvalue(L, 2);
  set_cfunc(L, C, "require", sandbox_require, 2);
}

/* lua_cpcall body: open the libraries, build the sandbox. Leaves in the
 * registry: ferry.msgh, ferry.env, ferry.tensor, ferry.tensor_fields,
 * ferry.ctx, ferry.ctx_fields, ferry.shape, ferry.strings. */
int setup_state(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, 1);
  lua_settop(L, 0);
  luaL_openlibs(L);

  lua_newtable(L); /* 1: strings, id -> Lua string */
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_EMPTY);
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_SCRATCH_PATH);
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_SCRATCH_CLASS);
  lua_newtable(L); /* 2: sandbox env */
  lua_newtable(L); /* 3: loaded modules */

  if (luaL_loadbuffer(L, SANDBOX_LUA, sizeof SANDBOX_LUA - 1, "@sandbox.lua") != 0) return lua_error(L);
  /* 4: bootstrap */
  push_ffi(L);
  lua_pushvalue(L, 2); /* arg env */
  push_constants(L);
  push_c_functions(L, p);
  lua_pushboolean(L, p->trusted);
  /* stack: strings, env, loaded, tensor, its fields, ctx, its fields, shape */
  lua_call(L, 5, 5);

  p->tensor_seen_valid = p->ctx_seen_valid = 0;
  p->ram_pct = NAN;
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.shape");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.ctx_fields");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.ctx");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.tensor_fields");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.tensor");
  lua_pop(L, 1); /* loaded lives on as an upvalue of require */
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.env");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.strings");
  lua_pushcfunction(L, policy_msgh);
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.msgh");
  return 0;
}

int policy_panic(lua_State *L) {
  fprintf(stderr, "ferry: unrecoverable error in a policy's Lua state: %s\n",
          lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
  abort();
}


const char *describe_value(lua_State *L, int idx, char *buf, size_t n) {
  switch (lua_type(L, idx)) {
  case LUA_TNUMBER:
    if (isnan(lua_tonumber(L, idx)))
      snprintf(buf, n, "nan");
    else
      snprintf(buf, n, "%.17g", lua_tonumber(L, idx));
    break;
  case LUA_TSTRING:
    snprintf(buf, n, "string \"%.40s\"", lua_tostring(L, idx));
    break;
  case LUA_TBOOLEAN:
    snprintf(buf, n, "%s", lua_toboolean(L, idx) ? "true" : "false");
    break;
  default:
    snprintf(buf, n, "%s", luaL_typename(L, idx));
  }
  return buf;
}

/* After a failed run: the message ("file:line: ..."), then recover memory. */
void take_fault(ferry_policy *p, int status, char *out, size_t n) {
  lua_State *L = p->L;
  if (p->interrupt)
    copy_str(out, n, p->interrupt_msg);
  else if (status == LUA_ERRMEM)
    snprintf(out, n, "%s: out of memory", p->chunk);
  else if (lua_type(L, -1) == LUA_TSTRING && has_position(lua_tostring(L, -1)))
    copy_str(out, n, lua_tostring(L, -1));
  else if (lua_type(L, -1) == LUA_TSTRING) /* e.g. from the loader */
    snprintf(out, n, "%s: %s", p->chunk, lua_tostring(L, -1));
  else
    snprintf(out, n, "%s: error object is a %s value", p->chunk, luaL_typename(L, -1));
  lua_pop(L, 1);
  if (p->interrupt == INTERRUPT_MEMORY || status == LUA_ERRMEM) lua_gc(L, LUA_GCCOLLECT, 0);
  p->interrupt = INTERRUPT_NONE;
}
