// Host entry points of the FP8 grouped expert GEMM (the argument builder's
// CPU backend; the CUTLASS sm_90a GEMM), bound one line
// each in bindings.cpp. Arguments are borrowed views; outputs are written in
// place. check_grouped_gemm_args runs every dtype/shape/device check before
// any launch. Spec: compass_kernels/fp8/reference_gemm.py (the CPU backend is
// torch there).
#pragma once

#include <cstdint>
#include <vector>

#include "compass/fp8.h"
#include "compass/tensor_view.h"

namespace compass {
namespace fp8 {

// a_q [M, K] float8_e4m3fn (unit stride along K), token-packed: rows
// [expert_offsets[e], expert_offsets[e+1]) belong to expert e, no padding;
// a_scales [M, ceil(K/128)] float32, any strides (K-major or MN-major);
// b_q [E, N, K] float8_e4m3fn (unit stride along K); b_scales
// [E, ceil(N/128), ceil(K/128)] float32, any strides; expert_offsets [E+1]
// int64; out_dtype 0 = bfloat16, 1 = float32 (must be out's dtype); out [M, N]
// (unit stride along N).
#define COMPASS_FP8_GROUPED_GEMM_ARGS                                                   \
  TensorView a_q, TensorView a_scales, TensorView b_q, TensorView b_scales,             \
      TensorView expert_offsets, int64_t out_dtype, TensorView out

// The argument builder (CPU: grouped_args_cpu.cpp; GPU: Triton,
// compass_kernels/fp8/triton_args.py): the GEMM's operands as above (out_dtype implied by
// out), plus outputs shapes [E, 3] int32 (M_e, N, K) and ptrs [5, E] int64
// (rows PtrRow: A, B, SFA, SFB, D addresses per expert).
#define COMPASS_FP8_GROUPED_ARGS_ARGS                                                   \
  TensorView a_q, TensorView a_scales, TensorView b_q, TensorView b_scales,             \
      TensorView expert_offsets, TensorView out, TensorView shapes, TensorView ptrs

enum OutDType : int64_t { kOutBF16 = 0, kOutF32 = 1 };

// Shared by every backend (views named by the caller's COMPASS_NAME_ARGS):
// dtypes, ranks, sizes, unit inner strides, same device. Offsets' contents
// are checked by the CPU entry point (host-readable) and, opt-in, in Python.
void check_grouped_gemm_args(COMPASS_FP8_GROUPED_GEMM_ARGS);
// offsets[0] == 0, non-decreasing, offsets[E] == rows (host memory).
void check_offsets_data(const TensorView& expert_offsets, int64_t rows);

// Checks of the builder's arguments, and the layout (base addresses, byte
// strides) it reads: shared by the CPU builder and the CUTLASS entry point.
void check_grouped_args(COMPASS_FP8_GROUPED_ARGS_ARGS);
GroupedLayout grouped_layout(const TensorView& a_q, const TensorView& a_scales,
                             const TensorView& b_q, const TensorView& b_scales,
                             const TensorView& out);
void grouped_args_cpu(COMPASS_FP8_GROUPED_ARGS_ARGS);
// The tile configuration heuristic (sm90_tiles.h), bound for the CPU tests
// and used by the CUDA entry point below.
int64_t choose_sm90_tile_binding(int64_t rows, int64_t experts, int64_t n, int64_t sm_count);
// The workspace layout (sm90_workspace.h), bound for the CPU tests:
// [cutlass_offset, cutlass_bytes, 5 array offsets, total].
std::vector<int64_t> sm90_workspace_layout_binding(int64_t experts, int64_t cutlass_bytes,
                                                  std::vector<int64_t> elem_bytes);
#ifdef COMPASS_WITH_CUDA  // CUTLASS sm_90a (grouped_gemm_sm90.cuh, one TU per tile config)
// Bytes of workspace the CUTLASS grouped GEMM with tile configuration `tile`
// (sm90_tiles.h: Sm90Tile) needs for E experts on sm_count SMs.
int64_t grouped_gemm_sm90_workspace(int64_t tile, int64_t experts, int64_t sm_count);
// Dynamic shared memory per CTA of a configuration (GemmKernel::SharedStorageSize).
int64_t grouped_gemm_sm90_shared_bytes(int64_t tile);
// The GEMM's arguments, then the tile configuration, the builder's shapes /
// ptrs (already filled on the device by the Triton builder), a uint8 workspace,
// the SM count, the stream.
void grouped_gemm_sm90_cuda(COMPASS_FP8_GROUPED_GEMM_ARGS, int64_t tile, TensorView shapes,
                            TensorView ptrs, TensorView workspace, int64_t sm_count,
                            uintptr_t stream);
// One per translation unit (grouped_gemm_sm90_<tile>.cu).
int64_t grouped_gemm_sm90_m64_workspace(int64_t experts, int64_t sm_count);
int64_t grouped_gemm_sm90_m64_shared_bytes();
void grouped_gemm_sm90_m64(COMPASS_FP8_GROUPED_GEMM_ARGS, TensorView shapes, TensorView ptrs,
                           TensorView workspace, int64_t sm_count, uintptr_t stream);
int64_t grouped_gemm_sm90_m128_workspace(int64_t experts, int64_t sm_count);
int64_t grouped_gemm_sm90_m128_shared_bytes();
void grouped_gemm_sm90_m128(COMPASS_FP8_GROUPED_GEMM_ARGS, TensorView shapes, TensorView ptrs,
                            TensorView workspace, int64_t sm_count, uintptr_t stream);
#endif

}  // namespace fp8
}  // namespace compass
