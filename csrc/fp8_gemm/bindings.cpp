// ck.fp8.grouped_gemm entry points: one line per backend.
#include "compass_pybind.h"
#include "fp8_gemm/fp8_gemm_api.h"

namespace compass {
namespace fp8_gemm {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("fp8_gemm", "FP8 grouped expert GEMM (blockwise scales)");
  COMPASS_DEF_NOGIL(m, grouped_gemm_cpu,
                    "(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out): writes out "
                    "in place");
}

}  // namespace fp8_gemm
}  // namespace compass
