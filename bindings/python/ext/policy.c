/*
 * policy.c — PolicyInstance: a policy file loaded on its own, outside any
 * engine, for the answers a trainer asks for once rather than per tensor:
 * snapshot(e) for checkpoints (ferry/checkpoint.py), resident(r) for
 * optimizer states and weights (ferry/optim.py, ferry/weights.py).
 */
#include "ext.h"
#include "ferry_tools.h"

/* ---- PolicyInstance: a policy file's snapshot(e) function ------------------
 * Its own instance of the policy (own sandboxed Lua state), loaded from the
 * same file the offload engine uses: checkpoint plans are made on the
 * Python thread, never under the engine's lock. */
typedef struct {
  PyObject_HEAD ferry_policy *p;
} PolicyInstanceObject;

static int policy_instance_init(PolicyInstanceObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "source", "trusted", NULL};
  const char *path = NULL, *source = NULL;
  int trusted = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzp", kwlist, &path, &source, &trusted))
    return -1;
  if (self->p) {
    PyErr_SetString(PyExc_RuntimeError, "PolicyInstance already initialised");
    return -1;
  }
  char err[1024] = "";
  int rc = ferry_policy_create(path, source, trusted, &self->p, err, sizeof err);
  if (rc) {
    raise_ferry(rc, err);
    return -1;
  }
  return 0;
}

static void policy_instance_dealloc(PolicyInstanceObject *self) {
  ferry_policy_destroy(self->p);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* plan(entries) -> [(stage, order)]; entries: (key, path, nbytes, index,
 * dtype_name or None, on_device). */
static PyObject *policy_instance_plan(PolicyInstanceObject *self, PyObject *entries) {
  if (!self->p) return raise_ferry(FERRY_ESTATE, "ferry: PolicyInstance not initialised");
  PyObject *seq = PySequence_Fast(entries, "ferry: plan() takes a sequence of entries");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject *out = PyList_New(n);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    const char *key, *path, *dtype_name = NULL;
    unsigned long long nbytes;
    int index, on_device;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ssKizp;ferry: a snapshot entry is "
                          "(key, path, nbytes, index, dtype name or None, on_device)",
                          &key, &path, &nbytes, &index, &dtype_name, &on_device)) {
      Py_CLEAR(out);
      break;
    }
    ferry_snapshot_entry e = {key, path, nbytes, index,
                              dtype_name ? ferry_dtype_of_name(dtype_name) : FERRY_DTYPE_UNKNOWN,
                              on_device};
    ferry_snapshot_choice c;
    ferry_policy_snapshot(self->p, &e, &c);
    PyObject *item = Py_BuildValue("(Od)", c.stage ? Py_True : Py_False, c.order);
    if (!item) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, item);
  }
  Py_DECREF(seq);
  return out;
}

/* resident(kind, candidates) -> [(host, rule, where)]; kind "optimizer" or
 * "weights"; candidates in the order to ask (largest first): (name, module,
 * layer, layer_count, nbytes, dtype name or None). index, count and
 * total_bytes come from the list. */
static PyObject *policy_instance_resident(PolicyInstanceObject *self, PyObject *args) {
  const char *kind_name;
  PyObject *candidates;
  if (!PyArg_ParseTuple(args, "sO", &kind_name, &candidates)) return NULL;
  if (!self->p) return raise_ferry(FERRY_ESTATE, "ferry: PolicyInstance not initialised");
  int kind = !strcmp(kind_name, "optimizer") ? FERRY_RESIDENT_OPTIMIZER
             : !strcmp(kind_name, "weights") ? FERRY_RESIDENT_WEIGHTS
                                             : -1;
  if (kind < 0)
    return PyErr_Format(PyExc_ValueError, "ferry: resident kind %R is not 'optimizer' or 'weights'",
                        PyTuple_GET_ITEM(args, 0));
  PyObject *seq = PySequence_Fast(candidates, "ferry: resident() takes a sequence of candidates");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  ferry_resident_entry *e = PyMem_Calloc((size_t)n + 1, sizeof *e);
  PyObject *out = e ? PyList_New(n) : PyErr_NoMemory();
  uint64_t total = 0;
  for (Py_ssize_t i = 0; out && i < n; i++) {
    const char *dtype_name = NULL;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ssiiKz;ferry: a resident candidate "
                          "is (name, module, layer, layer_count, nbytes, dtype name or None)",
                          &e[i].name, &e[i].module, &e[i].layer, &e[i].layer_count, &nbytes,
                          &dtype_name)) {
      Py_CLEAR(out);
      break;
    }
    e[i].kind = kind;
    e[i].bytes = nbytes;
    e[i].dtype = dtype_name ? ferry_dtype_of_name(dtype_name) : FERRY_DTYPE_UNKNOWN;
    e[i].index = (int32_t)i;
    e[i].count = (int32_t)n;
    total += nbytes;
  }
  for (Py_ssize_t i = 0; out && i < n; i++) {
    e[i].total_bytes = total;
    ferry_policy_reason why;
    int host = ferry_policy_resident(self->p, &e[i], &why);
    PyObject *item = Py_BuildValue("(Oss)", host ? Py_True : Py_False, why.rule, why.where);
    if (!item) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, item);
  }
  PyMem_Free(e);
  Py_DECREF(seq); /* the names point into it until here */
  return out;
}

static PyObject *policy_instance_get_has_resident(PolicyInstanceObject *self, void *unused) {
  return PyBool_FromLong(ferry_policy_has_resident(self->p));
}

static PyObject *policy_instance_last_error(PolicyInstanceObject *self, PyObject *unused) {
  return PyUnicode_FromString(ferry_policy_last_error(self->p));
}

static PyObject *policy_instance_get_has(PolicyInstanceObject *self, void *unused) {
  return PyBool_FromLong(ferry_policy_has_snapshot(self->p));
}

static PyObject *policy_instance_get_errors(PolicyInstanceObject *self, void *unused) {
  ferry_policy_stats st;
  ferry_policy_get_stats(self->p, &st);
  return PyLong_FromUnsignedLongLong(st.errors);
}

static PyObject *policy_instance_get_name(PolicyInstanceObject *self, void *unused) {
  return PyUnicode_FromString(ferry_policy_name(self->p));
}

static PyMethodDef policy_instance_methods[] = {
    {"plan", (PyCFunction)policy_instance_plan, METH_O,
     "plan([(key, path, nbytes, index, dtype, on_device)]) -> [(stage, order)]"},
    {"resident", (PyCFunction)policy_instance_resident, METH_VARARGS,
     "resident(kind, [(name, module, layer, layer_count, nbytes, dtype)]) -> "
     "[(host, rule, where)]: the policy's resident(r), asked in the list's order"},
    {"last_error", (PyCFunction)policy_instance_last_error, METH_NOARGS,
     "The last fault of snapshot() as 'file:line: message', or ''."},
    {NULL}};

static PyGetSetDef policy_instance_getset[] = {
    {"has_snapshot", (getter)policy_instance_get_has, NULL, "the policy defines snapshot(e)", NULL},
    {"has_resident", (getter)policy_instance_get_has_resident, NULL,
     "the policy defines resident(r)", NULL},
    {"errors", (getter)policy_instance_get_errors, NULL, "faults so far", NULL},
    {"name", (getter)policy_instance_get_name, NULL, "the policy's name", NULL},
    {NULL}};

PyTypeObject PolicyInstanceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.PolicyInstance",
    .tp_basicsize = sizeof(PolicyInstanceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PolicyInstance(path=None, source=None, trusted=False): a policy's snapshot(e) "
               "and resident(r).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)policy_instance_init,
    .tp_dealloc = (destructor)policy_instance_dealloc,
    .tp_methods = policy_instance_methods,
    .tp_getset = policy_instance_getset,
};

