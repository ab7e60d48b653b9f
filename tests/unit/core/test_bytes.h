// Deterministic test bytes and scratch files shared by the core unit tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
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

// The whole contents of the file at `path` ("" when it cannot be read).
inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh, empty directory for the running test: <tmp>/<prefix>_<pid>_<test name>.
inline std::filesystem::path ScratchDirectory(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      (prefix + "_" + std::to_string(::getpid()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace ucp::testing
