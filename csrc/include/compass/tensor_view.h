// A borrowed, framework-free view of a tensor: what crosses the Python/C++
// boundary. Host entry points take TensorView arguments directly; the pybind11
// type caster in csrc/compass_pybind.h builds them from anything with
// __dlpack__ (or a DLPack capsule). Kernels never see torch; one wheel serves
// any torch version.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

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
  const char* name = "tensor";  // argument name for errors; set by COMPASS_NAME_ARGS

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  bool is_contiguous() const {
    if (numel() == 0) return true;  // as torch: an empty view's strides are arbitrary
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  bool is_cuda() const { return device == DeviceType::kCUDA; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  std::string describe() const;  // "float32[7] on cpu"

  // Boundary checks; each failure names the argument and the expectation.
  const TensorView& expect_ndim(int n) const;
  const TensorView& expect_dtype(DType t) const;
  const TensorView& expect_contiguous() const;
  const TensorView& expect_size(int dim, int64_t n, const char* what) const;
  const TensorView& expect_same_device(const TensorView& other) const;
  const TensorView& expect_device(DeviceType d) const;
  // 1-d and contiguous: the common case of every packed/varlen op.
  const TensorView& expect_vector() const { return expect_ndim(1).expect_contiguous(); }
};

// ------------------------------------------------------------ dtype dispatch
// C++ type <-> DType, and one dispatch helper instead of hand-nested if/else:
//   dispatch(rewards, Types<float, double>{}, [&](auto tag) {
//     using R = decltype(tag);  ...  });
// An unsupported dtype is an error naming the argument and the accepted dtypes.
template <typename T> struct DTypeOf;
#define COMPASS_DTYPE_OF(T, D) \
  template <> struct DTypeOf<T> { static constexpr DType value = DType::D; };
COMPASS_DTYPE_OF(bool, kBool)
COMPASS_DTYPE_OF(int8_t, kInt8)
COMPASS_DTYPE_OF(uint8_t, kUInt8)
COMPASS_DTYPE_OF(int16_t, kInt16)
COMPASS_DTYPE_OF(int32_t, kInt32)
COMPASS_DTYPE_OF(int64_t, kInt64)
COMPASS_DTYPE_OF(float, kFloat32)
COMPASS_DTYPE_OF(double, kFloat64)
#undef COMPASS_DTYPE_OF

template <typename... Ts> struct Types {
  static std::string names() {  // "float32 | float64", for errors only
    std::string s;
    ((s += (s.empty() ? "" : " | "), s += dtype_name(DTypeOf<Ts>::value)), ...);
    return s;
  }
};

namespace detail {
template <typename All, typename F, typename T, typename... Rest>
decltype(auto) dispatch_impl(const TensorView& t, F&& f) {
  if (t.dtype == DTypeOf<T>::value) return f(T{});
  if constexpr (sizeof...(Rest) > 0) {
    return dispatch_impl<All, F, Rest...>(t, std::forward<F>(f));
  } else {
    fail(t.name, ": expected dtype ", All::names(), ", got ", t.describe());
  }
}
}  // namespace detail

template <typename... Ts, typename F>
decltype(auto) dispatch(const TensorView& t, Types<Ts...>, F&& f) {
  return detail::dispatch_impl<Types<Ts...>, F, Ts...>(t, std::forward<F>(f));
}

// Name a function's TensorView parameters after themselves, for error messages:
//   COMPASS_NAME_ARGS(rewards, order, offsets);
// The list is split once per call site (a function-local static).
#define COMPASS_NAME_ARGS(...)                                              \
  do {                                                                      \
    static const ::compass::detail::NameList compass_names_(#__VA_ARGS__); \
    compass_names_.apply(__VA_ARGS__);                                      \
  } while (0)
namespace detail {
class NameList {
 public:
  explicit NameList(const char* list) {
    for (const char* p = list; *p; ++p) {
      if (*p == ',') names_.push_back('\0');
      else if (*p != ' ') names_.push_back(*p);
    }
  }
  template <typename... Vs>
  void apply(Vs&... views) const {
    const char* p = names_.c_str();
    ((set_name(views, p), p += std::char_traits<char>::length(p) + 1), ...);
  }

 private:
  static void set_name(TensorView& v, const char* n) { v.name = n; }
  static void set_name(std::optional<TensorView>& v, const char* n) {
    if (v) v->name = n;
  }

  std::string names_;
};
}  // namespace detail

}  // namespace compass
