// Host entry points of the route set codec (CPU in codec_cpu.cpp; the GPU
// encoder is Triton: compass_kernels/routing/triton_setcode.py), bound one
// line each in bindings.cpp. Arguments are borrowed
// views; outputs are written in place. (Router replay is Python: the torch
// reference on CPU, Triton on GPU.)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "compass/tensor_view.h"

namespace compass {
namespace routing {

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
// (saturated at 2^64 - 1), the workspace of the GPU kernel. The CPU entry raises
// on a bad row instead (naming it) and fills status with (0, -1).
void encode_sets_op_cpu(COMPASS_ENCODE_SETS_ARGS);

}  // namespace routing
}  // namespace compass
