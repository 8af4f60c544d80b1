// ck.espo segmented-loss entry points: one line per backend.
#include "compass_pybind.h"
#include "espo/espo_api.h"

namespace compass {
namespace espo {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("espo", "ESPO segmented policy loss");
  const char* sums = "(entropy, logprobs, old_logprobs, cu_seqlens, mask|None, thresholds, "
                     "num_groups, flags, sums[, stream]): writes sums in place";
  const char* fwd = "(logprobs, old_logprobs, entropy, advantages, cu_seqlens, mask|None, "
                    "thresholds, sums, num_groups, flags, eps_low, eps_high, eps_scale, dual_clip, "
                    "log_lo, log_hi, inv_num_seqs, need_grad, loss, grad, seq_stats, stats"
                    "[, stream]): writes the outputs in place";
  const char* bwd = "(grad_loss, grad_coef, out[, stream]): out = grad_loss * grad_coef";
  COMPASS_DEF_NOGIL(m, espo_thresholds_cpu,
                    "(entropy, cu_seqlens, mask|None, levels, per_sequence, out): entropy "
                    "quantiles (torch.quantile's linear rule) written into out");
  COMPASS_DEF_NOGIL(m, espo_group_sums_cpu, sums);
  COMPASS_DEF_NOGIL(m, espo_loss_forward_cpu, fwd);
  COMPASS_DEF_NOGIL(m, espo_loss_backward_cpu, bwd);
#ifdef COMPASS_WITH_CUDA
  COMPASS_DEF(m, espo_group_sums_cuda, sums);
  COMPASS_DEF(m, espo_loss_forward_cuda, fwd);
  COMPASS_DEF(m, espo_loss_backward_cuda, bwd);
#endif
}

}  // namespace espo
}  // namespace compass
