// The launchers' tuning switches: environment variables read at each launch (benchmarks time
// both settings in turn; csrc/README.md lists them).
#pragma once
#include <cstdlib>

namespace kd_kernels {

// `name`=1 on, =0 (anything else) off; unset, `fallback` (the measured choice).
inline bool switch_on(const char* name, bool fallback) {
  const char* choice = std::getenv(name);
  return choice ? choice[0] == '1' : fallback;
}

}  // namespace kd_kernels
