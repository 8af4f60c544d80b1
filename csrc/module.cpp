// compass_kernels._C: the module init. Each capability binds its own entry
// points in csrc/<capability>/bindings.cpp (one line per backend); tensors
// arrive as borrowed TensorViews through the caster in compass_pybind.h.

#include <cstdint>
#include <optional>

#ifdef COMPASS_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <omp.h>

#include "compass_pybind.h"

namespace py = pybind11;

// One line per capability: its bind() in csrc/<capability>/bindings.cpp.
namespace compass {
namespace advantages { void bind(py::module_& m); }
namespace routing { void bind(py::module_& m); }
namespace packing { void bind(py::module_& m); }
namespace fp8 { void bind(py::module_& m); }
}  // namespace compass

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
#ifdef COMPASS_WITH_CUTLASS
  d["cutlass_version"] = COMPASS_CUTLASS_VERSION;
#else
  d["cutlass_version"] = "";  // not built: the CUTLASS kernels are left out
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "compass_kernels compiled kernels (framework-free C++/CUDA)";
  py::register_exception<compass::ValueError>(m, "KernelArgumentError", PyExc_ValueError);
  m.def("build_info", &build_info, "what was compiled: version, compilers, CUDA archs");
  m.def("cuda_devices", &cuda_devices, "(count, reason) of usable CUDA devices");
  compass::advantages::bind(m);
  compass::routing::bind(m);
  compass::packing::bind(m);
  compass::fp8::bind(m);
}
