/*
 * tensor.c — the torch objects the extension uses (looked up on first engine
 * creation, so `import ferry` needs no torch), the interned attribute names,
 * and the table of torch dtypes (identity -> ferry dtype and item size).
 */
#include "ext.h"

torch_objects T;

/* Interned attribute names. */
PyObject *s_numel, *s_dtype, *s_requires_grad, *s_is_leaf, *s_data, *s_layout,
    *s_is_nested, *s_shape, *s_stride, *s_data_ptr, *s_base, *s_is_cuda, *s_get_device,
    *s_as_strided, *s_view, *s_storage_offset, *s_cuda_stream, *s_itemsize, *s_element_size,
    *s_device, *s_version, *s_detach, *s_is_cpu, *s_cdata, *s_nbytes, *s_items, *s_module,
    *s_qualname, *s_untyped_storage, *s_storage, *s_grad_fn, *s_next_functions, *s_variable;

int intern_names(void) {
#define I(var, str) \
  if (!(var = PyUnicode_InternFromString(str))) return -1;
  I(s_numel, "numel") I(s_dtype, "dtype") I(s_requires_grad, "requires_grad")
  I(s_is_leaf, "is_leaf") I(s_data, "data") I(s_layout, "layout") I(s_is_nested, "is_nested")
  I(s_shape, "shape") I(s_stride, "stride") I(s_data_ptr, "data_ptr") I(s_base, "_base")
  I(s_is_cuda, "is_cuda") I(s_get_device, "get_device") I(s_as_strided, "as_strided")
  I(s_view, "view") I(s_storage_offset, "storage_offset") I(s_cuda_stream, "cuda_stream")
  I(s_itemsize, "itemsize") I(s_element_size, "element_size") I(s_device, "device")
  I(s_version, "_version") I(s_detach, "detach") I(s_is_cpu, "is_cpu") I(s_cdata, "_cdata")
  I(s_nbytes, "nbytes") I(s_items, "items") I(s_module, "__module__")
  I(s_qualname, "__qualname__") I(s_untyped_storage, "untyped_storage") I(s_storage, "_storage")
  I(s_grad_fn, "grad_fn") I(s_next_functions, "next_functions") I(s_variable, "variable")
#undef I
  return 0;
}

tensor_attr_slot TA[TA_COUNT_];

/* The slot of attribute (or method) name: its descriptor on torch.Tensor,
 * used directly when Parameter has the same one. */
static void tensor_attr_init(int a, PyObject *name, int is_method) {
  tensor_attr_slot *s = &TA[a];
  *s = (tensor_attr_slot){.name = name, .is_method = is_method};
  PyObject *d = PyObject_GetAttr((PyObject *)T.tensor, name); /* the descriptor itself */
  PyObject *dp = d ? PyObject_GetAttr((PyObject *)T.param, name) : NULL;
  if (!d || !dp) {
    PyErr_Clear(); /* an attribute this torch lacks: the generic path raises */
  } else if (d == dp && !is_method && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
    PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
    s->get = g->get;
    s->closure = g->closure;
  } else if (d == dp && is_method && Py_IS_TYPE(d, &PyMethodDescr_Type) &&
             PyVectorcall_Function(d)) {
    s->method = d; /* kept for the process's life, as torch.Tensor is */
    Py_INCREF(d);
  }
  Py_XDECREF(d);
  Py_XDECREF(dp);
}

static void tensor_attrs_init(void) {
  const struct {
    int attr;
    PyObject *name;
    int is_method;
  } table[] = {
      {TA_DTYPE, s_dtype, 0},     {TA_SHAPE, s_shape, 0},
      {TA_LAYOUT, s_layout, 0},   {TA_VERSION, s_version, 0},
      {TA_REQUIRES_GRAD, s_requires_grad, 0}, {TA_IS_LEAF, s_is_leaf, 0},
      {TA_IS_NESTED, s_is_nested, 0}, {TA_IS_CPU, s_is_cpu, 0},
      {TA_BASE, s_base, 0},       {TA_DATA_PTR, s_data_ptr, 1},
      {TA_STRIDE, s_stride, 1},   {TA_DETACH, s_detach, 1},
  };
  _Static_assert(sizeof table / sizeof *table == TA_COUNT_, "a slot for every tensor_attr");
  for (size_t i = 0; i < sizeof table / sizeof *table; i++)
    tensor_attr_init(table[i].attr, table[i].name, table[i].is_method);
}

int torch_init(void) {
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
  T.has_is_cpu = PyObject_HasAttr(tensor, s_is_cpu);
  T.has_untyped_storage = PyObject_HasAttr(tensor, s_untyped_storage);
  tensor_attrs_init();
  T.ready = 1;
  return 0;
}

/* ---- dtypes ------------------------------------------------------------------
 * torch.dtype objects are singletons: a short table keyed by identity. */
dtype_info dtypes[MAX_DTYPES];
int n_dtypes;

/* "torch.bfloat16" -> FERRY_DTYPE_BF16, by the table in ferry.h. */
int32_t ferry_dtype_of_name(const char *name) {
  if (strncmp(name, "torch.", 6) != 0) return FERRY_DTYPE_UNKNOWN;
  int d = ferry_dtype_from_name(name + 6);
  return d > 0 ? d : FERRY_DTYPE_UNKNOWN;
}

/* dtype_lookup's slow path (ext.h): a dtype seen for the first time. */
const dtype_info *dtype_add(PyObject *dtype) {
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


/* ---- tensor facts (ext.h) ------------------------------------------------ */
const ferry_facts_api *FACTS;
static const dtype_info *dtype_by_scalar[MAX_SCALAR_TYPES];

/* The dtype_info of scalar type st, learned from t's dtype the first time
 * (NULL with an exception set on failure). */
const dtype_info *dtype_of_scalar(PyObject *t, int32_t st) {
  if (st >= 0 && st < MAX_SCALAR_TYPES && dtype_by_scalar[st]) return dtype_by_scalar[st];
  PyObject *v = tensor_attr(t, TA_DTYPE);
  if (!v) return NULL;
  const dtype_info *di = dtype_lookup(v);
  if (di && st >= 0 && st < MAX_SCALAR_TYPES && FACTS->scalar_type(v) == st)
    dtype_by_scalar[st] = di;
  Py_DECREF(v);
  return di;
}

/* _ferry.set_tensor_facts(capsule or None): ferry.torch hands over the
 * _torchfacts module's API for the running torch (None: the getters only). */
PyObject *mod_set_tensor_facts(PyObject *self, PyObject *arg) {
  (void)self;
  if (arg == Py_None) {
    FACTS = NULL;
    Py_RETURN_NONE;
  }
  const ferry_facts_api *api = PyCapsule_GetPointer(arg, FERRY_FACTS_CAPSULE);
  if (!api) return NULL;
  if (api->abi != FERRY_FACTS_ABI || api->size != sizeof *api)
    return PyErr_Format(PyExc_ImportError,
                        "ferry: the tensor-facts module speaks ABI %u (%u bytes), this _ferry %u "
                        "(%u bytes): rebuild ferry", api->abi, api->size, FERRY_FACTS_ABI,
                        (unsigned)sizeof *api);
  if (torch_init() < 0) return NULL;
  memset(dtype_by_scalar, 0, sizeof dtype_by_scalar);
  FACTS = api;
  Py_RETURN_NONE;
}
