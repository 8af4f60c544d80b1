// Internals shared by the emulator's translation units: runtime.cpp
// (scheduling, collectives, launches) and memcheck.cpp (the instrumentation
// hooks: bounds, shared-memory races). Not for kernel code.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "compass_emu/runtime.h"
#include "fiber.h"

namespace compass {
namespace emu {
namespace detail {

constexpr int kMaxThreadsPerBlock = 1024;
constexpr std::size_t kMaxSharedBytes = 227 * 1024;  // H100 per-block opt-in maximum
constexpr std::uint8_t kSharedPoison = 0xff;         // dynamic shared memory: NaN, -1

enum class State { kRunnable, kWarp, kBarrier, kExited, kFailed };

struct Thread {
  Fiber fiber;
  uint3 tid{};
  int linear = 0;
  State state = State::kRunnable;
  // the collective this thread waits at
  WarpOp wop = WarpOp::kSyncWarp;
  BarrierOp bop = BarrierOp::kSync;
  unsigned mask = 0;
  std::uint64_t in = 0, out = 0;
  int arg = 0, width = 32, size = 0;
  const char* file = "";
  int line = 0;
  std::uintptr_t stack_lo = 0;
};

// Per shared-memory byte: who wrote / read it in which barrier interval.
struct Shadow {
  std::uint32_t wepoch = 0, repoch = 0;
  std::int32_t writer = -1, reader = -1;  // reader -2: several threads
  std::uint32_t wgen = 0, rgen = 0;      // the warp's __syncwarp count at the access
  std::int32_t rwarp = -1;               // -2: readers in several warps
};

struct Range {
  std::uintptr_t lo, hi;
  std::string name;
};

struct Launch {
  const char* kernel = "";
  dim3 grid, block;
  uint3 bidx{};
  KernelThunk thunk = nullptr;
  std::uintptr_t params_lo = 0, params_hi = 0;
  int nthreads = 0;
  std::vector<Thread> threads;
  Fiber scheduler;
  // shared memory: [static section][dynamic buffer], one shadow array
  std::uintptr_t static_lo = 0, static_hi = 0, dyn_lo = 0, dyn_hi = 0;
  std::vector<unsigned char> dyn;
  std::vector<Shadow> shadow;
  std::vector<std::uint32_t> warp_gen;
  std::uint32_t block_epoch = 0;
  std::string error;
  ErrorKind error_kind = ErrorKind::kLaunch;
};

extern Launch* g_launch;
extern thread_local Thread* t_current;  // the running CUDA thread, or null in host code
extern std::uint32_t g_epoch;           // barrier intervals, increasing over all launches
extern std::vector<Range> g_device;     // device memory of the current call
extern std::vector<Range> g_image;      // this module's loaded segments
extern std::size_t g_stack_size;
extern std::uintptr_t g_stacks_lo, g_stacks_hi;

std::string short_file(const char* file);
std::string fmt3(uint3 v);
std::string hex(std::uintptr_t v);
// "in kernel K, block (b), thread (t)": the prefix of every report.
std::string context(const Launch& L, const Thread* t);
[[noreturn]] void raise(ErrorKind kind, const std::string& what);
[[noreturn]] void fail_thread(Thread* t, ErrorKind kind, const std::string& what);
[[noreturn]] void out_of_bounds(Thread* t, std::uintptr_t a, std::size_t n, bool write, void* pc);
Thread* current(const char* what);

}  // namespace detail
}  // namespace emu
}  // namespace compass
