// ck.packing entry points: the planner (host-side by nature).
#include "compass_pybind.h"
#include "packing/packing_api.h"

namespace compass {
namespace packing {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("packing", "length-aware packing: the planner");
  COMPASS_DEF_NOGIL(m, plan_cpu,
                    "(lengths, group_ids|None, dp_size, max_tokens, micro_batch_multiple, "
                    "equal_samples, pad_multiple, cost_a, cost_b, refine_iters, order, offsets) "
                    "-> (micro-batches per rank, lower bound)");
  COMPASS_DEF_NOGIL(m, karmarkar_karp_cpu,
                    "(cost, k, rank_of): equal-size largest differencing, rank_of in place");
}

}  // namespace packing
}  // namespace compass
