// Set coding of routing traces: each row's top-k set (K distinct experts of E)
// as its rank in the combinatorial number system, r = sum_i C(a_i, i + 1) over
// the ascending ids a_0 < ... < a_{K-1}, so r < N = C(E, K) and a row needs
// log2(N) bits (E=256, K=8: 48.6 vs 64 for uint8 ids). G consecutive rows form
// one mixed-radix number v = r_0 + N (r_1 + N (...)) < N^G <= 2^64, written with
// B = ceil(log2(N^G)) bits: fixed width, so every pack's bit offset is known and
// threads encode / decode disjoint byte-aligned ranges.
//
// The order within a row is not kept: decode returns each set ascending (the
// trace contract: a row is a set).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "compass/tensor_view.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {

namespace {

constexpr int64_t kMaxK = 64;
constexpr int64_t kParallelMinRows = int64_t{1} << 16;

// Binomial table C(a, m) for a < E, m <= K, and the decode hints.
struct Tables {
  int64_t e = 0, k = 0;
  uint64_t n = 0;      // C(E, K)
  int64_t group = 1;   // rows per pack
  int64_t bits = 0;    // bits per pack
  std::vector<uint64_t> c;    // c[m * (e + 1) + a] = C(a, m), a <= E
  // Decode hints: for r in bucket key(r) (its bit length and the next 4 bits),
  // the largest a with C(a, m) <= r lies in [lo[m][key], hi[m][key]].
  std::vector<int32_t> lo, hi;
  int32_t step = 0;  // the largest power of two <= max(hi - lo) over the hints
  uint64_t binom(int64_t a, int64_t m) const { return c[m * (e + 1) + a]; }
};

constexpr int kKeys = 32 + 59 * 16;  // r < 32 exact; else (bit length 6..64, 4 bits)

int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

inline int key_of(uint64_t r) {
  if (r < 32) return static_cast<int>(r);
  const int b = bit_length(r);  // >= 6
  return 32 + (b - 6) * 16 + static_cast<int>((r >> (b - 5)) & 15);
}

// The smallest and largest r of bucket `key`.
void key_range(int key, uint64_t& r0, uint64_t& r1) {
  if (key < 32) {
    r0 = r1 = static_cast<uint64_t>(key);
    return;
  }
  const int b = (key - 32) / 16 + 6, frac = (key - 32) % 16;
  r0 = (uint64_t{1} << (b - 1)) | (static_cast<uint64_t>(frac) << (b - 5));
  r1 = r0 | ((uint64_t{1} << (b - 5)) - 1);
}

Tables make_tables(int64_t e, int64_t k) {
  Tables t;
  t.e = e;
  t.k = k;
  t.c.assign(static_cast<size_t>((k + 1) * (e + 1)), 0);
  // C(a, m) for a <= E: exact in 64 bits while C(E, K) < 2^64 (checked below;
  // C(a, m) <= C(E, K) for a <= E, m <= K <= E/2 or by the monotone rows used).
  for (int64_t a = 0; a <= e; ++a) {
    t.c[a] = 1;  // m = 0
    for (int64_t m = 1; m <= k; ++m) {
      if (a == 0) {
        t.c[m * (e + 1)] = 0;
        continue;
      }
      const unsigned __int128 v = static_cast<unsigned __int128>(t.c[m * (e + 1) + a - 1]) +
                                  t.c[(m - 1) * (e + 1) + a - 1];
      t.c[m * (e + 1) + a] = v > ~uint64_t{0} ? ~uint64_t{0} : static_cast<uint64_t>(v);
    }
  }
  t.n = t.binom(e, k);
  t.group = 1;
  unsigned __int128 pow = t.n;
  while (true) {  // the largest G with N^G <= 2^64
    const unsigned __int128 next = pow * t.n;
    if (t.n <= 1 || next > (static_cast<unsigned __int128>(1) << 64) || t.group >= 64) break;
    pow = next;
    ++t.group;
  }
  // bits for values < N^G <= 2^64: bit_length(N^G - 1) <= 64
  t.bits = bit_length(static_cast<uint64_t>(pow - 1));
  // N == 1 (K == E): every row is the full set, 0 bits.
  t.lo.assign(static_cast<size_t>((k + 1) * kKeys), 0);
  t.hi.assign(static_cast<size_t>((k + 1) * kKeys), 0);
  // largest a in [0, E] with C(a, m) <= r (C(0, m) = 0 for m >= 1)
  auto largest = [&t, e](int64_t m, uint64_t r) {
    int64_t lo_a = 0, hi_a = e;
    while (lo_a < hi_a) {
      const int64_t mid = (lo_a + hi_a + 1) / 2;
      if (t.binom(mid, m) <= r) lo_a = mid;
      else hi_a = mid - 1;
    }
    return lo_a;
  };
  for (int64_t m = 1; m <= k; ++m) {
    for (int key = 0; key < kKeys; ++key) {
      uint64_t r0, r1;
      key_range(key, r0, r1);
      t.lo[m * kKeys + key] = static_cast<int32_t>(largest(m, r0));
      t.hi[m * kKeys + key] = static_cast<int32_t>(largest(m, r1));
    }
  }
  int32_t width = 0;
  for (size_t i = 0; i < t.lo.size(); ++i) width = std::max(width, t.hi[i] - t.lo[i]);
  t.step = width > 0 ? int32_t{1} << (bit_length(static_cast<uint64_t>(width)) - 1) : 0;
  return t;
}

void check_layout(int64_t e, int64_t k) {
  COMPASS_CHECK(e >= 1 && k >= 1 && k <= e && k <= kMaxK,
                "num_experts / top_k: expected 1 <= top_k <= min(num_experts, ", kMaxK,
                "), got ", e, " / ", k);
  // C(E, K) must fit in 64 bits.
  double log2n = 0;
  for (int64_t i = 0; i < k; ++i) log2n += std::log2(static_cast<double>(e - i) / (k - i));
  COMPASS_CHECK(log2n < 63.9, "set coding needs C(num_experts, top_k) < 2^64; C(", e, ", ", k,
                ") ~ 2^", log2n, ": use codec='raw'");
}

// One Tables per (E, K), built once per process (a few microseconds to ms).
const Tables& tables(int64_t e, int64_t k) {
  static thread_local std::deque<Tables> cache;  // stable references
  for (const Tables& t : cache) {
    if (t.e == e && t.k == k) return t;
  }
  check_layout(e, k);
  cache.push_back(make_tables(e, k));
  return cache.back();
}

// Rank of one row without sorting: a_i's position in the sorted set is the
// number of ids below it, so r = sum_i C(a_i, 1 + #{j: a_j < a_i}); branch-free.
template <typename I>
uint64_t rank_row(const I* row, int64_t k, const Tables& t, int64_t index, const char* name) {
  int32_t a[kMaxK];
  bool out_of_range = false;
  for (int64_t i = 0; i < k; ++i) {
    a[i] = static_cast<int32_t>(row[i]);
    out_of_range |= (a[i] < 0) | (a[i] >= t.e);
  }
  uint64_t r = 0;
  int64_t equal = 0;
  if (!out_of_range) {
    for (int64_t i = 0; i < k; ++i) {
      int64_t below = 0;
      for (int64_t j = 0; j < k; ++j) {
        below += a[j] < a[i];
        equal += a[j] == a[i];
      }
      r += t.c[(below + 1) * (t.e + 1) + a[i]];
    }
  }
  if (out_of_range || equal != k) {  // cold: name the row and the id
    for (int64_t i = 0; i < k; ++i) {
      COMPASS_CHECK(a[i] >= 0 && a[i] < t.e, name, ": expert id ", a[i], " out of range [0, ",
                    t.e, ") at row ", index);
      for (int64_t j = 0; j < i; ++j) {
        COMPASS_CHECK(a[j] != a[i], name, ": expert ", a[i], " twice in row ", index);
      }
    }
  }
  return r;
}

// Unrank kBatch rows at once, level by level (m = K .. 1): the rows are
// independent, so the CPU overlaps their dependent table lookups. Within a
// level, a fixed number of branch-free halving steps over the hinted range.
constexpr int kBatch = 8;

template <typename I>
void unrank_rows(const uint64_t* ranks, int n, int64_t k, const Tables& t, I* out) {
  uint64_t r[kBatch];
  int32_t prev[kBatch];
  for (int j = 0; j < n; ++j) {
    r[j] = ranks[j];
    prev[j] = static_cast<int32_t>(t.e);
  }
  const int64_t stride = t.e + 1;
  for (int64_t m = k; m >= 1; --m) {
    const uint64_t* cm = t.c.data() + m * stride;
    const int32_t* lo_m = t.lo.data() + m * kKeys;
    const int32_t* hi_m = t.hi.data() + m * kKeys;
    int32_t lo[kBatch], hi[kBatch];
    for (int j = 0; j < n; ++j) {
      const int key = key_of(r[j]);
      lo[j] = std::max<int32_t>(static_cast<int32_t>(m - 1), lo_m[key]);
      hi[j] = std::min<int32_t>(prev[j] - 1, hi_m[key]);
    }
    for (int32_t step = t.step; step > 0; step >>= 1) {
      for (int j = 0; j < n; ++j) {  // independent rows: their loads overlap
        const int32_t cand = lo[j] + step;
        lo[j] = (cand <= hi[j] && cm[cand] <= r[j]) ? cand : lo[j];
      }
    }
    for (int j = 0; j < n; ++j) {
      out[j * k + m - 1] = static_cast<I>(lo[j]);
      r[j] -= cm[lo[j]];
      prev[j] = lo[j];
    }
  }
}

// Byte-aligned bit writer / reader over [begin, end) of a buffer.
struct BitWriter {
  uint8_t* p;
  unsigned __int128 acc = 0;
  int nbits = 0;
  void put(uint64_t v, int bits) {  // bits <= 64
    acc |= static_cast<unsigned __int128>(v) << nbits;
    nbits += bits;
    flush();
  }
  void flush() {
    while (nbits >= 8) {
      *p++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      nbits -= 8;
    }
  }
  void finish() {
    if (nbits > 0) *p++ = static_cast<uint8_t>(acc);
    nbits = 0;
    acc = 0;
  }
};

struct BitReader {
  const uint8_t* p;
  const uint8_t* end;
  unsigned __int128 acc = 0;
  int nbits = 0;
  uint64_t get(int bits) {  // bits <= 64
    while (nbits < bits) {
      const uint64_t byte = p < end ? *p : 0;
      ++p;
      acc |= static_cast<unsigned __int128>(byte) << nbits;
      nbits += 8;
    }
    const uint64_t v = bits == 64 ? static_cast<uint64_t>(acc)
                                  : static_cast<uint64_t>(acc) & ((uint64_t{1} << bits) - 1);
    acc >>= bits;
    nbits -= bits;
    return v;
  }
};

// Packs per thread chunk: a multiple of 8, so every chunk starts on a byte.
int64_t chunk_packs(int64_t packs, int nthreads) {
  int64_t c = (packs + nthreads - 1) / nthreads;
  return (c + 7) / 8 * 8;
}

}  // namespace

int64_t set_code_group(int64_t num_experts, int64_t top_k) {
  return tables(num_experts, top_k).group;
}

int64_t set_code_pack_bits(int64_t num_experts, int64_t top_k) {
  return tables(num_experts, top_k).bits;
}

int64_t set_code_bytes(int64_t rows, int64_t num_experts, int64_t top_k) {
  const Tables& t = tables(num_experts, top_k);
  const int64_t packs = (rows + t.group - 1) / t.group;
  return (packs * t.bits + 7) / 8;
}

void encode_sets_cpu(TensorView ids, int64_t num_experts, TensorView out) {
  COMPASS_NAME_ARGS(ids, out);
  ids.expect_ndim(2).expect_contiguous().expect_device(DeviceType::kCPU);
  out.expect_vector().expect_dtype(DType::kUInt8).expect_device(DeviceType::kCPU);
  const int64_t rows = ids.size(0), k = ids.size(1);
  const Tables& t = tables(num_experts, k);
  const int64_t need = set_code_bytes(rows, num_experts, k);
  COMPASS_CHECK(out.numel() == need, out.name, ": expected ", need, " bytes, got ", out.numel());
  const int64_t packs = (rows + t.group - 1) / t.group;
  uint8_t* dst = out.ptr<uint8_t>();
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    const I* src = ids.ptr<I>();
    auto run = [&](int64_t p0, int64_t p1) {
      if (p0 >= p1) return;
      BitWriter w{dst + p0 * t.bits / 8};
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t r0 = p * t.group;
        const int64_t r1 = std::min(rows, r0 + t.group);
        uint64_t v = 0;  // < N^G <= 2^64
        for (int64_t r = r1 - 1; r >= r0; --r) {
          v = v * t.n + rank_row<I>(src + r * k, k, t, r, ids.name);
        }
        w.put(v, static_cast<int>(t.bits));
      }
      w.finish();
    };
    if (rows < kParallelMinRows || omp_get_max_threads() == 1) return run(0, packs);
    const int nt = omp_get_max_threads();
    const int64_t chunk = chunk_packs(packs, nt);
    std::vector<std::string> errors(static_cast<size_t>(nt));
#pragma omp parallel num_threads(nt)
    {
      const int me = omp_get_thread_num();
      try {
        run(std::min(packs, me * chunk), std::min(packs, (me + 1) * chunk));
      } catch (const ValueError& e) {
        errors[static_cast<size_t>(me)] = e.what();
      }
    }
    for (const std::string& e : errors) COMPASS_CHECK(e.empty(), e);
  });
}

void decode_sets_cpu(TensorView data, int64_t num_experts, TensorView ids) {
  COMPASS_NAME_ARGS(data, ids);
  data.expect_vector().expect_dtype(DType::kUInt8).expect_device(DeviceType::kCPU);
  ids.expect_ndim(2).expect_contiguous().expect_device(DeviceType::kCPU);
  const int64_t rows = ids.size(0), k = ids.size(1);
  const Tables& t = tables(num_experts, k);
  const int64_t need = set_code_bytes(rows, num_experts, k);
  COMPASS_CHECK(data.numel() == need, data.name, ": expected ", need, " bytes for ", rows,
                " rows, got ", data.numel());
  const int64_t packs = (rows + t.group - 1) / t.group;
  const uint8_t* src = data.ptr<uint8_t>();
  const uint8_t* end = src + need;
  std::vector<int64_t> bad(1, -1);
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    I* dst = ids.ptr<I>();
    auto run = [&](int64_t p0, int64_t p1) -> int64_t {
      if (p0 >= p1) return -1;
      BitReader rd{src + p0 * t.bits / 8, end};
      uint64_t ranks[kBatch];
      int nb = 0;
      for (int64_t p = p0; p < p1; ++p) {
        uint64_t v = t.bits ? rd.get(static_cast<int>(t.bits)) : 0;
        const int64_t r0 = p * t.group;
        const int64_t r1 = std::min(rows, r0 + t.group);
        if (t.group == 1) {
          if (v >= t.n) return p;
          ranks[nb++] = v;
          if (nb == kBatch || r1 == rows || p + 1 == p1) {
            unrank_rows<I>(ranks, nb, k, t, dst + (r1 - nb) * k);
            nb = 0;
          }
          continue;
        }
        for (int64_t r = r0; r < r1; ++r) {
          const uint64_t rank = v % t.n;
          v /= t.n;
          unrank_rows<I>(&rank, 1, k, t, dst + r * k);
        }
        if (v != 0) return p;  // a value >= N^G: corrupted data
      }
      return -1;
    };
    if (rows < kParallelMinRows || omp_get_max_threads() == 1) {
      bad[0] = run(0, packs);
      return;
    }
    const int nt = omp_get_max_threads();
    const int64_t chunk = chunk_packs(packs, nt);
    bad.assign(static_cast<size_t>(nt), -1);
#pragma omp parallel num_threads(nt)
    {
      const int me = omp_get_thread_num();
      bad[static_cast<size_t>(me)] =
          run(std::min(packs, me * chunk), std::min(packs, (me + 1) * chunk));
    }
  });
  for (int64_t b : bad) {
    COMPASS_CHECK(b < 0, data.name, ": pack ", b, " holds a value past C(", num_experts, ", ", k,
                  ")^", t.group, " (corrupted payload)");
  }
}

}  // namespace routing
}  // namespace compass
