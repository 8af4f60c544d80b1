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
  std::vector<int32_t> lo;    // lo[m * 66 + b] = smallest a with bit_length(C(a, m)) >= b
  uint64_t binom(int64_t a, int64_t m) const { return c[m * (e + 1) + a]; }
};

int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

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
  // bits for values < N^G: bit_length(N^G - 1)
  const unsigned __int128 top = pow - 1;
  t.bits = top >> 64 ? 64 + bit_length(static_cast<uint64_t>(top >> 64))
                     : bit_length(static_cast<uint64_t>(top));
  // N == 1 (K == E): every row is the full set, 0 bits.
  t.lo.assign(static_cast<size_t>((k + 1) * 66), static_cast<int32_t>(e + 1));
  for (int64_t m = 1; m <= k; ++m) {
    for (int b = 0; b <= 65; ++b) {
      int64_t a = 0;
      while (a <= e && bit_length(t.binom(a, m)) < b) ++a;
      t.lo[m * 66 + b] = static_cast<int32_t>(a);
    }
  }
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

template <typename I>
uint64_t rank_row(const I* row, int64_t k, const Tables& t, int64_t index, const char* name) {
  int64_t a[kMaxK];
  for (int64_t i = 0; i < k; ++i) {
    const int64_t v = static_cast<int64_t>(row[i]);
    COMPASS_CHECK(v >= 0 && v < t.e, name, ": expert id ", v, " out of range [0, ", t.e,
                  ") at row ", index);
    int64_t j = i;
    while (j > 0 && a[j - 1] > v) {
      a[j] = a[j - 1];
      --j;
    }
    a[j] = v;
  }
  uint64_t r = 0;
  for (int64_t i = 0; i < k; ++i) {
    COMPASS_CHECK(i == 0 || a[i] != a[i - 1], name, ": expert ", a[i], " twice in row ", index);
    r += t.binom(a[i], i + 1);
  }
  return r;
}

template <typename I>
void unrank_row(uint64_t r, int64_t k, const Tables& t, I* out) {
  int64_t hi = t.e - 1;  // a_{m-1} <= hi
  for (int64_t m = k; m >= 1; --m) {
    int64_t a;
    if (r == 0) {
      a = m - 1;
    } else {
      const int b = bit_length(r);
      // C(a, m) <= r < 2^b: bit_length(C(a, m)) <= b, a < lo[m][b + 1];
      // C(a + 1, m) > r >= 2^(b-1): bit_length(C(a + 1, m)) >= b, a + 1 >= lo[m][b].
      int64_t lo_a = std::max<int64_t>(m - 1, t.lo[m * 66 + b] - 1);
      int64_t hi_a = std::min<int64_t>(hi, t.lo[m * 66 + b + 1] - 1);
      while (lo_a < hi_a) {  // the largest a in [lo_a, hi_a] with C(a, m) <= r
        const int64_t mid = (lo_a + hi_a + 1) / 2;
        if (t.binom(mid, m) <= r) lo_a = mid;
        else hi_a = mid - 1;
      }
      a = lo_a;
    }
    out[m - 1] = static_cast<I>(a);
    r -= t.binom(a, m);
    hi = a - 1;
  }
}

// Byte-aligned bit writer / reader over [begin, end) of a buffer.
struct BitWriter {
  uint8_t* p;
  unsigned __int128 acc = 0;
  int nbits = 0;
  void put(uint64_t v, int bits_hi, uint64_t v_hi, int bits) {
    // bits <= 64 from v, then bits_hi more from v_hi (bits_hi <= 64)
    acc |= static_cast<unsigned __int128>(v) << nbits;
    nbits += bits;
    flush();
    if (bits_hi) {
      acc |= static_cast<unsigned __int128>(v_hi) << nbits;
      nbits += bits_hi;
      flush();
    }
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
        unsigned __int128 v = 0;
        const int64_t r0 = p * t.group;
        const int64_t r1 = std::min(rows, r0 + t.group);
        for (int64_t r = r1 - 1; r >= r0; --r) {
          v = v * t.n + rank_row<I>(src + r * k, k, t, r, ids.name);
        }
        const int lo_bits = t.bits > 64 ? 64 : static_cast<int>(t.bits);
        const int hi_bits = t.bits > 64 ? static_cast<int>(t.bits - 64) : 0;
        w.put(static_cast<uint64_t>(v), hi_bits, static_cast<uint64_t>(v >> 64), lo_bits);
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
      for (int64_t p = p0; p < p1; ++p) {
        const int lo_bits = t.bits > 64 ? 64 : static_cast<int>(t.bits);
        unsigned __int128 v = lo_bits ? rd.get(lo_bits) : 0;
        if (t.bits > 64) {
          v |= static_cast<unsigned __int128>(rd.get(static_cast<int>(t.bits - 64))) << 64;
        }
        const int64_t r0 = p * t.group;
        const int64_t r1 = std::min(rows, r0 + t.group);
        for (int64_t r = r0; r < r1; ++r) {
          const uint64_t rank = static_cast<uint64_t>(v % t.n);
          v /= t.n;
          unrank_row<I>(rank, k, t, dst + r * k);
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
