// Helpers shared by the pickle tests: generating corpora with the Python scripts under
// tests/fixtures/pickle/ and reading the files back.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ucp::pickle::testing {

inline std::string ReadFileBytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

inline void WriteFileBytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Runs `script` (a file in tests/fixtures/pickle/) with `args` under UCP_PYTHON; returns the
// exit status and appends stdout+stderr to `output` when given.
inline int RunPython(const std::string& script, const std::string& args,
                     std::string* output = nullptr) {
  const std::string log = std::string(UCP_BINARY_DIR) + "/pickle_python_" +
                          std::to_string(::getpid()) + "_" + script + ".log";
  const std::string command = std::string(UCP_PYTHON) + " " + UCP_SOURCE_DIR +
                              "/tests/fixtures/pickle/" + script + " " + args + " >" + log +
                              " 2>&1";
  const int rc = std::system(command.c_str());
  if (output != nullptr) *output += ReadFileBytes(log);
  std::filesystem::remove(log);
  return rc;
}

// A fresh directory under the build tree for one test process's files (CTest runs the tests
// of one suite as parallel processes, so the name carries the pid).
inline std::filesystem::path FreshDir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(UCP_BINARY_DIR) / "pickle_tests" /
                                    (name + "." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The files in `dir` whose names end with `suffix`, sorted.
inline std::vector<std::filesystem::path> FilesEndingWith(const std::filesystem::path& dir,
                                                          const std::string& suffix) {
  std::vector<std::filesystem::path> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A suite whose tests share the corpus tests/fixtures/pickle/make_cases.py writes: CPython's
// pickles of every case under protocols 0-5, plus hand-assembled ones. Written once per suite
// into a fresh directory, removed after it.
class PickleCasesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(FreshDir("cases"));
    std::string output;
    ASSERT_EQ(RunPython("make_cases.py", dir_->string(), &output), 0) << output;
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  static const std::filesystem::path& cases_dir() { return *dir_; }

 private:
  static inline std::filesystem::path* dir_ = nullptr;
};

}  // namespace ucp::pickle::testing
