// ck.fp8 entry points: one line per backend.
#include "compass_pybind.h"
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("fp8", "FP8 blockwise quantization, fused MoE permutation");
  const char* quant = "(x, block_rows, block_cols, eps, ue8m0, use_div, scale_layout, q, scales[, stream]): "
                      "writes q and scales in place";
  const char* perm = "(x, topk_ids, num_experts, eps, ue8m0, scale_layout, q, scales, expert_offsets, "
                     "src_index, dst_index, workspace[, stream]): writes the outputs in place";
  const char* unperm = "(y, dst_index, topk_weights, out[, stream]): writes out in place";
  COMPASS_DEF_NOGIL(m, quantize_cpu, quant);
  COMPASS_DEF_NOGIL(m, permute_quantize_cpu, perm);
  COMPASS_DEF_NOGIL(m, unpermute_cpu, unperm);
  m.def("permute_workspace_size", &permute_workspace_size,
        "(slots, num_experts) -> int32 elements of workspace the CUDA permutation needs");
#ifdef COMPASS_WITH_CUDA
  COMPASS_DEF(m, quantize_cuda, quant);
  COMPASS_DEF(m, permute_quantize_cuda, perm);
  COMPASS_DEF(m, unpermute_cuda, unperm);
#endif
}

}  // namespace fp8
}  // namespace compass
