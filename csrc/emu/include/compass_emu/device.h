// CUDA device-side keywords and intrinsics for emulated builds.
//
// Keywords become plain C++ (a kernel is an ordinary function the emulator
// calls once per CUDA thread, each on its own fiber); `__shared__` variables
// become static thread_local storage, which the emulator race-checks and
// checks for reads of bytes no thread of the block wrote; indices and collectives call into the emulator.
//
// Calls pass their source location (__builtin_FILE/LINE as default
// arguments) so that a report names the line of the barrier or shuffle.
//
// Adding an intrinsic: write it here with CUDA's signature. Anything that only
// computes on its arguments is plain C++; anything that talks to other threads
// goes through compass::emu::warp_op / block_barrier; an atomic calls
// compass::emu::atomic_access first (COMPASS_EMU_UNCHECKED keeps its own
// read-modify-write out of the race check).
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "compass_emu/runtime.h"

// ---------------------------------------------------------------- keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// Thread-local to the launching OS thread: the emulator classifies every
// access inside this module's TLS block as shared memory (kernel code has no
// other thread_local data). A linker section would be simpler, but GCC drops
// section attributes on static locals of templates.
#define __shared__ static thread_local
#define __constant__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __restrict__ is a GCC/Clang keyword already.

// Not instrumented: the emulator's own reads and writes inside intrinsics.
#define COMPASS_EMU_UNCHECKED __attribute__((no_sanitize("kernel-address"))) inline

#define threadIdx (::compass::emu::thread_idx())
#define blockIdx (::compass::emu::block_idx())
#define blockDim (::compass::emu::block_dim())
#define gridDim (::compass::emu::grid_dim())
constexpr int warpSize = 32;

#define COMPASS_EMU_SRC const char *file = __builtin_FILE(), int line = __builtin_LINE()

// ---------------------------------------------------------------- barriers
inline void __syncthreads(COMPASS_EMU_SRC) {
  compass::emu::block_barrier(compass::emu::BarrierOp::kSync, 0, file, line);
}
inline int __syncthreads_count(int pred, COMPASS_EMU_SRC) {
  return compass::emu::block_barrier(compass::emu::BarrierOp::kCount, pred, file, line);
}
inline int __syncthreads_and(int pred, COMPASS_EMU_SRC) {
  return compass::emu::block_barrier(compass::emu::BarrierOp::kAnd, pred, file, line);
}
inline int __syncthreads_or(int pred, COMPASS_EMU_SRC) {
  return compass::emu::block_barrier(compass::emu::BarrierOp::kOr, pred, file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, COMPASS_EMU_SRC) {
  compass::emu::warp_op(compass::emu::WarpOp::kSyncWarp, mask, nullptr, 0, 0, 32, nullptr, file,
                        line);
}
// Memory fences order nothing here: threads run one at a time.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap(COMPASS_EMU_SRC) {
  compass::emu::trap("__trap()", file, line);
}

// --------------------------------------------------------- warp collectives
namespace compass {
namespace emu {
template <typename T>
inline T warp_value_op(WarpOp op, unsigned mask, T v, int arg, int width, const char* file,
                       int line) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "warp collectives move trivially copyable values of at most 8 bytes");
  T out;
  warp_op(op, mask, &v, sizeof(T), arg, width, &out, file, line);
  return out;
}
}  // namespace emu
}  // namespace compass

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize, COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op(compass::emu::WarpOp::kShflIdx, mask, v, src, width, file,
                                     line);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize,
                        COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op(compass::emu::WarpOp::kShflUp, mask, v,
                                     static_cast<int>(delta), width, file, line);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize,
                          COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op(compass::emu::WarpOp::kShflDown, mask, v,
                                     static_cast<int>(delta), width, file, line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize,
                         COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op(compass::emu::WarpOp::kShflXor, mask, v, lane_mask, width,
                                     file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op<unsigned>(compass::emu::WarpOp::kBallot, mask, pred != 0, 0,
                                               32, file, line);
}
inline int __any_sync(unsigned mask, int pred, COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op<int>(compass::emu::WarpOp::kAny, mask, pred != 0, 0, 32,
                                          file, line);
}
inline int __all_sync(unsigned mask, int pred, COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op<int>(compass::emu::WarpOp::kAll, mask, pred != 0, 0, 32,
                                          file, line);
}
// The lanes converged at this call: those of the warp that wait at this same
// line once every live lane of the warp has reached some collective.
inline unsigned __activemask(COMPASS_EMU_SRC) {
  return compass::emu::warp_value_op<unsigned>(compass::emu::WarpOp::kActiveMask, 0u, 0u, 0, 32,
                                               file, line);
}
#define COMPASS_EMU_REDUCE(name, op, T)                                                   \
  inline T name(unsigned mask, T v, COMPASS_EMU_SRC) {                                    \
    return compass::emu::warp_value_op<T>(compass::emu::WarpOp::op, mask, v,             \
                                          std::is_signed<T>::value, 32, file, line);      \
  }
COMPASS_EMU_REDUCE(__reduce_add_sync, kReduceAdd, unsigned)
COMPASS_EMU_REDUCE(__reduce_add_sync, kReduceAdd, int)
COMPASS_EMU_REDUCE(__reduce_min_sync, kReduceMin, unsigned)
COMPASS_EMU_REDUCE(__reduce_min_sync, kReduceMin, int)
COMPASS_EMU_REDUCE(__reduce_max_sync, kReduceMax, unsigned)
COMPASS_EMU_REDUCE(__reduce_max_sync, kReduceMax, int)
COMPASS_EMU_REDUCE(__reduce_and_sync, kReduceAnd, unsigned)
COMPASS_EMU_REDUCE(__reduce_or_sync, kReduceOr, unsigned)
COMPASS_EMU_REDUCE(__reduce_xor_sync, kReduceXor, unsigned)
#undef COMPASS_EMU_REDUCE

// ------------------------------------------------------------------ memory
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// Atomics: threads run one at a time, so a plain read-modify-write is atomic.
#define COMPASS_EMU_ATOMIC(name, T, expr)               \
  COMPASS_EMU_UNCHECKED T name(T* addr, T val) {        \
    compass::emu::atomic_access(addr, sizeof(T), #name); \
    const T old = *addr;                                \
    *addr = (expr);                                     \
    return old;                                         \
  }
#define COMPASS_EMU_ATOMIC_ARITH(T)                                  \
  COMPASS_EMU_ATOMIC(atomicAdd, T, old + val)                        \
  COMPASS_EMU_ATOMIC(atomicExch, T, val)
#define COMPASS_EMU_ATOMIC_INT(T)                                    \
  COMPASS_EMU_ATOMIC_ARITH(T)                                        \
  COMPASS_EMU_ATOMIC(atomicSub, T, old - val)                        \
  COMPASS_EMU_ATOMIC(atomicMax, T, old < val ? val : old)            \
  COMPASS_EMU_ATOMIC(atomicMin, T, val < old ? val : old)            \
  COMPASS_EMU_ATOMIC(atomicAnd, T, old & val)                        \
  COMPASS_EMU_ATOMIC(atomicOr, T, old | val)                         \
  COMPASS_EMU_ATOMIC(atomicXor, T, old ^ val)
COMPASS_EMU_ATOMIC_INT(int)
COMPASS_EMU_ATOMIC_INT(unsigned int)
COMPASS_EMU_ATOMIC_INT(unsigned long long)
COMPASS_EMU_ATOMIC(atomicMax, long long, old < val ? val : old)
COMPASS_EMU_ATOMIC(atomicMin, long long, val < old ? val : old)
COMPASS_EMU_ATOMIC_ARITH(float)
COMPASS_EMU_ATOMIC(atomicAdd, double, old + val)
#undef COMPASS_EMU_ATOMIC_INT
#undef COMPASS_EMU_ATOMIC_ARITH
#undef COMPASS_EMU_ATOMIC

#define COMPASS_EMU_CAS(T)                                           \
  COMPASS_EMU_UNCHECKED T atomicCAS(T* addr, T compare, T val) {     \
    compass::emu::atomic_access(addr, sizeof(T), "atomicCAS");       \
    const T old = *addr;                                             \
    if (old == compare) *addr = val;                                 \
    return old;                                                      \
  }
COMPASS_EMU_CAS(int)
COMPASS_EMU_CAS(unsigned int)
COMPASS_EMU_CAS(unsigned long long)
COMPASS_EMU_CAS(unsigned short)
#undef COMPASS_EMU_CAS

// ------------------------------------------------------------------- math
// Float math is the host's libm (correctly rounded where CUDA's is, within a
// few ulp elsewhere); the fast approximations (__expf, __fdividef...) are
// computed exactly, so a tolerance tuned here may be too tight on a GPU.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __dmul_rn(double x, double y) { return x * y; }
inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

// CUDA's global min/max overloads (device functions in the CUDA headers).
#define COMPASS_EMU_MINMAX(T)                          \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
COMPASS_EMU_MINMAX(int)
COMPASS_EMU_MINMAX(unsigned int)
COMPASS_EMU_MINMAX(long)
COMPASS_EMU_MINMAX(unsigned long)
COMPASS_EMU_MINMAX(long long)
COMPASS_EMU_MINMAX(unsigned long long)
#undef COMPASS_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ------------------------------------------------------------ bits / casts
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <typename To, typename From>
inline To compass_emu_bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit cast between sizes");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
inline int __float_as_int(float x) { return compass_emu_bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return compass_emu_bit_cast<unsigned>(x); }
inline float __int_as_float(int x) { return compass_emu_bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return compass_emu_bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return compass_emu_bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return compass_emu_bit_cast<double>(x); }
