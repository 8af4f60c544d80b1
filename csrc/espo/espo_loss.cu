// ESPO segmented loss on CUDA. Generic code (no Hopper-only instructions);
// built for COMPASS_CUDA_ARCHS, and for the CPU by the emulator
// (docs/emulation.md), which runs it in the tests.
//
// One block per sequence for both phases (sequences are 100s to 64k tokens;
// a block loops over its sequence with int64 indices, so no grid or int32
// limit applies), per-thread accumulators for up to KMax groups in registers
// (KMax a template argument: the unrolled bucket select keeps them out of
// local memory), fixed reduction trees: deterministic, no float atomics. A
// last single-block kernel reduces the per-sequence rows in a fixed order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "compass/cuda_utils.cuh"
#include "compass/espo_loss.h"
#include "compass/launch.cuh"
#include "espo/espo_api.h"

namespace compass {
namespace espo {

using namespace compass::espo_loss;

namespace {

constexpr int kThreads = 256;

struct SumOp {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct MinOp {
  __device__ double operator()(double a, double b) const { return fmin(a, b); }
};
struct MaxOp {
  __device__ double operator()(double a, double b) const { return fmax(a, b); }
};

// Reduction over the block (kThreads threads); the result is valid in thread 0.
template <typename Op>
__device__ __forceinline__ double block_reduce(double v, double identity, Op op) {
  __shared__ double partial[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  double r = identity;
  if (warp == 0) {
    r = lane < kThreads / 32 ? partial[lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) r = op(r, __shfl_xor_sync(0xffffffffu, r, o));
  }
  __syncthreads();  // partial[] is reused by the next call
  return r;
}

__device__ __forceinline__ bool valid_token(const bool* mask, int64_t t) {
  return mask == nullptr || mask[t];
}

template <typename R, int KMax>
__global__ void sums_kernel(const R* __restrict__ e, const R* __restrict__ l,
                            const R* __restrict__ lo, const int64_t* __restrict__ cu,
                            const bool* __restrict__ mask, const double* __restrict__ thr, int K,
                            int64_t flags, double* __restrict__ sums) {
  const int64_t i = blockIdx.x;
  const int q = K - 1;
  const double* row = (flags & kPerSeqThresholds) ? thr + i * q : thr;
  double cnt[KMax], sd[KMax], se[KMax];
#pragma unroll
  for (int k = 0; k < KMax; ++k) cnt[k] = sd[k] = se[k] = 0.0;
  const int64_t end = cu[i + 1];
  for (int64_t t = cu[i] + threadIdx.x; t < end; t += kThreads) {
    if (!valid_token(mask, t)) continue;
    const double et = static_cast<double>(e[t]);
    const double d = static_cast<double>(l[t]) - static_cast<double>(lo[t]);
    const int b = bucket(et, row, q);
#pragma unroll
    for (int k = 0; k < KMax; ++k) {
      const bool hit = k == b;
      cnt[k] += hit ? 1.0 : 0.0;
      sd[k] += hit ? d : 0.0;
      se[k] += hit ? et : 0.0;
    }
  }
  double* out = sums + i * K * 3;
#pragma unroll
  for (int k = 0; k < KMax; ++k) {
    if (k >= K) break;  // uniform across the block
    const double c = block_reduce(cnt[k], 0.0, SumOp{});
    const double a = block_reduce(sd[k], 0.0, SumOp{});
    const double b = block_reduce(se[k], 0.0, SumOp{});
    if (threadIdx.x == 0) {
      out[3 * k] = c;
      out[3 * k + 1] = a;
      out[3 * k + 2] = b;
    }
  }
}

struct ForwardParams {
  int K;
  int64_t flags;
  double eps_low, eps_high, eps_scale, dual_clip, log_lo, log_hi, inv_g;
};

template <typename R, int KMax>
__global__ void forward_kernel(const R* __restrict__ l, const R* __restrict__ lo,
                               const R* __restrict__ e, const R* __restrict__ adv,
                               const int64_t* __restrict__ cu, const bool* __restrict__ mask,
                               const double* __restrict__ thr, const double* __restrict__ sums,
                               ForwardParams p, R* __restrict__ grad,
                               double* __restrict__ seq_stats) {
  const int64_t i = blockIdx.x;
  const int K = p.K, q = K - 1;
  const StatCols cols{K};
  const int64_t flags = p.flags;
  const bool token_groups = flags & kTokenGroups, drop_low = flags & kDropLow;
  const double* s = sums + i * K * 3;
  const double* trow = (flags & kPerSeqThresholds) ? thr + i * q : thr;
  const double groups = groups_in_loss(s, K, flags);
  const double a_seq = (flags & kAdvPerToken) ? 0.0 : static_cast<double>(adv[i]);
  double clip_low[KMax], clip_high[KMax], dual[KMax];
#pragma unroll
  for (int k = 0; k < KMax; ++k) clip_low[k] = clip_high[k] = dual[k] = 0.0;
  double loss = 0.0, tokens = 0.0, sum_ratio = 0.0, sum_k3 = 0.0, big = 0.0;
  double rmin = DBL_MAX, rmax = -DBL_MAX;
  const int64_t end = cu[i + 1];
  for (int64_t t = cu[i] + threadIdx.x; t < end; t += kThreads) {
    if (!valid_token(mask, t)) {
      if (grad) grad[t] = R(0);
      continue;
    }
    const double d = static_cast<double>(l[t]) - static_cast<double>(lo[t]);
    const double r = exp(d);
    sum_k3 += k3(d, r);
    big += big_log_ratio(d) ? 1.0 : 0.0;
    const int b = token_groups ? 0 : bucket(static_cast<double>(e[t]), trow, q);
    if (drop_low && b == 0) {
      if (grad) grad[t] = R(0);
      continue;
    }
    // The group's constants per token: a few flops against 13+ bytes read.
    const GroupTerms g =
        group_terms(s + 3 * b, groups, flags, p.eps_low, p.eps_high, p.eps_scale, p.inv_g);
    bool clamped;
    const double ratio = token_ratio(d, r, g.m, g.s_g, flags, p.log_lo, p.log_hi, &clamped);
    const double at = (flags & kAdvPerToken) ? static_cast<double>(adv[t]) : a_seq;
    const TokenTerms tt = token_terms(ratio, clamped, at, g.eps_low, g.eps_high, p.dual_clip);
    const double w = g.weight;
    loss -= w * tt.objective;
    tokens += 1.0;
    sum_ratio += tt.ratio;
    rmin = fmin(rmin, tt.ratio);
    rmax = fmax(rmax, tt.ratio);
#pragma unroll
    for (int k = 0; k < KMax; ++k) {
      const bool hit = k == b;
      clip_low[k] += hit && tt.clip_low ? 1.0 : 0.0;
      clip_high[k] += hit && tt.clip_high ? 1.0 : 0.0;
      dual[k] += hit && tt.dual ? 1.0 : 0.0;
    }
    if (grad) grad[t] = static_cast<R>(-w * tt.grad);
  }
  double* row = seq_stats + i * cols.count();
#pragma unroll
  for (int k = 0; k < KMax; ++k) {
    if (k >= K) break;  // uniform across the block
    const double cl = block_reduce(clip_low[k], 0.0, SumOp{});
    const double ch = block_reduce(clip_high[k], 0.0, SumOp{});
    const double du = block_reduce(dual[k], 0.0, SumOp{});
    if (threadIdx.x == 0) {
      row[cols.clip_low(k)] = cl;
      row[cols.clip_high(k)] = ch;
      row[cols.dual(k)] = du;
    }
  }
  loss = block_reduce(loss, 0.0, SumOp{});
  tokens = block_reduce(tokens, 0.0, SumOp{});
  sum_ratio = block_reduce(sum_ratio, 0.0, SumOp{});
  sum_k3 = block_reduce(sum_k3, 0.0, SumOp{});
  big = block_reduce(big, 0.0, SumOp{});
  rmin = block_reduce(rmin, DBL_MAX, MinOp{});
  rmax = block_reduce(rmax, -DBL_MAX, MaxOp{});
  if (threadIdx.x == 0) {
    row[cols.loss()] = loss;
    row[cols.loss_tokens()] = tokens;
    row[cols.sum_ratio()] = sum_ratio;
    row[cols.sum_k3()] = sum_k3;
    row[cols.big_log_ratio()] = big;
    // no token in the loss: +-inf, as the CPU kernel (DBL_MAX is the tree's identity)
    row[cols.min_ratio()] = tokens > 0.0 ? rmin : HUGE_VAL;
    row[cols.max_ratio()] = tokens > 0.0 ? rmax : -HUGE_VAL;
  }
}

// One block: the batch statistics from the per-sequence rows (a fixed tree per
// column), the loss, and zero gradients for the padding after cu[n].
template <typename R>
__global__ void reduce_kernel(const double* __restrict__ seq_stats, const int64_t* __restrict__ cu,
                              int64_t n, int K, int64_t total, double* __restrict__ stats,
                              R* __restrict__ loss, R* __restrict__ grad) {
  const StatCols cols{K};
  const int width = cols.count();
  for (int c = 0; c < width; ++c) {
    const bool is_min = c == cols.min_ratio(), is_max = c == cols.max_ratio();
    const double id = is_min ? HUGE_VAL : is_max ? -HUGE_VAL : 0.0;
    double v = id;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const double x = seq_stats[i * width + c];
      v = is_min ? fmin(v, x) : is_max ? fmax(v, x) : v + x;
    }
    v = is_min ? block_reduce(v, id, MinOp{})
               : is_max ? block_reduce(v, id, MaxOp{}) : block_reduce(v, id, SumOp{});
    if (threadIdx.x == 0) {
      stats[c] = v;
      if (c == cols.loss()) loss[0] = static_cast<R>(v);
    }
  }
  if (grad) {
    for (int64_t t = cu[n] + threadIdx.x; t < total; t += kThreads) grad[t] = R(0);
  }
}

template <typename R>
__global__ void backward_kernel(const R* __restrict__ g, const R* __restrict__ coef, int64_t total,
                                R* __restrict__ out) {
  const R scale = g[0];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += stride) {
    out[t] = scale * coef[t];
  }
}

template <typename F>
void with_kmax(int K, F&& f) {
  if (K == 1) return f(std::integral_constant<int, 1>{});
  if (K == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, kMaxGroups>{});
}

}  // namespace

void espo_group_sums_cuda(COMPASS_ESPO_SUMS_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, sums);
  check_sums_args(entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, num_groups,
                  flags, sums);
  entropy.expect_device(DeviceType::kCUDA);
  const int64_t n = cu_seqlens.numel() - 1;
  if (n == 0) return;
  DeviceGuard guard(entropy.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int K = static_cast<int>(num_groups);
  dispatch(entropy, Types<float, double>{}, [&](auto tag) {
    using R = decltype(tag);
    with_kmax(K, [&](auto kmax) {
      compass::launch<sums_kernel<R, decltype(kmax)::value>>(
          static_cast<unsigned>(n), kThreads, 0, stream, entropy.ptr<R>(), logprobs.ptr<R>(),
          old_logprobs.ptr<R>(), cu_seqlens.ptr<int64_t>(),
          mask ? mask->ptr<bool>() : static_cast<bool*>(nullptr), thresholds.ptr<double>(), K,
          flags, sums.ptr<double>());
    });
  });
  check_launch("espo.sums_kernel");
}

void espo_loss_forward_cuda(COMPASS_ESPO_FORWARD_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(logprobs, old_logprobs, entropy, advantages, cu_seqlens, mask, thresholds,
                    sums, loss, grad, seq_stats, stats);
  check_forward_args(logprobs, old_logprobs, entropy, advantages, cu_seqlens, mask, thresholds,
                     sums, num_groups, flags, eps_low, eps_high, eps_scale, dual_clip, log_lo,
                     log_hi, inv_num_seqs, need_grad, loss, grad, seq_stats, stats);
  logprobs.expect_device(DeviceType::kCUDA);
  const int64_t n = cu_seqlens.numel() - 1, total = logprobs.numel();
  DeviceGuard guard(logprobs.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int K = static_cast<int>(num_groups);
  const ForwardParams p{K, flags, eps_low, eps_high, eps_scale, dual_clip, log_lo, log_hi,
                        inv_num_seqs};
  dispatch(logprobs, Types<float, double>{}, [&](auto tag) {
    using R = decltype(tag);
    R* g = need_grad ? grad.ptr<R>() : nullptr;
    if (n > 0) {
      with_kmax(K, [&](auto kmax) {
        compass::launch<forward_kernel<R, decltype(kmax)::value>>(
            static_cast<unsigned>(n), kThreads, 0, stream, logprobs.ptr<R>(),
            old_logprobs.ptr<R>(), entropy.ptr<R>(), advantages.ptr<R>(),
            cu_seqlens.ptr<int64_t>(), mask ? mask->ptr<bool>() : static_cast<bool*>(nullptr),
            thresholds.ptr<double>(), sums.ptr<double>(), p, g, seq_stats.ptr<double>());
      });
      check_launch("espo.forward_kernel");
    }
    compass::launch<reduce_kernel<R>>(1, kThreads, 0, stream, seq_stats.ptr<double>(),
                                      cu_seqlens.ptr<int64_t>(), n, K, total, stats.ptr<double>(),
                                      loss.ptr<R>(), g);
  });
  check_launch("espo.reduce_kernel");
}

void espo_loss_backward_cuda(COMPASS_ESPO_BACKWARD_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(grad_loss, grad_coef, out);
  check_backward_args(grad_loss, grad_coef, out);
  grad_coef.expect_device(DeviceType::kCUDA);
  const int64_t total = grad_coef.numel();
  if (total == 0) return;
  DeviceGuard guard(grad_coef.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  // Grid-stride: at most 2^16 blocks whatever T is (no grid-size limit).
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 16);
  dispatch(grad_coef, Types<float, double>{}, [&](auto tag) {
    using R = decltype(tag);
    compass::launch<backward_kernel<R>>(static_cast<unsigned>(blocks), kThreads, 0, stream,
                                        grad_loss.ptr<R>(), grad_coef.ptr<R>(), total,
                                        out.ptr<R>());
  });
  check_launch("espo.backward_kernel");
}

}  // namespace espo
}  // namespace compass
