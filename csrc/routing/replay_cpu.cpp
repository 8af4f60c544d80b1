// Router replay on the CPU: one pass per row (OpenMP over rows past a size
// threshold), the math of compass/routing.h.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "compass/routing.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {

namespace {
// Below this many logits the kernels run on the calling thread: waking the
// OpenMP team costs more than the work (advantages measured 6-8 ms team
// wake-ups on a loaded 2-core host).
constexpr int64_t kParallelMinElements = int64_t{1} << 18;
constexpr int64_t kMaxTopK = 64;
using Real = Types<float, double>;
using Ids = Types<uint8_t, int16_t, int32_t, int64_t>;
}  // namespace

void check_replay_topk_args(COMPASS_REPLAY_TOPK_ARGS) {
  logits.expect_ndim(2).expect_contiguous();
  dispatch(logits, Real{}, [](auto) {});
  const int64_t t = logits.size(0), e = logits.size(1);
  expert_ids.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  dispatch(expert_ids, Ids{}, [](auto) {});
  expert_ids.expect_size(0, t, "one row per logits row");
  const int64_t k = expert_ids.size(1);
  COMPASS_CHECK(k >= 1 && k <= e && k <= kMaxTopK, expert_ids.name, ": top_k = ", k,
                " must be in [1, min(num_experts = ", e, ", ", kMaxTopK, ")]");
  if (expert_bias) {
    expert_bias->expect_vector().expect_same_device(logits).expect_dtype(logits.dtype);
    expert_bias->expect_size(0, e, "num_experts");
  }
  if (valid) {
    valid->expect_vector().expect_same_device(logits).expect_dtype(DType::kBool);
    valid->expect_size(0, t, "one flag per logits row");
  }
  COMPASS_CHECK(score_function == kSoftmax || score_function == kSigmoid,
                "score_function: expected 0 (softmax) or 1 (sigmoid), got ", score_function);
  COMPASS_CHECK(std::isfinite(scaling), "scaling: expected a finite value, got ", scaling);
  weights.expect_ndim(2).expect_contiguous().expect_same_device(logits).expect_dtype(logits.dtype);
  weights.expect_size(0, t, "rows").expect_size(1, k, "top_k");
  routing_map.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  routing_map.expect_dtype(DType::kBool).expect_size(0, t, "rows").expect_size(1, e, "experts");
  tokens_per_expert.expect_vector().expect_same_device(logits).expect_dtype(DType::kInt64);
  tokens_per_expert.expect_size(0, e, "num_experts");
  counts.expect_vector().expect_same_device(logits).expect_dtype(DType::kInt64);
  counts.expect_size(0, kNumCounts, "the 6 replay counters");
  ids_used.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  ids_used.expect_dtype(DType::kInt64).expect_size(0, t, "rows").expect_size(1, k, "top_k");
}

void check_replay_topk_backward_args(COMPASS_REPLAY_TOPK_BACKWARD_ARGS) {
  logits.expect_ndim(2).expect_contiguous();
  dispatch(logits, Real{}, [](auto) {});
  const int64_t t = logits.size(0), e = logits.size(1);
  ids_used.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  ids_used.expect_dtype(DType::kInt64).expect_size(0, t, "one row per logits row");
  const int64_t k = ids_used.size(1);
  COMPASS_CHECK(k >= 1 && k <= e && k <= kMaxTopK, ids_used.name, ": top_k = ", k,
                " must be in [1, min(num_experts = ", e, ", ", kMaxTopK, ")]");
  grad_weights.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  grad_weights.expect_dtype(logits.dtype).expect_size(0, t, "rows").expect_size(1, k, "top_k");
  grad_logits.expect_ndim(2).expect_contiguous().expect_same_device(logits);
  grad_logits.expect_dtype(logits.dtype).expect_size(0, t, "rows").expect_size(1, e, "experts");
  COMPASS_CHECK(score_function == kSoftmax || score_function == kSigmoid,
                "score_function: expected 0 (softmax) or 1 (sigmoid), got ", score_function);
  COMPASS_CHECK(std::isfinite(scaling), "scaling: expected a finite value, got ", scaling);
}

namespace {

struct RowCounts {
  int64_t c[kNumCounts] = {};
};

// Rows [r0, r1) of the forward; tpe: this thread's [E] counts.
template <typename R, typename I>
void forward_rows(const R* z_all, const I* rid_all, const R* bias, const bool* valid, int64_t e,
                  int64_t k, int32_t sf, bool normalize, double scaling, double ratio, R* w_all,
                  bool* map_all, int64_t* used_all, int64_t r0, int64_t r1, int64_t* tpe,
                  RowCounts& cnt) {
  using A = R;  // float32 in float32 (as on the GPU), float64 in float64
  int64_t nat[kMaxTopK], rep[kMaxTopK], use_ids[kMaxTopK];
  A num[kMaxTopK];
  for (int64_t t = r0; t < r1; ++t) {
    const R* z = z_all + t * e;
    A zmax = -std::numeric_limits<A>::infinity();
    for (int64_t j = 0; j < e; ++j) zmax = std::max(zmax, static_cast<A>(z[j]));
    A sumexp = 0;
    if (sf == kSoftmax) {
      for (int64_t j = 0; j < e; ++j) sumexp += rexp(static_cast<A>(z[j]) - zmax);
    }
    const A inv_sum = sf == kSoftmax ? A(1) / sumexp : A(1);
    // Native top-k in one pass: a descending buffer of the K best (value,
    // index); j only grows, so a tie never displaces an earlier (lower) index:
    // the same order as K argmax rounds with ties to the lower index.
    A topv[kMaxTopK];
    int64_t filled = 0;
    for (int64_t j = 0; j < e; ++j) {
      const A v = router_score<A>(z[j], zmax, inv_sum, sf) + (bias ? static_cast<A>(bias[j]) : A(0));
      if (filled == k && !(v > topv[k - 1])) continue;
      int64_t p = filled < k ? filled++ : k - 1;
      while (p > 0 && v > topv[p - 1]) {
        topv[p] = topv[p - 1];
        nat[p] = nat[p - 1];
        --p;
      }
      topv[p] = v;
      nat[p] = j;
    }
    cnt.c[kRows] += 1;
    bool use = false;
    const bool cand = valid == nullptr || valid[t];
    if (cand) {
      // The entry point checked ids (range, duplicates) before the parallel region.
      for (int64_t r = 0; r < k; ++r) rep[r] = static_cast<int64_t>(rid_all[t * k + r]);
      int64_t overlap = 0;
      for (int64_t r = 0; r < k; ++r) {
        for (int64_t q = 0; q < k; ++q) overlap += rep[r] == nat[q];
      }
      A weak_r = std::numeric_limits<A>::infinity(), weak_n = weak_r;
      for (int64_t r = 0; r < k; ++r) {
        weak_r = std::min(weak_r, router_score<A>(z[rep[r]], zmax, inv_sum, sf));
        weak_n = std::min(weak_n, router_score<A>(z[nat[r]], zmax, inv_sum, sf));
      }
      use = replay_accepted<A>(weak_r, weak_n, ratio);
      cnt.c[kCandidates] += 1;
      cnt.c[kOverlap] += overlap;
      cnt.c[kExact] += overlap == k;
      cnt.c[kRejected] += !use;
    }
    for (int64_t r = 0; r < k; ++r) use_ids[r] = use ? rep[r] : nat[r];
    A shift = zmax;
    if (sf == kSoftmax && normalize) {
      shift = -std::numeric_limits<A>::infinity();
      for (int64_t r = 0; r < k; ++r) shift = std::max(shift, static_cast<A>(z[use_ids[r]]));
    }
    A sum = 0;
    for (int64_t r = 0; r < k; ++r) {
      num[r] = gate_numerator<A>(z[use_ids[r]], shift, sf);
      sum += num[r];
    }
    const A den = gate_denominator<A>(sum, sumexp, sf, normalize, k);
    R* w = w_all + t * k;
    int64_t* used = used_all + t * k;
    bool* map = map_all + t * e;
    std::fill(map, map + e, false);
    for (int64_t r = 0; r < k; ++r) {
      w[r] = static_cast<R>(num[r] / den * static_cast<A>(scaling));
      used[r] = use_ids[r];
      map[use_ids[r]] = true;
      tpe[use_ids[r]] += 1;
    }
  }
}

// Data checks for free on the CPU: ids of valid rows in range and distinct.
template <typename I>
void check_ids(const TensorView& ids_view, const bool* valid, int64_t t, int64_t e, int64_t k) {
  const I* ids = ids_view.ptr<I>();
  for (int64_t i = 0; i < t; ++i) {
    if (valid && !valid[i]) continue;
    const I* row = ids + i * k;
    for (int64_t r = 0; r < k; ++r) {
      const int64_t v = static_cast<int64_t>(row[r]);
      COMPASS_CHECK(v >= 0 && v < e, ids_view.name, ": expert id ", v, " out of range [0, ", e,
                    ") at row ", i, ", slot ", r);
      for (int64_t q = 0; q < r; ++q) {
        COMPASS_CHECK(static_cast<int64_t>(row[q]) != v, ids_view.name, ": expert ", v,
                      " twice in row ", i, " (slots ", q, " and ", r, ")");
      }
    }
  }
}

}  // namespace

void replay_topk_cpu(COMPASS_REPLAY_TOPK_ARGS) {
  COMPASS_NAME_ARGS(logits, expert_ids, expert_bias, valid, weights, routing_map,
                    tokens_per_expert, counts, ids_used);
  check_replay_topk_args(logits, expert_ids, expert_bias, valid, score_function, normalize,
                         scaling, min_score_ratio, weights, routing_map, tokens_per_expert,
                         counts, ids_used);
  logits.expect_device(DeviceType::kCPU);
  const int64_t t = logits.size(0), e = logits.size(1), k = expert_ids.size(1);
  const bool* vptr = valid ? valid->ptr<bool>() : nullptr;
  dispatch(expert_ids, Ids{}, [&](auto itag) {
    using I = decltype(itag);
    check_ids<I>(expert_ids, vptr, t, e, k);
  });
  int64_t* tpe = tokens_per_expert.ptr<int64_t>();
  int64_t* cnt = counts.ptr<int64_t>();
  std::fill(tpe, tpe + e, int64_t{0});
  std::fill(cnt, cnt + kNumCounts, int64_t{0});
  const int32_t sf = static_cast<int32_t>(score_function);
  dispatch(logits, Real{}, [&](auto rtag) {
    using R = decltype(rtag);
    const R* bias = expert_bias ? expert_bias->ptr<R>() : nullptr;
    dispatch(expert_ids, Ids{}, [&](auto itag) {
      using I = decltype(itag);
      auto run = [&](int64_t r0, int64_t r1, int64_t* my_tpe, RowCounts& my_cnt) {
        forward_rows<R, I>(logits.ptr<R>(), expert_ids.ptr<I>(), bias, vptr, e, k, sf,
                           normalize, scaling, min_score_ratio, weights.ptr<R>(),
                           routing_map.ptr<bool>(), ids_used.ptr<int64_t>(), r0, r1, my_tpe,
                           my_cnt);
      };
      if (t * e < kParallelMinElements || omp_get_max_threads() == 1) {
        RowCounts c;
        run(0, t, tpe, c);
        for (int i = 0; i < kNumCounts; ++i) cnt[i] = c.c[i];
        return;
      }
#pragma omp parallel
      {
        const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
        std::vector<int64_t> my_tpe(static_cast<size_t>(e), 0);
        RowCounts c;
        run(t * me / nt, t * (me + 1) / nt, my_tpe.data(), c);
#pragma omp critical(compass_routing_merge)
        {
          for (int64_t j = 0; j < e; ++j) tpe[j] += my_tpe[j];
          for (int i = 0; i < kNumCounts; ++i) cnt[i] += c.c[i];
        }
      }
    });
  });
}

namespace {

template <typename R>
void backward_rows(const R* g_all, const R* z_all, const int64_t* used_all, int64_t e, int64_t k,
                   int32_t sf, bool normalize, double scaling, R* out_all, int64_t r0,
                   int64_t r1) {
  using A = R;
  A num[kMaxTopK];
  const A sc = static_cast<A>(scaling);
  const bool dense = dense_gradient(sf, normalize);
  for (int64_t t = r0; t < r1; ++t) {
    const R* z = z_all + t * e;
    const R* g = g_all + t * k;
    const int64_t* u = used_all + t * k;
    R* out = out_all + t * e;
    A zmax = -std::numeric_limits<A>::infinity(), sumexp = 0;
    if (dense) {
      for (int64_t j = 0; j < e; ++j) zmax = std::max(zmax, static_cast<A>(z[j]));
      for (int64_t j = 0; j < e; ++j) sumexp += rexp(static_cast<A>(z[j]) - zmax);
    }
    A shift = zmax;
    if (sf == kSoftmax && normalize) {
      shift = -std::numeric_limits<A>::infinity();
      for (int64_t r = 0; r < k; ++r) shift = std::max(shift, static_cast<A>(z[u[r]]));
    }
    A sum = 0;
    for (int64_t r = 0; r < k; ++r) {
      num[r] = gate_numerator<A>(z[u[r]], shift, sf);
      sum += num[r];
    }
    const A den = gate_denominator<A>(sum, sumexp, sf, normalize, k);
    A dot = 0;
    for (int64_t r = 0; r < k; ++r) dot += static_cast<A>(g[r]) * (num[r] / den);
    if (dense) {
      const A inv = A(1) / sumexp;
      for (int64_t j = 0; j < e; ++j) {
        out[j] = static_cast<R>(-rexp(static_cast<A>(z[j]) - zmax) * inv * dot * sc);
      }
    } else {
      std::fill(out, out + e, R(0));
    }
    for (int64_t r = 0; r < k; ++r) {
      const A gu = grad_used<A>(static_cast<A>(g[r]), num[r] / den, dot, num[r], den, sf,
                                normalize, k);
      out[u[r]] = static_cast<R>(gu * sc);
    }
  }
}

}  // namespace

void replay_topk_backward_cpu(COMPASS_REPLAY_TOPK_BACKWARD_ARGS) {
  COMPASS_NAME_ARGS(grad_weights, logits, ids_used, grad_logits);
  check_replay_topk_backward_args(grad_weights, logits, ids_used, score_function, normalize,
                                  scaling, grad_logits);
  logits.expect_device(DeviceType::kCPU);
  const int64_t t = logits.size(0), e = logits.size(1), k = ids_used.size(1);
  const int64_t* u = ids_used.ptr<int64_t>();
  for (int64_t i = 0; i < t * k; ++i) {
    COMPASS_CHECK(u[i] >= 0 && u[i] < e, ids_used.name, ": expert id ", u[i],
                  " out of range [0, ", e, ") at row ", i / k);
  }
  const int32_t sf = static_cast<int32_t>(score_function);
  dispatch(logits, Real{}, [&](auto rtag) {
    using R = decltype(rtag);
    auto run = [&](int64_t r0, int64_t r1) {
      backward_rows<R>(grad_weights.ptr<R>(), logits.ptr<R>(), u, e, k, sf, normalize, scaling,
                       grad_logits.ptr<R>(), r0, r1);
    };
    if (t * e < kParallelMinElements || omp_get_max_threads() == 1) return run(0, t);
#pragma omp parallel
    {
      const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
      run(t * me / nt, t * (me + 1) / nt);
    }
  });
}

}  // namespace routing
}  // namespace compass
