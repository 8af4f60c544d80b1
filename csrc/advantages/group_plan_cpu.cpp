// Group plan from arbitrary integer ids, on the CPU: the order that makes each
// group's members contiguous (stable), the group boundaries and the sorted
// unique ids. Sorted ids take one pass (identity order); ids in a range up to
// max(4n, 65536) wide (the usual case: prompt indices) a counting sort,
// O(n + range); wider ranges a stable comparison sort, O(n log n). Returns the number of groups G; the caller
// allocates offsets/unique for the worst case (n + 1 / n) and keeps G + 1 / G.
#include <algorithm>
#include <numeric>
#include <vector>

#include "advantages/advantages_api.h"

namespace compass {
namespace advantages {

namespace {
template <typename I>
int64_t plan_impl(const I* ids, int64_t n, int64_t* order, int64_t* offsets, int64_t* unique) {
  offsets[0] = 0;
  if (n == 0) return 0;
  // Ids already sorted (the common layout: prompt index repeated per sample):
  // the order is the identity and the groups are the runs; one pass.
  bool sorted = true;
  for (int64_t i = 1; i < n; ++i) sorted &= !(ids[i] < ids[i - 1]);
  if (sorted) {
    int64_t groups = 0;
    for (int64_t i = 0; i < n; ++i) {
      order[i] = i;
      if (i == 0 || ids[i] != ids[i - 1]) {
        if (i > 0) offsets[groups] = i;
        unique[groups++] = static_cast<int64_t>(ids[i]);
      }
    }
    offsets[groups] = n;
    return groups;
  }
  const auto [lo_it, hi_it] = std::minmax_element(ids, ids + n);
  const int64_t lo = static_cast<int64_t>(*lo_it), hi = static_cast<int64_t>(*hi_it);
  // hi - lo in uint64: no signed overflow for ids spanning the whole int64 range.
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  int64_t groups = 0;
  if (span < static_cast<uint64_t>(std::max<int64_t>(4 * n, 65536))) {
    const uint64_t range = span + 1;
    std::vector<int64_t> start(range + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<int64_t>(ids[i]) - lo + 1];
    for (uint64_t k = 0; k < range; ++k) {
      if (start[k + 1] > 0) {
        unique[groups] = lo + static_cast<int64_t>(k);
        offsets[groups + 1] = offsets[groups] + start[k + 1];
        ++groups;
      }
      start[k + 1] += start[k];
    }
    for (int64_t i = 0; i < n; ++i) order[start[static_cast<int64_t>(ids[i]) - lo]++] = i;
    return groups;
  }
  std::iota(order, order + n, int64_t{0});
  std::stable_sort(order, order + n, [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || ids[order[j]] != ids[order[j - 1]]) {
      if (j > 0) offsets[groups] = j;
      unique[groups++] = static_cast<int64_t>(ids[order[j]]);
    }
  }
  offsets[groups] = n;
  return groups;
}
}  // namespace

int64_t group_plan_cpu(TensorView group_ids, TensorView order, TensorView offsets,
                       TensorView unique) {
  COMPASS_NAME_ARGS(group_ids, order, offsets, unique);
  for (const TensorView* t : {&group_ids, &order, &offsets, &unique}) {
    t->expect_vector().expect_device(DeviceType::kCPU);
  }
  const int64_t n = group_ids.numel();
  order.expect_dtype(DType::kInt64).expect_size(0, n, "one per id");
  offsets.expect_dtype(DType::kInt64).expect_size(0, n + 1, "len(group_ids) + 1");
  unique.expect_dtype(DType::kInt64).expect_size(0, n, "len(group_ids)");
  return dispatch(group_ids, Types<int8_t, uint8_t, int16_t, int32_t, int64_t>{}, [&](auto tag) {
    using I = decltype(tag);
    return plan_impl<I>(group_ids.ptr<I>(), n, order.ptr<int64_t>(), offsets.ptr<int64_t>(),
                        unique.ptr<int64_t>());
  });
}

}  // namespace advantages
}  // namespace compass
