// Host entry points of ck.packing: the planner (plan_cpu.cpp) and the THD
// pack / unpack kernels (pack_cpu.cpp, pack.cu), bound one line each in
// bindings.cpp. Arguments are borrowed views; outputs are written in place.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "compass/tensor_view.h"

namespace compass {
namespace packing {

// Planner. lengths [n] int64 (>= 1); each is padded to pad_multiple (what
// counts against max_tokens) and balanced by its cost: cost_a * P + cost_b * P^2
// of the padded length P (cost_b = 0: the tokens, in exact int64 arithmetic);
// group_ids [n] int64 or None: sequences of one group stay on one rank.
// Outputs: order [n] int64 (sequence indices, rank-major then micro-batch),
// offsets [n + 1] int64 (micro-batch (r, m) is order[offsets[r*M+m] :
// offsets[r*M+m+1]]). Returns (M, lower bound): M micro-batches per rank
// (offsets[:dp*M+1] is written) and max(total cost / dp, largest item cost).
// Plans whenever a plan exists (within a search budget); a refusal says why.
#define COMPASS_PLAN_ARGS                                                                   \
  TensorView lengths, std::optional<TensorView> group_ids, int64_t dp_size, int64_t max_tokens, \
      int64_t micro_batch_multiple, bool equal_samples, int64_t pad_multiple, double cost_a,   \
      double cost_b, int64_t refine_iters, TensorView order, TensorView offsets

std::pair<int64_t, double> plan_cpu(COMPASS_PLAN_ARGS);

// Reference-grade Karmarkar-Karp (largest differencing, equal-size mode as RL
// frameworks run it; n not a multiple of k gets zero-cost fillers) for the
// bench and as the planner's second seed: rank_of [n] int64 written.
void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of);

// THD pack / unpack (compass/packing.h has the layout). Rows are opaque bytes:
// every per-token tensor [T, ...] of any dtype travels as uint8 [T, W].
// pack: src [Ts, W] uint8 (the batch's tokens, jagged); seq_start [m] int64
// (first source row of each micro-batch sequence), seqlens [m] int64 (>= 1),
// out_offsets [m + 1] int64 (local packed offsets: increments P_j / cp);
// fill: the byte written to padding; total = out_offsets[m]; out [total, W].
#define COMPASS_THD_PACK_ARGS                                                             \
  TensorView src, TensorView seq_start, TensorView seqlens, TensorView out_offsets,        \
      int64_t cp_size, int64_t cp_rank, int64_t fill, int64_t total, TensorView out
// unpack: packed [cp * Tl, W] uint8 (every CP rank's packed tensor, rank-major;
// Tl = out_offsets[m]); cu_seqlens [m + 1] int64 (output offsets, increments
// seqlens); total = cu_seqlens[m]; out [total, W]: the sequences, unpadded,
// in micro-batch order.
#define COMPASS_THD_UNPACK_ARGS                                                          \
  TensorView packed, TensorView seqlens, TensorView cu_seqlens, TensorView out_offsets,   \
      int64_t cp_size, int64_t total, TensorView out
// positions: out [total] int64, each packed token's position in its padded sequence.
#define COMPASS_THD_POSITIONS_ARGS \
  TensorView out_offsets, int64_t cp_size, int64_t cp_rank, int64_t total, TensorView out

// Shared by every backend (pack_cpu.cpp): dtype, shape, device, scalar ranges.
void check_thd_pack_args(COMPASS_THD_PACK_ARGS);
void check_thd_unpack_args(COMPASS_THD_UNPACK_ARGS);
void check_thd_positions_args(COMPASS_THD_POSITIONS_ARGS);

void thd_pack_cpu(COMPASS_THD_PACK_ARGS);
void thd_unpack_cpu(COMPASS_THD_UNPACK_ARGS);
void thd_positions_cpu(COMPASS_THD_POSITIONS_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void thd_pack_cuda(COMPASS_THD_PACK_ARGS, uintptr_t stream);
void thd_unpack_cuda(COMPASS_THD_UNPACK_ARGS, uintptr_t stream);
void thd_positions_cuda(COMPASS_THD_POSITIONS_ARGS, uintptr_t stream);
#endif

}  // namespace packing
}  // namespace compass
