// Group advantages and RL-ZVP on the CPU (OpenMP over groups / sequences).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "advantages/advantages_api.h"
#include "advantages/group_cpu.h"
#include "compass/advantages.h"

namespace compass {
namespace advantages {

namespace {
// Below this many elements the kernels run on the calling thread: waking the
// OpenMP team costs more than the work (measured: 32x8 went from 0.13 ms to
// 6-8 ms on a loaded 2-core host).
constexpr int64_t kParallelMinElements = int64_t{1} << 15;
// Group advantages run at ~2 ns per sample on one thread (8192 x 16 in
// ~0.25 ms), so a team pays off only on larger batches; on a loaded host a
// team that waits for a descheduled thread costs milliseconds (measured:
// 1024 x 32 went from 0.1 ms to 8 ms on a shared 2-core host).
constexpr int64_t kGroupParallelMinElements = int64_t{1} << 18;
using Real = Types<float, double>;

}  // namespace

// The views arrive named: each entry point runs COMPASS_NAME_ARGS first.
void check_group_args(COMPASS_GROUP_ADVANTAGES_ARGS) {
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

// Groups [g0, g1). Contiguous: group g is r[off[g]:off[g+1]] (order is the
// identity, e.g. the group_size layout or ids already grouped), else
// r[order[off[g]:off[g+1]]].
//
// Per group, one pass for the statistics in float64: deviations from the
// group's first reward k (a shifted one-pass variance), m2 = S2 - S1^2 / c
// with S1 = sum(x - k), S2 = sum((x - k)^2). Since k is a member,
// S1^2 / c <= (c - 1) * m2, so the cancellation costs at most a factor c in
// relative error (~1e-14 at c = 64; the GPU's two-pass formula agrees to
// that), and a group of equal rewards has S1 = S2 = 0 exactly: zero variance
// stays exact. The sums are SIMD reductions (a fixed order per build:
// deterministic). Then one pass writes A = (r - mean) * scale + 0.0, with
// scale = 0 for a zero-variance group (+ 0.0 turns -0 into +0), 1 / (std +
// eps) in GRPO (within 1 ulp of float64 of the division), 1 in Dr.GRPO and
// c / (c - 1) in RLOO: advantages.h's formulas.
//
// Groups go in blocks: the statistics of a block first (independent
// per-group sqrt/divide chains the CPU overlaps, no data-dependent branch),
// then its outputs. The mode is a template argument: no branch per sample.
template <typename R, int32_t kMode, bool kContiguous>
void group_range(const GroupPtrs& a, int64_t g0, int64_t g1) {
  // Gathered rewards (order path) must still be in L1 when the block is written.
  constexpr int64_t kBlock = kContiguous ? 128 : 4;
  const R* r = static_cast<const R*>(a.rewards);
  const int64_t* order = a.order;
  const int64_t* off = a.offsets;
  R* __restrict__ adv = static_cast<R*>(a.adv);
  bool* __restrict__ zv = a.zero_var;
  double* gmean = a.group_mean;
  double* gstd = a.group_std;
  const double eps = a.eps, tol = a.tol;
  double bmean[kBlock], bscale[kBlock];
  bool bzero[kBlock];
  auto load = [r, order](int64_t j) {
    return static_cast<double>(kContiguous ? r[j] : r[order[j]]);
  };
  for (int64_t gb = g0; gb < g1; gb += kBlock) {
    const int64_t ge = std::min(gb + kBlock, g1);
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t begin = off[g], end = off[g + 1], count = end - begin;
      const double k = count > 0 ? load(begin) : 0.0;
      double s1 = 0.0, s2 = 0.0;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t j = begin; j < end; ++j) {
        const double d = load(j) - k;
        s1 += d;
        s2 += d * d;
      }
      const GroupAffine f = shifted_group_affine<kMode>(k, s1, s2, count, eps, tol);
      gmean[g] = f.mean;
      gstd[g] = f.std;
      bmean[g - gb] = f.mean;
      bscale[g - gb] = f.scale;
      bzero[g - gb] = f.zero;
    }
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t begin = off[g], end = off[g + 1];
      const double mean = bmean[g - gb], scale = bscale[g - gb];
      const bool zero = bzero[g - gb];
      if (kContiguous) {
#pragma omp simd
        for (int64_t j = begin; j < end; ++j) {
          adv[j] = static_cast<R>((static_cast<double>(r[j]) - mean) * scale + 0.0);
          zv[j] = zero;
        }
      } else {
        for (int64_t j = begin; j < end; ++j) {
          const int64_t i = order[j];
          adv[i] = static_cast<R>((static_cast<double>(r[i]) - mean) * scale + 0.0);
          zv[i] = zero;
        }
      }
    }
  }
}

template <typename R, int32_t kMode>
void group_impl_mode(const GroupPtrs& a, bool contiguous) {
  const int64_t groups = a.groups;
  // Threads only pay off on large batches: below the threshold, waking the
  // OpenMP team costs more than the work (measured: 32x8 went from 0.13 ms to
  // 6-8 ms on a loaded 2-core host), so small batches stay on the calling
  // thread. Static chunks of whole groups: every group costs about the same.
  if (a.n < kGroupParallelMinElements || omp_get_max_threads() == 1) {
    contiguous ? group_range<R, kMode, true>(a, 0, groups)
               : group_range<R, kMode, false>(a, 0, groups);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    contiguous ? group_range<R, kMode, true>(a, g0, g1)
               : group_range<R, kMode, false>(a, g0, g1);
  }
}

}  // namespace

template <typename R>
void group_impl(const GroupPtrs& a, bool contiguous) {
  switch (a.mode) {
    case kGRPO: group_impl_mode<R, kGRPO>(a, contiguous); break;
    case kDrGRPO: group_impl_mode<R, kDrGRPO>(a, contiguous); break;
    default: group_impl_mode<R, kRLOO>(a, contiguous); break;
  }
}

template void group_impl<float>(const GroupPtrs&, bool);
template void group_impl<double>(const GroupPtrs&, bool);

namespace {

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
  // One branch-free pass over order: bounds, and whether it is the identity
  // (then groups are contiguous runs and the kernel never reads order).
  const int64_t* ord = order.ptr<int64_t>();
  int64_t moved = 0;
  for (int64_t j = 0; j < n; ++j) moved |= ord[j] ^ j;  // vectorizes
  if (moved) {  // the kernel will index with order: bounds-check it
    uint64_t out_of_range = 0;
    for (int64_t j = 0; j < n; ++j) out_of_range |= static_cast<uint64_t>(ord[j]) >= uint64_t(n);
    for (int64_t j = 0; out_of_range && j < n; ++j) {
      COMPASS_CHECK(ord[j] >= 0 && ord[j] < n, "order: expected indices in [0, ", n,
                    "), got order[", j, "] = ", ord[j]);
    }
  }
  dispatch(rewards, Real{}, [&](auto tag) {
    using R = decltype(tag);
    expect_finite(rewards.ptr<R>(), n, "rewards");
    const GroupPtrs p{rewards.data, ord, off, adv.data, zero_var.ptr<bool>(),
                      group_mean.ptr<double>(), group_std.ptr<double>(), n, groups,
                      static_cast<int32_t>(mode), eps, zero_var_tol};
    group_impl<R>(p, moved == 0);
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
  // Padding tokens past cu_seqlens[-1] are never read, so not checked.
  expect_finite(entropy.ptr<float>(), cu[n], "entropy");
  dispatch(rewards, Real{}, [&](auto rtag) {
    using R = decltype(rtag);
    expect_finite(rewards.ptr<R>(), n, "rewards");
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
