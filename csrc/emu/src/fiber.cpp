#include "fiber.h"

#include <cstdint>

namespace compass {
namespace emu {

#if defined(__x86_64__)

extern "C" void compass_emu_switch(void** save_sp, void* new_sp);
extern "C" void compass_emu_fiber_start();

// System V: rbx, rbp, r12-r15 are callee-saved, as are MXCSR's control bits
// and the x87 control word; everything else the compiler already assumes
// clobbered across the call. A new fiber starts in compass_emu_fiber_start,
// which calls r13(r12) on a 16-byte-aligned stack.
asm(R"(
  .text
  .globl compass_emu_switch
  .hidden compass_emu_switch
  .type compass_emu_switch, @function
compass_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size compass_emu_switch, .-compass_emu_switch

  .globl compass_emu_fiber_start
  .hidden compass_emu_fiber_start
  .type compass_emu_fiber_start, @function
compass_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size compass_emu_fiber_start, .-compass_emu_fiber_start
)");

void fiber_init(Fiber* f, void* stack, std::size_t size, void (*entry)(void*), void* arg) {
  auto top = (reinterpret_cast<std::uintptr_t>(stack) + size) & ~std::uintptr_t{15};
  auto* sp = reinterpret_cast<std::uint64_t*>(top);
  *--sp = reinterpret_cast<std::uint64_t>(&compass_emu_fiber_start);  // ret; rsp = top after it
  *--sp = 0;                                        // rbp
  *--sp = 0;                                        // rbx
  *--sp = reinterpret_cast<std::uint64_t>(arg);    // r12
  *--sp = reinterpret_cast<std::uint64_t>(entry);  // r13
  *--sp = 0;                                        // r14
  *--sp = 0;                                        // r15
  std::uint32_t mxcsr;
  std::uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  *--sp = mxcsr | (std::uint64_t{fpucw} << 32);
  f->sp = sp;
}

void fiber_switch(Fiber* from, Fiber* to) { compass_emu_switch(&from->sp, to->sp); }

#else

void fiber_init(Fiber* f, void* stack, std::size_t size, void (*entry)(void*), void* arg) {
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = stack;
  f->uc.uc_stack.ss_size = size;
  f->uc.uc_link = nullptr;
  // makecontext passes int arguments: split the pointer in two.
  auto bits = reinterpret_cast<std::uintptr_t>(arg);
  static void (*target)(void*) = nullptr;
  target = entry;
  makecontext(
      &f->uc,
      reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo) {
        target(reinterpret_cast<void*>((std::uintptr_t{hi} << 32) | lo));
      }),
      2, static_cast<unsigned>(bits >> 32), static_cast<unsigned>(bits));
}

void fiber_switch(Fiber* from, Fiber* to) { swapcontext(&from->uc, &to->uc); }

#endif

}  // namespace emu
}  // namespace compass
