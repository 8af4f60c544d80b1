// CPU-only helpers shared by the group-advantages kernels (advantages_cpu.cpp,
// group_ids_cpu.cpp): the per-group statistics from shifted one-pass sums.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "compass/advantages.h"

namespace compass {
namespace advantages {

// A group's statistics and the affine map its samples get: A = (r - mean) *
// scale + 0.0, scale 0 for a zero-variance group.
struct GroupAffine {
  double mean, std, scale;
  bool zero;
};

// From S1 = sum(x - k), S2 = sum((x - k)^2) over the group's `count` members,
// k one of them (a shifted one-pass variance: m2 = S2 - S1^2 / c; since k is a
// member, S1^2 / c <= (c - 1) * m2, so cancellation costs at most a factor c in
// relative error, and a group of equal rewards has S1 = S2 = 0 exactly).
// Scale: 1 / (std + eps) in GRPO, 1 in Dr.GRPO, c / (c - 1) in RLOO
// (advantages.h's formulas).
template <int32_t kMode>
inline GroupAffine shifted_group_affine(double k, double s1, double s2, int64_t count, double eps,
                                        double tol) {
  const double c = static_cast<double>(count);
  const double mean = count > 0 ? k + s1 / c : 0.0;
  const double m2 = count > 0 ? std::max(0.0, s2 - s1 * s1 / c) : 0.0;
  const double std = group_std(m2, count);
  const bool zero = is_zero_variance(std, count, tol);
  double scale = 1.0;  // kDrGRPO
  if (kMode == kGRPO) scale = 1.0 / (std + eps);
  if (kMode == kRLOO) scale = c / (c - 1.0);
  return {mean, std, zero ? 0.0 : scale, zero};
}

// The group kernel's raw arguments (the checked views' pointers).
struct GroupPtrs {
  const void* rewards;
  const int64_t* order;
  const int64_t* offsets;
  void* adv;
  bool* zero_var;
  double* group_mean;
  double* group_std;
  int64_t n, groups;
  int32_t mode;
  double eps, tol;
};

// Group advantages over a plan: contiguous (group g is r[off[g]:off[g+1]])
// or through `order`; OpenMP over groups past a size threshold. Defined (for
// float and double) in advantages_cpu.cpp.
template <typename R>
void group_impl(const GroupPtrs& a, bool contiguous);

// Data checks the CPU entry points make for free (they read the values anyway):
// a non-finite value would make the backends disagree (max drops NaN).
template <typename T>
void expect_finite(const T* v, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(std::isfinite(v[i]), name, ": expected finite values, got ", v[i],
                  " at index ", i);
  }
}

}  // namespace advantages
}  // namespace compass
