// Host entry points of the router-replay kernels (CPU in replay_cpu.cpp, CUDA
// in replay.cu), bound one line each in bindings.cpp. Arguments are borrowed
// views; outputs are written in place. check_* runs every dtype/shape/device
// check before any launch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "compass/routing.h"
#include "compass/tensor_view.h"

namespace compass {
namespace routing {

// logits [T, E] float32|float64; expert_ids [T, K] uint8|int16|int32|int64 (rows
// with valid False are not read); expert_bias [E] logits' dtype or None; valid
// [T] bool or None; score_function 0 softmax / 1 sigmoid; min_score_ratio < 0:
// no ratio test. Outputs: weights [T, K] logits' dtype, routing_map [T, E] bool,
// tokens_per_expert [E] int64, counts [6] int64 (routing.h: Count), ids_used
// [T, K] int64.
#define COMPASS_REPLAY_TOPK_ARGS                                                               \
  TensorView logits, TensorView expert_ids, std::optional<TensorView> expert_bias,             \
      std::optional<TensorView> valid, int64_t score_function, bool normalize, double scaling, \
      double min_score_ratio, TensorView weights, TensorView routing_map,                      \
      TensorView tokens_per_expert, TensorView counts, TensorView ids_used
// grad_weights [T, K] and logits [T, E] float32|float64 (same dtype); ids_used
// [T, K] int64 (from replay_topk); out: grad_logits [T, E] logits' dtype.
#define COMPASS_REPLAY_TOPK_BACKWARD_ARGS                                                   \
  TensorView grad_weights, TensorView logits, TensorView ids_used, int64_t score_function, \
      bool normalize, double scaling, TensorView grad_logits

// Shared by every backend (defined in replay_cpu.cpp), called with named views.
void check_replay_topk_args(COMPASS_REPLAY_TOPK_ARGS);
void check_replay_topk_backward_args(COMPASS_REPLAY_TOPK_BACKWARD_ARGS);

// Set coding of top-k sets (codec_cpu.cpp, setcode.h): ids [rows, K] uint8|int16
// <-> the payload uint8 [set_code_bytes(rows, E, K)]; G rows per pack of B bits.
// missing [rows] bool or None: those rows are coded as 0..K-1 (rank 0), their ids
// not read. impl: 0 the fastest this CPU runs (AVX2 when present), 1 the x86-64
// baseline.
#define COMPASS_ENCODE_SETS_ARGS                                                              \
  TensorView ids, int64_t num_experts, std::optional<TensorView> missing, TensorView payload, \
      TensorView status, TensorView table
int64_t set_code_group(int64_t num_experts, int64_t top_k);
int64_t set_code_threads(int64_t threads);  // threads of the codec (0: OpenMP's); returns the old
int64_t set_code_pack_bits(int64_t num_experts, int64_t top_k);
int64_t set_code_bytes(int64_t rows, int64_t num_experts, int64_t top_k);
void encode_sets_cpu(TensorView ids, int64_t num_experts, std::optional<TensorView> missing,
                     TensorView out, int64_t impl);
// impl for decode: 0 auto, 1 the x86-64 baseline, 2 AVX2 with the v1 level-by-level
// unrank (no R12: the before of the bench, and the other path of the tests).
void decode_sets_cpu(TensorView data, int64_t num_experts, TensorView ids, int64_t impl);
// The unrank decode_sets_cpu runs for these arguments: "r12", "hint", "bisect" or
// "none" (K == E: nothing stored).
std::string set_code_decode_path(int64_t num_experts, int64_t top_k, bool uint8_ids,
                                 int64_t impl);
// The encode op (compass_kernels/routing/_setcode.py: encode_sets_op), every backend
// (checks: codec_args.h): ids [rows, K] uint8 | int16 contiguous; missing [rows] bool or
// None; all on ids' device. Outputs: payload; status int64 [2] =
// (bad rows, first bad row or -1); table int64 [K * E] = C(a, m) at (m - 1) * E + a
// (saturated at 2^64 - 1), the workspace of the CUDA kernel. The CPU entry raises
// on a bad row instead (naming it) and fills status with (0, -1).
void encode_sets_op_cpu(COMPASS_ENCODE_SETS_ARGS);

void replay_topk_cpu(COMPASS_REPLAY_TOPK_ARGS);
void replay_topk_backward_cpu(COMPASS_REPLAY_TOPK_BACKWARD_ARGS);
#if defined(COMPASS_WITH_CUDA) || defined(COMPASS_EMULATION)  // emulated: csrc/emu
void replay_topk_cuda(COMPASS_REPLAY_TOPK_ARGS, uintptr_t stream);
void replay_topk_backward_cuda(COMPASS_REPLAY_TOPK_BACKWARD_ARGS, uintptr_t stream);
void encode_sets_cuda(COMPASS_ENCODE_SETS_ARGS, uintptr_t stream);  // codec.cu
#endif

}  // namespace routing
}  // namespace compass
