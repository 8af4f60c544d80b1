// Group advantages and RL-ZVP on the CPU (OpenMP over groups / sequences).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "advantages/advantages_api.h"
#include "compass/advantages.h"

namespace compass {
namespace advantages {

namespace {
// Below this many elements the kernels run on the calling thread.
constexpr int64_t kParallelMinElements = int64_t{1} << 15;

void expect_real(const TensorView& t) {
  COMPASS_CHECK(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat64, t.name,
                ": expected dtype float32 or float64, got ", t.describe());
}
void expect_vec(const TensorView& t) { t.expect_ndim(1).expect_contiguous(); }
}  // namespace

void check_group_args(const GroupArgs& a) {
  for (const TensorView* t : {&a.rewards, &a.order, &a.offsets, &a.adv, &a.zero_var,
                              &a.group_mean, &a.group_std}) {
    expect_vec(*t);
    t->expect_same_device(a.rewards);
  }
  expect_real(a.rewards);
  const int64_t n = a.rewards.numel();
  a.order.expect_dtype(DType::kInt64).expect_size(0, n, "one index per reward");
  a.offsets.expect_dtype(DType::kInt64);
  COMPASS_CHECK(a.offsets.numel() >= 1, "offsets: expected at least one element (G+1)");
  const int64_t g = a.offsets.numel() - 1;
  a.adv.expect_dtype(a.rewards.dtype).expect_size(0, n, "rewards");
  a.zero_var.expect_dtype(DType::kBool).expect_size(0, n, "rewards");
  a.group_mean.expect_dtype(DType::kFloat64).expect_size(0, g, "groups");
  a.group_std.expect_dtype(DType::kFloat64).expect_size(0, g, "groups");
  COMPASS_CHECK(a.mode == kGRPO || a.mode == kDrGRPO || a.mode == kRLOO,
                "mode: expected 0 (grpo), 1 (dr_grpo) or 2 (rloo), got ", a.mode);
  COMPASS_CHECK(a.eps >= 0 && a.zero_var_tol >= 0, "eps and zero_var_tol must be >= 0, got ",
                a.eps, " and ", a.zero_var_tol);
}

void check_zvp_args(const ZvpArgs& a) {
  for (const TensorView* t : {&a.entropy, &a.cu_seqlens, &a.rewards, &a.zero_var, &a.out}) {
    expect_vec(*t);
    t->expect_same_device(a.entropy);
  }
  a.entropy.expect_dtype(DType::kFloat32);
  a.cu_seqlens.expect_dtype(DType::kInt64);
  COMPASS_CHECK(a.cu_seqlens.numel() >= 1, "cu_seqlens: expected at least one element (n+1)");
  const int64_t n = a.cu_seqlens.numel() - 1;
  expect_real(a.rewards);
  a.rewards.expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  a.zero_var.expect_dtype(DType::kBool).expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  if (a.advantages.data != nullptr) {
    expect_vec(a.advantages);
    a.advantages.expect_same_device(a.entropy);
    expect_real(a.advantages);
    a.advantages.expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  }
  a.out.expect_dtype(DType::kFloat32).expect_size(0, a.entropy.numel(), "entropy");
}

namespace {

template <typename R>
void group_impl(const GroupArgs& a) {
  const R* r = a.rewards.ptr<R>();
  const int64_t* order = a.order.ptr<int64_t>();
  const int64_t* off = a.offsets.ptr<int64_t>();
  R* adv = a.adv.ptr<R>();
  bool* zv = a.zero_var.ptr<bool>();
  double* gmean = a.group_mean.ptr<double>();
  double* gstd = a.group_std.ptr<double>();
  const int64_t groups = a.offsets.numel() - 1;
  // Groups are small (G ~ 4..64 samples) and many: one group per iteration,
  // two-pass float64 (deterministic, no catastrophic cancellation). Threads
  // only pay off past ~32k samples: below that, waking the OpenMP team costs
  // more than the work (measured: 32x8 went from 0.13 ms to 6-8 ms on a loaded
  // 2-core host), so small batches stay on the calling thread.
  const bool parallel = a.rewards.numel() >= kParallelMinElements;
#pragma omp parallel for schedule(dynamic, 64) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = off[g], end = off[g + 1], count = end - begin;
    double sum = 0.0;
    for (int64_t j = begin; j < end; ++j) sum += static_cast<double>(r[order[j]]);
    const double mean = count > 0 ? sum / static_cast<double>(count) : 0.0;
    double m2 = 0.0;
    for (int64_t j = begin; j < end; ++j) {
      const double d = static_cast<double>(r[order[j]]) - mean;
      m2 += d * d;
    }
    const double std = group_std(m2, count);
    const bool zero = is_zero_variance(std, count, a.zero_var_tol);
    gmean[g] = mean;
    gstd[g] = std;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t i = order[j];
      zv[i] = zero;
      adv[i] = static_cast<R>(
          advantage(static_cast<double>(r[i]), mean, std, count, a.mode, a.eps, zero));
    }
  }
}

template <typename R, typename A>
void zvp_impl(const ZvpArgs& a) {
  const float* h = a.entropy.ptr<float>();
  const int64_t* cu = a.cu_seqlens.ptr<int64_t>();
  const R* rew = a.rewards.ptr<R>();
  const bool* zv = a.zero_var.ptr<bool>();
  const A* adv = a.advantages.data ? a.advantages.ptr<A>() : nullptr;
  float* out = a.out.ptr<float>();
  const int64_t n = a.cu_seqlens.numel() - 1;
  const int64_t total = a.entropy.numel();
  const bool parallel = total >= kParallelMinElements;
#pragma omp parallel for schedule(dynamic, 16) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = cu[i], end = cu[i + 1];
    if (zv[i]) {
      float hmax = -INFINITY;
      for (int64_t t = begin; t < end; ++t) hmax = std::max(hmax, h[t]);
      const bool positive = static_cast<double>(rew[i]) > 0.0;
      for (int64_t t = begin; t < end; ++t) out[t] = zvp_token(h[t], hmax, positive, a.alpha);
    } else {
      const float v = adv ? static_cast<float>(adv[i]) : 0.0f;
      for (int64_t t = begin; t < end; ++t) out[t] = v;
    }
  }
  std::fill(out + cu[n], out + total, 0.0f);  // padding after the last sequence
}

template <typename R>
void zvp_dispatch_adv(const ZvpArgs& a) {
  if (a.advantages.data && a.advantages.dtype == DType::kFloat64) {
    zvp_impl<R, double>(a);
  } else {
    zvp_impl<R, float>(a);
  }
}

}  // namespace

void group_advantages_cpu(const GroupArgs& a) {
  check_group_args(a);
  COMPASS_CHECK(a.rewards.device == DeviceType::kCPU, "rewards: expected a CPU tensor, got ",
                a.rewards.describe());
  // Index data is host-readable here, so a malformed plan is caught before it
  // can send a read out of bounds (the CUDA path validates on device in Python).
  const int64_t n = a.rewards.numel(), groups = a.offsets.numel() - 1;
  const int64_t* off = a.offsets.ptr<int64_t>();
  COMPASS_CHECK(off[0] == 0 && off[groups] == n, "offsets: expected offsets[0] == 0 and ",
                "offsets[-1] == len(rewards) == ", n, ", got ", off[0], " and ", off[groups]);
  for (int64_t g = 0; g < groups; ++g) {
    COMPASS_CHECK(off[g] <= off[g + 1], "offsets: expected non-decreasing values, offsets[", g,
                  "] = ", off[g], " > offsets[", g + 1, "] = ", off[g + 1]);
  }
  const int64_t* order = a.order.ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    COMPASS_CHECK(order[j] >= 0 && order[j] < n, "order: expected indices in [0, ", n,
                  "), got order[", j, "] = ", order[j]);
  }
  if (a.rewards.dtype == DType::kFloat64) {
    group_impl<double>(a);
  } else {
    group_impl<float>(a);
  }
}

void rl_zvp_cpu(const ZvpArgs& a) {
  check_zvp_args(a);
  COMPASS_CHECK(a.entropy.device == DeviceType::kCPU, "entropy: expected a CPU tensor, got ",
                a.entropy.describe());
  const int64_t n = a.cu_seqlens.numel() - 1, total = a.entropy.numel();
  const int64_t* cu = a.cu_seqlens.ptr<int64_t>();
  COMPASS_CHECK(cu[0] == 0, "cu_seqlens: expected cu_seqlens[0] == 0, got ", cu[0]);
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(cu[i] <= cu[i + 1], "cu_seqlens: expected non-decreasing values, cu_seqlens[",
                  i, "] = ", cu[i], " > cu_seqlens[", i + 1, "] = ", cu[i + 1]);
  }
  COMPASS_CHECK(cu[n] <= total, "cu_seqlens: last value ", cu[n],
                " exceeds the number of tokens in entropy (", total, ")");
  if (a.rewards.dtype == DType::kFloat64) {
    zvp_dispatch_adv<double>(a);
  } else {
    zvp_dispatch_adv<float>(a);
  }
}

}  // namespace advantages
}  // namespace compass
