// ck.fp8.grouped_gemm on Hopper with CUTLASS: a pointer-array grouped GEMM
// with blockwise scaling (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise,
// 1x128 activation / 128x128 weight scales, fp32 promotion in the mainloop),
// bf16 out. This header holds the kernel template; each tile configuration is
// instantiated in its own translation unit (grouped_gemm_sm90_m64.cu,
// grouped_gemm_sm90_m128.cu: ~1 min and ~4 GB of compiler each), chosen at
// run time by sm90_tiles.h.
//
// Token-packed: group e is rows [off[e], off[e+1]) of A and D, M_e as is (TMA
// bounds the last tile; nothing is padded); an expert with M_e = 0 has no tiles.
// Problem shapes and pointer arrays come from the device-side builder
// (Triton: compass_kernels/fp8/triton_args.py); this file fills the per-group strides and scale layouts on
// the device and launches: no host sync.
//
// Scale layouts: K-major (a_scales [M, ceil(K/128)] and b_scales [E,
// ceil(N/128), ceil(K/128)] contiguous). The CUTLASS 4.2 mainloop rebuilds each
// group's scale layout from (M_e, N, K), so a token-packed MN-major activation
// scale array (column stride M, not M_e) cannot be described to it.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "compass/cuda_utils.cuh"
#include "fp8/fp8_api.h"
#include "fp8/sm90_workspace.h"

namespace compass {
namespace fp8 {
namespace sm90 {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M_e, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [K, N] column-major = b_q[e] [N, K]
using LayoutD = cutlass::layout::RowMajor;     // [M_e, N]
constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;  // 16 bytes (TMA)

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// One tile configuration: tile shape, cluster shape, mainloop and epilogue schedules.
template <class TileShape_, class ClusterShape_, class MainloopSchedule, class EpilogueSchedule>
struct Config {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;

  // Dynamic shared memory is not in ptxas' report: the sm_90 opt-in limit is
  // 227 KB per block (232448 bytes).
  static_assert(GemmKernel::SharedStorageSize <= 232448, "shared memory beyond the sm_90 limit");
};

// Per-group strides and scale layouts, all groups alike (the mainloop rebuilds
// the scale layouts from M_e anyway; they are filled for can_implement and for
// future CUTLASS versions that read them).
template <class Cfg>
__global__ void fill_group_layouts(const int32_t* shapes, int64_t groups, int64_t lda,
                                   int64_t ldd, typename Cfg::StrideA* sa,
                                   typename Cfg::StrideB* sb, typename Cfg::StrideD* sd,
                                   LayoutSFA* lsfa, LayoutSFB* lsfb) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int m = shapes[3 * g], n = shapes[3 * g + 1], k = shapes[3 * g + 2];
  sa[g] = typename Cfg::StrideA{lda, Int<1>{}, Int<0>{}};
  sb[g] = typename Cfg::StrideB{static_cast<int64_t>(k), Int<1>{}, Int<0>{}};
  sd[g] = typename Cfg::StrideD{ldd, Int<1>{}, Int<0>{}};
  lsfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  lsfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

// The workspace layout (sm90_workspace.h) for E experts on sm_count SMs:
// CUTLASS's region first, then the per-group strides and layouts.
template <class Cfg>
Sm90WorkspaceLayout workspace_layout(int64_t experts, int64_t sm_count) {
  typename Cfg::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(experts), nullptr, nullptr};
  args.hw_info.sm_count = static_cast<int>(sm_count);
  return sm90_workspace_layout(
      experts, static_cast<int64_t>(Cfg::Gemm::get_workspace_size(args)),
      {static_cast<int64_t>(sizeof(typename Cfg::StrideA)),
       static_cast<int64_t>(sizeof(typename Cfg::StrideB)),
       static_cast<int64_t>(sizeof(typename Cfg::StrideD)),
       static_cast<int64_t>(sizeof(LayoutSFA)), static_cast<int64_t>(sizeof(LayoutSFB))});
}

// Bytes of workspace run<Cfg> needs for E experts on sm_count SMs.
template <class Cfg>
int64_t workspace_bytes(int64_t experts, int64_t sm_count) {
  return workspace_layout<Cfg>(experts, sm_count).total;
}

template <class Cfg>
void run(COMPASS_FP8_GROUPED_GEMM_ARGS, TensorView shapes, TensorView ptrs, TensorView workspace,
         int64_t sm_count, uintptr_t stream_handle, const char* name) {
  using StrideA = typename Cfg::StrideA;
  using StrideB = typename Cfg::StrideB;
  using StrideD = typename Cfg::StrideD;
  using Gemm = typename Cfg::Gemm;
  COMPASS_NAME_ARGS(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs, workspace);
  check_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  a_q.expect_device(DeviceType::kCUDA);
  COMPASS_CHECK(out_dtype == kOutBF16, "out_dtype: the CUTLASS kernel writes bfloat16 (0), got ",
                out_dtype);
  const int64_t e = b_q.size(0), n = b_q.size(1), k = a_q.size(1);
  const int64_t kb = cdiv(k, kScaleBlock);
  COMPASS_CHECK(k % 16 == 0 && n % 8 == 0 && a_q.strides[0] % 16 == 0 && out.strides[0] % 8 == 0,
                "a_q, out: the CUTLASS kernel needs K % 16 == 0, N % 8 == 0 and 16-byte row "
                "strides (TMA), got K = ", k, ", N = ", n);
  COMPASS_CHECK(a_scales.strides[0] == kb && a_scales.strides[1] == 1,
                "a_scales: the CUTLASS kernel needs K-major contiguous scales (strides (",
                kb, ", 1)), got (", a_scales.strides[0], ", ", a_scales.strides[1], ")");
  COMPASS_CHECK(b_scales.is_contiguous() && b_q.is_contiguous(),
                "b_q, b_scales: the CUTLASS kernel needs contiguous weights and scales");
  const Sm90WorkspaceLayout layout = workspace_layout<Cfg>(e, sm_count);
  workspace.expect_vector().expect_dtype(DType::kUInt8);
  COMPASS_CHECK(workspace.numel() >= layout.total, "workspace: expected at least ", layout.total,
                " bytes for tile configuration ", name, ", got ", workspace.numel());
  auto* base = static_cast<uint8_t*>(workspace.data);
  COMPASS_CHECK(reinterpret_cast<uintptr_t>(base) % kSm90WorkspaceAlign == 0,
                "workspace: expected a ", kSm90WorkspaceAlign,
                "-byte aligned start (CUTLASS keeps its TMA descriptors there), got address ",
                reinterpret_cast<uintptr_t>(base));
  // TMA reads the operands from their base addresses: 16-byte aligned.
  for (const TensorView* v : {&a_q, &b_q, &out}) {
    COMPASS_CHECK(reinterpret_cast<uintptr_t>(v->data) % 16 == 0, v->name,
                  ": the CUTLASS kernel needs a 16-byte aligned start (TMA), got address ",
                  reinterpret_cast<uintptr_t>(v->data), " (a view at an odd offset?)");
  }
  DeviceGuard guard(a_q.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);

  uint8_t* cutlass_ws = base + layout.cutlass_offset;
  auto* sa = reinterpret_cast<StrideA*>(base + layout.offsets[0]);
  auto* sb = reinterpret_cast<StrideB*>(base + layout.offsets[1]);
  auto* sd = reinterpret_cast<StrideD*>(base + layout.offsets[2]);
  auto* lsfa = reinterpret_cast<LayoutSFA*>(base + layout.offsets[3]);
  auto* lsfb = reinterpret_cast<LayoutSFB*>(base + layout.offsets[4]);
  fill_group_layouts<Cfg><<<static_cast<unsigned>((e + 127) / 128), 128, 0, stream>>>(
      shapes.ptr<int32_t>(), e, a_q.strides[0], out.strides[0], sa, sb, sd, lsfa, lsfb);
  check_launch("fp8.fill_group_layouts");

  auto* p = ptrs.ptr<int64_t>();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(e), reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(shapes.data),
       nullptr},
      {reinterpret_cast<const ElementA**>(p + kPtrA * e), sa,
       reinterpret_cast<const ElementB**>(p + kPtrB * e), sb,
       reinterpret_cast<const float**>(p + kPtrSFA * e), lsfa,
       reinterpret_cast<const float**>(p + kPtrSFB * e), lsfb},
      {{}, nullptr, nullptr, reinterpret_cast<ElementD**>(p + kPtrD * e), sd}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.device_id = a_q.device_id;
  args.hw_info.sm_count = static_cast<int>(sm_count);

  Gemm gemm;
  COMPASS_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, "fp8 (", name,
                "): CUTLASS cannot run this problem (alignment or shape)");
  auto st = gemm.initialize(args, cutlass_ws, stream);
  COMPASS_CHECK(st == cutlass::Status::kSuccess, "fp8 (", name, "): CUTLASS initialize failed");
  st = gemm.run(stream);
  COMPASS_CHECK(st == cutlass::Status::kSuccess, "fp8 (", name, "): CUTLASS launch failed");
  check_launch("fp8.grouped_gemm_sm90");
}

}  // namespace sm90
}  // namespace fp8
}  // namespace compass
