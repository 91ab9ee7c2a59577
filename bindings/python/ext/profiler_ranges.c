/*
 * profiler_ranges.c — the binding's engine calls as torch profiler ranges.
 * Moved out of hooks.c, whose pack and unpack call it.
 */
#include "ext.h"

/* ---- torch profiler ranges ----------------------------------------------------
 * While torch's profiler runs (eng->profile_ranges, set at each offload
 * context entry), each engine call is a record_function range named
 * "ferry pack: <module path>" / "ferry unpack: <module path>", the names of
 * the Chrome trace's call slices: on a GPU the copy the call issues is the
 * profiler's own Memcpy event, launched inside it. Off, the hooks test one
 * int. A range that cannot be made is skipped, never an error. */
PyObject *range_enter(EngineObject *eng, const char *what, int32_t site_id) {
  if (!T.rf_enter) {
    PyObject *ops = PyObject_GetAttrString(T.torch, "ops");
    PyObject *prof = ops ? PyObject_GetAttrString(ops, "profiler") : NULL;
    T.rf_enter = prof ? PyObject_GetAttrString(prof, "_record_function_enter_new") : NULL;
    T.rf_exit = prof ? PyObject_GetAttrString(prof, "_record_function_exit") : NULL;
    Py_XDECREF(prof);
    Py_XDECREF(ops);
    if (!T.rf_enter || !T.rf_exit) {
      Py_CLEAR(T.rf_enter);
      Py_CLEAR(T.rf_exit);
      PyErr_Clear();
      eng->profile_ranges = 0; /* this torch has none: stop trying */
      return NULL;
    }
  }
  const char *path = site_id >= 0 && (uint32_t)site_id < eng->n_sites ? eng->sites[site_id].path
                                                                       : NULL;
  PyObject *name = path && *path ? PyUnicode_FromFormat("ferry %s: %s", what, path)
                                 : PyUnicode_FromFormat("ferry %s", what);
  PyObject *h = name ? PyObject_CallFunctionObjArgs(T.rf_enter, name, Py_None, NULL) : NULL;
  Py_XDECREF(name);
  if (!h) PyErr_Clear();
  return h;
}

void range_exit(PyObject *h) {
  if (!h) return;
  PyObject *exc_type, *exc, *tb; /* an error the call raised stays raised */
  PyErr_Fetch(&exc_type, &exc, &tb);
  PyObject *r = PyObject_CallFunctionObjArgs(T.rf_exit, h, NULL);
  Py_XDECREF(r);
  if (!r) PyErr_Clear();
  Py_DECREF(h);
  PyErr_Restore(exc_type, exc, tb);
}
