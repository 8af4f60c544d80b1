// compass::launch under emulation: converts the arguments to the kernel's
// parameter types (as a <<<>>> launch does), keeps them in one "parameter
// buffer" the kernel may read, and hands a thunk to the emulator.
#pragma once

#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "compass_emu/runtime.h"

namespace compass {
namespace emu {

template <typename F>
struct KernelParams;
template <typename... P>
struct KernelParams<void (*)(P...)> {
  using type = std::tuple<std::decay_t<P>...>;
};

// "compass::advantages::group_kernel<float>", from the compiler's own
// spelling of the template argument.
std::string kernel_name_from_signature(const char* pretty_function);

template <auto Kernel>
const char* kernel_name() {
  static const std::string name = kernel_name_from_signature(__PRETTY_FUNCTION__);
  return name.c_str();
}

// Every kernel this module can launch is known at load time (evidence for
// ck.info() and the tests), not only the ones launched so far.
template <auto Kernel>
struct KernelRegistration {
  static inline const int id = register_kernel(kernel_name<Kernel>());
};

template <auto Kernel, typename Params>
void kernel_thunk(const void* params) {
  std::apply(Kernel, *static_cast<const Params*>(params));
}

template <auto Kernel, typename... Args>
void launch_kernel(dim3 grid, dim3 block, std::size_t smem, Args&&... args) {
  using Params = typename KernelParams<decltype(Kernel)>::type;
  static_assert(std::tuple_size<Params>::value == sizeof...(Args),
                "compass::launch: wrong number of kernel arguments");
  (void)KernelRegistration<Kernel>::id;
  const Params params(std::forward<Args>(args)...);
  launch(kernel_name<Kernel>(), grid, block, smem, &kernel_thunk<Kernel, Params>, &params,
         sizeof(params));
}

}  // namespace emu
}  // namespace compass
