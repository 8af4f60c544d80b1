// Set-coding encoder on CUDA: ids [rows, K] (uint8 | int16, on the device) ->
// the payload of codec "set", byte for byte what the CPU encoder writes
// (codec_cpu.cpp; the format: setcode.h). Generic code (no Hopper-only
// instructions); built for COMPASS_CUDA_ARCHS and, for the tests, by the
// emulator (docs/emulation.md).
//
// Two launches on the caller's stream, no host sync:
// 1. table_kernel (one block): the binomial table C(a, m), m in [1, K], a in
//    [0, E), saturated at 2^64 - 1, into `table` (int64 [K * E], a workspace
//    output): level 1 is C(a, 1) = a, level m the exclusive prefix sum of level
//    m - 1 (C(a, m) = sum_{b < a} C(b, m - 1)), adds saturating; and status =
//    (0 bad rows, first bad row = -1).
// 2. encode_kernel: a block of kPacks threads owns kPacks consecutive packs, a
//    multiple of 64, so its bits [q0 B, (q0 + kPacks) B) start and end on a
//    64-bit word. Thread t ranks the G rows of pack q0 + t (r = sum_i C(a_i, 1 +
//    #{j : a_j < a_i}): no sort; the row is valid iff every id is in [0, E) and
//    the below counts sum to K (K - 1) / 2), folds them into the pack value
//    v = r_0 + N (r_1 + ...) and leaves it in shared memory; after a barrier,
//    thread t assembles 64-bit word t of the block from the (at most three:
//    B >= 32) packs overlapping it. Bit offsets are int64 (rows x B passes 2^31
//    at 44M rows of DeepSeek-V3 layers). A bad row counts in status[0], its
//    index goes to status[1] (atomicMin: the first one), and it is coded as
//    rank 0; missing rows are coded as rank 0 without being read.
//
// The CRC of the trace header is computed on the host over the body once the
// payload is there (compass_kernels/routing/codec.py): returning bytes needs
// the one device-to-host copy anyway.
#include <cuda_runtime.h>

#include <cstdint>

#include "compass/cuda_utils.cuh"
#include "compass/launch.cuh"
#include "routing/codec_args.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {

namespace {

constexpr int kPacks = 256;         // packs (and threads) per block: a multiple of 64
constexpr int kTableThreads = 256;  // the table kernel's block
constexpr unsigned long long kSat = ~0ull;

__device__ __forceinline__ unsigned long long sat_add(unsigned long long a, unsigned long long b) {
  const unsigned long long s = a + b;
  return s < a ? kSat : s;
}

// One block. table[(m - 1) * e + a] = C(a, m) (saturated). Each thread owns a
// contiguous segment of a; per level: segment sums, a block scan of the sums
// (Hillis-Steele over kTableThreads, saturating), then the segment's exclusive
// prefix written back.
__global__ void table_kernel(int32_t e, int32_t k, unsigned long long* __restrict__ table,
                             unsigned long long* __restrict__ status) {
  __shared__ unsigned long long scan[kTableThreads];
  if (threadIdx.x == 0) {
    status[0] = 0;
    status[1] = kSat;  // -1 as int64: no bad row
  }
  const int per = (e + kTableThreads - 1) / kTableThreads;
  const int a0 = min(e, static_cast<int>(threadIdx.x) * per), a1 = min(e, a0 + per);
  for (int a = a0; a < a1; ++a) table[a] = static_cast<unsigned long long>(a);
  for (int m = 2; m <= k; ++m) {
    const unsigned long long* prev = table + static_cast<int64_t>(m - 2) * e;
    unsigned long long* cur = table + static_cast<int64_t>(m - 1) * e;
    unsigned long long sum = 0;
    for (int a = a0; a < a1; ++a) sum = sat_add(sum, prev[a]);
    scan[threadIdx.x] = sum;
    __syncthreads();
    for (int d = 1; d < kTableThreads; d *= 2) {
      const int t = static_cast<int>(threadIdx.x);
      const unsigned long long add = t >= d ? scan[t - d] : 0;
      __syncthreads();
      scan[threadIdx.x] = sat_add(scan[threadIdx.x], add);
      __syncthreads();
    }
    unsigned long long run = threadIdx.x > 0 ? scan[threadIdx.x - 1] : 0;  // exclusive
    for (int a = a0; a < a1; ++a) {
      const unsigned long long x = prev[a];
      cur[a] = run;
      run = sat_add(run, x);
    }
    __syncthreads();  // level m lands before level m + 1 reads it; scan reused
  }
}

// Rank of one row, or ok = false (an id outside [0, e), or one twice). The ids
// are re-read from the row (L1) instead of a local array: with K fixed the
// unrolled loads stay in registers, and the generic K <= 64 kernel keeps no
// stack frame either.
template <typename I, int KC>
__device__ __forceinline__ unsigned long long rank_row(const I* __restrict__ x, int k, int e,
                                                       const unsigned long long* __restrict__ table,
                                                       bool& ok) {
  const int kk = KC > 0 ? KC : k;
  bool in_range = true;
#pragma unroll
  for (int i = 0; i < kk; ++i) {
    const int a = static_cast<int>(x[i]);
    in_range &= a >= 0 && a < e;
  }
  if (!in_range) {
    ok = false;
    return 0;
  }
  unsigned long long r = 0;
  int below_sum = 0;
#pragma unroll
  for (int i = 0; i < kk; ++i) {
    const int a = static_cast<int>(x[i]);
    int below = 0;
#pragma unroll
    for (int j = 0; j < kk; ++j) below += static_cast<int>(x[j]) < a;
    below_sum += below;
    r += table[static_cast<int64_t>(below) * e + a];  // C(a_i, below + 1)
  }
  ok = below_sum == kk * (kk - 1) / 2;
  return ok ? r : 0;
}

template <typename I, int KC>
__global__ void encode_kernel(const I* __restrict__ ids, const bool* __restrict__ missing,
                              int64_t rows, int32_t k, int32_t e,
                              const unsigned long long* __restrict__ table, unsigned long long n,
                              int32_t group, int32_t bits, int64_t packs, int64_t nbytes,
                              uint8_t* __restrict__ out, unsigned long long* __restrict__ status) {
  __shared__ unsigned long long vals[kPacks];
  const int kk = KC > 0 ? KC : k;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kPacks;
  const int64_t p = q0 + threadIdx.x;
  unsigned long long v = 0;
  if (p < packs) {
    const int64_t r0 = p * group;
    const int64_t r1 = min(rows, r0 + group);
    for (int64_t r = r1 - 1; r >= r0; --r) {  // v = r_0 + N (r_1 + N (...))
      unsigned long long rank = 0;
      if (missing == nullptr || !missing[r]) {
        bool ok = true;
        rank = rank_row<I, KC>(ids + r * kk, kk, e, table, ok);
        if (!ok) {
          atomicAdd(status, 1ull);
          atomicMin(status + 1, static_cast<unsigned long long>(r));
        }
      }
      v = v * n + rank;
    }
  }
  vals[threadIdx.x] = v;
  __syncthreads();
  if (bits == 0) return;  // K == E: only the checks
  const int64_t block_bits = (min(packs, q0 + kPacks) - q0) * bits;
  const int64_t words = (block_bits + 63) / 64;  // <= bits * kPacks / 64 <= kPacks
  if (threadIdx.x >= words) return;
  const int64_t lo = static_cast<int64_t>(threadIdx.x) * 64;  // bit offset in the block
  const int64_t j0 = lo / bits;
  const int64_t j1 = min((lo + 63) / bits, static_cast<int64_t>(kPacks) - 1);
  unsigned long long word = 0;
  for (int64_t j = j0; j <= j1; ++j) {
    const int64_t o = j * bits - lo;  // in (-bits, 64)
    word |= o >= 0 ? vals[j] << o : vals[j] >> -o;
  }
  const int64_t byte = (q0 * bits) / 8 + static_cast<int64_t>(threadIdx.x) * 8;
  if (byte + 8 <= nbytes && (reinterpret_cast<uintptr_t>(out + byte) & 7) == 0) {
    *reinterpret_cast<unsigned long long*>(out + byte) = word;
  } else {
    for (int b = 0; b < 8 && byte + b < nbytes; ++b) {
      out[byte + b] = static_cast<uint8_t>(word >> (8 * b));
    }
  }
}

template <typename I, int KC>
void launch_encode(int64_t blocks, cudaStream_t stream, const I* ids, const bool* missing,
                   int64_t rows, int64_t k, int64_t e, const unsigned long long* table,
                   const setcode::PackLayout& l, int64_t packs, int64_t nbytes, uint8_t* out,
                   unsigned long long* status) {
  compass::launch<encode_kernel<I, KC>>(
      dim3(static_cast<unsigned>(blocks)), kPacks, 0, stream, ids, missing, rows,
      static_cast<int32_t>(k), static_cast<int32_t>(e), table,
      static_cast<unsigned long long>(l.n), static_cast<int32_t>(l.group),
      static_cast<int32_t>(l.bits), packs, nbytes, out, status);
}

}  // namespace

void encode_sets_cuda(COMPASS_ENCODE_SETS_ARGS, uintptr_t stream_handle) {
  COMPASS_NAME_ARGS(ids, missing, payload, status, table);
  const setcode::PackLayout l = check_encode_sets_args(ids, num_experts, missing, payload,
                                                       status, table);
  ids.expect_device(DeviceType::kCUDA);
  const int64_t rows = ids.size(0), k = ids.size(1), e = num_experts;
  const int64_t packs = (rows + l.group - 1) / l.group;
  const int64_t blocks = (packs + kPacks - 1) / kPacks;
  COMPASS_CHECK(blocks <= 0x7fffffff, ids.name, ": ", rows, " rows is past the grid limit");
  DeviceGuard guard(ids.device_id);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto* tab = table.ptr<unsigned long long>();
  auto* st = status.ptr<unsigned long long>();
  compass::launch<table_kernel>(dim3(1), kTableThreads, 0, stream, static_cast<int32_t>(e),
                                static_cast<int32_t>(k), tab, st);
  check_launch("routing.set_code_table_kernel");
  if (blocks == 0) return;
  const bool* miss = missing ? missing->ptr<bool>() : nullptr;
  uint8_t* out = payload.ptr<uint8_t>();
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    const I* x = ids.ptr<I>();
    switch (k) {
#define COMPASS_ENCODE_K(K)                                                                   \
  case K:                                                                                     \
    launch_encode<I, K>(blocks, stream, x, miss, rows, k, e, tab, l, packs, payload.numel(), \
                        out, st);                                                            \
    break;
      COMPASS_ENCODE_K(1) COMPASS_ENCODE_K(2) COMPASS_ENCODE_K(4) COMPASS_ENCODE_K(6)
      COMPASS_ENCODE_K(8)
#undef COMPASS_ENCODE_K
      default:
        launch_encode<I, 0>(blocks, stream, x, miss, rows, k, e, tab, l, packs, payload.numel(),
                            out, st);
    }
  });
  check_launch("routing.set_code_encode_kernel");
}

}  // namespace routing
}  // namespace compass
