// FP8 blockwise quantization on the CPU (OpenMP over blocks), and the argument
// checks every backend shares. The math is compass/fp8.h.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

using namespace fp8_math;  // NOLINT: the shared math (compass/fp8.h)

namespace {
// Below this many elements the kernels run on the calling thread: waking the
// OpenMP team costs more than the work (a 128x128 block takes ~10 us).
constexpr int64_t kParallelMinElements = int64_t{1} << 16;

void check_x(const TensorView& x) {
  x.expect_ndim(2);
  dispatch(x, InputTypes{}, [](auto) {});
  COMPASS_CHECK(x.shape[1] <= 1 || x.strides[1] == 1, x.name,
                ": expected unit stride along the last dim, got strides (", x.strides[0], ", ",
                x.strides[1], ")");
}


// The first non-finite element of rows [r0, r1) x cols [c0, c1): an error
// naming it. Called only once a block's amax said there is one.
template <typename T>
[[noreturn]] void fail_non_finite(const TensorView& x, int64_t r0, int64_t r1, int64_t c0,
                                  int64_t c1) {
  const T* p = x.ptr<T>();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float v = Elem<T>::value(p[r * x.strides[0] + c]);
      if (!std::isfinite(v)) {
        fail(x.name, ": expected finite values, got ", v, " at [", r, ", ", c,
             "] (FP8 scales of a block with inf/NaN are meaningless)");
      }
    }
  }
  fail(x.name, ": expected finite values");
}

struct QuantArgs {
  int64_t rows, cols, br, bc, x_stride, q_stride, s_stride0, s_stride1;
  float eps;
  bool ue8m0;
};

// One block: amax as an integer max of |x| bits (vectorizes), then the
// quantized bytes. Returns false when the block holds inf/NaN (nothing written
// for it; the caller raises after the parallel region).
template <typename T, bool kDiv>
bool quantize_block(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s,
                    const QuantArgs& a, int64_t bi, int64_t bj) {
  using Bits = typename Elem<T>::Bits;
  const int64_t r0 = bi * a.br, r1 = std::min(a.rows, r0 + a.br);
  const int64_t c0 = bj * a.bc, n = std::min(a.cols, c0 + a.bc) - c0;
  Bits m = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * a.x_stride + c0;
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < n; ++c) {
      const Bits b = Elem<T>::abs_bits(row[c]);
      m = b > m ? b : m;
    }
  }
  if (m >= Elem<T>::kNonFinite) return false;
  const float scale = block_scale(Elem<T>::from_abs_bits(m), a.eps, a.ue8m0);
  const float inv = 1.0f / scale;
  s[bi * a.s_stride0 + bj * a.s_stride1] = scale;
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * a.x_stride + c0;
    uint8_t* out = q + r * a.q_stride + c0;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      out[c] = quantize_value(Elem<T>::value(row[c]), scale, inv, kDiv);
    }
  }
  return true;
}

template <typename T, bool kDiv>
void quantize_all(const TensorView& x, const TensorView& q, const TensorView& scales,
                  const QuantArgs& a) {
  const int64_t nb = (a.rows + a.br - 1) / a.br, kb = (a.cols + a.bc - 1) / a.bc;
  const int64_t blocks = nb * kb;
  const T* xp = x.ptr<T>();
  uint8_t* qp = q.ptr<uint8_t>();
  float* sp = scales.ptr<float>();
  bool ok = true;
  const bool parallel = a.rows * a.cols >= kParallelMinElements && blocks > 1;
#pragma omp parallel for schedule(static) reduction(&& : ok) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    ok = quantize_block<T, kDiv>(xp, qp, sp, a, b / kb, b % kb) && ok;
  }
  if (!ok) fail_non_finite<T>(x, 0, a.rows, 0, a.cols);
}

}  // namespace

void check_scales(const TensorView& scales, const TensorView& x, int64_t rows, int64_t cols,
                  int64_t scale_layout) {
  scales.expect_ndim(2).expect_dtype(DType::kFloat32).expect_same_device(x);
  scales.expect_size(0, rows, "row blocks").expect_size(1, cols, "column blocks");
  int64_t s0 = cols, s1 = 1;
  const char* what = "K-major (row-major)";
  if (scale_layout == kMNMajor) {
    s0 = 1, s1 = rows, what = "MN-major (column-major)";
  } else if (scale_layout == kMNMajorTMA) {
    s0 = 1, s1 = (rows + 3) / 4 * 4, what = "MN-major, TMA-aligned (column stride ceil4(rows))";
  } else {
    COMPASS_CHECK(scale_layout == kKMajor, "scale_layout: expected 0 (K-major), 1 (MN-major) or 2 "
                  "(MN-major TMA-aligned), got ", scale_layout);
  }
  // Strides of size-1 dims are free.
  const bool ok = (rows <= 1 || scales.strides[0] == s0) && (cols <= 1 || scales.strides[1] == s1);
  COMPASS_CHECK(ok, scales.name, ": expected ", what, " strides (", s0, ", ", s1, "), got (",
                scales.strides[0], ", ", scales.strides[1], ")");
}

void check_quantize_args(COMPASS_FP8_QUANTIZE_ARGS) {
  check_x(x);
  COMPASS_CHECK(block_rows >= 1 && block_cols >= 1, "block: expected positive sizes, got (",
                block_rows, ", ", block_cols, ")");
  COMPASS_CHECK(std::isfinite(eps) && eps >= 1e-30 && eps <= 1.0,
                "eps: expected a float in [1e-30, 1] (the scale floor of an all-zero block), got ",
                eps);
  const int64_t rows = x.shape[0], cols = x.shape[1];
  q.expect_ndim(2).expect_dtype(DType::kFloat8E4M3FN).expect_contiguous().expect_same_device(x);
  q.expect_size(0, rows, "x's rows").expect_size(1, cols, "x's columns");
  check_scales(scales, x, (rows + block_rows - 1) / block_rows,
               (cols + block_cols - 1) / block_cols, scale_layout);
}

void quantize_cpu(COMPASS_FP8_QUANTIZE_ARGS) {
  COMPASS_NAME_ARGS(x, q, scales);
  check_quantize_args(x, block_rows, block_cols, eps, ue8m0, use_div, scale_layout, q, scales);
  x.expect_device(DeviceType::kCPU);
  if (x.numel() == 0) return;
  const QuantArgs a{x.shape[0],      x.shape[1],        block_rows,        block_cols,
                    x.strides[0],    q.strides[0],      scales.strides[0], scales.strides[1],
                    static_cast<float>(eps), ue8m0};
  dispatch(x, InputTypes{}, [&](auto tag) {
    using T = decltype(tag);
    if (use_div) {
      quantize_all<T, true>(x, q, scales, a);
    } else {
      quantize_all<T, false>(x, q, scales, a);
    }
  });
}

}  // namespace fp8
}  // namespace compass
