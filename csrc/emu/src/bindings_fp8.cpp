// ck.fp8.grouped_gemm's plain CUDA entry points (csrc/fp8/grouped_args.cu
// compiled for emulation), one line each; plus the planted mutants the test
// suite must catch (cmake/emu.cmake), one submodule each under `mutants.fp8`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_FP8(X)
#include "emu_pybind.h"
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {
#define COMPASS_EMU_DECLARE(name) \
  void grouped_args_cuda__##name(COMPASS_FP8_GROUPED_ARGS_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_FP8(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace fp8

namespace emu {

void bind_fp8(pybind11::module_& root) {
  using namespace fp8;
  auto m = root.def_submodule("fp8", "ck.fp8.grouped_gemm CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "grouped_args_cuda", grouped_args_cuda, COMPASS_FP8_GROUPED_ARGS_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("fp8", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                      \
  {                                                                                 \
    auto sub = mut.def_submodule(#name);                                            \
    COMPASS_EMU_DEF(sub, "grouped_args_cuda", grouped_args_cuda__##name,            \
                    COMPASS_FP8_GROUPED_ARGS_ARGS);                                 \
  }
  COMPASS_EMU_MUTANTS_FP8(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
