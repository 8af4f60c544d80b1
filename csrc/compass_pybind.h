// pybind11 glue shared by every capability's bindings.cpp:
// - a type caster that turns a torch.Tensor (or anything with __dlpack__, or a
//   DLPack capsule) into a borrowed compass::TensorView, so a host entry point
//   taking TensorView arguments binds in one line;
// - COMPASS_DEF / COMPASS_DEF_NOGIL: one line per backend entry point.
// Only binding translation units include this (it pulls in pybind11).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "compass/tensor_view.h"

namespace compass {
// A view of the tensor a DLPack capsule describes (legacy "dltensor" or
// versioned "dltensor_versioned"), without consuming it: the capsule must
// outlive the view (the caster holds it for the call).
TensorView view_from_capsule(PyObject* capsule);
// A new reference to a DLPack capsule of `obj`: a capsule itself, a
// torch.Tensor (torch's C-level to_dlpack, ~0.3 us), or obj.__dlpack__().
// Returns nullptr (no Python error set) when obj is none of these.
PyObject* dlpack_capsule_of(PyObject* obj);
}  // namespace compass

namespace pybind11 {
namespace detail {
template <>
struct type_caster<compass::TensorView> {
  PYBIND11_TYPE_CASTER(compass::TensorView, const_name("Tensor"));
  bool load(handle src, bool) {
    PyObject* cap = compass::dlpack_capsule_of(src.ptr());
    if (cap == nullptr) return false;
    holder_ = reinterpret_steal<object>(cap);  // keeps the view's memory alive for the call
    value = compass::view_from_capsule(cap);
    return true;
  }
  static handle cast(const compass::TensorView&, return_value_policy, handle) {
    throw cast_error("compass::TensorView cannot be returned to Python");
  }

 private:
  object holder_;
};
}  // namespace detail
}  // namespace pybind11

// One line per entry point. _NOGIL releases the GIL around the call (CPU
// kernels that run long); CUDA launches keep it (they return at once).
#define COMPASS_DEF(m, fn, doc) (m).def(#fn, &fn, doc)
#define COMPASS_DEF_NOGIL(m, fn, doc) \
  (m).def(#fn, &fn, doc, ::pybind11::call_guard<::pybind11::gil_scoped_release>())
