// Grouping by arbitrary integer ids on the CPU.
//
// group_plan_cpu: the order that makes each group's members contiguous
// (stable), the group boundaries and the sorted unique ids, for the kernels
// that take a plan (the CUDA, Triton and emulated backends on CPU tensors).
//
// group_advantages_ids_cpu: the cpp backend's whole group_ids path in one call
// (plan and advantages), choosing by the ids' layout:
// - sorted ids (the common layout: prompt index repeated per sample): the
//   groups are the runs; one pass to find them, then the contiguous kernel;
// - unsorted ids in a compact range (up to max(n, 65536) wide: prompt indices
//   shuffled): no order at all. The shifted sums accumulate per id value in
//   sample order (sequential reads, deterministic), a walk over the range
//   numbers the groups in increasing id order, and a last pass writes each
//   sample from its group's affine map (by_value). This avoids the counting
//   sort and the random gathers through `order` that made the planned path 2x
//   slower;
// - wider ranges: a stable comparison sort, O(n log n), then the gather kernel.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "advantages/advantages_api.h"
#include "advantages/group_cpu.h"

namespace compass {
namespace advantages {

namespace {

// Counting arrays are used for id ranges up to this wide (O(n + range)).
int64_t compact_range_limit(int64_t n) { return std::max<int64_t>(4 * n, 65536); }

// One pass over the ids: whether they are sorted, their min and the width of
// their range, hi - lo, as uint64 (no signed overflow for ids spanning the
// whole int64 range).
struct IdScan {
  bool sorted;
  int64_t lo;
  uint64_t span;
};

template <typename I>
IdScan scan_ids(const I* ids, int64_t n) {
  I mn = ids[0], mx = ids[0];
  bool unsorted = false;
  for (int64_t i = 1; i < n; ++i) {
    mn = std::min(mn, ids[i]);
    mx = std::max(mx, ids[i]);
    unsorted |= ids[i] < ids[i - 1];
  }
  const int64_t lo = static_cast<int64_t>(mn);
  const uint64_t span =
      static_cast<uint64_t>(static_cast<int64_t>(mx)) - static_cast<uint64_t>(lo);
  return {!unsorted, lo, span};
}

// Sorted ids: the groups are the runs (order is the identity, not written).
template <typename I>
int64_t runs_plan(const I* ids, int64_t n, int64_t* offsets, int64_t* unique) {
  int64_t groups = 0;
  offsets[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || ids[i] != ids[i - 1]) {
      if (i > 0) offsets[groups] = i;
      unique[groups++] = static_cast<int64_t>(ids[i]);
    }
  }
  offsets[groups] = n;
  return groups;
}

// Counting pass over a compact range: count[v] = members with id lo + v, then
// the group boundaries and unique ids in increasing id order; count[v] becomes
// the start of id lo + v's group. Returns G.
template <typename I>
int64_t count_groups(const I* ids, int64_t n, int64_t lo, std::vector<int64_t>& start,
                     int64_t* offsets, int64_t* unique) {
  const int64_t range = static_cast<int64_t>(start.size()) - 1;
  for (int64_t i = 0; i < n; ++i) ++start[static_cast<int64_t>(ids[i]) - lo + 1];
  int64_t groups = 0;
  offsets[0] = 0;
  for (int64_t k = 0; k < range; ++k) {
    if (start[k + 1] > 0) {
      unique[groups] = lo + k;
      offsets[groups + 1] = offsets[groups] + start[k + 1];
      ++groups;
    }
    start[k + 1] += start[k];
  }
  return groups;
}

template <typename I>
int64_t plan_impl(const I* ids, int64_t n, int64_t* order, int64_t* offsets, int64_t* unique) {
  offsets[0] = 0;
  if (n == 0) return 0;
  const auto [sorted, lo, span] = scan_ids(ids, n);
  if (sorted) {
    std::iota(order, order + n, int64_t{0});
    return runs_plan(ids, n, offsets, unique);
  }
  if (span < static_cast<uint64_t>(compact_range_limit(n))) {
    std::vector<int64_t> start(span + 2, 0);
    const int64_t groups = count_groups(ids, n, lo, start, offsets, unique);
    for (int64_t i = 0; i < n; ++i) order[start[static_cast<int64_t>(ids[i]) - lo]++] = i;
    return groups;
  }
  std::iota(order, order + n, int64_t{0});
  std::stable_sort(order, order + n, [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  int64_t groups = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || ids[order[j]] != ids[order[j - 1]]) {
      if (j > 0) offsets[groups] = j;
      unique[groups++] = static_cast<int64_t>(ids[order[j]]);
    }
  }
  offsets[groups] = n;
  return groups;
}

// Unsorted ids in a compact range (up to max(n, 65536) wide): no order, no
// counting pass. One 32-byte accumulator per id value, filled in sample order
// (deterministic): the shift k is the group's first member in sample order
// (whose index goes to first_by_value). Then a walk over the range in
// increasing id order numbers the groups and writes the per-group outputs,
// turning each accumulator into its group's affine map; a last pass writes the
// samples. Three passes over the samples in all (with the layout scan).
template <typename R, typename I, int32_t kMode>
int64_t by_value(const R* r, const I* ids, int64_t n, int64_t lo, int64_t range, double eps,
                 double tol, R* __restrict__ adv, bool* __restrict__ zv, double* gmean,
                 double* gstd, int64_t* unique, int64_t* offsets, int64_t* first) {
  struct Acc {
    double k, s1, s2;
    int64_t count;
  };
  std::vector<Acc> acc(range, Acc{0.0, 0.0, 0.0, 0});
  std::vector<int64_t> first_by_value(range);
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(ids[i]) - lo;
    const double x = static_cast<double>(r[i]);
    finite &= std::isfinite(x);
    Acc& a = acc[v];
    if (a.count == 0) {
      first_by_value[v] = i;
      a.k = x;
    }
    const double d = x - a.k;
    a.s1 += d;
    a.s2 += d * d;
    ++a.count;
  }
  if (!finite) expect_finite(r, n, "rewards");  // raises, naming the first bad index
  int64_t groups = 0;
  offsets[0] = 0;
  for (int64_t v = 0; v < range; ++v) {
    Acc& a = acc[v];
    if (a.count == 0) continue;
    const GroupAffine f = shifted_group_affine<kMode>(a.k, a.s1, a.s2, a.count, eps, tol);
    gmean[groups] = f.mean;
    gstd[groups] = f.std;
    unique[groups] = lo + v;
    first[groups] = first_by_value[v];
    offsets[groups + 1] = offsets[groups] + a.count;
    ++groups;
    a.k = f.mean;  // the accumulator becomes the affine map (mean, scale, zero)
    a.s1 = f.scale;
    a.s2 = f.zero ? 1.0 : 0.0;
  }
  for (int64_t i = 0; i < n; ++i) {
    const Acc& a = acc[static_cast<int64_t>(ids[i]) - lo];
    adv[i] = static_cast<R>((static_cast<double>(r[i]) - a.k) * a.s1 + 0.0);
    zv[i] = a.s2 != 0.0;
  }
  return groups;
}

template <typename R, typename I>
int64_t ids_impl(const TensorView& rewards, const I* ids, int64_t mode, double eps, double tol,
                 const TensorView& adv, const TensorView& zero_var, double* group_mean,
                 double* group_std, int64_t* unique, int64_t* offsets, int64_t* first) {
  const int64_t n = rewards.numel();
  const R* r = rewards.ptr<R>();
  offsets[0] = 0;
  if (n == 0) return 0;
  GroupPtrs p{r, nullptr, offsets, adv.data, zero_var.ptr<bool>(), group_mean, group_std,
              n, 0, static_cast<int32_t>(mode), eps, tol};
  const IdScan scan = scan_ids(ids, n);
  const int64_t lo = scan.lo;  // a plain variable: the lambda below captures it
  const uint64_t span = scan.span;
  if (scan.sorted) {  // the groups are the runs
    expect_finite(r, n, "rewards");
    p.groups = runs_plan(ids, n, offsets, unique);
    std::copy(offsets, offsets + p.groups, first);
    group_impl<R>(p, /*contiguous=*/true);
    return p.groups;
  }
  if (span < static_cast<uint64_t>(std::max<int64_t>(n, 65536))) {
    const int64_t range = static_cast<int64_t>(span) + 1;
    auto run = [&](auto kmode) {
      return by_value<R, I, decltype(kmode)::value>(
          r, ids, n, lo, range, eps, tol, adv.ptr<R>(), zero_var.ptr<bool>(), group_mean,
          group_std, unique, offsets, first);
    };
    switch (mode) {
      case kGRPO: return run(std::integral_constant<int32_t, kGRPO>{});
      case kDrGRPO: return run(std::integral_constant<int32_t, kDrGRPO>{});
      default: return run(std::integral_constant<int32_t, kRLOO>{});
    }
  }
  expect_finite(r, n, "rewards");
  std::vector<int64_t> order(n);
  p.groups = plan_impl(ids, n, order.data(), offsets, unique);
  p.order = order.data();
  for (int64_t g = 0; g < p.groups; ++g) first[g] = order[offsets[g]];
  group_impl<R>(p, /*contiguous=*/false);
  return p.groups;
}

using Ids = Types<int8_t, uint8_t, int16_t, int32_t, int64_t>;

}  // namespace

int64_t group_plan_cpu(TensorView group_ids, TensorView order, TensorView offsets,
                       TensorView unique) {
  COMPASS_NAME_ARGS(group_ids, order, offsets, unique);
  for (const TensorView* t : {&group_ids, &order, &offsets, &unique}) {
    t->expect_vector().expect_device(DeviceType::kCPU);
  }
  const int64_t n = group_ids.numel();
  order.expect_dtype(DType::kInt64).expect_size(0, n, "one per id");
  offsets.expect_dtype(DType::kInt64).expect_size(0, n + 1, "len(group_ids) + 1");
  unique.expect_dtype(DType::kInt64).expect_size(0, n, "len(group_ids)");
  return dispatch(group_ids, Ids{}, [&](auto tag) {
    using I = decltype(tag);
    return plan_impl<I>(group_ids.ptr<I>(), n, order.ptr<int64_t>(), offsets.ptr<int64_t>(),
                        unique.ptr<int64_t>());
  });
}

int64_t group_advantages_ids_cpu(COMPASS_GROUP_ADVANTAGES_IDS_ARGS) {
  COMPASS_NAME_ARGS(rewards, group_ids, adv, zero_var, stats, index);
  for (const TensorView* t : {&rewards, &group_ids, &adv, &zero_var, &stats, &index}) {
    t->expect_vector().expect_device(DeviceType::kCPU);
  }
  const int64_t n = rewards.numel();
  group_ids.expect_size(0, n, "one id per reward");
  adv.expect_dtype(rewards.dtype).expect_size(0, n, "rewards");
  zero_var.expect_dtype(DType::kBool).expect_size(0, n, "rewards");
  stats.expect_dtype(DType::kFloat64).expect_size(0, 2 * n, "2 * len(rewards)");
  index.expect_dtype(DType::kInt64).expect_size(0, 3 * n + 1, "3 * len(rewards) + 1");
  COMPASS_CHECK(mode == kGRPO || mode == kDrGRPO || mode == kRLOO,
                "mode: expected 0 (grpo), 1 (dr_grpo) or 2 (rloo), got ", mode);
  COMPASS_CHECK(eps >= 0 && zero_var_tol >= 0, "eps and zero_var_tol: expected >= 0, got ", eps,
                " and ", zero_var_tol);
  double* mean = stats.ptr<double>();
  int64_t* ix = index.ptr<int64_t>();
  return dispatch(rewards, Types<float, double>{}, [&](auto rtag) {
    using R = decltype(rtag);
    return dispatch(group_ids, Ids{}, [&](auto itag) {
      using I = decltype(itag);
      return ids_impl<R, I>(rewards, group_ids.ptr<I>(), mode, eps, zero_var_tol, adv, zero_var,
                            mean, mean + n, ix, ix + 2 * n, ix + n);
    });
  });
}

}  // namespace advantages
}  // namespace compass
