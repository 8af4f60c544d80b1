// The packing planner (ck.packing.plan): sequences -> data-parallel ranks ->
// micro-batches, every constraint at once.
//
// 0. Input: lengths, padded here to pad_multiple (what the cap counts), and the
//    cost balanced: the padded tokens themselves (int64 arithmetic throughout:
//    balances are exact) or a*P + b*P^2 (float64). Both grow with P, so one
//    order by decreasing tokens is also decreasing cost.
// 1. Items: a group (group_ids) or a single sequence; items never split across
//    ranks. Sequences are ordered by packed keys (top - tokens) << ib | index,
//    32 bits wide where they fit (64 else), by a stable LSD radix sort in
//    8-bit digits, or a counting sort where the token range is small
//    (decreasing, ties by index either way), O(n); the keys stay packed and
//    their readers (items, by_rank) decode them. Items are relabelled by that
//    order, so item j is at least as heavy as item j + 1 and an id comparison
//    is a cost comparison.
// 2. Ranks: LPT (largest first onto the least-loaded rank, a tournament tree:
//    O(n log dp); with equal_samples a rank takes at most ceil(G/k) items and
//    only G % k ranks that many; without it, the middle of the sorted items
//    goes by a linear snake sweep, one item of each block of k per rank, see
//    lpt_ranks), then refinement: the heaviest rank against
//    the lightest (then the next lightest ...) takes the single move or pairwise
//    swap whose cost difference is closest to half their gap, found by one
//    two-pointer scan of both ranks' sorted members (O(m) per step), until the
//    heaviest rank is at the lower bound: max(ceil(total / k), largest item) for
//    token costs (provably optimal, no other method can do better), within
//    1e-9 of max(total / k, largest item) for float costs. Only when that bound
//    is not reached does Karmarkar-Karp (largest differencing in equal-size
//    mode, what RL frameworks run) seed a second candidate, refined the same
//    way, and the better one is kept: so the result is never worse than KK's.
//    Swaps keep item counts, so equal_samples holds throughout.
// 3. Micro-batches: M = the largest per-rank lower bound (ceil(tokens / cap), or
//    the number of sequences longer than cap / 2, each needing its own), rounded
//    up to micro_batch_multiple; every rank is packed into exactly M bins by
//    LPT on cost among the bins with room. Where that fails or leaves the
//    heaviest bin over the rank's bound (its lower bound + kBinTolerance),
//    the level fit: first fit by decreasing tokens into M bins of the
//    balanced level (mean tokens + kBinTolerance) rather than the cap, the
//    sequences fitting under no level then by LPT under the cap (while LPT
//    misses on most ranks, ranks try this first). The first packing within
//    the bound is taken; if both fit over it, both are refined and the better
//    kept. Where neither fits, first-fit
//    decreasing (a max-tree over bin room, O(m log m)) gives a feasible count:
//    M grows to the largest such count and ranks LPT cannot pack use FFD plus
//    splitting of their heaviest bins. Then, over the bound, the same move /
//    swap refinement between bins (bounded: partners and steps), never
//    breaking the cap.
//    Ranks go in groups of kLanes: the group's first choice (LPT for integer
//    costs, LptLanes; the level fit's first fit, LevelLanes) runs on all its
//    ranks at once, interleaved step by step, so the dependent tree updates
//    of one rank overlap those of the others (the level fit's first fit, up
//    to 32 bins: whole-row SSE2 compares instead of a tree). Same packings as
//    one at a time.
// 4. Output: each micro-batch by ascending sequence index, written by one pass
//    over all sequences (each knows its rank's bin: a uint32 map written in
//    the pass that sizes the bins; each bin knows where its sequences go),
//    not by per-bin sorts.
// Deterministic: every tie is broken by index. Serial: a host step that runs
// once per training step, where waking an OpenMP team on a busy host costs
// more than it saves. Buffers live in a per-thread workspace reused across
// calls (no allocation or page faults per plan once warm).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "packing/packing_api.h"

// Per-phase timers: a profiling driver defines COMPASS_PHASE(name) before
// including this file (scripts/profile_plan.cpp: thread CPU time per phase,
// accumulated over calls); otherwise the markers compile to nothing.
#ifndef COMPASS_PHASE
#define COMPASS_PHASE(name) \
  do {                      \
  } while (0)
#define COMPASS_COUNT(name, v) \
  do {                         \
  } while (0)
#endif

namespace compass {
namespace packing {

namespace {

// Refinement partners tried per step for the heaviest micro-batch (the
// lightest ones first): bins are many and cheap to rebalance, a full scan per
// step costs O(M^2) for little gain.
constexpr int64_t kBinPartners = 8;
// Micro-batches stop refining within 0.5% of their lower bound: their balance
// is a pipeline-bubble concern, and the last fractions of a percent cost most
// of the planner's time at 64k sequences.
constexpr double kBinTolerance = 5e-3;
// Float costs: ranks stop within 1e-9 of the lower bound max(total / k,
// largest item) (token costs are integers and stop at the exact optimum).
constexpr double kRankTolerance = 1e-9;
// Rank LPT places the middle of the items by a snake sweep (lpt_ranks) only
// from this many items per rank: below it LPT's tree updates cost little, and
// the refinement took more steps after the sweep (bimodal 4096 / 64).
constexpr int64_t kBulkMinPerBin = 96;
// The snake sweep stops while the items left exceed the lift of every rank
// to the heaviest by kSnakeMargin * k times the largest of them: LPT levels
// with those (a wider margin: more tree updates, fewer refinement steps).
constexpr int64_t kSnakeMargin = 8;
// Refinement over this many bins or more finds the heaviest and the lightest
// by tournament trees (ranks at dp 32+); fewer bins: by scans.
constexpr int64_t kTreeMinBins = 32;
// Micro-batches: while LPT fails on most ranks the level fit goes first; every
// kLptProbe-th rank tries LPT first anyway.
constexpr int64_t kLptProbe = 16;

// ------------------------------------------------------------------ sorting
// Stable LSD radix sort: out = 0..n-1 ordered by increasing key (ties by
// index). 11-bit digits at most, as few passes as the key range needs (two
// for lengths up to 2^22). Short inputs: a comparison sort.
void radix_order(const uint64_t* key, int64_t n, std::vector<int64_t>& out,
                 std::vector<int64_t>& tmp) {
  out.resize(n);
  std::iota(out.begin(), out.end(), int64_t{0});
  uint64_t hi = 0;
  for (int64_t i = 0; i < n; ++i) hi |= key[i];
  if (hi == 0 || n < 2) return;
  if (n <= 64) {
    std::stable_sort(out.begin(), out.end(), [key](int64_t a, int64_t b) { return key[a] < key[b]; });
    return;
  }
  const int bits = 64 - __builtin_clzll(hi);
  const int passes = (bits + 10) / 11;
  const int d = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << d) - 1;
  std::vector<int64_t> count(size_t{1} << d);
  tmp.resize(n);
  for (int p = 0; p < passes; ++p) {
    const int shift = p * d;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(key[out[i]] >> shift) & mask];
    int64_t sum = 0;
    for (int64_t& c : count) {
      const int64_t v = c;
      c = sum;
      sum += v;
    }
    for (int64_t i = 0; i < n; ++i) tmp[count[(key[out[i]] >> shift) & mask]++] = out[i];
    out.swap(tmp);
  }
}

// Indices by decreasing value, ties by index.
template <typename C>
void order_desc(const C* v, int64_t n, std::vector<int64_t>& out, std::vector<int64_t>& tmp) {
  if constexpr (std::is_integral_v<C>) {
    C top = v[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, v[i]);
    std::vector<uint64_t> key(n);
    for (int64_t i = 0; i < n; ++i) key[i] = static_cast<uint64_t>(top) - static_cast<uint64_t>(v[i]);
    radix_order(key.data(), n, out, tmp);
  } else {
    std::vector<std::pair<C, int64_t>> kv(n);
    for (int64_t i = 0; i < n; ++i) kv[i] = {-v[i], i};
    std::sort(kv.begin(), kv.end());
    out.resize(n);
    for (int64_t i = 0; i < n; ++i) out[i] = kv[i].second;
  }
}

// A sequence and its tokens.
struct SeqTok {
  int64_t seq, tok;
};

// The sequences by decreasing tokens, ties by index, as sort_tokens_desc
// leaves them: packed keys (top - tokens) << ib | index in increasing order,
// 32 bits wide where kb + ib <= 32 (ib index bits, kb bits of the token range:
// n = 64k with ranges under 2^16, every bench case), else 64 bits; or
// (sequence, tokens) pairs where no 64-bit key holds both. The keys stay
// packed: a reader decodes the one it loads (a mask, a shift), so the sort
// writes no decoded copy and by_rank's gather reads 4 bytes per sequence
// (16 as pairs: at n = 64k the gathered array is 256 KB, not 1 MB).
struct TokOrder {
  int width = 32;  // 32, 64: the keys are in a32 / a64; 0: pairs in st
  int ib = 0;
  int64_t top = 0;
  std::vector<uint32_t> a32, b32, cnt;
  std::vector<uint64_t> a64, b64;
  std::vector<SeqTok> st;
};

// Readers of a TokOrder: v[j] = the j-th sequence by decreasing tokens, and its
// tokens; v.tok(j) alone.
template <typename K>
struct PackedView {
  const K* a;
  int ib;
  K imask;
  int64_t top;
  SeqTok operator[](int64_t j) const {
    const K v = a[j];
    return {static_cast<int64_t>(v & imask), top - static_cast<int64_t>(v >> ib)};
  }
  int64_t tok(int64_t j) const { return top - static_cast<int64_t>(a[j] >> ib); }
};
struct PairView {
  const SeqTok* st;
  SeqTok operator[](int64_t j) const { return st[j]; }
  int64_t tok(int64_t j) const { return st[j].tok; }
};

// f(view) with the view that reads o (one instantiation of f per width).
template <typename F>
void with_order(const TokOrder& o, F&& f) {
  if (o.width == 32) {
    f(PackedView<uint32_t>{o.a32.data(), o.ib, (uint32_t{1} << o.ib) - 1, o.top});
  } else if (o.width == 64) {
    f(PackedView<uint64_t>{o.a64.data(), o.ib, (uint64_t{1} << o.ib) - 1, o.top});
  } else {
    f(PairView{o.st.data()});
  }
}

// How sort_tokens_desc ordered (the test hook reports it).
enum SortPath : int64_t { kSortCompare = 0, kSortCount = 1, kSortRadix = 2, kSortPairs = 3 };

// Radix digits: at most 8 bits, 256 counters per pass (every pass's table
// together is a few KB, in L1) and 256 write streams per scatter. The bench's
// 16-bit ranges take two passes with 8- or 11-bit digits alike, and 11 bits
// measured no faster there.
constexpr int kMaxDigit = 8;

// Stable LSD radix sort of the keys (top - tokens) << ib | index on their kb
// token bits: the index bits need no pass, the keys start in index order. One
// read pass builds the keys and every pass's histogram; a pass whose digit is
// one value for every key is skipped. K is the key width (uint32_t: half the
// bytes per pass); counts are K too (n < 2^ib fits).
template <typename K>
void radix_keys(const int64_t* tok, int64_t n, int64_t top, int kb, int ib, std::vector<K>& a,
                std::vector<K>& b) {
  a.resize(n);
  K* pa = a.data();
  if (kb == 0 || n <= 64) {  // one token value, or short: a comparison sort
    for (int64_t i = 0; i < n; ++i) pa[i] = (static_cast<K>(top - tok[i]) << ib) | static_cast<K>(i);
    if (kb > 0) std::sort(pa, pa + n);  // keys are distinct: the stable order
    return;
  }
  const int passes = (kb + kMaxDigit - 1) / kMaxDigit;  // <= 8
  const int d = (kb + passes - 1) / passes;
  const K mask = (K{1} << d) - 1;
  const size_t buckets = size_t{1} << d;
  K count[8][size_t{1} << kMaxDigit];
  for (int p = 0; p < passes; ++p) std::memset(count[p], 0, buckets * sizeof(K));
  auto build = [&](auto fixed) {  // fixed: the pass count known at compile time, or 0
    constexpr int P = decltype(fixed)::value;
    for (int64_t i = 0; i < n; ++i) {
      const K key = static_cast<K>(top - tok[i]);
      pa[i] = (key << ib) | static_cast<K>(i);
      if constexpr (P > 0) {
        for (int p = 0; p < P; ++p) ++count[p][(key >> (p * d)) & mask];
      } else {
        for (int p = 0; p < passes; ++p) ++count[p][(key >> (p * d)) & mask];
      }
    }
  };
  if (passes == 2) build(std::integral_constant<int, 2>{});
  else if (passes == 1) build(std::integral_constant<int, 1>{});
  else build(std::integral_constant<int, 0>{});
  b.resize(n);
  for (int p = 0; p < passes; ++p) {
    const int shift = ib + p * d;
    K* cp = count[p];
    if (cp[(a[0] >> shift) & mask] == static_cast<K>(n)) continue;  // one digit value
    K sum = 0;
    for (size_t c = 0; c < buckets; ++c) {
      const K v = cp[c];
      cp[c] = sum;
      sum += v;
    }
    const K* src = a.data();
    K* dst = b.data();
    for (int64_t i = 0; i < n; ++i) {
      const K v = src[i];
      dst[cp[(v >> shift) & mask]++] = v;
    }
    a.swap(b);
  }
}

// c[0:m] -> its exclusive prefix sums. The counting sort's table has as many
// entries as token values (64k for the bench's lengths, 8-16 per sequence):
// 4 lanes at once halve its cost (one dependent add per 4 entries, not per
// entry).
void exclusive_prefix(uint32_t* c, uint64_t m) {
  uint32_t sum = 0;
  uint64_t v = 0;
#ifdef __SSE2__
  __m128i carry = _mm_setzero_si128();
  for (; v + 4 <= m; v += 4) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + v));
    __m128i inc = _mm_add_epi32(x, _mm_slli_si128(x, 4));
    inc = _mm_add_epi32(inc, _mm_slli_si128(inc, 8));  // inclusive sums within the 4
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + v), _mm_add_epi32(carry, _mm_sub_epi32(inc, x)));
    carry = _mm_add_epi32(carry, _mm_shuffle_epi32(inc, 0xFF));
  }
  sum = static_cast<uint32_t>(_mm_cvtsi128_si32(carry));
#endif
  for (; v < m; ++v) {
    const uint32_t x = c[v];
    c[v] = sum;
    sum += x;
  }
}

// Counting sort of the same keys where the token range is small next to n:
// one histogram of top - tokens (32-bit counts), one scatter of the keys to
// their places (ties keep index order). Fewer passes than radix once the
// range needs two digits.
template <typename K>
void count_keys(const int64_t* tok, int64_t n, int64_t top, uint64_t range, int ib,
                std::vector<uint32_t>& cnt, std::vector<K>& a) {
  cnt.assign(range + 1, 0);
  uint32_t* c = cnt.data();
  for (int64_t i = 0; i < n; ++i) ++c[static_cast<uint64_t>(top - tok[i])];
  exclusive_prefix(c, range + 1);
  a.resize(n);
  K* pa = a.data();
  for (int64_t i = 0; i < n; ++i) {
    const K key = static_cast<K>(top - tok[i]);
    pa[c[key]++] = (key << ib) | static_cast<K>(i);
  }
}

// Sequences by decreasing tokens, ties by index, into o (see TokOrder); bot and
// top are the smallest and largest tokens (plan_cpu's check pass has them).
// Keys of 32 bits where they fit, else 64: sorted by counting where the range is
// small next to n, else by radix; keys over 64 bits: order_desc into pairs.
SortPath sort_tokens_desc(const int64_t* tok, int64_t n, int64_t bot, int64_t top, TokOrder& o) {
  const uint64_t range = static_cast<uint64_t>(top) - static_cast<uint64_t>(bot);
  const int ib = n > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(n - 1)) : 1;
  const int kb = range ? 64 - __builtin_clzll(range) : 0;
  o.ib = ib;
  o.top = top;
  if (kb + ib > 64) {
    o.width = 0;
    std::vector<int64_t> seq, tmp;
    order_desc(tok, n, seq, tmp);
    o.st.resize(n);
    for (int64_t j = 0; j < n; ++j) o.st[j] = {seq[j], tok[seq[j]]};
    return kSortPairs;
  }
  o.width = kb + ib <= 32 ? 32 : 64;
  // counting: a range past one digit and at most 8 per sequence (its table
  // and prefix then cost less than the radix sort's second pass); n < 2^32 for
  // 32-bit counts
  const bool counting = n > 64 && kb > kMaxDigit && range <= 8 * static_cast<uint64_t>(n) &&
                        range < (uint64_t{1} << 17) && n < (int64_t{1} << 32);
  if (o.width == 32) {
    if (counting) count_keys(tok, n, top, range, ib, o.cnt, o.a32);
    else radix_keys(tok, n, top, kb, ib, o.a32, o.b32);
  } else {
    if (counting) count_keys(tok, n, top, range, ib, o.cnt, o.a64);
    else radix_keys(tok, n, top, kb, ib, o.a64, o.b64);
  }
  return counting ? kSortCount : kb == 0 || n <= 64 ? kSortCompare : kSortRadix;
}

// ------------------------------------------------------------------- items
// Items relabelled by decreasing cost: w[j] >= w[j + 1]. The sequences of item
// j are member[start[j] : start[j + 1]] (ascending index).
template <typename C>
struct Items {
  std::vector<C> w;
  std::vector<int64_t> start, member;
  int64_t size() const { return static_cast<int64_t>(w.size()); }
};

// ------------------------------------------------------------------- bins
// Bins (ranks, or micro-batches of one rank) of items; each bin's members are
// kept by decreasing id, that is by increasing cost.
template <typename C>
struct Bins {
  std::vector<std::vector<int64_t>> mem;
  std::vector<C> load;
  void reset(int64_t nb) {
    mem.resize(nb);
    for (auto& m : mem) m.clear();
    load.assign(nb, C{0});
  }
  int64_t size() const { return static_cast<int64_t>(load.size()); }
  C max_load() const { return *std::max_element(load.begin(), load.end()); }
};

void erase_id(std::vector<int64_t>& m, int64_t x) {
  m.erase(std::lower_bound(m.begin(), m.end(), x, std::greater<int64_t>()));
}
void insert_id(std::vector<int64_t>& m, int64_t x) {
  m.insert(std::lower_bound(m.begin(), m.end(), x, std::greater<int64_t>()), x);
}

// The exchange between bins h and r that lowers the larger of the two loads
// the most: x leaves h and y (or nothing, y = -1) leaves r, with difference
// d = w[x] - w[y] in (0, gap) closest to gap / 2. xs and ys are by increasing
// cost, so for each x (increasing) the y closest to w[x] - gap / 2 only moves
// forward: one two-pointer scan, O(|xs| + |ys|). Scores are |2d - gap|,
// exact for integer costs. fits(x, y) filters (cap, counts). The scan stops
// at the best score possible, 0, or 1 for integer costs and an odd gap (2d -
// gap is then odd): no later pair can beat it, so the stop changes no result
// (it cut the rank refinement's time up to 10x: the scan ran to its end
// whenever the gap was odd).
template <typename C>
struct Exchange {
  int64_t x = -1, y = -1;
  C score{};
};

template <bool kSwapsFit = false, typename C, typename Fits>
Exchange<C> best_exchange(const std::vector<int64_t>& xs, const std::vector<int64_t>& ys,
                          const C* w, C gap, Fits&& fits) {
  Exchange<C> best;
  best.score = gap;  // a candidate must beat it: d strictly inside (0, gap)
  C floor{0};        // the best score possible
  if constexpr (std::is_integral_v<C>) floor = gap & 1;
  auto consider = [&](int64_t x, int64_t y, C d) {
    if (d <= C{0} || d >= gap) return;
    C s = 2 * d - gap;
    if (s < C{0}) s = -s;
    if (s < best.score && fits(x, y)) best.x = x, best.y = y, best.score = s;
  };
  const int64_t nx = static_cast<int64_t>(xs.size()), ny = static_cast<int64_t>(ys.size());
  {  // moves: the x closest to gap / 2
    int64_t lo = 0, hi = nx;  // first x with 2 w[x] >= gap
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (2 * w[xs[mid]] < gap) lo = mid + 1;
      else hi = mid;
    }
    for (int64_t p = std::max<int64_t>(lo - 2, 0); p < std::min(lo + 2, nx); ++p) {
      consider(xs[p], int64_t{-1}, w[xs[p]]);
    }
  }
  int64_t j = 0;
  for (int64_t i = 0; i < nx && best.score > floor; ++i) {
    const int64_t x = xs[i];
    const C t = 2 * w[x] - gap;  // want 2 w[y] close to t
    while (j < ny && 2 * w[ys[j]] < t) ++j;
    if constexpr (kSwapsFit && std::is_integral_v<C>) {
      // every swap fits and scores are exact: of j - 2, j - 1 (below t,
      // scores growing away from it) only j - 1 can win, or j - 2 where its
      // cost is the same (it comes first); of j, j + 1 only j
      if (j > 0) {
        const int64_t q = j >= 2 && w[ys[j - 2]] == w[ys[j - 1]] ? j - 2 : j - 1;
        consider(x, ys[q], w[x] - w[ys[q]]);
      }
      if (j < ny) consider(x, ys[j], w[x] - w[ys[j]]);
    } else {
      for (int64_t q = std::max<int64_t>(j - 2, 0); q < std::min(j + 2, ny); ++q) {
        consider(x, ys[q], w[x] - w[ys[q]]);
      }
    }
  }
  return best;
}

// ------------------------------------------------------- min tree
// The least-loaded bin, ties to the lower index: a tournament (winner) tree
// over the bins, LPT's one operation per item. Updating a leaf recomputes the
// minima on its path to the root: log2(k) levels whose addresses are known in
// advance, so the loads overlap and only a chain of branch-free minima
// remains (a binary heap's sift chases data-dependent addresses). Integer
// loads pack (load, index) into one uint64 key whenever the total fits beside
// the index bits; float loads use (load, index) pairs. A bin set aside (no
// room, or full under equal_samples) gets the largest key.
template <typename C>
struct MinTree {
  bool packed = false;
  int shift = 0;
  uint64_t mask = 0;
  int64_t leaves = 1;
  std::vector<uint64_t> tk;               // packed: [2 * leaves], root at 1
  std::vector<std::pair<C, int64_t>> tp;  // pairs

  // k bins at load 0; `total`: the most any load can reach
  void init(int64_t k, C total) {
    leaves = 1;
    while (leaves < k) leaves *= 2;
    packed = false;
    if constexpr (std::is_integral_v<C>) {
      shift = leaves > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(leaves - 1)) : 1;
      mask = (uint64_t{1} << shift) - 1;
      packed = static_cast<uint64_t>(total) < (uint64_t{1} << (63 - shift));
    }
    if (packed) {
      tk.assign(2 * leaves, ~uint64_t{0});
      for (int64_t r = 0; r < k; ++r) tk[leaves + r] = static_cast<uint64_t>(r);
      for (int64_t i = leaves - 1; i >= 1; --i) tk[i] = std::min(tk[2 * i], tk[2 * i + 1]);
    } else {
      tp.assign(2 * leaves, {std::numeric_limits<C>::max(), std::numeric_limits<int64_t>::max()});
      for (int64_t r = 0; r < k; ++r) tp[leaves + r] = {C{0}, r};
      for (int64_t i = leaves - 1; i >= 1; --i) tp[i] = std::min(tp[2 * i], tp[2 * i + 1]);
    }
  }
  bool empty() const {
    return packed ? tk[1] == ~uint64_t{0}
                  : tp[1].second == std::numeric_limits<int64_t>::max();
  }
  int64_t top() const { return packed ? static_cast<int64_t>(tk[1] & mask) : tp[1].second; }
  C top_load() const { return packed ? static_cast<C>(tk[1] >> shift) : tp[1].first; }
  template <typename K>
  static void replay(std::vector<K>& t, int64_t i) {
    // the running minimum stays in a register and only siblings are loaded:
    // no load waits on the store of the level below
    K cur = t[i];
    for (; i > 1; i >>= 1) {
      cur = std::min(cur, t[i ^ 1]);
      t[i >> 1] = cur;
    }
  }
  void set(int64_t r, C load) {  // bin r's load is now `load`
    const int64_t i = leaves + r;
    if (packed) {
      tk[i] = (static_cast<uint64_t>(load) << shift) | static_cast<uint64_t>(r);
      replay(tk, i);
    } else {
      tp[i] = {load, r};
      replay(tp, i);
    }
  }
  void set_aside(int64_t r) {
    const int64_t i = leaves + r;
    if (packed) {
      tk[i] = ~uint64_t{0};
      replay(tk, i);
    } else {
      tp[i] = {std::numeric_limits<C>::max(), std::numeric_limits<int64_t>::max()};
      replay(tp, i);
    }
  }
  void add_top(C d) {
    const int64_t r = top();
    set(r, top_load() + d);
  }
  // Packed only: the root is `root` (the caller keeps it in a register);
  // the least-loaded bin gains d. Returns the new root: LPT's next step
  // starts from it without reading back what the replay just stored.
  uint64_t add_top_packed(uint64_t root, C d) {
    int64_t i = leaves + static_cast<int64_t>(root & mask);
    uint64_t cur = root + (static_cast<uint64_t>(d) << shift);
    tk[i] = cur;
    for (; i > 1; i >>= 1) {
      cur = std::min(cur, tk[i ^ 1]);
      tk[i >> 1] = cur;
    }
    return cur;
  }
};

// Until the heaviest bin is at `target` or cannot be lowered: the heaviest bin
// h exchanges with the lightest bin that offers an exchange (lightest first,
// at most max_partners tried). fits(h, r, x, y) says whether the exchange keeps
// both bins feasible; applied(h, r, x, y) is told of each change made.
// kSwapsFit: the caller's fits accepts every swap (y >= 0), so the scan
// considers fewer candidates (same result). Returns the steps taken.
template <bool kSwapsFit = false, typename C, typename Fits, typename Applied>
int64_t refine(Bins<C>& b, const C* w, C target, int64_t max_iter, int64_t max_partners,
               Fits&& fits, Applied&& applied, std::vector<int64_t>& scratch) {
  const int64_t nb = b.size();
  if (nb < 2) return 0;
  // From kTreeMinBins bins the heaviest and the lightest come from two
  // tournament trees (keys: total - load, and load; ties to the lower index,
  // as the scans below) updated for the two bins a step changes, not from two
  // scans of every load per step
  const bool trees = nb >= kTreeMinBins;
  static thread_local MinTree<C> light, heavy;
  C total{0};
  auto heavy_key = [&](C load) {
    if constexpr (std::is_integral_v<C>) return total - load;
    else return -load;
  };
  if (trees) {
    for (int64_t j = 0; j < nb; ++j) total += b.load[j];
    light.init(nb, total);
    heavy.init(nb, total);
    for (int64_t j = 0; j < nb; ++j) {
      light.set(j, b.load[j]);
      heavy.set(j, heavy_key(b.load[j]));
    }
  }
  auto attempt = [&](int64_t h, int64_t r) -> bool {
    const C gap = b.load[h] - b.load[r];
    if (gap <= C{0}) return false;
    const Exchange<C> e = best_exchange<kSwapsFit>(b.mem[h], b.mem[r], w, gap,
                                        [&](int64_t x, int64_t y) { return fits(h, r, x, y); });
    if (e.x < 0) return false;
    if constexpr (!std::is_integral_v<C>) {
      // the pair's larger load drops by (gap - score) / 2: no float crumbs
      if (gap - e.score <= b.load[h] * 1e-13) return false;
    }
    erase_id(b.mem[h], e.x);
    insert_id(b.mem[r], e.x);
    C d = w[e.x];
    if (e.y >= 0) {
      erase_id(b.mem[r], e.y);
      insert_id(b.mem[h], e.y);
      d -= w[e.y];
    }
    b.load[h] -= d;
    b.load[r] += d;
    if (trees) {
      light.set(h, b.load[h]);
      light.set(r, b.load[r]);
      heavy.set(h, heavy_key(b.load[h]));
      heavy.set(r, heavy_key(b.load[r]));
    }
    applied(h, r, e.x, e.y);
    return true;
  };
  int64_t iter = 0;
  for (; iter < max_iter; ++iter) {
    int64_t h = 0, l = -1;
    if (trees) {
      h = heavy.top();
    } else {
      for (int64_t j = 1; j < nb; ++j) {
        if (b.load[j] > b.load[h]) h = j;
      }
    }
    if (b.load[h] <= target) break;
    if (trees && light.top() != h) {
      l = light.top();
    } else {  // (with the trees: every load equal)
      for (int64_t j = 0; j < nb; ++j) {
        if (j != h && (l < 0 || b.load[j] < b.load[l])) l = j;
      }
    }
    if (attempt(h, l)) continue;
    bool improved = false;
    if (trees && max_partners > 1) {
      // the next lightest from the light tree, with h, l and each partner
      // tried set aside and put back after: the heap's order below (load,
      // then index), without building a heap of every bin per failed step
      // (it cost more than the attempts at 256 ranks)
      scratch.clear();
      light.set_aside(h);
      light.set_aside(l);
      for (int64_t p = 1; p < max_partners && !improved && !light.empty(); ++p) {
        const int64_t r = light.top();
        light.set_aside(r);
        scratch.push_back(r);
        improved = attempt(h, r);
      }
      light.set(h, b.load[h]);
      light.set(l, b.load[l]);
      for (int64_t r : scratch) light.set(r, b.load[r]);
    } else if (max_partners > 1 && nb > 2) {
      scratch.clear();
      for (int64_t j = 0; j < nb; ++j) {
        if (j != h && j != l) scratch.push_back(j);
      }
      const int64_t keep = std::min<int64_t>(max_partners - 1, scratch.size());
      // lightest first (ties by index, a total order): a min-heap popped
      // lazily, O(nb + tried * log nb), since the first partners usually do
      auto heavier = [&](int64_t x, int64_t y) {
        return b.load[x] != b.load[y] ? b.load[x] > b.load[y] : x > y;
      };
      std::make_heap(scratch.begin(), scratch.end(), heavier);
      auto end = scratch.end();
      for (int64_t p = 0; p < keep && !improved; ++p) {
        std::pop_heap(scratch.begin(), end, heavier);
        --end;
        improved = attempt(h, *end);
      }
    }
    if (!improved) break;
  }
  COMPASS_COUNT(nb == max_partners ? "rank steps" : "mb steps", iter);
  return iter;
}

template <typename C>
C ceil_div(C a, int64_t k) {
  if constexpr (std::is_integral_v<C>) return (a + k - 1) / k;
  else return a / static_cast<C>(k);
}

// LPT over items 0..g-1 (decreasing cost). With `card` (equal_samples):
// floor(g/k) or ceil(g/k) items per rank, exactly g % k ranks at the ceiling.
// Without it and with kBulkMinPerBin+ items per rank, the middle of the list
// is placed by a snake sweep instead: LPT places items [0, a) (a = max(2k,
// g/16)), then whole blocks of k items go one to each rank, ranks in their
// order by load after LPT (lightest first), every other block reversed: one
// linear pass with no tree update that, like LPT once items are small, gives
// every rank one item of each block (so ranks keep alike mixes of long and
// short sequences, which the micro-batch count depends on). A pair of blocks
// widens the load range by at most its largest minus its smallest item. The
// sweep stops while the items left exceed the lift of every rank to the
// heaviest by a margin (kSnakeMargin), and LPT places those: it levels the
// ranks to within one of its items, as LPT on every item would; the
// refinement then reaches the same bound. Each rank's members (by decreasing
// id) are then written rank by rank: its snake items follow from its place
// in the sweep, so only the items LPT placed are looked up (writing every
// item to its rank's list in id order scatters the writes over k lists and
// cost 6 ns an item at 64k / 256).
template <typename C>
void lpt_ranks(const std::vector<C>& w, C total, int64_t k, bool card, Bins<C>& b,
               MinTree<C>& heap,
               std::vector<int64_t>& rank_of, std::vector<int64_t>& count,
               std::vector<int64_t>& by_load) {
  const int64_t g = static_cast<int64_t>(w.size());
  // (b.reset without emptying the member lists: they are resized below,
  // and zeroing what is then overwritten cost a pass over every item)
  b.mem.resize(k);
  b.load.assign(k, C{0});
  heap.init(k, total);
  const int64_t lo = g / k, rem = g % k;
  count.assign(k, 0);
  rank_of.resize(g);
  int64_t at_hi = 0;
  int64_t a = g;  // LPT on [0, a), the snake on [a, j), LPT on [j, g)
  if (!card && g >= kBulkMinPerBin * k) a = std::max<int64_t>(2 * k, g / 16);
  auto place = [&](int64_t j) {
    if (card) {
      for (;;) {  // ranks that can take no more leave the heap for good
        const int64_t c = count[heap.top()];
        if (c < lo || (c == lo && at_hi < rem)) break;
        heap.set_aside(heap.top());
      }
    }
    const int64_t r = heap.top();
    rank_of[j] = r;
    if (card && ++count[r] == lo + 1) ++at_hi;
    b.load[r] += w[j];
    heap.add_top(w[j]);
  };
  // without `card`, packed keys: the same steps with the root in a register
  auto lpt = [&](int64_t from, int64_t to) {
    if (card || !heap.packed) {
      for (int64_t q = from; q < to; ++q) place(q);
      return;
    }
    uint64_t root = heap.tk[1];
    for (int64_t q = from; q < to; ++q) {
      const int64_t r = static_cast<int64_t>(root & heap.mask);
      rank_of[q] = r;
      b.load[r] += w[q];
      root = heap.add_top_packed(root, w[q]);
    }
  };
  int64_t j = 0;
  lpt(0, a);
  j = a;
  int64_t snake_end = a;  // the sweep placed [a, snake_end)
  if (a < g) {
    by_load.resize(k);
    std::iota(by_load.begin(), by_load.end(), int64_t{0});
    std::sort(by_load.begin(), by_load.end(), [&](int64_t x, int64_t y) {
      return b.load[x] != b.load[y] ? b.load[x] < b.load[y] : x < y;
    });
    C top = b.load[by_load[k - 1]];
    const C mean = std::is_integral_v<C> ? total / k : total / static_cast<C>(k);
    // the block [j, j + k) keeps the heaviest under top + w[j]; the items left
    // after it (total - every load) then exceed the lift to it, k * (top +
    // w[j]) - every load, by kSnakeMargin * k * w[j + k] iff
    // top + w[j] + kSnakeMargin * w[j + k] <= mean
    for (bool fwd = true; j + k < g && top + w[j] + kSnakeMargin * w[j + k] <= mean; fwd = !fwd) {
      for (int64_t i = 0; i < k; ++i, ++j) {  // item j goes to by_load[fwd ? i : k - 1 - i]
        const int64_t r = by_load[fwd ? i : k - 1 - i];
        b.load[r] += w[j];
        top = std::max(top, b.load[r]);
      }
    }
    snake_end = j;
    COMPASS_COUNT("snake items", j - a);
    for (int64_t r = 0; r < k; ++r) heap.set(r, b.load[r]);
  }
  lpt(j, g);
  // members by decreasing id: each rank's list sized first, then filled from
  // its end by ascending id: LPT's head items, the sweep's (rank by_load[p]
  // took item a + t k + p of even blocks t, a + t k + k - 1 - p of odd ones),
  // LPT's tail items
  const int64_t blocks = (snake_end - a) / k;
  count.assign(k, blocks);
  for (int64_t i = 0; i < a; ++i) ++count[rank_of[i]];
  for (int64_t i = snake_end; i < g; ++i) ++count[rank_of[i]];
  for (int64_t r = 0; r < k; ++r) b.mem[r].resize(count[r]);
  for (int64_t i = 0; i < a; ++i) {
    const int64_t r = rank_of[i];
    b.mem[r][--count[r]] = i;
  }
  if (blocks > 0) {
    for (int64_t p = 0; p < k; ++p) {
      const int64_t r = by_load[p];
      int64_t* out = b.mem[r].data() + count[r];
      for (int64_t t = 0; t < blocks; ++t) *--out = a + t * k + (t & 1 ? k - 1 - p : p);
      count[r] -= blocks;
    }
  }
  for (int64_t i = snake_end; i < g; ++i) {
    const int64_t r = rank_of[i];
    b.mem[r][--count[r]] = i;
  }
  if constexpr (!std::is_integral_v<C>) {
    // float loads summed again from each rank's lightest item up, the order
    // the KK seed sums in (integer sums are exact in any order)
    for (int64_t r = 0; r < k; ++r) {
      C sum{0};
      for (int64_t x : b.mem[r]) sum += w[x];
      b.load[r] = sum;
    }
  }
}

// Karmarkar-Karp largest differencing, equal-size mode: items sorted
// ascending, taken k at a time as partial solutions of k one-item sets;
// repeatedly merge the two with the largest spread (largest set of one with
// the smallest of the other). g not a multiple of k gets zero-cost fillers, so
// counts differ by at most one. Sets are linked lists: O(1) concatenation.
// Ties as verl's code breaks them (and Python's reference): sets by (sum,
// count, first item), larger first; partial solutions by spread, then their
// top sets in that order. Returns the rank of each item;
// `ascending` lists the items by increasing cost (ties: any fixed order).
template <typename C>
struct KKSet {
  C sum;
  int64_t count, head, tail;
};

template <typename C>
std::vector<int32_t> karmarkar_karp(const C* c, const std::vector<int64_t>& ascending, int64_t k) {
  const int64_t g = static_cast<int64_t>(ascending.size());
  const int64_t p = (g + k - 1) / k * k;  // padded with fillers g..p-1 (cost 0)
  std::vector<int64_t> idx(p);             // ascending: the fillers, then the items
  std::iota(idx.begin(), idx.begin() + (p - g), g);
  std::copy(ascending.begin(), ascending.end(), idx.begin() + (p - g));
  auto val = [&](int64_t i) { return i < g ? c[i] : C{0}; };
  const int64_t states = p / k;
  std::vector<KKSet<C>> sets(p);
  std::vector<int64_t> next(p, -1);
  auto set_before = [](const KKSet<C>& a, const KKSet<C>& b) {  // decreasing set order
    if (a.sum != b.sum) return a.sum > b.sum;
    if (a.count != b.count) return a.count > b.count;
    return a.head > b.head;
  };
  for (int64_t s = 0; s < states; ++s) {
    KKSet<C>* st = &sets[s * k];
    for (int64_t i = 0; i < k; ++i) {  // the chunk is ascending: reversed, it is in set order
      const int64_t item = idx[s * k + k - 1 - i];
      st[i] = {val(item), 1, item, item};
    }
    std::sort(st, st + k, set_before);  // equal sums: by count, then head
  }
  auto spread = [&](int64_t s) { return sets[s * k].sum - sets[s * k + k - 1].sum; };
  auto pops_after = [&](int64_t a, int64_t b) {
    const C sa = spread(a), sb = spread(b);
    if (sa != sb) return sa < sb;
    const KKSet<C>&ta = sets[a * k], &tb = sets[b * k];  // then the top sets, as set order
    if (ta.sum != tb.sum) return ta.sum < tb.sum;
    if (ta.count != tb.count) return ta.count < tb.count;
    if (ta.head != tb.head) return ta.head < tb.head;
    return a > b;
  };
  std::vector<int64_t> heap(states);
  std::iota(heap.begin(), heap.end(), int64_t{0});
  std::make_heap(heap.begin(), heap.end(), pops_after);
  while (heap.size() > 1) {
    std::pop_heap(heap.begin(), heap.end(), pops_after);
    const int64_t a = heap.back();
    heap.pop_back();
    std::pop_heap(heap.begin(), heap.end(), pops_after);
    const int64_t b = heap.back();
    heap.pop_back();
    KKSet<C>* x = &sets[a * k];
    const KKSet<C>* y = &sets[b * k];
    for (int64_t i = 0; i < k; ++i) {
      const KKSet<C>& o = y[k - 1 - i];
      next[x[i].tail] = o.head;
      x[i].tail = o.tail;
      x[i].sum += o.sum;
      x[i].count += o.count;
    }
    std::sort(x, x + k, set_before);
    heap.push_back(a);
    std::push_heap(heap.begin(), heap.end(), pops_after);
  }
  std::vector<int32_t> rank(g);
  const KKSet<C>* fin = &sets[heap[0] * k];
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t i = fin[r].head; i != -1; i = next[i]) {
      if (i < g) rank[i] = static_cast<int32_t>(r);
    }
  }
  return rank;
}

// ------------------------------------------------------- micro-batches
// First fit: a linear scan where at most 64 bins can open, else a max-tree
// over bin room, O(m log m); both take the lowest bin with room. tokens[0..m)
// in decreasing order; returns the bin count, bin_of[i] the bin of item i.
int64_t first_fit(const int64_t* tokens, int64_t m, int64_t cap, std::vector<int64_t>& bin_of,
                  std::vector<int64_t>& room) {
  // first fit leaves at most one bin at most half full: it opens at most
  // 2 * total / cap + 1 bins, and never more than m
  int64_t total = 0;
  for (int64_t i = 0; i < m; ++i) total += tokens[i];
  const int64_t most = std::min<int64_t>(m, 2 * ((total + cap - 1) / cap) + 1);
  bin_of.resize(m);
  int64_t used = 0;
  if (most <= 64) {  // few bins: a linear scan (one predictable loop) beats the tree's descent
    room.assign(most, cap);
    const int64_t smallest = tokens[m - 1];
    int64_t lo = 0;  // bins before lo have room for no item left: skipped for good
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = tokens[i];
      int64_t bin = lo;
      while (room[bin] < t) ++bin;  // bins past `used` are empty, and t <= cap
      room[bin] -= t;
      bin_of[i] = bin;
      used = std::max(used, bin + 1);
      while (lo < used && room[lo] < smallest) ++lo;
    }
    return used;
  }
  int64_t size = 1;
  while (size < most) size *= 2;
  room.assign(2 * size, cap);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = tokens[i];
    int64_t node = 1;  // the root has room: `most` bins always suffice
    while (node < size) node = room[2 * node] >= t ? 2 * node : 2 * node + 1;
    const int64_t bin = node - size;
    bin_of[i] = bin;
    used = std::max(used, bin + 1);
    room[node] -= t;
    for (node /= 2; node >= 1; node /= 2) room[node] = std::max(room[2 * node], room[2 * node + 1]);
  }
  return used;
}

// Interleaved LPT: the micro-batches of kLanes ranks at once (integer
// costs). One rank's LPT is a chain of dependent tree updates (each placement
// reads the root its predecessor wrote, then recomputes log2(M) minima up to
// it): alone, the core mostly waits on that chain. kLanes independent chains,
// advanced step by step together, overlap those waits (measured ~2x the
// placements per second of one rank at a time). The same packing as
// RankPacker::lpt: keys (load << shift | bin), the least-loaded bin (ties to
// the lower) at the root; the first M sequences open bins 0..M-1 in order (the
// tree is built with them). For integer costs a bin's load is the cap less
// its room, so the least-loaded bin has the most room: a sequence it cannot
// take fits nowhere, and that lane's LPT has failed (it runs on, ignored:
// the lanes stay in step without a branch per lane).
constexpr int kLanes = 4;
struct LptLanes {
  int64_t leaves = 1, stride = 0;
  int shift = 0;
  uint64_t mask = 0;
  std::vector<uint64_t> tree;   // lane g: [g * 2 * leaves, (g + 1) * 2 * leaves), root at 1
  std::vector<int64_t> bin_of;  // lane g: [g * stride, g * stride + m_g)
  int64_t rank[kLanes];         // the rank in each lane, -1 for none
  bool ok[kLanes];
  int64_t heaviest[kLanes];     // each lane's heaviest bin load

  // Whether keys fit: loads reach at most `most` (a rank's tokens).
  static bool fits(int64_t nbins, int64_t most) {
    int64_t l = 1;
    while (l < nbins) l *= 2;
    const int sh = l > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(l - 1)) : 0;
    return static_cast<uint64_t>(most) < (uint64_t{1} << (62 - sh));
  }
  int lane_of(int64_t r) const {
    for (int g = 0; g < kLanes; ++g) {
      if (rank[g] == r) return g;
    }
    return -1;
  }
  // LPT of the ranks ranks[0..n) (n <= kLanes), their sequences tok[g][0..m[g])
  // by decreasing tokens, into nbins bins of cap tokens; ok[g] says whether
  // it fit. Unused lanes repeat lane 0 (their results are ignored).
  void run(int n, const int64_t* ranks, const int64_t* const* tok_in, const int64_t* m_in,
           int64_t nbins, int64_t cap) {
    const int64_t* tok[kLanes];
    int64_t m[kLanes];
    int64_t mm = m_in[0], most = 0;
    for (int g = 0; g < kLanes; ++g) {
      rank[g] = g < n ? ranks[g] : -1;
      tok[g] = tok_in[g < n ? g : 0];
      m[g] = m_in[g < n ? g : 0];
      mm = std::min(mm, m[g]);
      most = std::max(most, m[g]);
    }
    leaves = 1;
    while (leaves < nbins) leaves *= 2;
    shift = leaves > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(leaves - 1)) : 0;
    mask = (uint64_t{1} << shift) - 1;
    stride = most;
    const int64_t L = leaves;
    tree.assign(kLanes * 2 * L, ~uint64_t{0});
    bin_of.resize(kLanes * stride);
    uint64_t* t[kLanes];
    int64_t* bo[kLanes];
    const uint64_t full = static_cast<uint64_t>(cap) << shift;  // a key's load part, at most
    uint64_t bad[kLanes];
    for (int g = 0; g < kLanes; ++g) {
      t[g] = tree.data() + g * 2 * L;
      bo[g] = bin_of.data() + g * stride;
      const int64_t head = std::min(m[g], nbins);
      for (int64_t q = 0; q < nbins; ++q) t[g][L + q] = static_cast<uint64_t>(q);
      for (int64_t i = 0; i < head; ++i) {
        t[g][L + i] |= static_cast<uint64_t>(tok[g][i]) << shift;
        bo[g][i] = i;
      }
      for (int64_t v = L - 1; v >= 1; --v) t[g][v] = std::min(t[g][2 * v], t[g][2 * v + 1]);
      bad[g] = 0;
    }
    auto step = [&](int g, int64_t i) {  // one placement of lane g, alone
      uint64_t* tg = t[g];
      const uint64_t top = tg[1];
      const uint64_t cur = top + (static_cast<uint64_t>(tok[g][i]) << shift);
      bad[g] |= (cur & ~mask) > full;
      bo[g][i] = static_cast<int64_t>(top & mask);
      int64_t j = L + static_cast<int64_t>(top & mask);
      uint64_t c = cur;
      tg[j] = c;
      for (; j > 1; j >>= 1) {
        c = std::min(c, tg[j ^ 1]);
        tg[j >> 1] = c;
      }
    };
    for (int64_t i = std::min(mm, nbins); i < mm; ++i) {
      uint64_t cur[kLanes];
      int64_t j[kLanes];
      for (int g = 0; g < kLanes; ++g) {
        const uint64_t top = t[g][1];
        cur[g] = top + (static_cast<uint64_t>(tok[g][i]) << shift);
        bad[g] |= (cur[g] & ~mask) > full;
        bo[g][i] = static_cast<int64_t>(top & mask);
        j[g] = L + static_cast<int64_t>(top & mask);
        t[g][j[g]] = cur[g];
      }
      for (int64_t l = 1; l < L; l *= 2) {
        for (int g = 0; g < kLanes; ++g) {
          cur[g] = std::min(cur[g], t[g][j[g] ^ 1]);
          j[g] >>= 1;
          t[g][j[g]] = cur[g];
        }
      }
    }
    for (int g = 0; g < kLanes; ++g) {
      for (int64_t i = std::max(mm, std::min(m[g], nbins)); i < m[g]; ++i) step(g, i);
      ok[g] = bad[g] == 0;
      uint64_t hi = 0;
      for (int64_t q = 0; q < nbins; ++q) hi = std::max(hi, t[g][L + q]);
      heaviest[g] = static_cast<int64_t>(hi >> shift);
    }
  }
};

// The level fit's first fit, interleaved the same way: kLanes ranks, each
// its own max-tree of room under its level; a step descends every lane's
// tree to the lowest bin with room and replays the maxima above it, without
// a branch per lane (a sequence that fits under no level descends anyway and
// takes 0 tokens; it is marked -1, left for LPT under the cap).
struct LevelLanes {
  int64_t size = 1, stride = 0;
  std::vector<int64_t> tree;    // lane g: [g * 2 * size, (g + 1) * 2 * size), root at 1
  std::vector<int64_t> bin_of;  // lane g: [g * stride, g * stride + m_g); -1: no room
  int64_t rank[kLanes], level[kLanes];
  // Up to 32 bins and levels under 2^31 (SSE2): each lane's room as int32
  // in blocks of 4, bins past nbins at -1; a step compares the whole row
  // with the sequence (one compare and mask per 4 bins) and takes the lowest
  // bin whose room holds it: no tree to descend and replay, a third of the
  // instructions at 25 bins. Same first fit.
  bool flat = false;
  int64_t row = 0, at = 0;      // int32 rooms per lane (a multiple of 4); lane 0's start
  std::vector<int32_t> rooms;   // lane g: [g * row, (g + 1) * row), 16-byte aligned

  // Lane g's room under its level in bin q after run.
  int64_t room(int g, int64_t q) const {
    return flat ? rooms[at + g * row + q] : tree[g * 2 * size + size + q];
  }

  int lane_of(int64_t r) const {
    for (int g = 0; g < kLanes; ++g) {
      if (rank[g] == r) return g;
    }
    return -1;
  }
  int32_t* row_of(int g) { return rooms.data() + at + g * row; }
#if defined(__SSE2__)
  // The flat first fit: NV blocks of 4 bins per lane.
  template <int NV>
  void run_flat(const int64_t* const* tok, const int64_t* m, int64_t mm, int64_t* const* bo) {
    int32_t* rg[kLanes];
    for (int g = 0; g < kLanes; ++g) rg[g] = row_of(g);
    auto lowest = [](const int32_t* r, int32_t x) -> uint32_t {  // bins with room >= x
      const __m128i below = _mm_set1_epi32(x - 1);
      uint32_t mask = 0;
      for (int v = 0; v < NV; ++v) {
        const __m128i row = _mm_load_si128(reinterpret_cast<const __m128i*>(r) + v);
        const __m128i c = _mm_cmpgt_epi32(row, below);
        mask |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c))) << (4 * v);
      }
      return mask;
    };
    auto place = [&](int g, int64_t i) {
      const int32_t x = static_cast<int32_t>(tok[g][i]);
      const uint32_t mask = lowest(rg[g], x);
      // no room: bin q = the row's last, less 0 tokens
      const int64_t q = __builtin_ctz(mask | (1u << (4 * NV - 1)));
      bo[g][i] = mask ? q : -1;
      rg[g][q] -= mask ? x : 0;
    };
    for (int64_t i = 0; i < mm; ++i) {
#pragma GCC unroll 4
      for (int g = 0; g < kLanes; ++g) place(g, i);
    }
    for (int g = 0; g < kLanes; ++g) {
      for (int64_t i = mm; i < m[g]; ++i) place(g, i);
    }
  }
#endif

  void run(int n, const int64_t* ranks, const int64_t* const* tok_in, const int64_t* m_in,
           const int64_t* level_in, int64_t nbins) {
    const int64_t* tok[kLanes];
    int64_t m[kLanes];
    int64_t mm = m_in[0], most = 0;
    for (int g = 0; g < kLanes; ++g) {
      const int src = g < n ? g : 0;
      rank[g] = g < n ? ranks[g] : -1;
      tok[g] = tok_in[src];
      m[g] = m_in[src];
      mm = std::min(mm, m[g]);
      most = std::max(most, m[g]);
    }
    size = 1;
    while (size < nbins) size *= 2;
    stride = most;
    bin_of.resize(kLanes * stride);
    int64_t* bo[kLanes];
    int64_t top_level = 0;
    for (int g = 0; g < kLanes; ++g) {
      bo[g] = bin_of.data() + g * stride;
      level[g] = level_in[g < n ? g : 0];
      top_level = std::max(top_level, level[g]);
    }
#if defined(__SSE2__)
    int64_t top_tok = 0;  // (the lanes' first sequences are their longest)
    for (int g = 0; g < kLanes; ++g) top_tok = std::max(top_tok, m[g] > 0 ? tok[g][0] : 0);
    flat = nbins <= 32 && std::max(top_level, top_tok) < std::numeric_limits<int32_t>::max();
    if (flat) {
      row = nbins <= 8 ? 8 : nbins <= 16 ? 16 : 32;
      rooms.resize(kLanes * row + 4);  // room to align the rows to 16 bytes
      at = static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(rooms.data()) % 16) % 16 / 4);
      for (int g = 0; g < kLanes; ++g) {
        int32_t* rg = row_of(g);
        std::fill(rg, rg + nbins, static_cast<int32_t>(level[g]));
        std::fill(rg + nbins, rg + row, int32_t{-1});
      }
      if (row == 8) run_flat<2>(tok, m, mm, bo);
      else if (row == 16) run_flat<4>(tok, m, mm, bo);
      else run_flat<8>(tok, m, mm, bo);
      return;
    }
#else
    flat = false;
#endif
    const int64_t S = size;
    tree.assign(kLanes * 2 * S, -1);
    int64_t* t[kLanes];
    for (int g = 0; g < kLanes; ++g) {
      t[g] = tree.data() + g * 2 * S;
      std::fill(t[g] + S, t[g] + S + nbins, level[g]);
      for (int64_t v = S - 1; v >= 1; --v) t[g][v] = std::max(t[g][2 * v], t[g][2 * v + 1]);
    }
    auto step = [&](int g, int64_t i) {  // one placement of lane g, alone
      int64_t* tg = t[g];
      const int64_t x = tok[g][i];
      const bool fit = tg[1] >= x;
      int64_t v = 1;
      while (v < S) v = 2 * v + (tg[2 * v] < x);
      bo[g][i] = fit ? v - S : -1;
      int64_t c = tg[v] - (fit ? x : 0);
      tg[v] = c;
      for (; v > 1; v >>= 1) {  // the running maximum stays in a register
        c = std::max(c, tg[v ^ 1]);
        tg[v >> 1] = c;
      }
    };
    for (int64_t i = 0; i < mm; ++i) {
      int64_t x[kLanes], v[kLanes];
      bool fit[kLanes];
#pragma GCC unroll 4
      for (int g = 0; g < kLanes; ++g) {
        x[g] = tok[g][i];
        fit[g] = t[g][1] >= x[g];
        v[g] = 1;
      }
      for (int64_t l = 1; l < S; l *= 2) {
#pragma GCC unroll 4
        for (int g = 0; g < kLanes; ++g) v[g] = 2 * v[g] + (t[g][2 * v[g]] < x[g]);
      }
      int64_t c[kLanes];
#pragma GCC unroll 4
      for (int g = 0; g < kLanes; ++g) {
        bo[g][i] = fit[g] ? v[g] - S : -1;
        c[g] = t[g][v[g]] - (fit[g] ? x[g] : 0);
        t[g][v[g]] = c[g];
      }
      for (int64_t l = 1; l < S; l *= 2) {
  #pragma GCC unroll 4
      for (int g = 0; g < kLanes; ++g) {
          c[g] = std::max(c[g], t[g][v[g] ^ 1]);
          v[g] >>= 1;
          t[g][v[g]] = c[g];
        }
      }
    }
    for (int g = 0; g < kLanes; ++g) {
      for (int64_t i = mm; i < m[g]; ++i) step(g, i);
    }
  }
};

// A rank's bound for its heaviest micro-batch: its lower bound max(total /
// nbins, largest cost) plus kBinTolerance. Packings under it are not refined.
template <typename C>
C bin_target(C total, C largest, int64_t nbins) {
  if constexpr (std::is_integral_v<C>) {
    const C lb = std::max<C>((total + nbins - 1) / nbins, largest);
    return lb + static_cast<C>(static_cast<double>(lb) * kBinTolerance);
  } else {
    return std::max(total / static_cast<C>(nbins), largest) * (1.0 + kBinTolerance);
  }
}

// One rank's packing state, reused across ranks (no allocation per rank).
template <typename C>
struct RankPacker {
  const C* w = nullptr;          // local id (decreasing cost) -> cost
  const int64_t* tok = nullptr;  // local id -> tokens
  std::vector<C> wbuf;           // w for float costs (integer costs: w is tok)
  std::vector<int64_t> room, bin_of, scratch, all, ff_room;
  Bins<C> b;
  MinTree<C> heap;
  std::vector<std::pair<C, int64_t>> aside;
  C total{};  // of the rank's costs
  int64_t m = 0;
  // The packing is bin_of (local id -> bin), b.load and room; the member lists
  // b.mem are built only when splitting or refinement needs them (has_mem).
  bool has_mem = false;

  void ensure_mem() {
    if (has_mem) return;
    const int64_t nbins = b.size();
    b.mem.resize(nbins);
    for (auto& v : b.mem) v.clear();
    for (int64_t i = m - 1; i >= 0; --i) b.mem[bin_of[i]].push_back(i);  // decreasing id
    has_mem = true;
  }
  void bin_of_from_mem() {
    for (int64_t q = 0; q < b.size(); ++q) {
      for (int64_t i : b.mem[q]) bin_of[i] = q;
    }
  }

  // The packing of lane g of an interleaved LPT (LptLanes::run, which
  // succeeded on it): the same as lpt(m_, nbins, cap).
  void adopt(const struct LptLanes& lanes, int g, int64_t m_, int64_t nbins, int64_t cap);

  // One LPT step: sequence i to the least-loaded bin of the heap with room for
  // it (bins without room set aside for this step only). False when none has room.
  bool lpt_place(int64_t i) {
    while (!heap.empty() && room[heap.top()] < tok[i]) {
      aside.emplace_back(heap.top_load(), heap.top());
      heap.set_aside(heap.top());
    }
    if (heap.empty()) {
      aside.clear();
      return false;
    }
    const int64_t j = heap.top();
    bin_of[i] = j;
    room[j] -= tok[i];
    heap.add_top(w[i]);
    for (const auto& e : aside) heap.set(e.second, e.first);
    aside.clear();
    return true;
  }

  // LPT by cost among the bins with room for the sequence (bins set aside while
  // they lack room, usually none). False when some sequence fits nowhere.
  bool lpt(int64_t m_, int64_t nbins, int64_t cap) {
    m = m_;
    has_mem = false;
    b.load.assign(nbins, C{0});
    bin_of.resize(m);
    room.assign(nbins, cap);
    heap.init(nbins, total);
    for (int64_t i = 0; i < m; ++i) {
      if (!lpt_place(i)) return false;
    }
    for (int64_t i = m - 1; i >= 0; --i) b.load[bin_of[i]] += w[i];  // as summed by decreasing id
    return true;
  }

  // Tight ranks (LPT on cost leaves every bin too little room for a long
  // sequence): first fit by decreasing tokens into nbins bins of `level`
  // tokens each (the balanced level, not the cap), so bins fill to about the
  // same load instead of to the brim; the sequences that fit under no level
  // (the short ones, usually a few) then go by LPT on cost to the bins with
  // room under the cap. False when one fits nowhere.
  bool level_fit(int64_t m_, int64_t nbins, int64_t cap, int64_t level) {
    m = m_;
    has_mem = false;
    b.load.assign(nbins, C{0});
    bin_of.resize(m);
    room.assign(nbins, cap);
    all.clear();  // the sequences left for LPT
    int64_t size = 1;
    while (size < nbins) size *= 2;
    std::vector<int64_t>& lv = ff_room;  // max-tree of room under the level; padding -1
    lv.assign(2 * size, -1);
    std::fill(lv.begin() + size, lv.begin() + size + nbins, level);
    for (int64_t i = size - 1; i >= 1; --i) lv[i] = std::max(lv[2 * i], lv[2 * i + 1]);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = tok[i];
      if (lv[1] < t) {
        all.push_back(i);
        continue;
      }
      int64_t node = 1;  // the lowest bin with room under the level
      while (node < size) node = lv[2 * node] >= t ? 2 * node : 2 * node + 1;
      const int64_t q = node - size;
      bin_of[i] = q;
      room[q] -= t;
      b.load[q] += w[i];
      int64_t c = lv[node] - t;
      lv[node] = c;
      for (; node > 1; node >>= 1) {  // the running maximum stays in a register
        c = std::max(c, lv[node ^ 1]);
        lv[node >> 1] = c;
      }
    }
    return level_finish(nbins, cap);
  }

  // The level fit's end: the sequences in `all` by LPT under the cap.
  bool level_finish(int64_t nbins, int64_t cap) {
    if (!all.empty()) {
      heap.init(nbins, total);
      for (int64_t q = 0; q < nbins; ++q) heap.set(q, b.load[q]);
      for (int64_t i : all) {
        if (!lpt_place(i)) return false;
        b.load[bin_of[i]] += w[i];
      }
    }
    for (int64_t q = 0; q < nbins; ++q) {
      if (room[q] == cap) return false;  // an empty bin: leave it to the other packings
    }
    return true;
  }

  // The level fit of lane g of LevelLanes::run (its first fit under the
  // level done there): the same as level_fit(m_, nbins, cap, its level).
  bool adopt_level(const struct LevelLanes& lanes, int g, int64_t m_, int64_t nbins, int64_t cap);

  // The first-fit-decreasing packing of bin_of (first_fit's output, `used`
  // bins).
  void from_first_fit(int64_t m_, int64_t used, int64_t cap) {
    m = m_;
    has_mem = true;
    b.reset(used);
    room.assign(used, cap);
    for (int64_t i = m - 1; i >= 0; --i) {  // decreasing id within each bin
      b.mem[bin_of[i]].push_back(i);
      b.load[bin_of[i]] += w[i];
      room[bin_of[i]] -= tok[i];
    }
  }

  // Split the heaviest bin with two or more members in two (alternating by
  // cost; subsets of a feasible bin stay feasible) until there are nbins. The
  // rank holds >= nbins sequences, so some bin can always be split.
  void split_to(int64_t nbins, int64_t cap) {
    ensure_mem();
    while (b.size() < nbins) {
      int64_t h = -1;
      for (int64_t j = 0; j < b.size(); ++j) {
        if (b.mem[j].size() >= 2 && (h < 0 || b.load[j] > b.load[h])) h = j;
      }
      all.swap(b.mem[h]);  // decreasing id
      b.mem[h].clear();
      b.mem.emplace_back();
      b.load[h] = C{0};
      b.load.push_back(C{0});
      room[h] = cap;
      room.push_back(cap);
      const int64_t other = b.size() - 1;
      for (auto it = all.rbegin(); it != all.rend(); ++it) {  // heaviest first
        const int64_t x = *it;
        const int64_t to = (b.mem[other].empty() || b.load[other] < b.load[h]) ? other : h;
        b.mem[to].push_back(x);
        b.load[to] += w[x];
        room[to] -= tok[x];
      }
      std::reverse(b.mem[h].begin(), b.mem[h].end());
      std::reverse(b.mem[other].begin(), b.mem[other].end());
    }
    bin_of_from_mem();
  }

  // The heaviest bin's bound: the rank's lower bound max(total / nbins,
  // largest) plus kBinTolerance.
  C target(int64_t nbins) const { return bin_target<C>(total, w[0], nbins); }

  // The packing (bin_of, b.load, room; no member lists) set aside, and back.
  std::vector<int64_t> kept_bin_of, kept_room;
  std::vector<C> kept_load;
  void keep() {
    has_mem = false;
    bin_of.swap(kept_bin_of);
    b.load.swap(kept_load);
    room.swap(kept_room);
  }

  void balance(int64_t nbins, int64_t max_iter) {
    const C target = this->target(nbins);
    if (b.max_load() <= target) return;  // the common case: no member lists needed
    ensure_mem();
    refine(
        b, w, target, max_iter, kBinPartners,
        [&](int64_t h, int64_t r, int64_t x, int64_t y) {
          if (y < 0) return b.mem[h].size() >= 2 && room[r] >= tok[x];
          return room[r] + tok[y] >= tok[x] && room[h] + tok[x] >= tok[y];
        },
        [&](int64_t h, int64_t r, int64_t x, int64_t y) {
          const int64_t d = tok[x] - (y >= 0 ? tok[y] : 0);
          room[h] += d;
          room[r] -= d;
          bin_of[x] = r;
          if (y >= 0) bin_of[y] = h;
        },
        scratch);
  }
};


template <typename C>
void RankPacker<C>::adopt(const LptLanes& lanes, int g, int64_t m_, int64_t nbins, int64_t cap) {
  m = m_;
  has_mem = false;
  const int64_t* src = lanes.bin_of.data() + g * lanes.stride;
  bin_of.assign(src, src + m);
  b.load.resize(nbins);
  room.resize(nbins);
  const uint64_t* leaf = lanes.tree.data() + g * 2 * lanes.leaves + lanes.leaves;
  for (int64_t q = 0; q < nbins; ++q) {
    const int64_t load = static_cast<int64_t>(leaf[q] >> lanes.shift);
    b.load[q] = static_cast<C>(load);
    room[q] = cap - load;
  }
}

template <typename C>
bool RankPacker<C>::adopt_level(const LevelLanes& lanes, int g, int64_t m_, int64_t nbins,
                                int64_t cap) {
  m = m_;
  has_mem = false;
  b.load.assign(nbins, C{0});
  bin_of.resize(m);
  room.assign(nbins, cap);
  all.clear();
  const int64_t* src = lanes.bin_of.data() + g * lanes.stride;
  if constexpr (std::is_integral_v<C>) {  // each bin holds its level less its room under it
    bin_of.assign(src, src + m);
    for (int64_t i = 0; i < m; ++i) {
      if (src[i] < 0) all.push_back(i);
    }
    for (int64_t q = 0; q < nbins; ++q) {
      const int64_t placed = lanes.level[g] - lanes.room(g, q);
      b.load[q] = placed;
      room[q] = cap - placed;
    }
  } else {
    for (int64_t i = 0; i < m; ++i) {
      const int64_t q = src[i];
      if (q < 0) {
        all.push_back(i);
        continue;
      }
      bin_of[i] = q;
      room[q] -= tok[i];
      b.load[q] += w[i];
    }
  }
  return level_finish(nbins, cap);
}

// ------------------------------------------------------------------- plan
struct Input {
  const int64_t* tok;  // padded lengths
  const int64_t* gid;  // or nullptr
  int64_t n, k, cap, mbm, iters;
  bool equal;
  double a, b;          // float costs: a * P + b * P^2
  int64_t tmin, tmax;   // the fewest and most padded tokens
};

// The cost of a sequence of p padded tokens: p itself (integer costs), or
// a * p + b * p^2.
template <typename C>
inline C cost_of(const Input& in, int64_t p) {
  if constexpr (std::is_integral_v<C>) {
    return p;
  } else {
    const double d = static_cast<double>(p);
    return in.a * d + in.b * d * d;
  }
}

// A micro-batch in the output order: heaviest first, ties by first sequence.
template <typename C>
struct MbKey {
  C load;
  int64_t first, bin;
  bool before(const MbKey& o) const { return load != o.load ? load > o.load : first < o.first; }
};

// a[0..n) sorted by `less`: insertion sort for the usual few dozen
// micro-batches, std::sort past 64.
template <typename T, typename Less>
void sort_few(T* a, int64_t n, Less less) {
  if (n > 64) {
    std::sort(a, a + n, less);
    return;
  }
  for (int64_t j = 1; j < n; ++j) {
    const T x = a[j];
    int64_t p = j;
    for (; p > 0 && less(x, a[p - 1]); --p) a[p] = a[p - 1];
    a[p] = x;
  }
}

// order[0..nb) = the bins heaviest first, ties by first sequence (first[q] <
// n, distinct). Integer loads: one uint64 key per bin, (top - load, first,
// bin) packed where they fit, so the sort compares single words; otherwise
// (load, first, bin) records.
template <typename C>
void sort_bins(const C* load, const int64_t* first, int64_t nb, int64_t n,
               std::vector<MbKey<C>>& keys, std::vector<uint64_t>& packed,
               std::vector<int64_t>& order) {
  auto bits = [](uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; };
  if constexpr (std::is_integral_v<C>) {
    const C top = *std::max_element(load, load + nb);
    const int bb = bits(static_cast<uint64_t>(nb - 1)), bf = bits(static_cast<uint64_t>(n));
    if (bits(static_cast<uint64_t>(top)) + bf + bb <= 64) {
      packed.resize(nb);
      for (int64_t q = 0; q < nb; ++q) {
        packed[q] = (static_cast<uint64_t>(top - load[q]) << (bf + bb)) |
                    (static_cast<uint64_t>(first[q]) << bb) | static_cast<uint64_t>(q);
      }
      sort_few(packed.data(), nb, std::less<uint64_t>());
      const uint64_t mask = (uint64_t{1} << bb) - 1;
      for (int64_t j = 0; j < nb; ++j) order[j] = static_cast<int64_t>(packed[j] & mask);
      return;
    }
  }
  keys.resize(nb);
  for (int64_t q = 0; q < nb; ++q) keys[q] = {load[q], first[q], q};
  sort_few(keys.data(), nb, [](const MbKey<C>& x, const MbKey<C>& y) { return x.before(y); });
  for (int64_t j = 0; j < nb; ++j) order[j] = keys[j].bin;
}

// Everything plan_impl allocates, kept per thread between calls: a plan is a
// per-step host call, and allocating (and page-faulting) its buffers anew each
// time cost more than the search at small n. Holds O(n + k) memory of the
// largest plan made on the thread.
template <typename C>
struct Work {
  TokOrder sorted;
  std::vector<int64_t> tmp, rank_of, count, base, by_rank, by_tok, rank_tok, big,
      count_of, scratch, mb_order, lpt_ok_at, written_at;
  std::vector<int64_t> slot_of, first, slot;
  std::vector<int32_t> rank_seq;
  Items<C> it;
  Bins<C> best, other;
  MinTree<C> heap;
  RankPacker<C> pk;
  LptLanes lanes;
  LevelLanes levels;
  std::vector<MbKey<C>> mb_keys;
  std::vector<uint64_t> mb_packed;
  std::vector<int64_t> cursor;
  std::vector<uint32_t> cursor32;
  std::vector<uint32_t> slot32;
};

template <typename C>
Work<C>& work() {
  static thread_local Work<C> w;
  return w;
}

template <typename C>
std::pair<int64_t, double> plan_impl(const Input& in, int64_t* ord, int64_t* off) {
  const int64_t n = in.n, k = in.k;
  Work<C>& ws = work<C>();
  COMPASS_PHASE("start");
  sort_tokens_desc(in.tok, n, in.tmin, in.tmax, ws.sorted);  // decreasing tokens = decreasing cost
  COMPASS_PHASE("sort");

  // ---- items, relabelled by decreasing cost; their total cost
  Items<C>& it = ws.it;
  C total{0};
  if (in.gid == nullptr) {  // item j is the j-th sequence by decreasing tokens
    it.w.resize(n);
    C* w = it.w.data();
    with_order(ws.sorted, [&](const auto v) {
      for (int64_t j = 0; j < n; ++j) total += (w[j] = cost_of<C>(in, v.tok(j)));
    });
  } else {
    std::vector<int64_t>& tmp = ws.tmp;
    const int64_t* gid = in.gid;
    int64_t gmin = gid[0];
    for (int64_t i = 1; i < n; ++i) gmin = std::min(gmin, gid[i]);
    std::vector<uint64_t> key(n);
    for (int64_t i = 0; i < n; ++i) key[i] = static_cast<uint64_t>(gid[i]) - static_cast<uint64_t>(gmin);
    std::vector<int64_t> by_gid;
    radix_order(key.data(), n, by_gid, tmp);  // ascending group id, then index
    std::vector<int64_t> gstart{0};
    std::vector<C> gw;
    for (int64_t j = 0; j < n; ++j) {
      if (j > 0 && gid[by_gid[j]] != gid[by_gid[j - 1]]) gstart.push_back(j);
      if (static_cast<int64_t>(gstart.size()) > static_cast<int64_t>(gw.size())) gw.push_back(C{0});
      gw.back() += cost_of<C>(in, in.tok[by_gid[j]]);
    }
    gstart.push_back(n);
    const int64_t g = static_cast<int64_t>(gw.size());
    COMPASS_CHECK(g >= k, "group_ids: need at least dp_size = ", k,
                  " groups so that every rank gets one, got ", g);
    if (in.equal) {
      int64_t lo = n, hi = 0;
      for (int64_t j = 0; j < g; ++j) {
        lo = std::min(lo, gstart[j + 1] - gstart[j]);
        hi = std::max(hi, gstart[j + 1] - gstart[j]);
      }
      COMPASS_CHECK(lo == hi, "group_ids: equal_samples needs groups of one size, got sizes ", lo,
                    "..", hi);
    }
    std::vector<int64_t> gdesc;
    order_desc(gw.data(), g, gdesc, tmp);
    it.w.resize(g);
    it.start.assign(1, 0);
    it.member.clear();
    it.member.reserve(n);
    for (int64_t j = 0; j < g; ++j) {
      const int64_t q = gdesc[j];
      it.w[j] = gw[q];
      it.member.insert(it.member.end(), by_gid.begin() + gstart[q], by_gid.begin() + gstart[q + 1]);
      it.start.push_back(static_cast<int64_t>(it.member.size()));
    }
    for (C v : it.w) total += v;
  }
  const int64_t g = it.size();
  COMPASS_CHECK(g >= k, "lengths: need at least dp_size = ", k,
                " sequences so that every rank gets one, got ", g);
  COMPASS_PHASE("items");

  // ---- ranks: LPT + refinement; KK + refinement only if the bound is missed
  const double lb = std::max(static_cast<double>(total) / static_cast<double>(k),
                             static_cast<double>(it.w[0]));
  C target;
  if constexpr (std::is_integral_v<C>) {
    target = std::max<C>(ceil_div(total, k), it.w[0]);
  } else {
    target = static_cast<C>(lb * (1.0 + kRankTolerance));
  }
  const int64_t iters = in.iters >= 0 ? in.iters : 16 * k + 256;
  std::vector<int64_t>& count_of = ws.count_of;
  auto refine_ranks = [&](Bins<C>& b) {
    count_of.resize(k);
    for (int64_t r = 0; r < k; ++r) count_of[r] = static_cast<int64_t>(b.mem[r].size());
    refine<true>(  // swaps keep every count
        b, it.w.data(), target, iters, k,
        [&](int64_t h, int64_t r, int64_t, int64_t y) {
          if (y >= 0) return true;  // swaps keep every count
          return in.equal ? count_of[h] > count_of[r] : count_of[h] > 1;
        },
        [&](int64_t h, int64_t r, int64_t, int64_t y) {
          if (y < 0) --count_of[h], ++count_of[r];
        },
        ws.scratch);
  };
  Bins<C>& best = ws.best;
  lpt_ranks(it.w, total, k, in.equal, best, ws.heap, ws.rank_of, ws.count, ws.scratch);
  COMPASS_PHASE("lpt");
  refine_ranks(best);
  COMPASS_PHASE("refine");
  if (best.max_load() > target) {
    std::vector<int64_t>& ascending = ws.tmp;  // ids g-1 .. 0
    ascending.resize(g);
    for (int64_t j = 0; j < g; ++j) ascending[j] = g - 1 - j;
    const std::vector<int32_t> rank = karmarkar_karp(it.w.data(), ascending, k);
    Bins<C>& other = ws.other;
    other.reset(k);
    for (int64_t j = g - 1; j >= 0; --j) {  // decreasing id within each rank
      other.mem[rank[j]].push_back(j);
      other.load[rank[j]] += it.w[j];
    }
    COMPASS_PHASE("kk");
    refine_ranks(other);
    if (other.max_load() < best.max_load()) std::swap(ws.best, ws.other);
    COMPASS_PHASE("kk refine");
  }

  // ---- each rank's sequences and their tokens, by decreasing tokens
  // (rank-major); each rank's tokens and its count of sequences over cap / 2
  std::vector<int64_t>&base = ws.base, &by_rank = ws.by_rank, &by_tok = ws.by_tok;
  std::vector<int64_t>&rank_tok = ws.rank_tok, &big = ws.big;
  base.assign(k + 1, 0);
  by_rank.resize(n);
  by_tok.resize(n);
  rank_tok.assign(k, 0);
  big.assign(k, 0);
  const int64_t cap = in.cap;
  if (in.gid == nullptr) {
    // item j is the j-th sequence by decreasing tokens; each rank's members by
    // decreasing id, read backwards, are its sequences by decreasing tokens
    // (ties by index): written rank by rank, sequentially
    with_order(ws.sorted, [&](const auto v) {
      for (int64_t r = 0; r < k; ++r) {
        const std::vector<int64_t>& mem = best.mem[r];
        const int64_t m = static_cast<int64_t>(mem.size());
        const int64_t* id = mem.data() + m - 1;
        int64_t* out_s = by_rank.data() + base[r];
        int64_t* out_t = by_tok.data() + base[r];
        int64_t sum = 0, over = 0;
        for (int64_t i = 0; i < m; ++i) {
          const SeqTok x = v[id[-i]];
          out_s[i] = x.seq;
          out_t[i] = x.tok;
          sum += x.tok;
          over += 2 * x.tok > cap;
        }
        base[r + 1] = base[r] + m;
        rank_tok[r] = sum;
        big[r] = over;
      }
    });
  } else {
    std::vector<int32_t>& rank_of = ws.rank_seq;
    rank_of.resize(n);
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t j : best.mem[r]) {
        for (int64_t s = it.start[j]; s < it.start[j + 1]; ++s) rank_of[it.member[s]] = r;
        base[r + 1] += it.start[j + 1] - it.start[j];
      }
    }
    for (int64_t r = 0; r < k; ++r) base[r + 1] += base[r];
    std::vector<int64_t>& cursor = ws.tmp;
    cursor.assign(base.begin(), base.end() - 1);
    with_order(ws.sorted, [&](const auto v) {
      for (int64_t j = 0; j < n; ++j) {
        const SeqTok x = v[j];
        const int64_t r = rank_of[x.seq];
        by_rank[cursor[r]] = x.seq;
        by_tok[cursor[r]++] = x.tok;
        rank_tok[r] += x.tok;
        big[r] += 2 * x.tok > cap;
      }
    });
  }
  std::vector<int64_t>& slot_of = ws.slot_of;  // sequence -> its micro-batch (r * nb + j)
  slot_of.resize(n);
  COMPASS_PHASE("by_rank");

  // ---- micro-batches: nb = the largest per-rank lower bound, grown to the
  // largest first-fit count if LPT cannot pack some rank into it and first
  // fit needs more; each rank packed (LPT, else first fit + splitting),
  // refined, written
  auto round_up = [&](int64_t v) { return (v + in.mbm - 1) / in.mbm * in.mbm; };
  int64_t nb = 1;
  for (int64_t r = 0; r < k; ++r) nb = std::max({nb, (rank_tok[r] + cap - 1) / cap, big[r]});
  nb = round_up(nb);
  auto check_counts = [&]() {
    for (int64_t r = 0; r < k; ++r) {
      COMPASS_CHECK(base[r + 1] - base[r] >= nb, "rank ", r, " holds ", base[r + 1] - base[r],
                    " sequences but every rank needs ", nb,
                    " non-empty micro-batches (the most any rank needs under max_tokens = ",
                    cap, ", rounded up to micro_batch_multiple = ", in.mbm,
                    "): give more sequences, a larger max_tokens or a smaller "
                    "micro_batch_multiple");
    }
  };
  check_counts();
  RankPacker<C>& pk = ws.pk;
  auto load_rank = [&](int64_t r) {  // no copy: the rank's slice of by_tok
    const int64_t m = base[r + 1] - base[r];
    const int64_t* t = by_tok.data() + base[r];
    pk.tok = t;
    if constexpr (std::is_integral_v<C>) {
      pk.w = t;  // the cost is the tokens
      pk.total = rank_tok[r];
    } else {
      pk.wbuf.resize(m);
      C sum{0};
      for (int64_t i = 0; i < m; ++i) sum += (pk.wbuf[i] = cost_of<C>(in, t[i]));
      pk.w = pk.wbuf.data();
      pk.total = sum;
    }
    return m;
  };
  // Ranks are packed and written one by one. If one needs more bins than nb
  // (LPT fails and first fit needs more), nb grows and the ranks written so
  // far are packed again at the new nb: by LPT, else first fit, else the LPT
  // packing that worked at their smaller nb, split.
  std::vector<int64_t>&mb_order = ws.mb_order, &lpt_ok_at = ws.lpt_ok_at,
  &written_at = ws.written_at;
  lpt_ok_at.assign(k, 0);
  written_at.assign(k, 0);
  // ranks LPT packed within their bound / failed on or left over it, this call
  int64_t lpt_packed = 0, lpt_failed = 0;
  // each sequence's micro-batch: uint32 where they fit (k * nb <= n), half the
  // cache footprint of the scattered writes and the final pass's reads
  const bool narrow = n < std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t>& slot32 = ws.slot32;
  if (narrow) slot32.resize(n);
  // Ranks go in groups of kLanes (those not yet written at this nb). A group
  // tries LPT first unless LPT has failed (or missed the bound) on more ranks
  // than it packed so far (ranks are alike, and a failed LPT costs most of a
  // pass) and no rank of it is a probe (every kLptProbe-th rank). The
  // group's first choice runs ahead on all its ranks at once: LPT on
  // LptLanes (integer costs), the level fit's first fit on LevelLanes (and
  // after LPT, on the ranks where it failed or missed the bound).
  LptLanes& lanes = ws.lanes;
  LevelLanes& levels = ws.levels;
  const int64_t most_tok = *std::max_element(rank_tok.begin(), rank_tok.end());
  auto level_of = [&](int64_t r) {  // the balanced level of rank r, with tolerance
    const int64_t level = (rank_tok[r] + nb - 1) / nb;
    const int64_t slack = static_cast<int64_t>(static_cast<double>(level) * kBinTolerance);
    return std::min(cap, level + slack);
  };
  // (rank, bin) -> where its next sequence goes; uint32 where n fits (the
  // final pass's random reads then stay in L1 at 256 ranks x 25 bins)
  std::vector<int64_t>& cursor = ws.cursor;
  std::vector<uint32_t>& cursor32 = ws.cursor32;
  for (bool grown = true; grown;) {
    grown = false;
    mb_order.resize(nb);
    if (narrow) cursor32.resize(k * nb);
    else cursor.resize(k * nb);
    const int64_t mb_iters = 2 * nb + 32;
    const bool lpt_lanes = std::is_integral_v<C> && LptLanes::fits(nb, most_tok);
    int64_t next = 0;  // ranks from here are in no group yet
    bool level_first = false;  // the current group's first choice
    std::fill(lanes.rank, lanes.rank + kLanes, int64_t{-1});
    std::fill(levels.rank, levels.rank + kLanes, int64_t{-1});
    for (int64_t r = 0; r < k; ++r) {
      if (written_at[r] == nb) continue;
      if (r >= next) {  // the next group
        int64_t rs[kLanes], ms[kLanes], lv[kLanes];
        const int64_t* ts[kLanes];
        int cnt = 0;
        bool probe = false;
        for (next = r; next < k && cnt < kLanes; ++next) {
          if (written_at[next] == nb) continue;
          probe |= next % kLptProbe == 0;
          rs[cnt] = next;
          ms[cnt] = base[next + 1] - base[next];
          lv[cnt] = level_of(next);
          ts[cnt++] = by_tok.data() + base[next];
        }
        const bool failing = lpt_failed > lpt_packed;
        level_first = failing && !probe;
        std::fill(lanes.rank, lanes.rank + kLanes, int64_t{-1});
        std::fill(levels.rank, levels.rank + kLanes, int64_t{-1});
        // the level fit runs ahead where it goes first, and on the ranks
        // whose LPT ran ahead and failed or missed their bound (two or more:
        // alone, one rank's level fit costs less than a lane group's)
        if (level_first || (failing && !lpt_lanes)) {
          levels.run(cnt, rs, ts, ms, lv, nb);
        } else if (lpt_lanes) {
          lanes.run(cnt, rs, ts, ms, nb, cap);
          int bad = 0;
          for (int g = 0; g < cnt; ++g) {
            const int64_t bound = bin_target<int64_t>(rank_tok[rs[g]], ts[g][0], nb);
            if (lanes.ok[g] && lanes.heaviest[g] <= bound) continue;
            rs[bad] = rs[g], ts[bad] = ts[g], ms[bad] = ms[g], lv[bad] = lv[g];
            ++bad;
          }
          if (bad >= 2) levels.run(bad, rs, ts, ms, lv, nb);
        }
      }
      const int64_t m = load_rank(r);
      // LPT on cost, and where it finds no room for some long sequence the
      // level fit (bins filled to the balanced level by first fit, not to
      // the cap), or the other way round (level_first)
      auto level_fit = [&] {
        const int g = levels.lane_of(r);
        const bool ok = g >= 0 ? pk.adopt_level(levels, g, m, nb, cap)
                               : pk.level_fit(m, nb, cap, level_of(r));
        COMPASS_COUNT("level fit", ok);
        return ok;
      };
      bool lpt_ok = false;  // LPT found room for every sequence
      auto lpt = [&] {
        const int g = lanes.lane_of(r);
        if (g < 0) return lpt_ok = pk.lpt(m, nb, cap);
        if (lanes.ok[g]) pk.adopt(lanes, g, m, nb, cap);
        return lpt_ok = lanes.ok[g];
      };
      // The first choice is taken if it fits with its heaviest bin within the
      // rank's bound, else the second if it does (LPT fits over the bound on
      // ranks with few short sequences to level long ones, bimodal lengths,
      // where the level fit is within: refining LPT took hundreds of steps
      // there and stopped at the step limit over the bound). If both fit over
      // the bound, both are refined and the better kept (ties: the first).
      const C bound = pk.target(nb);
      const bool ok1 = level_first ? level_fit() : lpt();
      bool packed = ok1 && pk.b.max_load() <= bound, refined = false;
      const bool lpt_tried = !level_first || !packed;
      bool lpt_good = !level_first && packed;
      if (!packed) {
        if (ok1) pk.keep();
        const bool ok2 = level_first ? lpt() : level_fit();
        packed = ok2 && pk.b.max_load() <= bound;
        lpt_good = level_first && packed;
        if (!packed && ok1 && ok2) {
          pk.balance(nb, mb_iters);
          const C top2 = pk.b.max_load();
          pk.keep();
          pk.balance(nb, mb_iters);
          if (top2 < pk.b.max_load()) pk.keep();
          refined = true;
        } else if (!packed && ok1) {
          pk.keep();
        }
        packed |= ok1 || ok2;
      }
      if (lpt_tried) ++(lpt_good ? lpt_packed : lpt_failed);
      if (lpt_ok) lpt_ok_at[r] = nb;
      if (!packed) {
        COMPASS_COUNT("first fit", 1);
        const int64_t used = first_fit(pk.tok, m, cap, pk.bin_of, pk.ff_room);
        if (used <= nb) {
          pk.from_first_fit(m, used, cap);
        } else if (lpt_ok_at[r] > 0) {
          pk.lpt(m, lpt_ok_at[r], cap);
        } else {
          nb = round_up(used);
          check_counts();
          grown = true;
          break;
        }
        pk.split_to(nb, cap);
      }
      if (!refined) pk.balance(nb, mb_iters);
      // micro-batches heaviest first (ties by first sequence): their offsets
      // and where each bin's sequences start (cursor); each sequence's bin
      // (r * nb + bin, in the bins' packing order: the one pass over the
      // rank's sequences that finds each bin's size and first sequence also
      // writes the map; the sequences are written after the loop, by one
      // pass in ascending index)
      const int64_t* seqs = by_rank.data() + base[r];
      const int64_t* bin_of = pk.bin_of.data();
      std::vector<int64_t>&first = ws.first, &size = ws.slot;
      first.assign(nb, n);
      size.assign(nb, 0);
      const int64_t at = r * nb;
      auto size_bins = [&](auto* slot) {  // slot32 or slot_of
        using S = std::remove_pointer_t<decltype(slot)>;
        for (int64_t i = 0; i < m; ++i) {
          const int64_t q = bin_of[i], s = seqs[i];
          first[q] = std::min(first[q], s);
          ++size[q];
          slot[s] = static_cast<S>(at + q);
        }
      };
      if (narrow) size_bins(slot32.data());
      else size_bins(slot_of.data());
      sort_bins(pk.b.load.data(), first.data(), nb, n, ws.mb_keys, ws.mb_packed, mb_order);
      int64_t pos = base[r];
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t q = mb_order[j];
        off[at + j] = pos;
        if (narrow) cursor32[at + q] = static_cast<uint32_t>(pos);
        else cursor[at + q] = pos;
        pos += size[q];
      }
      written_at[r] = nb;
    }
  }
  off[k * nb] = n;
  {  // each micro-batch by ascending sequence index
    auto scatter = [&](const auto* slot, auto* cur) {
      for (int64_t s = 0; s < n; ++s) ord[cur[slot[s]]++] = s;
    };
    if (narrow) scatter(slot32.data(), cursor32.data());
    else scatter(slot_of.data(), cursor.data());
  }
  COMPASS_PHASE("micro-batches");
  return {nb, lb};
}

}  // namespace

std::pair<int64_t, double> plan_cpu(COMPASS_PLAN_ARGS) {
  COMPASS_NAME_ARGS(lengths, group_ids, order, offsets);
  lengths.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  const int64_t n = lengths.numel();
  COMPASS_CHECK(n >= 1, "lengths: expected at least one sequence, got none");
  if (group_ids) {
    group_ids->expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
    group_ids->expect_size(0, n, "one per sequence");
  }
  order.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  order.expect_size(0, n, "one per sequence");
  offsets.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  offsets.expect_size(0, n + 1, "len(lengths) + 1");
  COMPASS_CHECK(dp_size >= 1, "dp_size: expected >= 1, got ", dp_size);
  COMPASS_CHECK(max_tokens >= 1, "max_tokens: expected >= 1, got ", max_tokens);
  COMPASS_CHECK(micro_batch_multiple >= 1, "micro_batch_multiple: expected >= 1, got ",
                micro_batch_multiple);
  COMPASS_CHECK(pad_multiple >= 1, "pad_multiple: expected >= 1, got ", pad_multiple);
  COMPASS_CHECK(std::isfinite(cost_a) && cost_a > 0.0, "cost_a: expected a finite value > 0, got ",
                cost_a);
  COMPASS_CHECK(std::isfinite(cost_b) && cost_b >= 0.0,
                "cost_b: expected a finite value >= 0, got ", cost_b);
  const int64_t* len = lengths.ptr<int64_t>();
  // Padding and range checks. One branch-free pass (min, max, sum) settles
  // the common case; only a failing input, or one whose total could overflow,
  // takes the per-sequence loop that names the first offending sequence.
  const int64_t* tok = len;  // pad_multiple 1: the lengths themselves
  static thread_local std::vector<int64_t> padded;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  const int64_t room = max_tokens / pad_multiple;  // padded <= max_tokens iff ceil(L / pad) <= room
  if (pad_multiple == 1) {
    for (int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, len[i]);
      hi = std::max(hi, len[i]);
    }
  } else {
    padded.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, len[i]);
      hi = std::max(hi, len[i]);
      padded[i] = ((len[i] - 1) / pad_multiple + 1) * pad_multiple;  // overflow: checked below
    }
    tok = padded.data();
  }
  // (tokens <= max_tokens each; int64 totals and the doubled loads the
  // refinement compares must not overflow)
  const int64_t limit = std::numeric_limits<int64_t>::max() / 4;
  const bool fine = lo >= 1 && (hi - 1) / pad_multiple + 1 <= room &&
                    ((hi - 1) / pad_multiple + 1) * pad_multiple <= limit / n;
  if (!fine) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t L = len[i];
      COMPASS_CHECK(L >= 1, "lengths: expected every sequence non-empty, got lengths[", i,
                    "] = ", L);
      const int64_t q = (L - 1) / pad_multiple + 1;
      if (q > room) {
        if (q <= std::numeric_limits<int64_t>::max() / pad_multiple) {
          fail("lengths: sequence ", i, " has ", q * pad_multiple,
               " tokens (after padding), more than max_tokens = ", max_tokens,
               ": no micro-batch can hold it");
        }
        fail("lengths: sequence ", i, " has ", L, " tokens, more than max_tokens = ", max_tokens,
             ": no micro-batch can hold it");
      }
      COMPASS_CHECK(total <= limit - q * pad_multiple,
                    "lengths: the total token count overflows int64");
      total += q * pad_multiple;
    }
  }
  const int64_t top = ((hi - 1) / pad_multiple + 1) * pad_multiple;
  const int64_t bot = ((lo - 1) / pad_multiple + 1) * pad_multiple;  // padding keeps the order
  const Input in{tok, group_ids ? group_ids->ptr<int64_t>() : nullptr, n, dp_size,
                 max_tokens, micro_batch_multiple, refine_iters, equal_samples, cost_a, cost_b,
                 bot, top};
  int64_t* ord = order.ptr<int64_t>();
  int64_t* off = offsets.ptr<int64_t>();
  if (cost_b == 0.0) {  // a*P: balancing P is the same problem, in exact integers
    auto r = plan_impl<int64_t>(in, ord, off);
    return {r.first, r.second * cost_a};
  }
  // the cost grows with P: only the longest sequence can overflow first
  if (!std::isfinite(cost_of<double>(in, top))) {
    for (int64_t i = 0; i < n; ++i) {
      COMPASS_CHECK(std::isfinite(cost_of<double>(in, tok[i])), "cost_a, cost_b: the cost of sequence ",
                    i, " (", tok[i], " tokens) overflows float64");
    }
  }
  return plan_impl<double>(in, ord, off);
}

std::pair<int64_t, int64_t> sort_tokens_desc_cpu(TensorView tokens, TensorView order) {
  COMPASS_NAME_ARGS(tokens, order);
  tokens.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  const int64_t n = tokens.numel();
  COMPASS_CHECK(n >= 1, "tokens: expected at least one value, got none");
  order.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  order.expect_size(0, n, "one per token count");
  const int64_t* tok = tokens.ptr<int64_t>();
  int64_t lo = tok[0], hi = tok[0];
  for (int64_t i = 1; i < n; ++i) lo = std::min(lo, tok[i]), hi = std::max(hi, tok[i]);
  COMPASS_CHECK(lo >= 0, "tokens: expected values >= 0, got ", lo);
  TokOrder o;
  const SortPath path = sort_tokens_desc(tok, n, lo, hi, o);
  int64_t* out = order.ptr<int64_t>();
  with_order(o, [&](const auto v) {
    for (int64_t j = 0; j < n; ++j) out[j] = v[j].seq;
  });
  return {static_cast<int64_t>(path), static_cast<int64_t>(o.width)};
}

void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of) {
  COMPASS_NAME_ARGS(cost, rank_of);
  cost.expect_vector().expect_dtype(DType::kFloat64).expect_device(DeviceType::kCPU);
  rank_of.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  rank_of.expect_size(0, cost.numel(), "one per item");
  COMPASS_CHECK(k >= 1, "k: expected >= 1, got ", k);
  const int64_t n = cost.numel();
  const double* c = cost.ptr<double>();
  // ascending by cost, ties by index (the order Python's sorted((v, i)) gives)
  std::vector<int64_t> asc(n);
  std::iota(asc.begin(), asc.end(), int64_t{0});
  std::sort(asc.begin(), asc.end(), [&](int64_t x, int64_t y) { return c[x] != c[y] ? c[x] < c[y] : x < y; });
  const std::vector<int32_t> r = karmarkar_karp(c, asc, k);
  std::copy(r.begin(), r.end(), rank_of.ptr<int64_t>());
}

}  // namespace packing
}  // namespace compass
