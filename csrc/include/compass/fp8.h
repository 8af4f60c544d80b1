// FP8 grouped expert GEMM: the scale block and the argument layout the CPU
// argument builder writes (the GPU builder, compass_kernels/fp8/triton_args.py,
// writes the same and is tested against it).
// Spec: compass_kernels/fp8/reference_gemm.py; contract: docs/design.md (FP8 grouped GEMM).
#pragma once

#include <cstdint>

#include "compass/common.h"

namespace compass {
namespace fp8 {

// Scale granularity along K (1x128 activation groups, 128x128 weight blocks)
// and along N (weight blocks): the kernels promote their accumulator to fp32
// once per kScaleBlock of K (scales multiplied first, as DeepGEMM and CUTLASS's
// blockwise epilogue-in-mainloop do).
constexpr int64_t kScaleBlock = 128;

COMPASS_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ------------------------------------------------ grouped-GEMM arguments
// Per-expert problem shapes and pointer arrays of a pointer-array grouped GEMM
// (CUTLASS's GroupProblemShape<Shape<int,int,int>> and its ptr_A / ptr_B /
// ptr_SFA / ptr_SFB / ptr_D arrays), built from the expert offsets on the
// device (a Triton kernel: compass_kernels/fp8/triton_args.py) so the launch
// needs no host sync and can be captured in a CUDA graph; the CPU builds the
// same with this function.
enum PtrRow : int { kPtrA = 0, kPtrB, kPtrSFA, kPtrSFB, kPtrD, kNumPtrRows };

// Base addresses and element strides (in bytes: the builder only adds).
struct GroupedLayout {
  uint64_t a, b, sfa, sfb, d;         // data pointers of a_q, b_q, a_scales, b_scales, out
  int64_t a_row, b_expert, sfa_row;   // bytes per token row (a_q, a_scales), per expert (b_q)
  int64_t sfb_expert, d_row;          // bytes per expert (b_scales), per row (out)
  int32_t n, k;
};

// Expert e with token rows [lo, hi): its problem (M_e, N, K) and its five
// pointers, written to shapes[3e..3e+2] and ptrs[row * experts + e]. An empty
// expert gets M_e = 0 (no tiles: it costs nothing) and the pointers of its
// (empty) position, never an address outside the tensors.
COMPASS_HD void group_args(const GroupedLayout& g, int64_t e, int64_t experts, int64_t lo,
                           int64_t hi, int32_t* shapes, int64_t* ptrs) {
  shapes[3 * e + 0] = static_cast<int32_t>(hi - lo);
  shapes[3 * e + 1] = g.n;
  shapes[3 * e + 2] = g.k;
  ptrs[kPtrA * experts + e] = static_cast<int64_t>(g.a + static_cast<uint64_t>(lo * g.a_row));
  ptrs[kPtrB * experts + e] = static_cast<int64_t>(g.b + static_cast<uint64_t>(e * g.b_expert));
  ptrs[kPtrSFA * experts + e] = static_cast<int64_t>(g.sfa + static_cast<uint64_t>(lo * g.sfa_row));
  ptrs[kPtrSFB * experts + e] =
      static_cast<int64_t>(g.sfb + static_cast<uint64_t>(e * g.sfb_expert));
  ptrs[kPtrD * experts + e] = static_cast<int64_t>(g.d + static_cast<uint64_t>(lo * g.d_row));
}

}  // namespace fp8
}  // namespace compass
