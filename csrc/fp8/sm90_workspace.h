// Layout of the CUTLASS sm_90a grouped GEMM's workspace (grouped_gemm_sm90.cuh).
// Plain C++ (no CUTLASS types): the CUDA entry point feeds it the CUTLASS
// sizes; the CPU build binds it (fp8.sm90_workspace_layout) so the
// offsets are tested for every expert count on any host.
//
// CUTLASS's own region comes first, at offset 0 of a 128-byte aligned base:
// it keeps its per-SM TMA descriptors there, which need 64-byte alignment
// (128 for the in-place descriptor update of the pointer-array kernels).
// Then, each at a 128-byte boundary, the per-expert arrays the layout kernel
// fills: StrideA, StrideB, StrideD, LayoutSFA, LayoutSFB (E entries each).
#pragma once

#include <array>
#include <cstdint>

namespace compass {
namespace fp8 {

constexpr int64_t kSm90WorkspaceAlign = 128;
constexpr int kSm90GroupArrays = 5;

struct Sm90WorkspaceLayout {
  int64_t cutlass_offset = 0;                       // CUTLASS's region (always 0)
  int64_t cutlass_bytes = 0;
  std::array<int64_t, kSm90GroupArrays> offsets{};  // per-expert arrays
  int64_t total = 0;                                // bytes the caller allocates
};

constexpr int64_t round_up_128(int64_t x) {
  return (x + kSm90WorkspaceAlign - 1) / kSm90WorkspaceAlign * kSm90WorkspaceAlign;
}

// experts E >= 1; cutlass_bytes from Gemm::get_workspace_size; elem_bytes the
// sizeof of each per-expert entry.
inline Sm90WorkspaceLayout sm90_workspace_layout(
    int64_t experts, int64_t cutlass_bytes,
    const std::array<int64_t, kSm90GroupArrays>& elem_bytes) {
  Sm90WorkspaceLayout l;
  l.cutlass_bytes = cutlass_bytes;
  int64_t at = round_up_128(cutlass_bytes);
  for (int i = 0; i < kSm90GroupArrays; ++i) {
    l.offsets[i] = at;
    at = round_up_128(at + elem_bytes[i] * experts);
  }
  l.total = at;
  return l;
}

}  // namespace fp8
}  // namespace compass
