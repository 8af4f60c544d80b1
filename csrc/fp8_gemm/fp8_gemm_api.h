// Host entry points of the FP8 grouped expert GEMM (CPU in grouped_gemm_cpu.cpp),
// bound one line each in bindings.cpp. Arguments are borrowed views; the output
// is written in place. check_grouped_gemm_args runs every dtype/shape/device
// check before any work. Spec: compass_kernels/fp8/reference_gemm.py.
#pragma once

#include <cstdint>

#include "compass/fp8_gemm.h"
#include "compass/tensor_view.h"

namespace compass {
namespace fp8_gemm {

// a_q [M, K] float8_e4m3fn (unit stride along K), token-packed: rows
// [expert_offsets[e], expert_offsets[e+1]) belong to expert e, no padding;
// a_scales [M, ceil(K/128)] float32, any strides (K-major or MN-major);
// b_q [E, N, K] float8_e4m3fn (unit stride along K); b_scales
// [E, ceil(N/128), ceil(K/128)] float32, any strides; expert_offsets [E+1]
// int64; out_dtype 0 = bfloat16, 1 = float32 (must be out's dtype); out [M, N]
// (unit stride along N).
#define COMPASS_FP8_GROUPED_GEMM_ARGS                                                   \
  TensorView a_q, TensorView a_scales, TensorView b_q, TensorView b_scales,             \
      TensorView expert_offsets, int64_t out_dtype, TensorView out

enum OutDType : int64_t { kOutBF16 = 0, kOutF32 = 1 };

// Shared by every backend (views named by the caller's COMPASS_NAME_ARGS):
// dtypes, ranks, sizes, unit inner strides, same device. Offsets' contents
// are checked by the CPU entry point (host-readable) and, opt-in, in Python.
void check_grouped_gemm_args(COMPASS_FP8_GROUPED_GEMM_ARGS);
// offsets[0] == 0, non-decreasing, offsets[E] == rows (host memory).
void check_offsets_data(const TensorView& expert_offsets, int64_t rows);

void grouped_gemm_cpu(COMPASS_FP8_GROUPED_GEMM_ARGS);

}  // namespace fp8_gemm
}  // namespace compass
