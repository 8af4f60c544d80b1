// Group advantages and RL-ZVP: the per-element math shared by the C++ (CPU)
// and CUDA kernels, so the CPU tests exercise the lines the GPU runs.
// Spec: compass_kernels/advantages/reference.py.
#pragma once

#include <cmath>
#include <cstdint>

#include "compass/common.h"

namespace compass {
namespace advantages {

enum Mode : int32_t { kGRPO = 0, kDrGRPO = 1, kRLOO = 2 };

// Unbiased (count - 1) standard deviation from the two-pass sum of squared
// deviations. A group of one has no variance information: std 0.
COMPASS_HD double group_std(double m2, int64_t count) {
  return count >= 2 ? sqrt(m2 / static_cast<double>(count - 1)) : 0.0;
}

// Zero-variance: no learning signal in the group (all rewards equal within tol,
// or a single sample). Decided in float64 so that float32 rewards like 0.1
// repeated are detected exactly.
COMPASS_HD bool is_zero_variance(double std, int64_t count, double tol) {
  return count < 2 || std <= tol;
}

COMPASS_HD double advantage(double r, double mean, double std, int64_t count, int32_t mode,
                            double eps, bool zero_var) {
  if (zero_var) return 0.0;
  const double d = r - mean;
  switch (mode) {
    case kGRPO: return d / (std + eps);
    case kDrGRPO: return d;
    default:  // kRLOO: r - mean of the others = d * c / (c - 1)
      return d * static_cast<double>(count) / static_cast<double>(count - 1);
  }
}

// RL-ZVP (arXiv 2509.21880) token advantage for a zero-variance group:
// positive reward -> alpha * H_t; otherwise -alpha * (max_k H_k - H_t).
COMPASS_HD float zvp_token(float h, float hmax, bool positive, float alpha) {
  return positive ? alpha * h : -alpha * (hmax - h);
}

}  // namespace advantages
}  // namespace compass
