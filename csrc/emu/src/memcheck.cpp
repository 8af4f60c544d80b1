// Memory checks of the emulator: every load and store of kernel code calls a
// hook here (GCC's call-based -fsanitize=kernel-address instrumentation,
// cmake/emu.cmake). This file is not instrumented. See runtime.cpp's header.
#include <dlfcn.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "internal.h"

namespace compass {
namespace emu {
namespace detail {

// ------------------------------------------------------------ memory checks
const Range* nearest_device_range(std::uintptr_t a) {
  const Range* best = nullptr;
  std::uintptr_t best_d = ~std::uintptr_t{0};
  for (const Range& r : g_device) {
    const std::uintptr_t d = a < r.lo ? r.lo - a : (a >= r.hi ? a - r.hi + 1 : 0);
    if (d < best_d) best_d = d, best = &r;
  }
  return best;
}

std::string code_location(void* pc) {
  Dl_info info;
  if (pc && dladdr(pc, &info) && info.dli_fname) {
    return std::string(" [code: ") + info.dli_fname + "+" +
           hex(reinterpret_cast<std::uintptr_t>(pc) -
               reinterpret_cast<std::uintptr_t>(info.dli_fbase)) +
           "]";
  }
  return "";
}

[[noreturn]] void out_of_bounds(Thread* t, std::uintptr_t a, std::size_t n, bool write,
                                void* pc) {
  const Launch& L = *g_launch;
  std::string what = std::string("out-of-bounds global ") + (write ? "write" : "read") + " of " +
                     std::to_string(n) + " bytes at " + hex(a) + " " + context(L, t);
  if (a >= g_stacks_lo && a < g_stacks_hi) {
    what += ": it is another CUDA thread's local memory";
  } else if (const Range* r = nearest_device_range(a)) {
    const auto offset = static_cast<long long>(a - r->lo);  // wraps to negative below lo
    what += ": byte offset " + std::to_string(offset) + " of " + r->name + ", " +
            std::to_string(r->hi - r->lo) + " bytes at " + hex(r->lo) +
            (a < r->lo ? ", before its start" : a >= r->hi ? ", past its end" : ", across its end");
  } else {
    what += ": no device memory is registered for this call";
  }
  fail_thread(t, ErrorKind::kOutOfBounds, what + code_location(pc));
}

void shared_access(Thread* t, std::size_t offset, std::size_t n, bool write, void* pc,
                   std::uintptr_t addr) {
  Launch& L = *g_launch;
  const int me = t->linear, warp = me / 32;
  const std::uint32_t E = g_epoch, gen = L.warp_gen[warp];
  const bool in_dyn = addr >= L.dyn_lo && addr < L.dyn_hi;
  const std::string region =
      std::string(in_dyn ? "dynamic" : "static") + " shared memory offset " +
      std::to_string(in_dyn ? addr - L.dyn_lo : addr - L.static_lo) + " (" + hex(addr) + ")";
  auto other = [&](int linear) {
    return linear == -2 ? std::string("several threads")
                        : "thread " + fmt3(L.threads[linear].tid);
  };
  auto synced = [&](int other_linear, std::uint32_t other_gen) {  // __syncwarp in between
    return other_linear >= 0 && other_linear / 32 == warp && other_gen < gen;
  };
  bool any_written = false;
  for (std::size_t i = 0; i < n; ++i) {
    const Shadow& s = L.shadow[offset + i];
    any_written = any_written || s.wepoch >= L.block_epoch;
  }
  if (!write && !any_written) {
    fail_thread(t, ErrorKind::kUninitializedShared,
                "read of " + std::to_string(n) + " bytes of " + region +
                    " that no thread of the block wrote " + context(L, t) + code_location(pc));
  }
  for (std::size_t i = 0; i < n; ++i) {
    Shadow& s = L.shadow[offset + i];
    if (s.wepoch == E && s.writer != me && !synced(s.writer, s.wgen)) {
      fail_thread(t, ErrorKind::kSharedRace,
                  std::string("shared-memory race: ") + (write ? "write" : "read") + " of " +
                      std::to_string(n) + " bytes of " + region + " " + context(L, t) +
                      ", which " + other(s.writer) +
                      " wrote since the last barrier (a __syncthreads() is missing between them)" +
                      code_location(pc));
    }
    // A reader list of one warp is ordered before this write by a later __syncwarp.
    if (write && s.repoch == E && s.reader != me && !(s.rwarp == warp && s.rgen < gen)) {
      fail_thread(t, ErrorKind::kSharedRace,
                  "shared-memory race: write of " + std::to_string(n) + " bytes of " + region +
                      " " + context(L, t) + ", which " + other(s.reader) +
                      " read since the last barrier (a __syncthreads() is missing between them)" +
                      code_location(pc));
    }
    if (write) {
      s.wepoch = E;
      s.writer = me;
      s.wgen = gen;
    } else if (s.repoch != E) {
      s.repoch = E;
      s.reader = me;
      s.rwarp = warp;
      s.rgen = gen;
    } else if (s.reader != me) {
      s.reader = -2;
      if (s.rwarp != warp) s.rwarp = -2;
      s.rgen = std::max(s.rgen, gen);
    }
  }
}

inline void on_access(std::uintptr_t a, std::size_t n, bool write, void* pc) {
  Thread* t = t_current;
  if (t == nullptr) return;  // host code of an instrumented translation unit
  if (a - t->stack_lo < g_stack_size) return;
  Launch& L = *g_launch;
  if (a >= L.static_lo && a + n <= L.static_hi) {
    return shared_access(t, a - L.static_lo, n, write, pc, a);
  }
  if (a >= L.dyn_lo && a + n <= L.dyn_hi) {
    return shared_access(t, (L.static_hi - L.static_lo) + (a - L.dyn_lo), n, write, pc, a);
  }
  if (a >= L.params_lo && a + n <= L.params_hi) return;
  for (const Range& r : g_device) {
    if (a >= r.lo && a + n <= r.hi) return;
  }
  for (const Range& r : g_image) {
    if (a >= r.lo && a + n <= r.hi) return;
  }
  out_of_bounds(t, a, n, write, pc);
}

}  // namespace detail

using namespace detail;

void atomic_access(const void* addr, std::size_t size, const char* what) {
  Thread* t = current(what);
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  const Launch& L = *g_launch;
  const bool shared = (a >= L.static_lo && a + size <= L.static_hi) ||
                      (a >= L.dyn_lo && a + size <= L.dyn_hi);
  if (shared) return;  // atomics are not races; see docs/emulation.md
  for (const Range& r : g_device) {
    if (a >= r.lo && a + size <= r.hi) return;
  }
  out_of_bounds(t, a, size, true, __builtin_return_address(0));
}

void add_device_range(const void* data, std::size_t bytes, const std::string& name) {
  const auto lo = reinterpret_cast<std::uintptr_t>(data);
  g_device.push_back({lo, lo + bytes, name});
}
void remove_device_range(const void* data) {
  const auto lo = reinterpret_cast<std::uintptr_t>(data);
  g_device.erase(std::remove_if(g_device.begin(), g_device.end(),
                                [&](const Range& r) { return r.lo == lo; }),
                 g_device.end());
}
void clear_device_ranges() { g_device.clear(); }

void check_host_access(const void* addr, std::size_t bytes, const char* what) {
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  for (const Range& r : g_device) {
    if (a >= r.lo && a + bytes <= r.hi) return;
  }
  raise(ErrorKind::kOutOfBounds, std::string(what) + ": " + std::to_string(bytes) +
                                     " bytes at " + hex(a) +
                                     " are not inside one device allocation or tensor view");
}

}  // namespace emu
}  // namespace compass

// ---------------------------------------------------- instrumentation hooks
// Called by code compiled with -fsanitize=kernel-address
// --param asan-instrumentation-with-call-threshold=0 (cmake/emu.cmake).
#define COMPASS_EMU_HOOK extern "C" __attribute__((visibility("hidden")))
#define COMPASS_EMU_HOOKS(n)                                                        \
  COMPASS_EMU_HOOK void __asan_load##n##_noabort(std::uintptr_t a) {                \
    compass::emu::detail::on_access(a, n, false, __builtin_return_address(0));             \
  }                                                                                 \
  COMPASS_EMU_HOOK void __asan_store##n##_noabort(std::uintptr_t a) {               \
    compass::emu::detail::on_access(a, n, true, __builtin_return_address(0));              \
  }
COMPASS_EMU_HOOKS(1)
COMPASS_EMU_HOOKS(2)
COMPASS_EMU_HOOKS(4)
COMPASS_EMU_HOOKS(8)
COMPASS_EMU_HOOKS(16)
COMPASS_EMU_HOOK void __asan_loadN_noabort(std::uintptr_t a, std::size_t n) {
  compass::emu::detail::on_access(a, n, false, __builtin_return_address(0));
}
COMPASS_EMU_HOOK void __asan_storeN_noabort(std::uintptr_t a, std::size_t n) {
  compass::emu::detail::on_access(a, n, true, __builtin_return_address(0));
}
COMPASS_EMU_HOOK void __asan_handle_no_return() {}
// Dynamic initialisation order checks (static constructors of the kernel
// translation units): nothing to check here.
COMPASS_EMU_HOOK void __asan_before_dynamic_init(const char*) {}
COMPASS_EMU_HOOK void __asan_after_dynamic_init() {}
