// Router replay on CUDA. Generic code (no Hopper-only instructions); built for
// COMPASS_CUDA_ARCHS, and for the CPU by the emulator (docs/emulation.md),
// which runs it in the tests.
//
// One warp per row (a token's router logits, E <= 1024 experts): lane l holds
// experts l, l + 32, ... in registers, so the row is read once; the native
// top-k is K warp argmax rounds (ties to the lower index); lane k < K holds the
// k-th replayed and native ids. Per block: a shared-memory histogram of the
// used experts and per-warp counters, flushed with integer atomics (exact, so
// deterministic). No host sync.
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <type_traits>

#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"
#include "compass/routing.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxExperts = 1024;  // 32 per lane
constexpr int kMaxTopKCuda = 32;   // one lane per slot
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned kMaxBlocks = 2048;

template <typename A>
__device__ __forceinline__ A warp_max_t(A v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = rmax(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <typename A>
__device__ __forceinline__ A warp_min_t(A v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = rmin(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -static_cast<A>(INFINITY);
}

// The trace's ids in their stored width (uint8 / int16 / int32 / int64): one
// warp-uniform branch per load instead of a kernel instantiation per dtype.
__device__ __forceinline__ int64_t load_id(const void* ids, int32_t width, int64_t i) {
  switch (width) {
    case 1: return static_cast<const uint8_t*>(ids)[i];
    case 2: return static_cast<const int16_t*>(ids)[i];
    case 4: return static_cast<const int32_t*>(ids)[i];
    default: return static_cast<const int64_t*>(ids)[i];
  }
}

template <typename R, int kPerLane>
__global__ void replay_fwd_kernel(const R* __restrict__ logits, const void* __restrict__ ids,
                                  int32_t id_width,
                                  const R* __restrict__ bias, const bool* __restrict__ valid,
                                  int64_t rows, int32_t e, int32_t k, int32_t sf, bool normalize,
                                  double scaling, double ratio, R* __restrict__ weights,
                                  bool* __restrict__ map, unsigned long long* __restrict__ tpe,
                                  unsigned long long* __restrict__ counts,
                                  int64_t* __restrict__ used) {
  using A = R;
  int* hist = dynamic_smem<int>();
  for (int j = threadIdx.x; j < e; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  unsigned long long my_counts[kNumCounts] = {};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < rows; t += stride) {
    const R* z = logits + t * e;
    A zv[kPerLane];
    A zmax = neg_inf<A>();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int x = lane + 32 * j;
      zv[j] = x < e ? static_cast<A>(z[x]) : neg_inf<A>();
      zmax = rmax(zmax, zv[j]);
    }
    zmax = warp_max_t(zmax);
    A sumexp = 0;
    if (sf == kSoftmax) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (lane + 32 * j < e) sumexp += rexp(zv[j] - zmax);
      }
      sumexp = warp_sum(sumexp);
    }
    const A inv_sum = sf == kSoftmax ? A(1) / sumexp : A(1);
    A sel[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int x = lane + 32 * j;
      sel[j] = x < e ? router_score<A>(zv[j], zmax, inv_sum, sf) + (bias ? bias[x] : A(0))
                     : neg_inf<A>();
    }
    // Native top-k: K rounds of a warp argmax; lane r keeps round r's winner.
    unsigned taken = 0;
    int nat = 0;
    for (int r = 0; r < k; ++r) {
      A bv = neg_inf<A>();
      int bi = e;  // past every expert: loses every tie
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int x = lane + 32 * j;
        if (x < e && !(taken >> j & 1u) && (bi == e || ranks_above<A>(sel[j], x, bv, bi))) {
          bv = sel[j];
          bi = x;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        const A ov = __shfl_xor_sync(kFull, bv, o);
        const int oi = __shfl_xor_sync(kFull, bi, o);
        if (oi != e && (bi == e || ranks_above<A>(ov, oi, bv, bi))) {
          bv = ov;
          bi = oi;
        }
      }
      if (bi % 32 == lane) taken |= 1u << (bi / 32);
      if (lane == r) nat = bi;
    }
    const bool cand = valid == nullptr || valid[t];
    const bool slot = lane < k;
    int rep = 0;
    bool bad_slot = false;
    if (cand && slot) {
      const int64_t v = load_id(ids, id_width, t * k + lane);
      bad_slot = v < 0 || v >= e;
      rep = bad_slot ? 0 : static_cast<int>(v);
    }
    bool in_native = false;
    for (int q = 0; q < k; ++q) {
      const int rq = __shfl_sync(kFull, rep, q);
      const int nq = __shfl_sync(kFull, nat, q);
      if (slot && q < lane && rq == rep) bad_slot = true;  // a duplicate id
      if (slot && nq == rep) in_native = true;
    }
    const bool bad = cand && __any_sync(kFull, bad_slot);
    const bool ok = cand && !bad;  // warp-uniform
    bool use = false;
    if (ok) {
      const A sr = slot ? router_score<A>(static_cast<A>(z[rep]), zmax, inv_sum, sf)
                        : static_cast<A>(INFINITY);
      const A sn = slot ? router_score<A>(static_cast<A>(z[nat]), zmax, inv_sum, sf)
                        : static_cast<A>(INFINITY);
      use = replay_accepted<A>(warp_min_t(sr), warp_min_t(sn), ratio);
      const int overlap = __popc(__ballot_sync(kFull, slot && in_native));
      if (lane == 0) {
        my_counts[kCandidates] += 1;
        my_counts[kOverlap] += overlap;
        my_counts[kExact] += overlap == k;
        my_counts[kRejected] += !use;
      }
    }
    if (lane == 0) {
      my_counts[kRows] += 1;
      my_counts[kBadRows] += bad;
    }
    const int u = use ? rep : nat;
    const A zu = slot ? static_cast<A>(z[u]) : neg_inf<A>();
    A shift = zmax;
    if (sf == kSoftmax && normalize) shift = warp_max_t(zu);
    const A num = slot ? gate_numerator<A>(zu, shift, sf) : A(0);
    const A den = gate_denominator<A>(warp_sum(num), sumexp, sf, normalize, k);
    bool* mrow = map + t * e;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int x = lane + 32 * j;
      if (x < e) mrow[x] = false;
    }
    __syncwarp();  // the zeros land before the selected experts are set
    if (slot) {
      weights[t * k + lane] = static_cast<R>(num / den * static_cast<A>(scaling));
      used[t * k + lane] = u;
      mrow[u] = true;
      atomicAdd(&hist[u], 1);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < e; j += blockDim.x) {
    if (hist[j]) atomicAdd(&tpe[j], static_cast<unsigned long long>(hist[j]));
  }
  if (lane == 0) {
    for (int c = 0; c < kNumCounts; ++c) {
      if (my_counts[c]) atomicAdd(&counts[c], my_counts[c]);
    }
  }
}

template <typename R, int kPerLane>
__global__ void replay_bwd_kernel(const R* __restrict__ grad_w, const R* __restrict__ logits,
                                  const int64_t* __restrict__ used, int64_t rows, int32_t e,
                                  int32_t k, int32_t sf, bool normalize, double scaling,
                                  R* __restrict__ grad) {
  using A = R;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const bool dense = dense_gradient(sf, normalize);
  const A sc = static_cast<A>(scaling);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < rows; t += stride) {
    const R* z = logits + t * e;
    R* out = grad + t * e;
    A zmax = neg_inf<A>(), sumexp = 0;
    if (dense) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int x = lane + 32 * j;
        if (x < e) zmax = rmax(zmax, static_cast<A>(z[x]));
      }
      zmax = warp_max_t(zmax);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int x = lane + 32 * j;
        if (x < e) sumexp += rexp(static_cast<A>(z[x]) - zmax);
      }
      sumexp = warp_sum(sumexp);
    }
    const bool slot = lane < k;
    const int64_t u = slot ? used[t * k + lane] : 0;
    const A zu = slot ? static_cast<A>(z[u]) : neg_inf<A>();
    A shift = zmax;
    if (sf == kSoftmax && normalize) shift = warp_max_t(zu);
    const A num = slot ? gate_numerator<A>(zu, shift, sf) : A(0);
    const A den = gate_denominator<A>(warp_sum(num), sumexp, sf, normalize, k);
    const A g = slot ? static_cast<A>(grad_w[t * k + lane]) : A(0);
    const A dot = warp_sum(g * (num / den));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int x = lane + 32 * j;
      if (x < e) {
        out[x] = dense ? static_cast<R>(-rexp(static_cast<A>(z[x]) - zmax) / sumexp * dot * sc)
                       : R(0);
      }
    }
    __syncwarp();  // the dense part lands before the used experts are overwritten
    if (slot) {
      out[u] = static_cast<R>(grad_used<A>(g, num / den, dot, num, den, sf, normalize, k) * sc);
    }
  }
}

unsigned grid_for(int64_t rows) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Calls f(std::integral_constant<int, kPerLane>) for the smallest per-lane
// register count that holds e experts.
template <typename F>
void with_per_lane(int64_t e, F&& f) {
  if (e <= 32) return f(std::integral_constant<int, 1>{});
  if (e <= 64) return f(std::integral_constant<int, 2>{});
  if (e <= 128) return f(std::integral_constant<int, 4>{});
  if (e <= 256) return f(std::integral_constant<int, 8>{});
  if (e <= 512) return f(std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 32>{});
}

void check_cuda_limits(const TensorView& logits, int64_t k, const char* ids_name) {
  COMPASS_CHECK(logits.size(1) <= kMaxExperts, logits.name, ": the CUDA kernel supports up to ",
                kMaxExperts, " experts, got ", logits.size(1));
  COMPASS_CHECK(k <= kMaxTopKCuda, ids_name, ": the CUDA kernel supports top_k <= ",
                kMaxTopKCuda, ", got ", k);
}

}  // namespace

void replay_topk_cuda(COMPASS_REPLAY_TOPK_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(logits, expert_ids, expert_bias, valid, weights, routing_map,
                    tokens_per_expert, counts, ids_used);
  check_replay_topk_args(logits, expert_ids, expert_bias, valid, score_function, normalize,
                         scaling, min_score_ratio, weights, routing_map, tokens_per_expert,
                         counts, ids_used);
  logits.expect_device(DeviceType::kCUDA);
  const int64_t t = logits.size(0), e = logits.size(1), k = expert_ids.size(1);
  check_cuda_limits(logits, k, expert_ids.name);
  DeviceGuard guard(logits.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  check_cuda(cudaMemsetAsync(tokens_per_expert.data, 0, sizeof(int64_t) * e, stream),
             "routing: clearing tokens_per_expert");
  check_cuda(cudaMemsetAsync(counts.data, 0, sizeof(int64_t) * kNumCounts, stream),
             "routing: clearing counts");
  if (t == 0) return;
  dispatch(logits, Types<float, double>{}, [&](auto rtag) {
    using R = decltype(rtag);
    const int32_t id_width = static_cast<int32_t>(dtype_size(expert_ids.dtype));
    with_per_lane(e, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      compass::launch<replay_fwd_kernel<R, kPerLane>>(
          grid_for(t), kThreads, sizeof(int) * e, stream, logits.ptr<R>(),
          static_cast<const void*>(expert_ids.data), id_width,
          expert_bias ? expert_bias->ptr<R>() : nullptr, valid ? valid->ptr<bool>() : nullptr, t,
          static_cast<int32_t>(e), static_cast<int32_t>(k), static_cast<int32_t>(score_function),
          normalize, scaling, min_score_ratio, weights.ptr<R>(), routing_map.ptr<bool>(),
          tokens_per_expert.ptr<unsigned long long>(), counts.ptr<unsigned long long>(),
          ids_used.ptr<int64_t>());
    });
  });
  check_launch("routing.replay_fwd_kernel");
}

void replay_topk_backward_cuda(COMPASS_REPLAY_TOPK_BACKWARD_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(grad_weights, logits, ids_used, grad_logits);
  check_replay_topk_backward_args(grad_weights, logits, ids_used, score_function, normalize,
                                  scaling, grad_logits);
  logits.expect_device(DeviceType::kCUDA);
  const int64_t t = logits.size(0), e = logits.size(1), k = ids_used.size(1);
  check_cuda_limits(logits, k, ids_used.name);
  if (t == 0) return;
  DeviceGuard guard(logits.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch(logits, Types<float, double>{}, [&](auto rtag) {
    using R = decltype(rtag);
    with_per_lane(e, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      compass::launch<replay_bwd_kernel<R, kPerLane>>(
          grid_for(t), kThreads, 0, stream, grad_weights.ptr<R>(), logits.ptr<R>(),
          ids_used.ptr<int64_t>(), t, static_cast<int32_t>(e), static_cast<int32_t>(k),
          static_cast<int32_t>(score_function), normalize, scaling, grad_logits.ptr<R>());
    });
  });
  check_launch("routing.replay_bwd_kernel");
}

}  // namespace routing
}  // namespace compass
