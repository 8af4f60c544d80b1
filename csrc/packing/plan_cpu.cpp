// The packing planner (ck.packing.plan): sequences -> data-parallel ranks ->
// micro-batches, every constraint at once (docs/design.md has the contract).
// 1. Items (groups or sequences) by decreasing cost (padded tokens P, int64,
//    or a P + b P^2, float64: both grow with P, so one sort by tokens serves).
// 2. Ranks: LPT, exchange refinement to max(ceil(total / k), largest item);
//    where missed, a refined Karmarkar-Karp seed, the better kept.
// 3. Micro-batches: M = the largest per-rank lower bound (rounded up); each
//    rank by LPT or the level fit, else first fit plus splitting, M growing.
// 4. Feasibility: items move to ranks short of sequences; else a complete,
//    budgeted search over (rank, micro-batch): a refusal is a proof or says so.
// 5. Output: micro-batches heaviest first, each ascending. Ties by index.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "packing/packing_api.h"

namespace compass {
namespace packing {

namespace {

constexpr int64_t kBinPartners = 8;     // micro-batch refinement: partners per step,
constexpr double kBinTolerance = 5e-3;  // and its stop within 0.5% of the bound
constexpr double kRankTolerance = 1e-9;  // float costs: ranks within 1e-9 of the bound
// The rank snake sweep: from this many items per rank, and it stops while the
// items left exceed every rank's lift to the heaviest by kSnakeMargin * k of them.
constexpr int64_t kBulkMinPerBin = 96, kSnakeMargin = 8;
// Ranks try the level fit before LPT in groups of kGroup while LPT failed more
// often than not, unless a rank of the group is a probe (every kLptProbe-th).
constexpr int64_t kGroup = 4, kLptProbe = 16;
constexpr int64_t kSearchNodes = 4'000'000;  // the feasibility search's placements

// Stable LSD radix sort of (key, index) records, 8-bit digits, as many passes
// as the keys' bits need (std::sort: mispredicted branches, 10x slower).
struct Rec { uint64_t key; int64_t idx; };
void radix_sort(std::vector<Rec>& a) {
  uint64_t hi = 0;
  for (const Rec& r : a) hi |= r.key;
  std::vector<Rec> tmp(a.size());
  int64_t count[256];
  for (int shift = 0; shift < 64 && (hi >> shift) != 0; shift += 8) {
    std::fill(count, count + 256, 0);
    for (const Rec& r : a) ++count[(r.key >> shift) & 255];
    int64_t sum = 0;
    for (int64_t& c : count) sum += std::exchange(c, sum);
    for (const Rec& r : a) tmp[count[(r.key >> shift) & 255]++] = r;
    a.swap(tmp);
  }
}

// Items by decreasing cost w. With groups, item j's sequences are
// member[start[j] : start[j + 1]] (ascending); without, the j-th longest.
template <typename C>
struct Items {
  std::vector<C> w;
  std::vector<int64_t> start, member;
  int64_t size() const { return static_cast<int64_t>(w.size()); }
};

// Bins (ranks, or one rank's micro-batches); members by decreasing id (increasing cost).
template <typename C>
struct Bins {
  std::vector<std::vector<int64_t>> mem;
  std::vector<C> load;
  void reset(int64_t nb) { mem.assign(nb, {}), load.assign(nb, C{0}); }
  int64_t size() const { return static_cast<int64_t>(load.size()); }
  C max_load() const { return *std::max_element(load.begin(), load.end()); }
};

void move_id(std::vector<int64_t>& from, std::vector<int64_t>& to, int64_t x) {
  from.erase(std::lower_bound(from.begin(), from.end(), x, std::greater<int64_t>()));
  to.insert(std::lower_bound(to.begin(), to.end(), x, std::greater<int64_t>()), x);
}

// The exchange between bins h and r that lowers the larger load the most: x
// leaves h, y (or nothing, y = -1) leaves r, d = w[x] - w[y] in (0, gap)
// closest to gap / 2, by one two-pointer scan over xs and ys (increasing cost),
// stopped at the best score |2d - gap| possible (0, or 1 for an odd integer
// gap). fits(x, y) filters (cap, counts).
template <typename C>
struct Exchange { int64_t x, y; C score; };

template <typename C, typename Fits>
Exchange<C> best_exchange(const std::vector<int64_t>& xs, const std::vector<int64_t>& ys,
                          const C* w, C gap, Fits&& fits) {
  Exchange<C> best{-1, -1, gap};  // a candidate must beat it: d strictly inside (0, gap)
  C floor{0};
  if constexpr (std::is_integral_v<C>) floor = gap & 1;
  auto consider = [&](int64_t x, int64_t y, C d) {
    const C s = std::abs(2 * d - gap);
    if (d > C{0} && d < gap && s < best.score && fits(x, y)) best = {x, y, s};
  };
  const int64_t nx = static_cast<int64_t>(xs.size()), ny = static_cast<int64_t>(ys.size());
  // moves: the x closest to gap / 2 (the first with 2 w[x] >= gap, +- 2)
  const int64_t lo = std::partition_point(xs.begin(), xs.end(),
                                          [&](int64_t x) { return 2 * w[x] < gap; }) - xs.begin();
  for (int64_t p = std::max<int64_t>(lo - 2, 0); p < std::min(lo + 2, nx); ++p) {
    consider(xs[p], int64_t{-1}, w[xs[p]]);
  }
  int64_t j = 0;
  for (int64_t i = 0; i < nx && best.score > floor; ++i) {
    const int64_t x = xs[i];
    const C t = 2 * w[x] - gap;  // want 2 w[y] close to t
    while (j < ny && 2 * w[ys[j]] < t) ++j;
    for (int64_t q = std::max<int64_t>(j - 2, 0); q < std::min(j + 2, ny); ++q) {
      consider(x, ys[q], w[x] - w[ys[q]]);
    }
  }
  return best;
}

// The least-loaded bin, ties to the lower index: a tournament tree, O(log k).
// Keys are (load, bin) as one 128-bit integer (a non-negative double's bits
// order as its value), one branch-free minimum per level (pairs compared member
// by member: 3x slower LPT). A bin set aside holds the largest key.
template <typename To, typename From>
To bits_as(From v) {  // (std::bit_cast)
  To u;
  return std::memcpy(&u, &v, sizeof u), u;
}

template <typename C>
struct MinTree {
  using Key = unsigned __int128;
  static constexpr Key kNone = ~Key{0};
  int64_t leaves = 1;
  std::vector<Key> t;
  void init(int64_t k) {  // k bins at load 0
    for (leaves = 1; leaves < k;) leaves *= 2;
    t.assign(2 * leaves, kNone);
    for (int64_t r = 0; r < k; ++r) t[leaves + r] = static_cast<Key>(r);
    for (int64_t i = leaves - 1; i >= 1; --i) t[i] = std::min(t[2 * i], t[2 * i + 1]);
  }
  bool empty() const { return t[1] == kNone; }
  int64_t top() const { return static_cast<int64_t>(static_cast<uint64_t>(t[1])); }
  C top_load() const { return bits_as<C>(static_cast<uint64_t>(t[1] >> 64)); }
  void put(int64_t r, Key key) {  // (the running minimum: no load waits on the store below)
    int64_t i = leaves + r;
    for (t[i] = key; i > 1; i >>= 1) t[i >> 1] = key = t[i ^ 1] < key ? t[i ^ 1] : key;
  }
  void set(int64_t r, C load) { put(r, static_cast<Key>(bits_as<uint64_t>(load)) << 64 | r); }
  void set_aside(int64_t r) { put(r, kNone); }
  void add_top(C d) { set(top(), top_load() + d); }
};

// Until the heaviest bin h (the first of equal loads) is at `target` or cannot
// be lowered, it exchanges with the lightest bin that offers an exchange (at
// most max_partners tried, ties by index). fits(h, r, x, y): the exchange keeps
// both bins feasible; applied(h, r, x, y) is told of each change.
template <typename C, typename Fits, typename Applied>
void refine(Bins<C>& b, const C* w, C target, int64_t max_iter, int64_t max_partners,
            Fits&& fits, Applied&& applied) {
  const int64_t nb = b.size();
  if (nb < 2) return;
  auto attempt = [&](int64_t h, int64_t r) -> bool {
    const C gap = b.load[h] - b.load[r];
    if (gap <= C{0}) return false;
    const Exchange<C> e = best_exchange(b.mem[h], b.mem[r], w, gap,
                                        [&](int64_t x, int64_t y) { return fits(h, r, x, y); });
    if (e.x < 0 || (!std::is_integral_v<C> && gap - e.score <= b.load[h] * 1e-13)) {
      return false;  // (float costs: no crumbs)
    }
    move_id(b.mem[h], b.mem[r], e.x);
    if (e.y >= 0) move_id(b.mem[r], b.mem[h], e.y);
    const C d = w[e.x] - (e.y >= 0 ? w[e.y] : C{0});
    b.load[h] -= d;
    b.load[r] += d;
    applied(h, r, e.x, e.y);
    return true;
  };
  auto lighter = [&](int64_t x, int64_t y) {
    return std::make_pair(b.load[x], x) < std::make_pair(b.load[y], y);
  };
  std::vector<int64_t> others;
  for (int64_t iter = 0; iter < max_iter; ++iter) {
    const int64_t h = std::max_element(b.load.begin(), b.load.end()) - b.load.begin();
    if (b.load[h] <= target) break;
    int64_t l = h == 0 ? 1 : 0;
    for (int64_t j = 0; j < nb; ++j) l = j != h && lighter(j, l) ? j : l;
    if (attempt(h, l)) continue;
    others.clear();  // the next lightest, in order
    for (int64_t j = 0; j < nb; ++j) if (j != h && j != l) others.push_back(j);
    auto heavier = [&](int64_t x, int64_t y) { return lighter(y, x); };
    std::make_heap(others.begin(), others.end(), heavier);  // popped lazily: the first usually do
    int64_t p = 1;
    for (; p < max_partners && !others.empty(); ++p) {
      std::pop_heap(others.begin(), others.end(), heavier);
      if (attempt(h, others.back())) break;
      others.pop_back();
    }
    if (p == max_partners || others.empty()) break;
  }
}

// LPT over items 0..g-1 (decreasing cost) onto k ranks. With `card`
// (equal_samples): floor(g/k) or ceil(g/k) items per rank. Without it, from
// kBulkMinPerBin items per rank, after LPT of [0, max(2k, g/16)) whole blocks
// of k items go one to each rank (by load, lightest first, every other block
// reversed: alike mixes of long and short sequences, as LPT gives), while the
// items left exceed every rank's lift to the heaviest by a margin; LPT levels
// the rest.
template <typename C>
void lpt_ranks(const std::vector<C>& w, C total, int64_t k, bool card, Bins<C>& b) {
  const int64_t g = static_cast<int64_t>(w.size());
  b.reset(k);
  MinTree<C> heap;
  heap.init(k);
  const int64_t lo = g / k, rem = g % k;
  std::vector<int64_t> count(k, 0), rank_of(g);
  int64_t at_hi = 0;
  auto place = [&](int64_t j) {
    while (card) {  // ranks that can take no more leave the heap for good
      const int64_t c = count[heap.top()];
      if (c < lo || (c == lo && at_hi < rem)) break;
      heap.set_aside(heap.top());
    }
    const int64_t r = heap.top();
    rank_of[j] = r;
    if (card && ++count[r] == lo + 1) ++at_hi;
    b.load[r] += w[j];
    heap.add_top(w[j]);
  };
  int64_t a = g;  // LPT on [0, a), the snake on [a, j), LPT on [j, g)
  if (!card && g >= kBulkMinPerBin * k) a = std::max<int64_t>(2 * k, g / 16);
  int64_t j = 0;
  for (; j < a; ++j) place(j);
  if (a < g) {
    std::vector<int64_t> by_load(k);
    std::iota(by_load.begin(), by_load.end(), int64_t{0});
    std::sort(by_load.begin(), by_load.end(), [&](int64_t x, int64_t y) {
      return b.load[x] != b.load[y] ? b.load[x] < b.load[y] : x < y;
    });
    C top = b.load[by_load[k - 1]];
    const C mean = std::is_integral_v<C> ? total / k : total / static_cast<C>(k);
    // after the block [j, j + k) (heaviest under top + w[j]) the items left
    // exceed the lift to it by kSnakeMargin * k * w[j + k]
    for (bool fwd = true; j + k < g && top + w[j] + kSnakeMargin * w[j + k] <= mean; fwd = !fwd) {
      for (int64_t i = 0; i < k; ++i, ++j) {
        const int64_t r = by_load[fwd ? i : k - 1 - i];
        rank_of[j] = r;
        b.load[r] += w[j];
        top = std::max(top, b.load[r]);
      }
    }
    for (int64_t r = 0; r < k; ++r) heap.set(r, b.load[r]);
  }
  for (; j < g; ++j) place(j);
  count.assign(k, 0);
  for (int64_t i = 0; i < g; ++i) ++count[rank_of[i]];
  for (int64_t r = 0; r < k; ++r) b.mem[r].reserve(count[r]);
  for (int64_t i = g - 1; i >= 0; --i) b.mem[rank_of[i]].push_back(i);
  for (int64_t r = 0; r < k && !std::is_integral_v<C>; ++r) {  // float loads summed again
    b.load[r] = C{0};  // from the lightest item up, as the KK seed sums (integers: exact anyway)
    for (int64_t x : b.mem[r]) b.load[r] += w[x];
  }
}

// Karmarkar-Karp largest differencing, equal-size mode: items ascending (zero
// fillers pad g to a multiple of k), k at a time as partial solutions of k sets;
// the two with the largest spread merge (largest set of one with the smallest
// of the other) until one is left. Sets are linked lists. Ties as verl's code
// breaks them: sets by (sum, count, first item), larger first; solutions by
// spread, then their top sets. Returns each item's rank.
template <typename C>
struct KKSet {
  C sum;
  int64_t count, head, tail;
  std::tuple<C, int64_t, int64_t> key() const { return {sum, count, head}; }
};

template <typename C>
std::vector<int32_t> karmarkar_karp(const C* c, const std::vector<int64_t>& ascending, int64_t k) {
  const int64_t g = static_cast<int64_t>(ascending.size()), p = (g + k - 1) / k * k;
  std::vector<KKSet<C>> sets(p);
  std::vector<int64_t> next(p, -1), heap(p / k);
  auto set_before = [](const KKSet<C>& a, const KKSet<C>& b) { return a.key() > b.key(); };
  for (int64_t s = 0; s < p / k; ++s) {  // (the fillers g..p-1, then ascending) by chunks
    for (int64_t i = 0; i < k; ++i) {  // reversed: in set order but for ties
      const int64_t at = s * k + k - 1 - i - (p - g);  // < 0: a filler
      const int64_t item = at < 0 ? at + p : ascending[at];
      sets[s * k + i] = {at < 0 ? C{0} : c[item], 1, item, item};
    }
    std::sort(&sets[s * k], &sets[s * k + k], set_before);
  }
  auto pops_after = [&](int64_t a, int64_t b) {
    const KKSet<C>&ta = sets[a * k], &tb = sets[b * k];
    return std::make_tuple(ta.sum - sets[a * k + k - 1].sum, ta.key(), -a) <
           std::make_tuple(tb.sum - sets[b * k + k - 1].sum, tb.key(), -b);
  };
  std::iota(heap.begin(), heap.end(), int64_t{0});
  std::make_heap(heap.begin(), heap.end(), pops_after);
  auto pop = [&] {
    std::pop_heap(heap.begin(), heap.end(), pops_after);
    const int64_t s = heap.back();
    return heap.pop_back(), s;
  };
  while (heap.size() > 1) {
    const int64_t a = pop(), b = pop();
    KKSet<C>* x = &sets[a * k];
    for (int64_t i = 0; i < k; ++i) {
      const KKSet<C>& o = sets[b * k + k - 1 - i];
      next[x[i].tail] = o.head;
      x[i] = {x[i].sum + o.sum, x[i].count + o.count, x[i].head, o.tail};
    }
    std::sort(x, x + k, set_before);
    heap.push_back(a);
    std::push_heap(heap.begin(), heap.end(), pops_after);
  }
  std::vector<int32_t> rank(g);
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t i = sets[heap[0] * k + r].head; i != -1; i = next[i]) {
      if (i < g) rank[i] = static_cast<int32_t>(r);
    }
  }
  return rank;
}

// The lowest bin with room for t tokens: a max-tree over the bins' room, O(log nb).
struct FirstFit {
  int64_t size = 1;
  std::vector<int64_t> t;
  void init(int64_t nb, int64_t room) {
    for (size = 1; size < nb;) size *= 2;
    t.assign(2 * size, -1);
    std::fill(t.begin() + size, t.begin() + size + nb, room);
    for (int64_t i = size - 1; i >= 1; --i) t[i] = std::max(t[2 * i], t[2 * i + 1]);
  }
  int64_t take(int64_t tok) {  // that bin, its room lowered by tok; -1 where none has room
    if (t[1] < tok) return -1;
    int64_t node = 1;
    while (node < size) node = t[2 * node] >= tok ? 2 * node : 2 * node + 1;
    const int64_t q = node - size;
    for (t[node] -= tok; node > 1; node >>= 1) t[node >> 1] = std::max(t[node], t[node ^ 1]);
    return q;
  }
};

// One rank's micro-batch packing: bin_of (the rank's sequences by decreasing
// tokens -> bin), b.load, room; b.mem only where needed (has_mem).
template <typename C>
struct RankPacker {
  const C* w = nullptr;          // local id -> cost
  const int64_t* tok = nullptr;  // local id -> tokens
  std::vector<C> wbuf;           // w for float costs (integer costs: w is tok)
  std::vector<int64_t> room, bin_of, all;
  Bins<C> b;
  MinTree<C> heap;
  FirstFit ff;
  C total{};  // of the rank's costs
  int64_t m = 0;
  bool has_mem = false;
  void start(int64_t m_, int64_t nbins, int64_t cap) {
    m = m_, has_mem = false, bin_of.resize(m);
    b.load.assign(nbins, C{0}), room.assign(nbins, cap);
  }
  void ensure_mem() {  // b.mem from bin_of, by decreasing id
    if (!has_mem) b.mem.assign(b.size(), {});
    for (int64_t i = m - 1; i >= 0 && !has_mem; --i) b.mem[bin_of[i]].push_back(i);
    has_mem = true;
  }
  // One LPT step: sequence i to the least-loaded bin with room for it (bins
  // without room set aside for this step only). False when none has room.
  std::vector<std::pair<C, int64_t>> aside;
  bool lpt_place(int64_t i) {
    aside.clear();
    while (!heap.empty() && room[heap.top()] < tok[i]) {
      aside.emplace_back(heap.top_load(), heap.top());
      heap.set_aside(heap.top());
    }
    if (heap.empty()) return false;
    room[bin_of[i] = heap.top()] -= tok[i];
    heap.add_top(w[i]);
    for (const auto& e : aside) heap.set(e.second, e.first);
    return true;
  }
  // LPT by cost among the bins with room. False when some sequence fits nowhere.
  bool lpt(int64_t m_, int64_t nbins, int64_t cap) {
    start(m_, nbins, cap);
    heap.init(nbins);
    for (int64_t i = 0; i < m; ++i) if (!lpt_place(i)) return false;
    for (int64_t i = m - 1; i >= 0; --i) b.load[bin_of[i]] += w[i];  // summed by decreasing id
    return true;
  }
  // Tight ranks (LPT leaves no room for a late long sequence): first fit into
  // nbins bins of `level` tokens (the balanced level), the few that fit under
  // no level by LPT under the cap. False when one fits nowhere or a bin stays empty.
  bool level_fit(int64_t m_, int64_t nbins, int64_t cap, int64_t level) {
    start(m_, nbins, cap);
    ff.init(nbins, level);
    all.clear();  // the sequences left for LPT
    for (int64_t i = 0; i < m; ++i) {
      const int64_t q = ff.take(tok[i]);
      if (q < 0) all.push_back(i);
      else bin_of[i] = q, room[q] -= tok[i], b.load[q] += w[i];
    }
    heap.init(nbins);
    for (int64_t q = 0; q < nbins && !all.empty(); ++q) heap.set(q, b.load[q]);
    for (int64_t i : all) {
      if (!lpt_place(i)) return false;
      b.load[bin_of[i]] += w[i];
    }
    // an empty bin: leave it to the other packings
    return std::find(room.begin(), room.end(), cap) == room.end();
  }
  // First fit by decreasing tokens into bins of cap (all but one over half
  // full: at most 2 total / cap + 1 bins), then split into nbins bins.
  // False (bin_of unusable) where first fit needs more than nbins: `used`.
  bool first_fit(int64_t nbins, int64_t cap, int64_t& used) {
    int64_t sum = 0;
    for (int64_t i = 0; i < m; ++i) sum += tok[i];
    ff.init(std::min(m, 2 * ((sum + cap - 1) / cap) + 1), cap);
    used = 0;
    for (int64_t i = 0; i < m; ++i) used = std::max(used, (bin_of[i] = ff.take(tok[i])) + 1);
    if (used > nbins) return false;
    from_bins(used, cap);
    split_to(nbins, cap);
    return true;
  }
  void from_bins(int64_t nbins, int64_t cap) {  // the packing bin_of[0..m) into nbins bins
    b.reset(nbins);
    room.assign(nbins, cap);
    for (int64_t i = m - 1; i >= 0; --i) {  // decreasing id within each bin
      b.mem[bin_of[i]].push_back(i);
      b.load[bin_of[i]] += w[i];
      room[bin_of[i]] -= tok[i];
    }
    has_mem = true;
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
      b.mem[h].clear(), b.mem.emplace_back();
      b.load[h] = C{0}, b.load.push_back(C{0});
      room[h] = cap, room.push_back(cap);
      const int64_t other = b.size() - 1;
      for (auto it = all.rbegin(); it != all.rend(); ++it) {  // heaviest first
        const int64_t to = (b.mem[other].empty() || b.load[other] < b.load[h]) ? other : h;
        b.mem[to].push_back(*it);
        b.load[to] += w[*it];
        room[to] -= tok[*it];
      }
      std::reverse(b.mem[h].begin(), b.mem[h].end());
      std::reverse(b.mem[other].begin(), b.mem[other].end());
    }
    for (int64_t q = 0; q < b.size(); ++q) for (int64_t i : b.mem[q]) bin_of[i] = q;
  }
  // The bound for the heaviest micro-batch: max(total / nbins, largest cost)
  // plus kBinTolerance. Packings under it are not refined.
  C target(int64_t nbins) const {
    if constexpr (std::is_integral_v<C>) {
      const C lb = std::max<C>((total + nbins - 1) / nbins, w[0]);
      return lb + static_cast<C>(static_cast<double>(lb) * kBinTolerance);
    } else {
      return std::max(total / static_cast<C>(nbins), w[0]) * (1.0 + kBinTolerance);
    }
  }
  // The packing set aside, and back.
  std::vector<int64_t> kept_bin_of, kept_room;
  std::vector<C> kept_load;
  void keep() {
    has_mem = false, bin_of.swap(kept_bin_of), b.load.swap(kept_load), room.swap(kept_room);
  }
  // Move / swap refinement between bins over the bound, never breaking the cap
  // nor emptying a bin.
  void balance(int64_t nbins, int64_t max_iter) {
    const C target = this->target(nbins);
    if (b.max_load() <= target) return;
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
        });
  }
};

struct Input {
  const int64_t* tok;  // padded lengths
  const int64_t* gid;  // or nullptr
  int64_t n, k, cap, mbm, iters;
  bool equal;
  double a, b;  // float costs: a * P + b * P^2
};
template <typename C>
C cost_of(const Input& in, int64_t p) {  // of p padded tokens: p, or a p + b p^2
  const double d = static_cast<double>(p);
  if constexpr (std::is_integral_v<C>) return p; else return in.a * d + in.b * d * d;
}

template <typename C>
struct Planner {
  const Input& in;
  int64_t *ord, *off, n, k, cap;
  std::vector<int64_t> sorted, stok;  // sequences by decreasing tokens (ties by index), tokens
  Items<C> it;
  C total{0};
  Bins<C> best;  // items per rank
  // each rank's sequences by decreasing tokens (rank-major, rank r from
  // base[r]), their tokens; each rank's tokens and count of sequences over cap / 2
  std::vector<int64_t> base, by_rank, by_tok, rank_tok, big;
  std::vector<int64_t> slot_of, cursor;  // sequence -> r * M + bin; where each bin writes next
  std::vector<int64_t> first, size, order;  // write_rank's, per bin
  RankPacker<C> pk;
  Planner(const Input& in_, int64_t* o, int64_t* f)
      : in(in_), ord(o), off(f), n(in_.n), k(in_.k), cap(in_.cap) {}
  int64_t round_up(int64_t v) const { return (v + in.mbm - 1) / in.mbm * in.mbm; }
  void make_items() {
    std::vector<Rec> rec(n);
    const int64_t* tok = in.tok;
    const int64_t top = *std::max_element(tok, tok + n);
    for (int64_t i = 0; i < n; ++i) rec[i] = {static_cast<uint64_t>(top - tok[i]), i};
    radix_sort(rec);
    sorted.resize(n), stok.resize(n);
    for (int64_t j = 0; j < n; ++j) sorted[j] = rec[j].idx, stok[j] = top - rec[j].key;
    if (in.gid == nullptr) {
      it.w.resize(n);
      for (int64_t j = 0; j < n; ++j) total += (it.w[j] = cost_of<C>(in, stok[j]));
      return;
    }
    const int64_t gmin = *std::min_element(in.gid, in.gid + n);
    for (int64_t i = 0; i < n; ++i) rec[i] = {uint64_t(in.gid[i]) - uint64_t(gmin), i};
    radix_sort(rec);  // ascending group id, then index
    std::vector<int64_t> gstart;
    std::vector<C> gw;
    for (int64_t j = 0; j < n; ++j) {
      if (j == 0 || rec[j].key != rec[j - 1].key) gstart.push_back(j), gw.push_back(C{0});
      gw.back() += cost_of<C>(in, tok[rec[j].idx]);
    }
    gstart.push_back(n);
    const int64_t g = static_cast<int64_t>(gw.size());
    COMPASS_CHECK(g >= k, "group_ids: need at least dp_size = ", k,
                  " groups so that every rank gets one, got ", g);
    for (int64_t j = 1; j < g && in.equal; ++j) {
      COMPASS_CHECK(gstart[j + 1] - gstart[j] == gstart[1], "group_ids: equal_samples needs groups "
                    "of one size, got sizes ", gstart[1], " and ", gstart[j + 1] - gstart[j]);
    }
    std::vector<int64_t> gdesc(g);  // groups by decreasing cost, ties by group order
    std::iota(gdesc.begin(), gdesc.end(), int64_t{0});
    std::stable_sort(gdesc.begin(), gdesc.end(), [&](int64_t x, int64_t y) { return gw[x] > gw[y]; });
    it.w.resize(g);
    it.start.assign(1, 0);
    it.member.clear();
    for (int64_t j = 0; j < g; ++j) {
      const int64_t q = gdesc[j];
      it.w[j] = gw[q];
      for (int64_t s = gstart[q]; s < gstart[q + 1]; ++s) it.member.push_back(rec[s].idx);
      it.start.push_back(static_cast<int64_t>(it.member.size()));
      total += it.w[j];
    }
  }
  // Ranks: LPT + refinement; KK + refinement only if the bound is missed.
  double make_ranks() {
    const int64_t g = it.size();
    const double lb = std::max(static_cast<double>(total) / static_cast<double>(k),
                               static_cast<double>(it.w[0]));
    const C target = std::is_integral_v<C> ? std::max<C>((total + k - 1) / k, it.w[0])
                                           : static_cast<C>(lb * (1.0 + kRankTolerance));
    const int64_t iters = in.iters >= 0 ? in.iters : 16 * k + 256;
    auto refine_ranks = [&](Bins<C>& b) {
      std::vector<int64_t> count(k);
      for (int64_t r = 0; r < k; ++r) count[r] = static_cast<int64_t>(b.mem[r].size());
      refine(
          b, it.w.data(), target, iters, k,
          [&](int64_t h, int64_t r, int64_t, int64_t y) {  // (swaps keep every count)
            return y >= 0 || (in.equal ? count[h] > count[r] : count[h] > 1);
          },
          [&](int64_t h, int64_t r, int64_t, int64_t y) { if (y < 0) --count[h], ++count[r]; });
    };
    lpt_ranks(it.w, total, k, in.equal, best);
    refine_ranks(best);
    if (best.max_load() > target) {
      std::vector<int64_t> ascending(g);
      std::iota(ascending.rbegin(), ascending.rend(), int64_t{0});  // g-1 .. 0
      const std::vector<int32_t> rank = karmarkar_karp(it.w.data(), ascending, k);
      Bins<C> other;
      other.reset(k);
      for (int64_t j = g - 1; j >= 0; --j) other.mem[rank[j]].push_back(j), other.load[rank[j]] += it.w[j];
      refine_ranks(other);
      if (other.max_load() < best.max_load()) std::swap(best, other);
    }
    return lb;
  }
  // The sequences of item j: seq(s) for s in [first(j), first(j + 1)).
  int64_t first_of(int64_t j) const { return in.gid ? it.start[j] : j; }
  int64_t seq(int64_t s) const { return in.gid ? it.member[s] : sorted[s]; }
  // Each rank's sequences by decreasing tokens from its items (best); returns
  // the largest per-rank lower bound, rounded up to micro_batch_multiple.
  int64_t layout() {
    base.assign(k + 1, 0);
    rank_tok.assign(k, 0);
    big.assign(k, 0);
    by_rank.resize(n);
    by_tok.resize(n);
    auto add = [&](int64_t r, int64_t at, int64_t s, int64_t t) {
      by_rank[at] = s;
      by_tok[at] = t;
      rank_tok[r] += t;
      big[r] += 2 * t > cap;
    };
    if (!in.gid) {  // a rank's items by decreasing id, read backwards: written in order
      for (int64_t r = 0; r < k; ++r) {
        const std::vector<int64_t>& mem = best.mem[r];
        const int64_t m = static_cast<int64_t>(mem.size());
        for (int64_t i = 0; i < m; ++i) add(r, base[r] + i, sorted[mem[m - 1 - i]], stok[mem[m - 1 - i]]);
        base[r + 1] = base[r] + m;
      }
    } else {  // one pass over all sequences by decreasing tokens, each to its rank
      std::vector<int64_t> rank_of(n);
      for (int64_t r = 0; r < k; ++r) {
        for (int64_t j : best.mem[r]) {
          for (int64_t s = it.start[j]; s < it.start[j + 1]; ++s) rank_of[it.member[s]] = r;
          base[r + 1] += it.start[j + 1] - it.start[j];
        }
      }
      std::partial_sum(base.begin(), base.end(), base.begin());
      std::vector<int64_t> at(base.begin(), base.end() - 1);
      for (int64_t j = 0; j < n; ++j) add(rank_of[sorted[j]], at[rank_of[sorted[j]]]++, sorted[j], stok[j]);
    }
    int64_t nb = 1;
    for (int64_t r = 0; r < k; ++r) nb = std::max({nb, (rank_tok[r] + cap - 1) / cap, big[r]});
    return round_up(nb);
  }
  bool counts_fit(int64_t nb) const {  // every rank holds nb sequences
    for (int64_t r = 0; r < k; ++r) if (base[r + 1] - base[r] < nb) return false;
    return true;
  }
  int64_t load_rank(int64_t r) {  // pk reads the rank's slice of by_tok
    const int64_t m = base[r + 1] - base[r], *t = pk.tok = by_tok.data() + base[r];
    if constexpr (std::is_integral_v<C>) {
      pk.w = t, pk.total = rank_tok[r];  // the cost is the tokens
    } else {
      pk.wbuf.resize(m), pk.w = pk.wbuf.data(), pk.total = C{0};
      for (int64_t i = 0; i < m; ++i) pk.total += (pk.wbuf[i] = cost_of<C>(in, t[i]));
    }
    return m;
  }
  // Rank r's packing (pk) in the output: its micro-batches heaviest first
  // (ties by first sequence) get their offsets; each sequence its slot.
  void write_rank(int64_t r, int64_t nb) {
    const int64_t m = base[r + 1] - base[r];
    const int64_t* seqs = by_rank.data() + base[r];
    first.assign(nb, n), size.assign(nb, 0), order.resize(nb);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t q = pk.bin_of[i];
      first[q] = std::min(first[q], seqs[i]), ++size[q], slot_of[seqs[i]] = r * nb + q;
    }
    std::iota(order.begin(), order.end(), int64_t{0});
    std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      const C lx = pk.b.load[x], ly = pk.b.load[y];
      return lx != ly ? lx > ly : first[x] < first[y];
    });
    int64_t pos = base[r];
    for (int64_t j = 0; j < nb; ++j) {
      off[r * nb + j] = cursor[r * nb + order[j]] = pos, pos += size[order[j]];
    }
  }
  void write_order(int64_t nb) {  // each micro-batch by ascending sequence index
    off[k * nb] = n;
    for (int64_t s = 0; s < n; ++s) ord[cursor[slot_of[s]]++] = s;
  }
  // Micro-batches: each rank into nb bins (LPT or the level fit, first fit plus
  // splitting where neither fits), written. Where first fit needs more bins, nb
  // grows and the ranks are packed again. Returns nb, or 0 where nb grew past
  // some rank's sequence count.
  int64_t pack(int64_t nb) {
    std::vector<int64_t> lpt_ok_at(k, 0), written_at(k, 0);
    int64_t lpt_packed = 0, lpt_failed = 0;  // ranks LPT packed within their bound / not
    slot_of.resize(n);
    for (bool grown = true; grown;) {
      grown = false;
      cursor.resize(k * nb);
      const int64_t mb_iters = 2 * nb + 32;
      int64_t next = 0;          // ranks from here are in no group yet
      bool level_first = false;  // the current group's first choice
      for (int64_t r = 0; r < k; ++r) {
        if (written_at[r] == nb) continue;
        if (r >= next) {  // the next group of kGroup ranks not yet written at this nb
          bool probe = false;
          for (int64_t cnt = 0; next < k && cnt < kGroup; ++next) {
            if (written_at[next] != nb) probe |= next % kLptProbe == 0, ++cnt;
          }
          level_first = lpt_failed > lpt_packed && !probe;
        }
        const int64_t m = load_rank(r);
        auto level_fit = [&] {  // the balanced level plus kBinTolerance
          const int64_t level = (rank_tok[r] + nb - 1) / nb;
          return pk.level_fit(m, nb, cap, std::min(cap, level + int64_t(level * kBinTolerance)));
        };
        bool lpt_ok = false;  // LPT found room for every sequence
        auto lpt = [&] { return lpt_ok = pk.lpt(m, nb, cap); };
        // The first choice within the rank's bound, else the second; both over
        // it: both refined, the better kept (ties: the first).
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
            pk.keep(), pk.balance(nb, mb_iters), refined = true;
            if (top2 < pk.b.max_load()) pk.keep();
          } else if (!packed && ok1) {
            pk.keep();
          }
          packed |= ok1 || ok2;
        }
        if (lpt_tried) ++(lpt_good ? lpt_packed : lpt_failed);
        if (lpt_ok) lpt_ok_at[r] = nb;
        int64_t used = 0;
        if (!packed && !pk.first_fit(nb, cap, used)) {
          if (lpt_ok_at[r] == 0) {  // nb grows
            if (!counts_fit(nb = round_up(used))) return 0;
            grown = true;
            break;
          }
          pk.lpt(m, lpt_ok_at[r], cap);
          pk.split_to(nb, cap);
        }
        if (!refined) pk.balance(nb, mb_iters);
        write_rank(r, nb);
        written_at[r] = nb;
      }
    }
    write_order(nb);
    return nb;
  }
  // A rank with fewer than nb sequences takes the smallest item a rank with
  // some to spare can give without raising the receiver's bound past nb (not
  // under equal_samples). False when some short rank finds none.
  bool move_small_items(int64_t nb) {
    std::vector<int64_t> cnt(k), itok(it.size(), 0), ibig(it.size(), 0);
    std::vector<int64_t>&tok = rank_tok, &nbig = big;  // as layout() left them
    std::adjacent_difference(base.begin() + 1, base.end(), cnt.begin());  // (base[0] = 0)
    for (int64_t j = 0; j < it.size(); ++j) {
      for (int64_t s = first_of(j); s < first_of(j + 1); ++s) {
        itok[j] += in.tok[seq(s)], ibig[j] += 2 * in.tok[seq(s)] > cap;
      }
    }
    auto seqs = [&](int64_t j) { return first_of(j + 1) - first_of(j); };
    for (int64_t r = 0; r < k; r += cnt[r] >= nb ? 1 : 0) {
      if (cnt[r] >= nb) continue;
      int64_t x = -1, from = -1;  // the smallest item (largest id) any donor can give
      for (int64_t d = 0; d < k; ++d) {
        for (int64_t j : best.mem[d]) {  // by increasing cost: the first that fits
          if (d == r || j <= x || cnt[d] - seqs(j) < nb) continue;
          if ((tok[r] + itok[j] + cap - 1) / cap > nb || nbig[r] + ibig[j] > nb) continue;
          x = j, from = d;
          break;
        }
      }
      if (x < 0) return false;
      move_id(best.mem[from], best.mem[r], x);
      best.load[from] -= it.w[x], best.load[r] += it.w[x];
      cnt[from] -= seqs(x), tok[from] -= itok[x], nbig[from] -= ibig[x];
      cnt[r] += seqs(x), tok[r] += itok[x], nbig[r] += ibig[x];
    }
    return true;
  }
  // The feasibility search at M micro-batches per rank: each sequence (items
  // heaviest first, an item's sequences by decreasing tokens) gets a (rank,
  // bin), the item's first one its rank: ranks with items least-loaded first,
  // then the first without; bins least-loaded first, one of equal loads, then
  // the first empty one. Pruned where the sequences left cannot fill the empty
  // bins. Iterative, O(n) memory. Returns 1 found (slot_of), 0 exhausted, -1
  // budget spent.
  int64_t search(int64_t M, int64_t& nodes) {
    const int64_t g = it.size(), lo_cnt = g / k, rem = g % k;
    std::vector<int64_t> seq, item_of;  // level -> sequence, its item
    for (int64_t j = 0; j < g; ++j) {
      const size_t from = seq.size();
      for (int64_t s = first_of(j); s < first_of(j + 1); ++s) seq.push_back(this->seq(s));
      std::stable_sort(seq.begin() + from, seq.end(),
                       [&](int64_t x, int64_t y) { return in.tok[x] > in.tok[y]; });
      item_of.resize(seq.size(), j);
    }
    std::vector<C> rank_cost(k, C{0}), cost_before(n);  // (float costs restored exactly)
    std::vector<int64_t> items(k, 0), used(k, 0), load(k * M, 0), item_rank(g, -1), choice(n, -1);
    int64_t empty = k * M, at_hi = 0;  // empty bins; ranks at lo_cnt + 1 items (equal_samples)
    auto rank_before = [&](int64_t x, int64_t y) {  // ranks with items first, by (cost, index)
      return std::make_tuple(items[x] == 0, rank_cost[x], x) <
             std::make_tuple(items[y] == 0, rank_cost[y], y);
    };
    auto next_rank = [&](int64_t r) -> int64_t {  // after r (-1: the first), in rank_before order
      int64_t best_r = -1;
      bool empty_seen = false;
      for (int64_t x = 0; x < k; ++x) {
        if (items[x] == 0 && empty_seen) continue;  // ranks without items: only the first
        empty_seen |= items[x] == 0;
        const bool full = in.equal && (items[x] > lo_cnt || (items[x] == lo_cnt && at_hi >= rem));
        if (full || (r >= 0 && !rank_before(r, x))) continue;
        if (best_r < 0 || rank_before(x, best_r)) best_r = x;
      }
      return best_r;
    };
    // the next bin of rank r after bin q (-1: the first) for t tokens, or -1
    auto next_bin = [&](int64_t r, int64_t q, int64_t t) -> int64_t {
      if (q == used[r]) return -1;  // the empty bin is the last choice
      int64_t best_q = -1;
      for (int64_t p = 0; p < used[r]; ++p) {
        const int64_t l = load[r * M + p];
        if (l + t > cap || (q >= 0 && l <= load[r * M + q])) continue;
        if (best_q < 0 || l < load[r * M + best_q]) best_q = p;
      }
      return best_q >= 0 ? best_q : used[r] < M ? used[r] : -1;
    };
    auto apply = [&](int64_t i, int64_t r, int64_t q, int64_t sign) {
      const int64_t t = in.tok[seq[i]], j = item_of[i];
      if (i == 0 || item_of[i - 1] != j) {  // the item's first sequence: its rank
        items[r] += sign;
        at_hi += sign * (in.equal && items[r] == lo_cnt + (sign > 0));
        if (sign > 0) cost_before[i] = rank_cost[r];
        rank_cost[r] = sign > 0 ? rank_cost[r] + it.w[j] : cost_before[i];
        item_rank[j] = sign > 0 ? r : -1;
      }
      if (sign < 0 && load[r * M + q] == t) --used[r], ++empty;  // it opened the bin
      load[r * M + q] += sign * t;
      if (sign > 0 && q == used[r]) ++used[r], --empty;
    };
    int64_t i = 0;
    while (i >= 0 && i < n) {
      const bool first = i == 0 || item_of[i - 1] != item_of[i];
      int64_t r = -1, q = -1;
      if (choice[i] >= 0) r = choice[i] / M, q = choice[i] % M, apply(i, r, q, -1);  // undo it
      if (!first) r = item_rank[item_of[i]];
      for (;;) {  // the next (rank, bin)
        if (r >= 0) q = next_bin(r, q, in.tok[seq[i]]);
        if (q >= 0 || !first || (r = next_rank(r)) < 0) break;
      }
      if (r < 0 || q < 0) {  // no choice left: back up
        choice[i--] = -1;
        continue;
      }
      if (++nodes > kSearchNodes) return -1;
      apply(i, r, q, 1);
      choice[i] = r * M + q;
      if (empty <= n - 1 - i) ++i;  // else pruned: the next choice
    }
    if (i < 0) return 0;
    for (int64_t l = 0; l < n; ++l) slot_of[seq[l]] = choice[l];
    return 1;
  }
  // No plan from the balanced ranks: the search, for each M from the smallest
  // any plan could have up to the most every rank's sequences allow.
  int64_t fallback() {
    int64_t tokens = 0, nbig = 0;
    for (int64_t s = 0; s < n; ++s) tokens += in.tok[s], nbig += 2 * in.tok[s] > cap;
    const int64_t g = it.size(), cap_bins = (tokens + cap - 1) / cap;
    const int64_t m_lo = round_up(std::max({int64_t{1}, (cap_bins + k - 1) / k, (nbig + k - 1) / k}));
    const int64_t m_hi = in.equal ? g / k * (n / g) : n / k;  // the fewest sequences a rank can hold
    const std::string what = "every rank the same number M of non-empty micro-batches (M a "
                             "multiple of micro_batch_multiple = " + std::to_string(in.mbm) +
                             ") within max_tokens = " + std::to_string(cap) +
                             (in.gid ? ", each group on one rank" : "") +
                             (in.equal ? ", equal sample counts" : "");
    const char* give = ": give more sequences, a larger max_tokens or a smaller micro_batch_multiple";
    COMPASS_CHECK(m_lo <= m_hi, "lengths: no plan exists giving ", what, ": the ", tokens,
                  " tokens and ", nbig, " sequences over max_tokens / 2 need M >= ", m_lo,
                  " micro-batches per rank, so as many sequences on every rank, but ", n,
                  " sequences over dp_size = ", k, " ranks leave some rank at most ", m_hi, give);
    int64_t nodes = 0, M = m_lo - in.mbm, found = 0;
    slot_of.resize(n);
    while (found == 0 && (M += in.mbm) <= m_hi) found = search(M, nodes);
    COMPASS_CHECK(found != 0, "lengths: no plan exists giving ", what,
                  ": an exhaustive search over M = ", m_lo, "..", m_hi, " found none", give);
    COMPASS_CHECK(found > 0, "lengths: no plan found giving ", what, ": the balanced ranks leave "
                  "some rank too few sequences, and the search for another assignment gave up "
                  "after ", kSearchNodes, " placements at M = ", M, " (of ", m_lo, "..", m_hi,
                  "; a plan may exist)", give);
    best.reset(k);  // the search's ranks
    for (int64_t j = g - 1; j >= 0; --j) best.mem[slot_of[seq(first_of(j))] / M].push_back(j);
    layout();
    const std::vector<int64_t> bins = slot_of;
    cursor.resize(k * M);
    for (int64_t r = 0; r < k; ++r) {  // the search's bins, refined, written
      pk.start(load_rank(r), M, cap);
      for (int64_t i = 0; i < pk.m; ++i) pk.bin_of[i] = bins[by_rank[base[r] + i]] - r * M;
      pk.from_bins(M, cap);
      pk.balance(M, 2 * M + 32);
      write_rank(r, M);
    }
    write_order(M);
    return M;
  }
  std::pair<int64_t, double> run() {
    make_items();
    COMPASS_CHECK(it.size() >= k, "lengths: need at least dp_size = ", k,
                  " sequences so that every rank gets one, got ", it.size());
    const double lb = make_ranks();
    int64_t nb = layout();
    if (!counts_fit(nb) && !in.equal && move_small_items(nb)) nb = layout();
    if (counts_fit(nb) && (nb = pack(nb)) > 0) return {nb, lb};
    return {fallback(), lb};
  }
};

}  // namespace

std::pair<int64_t, double> plan_cpu(COMPASS_PLAN_ARGS) {
  COMPASS_NAME_ARGS(lengths, group_ids, order, offsets);
  for (const TensorView* v : {&lengths, &order, &offsets, group_ids ? &*group_ids : &lengths}) {
    v->expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  }
  const int64_t n = lengths.numel();
  COMPASS_CHECK(n >= 1, "lengths: expected at least one sequence, got none");
  if (group_ids) group_ids->expect_size(0, n, "one per sequence");
  order.expect_size(0, n, "one per sequence");
  offsets.expect_size(0, n + 1, "len(lengths) + 1");
  auto positive = [](int64_t v, const char* name) {
    COMPASS_CHECK(v >= 1, name, ": expected >= 1, got ", v);
  };
  positive(dp_size, "dp_size"), positive(max_tokens, "max_tokens");
  positive(micro_batch_multiple, "micro_batch_multiple"), positive(pad_multiple, "pad_multiple");
  COMPASS_CHECK(std::isfinite(cost_a) && cost_a > 0.0, "cost_a: expected a finite value > 0, got ",
                cost_a);
  COMPASS_CHECK(std::isfinite(cost_b) && cost_b >= 0.0,
                "cost_b: expected a finite value >= 0, got ", cost_b);
  // Padding and range checks, naming the first offending sequence. Totals
  // (and the doubled loads the refinement compares) must not overflow int64.
  const int64_t* len = lengths.ptr<int64_t>();
  std::vector<int64_t> padded(pad_multiple > 1 ? n : 0);
  // padded <= max_tokens iff ceil(L / pad) <= room
  int64_t room = max_tokens / pad_multiple, limit = std::numeric_limits<int64_t>::max() / 4, total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t L = len[i];
    COMPASS_CHECK(L >= 1, "lengths: expected every sequence non-empty, got lengths[", i, "] = ", L);
    const int64_t q = (L - 1) / pad_multiple + 1;
    if (q > room) {
      const bool pad = q <= std::numeric_limits<int64_t>::max() / pad_multiple;
      fail("lengths: sequence ", i, " has ", pad ? q * pad_multiple : L,
           pad ? " tokens (after padding)" : " tokens", ", more than max_tokens = ", max_tokens,
           ": no micro-batch can hold it");
    }
    const int64_t P = q * pad_multiple;
    COMPASS_CHECK(total <= limit - P, "lengths: the total token count overflows int64");
    total += P;
    if (pad_multiple > 1) padded[i] = P;
  }
  const int64_t* tok = pad_multiple > 1 ? padded.data() : len;
  const Input in{tok, group_ids ? group_ids->ptr<int64_t>() : nullptr, n, dp_size,
                 max_tokens, micro_batch_multiple, refine_iters, equal_samples, cost_a, cost_b};
  int64_t *ord = order.ptr<int64_t>(), *off = offsets.ptr<int64_t>();
  if (cost_b == 0.0) {  // a*P: balancing P is the same problem, in exact integers
    const auto r = Planner<int64_t>(in, ord, off).run();
    return {r.first, r.second * cost_a};
  }
  for (int64_t i = 0; i < n; ++i) {
    COMPASS_CHECK(std::isfinite(cost_of<double>(in, tok[i])), "cost_a, cost_b: the cost of sequence ",
                  i, " (", tok[i], " tokens) overflows float64");
  }
  return Planner<double>(in, ord, off).run();
}

void karmarkar_karp_cpu(TensorView cost, int64_t k, TensorView rank_of) {
  COMPASS_NAME_ARGS(cost, rank_of);
  cost.expect_vector().expect_dtype(DType::kFloat64).expect_device(DeviceType::kCPU);
  rank_of.expect_vector().expect_dtype(DType::kInt64).expect_device(DeviceType::kCPU);
  rank_of.expect_size(0, cost.numel(), "one per item");
  COMPASS_CHECK(k >= 1, "k: expected >= 1, got ", k);
  const double* c = cost.ptr<double>();
  std::vector<int64_t> asc(cost.numel());  // ties by index, as Python's sorted((v, i))
  std::iota(asc.begin(), asc.end(), int64_t{0});
  std::sort(asc.begin(), asc.end(),
            [&](int64_t x, int64_t y) { return std::make_pair(c[x], x) < std::make_pair(c[y], y); });
  const std::vector<int32_t> r = karmarkar_karp(c, asc, k);
  std::copy(r.begin(), r.end(), rank_of.ptr<int64_t>());
}

}  // namespace packing
}  // namespace compass
