// Host entry points of the token log-prob / entropy kernels (CPU in
// logprobs_cpu.cpp), bound one line each in bindings.cpp. Arguments are
// borrowed views; outputs are written in place. check_* runs every
// dtype/shape/device check before any work.
#pragma once

#include <cstdint>
#include <optional>

#include "compass/logprobs.h"
#include "compass/tensor_view.h"

namespace compass {

// bfloat16 storage (the upper 16 bits of a float32): loaded by widening,
// stored once with round-to-nearest-even.
struct bf16 {
  uint16_t bits;
};
template <> struct DTypeOf<bf16> { static constexpr DType value = DType::kBFloat16; };

namespace logprobs {

// logits [T, V] float32|bfloat16 (rows may be strided, the vocab dim must be
// contiguous); targets [T] int64 in [0, V); outputs [T] float32: logp (<= 0),
// entropy (NaN when with_entropy is false), row_max m (of the raw logits) and
// log_norm log s (lse of logits / T = m / T + log s), saved for the backward:
// kept apart, z - m is exact near the max (compass/logprobs.h).
#define COMPASS_LOGPROBS_FWD_ARGS                                                       \
  TensorView logits, TensorView targets, double temperature, bool with_entropy,         \
      TensorView logp, TensorView entropy, TensorView row_max, TensorView log_norm
// grad_logits [T, Vtile] (logits' dtype; may alias logits) = d(sum g_l * logp +
// g_h * entropy) / d logits for the vocab columns [vocab_start, vocab_start +
// Vtile) of a row whose full-vocab row_max, log_norm and entropy are given. grad_logprob /
// grad_entropy [T] float32 or None (zero).
#define COMPASS_LOGPROBS_BWD_ARGS                                                        \
  TensorView logits, TensorView targets, TensorView row_max, TensorView log_norm,         \
      TensorView entropy,                                                                 \
      std::optional<TensorView> grad_logprob, std::optional<TensorView> grad_entropy,    \
      double temperature, int64_t vocab_start, TensorView grad_logits
// One vocab tile of the online statistics: state_in / state_out [4, T] float32
// rows (m, s, a, z_target) as in compass/logprobs.h, z_target the raw target
// logit when the target falls in [vocab_start, vocab_start + Vtile) (kept
// otherwise). state_out may alias state_in. Init: m = -inf, s = a = x_target = 0.
#define COMPASS_LOGPROBS_TILE_ARGS                                                        \
  TensorView logits, TensorView targets, int64_t vocab_start, double temperature,        \
      bool with_entropy, TensorView state_in, TensorView state_out

void check_fwd_args(COMPASS_LOGPROBS_FWD_ARGS);
void check_bwd_args(COMPASS_LOGPROBS_BWD_ARGS);
void check_tile_args(COMPASS_LOGPROBS_TILE_ARGS);

void token_logprobs_entropy_cpu(COMPASS_LOGPROBS_FWD_ARGS);
void token_logprobs_entropy_bwd_cpu(COMPASS_LOGPROBS_BWD_ARGS);
void logprobs_tile_stats_cpu(COMPASS_LOGPROBS_TILE_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void token_logprobs_entropy_cuda(COMPASS_LOGPROBS_FWD_ARGS, uintptr_t stream);
void token_logprobs_entropy_bwd_cuda(COMPASS_LOGPROBS_BWD_ARGS, uintptr_t stream);
void logprobs_tile_stats_cuda(COMPASS_LOGPROBS_TILE_ARGS, uintptr_t stream);
#endif

}  // namespace logprobs
}  // namespace compass
