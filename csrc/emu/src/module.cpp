// compass_kernels._C_emu: our plain CUDA kernels compiled with the host
// compiler and run by the SIMT emulator (docs/emulation.md). Same host entry
// points as compass_kernels._C's CUDA backend, on CPU tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <set>

#include "bindings.h"
#include "compass/common.h"
#include "compass_emu/runtime.h"
#include "stats.h"

namespace py = pybind11;
using compass::emu::ErrorKind;

PYBIND11_MODULE(_C_emu, m) {
  m.doc() = "compass_kernels CUDA kernels run on the CPU by the SIMT emulator (tests only)";
  py::register_exception<compass::ValueError>(m, "KernelArgumentError", PyExc_ValueError);

  static py::exception<compass::emu::Error> base(m, "EmulationError", PyExc_RuntimeError);
  base.doc() = "a check of the CUDA emulator failed (names kernel, block, thread, address)";
  struct Sub {
    ErrorKind kind;
    const char* name;
    const char* doc;
  };
  static const Sub subs[] = {
      {ErrorKind::kOutOfBounds, "OutOfBoundsError",
       "a kernel read or wrote global memory outside every tensor view of the call"},
      {ErrorKind::kBarrier, "BarrierError",
       "a barrier or warp collective not reached by every thread it names (a GPU hang)"},
      {ErrorKind::kInactiveLane, "InactiveLaneError",
       "a warp collective naming or reading a lane that has exited or does not take part"},
      {ErrorKind::kSharedRace, "SharedMemoryRaceError",
       "two threads touched a shared-memory byte between barriers, one of them writing"},
      {ErrorKind::kUninitializedShared, "UninitializedSharedMemoryError",
       "a read of shared memory that no thread of the block wrote"},
      {ErrorKind::kLaunch, "LaunchError", "a launch or trap a GPU would report"},
  };
  static PyObject* classes[std::size(subs)];
  for (std::size_t i = 0; i < std::size(subs); ++i) {
    py::object cls = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
        (std::string("compass_kernels._C_emu.") + subs[i].name).c_str(), subs[i].doc,
        base.ptr(), nullptr));
    if (!cls) throw py::error_already_set();
    classes[i] = cls.ptr();
    m.attr(subs[i].name) = cls;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const compass::emu::Error& e) {
      for (std::size_t i = 0; i < std::size(subs); ++i) {
        if (subs[i].kind == e.kind()) {
          PyErr_SetString(classes[i], e.what());
          return;
        }
      }
      PyErr_SetString(base.ptr(), e.what());
    }
  });

  m.def("kernels", [] {
    const auto names = compass::emu::registered_kernels();
    const std::set<std::string> unique(names.begin(), names.end());
    return std::vector<std::string>(unique.begin(), unique.end());
  }, "names of every kernel this module can run");
  m.def("stats", [] {
    const auto s = compass::emu::stats();
    py::dict d;
    d["launches"] = s.launches;
    d["blocks"] = s.blocks;
    d["threads"] = s.threads;
    d["switches"] = s.switches;
    return d;
  }, "launches, blocks, CUDA threads and fiber switches emulated in this process");

  compass::emu::bind_routing(m);
  compass::emu::bind_fp8(m);
  compass::emu::bind_selftest(m);
}
