// Submodules of compass_kernels._C_emu, one function per capability.
#pragma once

#include <pybind11/pybind11.h>

namespace compass {
namespace emu {
void bind_routing(pybind11::module_& root);
void bind_fp8(pybind11::module_& root);
void bind_selftest(pybind11::module_& root);
}  // namespace emu
}  // namespace compass
