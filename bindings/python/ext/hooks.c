/*
 * hooks.c — the hot path: PackHook / UnpackHook, C callables handed to
 * saved_tensors_hooks so a saved tensor costs no Python frame (tiny tensors
 * take a fast keep path that never reaches the engine), and what a pack
 * returns: a Handle (the engine holds the tensor; its deallocation discards
 * the engine handle) or a Kept (the tensor stays as it is). Both carry the
 * tensor's version at pack time: torch skips its in-place check for tensors
 * saved through hooks, so unpack does it.
 */
#include "ext.h"

/* ---- Handle ------------------------------------------------------------------- */
static void handle_dealloc(HandleObject *self) {
  if (self->h && self->eng && self->eng->e) {
    ferry_discard(engine_call_begin(self->eng), self->h);
    engine_call_end(self->eng);
  }
  for (int i = 0; i < 3; i++) Py_XDECREF(self->sharers[i]);
  Py_XDECREF(self->result);
  Py_XDECREF(self->dtype);
  Py_XDECREF(self->eng);
  PyObject_Free(self);
}

static PyObject *handle_repr(HandleObject *self) {
  return PyUnicode_FromFormat("<ferry handle 0x%llx%s>", (unsigned long long)self->h,
                              self->h ? "" : " (unpacked)");
}

PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A saved tensor held by a ferry engine.",
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_repr = (reprfunc)handle_repr,
};

/* ---- Kept ---------------------------------------------------------------------
 * A kept tensor is stored as itself: torch gets back the very tensor it
 * packed, as from a no-op hook pair. A tensor with a grad_fn may be an output
 * of the node saving it; then grad_fn -> saved variable -> Kept -> tensor ->
 * grad_fn is a C++ reference cycle that Python's gc cannot see, and a graph
 * dropped without backward would never be freed. Backward breaks it (the
 * node releases its saved variables), so the step's Kepts are listed in
 * their engine, and those still alive when the step ends, or the engine
 * closes, swap their tensor for a detached alias (same storage, same version
 * counter, no grad_fn): a dropped graph is freed then, and only such Kepts
 * pay for an alias. */
struct KeptObject {
  PyObject_HEAD PyObject *tensor; /* the tensor, or a detached alias sharing its version counter */
  PyObject *origin;               /* weakref to the tensor when `tensor` is an alias */
  int64_t version;
  int32_t site;
  EngineObject *eng;              /* listed in eng->kept_live while eng is set */
  KeptObject *prev, *next;
};

static void kept_unlist(KeptObject *k) {
  if (!k->eng) return;
  if (k->prev) k->prev->next = k->next;
  else k->eng->kept_live = k->next;
  if (k->next) k->next->prev = k->prev;
  k->prev = k->next = NULL;
  Py_CLEAR(k->eng);
}

/* Freed Kepts are reused (one per saved tensor: the allocator's malloc and
 * free were a tenth of a keep's pack + unpack). Touched under the GIL only. */
#define KEPT_FREE_MAX 256
static KeptObject *kept_free[KEPT_FREE_MAX];
static int n_kept_free;

static KeptObject *kept_alloc(void) {
  if (!n_kept_free) return PyObject_New(KeptObject, &KeptType);
  KeptObject *k = kept_free[--n_kept_free];
  return (KeptObject *)PyObject_Init((PyObject *)k, &KeptType);
}

static void kept_dealloc(KeptObject *self) {
  kept_unlist(self);
  Py_XDECREF(self->tensor);
  Py_XDECREF(self->origin);
  if (n_kept_free < KEPT_FREE_MAX) kept_free[n_kept_free++] = self;
  else PyObject_Free(self);
}

PyTypeObject KeptType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Kept",
    .tp_basicsize = sizeof(KeptObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A saved tensor ferry left where it was, with its version at pack time.",
    .tp_dealloc = (destructor)kept_dealloc,
};

/* ---- hooks ---------------------------------------------------------------------- */
static PyObject *pack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames);
static PyObject *unpack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames);

PyObject *make_hook(PyTypeObject *type, EngineObject *eng) {
  HookObject *h = PyObject_GC_New(HookObject, type);
  if (!h) return NULL;
  h->vectorcall = type == &PackHookType ? pack_vectorcall : unpack_vectorcall;
  Py_INCREF(eng);
  h->eng = eng;
  PyObject_GC_Track(h);
  return (PyObject *)h;
}

static int hook_traverse(HookObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->eng);
  return 0;
}

static int hook_clear(HookObject *self) {
  Py_CLEAR(self->eng);
  return 0;
}

static void hook_dealloc(HookObject *self) {
  PyObject_GC_UnTrack(self);
  hook_clear(self);
  PyObject_GC_Del(self);
}

/* t, or a detached alias of it when t has a grad_fn (requires grad, not a
 * leaf): what may be held beyond backward without owning the graph. The
 * grad_fn may own the saved variable holding t (t an output of the node
 * saving it): a C++ reference cycle Python's gc cannot see. The alias shares
 * t's storage and version counter. For the owner the engine holds, and for
 * Kepts alive at the step's end (kept_end_step). */
static PyObject *keep_object(PyObject *t) {
  PyObject *rg = tensor_attr(t, TA_REQUIRES_GRAD);
  if (!rg) return NULL;
  int needs_alias = rg == Py_True;
  Py_DECREF(rg);
  if (needs_alias) {
    PyObject *leaf = tensor_attr(t, TA_IS_LEAF);
    if (!leaf) return NULL;
    needs_alias = leaf == Py_False;
    Py_DECREF(leaf);
  }
  if (needs_alias) return tensor_attr(t, TA_DETACH);
  Py_INCREF(t);
  return t;
}

static int read_version(PyObject *t, int64_t *v) {
  if (FACTS && (Py_TYPE(t) == T.tensor || Py_TYPE(t) == T.param) && FACTS->version(t, v) == 0)
    return 0;
  PyObject *o = tensor_attr(t, TA_VERSION);
  if (!o) return -1;
  *v = PyLong_AsLongLong(o);
  Py_DECREF(o);
  return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

static int32_t current_site(EngineObject *eng) {
  return eng->depth && (uint32_t)eng->stack[eng->depth - 1] < eng->n_sites
             ? eng->stack[eng->depth - 1] : -1;
}

/* A Kept of t at version *version (NULL: read it). */
static PyObject *make_kept_at(EngineObject *eng, PyObject *t, const int64_t *version) {
  KeptObject *k = kept_alloc();
  if (!k) return NULL;
  k->tensor = k->origin = NULL;
  k->eng = NULL;
  k->prev = k->next = NULL;
  k->site = current_site(eng);
  if (version) {
    k->version = *version;
  } else if (read_version(t, &k->version) < 0) {
    Py_DECREF(k);
    return NULL;
  }
  Py_INCREF(t);
  k->tensor = t;
  Py_INCREF(eng);
  k->eng = eng;
  k->next = eng->kept_live;
  if (k->next) k->next->prev = k;
  eng->kept_live = k;
  return (PyObject *)k;
}

static PyObject *make_kept(EngineObject *eng, PyObject *t) { return make_kept_at(eng, t, NULL); }

/* The step's live Kepts leave the list; those holding a tensor that may own
 * them through its grad_fn hold a detached alias instead (see Kept). */
int kept_end_step(EngineObject *eng) {
  int rc = 0;
  while (eng->kept_live) {
    KeptObject *k = eng->kept_live;
    Py_INCREF(k);
    kept_unlist(k);
    PyObject *t = k->tensor, *alias = rc ? NULL : keep_object(t);
    if (!alias) {
      rc = -1; /* the rest are only unlisted: the list must end empty */
    } else if (alias != t) {
      PyObject *origin = PyWeakref_NewRef(t, NULL);
      if (!origin) {
        Py_DECREF(alias);
        rc = -1;
      } else {
        k->origin = origin;
        k->tensor = alias;
        Py_DECREF(t);
      }
    } else {
      Py_DECREF(alias);
    }
    Py_DECREF(k);
  }
  return rc;
}

static PyObject *keep_with(EngineObject *eng, PyObject *t, int reason) {
  eng->kept[reason]++;
  return make_kept(eng, t);
}

static int read_int_tuple(PyObject *tup, int64_t *out, int32_t *n) {
  if (!PyTuple_Check(tup)) {
    PyErr_SetString(PyExc_TypeError, "ferry: expected a tuple of ints");
    return -1;
  }
  Py_ssize_t len = PyTuple_GET_SIZE(tup);
  if (len > FERRY_MAX_DIMS) {
    *n = (int32_t)len;
    return 1;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tup, i));
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  *n = (int32_t)len;
  return 0;
}

/* Whether the elements of (shape, strides) cover exactly numel consecutive
 * slots from the first one: dense and non-overlapping, any order (a
 * transpose or permute of a contiguous block). Then the tensor's bytes are
 * [data_ptr, data_ptr + numel * itemsize) and can be copied as one span. */
static int dense_span(int32_t ndim, const int64_t *shape, const int64_t *strides, int *contig) {
  int32_t order[FERRY_MAX_DIMS], n = 0;
  int64_t expect = 1;
  *contig = 1;
  for (int32_t i = ndim - 1; i >= 0; i--) {
    if (shape[i] == 0) return 1; /* empty: caught earlier by bytes == 0 */
    if (shape[i] != 1 && strides[i] != expect) *contig = 0;
    if (shape[i] != 1) expect *= shape[i];
  }
  if (*contig) return 1;
  for (int32_t i = 0; i < ndim; i++)
    if (shape[i] != 1) order[n++] = i;
  /* insertion sort by stride ascending */
  for (int32_t i = 1; i < n; i++) {
    int32_t k = order[i], j = i - 1;
    while (j >= 0 && strides[order[j]] > strides[k]) {
      order[j + 1] = order[j];
      j--;
    }
    order[j + 1] = k;
  }
  expect = 1;
  for (int32_t i = 0; i < n; i++) {
    if (strides[order[i]] != expect) return 0;
    expect *= shape[order[i]];
  }
  return 1;
}

/* torch.cuda.current_stream(the engine's device): the engine device's
 * stream, not the thread's current device's (they differ on a thread whose
 * current device was never set). NULL with an exception on error. */
PyObject *compute_stream_object(EngineObject *eng) {
  PyObject *dev = PyLong_FromLong(eng->device_index);
  PyObject *s = dev ? PyObject_CallOneArg(T.cuda_current_stream, dev) : NULL;
  Py_XDECREF(dev);
  return s;
}

void *compute_stream(EngineObject *eng) {
  if (eng->backend != FERRY_BACKEND_CUDA) return NULL;
  PyObject *s = compute_stream_object(eng);
  if (!s) return NULL;
  PyObject *p = PyObject_GetAttr(s, s_cuda_stream);
  Py_DECREF(s);
  if (!p) return NULL;
  void *ptr = PyLong_AsVoidPtr(p);
  Py_DECREF(p);
  return ptr;
}

/* The helpers of pack_impl below return -1 (exception set), a keep_reason,
 * or PACK_ON to go on. Each has one caller and is inlined into it. */
#define PACK_ON KEEP_REASONS_

/* Whether t lives where the engine's backend can copy it from. */
static int pack_check_device(EngineObject *eng, PyObject *t) {
  PyObject *v;
  if (eng->backend != FERRY_BACKEND_CUDA && T.has_is_cpu) {
    /* host memory or not, in one attribute read (t.device.type costs a
     * device object and a string: several times as much) */
    v = tensor_attr(t, TA_IS_CPU);
    if (!v) return -1;
    int cpu = v == Py_True;
    Py_DECREF(v);
    return cpu ? PACK_ON : KEEP_DEVICE;
  }
  v = PyObject_GetAttr(t, s_is_cuda);
  if (!v) return -1;
  int is_cuda = v == Py_True;
  Py_DECREF(v);
  if (eng->backend == FERRY_BACKEND_CUDA) {
    if (!is_cuda) return KEEP_DEVICE;
    v = PyObject_CallMethodNoArgs(t, s_get_device);
    if (!v) return -1;
    long dev = PyLong_AsLong(v);
    Py_DECREF(v);
    return dev == eng->device_index ? PACK_ON : KEEP_DEVICE;
  }
  if (is_cuda) return KEEP_DEVICE;
  v = PyObject_GetAttr(t, s_device); /* meta, mps, xla...: not host memory */
  if (!v) return -1;
  PyObject *ty = PyObject_GetAttrString(v, "type");
  Py_DECREF(v);
  if (!ty) return -1;
  int cpu = PyUnicode_CompareWithASCIIString(ty, "cpu") == 0;
  Py_DECREF(ty);
  return cpu ? PACK_ON : KEEP_DEVICE;
}

/* A strided layout (not sparse): PACK_ON. */
static int pack_check_strided(PyObject *t) {
  PyObject *v = tensor_attr(t, TA_LAYOUT);
  if (!v) return -1;
  int strided = v == T.strided;
  Py_DECREF(v);
  return strided ? PACK_ON : KEEP_SPARSE;
}

/* Not nested, on the right device: PACK_ON. */
static int pack_check(EngineObject *eng, PyObject *t) {
  if (!eng->e) return KEEP_ERROR;
  if (T.has_is_nested) {
    PyObject *v = tensor_attr(t, TA_IS_NESTED);
    if (!v) return -1;
    int nested = v == Py_True;
    Py_DECREF(v);
    if (nested) return KEEP_NESTED;
  }
  return pack_check_device(eng, t);
}

/* The data pointer of t; NULL with an exception set on error. */
static void *pack_data_ptr(PyObject *t) {
  PyObject *v = tensor_attr(t, TA_DATA_PTR);
  if (!v) return NULL;
  void *ptr = PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  return ptr;
}

/* Strides and view flag of t (its shape already in d) into d and strides. */
static int pack_layout(PyObject *t, ferry_tensor_desc *d, int64_t *strides) {
  int32_t nstrides = 0;
  PyObject *v = tensor_attr(t, TA_STRIDE);
  if (!v) return -1;
  int r = read_int_tuple(v, strides, &nstrides);
  Py_DECREF(v);
  if (r) return r < 0 ? -1 : KEEP_NDIM;
  int contig;
  if (!dense_span(d->ndim, d->shape, strides, &contig)) return KEEP_NON_DENSE;
  v = tensor_attr(t, TA_BASE);
  if (!v) return -1;
  int is_view = v != Py_None;
  Py_DECREF(v);
  d->flags = (is_view ? FERRY_FLAG_VIEW : 0) | (contig ? FERRY_FLAG_CONTIGUOUS : 0);
  return PACK_ON;
}

/* Whether t is autocast's cast of a parameter (a half-precision copy whose
 * grad_fn is a ToCopyBackward0 fed by a Parameter's AccumulateGrad): a
 * weight, though a new tensor. Errors read as no. */
static int is_cast_of_parameter(PyObject *t) {
  PyObject *gf = PyObject_GetAttr(t, s_grad_fn), *nf = NULL, *var = NULL;
  int r = 0;
  const char *name = gf && gf != Py_None ? Py_TYPE(gf)->tp_name : "";
  size_t n = strlen(name);
  if (n >= 15 && strcmp(name + n - 15, "ToCopyBackward0") == 0 &&
      (nf = PyObject_GetAttr(gf, s_next_functions)) && PyTuple_Check(nf) &&
      PyTuple_GET_SIZE(nf) >= 1 && PyTuple_Check(PyTuple_GET_ITEM(nf, 0)) &&
      PyTuple_GET_SIZE(PyTuple_GET_ITEM(nf, 0)) >= 1) {
    PyObject *node = PyTuple_GET_ITEM(PyTuple_GET_ITEM(nf, 0), 0);
    if (node != Py_None && (var = PyObject_GetAttr(node, s_variable)))
      r = PyObject_TypeCheck(var, T.param);
  }
  Py_XDECREF(var);
  Py_XDECREF(nf);
  Py_XDECREF(gf);
  PyErr_Clear();
  return r;
}

/* The kind of t at ptr: its parameter or buffer range when the context was
 * told the model, else a parameter by what it is, whatever model (or none)
 * the context was told of: an nn.Parameter (FSDP2's unsharded parameters
 * are), a view of one (weight.t(); FSDP's views of its flat parameter), or
 * autocast's cast of one. */
/* is_view: 0 when the torch-facts module said t is no view (its _base is
 * None, not read then), else 1 or -1 (unknown: read _base). */
static int32_t kind_of_tensor(EngineObject *eng, PyObject *t, void *ptr, int32_t dtype,
                              int is_view) {
  int32_t kind = kind_of_ptr(eng, (uintptr_t)ptr);
  if (kind != FERRY_KIND_ACTIVATION) return kind;
  /* t is an exact Tensor or Parameter (pack_impl): no MRO walk */
  if (Py_TYPE(t) == T.param) return FERRY_KIND_PARAMETER;
  if (is_view == 0) {
    int half = dtype == FERRY_DTYPE_BF16 || dtype == FERRY_DTYPE_F16;
    return half && is_cast_of_parameter(t) ? FERRY_KIND_PARAMETER : kind;
  }
  PyObject *base = tensor_attr(t, TA_BASE);
  if (!base) {
    PyErr_Clear();
    return kind;
  }
  PyObject *whole = base != Py_None ? base : t; /* autocast saves a view of its cast */
  int param = PyObject_TypeCheck(whole, T.param) ||
              ((dtype == FERRY_DTYPE_BF16 || dtype == FERRY_DTYPE_F16) &&
               is_cast_of_parameter(whole));
  Py_DECREF(base);
  return param ? FERRY_KIND_PARAMETER : kind;
}

/* Kind, phase and the innermost module site of the tensor t at ptr
 * (is_view: as kind_of_tensor's). */
static void pack_describe(EngineObject *eng, ferry_tensor_desc *d, PyObject *t, void *ptr,
                          int is_view) {
  d->kind = kind_of_tensor(eng, t, ptr, d->dtype, is_view);
  if (d->kind == FERRY_KIND_PARAMETER) d->flags |= FERRY_FLAG_RESIZABLE; /* FSDP's resize_(0) */
  d->phase = eng->in_backward ? FERRY_PHASE_RECOMPUTE : FERRY_PHASE_FORWARD;
  if (eng->depth && (uint32_t)eng->stack[eng->depth - 1] < eng->n_sites) {
    const site *s = &eng->sites[eng->stack[eng->depth - 1]];
    d->module_path = s->path;
    d->module_class = s->cls;
    d->layer = s->layer;
    d->layer_count = s->layer_count;
  } else {
    d->layer = -1;
  }
}

static HandleObject *new_handle(EngineObject *eng, const ferry_tensor_desc *d,
                                const int64_t *strides, PyObject *dtype) {
  HandleObject *hd = PyObject_New(HandleObject, &HandleType);
  if (!hd) return NULL;
  hd->h = 0;
  hd->result = NULL;
  hd->sharers[0] = hd->sharers[1] = hd->sharers[2] = NULL;
  hd->site = current_site(eng);
  hd->ndim = d->ndim;
  memcpy(hd->shape, d->shape, sizeof hd->shape);
  memcpy(hd->strides, strides, sizeof hd->strides);
  hd->dtype = dtype;
  Py_INCREF(hd->dtype);
  Py_INCREF(eng);
  hd->eng = eng;
  return hd;
}

/* The identity of t's storage (its StorageImpl's address) for
 * ferry_pack_keyed: while the engine holds t no other storage has it, even
 * when t's bytes were freed (resize_(0)) and the address reused. -1 with an
 * exception set on error. */
static int storage_key(PyObject *t, uint64_t *out) {
  /* torch 1.13: _storage, the C method under storage() (a Python wrapper:
   * Python code run inside the hook would raise a pending Ctrl-C there,
   * which autograd turns into a RuntimeError instead of KeyboardInterrupt) */
  PyObject *st = PyObject_CallMethodNoArgs(t, T.has_untyped_storage ? s_untyped_storage
                                                                     : s_storage_c);
  PyObject *cdata = st ? PyObject_GetAttr(st, s_cdata) : NULL;
  Py_XDECREF(st);
  if (!cdata) return -1;
  *out = PyLong_AsUnsignedLongLongMask(cdata);
  Py_DECREF(cdata);
  return PyErr_Occurred() ? -1 : 0;
}

/* Gives t to the engine: a Handle, or t kept as is if the engine refuses. */
static PyObject *pack_to_engine(EngineObject *eng, PyObject *t, const ferry_tensor_desc *d,
                                const int64_t *strides, PyObject *dtype, void *ptr) {
  HandleObject *hd = new_handle(eng, d, strides, dtype);
  if (!hd) return NULL;
  PyObject *base = NULL;
  PyObject *owner = read_version(t, &hd->version) < 0 ? NULL : keep_object(t);
  if (!owner || !(hd->sharers[0] = PyWeakref_NewRef(t, NULL)) ||
      (owner != t && !(hd->sharers[1] = PyWeakref_NewRef(owner, NULL))) ||
      ((d->flags & FERRY_FLAG_VIEW) &&
       (!(base = tensor_attr(t, TA_BASE)) || !(hd->sharers[2] = PyWeakref_NewRef(base, NULL))))) {
    Py_XDECREF(base);
    Py_XDECREF(owner);
    Py_DECREF(hd);
    return NULL;
  }
  Py_XDECREF(base);
  uint64_t storage = 0;
  void *stream = storage_key(t, &storage) < 0 ? NULL : compute_stream(eng);
  if (PyErr_Occurred()) {
    Py_DECREF(owner);
    Py_DECREF(hd);
    return NULL;
  }
  ferry_handle h = 0;
  PyObject *range = eng->profile_ranges ? range_enter(eng, "pack", hd->site) : NULL;
  /* aliases by storage and version, not address: an address written in
   * place, or freed and reused, since it was packed holds other bytes */
  int rc = ferry_pack_keyed(engine_call_begin(eng), d, ptr, owner, stream, storage,
                            hd->version, &h);
  engine_call_end(eng);
  range_exit(range);
  if (rc) {
    /* Nothing is lost: the tensor is kept as a plain saved tensor. */
    eng->pack_errors++;
    eng->kept[KEEP_ERROR]++;
    Py_XSETREF(eng->last_pack_error, PyUnicode_FromString(ferry_last_error(eng->e)));
    if (!eng->last_pack_error) PyErr_Clear();
    Py_DECREF(hd);
    Py_DECREF(owner);
    return make_kept(eng, t);
  }
  hd->h = h;
  return (PyObject *)hd;
}

/* Shape (its first FERRY_MAX_DIMS sizes; ndim may be more) and bytes of t
 * into d. -1 with an exception set; KEEP_NESTED for a nested tensor, which
 * has no shape. */
static int pack_shape(PyObject *t, const dtype_info *di, ferry_tensor_desc *d) {
  PyObject *v = tensor_attr(t, TA_SHAPE);
  if (!v) {
    if (!T.has_is_nested || !PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1;
    PyObject *exc_type, *exc, *tb; /* torch's error stays if t is not nested */
    PyErr_Fetch(&exc_type, &exc, &tb);
    PyObject *nested = tensor_attr(t, TA_IS_NESTED);
    int is_nested = nested == Py_True;
    Py_XDECREF(nested);
    if (is_nested) {
      Py_XDECREF(exc_type);
      Py_XDECREF(exc);
      Py_XDECREF(tb);
      return KEEP_NESTED;
    }
    PyErr_Restore(exc_type, exc, tb);
    return -1;
  }
  if (!PyTuple_Check(v)) {
    Py_DECREF(v);
    PyErr_SetString(PyExc_TypeError, "ferry pack hook: tensor.shape is not a tuple");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(v);
  uint64_t numel = 1;
  for (Py_ssize_t i = 0; i < n; i++) {
    long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(v, i));
    if (x == -1 && PyErr_Occurred()) {
      Py_DECREF(v);
      return -1;
    }
    if (i < FERRY_MAX_DIMS) d->shape[i] = x;
    numel *= (uint64_t)x;
  }
  Py_DECREF(v);
  d->ndim = (int32_t)n;
  d->bytes = numel * di->itemsize;
  d->dtype = di->ferry;
  return PACK_ON;
}

/* The keep paths a saved tensor tries once its dtype and shape are in d,
 * before any layout check (a sparse tensor has no data pointer, and any
 * tensor the policy keeps is kept whatever its layout): small, kept by the
 * binding; or kept as the policy answered before (ferry_pack_cached_keep).
 * ptr and version: what the caller read already, else NULL to read them.
 * 1 and the Kept in *out (NULL on error), or 0 when the full path must run. */
static int pack_try_keep(EngineObject *eng, PyObject *t, ferry_tensor_desc *d, void *ptr,
                         const int64_t *version, int is_view, PyObject **out) {
  if (d->bytes == 0 || (eng->fast_keep && d->bytes < eng->min_bytes)) {
    eng->kept[KEEP_SMALL]++;
    *out = make_kept_at(eng, t, version);
    return 1;
  }
  if (!eng->fast_keep || !eng->e || d->ndim > FERRY_MAX_DIMS) return 0;
  if (!ptr && !(ptr = pack_data_ptr(t))) { /* no storage (a fake or meta tensor): */
    PyErr_Clear();                          /* the full path says why */
    return 0;
  }
  pack_describe(eng, d, t, ptr, is_view);
  if (!ferry_pack_cached_keep(eng->e, d, ptr)) return 0;
  if (eng->in_backward) eng->recompute_packs++;
  *out = make_kept_at(eng, t, version);
  return 1;
}

/* pack_try_keep with the tensor read in one call through the torch-facts
 * module: as it, and 0 also when the module declines. */
static int pack_from_facts(EngineObject *eng, PyObject *t, PyObject **out) {
  ferry_tensor_facts f;
  if (FACTS->read(t, &f) != 0) return 0;
  const dtype_info *di = dtype_of_scalar(t, f.scalar_type);
  if (!di) {
    PyErr_Clear(); /* the full path reads the dtype again and says why */
    return 0;
  }
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  uint64_t numel = 1;
  for (int32_t i = 0; i < f.ndim; i++) {
    d.shape[i] = f.sizes[i];
    numel *= (uint64_t)f.sizes[i];
  }
  d.ndim = f.ndim;
  d.bytes = numel * di->itemsize;
  d.dtype = di->ferry;
  return pack_try_keep(eng, t, &d, f.data, &f.version, f.is_view, out);
}

static PyObject *pack_impl(EngineObject *eng, PyObject *t) {
  PyTypeObject *tp = Py_TYPE(t);
  if (tp != T.tensor && tp != T.param) {
    if (!PyObject_TypeCheck(t, T.tensor))
      return PyErr_Format(PyExc_TypeError, "ferry pack hook: expected a torch.Tensor, got %s",
                          tp->tp_name);
    return keep_with(eng, t, KEEP_SUBCLASS);
  }
  PyObject *fast;
  if (FACTS && pack_from_facts(eng, t, &fast)) return fast;
  PyObject *v = tensor_attr(t, TA_DTYPE);
  if (!v) return NULL;
  const dtype_info *di = dtype_lookup(v);
  Py_DECREF(v);
  if (!di) return NULL;
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  int r = pack_shape(t, di, &d);
  if (r != PACK_ON) return r < 0 ? NULL : keep_with(eng, t, r);
  PyObject *kept;
  if (pack_try_keep(eng, t, &d, NULL, NULL, -1, &kept)) return kept;
  if ((r = pack_check_strided(t)) != PACK_ON) return r < 0 ? NULL : keep_with(eng, t, r);
  if ((r = pack_check(eng, t)) != PACK_ON) return r < 0 ? NULL : keep_with(eng, t, r);
  if (d.ndim > FERRY_MAX_DIMS) return keep_with(eng, t, KEEP_NDIM);
  int64_t strides[FERRY_MAX_DIMS];
  if ((r = pack_layout(t, &d, strides)) != PACK_ON) return r < 0 ? NULL : keep_with(eng, t, r);
  void *ptr = pack_data_ptr(t);
  if (!ptr) return PyErr_Occurred() ? NULL : keep_with(eng, t, KEEP_ERROR);
  pack_describe(eng, &d, t, ptr, -1);
  if (eng->in_backward) eng->recompute_packs++;
  return pack_to_engine(eng, t, &d, strides, di->dtype, ptr);
}

static PyObject *pack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
    PyErr_SetString(PyExc_TypeError, "ferry pack hook takes one tensor");
    return NULL;
  }
  return pack_impl(((HookObject *)callable)->eng, args[0]);
}

static int same_layout(PyObject *t, HandleObject *hd, void *ptr) {
  PyObject *v = tensor_attr(t, TA_DTYPE);
  if (!v) return -1;
  int same = v == hd->dtype;
  Py_DECREF(v);
  if (!same) return 0;
  int64_t buf[FERRY_MAX_DIMS];
  int32_t n = 0;
  v = tensor_attr(t, TA_SHAPE);
  if (!v) return -1;
  int r = read_int_tuple(v, buf, &n);
  Py_DECREF(v);
  if (r) return r < 0 ? -1 : 0;
  if (n != hd->ndim || memcmp(buf, hd->shape, sizeof(int64_t) * (size_t)n)) return 0;
  v = tensor_attr(t, TA_STRIDE);
  if (!v) return -1;
  r = read_int_tuple(v, buf, &n);
  Py_DECREF(v);
  if (r) return r < 0 ? -1 : 0;
  if (n != hd->ndim || memcmp(buf, hd->strides, sizeof(int64_t) * (size_t)n)) return 0;
  v = tensor_attr(t, TA_DATA_PTR);
  if (!v) return -1;
  same = PyLong_AsVoidPtr(v) == ptr;
  Py_DECREF(v);
  return same;
}

PyObject *int_tuple(const int64_t *v, int32_t n) {
  PyObject *t = PyTuple_New(n);
  for (int32_t i = 0; t && i < n; i++) {
    PyObject *x = PyLong_FromLongLong(v[i]);
    if (!x) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, i, x);
  }
  return t;
}

static PyObject *call_method(PyObject *obj, PyObject *name, PyObject *a, PyObject *b,
                             PyObject *c) {
  PyObject *args[4] = {obj, a, b, c};
  size_t n = 1 + (a != NULL) + (b != NULL) + (c != NULL);
  return PyObject_VectorcallMethod(name, args, n | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* A tensor with the handle's dtype, shape and strides over the bytes at ptr
 * held by owner: the owner itself when it already is that (kept, stash hit),
 * else a view of it (a reloaded uint8 buffer, or the first tensor packed
 * for the same bytes when the engine stored them once). Steals owner. */
static PyObject *rebuild(EngineObject *eng, HandleObject *hd, PyObject *owner, void *ptr) {
  /* The very object this handle gave the engine (a kept tensor, or the
   * device buffer a stash hit returns): it is what was packed, so its
   * layout needs no reading. The weakref tells identity safely: it is
   * alive while the engine holds the object, so no other object can have
   * the same address. */
  PyObject *given = PyWeakref_GetObject(hd->sharers[1] ? hd->sharers[1] : hd->sharers[0]);
  if (given == owner) return owner;
  int same = same_layout(owner, hd, ptr);
  if (same) {
    if (same < 0) Py_CLEAR(owner);
    return owner;
  }
  eng->rebuilds++;
  PyObject *flat = NULL, *res = NULL, *shape = NULL, *strides = NULL, *off = NULL, *tmp = NULL;
  PyObject *numel = PyObject_CallMethodNoArgs(owner, s_numel);
  PyObject *ooff = numel ? PyObject_CallMethodNoArgs(owner, s_storage_offset) : NULL;
  PyObject *one = PyLong_FromLong(1);
  PyObject *flat_shape = numel ? PyTuple_Pack(1, numel) : NULL;
  PyObject *flat_stride = one ? PyTuple_Pack(1, one) : NULL;
  /* The owner's bytes in memory order: owner is dense, so these are its
   * numel elements starting at ptr. */
  if (flat_shape && flat_stride && ooff)
    flat = call_method(owner, s_as_strided, flat_shape, flat_stride, ooff);
  if (flat) {
    tmp = call_method(flat, s_view, T.uint8, NULL, NULL);
    Py_XSETREF(flat, tmp ? call_method(tmp, s_view, hd->dtype, NULL, NULL) : NULL);
    Py_XDECREF(tmp);
  }
  if (flat) {
    shape = int_tuple(hd->shape, hd->ndim);
    strides = int_tuple(hd->strides, hd->ndim);
    off = PyObject_CallMethodNoArgs(flat, s_storage_offset);
    if (shape && strides && off) res = call_method(flat, s_as_strided, shape, strides, off);
  }
  Py_XDECREF(numel);
  Py_XDECREF(ooff);
  Py_XDECREF(one);
  Py_XDECREF(flat_shape);
  Py_XDECREF(flat_stride);
  Py_XDECREF(flat);
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(off);
  Py_DECREF(owner);
  return res;
}

/* torch.empty_strided(shape, strides, dtype=..., device=...) for the handle
 * being unpacked when its span is `bytes`; NULL without an exception when
 * there is none. Dense handles only reach the engine, so the new tensor's
 * bytes are exactly [data_ptr, data_ptr + bytes). */
PyObject *empty_like_handle(EngineObject *self, uint64_t bytes) {
  HandleObject *hd = self->unpacking;
  if (!hd) return NULL;
  self->unpacking = NULL; /* once: later allocations are prefetches */
  int64_t numel = 1;
  for (int32_t i = 0; i < hd->ndim; i++) numel *= hd->shape[i];
  const dtype_info *di = NULL;
  for (int i = 0; i < n_dtypes; i++)
    if (dtypes[i].dtype == hd->dtype) di = &dtypes[i];
  if (!di || (uint64_t)numel * di->itemsize != bytes) return NULL;
  PyObject *shape = int_tuple(hd->shape, hd->ndim);
  PyObject *strides = int_tuple(hd->strides, hd->ndim);
  PyObject *kw = PyDict_Copy(self->alloc_kw);
  PyObject *t = NULL;
  if (shape && strides && kw && PyDict_SetItemString(kw, "dtype", hd->dtype) == 0) {
    PyObject *args = PyTuple_Pack(2, shape, strides);
    if (args) t = PyObject_Call(T.empty_strided, args, kw);
    Py_XDECREF(args);
  }
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(kw);
  return t;
}

/* torch's in-place check: `now` shares the saved tensor's version counter
 * (NULL: the tensor is gone, so nothing can have changed it); `info` is the
 * tensor itself, for the message, or NULL. -1 with torch's RuntimeError set
 * (its own text, from ferry._inplace, plus the module) on a mismatch. */
static int check_version(EngineObject *eng, PyObject *now, PyObject *info, PyObject *shape,
                         int64_t saved, int32_t site_id) {
  if (!now) return 0;
  int64_t cur;
  if (read_version(now, &cur) < 0) return -1;
  if (cur == saved) return 0;
  PyObject *mod = PyImport_ImportModule("ferry._inplace");
  if (!mod) return -1;
  const char *path =
      site_id >= 0 && (uint32_t)site_id < eng->n_sites ? eng->sites[site_id].path : NULL;
  PyObject *exc = PyObject_CallMethod(mod, "error", "OOOLLz", now, info ? info : Py_None,
                                      shape ? shape : Py_None, (long long)cur, (long long)saved,
                                      path);
  Py_DECREF(mod);
  if (!exc) return -1;
  PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
  Py_DECREF(exc);
  return -1;
}

/* ---- backward phases ------------------------------------------------------------
 * A backward begins at its first unpack and ends when autograd's graph task
 * ends (a callback queued on autograd's engine), not at the step's end: the
 * microbatches accumulated in one step each pack their forward as forward,
 * and each backward begins the engine's backward phase once
 * (prefetch_at_backward_begin). A backward no callback can be queued for (a
 * saved tensor read outside backward) ends with the step. */
static PyObject *backward_done(PyObject *arg, PyObject *unused) {
  /* arg: (engine, its backwards count when this backward began) */
  EngineObject *eng = (EngineObject *)PyTuple_GET_ITEM(arg, 0);
  unsigned long long began = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(arg, 1));
  if (!eng->e || !eng->in_backward || eng->backwards != began) Py_RETURN_NONE;
  if (eng->on_backward_end) { /* the backward's FLOPs, traced before its end */
    PyObject *r = PyObject_CallNoArgs(eng->on_backward_end);
    if (!r) return NULL;
    Py_DECREF(r);
  }
  eng->in_backward = 0;
  if (eng->e) {
    ferry_backward_end(engine_call_begin(eng));
    engine_call_end(eng);
  }
  Py_RETURN_NONE;
}

static PyMethodDef backward_done_def = {"ferry_backward_done", backward_done, METH_NOARGS, NULL};

static void end_backward_with_graph_task(EngineObject *eng) {
  if (!T.queue_callback_looked_up) {
    T.queue_callback_looked_up = 1;
    PyObject *ag = PyObject_GetAttrString(T.torch, "autograd");
    PyObject *var = ag ? PyObject_GetAttrString(ag, "Variable") : NULL;
    PyObject *ex = var ? PyObject_GetAttrString(var, "_execution_engine") : NULL;
    T.queue_callback = ex ? PyObject_GetAttrString(ex, "queue_callback") : NULL;
    Py_XDECREF(ag);
    Py_XDECREF(var);
    Py_XDECREF(ex);
    PyErr_Clear();
  }
  if (!T.queue_callback) return;
  PyObject *arg = Py_BuildValue("(OK)", (PyObject *)eng, (unsigned long long)eng->backwards);
  PyObject *cb = arg ? PyCFunction_New(&backward_done_def, arg) : NULL;
  Py_XDECREF(arg);
  PyObject *r = cb ? PyObject_CallOneArg(T.queue_callback, cb) : NULL;
  Py_XDECREF(cb);
  Py_XDECREF(r);
  if (!r) PyErr_Clear(); /* outside backward: the phase ends with the step */
}

static PyObject *unpack_kept(EngineObject *eng, KeptObject *k) {
  PyObject *origin = k->origin ? PyWeakref_GetObject(k->origin) : k->tensor; /* borrowed */
  if (check_version(eng, k->tensor, origin == Py_None ? NULL : origin, NULL, k->version, k->site))
    return NULL;
  Py_INCREF(k->tensor);
  return k->tensor;
}

/* A reloaded buffer may come from another stream's pool (a prefetch made
 * for another stream): the caching allocator must not hand its block out
 * again on that stream while this one still reads it. record_stream is a
 * no-op for the stream the block was allocated on. */
static int record_on_compute_stream(EngineObject *eng, PyObject *t) {
  if (eng->backend != FERRY_BACKEND_CUDA) return 0;
  PyObject *s = compute_stream_object(eng);
  PyObject *r = s ? PyObject_CallMethod(t, "record_stream", "(O)", s) : NULL;
  Py_XDECREF(s);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

static PyObject *unpack_impl(EngineObject *eng, PyObject *obj) {
  if (Py_TYPE(obj) == &KeptType) return unpack_kept(eng, (KeptObject *)obj);
  if (Py_TYPE(obj) != &HandleType) { /* not ours: returned as torch gave it */
    Py_INCREF(obj);
    return obj;
  }
  HandleObject *hd = (HandleObject *)obj;
  PyObject *now = NULL; /* borrowed */
  for (int i = 0; i < 3 && !now; i++)
    if (hd->sharers[i] && (now = PyWeakref_GetObject(hd->sharers[i])) == Py_None) now = NULL;
  PyObject *tensor = PyWeakref_GetObject(hd->sharers[0]);
  if (tensor == Py_None) tensor = NULL;
  /* the tensor gone (a view checked through its base): name its own shape */
  PyObject *shape = now && !tensor ? int_tuple(hd->shape, hd->ndim) : NULL;
  int bad = (now && !tensor && !shape) ||
            check_version(eng, now, tensor, shape, hd->version, hd->site);
  Py_XDECREF(shape);
  if (bad) return NULL;
  if (!hd->h) {
    if (hd->result) { /* unpacked before: backward over a retained graph */
      eng->unpacks_repeated++;
      Py_INCREF(hd->result);
      return hd->result;
    }
    return PyErr_Format(FerryError, "ferry: saved tensor handle was lost");
  }
  if (!hd->eng->e) return PyErr_Format(FerryError, "ferry: the engine holding this saved tensor was closed");
  /* read first: the reloads backward's beginning starts are for this stream */
  void *stream = compute_stream(eng);
  if (PyErr_Occurred()) return NULL;
  if (!eng->in_backward) {
    eng->in_backward = 1;
    eng->backwards++;
    ferry_backward_begin_on(engine_call_begin(eng), stream);
    engine_call_end(eng);
    if (!eng->e) return PyErr_Format(FerryError, "ferry: this engine was closed");
    end_backward_with_graph_task(eng);
  }
  void *ptr = NULL, *owner = NULL;
  eng->unpacking = hd;
  PyObject *range = eng->profile_ranges ? range_enter(eng, "unpack", hd->site) : NULL;
  int rc = ferry_unpack(engine_call_begin(eng), hd->h, stream, &ptr, &owner);
  engine_call_end(eng);
  range_exit(range);
  eng->unpacking = NULL;
  if (rc) return raise_ferry(rc, ferry_last_error(eng->e));
  hd->h = 0;
  PyObject *res = rebuild(eng, hd, (PyObject *)owner, ptr);
  if (!res || record_on_compute_stream(eng, res) < 0) {
    Py_XDECREF(res);
    return NULL;
  }
  Py_INCREF(res);
  hd->result = res;
  return res;
}

static PyObject *unpack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
    PyErr_SetString(PyExc_TypeError, "ferry unpack hook takes one argument");
    return NULL;
  }
  return unpack_impl(((HookObject *)callable)->eng, args[0]);
}

PyTypeObject PackHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.PackHook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "pack_hook for saved_tensors_hooks (C; no Python frame per tensor).",
    .tp_vectorcall_offset = offsetof(HookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
};

PyTypeObject UnpackHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.UnpackHook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "unpack_hook for saved_tensors_hooks.",
    .tp_vectorcall_offset = offsetof(HookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
};

