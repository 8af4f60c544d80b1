// A borrowed, framework-free view of a tensor: what crosses the Python/C++
// boundary (built from a DLPack capsule in dlpack_view.cpp). Kernels never see
// torch; one wheel serves any torch version.
#pragma once

#include <cstdint>
#include <string>

#include "compass/common.h"

namespace compass {

enum class DType : int32_t {
  kBool, kInt8, kUInt8, kInt16, kUInt16, kInt32, kUInt32, kInt64, kUInt64,
  kFloat16, kBFloat16, kFloat32, kFloat64, kFloat8E4M3FN, kFloat8E5M2,
};

enum class DeviceType : int32_t { kCPU, kCUDA };

const char* dtype_name(DType t);
int64_t dtype_size(DType t);

constexpr int kMaxDims = 8;

struct TensorView {
  void* data = nullptr;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int32_t device_id = 0;
  std::string name;  // argument name, for error messages

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  std::string describe() const;  // "float32[7] on cpu"

  // Boundary checks; each failure names the argument and the expectation.
  const TensorView& expect_ndim(int n) const;
  const TensorView& expect_dtype(DType t) const;
  const TensorView& expect_contiguous() const;
  const TensorView& expect_size(int dim, int64_t n, const char* what) const;
  const TensorView& expect_same_device(const TensorView& other) const;
};

}  // namespace compass
