// COMPASS_EMU_DEF(m, "name", fn, ARGS): binds a CUDA host entry point
// `void fn(ARGS, uintptr_t stream)` of an emulated build, where ARGS is the
// op's argument macro (e.g. COMPASS_GROUP_ADVANTAGES_ARGS): every TensorView
// argument (CPU tensors, through the caster of compass_pybind.h) becomes
// emulated device memory named after its parameter, for the bounds check. The
// stream is optional and ignored, as the op layer calls test-only backends
// without one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "compass_pybind.h"
#include "device_scope.h"

namespace compass {
namespace emu {

// "TensorView rewards, std::optional<TensorView> advantages, double alpha" ->
// {"rewards", "advantages", "alpha"}
inline std::vector<std::string> param_names(const char* params) {
  std::vector<std::string> names;
  std::string cur;
  int depth = 0;
  auto flush = [&] {
    const auto end = cur.find_last_not_of(" \t\n");
    const auto begin = cur.find_last_of(" \t\n*&", end);
    names.push_back(cur.substr(begin == std::string::npos ? 0 : begin + 1, end - begin));
    cur.clear();
  };
  for (const char* p = params; *p; ++p) {
    if (*p == '<') ++depth;
    if (*p == '>') --depth;
    if (*p == ',' && depth == 0) {
      flush();
    } else {
      cur += *p;
    }
  }
  flush();
  return names;
}

inline void adopt(const DeviceScope& d, TensorView& v, const std::string& name) {
  v = d.adopt(v, name.c_str());
}
inline void adopt(const DeviceScope& d, std::optional<TensorView>& v, const std::string& name) {
  if (v) *v = d.adopt(*v, name.c_str());
}
template <typename T>
inline void adopt(const DeviceScope&, T&, const std::string&) {}

template <auto Fn, typename Tuple, std::size_t... I>
void def_entry(pybind11::module_& m, const char* name, const char* params, const char* doc,
               std::index_sequence<I...>) {
  auto names = std::make_shared<std::vector<std::string>>(param_names(params));
  auto run = [names](std::tuple_element_t<I, Tuple>... args) {
    DeviceScope dev;
    (adopt(dev, args, (*names)[I]), ...);
    Fn(args..., uintptr_t{0});
  };
  m.def(name, run, doc);
  m.def(name, [run](std::tuple_element_t<I, Tuple>... args, uintptr_t) { run(args...); }, doc);
}

template <auto Fn, typename... P>
void def_entry(pybind11::module_& m, const char* name, const char* params, const char* doc,
               void (*)(P...)) {
  static_assert(sizeof...(P) >= 1, "a CUDA entry point takes the stream last");
  def_entry<Fn, std::tuple<P...>>(m, name, params, doc,
                                  std::make_index_sequence<sizeof...(P) - 1>{});
}

}  // namespace emu
}  // namespace compass

#define COMPASS_EMU_STR_(...) #__VA_ARGS__
#define COMPASS_EMU_STR(...) COMPASS_EMU_STR_(__VA_ARGS__)
#define COMPASS_EMU_DEF(m, name, fn, ARGS)                                               \
  ::compass::emu::def_entry<&fn>(m, name, COMPASS_EMU_STR(ARGS),                         \
                                 "emulated CUDA entry point: CPU tensors, stream ignored", \
                                 &fn)
