// See selftest.h. Compiled only for emulation (it tests the emulator).
#include <cuda_runtime.h>

#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"
#include "selftest.h"

namespace compass {
namespace emu_selftest {

namespace {

__global__ void shared_shift_kernel(const float* __restrict__ x, float* __restrict__ out,
                                    int mode) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 64 + t;
  float v = 0.0f;
  if (mode == 2) v = s[(t + 1) % 64];
  s[t] = x[i];
  __syncthreads();
  v += s[(t + 1) % 64];
  if (mode != 1) __syncthreads();
  s[t] = 2.0f * v;
  __syncthreads();
  out[i] = s[(t + 1) % 64];
}

__global__ void index_fill_kernel(const float* __restrict__ x, float* __restrict__ out,
                                  int64_t limit, int64_t read_offset) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= limit) return;
  out[i] = read_offset > 0 ? x[i + read_offset] : static_cast<float>(i);
}

__global__ void barrier_kernel(int* __restrict__ out, int mode) {
  const int t = threadIdx.x;
  if (mode == 1 && t >= 40) return;
  if (mode == 2 && t >= 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[t] = t;
}

__global__ void warp_kernel(const float* __restrict__ x, float* __restrict__ sum,
                            float* __restrict__ mx, float* __restrict__ scan,
                            int32_t* __restrict__ ballot, int32_t* __restrict__ count) {
  const int lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const float v = x[w * 32 + lane];
  float s = v;
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  float m = v;
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
  m = __shfl_sync(0xffffffffu, m, 0);
  float c = v;
  for (int o = 1; o < 32; o *= 2) {
    const float up = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) c += up;
  }
  const unsigned b = __ballot_sync(0xffffffffu, v > 0.0f);
  const int n = __reduce_add_sync(0xffffffffu, v > 0.0f ? 1 : 0);
  const int disagree = __any_sync(0xffffffffu, n != __popc(b));
  sum[w * 32 + lane] = s;
  mx[w * 32 + lane] = m;
  scan[w * 32 + lane] = c;
  if (lane == 0) {
    ballot[w] = static_cast<int32_t>(b);
    count[w] = disagree ? -1 : n;
  }
}

__global__ void partial_warp_kernel(const float* __restrict__ x, float* __restrict__ out,
                                    int mode) {
  const int lane = threadIdx.x;
  float v = x[lane];
  if (mode == 0) {
    if (lane >= 20) return;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
  } else if (mode == 1) {
    if (lane >= 20) return;
    v += __shfl_down_sync((1u << 20) - 1, v, 16);
  } else {
    if (lane >= 16) return;
    for (int o = 8; o > 0; o /= 2) v += __shfl_xor_sync(0xffffu, v, o, 16);
  }
  out[lane] = v;
}

constexpr int kBins = 16;

__global__ void atomics_kernel(const int32_t* __restrict__ x, int64_t n, int32_t* __restrict__ hist,
                               int32_t* __restrict__ mx, float* __restrict__ fsum) {
  __shared__ int32_t local[kBins];
  const int t = threadIdx.x;
  if (t < kBins) local[t] = 0;
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + t; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&local[x[i]], 1);
    atomicMax(mx, x[i]);
    // float add via compare-and-swap, the pattern for types without atomicAdd
    unsigned* addr = reinterpret_cast<unsigned*>(fsum);
    unsigned old = *addr, assumed;
    do {
      assumed = old;
      old = atomicCAS(addr, assumed,
                      __float_as_uint(__uint_as_float(assumed) + static_cast<float>(x[i])));
    } while (old != assumed);
  }
  __syncthreads();
  if (t < kBins) atomicAdd(&hist[t], local[t]);
}

__global__ void warp_exchange_kernel(const float* __restrict__ x, float* __restrict__ out,
                                     bool use_syncwarp) {
  __shared__ float s[64];
  const int t = threadIdx.x, lane = t % 32, base = t - lane;
  s[t] = x[t];
  if (use_syncwarp) __syncwarp();
  out[t] = s[base + (lane + 31) % 32];
}

__global__ void dynamic_reverse_kernel(const float* __restrict__ x, float* __restrict__ out) {
  float* s = dynamic_smem<float>();
  const int t = threadIdx.x, n = blockDim.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * n + t;
  s[t] = x[i];
  __syncthreads();
  out[i] = s[n - 1 - t];
}

__global__ void noop_kernel(float* out) { out[threadIdx.x] = 1.0f; }

cudaStream_t no_stream() { return nullptr; }

}  // namespace

void shared_shift(const TensorView& x, const TensorView& out, int mode) {
  const unsigned blocks = static_cast<unsigned>(x.numel() / 64);
  launch<shared_shift_kernel>(blocks, 64, 0, no_stream(), x.ptr<float>(), out.ptr<float>(),
                              mode);
}

void index_fill(const TensorView& x, const TensorView& out, int64_t limit, int64_t read_offset) {
  const unsigned blocks = static_cast<unsigned>((limit + 31) / 32);
  launch<index_fill_kernel>(blocks, 32, 0, no_stream(), x.ptr<float>(), out.ptr<float>(), limit,
                            read_offset);
}

void barriers(const TensorView& out, int mode) {
  launch<barrier_kernel>(1, static_cast<unsigned>(out.numel()), 0, no_stream(),
                         out.ptr<int32_t>(), mode);
}

void warp_collectives(const TensorView& x, const TensorView& sum, const TensorView& max,
                      const TensorView& scan, const TensorView& ballot, const TensorView& count) {
  const int64_t warps = x.numel() / 32;  // 2 warps per block
  launch<warp_kernel>(static_cast<unsigned>(warps / 2), 64, 0, no_stream(), x.ptr<float>(),
                      sum.ptr<float>(), max.ptr<float>(), scan.ptr<float>(),
                      ballot.ptr<int32_t>(), count.ptr<int32_t>());
}

void partial_warp(const TensorView& x, const TensorView& out, int mode) {
  launch<partial_warp_kernel>(1, 32, 0, no_stream(), x.ptr<float>(), out.ptr<float>(), mode);
}

void atomics(const TensorView& x, const TensorView& hist, const TensorView& max,
             const TensorView& fsum) {
  launch<atomics_kernel>(3, 64, 0, no_stream(), x.ptr<int32_t>(), x.numel(),
                         hist.ptr<int32_t>(), max.ptr<int32_t>(), fsum.ptr<float>());
}

void warp_exchange(const TensorView& x, const TensorView& out, bool use_syncwarp) {
  launch<warp_exchange_kernel>(1, 64, 0, no_stream(), x.ptr<float>(), out.ptr<float>(),
                               use_syncwarp);
}

void dynamic_reverse(const TensorView& x, const TensorView& out, int threads) {
  launch<dynamic_reverse_kernel>(static_cast<unsigned>(x.numel() / threads),
                                 static_cast<unsigned>(threads), threads * sizeof(float),
                                 no_stream(), x.ptr<float>(), out.ptr<float>());
}

void launch_config(const TensorView& out, int threads) {
  launch<noop_kernel>(1, static_cast<unsigned>(threads), 0, no_stream(), out.ptr<float>());
  check_launch("emu_selftest.noop_kernel");
}

}  // namespace emu_selftest
}  // namespace compass
