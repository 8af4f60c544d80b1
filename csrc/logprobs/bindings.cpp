// ck.espo token log-prob / entropy entry points: one line per backend.
#include "compass_pybind.h"
#include "logprobs/logprobs_api.h"

namespace compass {
namespace logprobs {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("logprobs", "token log-probs and entropy (ESPO)");
  COMPASS_DEF_NOGIL(m, token_logprobs_entropy_cpu,
                    "(logits, targets, temperature, with_entropy, logp, entropy, row_max, log_norm)");
  COMPASS_DEF_NOGIL(m, token_logprobs_entropy_bwd_cpu,
                    "(logits, targets, row_max, log_norm, entropy, grad_logprob|None, grad_entropy|None, "
                    "temperature, vocab_start, grad_logits): in place");
  COMPASS_DEF_NOGIL(m, logprobs_tile_stats_cpu,
                    "(logits, targets, vocab_start, temperature, with_entropy, state_in, "
                    "state_out): one vocab tile of the online statistics");
#ifdef COMPASS_WITH_CUDA
  COMPASS_DEF(m, token_logprobs_entropy_cuda, "as the _cpu entry point, plus the stream");
  COMPASS_DEF(m, token_logprobs_entropy_bwd_cuda, "as the _cpu entry point, plus the stream");
  COMPASS_DEF(m, logprobs_tile_stats_cuda, "as the _cpu entry point, plus the stream");
#endif
}

}  // namespace logprobs
}  // namespace compass
