// Set coding of routing traces on the CPU: ids [rows, K] <-> the payload of
// codec "set" (the math and the layout: setcode.h). OpenMP over byte-aligned
// chunks of packs; within a chunk, blocks of rows: check the block's ids
// (range, duplicates: one compare per block, the row named only on failure),
// rank, pack; or unpack, check the ranks, unrank.
//
// Two builds of the block loops: the x86-64 baseline and AVX2 (chosen at run
// time, __builtin_cpu_supports). With AVX2 and uint8 ids, K <= 8, a row's
// ranks come from one 8-byte load: 64 byte compares in two registers, their
// counts per id by psadbw, then K table reads. impl = 1 forces the baseline
// (the tests run both).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "compass/tensor_view.h"
#include "routing/codec_args.h"
#include "routing/routing_api.h"
#include "routing/setcode.h"

namespace compass {
namespace routing {

namespace {

using setcode::Tables;
constexpr int64_t kParallelMinRows = int64_t{1} << 16;
constexpr int64_t kBlockRows = 512;

// ------------------------------------------------------ unrank tables (R12)
// The decode of uint8 ids with E <= 256, 3 <= K <= 8, C(E, K) < 2^52 (DeepSeek-V3,
// Qwen3-MoE). A rank r travels as R = r << 12 | 0xfff. Level m = K .. 3: a
// byte hint h = hint[m][lz_key(R)] with the answer a in {h, h + 1}; the two
// candidates c[m][h], c[m][h + 1] hold C(a, m) << 12 | a, so one compare R >= c
// (the low field of R is >= 4095 - 6 * 255 > 255 >= a: it never decides),
// one conditional move and R -= sel give the next R, and the id is sel's low
// byte, stored straight into the row. The low field only shrinks by the ids
// subtracted (<= 255 per level, K - 2 levels) and never borrows from r, so no
// mask or OR per level. Levels 2 and 1: the pair table at R >> 12.
//
// lz_key(R) = lz * 128 + the top 8 bits of R << lz (lz = leading zeros):
// exponent and 7 mantissa bits, as key_of but on integers: lzcnt, shift,
// shift, shift and add (about 4 cycles of latency against 11 for the int ->
// double -> int round trip of key_of, which this loop, latency bound, feels).
constexpr int kLowBits = 12;
constexpr uint64_t kLowFill = (uint64_t{1} << kLowBits) - 1;
constexpr int64_t kLzKeys = 64 * 128 + 256;  // lz in [0, 64) x top byte in [128, 256)
constexpr int64_t kC12Stride = 264;          // a in [0, 256], padded
constexpr int kR12Batch = 8;                 // rows unranked together

struct R12 {
  bool ok = false;
  std::vector<uint8_t> hint;  // [m * kLzKeys + lz_key(R)], m in [3, K]
  std::vector<uint64_t> c;    // [m * kC12Stride + a] = C(a, m) << 12 | a; a > min(E, 255): ~0
};

// Inlined into the AVX2 build of decode_packs (target lzcnt: __builtin_clzll is one lzcnt).
__attribute__((always_inline)) inline uint64_t lz_key(uint64_t big_r) {  // big_r >= 2^9 (its low field)
  const int lz = __builtin_clzll(big_r);
  return (static_cast<uint64_t>(lz) << 7) + ((big_r << lz) >> 56);
}

R12 make_r12(const Tables& t) {
  R12 x;
  const int64_t e = t.e, k = t.k;
  if (e > 256 || k < 3 || k > 8 || t.pair.empty() || t.n >= (uint64_t{1} << 52)) return x;
  x.c.assign(static_cast<size_t>((k + 1) * kC12Stride), ~uint64_t{0});
  for (int64_t m = 1; m <= k; ++m) {
    for (int64_t a = 0; a <= std::min<int64_t>(e, 255); ++a) {
      x.c[m * kC12Stride + a] = t.binom(a, m) << kLowBits | static_cast<uint64_t>(a);
    }
  }
  x.hint.assign(static_cast<size_t>((k + 1) * kLzKeys), 0);
  for (int64_t m = 3; m <= k; ++m) {
    const uint64_t* cm = t.c.data() + m * t.stride;
    const uint64_t top = t.binom(e, m);  // ranks at level m are < C(E, m)
    for (int lz = 0; lz < 64; ++lz) {
      for (int byte = 128; byte < 256; ++byte) {
        // the R with this key: [byte << 56 >> lz, (byte + 1) << 56 >> lz); their r = R >> 12
        const unsigned __int128 lo = static_cast<unsigned __int128>(byte) << 56 >> lz;
        const unsigned __int128 hi = (static_cast<unsigned __int128>(byte + 1) << 56 >> lz) - 1;
        const uint64_t r0 = static_cast<uint64_t>(lo >> kLowBits);
        const uint64_t r1 = std::min<uint64_t>(static_cast<uint64_t>(hi >> kLowBits), top - 1);
        if (r0 >= top) continue;  // no valid rank has this key
        const int64_t a0 = setcode::largest_a(cm, r0, m - 1, e - 1);
        const int64_t a1 = setcode::largest_a(cm, r1, m - 1, e - 1);
        if (a1 - a0 > 1) return R12{};  // more than two candidates: not this path
        x.hint[m * kLzKeys + lz * 128 + byte] = static_cast<uint8_t>(a0);
      }
    }
  }
  x.ok = true;
  return x;
}

struct CodecTables {
  Tables t;
  R12 r12;
};

// One Tables per (E, K), built once per process and thread.
const CodecTables& codec_tables(int64_t e, int64_t k) {
  static thread_local std::deque<CodecTables> cache;  // stable references
  for (const CodecTables& c : cache) {
    if (c.t.e == e && c.t.k == k) return c;
  }
  check_set_layout(e, k);
  CodecTables c;
  c.t = setcode::make_tables(e, k);
  c.r12 = make_r12(c.t);
  cache.push_back(std::move(c));
  return cache.back();
}

const Tables& tables(int64_t e, int64_t k) { return codec_tables(e, k).t; }

// The first bad row of ids[r0, r1) (cold path: names the row and the id).
// block: the ids of rows [r0, r1).
template <typename I>
void explain_bad_rows(const I* block, int64_t r0, int64_t r1, int64_t k, int64_t e,
                      const char* name) {
  for (int64_t r = r0; r < r1; ++r) {
    const I* x = block + (r - r0) * k;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t a = static_cast<int64_t>(x[i]);
      COMPASS_CHECK(a >= 0 && a < e, name, ": expert id ", a, " out of range [0, ", e,
                    ") at row ", r);
      for (int64_t j = 0; j < i; ++j) {
        COMPASS_CHECK(static_cast<int64_t>(x[j]) != a, name, ": expert ", a, " twice in row ", r);
      }
    }
  }
  COMPASS_CHECK(false, name, ": internal error: rows [", r0, ", ", r1, ") flagged but valid");
}

// ------------------------------------------------------------------ AVX2 rank
// uint8 ids, K <= 8 (E <= 256), rows [0, n) with 8 readable bytes at each row.
// One pass: the ranks (into rank[], or with kPack straight into w, bits each:
// G == 1), the sum of the below counts (duplicates) and the largest id (range;
// any id is inside the [K+1, 256] table, so the check can come after).
template <int K, bool kPack>
__attribute__((target("avx2,bmi,bmi2"))) void rank_rows_avx2(
    const uint8_t* ids, int64_t n, const uint64_t* c8, uint64_t* rank, int64_t* below_sum,
    int64_t* max_id, setcode::BitWriter* w, int bits) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  // lanes j >= K of a row never count as below (0x7f after the flip is the max)
  alignas(32) int8_t keep_b[32], pad_b[32], one1_b[32], one2_b[32];
  for (int q = 0; q < 32; ++q) {
    const int j = q % 8;
    keep_b[q] = j < K ? -1 : 0;
    pad_b[q] = j < K ? 0 : 0x7f;
    one1_b[q] = q / 8 < K ? 1 : 0;      // ids i = 0..3 in the four 8-byte groups
    one2_b[q] = q / 8 + 4 < K ? 1 : 0;  // ids i = 4..7
  }
  const __m256i keep = _mm256_load_si256(reinterpret_cast<const __m256i*>(keep_b));
  const __m256i pad = _mm256_load_si256(reinterpret_cast<const __m256i*>(pad_b));
  const __m256i one1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(one1_b));
  const __m256i one2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(one2_b));
  const __m256i sh1 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                       2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sh2 = _mm256_setr_epi8(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6,
                                       6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7);
  const __m256i zero = _mm256_setzero_si256();
  const uint64_t* cc = c8 + 256;  // row m = below + 1
  __m256i acc = zero;
  const __m128i row_bytes = _mm_cvtsi64_si128(K == 8 ? -1 : static_cast<long long>((1ull << (8 * K)) - 1));
  __m128i mx = _mm_setzero_si128();
  setcode::BitWriter out{nullptr};
  if constexpr (kPack) out = *w;
  for (int64_t row = 0; row < n; ++row) {
    uint64_t w;
    std::memcpy(&w, ids + row * K, 8);
    mx = _mm_max_epu8(mx, _mm_and_si128(_mm_cvtsi64_si128(static_cast<long long>(w)), row_bytes));
    const __m256i x = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(w)), flip);
    const __m256i a = _mm256_or_si256(_mm256_and_si256(x, keep), pad);
    const __m256i b1 = _mm256_shuffle_epi8(x, sh1), b2 = _mm256_shuffle_epi8(x, sh2);
    const __m256i s1 = _mm256_sad_epu8(_mm256_and_si256(_mm256_cmpgt_epi8(b1, a), one1), zero);
    const __m256i s2 = _mm256_sad_epu8(_mm256_and_si256(_mm256_cmpgt_epi8(b2, a), one2), zero);
    acc = _mm256_add_epi64(acc, _mm256_add_epi64(s1, s2));
    const __m256i i1 = _mm256_or_si256(_mm256_slli_epi64(s1, 8),
                                       _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(w))));
    const __m256i i2 = _mm256_or_si256(
        _mm256_slli_epi64(s2, 8), _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(w >> 32))));
    alignas(32) uint64_t ix[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix), i1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix + 4), i2);
    uint64_t r = 0;
    for (int i = 0; i < K; ++i) r += cc[ix[i]];
    if constexpr (kPack) out.put(r, bits);
    else rank[row] = r;
  }
  if constexpr (kPack) *w = out;
  alignas(32) uint64_t s[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s), acc);
  *below_sum += static_cast<int64_t>(s[0] + s[1] + s[2] + s[3]);
  alignas(16) uint8_t m[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(m), mx);
  int64_t hi = 0;
  for (int i = 0; i < 8; ++i) hi = std::max<int64_t>(hi, m[i]);
  *max_id = hi;
}

bool use_avx2() {  // the AVX2 build also uses BMI2 shifts and lzcnt
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") &&
                         __builtin_cpu_supports("lzcnt");
  return ok;
}

// ------------------------------------------------------------- block loops
struct EncodeArgs {
  const Tables* t;
  int64_t rows, k;
  uint8_t* dst;
  const bool* missing;  // [rows] or null: rows coded as 0..K-1 (rank 0), ids not read
  const char* name;
  bool avx2;
};

// Packs [p0, p1) (p0 a multiple of 8 unless 0): ids -> bits from dst + p0 * B / 8.
template <typename I>
void encode_packs(const EncodeArgs& g, const I* ids, int64_t p0, int64_t p1) {
  const Tables& t = *g.t;
  const int64_t k = g.k, group = t.group, bits = t.bits;
  if (p0 >= p1) return;
  setcode::BitWriter w{g.dst + p0 * bits / 8};
  const int64_t block_packs = std::max<int64_t>(1, kBlockRows / group);
  uint64_t rank[kBlockRows + 64];
  std::vector<I> filled;  // a block with missing rows: a copy holding 0..K-1 there
  const int64_t total_bytes = g.rows * k * static_cast<int64_t>(sizeof(I));
  for (int64_t q0 = p0; q0 < p1; q0 += block_packs) {
    const int64_t q1 = std::min(p1, q0 + block_packs);
    const int64_t r0 = q0 * group, r1 = std::min(g.rows, q1 * group), n = r1 - r0;
    const I* x = ids + r0 * k;
    if (g.missing) {
      bool any = false;
      for (int64_t i = r0; i < r1; ++i) any |= g.missing[i];
      if (any) {
        filled.assign(x, x + n * k);
        filled.resize(n * k + 8);  // room for the 8-byte row loads
        for (int64_t i = 0; i < n; ++i) {
          if (!g.missing[r0 + i]) continue;
          for (int64_t j = 0; j < k; ++j) filled[i * k + j] = static_cast<I>(j);
        }
        x = filled.data();
      }
    }
    // range: the block's min and max (vectorizes; the AVX2 pass keeps its own
    // max); duplicates: the below counts
    int64_t below = 0;
    int64_t done = 0, packed = 0;  // rows ranked by AVX2; rows already in w
    if constexpr (sizeof(I) == 1) {
      if (g.avx2 && k <= 8 && !t.c8.empty()) {
        // rows whose 8-byte load stays inside the ids array
        const int64_t room = x == ids + r0 * k ? total_bytes - r0 * k - 8 : n * k;
        const int64_t fast = room < 0 ? 0 : std::min(n, room / k + 1);
        const uint8_t* u = reinterpret_cast<const uint8_t*>(x);
        const bool pack = group == 1 && bits > 0;
        int64_t hi = 0;
        if (fast > 0) {
          const int b = static_cast<int>(bits);
          switch (k * 2 + pack) {
#define COMPASS_RANK_AVX2(K)                                                          \
  case 2 * K: rank_rows_avx2<K, false>(u, fast, t.c8.data(), rank, &below, &hi, &w, b); break; \
  case 2 * K + 1: rank_rows_avx2<K, true>(u, fast, t.c8.data(), rank, &below, &hi, &w, b); break;
            COMPASS_RANK_AVX2(1) COMPASS_RANK_AVX2(2) COMPASS_RANK_AVX2(3) COMPASS_RANK_AVX2(4)
            COMPASS_RANK_AVX2(5) COMPASS_RANK_AVX2(6) COMPASS_RANK_AVX2(7) COMPASS_RANK_AVX2(8)
#undef COMPASS_RANK_AVX2
          }
          done = fast;
          if (pack) packed = fast;
        }
        if (hi >= t.e) explain_bad_rows(x, r0, r1, k, t.e, g.name);
      }
    }
    if (done < n) {
      const I* y = x + done * k;
      I mn = y[0], mx = y[0];
      for (int64_t i = 0; i < (n - done) * k; ++i) {
        mn = std::min(mn, y[i]);
        mx = std::max(mx, y[i]);
      }
      if (static_cast<int64_t>(mn) < 0 || static_cast<int64_t>(mx) >= t.e) {
        explain_bad_rows(x, r0, r1, k, t.e, g.name);
      }
      setcode::rank_rows<I>(y, n - done, k, t, rank + done, &below);
    }
    if (below != n * (k * (k - 1) / 2)) explain_bad_rows(x, r0, r1, k, t.e, g.name);
    if (bits == 0) continue;  // K == E: nothing to store
    if (group == 1) {
      for (int64_t i = packed; i < n; ++i) w.put(rank[i], static_cast<int>(bits));
    } else {
      for (int64_t q = 0; q < q1 - q0; ++q) {
        const int64_t a = q * group, b = std::min(n, a + group);
        uint64_t v = 0;  // < N^G <= 2^64
        for (int64_t i = b - 1; i >= a; --i) v = v * t.n + rank[i];
        w.put(v, static_cast<int>(bits));
      }
    }
  }
  w.finish();
}

struct DecodeArgs {
  const Tables* t;
  int64_t rows, k;
  const uint8_t* src;
  int64_t size;
  const R12* r12;  // usable (ok) or null
};

// R12 unrank of kR12Batch rows: R[j] = rank << 12 | 0xfff -> rows out[j * K, j * K + K).
template <int K>
__attribute__((always_inline)) inline void r12_batch(uint64_t* big_r, const R12& x, const uint16_t* pair, uint8_t* out) {
  const uint8_t* hint = x.hint.data();
  const uint64_t* c = x.c.data();
#ifndef __CUDACC__
#pragma GCC unroll 8
#endif
  for (int m = K; m >= 3; --m) {
    const uint8_t* hm = hint + m * kLzKeys;
    const uint64_t* cm = c + m * kC12Stride;
#ifndef __CUDACC__
#pragma GCC unroll 8
#endif
    for (int j = 0; j < kR12Batch; ++j) {
      const uint64_t h = hm[lz_key(big_r[j])];
      const uint64_t lo = cm[h], hi = cm[h + 1];  // both loaded before the compare
      // a select by mask, never a branch (the ?: form compiled to a branch here: 2x slower)
      const uint64_t take_hi = uint64_t{0} - static_cast<uint64_t>(big_r[j] >= hi);
      const uint64_t sel = lo ^ ((lo ^ hi) & take_hi);
      big_r[j] -= sel;
      out[j * K + m - 1] = static_cast<uint8_t>(sel);
    }
  }
#ifndef __CUDACC__
#pragma GCC unroll 8
#endif
  for (int j = 0; j < kR12Batch; ++j) {
    const uint16_t p = pair[big_r[j] >> kLowBits];  // a_1 << 8 | a_0: little-endian bytes a_0, a_1
    std::memcpy(out + j * K, &p, 2);
  }
}

// Packs [p0, p1) of a G = 1 layout with B <= 52 bits (p0 a multiple of 8 or 0):
// bits -> uint8 ids by R12, batches of 8 packs (byte aligned) read straight
// from the payload, the rank check (< C(E, K)) one compare per row. Returns
// the first corrupted pack, or -1.
// kBits: B as a constant (DeepSeek-V3 49, Qwen3-MoE 41: the pack offsets and
// shifts become immediates), or 0 (B at run time).
template <int K, int kBits>
__attribute__((always_inline)) inline int64_t decode_packs_r12(const DecodeArgs& g, uint8_t* ids,
                                                               int64_t p0, int64_t p1) {
  const Tables& t = *g.t;
  const R12& x = *g.r12;
  const uint16_t* pair = t.pair.data();
  const int bits = kBits > 0 ? kBits : static_cast<int>(t.bits);
  const uint64_t field = (uint64_t{1} << (bits + kLowBits)) - 1;  // bits + 12 <= 64
  const uint64_t lim = t.n << kLowBits;                            // R >= lim: rank >= C(E, K)
  int off[kR12Batch], shl[kR12Batch];  // pack j of a batch: byte off[j], bit (12 - shl[j])
  for (int j = 0; j < kR12Batch; ++j) {
    off[j] = j * bits >> 3;
    shl[j] = kLowBits - (j * bits & 7);
  }
  // packs whose 8-byte load stays inside the payload: [0, safe)
  const int64_t safe = g.size >= 8 ? ((g.size - 8) * 8) / bits + 1 : 0;
  const int64_t fast_end = std::max(p0, std::min(p1, safe) - kR12Batch + 1);
  int64_t q = p0;
  for (; q < fast_end; q += kR12Batch) {
    const uint8_t* p = g.src + q / 8 * bits;  // q is a multiple of 8
    uint64_t big_r[kR12Batch];
    uint64_t bad = 0;
    for (int j = 0; j < kR12Batch; ++j) {
      uint64_t v;
      std::memcpy(&v, p + off[j], 8);
      big_r[j] = ((v << shl[j]) & field) | kLowFill;
      bad |= big_r[j] >= lim;
    }
    if (bad) {
      for (int j = 0; j < kR12Batch; ++j) {
        if (big_r[j] >= lim) return q + j;
      }
    }
    r12_batch<K>(big_r, x, pair, ids + q * K);
  }
  // the last packs (fewer than a batch, or at the payload's end): padded with rank 0
  for (; q < p1; q += kR12Batch) {
    const int64_t n = std::min<int64_t>(kR12Batch, p1 - q);
    uint64_t big_r[kR12Batch];
    for (int j = 0; j < kR12Batch; ++j) {
      const uint64_t r = j < n ? setcode::read_bits(g.src, g.size, (q + j) * bits, bits) : 0;
      if (r >= t.n) return q + j;
      big_r[j] = r << kLowBits | kLowFill;
    }
    uint8_t tmp[kR12Batch * K];
    r12_batch<K>(big_r, x, pair, tmp);
    std::memcpy(ids + q * K, tmp, static_cast<size_t>(n * K));
  }
  return -1;
}

// Unranks n <= kBatch ranks into rows out[0, n).
template <typename I, int K, int W>
void unrank_into(const uint64_t* ranks, int64_t n, const Tables& t, I* out) {
  constexpr int kBits = 8 * sizeof(I);
  constexpr int kPerWord = 64 / kBits;
  constexpr int kWords = K > 0 ? (K + kPerWord - 1) / kPerWord : 1;
  if (n == setcode::kBatch && K > 0 && t.fast) {
    uint64_t word[kWords][setcode::kBatch] = {};
    auto put = [&](int j, int64_t level, int64_t a) {
      word[level / kPerWord][j] |= static_cast<uint64_t>(a) << (kBits * (level % kPerWord));
    };
    if (t.hint8.empty()) setcode::unrank_batch<W>(ranks, t, t.hint16.data(), put);
    else setcode::unrank_batch<W>(ranks, t, t.hint8.data(), put);
    for (int j = 0; j < setcode::kBatch; ++j) {
      for (int q = 0; q < kWords; ++q) {
        const int cnt = std::min(kPerWord, K - q * kPerWord);
        std::memcpy(out + j * K + q * kPerWord, &word[q][j], cnt * sizeof(I));
      }
    }
    return;
  }
  const int64_t k = t.k;
  if (t.fast) {  // a partial batch or K > 8: padded ranks, direct stores
    uint64_t r[setcode::kBatch] = {};
    std::copy(ranks, ranks + n, r);
    auto put = [&](int j, int64_t level, int64_t a) {
      if (j < n) out[j * k + level] = static_cast<I>(a);
    };
    if (t.hint8.empty()) setcode::unrank_batch<W>(r, t, t.hint16.data(), put);
    else setcode::unrank_batch<W>(r, t, t.hint8.data(), put);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    setcode::unrank_slow(ranks[j], t,
                         [&](int64_t level, int64_t a) { out[j * k + level] = static_cast<I>(a); });
  }
}

// Packs [p0, p1): bits -> ids. Returns the first corrupted pack, or -1.
// always_inline: each ISA wrapper below gets its own copy (else the AVX2 one is
// a jump to the one baseline copy).
template <typename I, int K, int W>
__attribute__((always_inline)) inline int64_t decode_packs(const DecodeArgs& g, I* ids, int64_t p0,
                                                           int64_t p1) {
  if constexpr (sizeof(I) == 1 && (K == 6 || K == 8)) {
    if (g.r12) {
      if constexpr (K == 8) {
        if (g.t->bits == 49) return decode_packs_r12<K, 49>(g, ids, p0, p1);
        if (g.t->bits == 41) return decode_packs_r12<K, 41>(g, ids, p0, p1);
      }
      return decode_packs_r12<K, 0>(g, ids, p0, p1);
    }
  }
  const Tables& t = *g.t;
  const int64_t k = g.k, group = t.group, bits = t.bits;
  const int64_t block_packs = std::max<int64_t>(1, kBlockRows / group);
  uint64_t rank[kBlockRows + 64];
  for (int64_t q0 = p0; q0 < p1; q0 += block_packs) {
    const int64_t q1 = std::min(p1, q0 + block_packs);
    const int64_t r0 = q0 * group, r1 = std::min(g.rows, q1 * group), n = r1 - r0;
    if (bits == 0) {
      std::fill(rank, rank + n, 0);
    } else if (group == 1) {
      uint64_t mx = 0;
      int64_t i = 0;
      if (bits <= 57) {  // a pack at any bit shift fits one 8-byte load
        const uint64_t mask = (uint64_t{1} << bits) - 1;
        // packs whose 8-byte load stays inside the payload
        const int64_t safe = g.size >= 8 ? ((g.size - 8) * 8) / bits + 1 - q0 : 0;
        const int64_t fast = std::max<int64_t>(0, std::min(n, safe));
        for (; i < fast; ++i) {
          const int64_t o = (q0 + i) * bits;
          uint64_t x;
          std::memcpy(&x, g.src + (o >> 3), 8);
          rank[i] = (x >> (o & 7)) & mask;
          mx = std::max(mx, rank[i]);
        }
      }
      for (; i < n; ++i) {
        rank[i] = setcode::read_bits(g.src, g.size, (q0 + i) * bits, static_cast<int>(bits));
        mx = std::max(mx, rank[i]);
      }
      if (mx >= t.n) {
        for (int64_t i = 0; i < n; ++i) {
          if (rank[i] >= t.n) return q0 + i;
        }
      }
    } else {
      for (int64_t q = q0; q < q1; ++q) {
        uint64_t v = setcode::read_bits(g.src, g.size, q * bits, static_cast<int>(bits));
        const int64_t a = (q - q0) * group, b = std::min(n, a + group);
        for (int64_t i = a; i < b; ++i) {
          rank[i] = v % t.n;
          v /= t.n;
        }
        if (v != 0) return q;  // a value >= N^G (or past the last row): corrupted
      }
    }
    I* out = ids + r0 * k;
    int64_t i = 0;
    for (; i + setcode::kBatch <= n; i += setcode::kBatch) {
      unrank_into<I, K, W>(rank + i, setcode::kBatch, t, out + i * k);
    }
    if (i < n) unrank_into<I, K, W>(rank + i, n - i, t, out + i * k);
  }
  return -1;
}

// The block loops, compiled for the baseline and for AVX2 (+BMI2 shifts).
#define COMPASS_SETCODE_ISA(suffix, attr)                                                  \
  template <typename I>                                                                    \
  attr void encode_packs_##suffix(const EncodeArgs& g, const I* ids, int64_t p0,           \
                                  int64_t p1) {                                            \
    encode_packs<I>(g, ids, p0, p1);                                                       \
  }                                                                                        \
  template <typename I, int K, int W>                                                      \
  attr int64_t decode_packs_##suffix(const DecodeArgs& g, I* ids, int64_t p0, int64_t p1) { \
    return decode_packs<I, K, W>(g, ids, p0, p1);                                          \
  }
COMPASS_SETCODE_ISA(base, )
COMPASS_SETCODE_ISA(avx2, __attribute__((target("avx2,bmi,bmi2,lzcnt"))))
#undef COMPASS_SETCODE_ISA

template <typename I, int K, int W>
int64_t decode_packs_isa(bool avx2, const DecodeArgs& g, I* ids, int64_t p0, int64_t p1) {
  return avx2 ? decode_packs_avx2<I, K, W>(g, ids, p0, p1)
              : decode_packs_base<I, K, W>(g, ids, p0, p1);
}

template <typename I, int K>
int64_t decode_packs_w(bool avx2, const DecodeArgs& g, I* ids, int64_t p0, int64_t p1) {
  switch (g.t->w) {
    case 0:
    case 1: return decode_packs_isa<I, K, 1>(avx2, g, ids, p0, p1);
    case 2: return decode_packs_isa<I, K, 2>(avx2, g, ids, p0, p1);
    default: return decode_packs_isa<I, K, setcode::kMaxW>(avx2, g, ids, p0, p1);
  }
}

template <typename I>
int64_t decode_packs_any(bool avx2, const DecodeArgs& g, I* ids, int64_t p0, int64_t p1) {
  switch (g.k) {
    case 1: return decode_packs_w<I, 1>(avx2, g, ids, p0, p1);
    case 2: return decode_packs_w<I, 2>(avx2, g, ids, p0, p1);
    case 4: return decode_packs_w<I, 4>(avx2, g, ids, p0, p1);
    case 6: return decode_packs_w<I, 6>(avx2, g, ids, p0, p1);
    case 8: return decode_packs_w<I, 8>(avx2, g, ids, p0, p1);
    default: return decode_packs_w<I, 0>(avx2, g, ids, p0, p1);
  }
}

// Packs per thread chunk: a multiple of 8, so every chunk starts on a byte.
int64_t chunk_packs(int64_t packs, int nthreads) {
  const int64_t c = (packs + nthreads - 1) / nthreads;
  return (c + 7) / 8 * 8;
}

std::atomic<int> g_threads{0};  // set_code_threads: 0 = the OpenMP default

int threads_for(int64_t rows) {
  const int cap = g_threads.load(std::memory_order_relaxed);
  return rows < kParallelMinRows ? 1 : std::max(1, cap > 0 ? cap : omp_get_max_threads());
}

// R12 decodes: uint8 ids, K in {6, 8} (the specialised kernels; K = 4 never has
// G = 1 with E <= 256), a G = 1 layout of <= 52 bits (R = r << 12 fits 64 bits),
// in the AVX2 build (lzcnt: the baseline's bsr would make it slower than the
// level-by-level unrank).
bool use_r12(const CodecTables& ct, bool uint8_ids, bool avx2) {
  const Tables& t = ct.t;
  return ct.r12.ok && (t.k == 6 || t.k == 8) && t.group == 1 && t.bits > 0 && t.bits <= 52 &&
         uint8_ids && avx2;
}

bool pick_avx2(int64_t impl) {
  COMPASS_CHECK(impl == 0 || impl == 1, "impl: expected 0 (auto) or 1 (baseline x86-64), got ",
                impl);
  return impl == 0 && use_avx2();
}

}  // namespace

int64_t set_code_threads(int64_t threads) {
  COMPASS_CHECK(threads >= 0, "threads: expected >= 0 (0: the OpenMP default), got ", threads);
  return g_threads.exchange(static_cast<int>(threads));
}

int64_t set_code_group(int64_t num_experts, int64_t top_k) {
  return tables(num_experts, top_k).group;
}

int64_t set_code_pack_bits(int64_t num_experts, int64_t top_k) {
  return tables(num_experts, top_k).bits;
}

int64_t set_code_bytes(int64_t rows, int64_t num_experts, int64_t top_k) {
  COMPASS_CHECK(rows >= 0, "rows: expected >= 0, got ", rows);
  const Tables& t = tables(num_experts, top_k);
  return set_payload_bytes(rows, setcode::PackLayout{t.n, t.group, t.bits});
}

void encode_sets_cpu(TensorView ids, int64_t num_experts, std::optional<TensorView> missing,
                     TensorView out, int64_t impl) {
  COMPASS_NAME_ARGS(ids, missing, out);
  ids.expect_ndim(2).expect_contiguous().expect_device(DeviceType::kCPU);
  out.expect_vector().expect_dtype(DType::kUInt8).expect_device(DeviceType::kCPU);
  if (missing) {
    missing->expect_vector().expect_dtype(DType::kBool).expect_device(DeviceType::kCPU);
    missing->expect_size(0, ids.size(0), "one per row = ids.shape[0]");
  }
  const bool avx2 = pick_avx2(impl);
  const int64_t rows = ids.size(0), k = ids.size(1);
  const Tables& t = tables(num_experts, k);
  const int64_t need = set_code_bytes(rows, num_experts, k);
  COMPASS_CHECK(out.numel() == need, out.name, ": expected ", need, " bytes, got ", out.numel());
  const int64_t packs = (rows + t.group - 1) / t.group;
  const EncodeArgs g{&t,   rows, k, out.ptr<uint8_t>(), missing ? missing->ptr<bool>() : nullptr,
                     ids.name, avx2};
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    const I* src = ids.ptr<I>();
    auto run = [&](int64_t p0, int64_t p1) {
      if (avx2) encode_packs_avx2<I>(g, src, p0, p1);
      else encode_packs_base<I>(g, src, p0, p1);
    };
    const int nt = threads_for(rows);
    if (nt == 1) return run(0, packs);
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

std::string set_code_decode_path(int64_t num_experts, int64_t top_k, bool uint8_ids,
                                 int64_t impl) {
  const bool avx2 = pick_avx2(impl);
  const CodecTables& ct = codec_tables(num_experts, top_k);
  if (ct.t.bits == 0) return "none";
  if (use_r12(ct, uint8_ids, avx2)) return "r12";
  return ct.t.fast ? "hint" : "bisect";
}

void decode_sets_cpu(TensorView data, int64_t num_experts, TensorView ids, int64_t impl) {
  COMPASS_NAME_ARGS(data, ids);
  data.expect_vector().expect_dtype(DType::kUInt8).expect_device(DeviceType::kCPU);
  ids.expect_ndim(2).expect_contiguous().expect_device(DeviceType::kCPU);
  const bool avx2 = pick_avx2(impl);
  const int64_t rows = ids.size(0), k = ids.size(1);
  const CodecTables& ct = codec_tables(num_experts, k);
  const Tables& t = ct.t;
  const int64_t need = set_code_bytes(rows, num_experts, k);
  COMPASS_CHECK(data.numel() == need, data.name, ": expected ", need, " bytes for ", rows,
                " rows, got ", data.numel());
  const int64_t packs = (rows + t.group - 1) / t.group;
  const bool r12 = use_r12(ct, ids.dtype == DType::kUInt8, avx2);
  const DecodeArgs g{&t, rows, k, data.ptr<uint8_t>(), need, r12 ? &ct.r12 : nullptr};
  std::vector<int64_t> bad(1, -1);
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    I* dst = ids.ptr<I>();
    const int nt = threads_for(rows);
    if (nt == 1) {
      bad[0] = decode_packs_any<I>(avx2, g, dst, 0, packs);
      return;
    }
    // Chunks of ~2^14 rows (byte aligned) taken in turn: a thread whose core is
    // busy with other work takes fewer (the host's cores are shared), instead
    // of the call waiting for its fixed half.
    const int64_t chunks = std::max<int64_t>(nt, (packs * t.group) >> 14);
    const int64_t chunk = chunk_packs(packs, static_cast<int>(std::min<int64_t>(chunks, 1 << 20)));
    const int64_t n_chunks = (packs + chunk - 1) / chunk;
    bad.assign(static_cast<size_t>(n_chunks), -1);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t c = 0; c < n_chunks; ++c) {
      bad[static_cast<size_t>(c)] = decode_packs_any<I>(
          avx2, g, dst, std::min(packs, c * chunk), std::min(packs, (c + 1) * chunk));
    }
  });
  for (int64_t b : bad) {
    COMPASS_CHECK(b < 0, data.name, ": pack ", b, " holds a value past C(", num_experts, ", ", k,
                  ")^", t.group, " (corrupted payload)");
  }
}

void encode_sets_op_cpu(COMPASS_ENCODE_SETS_ARGS) {
  COMPASS_NAME_ARGS(ids, missing, payload, status, table);
  check_encode_sets_args(ids, num_experts, missing, payload, status, table);
  ids.expect_device(DeviceType::kCPU);
  encode_sets_cpu(ids, num_experts, missing, payload, 0);  // raises naming a bad row
  const int64_t k = ids.size(1), e = num_experts;
  const Tables& t = tables(e, k);
  int64_t* tab = table.ptr<int64_t>();
  for (int64_t m = 1; m <= k; ++m) {
    for (int64_t a = 0; a < e; ++a) tab[(m - 1) * e + a] = static_cast<int64_t>(t.binom(a, m));
  }
  status.ptr<int64_t>()[0] = 0;   // no bad row (they raise above)
  status.ptr<int64_t>()[1] = -1;
}

}  // namespace routing
}  // namespace compass
