// Host side of the grouped-GEMM argument builder: checks, the layout (base
// addresses and byte strides) both builders read, and the CPU builder, which
// runs the same per-expert function (compass::fp8_gemm::group_args) as the
// CUDA kernel in grouped_args.cu.
#include "fp8_gemm/fp8_gemm_api.h"

namespace compass {
namespace fp8_gemm {

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

}  // namespace fp8_gemm
}  // namespace compass
