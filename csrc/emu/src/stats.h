// What the emulator has done in this process (module.cpp reports it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace compass {
namespace emu {

struct Stats {
  std::uint64_t launches = 0, blocks = 0, threads = 0, switches = 0;
};

Stats stats();
std::vector<std::string> registered_kernels();

}  // namespace emu
}  // namespace compass
