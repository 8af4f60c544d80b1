// User-space fibers: one per emulated CUDA thread, switched at barriers and
// warp collectives. x86-64 uses a 20-instruction hand-written switch (callee-
// saved registers, MXCSR and x87 control word; ~5 ns); elsewhere ucontext
// (which also saves the signal mask: a system call per switch, ~1 us).
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace compass {
namespace emu {

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

// Prepares `f` to run entry(arg) on [stack, stack + size) at its first switch.
// entry must never return (it switches away for the last time instead).
void fiber_init(Fiber* f, void* stack, std::size_t size, void (*entry)(void*), void* arg);
// Saves the running context into `from` and resumes `to`.
void fiber_switch(Fiber* from, Fiber* to);

}  // namespace emu
}  // namespace compass
