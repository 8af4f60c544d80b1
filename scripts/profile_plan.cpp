// Per-phase profile of the packing planner (csrc/packing/plan_cpu.cpp), outside
// Python: thread CPU time per phase (COMPASS_PHASE markers) and counters
// (COMPASS_COUNT: refinement steps, first-fit fallbacks), averaged over calls
// (the counters print as counts per call, not ms).
//
//   python -c "from compass_kernels.packing import reference as ref;
//     ref.lognormal_lengths(65536, 65536 + 256).tofile('/tmp/L.bin')"   (one line)
//   g++ -O3 -std=c++17 -Icsrc/include -Icsrc scripts/profile_plan.cpp -o /tmp/profile_plan
//   /tmp/profile_plan /tmp/L.bin 256 20           # lengths file (int64), dp, calls
//   /tmp/profile_plan /tmp/L.bin 256 20 /tmp/out  # also writes order, offsets
//
// With -DNO_PHASES the markers compile to nothing (the timed total alone).
// The TensorView checks are stubbed: the planner's own checks still run.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

static double now_ms() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

#ifndef NO_PHASES
static std::vector<std::pair<std::string, double>> g_acc;  // phase -> ms, or counter -> count
static double g_last = 0.0;
static void add(const char* name, double v) {
  for (auto& p : g_acc) {
    if (p.first == name) {
      p.second += v;
      return;
    }
  }
  g_acc.emplace_back(name, v);
}
static void phase(const char* name) {  // the time since the previous marker
  add(name, now_ms() - g_last);
  g_last = now_ms();  // the clock read itself is not charged to the next phase
}
#define COMPASS_PHASE(name) phase(name)
#define COMPASS_COUNT(name, v) add(name, static_cast<double>(v))
#endif

#include "compass/tensor_view.h"
namespace compass {
const TensorView& TensorView::expect_ndim(int) const { return *this; }
const TensorView& TensorView::expect_dtype(DType) const { return *this; }
const TensorView& TensorView::expect_contiguous() const { return *this; }
const TensorView& TensorView::expect_size(int, int64_t, const char*) const { return *this; }
const TensorView& TensorView::expect_device(DeviceType) const { return *this; }
std::string TensorView::describe() const { return ""; }
}  // namespace compass

#include "packing/plan_cpu.cpp"

static compass::TensorView view(int64_t* p, int64_t n) {
  compass::TensorView t;
  t.data = p;
  t.ndim = 1;
  t.shape[0] = n;
  t.strides[0] = 1;
  t.dtype = compass::DType::kInt64;
  return t;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s lengths.bin dp calls [out.bin]\n", argv[0]);
    return 2;
  }
  const int64_t dp = std::atoll(argv[2]);
  const int calls = std::atoi(argv[3]);
  std::vector<int64_t> L;
  if (FILE* f = std::fopen(argv[1], "rb")) {
    int64_t x;
    while (std::fread(&x, sizeof x, 1, f) == 1) L.push_back(x);
    std::fclose(f);
  }
  const int64_t n = static_cast<int64_t>(L.size());
  if (n == 0) {
    std::fprintf(stderr, "%s: no int64 lengths read\n", argv[1]);
    return 2;
  }
  std::vector<int64_t> order(n), offsets(n + 1);
  auto run = [&] {
    return compass::packing::plan_cpu(view(L.data(), n), std::nullopt, dp, 65536, 1, false, 1,
                                      1.0, 0.0, -1, view(order.data(), n),
                                      view(offsets.data(), n + 1));
  };
  std::pair<int64_t, double> r = run();  // warm: the per-thread workspace is sized
#ifndef NO_PHASES
  g_acc.clear();
#endif
  const double t0 = now_ms();
  for (int i = 0; i < calls; ++i) {
#ifndef NO_PHASES
    g_last = now_ms();
#endif
    r = run();
  }
  const double total = (now_ms() - t0) / calls;
  std::printf("n=%lld dp=%lld: %.3f ms per call (M=%lld)\n", static_cast<long long>(n),
              static_cast<long long>(dp), total, static_cast<long long>(r.first));
#ifndef NO_PHASES
  for (const auto& p : g_acc) std::printf("  %-14s %9.3f\n", p.first.c_str(), p.second / calls);
#endif
  if (argc > 4) {
    if (FILE* f = std::fopen(argv[4], "wb")) {
      std::fwrite(order.data(), sizeof(int64_t), n, f);
      std::fwrite(offsets.data(), sizeof(int64_t), r.first * dp + 1, f);
      std::fclose(f);
    }
  }
  return 0;
}
