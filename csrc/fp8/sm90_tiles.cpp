// Host side of the CUTLASS sm_90a grouped GEMM's tile configurations: the
// heuristic's binding (plain C++, built and tested on every host) and, in CUDA
// builds with CUTLASS, the dispatch to the configuration's translation unit.
#include "fp8/fp8_api.h"
#include "fp8/sm90_tiles.h"
#include "fp8/sm90_workspace.h"

namespace compass {
namespace fp8 {

int64_t choose_sm90_tile_binding(int64_t rows, int64_t experts, int64_t n, int64_t sm_count) {
  COMPASS_CHECK(rows >= 0 && experts >= 1 && n >= 1 && sm_count >= 1,
                "choose_sm90_tile: expected rows >= 0, experts >= 1, n >= 1, sm_count >= 1, got ",
                rows, ", ", experts, ", ", n, ", ", sm_count);
  return choose_sm90_tile(rows, experts, n, sm_count);
}

std::vector<int64_t> sm90_workspace_layout_binding(int64_t experts, int64_t cutlass_bytes,
                                                  std::vector<int64_t> elem_bytes) {
  COMPASS_CHECK(experts >= 1 && cutlass_bytes >= 0,
                "sm90_workspace_layout: expected experts >= 1 and cutlass_bytes >= 0, got ",
                experts, ", ", cutlass_bytes);
  COMPASS_CHECK(elem_bytes.size() == kSm90GroupArrays, "elem_bytes: expected ",
                kSm90GroupArrays, " sizes (StrideA, StrideB, StrideD, LayoutSFA, LayoutSFB), got ",
                elem_bytes.size());
  std::array<int64_t, kSm90GroupArrays> sizes{};
  for (int i = 0; i < kSm90GroupArrays; ++i) sizes[i] = elem_bytes[i];
  const Sm90WorkspaceLayout l = sm90_workspace_layout(experts, cutlass_bytes, sizes);
  std::vector<int64_t> out{l.cutlass_offset, l.cutlass_bytes};
  out.insert(out.end(), l.offsets.begin(), l.offsets.end());
  out.push_back(l.total);
  return out;
}

#ifdef COMPASS_WITH_CUTLASS  // CUDA build with CUTLASS headers (CMakeLists.txt)
int64_t grouped_gemm_sm90_workspace(int64_t tile, int64_t experts, int64_t sm_count) {
  switch (tile) {
    case kSm90M64: return grouped_gemm_sm90_m64_workspace(experts, sm_count);
    case kSm90M128: return grouped_gemm_sm90_m128_workspace(experts, sm_count);
  }
  COMPASS_CHECK(false, "tile: expected a tile configuration in [0, ", kNumSm90Tiles, "), got ",
                tile);
  return 0;
}

int64_t grouped_gemm_sm90_shared_bytes(int64_t tile) {
  switch (tile) {
    case kSm90M64: return grouped_gemm_sm90_m64_shared_bytes();
    case kSm90M128: return grouped_gemm_sm90_m128_shared_bytes();
  }
  COMPASS_CHECK(false, "tile: expected a tile configuration in [0, ", kNumSm90Tiles, "), got ",
                tile);
  return 0;
}

void grouped_gemm_sm90_cuda(COMPASS_FP8_GROUPED_GEMM_ARGS, int64_t tile, TensorView shapes,
                            TensorView ptrs, TensorView workspace, int64_t sm_count,
                            uintptr_t stream) {
  switch (tile) {
    case kSm90M64:
      return grouped_gemm_sm90_m64(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out,
                                   shapes, ptrs, workspace, sm_count, stream);
    case kSm90M128:
      return grouped_gemm_sm90_m128(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out,
                                    shapes, ptrs, workspace, sm_count, stream);
  }
  COMPASS_CHECK(false, "tile: expected a tile configuration in [0, ", kNumSm90Tiles, "), got ",
                tile);
}
#endif

}  // namespace fp8
}  // namespace compass
