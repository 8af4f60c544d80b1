// ck.fp8.grouped_gemm entry points: one line per backend.
#include "compass_pybind.h"
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

namespace {
// The builder's checks alone, for its GPU backend (Triton:
// compass_kernels/fp8/triton_args.py).
void check_grouped_args_named(COMPASS_FP8_GROUPED_ARGS_ARGS) {
  COMPASS_NAME_ARGS(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  check_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
}
}  // namespace

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("fp8", "FP8 grouped expert GEMM (blockwise scales)");
  const char* args = "(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs[, stream]): "
                     "per-expert problem shapes [E, 3] and pointer arrays [5, E] in place";
  COMPASS_DEF_NOGIL(m, grouped_args_cpu, args);
  m.def("check_grouped_args", &check_grouped_args_named,
        "(the builder's arguments and outputs): its checks alone (the Triton backend)");
  m.def("choose_sm90_tile", &choose_sm90_tile_binding,
        "(rows, experts, n, sm_count) -> CUTLASS sm_90a tile configuration (0 = m64, 1 = m128)");
  m.def("sm90_workspace_layout", &sm90_workspace_layout_binding,
        "(experts, cutlass_bytes, elem_bytes[5]) -> [cutlass_offset, cutlass_bytes, offsets of "
        "StrideA, StrideB, StrideD, LayoutSFA, LayoutSFB, total bytes]");
  m.attr("SM90_TILES") = pybind11::make_tuple("m64", "m128");
#ifdef COMPASS_WITH_CUTLASS  // CUDA build with CUTLASS headers (CMakeLists.txt)
  COMPASS_DEF(m, grouped_gemm_sm90_workspace, "(tile, experts, sm_count) -> workspace bytes");
  COMPASS_DEF(m, grouped_gemm_sm90_shared_bytes, "(tile) -> dynamic shared memory per CTA");
  COMPASS_DEF(m, grouped_gemm_sm90_cuda,
              "(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out, tile, shapes, ptrs, "
              "workspace, sm_count, stream): CUTLASS sm_90a blockwise grouped GEMM");
#endif
}

}  // namespace fp8
}  // namespace compass
