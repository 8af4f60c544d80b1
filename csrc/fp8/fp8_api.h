// Host entry points of the FP8 kernels (CPU in fp8_cpu.cpp / permute_cpu.cpp,
// CUDA in fp8.cu), bound one line each in bindings.cpp. Arguments are borrowed
// views; outputs are written in place. check_* runs every dtype/shape/device
// check before any launch. Spec: compass_kernels/fp8/reference.py.
#pragma once

#include <cstdint>

#include "compass/fp8.h"
#include "compass/tensor_view.h"

namespace compass {
template <> struct DTypeOf<fp8_math::Bf16Bits> {
  static constexpr DType value = DType::kBFloat16;
};
template <> struct DTypeOf<fp8_math::F16Bits> {
  static constexpr DType value = DType::kFloat16;
};

namespace fp8 {

// Input dtypes of the quantizers (fp32 values or raw 16-bit storage).
using InputTypes = Types<float, fp8_math::Bf16Bits, fp8_math::F16Bits>;

// x [R, C] float32|bfloat16|float16 (unit column stride, any row stride);
// blocks of block_rows x block_cols (ragged edges: partial blocks); outputs
// q [R, C] float8_e4m3fn (contiguous), scales [ceil(R/br), ceil(C/bc)] float32
// in the consumer's layout, scale_layout (checked against the strides):
// 0 K-major (row-major), 1 MN-major (column-major), 2 MN-major with the
// column stride rounded up to a multiple of 4 (DeepGEMM's TMA-aligned fp32
// scales: 16-byte aligned columns).
// use_div: q = e4m3(x / s) (vLLM's activation kernels), else e4m3(x * (1/s))
// (DeepGEMM / vLLM per_block_cast_to_fp8).
#define COMPASS_FP8_QUANTIZE_ARGS                                                           \
  TensorView x, int64_t block_rows, int64_t block_cols, double eps, bool ue8m0, bool use_div, \
      int64_t scale_layout, TensorView q, TensorView scales

// MoE token permutation fused with 1x128 quantization. x [M, K] as above;
// topk_ids [M, k] int32|int64 in [0, E); outputs: q [M*k, K] float8_e4m3fn
// and scales [M*k, ceil(K/128)] float32 (scale_layout as above) in expert order (stable:
// ties keep the flat slot order t*k + j), expert_offsets [E+1] int64 (no
// padding), src_index [M*k] int64 (permuted row -> slot t*k + j), dst_index
// [M*k] int64 (slot -> permuted row), workspace int32 (permute_workspace_size):
// the sort's intermediates, the same numbers on every backend: rank [M*k]
// (within a chunk of kPermuteChunk slots), chunk counts [chunks, E], chunk
// bases [chunks, E] (exclusive prefix over chunks per expert).
#define COMPASS_FP8_PERMUTE_ARGS                                                       \
  TensorView x, TensorView topk_ids, int64_t num_experts, double eps, bool ue8m0,        \
      int64_t scale_layout, TensorView q, TensorView scales, TensorView expert_offsets, TensorView src_index, \
      TensorView dst_index, TensorView workspace

// The inverse with the top-k combine: out[t] = sum_j w[t, j] * y[dst_index[t*k + j]]
// (fp32 accumulation in j order, rows with dst_index < 0 skipped). y [P, N]
// float32|bfloat16 (unit column stride); dst_index [M*k] int64; topk_weights
// [M, k] float32; out [M, N] y's dtype (contiguous).
#define COMPASS_FP8_UNPERMUTE_ARGS \
  TensorView y, TensorView dst_index, TensorView topk_weights, TensorView out

// Tokens per chunk of the CUDA permutation (one CTA ranks a chunk stably).
constexpr int64_t kPermuteChunk = 256;
// Most experts the CUDA permutation handles (a chunk's per-warp histograms
// live in shared memory: 8 warps x E int32).
constexpr int64_t kPermuteMaxExperts = 1024;

// int32 elements of workspace the CUDA permutation needs for n = M*k slots.
inline int64_t permute_workspace_size(int64_t slots, int64_t num_experts) {
  const int64_t chunks = (slots + kPermuteChunk - 1) / kPermuteChunk;
  return slots + 2 * chunks * num_experts;
}

enum ScaleLayout : int64_t { kKMajor = 0, kMNMajor = 1, kMNMajorTMA = 2 };

// Shared by every backend (defined in fp8_cpu.cpp). check_scales: dtype,
// shape [rows, cols] and the strides of scale_layout.
void check_scales(const TensorView& scales, const TensorView& x, int64_t rows, int64_t cols,
                  int64_t scale_layout);
void check_quantize_args(COMPASS_FP8_QUANTIZE_ARGS);
void check_permute_args(COMPASS_FP8_PERMUTE_ARGS);
void check_unpermute_args(COMPASS_FP8_UNPERMUTE_ARGS);

void quantize_cpu(COMPASS_FP8_QUANTIZE_ARGS);
void permute_quantize_cpu(COMPASS_FP8_PERMUTE_ARGS);
void unpermute_cpu(COMPASS_FP8_UNPERMUTE_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void quantize_cuda(COMPASS_FP8_QUANTIZE_ARGS, uintptr_t stream);
void permute_quantize_cuda(COMPASS_FP8_PERMUTE_ARGS, uintptr_t stream);
void unpermute_cuda(COMPASS_FP8_UNPERMUTE_ARGS, uintptr_t stream);
#endif

}  // namespace fp8
}  // namespace compass
