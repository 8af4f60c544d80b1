// Host entry points of the ESPO segmented loss (CPU in espo_loss_cpu.cpp, CUDA
// in espo_loss.cu), bound one line each in bindings.cpp. Arguments are borrowed
// views; outputs are written in place. check_* runs every dtype/shape/device
// check before any launch. R (the compute dtype) is float32 or float64: every
// float tensor but thresholds / sums / stats (float64) has it.
#pragma once

#include <cstdint>
#include <optional>

#include "compass/espo_loss.h"
#include "compass/tensor_view.h"

namespace compass {
namespace espo {

// Phase 1, per (sequence, entropy group): count, sum of l - l_old, sum of entropy.
// entropy, logprobs, old_logprobs [T] R; cu_seqlens [n+1] int64 (tokens past
// cu[n] are padding); mask [T] bool or None; thresholds [K-1] or [n*(K-1)]
// float64; sums [n*K*3] float64 (output).
#define COMPASS_ESPO_SUMS_ARGS                                                         \
  TensorView entropy, TensorView logprobs, TensorView old_logprobs, TensorView cu_seqlens, \
      std::optional<TensorView> mask, TensorView thresholds, int64_t num_groups,           \
      int64_t flags, TensorView sums
// Phase 2: per-token ratio, clip, loss and gradient with the (all-reduced) sums.
// advantages [n] or [T] R; loss [1] R; grad [T] R (or [0] without need_grad):
// d loss / d logprobs; seq_stats [n, 3K+7] float64; stats [3K+7] float64 (the
// columns of compass::espo_loss::StatCols).
#define COMPASS_ESPO_FORWARD_ARGS                                                          \
  TensorView logprobs, TensorView old_logprobs, TensorView entropy, TensorView advantages,  \
      TensorView cu_seqlens, std::optional<TensorView> mask, TensorView thresholds,          \
      TensorView sums, int64_t num_groups, int64_t flags, double eps_low, double eps_high,   \
      double eps_scale, double dual_clip, double log_lo, double log_hi, double inv_num_seqs, \
      int64_t need_grad, TensorView loss, TensorView grad, TensorView seq_stats, TensorView stats
// Backward: grad_logprobs = grad_loss * grad_coef. grad_loss [1] or [] R,
// grad_coef [T] R, out [T] R.
#define COMPASS_ESPO_BACKWARD_ARGS TensorView grad_loss, TensorView grad_coef, TensorView out

// Group boundaries: the quantiles at `levels` (torch.quantile's linear rule,
// bit for bit) of the valid tokens' entropy, over the batch (out [Q]) or per
// sequence (per_sequence != 0: out [n*Q]; NaN for a sequence without valid
// tokens). entropy [T] R, levels [Q] float64, out float64. CPU only: on CUDA
// a device sort in torch (compass_kernels/espo/loss.py) does it without a sync.
#define COMPASS_ESPO_THRESHOLDS_ARGS                                                     \
  TensorView entropy, TensorView cu_seqlens, std::optional<TensorView> mask, TensorView levels, \
      int64_t per_sequence, TensorView out

// Shared by every backend (defined in espo_loss_cpu.cpp), called with named views.
void check_sums_args(COMPASS_ESPO_SUMS_ARGS);
void check_forward_args(COMPASS_ESPO_FORWARD_ARGS);
void check_backward_args(COMPASS_ESPO_BACKWARD_ARGS);
// Index and value checks the CPU entry points make (host-readable data).
void check_host_data(const TensorView& cu_seqlens, int64_t total);

void espo_thresholds_cpu(COMPASS_ESPO_THRESHOLDS_ARGS);
void espo_group_sums_cpu(COMPASS_ESPO_SUMS_ARGS);
void espo_loss_forward_cpu(COMPASS_ESPO_FORWARD_ARGS);
void espo_loss_backward_cpu(COMPASS_ESPO_BACKWARD_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void espo_group_sums_cuda(COMPASS_ESPO_SUMS_ARGS, uintptr_t stream);
void espo_loss_forward_cuda(COMPASS_ESPO_FORWARD_ARGS, uintptr_t stream);
void espo_loss_backward_cuda(COMPASS_ESPO_BACKWARD_ARGS, uintptr_t stream);
#endif

}  // namespace espo
}  // namespace compass
