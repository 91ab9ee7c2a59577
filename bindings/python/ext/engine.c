/*
 * engine.c — the Engine type: a ferry_engine with Python tensors as owner
 * tokens (retain/release = Py_INCREF/Py_DECREF, device_alloc = torch.empty),
 * its configuration from keyword arguments, steps, policy, stats, and the
 * parameter ranges that tell activations from parameters.
 */
#include "ext.h"

#include <pthread.h>

const char *keep_reason_names[KEEP_REASONS_] = {
    "kept_small", "kept_subclass", "kept_sparse", "kept_nested",
    "kept_device", "kept_non_dense", "kept_ndim", "kept_pack_error"};

PyObject *raise_ferry(int code, const char *msg) {
  PyObject *args = Py_BuildValue("(ss)", msg && *msg ? msg : ferry_strerror(code),
                                 ferry_err_name(code));
  if (args) {
    PyErr_SetObject(FerryError, args);
    Py_DECREF(args);
  }
  return NULL;
}

PyObject *raise_forked(void) {
  return raise_ferry(FERRY_ESTATE,
                     "ferry: this engine belongs to the parent of this forked process: its copy "
                     "threads did not fork; make a new engine here (ferry.torch.offload() and "
                     "ferry.torch.snapshot() do so by themselves)");
}

int engine_live(EngineObject *self) {
  if (self->e) return 1;
  if (self->forked)
    raise_forked();
  else
    PyErr_SetString(FerryError, "ferry: this engine was closed");
  return 0;
}

/* 1 when an object of eng that holds h (a snapshot, a resident buffer) can
 * be used; else 0 with the error set, gone saying what freed h. A forked
 * child's objects are its parent's: their threads did not fork. */
int owned_live(EngineObject *eng, const void *h, const char *gone) {
  if (eng->forked) {
    raise_forked();
    return 0;
  }
  if (h) return 1;
  raise_ferry(FERRY_ESTATE, gone);
  return 0;
}

/* ---- engines across fork() ----------------------------------------------------
 * The list changes under the GIL only; the child handler runs inside
 * fork(), in the one thread the child has, which held the GIL (os.fork) or
 * is the only thread that could touch the list. */
static EngineObject *live_engines;

static void live_add(EngineObject *self) {
  if (self->on_live_list) return;
  self->live_prev = NULL;
  self->live_next = live_engines;
  if (live_engines) live_engines->live_prev = self;
  live_engines = self;
  self->on_live_list = 1;
}

static void live_remove(EngineObject *self) {
  if (!self->on_live_list) return;
  if (self->live_prev)
    self->live_prev->live_next = self->live_next;
  else
    live_engines = self->live_next;
  if (self->live_next) self->live_next->live_prev = self->live_prev;
  self->on_live_list = 0;
}

/* The engine's memory stays as the child's copy: destroying it would join
 * threads this process does not have. */
static void engines_after_fork_child(void) {
  for (EngineObject *o = live_engines; o; o = o->live_next)
    if (o->e || o->closing) {
      o->e = NULL;
      o->closing = NULL;
      o->forked = 1;
    }
}

int engines_watch_fork(void) {
  int rc = pthread_atfork(NULL, NULL, engines_after_fork_child);
  if (rc) PyErr_Format(PyExc_OSError, "ferry: pthread_atfork failed: %s", strerror(rc));
  return rc ? -1 : 0;
}

/* Engine callbacks. All run with the GIL held (see the file comment); the
 * PyGILState calls make that true even for an embedder that calls the engine
 * from a thread without it. */

/* The buffer itself: the handle being unpacked gets one with its own dtype
 * and strides, so unpack hands it out as is; others (prefetches) get raw
 * bytes. */
static PyObject *alloc_buffer(EngineObject *self, uint64_t bytes) {
  PyObject *t = empty_like_handle(self, bytes);
  if (!t && !PyErr_Occurred()) {
    PyObject *args = Py_BuildValue("(K)", (unsigned long long)bytes);
    t = args ? PyObject_Call(T.empty, args, self->alloc_kw) : NULL;
    Py_XDECREF(args);
  }
  return t;
}

/* alloc_buffer from the pool of `stream` (the one the engine orders the
 * reload after): torch's caching allocator takes a block from the current
 * stream's pool, so when the engine's stream is not the current one it is
 * made current around the allocation. */
static PyObject *alloc_buffer_for(EngineObject *self, uint64_t bytes, void *stream) {
  if (self->backend != FERRY_BACKEND_CUDA) return alloc_buffer(self, bytes);
  void *current = compute_stream(self);
  if (PyErr_Occurred()) return NULL;
  if (current == stream) return alloc_buffer(self, bytes);
  PyObject *cuda = PyObject_GetAttrString(T.torch, "cuda");
  /* NULL: the legacy default stream, torch's default stream */
  PyObject *ext = !cuda    ? NULL
                  : stream ? PyObject_CallMethod(cuda, "ExternalStream", "(Ki)",
                                                 (unsigned long long)(uintptr_t)stream,
                                                 self->device_index)
                           : PyObject_CallMethod(cuda, "default_stream", "(i)",
                                                 self->device_index);
  PyObject *ctx = ext ? PyObject_CallMethod(cuda, "stream", "(O)", ext) : NULL;
  PyObject *in = ctx ? PyObject_CallMethod(ctx, "__enter__", NULL) : NULL;
  PyObject *t = in ? alloc_buffer(self, bytes) : NULL;
  if (in) {
    PyObject *exc_type, *exc, *tb; /* an allocation error stays the error */
    PyErr_Fetch(&exc_type, &exc, &tb);
    PyObject *out = PyObject_CallMethod(ctx, "__exit__", "(OOO)", Py_None, Py_None, Py_None);
    if (!out) Py_CLEAR(t);
    Py_XDECREF(out);
    if (exc_type) PyErr_Restore(exc_type, exc, tb);
  }
  Py_XDECREF(in);
  Py_XDECREF(ctx);
  Py_XDECREF(ext);
  Py_XDECREF(cuda);
  return t;
}

static int cb_device_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  EngineObject *self = ud;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = -1;
  PyObject *t = alloc_buffer_for(self, bytes, stream);
  if (t) {
    PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (p) {
      *dev = PyLong_AsVoidPtr(p);
      Py_DECREF(p);
      if (*dev || !PyErr_Occurred()) {
        *owner = t;
        t = NULL;
        self->allocs_live++;
        rc = 0;
      }
    }
    Py_XDECREF(t);
  }
  if (rc) PyErr_WriteUnraisable((PyObject *)self); /* reported; the engine fails the unpack */
  PyGILState_Release(g);
  return rc;
}

static void cb_release(void *ud, void *owner) {
  PyGILState_STATE g = PyGILState_Ensure();
  Py_DECREF((PyObject *)owner);
  PyGILState_Release(g);
}

/* Around an engine wait for another thread's reload of the same tensor:
 * the GIL goes meanwhile, for that thread may be inside torch.empty_strided
 * (device_alloc), which lets the GIL go and needs it back to return. */
static void *cb_wait_begin(void *ud) {
  (void)ud;
  return PyGILState_Check() ? (void *)PyEval_SaveThread() : NULL;
}

static void cb_wait_end(void *ud, void *token) {
  (void)ud;
  if (token) PyEval_RestoreThread((PyThreadState *)token);
}

static void cb_retain(void *ud, void *owner) {
  /* Called under the engine's lock; the GIL is held by our caller. */
  Py_INCREF((PyObject *)owner);
}

/* The engine's min_offload_bytes after policy knobs: the fast keep path
 * must not keep a tensor the engine would have shown the policy. */
static uint64_t effective_min_bytes(ferry_engine *e) {
  ferry_knobs k;
  return ferry_get_knobs(e, &k, sizeof k) == FERRY_OK ? k.min_offload_bytes : 0;
}

/* ---- Engine type ------------------------------------------------------------- */
static int backend_of(const char *name) {
  if (!strcmp(name, "host")) return FERRY_BACKEND_HOST;
  if (!strcmp(name, "cuda")) return FERRY_BACKEND_CUDA;
  if (!strcmp(name, "sim")) return FERRY_BACKEND_SIM;
  return -1;
}

static int arena_of(const char *name) {
  if (!strcmp(name, "auto")) return FERRY_ARENA_AUTO;
  if (!strcmp(name, "jemalloc")) return FERRY_ARENA_JEMALLOC;
  if (!strcmp(name, "pool")) return FERRY_ARENA_POOL;
  return -1;
}

static PyObject *engine_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
  return (PyObject *)self;
}

/* backend, arena and link (a tuple or None) into cfg. */
static int config_kinds(ferry_config *cfg, const char *backend, const char *arena,
                        PyObject *link) {
  cfg->backend = backend_of(backend);
  if (cfg->backend < 0) {
    PyErr_Format(PyExc_ValueError, "ferry: backend '%s' is not one of host, cuda, sim", backend);
    return -1;
  }
  cfg->arena = arena_of(arena);
  if (cfg->arena < 0) {
    PyErr_Format(PyExc_ValueError, "ferry: arena '%s' is not one of auto, jemalloc, pool", arena);
    return -1;
  }
  if (link != Py_None &&
      !PyArg_ParseTuple(link, "dddd;link must be (d2h_bytes_per_s, h2d_bytes_per_s, latency_us, "
                              "duplex)",
                        &cfg->link.d2h_bytes_per_s, &cfg->link.h2d_bytes_per_s,
                        &cfg->link.latency_us, &cfg->link.duplex))
    return -1;
  return 0;
}

/* A NodeCap's reserve hook into cfg; the engine keeps the NodeCap alive. */
static int config_node_cap(EngineObject *self, ferry_config *cfg, PyObject *node_cap) {
  if (node_cap == Py_None) return 0;
  if (!PyObject_TypeCheck(node_cap, &NodeCapType) || !((NodeCapObject *)node_cap)->nb) {
    PyErr_SetString(PyExc_TypeError, "ferry: node_cap must be an initialised NodeCap");
    return -1;
  }
#ifdef FERRY_HAVE_RESERVE_FN
  cfg->host_reserve = ferry_node_budget_reserve;
  cfg->host_reserve_ud = ((NodeCapObject *)node_cap)->nb;
#else
  PyErr_SetString(PyExc_NotImplementedError,
                  "ferry: this libferry has no host_reserve hook; a node-wide cap needs it");
  return -1;
#endif
  Py_INCREF(node_cap);
  self->node_cap = node_cap;
  return 0;
}

/* torch.empty's keywords for device_alloc; a cuda engine's stream getter. */
static int engine_alloc_setup(EngineObject *self) {
  self->alloc_kw = PyDict_New();
  if (!self->alloc_kw || PyDict_SetItemString(self->alloc_kw, "dtype", T.uint8)) return -1;
  if (self->backend != FERRY_BACKEND_CUDA) return 0;
  PyObject *dev = PyUnicode_FromFormat("cuda:%d", self->device_index);
  int bad = !dev || PyDict_SetItemString(self->alloc_kw, "device", dev);
  Py_XDECREF(dev);
  if (bad) return -1;
  PyObject *cuda = PyObject_GetAttrString(T.torch, "cuda");
  T.cuda_current_stream = cuda ? PyObject_GetAttrString(cuda, "current_stream") : NULL;
  Py_XDECREF(cuda);
  return T.cuda_current_stream ? 0 : -1;
}

static int engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"backend", "policy_path", "policy_source", "trace_path",
                           "host_cap_bytes", "host_cap_pct", "min_offload_bytes",
                           "max_fwd_stash", "prefetch_distance", "link", "arena",
                           "device", "policy_trusted", "node_cap", "fast_keep",
                           "max_fwd_stash_bytes", "knobs_fixed", "chrome_trace_path",
                           "count_reasons", "release_when_copied", "prefetch_at_backward_begin",
                           NULL};
  const char *backend = "host", *policy_path = NULL, *policy_source = NULL, *trace_path = NULL,
             *arena = "auto", *chrome_trace_path = NULL;
  unsigned long long cap_bytes = 0, min_bytes = 1024, stash_bytes = 0;
  unsigned int knobs_fixed = 0;
  double cap_pct = 0;
  unsigned int max_stash = 4, prefetch = 2;
  PyObject *link = Py_None, *node_cap = Py_None;
  int device = -1, trusted = 0, fast_keep = 1, count_reasons = 0, release_copied = 0,
      prefetch_bwd = 0;
  if (self->e) {
    PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|szzzKdKIIOsipOpKIzppp", kwlist, &backend,
                                   &policy_path, &policy_source, &trace_path, &cap_bytes, &cap_pct,
                                   &min_bytes, &max_stash, &prefetch, &link, &arena, &device,
                                   &trusted, &node_cap, &fast_keep, &stash_bytes, &knobs_fixed,
                                   &chrome_trace_path, &count_reasons, &release_copied,
                                   &prefetch_bwd))
    return -1;
  ferry_config cfg;
  ferry_config_init(&cfg);
  if (config_kinds(&cfg, backend, arena, link) || torch_init()) return -1;
  cfg.device = device;
  cfg.host_cap_bytes = cap_bytes;
  cfg.host_cap_pct = cap_pct;
  cfg.min_offload_bytes = min_bytes;
  cfg.max_fwd_stash = max_stash;
  cfg.prefetch_distance = prefetch;
  cfg.max_fwd_stash_bytes = stash_bytes;
  cfg.knobs_fixed = knobs_fixed;
  cfg.release_when_copied = release_copied;
  cfg.prefetch_at_backward_begin = prefetch_bwd;
  cfg.device_alloc = cb_device_alloc;
  cfg.release = cb_release;
  cfg.retain = cb_retain;
  cfg.wait_begin = cb_wait_begin;
  cfg.wait_end = cb_wait_end;
  cfg.callback_ud = self;
  cfg.policy_path = policy_path;
  cfg.policy_source = policy_source;
  cfg.policy_trusted = trusted;
  cfg.trace_path = trace_path;
  cfg.chrome_trace_path = chrome_trace_path;
  cfg.count_reasons = count_reasons;
  if (config_node_cap(self, &cfg, node_cap)) return -1;
  self->backend = cfg.backend;
  self->device_index = device < 0 ? 0 : device;
  if (engine_alloc_setup(self)) return -1;
  char err[512] = "";
  ferry_engine *e = NULL;
  int rc = ferry_engine_create(&cfg, &e, err, sizeof err);
  if (rc) {
    raise_ferry(rc, err);
    return -1;
  }
  self->e = e;
  self->forked = 0;
  live_add(self);
  self->min_bytes = effective_min_bytes(e);
  /* a trace or a breakdown counts every tensor: none may pass the engine by */
  self->fast_keep = fast_keep && !trace_path && !count_reasons;
  self->release_when_copied = release_copied;
  self->prefetch_at_backward_begin = prefetch_bwd;
  self->pack_hook = make_hook(&PackHookType, self);
  self->unpack_hook = make_hook(&UnpackHookType, self);
  if (!self->pack_hook || !self->unpack_hook) return -1;
  return 0;
}

static void engine_close_impl(EngineObject *self) {
  if (kept_end_step(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
  if (!self->e) return;
  ferry_engine *e = self->e;
  /* Handles still alive become invalid: they hold a reference to this
   * object, so close only happens explicitly or when none is left. */
  self->e = NULL;
  /* Resident buffers' bytes are the arena's, and tensors over them
   * (torch.frombuffer holds the Resident, not a buffer export) may still
   * read them: the last buffer to go destroys the engine. */
  if (self->residents_live > 0 || self->calls > 0) {
    self->closing = e;
    return;
  }
  ferry_engine_destroy(e);
}

ferry_engine *engine_call_begin(EngineObject *eng) {
  Py_INCREF(eng);
  eng->calls++;
  return eng->e;
}

void engine_call_end(EngineObject *eng) {
  if (--eng->calls == 0 && eng->closing && eng->residents_live == 0) {
    ferry_engine *e = eng->closing;
    eng->closing = NULL;
    if (!eng->forked) ferry_engine_destroy(e);
  }
  Py_DECREF(eng);
}

void engine_resident_gone(EngineObject *eng) {
  if (--eng->residents_live > 0 || !eng->closing || eng->calls > 0) return;
  ferry_engine *e = eng->closing;
  eng->closing = NULL;
  if (!eng->forked) ferry_engine_destroy(e); /* a parent's: its threads did not fork */
}

static int engine_traverse(EngineObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->pack_hook);
  Py_VISIT(self->unpack_hook);
  Py_VISIT(self->on_backward_end);
  return 0;
}

static int engine_clear(EngineObject *self) {
  Py_CLEAR(self->pack_hook);
  Py_CLEAR(self->unpack_hook);
  Py_CLEAR(self->on_backward_end);
  return 0;
}

static void engine_dealloc(EngineObject *self) {
  PyObject_GC_UnTrack(self);
  if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
  engine_clear(self);
  engine_close_impl(self);
  if (self->closing && !self->forked) ferry_engine_destroy(self->closing); /* no Resident left */
  self->closing = NULL;
  live_remove(self);
  Py_CLEAR(self->alloc_kw);
  Py_CLEAR(self->last_pack_error);
  Py_CLEAR(self->node_cap);
  PyMem_Free(self->sites);
  PyMem_Free(self->stack);
  PyMem_Free(self->params);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *engine_close(EngineObject *self, PyObject *unused) {
  engine_close_impl(self);
  Py_RETURN_NONE;
}

static PyObject *check_rc(EngineObject *self, int rc) {
  if (rc) return raise_ferry(rc, ferry_last_error(self->e));
  Py_RETURN_NONE;
}

static PyObject *engine_step_begin(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  self->depth = 0;
  self->in_backward = 0;
  return check_rc(self, ferry_step_begin(self->e));
}

/* Ends the step. Returns the number of handles still live (retain_graph, or
 * a graph kept by the user): they stay valid; 0 is the normal case. */
static PyObject *engine_step_end(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  if (self->in_backward) ferry_backward_end(self->e);
  self->in_backward = 0;
  self->depth = 0;
  if (kept_end_step(self) < 0) return NULL;
  if (!engine_live(self)) return NULL; /* a release closed it */
  int rc = ferry_step_end(engine_call_begin(self));
  engine_call_end(self);
  if (!engine_live(self)) return NULL;
  if (rc == FERRY_ELEAK) {
    ferry_stats s;
    ferry_get_stats(self->e, &s, sizeof s);
    return PyLong_FromUnsignedLongLong(s.live_handles);
  }
  if (rc) return raise_ferry(rc, ferry_last_error(self->e));
  return PyLong_FromLong(0);
}

static PyObject *engine_backward_begin(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  void *stream = compute_stream(self);
  if (PyErr_Occurred()) return NULL;
  self->in_backward = 1;
  self->backwards++;
  int rc = ferry_backward_begin_on(engine_call_begin(self), stream);
  engine_call_end(self);
  return check_rc(self, rc);
}

static PyObject *engine_set_policy(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "source", "trusted", NULL};
  const char *path = NULL, *source = NULL;
  int trusted = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzp", kwlist, &path, &source, &trusted))
    return NULL;
  if (!engine_live(self)) return NULL;
  int rc = ferry_set_policy(self->e, path, source, trusted);
  if (!rc) self->min_bytes = effective_min_bytes(self->e);
  return check_rc(self, rc);
}

/* ferry_get_breakdown's rows as dicts, appended to a list */
static void breakdown_row(void *ud, const ferry_breakdown_row *r) {
  PyObject *rows = ud;
  if (PyErr_Occurred()) return;
  PyObject *d = Py_BuildValue("{s:s,s:s,s:i,s:K,s:K,s:K,s:K}", "rule", r->rule, "where",
                              r->where, "layer", r->layer, "tensors_offloaded",
                              (unsigned long long)r->tensors_offloaded, "bytes_offloaded",
                              (unsigned long long)r->bytes_offloaded, "tensors_kept",
                              (unsigned long long)r->tensors_kept, "bytes_kept",
                              (unsigned long long)r->bytes_kept);
  if (d) PyList_Append(rows, d);
  Py_XDECREF(d);
}

static PyObject *engine_breakdown(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  PyObject *rows = PyList_New(0);
  if (!rows) return NULL;
  int rc = ferry_get_breakdown(self->e, breakdown_row, rows);
  if (rc) {
    Py_DECREF(rows);
    return raise_ferry(rc, ferry_last_error(self->e));
  }
  if (PyErr_Occurred()) Py_CLEAR(rows);
  return rows;
}

/* trace_resident(what, nbytes): ferry_trace_resident, between steps. */
static PyObject *engine_trace_resident(EngineObject *self, PyObject *args) {
  const char *what;
  unsigned long long bytes;
  if (!PyArg_ParseTuple(args, "sK:trace_resident", &what, &bytes)) return NULL;
  if (!engine_live(self)) return NULL;
  return check_rc(self, ferry_trace_resident(self->e, what, bytes));
}

/* trace_device_peak(nbytes): ferry_trace_device_peak, after a step. */
static PyObject *engine_trace_device_peak(EngineObject *self, PyObject *arg) {
  unsigned long long bytes = PyLong_AsUnsignedLongLong(arg);
  if (bytes == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  if (!engine_live(self)) return NULL;
  return check_rc(self, ferry_trace_device_peak(self->e, bytes));
}

/* trace_flops(n): ferry_trace_flops; the next traced event carries the sum. */
static PyObject *engine_trace_flops(EngineObject *self, PyObject *arg) {
  double flops = PyFloat_AsDouble(arg);
  if (flops == -1.0 && PyErr_Occurred()) return NULL;
  if (!engine_live(self)) return NULL;
  return check_rc(self, ferry_trace_flops(self->e, flops));
}

/* trace_flops_all(on): ferry_trace_flops_all. */
static PyObject *engine_trace_flops_all(EngineObject *self, PyObject *arg) {
  int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  if (!engine_live(self)) return NULL;
  return check_rc(self, ferry_trace_flops_all(self->e, on));
}

static PyObject *engine_stats(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  ferry_stats s;
  int rc = ferry_get_stats(self->e, &s, sizeof s);
  if (rc) return raise_ferry(rc, ferry_last_error(self->e));
  PyObject *d = PyDict_New();
  if (!d) return NULL;
#define PUT(name, value)                                        \
  do {                                                          \
    PyObject *v_ = PyLong_FromUnsignedLongLong(value);          \
    if (!v_ || PyDict_SetItemString(d, name, v_)) {             \
      Py_XDECREF(v_);                                           \
      Py_DECREF(d);                                             \
      return NULL;                                              \
    }                                                           \
    Py_DECREF(v_);                                              \
  } while (0)
#define S(f) PUT(#f, s.f)
  S(steps); S(tensors_packed); S(tensors_offloaded); S(tensors_kept); S(tensors_aliased);
  S(tensors_unpacked); S(stash_hits); S(prefetches); S(bytes_d2h); S(bytes_h2d);
  S(live_handles); S(device_bytes_held); S(device_bytes_held_peak); S(arena_in_use);
  S(arena_peak); S(arena_reserved); S(arena_cap); S(backend_pinned_allocs); S(waits);
  S(cap_fallbacks); S(alloc_failures); S(policy_errors); S(policy_calls);
  S(policy_cache_hits); S(policy_disabled); S(tensors_kept_unheld);
  S(snapshot_bytes_direct); S(snapshot_bytes_buffered);
#undef S
  for (int i = 0; i < KEEP_REASONS_; i++) PUT(keep_reason_names[i], self->kept[i]);
  PUT("recompute_packs", self->recompute_packs);
  PUT("backwards", self->backwards);
  PUT("unpack_rebuilds", self->rebuilds);
  PUT("pack_errors", self->pack_errors);
  PUT("unpacks_repeated", self->unpacks_repeated);
  PUT("device_allocs", self->allocs_live); /* device_alloc callback calls */
#undef PUT
  return d;
}

/* policy_errors() -> int: stats()["policy_errors"] without the dict (checked
 * at every step end) */
static PyObject *engine_policy_errors(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  ferry_stats s;
  int rc = ferry_get_stats(self->e, &s, sizeof s);
  if (rc) return raise_ferry(rc, ferry_last_error(self->e));
  return PyLong_FromUnsignedLongLong(s.policy_errors);
}

static PyObject *engine_reset_counters(EngineObject *self, PyObject *unused) {
  memset(self->kept, 0, sizeof self->kept);
  self->recompute_packs = self->rebuilds = self->pack_errors = self->unpacks_repeated = 0;
  Py_RETURN_NONE;
}

static PyObject *engine_last_error(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  return PyUnicode_FromString(ferry_last_error(self->e));
}

static PyObject *engine_policy_error(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  return PyUnicode_FromString(ferry_last_policy_error(self->e));
}

static PyObject *engine_last_pack_error(EngineObject *self, PyObject *unused) {
  if (!self->last_pack_error) Py_RETURN_NONE;
  Py_INCREF(self->last_pack_error);
  return self->last_pack_error;
}

/* add_sites([(path, class, layer, layer_count), ...]) -> index of the first */
static PyObject *engine_add_sites(EngineObject *self, PyObject *list) {
  if (!engine_live(self)) return NULL;
  PyObject *seq = PySequence_Fast(list, "add_sites expects a sequence of tuples");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (self->n_sites + (uint64_t)n > INT32_MAX) {
    Py_DECREF(seq);
    return PyErr_Format(PyExc_OverflowError, "ferry: too many module sites");
  }
  uint32_t need = self->n_sites + (uint32_t)n;
  if (need > self->cap_sites) {
    uint32_t ncap = self->cap_sites ? self->cap_sites : 64;
    while (ncap < need) ncap *= 2;
    site *ns = PyMem_Realloc(self->sites, ncap * sizeof *ns);
    if (!ns) {
      Py_DECREF(seq);
      return PyErr_NoMemory();
    }
    self->sites = ns;
    self->cap_sites = ncap;
  }
  uint32_t first = self->n_sites;
  for (Py_ssize_t i = 0; i < n; i++) {
    const char *path, *cls;
    int layer, count;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ssii;a site is (path, class, layer, layer_count)",
                          &path, &cls, &layer, &count)) {
      Py_DECREF(seq);
      return NULL;
    }
    site *s = &self->sites[first + i];
    s->path = ferry_intern(self->e, path);
    s->cls = ferry_intern(self->e, cls);
    s->layer = layer;
    s->layer_count = count;
    if (!s->path || !s->cls) {
      Py_DECREF(seq);
      return PyErr_NoMemory();
    }
  }
  self->n_sites = need;
  Py_DECREF(seq);
  return PyLong_FromUnsignedLong(first);
}

static int range_cmp(const void *a, const void *b) {
  const param_range *x = a, *y = b;
  return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* set_param_ranges([(start, nbytes, is_buffer), ...]) replaces the table. */
static PyObject *engine_set_param_ranges(EngineObject *self, PyObject *list) {
  PyObject *seq = PySequence_Fast(list, "set_param_ranges expects a sequence of tuples");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  param_range *r = n ? PyMem_Malloc((size_t)n * sizeof *r) : NULL;
  if (n && !r) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long long lo, len;
    int is_buffer;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKp;a range is (start, nbytes, is_buffer)",
                          &lo, &len, &is_buffer)) {
      PyMem_Free(r);
      Py_DECREF(seq);
      return NULL;
    }
    r[i] = (param_range){(uintptr_t)lo, (uintptr_t)(lo + (len ? len : 1)),
                         is_buffer ? FERRY_KIND_BUFFER : FERRY_KIND_PARAMETER};
  }
  Py_DECREF(seq);
  if (n) qsort(r, (size_t)n, sizeof *r, range_cmp);
  PyMem_Free(self->params);
  self->params = r;
  self->n_params = (uint32_t)n;
  Py_RETURN_NONE;
}

static PyObject *engine_kind_of(EngineObject *self, PyObject *arg) {
  uintptr_t p = (uintptr_t)PyLong_AsVoidPtr(arg);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromLong(kind_of_ptr(self, p));
}

static PyObject *engine_hooks(EngineObject *self, PyObject *unused) {
  return PyTuple_Pack(2, self->pack_hook, self->unpack_hook);
}


static PyObject *engine_info(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  return Py_BuildValue("{sssssKsisNsN}", "backend", ferry_backend_name(self->e), "arena",
                       ferry_arena_name(self->e), "min_offload_bytes",
                       (unsigned long long)self->min_bytes, "fast_keep", self->fast_keep,
                       "release_when_copied", PyBool_FromLong(self->release_when_copied),
                       "prefetch_at_backward_begin",
                       PyBool_FromLong(self->prefetch_at_backward_begin));
}

/* The knobs in force, and the names of those a policy set but the caller's
 * fixed value overruled (config.knobs_fixed). */
static PyObject *engine_knobs(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  ferry_knobs k;
  int rc = ferry_get_knobs(self->e, &k, sizeof k);
  if (rc) return raise_ferry(rc, ferry_last_error(self->e));
  PyObject *over = PyList_New(0);
  static const struct { uint32_t bit; const char *name; } names[] = {
      {FERRY_KNOB_MAX_FWD_STASH, "max_fwd_stash"},
      {FERRY_KNOB_PREFETCH_DISTANCE, "prefetch_distance"},
      {FERRY_KNOB_MIN_OFFLOAD_BYTES, "min_offload_bytes"},
      {FERRY_KNOB_MAX_FWD_STASH_BYTES, "max_fwd_stash_bytes"}};
  for (size_t i = 0; over && i < sizeof names / sizeof names[0]; i++) {
    if (!(k.overruled & names[i].bit)) continue;
    PyObject *n = PyUnicode_FromString(names[i].name);
    if (!n || PyList_Append(over, n)) Py_CLEAR(over);
    Py_XDECREF(n);
  }
  if (!over) return NULL;
  PyObject *tail = k.max_tail_prefetch == UINT32_MAX ? (Py_INCREF(Py_None), Py_None)
                                                    : PyLong_FromUnsignedLong(k.max_tail_prefetch);
  if (!tail) {
    Py_DECREF(over);
    return NULL;
  }
  return Py_BuildValue("{sIsIsKsKsNsNsIsIsN}", "max_fwd_stash", k.max_fwd_stash, "prefetch_distance",
                       k.prefetch_distance, "min_offload_bytes",
                       (unsigned long long)k.min_offload_bytes, "max_fwd_stash_bytes",
                       (unsigned long long)k.max_fwd_stash_bytes, "release_when_copied",
                       PyBool_FromLong(k.release_when_copied), "max_tail_prefetch", tail,
                       "sync_copies", k.sync_copies, "one_copy_stream", k.one_copy_stream, "overruled",
                       over);
}

static PyObject *engine_get_closed(EngineObject *self, void *unused) {
  return PyBool_FromLong(self->e == NULL);
}

static PyObject *engine_get_in_step(EngineObject *self, void *unused) {
  /* the engine's own flag: it begins a step at a pack or unpack outside one */
  return PyBool_FromLong(ferry_in_step(self->e));
}

/* stats()["backwards"] without the dict: the step's end reads it each step */
static PyObject *engine_get_backwards(EngineObject *self, void *unused) {
  return PyLong_FromUnsignedLongLong(self->backwards);
}

static PyObject *engine_get_on_backward_end(EngineObject *self, void *unused) {
  PyObject *f = self->on_backward_end ? self->on_backward_end : Py_None;
  Py_INCREF(f);
  return f;
}

static int engine_set_on_backward_end(EngineObject *self, PyObject *v, void *unused) {
  if (v && v != Py_None && !PyCallable_Check(v)) {
    PyErr_SetString(PyExc_TypeError, "on_backward_end must be callable or None");
    return -1;
  }
  Py_XINCREF(v == Py_None ? NULL : v);
  Py_XSETREF(self->on_backward_end, v == Py_None ? NULL : v);
  return 0;
}

static PyObject *engine_get_profile_ranges(EngineObject *self, void *unused) {
  return PyBool_FromLong(self->profile_ranges);
}

static int engine_set_profile_ranges(EngineObject *self, PyObject *v, void *unused) {
  int on = v ? PyObject_IsTrue(v) : 0;
  if (on < 0) return -1;
  self->profile_ranges = on;
  return 0;
}

static PyObject *engine_get_depth(EngineObject *self, void *unused) {
  return PyLong_FromUnsignedLong(self->depth);
}

static PyObject *engine_get_min_bytes(EngineObject *self, void *unused) {
  return PyLong_FromUnsignedLongLong(self->min_bytes);
}

static int engine_set_min_bytes(EngineObject *self, PyObject *v, void *unused) {
  if (!v) {
    PyErr_SetString(PyExc_AttributeError, "cannot delete min_offload_bytes");
    return -1;
  }
  unsigned long long n = PyLong_AsUnsignedLongLong(v);
  if (PyErr_Occurred()) return -1;
  self->min_bytes = n;
  return 0;
}

static PyGetSetDef engine_getset[] = {
    {"closed", (getter)engine_get_closed, NULL, "whether close() was called", NULL},
    {"in_step", (getter)engine_get_in_step, NULL, "a step is in progress", NULL},
    {"backwards", (getter)engine_get_backwards, NULL,
     "backward phases begun (stats()['backwards'], without building the dict)", NULL},
    {"on_backward_end", (getter)engine_get_on_backward_end, (setter)engine_set_on_backward_end,
     "called (no arguments) as each backward ends, before the engine's backward_end", NULL},
    {"profile_ranges", (getter)engine_get_profile_ranges, (setter)engine_set_profile_ranges,
     "pack and unpack calls are torch profiler ranges (set at each offload entry)", NULL},
    {"module_depth", (getter)engine_get_depth, NULL, "current module stack depth", NULL},
    {"min_offload_bytes", (getter)engine_get_min_bytes, (setter)engine_set_min_bytes,
     "the fast keep path's threshold (the engine's min_offload_bytes)", NULL},
    {NULL}};


static PyMethodDef engine_methods[] = {
    {"close", (PyCFunction)engine_close, METH_NOARGS, "Destroy the engine now."},
    {"step_begin", (PyCFunction)engine_step_begin, METH_NOARGS, NULL},
    {"step_end", (PyCFunction)engine_step_end, METH_NOARGS,
     "End the step; returns the number of handles still live (0 normally)."},
    {"backward_begin", (PyCFunction)engine_backward_begin, METH_NOARGS, NULL},
    {"set_policy", (PyCFunction)(void (*)(void))engine_set_policy, METH_VARARGS | METH_KEYWORDS,
     "set_policy(path=None, source=None, trusted=False), between steps."},
    {"stats", (PyCFunction)engine_stats, METH_NOARGS, "Engine stats and binding counters."},
    {"policy_errors", (PyCFunction)engine_policy_errors, METH_NOARGS,
     "stats()['policy_errors'], cheaply."},
    {"breakdown", (PyCFunction)engine_breakdown, METH_NOARGS,
     "Saved tensors by rule and layer (ferry_get_breakdown): a list of dicts with rule, where, "
     "layer, tensors_offloaded, bytes_offloaded, tensors_kept, bytes_kept. Needs "
     "count_reasons=True."},
    {"reset_counters", (PyCFunction)engine_reset_counters, METH_NOARGS,
     "Zero the binding's own counters (kept_*, recompute_packs...)."},
    {"last_error", (PyCFunction)engine_last_error, METH_NOARGS, NULL},
    {"policy_error", (PyCFunction)engine_policy_error, METH_NOARGS, NULL},
    {"last_pack_error", (PyCFunction)engine_last_pack_error, METH_NOARGS, NULL},
    {"add_sites", (PyCFunction)engine_add_sites, METH_O, NULL},
    {"set_param_ranges", (PyCFunction)engine_set_param_ranges, METH_O, NULL},
    {"kind_of", (PyCFunction)engine_kind_of, METH_O, "ferry_kind of a data pointer."},
    {"hooks", (PyCFunction)engine_hooks, METH_NOARGS,
     "(pack_hook, unpack_hook) for torch.autograd.graph.saved_tensors_hooks."},
    {"site_hooks", (PyCFunction)engine_site_hooks, METH_O,
     "site_hooks(index) -> (pre_hook, post_hook) for one module."},
    {"info", (PyCFunction)engine_info, METH_NOARGS, NULL},
    {"knobs", (PyCFunction)engine_knobs, METH_NOARGS,
     "The knobs in force, with 'overruled': those the policy lost to knobs_fixed."},
    {"trace_device_peak", (PyCFunction)engine_trace_device_peak, METH_O,
     "trace_device_peak(nbytes): record the most device memory the trainer's allocator "
     "had in use during the step just ended (ferry_trace_device_peak; a no-op without a "
     "trace)."},
    {"trace_resident", (PyCFunction)engine_trace_resident, METH_VARARGS,
     "trace_resident(what, nbytes): record device memory held for the whole step "
     "(ferry_trace_resident; between steps; a no-op without a trace)."},
    {"trace_flops", (PyCFunction)engine_trace_flops, METH_O,
     "trace_flops(n): add n floating-point operations of the compute since the last "
     "traced event; the next event carries the sum (ferry_trace_flops)."},
    {"trace_flops_all", (PyCFunction)engine_trace_flops_all, METH_O,
     "trace_flops_all(on): every traced event carries flops, 0 where none were added "
     "(ferry_trace_flops_all)."},
    {"resident", (PyCFunction)engine_resident, METH_O,
     "resident(nbytes) -> Resident: a buffer of the pinned arena living on the host "
     "(ferry_resident_create; FerryError FERRY_ECAP past the host cap)."},
    {"trim", (PyCFunction)engine_trim, METH_VARARGS,
     "trim(keep_bytes=0) -> int: give the pinned arena's free memory back to the OS, keeping "
     "keep_bytes reserved; returns the bytes given back (ferry_arena_trim)."},
    {"snapshot", (PyCFunction)engine_snapshot, METH_VARARGS,
     "snapshot(path, records) -> Snapshot: start a checkpoint snapshot (ferry_snapshot_start). "
     "records: (name, bytes-like) for host bytes copied now, or (name, data_ptr, nbytes, owner, "
     "is_host) for memory read later (device) or now (is_host); owner is kept until fence()."},
    {NULL}};

PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A ferry engine whose owner tokens are torch tensors.",
    .tp_new = engine_new,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_traverse = (traverseproc)engine_traverse,
    .tp_clear = (inquiry)engine_clear,
    .tp_methods = engine_methods,
    .tp_getset = engine_getset,
    .tp_weaklistoffset = offsetof(EngineObject, weakreflist),
};

