// Host entry points of the advantages kernels (CPU in advantages_cpu.cpp,
// CUDA in advantages.cu). Arguments are borrowed views; outputs are written in
// place. Checks (dtype, shape, device) run in check_* before any launch.
#pragma once

#include <cstdint>

#include "compass/advantages.h"
#include "compass/tensor_view.h"

namespace compass {
namespace advantages {

struct GroupArgs {
  TensorView rewards;    // [n] float32 | float64
  TensorView order;      // [n] int64, members of group g at order[offsets[g]:offsets[g+1]]
  TensorView offsets;    // [G+1] int64
  TensorView adv;        // [n] out, dtype of rewards
  TensorView zero_var;   // [n] out, bool
  TensorView group_mean; // [G] out, float64
  TensorView group_std;  // [G] out, float64
  int32_t mode = 0;  // Mode
  double eps = 1e-6;
  double zero_var_tol = 1e-6;
};

struct ZvpArgs {
  TensorView entropy;     // [T] float32
  TensorView cu_seqlens;  // [n+1] int64
  TensorView rewards;     // [n] float32 | float64
  TensorView zero_var;    // [n] bool
  TensorView advantages;  // [n] float32 | float64, or data == nullptr
  TensorView out;         // [T] out, float32
  float alpha = 0.1f;
};

void check_group_args(const GroupArgs& a);
void check_zvp_args(const ZvpArgs& a);

void group_advantages_cpu(const GroupArgs& a);
void rl_zvp_cpu(const ZvpArgs& a);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void group_advantages_cuda(const GroupArgs& a, uintptr_t stream);
void rl_zvp_cuda(const ZvpArgs& a, uintptr_t stream);
#endif

}  // namespace advantages
}  // namespace compass
