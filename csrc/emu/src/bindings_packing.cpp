// ck.packing's CUDA entry points (csrc/packing/pack.cu compiled for
// emulation), one line each; plus the planted mutants the test suite must
// catch (cmake/emu.cmake), one submodule each under `mutants.packing`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_PACKING(X)
#include "emu_pybind.h"
#include "packing/packing_api.h"

namespace compass {
namespace packing {
#define COMPASS_EMU_DECLARE(name)                                            \
  void thd_pack_cuda__##name(COMPASS_THD_PACK_ARGS, uintptr_t stream);       \
  void thd_unpack_cuda__##name(COMPASS_THD_UNPACK_ARGS, uintptr_t stream);   \
  void thd_positions_cuda__##name(COMPASS_THD_POSITIONS_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_PACKING(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace packing

namespace emu {

void bind_packing(pybind11::module_& root) {
  using namespace packing;
  auto m = root.def_submodule("packing", "ck.packing CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "thd_pack_cuda", thd_pack_cuda, COMPASS_THD_PACK_ARGS);
  COMPASS_EMU_DEF(m, "thd_unpack_cuda", thd_unpack_cuda, COMPASS_THD_UNPACK_ARGS);
  COMPASS_EMU_DEF(m, "thd_positions_cuda", thd_positions_cuda, COMPASS_THD_POSITIONS_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("packing", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                             \
  {                                                                                        \
    auto sub = mut.def_submodule(#name);                                                   \
    COMPASS_EMU_DEF(sub, "thd_pack_cuda", thd_pack_cuda__##name, COMPASS_THD_PACK_ARGS);   \
    COMPASS_EMU_DEF(sub, "thd_unpack_cuda", thd_unpack_cuda__##name, COMPASS_THD_UNPACK_ARGS); \
    COMPASS_EMU_DEF(sub, "thd_positions_cuda", thd_positions_cuda__##name,                 \
                    COMPASS_THD_POSITIONS_ARGS);                                           \
  }
  COMPASS_EMU_MUTANTS_PACKING(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
