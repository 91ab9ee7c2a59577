/*
 * ext.h — what the parts of the _ferry extension share (private).
 *
 * Parts: module.c (init, module functions), tensor.c (torch objects,
 * interned names, dtypes), engine.c (Engine), hooks.c (pack/unpack hooks,
 * Handle: the hot path), sites.c (module site hooks), snapshot.c (Snapshot),
 * policy.c (PolicyInstance), resident.c (Resident), nodecap.c (NodeCap).
 * docs/pytorch.md explains the design.
 */
#ifndef FERRY_PY_EXT_H
#define FERRY_PY_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ferry.h"
#include "torch_facts.h"

/* Internal linkage in all but name: the module exports PyInit__ferry only,
 * and hidden declarations keep cross-part accesses as direct as static ones. */
#pragma GCC visibility push(hidden)

/* ---- torch objects (tensor.c), looked up on first engine creation ----------
 * `import ferry` must work without torch, so nothing here is touched at
 * module import. */
typedef struct torch_objects {
  int ready;
  PyObject *torch;        /* module */
  PyTypeObject *tensor;   /* torch.Tensor */
  PyTypeObject *param;    /* torch.nn.Parameter */
  PyObject *strided;      /* torch.strided */
  PyObject *uint8;        /* torch.uint8 */
  PyObject *empty;        /* torch.empty */
  PyObject *empty_strided; /* torch.empty_strided */
  PyObject *cuda_current_stream; /* torch.cuda.current_stream, or NULL */
  /* torch.autograd.Variable._execution_engine.queue_callback, looked up at
   * the first backward (NULL: not yet, or this torch has none) */
  PyObject *queue_callback;
  int queue_callback_looked_up;
  /* torch.ops.profiler._record_function_enter_new / _exit, looked up the
   * first time an engine's calls are wrapped in profiler ranges */
  PyObject *rf_enter, *rf_exit;
  int has_is_nested;
  int has_is_cpu;         /* Tensor.is_cpu exists (one attribute read instead of device.type) */
  int has_untyped_storage; /* torch >= 2.0; else _storage() (storage() is Python code) */
} torch_objects;
extern torch_objects T;

/* Interned attribute names (tensor.c). */
extern PyObject *s_numel, *s_dtype, *s_requires_grad, *s_is_leaf, *s_data, *s_layout,
    *s_is_nested, *s_shape, *s_stride, *s_data_ptr, *s_base, *s_is_cuda, *s_get_device,
    *s_as_strided, *s_view, *s_storage_offset, *s_cuda_stream, *s_itemsize, *s_element_size,
    *s_device, *s_version, *s_detach, *s_is_cpu, *s_cdata, *s_nbytes, *s_items, *s_module,
    *s_qualname, *s_untyped_storage, *s_storage_c, *s_grad_fn, *s_next_functions, *s_variable;

/* ---- tensor attributes on the hot path (tensor.c) ----------------------------
 * PyObject_GetAttr on a tensor walks torch.Tensor's type dictionaries (and,
 * for a method, builds a bound method) before torch's own getter runs: a
 * third of an attribute read. These slots hold what the lookup finds on
 * torch.Tensor -- a getset descriptor's getter, a method descriptor -- so a
 * read calls it directly. Only for exact torch.Tensor / nn.Parameter
 * objects, and only where Parameter resolves the name to the same
 * descriptor; anything else takes the generic lookup. */
enum tensor_attr {
  TA_DTYPE, TA_SHAPE, TA_LAYOUT, TA_VERSION, TA_REQUIRES_GRAD, TA_IS_LEAF, TA_IS_NESTED,
  TA_IS_CPU, TA_BASE, /* attributes */
  TA_DATA_PTR, TA_STRIDE, TA_DETACH, /* methods, called without arguments */
  TA_COUNT_
};
typedef struct tensor_attr_slot {
  PyObject *name;   /* interned */
  getter get;       /* a getset descriptor's getter, or NULL */
  void *closure;
  PyObject *method; /* a method descriptor (vectorcall with the tensor), or NULL */
  int is_method;
} tensor_attr_slot;
extern tensor_attr_slot TA[TA_COUNT_];

static inline PyObject *tensor_attr(PyObject *t, int a) {
  const tensor_attr_slot *s = &TA[a];
  if (Py_TYPE(t) == T.tensor || Py_TYPE(t) == T.param) {
    if (s->get) return s->get(t, s->closure);
    if (s->method) return PyObject_Vectorcall(s->method, &t, 1, NULL);
  }
  return s->is_method ? PyObject_CallMethodNoArgs(t, s->name) : PyObject_GetAttr(t, s->name);
}

/* ---- dtypes ------------------------------------------------------------------
 * torch.dtype objects are singletons: a short table keyed by identity. */
typedef struct dtype_info {
  PyObject *dtype; /* borrowed forever: dtypes are immortal in practice; we hold a ref */
  int32_t ferry;
  uint32_t itemsize;
} dtype_info;
#define MAX_DTYPES 48
extern dtype_info dtypes[MAX_DTYPES];
extern int n_dtypes;


const dtype_info *dtype_add(PyObject *dtype);

/* ---- tensor facts from the running torch's own headers (tensor.c) -----------
 * NULL unless ferry.torch loaded the _torchfacts module built for this torch
 * (torch_facts.h); then the hooks read a plain tensor's dtype, shape, data
 * pointer and version with one call, and fall back to the getters when it
 * declines. dtype_by_scalar caches each c10::ScalarType's dtype_info. */
extern const ferry_facts_api *FACTS;
#define MAX_SCALAR_TYPES 64
const dtype_info *dtype_of_scalar(PyObject *t, int32_t scalar_type);
PyObject *mod_set_tensor_facts(PyObject *self, PyObject *arg);

/* The entry for dtype, added on first sight; NULL with an exception set on
 * failure. Inline: the pack hook calls it for every saved tensor. */
static inline const dtype_info *dtype_lookup(PyObject *dtype) {
  for (int i = 0; i < n_dtypes; i++)
    if (dtypes[i].dtype == dtype) return &dtypes[i];
  return dtype_add(dtype);
}
int intern_names(void);
int torch_init(void);
/* "torch.bfloat16" -> FERRY_DTYPE_BF16 */
int32_t ferry_dtype_of_name(const char *name);

/* ---- engine (engine.c) --------------------------------------------------------- */
typedef struct site {
  const char *path; /* interned in the engine */
  const char *cls;
  int32_t layer, layer_count;
} site;

typedef struct param_range {
  uintptr_t lo, hi; /* [lo, hi) of a parameter's or buffer's storage */
  int32_t kind;     /* FERRY_KIND_PARAMETER or FERRY_KIND_BUFFER */
} param_range;

/* Why a saved tensor was kept without reaching the engine. */
enum keep_reason {
  KEEP_SMALL,     /* under min_offload_bytes: the fast path */
  KEEP_SUBCLASS,  /* a tensor subclass: its storage is not ours to copy */
  KEEP_SPARSE,    /* not a strided layout */
  KEEP_NESTED,
  KEEP_DEVICE,    /* not on the backend's device */
  KEEP_NON_DENSE, /* overlapping or gapped strides (expand, strided slices) */
  KEEP_NDIM,      /* more than FERRY_MAX_DIMS dimensions */
  KEEP_ERROR,     /* the engine refused the pack: see pack_errors */
  KEEP_REASONS_
};
extern const char *keep_reason_names[KEEP_REASONS_];

typedef struct EngineObject EngineObject;
typedef struct KeptObject KeptObject;

typedef struct {
  PyObject_HEAD vectorcallfunc vectorcall;
  EngineObject *eng;
} HookObject;

struct EngineObject {
  PyObject_HEAD ferry_engine *e;
  int backend;        /* ferry_backend_kind */
  int device_index;   /* cuda ordinal */
  PyObject *alloc_kw; /* {"dtype": torch.uint8, "device": ...} for device_alloc */
  uint64_t min_bytes; /* fast keep threshold */
  int fast_keep;      /* off while recording a trace: every tensor is traced */
  int release_when_copied, prefetch_at_backward_begin; /* the config's, for info() */
  int in_backward;    /* an unpack happened in this step */
  /* torch's profiler was on when the step's offload context was entered:
   * pack and unpack calls are record_function ranges (hooks.c) */
  int profile_ranges;
  uint64_t backwards; /* backward phases begun: names the one a callback ends */
  site *sites;
  uint32_t n_sites, cap_sites;
  int32_t *stack;
  uint32_t depth, cap_stack;
  param_range *params;
  uint32_t n_params;
  uint64_t kept[KEEP_REASONS_];
  uint64_t recompute_packs, rebuilds, pack_errors, unpacks_repeated;
  uint64_t allocs_live; /* device_alloc buffers not yet released: debug aid */
  PyObject *pack_hook, *unpack_hook;
  PyObject *on_backward_end; /* callable or NULL: called as a backward ends (hooks.c) */
  PyObject *last_pack_error; /* str or NULL */
  struct HandleObject *unpacking; /* the handle in ferry_unpack, for device_alloc */
  PyObject *node_cap;        /* NodeCap kept alive while the engine uses it */
  KeptObject *kept_live;     /* this step's kept tensors still alive (hooks.c) */
  PyObject *weakreflist;
  /* Every initialised engine is on one list, so that a forked child can
   * mark its parent's engines unusable: their copy threads (and snapshot
   * writers) did not fork, and a call into them would wait forever. */
  EngineObject *live_prev, *live_next;
  int on_live_list;
  int forked; /* the parent's engine, seen from a forked child */
  /* Resident buffers holding arena memory: torch.frombuffer views of them
   * read it, so close() leaves the engine to the last one (closing). */
  Py_ssize_t residents_live;
  ferry_engine *closing;
  /* engine calls in progress (engine_call_begin): their callbacks run
   * Python, which may close the engine; it is destroyed after them */
  int calls;
};

/* What a pack returns for a tensor given to the engine (hooks.c). */
typedef struct HandleObject {
  PyObject_HEAD EngineObject *eng;
  ferry_handle h;   /* 0 once unpacked */
  /* weakrefs to tensors sharing the saved tensor's version counter (the
   * tensor, its base if a view, the alias the engine holds): the first one
   * alive is checked at unpack; NULL slots unused */
  PyObject *sharers[3];
  int64_t version;  /* the saved tensor's version when it was packed */
  int32_t site;     /* innermost module site when packed, -1 if none */
  PyObject *dtype;  /* torch.dtype */
  PyObject *result; /* the unpacked tensor, for a second unpack (retain_graph) */
  int32_t ndim;
  int64_t shape[FERRY_MAX_DIMS];
  int64_t strides[FERRY_MAX_DIMS];
} HandleObject;

typedef struct {
  PyObject_HEAD ferry_node_budget *nb;
} NodeCapObject;

/* Kind of the storage holding ptr: a parameter/buffer range, or activation.
 * Ranges may nest (a flat buffer and views into it), so after the binary
 * search look back over ranges that start before ptr. */
static inline int32_t kind_of_ptr(const EngineObject *self, uintptr_t p) {
  uint32_t lo = 0, hi = self->n_params;
  while (lo < hi) { /* first range with start > p */
    uint32_t mid = (lo + hi) / 2;
    if (self->params[mid].lo <= p) lo = mid + 1;
    else hi = mid;
  }
  for (uint32_t i = lo; i-- > 0;) {
    if (p < self->params[i].hi) return self->params[i].kind;
    if (lo - i > 8) break; /* nesting deeper than this is not a real model */
  }
  return FERRY_KIND_ACTIVATION;
}

extern PyTypeObject EngineType, HandleType, KeptType, PackHookType, UnpackHookType, SiteHookType,
    NodeCapType, SnapshotType, PolicyInstanceType, ResidentType, StorageFilterType;
extern PyObject *FerryError; /* ferry.FerryError(RuntimeError) */

/* engine.c */
PyObject *raise_ferry(int code, const char *msg);
int engine_live(EngineObject *self);
/* Once, at module init: after a fork(), the child's engines are its
 * parent's and are marked (forked = 1, e = NULL; never destroyed there). */
int engines_watch_fork(void);
/* The error for a call into a forked child's inherited engine. */
PyObject *raise_forked(void);
/* 1 when an object of eng holding h (a snapshot, a resident buffer) can be
 * used; else 0 with the error: forked, or gone (what freed h). */
int owned_live(EngineObject *eng, const void *h, const char *gone);
/* hooks.c */
PyObject *make_hook(PyTypeObject *type, EngineObject *eng);
/* at step end and close: the step's live kept tensors stop being tracked;
 * -1 with an exception set if an alias could not be made */
int kept_end_step(EngineObject *eng);
PyObject *empty_like_handle(EngineObject *self, uint64_t bytes);
PyObject *int_tuple(const int64_t *v, int32_t n);
/* torch.cuda.current_stream() of a cuda engine, else NULL */
void *compute_stream(EngineObject *eng);
PyObject *compute_stream_object(EngineObject *eng);
/* profiler_ranges.c: a torch profiler range named "ferry WHAT: <module
 * path>" while the profiler runs (NULL when none could be made); its exit,
 * which keeps a raised error raised */
PyObject *range_enter(EngineObject *eng, const char *what, int32_t site_id);
void range_exit(PyObject *h);
/* sites.c */
PyObject *engine_site_hooks(EngineObject *self, PyObject *arg);
/* snapshot.c */
PyObject *engine_snapshot(EngineObject *self, PyObject *args);
PyObject *describe_walk(PyObject *unused, PyObject *args);
/* resident.c */
PyObject *engine_resident(EngineObject *self, PyObject *arg);
PyObject *engine_trim(EngineObject *self, PyObject *args);
/* A Resident of eng gave its arena memory back (closed or freed): a
 * close() that waited for it destroys the engine now. */
void engine_resident_gone(EngineObject *eng);
/* Around a ferry call that may run Python (release, device_alloc, a wait
 * letting the GIL go): a close() meanwhile destroys the engine only once
 * the call returned. begin returns the engine (non-NULL: check first). */
ferry_engine *engine_call_begin(EngineObject *eng);
void engine_call_end(EngineObject *eng);
/* nodecap.c */
PyObject *nodecap_unlink(PyObject *unused, PyObject *arg);

#pragma GCC visibility pop
#endif
