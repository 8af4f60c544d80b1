// ck.espo's segmented-loss CUDA entry points (csrc/espo/espo_loss.cu compiled
// for emulation), one line each; plus the planted mutants the test suite must
// catch (cmake/emu.cmake), one submodule each under `mutants.espo`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_ESPO(X)
#include "emu_pybind.h"
#include "espo/espo_api.h"

namespace compass {
namespace espo {
#define COMPASS_EMU_DECLARE(name)                                                      \
  void espo_group_sums_cuda__##name(COMPASS_ESPO_SUMS_ARGS, uintptr_t stream);       \
  void espo_loss_forward_cuda__##name(COMPASS_ESPO_FORWARD_ARGS, uintptr_t stream);  \
  void espo_loss_backward_cuda__##name(COMPASS_ESPO_BACKWARD_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_ESPO(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace espo

namespace emu {

void bind_espo(pybind11::module_& root) {
  using namespace espo;
  auto m = root.def_submodule("espo", "ck.espo CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "espo_group_sums_cuda", espo_group_sums_cuda, COMPASS_ESPO_SUMS_ARGS);
  COMPASS_EMU_DEF(m, "espo_loss_forward_cuda", espo_loss_forward_cuda, COMPASS_ESPO_FORWARD_ARGS);
  COMPASS_EMU_DEF(m, "espo_loss_backward_cuda", espo_loss_backward_cuda,
                  COMPASS_ESPO_BACKWARD_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("espo", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                              \
  {                                                                                         \
    auto sub = mut.def_submodule(#name);                                                    \
    COMPASS_EMU_DEF(sub, "espo_group_sums_cuda", espo_group_sums_cuda__##name,              \
                    COMPASS_ESPO_SUMS_ARGS);                                                \
    COMPASS_EMU_DEF(sub, "espo_loss_forward_cuda", espo_loss_forward_cuda__##name,          \
                    COMPASS_ESPO_FORWARD_ARGS);                                             \
    COMPASS_EMU_DEF(sub, "espo_loss_backward_cuda", espo_loss_backward_cuda__##name,        \
                    COMPASS_ESPO_BACKWARD_ARGS);                                            \
  }
  COMPASS_EMU_MUTANTS_ESPO(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
