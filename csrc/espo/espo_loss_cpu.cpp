// ESPO segmented loss on the CPU: OpenMP over sequences past a size
// threshold, one statistics row per sequence, then a fixed-order reduction over
// the rows (the same result for any thread count).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "compass/espo_loss.h"
#include "espo/espo_api.h"

namespace compass {
namespace espo {

using namespace compass::espo_loss;

namespace {
// Below this many tokens the kernels run on the calling thread: waking the
// OpenMP team costs more than the work (~10 ns per token here).
constexpr int64_t kParallelMinTokens = int64_t{1} << 15;
using Real = Types<float, double>;
constexpr int64_t kAllFlags = kPerSeqThresholds | kTokenGroups | kDropLow | kAdaptiveEps |
                              kGspoTokenForm | kAdvPerToken;

void check_common(const TensorView& ref, const TensorView& cu_seqlens,
                  const std::optional<TensorView>& mask, const TensorView& thresholds,
                  int64_t num_groups, int64_t flags) {
  const int64_t total = ref.numel();
  COMPASS_CHECK((flags & ~kAllFlags) == 0, "flags: unknown bits in ", flags);
  COMPASS_CHECK(num_groups >= 1 && num_groups <= kMaxGroups, "num_groups: expected 1..",
                kMaxGroups, ", got ", num_groups);
  COMPASS_CHECK(!(flags & kTokenGroups) || num_groups == 1,
                "num_groups: token groups (grpo) take 1 bucket, got ", num_groups);
  cu_seqlens.expect_vector().expect_same_device(ref).expect_dtype(DType::kInt64);
  COMPASS_CHECK(cu_seqlens.numel() >= 1, "cu_seqlens: expected at least one element (n+1)");
  const int64_t n = cu_seqlens.numel() - 1;
  if (mask) {
    mask->expect_vector().expect_same_device(ref).expect_dtype(DType::kBool);
    mask->expect_size(0, total, "one per token");
  }
  thresholds.expect_vector().expect_same_device(ref).expect_dtype(DType::kFloat64);
  const int64_t q = num_groups - 1;
  const int64_t want = (flags & kPerSeqThresholds) ? n * q : q;
  thresholds.expect_size(0, want, (flags & kPerSeqThresholds)
                                      ? "sequences x (num_groups - 1)"
                                      : "num_groups - 1 boundaries");
}

template <typename T>
void expect_finite(const T* v, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(std::isfinite(v[i]), name, ": expected finite values, got ", v[i], " at index ",
                  i);
  }
}

inline bool token_valid(const bool* mask, int64_t t) { return mask == nullptr || mask[t]; }

}  // namespace

void check_sums_args(COMPASS_ESPO_SUMS_ARGS) {
  entropy.expect_vector();
  dispatch(entropy, Real{}, [](auto) {});
  const int64_t total = entropy.numel();
  for (const TensorView* t : {&logprobs, &old_logprobs}) {
    t->expect_vector().expect_same_device(entropy).expect_dtype(entropy.dtype);
    t->expect_size(0, total, "one per token = len(entropy)");
  }
  check_common(entropy, cu_seqlens, mask, thresholds, num_groups, flags);
  const int64_t n = cu_seqlens.numel() - 1;
  sums.expect_vector().expect_same_device(entropy).expect_dtype(DType::kFloat64);
  sums.expect_size(0, n * num_groups * 3, "sequences x num_groups x 3");
}

void check_forward_args(COMPASS_ESPO_FORWARD_ARGS) {
  logprobs.expect_vector();
  dispatch(logprobs, Real{}, [](auto) {});
  const int64_t total = logprobs.numel();
  for (const TensorView* t : {&old_logprobs, &entropy}) {
    t->expect_vector().expect_same_device(logprobs).expect_dtype(logprobs.dtype);
    t->expect_size(0, total, "one per token = len(logprobs)");
  }
  check_common(logprobs, cu_seqlens, mask, thresholds, num_groups, flags);
  const int64_t n = cu_seqlens.numel() - 1, K = num_groups;
  advantages.expect_vector().expect_same_device(logprobs).expect_dtype(logprobs.dtype);
  if (flags & kAdvPerToken) {
    advantages.expect_size(0, total, "one per token (advantages per token)");
  } else {
    advantages.expect_size(0, n, "one per sequence = len(cu_seqlens) - 1");
  }
  sums.expect_vector().expect_same_device(logprobs).expect_dtype(DType::kFloat64);
  sums.expect_size(0, n * K * 3, "sequences x num_groups x 3");
  loss.expect_same_device(logprobs).expect_dtype(logprobs.dtype);
  COMPASS_CHECK(loss.numel() == 1 && loss.is_contiguous(), "loss: expected one element, got ",
                loss.describe());
  grad.expect_vector().expect_same_device(logprobs).expect_dtype(logprobs.dtype);
  grad.expect_size(0, need_grad ? total : 0, need_grad ? "one per token" : "0 (need_grad=0)");
  const StatCols cols{static_cast<int>(K)};
  seq_stats.expect_vector().expect_same_device(logprobs).expect_dtype(DType::kFloat64);
  seq_stats.expect_size(0, n * cols.count(), "sequences x (3 num_groups + 7)");
  stats.expect_vector().expect_same_device(logprobs).expect_dtype(DType::kFloat64);
  stats.expect_size(0, cols.count(), "3 num_groups + 7");
  if (!(flags & kAdaptiveEps)) {
    COMPASS_CHECK(eps_low >= 0.0 && eps_low < 1.0 && eps_high >= 0.0 && std::isfinite(eps_high),
                  "eps_low, eps_high: expected 0 <= eps_low < 1 and 0 <= eps_high < inf, got ",
                  eps_low, " and ", eps_high);
  } else {
    COMPASS_CHECK(eps_scale >= 0.0 && std::isfinite(eps_scale),
                  "eps_scale: expected a finite value >= 0, got ", eps_scale);
  }
  COMPASS_CHECK(dual_clip == 0.0 || (dual_clip > 1.0 && std::isfinite(dual_clip)),
                "dual_clip: expected 0 (off) or a finite value > 1, got ", dual_clip);
  COMPASS_CHECK(log_lo <= log_hi && !std::isnan(log_lo) && !std::isnan(log_hi),
                "log_lo, log_hi: expected log_lo <= log_hi, got ", log_lo, " and ", log_hi);
  COMPASS_CHECK(inv_num_seqs > 0.0 && std::isfinite(inv_num_seqs),
                "inv_num_seqs: expected a finite value > 0, got ", inv_num_seqs);
}

void check_backward_args(COMPASS_ESPO_BACKWARD_ARGS) {
  grad_coef.expect_vector();
  dispatch(grad_coef, Real{}, [](auto) {});
  grad_loss.expect_same_device(grad_coef).expect_dtype(grad_coef.dtype);
  COMPASS_CHECK(grad_loss.numel() == 1, "grad_loss: expected one element, got ",
                grad_loss.describe());
  out.expect_vector().expect_same_device(grad_coef).expect_dtype(grad_coef.dtype);
  out.expect_size(0, grad_coef.numel(), "one per token = len(grad_coef)");
}

void check_host_data(const TensorView& cu_seqlens, int64_t total) {
  const int64_t n = cu_seqlens.numel() - 1;
  const int64_t* cu = cu_seqlens.ptr<int64_t>();
  COMPASS_CHECK(cu[0] == 0, "cu_seqlens: expected cu_seqlens[0] == 0, got ", cu[0]);
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(cu[i] <= cu[i + 1], "cu_seqlens: expected non-decreasing values, cu_seqlens[",
                  i, "] = ", cu[i], " > cu_seqlens[", i + 1, "] = ", cu[i + 1]);
  }
  COMPASS_CHECK(cu[n] <= total, "cu_seqlens: expected cu_seqlens[-1] <= ", total,
                " (tokens), got ", cu[n]);
}

namespace {

template <typename R>
void sums_impl(const R* e, const R* l, const R* lo, const int64_t* cu, const bool* mask,
               const double* thr, int K, int64_t flags, int64_t n, int64_t total, double* sums) {
  const int q = K - 1;
  const bool per_seq = flags & kPerSeqThresholds;
#pragma omp parallel for schedule(dynamic, 4) if (total >= kParallelMinTokens)
  for (int64_t i = 0; i < n; ++i) {
    double acc[kMaxGroups * 3] = {};
    const double* row = per_seq ? thr + i * q : thr;
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
      if (!token_valid(mask, t)) continue;
      const double et = static_cast<double>(e[t]);
      const int b = bucket(et, row, q);
      acc[3 * b] += 1.0;
      acc[3 * b + 1] += static_cast<double>(l[t]) - static_cast<double>(lo[t]);
      acc[3 * b + 2] += et;
    }
    std::copy(acc, acc + 3 * K, sums + i * K * 3);
  }
}

struct ForwardArgs {
  int K;
  int64_t flags;
  double eps_low, eps_high, eps_scale, dual_clip, log_lo, log_hi, inv_g;
};

template <typename R>
void forward_impl(const R* l, const R* lo, const R* e, const R* adv, const int64_t* cu,
                  const bool* mask, const double* thr, const double* sums, const ForwardArgs& a,
                  int64_t n, int64_t total, R* grad, double* seq_stats, double* stats) {
  const int K = a.K, q = K - 1;
  const StatCols cols{K};
  const int64_t flags = a.flags;
  const bool per_seq = flags & kPerSeqThresholds, token_groups = flags & kTokenGroups;
  const bool drop_low = flags & kDropLow, adv_per_token = flags & kAdvPerToken;
#pragma omp parallel for schedule(dynamic, 4) if (total >= kParallelMinTokens)
  for (int64_t i = 0; i < n; ++i) {
    double row[3 * kMaxGroups + 7] = {};
    row[cols.min_ratio()] = std::numeric_limits<double>::infinity();
    row[cols.max_ratio()] = -std::numeric_limits<double>::infinity();
    const double* s = sums + i * K * 3;
    const double* trow = per_seq ? thr + i * q : thr;
    const double groups = groups_in_loss(s, K, flags);
    // The group constants once per sequence (divisions and exp out of the token loop).
    GroupTerms gt[kMaxGroups];
    for (int k = 0; k < K; ++k) {
      gt[k] = group_terms(s + 3 * k, groups, flags, a.eps_low, a.eps_high, a.eps_scale, a.inv_g);
    }
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
      if (!token_valid(mask, t)) {
        if (grad) grad[t] = R(0);
        continue;
      }
      const double d = static_cast<double>(l[t]) - static_cast<double>(lo[t]);
      const double r = exp(d);
      row[cols.sum_k3()] += k3(d, r);
      row[cols.big_log_ratio()] += big_log_ratio(d) ? 1.0 : 0.0;
      const int b = token_groups ? 0 : bucket(static_cast<double>(e[t]), trow, q);
      if (drop_low && b == 0) {
        if (grad) grad[t] = R(0);
        continue;
      }
      const GroupTerms& g = gt[b];
      bool clamped;
      const double ratio = token_ratio(d, r, g.m, g.s_g, flags, a.log_lo, a.log_hi, &clamped);
      const double at = static_cast<double>(adv_per_token ? adv[t] : adv[i]);
      const TokenTerms tt = token_terms(ratio, clamped, at, g.eps_low, g.eps_high, a.dual_clip);
      row[cols.loss()] -= g.weight * tt.objective;
      row[cols.loss_tokens()] += 1.0;
      row[cols.sum_ratio()] += tt.ratio;
      row[cols.min_ratio()] = std::min(row[cols.min_ratio()], tt.ratio);
      row[cols.max_ratio()] = std::max(row[cols.max_ratio()], tt.ratio);
      row[cols.clip_low(b)] += tt.clip_low ? 1.0 : 0.0;
      row[cols.clip_high(b)] += tt.clip_high ? 1.0 : 0.0;
      row[cols.dual(b)] += tt.dual ? 1.0 : 0.0;
      if (grad) grad[t] = static_cast<R>(-g.weight * tt.grad);
    }
    std::copy(row, row + cols.count(), seq_stats + i * cols.count());
  }
  if (grad) std::fill(grad + cu[n], grad + total, R(0));  // padding after the last sequence
  // Fixed order over sequences: deterministic whatever the thread count.
  for (int c = 0; c < cols.count(); ++c) stats[c] = 0.0;
  stats[cols.min_ratio()] = std::numeric_limits<double>::infinity();
  stats[cols.max_ratio()] = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const double* row = seq_stats + i * cols.count();
    for (int c = 0; c < cols.min_ratio(); ++c) stats[c] += row[c];
    stats[cols.min_ratio()] = std::min(stats[cols.min_ratio()], row[cols.min_ratio()]);
    stats[cols.max_ratio()] = std::max(stats[cols.max_ratio()], row[cols.max_ratio()]);
  }
}

}  // namespace

namespace {
// torch.quantile's linear interpolation: rank q * (n - 1) of the sorted
// values, then torch.lerp's formula (the two branches keep it exact at w = 0
// and 1). Selection, not a sort: nth_element puts the floor-rank value in
// place with everything after it >= it, so the ceil-rank value is the minimum
// of the rest: O(n) per level (a sort of 64k doubles cost ~4 ms here).
void quantiles(std::vector<double>& v, const double* levels, int64_t q, double* out) {
  const int64_t nv = static_cast<int64_t>(v.size());
  if (nv == 0) {
    std::fill(out, out + q, std::numeric_limits<double>::quiet_NaN());
    return;
  }
  for (int64_t k = 0; k < q; ++k) {
    const double pos = levels[k] * static_cast<double>(nv - 1);
    const double lo = std::floor(pos), w = pos - lo;
    const int64_t i = static_cast<int64_t>(lo), j = static_cast<int64_t>(std::ceil(pos));
    std::nth_element(v.begin(), v.begin() + i, v.end());
    const double a = v[i];
    const double b = j == i ? a : *std::min_element(v.begin() + i + 1, v.end());
    out[k] = w < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w);
  }
}
}  // namespace

void espo_thresholds_cpu(COMPASS_ESPO_THRESHOLDS_ARGS) {
  COMPASS_NAME_ARGS(entropy, cu_seqlens, mask, levels, out);
  entropy.expect_vector().expect_device(DeviceType::kCPU);
  dispatch(entropy, Real{}, [](auto) {});
  const int64_t total = entropy.numel();
  cu_seqlens.expect_vector().expect_same_device(entropy).expect_dtype(DType::kInt64);
  COMPASS_CHECK(cu_seqlens.numel() >= 1, "cu_seqlens: expected at least one element (n+1)");
  if (mask) {
    mask->expect_vector().expect_same_device(entropy).expect_dtype(DType::kBool);
    mask->expect_size(0, total, "one per token");
  }
  levels.expect_vector().expect_same_device(entropy).expect_dtype(DType::kFloat64);
  const int64_t n = cu_seqlens.numel() - 1, q = levels.numel();
  const double* lv = levels.ptr<double>();
  for (int64_t k = 0; k < q; ++k) {
    COMPASS_CHECK(lv[k] >= 0.0 && lv[k] <= 1.0, "levels: expected values in [0, 1], got ", lv[k],
                  " at index ", k);
  }
  out.expect_vector().expect_same_device(entropy).expect_dtype(DType::kFloat64);
  out.expect_size(0, per_sequence ? n * q : q, per_sequence ? "sequences x levels" : "levels");
  check_host_data(cu_seqlens, total);
  const int64_t* cu = cu_seqlens.ptr<int64_t>();
  const bool* m = mask ? mask->ptr<bool>() : nullptr;
  double* o = out.ptr<double>();
  dispatch(entropy, Real{}, [&](auto tag) {
    using R = decltype(tag);
    const R* e = entropy.ptr<R>();
    expect_finite(e, cu[n], "old_entropy");
    auto collect = [&](int64_t begin, int64_t end, std::vector<double>& v) {
      v.clear();
      for (int64_t t = begin; t < end; ++t) {
        if (token_valid(m, t)) v.push_back(static_cast<double>(e[t]));
      }
    };
    if (!per_sequence) {
      std::vector<double> v;
      v.reserve(cu[n]);
      collect(0, cu[n], v);
      quantiles(v, lv, q, o);
      return;
    }
#pragma omp parallel if (total >= kParallelMinTokens)
    {
      std::vector<double> v;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < n; ++i) {
        collect(cu[i], cu[i + 1], v);
        quantiles(v, lv, q, o + i * q);
      }
    }
  });
}

void espo_group_sums_cpu(COMPASS_ESPO_SUMS_ARGS) {
  COMPASS_NAME_ARGS(entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, sums);
  check_sums_args(entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, num_groups,
                  flags, sums);
  entropy.expect_device(DeviceType::kCPU);
  const int64_t total = entropy.numel(), n = cu_seqlens.numel() - 1;
  check_host_data(cu_seqlens, total);
  const int64_t end = cu_seqlens.ptr<int64_t>()[n];
  dispatch(entropy, Real{}, [&](auto tag) {
    using R = decltype(tag);
    // Padding tokens (past cu_seqlens[-1]) are never read, so not checked.
    expect_finite(entropy.ptr<R>(), end, "old_entropy");
    expect_finite(logprobs.ptr<R>(), end, "logprobs");
    expect_finite(old_logprobs.ptr<R>(), end, "old_logprobs");
    sums_impl<R>(entropy.ptr<R>(), logprobs.ptr<R>(), old_logprobs.ptr<R>(),
                 cu_seqlens.ptr<int64_t>(), mask ? mask->ptr<bool>() : nullptr,
                 thresholds.ptr<double>(), static_cast<int>(num_groups), flags, n, total,
                 sums.ptr<double>());
  });
}

void espo_loss_forward_cpu(COMPASS_ESPO_FORWARD_ARGS) {
  COMPASS_NAME_ARGS(logprobs, old_logprobs, entropy, advantages, cu_seqlens, mask, thresholds,
                    sums, loss, grad, seq_stats, stats);
  check_forward_args(logprobs, old_logprobs, entropy, advantages, cu_seqlens, mask, thresholds,
                     sums, num_groups, flags, eps_low, eps_high, eps_scale, dual_clip, log_lo,
                     log_hi, inv_num_seqs, need_grad, loss, grad, seq_stats, stats);
  logprobs.expect_device(DeviceType::kCPU);
  const int64_t total = logprobs.numel(), n = cu_seqlens.numel() - 1;
  check_host_data(cu_seqlens, total);
  const ForwardArgs a{static_cast<int>(num_groups), flags, eps_low, eps_high, eps_scale,
                      dual_clip, log_lo, log_hi, inv_num_seqs};
  dispatch(logprobs, Real{}, [&](auto tag) {
    using R = decltype(tag);
    const int64_t end = cu_seqlens.ptr<int64_t>()[n];
    expect_finite(advantages.ptr<R>(), (flags & kAdvPerToken) ? end : n, "advantages");
    forward_impl<R>(logprobs.ptr<R>(), old_logprobs.ptr<R>(), entropy.ptr<R>(),
                    advantages.ptr<R>(), cu_seqlens.ptr<int64_t>(),
                    mask ? mask->ptr<bool>() : nullptr, thresholds.ptr<double>(),
                    sums.ptr<double>(), a, n, total, need_grad ? grad.ptr<R>() : nullptr,
                    seq_stats.ptr<double>(), stats.ptr<double>());
    loss.ptr<R>()[0] = static_cast<R>(stats.ptr<double>()[StatCols{a.K}.loss()]);
  });
}

void espo_loss_backward_cpu(COMPASS_ESPO_BACKWARD_ARGS) {
  COMPASS_NAME_ARGS(grad_loss, grad_coef, out);
  check_backward_args(grad_loss, grad_coef, out);
  grad_coef.expect_device(DeviceType::kCPU);
  dispatch(grad_coef, Real{}, [&](auto tag) {
    using R = decltype(tag);
    const R g = grad_loss.ptr<R>()[0];
    const R* c = grad_coef.ptr<R>();
    R* o = out.ptr<R>();
    const int64_t total = grad_coef.numel();
#pragma omp parallel for simd if (total >= 16 * kParallelMinTokens)
    for (int64_t t = 0; t < total; ++t) o[t] = g * c[t];
  });
}

}  // namespace espo
}  // namespace compass
