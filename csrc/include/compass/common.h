// Shared macros and error reporting for compass_kernels' framework-free C++/CUDA.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define COMPASS_HD __host__ __device__ __forceinline__
#else
#define COMPASS_HD inline
#endif

namespace compass {

// Bad input: maps to Python ValueError. Messages name the argument and what was
// expected, so a user can fix the call without reading our source.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
inline void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

template <typename... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  throw ValueError(os.str());
}

}  // namespace compass

#define COMPASS_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::compass::fail(__VA_ARGS__);    \
  } while (0)
