/*
 * sites.c — SiteHook: C callables registered as module forward pre/post
 * hooks. They keep the stack of module sites (path, class, layer) so each
 * saved tensor is described with the innermost module that saved it.
 */
#include "ext.h"

/* ---- module site hooks --------------------------------------------------------
 * A forward pre-hook pushes the module's site, the forward hook pops back to
 * below it (robust to a module whose forward raised and never popped). */
typedef struct {
  PyObject_HEAD vectorcallfunc vectorcall;
  EngineObject *eng;
  int32_t site;
  int32_t enter;
} SiteHookObject;

static PyObject *site_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
  SiteHookObject *h = (SiteHookObject *)callable;
  EngineObject *eng = h->eng;
  if (h->enter) {
    if (eng->depth == eng->cap_stack) {
      uint32_t ncap = eng->cap_stack ? eng->cap_stack * 2 : 64;
      int32_t *n = PyMem_Realloc(eng->stack, ncap * sizeof *n);
      if (!n) return PyErr_NoMemory();
      eng->stack = n;
      eng->cap_stack = ncap;
    }
    eng->stack[eng->depth++] = h->site;
  } else {
    for (uint32_t i = eng->depth; i-- > 0;)
      if (eng->stack[i] == h->site) {
        eng->depth = i;
        break;
      }
  }
  Py_RETURN_NONE;
}

static int site_traverse(SiteHookObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->eng);
  return 0;
}

static int site_clear(SiteHookObject *self) {
  Py_CLEAR(self->eng);
  return 0;
}

static void site_dealloc(SiteHookObject *self) {
  PyObject_GC_UnTrack(self);
  site_clear(self);
  PyObject_GC_Del(self);
}

PyTypeObject SiteHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.SiteHook",
    .tp_basicsize = sizeof(SiteHookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Module forward pre/post hook that tracks the module stack.",
    .tp_vectorcall_offset = offsetof(SiteHookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)site_dealloc,
    .tp_traverse = (traverseproc)site_traverse,
    .tp_clear = (inquiry)site_clear,
};

static PyObject *new_site_hook(EngineObject *eng, int32_t site_index, int enter) {
  SiteHookObject *h = PyObject_GC_New(SiteHookObject, &SiteHookType);
  if (!h) return NULL;
  h->vectorcall = site_vectorcall;
  Py_INCREF(eng);
  h->eng = eng;
  h->site = site_index;
  h->enter = enter;
  PyObject_GC_Track(h);
  return (PyObject *)h;
}

PyObject *engine_site_hooks(EngineObject *self, PyObject *arg) {
  long idx = PyLong_AsLong(arg);
  if (idx == -1 && PyErr_Occurred()) return NULL;
  if (idx < 0 || (uint32_t)idx >= self->n_sites)
    return PyErr_Format(PyExc_IndexError, "ferry: site %ld was never added", idx);
  PyObject *pre = new_site_hook(self, (int32_t)idx, 1);
  PyObject *post = pre ? new_site_hook(self, (int32_t)idx, 0) : NULL;
  if (!post) {
    Py_XDECREF(pre);
    return NULL;
  }
  PyObject *r = PyTuple_Pack(2, pre, post);
  Py_DECREF(pre);
  Py_DECREF(post);
  return r;
}

