// Adaptive rollout budgets (ck.advantages.allocate_rollouts), host C++.
//
// Problem: prompt i's pass rate p ~ Beta(a_i, b_i); n_i samples give a group
// that is not zero-variance with probability g_i(n) = 1 - E[p^n] - E[(1-p)^n]
// (g(0) = g(1) = 0). Choose n_i in {0} U [m, M] maximising sum_i g_i(n_i)
// subject to sum_i n_i * c_i <= budget (c_i >= 1, integer: samples or tokens).
//
// Items. The increments D(n) = g(n+1) - g(n) = E[p^n (1-p)] + E[(1-p)^n p]
// (n >= 1) are non-increasing in n, and g(m) >= m * D(m) for m >= 2 (D(1) =
// 2 E[p(1-p)] >= 2 D(m)), so prompt i is a chain of items in non-increasing
// gain per cost: a block 0 -> m (gain g(m), cost m c), then unit increments
// m -> m+1 -> ... -> M (gain D(n), cost c). Rounding is clamped so that each
// chain's ratios never increase.
//
// Greedy with skip (the spec, compass_kernels/advantages/reference.py): forced
// blocks first; then every item in decreasing gain / cost, ties by prompt then
// position, taken when its predecessor was taken, it fits and its gain > 0.
// Then up to kRepairRounds exchanges: an unallocated prompt gets its block in
// place of the lowest-ratio increments of others when that adds gain.
//
// Fast path of the greedy (the items are never sorted): chains are generated
// lazily to the uniform depth, item costs are histogrammed on the top 16 bits
// of their ratio's IEEE pattern (monotone for positive doubles), the bucket
// where the cumulative cost crosses the budget is the only one split further
// (12 more bits) and sorted, chains still above it are extended a few items at
// a time until none is, and what follows the first item that does not fit runs
// on a heap of the chains' next items. Chain storage is compact and lazy
// (struct Chains).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "advantages/advantages_api.h"

namespace compass {
namespace advantages {

namespace {

constexpr int kRepairRounds = 4;
constexpr double kMinGain = 1e-12;  // an exchange must add more (expected groups)
constexpr int kBuckets = 1 << 15;  // top 16 bits of a positive double, sign bit 0

inline uint32_t bucket(double ratio) {
  uint64_t bits;
  std::memcpy(&bits, &ratio, sizeof bits);
  return static_cast<uint32_t>(bits >> 48);
}

// Chain storage, compact and lazy: prompt i's generated ratios lie at
// buf[off[i] .. off[i] + filled[i]) with room for cap[i]. Every chain starts in a
// dense [P, depth] base (depth: the uniform allocation's items, often 1-15);
// a chain extended past its room moves to the arena after it with double the
// room (at most K). A [P, K] layout (K = max_n - min_n + 1) would spread each
// pass over P x K doubles (5 MB at 10,000 x 64) for chains that mostly stop
// after one or two items.
struct Chains {
  int64_t P, K, m, M;
  const double* a;
  const double* b;
  const int64_t* c;
  std::vector<double>& buf;  // base then arena; buf.size() is capacity, `used` the end
  int64_t used;
  std::vector<int64_t>& off;
  std::vector<int32_t>& cap;
  std::vector<int32_t>& filled;  // items generated per prompt
  std::vector<double>& ep;  // E[p^n], E[(1-p)^n] at the chain's next n
  std::vector<double>& eq;

  double r(int64_t i, int64_t k) const { return buf[off[i] + k]; }
  const double* row(int64_t i) const { return buf.data() + off[i]; }

  // Move chain i to the arena's end with room for at least `need` items.
  void grow(int64_t i, int64_t need) {
    const int64_t room = std::min<int64_t>(K, std::max<int64_t>(need, 2 * int64_t{cap[i]}));
    if (used + room > static_cast<int64_t>(buf.size())) {
      buf.resize(std::max<size_t>(2 * buf.size(), static_cast<size_t>(used + room)));
    }
    std::copy_n(buf.data() + off[i], filled[i], buf.data() + used);
    off[i] = used;
    cap[i] = static_cast<int32_t>(room);
    used += room;
  }

  // Chains i0 .. i0 + L - 1 from nothing to `depth` items (<= their room), in
  // lockstep (the L independent multiply chains overlap). Item 0 is the block
  // 0 -> m, its gain summed from the increments D(1..m-1) (positive terms: no
  // cancellation in 1 - E[p^m] - E[q^m] for confident posteriors); then the
  // increments as more() computes them.
  template <int L>
  void base(int64_t i0, int64_t depth) {
    double ai[L], bi[L], s[L], p[L], q[L], g[L], inv_c[L], prev[L];
    double* rw[L];
    for (int j = 0; j < L; ++j) {
      ai[j] = a[i0 + j];
      bi[j] = b[i0 + j];
      s[j] = ai[j] + bi[j];
      p[j] = ai[j] / s[j];
      q[j] = bi[j] / s[j];
      g[j] = 0.0;
      inv_c[j] = 1.0 / static_cast<double>(c[i0 + j]);
      rw[j] = buf.data() + off[i0 + j];
    }
    for (int64_t n = 1; n < m; ++n) {
      for (int j = 0; j < L; ++j) {
        const double t = 1.0 / (s[j] + n);
        g[j] += (p[j] * bi[j] + q[j] * ai[j]) * t;
        p[j] *= (ai[j] + n) * t;
        q[j] *= (bi[j] + n) * t;
      }
    }
    for (int j = 0; j < L; ++j) rw[j][0] = prev[j] = g[j] / static_cast<double>(m * c[i0 + j]);
    for (int64_t k = 1; k < depth; ++k) {
      const double n = static_cast<double>(m + k - 1);
      for (int j = 0; j < L; ++j) {
        const double t = 1.0 / (s[j] + n);
        const double r = std::min((p[j] * bi[j] + q[j] * ai[j]) * t * inv_c[j], prev[j]);
        rw[j][k] = prev[j] = r;
        p[j] *= (ai[j] + n) * t;
        q[j] *= (bi[j] + n) * t;
      }
    }
    for (int j = 0; j < L; ++j) {
      ep[i0 + j] = p[j];
      eq[i0 + j] = q[j];
      filled[i0 + j] = static_cast<int32_t>(depth);
    }
  }

  // Up to `e` more items (at most to K) for each of the L chains idx[0..L), in
  // lockstep like base(); no stopping test inside (the caller checks the last
  // item and calls again).
  template <int L>
  void more(const int64_t* idx, int64_t e) {
    int64_t k0[L], cnt[L];
    for (int j = 0; j < L; ++j) {
      const int64_t i = idx[j];
      k0[j] = filled[i];
      cnt[j] = std::min(e, K - k0[j]);
      if (k0[j] + cnt[j] > cap[i]) grow(i, k0[j] + cnt[j]);
    }
    double ai[L], bi[L], s[L], p[L], q[L], inv_c[L], prev[L];
    double* rw[L];
    for (int j = 0; j < L; ++j) {  // after every grow: the arena may have moved
      const int64_t i = idx[j];
      ai[j] = a[i];
      bi[j] = b[i];
      s[j] = ai[j] + bi[j];
      p[j] = ep[i];
      q[j] = eq[i];
      inv_c[j] = 1.0 / static_cast<double>(c[i]);
      rw[j] = buf.data() + off[i];
      prev[j] = rw[j][k0[j] - 1];
    }
    for (int64_t t = 0; t < e; ++t) {
      for (int j = 0; j < L; ++j) {
        if (t >= cnt[j]) continue;
        const int64_t k = k0[j] + t;
        const double n = static_cast<double>(m + k - 1);
        const double tt = 1.0 / (s[j] + n);
        const double r = std::min((p[j] * bi[j] + q[j] * ai[j]) * tt * inv_c[j], prev[j]);
        rw[j][k] = prev[j] = r;
        p[j] *= (ai[j] + n) * tt;
        q[j] *= (bi[j] + n) * tt;
      }
    }
    for (int j = 0; j < L; ++j) {
      const int64_t i = idx[j];
      ep[i] = p[j];
      eq[i] = q[j];
      filled[i] = static_cast<int32_t>(k0[j] + cnt[j]);
    }
  }

  // Generate prompt i's items up to (excluding) index `upto` (at most K).
  void extend(int64_t i, int64_t upto) {
    const int64_t stop = std::min(upto, K);
    if (filled[i] < stop) more<1>(&i, stop - filled[i]);
  }

  int64_t item_cost(int64_t i, int64_t k) const { return k == 0 ? m * c[i] : c[i]; }
  double item_gain(int64_t i, int64_t k) const {
    return r(i, k) * static_cast<double>(item_cost(i, k));
  }
};

struct HeapItem {
  double ratio;
  int64_t prompt;
};

// Max-heap order of the greedy: higher ratio first, ties by lower prompt index.
struct GreedyLess {
  bool operator()(const HeapItem& x, const HeapItem& y) const {
    return x.ratio < y.ratio || (x.ratio == y.ratio && x.prompt > y.prompt);
  }
};
// Min-heap order of the removals: lower ratio first, ties by higher prompt index
// (the reverse of the greedy order: the last item taken goes first).
struct RemovalLess {
  bool operator()(const HeapItem& x, const HeapItem& y) const {
    return x.ratio > y.ratio || (x.ratio == y.ratio && x.prompt < y.prompt);
  }
};

}  // namespace

std::tuple<double, double, int64_t> allocate_rollouts_cpu(COMPASS_ALLOCATE_ROLLOUTS_ARGS) {
  COMPASS_NAME_ARGS(successes, attempts, cost, required, out);
  for (const TensorView* t : {&successes, &attempts, &cost, &required, &out}) {
    t->expect_vector().expect_device(DeviceType::kCPU);
  }
  const int64_t P = successes.numel();
  successes.expect_dtype(DType::kFloat64);
  attempts.expect_dtype(DType::kFloat64).expect_size(0, P, "one per prompt");
  cost.expect_dtype(DType::kInt64).expect_size(0, P, "one per prompt");
  required.expect_dtype(DType::kBool).expect_size(0, P, "one per prompt");
  out.expect_dtype(DType::kInt64).expect_size(0, P, "one per prompt");
  COMPASS_CHECK(min_n >= 2 && max_n >= min_n, "min_n, max_n: expected 2 <= min_n <= max_n, got ",
                min_n, ", ", max_n);
  COMPASS_CHECK(std::isfinite(prior_a) && std::isfinite(prior_b) && prior_a > 0 && prior_b > 0,
                "prior: expected two finite values > 0, got (", prior_a, ", ", prior_b, ")");
  COMPASS_CHECK(budget >= 0, "budget: expected >= 0, got ", budget);
  const double* s = successes.ptr<double>();
  const double* n_att = attempts.ptr<double>();
  const int64_t* c = cost.ptr<int64_t>();
  const bool* req = required.ptr<bool>();
  int64_t* n_out = out.ptr<int64_t>();
  const int64_t m = min_n, M = max_n, K = M - m + 1;

  // Scratch kept across calls; thread-locals are bound to references once (in
  // a shared object each access to one is a call to __tls_get_addr).
  static thread_local std::vector<double> a_tls, b_tls, buf_tls, ep_tls, eq_tls;
  static thread_local std::vector<int32_t> filled_tls, cap_tls, taken_tls;
  static thread_local std::vector<int64_t> off_tls;
  auto &a = a_tls, &b = b_tls, &buf = buf_tls, &ep = ep_tls, &eq = eq_tls;
  auto &filled = filled_tls, &cap = cap_tls, &taken = taken_tls;
  auto& off = off_tls;
  a.resize(P);
  b.resize(P);
  ep.resize(P);
  eq.resize(P);
  filled.assign(P, 0);
  int64_t forced_cost = 0, total_c = 0;
  for (int64_t i = 0; i < P; ++i) {
    const double si = s[i], ni = n_att[i];
    if (!(si >= 0 && std::isfinite(si) && ni >= si && std::isfinite(ni))) {
      COMPASS_CHECK(si >= 0 && std::isfinite(si), "successes: expected finite values >= 0, got ",
                    si, " at prompt ", i);
      COMPASS_CHECK(std::isfinite(ni), "attempts: expected finite values, got ", ni,
                    " at prompt ", i);
      ::compass::fail("successes: expected <= attempts, got ", si, " > ", ni, " at prompt ", i);
    }
    COMPASS_CHECK(c[i] >= 1, "cost: expected >= 1 per sample, got ", c[i], " at prompt ", i);
    a[i] = prior_a + si;
    b[i] = prior_b + (ni - si);
    total_c += c[i];
    if (req[i]) forced_cost += m * c[i];
  }
  COMPASS_CHECK(forced_cost <= budget, "budget: ", budget, " is below what min_n = ", m,
                " needs for the prompts that must be sampled (", forced_cost, ")");

  // Uniform depth plus one: enough items that the chains, if all taken, cost
  // more than the budget (then a crossing bucket exists; otherwise the chains
  // are deepened by doubling below).
  const int64_t uniform_n = total_c > 0 ? (budget + total_c - 1) / total_c : 0;
  const int64_t depth = std::clamp<int64_t>(uniform_n - m + 2, 1, K);
  // Base rows have slack past the depth (most chains the crossing extends
  // end a few items later); the arena starts with room for a quarter of the
  // chains to double once and grows if needed.
  const int64_t stride = std::min<int64_t>(K, depth + std::max<int64_t>(4, depth / 2));
  off.resize(P);
  cap.assign(P, static_cast<int32_t>(stride));
  for (int64_t i = 0; i < P; ++i) off[i] = i * stride;
  const size_t want = static_cast<size_t>(P * stride + P / 4 * std::min<int64_t>(2 * stride, K));
  if (buf.size() < want) buf.resize(want);
  Chains ch{P, K, m, M, a.data(), b.data(), c, buf, P * stride, off, cap, filled, ep, eq};

  // Histogram of the candidate items' costs by ratio bucket (forced blocks are
  // taken up front and not candidates).
  const int64_t free_budget = budget - forced_cost;
  // The histogram stays zero between calls but for [hlo, hhi], the keys the
  // last call touched (cleared here, so a call that threw leaves no residue).
  static thread_local std::vector<int64_t> hist_tls(kBuckets, 0);
  static thread_local uint32_t hlo_tls = kBuckets, hhi_tls = 0;
  int64_t* hist = hist_tls.data();
  if (hlo_tls <= hhi_tls) std::fill(hist + hlo_tls, hist + hhi_tls + 1, int64_t{0});
  uint32_t hlo = kBuckets, hhi = 0;
  hlo_tls = 0;  // until the range is known, a throw leaves all of it to clear
  hhi_tls = kBuckets - 1;
  // A chain's keys never increase: runs of one key are summed before the
  // histogram is touched (no store-to-load chain on one bucket), its first
  // key bounds hhi and its last hlo.
  auto add_items = [&](int64_t i, int64_t from) {
    const double* row = ch.row(i);
    const int64_t f = filled[i], ci = c[i];
    int64_t k = from;
    if (k == 0 && req[i]) ++k;
    if (k >= f || !(row[k] > 0)) return;
    uint32_t cur = bucket(row[k]);
    hhi = std::max(hhi, cur);
    int64_t acc = 0;
    for (; k < f && row[k] > 0; ++k) {
      const uint32_t key = bucket(row[k]);
      if (key != cur) {
        hist[cur] += acc;
        cur = key;
        acc = 0;
      }
      acc += k == 0 ? m * ci : ci;
    }
    hist[cur] += acc;
    hlo = std::min(hlo, cur);
  };
  {  // generated in lockstep groups and histogrammed while in L1
    int64_t i = 0;
    for (; i + 4 <= P; i += 4) {
      ch.base<4>(i, depth);
      for (int j = 0; j < 4; ++j) add_items(i + j, 0);
    }
    for (; i < P; ++i) {
      ch.base<1>(i, depth);
      add_items(i, 0);
    }
  }
  // Crossing bucket: the highest key where the cost of items at or above it
  // exceeds the free budget; -1 when everything generated fits.
  auto crossing = [&]() -> int64_t {
    int64_t cum = 0;
    for (int64_t key = hhi; key > 0 && key >= static_cast<int64_t>(hlo); --key) {
      cum += hist[key];
      if (cum > free_budget) return key;
    }
    return -1;
  };
  int64_t cross = crossing();
  // Nothing crossed: the generated items all fit. Deepen the chains that have
  // more (doubling) until the budget is crossed or every chain is complete.
  for (int64_t d = depth; cross < 0 && d < K;) {
    d = std::min(K, 2 * d);
    bool more = false;
    for (int64_t i = 0; i < P; ++i) {
      const int64_t k = filled[i];
      if (k >= K || !(ch.r(i, k - 1) > 0)) continue;
      ch.extend(i, d);
      add_items(i, k);
      more = true;
    }
    if (!more) break;
    cross = crossing();
  }
  // Chains whose generated items all lie at or above the crossing may have
  // more items there (nothing crossed here means every chain is complete).
  // They are extended
  // kMore items at a time, four in lockstep, the crossing recomputed after each
  // round (it rises as items are added), until no chain's last item is at or
  // above it: then every item at or above the crossing is generated and the
  // crossing is exact. Extending to the first crossing instead would generate
  // items far below the final one (the first is low: the chains were cut).
  constexpr int64_t kMore = 4;
  static thread_local std::vector<int64_t> todo_tls, from_tls;
  auto &todo = todo_tls, &from = from_tls;
  auto above = [&](int64_t i) {
    const int64_t k = filled[i];
    return cross >= 0 && k < K && ch.r(i, k - 1) > 0 &&
           bucket(ch.r(i, k - 1)) >= static_cast<uint32_t>(cross);
  };
  todo.clear();
  for (int64_t i = 0; i < P; ++i) {
    if (above(i)) todo.push_back(i);
  }
  while (!todo.empty()) {
    from.resize(todo.size());
    for (size_t x = 0; x < todo.size(); ++x) from[x] = filled[todo[x]];
    size_t x = 0;
    for (; x + 4 <= todo.size(); x += 4) ch.more<4>(todo.data() + x, kMore);
    for (; x < todo.size(); ++x) ch.more<1>(todo.data() + x, kMore);
    for (size_t y = 0; y < todo.size(); ++y) add_items(todo[y], from[y]);
    cross = crossing();  // rises: fewer chains are still above it
    size_t kept = 0;
    for (size_t y = 0; y < todo.size(); ++y) {
      if (above(todo[y])) todo[kept++] = todo[y];
    }
    todo.resize(kept);
  }
  hlo_tls = hlo;  // the keys this call touched
  hhi_tls = hhi;

  // Prefix: items above the crossing bucket are all taken (by monotonicity
  // each prompt's are a prefix of its chain); the crossing bucket's items in
  // greedy order until the first that does not fit (the critical item).
  taken.assign(P, 0);  // items of the chain taken (forced block included)
  int64_t spent = forced_cost;
  double value = 0.0;
  static thread_local std::vector<std::tuple<double, int64_t, int64_t>> mid_tls;
  auto& mid = mid_tls;
  mid.clear();
  // Ratios >= thr lie above the crossing bucket (bucket(r) > cross); each
  // chain's taken prefix is found by comparisons alone, its gain summed with
  // four accumulators (one serial add per item would bound this pass).
  double thr = std::numeric_limits<double>::denorm_min();
  if (cross >= 0) {
    const uint64_t bits = static_cast<uint64_t>(cross + 1) << 48;
    std::memcpy(&thr, &bits, sizeof thr);
  }
  for (int64_t i = 0; i < P; ++i) {
    const double* row = ch.row(i);
    const int64_t f = filled[i], ci = c[i];
    const int64_t k0 = req[i] ? 1 : 0;
    if (req[i]) value += row[0] * static_cast<double>(m * ci);
    int64_t k = k0;
    while (k < f && row[k] >= thr) ++k;
    if (k > k0) {
      const int64_t lo = std::max<int64_t>(k0, 1);
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
      int64_t j = lo;
      for (; j + 4 <= k; j += 4) {
        s0 += row[j];
        s1 += row[j + 1];
        s2 += row[j + 2];
        s3 += row[j + 3];
      }
      for (; j < k; ++j) s0 += row[j];
      double gain = ((s0 + s1) + (s2 + s3)) * static_cast<double>(ci);
      int64_t cost = (k - lo) * ci;
      if (k0 == 0) {
        gain += row[0] * static_cast<double>(m * ci);
        cost += m * ci;
      }
      value += gain;
      spent += cost;
    }
    if (cross >= 0 && k < f && row[k] > 0 && bucket(row[k]) == static_cast<uint32_t>(cross)) {
      for (int64_t j = k; j < f && bucket(row[j]) == static_cast<uint32_t>(cross); ++j) {
        mid.emplace_back(-row[j], i, j);
      }
    }
    taken[i] = static_cast<int32_t>(k);
  }
  // The crossing bucket's items: a second histogram on the next 12 bits of the
  // ratio; the items above its crossing all fit (taken), only the sub-bucket
  // where the budget runs out is sorted (the critical item lies in it).
  constexpr int kSubBits = 12;
  auto sub_key = [](double r) -> uint32_t {
    uint64_t bits;
    std::memcpy(&bits, &r, sizeof bits);
    return static_cast<uint32_t>(bits >> (48 - kSubBits)) & ((1u << kSubBits) - 1);
  };
  if (mid.size() > 64) {
    int64_t sub[1 << kSubBits] = {};
    for (const auto& [neg_r, i, k] : mid) sub[sub_key(-neg_r)] += ch.item_cost(i, k);
    int64_t cum = 0, sub_cross = -1;
    for (int64_t key = (1 << kSubBits) - 1; key >= 0; --key) {
      cum += sub[key];
      if (spent + cum > budget) {
        sub_cross = key;
        break;
      }
    }
    size_t kept = 0;
    for (size_t x = 0; x < mid.size(); ++x) {
      const auto [neg_r, i, k] = mid[x];
      const int64_t key = sub_key(-neg_r);
      if (key > sub_cross) {  // above the sub-crossing: fits in any order
        spent += ch.item_cost(i, k);
        value += ch.item_gain(i, k);
        taken[i] = std::max(taken[i], static_cast<int32_t>(k + 1));
      } else if (key == sub_cross) {
        mid[kept++] = mid[x];
      }
    }
    mid.resize(kept);
  }
  std::sort(mid.begin(), mid.end());
  double upper = value;
  bool critical = false;
  for (const auto& [neg_r, i, k] : mid) {
    const int64_t ci = ch.item_cost(i, k);
    if (spent + ci > budget) {
      upper = value + (-neg_r) * static_cast<double>(budget - spent);
      critical = true;
      break;
    }
    spent += ci;
    value += ch.item_gain(i, k);
    taken[i] = static_cast<int32_t>(k + 1);
  }
  if (!critical && cross >= 0) {  // cannot happen: the bucket's items exceed the budget
    ::compass::fail("allocate_rollouts: internal error, no critical item in the crossing bucket");
  }

  // Skip phase: the chains' next items in greedy order, each taken if it fits;
  // a chain whose next item does not fit is done (its later items cost as much).
  if (critical) {
    int64_t c_min = std::numeric_limits<int64_t>::max();
    std::vector<HeapItem> heap;
    for (int64_t i = 0; i < P; ++i) {
      const int64_t k = taken[i];
      if (k >= K || spent + ch.item_cost(i, k) > budget) continue;
      if (k == filled[i]) ch.extend(i, k + 1);
      const double r = ch.r(i, k);
      if (!(r > 0)) continue;
      heap.push_back({r, i});
      c_min = std::min(c_min, c[i]);
    }
    std::make_heap(heap.begin(), heap.end(), GreedyLess{});
    while (!heap.empty() && budget - spent >= c_min) {
      std::pop_heap(heap.begin(), heap.end(), GreedyLess{});
      const HeapItem top = heap.back();
      heap.pop_back();
      const int64_t i = top.prompt, k = taken[i];
      const int64_t ci = ch.item_cost(i, k);
      if (spent + ci > budget) continue;
      spent += ci;
      value += ch.item_gain(i, k);
      taken[i] = static_cast<int32_t>(k + 1);
      if (k + 1 < K) {
        if (k + 1 == filled[i]) ch.extend(i, k + 2);
        const double r = ch.r(i, k + 1);
        if (r > 0) {
          heap.push_back({r, i});
          std::push_heap(heap.begin(), heap.end(), GreedyLess{});
        }
      }
    }
  }

  // Exchange repair: give an unallocated prompt j its block, freeing room by
  // dropping the lowest-ratio increments of allocated prompts, when the block's
  // gain exceeds what is dropped. The drops run in reverse greedy order (a
  // chain's last item first); the best exchange over all j is applied.
  std::vector<HeapItem> rm;
  std::vector<int64_t> seq_prompt, seq_freed;
  std::vector<double> seq_loss;
  for (int round = 0; critical && round < kRepairRounds; ++round) {
    const int64_t left = budget - spent;
    int64_t max_need = 0;
    for (int64_t i = 0; i < P; ++i) {
      if (taken[i] == 0 && ch.r(i, 0) > 0) max_need = std::max(max_need, m * c[i] - left);
    }
    if (max_need <= 0) break;
    rm.clear();
    for (int64_t i = 0; i < P; ++i) {
      if (taken[i] > 1) rm.push_back({ch.r(i, taken[i] - 1), i});
    }
    std::make_heap(rm.begin(), rm.end(), RemovalLess{});
    seq_prompt.clear();
    seq_freed.assign(1, 0);
    seq_loss.assign(1, 0.0);
    std::vector<int32_t> left_items(taken);  // items still held during the walk
    while (!rm.empty() && seq_freed.back() < max_need) {
      std::pop_heap(rm.begin(), rm.end(), RemovalLess{});
      const HeapItem top = rm.back();
      rm.pop_back();
      const int64_t i = top.prompt;
      seq_prompt.push_back(i);
      seq_freed.push_back(seq_freed.back() + c[i]);
      seq_loss.push_back(seq_loss.back() + top.ratio * static_cast<double>(c[i]));
      if (--left_items[i] > 1) {
        rm.push_back({ch.r(i, left_items[i] - 1), i});
        std::push_heap(rm.begin(), rm.end(), RemovalLess{});
      }
    }
    double best_net = 0.0;
    int64_t best_j = -1, best_k = 0;
    for (int64_t j = 0; j < P; ++j) {
      if (taken[j] != 0 || !(ch.r(j, 0) > 0)) continue;
      const int64_t need = m * c[j] - left;
      const auto it = std::lower_bound(seq_freed.begin(), seq_freed.end(), need);
      if (it == seq_freed.end()) continue;
      const int64_t kk = it - seq_freed.begin();
      const double net = ch.r(j, 0) * static_cast<double>(m * c[j]) - seq_loss[kk];
      if (net > best_net && net > kMinGain) {
        best_net = net;
        best_j = j;
        best_k = kk;
      }
    }
    if (best_j < 0) break;
    for (int64_t q = 0; q < best_k; ++q) --taken[seq_prompt[q]];
    taken[best_j] = 1;
    spent += m * c[best_j] - seq_freed[best_k];
    value += best_net;
  }

  for (int64_t i = 0; i < P; ++i) n_out[i] = taken[i] == 0 ? 0 : m + taken[i] - 1;
  return {value, std::max(upper, value), spent};
}

}  // namespace advantages
}  // namespace compass
