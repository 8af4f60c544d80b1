// Token log-probs and entropy on CUDA: one block per token row, each thread an
// online (m, s, a) state over a strided slice of the vocabulary, merged across
// the block (max, rescale, sums: compass/logprobs.h). Generic code (no
// Hopper-only instructions); built for COMPASS_CUDA_ARCHS, and for the CPU by
// the emulator (docs/emulation.md), which runs it in the tests.
#include <cuda_runtime.h>

#include <cfloat>

#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"
#include "compass/logprobs.h"
#include "logprobs/logprobs_api.h"

namespace compass {
namespace logprobs {

namespace {

// 256 threads per row: V = 32k..152k gives each thread 128..600 logits, enough
// to hide latency; the grid is the token count on axis x (up to 2^31 - 1).
constexpr int kThreads = 256;

__device__ __forceinline__ float widen_d(float v) { return v; }
__device__ __forceinline__ float widen_d(bf16 v) {
  return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
}
__device__ __forceinline__ void narrow_d(float* p, float v) { *p = v; }
__device__ __forceinline__ void narrow_d(bf16* p, float v) {  // round to nearest even
  const uint32_t b = __float_as_uint(v);
  const uint32_t r = (v != v) ? (b | 0x00400000u) : b + 0x7FFFu + ((b >> 16) & 1u);
  p->bits = static_cast<uint16_t>(r >> 16);
}

// Sum over the block; every thread gets it. Fixed tree: deterministic.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  v = lane < kThreads / 32 ? partial[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();  // partial[] is reused by the next call
  return v;
}

// This thread's slice of the row into st, then the block's merged state.
template <typename In, bool kEnt>
__device__ __forceinline__ RowState block_row_stats(const In* x, int64_t n, float inv_t,
                                                   RowState st) {
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const float z = widen_d(x[j]);
    if (z > st.m) rescale(st, z, inv_t);
    const float d = fmaxf((z - st.m) * inv_t, kMinExponent);
    const float e = __expf(d);
    st.s += e;
    if (kEnt) st.a += e * d;
  }
  // -FLT_MAX pads block_max; a row of only -inf keeps m = -inf below.
  const float m = block_max<kThreads>(st.m == -INFINITY ? -FLT_MAX : st.m);
  if (m > -FLT_MAX) rescale(st, m, inv_t);
  RowState out;
  out.m = m > -FLT_MAX ? m : -INFINITY;
  out.s = block_sum(st.s);
  out.a = kEnt ? block_sum(st.a) : 0.0f;
  return out;
}

template <typename In, bool kEnt>
__global__ void fwd_kernel(const In* __restrict__ logits, int64_t stride, int64_t vocab,
                           const int64_t* __restrict__ targets, float inv_t,
                           float* __restrict__ logp, float* __restrict__ entropy,
                           float* __restrict__ row_max, float* __restrict__ log_norm) {
  const int64_t row = blockIdx.x;
  const In* x = logits + row * stride;
  const RowState st = block_row_stats<In, kEnt>(x, vocab, inv_t, RowState{});
  if (threadIdx.x == 0) {
    row_max[row] = st.m;
    log_norm[row] = logf(st.s);
    const int64_t y = targets[row];
    logp[row] = (y >= 0 && y < vocab) ? logprob_of(widen_d(x[y]), st, inv_t)
                                      : (y == kIgnoreIndex ? 0.0f : NAN);
    entropy[row] = kEnt ? entropy_of(st) : NAN;
  }
}

template <typename In, bool kEnt>
__global__ void tile_kernel(const In* __restrict__ logits, int64_t stride, int64_t rows,
                            int64_t vocab, int64_t vocab_start,
                            const int64_t* __restrict__ targets, float inv_t,
                            const float* state_in, float* state_out) {
  const int64_t row = blockIdx.x;
  const In* x = logits + row * stride;
  RowState mine;  // thread 0 carries the incoming state, the others start empty
  if (threadIdx.x == 0) mine = RowState{state_in[row], state_in[rows + row], state_in[2 * rows + row]};
  const float zt_in = state_in[3 * rows + row];
  const RowState st = block_row_stats<In, kEnt>(x, vocab, inv_t, mine);
  if (threadIdx.x == 0) {
    const int64_t y = targets[row] - vocab_start;
    state_out[row] = st.m;
    state_out[rows + row] = st.s;
    state_out[2 * rows + row] = st.a;
    state_out[3 * rows + row] = (y >= 0 && y < vocab) ? widen_d(x[y]) : zt_in;
  }
}

template <typename In, bool kGl, bool kGh>
__global__ void bwd_kernel(const In* logits, In* grad, int64_t stride, int64_t grad_stride,
                           int64_t vocab, int64_t vocab_start,
                           const int64_t* __restrict__ targets,
                           const float* __restrict__ row_max, const float* __restrict__ log_norm,
                           const float* __restrict__ entropy, const float* __restrict__ gls,
                           const float* __restrict__ ghs, float inv_t) {
  const int64_t row = blockIdx.x;
  const In* x = logits + row * stride;
  In* out = grad + row * grad_stride;
  const float m = row_max[row], log_s = log_norm[row];
  const float gl = (kGl && targets[row] != kIgnoreIndex) ? gls[row] : 0.0f;
  const float gh = kGh ? ghs[row] : 0.0f;
  const float h = kGh ? entropy[row] : 0.0f;
  const int64_t y = targets[row] - vocab_start;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float d = log_softmax_of(widen_d(x[j]), m, log_s, inv_t);
    const float p = __expf(d);
    // float32 until the store; the target's 1 - p_y as -expm1(log p_y).
    const float g = j == y ? -gl * expm1f(d) - gh * p * (d + h) : grad_nontarget(d, p, gl, gh, h);
    narrow_d(out + j, g * inv_t);
  }
}

using Logits = Types<float, bf16>;

}  // namespace

void token_logprobs_entropy_cuda(COMPASS_LOGPROBS_FWD_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(logits, targets, logp, entropy, row_max, log_norm);
  check_fwd_args(logits, targets, temperature, with_entropy, logp, entropy, row_max, log_norm);
  logits.expect_device(DeviceType::kCUDA);
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  DeviceGuard guard(logits.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float inv_t = static_cast<float>(1.0 / temperature);
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    auto go = [&](auto ent) {
      compass::launch<fwd_kernel<In, decltype(ent)::value>>(
          static_cast<unsigned>(rows), kThreads, 0, stream, logits.ptr<In>(), logits.strides[0],
          logits.size(1), targets.ptr<int64_t>(), inv_t, logp.ptr<float>(), entropy.ptr<float>(),
          row_max.ptr<float>(), log_norm.ptr<float>());
    };
    with_entropy ? go(std::true_type{}) : go(std::false_type{});
  });
  check_launch("logprobs.fwd_kernel");
}

void logprobs_tile_stats_cuda(COMPASS_LOGPROBS_TILE_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(logits, targets, state_in, state_out);
  check_tile_args(logits, targets, vocab_start, temperature, with_entropy, state_in, state_out);
  logits.expect_device(DeviceType::kCUDA);
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  DeviceGuard guard(logits.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float inv_t = static_cast<float>(1.0 / temperature);
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    auto go = [&](auto ent) {
      compass::launch<tile_kernel<In, decltype(ent)::value>>(
          static_cast<unsigned>(rows), kThreads, 0, stream, logits.ptr<In>(), logits.strides[0],
          rows, logits.size(1), vocab_start, targets.ptr<int64_t>(), inv_t,
          state_in.ptr<float>(), state_out.ptr<float>());
    };
    with_entropy ? go(std::true_type{}) : go(std::false_type{});
  });
  check_launch("logprobs.tile_kernel");
}

void token_logprobs_entropy_bwd_cuda(COMPASS_LOGPROBS_BWD_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(logits, targets, row_max, log_norm, entropy, grad_logprob, grad_entropy,
                    grad_logits);
  check_bwd_args(logits, targets, row_max, log_norm, entropy, grad_logprob, grad_entropy,
                 temperature, vocab_start, grad_logits);
  logits.expect_device(DeviceType::kCUDA);
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  DeviceGuard guard(logits.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* gl = grad_logprob ? grad_logprob->ptr<float>() : nullptr;
  const float* gh = grad_entropy ? grad_entropy->ptr<float>() : nullptr;
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    auto go = [&](auto kgl, auto kgh) {
      compass::launch<bwd_kernel<In, decltype(kgl)::value, decltype(kgh)::value>>(
          static_cast<unsigned>(rows), kThreads, 0, stream, logits.ptr<In>(),
          grad_logits.ptr<In>(), logits.strides[0], grad_logits.strides[0], logits.size(1),
          vocab_start, targets.ptr<int64_t>(), row_max.ptr<float>(), log_norm.ptr<float>(),
          entropy.ptr<float>(), gl, gh, inv_t);
    };
    if (gl && gh) go(std::true_type{}, std::true_type{});
    else if (gl) go(std::true_type{}, std::false_type{});
    else if (gh) go(std::false_type{}, std::true_type{});
    else go(std::false_type{}, std::false_type{});
  });
  check_launch("logprobs.bwd_kernel");
}

}  // namespace logprobs
}  // namespace compass
