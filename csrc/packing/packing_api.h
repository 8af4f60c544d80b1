// Host entry points of ck.packing's planner (plan_cpu.cpp), bound in
// bindings.cpp (THD pack / unpack is Python: the torch reference on CPU,
// Triton on GPU). Arguments are borrowed views; outputs are written in place.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "compass/tensor_view.h"

namespace compass {
namespace packing {

// Planner. lengths [n] int64 (>= 1); each is padded to pad_multiple (what
// counts against max_tokens) and balanced by its cost: cost_a * P + cost_b * P^2
// of the padded length P (cost_b = 0: the tokens, in exact int64 arithmetic);
// group_ids [n] int64 or None: sequences of one group stay on one rank.
// Outputs: order [n] int64 (sequence indices, rank-major then micro-batch),
// offsets [n + 1] int64 (micro-batch (r, m) is order[offsets[r*M+m] :
// offsets[r*M+m+1]]). Returns (M, lower bound): M micro-batches per rank
// (offsets[:dp*M+1] is written) and max(total cost / dp, largest item cost).
// Plans whenever a plan exists (within a search budget); a refusal says why.
#define COMPASS_PLAN_ARGS                                                                   \
  TensorView lengths, std::optional<TensorView> group_ids, int64_t dp_size, int64_t max_tokens, \
      int64_t micro_batch_multiple, bool equal_samples, int64_t pad_multiple, double cost_a,   \
      double cost_b, int64_t refine_iters, TensorView order, TensorView offsets

std::pair<int64_t, double> plan_cpu(COMPASS_PLAN_ARGS);

// Reference-grade Karmarkar-Karp (largest differencing, equal-size mode as RL
// frameworks run it; n not a multiple of k gets zero-cost fillers) for the
// bench and as the planner's second seed: rank_of [n] int64 written.
void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of);

}  // namespace packing
}  // namespace compass
