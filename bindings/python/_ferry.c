/*
 * _ferry.c — the CPython extension behind `import ferry`.
 *
 * Python C API only: no libtorch headers or link, so one build works with
 * every torch that has torch.autograd.graph.saved_tensors_hooks (1.13+).
 * Tensors are reached through their Python attributes (data_ptr(), shape,
 * stride(), dtype ...), looked up with interned names.
 *
 * What lives here:
 *   - Engine: a ferry_engine with Python tensors as owner tokens
 *     (retain/release = Py_INCREF/Py_DECREF; device_alloc = torch.empty).
 *   - PackHook / UnpackHook: C callables handed to saved_tensors_hooks, so a
 *     saved tensor costs no Python frame. Tiny tensors take a fast keep path
 *     that never reaches the engine or the policy.
 *   - SiteHook: C callables registered as module forward pre/post hooks;
 *     they keep a stack of module "sites" (path, class, layer) so each saved
 *     tensor is described with the innermost module that saved it.
 *   - Handle: what a pack returns for a tensor given to the engine; its
 *     deallocation discards the engine handle (the graph was freed).
 *   - NodeCap: a host-memory cap shared by the processes of one node through
 *     POSIX shared memory (see the block comment there).
 *
 * Threads: every entry point runs with the GIL held (hooks are called by
 * torch with the GIL), and the GIL is never released around engine calls, so
 * the engine's callbacks (which touch Python objects) always run with it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "ferry_tools.h" /* snapshot(e) of policies: SnapshotPolicy */

/* ---- torch objects, looked up on first engine creation --------------------
 * `import ferry` must work without torch, so nothing here is touched at
 * module import. */
static struct {
  int ready;
  PyObject *torch;        /* module */
  PyTypeObject *tensor;   /* torch.Tensor */
  PyTypeObject *param;    /* torch.nn.Parameter */
  PyObject *strided;      /* torch.strided */
  PyObject *uint8;        /* torch.uint8 */
  PyObject *empty;        /* torch.empty */
  PyObject *empty_strided; /* torch.empty_strided */
  PyObject *cuda_current_stream; /* torch.cuda.current_stream, or NULL */
  int has_is_nested;
} T;

/* Interned attribute names. */
static PyObject *s_numel, *s_dtype, *s_requires_grad, *s_is_leaf, *s_data, *s_layout,
    *s_is_nested, *s_shape, *s_stride, *s_data_ptr, *s_base, *s_is_cuda, *s_get_device,
    *s_as_strided, *s_view, *s_storage_offset, *s_cuda_stream, *s_itemsize, *s_element_size,
    *s_device;

static int intern_names(void) {
#define I(var, str) \
  if (!(var = PyUnicode_InternFromString(str))) return -1;
  I(s_numel, "numel") I(s_dtype, "dtype") I(s_requires_grad, "requires_grad")
  I(s_is_leaf, "is_leaf") I(s_data, "data") I(s_layout, "layout") I(s_is_nested, "is_nested")
  I(s_shape, "shape") I(s_stride, "stride") I(s_data_ptr, "data_ptr") I(s_base, "_base")
  I(s_is_cuda, "is_cuda") I(s_get_device, "get_device") I(s_as_strided, "as_strided")
  I(s_view, "view") I(s_storage_offset, "storage_offset") I(s_cuda_stream, "cuda_stream")
  I(s_itemsize, "itemsize") I(s_element_size, "element_size") I(s_device, "device")
#undef I
  return 0;
}

static int torch_init(void) {
  if (T.ready) return 0;
  PyObject *torch = PyImport_ImportModule("torch");
  if (!torch) return -1;
  PyObject *nn = PyImport_ImportModule("torch.nn");
  PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
  PyObject *param = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
  PyObject *strided = PyObject_GetAttrString(torch, "strided");
  PyObject *uint8 = PyObject_GetAttrString(torch, "uint8");
  PyObject *empty = PyObject_GetAttrString(torch, "empty");
  PyObject *empty_strided = PyObject_GetAttrString(torch, "empty_strided");
  Py_XDECREF(nn);
  if (!tensor || !param || !strided || !uint8 || !empty || !empty_strided || !PyType_Check(tensor) ||
      !PyType_Check(param)) {
    Py_XDECREF(tensor);
    Py_XDECREF(param);
    Py_XDECREF(strided);
    Py_XDECREF(uint8);
    Py_XDECREF(empty);
    Py_XDECREF(empty_strided);
    Py_DECREF(torch);
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ImportError, "ferry: this torch lacks Tensor/Parameter types");
    return -1;
  }
  T.torch = torch;
  T.tensor = (PyTypeObject *)tensor;
  T.param = (PyTypeObject *)param;
  T.strided = strided;
  T.uint8 = uint8;
  T.empty = empty;
  T.empty_strided = empty_strided;
  T.has_is_nested = PyObject_HasAttr(tensor, s_is_nested);
  T.ready = 1;
  return 0;
}

/* ---- dtypes ------------------------------------------------------------------
 * torch.dtype objects are singletons: a short table keyed by identity. */
typedef struct dtype_info {
  PyObject *dtype; /* borrowed forever: dtypes are immortal in practice; we hold a ref */
  int32_t ferry;
  uint32_t itemsize;
} dtype_info;
#define MAX_DTYPES 48
static dtype_info dtypes[MAX_DTYPES];
static int n_dtypes;

/* "torch.bfloat16" -> FERRY_DTYPE_BF16, by the table in ferry.h. */
static int32_t ferry_dtype_of_name(const char *name) {
  if (strncmp(name, "torch.", 6) != 0) return FERRY_DTYPE_UNKNOWN;
  int d = ferry_dtype_from_name(name + 6);
  return d > 0 ? d : FERRY_DTYPE_UNKNOWN;
}

/* Returns the entry for dtype, adding it on first sight; NULL with an
 * exception set on failure. */
static const dtype_info *dtype_lookup(PyObject *dtype) {
  for (int i = 0; i < n_dtypes; i++)
    if (dtypes[i].dtype == dtype) return &dtypes[i];
  if (n_dtypes == MAX_DTYPES) {
    PyErr_SetString(PyExc_RuntimeError, "ferry: too many distinct dtypes");
    return NULL;
  }
  long itemsize = -1;
  PyObject *v = PyObject_GetAttr(dtype, s_itemsize); /* torch >= 2.1 */
  if (!v) {
    PyErr_Clear();
    /* torch 1.13: element_size() of an empty tensor of that dtype */
    PyObject *args = PyTuple_Pack(1, PyLong_FromLong(0));
    PyObject *kw = args ? Py_BuildValue("{sO}", "dtype", dtype) : NULL;
    PyObject *t = kw ? PyObject_Call(T.empty, args, kw) : NULL;
    if (args) Py_DECREF(PyTuple_GET_ITEM(args, 0));
    Py_XDECREF(args);
    Py_XDECREF(kw);
    if (t) {
      v = PyObject_CallMethodNoArgs(t, s_element_size);
      Py_DECREF(t);
    }
  }
  if (!v) return NULL;
  itemsize = PyLong_AsLong(v);
  Py_DECREF(v);
  if (itemsize <= 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ferry: dtype with itemsize 0");
    return NULL;
  }
  PyObject *str = PyObject_Str(dtype);
  if (!str) return NULL;
  const char *name = PyUnicode_AsUTF8(str);
  int32_t code = name ? ferry_dtype_of_name(name) : FERRY_DTYPE_UNKNOWN;
  Py_DECREF(str);
  Py_INCREF(dtype);
  dtypes[n_dtypes] = (dtype_info){dtype, code, (uint32_t)itemsize};
  return &dtypes[n_dtypes++];
}

/* ---- engine ------------------------------------------------------------------ */
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
static const char *keep_reason_names[KEEP_REASONS_] = {
    "kept_small", "kept_subclass", "kept_sparse", "kept_nested",
    "kept_device", "kept_non_dense", "kept_ndim", "kept_pack_error"};

typedef struct EngineObject EngineObject;

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
  int in_backward;    /* an unpack happened in this step */
  int in_step;
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
  PyObject *last_pack_error; /* str or NULL */
  struct HandleObject *unpacking; /* the handle in ferry_unpack, for device_alloc */
  PyObject *node_cap;        /* NodeCap kept alive while the engine uses it */
  PyObject *weakreflist;
};

static PyTypeObject EngineType, HandleType, PackHookType, UnpackHookType, SiteHookType,
    NodeCapType;

static PyObject *FerryError; /* ferry.FerryError(RuntimeError) */

static PyObject *raise_ferry(int code, const char *msg) {
  PyObject *args = Py_BuildValue("(ss)", msg && *msg ? msg : ferry_strerror(code),
                                 ferry_err_name(code));
  if (args) {
    PyErr_SetObject(FerryError, args);
    Py_DECREF(args);
  }
  return NULL;
}

static int engine_live(EngineObject *self) {
  if (self->e) return 1;
  PyErr_SetString(FerryError, "ferry: this engine was closed");
  return 0;
}

/* Engine callbacks. All run with the GIL held (see the file comment); the
 * PyGILState calls make that true even for an embedder that calls the engine
 * from a thread without it. */
static PyObject *empty_like_handle(EngineObject *self, uint64_t bytes);
static PyObject *int_tuple(const int64_t *v, int32_t n);

static int cb_device_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  EngineObject *self = ud;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = -1;
  /* The handle being unpacked gets a buffer with its own dtype and strides,
   * so unpack hands it out as is; others (prefetches) get raw bytes. */
  PyObject *t = empty_like_handle(self, bytes);
  if (!t && !PyErr_Occurred()) {
    PyObject *args = Py_BuildValue("(K)", (unsigned long long)bytes);
    t = args ? PyObject_Call(T.empty, args, self->alloc_kw) : NULL;
    Py_XDECREF(args);
  }
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

static void cb_retain(void *ud, void *owner) {
  /* Called under the engine's lock; the GIL is held by our caller. */
  Py_INCREF((PyObject *)owner);
}

/* ---- NodeCap: a host cap shared by the processes of one node --------------
 * One POSIX shared-memory segment per name holds the cap and one slot per
 * process: its pid, its start time (so a reused pid is not mistaken for the
 * dead rank) and the pinned bytes it reserved. A process-shared robust mutex
 * guards it: a rank killed while holding it leaves EOWNERDEAD, and the next
 * locker marks it consistent. Reserving sums the slots of live processes
 * only and frees the slots of dead ones, so a killed rank's share comes back
 * on the next reservation of any other rank. */
#define NODECAP_MAGIC 0x66657279636170ull /* "ferycap" */
#define NODECAP_SLOTS 256

typedef struct nodecap_slot {
  int32_t pid;
  int32_t reserved0;
  uint64_t start_time; /* /proc/<pid>/stat field 22 */
  uint64_t bytes;
  uint64_t peak;
} nodecap_slot;

typedef struct nodecap_shm {
  _Atomic uint64_t magic; /* set last by the creator */
  uint64_t cap;
  pthread_mutex_t lock;
  uint64_t reclaimed_bytes; /* from dead processes, ever */
  uint64_t refusals;
  nodecap_slot slots[NODECAP_SLOTS];
} nodecap_shm;

typedef struct {
  PyObject_HEAD nodecap_shm *shm;
  int slot;
  char name[128];
} NodeCapObject;

static uint64_t proc_start_time(int pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')'); /* comm may hold spaces */
  if (!p) return 0;
  unsigned long long v = 0;
  /* after ")": state(3) ... starttime is field 22 */
  int field = 2;
  for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " ")) {
    if (++field == 22) {
      v = strtoull(tok, NULL, 10);
      break;
    }
  }
  return v;
}

static int slot_alive(const nodecap_slot *s) {
  if (!s->pid) return 0;
  if (kill(s->pid, 0) != 0 && errno == ESRCH) return 0;
  uint64_t st = proc_start_time(s->pid);
  if (st == 0) return 0; /* gone, or a zombie whose /proc entry vanished */
  /* A zombie still has /proc but holds no memory: treat as dead. */
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", s->pid);
  FILE *f = fopen(path, "r");
  if (f) {
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (p && p[1] == ' ' && p[2] == 'Z') return 0;
  }
  return st == s->start_time;
}

static int nodecap_lock(nodecap_shm *m) {
  int rc = pthread_mutex_lock(&m->lock);
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&m->lock);
    rc = 0;
  }
  return rc;
}

/* With the lock held: free dead slots, return the live total. */
static uint64_t nodecap_sweep(nodecap_shm *m) {
  uint64_t total = 0;
  for (int i = 0; i < NODECAP_SLOTS; i++) {
    nodecap_slot *s = &m->slots[i];
    if (!s->pid) continue;
    if (!slot_alive(s)) {
      m->reclaimed_bytes += s->bytes;
      memset(s, 0, sizeof *s);
      continue;
    }
    total += s->bytes;
  }
  return total;
}

/* 0 = reserved; 1 = refused by the cap. Release with release != 0. */
static int nodecap_reserve(NodeCapObject *nc, uint64_t bytes, int release) {
  nodecap_shm *m = nc->shm;
  if (nodecap_lock(m)) return 1;
  nodecap_slot *me = &m->slots[nc->slot];
  int refused = 0;
  if (release) {
    me->bytes = bytes > me->bytes ? 0 : me->bytes - bytes;
  } else {
    uint64_t total = nodecap_sweep(m);
    if (me->pid != getpid()) { /* swept by a confused peer: re-claim */
      me->pid = getpid();
      me->start_time = proc_start_time(getpid());
    }
    if (bytes > m->cap || total > m->cap - bytes) {
      refused = 1;
      m->refusals++;
    } else {
      me->bytes += bytes;
      if (me->bytes > me->peak) me->peak = me->bytes;
    }
  }
  pthread_mutex_unlock(&m->lock);
  return refused;
}

static int nodecap_init(NodeCapObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "cap_bytes", NULL};
  const char *name;
  unsigned long long cap;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sK", kwlist, &name, &cap)) return -1;
  if (self->shm) {
    PyErr_SetString(PyExc_RuntimeError, "NodeCap already initialised");
    return -1;
  }
  if (!cap) {
    PyErr_SetString(PyExc_ValueError, "NodeCap: cap_bytes must be > 0");
    return -1;
  }
  if (!*name || strchr(name, '/') || strlen(name) > 100) {
    PyErr_Format(PyExc_ValueError,
                 "NodeCap: name %R must be 1-100 characters without '/'", PyTuple_GET_ITEM(args, 0));
    return -1;
  }
  snprintf(self->name, sizeof self->name, "/%s", name);
  int creator = 1;
  int fd = shm_open(self->name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 && errno == EEXIST) {
    creator = 0;
    fd = shm_open(self->name, O_RDWR, 0600);
  }
  if (fd < 0) {
    PyErr_Format(PyExc_OSError, "NodeCap: shm_open(%s): %s", self->name, strerror(errno));
    return -1;
  }
  if (creator && ftruncate(fd, sizeof(nodecap_shm)) != 0) {
    PyErr_Format(PyExc_OSError, "NodeCap: ftruncate(%s): %s", self->name, strerror(errno));
    close(fd);
    shm_unlink(self->name);
    return -1;
  }
  if (!creator) { /* wait for the creator's ftruncate */
    struct stat st;
    for (int i = 0; i < 2000; i++) {
      if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(nodecap_shm)) break;
      usleep(1000);
    }
  }
  nodecap_shm *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    PyErr_Format(PyExc_OSError, "NodeCap: mmap(%s): %s", self->name, strerror(errno));
    return -1;
  }
  if (creator) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&m->lock, &a);
    pthread_mutexattr_destroy(&a);
    m->cap = cap;
    atomic_store_explicit(&m->magic, NODECAP_MAGIC, memory_order_release);
  } else {
    int i;
    for (i = 0; i < 2000; i++) {
      if (atomic_load_explicit(&m->magic, memory_order_acquire) == NODECAP_MAGIC) break;
      usleep(1000);
    }
    if (i == 2000) {
      munmap(m, sizeof *m);
      PyErr_Format(PyExc_RuntimeError, "NodeCap: segment %s was never initialised", self->name);
      return -1;
    }
    if (m->cap != cap) {
      unsigned long long have = m->cap;
      munmap(m, sizeof *m);
      PyErr_Format(PyExc_ValueError,
                   "NodeCap %s: this process asks for a cap of %llu bytes but the node's "
                   "segment was created with %llu; give every local rank the same cap",
                   self->name, cap, have);
      return -1;
    }
  }
  if (nodecap_lock(m)) {
    munmap(m, sizeof *m);
    PyErr_SetString(PyExc_RuntimeError, "NodeCap: cannot lock the shared segment");
    return -1;
  }
  nodecap_sweep(m);
  int slot = -1;
  for (int i = 0; i < NODECAP_SLOTS && slot < 0; i++)
    if (!m->slots[i].pid) slot = i;
  if (slot >= 0) {
    m->slots[slot].pid = getpid();
    m->slots[slot].start_time = proc_start_time(getpid());
    m->slots[slot].bytes = m->slots[slot].peak = 0;
  }
  pthread_mutex_unlock(&m->lock);
  if (slot < 0) {
    munmap(m, sizeof *m);
    PyErr_Format(PyExc_RuntimeError, "NodeCap %s: all %d process slots are in use", self->name,
                 NODECAP_SLOTS);
    return -1;
  }
  self->shm = m;
  self->slot = slot;
  return 0;
}

static void nodecap_dealloc(NodeCapObject *self) {
  if (self->shm) {
    if (nodecap_lock(self->shm) == 0) {
      memset(&self->shm->slots[self->slot], 0, sizeof(nodecap_slot));
      pthread_mutex_unlock(&self->shm->lock);
    }
    munmap(self->shm, sizeof *self->shm);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int nodecap_ready(NodeCapObject *self) {
  if (self->shm) return 1;
  PyErr_SetString(PyExc_RuntimeError, "NodeCap is not initialised");
  return 0;
}

static PyObject *nodecap_reserve_py(NodeCapObject *self, PyObject *arg) {
  if (!nodecap_ready(self)) return NULL;
  unsigned long long n = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  return PyBool_FromLong(!nodecap_reserve(self, n, 0));
}

static PyObject *nodecap_release_py(NodeCapObject *self, PyObject *arg) {
  if (!nodecap_ready(self)) return NULL;
  unsigned long long n = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  nodecap_reserve(self, n, 1);
  Py_RETURN_NONE;
}

static PyObject *nodecap_state(NodeCapObject *self, PyObject *unused) {
  if (!nodecap_ready(self)) return NULL;
  nodecap_shm *m = self->shm;
  if (nodecap_lock(m)) return PyErr_Format(PyExc_RuntimeError, "NodeCap: lock failed");
  uint64_t total = nodecap_sweep(m);
  PyObject *slots = PyDict_New();
  for (int i = 0; slots && i < NODECAP_SLOTS; i++) {
    if (!m->slots[i].pid) continue;
    PyObject *k = PyLong_FromLong(m->slots[i].pid);
    PyObject *v = PyLong_FromUnsignedLongLong(m->slots[i].bytes);
    if (!k || !v || PyDict_SetItem(slots, k, v)) Py_CLEAR(slots);
    Py_XDECREF(k);
    Py_XDECREF(v);
  }
  uint64_t cap = m->cap, mine = m->slots[self->slot].bytes, rec = m->reclaimed_bytes,
           ref = m->refusals;
  pthread_mutex_unlock(&m->lock);
  if (!slots) return NULL;
  return Py_BuildValue("{sKsKsKsKsKsN}", "cap", (unsigned long long)cap, "total",
                       (unsigned long long)total, "mine", (unsigned long long)mine,
                       "reclaimed", (unsigned long long)rec, "refusals",
                       (unsigned long long)ref, "slots", slots);
}

static PyObject *nodecap_unlink(PyObject *unused, PyObject *arg) {
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name) return NULL;
  char full[128];
  snprintf(full, sizeof full, "/%s", name);
  if (shm_unlink(full) != 0 && errno != ENOENT)
    return PyErr_Format(PyExc_OSError, "shm_unlink(%s): %s", full, strerror(errno));
  Py_RETURN_NONE;
}

static PyMethodDef nodecap_methods[] = {
    {"reserve", (PyCFunction)nodecap_reserve_py, METH_O,
     "reserve(nbytes) -> bool: take nbytes of the node's cap for this process."},
    {"release", (PyCFunction)nodecap_release_py, METH_O, "release(nbytes): give bytes back."},
    {"state", (PyCFunction)nodecap_state, METH_NOARGS,
     "state() -> dict(cap, total, mine, reclaimed, refusals, slots={pid: bytes})."},
    {NULL}};

static PyTypeObject NodeCapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.NodeCap",
    .tp_basicsize = sizeof(NodeCapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NodeCap(name, cap_bytes): a pinned-host-memory cap shared by the processes of "
              "one node through POSIX shared memory /name.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)nodecap_init,
    .tp_dealloc = (destructor)nodecap_dealloc,
    .tp_methods = nodecap_methods,
};

#ifdef FERRY_HAVE_RESERVE_FN
static int cb_reserve(void *ud, uint64_t bytes, int release) {
  return nodecap_reserve((NodeCapObject *)ud, bytes, release);
}
#endif

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

static PyObject *make_hook(PyTypeObject *type, EngineObject *eng);

static int engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"backend", "policy_path", "policy_source", "trace_path",
                           "host_cap_bytes", "host_cap_pct", "min_offload_bytes",
                           "max_fwd_stash", "prefetch_distance", "link", "arena",
                           "device", "policy_trusted", "node_cap", "fast_keep", NULL};
  const char *backend = "host", *policy_path = NULL, *policy_source = NULL, *trace_path = NULL,
             *arena = "auto";
  unsigned long long cap_bytes = 0, min_bytes = 1024;
  double cap_pct = 0;
  unsigned int max_stash = 4, prefetch = 2;
  PyObject *link = Py_None, *node_cap = Py_None;
  int device = -1, trusted = 0, fast_keep = 1;
  if (self->e) {
    PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|szzzKdKIIOsipOp", kwlist, &backend, &policy_path,
                                   &policy_source, &trace_path, &cap_bytes, &cap_pct, &min_bytes,
                                   &max_stash, &prefetch, &link, &arena, &device, &trusted,
                                   &node_cap, &fast_keep))
    return -1;
  ferry_config cfg;
  ferry_config_init(&cfg);
  cfg.backend = backend_of(backend);
  if (cfg.backend < 0) {
    PyErr_Format(PyExc_ValueError, "ferry: backend '%s' is not one of host, cuda, sim", backend);
    return -1;
  }
  cfg.arena = arena_of(arena);
  if (cfg.arena < 0) {
    PyErr_Format(PyExc_ValueError, "ferry: arena '%s' is not one of auto, jemalloc, pool", arena);
    return -1;
  }
  if (link != Py_None &&
      !PyArg_ParseTuple(link, "dddd;link must be (d2h_bytes_per_s, h2d_bytes_per_s, latency_us, "
                              "duplex)",
                        &cfg.link.d2h_bytes_per_s, &cfg.link.h2d_bytes_per_s,
                        &cfg.link.latency_us, &cfg.link.duplex))
    return -1;
  if (torch_init()) return -1;
  cfg.device = device;
  cfg.host_cap_bytes = cap_bytes;
  cfg.host_cap_pct = cap_pct;
  cfg.min_offload_bytes = min_bytes;
  cfg.max_fwd_stash = max_stash;
  cfg.prefetch_distance = prefetch;
  cfg.device_alloc = cb_device_alloc;
  cfg.release = cb_release;
  cfg.retain = cb_retain;
  cfg.callback_ud = self;
  cfg.policy_path = policy_path;
  cfg.policy_source = policy_source;
  cfg.policy_trusted = trusted;
  cfg.trace_path = trace_path;
  if (node_cap != Py_None) {
    if (!PyObject_TypeCheck(node_cap, &NodeCapType) || !((NodeCapObject *)node_cap)->shm) {
      PyErr_SetString(PyExc_TypeError, "ferry: node_cap must be an initialised NodeCap");
      return -1;
    }
#ifdef FERRY_HAVE_RESERVE_FN
    cfg.host_reserve = cb_reserve;
    cfg.host_reserve_ud = node_cap;
#else
    PyErr_SetString(PyExc_NotImplementedError,
                    "ferry: this libferry has no host_reserve hook; a node-wide cap needs it");
    return -1;
#endif
    Py_INCREF(node_cap);
    self->node_cap = node_cap;
  }
  self->backend = cfg.backend;
  self->device_index = device < 0 ? 0 : device;
  self->alloc_kw = PyDict_New();
  if (!self->alloc_kw || PyDict_SetItemString(self->alloc_kw, "dtype", T.uint8)) return -1;
  if (cfg.backend == FERRY_BACKEND_CUDA) {
    PyObject *dev = PyUnicode_FromFormat("cuda:%d", self->device_index);
    int bad = !dev || PyDict_SetItemString(self->alloc_kw, "device", dev);
    Py_XDECREF(dev);
    if (bad) return -1;
    PyObject *cuda = PyObject_GetAttrString(T.torch, "cuda");
    T.cuda_current_stream = cuda ? PyObject_GetAttrString(cuda, "current_stream") : NULL;
    Py_XDECREF(cuda);
    if (!T.cuda_current_stream) return -1;
  }
  char err[512] = "";
  ferry_engine *e = NULL;
  int rc = ferry_engine_create(&cfg, &e, err, sizeof err);
  if (rc) {
    raise_ferry(rc, err);
    return -1;
  }
  self->e = e;
  self->min_bytes = effective_min_bytes(e);
  self->fast_keep = fast_keep && !trace_path;
  self->pack_hook = make_hook(&PackHookType, self);
  self->unpack_hook = make_hook(&UnpackHookType, self);
  if (!self->pack_hook || !self->unpack_hook) return -1;
  return 0;
}

static void engine_close_impl(EngineObject *self) {
  if (!self->e) return;
  ferry_engine *e = self->e;
  /* Handles still alive become invalid: they hold a reference to this
   * object, so close only happens explicitly or when none is left. */
  self->e = NULL;
  ferry_engine_destroy(e);
}

static int engine_traverse(EngineObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->pack_hook);
  Py_VISIT(self->unpack_hook);
  return 0;
}

static int engine_clear(EngineObject *self) {
  Py_CLEAR(self->pack_hook);
  Py_CLEAR(self->unpack_hook);
  return 0;
}

static void engine_dealloc(EngineObject *self) {
  PyObject_GC_UnTrack(self);
  if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
  engine_clear(self);
  engine_close_impl(self);
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
  int rc = ferry_step_begin(self->e);
  if (!rc) self->in_step = 1;
  return check_rc(self, rc);
}

/* Ends the step. Returns the number of handles still live (retain_graph, or
 * a graph kept by the user): they stay valid; 0 is the normal case. */
static PyObject *engine_step_end(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  if (self->in_backward) ferry_backward_end(self->e);
  self->in_backward = 0;
  self->depth = 0;
  self->in_step = 0;
  int rc = ferry_step_end(self->e);
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
  self->in_backward = 1;
  return check_rc(self, ferry_backward_begin(self->e));
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
  S(policy_cache_hits); S(policy_disabled);
#undef S
  for (int i = 0; i < KEEP_REASONS_; i++) PUT(keep_reason_names[i], self->kept[i]);
  PUT("recompute_packs", self->recompute_packs);
  PUT("unpack_rebuilds", self->rebuilds);
  PUT("pack_errors", self->pack_errors);
  PUT("unpacks_repeated", self->unpacks_repeated);
  PUT("device_allocs", self->allocs_live); /* device_alloc callback calls */
#undef PUT
  return d;
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

/* Kind of the storage holding ptr: a parameter/buffer range, or activation.
 * Ranges may nest (a flat buffer and views into it), so after the binary
 * search look back over ranges that start before ptr. */
static int32_t kind_of_ptr(const EngineObject *self, uintptr_t p) {
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

static PyObject *engine_kind_of(EngineObject *self, PyObject *arg) {
  uintptr_t p = (uintptr_t)PyLong_AsVoidPtr(arg);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromLong(kind_of_ptr(self, p));
}

static PyObject *engine_hooks(EngineObject *self, PyObject *unused) {
  return PyTuple_Pack(2, self->pack_hook, self->unpack_hook);
}

static PyObject *engine_site_hooks(EngineObject *self, PyObject *arg);

static PyObject *engine_info(EngineObject *self, PyObject *unused) {
  if (!engine_live(self)) return NULL;
  return Py_BuildValue("{sssssKsi}", "backend", ferry_backend_name(self->e), "arena",
                       ferry_arena_name(self->e), "min_offload_bytes",
                       (unsigned long long)self->min_bytes, "fast_keep", self->fast_keep);
}

static PyObject *engine_get_closed(EngineObject *self, void *unused) {
  return PyBool_FromLong(self->e == NULL);
}

static PyObject *engine_get_in_step(EngineObject *self, void *unused) {
  return PyBool_FromLong(self->in_step);
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
    {"module_depth", (getter)engine_get_depth, NULL, "current module stack depth", NULL},
    {"min_offload_bytes", (getter)engine_get_min_bytes, (setter)engine_set_min_bytes,
     "the fast keep path's threshold (the engine's min_offload_bytes)", NULL},
    {NULL}};

static PyObject *engine_snapshot(EngineObject *self, PyObject *args);

static PyMethodDef engine_methods[] = {
    {"close", (PyCFunction)engine_close, METH_NOARGS, "Destroy the engine now."},
    {"step_begin", (PyCFunction)engine_step_begin, METH_NOARGS, NULL},
    {"step_end", (PyCFunction)engine_step_end, METH_NOARGS,
     "End the step; returns the number of handles still live (0 normally)."},
    {"backward_begin", (PyCFunction)engine_backward_begin, METH_NOARGS, NULL},
    {"set_policy", (PyCFunction)(void (*)(void))engine_set_policy, METH_VARARGS | METH_KEYWORDS,
     "set_policy(path=None, source=None, trusted=False), between steps."},
    {"stats", (PyCFunction)engine_stats, METH_NOARGS, "Engine stats and binding counters."},
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
    {"snapshot", (PyCFunction)engine_snapshot, METH_VARARGS,
     "snapshot(path, records) -> Snapshot: start a checkpoint snapshot (ferry_snapshot_start). "
     "records: (name, bytes-like) for host bytes copied now, or (name, data_ptr, nbytes, owner, "
     "is_host) for memory read later (device) or now (is_host); owner is kept until fence()."},
    {NULL}};

static PyTypeObject EngineType = {
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

/* ---- Handle ------------------------------------------------------------------- */
typedef struct HandleObject {
  PyObject_HEAD EngineObject *eng;
  ferry_handle h;   /* 0 once unpacked */
  PyObject *dtype;  /* torch.dtype */
  PyObject *result; /* the unpacked tensor, for a second unpack (retain_graph) */
  int32_t ndim;
  int64_t shape[FERRY_MAX_DIMS];
  int64_t strides[FERRY_MAX_DIMS];
} HandleObject;

static void handle_dealloc(HandleObject *self) {
  if (self->h && self->eng && self->eng->e) ferry_discard(self->eng->e, self->h);
  Py_XDECREF(self->result);
  Py_XDECREF(self->dtype);
  Py_XDECREF(self->eng);
  PyObject_Free(self);
}

static PyObject *handle_repr(HandleObject *self) {
  return PyUnicode_FromFormat("<ferry handle 0x%llx%s>", (unsigned long long)self->h,
                              self->h ? "" : " (unpacked)");
}

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A saved tensor held by a ferry engine.",
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_repr = (reprfunc)handle_repr,
};

/* ---- hooks ---------------------------------------------------------------------- */
static PyObject *pack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames);
static PyObject *unpack_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames);

static PyObject *make_hook(PyTypeObject *type, EngineObject *eng) {
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

/* The object a kept tensor is stored as. A tensor with a grad_fn (an output
 * the saving node produced) must not be stored as is: its grad_fn owns the
 * saved variable, which would own the tensor — a C++ reference cycle that
 * Python's gc cannot see, leaking the graph when backward never runs. An
 * alias without autograd metadata (`.data`) breaks it. */
static PyObject *keep_object(PyObject *t) {
  PyObject *rg = PyObject_GetAttr(t, s_requires_grad);
  if (!rg) return NULL;
  int needs_alias = rg == Py_True;
  Py_DECREF(rg);
  if (needs_alias) {
    PyObject *leaf = PyObject_GetAttr(t, s_is_leaf);
    if (!leaf) return NULL;
    needs_alias = leaf == Py_False;
    Py_DECREF(leaf);
  }
  if (needs_alias) return PyObject_GetAttr(t, s_data);
  Py_INCREF(t);
  return t;
}

static PyObject *keep_with(EngineObject *eng, PyObject *t, int reason) {
  eng->kept[reason]++;
  return keep_object(t);
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

static void *compute_stream(EngineObject *eng) {
  if (eng->backend != FERRY_BACKEND_CUDA) return NULL;
  PyObject *s = PyObject_CallNoArgs(T.cuda_current_stream);
  if (!s) return NULL;
  PyObject *p = PyObject_GetAttr(s, s_cuda_stream);
  Py_DECREF(s);
  if (!p) return NULL;
  void *ptr = PyLong_AsVoidPtr(p);
  Py_DECREF(p);
  return ptr;
}

static PyObject *pack_impl(EngineObject *eng, PyObject *t) {
  PyTypeObject *tp = Py_TYPE(t);
  if (tp != T.tensor && tp != T.param) {
    if (!PyObject_TypeCheck(t, T.tensor))
      return PyErr_Format(PyExc_TypeError, "ferry pack hook: expected a torch.Tensor, got %s",
                          tp->tp_name);
    return keep_with(eng, t, KEEP_SUBCLASS);
  }
  /* Fast path first: the size, from numel and dtype only. */
  PyObject *v = PyObject_CallMethodNoArgs(t, s_numel);
  if (!v) return NULL;
  long long numel = PyLong_AsLongLong(v);
  Py_DECREF(v);
  if (numel < 0) return NULL;
  v = PyObject_GetAttr(t, s_dtype);
  if (!v) return NULL;
  const dtype_info *di = dtype_lookup(v);
  Py_DECREF(v);
  if (!di) return NULL;
  uint64_t bytes = (uint64_t)numel * di->itemsize;
  if (bytes == 0 || (eng->fast_keep && bytes < eng->min_bytes))
    return keep_with(eng, t, KEEP_SMALL);
  v = PyObject_GetAttr(t, s_layout);
  if (!v) return NULL;
  int strided = v == T.strided;
  Py_DECREF(v);
  if (!strided) return keep_with(eng, t, KEEP_SPARSE);
  if (!eng->e) return keep_with(eng, t, KEEP_ERROR);
  if (T.has_is_nested) {
    v = PyObject_GetAttr(t, s_is_nested);
    if (!v) return NULL;
    int nested = v == Py_True;
    Py_DECREF(v);
    if (nested) return keep_with(eng, t, KEEP_NESTED);
  }
  /* device */
  v = PyObject_GetAttr(t, s_is_cuda);
  if (!v) return NULL;
  int is_cuda = v == Py_True;
  Py_DECREF(v);
  if (eng->backend == FERRY_BACKEND_CUDA) {
    if (!is_cuda) return keep_with(eng, t, KEEP_DEVICE);
    v = PyObject_CallMethodNoArgs(t, s_get_device);
    if (!v) return NULL;
    long dev = PyLong_AsLong(v);
    Py_DECREF(v);
    if (dev != eng->device_index) return keep_with(eng, t, KEEP_DEVICE);
  } else if (is_cuda) {
    return keep_with(eng, t, KEEP_DEVICE);
  } else {
    v = PyObject_GetAttr(t, s_device); /* meta, mps, xla...: not host memory */
    if (!v) return NULL;
    PyObject *ty = PyObject_GetAttrString(v, "type");
    Py_DECREF(v);
    if (!ty) return NULL;
    int cpu = PyUnicode_CompareWithASCIIString(ty, "cpu") == 0;
    Py_DECREF(ty);
    if (!cpu) return keep_with(eng, t, KEEP_DEVICE);
  }
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  int64_t strides[FERRY_MAX_DIMS];
  int32_t nstrides = 0;
  v = PyObject_GetAttr(t, s_shape);
  if (!v) return NULL;
  int r = read_int_tuple(v, d.shape, &d.ndim);
  Py_DECREF(v);
  if (r < 0) return NULL;
  if (r > 0) return keep_with(eng, t, KEEP_NDIM);
  v = PyObject_CallMethodNoArgs(t, s_stride);
  if (!v) return NULL;
  r = read_int_tuple(v, strides, &nstrides);
  Py_DECREF(v);
  if (r) return r < 0 ? NULL : keep_with(eng, t, KEEP_NDIM);
  int contig;
  if (!dense_span(d.ndim, d.shape, strides, &contig)) return keep_with(eng, t, KEEP_NON_DENSE);
  v = PyObject_CallMethodNoArgs(t, s_data_ptr);
  if (!v) return NULL;
  void *ptr = PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  if (!ptr) return PyErr_Occurred() ? NULL : keep_with(eng, t, KEEP_ERROR);
  v = PyObject_GetAttr(t, s_base);
  if (!v) return NULL;
  int is_view = v != Py_None;
  Py_DECREF(v);

  d.bytes = bytes;
  d.dtype = di->ferry;
  d.kind = kind_of_ptr(eng, (uintptr_t)ptr);
  d.flags = (is_view ? FERRY_FLAG_VIEW : 0) | (contig ? FERRY_FLAG_CONTIGUOUS : 0);
  d.phase = eng->in_backward ? FERRY_PHASE_RECOMPUTE : FERRY_PHASE_FORWARD;
  if (eng->depth && (uint32_t)eng->stack[eng->depth - 1] < eng->n_sites) {
    const site *s = &eng->sites[eng->stack[eng->depth - 1]];
    d.module_path = s->path;
    d.module_class = s->cls;
    d.layer = s->layer;
    d.layer_count = s->layer_count;
  } else {
    d.layer = -1;
  }
  if (eng->in_backward) eng->recompute_packs++;

  HandleObject *hd = PyObject_New(HandleObject, &HandleType);
  if (!hd) return NULL;
  hd->h = 0;
  hd->result = NULL;
  hd->ndim = d.ndim;
  memcpy(hd->shape, d.shape, sizeof hd->shape);
  memcpy(hd->strides, strides, sizeof hd->strides);
  hd->dtype = di->dtype;
  Py_INCREF(hd->dtype);
  Py_INCREF(eng);
  hd->eng = eng;
  PyObject *owner = keep_object(t);
  if (!owner) {
    Py_DECREF(hd);
    return NULL;
  }
  void *stream = compute_stream(eng);
  if (PyErr_Occurred()) {
    Py_DECREF(owner);
    Py_DECREF(hd);
    return NULL;
  }
  ferry_handle h = 0;
  int rc = ferry_pack(eng->e, &d, ptr, owner, stream, &h);
  if (rc) {
    /* Nothing is lost: the tensor is kept as a plain saved tensor. */
    eng->pack_errors++;
    eng->kept[KEEP_ERROR]++;
    Py_XSETREF(eng->last_pack_error, PyUnicode_FromString(ferry_last_error(eng->e)));
    if (!eng->last_pack_error) PyErr_Clear();
    Py_DECREF(hd);
    return owner;
  }
  hd->h = h;
  return (PyObject *)hd;
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
  PyObject *v = PyObject_GetAttr(t, s_dtype);
  if (!v) return -1;
  int same = v == hd->dtype;
  Py_DECREF(v);
  if (!same) return 0;
  int64_t buf[FERRY_MAX_DIMS];
  int32_t n = 0;
  v = PyObject_GetAttr(t, s_shape);
  if (!v) return -1;
  int r = read_int_tuple(v, buf, &n);
  Py_DECREF(v);
  if (r) return r < 0 ? -1 : 0;
  if (n != hd->ndim || memcmp(buf, hd->shape, sizeof(int64_t) * (size_t)n)) return 0;
  v = PyObject_CallMethodNoArgs(t, s_stride);
  if (!v) return -1;
  r = read_int_tuple(v, buf, &n);
  Py_DECREF(v);
  if (r) return r < 0 ? -1 : 0;
  if (n != hd->ndim || memcmp(buf, hd->strides, sizeof(int64_t) * (size_t)n)) return 0;
  v = PyObject_CallMethodNoArgs(t, s_data_ptr);
  if (!v) return -1;
  same = PyLong_AsVoidPtr(v) == ptr;
  Py_DECREF(v);
  return same;
}

static PyObject *int_tuple(const int64_t *v, int32_t n) {
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
static PyObject *empty_like_handle(EngineObject *self, uint64_t bytes) {
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

static PyObject *unpack_impl(EngineObject *eng, PyObject *obj) {
  if (Py_TYPE(obj) != &HandleType) { /* kept as a plain tensor */
    Py_INCREF(obj);
    return obj;
  }
  HandleObject *hd = (HandleObject *)obj;
  if (!hd->h) {
    if (hd->result) { /* unpacked before: backward over a retained graph */
      eng->unpacks_repeated++;
      Py_INCREF(hd->result);
      return hd->result;
    }
    return PyErr_Format(FerryError, "ferry: saved tensor handle was lost");
  }
  if (!hd->eng->e) return PyErr_Format(FerryError, "ferry: the engine holding this saved tensor was closed");
  if (!eng->in_backward) {
    eng->in_backward = 1;
    ferry_backward_begin(eng->e);
  }
  void *stream = compute_stream(eng);
  if (PyErr_Occurred()) return NULL;
  void *ptr = NULL, *owner = NULL;
  eng->unpacking = hd;
  int rc = ferry_unpack(eng->e, hd->h, stream, &ptr, &owner);
  eng->unpacking = NULL;
  if (rc) return raise_ferry(rc, ferry_last_error(eng->e));
  hd->h = 0;
  PyObject *res = rebuild(eng, hd, (PyObject *)owner, ptr);
  if (!res) return NULL;
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

static PyTypeObject PackHookType = {
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

static PyTypeObject UnpackHookType = {
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

static PyTypeObject SiteHookType = {
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

static PyObject *engine_site_hooks(EngineObject *self, PyObject *arg) {
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

static PyTypeObject SnapshotType;

static PyObject *snapshot_raise(SnapshotObject *self, int rc) {
  const char *msg = ferry_snapshot_error(self->s);
  return raise_ferry(rc, msg);
}

static PyObject *snapshot_fence(SnapshotObject *self, PyObject *unused) {
  if (!self->s) return raise_ferry(FERRY_ESTATE, "ferry: this snapshot was freed");
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
  if (!self->s) return raise_ferry(FERRY_ESTATE, "ferry: this snapshot was freed");
  int rc = ferry_snapshot_poll(self->s);
  if (rc == 1) Py_RETURN_FALSE;
  if (rc) return snapshot_raise(self, rc);
  Py_CLEAR(self->owners);
  Py_RETURN_TRUE;
}

static PyObject *snapshot_wait(SnapshotObject *self, PyObject *unused) {
  if (!self->s) return raise_ferry(FERRY_ESTATE, "ferry: this snapshot was freed");
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = ferry_snapshot_wait(self->s);
  Py_END_ALLOW_THREADS
  Py_CLEAR(self->owners);
  if (rc) return snapshot_raise(self, rc);
  Py_RETURN_NONE;
}

static PyObject *snapshot_error(SnapshotObject *self, PyObject *unused) {
  return PyUnicode_FromString(self->s ? ferry_snapshot_error(self->s) : "");
}

static void snapshot_dealloc(SnapshotObject *self) {
  if (self->s) {
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

static PyTypeObject SnapshotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.Snapshot",
    .tp_basicsize = sizeof(SnapshotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A checkpoint snapshot in progress (Engine.snapshot).",
    .tp_dealloc = (destructor)snapshot_dealloc,
    .tp_methods = snapshot_methods,
    .tp_getset = snapshot_getset,
};

static PyObject *engine_snapshot(EngineObject *self, PyObject *args) {
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
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *r = PySequence_Fast_GET_ITEM(seq, i);
    Py_ssize_t len = PyTuple_Check(r) ? PyTuple_GET_SIZE(r) : -1;
    if ((len != 2 && len != 5) || !PyUnicode_Check(PyTuple_GET_ITEM(r, 0))) {
      PyErr_Format(PyExc_TypeError,
                   "ferry: snapshot record %zd must be (name, bytes) or "
                   "(name, data_ptr, nbytes, owner, is_host)", i);
      goto done;
    }
    recs[i].name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(r, 0));
    if (!recs[i].name) goto done;
    if (len == 2) {
      if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 1), &bufs[nbufs], PyBUF_SIMPLE)) goto done;
      recs[i].host_data = bufs[nbufs].buf;
      recs[i].bytes = (uint64_t)bufs[nbufs].len;
      nbufs++;
      continue;
    }
    void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(r, 1));
    unsigned long long nbytes = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 2));
    int is_host = PyObject_IsTrue(PyTuple_GET_ITEM(r, 4));
    if (PyErr_Occurred() || is_host < 0) goto done;
    recs[i].bytes = nbytes;
    if (nbytes == 0) continue; /* an empty entry */
    if (!ptr) {
      PyErr_Format(PyExc_ValueError, "ferry: snapshot record %zd (%s) has a NULL data pointer",
                   i, recs[i].name);
      goto done;
    }
    if (is_host) {
      recs[i].host_data = ptr; /* copied by ferry_snapshot_start */
    } else {
      recs[i].device_ptr = ptr;
      if (PyList_Append(owners, PyTuple_GET_ITEM(r, 3))) goto done;
    }
  }
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

/* ---- SnapshotPolicy: a policy file's snapshot(e) function -------------------
 * Its own instance of the policy (own sandboxed Lua state), loaded from the
 * same file the offload engine uses: checkpoint plans are made on the
 * Python thread, never under the engine's lock. */
typedef struct {
  PyObject_HEAD ferry_policy *p;
} SnapshotPolicyObject;

static int snappol_init(SnapshotPolicyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "source", "trusted", NULL};
  const char *path = NULL, *source = NULL;
  int trusted = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzp", kwlist, &path, &source, &trusted))
    return -1;
  if (self->p) {
    PyErr_SetString(PyExc_RuntimeError, "SnapshotPolicy already initialised");
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

static void snappol_dealloc(SnapshotPolicyObject *self) {
  ferry_policy_destroy(self->p);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* plan(entries) -> [(stage, order)]; entries: (key, path, nbytes, index,
 * dtype_name or None, on_device). */
static PyObject *snappol_plan(SnapshotPolicyObject *self, PyObject *entries) {
  if (!self->p) return raise_ferry(FERRY_ESTATE, "ferry: SnapshotPolicy not initialised");
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

static PyObject *snappol_last_error(SnapshotPolicyObject *self, PyObject *unused) {
  return PyUnicode_FromString(ferry_policy_last_error(self->p));
}

static PyObject *snappol_get_has(SnapshotPolicyObject *self, void *unused) {
  return PyBool_FromLong(ferry_policy_has_snapshot(self->p));
}

static PyObject *snappol_get_errors(SnapshotPolicyObject *self, void *unused) {
  ferry_policy_stats st;
  ferry_policy_get_stats(self->p, &st);
  return PyLong_FromUnsignedLongLong(st.errors);
}

static PyObject *snappol_get_name(SnapshotPolicyObject *self, void *unused) {
  return PyUnicode_FromString(ferry_policy_name(self->p));
}

static PyMethodDef snappol_methods[] = {
    {"plan", (PyCFunction)snappol_plan, METH_O,
     "plan([(key, path, nbytes, index, dtype, on_device)]) -> [(stage, order)]"},
    {"last_error", (PyCFunction)snappol_last_error, METH_NOARGS,
     "The last fault of snapshot() as 'file:line: message', or ''."},
    {NULL}};

static PyGetSetDef snappol_getset[] = {
    {"has_snapshot", (getter)snappol_get_has, NULL, "the policy defines snapshot(e)", NULL},
    {"errors", (getter)snappol_get_errors, NULL, "faults so far", NULL},
    {"name", (getter)snappol_get_name, NULL, "the policy's name", NULL},
    {NULL}};

static PyTypeObject SnapshotPolicyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ferry._ferry.SnapshotPolicy",
    .tp_basicsize = sizeof(SnapshotPolicyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SnapshotPolicy(path=None, source=None, trusted=False): a policy's snapshot(e).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)snappol_init,
    .tp_dealloc = (destructor)snappol_dealloc,
    .tp_methods = snappol_methods,
    .tp_getset = snappol_getset,
};

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

static PyObject *mod_strerror(PyObject *mod, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(ferry_strerror((int)code));
}

static PyMethodDef module_methods[] = {
    {"info", mod_info, METH_NOARGS,
     "info() -> dict: version, which arena an engine gets here, backend availability."},
    {"strerror", mod_strerror, METH_O, "Message of a FERRY_E* code."},
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
  if (intern_names()) return NULL;
  PyTypeObject *types[] = {&EngineType,   &HandleType,   &PackHookType,
                           &UnpackHookType, &SiteHookType, &NodeCapType,
                           &SnapshotType, &SnapshotPolicyType};
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
      PyModule_AddObjectRef(m, "SnapshotPolicy", (PyObject *)&SnapshotPolicyType) ||
      PyModule_AddStringConstant(m, "__version__", ferry_version_string()) ||
      PyModule_AddIntConstant(m, "MAX_DIMS", FERRY_MAX_DIMS) ||
      PyModule_AddIntConstant(m, "KIND_ACTIVATION", FERRY_KIND_ACTIVATION) ||
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
