// THD packing index math shared by the CPU, CUDA (and, by the same formulas,
// Triton) pack / unpack kernels.
//
// Layout: micro-batch sequence j (length len_j >= 1) is padded to P_j, a
// multiple of 2*cp, and cut in 2*cp chunks of c_j = P_j / (2*cp) tokens.
// Context-parallel rank r holds chunks r and 2*cp-1-r, in that order (the
// zigzag that balances causal attention work): local length L_j = P_j / cp =
// 2*c_j, at local offset off[j] of its packed tensor. cp = 1: the whole
// padded sequence, in order.
#pragma once

#include <cstdint>

#include "compass/common.h"

// Functions live in namespace compass itself (not compass::packing), so a
// planted mutant of this header (cmake/emu.cmake wraps it in an inline
// namespace) does not capture the kernels' own namespace.
namespace compass {

// Position in the padded sequence of local slot u (0 <= u < local_len) on rank r.
COMPASS_HD int64_t thd_zigzag_position(int64_t u, int64_t local_len, int64_t cp, int64_t r) {
  if (cp == 1) return u;
  const int64_t c = local_len / 2;
  return u < c ? r * c + u : (2 * cp - 1 - r) * c + (u - c);
}

// Inverse: the rank holding position p of the padded sequence, and its local slot.
COMPASS_HD int64_t thd_zigzag_slot(int64_t p, int64_t local_len, int64_t cp, int64_t* rank) {
  if (cp == 1) {
    *rank = 0;
    return p;
  }
  const int64_t c = local_len / 2;
  const int64_t q = p / c, within = p - q * c;
  if (q < cp) {
    *rank = q;
    return within;
  }
  *rank = 2 * cp - 1 - q;
  return c + within;
}

// The segment j with off[j] <= x < off[j + 1] of a non-decreasing off[0..m]
// (off[0] <= x < off[m]); empty segments are skipped. O(log m).
COMPASS_HD int64_t thd_find_segment(const int64_t* off, int64_t m, int64_t x) {
  int64_t lo = 0, hi = m;  // off[lo] <= x < off[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (off[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace compass
