// compass_kernels._C: thin pybind11 bindings. Tensors arrive as DLPack
// capsules (borrowed views); one submodule per capability.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>

#ifdef COMPASS_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <omp.h>

#include "advantages/advantages_api.h"
#include "dlpack_view.h"

namespace py = pybind11;
using compass::view_from_dlpack;

namespace {

py::dict build_info() {
  py::dict d;
  d["version"] = COMPASS_VERSION;
  d["cxx_compiler"] = COMPASS_CXX_COMPILER;
  d["openmp"] = _OPENMP;
  d["omp_max_threads"] = omp_get_max_threads();
#ifdef COMPASS_WITH_CUDA
  d["cuda"] = true;
  d["cuda_archs"] = COMPASS_CUDA_ARCHS_STR;
  d["nvcc_version"] = COMPASS_NVCC_VERSION;
  d["cudart_version"] = CUDART_VERSION;
  d["cutlass_include"] = COMPASS_CUTLASS_INCLUDE_STR;  // "" when CUTLASS was not found
#else
  d["cuda"] = false;
  d["cuda_archs"] = "";
  d["cutlass_include"] = "";
#endif
  return d;
}

// Number of usable CUDA devices and why there are none. Static cudart: this
// works (and answers 0) on a machine with no driver.
py::tuple cuda_devices() {
#ifdef COMPASS_WITH_CUDA
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return py::make_tuple(0, std::string(cudaGetErrorString(err)));
  }
  return py::make_tuple(n, std::string(""));
#else
  return py::make_tuple(0, std::string("built without CUDA (COMPASS_CUDA=OFF or no nvcc)"));
#endif
}

compass::advantages::GroupArgs group_args(const py::capsule& rewards, const py::capsule& order,
                                          const py::capsule& offsets, int mode, double eps,
                                          double tol, const py::capsule& adv,
                                          const py::capsule& zero_var, const py::capsule& mean,
                                          const py::capsule& std) {
  compass::advantages::GroupArgs a;
  a.rewards = view_from_dlpack(rewards, "rewards");
  a.order = view_from_dlpack(order, "order");
  a.offsets = view_from_dlpack(offsets, "offsets");
  a.adv = view_from_dlpack(adv, "adv");
  a.zero_var = view_from_dlpack(zero_var, "zero_var");
  a.group_mean = view_from_dlpack(mean, "group_mean");
  a.group_std = view_from_dlpack(std, "group_std");
  a.mode = mode;
  a.eps = eps;
  a.zero_var_tol = tol;
  return a;
}

compass::advantages::ZvpArgs zvp_args(const py::capsule& entropy, const py::capsule& cu,
                                      const py::capsule& rewards, const py::capsule& zero_var,
                                      const std::optional<py::capsule>& advantages, float alpha,
                                      const py::capsule& out) {
  compass::advantages::ZvpArgs a;
  a.entropy = view_from_dlpack(entropy, "entropy");
  a.cu_seqlens = view_from_dlpack(cu, "cu_seqlens");
  a.rewards = view_from_dlpack(rewards, "rewards");
  a.zero_var = view_from_dlpack(zero_var, "zero_var");
  if (advantages) a.advantages = view_from_dlpack(*advantages, "advantages");
  a.out = view_from_dlpack(out, "out");
  a.alpha = alpha;
  return a;
}

void bind_advantages(py::module_& root) {
  auto m = root.def_submodule("advantages", "group advantages, zero variance, RL-ZVP");
  const auto group_doc =
      "group_advantages(rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, "
      "group_mean, group_std): writes the outputs in place";
  m.def("group_advantages_cpu",
        [](py::capsule r, py::capsule o, py::capsule off, int mode, double eps, double tol,
           py::capsule adv, py::capsule zv, py::capsule mean, py::capsule std) {
          auto a = group_args(r, o, off, mode, eps, tol, adv, zv, mean, std);
          py::gil_scoped_release nogil;
          compass::advantages::group_advantages_cpu(a);
        }, group_doc);
  m.def("rl_zvp_cpu",
        [](py::capsule h, py::capsule cu, py::capsule r, py::capsule zv,
           std::optional<py::capsule> adv, float alpha, py::capsule out) {
          auto a = zvp_args(h, cu, r, zv, adv, alpha, out);
          py::gil_scoped_release nogil;
          compass::advantages::rl_zvp_cpu(a);
        }, "rl_zvp(entropy, cu_seqlens, rewards, zero_var, advantages|None, alpha, out)");
#ifdef COMPASS_WITH_CUDA
  m.def("group_advantages_cuda",
        [](py::capsule r, py::capsule o, py::capsule off, int mode, double eps, double tol,
           py::capsule adv, py::capsule zv, py::capsule mean, py::capsule std,
           uintptr_t stream) {
          auto a = group_args(r, o, off, mode, eps, tol, adv, zv, mean, std);
          compass::advantages::group_advantages_cuda(a, stream);
        }, group_doc);
  m.def("rl_zvp_cuda",
        [](py::capsule h, py::capsule cu, py::capsule r, py::capsule zv,
           std::optional<py::capsule> adv, float alpha, py::capsule out, uintptr_t stream) {
          auto a = zvp_args(h, cu, r, zv, adv, alpha, out);
          compass::advantages::rl_zvp_cuda(a, stream);
        }, "rl_zvp on a CUDA stream (uintptr_t handle)");
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "compass_kernels compiled kernels (framework-free C++/CUDA)";
  py::register_exception<compass::ValueError>(m, "KernelArgumentError", PyExc_ValueError);
  m.def("build_info", &build_info, "what was compiled: version, compilers, CUDA archs");
  m.def("cuda_devices", &cuda_devices, "(count, reason) of usable CUDA devices");
  bind_advantages(m);
}
