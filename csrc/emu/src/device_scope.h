// Emulated device memory for one host entry point call: the CPU tensors
// passed in become "CUDA" views (device 0), and their byte ranges are the only
// global memory kernels may touch until the scope ends.
#pragma once

#include <string>

#include "compass/tensor_view.h"
#include "compass_emu/runtime.h"

namespace compass {
namespace emu {

class DeviceScope {
 public:
  DeviceScope() { clear_device_ranges(); }
  ~DeviceScope() { clear_device_ranges(); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  // `name` must outlive the call (a string literal, or the binding's names).
  TensorView adopt(TensorView v, const char* name) const {
    v.name = name;
    COMPASS_CHECK(v.device == DeviceType::kCPU, name,
                  ": the cuda-emulated backend runs on CPU tensors (its emulated device "
                  "memory), got ", v.describe());
    int64_t extent = v.numel() > 0 ? 1 : 0;  // elements spanned, strides included
    for (int i = 0; i < v.ndim && extent > 0; ++i) extent += (v.shape[i] - 1) * v.strides[i];
    std::string shape = "[";
    for (int i = 0; i < v.ndim; ++i) shape += (i ? ", " : "") + std::to_string(v.shape[i]);
    add_device_range(v.data, static_cast<std::size_t>(extent * dtype_size(v.dtype)),
                     "'" + std::string(name) + "' (" + dtype_name(v.dtype) + shape + "])");
    v.device = DeviceType::kCUDA;
    v.device_id = 0;
    return v;
  }
};

}  // namespace emu
}  // namespace compass
