// The grouped-GEMM argument builder on CUDA: per-expert problem shapes and
// pointer arrays from the expert offsets, on the device. No host sync (the
// offsets never leave the GPU), fixed grid from E alone, so a grouped GEMM
// launch that follows it can be captured in a CUDA graph. Plain CUDA: built
// for COMPASS_CUDA_ARCHS and run under the CPU emulator in the tests.
#include <cuda_runtime.h>

#include "compass/cuda_utils.cuh"
#include "compass/fp8.h"
#include "compass/launch.cuh"
#include "fp8/fp8_api.h"

namespace compass {
namespace fp8 {

namespace {

constexpr int kArgsThreads = 128;

// One thread per expert (E is 8..384: one or a few blocks).
__global__ void grouped_args_kernel(GroupedLayout g, const int64_t* __restrict__ off,
                                    int64_t experts, int32_t* __restrict__ shapes,
                                    int64_t* __restrict__ ptrs) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  group_args(g, e, experts, off[e], off[e + 1], shapes, ptrs);
}

}  // namespace

void grouped_args_cuda(COMPASS_FP8_GROUPED_ARGS_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  check_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs);
  a_q.expect_device(DeviceType::kCUDA);
  DeviceGuard guard(a_q.device_id);
  const int64_t experts = b_q.size(0);
  const unsigned blocks = static_cast<unsigned>((experts + kArgsThreads - 1) / kArgsThreads);
  compass::launch<grouped_args_kernel>(blocks, kArgsThreads, 0,
      reinterpret_cast<cudaStream_t>(stream_handle), grouped_layout(a_q, a_scales, b_q, b_scales, out),
      expert_offsets.ptr<int64_t>(), experts, shapes.ptr<int32_t>(), ptrs.ptr<int64_t>());
  check_launch("fp8.grouped_args_kernel");
}

}  // namespace fp8
}  // namespace compass
