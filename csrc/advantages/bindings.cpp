// ck.advantages entry points: one line per backend.
#include "advantages/advantages_api.h"
#include "compass_pybind.h"

namespace compass {
namespace advantages {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("advantages", "group advantages, zero variance, RL-ZVP");
  const char* group = "(rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, "
                      "group_mean, group_std[, stream]): writes the outputs in place";
  const char* zvp = "(entropy, cu_seqlens, rewards, zero_var, advantages|None, alpha, out"
                    "[, stream]): writes out in place";
  COMPASS_DEF_NOGIL(m, group_advantages_cpu, group);
  COMPASS_DEF_NOGIL(m, rl_zvp_cpu, zvp);
  COMPASS_DEF_NOGIL(m, group_advantages_ids_cpu,
                    "(rewards, group_ids, mode, eps, zero_var_tol, adv, zero_var, stats, index) -> G: "
                    "plan and advantages in one call");
  COMPASS_DEF_NOGIL(m, group_plan_cpu,
                    "(group_ids, order, offsets, unique) -> G: stable grouping by id");
  COMPASS_DEF_NOGIL(m, allocate_rollouts_cpu,
                    "(successes, attempts, cost, required, budget, min_n, max_n, prior_a, "
                    "prior_b, out) -> (value, upper bound, spent): samples per prompt, out in place");
#ifdef COMPASS_WITH_CUDA
  COMPASS_DEF(m, group_advantages_cuda, group);
  COMPASS_DEF(m, rl_zvp_cuda, zvp);
#endif
}

}  // namespace advantages
}  // namespace compass
