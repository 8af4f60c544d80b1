// Emulated device memory for one host entry point call: the CPU tensors
// passed in become "CUDA" views (device 0), and their byte ranges are the only
// global memory kernels may touch until the scope ends.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "compass/tensor_view.h"
#include "compass_emu/runtime.h"
#include "dlpack_view.h"

namespace compass {
namespace emu {

class DeviceScope {
 public:
  DeviceScope() { clear_device_ranges(); }
  ~DeviceScope() { clear_device_ranges(); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  TensorView adopt(TensorView v) const {
    COMPASS_CHECK(v.device == DeviceType::kCPU, v.name,
                  ": the cuda-emulated backend runs on CPU tensors (its emulated device "
                  "memory), got ", v.describe());
    int64_t extent = v.numel() > 0 ? 1 : 0;  // elements spanned, strides included
    for (int i = 0; i < v.ndim && extent > 0; ++i) extent += (v.shape[i] - 1) * v.strides[i];
    add_device_range(v.data, static_cast<std::size_t>(extent * dtype_size(v.dtype)),
                     "'" + v.name + "' (" + dtype_name(v.dtype) + shape(v) + ")");
    v.device = DeviceType::kCUDA;
    v.device_id = 0;
    return v;
  }
  static std::string shape(const TensorView& v) {
    std::string s = "[";
    for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
    return s + "]";
  }
  TensorView view(const pybind11::capsule& cap, const char* name) const {
    return adopt(view_from_dlpack(cap, name));
  }
};

}  // namespace emu
}  // namespace compass
