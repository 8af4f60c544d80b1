// FP8 grouped expert GEMM: the per-element math and the tile/argument layout
// shared by the C++ (CPU) kernel, the CUDA argument builder and its host-side
// planning, so the CPU tests run the lines the GPU runs.
// Spec: compass_kernels/fp8/reference_gemm.py; contract: docs/design.md (FP8 grouped GEMM).
#pragma once

#include <cstdint>

#include "compass/common.h"

namespace compass {
namespace fp8_gemm {

// Scale granularity along K (1x128 activation groups, 128x128 weight blocks)
// and along N (weight blocks): every backend promotes its accumulator to fp32
// once per kScaleBlock of K.
constexpr int64_t kScaleBlock = 128;

COMPASS_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The promotion step of every backend: one K block's partial sum (fp8 x fp8
// products summed in fp32, or in the tensor core's reduced-precision
// accumulator for at most 128 of K) is scaled by the product of its two scales
// and added to the fp32 accumulator. Scales multiply first (as DeepGEMM and
// CUTLASS's blockwise epilogue-in-mainloop do), so every backend rounds alike.
COMPASS_HD float promote(float acc, float partial, float a_scale, float b_scale) {
  return acc + partial * (a_scale * b_scale);
}

}  // namespace fp8_gemm
}  // namespace compass
