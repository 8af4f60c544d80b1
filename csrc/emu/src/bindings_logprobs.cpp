// ck.espo log-probs' CUDA entry points (csrc/logprobs/logprobs.cu compiled for
// emulation), one line each; plus the planted mutants the test suite must
// catch (cmake/emu.cmake), one submodule each under `mutants.logprobs`.
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS(X)
#include "emu_pybind.h"
#include "logprobs/logprobs_api.h"

namespace compass {
namespace logprobs {
#define COMPASS_EMU_DECLARE(name)                                                          \
  void token_logprobs_entropy_cuda__##name(COMPASS_LOGPROBS_FWD_ARGS, uintptr_t stream);     \
  void token_logprobs_entropy_bwd_cuda__##name(COMPASS_LOGPROBS_BWD_ARGS, uintptr_t stream); \
  void logprobs_tile_stats_cuda__##name(COMPASS_LOGPROBS_TILE_ARGS, uintptr_t stream);
COMPASS_EMU_MUTANTS_LOGPROBS(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace logprobs

namespace emu {

void bind_logprobs(pybind11::module_& root) {
  using namespace logprobs;
  auto m = root.def_submodule("logprobs", "ck.espo log-probs CUDA entry points, emulated");
  COMPASS_EMU_DEF(m, "token_logprobs_entropy_cuda", token_logprobs_entropy_cuda,
                  COMPASS_LOGPROBS_FWD_ARGS);
  COMPASS_EMU_DEF(m, "token_logprobs_entropy_bwd_cuda", token_logprobs_entropy_bwd_cuda,
                  COMPASS_LOGPROBS_BWD_ARGS);
  COMPASS_EMU_DEF(m, "logprobs_tile_stats_cuda", logprobs_tile_stats_cuda,
                  COMPASS_LOGPROBS_TILE_ARGS);
  auto mut = root.def_submodule("mutants").def_submodule("logprobs", "planted bugs");
#define COMPASS_EMU_BIND(name)                                                               \
  {                                                                                          \
    auto sub = mut.def_submodule(#name);                                                     \
    COMPASS_EMU_DEF(sub, "token_logprobs_entropy_cuda", token_logprobs_entropy_cuda__##name, \
                    COMPASS_LOGPROBS_FWD_ARGS);                                              \
    COMPASS_EMU_DEF(sub, "token_logprobs_entropy_bwd_cuda",                                  \
                    token_logprobs_entropy_bwd_cuda__##name, COMPASS_LOGPROBS_BWD_ARGS);     \
    COMPASS_EMU_DEF(sub, "logprobs_tile_stats_cuda", logprobs_tile_stats_cuda__##name,       \
                    COMPASS_LOGPROBS_TILE_ARGS);                                             \
  }
  COMPASS_EMU_MUTANTS_LOGPROBS(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
