// Shared by the zip codec tests: a scratch directory, running the Python oracle
// (tests/fixtures/zip_fixtures.py) and parsing its `describe` output.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace ucp::testing {

// A fresh directory under $TMPDIR, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ucp_zip_test_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

inline CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) result.output.append(buf, n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

inline std::string FixtureScript() {
  return std::string(UCP_PYTHON) + " " + UCP_SOURCE_DIR + "/tests/fixtures/zip_fixtures.py";
}

// One record as Python's zipfile reports it.
struct OracleRecord {
  std::string file;
  std::string name;
  uint64_t header_offset = 0;
  uint64_t data_offset = 0;
  uint64_t size = 0;
  uint64_t compressed_size = 0;
  uint32_t crc32 = 0;
  int method = 0;
};

// Records of every file in `paths` (one Python process for all), in file then directory order.
inline std::vector<OracleRecord> DescribeAll(const std::vector<std::string>& paths) {
  ScratchDir dir;
  const std::string list = dir / "paths.txt";
  {
    std::ofstream out(list);
    for (const std::string& path : paths) out << path << "\n";
  }
  const CommandResult r = RunCommand(FixtureScript() + " describe < '" + list + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<OracleRecord> out;
  std::istringstream lines(r.output);
  std::string line;
  while (std::getline(lines, line)) {
    std::vector<std::string> f;
    std::stringstream fields(line);
    std::string field;
    while (std::getline(fields, field, '\t')) f.push_back(field);
    if (f.size() != 8) {
      ADD_FAILURE() << "unexpected describe line: " << line;
      continue;
    }
    out.push_back({f[0], f[1], std::stoull(f[2]), std::stoull(f[3]), std::stoull(f[4]),
                   std::stoull(f[5]), static_cast<uint32_t>(std::stoul(f[6])), std::stoi(f[7])});
  }
  return out;
}

inline std::vector<OracleRecord> Describe(const std::string& path) { return DescribeAll({path}); }

inline std::string ReadAll(const std::string& path) {
  std::string out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

inline void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The archives tests/fixtures/zip_fixtures.py makes. CTest runs every test case as its own process
// (several at once), and making them imports torch, so they are made once per build folder and
// script version: into a private folder that is then renamed into place (the first rename wins).
class Fixtures {
 public:
  static const Fixtures& Get() {
    static const Fixtures fixtures;
    return fixtures;
  }
  std::string operator/(const std::string& name) const { return (dir_ / name).string(); }
  const std::string& error() const { return error_; }
  static std::vector<std::string> TorchFiles() {
    return {"small.pt", "nested.pt", "many.pt", "onebig.pt"};
  }

 private:
  Fixtures() {
    const std::string script =
        ReadAll(std::string(UCP_SOURCE_DIR) + "/tests/fixtures/zip_fixtures.py");
    const std::filesystem::path parent = std::filesystem::path(UCP_BINARY_DIR) / "tests";
    dir_ = parent / ("zip_fixtures_" + std::to_string(std::hash<std::string>{}(script)));
    if (std::filesystem::exists(dir_)) return;
    std::string tmpl = (parent / "zip_fixtures_tmp_XXXXXX").string();
    std::filesystem::create_directories(parent);
    if (::mkdtemp(tmpl.data()) == nullptr) {
      error_ = "mkdtemp failed under " + parent.string();
      return;
    }
    const CommandResult r = RunCommand(FixtureScript() + " make '" + tmpl + "'");
    std::error_code ec;
    if (r.exit_code != 0) {
      error_ = r.output;
    } else {
      std::filesystem::rename(tmpl, dir_, ec);
    }
    std::filesystem::remove_all(tmpl, ec);  // left only when another process won or make failed
  }
  std::filesystem::path dir_;
  std::string error_;
};

}  // namespace ucp::testing
