// Host entry points of the advantages kernels (CPU in advantages_cpu.cpp, CUDA
// in advantages.cu), bound one line each in bindings.cpp. Arguments are
// borrowed views; outputs are written in place. check_* runs every
// dtype/shape/device check before any launch.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include "compass/advantages.h"
#include "compass/tensor_view.h"

namespace compass {
namespace advantages {

// rewards [n] float32|float64; order [n] int64 (members of group g are
// order[offsets[g]:offsets[g+1]]); offsets [G+1] int64; outputs: adv [n]
// (rewards' dtype), zero_var [n] bool, group_mean / group_std [G] float64.
#define COMPASS_GROUP_ADVANTAGES_ARGS                                              \
  TensorView rewards, TensorView order, TensorView offsets, int64_t mode, double eps, \
      double zero_var_tol, TensorView adv, TensorView zero_var, TensorView group_mean,  \
      TensorView group_std
// group_advantages with the plan made inside (cpp backend, CPU): rewards [n]
// float32|float64, group_ids [n] any integer dtype; outputs adv [n], zero_var
// [n] bool, and per group, in buffers sized for the worst case (n groups):
// stats [2n] float64 = group mean [n] | group std [n]; index [3n+1] int64 =
// unique ids [n] (increasing) | first member of each group in sample order [n]
// | offsets [n+1] (group sizes' prefix sums). Returns G: the first G (G + 1)
// entries of each part are written.
#define COMPASS_GROUP_ADVANTAGES_IDS_ARGS                                              \
  TensorView rewards, TensorView group_ids, int64_t mode, double eps, double zero_var_tol, \
      TensorView adv, TensorView zero_var, TensorView stats, TensorView index
// entropy [T] float32; cu_seqlens [n+1] int64; rewards [n] float32|float64;
// zero_var [n] bool; advantages [n] float32|float64 or None; out [T] float32.
#define COMPASS_RL_ZVP_ARGS                                                         \
  TensorView entropy, TensorView cu_seqlens, TensorView rewards, TensorView zero_var, \
      std::optional<TensorView> advantages, double alpha, TensorView out

// Shared by every backend (defined in advantages_cpu.cpp), called with views
// the entry point has named: checks dtype, shape and same-device; index contents are checked by the CPU
// entry points (host-readable) and by the Python layer on CUDA.
void check_group_args(COMPASS_GROUP_ADVANTAGES_ARGS);
void check_rl_zvp_args(COMPASS_RL_ZVP_ARGS);

void group_advantages_cpu(COMPASS_GROUP_ADVANTAGES_ARGS);
// group_ids [n] any integer dtype -> order [n], offsets [n+1], unique [n]
// (int64, allocated by the caller for the worst case); returns G, the number
// of groups: offsets[:G+1] and unique[:G] are written.
int64_t group_plan_cpu(TensorView group_ids, TensorView order, TensorView offsets,
                       TensorView unique);
int64_t group_advantages_ids_cpu(COMPASS_GROUP_ADVANTAGES_IDS_ARGS);
void rl_zvp_cpu(COMPASS_RL_ZVP_ARGS);

// Adaptive rollout budgets (budget_cpu.cpp): successes, attempts [P] float64
// (0 <= s <= a), cost [P] int64 (>= 1 per sample), required [P] bool (prompts
// that get at least min_n), out [P] int64 (n_i in {0} U [min_n, max_n]).
// Returns (expected informative groups, LP upper bound on the optimum, cost spent).
#define COMPASS_ALLOCATE_ROLLOUTS_ARGS                                                    \
  TensorView successes, TensorView attempts, TensorView cost, TensorView required,        \
      int64_t budget, int64_t min_n, int64_t max_n, double prior_a, double prior_b,        \
      TensorView out
std::tuple<double, double, int64_t> allocate_rollouts_cpu(COMPASS_ALLOCATE_ROLLOUTS_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void group_advantages_cuda(COMPASS_GROUP_ADVANTAGES_ARGS, uintptr_t stream);
void rl_zvp_cuda(COMPASS_RL_ZVP_ARGS, uintptr_t stream);
#endif

}  // namespace advantages
}  // namespace compass
