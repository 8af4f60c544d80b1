// ck.advantages' CUDA entry points (csrc/advantages/advantages.cu, compiled
// for emulation) on CPU tensors; plus the planted mutants the test suite must
// catch (cmake/emu.cmake), one submodule each under `mutants`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "advantages/advantages_api.h"
#include "bindings.h"
#include "compass_emu_mutants.h"  // generated: COMPASS_EMU_MUTANTS(X)
#include "device_scope.h"

namespace py = pybind11;

namespace compass {
namespace advantages {
#define COMPASS_EMU_DECLARE(name)                                        \
  void group_advantages_cuda__##name(const GroupArgs& a, uintptr_t stream); \
  void rl_zvp_cuda__##name(const ZvpArgs& a, uintptr_t stream);
COMPASS_EMU_MUTANTS(COMPASS_EMU_DECLARE)
#undef COMPASS_EMU_DECLARE
}  // namespace advantages

namespace emu {
namespace {

using advantages::GroupArgs;
using advantages::ZvpArgs;
using GroupFn = void (*)(const GroupArgs&, uintptr_t);
using ZvpFn = void (*)(const ZvpArgs&, uintptr_t);

void def_entries(py::module_& m, GroupFn group, ZvpFn zvp) {
  m.def("group_advantages_cuda",
        [group](py::capsule r, py::capsule o, py::capsule off, int mode, double eps, double tol,
                py::capsule adv, py::capsule zv, py::capsule mean, py::capsule std,
                uintptr_t stream) {
          DeviceScope dev;
          GroupArgs a;
          a.rewards = dev.view(r, "rewards");
          a.order = dev.view(o, "order");
          a.offsets = dev.view(off, "offsets");
          a.adv = dev.view(adv, "adv");
          a.zero_var = dev.view(zv, "zero_var");
          a.group_mean = dev.view(mean, "group_mean");
          a.group_std = dev.view(std, "group_std");
          a.mode = mode;
          a.eps = eps;
          a.zero_var_tol = tol;
          group(a, stream);
        },
        "group_advantages_cuda(rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, "
        "group_mean, group_std, stream): CPU tensors; the stream is ignored");
  m.def("rl_zvp_cuda",
        [zvp](py::capsule h, py::capsule cu, py::capsule r, py::capsule zv,
              std::optional<py::capsule> adv, float alpha, py::capsule out, uintptr_t stream) {
          DeviceScope dev;
          ZvpArgs a;
          a.entropy = dev.view(h, "entropy");
          a.cu_seqlens = dev.view(cu, "cu_seqlens");
          a.rewards = dev.view(r, "rewards");
          a.zero_var = dev.view(zv, "zero_var");
          if (adv) a.advantages = dev.view(*adv, "advantages");
          a.out = dev.view(out, "out");
          a.alpha = alpha;
          zvp(a, stream);
        },
        "rl_zvp_cuda(entropy, cu_seqlens, rewards, zero_var, advantages|None, alpha, out, "
        "stream): CPU tensors; the stream is ignored");
}

}  // namespace

void bind_advantages(py::module_& root) {
  auto m = root.def_submodule("advantages", "ck.advantages CUDA entry points, emulated");
  def_entries(m, &advantages::group_advantages_cuda, &advantages::rl_zvp_cuda);
  auto mutants = root.def_submodule("mutants", "planted bugs the tests must catch");
  auto mut = mutants.def_submodule("advantages", "mutants of the advantages kernels");
#define COMPASS_EMU_BIND(name)                                                 \
  {                                                                            \
    auto sub = mut.def_submodule(#name);                                       \
    def_entries(sub, &advantages::group_advantages_cuda__##name,               \
                &advantages::rl_zvp_cuda__##name);                             \
  }
  COMPASS_EMU_MUTANTS(COMPASS_EMU_BIND)
#undef COMPASS_EMU_BIND
}

}  // namespace emu
}  // namespace compass
