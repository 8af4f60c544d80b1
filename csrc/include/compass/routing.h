// Router replay: the per-element math shared by the C++ (CPU) and CUDA kernels,
// so the CPU tests exercise the lines the GPU runs.
// Spec: compass_kernels/routing/reference.py.
#pragma once

#include <cmath>
#include <cstdint>

#include "compass/common.h"

namespace compass {
namespace routing {

enum ScoreFunction : int32_t { kSoftmax = 0, kSigmoid = 1 };

// Slots of the int64 counts output of replay_topk.
enum Count : int32_t {
  kRows = 0,        // rows in the call
  kCandidates = 1,  // rows replayed from the trace or rejected by the ratio (valid, well formed)
  kOverlap = 2,     // sum over candidates of |native top-k ∩ replayed|
  kExact = 3,       // candidates whose native set equals the replayed set
  kRejected = 4,    // candidates routed natively by min_score_ratio
  kBadRows = 5,     // valid rows with an id out of [0, E) or twice: routed natively
  kNumCounts = 6
};

// Megatron-core's epsilon of the sigmoid normalisation (DeepSeek-V3).
constexpr double kSigmoidEps = 1e-20;

// Precision-matched math: float stays float (expf), double stays double.
COMPASS_HD float rexp(float x) { return expf(x); }
COMPASS_HD double rexp(double x) { return exp(x); }
COMPASS_HD float rmax(float a, float b) { return fmaxf(a, b); }
COMPASS_HD double rmax(double a, double b) { return fmax(a, b); }
COMPASS_HD float rmin(float a, float b) { return fminf(a, b); }
COMPASS_HD double rmin(double a, double b) { return fmin(a, b); }

template <typename A>
COMPASS_HD A sigmoid(A z) {
  return A(1) / (A(1) + rexp(-z));
}

// The router score of one expert: softmax probability (row max zmax, 1 / sum of
// exp(z - zmax) inv_sum) or sigmoid. The ratio test compares these.
template <typename A>
COMPASS_HD A router_score(A z, A zmax, A inv_sum, int32_t score_function) {
  return score_function == kSoftmax ? rexp(z - zmax) * inv_sum : sigmoid(z);
}

// Native selection order: (value a, index ia) ranks above (b, ib); ties go to
// the lower expert index on every backend.
template <typename A>
COMPASS_HD bool ranks_above(A a, int64_t ia, A b, int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// Replay a row only when its weakest replayed score is at least ratio x its
// weakest native top-k score (ratio < 0: no test).
template <typename A>
COMPASS_HD bool replay_accepted(A weakest_replayed, A weakest_native, double ratio) {
  return ratio < 0 || weakest_replayed >= static_cast<A>(ratio) * weakest_native;
}

// Gating weight w_k = numerator_k / denominator * scaling, where
//   softmax, normalize:  numerator = exp(z_k - max_j z_j over the K used), denominator = their sum
//   softmax, !normalize: numerator = exp(z_k - row max), denominator = row sum of exp(z - row max)
//   sigmoid:             numerator = sigmoid(z_k), denominator = sum + 1e-20 if normalize
//                        and K > 1, else 1.
// ``shift`` is the max of the used logits (normalized softmax) or the row max.
template <typename A>
COMPASS_HD A gate_numerator(A z, A shift, int32_t score_function) {
  return score_function == kSoftmax ? rexp(z - shift) : sigmoid(z);
}

template <typename A>
COMPASS_HD A gate_denominator(A sum_numerators, A row_sumexp, int32_t score_function,
                              bool normalize, int64_t k) {
  if (score_function == kSoftmax) return normalize ? sum_numerators : row_sumexp;
  return (normalize && k > 1) ? sum_numerators + static_cast<A>(kSigmoidEps) : A(1);
}

// Whether the softmax-without-renormalisation gradient is dense (every expert
// of the row gets -p_e * dot); otherwise only the K used logits get gradient.
COMPASS_HD bool dense_gradient(int32_t score_function, bool normalize) {
  return score_function == kSoftmax && !normalize;
}

// d loss / d z at a used expert k, before ``scaling``. g = d loss / d w_k,
// w0 = numerator / denominator (unscaled weight), dot = sum_j g_j w0_j,
// den = the denominator, num = the numerator (sigmoid score for sigmoid).
//   softmax (either): w0 * (g - dot)          [normalize: softmax over K; else p * (g - dot)]
//   sigmoid, normalized, K > 1: (g - dot) / den * s * (1 - s)
//   sigmoid otherwise:          g * s * (1 - s)
template <typename A>
COMPASS_HD A grad_used(A g, A w0, A dot, A num, A den, int32_t score_function, bool normalize,
                       int64_t k) {
  if (score_function == kSoftmax) return w0 * (g - dot);
  const A ds = num * (A(1) - num);
  return (normalize && k > 1) ? (g - dot) / den * ds : g * ds;
}

}  // namespace routing
}  // namespace compass
