/*
 * nodecap.c — NodeCap: a pinned-host cap shared by the processes of one
 * node, a thin wrapper of the engine's ferry_node_budget (POSIX shared
 * memory, one slot per process, dead processes' shares reclaimed).
 */
#include "ext.h"

#define NODECAP_MAX_PROCS 256

/* FERRY_EINVAL -> ValueError, FERRY_EIO -> OSError, else RuntimeError. */
static void nodecap_raise(int rc, const char *err) {
  PyObject *type = rc == FERRY_EINVAL ? PyExc_ValueError
                   : rc == FERRY_EIO  ? PyExc_OSError
                                      : PyExc_RuntimeError;
  PyErr_Format(type, "NodeCap: %s", *err ? err : ferry_strerror(rc));
}

static int nodecap_init(NodeCapObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "cap_bytes", NULL};
  const char *name;
  unsigned long long cap;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sK", kwlist, &name, &cap)) return -1;
  if (self->nb) {
    PyErr_SetString(PyExc_RuntimeError, "NodeCap already initialised");
    return -1;
  }
  char err[512] = "";
  int rc = ferry_node_budget_open(name, cap, &self->nb, err, sizeof err);
  if (rc != FERRY_OK) {
    nodecap_raise(rc, err);
    return -1;
  }
  return 0;
}

static void nodecap_dealloc(NodeCapObject *self) {
  ferry_node_budget_close(self->nb);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int nodecap_ready(NodeCapObject *self) {
  if (self->nb) return 1;
  PyErr_SetString(PyExc_RuntimeError, "NodeCap is not initialised");
  return 0;
}

static PyObject *nodecap_reserve_py(NodeCapObject *self, PyObject *arg) {
  if (!nodecap_ready(self)) return NULL;
  unsigned long long n = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  return PyBool_FromLong(!ferry_node_budget_reserve(self->nb, n, 0));
}

static PyObject *nodecap_release_py(NodeCapObject *self, PyObject *arg) {
  if (!nodecap_ready(self)) return NULL;
  unsigned long long n = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  ferry_node_budget_reserve(self->nb, n, 1);
  Py_RETURN_NONE;
}

static PyObject *nodecap_state(NodeCapObject *self, PyObject *unused) {
  if (!nodecap_ready(self)) return NULL;
  ferry_node_budget_stats st;
  int32_t pids[NODECAP_MAX_PROCS];
  uint64_t bytes[NODECAP_MAX_PROCS];
  if (ferry_node_budget_get_stats(self->nb, &st, pids, bytes, NODECAP_MAX_PROCS) != FERRY_OK)
    return PyErr_Format(PyExc_RuntimeError, "NodeCap: lock failed");
  PyObject *slots = PyDict_New();
  uint32_t n = st.processes < NODECAP_MAX_PROCS ? st.processes : NODECAP_MAX_PROCS;
  for (uint32_t i = 0; slots && i < n; i++) {
    PyObject *k = PyLong_FromLong(pids[i]);
    PyObject *v = PyLong_FromUnsignedLongLong(bytes[i]);
    if (!k || !v || PyDict_SetItem(slots, k, v)) Py_CLEAR(slots);
    Py_XDECREF(k);
    Py_XDECREF(v);
  }
  if (!slots) return NULL;
  return Py_BuildValue("{sKsKsKsKsKsN}", "cap", (unsigned long long)st.cap, "total",
                       (unsigned long long)st.total, "mine", (unsigned long long)st.mine,
                       "reclaimed", (unsigned long long)st.reclaimed, "refusals",
                       (unsigned long long)st.refusals, "slots", slots);
}

PyObject *nodecap_unlink(PyObject *unused, PyObject *arg) {
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name) return NULL;
  char err[512] = "";
  int rc = ferry_node_budget_unlink(name, err, sizeof err);
  if (rc != FERRY_OK) {
    nodecap_raise(rc, err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef nodecap_methods[] = {
    {"reserve", (PyCFunction)nodecap_reserve_py, METH_O,
     "reserve(nbytes) -> bool: take nbytes of the node's cap for this process."},
    {"release", (PyCFunction)nodecap_release_py, METH_O, "release(nbytes): give bytes back."},
    {"state", (PyCFunction)nodecap_state, METH_NOARGS,
     "state() -> dict(cap, total, mine, reclaimed, refusals, slots={pid: bytes})."},
    {NULL}};

PyTypeObject NodeCapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.NodeCap",
    .tp_basicsize = sizeof(NodeCapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NodeCap(name, cap_bytes): a pinned-host-memory cap shared by the processes of "
              "one node through POSIX shared memory /name (ferry_node_budget).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)nodecap_init,
    .tp_dealloc = (destructor)nodecap_dealloc,
    .tp_methods = nodecap_methods,
};
