// Per-token log-prob / entropy math shared by the CPU kernels (and any CUDA
// port): the online log-sum-exp state, its merge, its finalisation and the
// per-logit gradient. Everything is float32. With raw logits z and
// temperature T (inv_t = 1 / T), the distribution is softmax(z * inv_t).
//
// State of a row after seeing z_1..z_k (m = max z, raw units; d_j = (z_j - m) * inv_t):
//   s = sum exp(d_j),  a = sum exp(d_j) * d_j   (a <= 0)
// so lse = m * inv_t + log s and entropy H = lse - sum p x = log s - a / s.
// - a relative to the running max (instead of sum exp(x) * x) keeps every term
//   bounded: no cancellation between lse and E[x] for logits of any sign or
//   size (the all-negative-logits bug of a peer kernel);
// - z_j - m is exact near the max (Sterbenz) and is scaled once, so log p of
//   a confident token, and its gradient, keep full relative accuracy (a
//   scaled max m * inv_t differs from z_j * inv_t by an ulp of |x| when the
//   compiler fuses the product into an FMA, ~2e-6 at |x| = 30).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "compass/common.h"

namespace compass {
namespace logprobs {

// x - m below this is exp() == 0 in float32; clamping keeps (x - m) * exp(x - m)
// at 0 * finite for x = -inf (masked vocab entries) instead of NaN.
constexpr float kMinExponent = -200.0f;
// A target equal to kIgnoreIndex (-100, Hugging Face's / torch's ignore_index) is
// a masked token: log-prob 0 and no log-prob gradient. Any other target outside
// [0, V) is invalid: the CPU entry points raise; the GPU kernels, which never read
// outside the row, write a NaN log-prob (no host sync to raise).
constexpr int64_t kIgnoreIndex = -100;

// exp(x) for x in [-200, 88], written so the compiler vectorizes it (no libm
// call, no branch): round-to-nearest range reduction with the 1.5 * 2^23 trick,
// Cephes' degree-6 polynomial on [-ln2/2, ln2/2] (~1 ulp), 2^n through the
// exponent bits. Results below 2^-126 flush to 0 (they change no float32 sum
// of terms that include exp(0) = 1).
COMPASS_HD float fast_exp(float x) {
  const float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x > -87.0f ? x : -87.0f;  // two selects (a nested one blocked if-conversion)
  x = x < 88.0f ? x : 88.0f;
  const float t = x * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ti;
  std::memcpy(&ti, &t, sizeof ti);
  const int32_t ni = ti - 0x4B400000;  // the integer n (bits of kShift removed)
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Online state of one row (or one vocab shard of a row).
struct RowState {
  float m = -INFINITY;
  float s = 0.0f;
  float a = 0.0f;
};

// Moves state (s, a) from max m to max m_new >= m (raw units).
COMPASS_HD void rescale(RowState& st, float m_new, float inv_t) {
  if (st.m == m_new) return;
  if (st.m == -INFINITY) {  // nothing seen yet (or only -inf): s = a = 0
    st.m = m_new;
    return;
  }
  const float d = (st.m - m_new) * inv_t;  // <= 0
  const float c = std::exp(d);
  st.a = c * (st.a + st.s * d);
  st.s = c * st.s;
  st.m = m_new;
}

// Merges another shard's state into st (vocab tensor parallelism, tiles).
COMPASS_HD void merge(RowState& st, RowState o, float inv_t) {
  const float m = st.m > o.m ? st.m : o.m;
  rescale(st, m, inv_t);
  rescale(o, m, inv_t);
  st.s += o.s;
  st.a += o.a;
}

// H = log s - a / s, >= 0 in exact arithmetic; rounding can leave -1 ulp.
COMPASS_HD float entropy_of(const RowState& st) {
  const float h = std::log(st.s) - st.a / st.s;
  return h > 0.0f ? h : 0.0f;
}

// log p(y) = (z_y - m) * inv_t - log s, <= 0 in exact arithmetic: never
// positive here (a positive log-prob from rounding was a peer kernel's bug).
COMPASS_HD float logprob_of(float z_target, const RowState& st, float inv_t) {
  const float l = (z_target - st.m) * inv_t - std::log(st.s);
  return l < 0.0f ? l : 0.0f;
}

// log p_j = (z_j - m) * inv_t - log s, clamped to kMinExponent so that a masked
// (-inf) logit gives p = 0 and a finite d * p = 0.
COMPASS_HD float log_softmax_of(float z, float m, float log_s, float inv_t) {
  const float d = (z - m) * inv_t - log_s;
  return d < kMinExponent ? kMinExponent : d;
}

// d(g_l * log p_y + g_h * H) / dx_j for a non-target j, with d = x_j - lse
// (log p_j): -g_l p_j - g_h p_j (log p_j + H). The target adds g_l. All in
// float32; the caller rounds once, at the store (rounding p to bf16 before the
// one-hot subtraction erases small target gradients).
COMPASS_HD float grad_nontarget(float d, float p, float g_l, float g_h, float h) {
  return -p * (g_l + g_h * (d + h));
}

}  // namespace logprobs
}  // namespace compass
