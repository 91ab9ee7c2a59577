/*
 * bounded.c: the sandbox's versions of the library C functions that would
 * otherwise run unbounded inside one call, where the instruction hook never
 * fires: tostring and string.format (they call __tostring from C: counted
 * as nesting levels, so __tostring = tostring is an error, not an endless
 * loop), table.insert (its position checked against [1, #t + 1]: LuaJIT
 * shifts elements from any position, 2^31 of them for -2^31), table.insert
 * and table.concat on long tables (their work charged every TABLE_CHUNK
 * elements, so the clock is read within one: a 2M-element concat is about
 * 40 ms in one C call) and os.time (it reads a table's fields through
 * __index, from C). See docs/policy-api.md, "Limits".
 */
#include "policy/policy_internal.h"

/* tostring(v): __tostring called from C as a nesting level (LuaJIT's own
 * tail-calls it, so __tostring = tostring loops with no VM instruction);
 * without one, LuaJIT's (upvalue 1), which then calls nothing. */
static int sandbox_tostring(lua_State *L) {
  luaL_checkany(L, 1);
  lua_settop(L, 1);
  if (luaL_getmetafield(L, 1, "__tostring")) {
    ferry_policy *p = policy_of(L);
    int nesting = p->c_nesting;
    enter_nested(L, p, "tostring");
    lua_insert(L, 1);
    lua_call(L, 1, 1);
    p->c_nesting = nesting;
    return 1;
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, 1, 1);
  return 1;
}

/* The index of the argument each conversion of fmt takes, as LuaJIT's
 * lj_strfmt_parse reads it (flags, up to 2 digits of width, '.', up to 2
 * of precision, the conversion); calls each(L, arg) for every %s and %q
 * (LuaJIT's %q also converts through __tostring, from C). */
static void for_each_string_arg(lua_State *L, const char *fmt, size_t len,
                                void (*each)(lua_State *, int)) {
  int arg = 1;
  for (size_t i = 0; i < len; i++) {
    if (fmt[i] != '%') continue;
    if (i + 1 < len && fmt[i + 1] == '%') {
      i++;
      continue;
    }
    i++;
    while (i < len && strchr("-+0 #", fmt[i])) i++;
    for (int d = 0; d < 2 && i < len && fmt[i] >= '0' && fmt[i] <= '9'; d++) i++;
    if (i < len && fmt[i] == '.') {
      i++;
      for (int d = 0; d < 2 && i < len && fmt[i] >= '0' && fmt[i] <= '9'; d++) i++;
    }
    if (i >= len) return; /* the real format reports it */
    arg++;
    if (fmt[i] == 's' || fmt[i] == 'q') each(L, arg);
  }
}

/* A %s or %q argument with __tostring becomes its string here, through the
 * sandbox's tostring: LuaJIT's format would call __tostring from C
 * (uncounted nesting) and again on a result that still has one. */
static void stringify_arg(lua_State *L, int arg) {
  if (arg > lua_gettop(L) || lua_type(L, arg) == LUA_TSTRING ||
      lua_type(L, arg) == LUA_TNUMBER || !luaL_getmetafield(L, arg, "__tostring"))
    return;
  lua_pop(L, 1);
  lua_pushvalue(L, lua_upvalueindex(2)); /* sandbox tostring */
  lua_pushvalue(L, arg);
  lua_call(L, 1, 1);
  if (lua_type(L, -1) != LUA_TSTRING && lua_type(L, -1) != LUA_TNUMBER)
    luaL_error(L, "bad argument #%d to 'format' ('__tostring' must return a string, got %s)",
               arg, luaL_typename(L, -1));
  lua_replace(L, arg);
}

static int sandbox_format(lua_State *L) {
  size_t len;
  const char *fmt = luaL_checklstring(L, 1, &len);
  for_each_string_arg(L, fmt, len, stringify_arg);
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  return 1;
}

/* table.insert(t, [pos,] v), with pos in [1, #t + 1] as in Lua 5.3. */
static int sandbox_insert(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int nargs = lua_gettop(L);
  if (nargs != 2 && nargs != 3) return luaL_error(L, "wrong number of arguments to 'insert'");
  lua_Integer end = (lua_Integer)lua_objlen(L, 1) + 1, pos = end;
  if (nargs == 3) {
    pos = luaL_checkinteger(L, 2);
    if (pos < 1 || pos > end)
      return luaL_error(L, "bad argument #2 to 'insert' (position %f out of bounds [1, %f])",
                        (lua_Number)pos, (lua_Number)end);
    ferry_policy *p = policy_of(L);
    for (lua_Integer i = end; i > pos; i--) {
      if ((end - i) % TABLE_CHUNK == 0) charge_work(L, p, TABLE_CHUNK * MOVE_NS_PER_ITEM);
      lua_rawgeti(L, 1, (int)(i - 1));
      lua_rawseti(L, 1, (int)i);
    }
  }
  lua_pushvalue(L, nargs);
  lua_rawseti(L, 1, (int)pos);
  return 0;
}

/* table.concat(t, sep, i, j): LuaJIT's (upvalue 1) on TABLE_CHUNK elements
 * at a time, the work charged before each, the pieces joined at the end. */
static int sandbox_concat(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checktype(L, 1, LUA_TTABLE);
  size_t seplen;
  luaL_optlstring(L, 2, "", &seplen);
  lua_Integer first = luaL_optinteger(L, 3, 1);
  lua_Integer last = lua_isnoneornil(L, 4) ? (lua_Integer)lua_objlen(L, 1) : luaL_checkinteger(L, 4);
  lua_settop(L, 2);
  if (lua_isnil(L, 2)) {
    lua_pushliteral(L, "");
    lua_replace(L, 2);
  }
  int pieces = 0;
  for (lua_Integer a = first; a <= last || pieces == 0; a += TABLE_CHUNK) {
    lua_Integer b = last - a >= TABLE_CHUNK ? a + TABLE_CHUNK - 1 : last;
    charge_work(L, p, (double)(b - a + 1) * CONCAT_NS_PER_ITEM);
    if (pieces) lua_pushvalue(L, 2); /* the separator between two pieces */
    luaL_checkstack(L, 3, "table.concat");
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_pushvalue(L, 1);
    lua_pushvalue(L, 2);
    lua_pushnumber(L, (lua_Number)a);
    lua_pushnumber(L, (lua_Number)b);
    lua_call(L, 4, 1);
    pieces++;
    if (pieces > 1) lua_concat(L, 3); /* ..., joined, sep, piece -> joined */
    if (b >= last) break;
  }
  return 1;
}

/* os.time(t) reads t's fields with lua_getfield, which runs __index from
 * C: a nesting level. */
static int sandbox_time(lua_State *L) {
  ferry_policy *p = policy_of(L);
  int nesting = p->c_nesting;
  if (lua_istable(L, 1)) enter_nested(L, p, "os.time");
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  p->c_nesting = nesting;
  return 1;
}

static void push_library_function(lua_State *L, const char *lib, const char *name) {
  lua_getglobal(L, lib);
  lua_getfield(L, -1, name);
  lua_remove(L, -2);
}

void push_bounded_functions(lua_State *L, int C) {
  push_library_function(L, "_G", "tostring");
  lua_pushcclosure(L, sandbox_tostring, 1);
  lua_pushvalue(L, -1);
  lua_setfield(L, C, "tostring");
  push_library_function(L, "string", "format"); /* stack: tostring, format */
  lua_insert(L, -2);
  lua_pushcclosure(L, sandbox_format, 2);
  lua_setfield(L, C, "format");
  lua_pushcfunction(L, sandbox_insert);
  lua_setfield(L, C, "insert");
  push_library_function(L, "table", "concat");
  lua_pushcclosure(L, sandbox_concat, 1);
  lua_setfield(L, C, "concat");
  push_library_function(L, "os", "time");
  lua_pushcclosure(L, sandbox_time, 1);
  lua_setfield(L, C, "time");
}
