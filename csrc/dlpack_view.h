#pragma once

#include <pybind11/pybind11.h>

#include "compass/tensor_view.h"

namespace compass {
// Borrow a view of a legacy DLPack capsule without consuming it: the capsule
// (and the tensor it came from) must outlive the call, which the Python caller
// guarantees by holding the tensor. `name` is the argument name for errors.
TensorView view_from_dlpack(const pybind11::capsule& cap, const char* name);
}  // namespace compass
