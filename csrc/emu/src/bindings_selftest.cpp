// compass_kernels._C_emu.selftest: the emulator's own test kernels
// (csrc/emu/tests/selftest.cu), driven by tests/test_emu.py.
#include "bindings.h"
#include "compass_pybind.h"
#include "device_scope.h"
#include "tests/selftest.h"

namespace py = pybind11;

namespace compass {
namespace emu {

void bind_selftest(py::module_& root) {
  namespace st = emu_selftest;
  using C = TensorView;
  auto m = root.def_submodule("selftest", "kernels that exercise each emulator check");
  m.def("shared_shift", [](C x, C out, int mode) {
    DeviceScope d;
    st::shared_shift(d.adopt(x, "x"), d.adopt(out, "out"), mode);
  });
  m.def("index_fill", [](C x, C out, int64_t limit, int64_t read_offset) {
    DeviceScope d;
    st::index_fill(d.adopt(x, "x"), d.adopt(out, "out"), limit, read_offset);
  });
  m.def("barriers", [](C out, int mode) {
    DeviceScope d;
    st::barriers(d.adopt(out, "out"), mode);
  });
  m.def("warp_collectives", [](C x, C sum, C max, C scan, C ballot, C count) {
    DeviceScope d;
    st::warp_collectives(d.adopt(x, "x"), d.adopt(sum, "sum"), d.adopt(max, "max"),
                         d.adopt(scan, "scan"), d.adopt(ballot, "ballot"), d.adopt(count, "count"));
  });
  m.def("partial_warp", [](C x, C out, int mode) {
    DeviceScope d;
    st::partial_warp(d.adopt(x, "x"), d.adopt(out, "out"), mode);
  });
  m.def("atomics", [](C x, C hist, C max, C fsum) {
    DeviceScope d;
    st::atomics(d.adopt(x, "x"), d.adopt(hist, "hist"), d.adopt(max, "max"), d.adopt(fsum, "fsum"));
  });
  m.def("warp_exchange", [](C x, C out, bool use_syncwarp) {
    DeviceScope d;
    st::warp_exchange(d.adopt(x, "x"), d.adopt(out, "out"), use_syncwarp);
  });
  m.def("dynamic_reverse", [](C x, C out, int threads) {
    DeviceScope d;
    st::dynamic_reverse(d.adopt(x, "x"), d.adopt(out, "out"), threads);
  });
  m.def("launch_config", [](C out, int threads) {
    DeviceScope d;
    st::launch_config(d.adopt(out, "out"), threads);
  });
}

}  // namespace emu
}  // namespace compass
