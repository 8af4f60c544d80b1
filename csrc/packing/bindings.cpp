// ck.packing entry points: one line per backend.
#include "compass_pybind.h"
#include "packing/packing_api.h"

namespace compass {
namespace packing {

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("packing", "length-aware packing: planner, THD pack / unpack");
  COMPASS_DEF_NOGIL(m, plan_cpu,
                    "(lengths, group_ids|None, dp_size, max_tokens, micro_batch_multiple, "
                    "equal_samples, pad_multiple, cost_a, cost_b, refine_iters, order, offsets) "
                    "-> (micro-batches per rank, lower bound)");
  COMPASS_DEF_NOGIL(m, karmarkar_karp_cpu,
                    "(cost, k, rank_of): equal-size largest differencing, rank_of in place");
  const char* pack = "(src, seq_start, seqlens, out_offsets, cp_size, cp_rank, fill, total, out"
                     "[, stream]): THD pack, out in place";
  const char* unpack = "(packed, seqlens, cu_seqlens, out_offsets, cp_size, total, out"
                       "[, stream]): THD unpack, out in place";
  const char* pos = "(out_offsets, cp_size, cp_rank, total, out[, stream]): position ids";
  COMPASS_DEF_NOGIL(m, thd_pack_cpu, pack);
  COMPASS_DEF_NOGIL(m, thd_unpack_cpu, unpack);
  COMPASS_DEF_NOGIL(m, thd_positions_cpu, pos);
#ifdef COMPASS_WITH_CUDA
  COMPASS_DEF(m, thd_pack_cuda, pack);
  COMPASS_DEF(m, thd_unpack_cuda, unpack);
  COMPASS_DEF(m, thd_positions_cuda, pos);
#endif
}

}  // namespace packing
}  // namespace compass
