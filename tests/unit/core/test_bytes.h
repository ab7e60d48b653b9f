// Deterministic test bytes shared by the core unit tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucp::testing {

// `n` pseudo-random bytes from a linear congruential generator seeded with `seed`: the same
// bytes on every run, different for different seeds.
inline std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> out(n);
  uint32_t x = seed;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return out;
}

}  // namespace ucp::testing
