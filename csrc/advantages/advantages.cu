// Group advantages and RL-ZVP on CUDA. Generic code (no Hopper-only
// instructions); built for COMPASS_CUDA_ARCHS, and for the CPU by the
// emulator (docs/emulation.md), which runs it in the tests.
#include <cuda_runtime.h>

#include <cfloat>

#include "advantages/advantages_api.h"
#include "compass/advantages.h"
#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"

namespace compass {
namespace advantages {

namespace {

constexpr int kWarpsPerBlock = 4;

// One warp per group: RL groups are 4..64 samples, so a block per group would
// idle most threads; a warp loops over larger groups. Two passes in float64
// with a fixed reduction tree: deterministic, no atomics.
template <typename R>
__global__ void group_kernel(const R* __restrict__ r, const int64_t* __restrict__ order,
                             const int64_t* __restrict__ off, int64_t groups, int32_t mode,
                             double eps, double tol, R* __restrict__ adv, bool* __restrict__ zv,
                             double* __restrict__ gmean, double* __restrict__ gstd) {
  const int lane = threadIdx.x % 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (g >= groups) return;
  const int64_t begin = off[g], end = off[g + 1], count = end - begin;
  double sum = 0.0;
  for (int64_t j = begin + lane; j < end; j += 32) sum += static_cast<double>(r[order[j]]);
  sum = warp_sum(sum);
  const double mean = count > 0 ? sum / static_cast<double>(count) : 0.0;
  double m2 = 0.0;
  for (int64_t j = begin + lane; j < end; j += 32) {
    const double d = static_cast<double>(r[order[j]]) - mean;
    m2 += d * d;
  }
  m2 = warp_sum(m2);
  const double sd = group_std(m2, count);
  const bool zero = is_zero_variance(sd, count, tol);
  if (lane == 0) {
    gmean[g] = mean;
    gstd[g] = sd;
  }
  for (int64_t j = begin + lane; j < end; j += 32) {
    const int64_t i = order[j];
    zv[i] = zero;
    adv[i] = static_cast<R>(advantage(static_cast<double>(r[i]), mean, sd, count, mode, eps, zero));
  }
}

constexpr int kZvpThreads = 256;

// One block per sequence (sequences run to 64k tokens); block n clears the
// padding tail after the last sequence.
template <typename R, typename A>
__global__ void zvp_kernel(const float* __restrict__ h, const int64_t* __restrict__ cu,
                           const R* __restrict__ rew, const bool* __restrict__ zv,
                           const A* __restrict__ adv, int64_t n, int64_t total, float alpha,
                           float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  if (i == n) {
    for (int64_t t = cu[n] + threadIdx.x; t < total; t += blockDim.x) out[t] = 0.0f;
    return;
  }
  const int64_t begin = cu[i], end = cu[i + 1];
  if (!zv[i]) {
    const float v = adv ? static_cast<float>(adv[i]) : 0.0f;
    for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) out[t] = v;
    return;
  }
  float hmax = -FLT_MAX;
  for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) hmax = fmaxf(hmax, h[t]);
  hmax = block_max<kZvpThreads>(hmax);
  const bool positive = static_cast<double>(rew[i]) > 0.0;
  for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) {
    out[t] = zvp_token(h[t], hmax, positive, alpha);
  }
}

}  // namespace

void group_advantages_cuda(COMPASS_GROUP_ADVANTAGES_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(rewards, order, offsets, adv, zero_var, group_mean, group_std);
  check_group_args(rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, group_mean,
                   group_std);
  rewards.expect_device(DeviceType::kCUDA);
  const int64_t groups = offsets.numel() - 1;
  if (groups == 0) return;
  DeviceGuard guard(rewards.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const unsigned blocks = static_cast<unsigned>((groups + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch(rewards, Types<float, double>{}, [&](auto tag) {
    using R = decltype(tag);
    compass::launch<group_kernel<R>>(blocks, 32 * kWarpsPerBlock, 0, stream,
        rewards.ptr<R>(), order.ptr<int64_t>(), offsets.ptr<int64_t>(), groups,
        static_cast<int32_t>(mode), eps, zero_var_tol, adv.ptr<R>(), zero_var.ptr<bool>(),
        group_mean.ptr<double>(), group_std.ptr<double>());
  });
  check_launch("advantages.group_kernel");
}

void rl_zvp_cuda(COMPASS_RL_ZVP_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(entropy, cu_seqlens, rewards, zero_var, advantages, out);
  check_rl_zvp_args(entropy, cu_seqlens, rewards, zero_var, advantages, alpha, out);
  entropy.expect_device(DeviceType::kCUDA);
  DeviceGuard guard(entropy.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t n = cu_seqlens.numel() - 1;
  dispatch(rewards, Types<float, double>{}, [&](auto rtag) {
    using R = decltype(rtag);
    auto launch = [&](auto atag, const void* adv) {
      using A = decltype(atag);
      compass::launch<zvp_kernel<R, A>>(static_cast<unsigned>(n + 1), kZvpThreads, 0, stream,
          entropy.ptr<float>(), cu_seqlens.ptr<int64_t>(), rewards.ptr<R>(),
          zero_var.ptr<bool>(), static_cast<const A*>(adv), n, entropy.numel(),
          static_cast<float>(alpha), out.ptr<float>());
    };
    if (!advantages) return launch(float{}, nullptr);
    dispatch(*advantages, Types<float, double>{},
             [&](auto atag) { launch(atag, advantages->data); });
  });
  check_launch("advantages.zvp_kernel");
}

}  // namespace advantages
}  // namespace compass
