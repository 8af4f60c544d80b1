// FP8 blockwise quantization and the fused MoE permutation on CUDA. Generic
// code (no Hopper-only instructions): built for COMPASS_CUDA_ARCHS, and for
// the CPU by the emulator (docs/emulation.md), which runs it in the tests.
//
// fp32 -> e4m3 goes through compass/fp8.h's portable conversion, not
// __nv_cvt_float_to_fp8 / cvt.rn.satfinite.e4m3x2.f32: the emulator has no
// such intrinsic, and the two give the same bits (RNE, saturating); the
// kernels are memory-bound, so the ~10 integer ops per element are hidden.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "compass/cuda_utils.cuh"
#include "compass/fp8.h"
#include "compass/launch.cuh"
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

using namespace fp8_math;  // NOLINT: the shared math (compass/fp8.h)

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 128;  // columns per block / group; 4 per lane

template <typename T>
__device__ __forceinline__ float load_value(const T* p) {
  return Elem<T>::value(*p);
}

// Largest |x| of 128-column row pieces: warp-wide max, every lane gets it.
// fmaxf drops NaN (unchecked non-finite input on the GPU: see the Python API).
__device__ __forceinline__ float warp_amax(float m) { return warp_max(m); }

// Weights: one CTA per 128x128 block (ragged edges masked); warp w holds rows
// w, w + 8, ..., lane l columns l, l + 32, l + 64, l + 96: every load and
// store instruction of a warp touches consecutive addresses. The block stays
// in registers (64 values per thread, kept in the input type: 32 registers for
// bf16) between the amax and the quantization: x is read once. Under 128
// registers, two CTAs (16 warps) fit per SM.
template <typename T, bool kDiv>
__global__ void __launch_bounds__(kThreads, 2)
    quantize_block_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t xs,
                          uint8_t* __restrict__ q, int64_t qs, float* __restrict__ s,
                          int64_t ss0, int64_t ss1, float eps, bool ue8m0) {
  constexpr int kRowsPerWarp = kTile / kWarps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  T v[kRowsPerWarp][4];
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + lane + 32 * j;
      v[i][j] = (r < rows && c < cols) ? x[r * xs + c] : T{};
      m = fmaxf(m, fabsf(Elem<T>::value(v[i][j])));
    }
  }
  __shared__ float partial[kWarps];
  m = warp_amax(m);
  if (lane == 0) partial[warp] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, partial[w]);
  const float scale = block_scale(m, eps, ue8m0);
  const float inv = 1.0f / scale;
  if (threadIdx.x == 0) s[blockIdx.y * ss0 + blockIdx.x * ss1] = scale;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + lane + 32 * j;
      if (r < rows && c < cols) {
        q[r * qs + c] = quantize_value(Elem<T>::value(v[i][j]), scale, inv, kDiv);
      }
    }
  }
}

// One 1x128 group held by a warp (4 values per lane): amax, scale, bytes.
template <typename T, bool kDiv>
__device__ __forceinline__ void quantize_group(const T* __restrict__ row, int64_t cols,
                                               int64_t c0, uint8_t* __restrict__ out,
                                               float* __restrict__ scale_out, float eps,
                                               bool ue8m0, int lane) {
  float v[4];
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = c0 + lane + 32 * j;
    v[j] = c < cols ? load_value(row + c) : 0.0f;
    m = fmaxf(m, fabsf(v[j]));
  }
  m = warp_amax(m);
  const float scale = block_scale(m, eps, ue8m0);
  const float inv = 1.0f / scale;
  if (lane == 0) *scale_out = scale;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = c0 + lane + 32 * j;
    if (c < cols) out[c] = quantize_value(v[j], scale, inv, kDiv);
  }
}

// Activations: one warp per 1x128 group, 8 groups per CTA.
template <typename T, bool kDiv>
__global__ void __launch_bounds__(kThreads)
    quantize_group_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t xs,
                          uint8_t* __restrict__ q, int64_t qs, float* __restrict__ s,
                          int64_t ss0, int64_t ss1, float eps, bool ue8m0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t per_row = (cols + kTile - 1) / kTile;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (gid >= rows * per_row) return;  // uniform per warp
  const int64_t r = gid / per_row, g = gid % per_row;
  quantize_group<T, kDiv>(x + r * xs, cols, g * kTile, q + r * qs, s + r * ss0 + g * ss1, eps,
                          ue8m0, lane);
}

// ------------------------------------------------------------ permutation
// Three launches, no host sync (the output size M*k is known):
// 1. rank: per chunk of 256 slots, each slot's rank among the earlier slots of
//    its expert in the chunk (warp match by ballots over the id's bits, then a
//    prefix over the 8 warps), and the chunk's per-expert counts;
// 2. scan: per expert, the exclusive prefix over chunks; per-expert totals,
//    exclusively scanned into expert_offsets;
// 3. scatter: one warp per slot: its row = offsets[e] + base[chunk, e] +
//    rank, the index maps, and the 1x128 quantization of its token's row.
// Integer counts only: deterministic and stable by construction.

template <typename I>
__global__ void __launch_bounds__(kThreads)
    permute_rank_kernel(const I* __restrict__ ids, int64_t slots, int64_t experts,
                        int32_t* __restrict__ rank, int32_t* __restrict__ chunk_counts) {
  int32_t* hist = dynamic_smem<int32_t>();  // [kWarps][experts]
  for (int64_t i = threadIdx.x; i < kWarps * experts; i += kThreads) hist[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunk = blockIdx.x;
  const int64_t slot = chunk * kPermuteChunk + threadIdx.x;
  const int64_t e = slot < slots ? static_cast<int64_t>(ids[slot]) : -1;
  const bool valid = e >= 0 && e < experts;
  // Lanes holding the same expert: agree on every bit of the id.
  unsigned peers = __ballot_sync(0xffffffffu, valid);
  for (int b = 0; (int64_t{1} << b) < experts; ++b) {
    const bool bit = valid && ((e >> b) & 1);
    const unsigned set = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? set : ~set;
  }
  const unsigned below = peers & ((1u << lane) - 1u);
  if (valid && below == 0) hist[warp * experts + e] = __popc(peers);
  __syncthreads();
  for (int64_t x = threadIdx.x; x < experts; x += kThreads) {
    int32_t run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int32_t c = hist[w * experts + x];
      hist[w * experts + x] = run;
      run += c;
    }
    chunk_counts[chunk * experts + x] = run;
  }
  __syncthreads();
  if (valid) rank[slot] = hist[warp * experts + e] + __popc(below);
}

constexpr int kScanThreads = 1024;  // >= kPermuteMaxExperts

__global__ void __launch_bounds__(kScanThreads)
    permute_scan_kernel(const int32_t* __restrict__ chunk_counts, int32_t* __restrict__ chunk_base,
                        int64_t chunks, int64_t experts, int64_t* __restrict__ offsets) {
  __shared__ int64_t total[kScanThreads];
  const int64_t e = threadIdx.x;
  int64_t run = 0;
  if (e < experts) {
    for (int64_t c = 0; c < chunks; ++c) {
      chunk_base[c * experts + e] = static_cast<int32_t>(run);
      run += chunk_counts[c * experts + e];
    }
  }
  total[e] = run;
  __syncthreads();
  // Inclusive Hillis-Steele scan of the per-expert totals.
  for (int d = 1; d < kScanThreads; d *= 2) {
    const int64_t add = e >= d ? total[e - d] : 0;
    __syncthreads();
    total[e] += add;
    __syncthreads();
  }
  if (e == 0) offsets[0] = 0;
  if (e < experts) offsets[e + 1] = total[e];
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads)
    permute_scatter_kernel(const T* __restrict__ x, int64_t xs, int64_t cols,
                           const I* __restrict__ ids, int64_t k, int64_t slots, int64_t experts,
                           const int32_t* __restrict__ rank, const int32_t* __restrict__ chunk_base,
                           const int64_t* __restrict__ offsets, uint8_t* __restrict__ q,
                           int64_t qs, float* __restrict__ s, int64_t ss0, int64_t ss1,
                           int64_t* __restrict__ src, int64_t* __restrict__ dst, float eps,
                           bool ue8m0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (slot >= slots) return;  // uniform per warp
  const int64_t e = static_cast<int64_t>(ids[slot]);
  if (e < 0 || e >= experts) {  // unchecked bad id: dropped, no row written
    if (lane == 0) dst[slot] = -1;
    return;
  }
  const int64_t p = offsets[e] + chunk_base[(slot / kPermuteChunk) * experts + e] + rank[slot];
  if (lane == 0) {
    src[p] = slot;
    dst[slot] = p;
  }
  const T* row = x + (slot / k) * xs;
  const int64_t groups = (cols + kTile - 1) / kTile;
  for (int64_t g = 0; g < groups; ++g) {
    quantize_group<T, true>(row, cols, g * kTile, q + p * qs, s + p * ss0 + g * ss1, eps, ue8m0,
                            lane);
  }
}

// One CTA per token, threads over columns; fp32 accumulation in j order with
// unfused multiply and add (the CPU and Triton round the same way).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    unpermute_kernel(const T* __restrict__ y, int64_t ys, int64_t cols,
                     const int64_t* __restrict__ dst, const float* __restrict__ w, int64_t k,
                     T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = dst[t * k + j];
      if (p < 0) continue;
      acc = __fadd_rn(acc, __fmul_rn(w[t * k + j], load_value(y + p * ys + c)));
    }
    if constexpr (sizeof(T) == 4) {
      out[t * cols + c] = acc;
    } else {
      out[t * cols + c] = T{bf16_from_f32(acc)};
    }
  }
}

}  // namespace

void quantize_cuda(COMPASS_FP8_QUANTIZE_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(x, q, scales);
  check_quantize_args(x, block_rows, block_cols, eps, ue8m0, use_div, scale_layout, q, scales);
  x.expect_device(DeviceType::kCUDA);
  COMPASS_CHECK(block_cols == kTile && (block_rows == 1 || block_rows == kTile),
                "block: the CUDA kernels support (1, 128) and (128, 128), got (", block_rows,
                ", ", block_cols, ")");
  const int64_t rows = x.shape[0], cols = x.shape[1];
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(x.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t kb = (cols + kTile - 1) / kTile;
  const float e = static_cast<float>(eps);
  COMPASS_CHECK(block_rows == 1 || (rows + kTile - 1) / kTile <= 65535, x.name,
                ": at most 65535 * 128 rows per call, got ", rows);
  dispatch(x, InputTypes{}, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto div) {
      constexpr bool kDiv = decltype(div)::value;
      if (block_rows == kTile) {
        const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>((rows + kTile - 1) / kTile));
        compass::launch<quantize_block_kernel<T, kDiv>>(grid, kThreads, 0, stream, x.ptr<T>(),
            rows, cols, x.strides[0], q.ptr<uint8_t>(), q.strides[0], scales.ptr<float>(),
            scales.strides[0], scales.strides[1], e, ue8m0);
      } else {
        const int64_t blocks = (rows * kb + kWarps - 1) / kWarps;
        compass::launch<quantize_group_kernel<T, kDiv>>(static_cast<unsigned>(blocks), kThreads,
            0, stream, x.ptr<T>(), rows, cols, x.strides[0], q.ptr<uint8_t>(), q.strides[0],
            scales.ptr<float>(), scales.strides[0], scales.strides[1], e, ue8m0);
      }
    };
    if (use_div) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  check_launch("fp8.quantize");
}

void permute_quantize_cuda(COMPASS_FP8_PERMUTE_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(x, topk_ids, q, scales, expert_offsets, src_index, dst_index, workspace);
  check_permute_args(x, topk_ids, num_experts, eps, ue8m0, scale_layout, q, scales, expert_offsets, src_index,
                     dst_index, workspace);
  x.expect_device(DeviceType::kCUDA);
  COMPASS_CHECK(num_experts <= kPermuteMaxExperts, "num_experts: the CUDA permutation supports "
                "at most ", kPermuteMaxExperts, " experts, got ", num_experts);
  const int64_t k = topk_ids.shape[1], slots = x.shape[0] * k;
  COMPASS_CHECK(slots < INT32_MAX, "topk_ids: the CUDA permutation supports < 2^31 slots "
                "(tokens * top_k), got ", slots);
  const int64_t chunks = (slots + kPermuteChunk - 1) / kPermuteChunk;
  DeviceGuard guard(x.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  int32_t* rank = workspace.ptr<int32_t>();
  int32_t* counts = rank + slots;
  int32_t* base = counts + chunks * num_experts;
  dispatch(topk_ids, Types<int32_t, int64_t>{}, [&](auto itag) {
    using I = decltype(itag);
    if (chunks > 0) {
      compass::launch<permute_rank_kernel<I>>(static_cast<unsigned>(chunks), kThreads,
          static_cast<size_t>(kWarps * num_experts) * sizeof(int32_t), stream,
          topk_ids.ptr<I>(), slots, num_experts, rank, counts);
    }
    compass::launch<permute_scan_kernel>(1, kScanThreads, 0, stream, counts, base, chunks,
        num_experts, expert_offsets.ptr<int64_t>());
    if (slots == 0) return;
    dispatch(x, InputTypes{}, [&](auto tag) {
      using T = decltype(tag);
      compass::launch<permute_scatter_kernel<T, I>>(
          static_cast<unsigned>((slots + kWarps - 1) / kWarps), kThreads, 0, stream, x.ptr<T>(),
          x.strides[0], x.shape[1], topk_ids.ptr<I>(), k, slots, num_experts, rank, base,
          expert_offsets.ptr<int64_t>(), q.ptr<uint8_t>(), q.strides[0], scales.ptr<float>(),
          scales.strides[0], scales.strides[1], src_index.ptr<int64_t>(),
          dst_index.ptr<int64_t>(), static_cast<float>(eps), ue8m0);
    });
  });
  check_launch("fp8.permute_quantize");
}

void unpermute_cuda(COMPASS_FP8_UNPERMUTE_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(y, dst_index, topk_weights, out);
  check_unpermute_args(y, dst_index, topk_weights, out);
  y.expect_device(DeviceType::kCUDA);
  const int64_t m = topk_weights.shape[0], k = topk_weights.shape[1];
  if (m == 0 || y.shape[1] == 0) return;
  DeviceGuard guard(y.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch(y, Types<float, Bf16Bits>{}, [&](auto tag) {
    using T = decltype(tag);
    compass::launch<unpermute_kernel<T>>(static_cast<unsigned>(m), kThreads, 0, stream,
        y.ptr<T>(), y.strides[0], y.shape[1], dst_index.ptr<int64_t>(),
        topk_weights.ptr<float>(), k, out.ptr<T>());
  });
  check_launch("fp8.unpermute");
}

}  // namespace fp8
}  // namespace compass
