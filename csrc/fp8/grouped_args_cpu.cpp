// Host side of the grouped-GEMM argument builder: the GEMM's argument checks
// (shared with the CUTLASS entry point), the layout (base addresses and byte
// strides) the builder reads, and the CPU builder (compass::fp8::group_args per
// expert), the reference the GPU builder (compass_kernels/fp8/triton_args.py)
// is tested against.
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

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

void check_grouped_args(COMPASS_FP8_GROUPED_ARGS_ARGS) {
  const int64_t code = out.dtype == DType::kFloat32 ? kOutF32 : kOutBF16;
  check_grouped_gemm_args(a_q, a_scales, b_q, b_scales, expert_offsets, code, out);
  const int64_t e = b_q.size(0);
  shapes.expect_same_device(a_q).expect_ndim(2).expect_dtype(DType::kInt32).expect_contiguous();
  shapes.expect_size(0, e, "E = b_q.shape[0]").expect_size(1, 3, "(M_e, N, K)");
  ptrs.expect_same_device(a_q).expect_ndim(2).expect_dtype(DType::kInt64).expect_contiguous();
  ptrs.expect_size(0, kNumPtrRows, "rows A, B, SFA, SFB, D").expect_size(1, e, "E = b_q.shape[0]");
  COMPASS_CHECK(b_q.size(1) <= INT32_MAX && a_q.size(1) <= INT32_MAX,
                "b_q: expected N and K < 2^31 (int32 problem shapes), got ", b_q.describe());
}

GroupedLayout grouped_layout(const TensorView& a_q, const TensorView& a_scales,
                             const TensorView& b_q, const TensorView& b_scales,
                             const TensorView& out) {
  GroupedLayout g;
  g.a = reinterpret_cast<uint64_t>(a_q.data);
  g.b = reinterpret_cast<uint64_t>(b_q.data);
  g.sfa = reinterpret_cast<uint64_t>(a_scales.data);
  g.sfb = reinterpret_cast<uint64_t>(b_scales.data);
  g.d = reinterpret_cast<uint64_t>(out.data);
  g.a_row = a_q.strides[0];  // e4m3: one byte per element
  g.b_expert = b_q.strides[0];
  g.sfa_row = a_scales.strides[0] * 4;
  g.sfb_expert = b_scales.strides[0] * 4;
  g.d_row = out.strides[0] * dtype_size(out.dtype);
  g.n = static_cast<int32_t>(b_q.size(1));
  g.k = static_cast<int32_t>(a_q.size(1));
  return g;
}

void grouped_args_cpu(COMPASS_FP8_GROUPED_ARGS_ARGS) {
  COMPASS_NAME_ARGS(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  check_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  a_q.expect_device(DeviceType::kCPU);
  check_offsets_data(expert_offsets, a_q.size(0));
  const GroupedLayout g = grouped_layout(a_q, a_scales, b_q, b_scales, out);
  const int64_t* off = expert_offsets.ptr<int64_t>();
  const int64_t experts = b_q.size(0);
  for (int64_t e = 0; e < experts; ++e) {
    group_args(g, e, experts, off[e], off[e + 1], shapes.ptr<int32_t>(), ptrs.ptr<int64_t>());
  }
}

}  // namespace fp8
}  // namespace compass
