// FP8 grouped expert GEMM on the CPU (OpenMP over output tiles).
//
// Why C++ and not vectorized torch: this is the `cpp` backend CPU tensors
// dispatch to, and it runs the GPU kernels' numerics (fp32 partial sums per
// 128 of K, promoted with the product of the two block scales,
// compass::fp8_gemm::promote), where a torch path would dequantize and matmul
// (the reference's math, which tests must not share). It reads the offsets on
// the host, so it also validates them at no cost. Speed target: tests and
// small runs (a 64x64 tile's operands are widened to fp32 once, ~3% of the
// work; the K-block dots vectorize under `omp simd`).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "compass/fp8.h"
#include "fp8_gemm/fp8_gemm_api.h"

namespace compass {
namespace fp8_gemm {

namespace {

// Output tile of one work item: rows of one expert x columns (never crossing
// an expert, so a tile reads one weight matrix).
constexpr int64_t kTileM = 64;
constexpr int64_t kTileN = 64;
// Below this many multiply-adds the work runs on the calling thread (waking
// the OpenMP team costs more than small GEMMs; see advantages_cpu.cpp).
constexpr int64_t kParallelMinMacs = int64_t{1} << 22;

// e4m3fn byte -> float32, exact (NaN encodings give NaN).
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_math::f32_from_e4m3(static_cast<uint8_t>(i));
  }
};
const E4M3Table& e4m3_table() {
  static const E4M3Table t;
  return t;
}

void widen(const uint8_t* src, int64_t n, float* dst, const float* lut) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < n; ++k) s += a[k] * b[k];
  return s;
}

struct Item {
  int64_t expert, row0, rows, col0;
};

}  // namespace

void check_grouped_gemm_args(COMPASS_FP8_GROUPED_GEMM_ARGS) {
  for (const TensorView* t : {&a_scales, &b_q, &b_scales, &expert_offsets, &out}) {
    t->expect_same_device(a_q);
  }
  a_q.expect_ndim(2).expect_dtype(DType::kFloat8E4M3FN);
  b_q.expect_ndim(3).expect_dtype(DType::kFloat8E4M3FN);
  const int64_t m = a_q.size(0), k = a_q.size(1), e = b_q.size(0), n = b_q.size(1);
  COMPASS_CHECK(k >= 1, "a_q: expected K >= 1 columns, got ", a_q.describe());
  COMPASS_CHECK(e >= 1, "b_q: expected at least one expert, got ", b_q.describe());
  b_q.expect_size(2, k, "K = a_q.shape[1]");
  COMPASS_CHECK(a_q.strides[1] == 1 || k == 1, "a_q: expected unit stride along K, got strides (",
                a_q.strides[0], ", ", a_q.strides[1], ")");
  COMPASS_CHECK(b_q.strides[2] == 1 || k == 1, "b_q: expected unit stride along K, got strides (",
                b_q.strides[0], ", ", b_q.strides[1], ", ", b_q.strides[2], ")");
  const int64_t kb = cdiv(k, kScaleBlock), nb = cdiv(n, kScaleBlock);
  a_scales.expect_ndim(2).expect_dtype(DType::kFloat32);
  a_scales.expect_size(0, m, "M = a_q.shape[0]").expect_size(1, kb, "ceil(K/128)");
  b_scales.expect_ndim(3).expect_dtype(DType::kFloat32);
  b_scales.expect_size(0, e, "E = b_q.shape[0]").expect_size(1, nb, "ceil(N/128)");
  b_scales.expect_size(2, kb, "ceil(K/128)");
  expert_offsets.expect_vector().expect_dtype(DType::kInt64);
  expert_offsets.expect_size(0, e + 1, "E + 1");
  COMPASS_CHECK(out_dtype == kOutBF16 || out_dtype == kOutF32,
                "out_dtype: expected 0 (bfloat16) or 1 (float32), got ", out_dtype);
  out.expect_ndim(2).expect_dtype(out_dtype == kOutBF16 ? DType::kBFloat16 : DType::kFloat32);
  out.expect_size(0, m, "M = a_q.shape[0]").expect_size(1, n, "N = b_q.shape[1]");
  COMPASS_CHECK(out.strides[1] == 1 || n <= 1, "out: expected unit stride along N, got strides (",
                out.strides[0], ", ", out.strides[1], ")");
}

void check_offsets_data(const TensorView& expert_offsets, int64_t rows) {
  const int64_t* off = expert_offsets.ptr<int64_t>();
  const int64_t e = expert_offsets.numel() - 1;
  COMPASS_CHECK(off[0] == 0, expert_offsets.name, ": expected ", expert_offsets.name,
                "[0] == 0, got ", off[0]);
  for (int64_t i = 0; i < e; ++i) {
    COMPASS_CHECK(off[i + 1] >= off[i], expert_offsets.name, ": expected non-decreasing values, got ",
                  expert_offsets.name, "[", i, "] = ", off[i], " > ", expert_offsets.name, "[",
                  i + 1, "] = ", off[i + 1]);
  }
  COMPASS_CHECK(off[e] == rows, expert_offsets.name, ": expected ", expert_offsets.name,
                "[-1] == M = ", rows, " (a_q rows), got ", off[e]);
}

void grouped_gemm_cpu(COMPASS_FP8_GROUPED_GEMM_ARGS) {
  COMPASS_NAME_ARGS(a_q, a_scales, b_q, b_scales, expert_offsets, out);
  check_grouped_gemm_args(a_q, a_scales, b_q, b_scales, expert_offsets, out_dtype, out);
  a_q.expect_device(DeviceType::kCPU);
  const int64_t m = a_q.size(0), k = a_q.size(1), e = b_q.size(0), n = b_q.size(1);
  check_offsets_data(expert_offsets, m);
  if (m == 0 || n == 0) return;
  const int64_t* off = expert_offsets.ptr<int64_t>();
  const int64_t kb = cdiv(k, kScaleBlock);

  // Work items: (expert, row tile, column tile); zero-token experts add none.
  std::vector<Item> items;
  for (int64_t x = 0; x < e; ++x) {
    for (int64_t r = off[x]; r < off[x + 1]; r += kTileM) {
      for (int64_t c = 0; c < n; c += kTileN) {
        items.push_back({x, r, std::min(kTileM, off[x + 1] - r), c});
      }
    }
  }
  const uint8_t* a = a_q.ptr<uint8_t>();
  const uint8_t* b = b_q.ptr<uint8_t>();
  const float* sa = a_scales.ptr<float>();
  const float* sb = b_scales.ptr<float>();
  const float* lut = e4m3_table().v;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const bool parallel = m * n * k >= kParallelMinMacs && n_items > 1;

#pragma omp parallel if (parallel)
  {
    std::vector<float> at(static_cast<size_t>(kTileM * k)), bt(static_cast<size_t>(kTileN * k));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item w = items[static_cast<size_t>(it)];
      const int64_t cols = std::min(kTileN, n - w.col0);
      for (int64_t i = 0; i < w.rows; ++i) {
        widen(a + (w.row0 + i) * a_q.strides[0], k, at.data() + i * k, lut);
      }
      for (int64_t j = 0; j < cols; ++j) {
        widen(b + w.expert * b_q.strides[0] + (w.col0 + j) * b_q.strides[1], k,
              bt.data() + j * k, lut);
      }
      for (int64_t i = 0; i < w.rows; ++i) {
        const int64_t row = w.row0 + i;
        const float* sa_row = sa + row * a_scales.strides[0];
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t col = w.col0 + j;
          const float* sb_blk = sb + w.expert * b_scales.strides[0] +
                                (col / kScaleBlock) * b_scales.strides[1];
          float acc = 0.0f;
          for (int64_t q = 0; q < kb; ++q) {
            const int64_t k0 = q * kScaleBlock, len = std::min(kScaleBlock, k - k0);
            const float partial = dot(at.data() + i * k + k0, bt.data() + j * k + k0, len);
            acc = promote(acc, partial, sa_row[q * a_scales.strides[1]],
                          sb_blk[q * b_scales.strides[2]]);
          }
          if (out_dtype == kOutBF16) {
            out.ptr<uint16_t>()[row * out.strides[0] + col] = fp8_math::bf16_from_f32(acc);
          } else {
            out.ptr<float>()[row * out.strides[0] + col] = acc;
          }
        }
      }
    }
  }
}

}  // namespace fp8_gemm
}  // namespace compass
