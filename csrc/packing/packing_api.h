// Host entry points of ck.packing: the planner (plan_cpu.cpp) and the THD
// pack / unpack kernels (pack_cpu.cpp, pack.cu), bound one line each in
// bindings.cpp. Arguments are borrowed views; outputs are written in place.
#pragma once

#include <cstdint>
#include <optional>

#include "compass/tensor_view.h"

namespace compass {
namespace packing {

// Planner. tokens [n] int64: each sequence's length as it counts against the
// cap (already padded to the pack multiple); cost [n] float64: what is balanced;
// group_ids [n] int64 or None: sequences of one group stay on one rank.
// Outputs: order [n] int64 (sequence indices, rank-major then micro-batch),
// offsets [n + 1] int64 (micro-batch (r, m) is order[offsets[r*M+m] :
// offsets[r*M+m+1]]). Returns M, the micro-batches per rank; offsets[:dp*M+1]
// is written.
#define COMPASS_PLAN_ARGS                                                                \
  TensorView tokens, TensorView cost, std::optional<TensorView> group_ids, int64_t dp_size, \
      int64_t max_tokens, int64_t micro_batch_multiple, bool equal_samples,               \
      int64_t refine_iters, TensorView order, TensorView offsets

int64_t plan_cpu(COMPASS_PLAN_ARGS);

// Reference-grade Karmarkar-Karp (largest differencing, equal-size mode as RL
// frameworks run it; n not a multiple of k gets zero-cost fillers) for the
// bench and as the planner's second seed: rank_of [n] int64 written.
void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of);

}  // namespace packing
}  // namespace compass
