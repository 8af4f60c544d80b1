// Set coding of top-k rows: the tables and scalar kernels of the CPU codec
// (codec_cpu.cpp). Header-only, no torch, no TensorView.
//
// A row's K distinct experts a_0 < ... < a_{K-1} of E (any order in memory) has
// the rank r = sum_i C(a_i, i + 1) in the combinatorial number system, 0 <= r <
// N = C(E, K): log2(N) bits (E=256, K=8: 48.6 vs 64 for uint8 ids). G
// consecutive rows form one mixed-radix value v = r_0 + N (r_1 + N (...)) <
// N^G <= 2^64 written with B = bit_length(N^G - 1) bits at bit offset
// pack * B, least significant bit first: every pack's place is known, so
// threads encode / decode disjoint ranges (a multiple of 8 packs starts on a
// byte).
//
// Rank without sorting: a_i's place among the ascending ids is the number of
// ids below it, so r = sum_i C(a_i, 1 + #{j : a_j < a_i}). The ids of a row
// are distinct exactly when sum_i #{j : a_j < a_i} == K (K - 1) / 2 (equal ids
// count in neither direction), so the hot loop checks duplicates with one
// compare per block of rows, and names the row only when that fails.
//
// Unrank level by level, m = K .. 1: a_{m-1} is the largest a with
// C(a, m) <= r, then r -= C(a, m). A hint table indexed by a monotone key of
// r (the exponent and top kS mantissa bits of double(r)) gives a lower bound
// h with a in [h, h + w] (w = 1 for E=256 and E=128, K=8). Level 1 is a = r;
// for E <= 256 one pair table decodes levels 2 and 1 at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace compass {
namespace routing {
namespace setcode {

constexpr int64_t kMaxK = 64;
constexpr int kS = 7;     // hint key: exponent and 7 mantissa bits of double(r)
constexpr int kPadA = 4;  // C(a, m) saturated for a in (E, E + kPadA]: the compares stop
constexpr int kMaxW = 4;  // hint width handled by the fast unrank

inline int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

// Monotone non-decreasing in r, for r < 2^63 (the hints are built only then):
// r | 1 keeps r = 0 at the key of 1 without a compare.
inline uint64_t key_of(uint64_t r) {
  const double d = static_cast<double>(static_cast<int64_t>(r | 1));
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return (bits >> (52 - kS)) - (uint64_t{1023} << kS);
}

struct Tables {
  int64_t e = 0, k = 0;
  uint64_t n = 0;      // C(E, K)
  int64_t group = 1;   // rows per pack
  int64_t bits = 0;    // bits per pack
  int64_t stride = 0;  // e + 1 + kPadA
  std::vector<uint64_t> c;  // c[m * stride + a] = C(a, m) (0 for a < m; saturated)
  // Encode (E <= 256, K <= 8): c8[m * 256 + a] = C(a, m), m in [1, K].
  std::vector<uint64_t> c8;
  // Decode hints, level m >= 2 (>= 3 with the pair table): hint[hint_off[m] +
  // key_of(r)] = largest a with key_of(C(a, m)) < key_of(r), so C(a, m) <= r.
  bool fast = false;  // hints built: every C(E, m), m <= K, < 2^63 and w <= kMaxW
  int w = 0;
  std::vector<int64_t> hint_off;
  std::vector<uint8_t> hint8;    // E <= 256
  std::vector<uint16_t> hint16;  // E > 256
  // Pair table (E <= 256, K >= 2): r < C(E, 2) -> a_1 << 8 | a_0.
  std::vector<uint16_t> pair;
  uint64_t binom(int64_t a, int64_t m) const { return c[m * stride + a]; }
};

// C(e, k) computed exactly (the caller checks it is < 2^64: check_set_layout).
inline uint64_t binom_exact(int64_t e, int64_t k) {
  if (k < 0 || k > e) return 0;
  const int64_t j = std::min(k, e - k);
  unsigned __int128 c = 1;
  for (int64_t i = 1; i <= j; ++i) c = c * static_cast<unsigned __int128>(e - j + i) / i;
  return c > ~uint64_t{0} ? ~uint64_t{0} : static_cast<uint64_t>(c);
}

// Rows per pack G (the largest with N^G <= 2^64, at most 64) and bits per pack
// B = bit_length(N^G - 1) for N = C(E, K) subsets; N == 1: B = 0. B is 0 or in
// [32, 64]: N^G > 2^64 / N, so a pack never spans more than three 64-bit words.
struct PackLayout {
  uint64_t n = 0;
  int64_t group = 1;
  int64_t bits = 0;
};

inline PackLayout pack_layout(uint64_t n) {
  PackLayout l;
  l.n = n;
  unsigned __int128 pow = n;
  while (n > 1 && l.group < 64) {
    const unsigned __int128 next = pow * n;
    if (next > (static_cast<unsigned __int128>(1) << 64)) break;
    pow = next;
    ++l.group;
  }
  l.bits = bit_length(static_cast<uint64_t>(pow - 1));
  return l;
}

inline Tables make_tables(int64_t e, int64_t k) {
  Tables t;
  t.e = e;
  t.k = k;
  t.stride = e + 1 + kPadA;
  t.c.assign(static_cast<size_t>((k + 1) * t.stride), ~uint64_t{0});
  for (int64_t m = 0; m <= k; ++m) {
    for (int64_t a = 0; a <= e; ++a) {
      uint64_t v = 1;
      if (m > 0) {
        const unsigned __int128 s = a == 0 ? 0
                                           : static_cast<unsigned __int128>(t.binom(a - 1, m)) +
                                                 t.binom(a - 1, m - 1);
        v = s > ~uint64_t{0} ? ~uint64_t{0} : static_cast<uint64_t>(s);
      }
      t.c[m * t.stride + a] = v;
    }
  }
  t.n = t.binom(e, k);
  const PackLayout l = pack_layout(t.n);  // N == 1 (K == E): 0 bits
  t.group = l.group;
  t.bits = l.bits;
  if (e <= 256 && k <= 8) {
    t.c8.assign(static_cast<size_t>((k + 1) * 256), 0);
    for (int64_t m = 0; m <= k; ++m) {
      for (int64_t a = 0; a < std::min<int64_t>(e + 1, 256); ++a) t.c8[m * 256 + a] = t.binom(a, m);
    }
  }
  // Decode hints.
  bool fits = true;
  for (int64_t m = 0; m <= k; ++m) fits &= t.binom(e, m) < (uint64_t{1} << 63);
  if (!fits) return t;
  const bool use_pair = e <= 256 && k >= 2;
  const int64_t m_lo = use_pair ? 3 : 2;
  t.hint_off.assign(static_cast<size_t>(k + 1), 0);
  std::vector<uint16_t> hint;
  for (int64_t m = m_lo; m <= k; ++m) {
    t.hint_off[m] = static_cast<int64_t>(hint.size());
    const uint64_t nkeys = key_of(t.binom(e, m)) + 1;
    int64_t a = m - 1;  // C(a, m) strictly increases from 0 over a in [m - 1, E]
    for (uint64_t key = 0; key < nkeys; ++key) {
      while (a + 1 <= e && key_of(t.binom(a + 1, m)) < key) ++a;
      hint.push_back(static_cast<uint16_t>(a));
      int64_t same = 0;  // a's above with the same key: the candidates to compare
      while (a + same + 1 <= e && key_of(t.binom(a + same + 1, m)) == key) ++same;
      t.w = std::max<int>(t.w, static_cast<int>(same));
    }
  }
  if (t.w > kMaxW) return t;
  t.fast = true;
  if (e <= 256) t.hint8.assign(hint.begin(), hint.end());
  else t.hint16 = std::move(hint);
  if (use_pair) {
    t.pair.assign(static_cast<size_t>(t.binom(e, 2)), 0);
    for (int64_t a1 = 1; a1 < e; ++a1) {
      for (int64_t a0 = 0; a0 < a1; ++a0) {
        t.pair[a1 * (a1 - 1) / 2 + a0] = static_cast<uint16_t>(a1 << 8 | a0);
      }
    }
  }
  return t;
}

// ------------------------------------------------------------------ rank
// Ranks of rows [0, n) into rank[]; adds the rows' below counts to *below_sum.
// Ids must be in [0, E): callers check the block's min / max first.
template <typename I, int K>
inline void rank_rows_k(const I* ids, int64_t n, const uint64_t* c, int64_t stride,
                        uint64_t* rank, int64_t* below_sum) {
  int64_t total = 0;
  for (int64_t row = 0; row < n; ++row) {
    const I* x = ids + row * K;
    int64_t a[K];
    for (int i = 0; i < K; ++i) a[i] = static_cast<int64_t>(x[i]);
    uint64_t r = 0;
    for (int i = 0; i < K; ++i) {
      int64_t below = 0;
      for (int j = 0; j < K; ++j) below += a[j] < a[i];
      total += below;
      r += c[(below + 1) * stride + a[i]];
    }
    rank[row] = r;
  }
  *below_sum += total;
}

template <typename I>
inline void rank_rows_any(const I* ids, int64_t n, int64_t k, const uint64_t* c, int64_t stride,
                          uint64_t* rank, int64_t* below_sum) {
  int64_t total = 0;
  for (int64_t row = 0; row < n; ++row) {
    const I* x = ids + row * k;
    uint64_t r = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t ai = static_cast<int64_t>(x[i]);
      int64_t below = 0;
      for (int64_t j = 0; j < k; ++j) below += static_cast<int64_t>(x[j]) < ai;
      total += below;
      r += c[(below + 1) * stride + ai];
    }
    rank[row] = r;
  }
  *below_sum += total;
}

template <typename I>
inline void rank_rows(const I* ids, int64_t n, int64_t k, const Tables& t, uint64_t* rank,
                      int64_t* below_sum) {
  const uint64_t* c = t.c.data();
  switch (k) {
#define COMPASS_SETCODE_K(K) \
  case K: return rank_rows_k<I, K>(ids, n, c, t.stride, rank, below_sum);
    COMPASS_SETCODE_K(1) COMPASS_SETCODE_K(2) COMPASS_SETCODE_K(3) COMPASS_SETCODE_K(4)
    COMPASS_SETCODE_K(5) COMPASS_SETCODE_K(6) COMPASS_SETCODE_K(7) COMPASS_SETCODE_K(8)
#undef COMPASS_SETCODE_K
    default: return rank_rows_any<I>(ids, n, k, c, t.stride, rank, below_sum);
  }
}

// ---------------------------------------------------------------- unrank
constexpr int kBatch = 8;  // rows unranked together: their table loads overlap

// Largest a in [lo, hi] with C(a, m) <= r, by bisection (no hints).
inline int64_t largest_a(const uint64_t* cm, uint64_t r, int64_t lo, int64_t hi) {
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cm[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// ranks[0, n) (each < C(E, K)) -> rows of ids, ascending. Hinted levels write
// their ids through put(row, level, a); level 1 (and 2 with the pair table) too.
template <int W, typename H, typename Put>
inline void unrank_batch(const uint64_t* ranks, const Tables& t, const H* hint, Put&& put) {
  const int64_t k = t.k;
  const uint64_t* c = t.c.data();
  const int64_t stride = t.stride;
  const bool use_pair = !t.pair.empty();
  const int64_t m_lo = use_pair ? 3 : 2;
  uint64_t r[kBatch];
  for (int j = 0; j < kBatch; ++j) r[j] = ranks[j];
  for (int64_t m = k; m >= m_lo; --m) {
    const uint64_t* cm = c + m * stride;
    const H* h = hint + t.hint_off[m];
#ifndef __CUDACC__
#pragma GCC unroll 8
#endif
    for (int j = 0; j < kBatch; ++j) {
      int64_t a = h[key_of(r[j])];
      if constexpr (W == 1) {  // both candidates loaded at once: no load after the compare
        const uint64_t c0 = cm[a], c1 = cm[a + 1];
        const bool up = c1 <= r[j];
        a += up;
        r[j] -= up ? c1 : c0;
        put(j, m - 1, a);
      } else {
        int64_t up = 0;
        for (int q = 1; q <= W; ++q) up += cm[a + q] <= r[j];
        a += up;
        put(j, m - 1, a);
        r[j] -= cm[a];
      }
    }
  }
  if (use_pair && k >= 2) {
    const uint16_t* pair = t.pair.data();
    for (int j = 0; j < kBatch; ++j) {
      const uint16_t p = pair[r[j]];
      put(j, 1, p >> 8);
      put(j, 0, p & 255);
    }
  } else {
    for (int j = 0; j < kBatch; ++j) put(j, 0, static_cast<int64_t>(r[j]));
  }
}

// Without hints (C(E, m) >= 2^63 for some m, or a wide hint): bisection per level.
template <typename Put>
inline void unrank_slow(uint64_t r, const Tables& t, Put&& put) {
  int64_t prev = t.e;
  for (int64_t m = t.k; m >= 1; --m) {
    const int64_t a = largest_a(t.c.data() + m * t.stride, r, m - 1, prev - 1);
    put(m - 1, a);
    r -= t.binom(a, m);
    prev = a;
  }
}

// ------------------------------------------------------------ bit packing
// Writes fixed-width values LSB first from a byte-aligned start.
struct BitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int n = 0;  // bits in acc, < 64
  void put(uint64_t v, int bits) {  // 1 <= bits <= 64, v < 2^bits
    acc |= v << n;
    n += bits;
    if (n >= 64) {
      std::memcpy(p, &acc, 8);
      p += 8;
      n -= 64;
      acc = n ? v >> (bits - n) : 0;
    }
  }
  void finish() {
    for (; n > 0; n -= 8, acc >>= 8) *p++ = static_cast<uint8_t>(acc);
    n = 0;
  }
};

// The value of `bits` bits at bit offset `o` of src[0, size).
inline uint64_t read_bits(const uint8_t* src, int64_t size, int64_t o, int bits) {
  const int64_t byte = o >> 3;
  const int s = static_cast<int>(o & 7);
  uint64_t lo, hi = 0;
  if (byte + 16 <= size) {
    std::memcpy(&lo, src + byte, 8);
    std::memcpy(&hi, src + byte + 8, 8);
  } else {  // the tail: zero-padded copy
    uint8_t tmp[16] = {};
    std::memcpy(tmp, src + byte, static_cast<size_t>(std::min<int64_t>(16, size - byte)));
    std::memcpy(&lo, tmp, 8);
    std::memcpy(&hi, tmp + 8, 8);
  }
  uint64_t v = lo >> s;
  if (s && s + bits > 64) v |= hi << (64 - s);
  return bits == 64 ? v : v & ((uint64_t{1} << bits) - 1);
}

}  // namespace setcode
}  // namespace routing
}  // namespace compass
