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

// One Tables per (E, K), built once per process and thread.
const Tables& tables(int64_t e, int64_t k) {
  static thread_local std::deque<Tables> cache;  // stable references
  for (const Tables& t : cache) {
    if (t.e == e && t.k == k) return t;
  }
  check_set_layout(e, k);
  cache.push_back(setcode::make_tables(e, k));
  return cache.back();
}

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

bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
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
};

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
template <typename I, int K, int W>
int64_t decode_packs(const DecodeArgs& g, I* ids, int64_t p0, int64_t p1) {
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
COMPASS_SETCODE_ISA(avx2, __attribute__((target("avx2,bmi,bmi2"))))
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

void decode_sets_cpu(TensorView data, int64_t num_experts, TensorView ids, int64_t impl) {
  COMPASS_NAME_ARGS(data, ids);
  data.expect_vector().expect_dtype(DType::kUInt8).expect_device(DeviceType::kCPU);
  ids.expect_ndim(2).expect_contiguous().expect_device(DeviceType::kCPU);
  const bool avx2 = pick_avx2(impl);
  const int64_t rows = ids.size(0), k = ids.size(1);
  const Tables& t = tables(num_experts, k);
  const int64_t need = set_code_bytes(rows, num_experts, k);
  COMPASS_CHECK(data.numel() == need, data.name, ": expected ", need, " bytes for ", rows,
                " rows, got ", data.numel());
  const int64_t packs = (rows + t.group - 1) / t.group;
  const DecodeArgs g{&t, rows, k, data.ptr<uint8_t>(), need};
  std::vector<int64_t> bad(1, -1);
  dispatch(ids, Types<uint8_t, int16_t>{}, [&](auto tag) {
    using I = decltype(tag);
    I* dst = ids.ptr<I>();
    const int nt = threads_for(rows);
    if (nt == 1) {
      bad[0] = decode_packs_any<I>(avx2, g, dst, 0, packs);
      return;
    }
    const int64_t chunk = chunk_packs(packs, nt);
    bad.assign(static_cast<size_t>(nt), -1);
#pragma omp parallel num_threads(nt)
    {
      const int me = omp_get_thread_num();
      bad[static_cast<size_t>(me)] = decode_packs_any<I>(
          avx2, g, dst, std::min(packs, me * chunk), std::min(packs, (me + 1) * chunk));
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
