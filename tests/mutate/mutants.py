"""The mutants of `make mutate` (tests/mutate/run.py): each a small
deliberate bug of a class that has corrupted data or broken a promise in
offload engines. suite: "c" (the C suite), "py:<pytest args>" or
"cli:<tests/cli script>".
Survivors are explained in tests/MUTANTS.md."""

PY_RELOADS = "py:tests/python/test_reloads.py tests/python/test_autograd.py"


def m(id, cls, file, old, new, suite="c"):
    return {"id": id, "class": cls, "file": file, "old": old, "new": new, "suite": suite}


STASH = "engine/src/core/stash.c"
ARENA = "engine/src/arena/arena.c"
HOST = "engine/src/backend/backend_host.c"
HOOKS = "bindings/python/ext/hooks.c"
READER = "engine/src/sim/trace_reader.c"
DECIDE = "engine/src/policy/decide.c"
NUMBER = "engine/src/util/number.c"
MEMINFO = "engine/src/util/meminfo.c"
STAGING = "engine/src/checkpoint/staging.c"
ZIP = "engine/src/checkpoint/zip_writer.c"
RESIDENT = "engine/src/resident/resident.c"
LOAD = "engine/src/policy/load.c"
SANDBOX = "engine/src/policy/sandbox.c"
CHECK = "bindings/cli/cli_check.c"

MUTANTS = [
    # ---- copy paths
    m("host-copy-drops-bytes", "copy path", HOST,
      "      if (!l->throttled) {\n        if (op->bytes) memcpy(op->dst, op->src, op->bytes);",
      "      if (!l->throttled) {\n        if (op->bytes) memcpy(op->dst, op->src, op->bytes - 1);"),
    m("host-throttled-copy-skipped", "copy path", HOST,
      "        link_finish(l, &c);\n        if (op->bytes) memcpy(op->dst, op->src, op->bytes);",
      "        link_finish(l, &c);\n        (void)0;"),
    m("reload-copies-short", "copy path", STASH,
      "rc = o->copy_h2d(e->bk, dev, s->host, s->bytes, e->h2d);",
      "rc = o->copy_h2d(e->bk, dev, s->host, s->bytes / 2, e->h2d);"),
    m("offload-copies-short", "copy path", STASH,
      "rc = o->copy_d2h(e->bk, s->host, s->dev_ptr, s->bytes, e->d2h);",
      "rc = o->copy_d2h(e->bk, s->host, s->dev_ptr, s->bytes - 1, e->d2h);"),
    # ---- stream ordering
    m("offload-not-after-compute", "stream ordering", STASH,
      "!(rc = o->stream_wait_event(e->bk, e->d2h, e->ev_scratch))) {",
      "!(rc = 0)) {"),
    m("reload-not-after-compute", "stream ordering", STASH,
      "!(rc = o->stream_wait_event(e->bk, e->h2d, e->ev_scratch))) {",
      "!(rc = 0)) {"),
    m("reload-event-not-recorded", "stream ordering", STASH,
      "if (!rc) rc = o->event_record(e->bk, s->ev, e->h2d);",
      "if (!rc) rc = 0;"),
    m("staging-not-after-compute", "stream ordering", STAGING,
      "       (rc = o->stream_wait_event(engine_backend(e), engine_d2h_stream(e), engine_scratch_event(e)))))",
      "       (rc = 0)))"),
    m("resident-not-after-compute", "stream ordering", RESIDENT,
      "      (rc = o->stream_wait_event(b, s, engine_scratch_event(e))) ||",
      "      (rc = 0) ||"),
    # ---- stash bookkeeping
    m("stash-bytes-not-decremented", "stash bookkeeping", STASH,
      "  e->ctx.stash_depth--;\n  e->fwd_bytes -= s->bytes;",
      "  e->ctx.stash_depth--;"),
    m("stash-depth-off-by-one", "stash bookkeeping", STASH,
      "  return e->ctx.stash_depth > e->max_fwd_stash ||",
      "  return e->ctx.stash_depth > e->max_fwd_stash + 1 ||"),
    m("stash-byte-bound-ignored", "stash bookkeeping", STASH,
      "         (e->max_fwd_stash_bytes && e->fwd_bytes > e->max_fwd_stash_bytes);",
      "         0;"),
    m("arena-in-use-not-counted", "caps", STASH,
      "    e->offload_order[e->n_offloads++] = idx;\n    e->ctx.arena_in_use += s->bytes;",
      "    e->offload_order[e->n_offloads++] = idx;"),
    m("device-bytes-held-not-decremented", "stash bookkeeping", STASH,
      "  e->stats.device_bytes_held -= s->bytes;\n  e->ctx.stash_depth--;",
      "  e->ctx.stash_depth--;"),
    m("bytes-offloaded-not-counted", "stash bookkeeping", STASH,
      "    e->ctx.bytes_offloaded_this_step += s->bytes;\n",
      ""),
    m("prefetch-distance-ignores-policy", "prefetch", STASH,
      "        d->prefetch_distance >= 0 ? (uint32_t)d->prefetch_distance : e->prefetch_distance;",
      "        e->prefetch_distance;"),
    m("min-offload-bytes-off", "caps", STASH,
      "  if (desc->bytes < e->min_offload_bytes) {\n    if (e->bd)",
      "  if (desc->bytes <= e->min_offload_bytes / 2) {\n    if (e->bd)"),
    # ---- aliases and views
    m("alias-matched-without-size", "alias/view", STASH,
      "      e->entries[pidx].bytes == desc->bytes) {",
      "      1) {"),
    m("alias-never-matched", "alias/view", STASH,
      "  if (e->cfg.retain && u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx) &&",
      "  if (0 && u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx) &&"),
    m("view-rebuilt-at-offset-0", "alias/view", HOOKS,
      "    if (shape && strides && off) res = call_method(flat, s_as_strided, shape, strides, off);",
      "    PyObject *zero = PyLong_FromLong(0);\n    if (shape && strides && off) res = call_method(flat, s_as_strided, shape, strides, zero);\n    Py_XDECREF(zero);",
      PY_RELOADS),
    m("dense-span-accepts-gaps", "alias/view", HOOKS,
      "    if (strides[order[i]] != expect) return 0;",
      "    if (strides[order[i]] < expect) return 0;",
      PY_RELOADS),
    # ---- Python pack/unpack
    m("itemsize-of-one", "pack/unpack", HOOKS,
      "  d->bytes = numel * di->itemsize;",
      "  d->bytes = numel;",
      PY_RELOADS),
    m("unpack-size-check-off", "pack/unpack", HOOKS,
      "  if (!di || (uint64_t)numel * di->itemsize != bytes) return NULL;",
      "  if (!di) return NULL;",
      PY_RELOADS),
    # ---- caps
    m("arena-cap-off-by-one", "caps", ARENA,
      "  if (cap && (bytes > cap || a->stats.reserved > cap - bytes)) {",
      "  if (cap && (bytes > cap || a->stats.reserved > cap - bytes + 4096)) {"),
    m("arena-cap-ignored", "caps", ARENA,
      "  if (cap && (bytes > cap || a->stats.reserved > cap - bytes)) {",
      "  if (0 && cap && (bytes > cap || a->stats.reserved > cap - bytes)) {"),
    m("ram-reading-zero", "caps", MEMINFO,
      "  *avail = (uint64_t)a * 1024;",
      "  *avail = 0;"),
    m("ram-reading-in-kib", "caps", MEMINFO,
      "  *total = (uint64_t)t * 1024;",
      "  *total = (uint64_t)t;"),
    m("size-suffix-1000-based", "strict numbers", NUMBER,
      "#define KI 1024.0",
      "#define KI 1000.0"),
    # ---- policy cache and sandbox
    m("site-cache-answers-any-shape", "policy cache", DECIDE,
      "  for (int i = 0; i < key->ndim; i++) key->shape[i] = desc->shape[i];",
      "  for (int i = 0; i < key->ndim; i++) key->shape[i] = 0;"),
    m("cache-hits-not-counted", "policy cache", DECIDE,
      "      *out = e->decision;\n      p->stats.cache_hits++;",
      "      *out = e->decision;"),
    m("policy-scan-line-count", "trace/policy line numbers", LOAD,
      "    if (*c == '\\n') {\n      line++;\n      continue;\n    }",
      "    if (*c == '\\n') {\n      continue;\n    }"),
    m("reason-line-off-by-one", "trace/policy line numbers", SANDBOX,
      '    lua_pushfstring(L, "%s:%d", ar.short_src, ar.currentline);',
      '    lua_pushfstring(L, "%s:%d", ar.short_src, ar.currentline - 1);'),
    m("cached-answer-loses-reason", "policy cache", DECIDE,
      "        if (why) reason_store(p, &key, h, why);",
      "        if (why && 0) reason_store(p, &key, h, why);"),
    # ---- trace line numbers
    m("trace-blank-lines-uncounted", "trace/policy line numbers", READER,
      "    if (k == n) continue; /* blank lines carry nothing */",
      "    if (k == n) {\n      r->line--;\n      continue;\n    }"),
    m("trace-first-at-line-wrong", "trace/policy line numbers", READER,
      "    return reader_fail(r, \"id %lld packed twice (first at line %u)\", (long long)id,\n                       t->tensors[dup].line);",
      "    return reader_fail(r, \"id %lld packed twice (first at line %u)\", (long long)id,\n                       r->line);"),
    m("trace-bytes-bound-off", "strict numbers", READER,
      "      (rc = get_int(r, o, JK_BYTES, 1, 1, (double)MAX_TENSOR_BYTES, &bytes)) ||\n      (rc = get_int(r, o, JK_LAYER,",
      "      (rc = get_int(r, o, JK_BYTES, 1, 0, (double)MAX_TENSOR_BYTES, &bytes)) ||\n      (rc = get_int(r, o, JK_LAYER,"),
    m("trace-nul-byte-accepted", "hostile input", READER,
      "    if (nul && nul < nl) return reader_fail(r, \"a NUL byte: not a JSON-lines trace (a binary file?)\");",
      "    if (nul && nul < nl && 0) return reader_fail(r, \"a NUL byte: not a JSON-lines trace (a binary file?)\");"),
    # ---- checkpoint writer
    m("zip-crc-not-updated", "checkpoint writer", ZIP,
      "  z->crc = (uint32_t)crc32_z(z->crc, data, n);",
      "  (void)data;"),
    m("zip-padding-tag", "checkpoint writer", ZIP,
      "#define EXTRA_PADDING 0x4246u",
      "#define EXTRA_PADDING 0x4247u",
      "py:tests/python/test_checkpoint.py -k torch_save_writes"),
    m("staging-event-not-recorded", "checkpoint writer", STAGING,
      "  int rc2 = o->event_record(engine_backend(e), slot->ev, engine_d2h_stream(e));",
      "  int rc2 = 0;"),
    # ---- Python checkpoint and staging
    m("snapshot-storage-order-reversed", "checkpoint writer", "bindings/python/ferry/checkpoint.py",
      "        name = prefix + data_names[i]",
      "        name = prefix + data_names[len(entries) - 1 - i]",
      "py:tests/python/test_checkpoint.py"),
    m("stager-aliases-live-tensor", "checkpoint writer", "bindings/python/ferry/checkpoint.py",
      "            return torch.frombuffer(r, dtype=t.dtype).view(t.shape)",
      "            return t",
      "py:tests/python/test_checkpoint.py"),

    # ---- policy sandbox limits
    m("wall-clock-budget-ignored", "policy sandbox", SANDBOX,
      "!(over_time = util_now_ns() > p->deadline_ns))",
      "!(over_time = 0))"),
    m("pattern-bound-off-by-a-power", "policy sandbox", SANDBOX,
      "  for (size_t j = 1; j <= k; j++) ways = ways * (double)(slen + j) / (double)j;",
      "  for (size_t j = 2; j <= k; j++) ways = ways * (double)(slen + j) / (double)j;"),
    m("pattern-anchor-always", "policy sandbox", SANDBOX,
      "  double starts = anchored ? 1 : (double)slen + 1;",
      "  double starts = 1;"),
    m("sort-bound-ignored", "policy sandbox", SANDBOX,
      "  if (n > SORT_MAX_ITEMS)",
      "  if (n > SORT_MAX_ITEMS * 2)"),
    m("env-limit-not-checked", "strict numbers", LOAD,
      'env_count("FERRY_POLICY_LOAD_MS", DEFAULT_LOAD_MS, 1, 3600000, &load_ms, errbuf, errlen)) {',
      '(env_count("FERRY_POLICY_LOAD_MS", DEFAULT_LOAD_MS, 1, 3600000, &load_ms, errbuf, errlen), 0)) {'),
    m("fault-printed-every-time", "quiet logs", CHECK,
      "      f->count[i]++;\n      return;",
      "      f->count[i]++;\n      break;",
      "cli:tests/cli/test_check_faults.py"),

    # ---- policy swaps
    m("parked-policy-blind-to-edits", "policy cache", "engine/src/core/engine.c",
      "a->size == b->size && a->mtime_ns == b->mtime_ns;",
      "1;"),
    m("policy-never-parked", "policy cache", "engine/src/core/engine.c",
      "    if (!e->parked[i].p || !policy_key_equal(&e->parked[i].key, &k)) continue;",
      "    if (!e->parked[i].p || !policy_key_equal(&e->parked[i].key, &k) || 1) continue;"),

    # ---- torch's in-place check
    m("version-not-compared", "pack/unpack", HOOKS,
      "  if (cur == saved) return 0;",
      "  if (cur >= saved) return 0;",
      "py:tests/python/test_limits.py -k inplace"),
    m("kept-alias-without-shared-counter", "pack/unpack", HOOKS,
      "  if (needs_alias) return tensor_attr(t, TA_DETACH);",
      "  if (needs_alias) return PyObject_GetAttr(t, s_data);",
      "py:tests/python/test_lifecycle.py -k cached_keeps"),
    m("kept-never-aliased", "pack/unpack", HOOKS,
      "    PyObject *t = k->tensor, *alias = rc ? NULL : keep_object(t);",
      "    PyObject *t = k->tensor, *alias = rc ? NULL : Py_NewRef(t);",
      "py:tests/python/test_lifecycle.py -k cached_keeps"),
    m("cached-keep-of-an-offload", "policy cache", STASH,
      "(ferry_policy_cached(e->policy, desc, &d) && d.action == FERRY_KEEP)",
      "ferry_policy_cached(e->policy, desc, &d)"),
    m("cached-keep-of-a-stored-buffer", "alias/view", STASH,
      "             (!e->cfg.retain || !u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx)) &&",
      "             (!e->cfg.retain || !u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx) || 1) &&"),
    m("offload-memo-blind-to-environment", "strict numbers (environment)",
      "bindings/python/ferry/torch.py",
      "            key = (args, _getenv_many(_ENV_READ), os.getcwd())",
      "            key = (args, os.getcwd())",
      "py:tests/python/test_lifecycle.py -k follows"),
    m("view-base-not-watched", "pack/unpack", HOOKS,
      "  for (int i = 0; i < 3 && !now; i++)",
      "  for (int i = 0; i < 2 && !now; i++)",
      "py:tests/python/test_limits.py -k inplace"),
]
