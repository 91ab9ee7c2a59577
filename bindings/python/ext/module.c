/*
 * module.c — the CPython extension behind `import ferry` (ferry._ferry):
 * module init, info() and strerror(). The parts are listed in ext.h.
 *
 * Python C API only: no libtorch headers or link, so one build works with
 * every torch that has torch.autograd.graph.saved_tensors_hooks (1.13+).
 * Threads: every entry point runs with the GIL held, and the GIL is never
 * released around engine calls (docs/pytorch.md).
 */
#include "ext.h"
#include "ferry_tools.h"

PyObject *FerryError; /* ferry.FerryError(RuntimeError) */

/* ---- module functions --------------------------------------------------------- */
static int dummy_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  return -1;
}
static void dummy_release(void *ud, void *owner) {}

/* Create and destroy a throwaway engine to learn what a backend/arena would
 * be here. */
static PyObject *probe_engine(int backend) {
  ferry_config cfg;
  ferry_config_init(&cfg);
  cfg.backend = backend;
  cfg.device_alloc = dummy_alloc;
  cfg.release = dummy_release;
  char err[512] = "";
  ferry_engine *e = NULL;
  int rc = ferry_engine_create(&cfg, &e, err, sizeof err);
  PyObject *r;
  if (rc)
    r = Py_BuildValue("{sOss}", "available", Py_False, "error", err[0] ? err : ferry_strerror(rc));
  else
    r = Py_BuildValue("{sOss}", "available", Py_True, "arena", ferry_arena_name(e));
  ferry_engine_destroy(e);
  return r;
}

static PyObject *mod_info(PyObject *mod, PyObject *unused) {
  PyObject *host = probe_engine(FERRY_BACKEND_HOST);
  PyObject *cuda = host ? probe_engine(FERRY_BACKEND_CUDA) : NULL;
  PyObject *sim = cuda ? probe_engine(FERRY_BACKEND_SIM) : NULL;
  if (!sim) {
    Py_XDECREF(host);
    Py_XDECREF(cuda);
    return NULL;
  }
  PyObject *arena = PyDict_GetItemString(host, "arena");
  PyObject *r = Py_BuildValue("{sssIsOs{sNsNsN}sO}", "version", ferry_version_string(),
                              "version_hex", ferry_version(), "arena",
                              arena ? arena : Py_None, "backends", "host", host, "cuda", cuda,
                              "sim", sim, "node_cap_hook",
#ifdef FERRY_HAVE_RESERVE_FN
                              Py_True
#else
                              Py_False
#endif
  );
  return r;
}

/* parse_number(what, text, kind, min, max, min_open=False) -> float: the
 * engine's one strict parser (ferry_tools.h), so Python keywords read
 * numbers exactly as CLI flags and environment variables do. */
static PyObject *mod_parse_number(PyObject *mod, PyObject *args) {
  const char *what, *text;
  int kind, min_open = 0;
  double lo, hi, v;
  if (!PyArg_ParseTuple(args, "ssidd|p", &what, &text, &kind, &lo, &hi, &min_open)) return NULL;
  char err[256];
  if (ferry_parse_number(what, text, kind, lo, hi, min_open, &v, err, sizeof err) != FERRY_OK)
    return PyErr_Format(PyExc_ValueError, "ferry: %s", err);
  return PyFloat_FromDouble(v);
}

/* getenv_many(names) -> tuple of str or None: the process environment
 * (which os.environ's changes reach through putenv) read in one call, the
 * key of ferry.torch.offload's memo of what it derives from it. */
static PyObject *mod_getenv_many(PyObject *mod, PyObject *names) {
  if (!PyTuple_Check(names)) return PyErr_Format(PyExc_TypeError, "getenv_many: expected a tuple");
  Py_ssize_t n = PyTuple_GET_SIZE(names);
  PyObject *out = PyTuple_New(n);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, i));
    const char *v = name ? getenv(name) : NULL;
    PyObject *o = !name ? NULL : v ? PyUnicode_DecodeFSDefault(v) : Py_NewRef(Py_None);
    if (!o) Py_CLEAR(out);
    else PyTuple_SET_ITEM(out, i, o);
  }
  return out;
}

static PyObject *mod_strerror(PyObject *mod, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(ferry_strerror((int)code));
}

static PyObject *mod_tensor_facts_active(PyObject *self, PyObject *unused) {
  (void)self, (void)unused;
  return PyBool_FromLong(FACTS != NULL);
}

/* tensor_facts(t): what the facts module reads of t, for tests: (scalar
 * type, sizes, data pointer, version, is a view), or None (no module, or it
 * declined). */
static PyObject *mod_tensor_facts(PyObject *self, PyObject *t) {
  (void)self;
  ferry_tensor_facts f;
  if (!FACTS || (Py_TYPE(t) != T.tensor && Py_TYPE(t) != T.param) || FACTS->read(t, &f) != 0)
    Py_RETURN_NONE;
  PyObject *sizes = PyTuple_New(f.ndim);
  if (!sizes) return NULL;
  for (int32_t i = 0; i < f.ndim; i++) PyTuple_SET_ITEM(sizes, i, PyLong_FromLongLong(f.sizes[i]));
  return Py_BuildValue("(iNKLN)", f.scalar_type, sizes, (unsigned long long)(uintptr_t)f.data,
                       (long long)f.version, PyBool_FromLong(f.is_view));
}

static PyMethodDef module_methods[] = {
    {"tensor_facts", mod_tensor_facts, METH_O,
     "tensor_facts(t): (scalar type, sizes, data pointer, version, is a view) as the facts "
     "module reads "
     "them, or None (tests)."},
    {"set_tensor_facts", mod_set_tensor_facts, METH_O,
     "set_tensor_facts(capsule or None): the _torchfacts module's reader for the running "
     "torch (ferry.torch calls it), or None for torch's getters only."},
    {"tensor_facts_active", mod_tensor_facts_active, METH_NOARGS,
     "Whether the hooks read tensors through a _torchfacts module."},
    {"info", mod_info, METH_NOARGS,
     "info() -> dict: version, which arena an engine gets here, backend availability."},
    {"strerror", mod_strerror, METH_O, "Message of a FERRY_E* code."},
    {"getenv_many", mod_getenv_many, METH_O,
     "getenv_many(names: tuple) -> tuple: each variable's value in the process environment, "
     "or None."},
    {"parse_number", mod_parse_number, METH_VARARGS,
     "parse_number(what, text, kind, min, max, min_open=False) -> float: the strict parser of "
     "every ferry flag (NUMBER_* kinds); ValueError naming what, the text and what was expected."},
    {"describe_walk", describe_walk, METH_VARARGS,
     "describe_walk(roots, tensor_type, untyped) -> (tensors, tensor_bytes, primitives, "
     "objects, skipped, paths, dtypes): ferry.checkpoint.describe's walk from each (value, "
     "top-level key, path) of roots; untyped: the tensor method's name, or a function, "
     "that gives a tensor's untyped storage."},
    {"unlink_node_cap", nodecap_unlink, METH_O,
     "unlink_node_cap(name): remove a NodeCap's shared-memory segment."},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ferry",
    .m_doc = "C extension of the ferry package (libferry inside).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__ferry(void) {
  if (intern_names() || engines_watch_fork()) return NULL;
  PyTypeObject *types[] = {&EngineType,   &HandleType,   &KeptType,     &PackHookType,
                           &UnpackHookType, &SiteHookType, &NodeCapType,
                           &SnapshotType, &PolicyInstanceType, &ResidentType, &StorageFilterType};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (PyType_Ready(types[i]) < 0) return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (!m) return NULL;
  FerryError = PyErr_NewExceptionWithDoc(
      "ferry.FerryError", "An error reported by libferry; args = (message, FERRY_E* name).",
      PyExc_RuntimeError, NULL);
  if (!FerryError || PyModule_AddObjectRef(m, "FerryError", FerryError) ||
      PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) ||
      PyModule_AddObjectRef(m, "Handle", (PyObject *)&HandleType) ||
      PyModule_AddObjectRef(m, "NodeCap", (PyObject *)&NodeCapType) ||
      PyModule_AddObjectRef(m, "Snapshot", (PyObject *)&SnapshotType) ||
      PyModule_AddObjectRef(m, "StorageFilter", (PyObject *)&StorageFilterType) ||
      PyModule_AddObjectRef(m, "PolicyInstance", (PyObject *)&PolicyInstanceType) ||
      PyModule_AddObjectRef(m, "Resident", (PyObject *)&ResidentType) ||
      PyModule_AddStringConstant(m, "__version__", ferry_version_string()) ||
      PyModule_AddIntConstant(m, "MAX_DIMS", FERRY_MAX_DIMS) ||
      PyModule_AddIntConstant(m, "KIND_ACTIVATION", FERRY_KIND_ACTIVATION) ||
      PyModule_AddIntConstant(m, "NUMBER_COUNT", FERRY_NUMBER_COUNT) ||
      PyModule_AddIntConstant(m, "NUMBER_BYTES", FERRY_NUMBER_BYTES) ||
      PyModule_AddIntConstant(m, "NUMBER_PERCENT", FERRY_NUMBER_PERCENT) ||
      PyModule_AddIntConstant(m, "KIND_PARAMETER", FERRY_KIND_PARAMETER) ||
      PyModule_AddIntConstant(m, "KIND_BUFFER", FERRY_KIND_BUFFER) ||
      PyModule_AddIntConstant(m, "HAVE_NODE_CAP_HOOK",
#ifdef FERRY_HAVE_RESERVE_FN
                              1
#else
                              0
#endif
                              )) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
