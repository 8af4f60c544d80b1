// ESPO / GSPO-token / GRPO clipped policy loss: the per-token math shared by
// the C++ (CPU) and CUDA kernels, so the CPU tests run the lines the GPU runs.
// Spec: compass_kernels/espo/reference_loss.py (DESIGN.md "ESPO").
#pragma once

#include <cmath>
#include <cstdint>

#include "compass/common.h"

namespace compass {
namespace espo_loss {

// Most entropy groups per sequence (compass_kernels/espo/loss_config.py).
constexpr int kMaxGroups = 8;

// flags (compass_kernels/espo/loss.py builds them)
enum Flags : int64_t {
  kPerSeqThresholds = 1,  // thresholds are [n, K-1], else [K-1]
  kTokenGroups = 2,       // GRPO: every token its own group (K = 1 bucket)
  kDropLow = 4,           // the lowest entropy bucket is left out of the loss
  kAdaptiveEps = 8,       // eps_g = eps_scale * mean_g(entropy), else (eps_low, eps_high)
  kGspoTokenForm = 16,    // token ratio value s_g (GSPO-token), else s_g * r_t (Eq. 9)
  kAdvPerToken = 32,      // advantages [T], else [n]
};

// Columns of a sequence's statistics row (seq_stats [n, 3K + 7]) and of the
// batch's (stats [3K + 7]): per group k clipped-low, clipped-high and
// dual-clipped token counts, then the loss and the scalar sums. Min / max of
// the ratio are the last two (a CP all-reduce takes MIN / MAX there, SUM before).
struct StatCols {
  int K;
  COMPASS_HD int clip_low(int k) const { return k; }
  COMPASS_HD int clip_high(int k) const { return K + k; }
  COMPASS_HD int dual(int k) const { return 2 * K + k; }
  COMPASS_HD int loss() const { return 3 * K; }
  COMPASS_HD int loss_tokens() const { return 3 * K + 1; }
  COMPASS_HD int sum_ratio() const { return 3 * K + 2; }
  COMPASS_HD int sum_k3() const { return 3 * K + 3; }
  COMPASS_HD int big_log_ratio() const { return 3 * K + 4; }
  COMPASS_HD int min_ratio() const { return 3 * K + 5; }
  COMPASS_HD int max_ratio() const { return 3 * K + 6; }
  COMPASS_HD int count() const { return 3 * K + 7; }
};

// Entropy bucket of a token: how many group boundaries its entropy exceeds
// (strictly: a token at the quantile is in the lower group).
COMPASS_HD int bucket(double e, const double* thr, int q) {
  int b = 0;
  for (int k = 0; k < q; ++k) b += e > thr[k] ? 1 : 0;
  return b;
}

// A group's constants (from its sums: count, sum d, sum e): mean log-ratio m,
// s_g = exp(m) unclamped, clip range, and the token weight 1 / (G K_i |g|).
// GRPO (token groups): per token, from d (m = d, |g| = 1).
struct GroupTerms {
  double m, s_g, eps_low, eps_high, weight;
};
COMPASS_HD GroupTerms group_terms(const double* g3, double groups, int64_t flags, double eps_low,
                                  double eps_high, double eps_scale, double inv_g) {
  const double cnt = g3[0];
  GroupTerms t;
  t.m = g3[1] / cnt;
  t.s_g = exp(t.m);
  const bool adaptive = flags & kAdaptiveEps;
  const double eps = adaptive ? eps_scale * (g3[2] / cnt) : 0.0;
  t.eps_low = adaptive ? eps : eps_low;
  t.eps_high = adaptive ? eps : eps_high;
  t.weight = inv_g / (groups * ((flags & kTokenGroups) ? 1.0 : cnt));
  return t;
}

// Token ratio s_t from d = l - l_old, r = exp(d) (computed once per token, also
// for k3) and its group's m and s_g: log s = m + d (Eq. 9), m (GSPO-token) or
// d (GRPO: m = d), clamped to [lo, hi]. Unclamped, s = s_g * r, s_g or r
// (one exp per token); clamped, exp of the bound. `clamped` tells the caller
// the token has no gradient.
COMPASS_HD double token_ratio(double d, double r, double m, double s_g, int64_t flags, double lo,
                              double hi, bool* clamped) {
  const bool token_groups = flags & kTokenGroups, gspo_token = flags & kGspoTokenForm;
  const double log_s = token_groups ? d : gspo_token ? m : m + d;
  *clamped = log_s < lo || log_s > hi;
  if (*clamped) return exp(fmin(fmax(log_s, lo), hi));
  return token_groups ? r : gspo_token ? s_g : s_g * r;
}

struct TokenTerms {
  double ratio;      // s_t (value)
  double objective;  // f_t
  double grad;       // d f_t / d l_t
  bool clip_low, clip_high, dual;
};

// One token of ratio s (token_ratio; `clamped` from it), advantage a, clip
// range [1 - el, 1 + eh], dual-clip bound dual_c > 0 for negative advantages.
// ds/dl = s in every ratio form; a clipped, dual-clipped or clamped token has
// no gradient (torch.clamp's and min's derivatives there).
COMPASS_HD TokenTerms token_terms(double s, bool clamped, double a, double el, double eh,
                                  double dual_c) {
  const double c = fmin(fmax(s, 1.0 - el), 1.0 + eh);
  const double o1 = s * a, o2 = c * a;
  const bool clipped = o2 < o1;
  double f = clipped ? o2 : o1;
  bool dual = false;
  if (dual_c > 0.0 && a < 0.0 && f < dual_c * a) {
    dual = true;
    f = dual_c * a;
  }
  TokenTerms t;
  t.ratio = s;
  t.objective = f;
  t.grad = (clipped || dual || clamped) ? 0.0 : a * s;
  t.clip_low = clipped && a < 0.0;
  t.clip_high = clipped && a > 0.0;
  t.dual = dual;
  return t;
}

// k3 estimate of KL(old || new) at one token (r = exp(d)) and the
// |log-ratio| > ln 2 flag.
COMPASS_HD double k3(double d, double r) { return r - 1.0 - d; }
COMPASS_HD bool big_log_ratio(double d) { return fabs(d) > 0.69314718055994530942; }

// Groups of sequence i that enter the loss (K_i): non-empty buckets, less the
// lowest with drop_low; GRPO: its valid tokens. sums: [n, K, 3] (count, sum d, sum e).
COMPASS_HD double groups_in_loss(const double* seq_sums, int K, int64_t flags) {
  if (flags & kTokenGroups) return seq_sums[0];
  double groups = 0.0;
  for (int k = (flags & kDropLow) ? 1 : 0; k < K; ++k) groups += seq_sums[3 * k] > 0.0 ? 1.0 : 0.0;
  return groups;
}

}  // namespace espo_loss
}  // namespace compass
