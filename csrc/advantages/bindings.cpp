// ck.advantages entry points: the host-side budget allocator (the advantages
// ops are Python: compass_kernels/advantages/{reference,triton}.py).
#include "advantages/advantages_api.h"
#include "compass_pybind.h"

namespace compass {
namespace advantages {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("advantages", "rollout budget allocation");
  COMPASS_DEF_NOGIL(m, allocate_rollouts_cpu,
                    "(successes, attempts, cost, required, budget, min_n, max_n, prior_a, "
                    "prior_b, out) -> (value, upper bound, spent): samples per prompt, out in place");
}

}  // namespace advantages
}  // namespace compass
