// DLPack capsule -> compass::TensorView, and the TensorView checks.
#include <cstring>
#include <sstream>

#include "compass_pybind.h"
#include "dlpack_abi.h"

namespace compass {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBool: return "bool";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt16: return "int16";
    case DType::kUInt16: return "uint16";
    case DType::kInt32: return "int32";
    case DType::kUInt32: return "uint32";
    case DType::kInt64: return "int64";
    case DType::kUInt64: return "uint64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "?";
}

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kBool: case DType::kInt8: case DType::kUInt8:
    case DType::kFloat8E4M3FN: case DType::kFloat8E5M2: return 1;
    case DType::kInt16: case DType::kUInt16: case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kInt32: case DType::kUInt32: case DType::kFloat32: return 4;
    case DType::kInt64: case DType::kUInt64: case DType::kFloat64: return 8;
  }
  return 0;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "] on " << (device == DeviceType::kCPU ? "cpu" : "cuda:") ;
  if (device == DeviceType::kCUDA) os << device_id;
  return os.str();
}

const TensorView& TensorView::expect_ndim(int n) const {
  COMPASS_CHECK(ndim == n, name, ": expected a ", n, "-d tensor, got ", describe());
  return *this;
}
const TensorView& TensorView::expect_dtype(DType t) const {
  COMPASS_CHECK(dtype == t, name, ": expected dtype ", dtype_name(t), ", got ", describe());
  return *this;
}
const TensorView& TensorView::expect_contiguous() const {
  COMPASS_CHECK(is_contiguous(), name, ": expected a contiguous tensor, got ", describe());
  return *this;
}
const TensorView& TensorView::expect_size(int dim, int64_t n, const char* what) const {
  COMPASS_CHECK(size(dim) == n, name, ": expected size ", n, " (", what, ") in dim ", dim,
                ", got ", describe());
  return *this;
}
const TensorView& TensorView::expect_device(DeviceType d) const {
  COMPASS_CHECK(device == d, name, ": expected a ", d == DeviceType::kCUDA ? "CUDA" : "CPU",
                " tensor, got ", describe());
  return *this;
}
const TensorView& TensorView::expect_same_device(const TensorView& o) const {
  COMPASS_CHECK(device == o.device && device_id == o.device_id, name, " (", describe(), ") and ",
                o.name, " (", o.describe(), ") must be on the same device");
  return *this;
}

static DType map_dtype(const DLDataType& t, const char* name) {
  COMPASS_CHECK(t.lanes == 1, name, ": vector dtypes (lanes=", t.lanes, ") are not supported");
  switch (t.code) {
    case kDLBool: if (t.bits == 8) return DType::kBool; break;
    case kDLInt:
      if (t.bits == 8) return DType::kInt8;
      if (t.bits == 16) return DType::kInt16;
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    case kDLUInt:
      if (t.bits == 1 || t.bits == 8) return t.bits == 1 ? DType::kBool : DType::kUInt8;
      if (t.bits == 16) return DType::kUInt16;
      if (t.bits == 32) return DType::kUInt32;
      if (t.bits == 64) return DType::kUInt64;
      break;
    case kDLFloat:
      if (t.bits == 16) return DType::kFloat16;
      if (t.bits == 32) return DType::kFloat32;
      if (t.bits == 64) return DType::kFloat64;
      break;
    case kDLBfloat: if (t.bits == 16) return DType::kBFloat16; break;
    case kDLFloat8_e4m3fn: if (t.bits == 8) return DType::kFloat8E4M3FN; break;
    case kDLFloat8_e5m2: if (t.bits == 8) return DType::kFloat8E5M2; break;
    default: break;
  }
  fail(name, ": unsupported DLPack dtype (code ", int(t.code), ", bits ", int(t.bits), ")");
}

namespace {
PyObject* g_torch_tensor_type = nullptr;  // torch.Tensor, once torch is imported
PyObject* g_to_dlpack = nullptr;          // torch.utils.dlpack.to_dlpack (C-level)

// Looked up lazily and only when torch is already imported: csrc never
// imports torch itself.
bool torch_ready() {
  if (g_to_dlpack != nullptr) return true;
  PyObject* modules = PyImport_GetModuleDict();
  PyObject* torch = PyDict_GetItemString(modules, "torch");  // borrowed
  PyObject* dlpack = PyDict_GetItemString(modules, "torch.utils.dlpack");
  if (torch == nullptr || dlpack == nullptr) return false;
  PyObject* type = PyObject_GetAttrString(torch, "Tensor");
  PyObject* fn = PyObject_GetAttrString(dlpack, "to_dlpack");
  if (type == nullptr || fn == nullptr || !PyType_Check(type)) {
    Py_XDECREF(type);
    Py_XDECREF(fn);
    PyErr_Clear();
    return false;
  }
  g_torch_tensor_type = type;  // kept for the process's lifetime
  g_to_dlpack = fn;
  return true;
}
}  // namespace

PyObject* dlpack_capsule_of(PyObject* obj) {
  if (PyCapsule_CheckExact(obj)) {
    Py_INCREF(obj);
    return obj;
  }
  if (torch_ready() && PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(g_torch_tensor_type))) {
    PyObject* cap = PyObject_CallOneArg(g_to_dlpack, obj);
    if (cap == nullptr) throw pybind11::error_already_set();
    return cap;
  }
  if (!PyObject_HasAttrString(obj, "__dlpack__")) return nullptr;
  PyObject* method = PyObject_GetAttrString(obj, "__dlpack__");
  PyObject* cap = method ? PyObject_CallNoArgs(method) : nullptr;
  Py_XDECREF(method);
  if (cap == nullptr) throw pybind11::error_already_set();
  return cap;
}

TensorView view_from_capsule(PyObject* cap) {
  const char* cap_name = PyCapsule_GetName(cap);
  const DLTensor* t = nullptr;
  if (cap_name && std::strcmp(cap_name, "dltensor") == 0) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (m) t = &m->dl_tensor;
  } else if (cap_name && std::strcmp(cap_name, "dltensor_versioned") == 0) {
    auto* m = static_cast<DLManagedTensorVersioned*>(
        PyCapsule_GetPointer(cap, "dltensor_versioned"));
    COMPASS_CHECK(m == nullptr || m->version.major == 1,
                  "DLPack: unsupported major version ", m ? m->version.major : 0);
    if (m) t = &m->dl_tensor;
  } else {
    fail("expected a tensor or an unconsumed DLPack capsule ('dltensor'), got a capsule named '",
         cap_name ? cap_name : "(null)", "'");
  }
  COMPASS_CHECK(t != nullptr, "DLPack capsule holds a null pointer");
  const char* name = "tensor";
  COMPASS_CHECK(t->ndim >= 0 && t->ndim <= kMaxDims, "at most ", kMaxDims,
                " dims are supported, got ", t->ndim);
  TensorView v;
  v.ndim = t->ndim;
  v.dtype = map_dtype(t->dtype, name);
  switch (t->device.device_type) {
    case kDLCPU: case kDLCUDAHost: v.device = DeviceType::kCPU; break;
    case kDLCUDA: case kDLCUDAManaged: v.device = DeviceType::kCUDA; break;
    default: fail("unsupported DLPack device type ", int(t->device.device_type));
  }
  v.device_id = t->device.device_id;
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    v.shape[i] = t->shape[i];
    v.strides[i] = t->strides ? t->strides[i] : expected;
    expected *= t->shape[i];
  }
  return v;
}

}  // namespace compass
