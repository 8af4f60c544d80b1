// Group advantages and RL-ZVP on the CPU (OpenMP over groups / sequences).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "advantages/advantages_api.h"
#include "compass/advantages.h"

namespace compass {
namespace advantages {

namespace {
// Below this many elements the kernels run on the calling thread: waking the
// OpenMP team costs more than the work (measured: 32x8 went from 0.13 ms to
// 6-8 ms on a loaded 2-core host).
constexpr int64_t kParallelMinElements = int64_t{1} << 15;
using Real = Types<float, double>;
}  // namespace

void check_group_args(COMPASS_GROUP_ADVANTAGES_ARGS) {
  COMPASS_NAME_ARGS(rewards, order, offsets, adv, zero_var, group_mean, group_std);
  for (const TensorView* t : {&rewards, &order, &offsets, &adv, &zero_var, &group_mean,
                              &group_std}) {
    t->expect_vector().expect_same_device(rewards);
  }
  dispatch(rewards, Real{}, [](auto) {});
  const int64_t n = rewards.numel();
  order.expect_dtype(DType::kInt64).expect_size(0, n, "one index per reward");
  offsets.expect_dtype(DType::kInt64);
  COMPASS_CHECK(offsets.numel() >= 1, "offsets: expected at least one element (G+1)");
  const int64_t g = offsets.numel() - 1;
  adv.expect_dtype(rewards.dtype).expect_size(0, n, "rewards");
  zero_var.expect_dtype(DType::kBool).expect_size(0, n, "rewards");
  group_mean.expect_dtype(DType::kFloat64).expect_size(0, g, "groups");
  group_std.expect_dtype(DType::kFloat64).expect_size(0, g, "groups");
  COMPASS_CHECK(mode == kGRPO || mode == kDrGRPO || mode == kRLOO,
                "mode: expected 0 (grpo), 1 (dr_grpo) or 2 (rloo), got ", mode);
  COMPASS_CHECK(eps >= 0 && zero_var_tol >= 0, "eps and zero_var_tol: expected >= 0, got ", eps,
                " and ", zero_var_tol);
}

void check_rl_zvp_args(COMPASS_RL_ZVP_ARGS) {
  COMPASS_NAME_ARGS(entropy, cu_seqlens, rewards, zero_var, advantages, out);
  for (const TensorView* t : {&entropy, &cu_seqlens, &rewards, &zero_var, &out}) {
    t->expect_vector().expect_same_device(entropy);
  }
  entropy.expect_dtype(DType::kFloat32);
  cu_seqlens.expect_dtype(DType::kInt64);
  COMPASS_CHECK(cu_seqlens.numel() >= 1, "cu_seqlens: expected at least one element (n+1)");
  const int64_t n = cu_seqlens.numel() - 1;
  dispatch(rewards, Real{}, [](auto) {});
  rewards.expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  zero_var.expect_dtype(DType::kBool).expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  if (advantages) {
    advantages->expect_vector().expect_same_device(entropy);
    dispatch(*advantages, Real{}, [](auto) {});
    advantages->expect_size(0, n, "sequences = len(cu_seqlens) - 1");
  }
  out.expect_dtype(DType::kFloat32).expect_size(0, entropy.numel(), "entropy");
  COMPASS_CHECK(alpha >= 0, "alpha: expected >= 0, got ", alpha);
}

namespace {

template <typename R>
void group_impl(const TensorView& rewards, const TensorView& order, const TensorView& offsets,
                int32_t mode, double eps, double tol, const TensorView& adv_v,
                const TensorView& zv_v, const TensorView& mean_v, const TensorView& std_v) {
  const R* r = rewards.ptr<R>();
  const int64_t* ord = order.ptr<int64_t>();
  const int64_t* off = offsets.ptr<int64_t>();
  R* adv = adv_v.ptr<R>();
  bool* zv = zv_v.ptr<bool>();
  double* gmean = mean_v.ptr<double>();
  double* gstd = std_v.ptr<double>();
  const int64_t groups = offsets.numel() - 1;
  // Groups are small (4..64 samples) and many: one group per iteration,
  // two-pass float64 (deterministic, no catastrophic cancellation).
  const bool parallel = rewards.numel() >= kParallelMinElements;
#pragma omp parallel for schedule(dynamic, 64) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = off[g], end = off[g + 1], count = end - begin;
    double sum = 0.0;
    for (int64_t j = begin; j < end; ++j) sum += static_cast<double>(r[ord[j]]);
    const double mean = count > 0 ? sum / static_cast<double>(count) : 0.0;
    double m2 = 0.0;
    for (int64_t j = begin; j < end; ++j) {
      const double d = static_cast<double>(r[ord[j]]) - mean;
      m2 += d * d;
    }
    const double sd = group_std(m2, count);
    const bool zero = is_zero_variance(sd, count, tol);
    gmean[g] = mean;
    gstd[g] = sd;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t i = ord[j];
      zv[i] = zero;
      adv[i] = static_cast<R>(advantage(static_cast<double>(r[i]), mean, sd, count, mode, eps,
                                        zero));
    }
  }
}

template <typename R, typename A>
void zvp_impl(const TensorView& entropy, const TensorView& cu_seqlens, const TensorView& rewards,
              const TensorView& zero_var, const A* adv, float alpha, const TensorView& out_v) {
  const float* h = entropy.ptr<float>();
  const int64_t* cu = cu_seqlens.ptr<int64_t>();
  const R* rew = rewards.ptr<R>();
  const bool* zv = zero_var.ptr<bool>();
  float* out = out_v.ptr<float>();
  const int64_t n = cu_seqlens.numel() - 1;
  const int64_t total = entropy.numel();
  const bool parallel = total >= kParallelMinElements;
#pragma omp parallel for schedule(dynamic, 16) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = cu[i], end = cu[i + 1];
    if (zv[i]) {
      float hmax = -INFINITY;
      for (int64_t t = begin; t < end; ++t) hmax = std::max(hmax, h[t]);
      const bool positive = static_cast<double>(rew[i]) > 0.0;
      for (int64_t t = begin; t < end; ++t) out[t] = zvp_token(h[t], hmax, positive, alpha);
    } else {
      const float v = adv ? static_cast<float>(adv[i]) : 0.0f;
      for (int64_t t = begin; t < end; ++t) out[t] = v;
    }
  }
  std::fill(out + cu[n], out + total, 0.0f);  // padding after the last sequence
}

}  // namespace

void group_advantages_cpu(COMPASS_GROUP_ADVANTAGES_ARGS) {
  COMPASS_NAME_ARGS(rewards, order, offsets, adv, zero_var, group_mean, group_std);
  check_group_args(rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, group_mean,
                   group_std);
  rewards.expect_device(DeviceType::kCPU);
  // Index data is host-readable here, so a malformed plan is caught before it
  // can send a read out of bounds (the CUDA path validates on device in Python).
  const int64_t n = rewards.numel(), groups = offsets.numel() - 1;
  const int64_t* off = offsets.ptr<int64_t>();
  COMPASS_CHECK(off[0] == 0 && off[groups] == n, "offsets: expected offsets[0] == 0 and ",
                "offsets[-1] == len(rewards) == ", n, ", got ", off[0], " and ", off[groups]);
  for (int64_t g = 0; g < groups; ++g) {
    COMPASS_CHECK(off[g] <= off[g + 1], "offsets: expected non-decreasing values, offsets[", g,
                  "] = ", off[g], " > offsets[", g + 1, "] = ", off[g + 1]);
  }
  const int64_t* ord = order.ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    COMPASS_CHECK(ord[j] >= 0 && ord[j] < n, "order: expected indices in [0, ", n,
                  "), got order[", j, "] = ", ord[j]);
  }
  dispatch(rewards, Real{}, [&](auto tag) {
    using R = decltype(tag);
    const R* r = rewards.ptr<R>();
    for (int64_t i = 0; i < n; ++i) {  // one cheap pass; the kernel reads them anyway
      COMPASS_CHECK(std::isfinite(r[i]), "rewards: expected finite values, got ", r[i],
                    " at index ", i);
    }
    group_impl<R>(rewards, order, offsets, static_cast<int32_t>(mode), eps,
                              zero_var_tol, adv, zero_var, group_mean, group_std);
  });
}

void rl_zvp_cpu(COMPASS_RL_ZVP_ARGS) {
  COMPASS_NAME_ARGS(entropy, cu_seqlens, rewards, zero_var, advantages, out);
  check_rl_zvp_args(entropy, cu_seqlens, rewards, zero_var, advantages, alpha, out);
  entropy.expect_device(DeviceType::kCPU);
  const int64_t n = cu_seqlens.numel() - 1, total = entropy.numel();
  const int64_t* cu = cu_seqlens.ptr<int64_t>();
  COMPASS_CHECK(cu[0] == 0, "cu_seqlens: expected cu_seqlens[0] == 0, got ", cu[0]);
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(cu[i] <= cu[i + 1], "cu_seqlens: expected non-decreasing values, cu_seqlens[",
                  i, "] = ", cu[i], " > cu_seqlens[", i + 1, "] = ", cu[i + 1]);
  }
  COMPASS_CHECK(cu[n] <= total, "cu_seqlens: expected cu_seqlens[-1] <= ", total,
                " (tokens in entropy), got ", cu[n]);
  dispatch(rewards, Real{}, [&](auto rtag) {
    using R = decltype(rtag);
    if (!advantages) {
      zvp_impl<R, float>(entropy, cu_seqlens, rewards, zero_var, nullptr,
                         static_cast<float>(alpha), out);
      return;
    }
    dispatch(*advantages, Real{}, [&](auto atag) {
      using A = decltype(atag);
      zvp_impl<R, A>(entropy, cu_seqlens, rewards, zero_var, advantages->ptr<A>(),
                     static_cast<float>(alpha), out);
    });
  });
}

}  // namespace advantages
}  // namespace compass
