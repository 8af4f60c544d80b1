// The SIMT emulator: runs a CUDA grid on the calling CPU thread, one fiber per
// CUDA thread, one block at a time, and checks what a GPU would not.
//
// Scheduling. A block's threads run in order, each until it blocks at a
// barrier or warp collective (or exits). When none can run, the pending
// collectives are resolved: a warp collective fires once every lane its mask
// names waits at one with the same mask; a block barrier fires once every
// thread waits at it. Anything else is a hang on a GPU, reported here with the
// threads and source lines involved. Blocks run in a shuffled order (a GPU
// guarantees none), so a kernel that relies on block order shows it.
//
// Memory checks (memcheck.cpp). Kernel translation units are compiled with
// -fsanitize=kernel-address and call-based instrumentation: before every load
// and store that is not in a register, the compiler emits a call to a hook
// that classifies the address (own stack, parameters, module image: fine;
// shared memory: the race checker; otherwise inside one tensor view of the
// call, or an out-of-bounds access).
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "compass_emu/runtime.h"
#include "fiber.h"
#include "internal.h"
#include "stats.h"

namespace compass {
namespace emu {

namespace detail {

// ---------------------------------------------------------------- globals
// One launch at a time per process (kernels do not launch kernels here).
std::mutex g_launch_mutex;
Launch* g_launch = nullptr;
thread_local Thread* t_current = nullptr;  // the running CUDA thread, or null in host code
std::uint32_t g_epoch = 0;                  // barrier intervals, increasing over all launches
std::vector<Range> g_device;                // device memory of the current call
std::vector<Range> g_image;                 // this module's loaded segments
int g_last_error = 0;
Stats g_stats;

// Stacks: one mapping, a guard page below each stack.
std::size_t g_stack_size = 0;
char* g_stacks = nullptr;
int g_stack_count = 0;
std::uintptr_t g_stacks_lo = 0, g_stacks_hi = 0;

std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

void ensure_stacks(int count) {
  if (count <= g_stack_count) return;
  if (g_stack_size == 0) {
    const char* env = std::getenv("COMPASS_EMU_STACK_KB");
    std::size_t kb = env ? std::strtoul(env, nullptr, 10) : 64;
    g_stack_size = std::max<std::size_t>(kb, 16) * 1024;
    g_stack_size = (g_stack_size + page_size() - 1) / page_size() * page_size();
  }
  if (g_stacks) munmap(g_stacks, (g_stack_size + page_size()) * g_stack_count);
  const std::size_t span = g_stack_size + page_size();
  void* p = mmap(nullptr, span * count, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  g_stacks = static_cast<char*>(p);
  for (int i = 0; i < count; ++i) mprotect(g_stacks + i * span, page_size(), PROT_NONE);
  g_stack_count = count;
  g_stacks_lo = reinterpret_cast<std::uintptr_t>(g_stacks);
  g_stacks_hi = g_stacks_lo + span * count;
}
char* stack_of(int i) { return g_stacks + i * (g_stack_size + page_size()) + page_size(); }

std::size_t g_tls_size = 0;  // this module's TLS block: the static __shared__ variables
void* g_self = nullptr;       // dlopen handle of this module

int image_phdr(dl_phdr_info* info, size_t, void* data) {
  auto self = reinterpret_cast<std::uintptr_t>(data);
  std::vector<Range> segs;
  bool mine = false;
  std::size_t tls = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_TLS) tls = ph.p_memsz;
    if (ph.p_type != PT_LOAD) continue;
    const std::uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    segs.push_back({lo, hi, "module image"});
    mine = mine || (self >= lo && self < hi);
  }
  if (mine) {
    g_image = segs;
    g_tls_size = tls;
  }
  return mine ? 1 : 0;
}
void find_image() {
  if (!g_image.empty()) return;
  dl_iterate_phdr(image_phdr, reinterpret_cast<void*>(&find_image));
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&find_image), &info) && info.dli_fname) {
    g_self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }
}

// [lo, hi) of this module's TLS block for the calling OS thread.
std::pair<std::uintptr_t, std::uintptr_t> static_shared_range() {
  t_current = nullptr;  // touching a thread_local allocates the block for this thread
  void* block = nullptr;
  if (g_self == nullptr || g_tls_size == 0 || dlinfo(g_self, RTLD_DI_TLS_DATA, &block) != 0 ||
      block == nullptr) {
    return {0, 0};
  }
  const auto lo = reinterpret_cast<std::uintptr_t>(block);
  return {lo, lo + g_tls_size};
}

std::string short_file(const char* file) {
  std::string f = file ? file : "?";
  const auto pos = f.rfind("csrc/");
  return pos == std::string::npos ? f : f.substr(pos);
}
std::string fmt3(uint3 v) {
  std::ostringstream os;
  os << "(" << v.x << "," << v.y << "," << v.z << ")";
  return os.str();
}
std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, v);
  return buf;
}
const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kSyncWarp: return "__syncwarp";
    case WarpOp::kActiveMask: return "__activemask";
    case WarpOp::kReduceAdd: return "__reduce_add_sync";
    case WarpOp::kReduceMin: return "__reduce_min_sync";
    case WarpOp::kReduceMax: return "__reduce_max_sync";
    case WarpOp::kReduceAnd: return "__reduce_and_sync";
    case WarpOp::kReduceOr: return "__reduce_or_sync";
    case WarpOp::kReduceXor: return "__reduce_xor_sync";
  }
  return "?";
}
const char* barrier_name(BarrierOp op) {
  switch (op) {
    case BarrierOp::kSync: return "__syncthreads()";
    case BarrierOp::kCount: return "__syncthreads_count()";
    case BarrierOp::kAnd: return "__syncthreads_and()";
    case BarrierOp::kOr: return "__syncthreads_or()";
  }
  return "?";
}
std::string where(const Thread& t) { return short_file(t.file) + ":" + std::to_string(t.line); }

// "in kernel K, block (b), thread (t)": the prefix of every report.
std::string context(const Launch& L, const Thread* t) {
  std::string s = std::string("in kernel ") + L.kernel + ", block " + fmt3(L.bidx);
  if (t) s += ", thread " + fmt3(t->tid);
  return s;
}

[[noreturn]] void raise(ErrorKind kind, const std::string& what) {
  throw Error(kind, "[cuda-emulated] " + what);
}

// A check failed inside a fiber: record it and leave the fiber for good (no
// unwinding through kernel frames; the scheduler raises on the host stack).
[[noreturn]] void fail_thread(Thread* t, ErrorKind kind, const std::string& what) {
  Launch& L = *g_launch;
  L.error = "[cuda-emulated] " + what;
  L.error_kind = kind;
  t->state = State::kFailed;
  fiber_switch(&t->fiber, &L.scheduler);
  std::abort();  // never resumed
}

void block_on(Thread* t) { fiber_switch(&t->fiber, &g_launch->scheduler); }

void fiber_entry(void* arg) {
  auto* t = static_cast<Thread*>(arg);
  Launch& L = *g_launch;
  L.thunk(reinterpret_cast<const void*>(L.params_lo));
  t->state = State::kExited;
  fiber_switch(&t->fiber, &L.scheduler);
  std::abort();  // never resumed
}

// ------------------------------------------------------------ warp collectives

// Fires one warp collective for the lanes of `mask` in warp `w`.
void fire_warp_op(Launch& L, int w, unsigned mask, WarpOp op, const Thread& first) {
  const int base = w * 32;
  if (op == WarpOp::kSyncWarp) {
    ++L.warp_gen[w];
  } else if (op == WarpOp::kBallot || op == WarpOp::kAny || op == WarpOp::kAll) {
    unsigned votes = 0;
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) && L.threads[base + l].in != 0) votes |= 1u << l;
    }
    const std::uint64_t r = op == WarpOp::kBallot ? votes
                            : op == WarpOp::kAny  ? (votes != 0)
                                                  : (votes == mask);
    for (int l = 0; l < 32; ++l) {
      if (mask >> l & 1u) L.threads[base + l].out = r;
    }
  } else if (op >= WarpOp::kReduceAdd) {
    const bool is_signed = first.arg != 0;
    std::int64_t acc = 0;
    bool seeded = false;
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      const std::uint32_t raw = static_cast<std::uint32_t>(L.threads[base + l].in);
      const std::int64_t v = is_signed ? std::int64_t{static_cast<std::int32_t>(raw)}
                                       : std::int64_t{raw};
      if (!seeded) {
        acc = v;
        seeded = true;
        continue;
      }
      switch (op) {
        case WarpOp::kReduceAdd: acc += v; break;
        case WarpOp::kReduceMin: acc = std::min(acc, v); break;
        case WarpOp::kReduceMax: acc = std::max(acc, v); break;
        case WarpOp::kReduceAnd: acc &= v; break;
        case WarpOp::kReduceOr: acc |= v; break;
        default: acc ^= v; break;
      }
    }
    for (int l = 0; l < 32; ++l) {
      if (mask >> l & 1u) L.threads[base + l].out = static_cast<std::uint32_t>(acc);
    }
  } else {  // shuffles
    const int width = first.width;
    if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
      raise(ErrorKind::kLaunch, std::string(op_name(op)) + " at " + where(first) +
                                    ": width must be a power of two in [1, 32], got " +
                                    std::to_string(width) + " " + context(L, &first));
    }
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Thread& t = L.threads[base + l];
      const int seg = l / width * width;
      int src;
      switch (op) {
        case WarpOp::kShflIdx: src = seg + (t.arg & (width - 1)); break;
        case WarpOp::kShflUp: src = l - t.arg < seg ? l : l - t.arg; break;
        case WarpOp::kShflDown: src = l + t.arg >= seg + width ? l : l + t.arg; break;
        default: {
          const int x = l ^ (t.arg & 31);
          src = x >= seg + width ? l : x;
        }
      }
      if (!(mask >> src & 1u)) {
        const bool exists = base + src < L.nthreads;
        const bool exited = exists && L.threads[base + src].state == State::kExited;
        raise(ErrorKind::kInactiveLane,
              std::string(op_name(op)) + " at " + where(t) + " reads lane " +
                  std::to_string(src) + ", which is not in its mask " + hex(mask) +
                  (exists ? (exited ? " (it has exited)" : " (it does not take part)")
                          : " (no such thread in the block)") +
                  " " + context(L, &t) + ": the value read is undefined on a GPU");
      }
      t.out = L.threads[base + src].in;
    }
  }
  for (int l = 0; l < 32; ++l) {
    if (mask >> l & 1u) L.threads[base + l].state = State::kRunnable;
  }
}

// Every thread is blocked or done: fire what can fire, or explain the hang.
// Returns false when every thread has exited.
bool resolve(Launch& L) {
  bool fired = false;
  const int nwarps = (L.nthreads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) {
    const int base = w * 32, lanes = std::min(32, L.nthreads - base);
    for (int l = 0; l < lanes; ++l) {
      Thread& t = L.threads[base + l];
      if (t.state != State::kWarp) continue;
      if (t.wop == WarpOp::kActiveMask) {
        unsigned active = 0;
        for (int k = 0; k < lanes; ++k) {
          const Thread& u = L.threads[base + k];
          if (u.state == State::kWarp && u.wop == WarpOp::kActiveMask && u.line == t.line &&
              std::strcmp(u.file, t.file) == 0) {
            active |= 1u << k;
          }
        }
        for (int k = 0; k < lanes; ++k) {
          if (active >> k & 1u) {
            L.threads[base + k].out = active;
            L.threads[base + k].state = State::kRunnable;
          }
        }
        fired = true;
        continue;
      }
      const unsigned mask = t.mask;
      for (int k = 0; k < 32; ++k) {
        if (!(mask >> k & 1u)) continue;
        const std::string head = std::string(op_name(t.wop)) + " at " + where(t) + " with mask " +
                                 hex(mask) + " names lane " + std::to_string(k);
        if (k >= lanes) {
          raise(ErrorKind::kInactiveLane,
                head + ", which does not exist (the block has " + std::to_string(L.nthreads) +
                    " threads) " + context(L, &t));
        }
        const Thread& u = L.threads[base + k];
        if (u.state == State::kExited) {
          raise(ErrorKind::kInactiveLane,
                head + " " + fmt3(u.tid) + ", which has exited " + context(L, &t) +
                    ": a GPU hangs or returns undefined values");
        }
        if (u.state == State::kBarrier) {
          raise(ErrorKind::kBarrier,
                head + " " + fmt3(u.tid) + ", which waits at " + barrier_name(u.bop) + " at " +
                    where(u) + " " + context(L, &t) + ": the warp diverged around a barrier");
        }
        if (u.wop != t.wop || u.mask != mask) {
          raise(ErrorKind::kBarrier,
                head + " " + fmt3(u.tid) + ", which waits at " + op_name(u.wop) + " at " +
                    where(u) + " with mask " + hex(u.mask) + " " + context(L, &t) +
                    ": lanes of one warp wait at different collectives");
        }
      }
      fire_warp_op(L, w, mask, t.wop, t);
      fired = true;
    }
  }
  if (fired) return true;

  const Thread* waiting = nullptr;
  const Thread* exited = nullptr;
  int arrived = 0;
  for (const Thread& t : L.threads) {
    if (t.state == State::kBarrier) {
      ++arrived;
      if (waiting == nullptr) waiting = &t;
      if (t.line != waiting->line || std::strcmp(t.file, waiting->file) != 0 ||
          t.bop != waiting->bop) {
        raise(ErrorKind::kBarrier,
              std::string("threads of one block wait at different barriers: thread ") +
                  fmt3(waiting->tid) + " at " + barrier_name(waiting->bop) + " at " +
                  where(*waiting) + ", thread " + fmt3(t.tid) + " at " + barrier_name(t.bop) +
                  " at " + where(t) + " " + context(L, nullptr));
      }
    } else if (t.state == State::kExited && exited == nullptr) {
      exited = &t;
    }
  }
  if (waiting == nullptr) return false;  // all exited
  if (exited != nullptr) {
    raise(ErrorKind::kBarrier,
          std::string(barrier_name(waiting->bop)) + " at " + where(*waiting) + " reached by " +
              std::to_string(arrived) + " of " + std::to_string(L.nthreads) +
              " threads; thread " + fmt3(exited->tid) + " exited without reaching it " +
              context(L, nullptr) + ": a divergent barrier (a hang or undefined on a GPU)");
  }
  int count = 0;
  for (const Thread& t : L.threads) count += t.in != 0;
  const int result = waiting->bop == BarrierOp::kCount ? count
                     : waiting->bop == BarrierOp::kAnd ? (count == L.nthreads)
                     : waiting->bop == BarrierOp::kOr  ? (count > 0)
                                                       : 0;
  for (Thread& t : L.threads) {
    t.out = static_cast<std::uint64_t>(result);
    t.state = State::kRunnable;
  }
  ++g_epoch;
  return true;
}

void run_block(Launch& L) {
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t = Thread{};
    t.linear = i;
    t.tid = uint3{static_cast<unsigned>(i % L.block.x),
                  static_cast<unsigned>(i / L.block.x % L.block.y),
                  static_cast<unsigned>(i / (L.block.x * L.block.y))};
    t.stack_lo = reinterpret_cast<std::uintptr_t>(stack_of(i));
    fiber_init(&t.fiber, stack_of(i), g_stack_size, &fiber_entry, &t);
  }
  L.block_epoch = ++g_epoch;
  // Static shared memory keeps the previous block's bytes (the TLS block also
  // holds other thread_local data); reading them is reported as uninitialized.
  if (!L.dyn.empty()) std::memset(L.dyn.data(), kSharedPoison, L.dyn.size());
  ++g_stats.blocks;
  g_stats.threads += static_cast<std::uint64_t>(L.nthreads);
  for (;;) {
    for (Thread& t : L.threads) {
      if (t.state != State::kRunnable) continue;
      t_current = &t;
      fiber_switch(&L.scheduler, &t.fiber);
      t_current = nullptr;
      ++g_stats.switches;
      if (t.state == State::kFailed) throw Error(L.error_kind, L.error);
    }
    if (!resolve(L)) break;
  }
}

std::vector<std::string>& kernel_registry() {
  static std::vector<std::string> names;
  return names;
}

Thread* current(const char* what) {
  if (t_current == nullptr) {
    raise(ErrorKind::kLaunch, std::string(what) + " called outside a kernel");
  }
  return t_current;
}

}  // namespace detail

using namespace detail;

// ===================================================================== API

std::string kernel_name_from_signature(const char* pretty) {
  std::string s = pretty;
  auto pos = s.find("Kernel = ");
  if (pos == std::string::npos) return s;
  s = s.substr(pos + 9);
  int depth = 0;
  std::size_t end = 0;
  for (; end < s.size(); ++end) {
    const char c = s[end];
    if (c == '<' || c == '(') ++depth;
    if (c == '>' || c == ')') --depth;
    if (depth < 0 || (depth == 0 && (c == ';' || c == ']'))) break;
  }
  s = s.substr(0, end);
  for (const std::string junk : {"{anonymous}::", "(anonymous namespace)::", "& "}) {
    for (auto p = s.find(junk); p != std::string::npos; p = s.find(junk)) s.erase(p, junk.size());
  }
  if (s.size() > 2 && s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  if (!s.empty() && s.front() == '&') s.erase(0, 1);
  return s;
}

int register_kernel(const char* name) {
  auto& names = kernel_registry();
  names.emplace_back(name);
  return static_cast<int>(names.size()) - 1;
}

std::vector<std::string> registered_kernels() { return kernel_registry(); }
Stats stats() { return g_stats; }

bool launch(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_smem,
            KernelThunk thunk, const void* params, std::size_t params_size) {
  if (t_current != nullptr) raise(ErrorKind::kLaunch, "a kernel launched a kernel (unsupported)");
  const std::uint64_t nthreads = std::uint64_t{block.x} * block.y * block.z;
  find_image();
  const auto [static_lo, static_hi] = static_shared_range();
  const std::size_t static_bytes = static_hi - static_lo;
  if (nthreads == 0 || nthreads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    g_last_error = 9;  // cudaErrorInvalidConfiguration
    return false;
  }
  if (static_bytes + dynamic_smem > kMaxSharedBytes) {
    g_last_error = 1;  // cudaErrorInvalidValue
    return false;
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  ensure_stacks(static_cast<int>(nthreads));
  Launch L;
  L.kernel = kernel;
  L.grid = grid;
  L.block = block;
  L.thunk = thunk;
  L.params_lo = reinterpret_cast<std::uintptr_t>(params);
  L.params_hi = L.params_lo + params_size;
  L.nthreads = static_cast<int>(nthreads);
  L.threads.resize(nthreads);
  L.static_lo = static_lo;
  L.static_hi = static_hi;
  L.dyn.resize(dynamic_smem);
  L.dyn_lo = reinterpret_cast<std::uintptr_t>(L.dyn.data());
  L.dyn_hi = L.dyn_lo + dynamic_smem;
  L.shadow.resize(static_bytes + dynamic_smem);
  L.warp_gen.assign((nthreads + 31) / 32, 0);

  // Blocks in a shuffled order (deterministic; COMPASS_EMU_BLOCK_ORDER=forward
  // or reverse, COMPASS_EMU_SEED to vary it).
  const std::uint64_t nblocks = std::uint64_t{grid.x} * grid.y * grid.z;
  std::vector<std::uint64_t> order(nblocks);
  for (std::uint64_t i = 0; i < nblocks; ++i) order[i] = i;
  const char* mode = std::getenv("COMPASS_EMU_BLOCK_ORDER");
  if (mode && std::strcmp(mode, "reverse") == 0) {
    std::reverse(order.begin(), order.end());
  } else if (!(mode && std::strcmp(mode, "forward") == 0)) {
    const char* seed_env = std::getenv("COMPASS_EMU_SEED");
    std::uint64_t x = 0x9e3779b97f4a7c15ull ^ (seed_env ? std::strtoull(seed_env, nullptr, 10) : 0);
    for (std::uint64_t i = nblocks; i > 1; --i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::swap(order[i - 1], order[x % i]);
    }
  }

  g_launch = &L;
  ++g_stats.launches;
  try {
    for (std::uint64_t b : order) {
      L.bidx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (std::uint64_t{grid.x} * grid.y))};
      run_block(L);
    }
  } catch (...) {
    t_current = nullptr;
    g_launch = nullptr;
    throw;
  }
  g_launch = nullptr;
  return true;
}

uint3 thread_idx() { return current("threadIdx")->tid; }
uint3 block_idx() {
  current("blockIdx");
  return g_launch->bidx;
}
dim3 block_dim() {
  current("blockDim");
  return g_launch->block;
}
dim3 grid_dim() {
  current("gridDim");
  return g_launch->grid;
}
void* dynamic_shared() {
  current("dynamic shared memory");
  return g_launch->dyn.data();
}

void warp_op(WarpOp op, unsigned mask, const void* in, int size, int arg, int width, void* out,
             const char* file, int line) {
  Thread* t = current(op_name(op));
  const int lane = t->linear % 32;
  t->wop = op;
  t->mask = mask;
  t->arg = arg;
  t->width = width;
  t->size = size;
  t->file = file;
  t->line = line;
  t->in = 0;
  if (in) std::memcpy(&t->in, in, static_cast<std::size_t>(size));
  if (op != WarpOp::kActiveMask && !(mask >> lane & 1u)) {
    fail_thread(t, ErrorKind::kInactiveLane,
                std::string(op_name(op)) + " at " + short_file(file) + ":" +
                    std::to_string(line) + " called by lane " + std::to_string(lane) +
                    ", which is not in its mask " + hex(mask) + " " + context(*g_launch, t));
  }
  t->state = State::kWarp;
  block_on(t);
  if (out) std::memcpy(out, &t->out, static_cast<std::size_t>(size));
}

int block_barrier(BarrierOp op, int predicate, const char* file, int line) {
  Thread* t = current(barrier_name(op));
  t->bop = op;
  t->in = predicate != 0;
  t->file = file;
  t->line = line;
  t->state = State::kBarrier;
  block_on(t);
  return static_cast<int>(t->out);
}

void trap(const char* why, const char* file, int line) {
  Thread* t = current(why);
  fail_thread(t, ErrorKind::kLaunch,
              std::string(why) + " at " + short_file(file) + ":" + std::to_string(line) + " " +
                  context(*g_launch, t));
}

const char* last_error_string(int code) {
  switch (code) {
    case 0: return "no error";
    case 1: return "invalid argument";
    case 2: return "out of memory";
    case 9: return "invalid configuration argument";
    case 101: return "invalid device ordinal";
    default: return "unspecified launch failure";
  }
}
int take_last_error() {
  const int e = g_last_error;
  g_last_error = 0;
  return e;
}
int peek_last_error() { return g_last_error; }

}  // namespace emu
}  // namespace compass
