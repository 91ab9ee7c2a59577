/*
 * snapshot.c — checkpoint staging: Snapshot (ferry_snapshot_*, made by
 * Engine.snapshot). ferry/checkpoint.py drives it with a PolicyInstance's
 * snapshot(e) answers (policy.c; docs/checkpoints.md).
 */
#include "ext.h"
#include "ferry_tools.h"

/* ---- Snapshot: checkpoint staging (ferry_snapshot_*) ------------------------
 * The Python side (ferry/checkpoint.py) builds the records: the pickle and
 * the other small records as host bytes, each tensor storage as a pointer
 * with its owner. Owners stay referenced until fence() (or the end of the
 * snapshot): the engine reads their memory until then. Blocking calls
 * (fence, wait, free) release the GIL: the writer thread never needs it. */
typedef struct {
  PyObject_HEAD ferry_snapshot *s;
  EngineObject *eng;
  PyObject *owners; /* list, or NULL once fenced */
  PyObject *path;   /* str */
} SnapshotObject;


static PyObject *snapshot_raise(SnapshotObject *self, int rc) {
  const char *msg = ferry_snapshot_error(self->s);
  return raise_ferry(rc, msg);
}

static int snapshot_live(SnapshotObject *self) {
  return owned_live(self->eng, self->s, "ferry: this snapshot was freed");
}

static PyObject *snapshot_fence(SnapshotObject *self, PyObject *unused) {
  if (!snapshot_live(self)) return NULL;
  if (!self->owners) Py_RETURN_NONE;
  void *stream = NULL;
  if (self->eng->backend == FERRY_BACKEND_CUDA) {
    stream = compute_stream(self->eng);
    if (!stream && PyErr_Occurred()) return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = ferry_snapshot_fence(self->s, stream);
  Py_END_ALLOW_THREADS
  Py_CLEAR(self->owners);
  if (rc) return snapshot_raise(self, rc);
  Py_RETURN_NONE;
}

/* poll() -> True once durable, False while in progress; raises on failure. */
static PyObject *snapshot_poll(SnapshotObject *self, PyObject *unused) {
  if (!snapshot_live(self)) return NULL;
  int rc = ferry_snapshot_poll(self->s);
  if (rc == 1) Py_RETURN_FALSE;
  if (rc) return snapshot_raise(self, rc);
  Py_CLEAR(self->owners);
  Py_RETURN_TRUE;
}

static PyObject *snapshot_wait(SnapshotObject *self, PyObject *unused) {
  if (!snapshot_live(self)) return NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = ferry_snapshot_wait(self->s);
  Py_END_ALLOW_THREADS
  Py_CLEAR(self->owners);
  if (rc) return snapshot_raise(self, rc);
  Py_RETURN_NONE;
}

static PyObject *snapshot_error(SnapshotObject *self, PyObject *unused) {
  return PyUnicode_FromString(self->s && !self->eng->forked ? ferry_snapshot_error(self->s) : "");
}

static void snapshot_dealloc(SnapshotObject *self) {
  if (self->s && !self->eng->forked) { /* a parent's snapshot stays (its writer did not fork) */
    ferry_snapshot *s = self->s;
    self->s = NULL;
    Py_BEGIN_ALLOW_THREADS ferry_snapshot_free(s); /* waits for the writer */
    Py_END_ALLOW_THREADS
  }
  Py_XDECREF(self->owners);
  Py_XDECREF(self->path);
  Py_XDECREF(self->eng);
  PyObject_Free(self);
}

static PyObject *snapshot_get_path(SnapshotObject *self, void *unused) {
  Py_INCREF(self->path);
  return self->path;
}

static PyObject *snapshot_get_fenced(SnapshotObject *self, void *unused) {
  return PyBool_FromLong(self->owners == NULL);
}

static PyMethodDef snapshot_methods[] = {
    {"fence", (PyCFunction)snapshot_fence, METH_NOARGS,
     "Order the compute stream after the snapshot's copies (host backend: wait for them). "
     "Call before the next in-place update of the snapshotted tensors."},
    {"poll", (PyCFunction)snapshot_poll, METH_NOARGS,
     "True once the file is durable, False while in progress; raises FerryError on failure."},
    {"wait", (PyCFunction)snapshot_wait, METH_NOARGS,
     "Block until the file is durable; raises FerryError on failure."},
    {"error", (PyCFunction)snapshot_error, METH_NOARGS, "The failure message, or ''."},
    {NULL}};

static PyGetSetDef snapshot_getset[] = {
    {"path", (getter)snapshot_get_path, NULL, "the file being written", NULL},
    {"fenced", (getter)snapshot_get_fenced, NULL, "fence() (or the end) was reached", NULL},
    {NULL}};

PyTypeObject SnapshotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Snapshot",
    .tp_basicsize = sizeof(SnapshotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A checkpoint snapshot in progress (Engine.snapshot).",
    .tp_dealloc = (destructor)snapshot_dealloc,
    .tp_methods = snapshot_methods,
    .tp_getset = snapshot_getset,
};

/* Record i of Engine.snapshot: (name, bytes) -> host bytes held in
 * bufs[*nbufs]; (name, data_ptr, nbytes, owner, is_host) -> a pointer, the
 * owner of device memory appended to owners. */
static int read_record(PyObject *r, Py_ssize_t i, ferry_snapshot_record *rec, Py_buffer *bufs,
                       Py_ssize_t *nbufs, PyObject *owners) {
  Py_ssize_t len = PyTuple_Check(r) ? PyTuple_GET_SIZE(r) : -1;
  if ((len != 2 && len != 5) || !PyUnicode_Check(PyTuple_GET_ITEM(r, 0))) {
    PyErr_Format(PyExc_TypeError,
                 "ferry: snapshot record %zd must be (name, bytes) or "
                 "(name, data_ptr, nbytes, owner, is_host)", i);
    return -1;
  }
  rec->name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(r, 0));
  if (!rec->name) return -1;
  if (len == 2) {
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 1), &bufs[*nbufs], PyBUF_SIMPLE)) return -1;
    rec->host_data = bufs[*nbufs].buf;
    rec->bytes = (uint64_t)bufs[*nbufs].len;
    (*nbufs)++;
    return 0;
  }
  void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(r, 1));
  unsigned long long nbytes = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 2));
  int is_host = PyObject_IsTrue(PyTuple_GET_ITEM(r, 4));
  if (PyErr_Occurred() || is_host < 0) return -1;
  rec->bytes = nbytes;
  if (nbytes == 0) return 0; /* an empty entry */
  if (!ptr) {
    PyErr_Format(PyExc_ValueError, "ferry: snapshot record %zd (%s) has a NULL data pointer", i,
                 rec->name);
    return -1;
  }
  if (is_host) {
    rec->host_data = ptr; /* copied by ferry_snapshot_start */
    return 0;
  }
  rec->device_ptr = ptr;
  return PyList_Append(owners, PyTuple_GET_ITEM(r, 3));
}

PyObject *engine_snapshot(EngineObject *self, PyObject *args) {
  PyObject *path_obj, *records;
  if (!PyArg_ParseTuple(args, "O&O:snapshot", PyUnicode_FSConverter, &path_obj, &records))
    return NULL;
  PyObject *seq = NULL, *owners = NULL, *path_str = NULL;
  ferry_snapshot_record *recs = NULL;
  Py_buffer *bufs = NULL;
  Py_ssize_t n = 0, nbufs = 0;
  SnapshotObject *out = NULL;
  if (!engine_live(self)) goto done;
  seq = PySequence_Fast(records, "ferry: snapshot records must be a sequence");
  if (!seq) goto done;
  n = PySequence_Fast_GET_SIZE(seq);
  recs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *recs);
  bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *bufs);
  owners = PyList_New(0);
  if (!recs || !bufs || !owners) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    if (read_record(PySequence_Fast_GET_ITEM(seq, i), i, &recs[i], bufs, &nbufs, owners))
      goto done;
  void *stream = NULL;
  if (self->backend == FERRY_BACKEND_CUDA) {
    stream = compute_stream(self);
    if (!stream && PyErr_Occurred()) goto done;
  }
  path_str = PyUnicode_DecodeFSDefault(PyBytes_AS_STRING(path_obj));
  out = path_str ? PyObject_New(SnapshotObject, &SnapshotType) : NULL;
  if (!out) goto done;
  out->s = NULL;
  out->owners = NULL;
  out->path = path_str;
  path_str = NULL;
  Py_INCREF(self);
  out->eng = self;
  int rc = ferry_snapshot_start(self->e, PyBytes_AS_STRING(path_obj), recs, (size_t)n, stream,
                                &out->s);
  if (rc) {
    raise_ferry(rc, ferry_last_error(self->e));
    Py_CLEAR(out);
    goto done;
  }
  out->owners = owners;
  owners = NULL;
done:
  for (Py_ssize_t i = 0; i < nbufs; i++) PyBuffer_Release(&bufs[i]);
  PyMem_Free(bufs);
  PyMem_Free(recs);
  Py_XDECREF(owners);
  Py_XDECREF(path_str);
  Py_XDECREF(seq);
  Py_DECREF(path_obj);
  return (PyObject *)out;
}

/* ---- StorageFilter: torch's persistent_id, asked only about storages --------
 * The pickler asks persistent_id about every object it writes (about 700
 * for an MLP's state and its AdamW moments); torch's answers None for all
 * but the storages after two Python calls. StorageFilter(pid, known,
 * is_storage) answers None itself, from a dict of verdicts per type
 * (is_storage(obj) asked once per new type), and passes storages (all its
 * arguments, a bound method's self included) to pid. As a class attribute
 * it binds like a function, so it can stand for a persistent_id method. */
typedef struct {
  PyObject_HEAD vectorcallfunc vectorcall;
  PyObject *pid, *known, *is_storage;
} StorageFilterObject;

static PyObject *storage_filter_call(StorageFilterObject *self, PyObject *const *args,
                                     size_t nargsf, PyObject *kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (n < 1 || kwnames) {
    PyErr_SetString(PyExc_TypeError, "ferry: StorageFilter takes positional arguments, the "
                                     "object last");
    return NULL;
  }
  PyObject *obj = args[n - 1], *type = (PyObject *)Py_TYPE(obj);
  PyObject *yes = PyDict_GetItemWithError(self->known, type); /* borrowed */
  if (!yes) {
    if (PyErr_Occurred()) return NULL;
    PyObject *v = PyObject_CallOneArg(self->is_storage, obj);
    if (!v) return NULL;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (t < 0) return NULL;
    yes = t ? Py_True : Py_False;
    if (PyDict_SetItem(self->known, type, yes)) return NULL;
  }
  if (yes == Py_False) Py_RETURN_NONE;
  return PyObject_Vectorcall(self->pid, args, nargsf, kwnames);
}

static PyObject *storage_filter_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *pid, *known, *is_storage;
  static char *kwlist[] = {"pid", "known", "is_storage", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!O:StorageFilter", kwlist, &pid, &PyDict_Type,
                                   &known, &is_storage))
    return NULL;
  if (!PyCallable_Check(pid) || !PyCallable_Check(is_storage)) {
    PyErr_SetString(PyExc_TypeError, "ferry: StorageFilter: pid and is_storage must be callable");
    return NULL;
  }
  StorageFilterObject *self = (StorageFilterObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->vectorcall = (vectorcallfunc)storage_filter_call;
  self->pid = Py_NewRef(pid);
  self->known = Py_NewRef(known);
  self->is_storage = Py_NewRef(is_storage);
  return (PyObject *)self;
}

static int storage_filter_traverse(StorageFilterObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->pid);
  Py_VISIT(self->known);
  Py_VISIT(self->is_storage);
  return 0;
}

static int storage_filter_clear(StorageFilterObject *self) {
  Py_CLEAR(self->pid);
  Py_CLEAR(self->known);
  Py_CLEAR(self->is_storage);
  return 0;
}

static void storage_filter_dealloc(StorageFilterObject *self) {
  PyObject_GC_UnTrack(self);
  storage_filter_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Bound to an instance as a function is: a method whose self is passed on. */
static PyObject *storage_filter_get(PyObject *self, PyObject *obj, PyObject *type) {
  if (!obj || obj == Py_None) return Py_NewRef(self);
  return PyMethod_New(self, obj);
}

PyTypeObject StorageFilterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.StorageFilter",
    .tp_basicsize = sizeof(StorageFilterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "StorageFilter(pid, known, is_storage): a persistent_id that returns None for "
              "objects whose type is not a storage (verdicts cached in known by type) and "
              "calls pid(*args) for the others.",
    .tp_new = storage_filter_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(StorageFilterObject, vectorcall),
    .tp_descr_get = storage_filter_get,
    .tp_traverse = (traverseproc)storage_filter_traverse,
    .tp_clear = (inquiry)storage_filter_clear,
    .tp_dealloc = (destructor)storage_filter_dealloc,
};

/* ---- describe_walk: ferry.checkpoint.describe's walk -------------------------
 * snapshot() walks the state on the training thread before torch's pickler
 * does: dicts, lists and tuples (subclasses too, through their own items()
 * and iteration), tensors (each storage's path, first dtype and bytes),
 * primitives (None, bool, int, float, complex, str, bytes and their
 * subclasses) and other objects (passed through to the pickle). In Python
 * the walk cost 80 us of the blocked time right after a training step for
 * an MLP's state and its AdamW moments (docs/checkpoints.md); here the
 * interpreter's frame per object is gone and what remains is torch's own
 * getters per tensor. */
typedef struct {
  PyObject *tensor_type; /* torch.Tensor */
  PyObject *untyped;     /* a method name, or a function of the tensor: its untyped storage */
  PyObject *skipped, *paths, *dtypes;
  Py_ssize_t tensors, primitives, objects;
  PyObject *tensor_bytes; /* int */
} walk_state;

static int exact_primitive(PyObject *v) {
  PyTypeObject *t = Py_TYPE(v);
  return v == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type ||
         t == &PyUnicode_Type || t == &PyComplex_Type || t == &PyBytes_Type;
}

static int is_primitive(PyObject *v) {
  return v == Py_None || PyLong_Check(v) || PyFloat_Check(v) || PyUnicode_Check(v) ||
         PyComplex_Check(v) || PyBytes_Check(v);
}

/* The storage's first sight: its (top-level key, path), the tensor's dtype
 * and the storage's bytes. torch's errors for tensors without one (sparse,
 * nested, some subclasses) are not the walk's: the pickler finds those. */
static int walk_tensor(walk_state *w, PyObject *x, PyObject *key, PyObject *path) {
  w->tensors++;
  PyObject *st = PyUnicode_Check(w->untyped) ? PyObject_CallMethodNoArgs(x, w->untyped)
                                              : PyObject_CallOneArg(w->untyped, x);
  PyObject *cid = NULL, *where = NULL, *v = NULL;
  int rc = -1, seen;
  if (!st || !(cid = PyObject_GetAttr(st, s_cdata)) ||
      (seen = PyDict_Contains(w->paths, cid)) < 0)
    goto done;
  rc = 0;
  if (seen) goto done;
  rc = -1;
  if (!(where = PyTuple_Pack(2, key, path)) || PyDict_SetItem(w->paths, cid, where) ||
      !(v = PyObject_GetAttr(x, s_dtype)) || PyDict_SetItem(w->dtypes, cid, v))
    goto done;
  Py_CLEAR(v);
  PyObject *sum;
  if (!(v = PyObject_CallMethodNoArgs(st, s_nbytes)) ||
      !(sum = PyNumber_Add(w->tensor_bytes, v)))
    goto done;
  Py_SETREF(w->tensor_bytes, sum);
  rc = 0;
done:
  Py_XDECREF(st);
  Py_XDECREF(cid);
  Py_XDECREF(where);
  Py_XDECREF(v);
  if (rc && (PyErr_ExceptionMatches(PyExc_RuntimeError) ||
             PyErr_ExceptionMatches(PyExc_NotImplementedError) ||
             PyErr_ExceptionMatches(PyExc_AttributeError))) {
    PyErr_Clear();
    rc = 0;
  }
  return rc;
}

static int walk(walk_state *w, PyObject *x, PyObject *key, PyObject *path);

/* Child k -> v of a container at (key, path): "path.k", and the top-level
 * key str(k) at the top. */
static int walk_child(walk_state *w, PyObject *k, PyObject *v, PyObject *key, PyObject *path) {
  if (exact_primitive(v)) {
    w->primitives++;
    return 0;
  }
  PyObject *child_key = NULL, *child_path = NULL;
  int rc = -1;
  if (PyUnicode_GET_LENGTH(path)) {
    PyObject *ks = PyObject_Format(k, NULL);
    if (!ks) return -1;
    child_path = PyUnicode_FromFormat("%U.%U", path, ks);
    Py_DECREF(ks);
    child_key = Py_NewRef(key);
  } else {
    child_path = PyObject_Str(k);
    child_key = Py_XNewRef(child_path);
  }
  if (child_path && child_key) rc = walk(w, v, child_key, child_path);
  Py_XDECREF(child_key);
  Py_XDECREF(child_path);
  return rc;
}

static int walk_container(walk_state *w, PyObject *x, PyObject *key, PyObject *path) {
  int rc = 0;
  if (PyDict_CheckExact(x)) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (!rc && PyDict_Next(x, &pos, &k, &v)) {
      Py_INCREF(k);
      Py_INCREF(v);
      rc = walk_child(w, k, v, key, path);
      Py_DECREF(k);
      Py_DECREF(v);
    }
    return rc;
  }
  if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
    for (Py_ssize_t i = 0; !rc && i < PySequence_Fast_GET_SIZE(x); i++) {
      PyObject *v = Py_NewRef(PySequence_Fast_GET_ITEM(x, i)), *k = PyLong_FromSsize_t(i);
      rc = k ? walk_child(w, k, v, key, path) : -1;
      Py_XDECREF(k);
      Py_DECREF(v);
    }
    return rc;
  }
  /* subclasses: their own items() and iteration order (an OrderedDict's) */
  int is_dict = PyDict_Check(x);
  PyObject *items = is_dict ? PyObject_CallMethodNoArgs(x, s_items) : Py_NewRef(x), *item;
  PyObject *it = items ? PyObject_GetIter(items) : NULL;
  Py_XDECREF(items);
  if (!it) return -1;
  for (Py_ssize_t i = 0; !rc && (item = PyIter_Next(it)); i++) {
    PyObject *k, *v;
    if (is_dict) {
      if (!PyArg_UnpackTuple(item, "items", 2, 2, &k, &v)) rc = -1;
      else rc = walk_child(w, k, v, key, path);
    } else {
      k = PyLong_FromSsize_t(i);
      rc = k ? walk_child(w, k, item, key, path) : -1;
      Py_XDECREF(k);
    }
    Py_DECREF(item);
  }
  Py_DECREF(it);
  return rc || PyErr_Occurred() ? -1 : 0;
}

static int walk(walk_state *w, PyObject *x, PyObject *key, PyObject *path) {
  if (PyDict_Check(x) || PyList_Check(x) || PyTuple_Check(x)) {
    if (Py_EnterRecursiveCall(" while walking a snapshot's state")) return -1;
    int rc = walk_container(w, x, key, path);
    Py_LeaveRecursiveCall();
    return rc;
  }
  int t = PyObject_IsInstance(x, w->tensor_type);
  if (t < 0) return -1;
  if (t) return walk_tensor(w, x, key, path);
  if (is_primitive(x)) {
    w->primitives++;
    return 0;
  }
  w->objects++;
  PyObject *type = (PyObject *)Py_TYPE(x), *mod = PyObject_GetAttr(type, s_module),
           *qual = mod ? PyObject_GetAttr(type, s_qualname) : NULL, *line = NULL;
  if (qual) {
    if (PyUnicode_GET_LENGTH(path)) line = PyUnicode_FromFormat("%U: %S.%S", path, mod, qual);
    else line = PyUnicode_FromFormat("<top>: %S.%S", mod, qual);
  }
  Py_XDECREF(mod);
  Py_XDECREF(qual);
  if (!line) return -1;
  int rc = PyList_Append(w->skipped, line);
  Py_DECREF(line);
  return rc;
}

/* describe_walk(roots, tensor_type, untyped) -> (tensors, tensor_bytes,
 * primitives, objects, skipped, paths, dtypes); roots: (value, top-level
 * key, path) triples. */
PyObject *describe_walk(PyObject *unused, PyObject *args) {
  PyObject *roots;
  walk_state w = {0};
  if (!PyArg_ParseTuple(args, "O!OO:describe_walk", &PyList_Type, &roots, &w.tensor_type,
                        &w.untyped))
    return NULL;
  PyObject *out = NULL;
  w.skipped = PyList_New(0);
  w.paths = PyDict_New();
  w.dtypes = PyDict_New();
  w.tensor_bytes = PyLong_FromLong(0);
  if (!w.skipped || !w.paths || !w.dtypes || !w.tensor_bytes) goto done;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(roots); i++) {
    PyObject *root = PyList_GET_ITEM(roots, i), *x, *key, *path;
    if (!PyArg_ParseTuple(root, "OUU:describe_walk root", &x, &key, &path)) goto done;
    Py_INCREF(root);
    int rc = walk(&w, x, key, path);
    Py_DECREF(root);
    if (rc) goto done;
  }
  out = Py_BuildValue("(nOnnOOO)", w.tensors, w.tensor_bytes, w.primitives, w.objects,
                      w.skipped, w.paths, w.dtypes);
done:
  Py_XDECREF(w.skipped);
  Py_XDECREF(w.paths);
  Py_XDECREF(w.dtypes);
  Py_XDECREF(w.tensor_bytes);
  return out;
}
