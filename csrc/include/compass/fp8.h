// FP8 (e4m3fn) blockwise quantization: the per-element math shared by the C++
// (CPU) and CUDA kernels, so the CPU tests run the lines the GPU runs.
// Spec: compass_kernels/fp8/reference.py; conventions: docs/design.md (FP8).
//
// A block (a 128x128 weight tile or a 1x128 activation group) gets
//   amax  = max(max |x|, eps)                      (fp32; eps: the all-zero floor)
//   scale = amax / 448                             (fp32, IEEE division)
//   scale = 2^ceil(log2(scale))  if ue8m0          (exact: the next power of two)
//   q     = e4m3(clamp(x * (1 / scale)))  "recip"  (DeepGEMM / vLLM weights)
//         = e4m3(clamp(x / scale))        "div"    (vLLM's CUDA activation quant)
// with e4m3() round-to-nearest-even, saturating at +-448, subnormals kept.
//
// The namespace is compass::fp8_math, not compass::fp8: an emulator mutant of
// this header (cmake/emu.cmake) moves it into an inline namespace, which must
// not capture the entry points and argument checks of compass::fp8.
#pragma once

#include <cstdint>
#include <cstring>

#include "compass/common.h"

namespace compass {
namespace fp8_math {

constexpr float kE4M3Max = 448.0f;
constexpr uint32_t kF32AbsMask = 0x7fffffffu;
constexpr uint32_t kF32Inf = 0x7f800000u;

COMPASS_HD uint32_t f32_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

COMPASS_HD float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// fp32 -> e4m3fn bits, round-to-nearest-even, saturating (|x| >= 448 and
// +-inf give +-448), NaN -> 0x7f with the sign, subnormals (steps of 2^-9)
// kept. Branch-free (selects), so the CPU loop vectorizes and GPU warps do not
// diverge. The hardware cvt.rn.satfinite.e4m3x2.f32 of sm_89+ gives the same
// bits; this portable form is what the emulator and the CPU can run too.
COMPASS_HD uint8_t e4m3_from_f32(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & kF32AbsMask;
  // Normal e4m3 (|x| >= 2^-6): rebias the exponent (127 -> 7) and round the
  // 23-bit mantissa to 3 bits, ties to even; a carry moves into the exponent.
  const uint32_t n = a - (120u << 23);
  const uint32_t normal = (n + 0x7ffffu + ((n >> 20) & 1u)) >> 20;
  // Subnormal e4m3 (|x| < 2^-6): adding 2^14 leaves an fp32 whose ulp is 2^-9,
  // so the hardware add rounds |x| to the e4m3 subnormal grid (ties to even);
  // the low mantissa bits are then the count of 2^-9 steps (0..8, 8 = 2^-6).
#ifdef __CUDA_ARCH__
  const float shifted = __fadd_rn(f32_from_bits(a), 16384.0f);  // never contracted
#else
  const float shifted = f32_from_bits(a) + 16384.0f;
#endif
  const uint32_t sub = f32_bits(shifted) - 0x46800000u;
  // Selects as masks: GCC if-converts ?: here only partly, and then does not
  // vectorize the CPU loop at all ("control flow in loop").
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x3c800000u);  // < 2^-6
  const uint32_t is_sat = 0u - static_cast<uint32_t>(a >= 0x43e00000u);  // >= 448, inf
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > kF32Inf);
  uint32_t r = (sub & is_sub) | (normal & ~is_sub);
  r = (0x7eu & is_sat) | (r & ~is_sat);
  r = (0x7fu & is_nan) | (r & ~is_nan);
  return static_cast<uint8_t>(sign | r);
}

// e4m3fn bits -> fp32 (exact).
COMPASS_HD float f32_from_e4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
  if ((b & 0x7fu) == 0x7fu) return f32_from_bits(sign | 0x7fc00000u);
  const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f  // m * 2^-9
                           : f32_from_bits(((e + 120u) << 23) | (m << 20));
  return f32_from_bits(sign | f32_bits(mag));
}

// bf16 / fp16 storage (uint16_t) -> fp32, exact.
COMPASS_HD float f32_from_bf16(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

COMPASS_HD float f32_from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = 0x7f800000u | (m << 13);  // inf / NaN
  } else if (e != 0) {
    bits = ((e + 112u) << 23) | (m << 13);
  } else {  // zero or subnormal: m * 2^-24, exact in fp32
    bits = f32_bits(static_cast<float>(m) * 5.9604644775390625e-08f);
  }
  return f32_from_bits(sign | bits);
}

// fp32 -> bf16 bits, round-to-nearest-even (NaN stays NaN).
COMPASS_HD uint16_t bf16_from_f32(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & kF32AbsMask) > kF32Inf) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// bf16 / fp16 storage as distinct types (for dtype dispatch): raw bits.
struct Bf16Bits { uint16_t bits; };
struct F16Bits { uint16_t bits; };

// Per input type: its fp32 value, and |x| as integer bits whose order is the
// order of |x| for finite values (a block's amax is then an integer max, which
// vectorizes on the CPU), with the first non-finite |x| pattern.
template <typename T> struct Elem;
template <> struct Elem<float> {
  using Bits = uint32_t;
  static constexpr uint32_t kNonFinite = kF32Inf;
  COMPASS_HD static float value(float v) { return v; }
  COMPASS_HD static uint32_t abs_bits(float v) { return f32_bits(v) & kF32AbsMask; }
  COMPASS_HD static float from_abs_bits(uint32_t b) { return f32_from_bits(b); }
};
template <> struct Elem<Bf16Bits> {
  using Bits = uint16_t;
  static constexpr uint16_t kNonFinite = 0x7f80u;
  COMPASS_HD static float value(Bf16Bits v) { return f32_from_bf16(v.bits); }
  COMPASS_HD static uint16_t abs_bits(Bf16Bits v) { return v.bits & 0x7fffu; }
  COMPASS_HD static float from_abs_bits(uint16_t b) { return f32_from_bf16(b); }
};
template <> struct Elem<F16Bits> {
  using Bits = uint16_t;
  static constexpr uint16_t kNonFinite = 0x7c00u;
  COMPASS_HD static float value(F16Bits v) { return f32_from_f16(v.bits); }
  COMPASS_HD static uint16_t abs_bits(F16Bits v) { return v.bits & 0x7fffu; }
  COMPASS_HD static float from_abs_bits(uint16_t b) { return f32_from_f16(b); }
};

// The block scale from the block's amax (fp32 bits of max |x|).
COMPASS_HD float block_scale(float amax, float eps, bool ue8m0) {
  const float a = amax > eps ? amax : eps;
  float s = a / kE4M3Max;
  if (ue8m0) {
    // The smallest power of two >= s (s is normal: eps / 448 >> FLT_MIN for
    // any eps the API accepts): bump the exponent if any mantissa bit is set.
    const uint32_t b = f32_bits(s);
    const uint32_t e = (b >> 23) + ((b & 0x7fffffu) != 0u ? 1u : 0u);
    s = f32_from_bits(e << 23);
  }
  return s;
}

// One element with its block's scale: q bits. `inv` = 1 / scale (correctly
// rounded), used when !use_div.
COMPASS_HD uint8_t quantize_value(float x, float scale, float inv, bool use_div) {
  const float y = use_div ? x / scale : x * inv;
  return e4m3_from_f32(y);  // saturates: no separate clamp needed
}

}  // namespace fp8_math
}  // namespace compass
