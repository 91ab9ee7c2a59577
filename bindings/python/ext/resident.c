/*
 * resident.c — Resident: a buffer of the engine's pinned arena that lives on
 * the host between uses (ferry_resident_*), made by Engine.resident(nbytes).
 * It exports its bytes through the buffer protocol, so torch.frombuffer
 * gives a CPU tensor over the pinned memory; the tensor keeps the Resident
 * (and so the arena bytes) alive. ferry/checkpoint.py stages DCP state
 * dicts into these (docs/checkpoints.md).
 *
 * torch.frombuffer releases its buffer export at once and keeps a reference
 * to the Resident itself, so a live view cannot be counted: once a buffer
 * has been exported, close() only marks it closed and the bytes go back
 * when the Resident is freed, i.e. after the last view (and the caller's
 * reference) is gone. Never exported, close() frees them at once.
 */
#include "ext.h"

typedef struct {
  PyObject_HEAD ferry_resident *r;
  EngineObject *eng;
  Py_ssize_t exports; /* live Py_buffer exports (memoryview, numpy) */
  int exported;       /* ever exported: a tensor may read the bytes */
  int closed;         /* close() was called; the bytes may stay for views */
} ResidentObject;

static int resident_open(ResidentObject *self) {
  return owned_live(self->eng, self->closed ? NULL : self->r,
                    "ferry: this resident buffer was closed");
}

static PyObject *resident_raise(ResidentObject *self, int rc) {
  return raise_ferry(rc, self->eng && self->eng->e ? ferry_last_error(self->eng->e)
                                                   : ferry_strerror(rc));
}

static int resident_live(ResidentObject *self) {
  if (!resident_open(self)) return 0;
  if (self->eng->e) return 1;
  /* its engine's close() waits for this buffer: the bytes stay, copies stop */
  raise_ferry(FERRY_ESTATE, "ferry: this resident buffer's engine was closed");
  return 0;
}

/* to_host(data_ptr) / to_device(data_ptr): queue the copy after the work on
 * the current compute stream (cuda) or the calling thread (host). */
static PyObject *resident_copy(ResidentObject *self, PyObject *arg, int to_host) {
  if (!resident_live(self)) return NULL;
  void *ptr = PyLong_AsVoidPtr(arg);
  if (!ptr) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "ferry: resident copy needs a non-NULL data_ptr");
    return NULL;
  }
  void *stream = NULL;
  if (self->eng->backend == FERRY_BACKEND_CUDA) {
    stream = compute_stream(self->eng);
    if (!stream && PyErr_Occurred()) return NULL;
  }
  int rc = to_host ? ferry_resident_to_host(self->r, ptr, stream)
                   : ferry_resident_to_device(self->r, ptr, stream);
  if (rc) return resident_raise(self, rc);
  Py_RETURN_NONE;
}

static PyObject *resident_to_host(ResidentObject *self, PyObject *arg) {
  return resident_copy(self, arg, 1);
}

static PyObject *resident_to_device(ResidentObject *self, PyObject *arg) {
  return resident_copy(self, arg, 0);
}

static PyObject *resident_wait(ResidentObject *self, PyObject *unused) {
  /* also after its engine's close(), which left the engine to this buffer:
   * copies queued before it still complete */
  if (!resident_open(self)) return NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = ferry_resident_wait(self->r);
  Py_END_ALLOW_THREADS
  if (rc) return resident_raise(self, rc);
  Py_RETURN_NONE;
}

static int resident_free(ResidentObject *self) {
  ferry_resident *r = self->r;
  self->r = NULL;
  int rc = 0;
  if (r && !self->eng->forked) { /* a parent's buffer stays: its copies' threads did not fork */
    Py_BEGIN_ALLOW_THREADS rc = ferry_resident_destroy(r); /* waits for its copies */
    Py_END_ALLOW_THREADS
  }
  if (r) engine_resident_gone(self->eng);
  return rc;
}

static PyObject *resident_close(ResidentObject *self, PyObject *unused) {
  if (self->closed || !self->r) Py_RETURN_NONE;
  self->closed = 1;
  int rc = 0;
  if (self->exports > 0 || self->exported) {
    /* views may read the bytes: they go back when this object is freed;
     * the copies still complete now, as close() promises */
    if (!self->eng->forked) {
      Py_BEGIN_ALLOW_THREADS rc = ferry_resident_wait(self->r);
      Py_END_ALLOW_THREADS
    }
  } else {
    rc = resident_free(self);
  }
  if (rc && rc != FERRY_EHANDLE) return raise_ferry(rc, ferry_strerror(rc));
  Py_RETURN_NONE;
}

static void resident_dealloc(ResidentObject *self) {
  resident_free(self);
  Py_XDECREF(self->eng);
  PyObject_Free(self);
}

static int resident_getbuffer(ResidentObject *self, Py_buffer *view, int flags) {
  if (!self->r || self->closed) {
    PyErr_SetString(PyExc_BufferError, "ferry: this resident buffer was closed");
    view->obj = NULL;
    return -1;
  }
  void *p = ferry_resident_host_ptr(self->r);
  if (!p) {
    PyErr_SetString(PyExc_BufferError,
                    "ferry: the resident buffer's engine was destroyed (its memory is gone)");
    view->obj = NULL;
    return -1;
  }
  if (PyBuffer_FillInfo(view, (PyObject *)self, p, (Py_ssize_t)ferry_resident_bytes(self->r), 0,
                        flags))
    return -1;
  self->exports++;
  self->exported = 1;
  return 0;
}

static void resident_releasebuffer(ResidentObject *self, Py_buffer *view) {
  self->exports--;
}

static PyBufferProcs resident_as_buffer = {
    .bf_getbuffer = (getbufferproc)resident_getbuffer,
    .bf_releasebuffer = (releasebufferproc)resident_releasebuffer,
};

static PyObject *resident_get_nbytes(ResidentObject *self, void *unused) {
  return PyLong_FromUnsignedLongLong(self->r && !self->closed ? ferry_resident_bytes(self->r)
                                                               : 0);
}

static PyObject *resident_get_host_ptr(ResidentObject *self, void *unused) {
  return PyLong_FromVoidPtr(self->r && !self->closed ? ferry_resident_host_ptr(self->r) : NULL);
}

static PyMethodDef resident_methods[] = {
    {"to_host", (PyCFunction)resident_to_host, METH_O,
     "to_host(data_ptr): copy nbytes from data_ptr into the pinned buffer, asynchronously, "
     "after the work on the current compute stream."},
    {"to_device", (PyCFunction)resident_to_device, METH_O,
     "to_device(data_ptr): copy the pinned buffer to data_ptr, asynchronously."},
    {"wait", (PyCFunction)resident_wait, METH_NOARGS, "Block until the last copy is complete."},
    {"close", (PyCFunction)resident_close, METH_NOARGS,
     "Wait for the copies and give the bytes back to the arena; once the buffer was exported "
     "(torch.frombuffer), only mark it closed: the bytes go back when the last view and "
     "reference are gone."},
    {NULL}};

static PyGetSetDef resident_getset[] = {
    {"nbytes", (getter)resident_get_nbytes, NULL, "size in bytes (0 once closed)", NULL},
    {"host_ptr", (getter)resident_get_host_ptr, NULL, "address of the pinned bytes", NULL},
    {NULL}};

PyTypeObject ResidentType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Resident",
    .tp_basicsize = sizeof(ResidentObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A buffer of the engine's pinned arena living on the host (Engine.resident).",
    .tp_dealloc = (destructor)resident_dealloc,
    .tp_methods = resident_methods,
    .tp_getset = resident_getset,
    .tp_as_buffer = &resident_as_buffer,
};

/* Engine.resident(nbytes) -> Resident; FerryError (FERRY_ECAP) past the cap. */
PyObject *engine_resident(EngineObject *self, PyObject *arg) {
  unsigned long long nbytes = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  if (!engine_live(self)) return NULL;
  ResidentObject *out = PyObject_New(ResidentObject, &ResidentType);
  if (!out) return NULL;
  out->r = NULL;
  out->exports = 0;
  out->exported = 0;
  out->closed = 0;
  Py_INCREF(self);
  out->eng = self;
  int rc = ferry_resident_create(self->e, nbytes, &out->r);
  if (rc) {
    raise_ferry(rc, ferry_last_error(self->e));
    Py_DECREF(out);
    return NULL;
  }
  self->residents_live++;
  return (PyObject *)out;
}

/* Engine.trim(keep_bytes=0) -> int: the pinned bytes given back to the OS
 * (ferry_arena_trim). munmap and cudaFreeHost take time: without the GIL,
 * as a call (engine_call_begin), so that a close() on another thread (the
 * user's, or snapshot(trim=)'s thread racing one) destroys the engine only
 * after the trim. */
PyObject *engine_trim(EngineObject *self, PyObject *args) {
  PyObject *keep_obj = NULL;
  if (!PyArg_ParseTuple(args, "|O!:trim", &PyLong_Type, &keep_obj)) return NULL;
  /* "K" would take -1 as 2**64 - 1 and silently keep everything. */
  unsigned long long keep = keep_obj ? PyLong_AsUnsignedLongLong(keep_obj) : 0;
  if (keep_obj && PyErr_Occurred()) {
    PyErr_Format(PyExc_ValueError, "Engine.trim: keep_bytes=%R is not a number of bytes "
                 "(>= 0) to keep reserved", keep_obj);
    return NULL;
  }
  if (!engine_live(self)) return NULL;
  uint64_t released = 0;
  int rc;
  ferry_engine *e = engine_call_begin(self);
  Py_BEGIN_ALLOW_THREADS rc = ferry_arena_trim(e, keep, &released);
  Py_END_ALLOW_THREADS
  PyObject *out = rc ? raise_ferry(rc, ferry_last_error(e))
                     : PyLong_FromUnsignedLongLong(released);
  engine_call_end(self);
  return out;
}
