// Token log-probs and entropy on the CPU: one pass over each row's vocab in
// L1-sized tiles (float32 online log-sum-exp, compass/logprobs.h), OpenMP
// over tokens. The hot loops are compiled twice, for the x86-64 baseline and
// for AVX2+FMA, and picked once at run time (a wheel must run on any x86-64;
// -march=native would not).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "logprobs/logprobs_api.h"

namespace compass {
namespace logprobs {

namespace {

// Below this many logits the kernels run on the calling thread: waking the
// OpenMP team costs more than the work on a loaded 2-core host.
constexpr int64_t kParallelMinElements = int64_t{1} << 16;
// Floats per tile: scaled once into a stack buffer, read by the max pass and
// again by the exp pass while still in L1 (2 KiB), so DRAM sees each logit once.
constexpr int64_t kTile = 512;

inline float widen(float v) { return v; }
inline float widen(bf16 v) {
  const uint32_t b = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline void narrow(float* p, float v) { *p = v; }
inline void narrow(bf16* p, float v) {  // round to nearest even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  const uint32_t r = (v != v) ? (b | 0x00400000u) : b + 0x7FFFu + ((b >> 16) & 1u);
  p->bits = static_cast<uint16_t>(r >> 16);
}

// One row's state after its raw logits [0, n) (temperature inv_t). kCheck counts
// NaN / +inf logits into *bad (a -inf logit is a masked token, allowed).
template <typename In, bool kEnt, bool kCheck>
__attribute__((always_inline)) inline RowState row_stats(const In* x, int64_t n, float inv_t,
                                                         RowState st, int64_t* bad) {
  alignas(64) float buf[kTile];
  int64_t nbad = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t len = std::min(kTile, n - j0);
    float tmax = -INFINITY;
#pragma omp simd reduction(max : tmax) reduction(+ : nbad)
    for (int64_t j = 0; j < len; ++j) {
      const float v = widen(x[j0 + j]);
      buf[j] = v;
      tmax = v > tmax ? v : tmax;
      if (kCheck) nbad += !(v <= 3.4e38f);  // NaN or +inf
    }
    const float m_new = tmax > st.m ? tmax : st.m;
    if (m_new == -INFINITY) continue;  // only -inf so far: contributes nothing
    rescale(st, m_new, inv_t);
    const float m = st.m;
    float s = 0.0f, a = 0.0f;
#pragma omp simd reduction(+ : s, a)
    for (int64_t j = 0; j < len; ++j) {
      float d = (buf[j] - m) * inv_t;
      d = d < kMinExponent ? kMinExponent : d;
      const float e = fast_exp(d);
      s += e;
      if (kEnt) a += e * d;
    }
    st.s += s;
    st.a += a;
  }
  if (kCheck) *bad += nbad;
  return st;
}

// Gradient of one row tile [0, n) (columns vocab_start + j); out may alias x.
template <typename In, bool kGl, bool kGh>
__attribute__((always_inline)) inline void row_grad(const In* x, In* out, int64_t n, int64_t y,
                                                    float inv_t, float m, float log_s, float h,
                                                    float gl, float gh) {
  // The target's entry first (out may alias x): g_l (1 - p_y) with
  // 1 - p_y = -expm1(log p_y), exact for confident tokens where 1 - p_y in
  // float32 would round to 0.
  float gy = 0.0f;
  const bool has_y = y >= 0 && y < n;
  if (has_y) {
    const float d = log_softmax_of(widen(x[y]), m, log_s, inv_t);
    const float p = std::exp(d);
    gy = (kGl ? -gl * std::expm1(d) : 0.0f) - (kGh ? gh * p * (d + h) : 0.0f);
  }
  const float gl_ = kGl ? gl : 0.0f;
  const float gh_ = kGh ? gh : 0.0f;
  // Through an L1 buffer, like the forward: the arithmetic loop then has no
  // possible aliasing and no conversion (it did not vectorize reading x and
  // writing out directly).
  alignas(64) float buf[kTile];
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t len = std::min(kTile, n - j0);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) buf[j] = widen(x[j0 + j]);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float d = log_softmax_of(buf[j], m, log_s, inv_t);
      const float p = fast_exp(d);
      buf[j] = grad_nontarget(d, p, gl_, gh_, h) * inv_t;
    }
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) narrow(out + j0 + j, buf[j]);
  }
  if (has_y) narrow(out + y, gy * inv_t);
}

struct FwdPtrs {
  const void* logits;
  int64_t row_stride, rows, vocab;
  const int64_t* targets;
  float inv_t;
  float *logp, *entropy, *row_max, *log_norm;
};

template <typename In, bool kEnt>
__attribute__((always_inline)) inline void fwd_rows(const FwdPtrs& p, int64_t r0, int64_t r1,
                                                    int64_t* bad) {
  const In* base = static_cast<const In*>(p.logits);
  for (int64_t t = r0; t < r1; ++t) {
    const In* x = base + t * p.row_stride;
    const RowState st = row_stats<In, kEnt, true>(x, p.vocab, p.inv_t, RowState{}, bad);
    p.row_max[t] = st.m;
    p.log_norm[t] = std::log(st.s);
    const int64_t y = p.targets[t];  // checked: in [0, V) or kIgnoreIndex
    p.logp[t] = y == kIgnoreIndex ? 0.0f : logprob_of(widen(x[y]), st, p.inv_t);
    p.entropy[t] = kEnt ? entropy_of(st) : NAN;
  }
}

struct TilePtrs {
  const void* logits;
  int64_t row_stride, rows, vocab, vocab_start;
  const int64_t* targets;
  float inv_t;
  const float* in;  // [4, rows]
  float* out;
};

template <typename In, bool kEnt>
__attribute__((always_inline)) inline void tile_rows(const TilePtrs& p, int64_t r0, int64_t r1) {
  const In* base = static_cast<const In*>(p.logits);
  const int64_t R = p.rows;
  for (int64_t t = r0; t < r1; ++t) {
    const In* x = base + t * p.row_stride;
    RowState st{p.in[t], p.in[R + t], p.in[2 * R + t]};
    float xt = p.in[3 * R + t];
    const int64_t y = p.targets[t] - p.vocab_start;
    if (y >= 0 && y < p.vocab) xt = widen(x[y]);
    st = row_stats<In, kEnt, false>(x, p.vocab, p.inv_t, st, nullptr);
    p.out[t] = st.m;
    p.out[R + t] = st.s;
    p.out[2 * R + t] = st.a;
    p.out[3 * R + t] = xt;
  }
}

struct BwdPtrs {
  const void* logits;
  void* grad;
  int64_t row_stride, grad_stride, rows, vocab, vocab_start;
  const int64_t* targets;
  const float *row_max, *log_norm, *entropy, *gl, *gh;
  float inv_t;
};

template <typename In, bool kGl, bool kGh>
__attribute__((always_inline)) inline void bwd_rows(const BwdPtrs& p, int64_t r0, int64_t r1) {
  const In* base = static_cast<const In*>(p.logits);
  In* gbase = static_cast<In*>(p.grad);
  for (int64_t t = r0; t < r1; ++t) {
    row_grad<In, kGl, kGh>(base + t * p.row_stride, gbase + t * p.grad_stride, p.vocab,
                           p.targets[t] - p.vocab_start, p.inv_t, p.row_max[t], p.log_norm[t],
                           kGh ? p.entropy[t] : 0.0f,
                           (kGl && p.targets[t] != kIgnoreIndex) ? p.gl[t] : 0.0f,
                           kGh ? p.gh[t] : 0.0f);
  }
}

// The same row loops for the baseline ISA and for AVX2+FMA (fast_exp and the
// reductions vectorize 8 wide instead of 4: measured ~1.8x on the forward).
#define COMPASS_LP_ISA(suffix, attr)                                                        \
  template <typename In, bool kEnt>                                                         \
  attr void fwd_rows_##suffix(const FwdPtrs& p, int64_t r0, int64_t r1, int64_t* bad) {     \
    fwd_rows<In, kEnt>(p, r0, r1, bad);                                                     \
  }                                                                                         \
  template <typename In, bool kEnt>                                                         \
  attr void tile_rows_##suffix(const TilePtrs& p, int64_t r0, int64_t r1) {                 \
    tile_rows<In, kEnt>(p, r0, r1);                                                         \
  }                                                                                         \
  template <typename In, bool kGl, bool kGh>                                                \
  attr void bwd_rows_##suffix(const BwdPtrs& p, int64_t r0, int64_t r1) {                   \
    bwd_rows<In, kGl, kGh>(p, r0, r1);                                                      \
  }
COMPASS_LP_ISA(base, )
COMPASS_LP_ISA(avx2, __attribute__((target("avx2,fma"))))
#undef COMPASS_LP_ISA

bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// Runs body(r0, r1) over [0, rows) on the OpenMP team when the work is large.
template <typename F>
void for_rows(int64_t rows, int64_t vocab, F&& body) {
  if (rows * vocab < kParallelMinElements || rows < 2 || omp_get_max_threads() == 1) {
    body(int64_t{0}, rows);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    body(rows * t / nt, rows * (t + 1) / nt);
  }
}

using Logits = Types<float, bf16>;

void check_logits(const TensorView& logits) {
  logits.expect_ndim(2);
  dispatch(logits, Logits{}, [](auto) {});
  COMPASS_CHECK(logits.size(1) <= 1 || logits.strides[1] == 1, logits.name,
                ": expected a contiguous vocab dimension (stride 1), got strides [",
                logits.strides[0], ", ", logits.strides[1], "]");
}

void check_row_vector(const TensorView& v, const TensorView& like, int64_t rows, DType dtype) {
  v.expect_vector().expect_same_device(like).expect_dtype(dtype);
  v.expect_size(0, rows, "one per token = logits.shape[0]");
}

float inv_temperature(double temperature) {
  COMPASS_CHECK(std::isfinite(temperature) && temperature > 0.0,
                "temperature: expected a finite value > 0, got ", temperature);
  return static_cast<float>(1.0 / temperature);
}

}  // namespace

void check_fwd_args(COMPASS_LOGPROBS_FWD_ARGS) {
  check_logits(logits);
  const int64_t rows = logits.size(0);
  check_row_vector(targets, logits, rows, DType::kInt64);
  for (const TensorView* o : {&logp, &entropy, &row_max, &log_norm}) {
    check_row_vector(*o, logits, rows, DType::kFloat32);
  }
  COMPASS_CHECK(rows == 0 || logits.size(1) > 0, "logits: expected a vocabulary of at least 1, got ",
                logits.describe());
  inv_temperature(temperature);
}

void check_bwd_args(COMPASS_LOGPROBS_BWD_ARGS) {
  check_logits(logits);
  const int64_t rows = logits.size(0);
  check_row_vector(targets, logits, rows, DType::kInt64);
  check_row_vector(row_max, logits, rows, DType::kFloat32);
  check_row_vector(log_norm, logits, rows, DType::kFloat32);
  check_row_vector(entropy, logits, rows, DType::kFloat32);
  if (grad_logprob) check_row_vector(*grad_logprob, logits, rows, DType::kFloat32);
  if (grad_entropy) check_row_vector(*grad_entropy, logits, rows, DType::kFloat32);
  grad_logits.expect_ndim(2).expect_same_device(logits).expect_dtype(logits.dtype);
  grad_logits.expect_size(0, rows, "logits").expect_size(1, logits.size(1), "logits");
  COMPASS_CHECK(logits.size(1) <= 1 || grad_logits.strides[1] == 1,
                "grad_logits: expected a contiguous vocab dimension (stride 1)");
  COMPASS_CHECK(vocab_start >= 0, "vocab_start: expected >= 0, got ", vocab_start);
  inv_temperature(temperature);
}

void check_tile_args(COMPASS_LOGPROBS_TILE_ARGS) {
  check_logits(logits);
  const int64_t rows = logits.size(0);
  check_row_vector(targets, logits, rows, DType::kInt64);
  for (const TensorView* s : {&state_in, &state_out}) {
    s->expect_ndim(2).expect_contiguous().expect_same_device(logits).expect_dtype(DType::kFloat32);
    s->expect_size(0, 4, "(m, s, a, x_target)").expect_size(1, rows, "one per token");
  }
  COMPASS_CHECK(vocab_start >= 0, "vocab_start: expected >= 0, got ", vocab_start);
  inv_temperature(temperature);
}

void token_logprobs_entropy_cpu(COMPASS_LOGPROBS_FWD_ARGS) {
  COMPASS_NAME_ARGS(logits, targets, logp, entropy, row_max, log_norm);
  check_fwd_args(logits, targets, temperature, with_entropy, logp, entropy, row_max, log_norm);
  logits.expect_device(DeviceType::kCPU);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t* y = targets.ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    COMPASS_CHECK((y[t] >= 0 && y[t] < vocab) || y[t] == kIgnoreIndex,
                  "targets: expected token ids in [0, ", vocab,
                  ") (the vocabulary of logits) or the ignore index ", kIgnoreIndex,
                  ", got targets[", t, "] = ", y[t]);
  }
  const FwdPtrs p{logits.data, logits.strides[0], rows, vocab, y,
                  inv_temperature(temperature), logp.ptr<float>(), entropy.ptr<float>(),
                  row_max.ptr<float>(), log_norm.ptr<float>()};
  int64_t bad = 0;
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    const bool avx2 = use_avx2();
    auto run = [&](auto ent) {
      constexpr bool kEnt = decltype(ent)::value;
      for_rows(rows, vocab, [&](int64_t r0, int64_t r1) {
        int64_t local = 0;
        avx2 ? fwd_rows_avx2<In, kEnt>(p, r0, r1, &local) : fwd_rows_base<In, kEnt>(p, r0, r1, &local);
#pragma omp atomic
        bad += local;
      });
    };
    with_entropy ? run(std::true_type{}) : run(std::false_type{});
  });
  if (bad == 0) {
    // A row of only -inf logits has no distribution (s == 0): refuse it.
    const float* m = row_max.ptr<float>();
    for (int64_t t = 0; t < rows; ++t) {
      COMPASS_CHECK(m[t] != -INFINITY, "logits: row ", t,
                    " has every logit -inf (no distribution to take a log-prob of)");
    }
    return;
  }
  dispatch(logits, Logits{}, [&](auto tag) {  // find the first NaN / +inf for the message
    using In = decltype(tag);
    const In* base = logits.ptr<In>();
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t j = 0; j < vocab; ++j) {
        const float v = widen(base[t * logits.strides[0] + j]);
        COMPASS_CHECK(v <= 3.4e38f, "logits: expected finite or -inf values, got ", v,
                      " at [", t, ", ", j, "] (", bad, " NaN / +inf in all)");
      }
    }
  });
}

void logprobs_tile_stats_cpu(COMPASS_LOGPROBS_TILE_ARGS) {
  COMPASS_NAME_ARGS(logits, targets, state_in, state_out);
  check_tile_args(logits, targets, vocab_start, temperature, with_entropy, state_in, state_out);
  logits.expect_device(DeviceType::kCPU);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const TilePtrs p{logits.data, logits.strides[0], rows, vocab, vocab_start,
                   targets.ptr<int64_t>(), inv_temperature(temperature),
                   state_in.ptr<float>(), state_out.ptr<float>()};
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    const bool avx2 = use_avx2();
    auto run = [&](auto ent) {
      constexpr bool kEnt = decltype(ent)::value;
      for_rows(rows, vocab, [&](int64_t r0, int64_t r1) {
        avx2 ? tile_rows_avx2<In, kEnt>(p, r0, r1) : tile_rows_base<In, kEnt>(p, r0, r1);
      });
    };
    with_entropy ? run(std::true_type{}) : run(std::false_type{});
  });
}

void token_logprobs_entropy_bwd_cpu(COMPASS_LOGPROBS_BWD_ARGS) {
  COMPASS_NAME_ARGS(logits, targets, row_max, log_norm, entropy, grad_logprob, grad_entropy,
                    grad_logits);
  check_bwd_args(logits, targets, row_max, log_norm, entropy, grad_logprob, grad_entropy,
                 temperature, vocab_start, grad_logits);
  logits.expect_device(DeviceType::kCPU);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const BwdPtrs p{logits.data, grad_logits.data, logits.strides[0], grad_logits.strides[0],
                  rows, vocab, vocab_start, targets.ptr<int64_t>(), row_max.ptr<float>(),
                  log_norm.ptr<float>(), entropy.ptr<float>(), grad_logprob ? grad_logprob->ptr<float>() : nullptr,
                  grad_entropy ? grad_entropy->ptr<float>() : nullptr,
                  inv_temperature(temperature)};
  dispatch(logits, Logits{}, [&](auto tag) {
    using In = decltype(tag);
    const bool avx2 = use_avx2();
    auto run = [&](auto gl, auto gh) {
      constexpr bool kGl = decltype(gl)::value, kGh = decltype(gh)::value;
      for_rows(rows, vocab, [&](int64_t r0, int64_t r1) {
        avx2 ? bwd_rows_avx2<In, kGl, kGh>(p, r0, r1) : bwd_rows_base<In, kGl, kGh>(p, r0, r1);
      });
    };
    const bool gl = grad_logprob.has_value(), gh = grad_entropy.has_value();
    if (gl && gh) run(std::true_type{}, std::true_type{});
    else if (gl) run(std::true_type{}, std::false_type{});
    else if (gh) run(std::false_type{}, std::true_type{});
    else run(std::false_type{}, std::false_type{});
  });
}

}  // namespace logprobs
}  // namespace compass
