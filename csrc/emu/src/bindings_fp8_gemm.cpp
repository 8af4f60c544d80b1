// ck.fp8.grouped_gemm's plain CUDA entry points (csrc/fp8_gemm/grouped_args.cu
// compiled for emulation), one line each; plus the planted mutants the test
// suite must catch (cmake/emu.cmake), one submodule each under `mutants.fp8_gemm`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_FP8_GEMM(X)
#include "emu_pybind.h"
#include "fp8_gemm/fp8_gemm_api.h"

namespace compass {
namespace fp8_gemm {
#define COMPASS_EMU_DECLARE(name) \
  void grouped_args_cuda__##name(COMPASS_FP8_GROUPED_ARGS_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_FP8_GEMM(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace fp8_gemm

namespace emu {

void bind_fp8_gemm(pybind11::module_& root) {
  using namespace fp8_gemm;
  auto m = root.def_submodule("fp8_gemm", "ck.fp8.grouped_gemm CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "grouped_args_cuda", grouped_args_cuda, COMPASS_FP8_GROUPED_ARGS_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("fp8_gemm", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                      \
  {                                                                                 \
    auto sub = mut.def_submodule(#name);                                            \
    COMPASS_EMU_DEF(sub, "grouped_args_cuda", grouped_args_cuda__##name,            \
                    COMPASS_FP8_GROUPED_ARGS_ARGS);                                 \
  }
  COMPASS_EMU_MUTANTS_FP8_GEMM(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
