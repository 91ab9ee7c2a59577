// torch_facts.cpp — _torchfacts_<torch version>: reads a tensor's dtype,
// sizes, data pointer and version counter from its at::Tensor for the
// _ferry hooks (torch_facts.h says why and how it is chosen). Built against
// one torch's headers; any exception, or a tensor unlike the plain strided
// ones this handles, answers -1 and the hooks ask torch's Python getters.
#include <Python.h>

#include <cstring>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include "torch_facts.h"

namespace {

int read(void *obj, ferry_tensor_facts *f) noexcept {
  try {
    const at::Tensor &t = THPVariable_Unpack(static_cast<PyObject *>(obj));
    if (!t.defined()) return -1;
    c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    if (impl->layout() != c10::kStrided || impl->is_nested() || !impl->has_storage())
      return -1;
    c10::IntArrayRef sizes = impl->sizes();
    if (sizes.size() > FERRY_FACTS_MAX_DIMS) return -1;
    f->scalar_type = static_cast<int32_t>(t.scalar_type());
    f->ndim = static_cast<int32_t>(sizes.size());
    for (size_t i = 0; i < sizes.size(); i++) f->sizes[i] = sizes[i];
#if TORCH_VERSION_MAJOR >= 2
    f->data = const_cast<void *>(t.const_data_ptr()); // no copy-on-write materialized
#else
    f->data = t.data_ptr();
#endif
    f->version = static_cast<int64_t>(impl->version_counter().current_version());
    // what Tensor._base tests (is_view(), a libtorch_cpu symbol this module
    // does not link against), read from the autograd meta inline
    auto *meta = static_cast<torch::autograd::AutogradMeta *>(impl->autograd_meta());
    f->is_view = meta && meta->is_view_ ? 1 : 0;
    return 0;
  } catch (...) {
    return -1;
  }
}

int version(void *obj, int64_t *v) noexcept {
  try {
    const at::Tensor &t = THPVariable_Unpack(static_cast<PyObject *>(obj));
    if (!t.defined()) return -1;
    *v = static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
    return 0;
  } catch (...) {
    return -1;
  }
}

int scalar_type(void *obj) noexcept {
  // a torch.dtype is a THPDtype; its type's name says so without touching
  // torch's own type object (a symbol of libtorch_python)
  PyObject *o = static_cast<PyObject *>(obj);
  if (std::strcmp(Py_TYPE(o)->tp_name, "torch.dtype") != 0) return -1;
  return static_cast<int>(reinterpret_cast<THPDtype *>(o)->scalar_type);
}

const ferry_facts_api api = {FERRY_FACTS_ABI, sizeof(ferry_facts_api), read, version, scalar_type};

PyModuleDef module = {PyModuleDef_HEAD_INIT, FERRY_TORCH_FACTS_MODULE,
                      "ferry's reader of tensor facts for one torch version (torch_facts.h)", -1,
                      nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define FERRY_CAT2(a, b) a##b
#define FERRY_CAT(a, b) FERRY_CAT2(a, b)
extern "C" PyMODINIT_FUNC FERRY_CAT(PyInit_, FERRY_TORCH_FACTS_NAME)(void) {
  PyObject *m = PyModule_Create(&module);
  if (!m) return nullptr;
  PyObject *cap = PyCapsule_New(const_cast<ferry_facts_api *>(&api), FERRY_FACTS_CAPSULE, nullptr);
  if (!cap || PyModule_AddObject(m, "api", cap) < 0) {
    Py_XDECREF(cap);
    Py_DECREF(m);
    return nullptr;
  }
  PyObject *v = PyUnicode_FromString(FERRY_TORCH_VERSION);
  if (!v || PyModule_AddObject(m, "torch_version", v) < 0) {
    Py_XDECREF(v);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
