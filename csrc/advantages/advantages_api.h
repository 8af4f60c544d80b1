// Host entry point of the rollout budget allocator (budget_cpu.cpp), bound in
// bindings.cpp. Host-side by nature: it runs once per RL step on a few
// thousand prompts. (Group advantages and RL-ZVP are Python: the torch
// reference on CPU, Triton on GPU.)
#pragma once

#include <cstdint>
#include <tuple>

#include "compass/tensor_view.h"

namespace compass {
namespace advantages {

// Adaptive rollout budgets (budget_cpu.cpp): successes, attempts [P] float64
// (0 <= s <= a), cost [P] int64 (>= 1 per sample), required [P] bool (prompts
// that get at least min_n), out [P] int64 (n_i in {0} U [min_n, max_n]).
// Returns (expected informative groups, LP upper bound on the optimum, cost spent).
#define COMPASS_ALLOCATE_ROLLOUTS_ARGS                                                    \
  TensorView successes, TensorView attempts, TensorView cost, TensorView required,        \
      int64_t budget, int64_t min_n, int64_t max_n, double prior_a, double prior_b,        \
      TensorView out
std::tuple<double, double, int64_t> allocate_rollouts_cpu(COMPASS_ALLOCATE_ROLLOUTS_ARGS);

}  // namespace advantages
}  // namespace compass
