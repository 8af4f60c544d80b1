// THD pack / unpack / positions on CUDA. Generic code, built for
// COMPASS_CUDA_ARCHS and for the CPU by the emulator (docs/emulation.md).
//
// No host sync: every size comes from the host plan (total rows, row bytes);
// per-sequence metadata is a few small device vectors. Each thread moves one
// unit (8/4/2/1 bytes, the widest that divides the row and both base
// addresses) of one row; a warp then reads and writes contiguous bytes. The
// row's sequence is a binary search over the m + 1 offsets (cached in L1/L2:
// m is a micro-batch's sequence count, ~10..1000).
#include <cuda_runtime.h>

#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"
#include "compass/packing.h"
#include "packing/packing_api.h"

namespace compass {
namespace packing {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride beyond this

unsigned blocks_for(int64_t units) {
  const int64_t b = (units + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

template <typename U>
__global__ void pack_kernel(const U* __restrict__ src, int64_t upr, const int64_t* __restrict__ start,
                            const int64_t* __restrict__ len, const int64_t* __restrict__ off,
                            int64_t m, int64_t cp, int64_t rank, U fill, int64_t units,
                            U* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < units;
       i += stride) {
    const int64_t row = i / upr, e = i - row * upr;
    const int64_t j = thd_find_segment(off, m, row);
    const int64_t p = thd_zigzag_position(row - off[j], off[j + 1] - off[j], cp, rank);
    out[i] = p < len[j] ? src[(start[j] + p) * upr + e] : fill;
  }
}

template <typename U>
__global__ void unpack_kernel(const U* __restrict__ packed, int64_t upr,
                              const int64_t* __restrict__ cu, const int64_t* __restrict__ off,
                              int64_t m, int64_t cp, int64_t rows_per_rank, int64_t units,
                              U* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < units;
       i += stride) {
    const int64_t row = i / upr, e = i - row * upr;
    const int64_t j = thd_find_segment(cu, m, row);
    int64_t rank = 0;
    const int64_t u = thd_zigzag_slot(row - cu[j], off[j + 1] - off[j], cp, &rank);
    out[i] = packed[(rank * rows_per_rank + off[j] + u) * upr + e];
  }
}

__global__ void positions_kernel(const int64_t* __restrict__ off, int64_t m, int64_t cp,
                                 int64_t rank, int64_t total, int64_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t j = thd_find_segment(off, m, i);
    out[i] = thd_zigzag_position(i - off[j], off[j + 1] - off[j], cp, rank);
  }
}

// The widest unit (8, 4, 2 or 1 bytes) dividing the row and every base address.
int unit_bytes(int64_t row_bytes, const void* a, const void* b) {
  const auto bits = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(a) |
                    reinterpret_cast<uintptr_t>(b);
  for (int s = 8; s > 1; s /= 2) {
    if (bits % s == 0) return s;
  }
  return 1;
}

template <typename F>
void with_unit(int bytes, F&& f) {
  switch (bytes) {
    case 8: return f(uint64_t{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return f(uint8_t{});
  }
}

template <typename U>
U replicate(int64_t byte) {
  U v = 0;
  for (size_t k = 0; k < sizeof(U); ++k) v = static_cast<U>((v << 8) | static_cast<U>(byte));
  return v;
}

}  // namespace

void thd_pack_cuda(COMPASS_THD_PACK_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(src, seq_start, seqlens, out_offsets, out);
  check_thd_pack_args(src, seq_start, seqlens, out_offsets, cp_size, cp_rank, fill, total, out);
  src.expect_device(DeviceType::kCUDA);
  const int64_t m = seqlens.numel(), w = src.size(1);
  if (total == 0 || w == 0) return;
  DeviceGuard guard(src.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_unit(unit_bytes(w, src.data, out.data), [&](auto tag) {
    using U = decltype(tag);
    const int64_t upr = w / static_cast<int64_t>(sizeof(U)), units = total * upr;
    compass::launch<pack_kernel<U>>(blocks_for(units), kThreads, 0, stream, src.ptr<U>(), upr,
        seq_start.ptr<int64_t>(), seqlens.ptr<int64_t>(), out_offsets.ptr<int64_t>(), m, cp_size,
        cp_rank, replicate<U>(fill), units, out.ptr<U>());
  });
  check_launch("packing.pack_kernel");
}

void thd_unpack_cuda(COMPASS_THD_UNPACK_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(packed, seqlens, cu_seqlens, out_offsets, out);
  check_thd_unpack_args(packed, seqlens, cu_seqlens, out_offsets, cp_size, total, out);
  packed.expect_device(DeviceType::kCUDA);
  const int64_t m = seqlens.numel(), w = packed.size(1);
  if (total == 0 || w == 0) return;
  DeviceGuard guard(packed.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_unit(unit_bytes(w, packed.data, out.data), [&](auto tag) {
    using U = decltype(tag);
    const int64_t upr = w / static_cast<int64_t>(sizeof(U)), units = total * upr;
    compass::launch<unpack_kernel<U>>(blocks_for(units), kThreads, 0, stream, packed.ptr<U>(),
        upr, cu_seqlens.ptr<int64_t>(), out_offsets.ptr<int64_t>(), m, cp_size,
        packed.size(0) / cp_size, units, out.ptr<U>());
  });
  check_launch("packing.unpack_kernel");
}

void thd_positions_cuda(COMPASS_THD_POSITIONS_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(out_offsets, out);
  check_thd_positions_args(out_offsets, cp_size, cp_rank, total, out);
  out_offsets.expect_device(DeviceType::kCUDA);
  if (total == 0) return;
  DeviceGuard guard(out.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  compass::launch<positions_kernel>(blocks_for(total), kThreads, 0, stream,
      out_offsets.ptr<int64_t>(), out_offsets.numel() - 1, cp_size, cp_rank, total,
      out.ptr<int64_t>());
  check_launch("packing.positions_kernel");
}

}  // namespace packing
}  // namespace compass
