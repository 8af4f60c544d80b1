// ck.advantages' CUDA entry points (csrc/advantages/advantages.cu compiled for
// emulation), one line each; plus the planted mutants the test suite must
// catch (cmake/emu.cmake), one submodule each under `mutants.advantages`.
#include "advantages/advantages_api.h"
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_advantages(X)
#include "emu_pybind.h"

namespace compass {
namespace advantages {
#define COMPASS_EMU_DECLARE(name)                                                       \
  void group_advantages_cuda__##name(COMPASS_GROUP_ADVANTAGES_ARGS, uintptr_t stream); \
  void rl_zvp_cuda__##name(COMPASS_RL_ZVP_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_advantages(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace advantages

namespace emu {

void bind_advantages(pybind11::module_& root) {
  using namespace advantages;
  auto m = root.def_submodule("advantages", "ck.advantages CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "group_advantages_cuda", group_advantages_cuda,
                  COMPASS_GROUP_ADVANTAGES_ARGS);
  COMPASS_EMU_DEF(m, "rl_zvp_cuda", rl_zvp_cuda, COMPASS_RL_ZVP_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("advantages", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                           \
  {                                                                                      \
    auto sub = mut.def_submodule(#name);                                                 \
    COMPASS_EMU_DEF(sub, "group_advantages_cuda", group_advantages_cuda__##name,         \
                    COMPASS_GROUP_ADVANTAGES_ARGS);                                      \
    COMPASS_EMU_DEF(sub, "rl_zvp_cuda", rl_zvp_cuda__##name, COMPASS_RL_ZVP_ARGS);       \
  }
  COMPASS_EMU_MUTANTS_advantages(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
