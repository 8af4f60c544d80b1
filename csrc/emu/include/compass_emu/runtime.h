// The interface between emulated kernel code and the emulator (runtime.cpp).
//
// Kernel translation units (.cu files compiled with the host compiler, see
// docs/emulation.md) reach the emulator only through the functions declared
// here; they are defined in runtime.cpp, which is compiled WITHOUT memory
// instrumentation, so the emulator's own state (thread-local scheduler data,
// warp exchange slots) is never mistaken for a kernel's memory access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

namespace compass {
namespace emu {

// What an emulation check found. Each kind maps to one Python exception class
// of compass_kernels._C_emu (module.cpp).
enum class ErrorKind : int {
  kOutOfBounds,         // global (or other thread's local) memory outside every tensor view
  kBarrier,             // a barrier or warp collective not reached by every thread it names
  kInactiveLane,        // a warp collective naming or reading a lane that cannot take part
  kSharedRace,          // two threads touch a shared byte between barriers, one of them writing
  kUninitializedShared, // a read of shared memory no thread of the block wrote
  kLaunch,              // a launch a GPU would reject, or a kernel that trapped
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// ------------------------------------------------------------- launch side
using KernelThunk = void (*)(const void* params);
// Runs grid x block CUDA threads of `thunk(params)`; throws Error on a check.
// Returns false (and sets the sticky last error) for a configuration a GPU
// refuses, as cudaLaunchKernel would.
bool launch(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_smem,
            KernelThunk thunk, const void* params, std::size_t params_size);
int register_kernel(const char* name);  // at static-init time: what this module can run

// ------------------------------------------------------------- thread side
uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
void* dynamic_shared();

enum class WarpOp : int {
  kShflIdx, kShflUp, kShflDown, kShflXor,
  kBallot, kAny, kAll, kSyncWarp, kActiveMask,
  kReduceAdd, kReduceMin, kReduceMax, kReduceAnd, kReduceOr, kReduceXor,
};
// One warp collective: `in` (size <= 8 bytes) is this lane's operand, `arg`
// the lane / delta / lane mask, `out` receives the result.
void warp_op(WarpOp op, unsigned mask, const void* in, int size, int arg, int width, void* out,
             const char* file, int line);

enum class BarrierOp : int { kSync, kCount, kAnd, kOr };
int block_barrier(BarrierOp op, int predicate, const char* file, int line);

// Atomics: the emulator checks the address (bounds; atomics are exempt from
// the shared-memory race check) and the caller performs the read-modify-write.
void atomic_access(const void* addr, std::size_t size, const char* what);
[[noreturn]] void trap(const char* why, const char* file, int line);

// -------------------------------------------------------------- host side
// Device memory = tensor views (and cudaMalloc blocks) registered for the
// duration of one host entry point call.
void add_device_range(const void* data, std::size_t bytes, const std::string& name);
void remove_device_range(const void* data);
void clear_device_ranges();
void check_host_access(const void* addr, std::size_t bytes, const char* what);
const char* last_error_string(int code);
int take_last_error();
int peek_last_error();

}  // namespace emu
}  // namespace compass
