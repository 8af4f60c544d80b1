// Tile configurations of the CUTLASS sm_90a grouped GEMM and the heuristic
// that chooses among them from shapes only (no host sync: the per-expert
// counts live on the device). Plain C++, unit-tested on the CPU
// (tests/test_fp8_tiles.py through fp8.choose_sm90_tile).
//
// Each configuration is one translation unit (grouped_gemm_sm90_m64.cu, _m128.cu):
//   kSm90M64   64x128x128, pingpong: two consumer warpgroups, each on its own
//              64-row tile, one's MMA overlapping the other's epilogue. For
//              decode-sized groups: an expert with a few tokens wastes at most
//              63 masked rows of MMA instead of 127.
//   kSm90M128  128x128x128, cooperative: both consumer warpgroups on one
//              128-row tile (64 rows each); every weight tile loaded serves
//              twice the rows. For prefill-sized groups.
#pragma once

#include <cstdint>

namespace compass {
namespace fp8 {

enum Sm90Tile : int64_t { kSm90M64 = 0, kSm90M128 = 1, kNumSm90Tiles = 2 };

constexpr int64_t sm90_tile_rows(int64_t tile) { return tile == kSm90M64 ? 64 : 128; }

// rows = M (all experts' token rows), experts = E, n = N, sm_count = SMs.
// 64-row tiles when the mean group is at most 64 rows (the masked tail of a
// 128-row tile would be at least half of the work), or when 128-row tiles
// cannot fill the GPU once (fewer tiles than SMs even if all rows packed
// into full tiles: halving the tile height doubles the parallelism for free,
// since such a GEMM is bound by streaming the weights, not by MMA).
// Otherwise 128-row tiles.
inline Sm90Tile choose_sm90_tile(int64_t rows, int64_t experts, int64_t n, int64_t sm_count) {
  if (experts <= 0 || rows <= 64 * experts) return kSm90M64;
  const int64_t n_tiles = (n + 127) / 128;
  const int64_t full_tiles_128 = (rows + 127) / 128 * n_tiles;
  if (full_tiles_128 < sm_count) return kSm90M64;
  return kSm90M128;
}

}  // namespace fp8
}  // namespace compass
