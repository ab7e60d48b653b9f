// Deterministic test bytes and scratch files shared by the core unit tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
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

// Removes the scratch directories a test made when it ends, unless it failed: those stay for a
// look at what it left.
class ScratchRemover : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) {
      for (const std::filesystem::path& dir : directories_) {
        std::error_code ignored;
        std::filesystem::remove_all(dir, ignored);
      }
    }
    directories_.clear();
  }
  std::vector<std::filesystem::path>& directories() { return directories_; }

 private:
  std::vector<std::filesystem::path> directories_;
};

// The remover of this test program, registered with GoogleTest (which owns it) at first use.
inline ScratchRemover& TheScratchRemover() {
  static ScratchRemover* remover = [] {
    auto* created = new ScratchRemover;
    ::testing::UnitTest::GetInstance()->listeners().Append(created);
    return created;
  }();
  return *remover;
}

// A fresh, empty directory for the running test: <tmp>/<prefix>_<pid>_<test name> (a
// parameterized test's "Name/N" as "Name_N"), removed when the test passes.
inline std::filesystem::path ScratchDirectory(const std::string& prefix) {
  std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(test.begin(), test.end(), '/', '_');
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    (prefix + "_" + std::to_string(::getpid()) + "_" + test);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TheScratchRemover().directories().push_back(dir);
  return dir;
}

}  // namespace ucp::testing
