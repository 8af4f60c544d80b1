// The packing planner (ck.packing.plan): sequences -> data-parallel ranks ->
// micro-batches, every constraint at once.
//
// 1. Items: a group (group_ids) or a single sequence; items never split across
//    ranks.
// 2. Ranks: two seeds, each refined by local search, the better kept:
//    - LPT (largest cost first onto the least-loaded rank; with equal_samples
//      a rank takes at most ceil(G/k) items and only G % k ranks that many);
//    - Karmarkar-Karp largest differencing in equal-size mode (what RL
//      frameworks run), so the result is never worse than KK's on the same
//      cost;
//    refinement: the heaviest rank against the others, lightest first, takes
//    the single move or pairwise swap whose cost difference is closest to half
//    their gap; repeated until the heaviest rank cannot be lowered or it sits
//    at the lower bound max(total / k, largest item). Swaps keep item counts,
//    so equal_samples holds throughout.
// 3. Micro-batches: M = max over ranks of the first-fit-decreasing bin count
//    under max_tokens, rounded up to micro_batch_multiple; every rank is then
//    packed into exactly M bins: LPT by cost among the bins with room (falls
//    back to FFD plus splitting its heaviest bins), then the same move / swap
//    refinement between bins, never breaking the cap.
// Deterministic: every tie is broken by index. Serial: a host step that runs
// once per training step, where waking an OpenMP team on a busy host cost more
// than it saved (measured: 8192 sequences / 8 ranks 3 ms serial, 44 ms with
// two threads on two loaded cores).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <vector>

#include "packing/packing_api.h"

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
// Ranks stop within 1e-6 of the lower bound max(total / dp, largest item): the
// imbalance is then 1.000001 at worst, and the tail of ever smaller swaps that
// a tighter target buys cost 5x the planner's time at 16k sequences / 128 ranks.
constexpr double kRankTolerance = 1e-6;

struct Items {
  std::vector<double> cost;
  std::vector<int64_t> start;   // members of item j: member[start[j] : start[j+1]]
  std::vector<int64_t> member;  // sequence indices
  int64_t size() const { return static_cast<int64_t>(cost.size()); }
};

Items build_items(const double* cost, const int64_t* gid, int64_t n) {
  Items it;
  it.member.resize(n);
  std::iota(it.member.begin(), it.member.end(), int64_t{0});
  if (gid == nullptr) {
    it.cost.assign(cost, cost + n);
    it.start.resize(n + 1);
    std::iota(it.start.begin(), it.start.end(), int64_t{0});
    return it;
  }
  std::stable_sort(it.member.begin(), it.member.end(),
                   [gid](int64_t a, int64_t b) { return gid[a] < gid[b]; });
  it.start.push_back(0);
  for (int64_t j = 0; j < n; ++j) {
    if (j > 0 && gid[it.member[j]] != gid[it.member[j - 1]]) {
      it.start.push_back(j);
      it.cost.push_back(0.0);
    }
    if (j == 0) it.cost.push_back(0.0);
    it.cost.back() += cost[it.member[j]];
  }
  it.start.push_back(n);
  return it;
}

// Indices by decreasing value, ties by index: a sort of (-value, index) pairs
// (contiguous keys: ~2x faster than sorting indices through the values).
std::vector<int64_t> sort_desc(const double* v, int64_t n) {
  std::vector<std::pair<double, int64_t>> kv(n);
  for (int64_t i = 0; i < n; ++i) kv[i] = {-v[i], i};
  std::sort(kv.begin(), kv.end());
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = kv[i].second;
  return out;
}

// ------------------------------------------------------------------ seeds
// LPT. With `card`, the count constraint of equal_samples: floor(G/k) or
// ceil(G/k) items per rank, exactly G % k ranks at the ceiling.
std::vector<int32_t> lpt(const std::vector<double>& c, const std::vector<int64_t>& desc, int64_t k,
                         bool card) {
  const int64_t g = static_cast<int64_t>(c.size());
  using Entry = std::pair<double, int64_t>;  // (load, rank): min-heap, ties lowest rank
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64_t r = 0; r < k; ++r) heap.emplace(0.0, r);
  const int64_t lo = g / k, rem = g % k;
  std::vector<int64_t> count(k, 0);
  int64_t at_hi = 0;
  std::vector<int32_t> rank(g);
  for (int64_t j : desc) {
    Entry e;
    for (;;) {
      e = heap.top();
      heap.pop();
      const int64_t cnt = count[e.second];
      if (!card || cnt < lo || (cnt == lo && at_hi < rem)) break;
    }
    const int64_t r = e.second;
    rank[j] = static_cast<int32_t>(r);
    if (card && ++count[r] == lo + 1) ++at_hi;
    heap.emplace(e.first + c[j], r);
  }
  return rank;
}

// Karmarkar-Karp largest differencing, equal-size mode: items sorted
// ascending, taken k at a time as partial solutions of k one-item sets;
// repeatedly merge the two with the largest spread (largest set of one with
// the smallest of the other). G not a multiple of k gets zero-cost fillers, so
// counts differ by at most one. Sets are linked lists: O(1) concatenation.
struct KKSet {
  double sum;
  int64_t count, head, tail;
};

std::vector<int32_t> karmarkar_karp(const std::vector<double>& c, const std::vector<int64_t>& desc,
                                   int64_t k) {
  const int64_t g = static_cast<int64_t>(c.size());
  const int64_t p = (g + k - 1) / k * k;  // padded with fillers g..p-1 (cost 0)
  std::vector<int64_t> idx(p);             // ascending: the fillers, then desc reversed
  std::iota(idx.begin(), idx.begin() + (p - g), g);
  std::reverse_copy(desc.begin(), desc.end(), idx.begin() + (p - g));
  auto val = [&](int64_t i) { return i < g ? c[i] : 0.0; };
  const int64_t states = p / k;
  std::vector<KKSet> sets(p);
  std::vector<int64_t> next(p, -1);
  auto set_less = [](const KKSet& a, const KKSet& b) {  // descending order wants a > b first
    if (a.sum != b.sum) return a.sum > b.sum;
    if (a.count != b.count) return a.count > b.count;
    return a.head < b.head;
  };
  for (int64_t s = 0; s < states; ++s) {
    KKSet* st = &sets[s * k];
    for (int64_t i = 0; i < k; ++i) {  // the chunk is ascending: reversed, it is in set order
      const int64_t item = idx[s * k + k - 1 - i];
      st[i] = {val(item), 1, item, item};
    }
  }
  auto spread = [&](int64_t s) { return sets[s * k].sum - sets[s * k + k - 1].sum; };
  auto heap_less = [&](int64_t a, int64_t b) {  // true: a pops after b
    const double sa = spread(a), sb = spread(b);
    if (sa != sb) return sa < sb;
    const KKSet &x = sets[a * k], &y = sets[b * k];
    if (x.sum != y.sum) return x.sum < y.sum;
    return a > b;
  };
  std::priority_queue<int64_t, std::vector<int64_t>, decltype(heap_less)> heap(heap_less);
  for (int64_t s = 0; s < states; ++s) heap.push(s);
  while (heap.size() > 1) {
    const int64_t a = heap.top();
    heap.pop();
    const int64_t b = heap.top();
    heap.pop();
    KKSet* x = &sets[a * k];
    const KKSet* y = &sets[b * k];
    for (int64_t i = 0; i < k; ++i) {
      const KKSet& o = y[k - 1 - i];
      next[x[i].tail] = o.head;
      x[i].tail = o.tail;
      x[i].sum += o.sum;
      x[i].count += o.count;
    }
    std::sort(x, x + k, set_less);
    heap.push(a);
  }
  std::vector<int32_t> rank(g);
  const KKSet* fin = &sets[heap.top() * k];
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t i = fin[r].head; i != -1; i = next[i]) {
      if (i < g) rank[i] = static_cast<int32_t>(r);
    }
  }
  return rank;
}

// ------------------------------------------------------------- refinement
// Bins (ranks, or micro-batches of one rank) of weighted elements; the
// heaviest bin gives one element to, or swaps one with, a lighter bin so that
// the pair's larger load drops the most (difference closest to half the gap),
// until the heaviest is at `target` or cannot be lowered.
// `fits(h, r, x, y)` says whether moving x (h -> r) and y (r -> h, y < 0: no y)
// keeps both bins feasible (token cap, counts); `applied(h, r, x, y)` is told
// of each change made, to keep that state current.
struct Bins {
  std::vector<std::vector<int64_t>> members;  // element ids per bin
  std::vector<double> load;
};

template <typename Fits, typename Applied>
void refine(Bins& b, const std::vector<double>& w, double target, int64_t max_iter,
            int64_t max_partners, Fits fits, Applied applied) {
  const int64_t nb = static_cast<int64_t>(b.load.size());
  if (nb < 2) return;
  std::vector<std::vector<int64_t>> sorted(nb);  // members by weight, rebuilt when dirty
  std::vector<char> dirty(nb, 1);
  auto sorted_of = [&](int64_t r) -> const std::vector<int64_t>& {
    if (dirty[r]) {
      sorted[r] = b.members[r];
      std::sort(sorted[r].begin(), sorted[r].end(),
                [&](int64_t x, int64_t y) { return w[x] != w[y] ? w[x] < w[y] : x < y; });
      dirty[r] = 0;
    }
    return sorted[r];
  };
  std::vector<int64_t> by_load;
  for (int64_t iter = 0; iter < max_iter; ++iter) {
    const int64_t h = std::max_element(b.load.begin(), b.load.end()) - b.load.begin();
    const double top = b.load[h];
    if (top <= target) return;
    by_load.resize(nb);
    std::iota(by_load.begin(), by_load.end(), int64_t{0});
    // only the lightest max_partners + 1 (h may be among them) are ever tried
    const int64_t keep = std::min(nb, max_partners + 1);
    std::partial_sort(by_load.begin(), by_load.begin() + keep, by_load.end(),
                      [&](int64_t x, int64_t y) {
                        return b.load[x] != b.load[y] ? b.load[x] < b.load[y] : x < y;
                      });
    by_load.resize(keep);
    const std::vector<int64_t>& hs = sorted_of(h);
    bool improved = false;
    int64_t partners = 0;
    for (int64_t r : by_load) {
      if (r == h) continue;
      if (++partners > max_partners) break;
      const double gap = top - b.load[r];
      if (gap <= top * 1e-12) break;
      const double half = 0.5 * gap;
      double best = gap;  // |d - gap/2| must beat gap/2 strictly: d in (0, gap)
      int64_t bx = -1, by = -1;
      // moves: x in h with w[x] closest to gap/2
      {
        auto it = std::lower_bound(hs.begin(), hs.end(), half,
                                   [&](int64_t x, double v) { return w[x] < v; });
        for (int step = 0; step < 4; ++step) {  // two neighbours each side
          const int64_t pos = (it - hs.begin()) + (step % 2 ? -(step / 2 + 1) : step / 2);
          if (pos < 0 || pos >= static_cast<int64_t>(hs.size())) continue;
          const int64_t x = hs[pos];
          const double d = w[x];
          if (d <= 0.0 || d >= gap) continue;
          const double score = std::abs(d - half);
          if (score < best && fits(h, r, x, int64_t{-1})) best = score, bx = x, by = -1;
        }
      }
      // swaps: for each x in h, y in r with w[x] - w[y] closest to gap/2
      const std::vector<int64_t>& rs = sorted_of(r);
      for (int64_t x : hs) {
        const double target = w[x] - half;
        auto it = std::lower_bound(rs.begin(), rs.end(), target,
                                   [&](int64_t y, double v) { return w[y] < v; });
        for (int step = 0; step < 4; ++step) {
          const int64_t pos = (it - rs.begin()) + (step % 2 ? -(step / 2 + 1) : step / 2);
          if (pos < 0 || pos >= static_cast<int64_t>(rs.size())) continue;
          const int64_t y = rs[pos];
          const double d = w[x] - w[y];
          if (d <= 0.0 || d >= gap) continue;
          const double score = std::abs(d - half);
          if (score < best && fits(h, r, x, y)) best = score, bx = x, by = y;
        }
      }
      if (bx < 0 || gap - 2.0 * best <= top * 1e-12) continue;  // no real drop of the pair max
      auto& hm = b.members[h];
      auto& rm = b.members[r];
      hm.erase(std::find(hm.begin(), hm.end(), bx));
      rm.push_back(bx);
      double d = w[bx];
      if (by >= 0) {
        rm.erase(std::find(rm.begin(), rm.end(), by));
        hm.push_back(by);
        d -= w[by];
      }
      b.load[h] -= d;
      b.load[r] += d;
      dirty[h] = dirty[r] = 1;
      applied(h, r, bx, by);
      improved = true;
      break;
    }
    if (!improved) return;
  }
}

double max_load(const Bins& b) { return *std::max_element(b.load.begin(), b.load.end()); }

Bins bins_from(const std::vector<int32_t>& rank, const std::vector<double>& w, int64_t k) {
  Bins b;
  b.members.assign(k, {});
  b.load.assign(k, 0.0);
  for (int64_t j = 0; j < static_cast<int64_t>(rank.size()); ++j) {
    b.members[rank[j]].push_back(j);
    b.load[rank[j]] += w[j];
  }
  return b;
}

// ------------------------------------------------------- micro-batches
// A rank's sequences arrive in decreasing cost order, which is decreasing
// length for both cost models (L and a*L + b*L^2 grow with L): one global
// sort serves every rank, no per-rank sort.

// First fit with a max-tree over bin room: O(m log m). Returns the bin count;
// bin_of[i] is the bin of seqs[i].
int64_t first_fit(const std::vector<int64_t>& seqs, const int64_t* tokens, int64_t cap,
                  std::vector<int64_t>& bin_of) {
  const int64_t m = static_cast<int64_t>(seqs.size());
  int64_t size = 1;
  while (size < m) size *= 2;
  std::vector<int64_t> room(2 * size, cap);
  bin_of.assign(m, -1);
  int64_t used = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = tokens[seqs[i]];
    int64_t node = 1;  // the root has room: m bins always suffice (each t <= cap)
    while (node < size) node = room[2 * node] >= t ? 2 * node : 2 * node + 1;
    const int64_t bin = node - size;
    bin_of[i] = bin;
    used = std::max(used, bin + 1);
    room[node] -= t;
    for (node /= 2; node >= 1; node /= 2) room[node] = std::max(room[2 * node], room[2 * node + 1]);
  }
  return used;
}

// Pack one rank's sequences (decreasing cost) into exactly `nbins` bins
// (nbins <= seqs.size()): LPT among the bins with room, else first fit plus
// splitting; then refinement under the cap. Bins come out heaviest first,
// members ascending.
Bins pack_rank(const std::vector<int64_t>& seqs, const int64_t* tokens, const double* cost,
               int64_t cap, int64_t nbins, int64_t max_iter) {
  const int64_t m = static_cast<int64_t>(seqs.size());
  std::vector<double> w(m);
  std::vector<int64_t> tok(m);
  for (int64_t i = 0; i < m; ++i) w[i] = cost[seqs[i]], tok[i] = tokens[seqs[i]];
  Bins b;
  b.members.assign(nbins, {});
  b.load.assign(nbins, 0.0);
  std::vector<int64_t> room(nbins, cap);
  // LPT: the lightest bin that has room (a min-heap; bins without room for this
  // sequence are set aside and put back, usually none).
  using Entry = std::pair<double, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64_t j = 0; j < nbins; ++j) heap.emplace(0.0, j);
  std::vector<Entry> aside;
  bool ok = true;
  for (int64_t i = 0; i < m && ok; ++i) {
    while (!heap.empty() && room[heap.top().second] < tok[i]) {
      aside.push_back(heap.top());
      heap.pop();
    }
    if (heap.empty()) {
      ok = false;
      break;
    }
    const int64_t j = heap.top().second;
    heap.pop();
    b.members[j].push_back(i);
    b.load[j] += w[i];
    room[j] -= tok[i];
    heap.emplace(b.load[j], j);
    for (const Entry& e : aside) heap.push(e);
    aside.clear();
  }
  if (!ok) {  // first fit (fits in <= nbins), then split the heaviest bins until nbins
    std::vector<int64_t> local(m), bin_of;
    std::iota(local.begin(), local.end(), int64_t{0});
    const int64_t used = first_fit(local, tok.data(), cap, bin_of);
    b.members.assign(used, {});
    b.load.assign(used, 0.0);
    room.assign(used, cap);
    for (int64_t i = 0; i < m; ++i) {
      b.members[bin_of[i]].push_back(i);
      b.load[bin_of[i]] += w[i];
      room[bin_of[i]] -= tok[i];
    }
    while (static_cast<int64_t>(b.load.size()) < nbins) {
      int64_t h = -1;
      for (int64_t j = 0; j < static_cast<int64_t>(b.load.size()); ++j) {
        if (b.members[j].size() >= 2 && (h < 0 || b.load[j] > b.load[h])) h = j;
      }
      std::vector<int64_t> all = std::move(b.members[h]);  // decreasing cost already
      b.members[h].clear();
      b.members.emplace_back();
      b.load[h] = 0.0;
      b.load.push_back(0.0);
      room[h] = cap;
      room.push_back(cap);
      const int64_t other = static_cast<int64_t>(b.load.size()) - 1;
      for (int64_t x : all) {  // subsets of a feasible bin stay feasible
        const int64_t to = (b.members[other].empty() || b.load[other] < b.load[h]) ? other : h;
        b.members[to].push_back(x);
        b.load[to] += w[x];
        room[to] -= tok[x];
      }
    }
  }
  double total = 0.0;
  for (double v : w) total += v;
  const double lb = std::max(total / static_cast<double>(nbins), w[0]);
  refine(
      b, w, lb * (1.0 + kBinTolerance), max_iter, kBinPartners,
      [&](int64_t h, int64_t r, int64_t x, int64_t y) {
        if (y < 0) return b.members[h].size() >= 2 && room[r] >= tok[x];
        return room[r] + tok[y] >= tok[x] && room[h] + tok[x] >= tok[y];
      },
      [&](int64_t h, int64_t r, int64_t x, int64_t y) {
        const int64_t d = tok[x] - (y >= 0 ? tok[y] : 0);
        room[h] += d;
        room[r] -= d;
      });
  for (auto& mem : b.members) {
    for (int64_t& x : mem) x = seqs[x];
    std::sort(mem.begin(), mem.end());
  }
  std::vector<int64_t> ord(nbins);  // heaviest micro-batch first; ties by first sequence
  std::iota(ord.begin(), ord.end(), int64_t{0});
  std::sort(ord.begin(), ord.end(), [&](int64_t x, int64_t y) {
    if (b.load[x] != b.load[y]) return b.load[x] > b.load[y];
    return b.members[x].front() < b.members[y].front();
  });
  Bins out;
  for (int64_t j : ord) out.members.push_back(std::move(b.members[j])), out.load.push_back(b.load[j]);
  return out;
}

}  // namespace

int64_t plan_cpu(COMPASS_PLAN_ARGS) {
  COMPASS_NAME_ARGS(tokens, cost, group_ids, order, offsets);
  const int64_t n = tokens.numel();
  tokens.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  cost.expect_vector().expect_dtype(DType::kFloat64).expect_device(DeviceType::kCPU);
  cost.expect_size(0, n, "one per sequence");
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
  const int64_t* tok = tokens.ptr<int64_t>();
  const double* cst = cost.ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(tok[i] >= 1, "lengths: expected every sequence non-empty, got lengths[", i,
                  "] = ", tok[i]);
    COMPASS_CHECK(tok[i] <= max_tokens, "lengths: sequence ", i, " has ", tok[i],
                  " tokens (after padding), more than max_tokens = ", max_tokens,
                  ": no micro-batch can hold it");
    COMPASS_CHECK(std::isfinite(cst[i]) && cst[i] > 0.0, "cost: expected finite positive values, "
                  "got cost[", i, "] = ", cst[i]);
  }
  const Items it = build_items(cst, group_ids ? group_ids->ptr<int64_t>() : nullptr, n);
  const int64_t g = it.size(), k = dp_size;
  COMPASS_CHECK(g >= k, group_ids ? "group_ids: " : "lengths: ", "need at least dp_size = ", k,
                group_ids ? " groups" : " sequences", " so that every rank gets one, got ", g);
  if (equal_samples && group_ids) {
    int64_t lo = n, hi = 0;
    for (int64_t j = 0; j < g; ++j) {
      lo = std::min(lo, it.start[j + 1] - it.start[j]);
      hi = std::max(hi, it.start[j + 1] - it.start[j]);
    }
    COMPASS_CHECK(lo == hi, "group_ids: equal_samples needs groups of one size, got sizes ", lo,
                  "..", hi);
  }

  // ---- one sort: sequences by decreasing cost
  std::vector<int64_t> seq_desc = sort_desc(cst, n);
  std::vector<int64_t> item_desc;
  if (group_ids) {
    item_desc = sort_desc(it.cost.data(), g);
  }
  const std::vector<int64_t>& desc = group_ids ? item_desc : seq_desc;

  // ---- ranks: KK seed refined; LPT seed refined too unless KK is already
  // within 1e-4 of the lower bound.
  const int64_t iters = refine_iters >= 0 ? refine_iters : 16 * k + 256;
  double total = 0.0;
  for (double v : it.cost) total += v;
  const double lb = std::max(total / static_cast<double>(k), it.cost[desc[0]]);
  std::vector<int64_t> count_of;  // items per rank, kept current for the move check
  auto refine_ranks = [&](Bins& b) {
    count_of.assign(k, 0);
    for (int64_t r = 0; r < k; ++r) count_of[r] = static_cast<int64_t>(b.members[r].size());
    refine(
        b, it.cost, lb * (1.0 + kRankTolerance), iters, k,
        [&](int64_t h, int64_t r, int64_t, int64_t y) {
          if (y >= 0) return true;  // swaps keep every count
          return equal_samples ? count_of[h] > count_of[r] : count_of[h] > 1;
        },
        [&](int64_t h, int64_t r, int64_t, int64_t y) {
          if (y < 0) --count_of[h], ++count_of[r];
        });
  };
  Bins best = bins_from(karmarkar_karp(it.cost, desc, k), it.cost, k);
  refine_ranks(best);
  if (max_load(best) > lb * (1.0 + 1e-4)) {
    Bins other = bins_from(lpt(it.cost, desc, k, equal_samples), it.cost, k);
    refine_ranks(other);
    if (max_load(other) < max_load(best)) best = std::move(other);
  }

  // ---- micro-batches: each rank's sequences in decreasing cost order
  std::vector<int32_t> rank_of(n);
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t j : best.members[r]) {
      for (int64_t s = it.start[j]; s < it.start[j + 1]; ++s) rank_of[it.member[s]] = r;
    }
  }
  std::vector<std::vector<int64_t>> seqs(k);
  for (int64_t r = 0; r < k; ++r) seqs[r].reserve(n / k + 1);
  for (int64_t s : seq_desc) seqs[rank_of[s]].push_back(s);
  std::vector<int64_t> need(k);
  for (int64_t r = 0; r < k; ++r) {
    std::vector<int64_t> bin_of;
    need[r] = first_fit(seqs[r], tok, max_tokens, bin_of);
  }
  int64_t nb = *std::max_element(need.begin(), need.end());
  nb = (nb + micro_batch_multiple - 1) / micro_batch_multiple * micro_batch_multiple;
  for (int64_t r = 0; r < k; ++r) {
    COMPASS_CHECK(static_cast<int64_t>(seqs[r].size()) >= nb, "rank ", r, " holds ",
                  seqs[r].size(), " sequences but every rank needs ", nb,
                  " non-empty micro-batches (the most any rank needs under max_tokens = ",
                  max_tokens, ", rounded up to micro_batch_multiple = ", micro_batch_multiple,
                  "): give more sequences, a larger max_tokens or a smaller micro_batch_multiple");
  }
  std::vector<int64_t> base(k + 1, 0);
  for (int64_t r = 0; r < k; ++r) base[r + 1] = base[r] + static_cast<int64_t>(seqs[r].size());
  int64_t* ord = order.ptr<int64_t>();
  int64_t* off = offsets.ptr<int64_t>();
  const int64_t mb_iters = 2 * nb + 32;
  for (int64_t r = 0; r < k; ++r) {
    const Bins b = pack_rank(seqs[r], tok, cst, max_tokens, nb, mb_iters);
    int64_t pos = base[r];
    for (int64_t j = 0; j < nb; ++j) {
      off[r * nb + j] = pos;
      for (int64_t s : b.members[j]) ord[pos++] = s;
    }
  }
  off[k * nb] = n;
  return nb;
}

void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of) {
  COMPASS_NAME_ARGS(cost, rank_of);
  cost.expect_vector().expect_dtype(DType::kFloat64).expect_device(DeviceType::kCPU);
  rank_of.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  rank_of.expect_size(0, cost.numel(), "one per item");
  COMPASS_CHECK(k >= 1, "k: expected >= 1, got ", k);
  std::vector<double> c(cost.ptr<double>(), cost.ptr<double>() + cost.numel());
  std::vector<int64_t> desc(c.size());
  std::iota(desc.begin(), desc.end(), int64_t{0});
  std::sort(desc.begin(), desc.end(),
            [&](int64_t x, int64_t y) { return c[x] != c[y] ? c[x] > c[y] : x < y; });
  const std::vector<int32_t> r = karmarkar_karp(c, desc, k);
  std::copy(r.begin(), r.end(), rank_of.ptr<int64_t>());
}

}  // namespace packing
}  // namespace compass
