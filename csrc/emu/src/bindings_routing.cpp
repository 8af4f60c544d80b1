// ck.routing's CUDA entry point (csrc/routing/codec.cu compiled for
// emulation), plus the planted mutants the test suite must catch
// (cmake/emu.cmake), one submodule each under `mutants.routing`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS_ROUTING_<FILE>(X)
#include "emu_pybind.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {
#define COMPASS_EMU_DECLARE(name) \
  void encode_sets_cuda__##name(COMPASS_ENCODE_SETS_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_ROUTING_CODEC(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace routing

namespace emu {

void bind_routing(pybind11::module_& root) {
  using namespace routing;
  auto m = root.def_submodule("routing", "ck.routing CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "encode_sets_cuda", encode_sets_cuda, COMPASS_ENCODE_SETS_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("routing", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                           \
  {                                                                                      \
    auto sub = mut.def_submodule(#name);                                                 \
    COMPASS_EMU_DEF(sub, "encode_sets_cuda", encode_sets_cuda__##name, COMPASS_ENCODE_SETS_ARGS); \
  }
  COMPASS_EMU_MUTANTS_ROUTING_CODEC(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
