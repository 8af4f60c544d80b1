// THD pack / unpack on the CPU, and the argument checks every backend shares.
// A sequence's rows on one rank are at most two contiguous runs (its zigzag
// chunks), each one memcpy plus one memset of its padding: the copy runs at
// memory speed with no per-token index.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "compass/packing.h"
#include "packing/packing_api.h"

namespace compass {
namespace packing {

namespace {

// Below this many bytes moved, one thread: waking a team costs more.
constexpr int64_t kParallelMinBytes = int64_t{1} << 23;

void check_meta(const TensorView& seqlens, const TensorView& out_offsets, int64_t cp_size,
                const TensorView& like) {
  seqlens.expect_vector().expect_dtype(DType::kInt64).expect_same_device(like);
  const int64_t m = seqlens.numel();
  out_offsets.expect_vector().expect_dtype(DType::kInt64).expect_same_device(like);
  out_offsets.expect_size(0, m + 1, "len(seqlens) + 1");
  COMPASS_CHECK(cp_size >= 1, "cp_size: expected >= 1, got ", cp_size);
}

// Host-readable metadata (CPU tensors): every value the kernels rely on.
void check_meta_values(const TensorView& seqlens, const TensorView& out_offsets, int64_t cp_size,
                       int64_t total) {
  const int64_t m = seqlens.numel();
  const int64_t* len = seqlens.ptr<int64_t>();
  const int64_t* off = out_offsets.ptr<int64_t>();
  COMPASS_CHECK(off[0] == 0, "out_offsets: expected out_offsets[0] == 0, got ", off[0]);
  for (int64_t j = 0; j < m; ++j) {
    COMPASS_CHECK(len[j] >= 1, "seqlens: expected every sequence non-empty, got seqlens[", j,
                  "] = ", len[j]);
    const int64_t local = off[j + 1] - off[j];
    COMPASS_CHECK(local >= 1 && local * cp_size >= len[j] && (cp_size == 1 || local % 2 == 0),
                  "out_offsets: sequence ", j, " of ", len[j], " tokens has ", local,
                  " local slots; expected an even count (cp > 1) >= ceil(len / cp_size) with "
                  "cp_size = ", cp_size);
  }
  COMPASS_CHECK(off[m] == total, "total: expected out_offsets[-1] = ", off[m], ", got ", total);
}

}  // namespace

void check_thd_pack_args(COMPASS_THD_PACK_ARGS) {
  src.expect_ndim(2).expect_contiguous().expect_dtype(DType::kUInt8);
  seq_start.expect_vector().expect_dtype(DType::kInt64).expect_same_device(src);
  check_meta(seqlens, out_offsets, cp_size, src);
  seq_start.expect_size(0, seqlens.numel(), "one per sequence = len(seqlens)");
  COMPASS_CHECK(0 <= cp_rank && cp_rank < cp_size, "cp_rank: expected 0 <= cp_rank < cp_size = ",
                cp_size, ", got ", cp_rank);
  COMPASS_CHECK(0 <= fill && fill <= 255, "fill: expected a byte 0..255, got ", fill);
  out.expect_ndim(2).expect_contiguous().expect_dtype(DType::kUInt8).expect_same_device(src);
  out.expect_size(0, total, "total").expect_size(1, src.size(1), "src row bytes");
}

void check_thd_unpack_args(COMPASS_THD_UNPACK_ARGS) {
  packed.expect_ndim(2).expect_contiguous().expect_dtype(DType::kUInt8);
  check_meta(seqlens, out_offsets, cp_size, packed);
  cu_seqlens.expect_vector().expect_dtype(DType::kInt64).expect_same_device(packed);
  cu_seqlens.expect_size(0, seqlens.numel() + 1, "len(seqlens) + 1");
  COMPASS_CHECK(packed.size(0) % cp_size == 0, "packed: expected cp_size = ", cp_size,
                " ranks' rows stacked (a multiple of cp_size), got ", packed.describe());
  out.expect_ndim(2).expect_contiguous().expect_dtype(DType::kUInt8).expect_same_device(packed);
  out.expect_size(0, total, "total").expect_size(1, packed.size(1), "packed row bytes");
}

void check_thd_positions_args(COMPASS_THD_POSITIONS_ARGS) {
  out_offsets.expect_vector().expect_dtype(DType::kInt64);
  COMPASS_CHECK(out_offsets.numel() >= 1, "out_offsets: expected m + 1 >= 1 elements, got ",
                out_offsets.describe());
  COMPASS_CHECK(cp_size >= 1, "cp_size: expected >= 1, got ", cp_size);
  COMPASS_CHECK(0 <= cp_rank && cp_rank < cp_size, "cp_rank: expected 0 <= cp_rank < cp_size = ",
                cp_size, ", got ", cp_rank);
  out.expect_vector().expect_dtype(DType::kInt64).expect_same_device(out_offsets);
  out.expect_size(0, total, "total");
}

void thd_pack_cpu(COMPASS_THD_PACK_ARGS) {
  COMPASS_NAME_ARGS(src, seq_start, seqlens, out_offsets, out);
  check_thd_pack_args(src, seq_start, seqlens, out_offsets, cp_size, cp_rank, fill, total, out);
  src.expect_device(DeviceType::kCPU);
  check_meta_values(seqlens, out_offsets, cp_size, total);
  const int64_t m = seqlens.numel(), rows = src.size(0), w = src.size(1);
  const int64_t* start = seq_start.ptr<int64_t>();
  const int64_t* len = seqlens.ptr<int64_t>();
  for (int64_t j = 0; j < m; ++j) {
    COMPASS_CHECK(start[j] >= 0 && start[j] + len[j] <= rows, "seq_start: sequence ", j,
                  " spans source rows [", start[j], ", ", start[j] + len[j], "), outside src (",
                  rows, " rows)");
  }
  const int64_t* off = out_offsets.ptr<int64_t>();
  const uint8_t* s = src.ptr<uint8_t>();
  uint8_t* o = out.ptr<uint8_t>();
  const int chunks = cp_size == 1 ? 1 : 2;
#pragma omp parallel for schedule(static) if (total * w >= kParallelMinBytes)
  for (int64_t j = 0; j < m; ++j) {
    const int64_t local = off[j + 1] - off[j], c = local / chunks;
    for (int h = 0; h < chunks; ++h) {
      const int64_t u0 = h * c, p0 = thd_zigzag_position(u0, local, cp_size, cp_rank);
      const int64_t valid = std::clamp<int64_t>(len[j] - p0, 0, c);
      uint8_t* dst = o + (off[j] + u0) * w;
      std::memcpy(dst, s + (start[j] + p0) * w, static_cast<size_t>(valid * w));
      std::memset(dst + valid * w, static_cast<int>(fill), static_cast<size_t>((c - valid) * w));
    }
  }
}

void thd_unpack_cpu(COMPASS_THD_UNPACK_ARGS) {
  COMPASS_NAME_ARGS(packed, seqlens, cu_seqlens, out_offsets, out);
  check_thd_unpack_args(packed, seqlens, cu_seqlens, out_offsets, cp_size, total, out);
  packed.expect_device(DeviceType::kCPU);
  const int64_t m = seqlens.numel(), w = packed.size(1), tl = packed.size(0) / cp_size;
  check_meta_values(seqlens, out_offsets, cp_size, tl);
  const int64_t* len = seqlens.ptr<int64_t>();
  const int64_t* cu = cu_seqlens.ptr<int64_t>();
  COMPASS_CHECK(cu[0] == 0, "cu_seqlens: expected cu_seqlens[0] == 0, got ", cu[0]);
  for (int64_t j = 0; j < m; ++j) {
    COMPASS_CHECK(cu[j + 1] - cu[j] == len[j], "cu_seqlens: expected increments equal to seqlens, "
                  "got cu_seqlens[", j + 1, "] - cu_seqlens[", j, "] = ", cu[j + 1] - cu[j],
                  " for seqlens[", j, "] = ", len[j]);
  }
  COMPASS_CHECK(cu[m] == total, "total: expected cu_seqlens[-1] = ", cu[m], ", got ", total);
  const int64_t* off = out_offsets.ptr<int64_t>();
  const uint8_t* pk = packed.ptr<uint8_t>();
  uint8_t* o = out.ptr<uint8_t>();
  const int64_t chunks = cp_size == 1 ? 1 : 2 * cp_size;
#pragma omp parallel for schedule(static) if (total * w >= kParallelMinBytes)
  for (int64_t j = 0; j < m; ++j) {
    const int64_t local = off[j + 1] - off[j];
    const int64_t c = cp_size == 1 ? local : local / 2;
    for (int64_t q = 0; q < chunks; ++q) {
      const int64_t p0 = q * c, valid = std::clamp<int64_t>(len[j] - p0, 0, c);
      if (valid == 0) continue;
      int64_t rank = 0;
      const int64_t u0 = thd_zigzag_slot(p0, local, cp_size, &rank);
      std::memcpy(o + (cu[j] + p0) * w, pk + (rank * tl + off[j] + u0) * w,
                  static_cast<size_t>(valid * w));
    }
  }
}

void thd_positions_cpu(COMPASS_THD_POSITIONS_ARGS) {
  COMPASS_NAME_ARGS(out_offsets, out);
  check_thd_positions_args(out_offsets, cp_size, cp_rank, total, out);
  out_offsets.expect_device(DeviceType::kCPU);
  const int64_t m = out_offsets.numel() - 1;
  const int64_t* off = out_offsets.ptr<int64_t>();
  COMPASS_CHECK(off[0] == 0 && off[m] == total, "out_offsets: expected 0 .. total = ", total,
                ", got ", off[0], " .. ", off[m]);
  int64_t* o = out.ptr<int64_t>();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t local = off[j + 1] - off[j];
    COMPASS_CHECK(local >= 0 && (cp_size == 1 || local % 2 == 0), "out_offsets: sequence ", j,
                  " has ", local, " local slots; expected an even count >= 0 (cp_size = ",
                  cp_size, ")");
    for (int64_t u = 0; u < local; ++u) o[off[j] + u] = thd_zigzag_position(u, local, cp_size, cp_rank);
  }
}

}  // namespace packing
}  // namespace compass
