// MoE token permutation fused with 1x128 FP8 quantization, and its inverse
// with the top-k combine, on the CPU. A stable counting sort by expert (one
// serial pass: ~1 ns per slot), then the rows in parallel: each token is
// quantized once and its bytes copied to its k destination rows.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

using namespace fp8_math;  // NOLINT: the shared math (compass/fp8.h)

namespace {
constexpr int64_t kParallelMinElements = int64_t{1} << 16;
constexpr int64_t kGroup = 128;

// The stable counting sort, in the CUDA kernels' terms (so the workspace holds
// the same numbers on every backend): per chunk of kPermuteChunk slots, each
// slot's rank among the chunk's earlier slots of its expert and the chunk's
// per-expert counts; per expert, the exclusive prefix over chunks (base) and
// the offsets; slot s of expert e goes to row offsets[e] + base[chunk, e] + rank[s].
template <typename I>
void sort_slots(const I* ids, int64_t slots, int64_t experts, int64_t* offsets, int32_t* rank,
                int32_t* counts, int32_t* base, int64_t* src, int64_t* dst, const char* name) {
  const int64_t chunks = (slots + kPermuteChunk - 1) / kPermuteChunk;
  std::fill(counts, counts + chunks * experts, 0);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = static_cast<int64_t>(ids[s]);
    COMPASS_CHECK(e >= 0 && e < experts, name, ": expected expert ids in [0, ", experts,
                  "), got ", e, " at flat index ", s);
    rank[s] = counts[(s / kPermuteChunk) * experts + e]++;
  }
  std::vector<int64_t> run(static_cast<size_t>(experts), 0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t e = 0; e < experts; ++e) {
      base[c * experts + e] = static_cast<int32_t>(run[e]);
      run[e] += counts[c * experts + e];
    }
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + run[e];
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = static_cast<int64_t>(ids[s]);
    const int64_t p = offsets[e] + base[(s / kPermuteChunk) * experts + e] + rank[s];
    src[p] = s;
    dst[s] = p;
  }
}

// Quantize row t of x into its k destination rows (groups of 128).
template <typename T>
bool quantize_token(const TensorView& x, const TensorView& q, const TensorView& scales,
                    const int64_t* dst, int64_t t, int64_t k, float eps, bool ue8m0) {
  const int64_t cols = x.shape[1], groups = (cols + kGroup - 1) / kGroup;
  const T* row = x.ptr<T>() + t * x.strides[0];
  uint8_t* qp = q.ptr<uint8_t>();
  float* sp = scales.ptr<float>();
  const int64_t first = dst[t * k];
  uint8_t* out = qp + first * q.strides[0];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * kGroup, n = std::min(cols, c0 + kGroup) - c0;
    using Bits = typename Elem<T>::Bits;
    Bits m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < n; ++c) {
      const Bits b = Elem<T>::abs_bits(row[c0 + c]);
      m = b > m ? b : m;
    }
    if (m >= Elem<T>::kNonFinite) return false;
    const float scale = block_scale(Elem<T>::from_abs_bits(m), eps, ue8m0);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      out[c0 + c] = quantize_value(Elem<T>::value(row[c0 + c]), scale, 0.0f, true);
    }
    for (int64_t j = 0; j < k; ++j) sp[dst[t * k + j] * scales.strides[0] + g * scales.strides[1]] = scale;
  }
  for (int64_t j = 1; j < k; ++j) {
    std::memcpy(qp + dst[t * k + j] * q.strides[0], out, static_cast<size_t>(cols));
  }
  return true;
}

}  // namespace

void check_permute_args(COMPASS_FP8_PERMUTE_ARGS) {
  x.expect_ndim(2);
  dispatch(x, InputTypes{}, [](auto) {});
  COMPASS_CHECK(x.shape[1] <= 1 || x.strides[1] == 1, x.name,
                ": expected unit stride along the last dim");
  const int64_t m = x.shape[0], cols = x.shape[1];
  topk_ids.expect_ndim(2).expect_contiguous().expect_same_device(x);
  dispatch(topk_ids, Types<int32_t, int64_t>{}, [](auto) {});
  topk_ids.expect_size(0, m, "one row of expert ids per token of x");
  const int64_t k = topk_ids.shape[1], slots = m * k;
  COMPASS_CHECK(num_experts >= 1, "num_experts: expected >= 1, got ", num_experts);
  COMPASS_CHECK(std::isfinite(eps) && eps >= 1e-30 && eps <= 1.0,
                "eps: expected a float in [1e-30, 1], got ", eps);
  q.expect_ndim(2).expect_dtype(DType::kFloat8E4M3FN).expect_contiguous().expect_same_device(x);
  q.expect_size(0, slots, "tokens * top_k").expect_size(1, cols, "x's columns");
  check_scales(scales, x, slots, (cols + kGroup - 1) / kGroup, scale_layout);
  expert_offsets.expect_vector().expect_dtype(DType::kInt64).expect_same_device(x);
  expert_offsets.expect_size(0, num_experts + 1, "num_experts + 1");
  src_index.expect_vector().expect_dtype(DType::kInt64).expect_same_device(x);
  src_index.expect_size(0, slots, "tokens * top_k");
  dst_index.expect_vector().expect_dtype(DType::kInt64).expect_same_device(x);
  dst_index.expect_size(0, slots, "tokens * top_k");
  workspace.expect_vector().expect_dtype(DType::kInt32).expect_same_device(x);
  workspace.expect_size(0, permute_workspace_size(slots, num_experts),
                        "permute_workspace_size(tokens * top_k, num_experts)");
}

void permute_quantize_cpu(COMPASS_FP8_PERMUTE_ARGS) {
  COMPASS_NAME_ARGS(x, topk_ids, q, scales, expert_offsets, src_index, dst_index, workspace);
  check_permute_args(x, topk_ids, num_experts, eps, ue8m0, scale_layout, q, scales, expert_offsets, src_index,
                     dst_index, workspace);
  x.expect_device(DeviceType::kCPU);
  const int64_t m = x.shape[0], k = topk_ids.shape[1], slots = m * k;
  int64_t* off = expert_offsets.ptr<int64_t>();
  int64_t* src = src_index.ptr<int64_t>();
  int64_t* dst = dst_index.ptr<int64_t>();
  COMPASS_CHECK(slots < INT32_MAX, "topk_ids: at most 2^31 - 1 slots (tokens * top_k), got ",
                slots);
  const int64_t chunks = (slots + kPermuteChunk - 1) / kPermuteChunk;
  int32_t* rank = workspace.ptr<int32_t>();
  int32_t* counts = rank + slots;
  int32_t* base = counts + chunks * num_experts;
  dispatch(topk_ids, Types<int32_t, int64_t>{}, [&](auto tag) {
    using I = decltype(tag);
    sort_slots(topk_ids.ptr<I>(), slots, num_experts, off, rank, counts, base, src, dst,
               topk_ids.name);
  });
  if (slots == 0 || x.shape[1] == 0) return;
  const float e = static_cast<float>(eps);
  dispatch(x, InputTypes{}, [&](auto tag) {
    using T = decltype(tag);
    bool ok = true;
    const bool parallel = slots * x.shape[1] >= kParallelMinElements;
#pragma omp parallel for schedule(static) reduction(&& : ok) if (parallel)
    for (int64_t t = 0; t < m; ++t) {
      ok = quantize_token<T>(x, q, scales, dst, t, k, e, ue8m0) && ok;
    }
    if (!ok) {
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t c = 0; c < x.shape[1]; ++c) {
          const float v = Elem<T>::value(x.ptr<T>()[t * x.strides[0] + c]);
          COMPASS_CHECK(std::isfinite(v), x.name, ": expected finite values, got ", v, " at [",
                        t, ", ", c, "]");
        }
      }
    }
  });
}

void check_unpermute_args(COMPASS_FP8_UNPERMUTE_ARGS) {
  y.expect_ndim(2);
  dispatch(y, Types<float, Bf16Bits>{}, [](auto) {});
  COMPASS_CHECK(y.shape[1] <= 1 || y.strides[1] == 1, y.name,
                ": expected unit stride along the last dim");
  topk_weights.expect_ndim(2).expect_dtype(DType::kFloat32).expect_contiguous();
  topk_weights.expect_same_device(y);
  const int64_t m = topk_weights.shape[0], k = topk_weights.shape[1];
  dst_index.expect_vector().expect_dtype(DType::kInt64).expect_same_device(y);
  dst_index.expect_size(0, m * k, "tokens * top_k = topk_weights.numel()");
  out.expect_ndim(2).expect_dtype(y.dtype).expect_contiguous().expect_same_device(y);
  out.expect_size(0, m, "tokens = topk_weights.shape[0]").expect_size(1, y.shape[1], "y's columns");
}

namespace {
template <typename T> float load_f32(const T* p);
template <> float load_f32<float>(const float* p) { return *p; }
template <> float load_f32<Bf16Bits>(const Bf16Bits* p) { return f32_from_bf16(p->bits); }
inline void store_f32(float* p, float v) { *p = v; }
inline void store_f32(Bf16Bits* p, float v) { p->bits = bf16_from_f32(v); }
}  // namespace

void unpermute_cpu(COMPASS_FP8_UNPERMUTE_ARGS) {
  COMPASS_NAME_ARGS(y, dst_index, topk_weights, out);
  check_unpermute_args(y, dst_index, topk_weights, out);
  y.expect_device(DeviceType::kCPU);
  const int64_t m = topk_weights.shape[0], k = topk_weights.shape[1], n = y.shape[1];
  const int64_t rows = y.shape[0];
  const int64_t* dst = dst_index.ptr<int64_t>();
  for (int64_t s = 0; s < m * k; ++s) {
    COMPASS_CHECK(dst[s] >= -1 && dst[s] < rows, dst_index.name, ": expected values in [-1, ",
                  rows, ") (rows of y; -1 = dropped), got ", dst[s], " at index ", s);
  }
  const float* w = topk_weights.ptr<float>();
  dispatch(y, Types<float, Bf16Bits>{}, [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<T>();
    T* op = out.ptr<T>();
    const bool parallel = m * k * n >= kParallelMinElements;
#pragma omp parallel if (parallel)
    {
      std::vector<float> acc(static_cast<size_t>(n));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < m; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t p = dst[t * k + j];
          if (p < 0) continue;
          const float wj = w[t * k + j];
          const T* row = yp + p * y.strides[0];
          float* a = acc.data();
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) a[c] += wj * load_f32(row + c);
        }
        for (int64_t c = 0; c < n; ++c) store_f32(op + t * n + c, acc[c]);
      }
    }
  });
}

}  // namespace fp8
}  // namespace compass
