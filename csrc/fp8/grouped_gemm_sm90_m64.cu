// One tile configuration of the CUTLASS sm_90a FP8 blockwise grouped GEMM
// (grouped_gemm_sm90.cuh): 64x128x128, cluster 1x1x1, pingpong: two consumer
// warpgroups on their own 64-row tiles (decode-sized groups).
// One configuration per translation unit: each costs ~1 min and ~4 GB to compile.
#include "fp8/grouped_gemm_sm90.cuh"

namespace compass {
namespace fp8 {

using Sm90Config_m64 =
    sm90::Config<cute::Shape<cute::_64, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

int64_t grouped_gemm_sm90_m64_workspace(int64_t experts, int64_t sm_count) {
  return sm90::workspace_bytes<Sm90Config_m64>(experts, sm_count);
}

int64_t grouped_gemm_sm90_m64_shared_bytes() {
  return static_cast<int64_t>(Sm90Config_m64::GemmKernel::SharedStorageSize);
}

void grouped_gemm_sm90_m64(COMPASS_FP8_GROUPED_GEMM_ARGS, TensorView shapes, TensorView ptrs,
                           TensorView workspace, int64_t sm_count, uintptr_t stream) {
  sm90::run<Sm90Config_m64>(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out,
                            shapes, ptrs, workspace, sm_count, stream, "m64");
}

}  // namespace fp8
}  // namespace compass
