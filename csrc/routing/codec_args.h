// Argument checks of the set codec's CPU entry points (codec_cpu.cpp): the
// (num_experts, top_k) layout and the encode op's views.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "compass/tensor_view.h"
#include "routing/routing_api.h"
#include "routing/setcode.h"

namespace compass {
namespace routing {

// 1 <= K <= min(E, 64), E <= 65536, C(E, K) < 2^64; returns the pack layout.
inline setcode::PackLayout check_set_layout(int64_t e, int64_t k) {
  COMPASS_CHECK(e >= 1 && k >= 1 && k <= e && k <= setcode::kMaxK,
                "num_experts / top_k: expected 1 <= top_k <= min(num_experts, ", setcode::kMaxK,
                "), got ", e, " / ", k);
  COMPASS_CHECK(e <= 65536, "num_experts: expected <= 65536 (int16 / uint16 ids), got ", e);
  double log2n = 0;
  for (int64_t i = 0; i < k; ++i) log2n += std::log2(static_cast<double>(e - i) / (k - i));
  COMPASS_CHECK(log2n < 63.9, "set coding needs C(num_experts, top_k) < 2^64; C(", e, ", ", k,
                ") ~ 2^", log2n, ": use codec='raw'");
  return setcode::pack_layout(setcode::binom_exact(e, k));
}

inline int64_t set_payload_bytes(int64_t rows, const setcode::PackLayout& l) {
  const int64_t packs = (rows + l.group - 1) / l.group;
  return (packs * l.bits + 7) / 8;
}

// The encode op's views (COMPASS_ENCODE_SETS_ARGS, routing_api.h): payload uint8
// [set_payload_bytes]; status int64 [2]; table int64 [K * E]; all on ids' device.
// Returns the layout.
inline setcode::PackLayout check_encode_sets_args(COMPASS_ENCODE_SETS_ARGS) {
  ids.expect_ndim(2).expect_contiguous();
  COMPASS_CHECK(ids.dtype == DType::kUInt8 || ids.dtype == DType::kInt16, ids.name,
                ": expected dtype uint8 | int16, got ", ids.describe());
  const int64_t rows = ids.size(0), k = ids.size(1);
  const setcode::PackLayout l = check_set_layout(num_experts, k);
  if (missing) {
    missing->expect_vector().expect_dtype(DType::kBool).expect_same_device(ids);
    missing->expect_size(0, rows, "one per row = ids.shape[0]");
  }
  payload.expect_vector().expect_dtype(DType::kUInt8).expect_same_device(ids);
  payload.expect_size(0, set_payload_bytes(rows, l), "set_code_bytes(rows, num_experts, top_k)");
  status.expect_vector().expect_dtype(DType::kInt64).expect_same_device(ids);
  status.expect_size(0, 2, "2: (bad rows, first bad row)");
  table.expect_vector().expect_dtype(DType::kInt64).expect_same_device(ids);
  table.expect_size(0, k * num_experts, "top_k * num_experts");
  return l;
}

}  // namespace routing
}  // namespace compass
