#include "core/io/fault_injection.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/io/file.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using ::ucp::testing::Pattern;

// Faults on the calls of one operation in kIndexBuild: from call `first` (counting from 1),
// `count` calls in a row (0: all; EINTR only every other one), either an errno or half of each
// transfer; with `short_before`,
// the calls before `first` move half of what they are asked. Counts what it fired.
class ScriptedInjector : public IoFaultInjector {
 public:
  ScriptedInjector(IoOp op, int error, uint64_t first = 1, uint64_t count = 0,
                   bool short_before = false)
      : op_(op), error_(error), first_(first), count_(count), short_before_(short_before) {}

  IoFault Decide(IoPhase phase, IoOp op, std::string_view, size_t bytes) noexcept override {
    std::lock_guard lock(mutex_);
    if (op != op_ || phase != IoPhase::kIndexBuild) return {};
    ++seen_;
    IoFault fault;
    if (seen_ < first_ && short_before_) {
      ++fired_;
      fault.max_bytes = bytes / 2;
      return fault;
    }
    if (seen_ < first_ || (count_ != 0 && seen_ >= first_ + count_)) return {};
    // The retry of an interrupted call goes through: EINTR on every call would never end.
    if (error_ == EINTR && std::exchange(interrupted_, false)) return {};
    interrupted_ = error_ == EINTR;
    ++fired_;
    if (error_ != 0) {
      fault.error = error_;
    } else {
      fault.max_bytes = bytes / 2;
    }
    return fault;
  }

  uint64_t fired() const { return fired_; }

 private:
  std::mutex mutex_;
  const IoOp op_;
  const int error_;
  const uint64_t first_;
  const uint64_t count_;
  const bool short_before_;
  uint64_t seen_ = 0;
  uint64_t fired_ = 0;
  bool interrupted_ = false;
};

class FaultInjectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ucp_fault_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    SetIoFaultInjector(nullptr);
    std::filesystem::remove_all(dir_);
  }
  std::string PathOf(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    return names;
  }

  std::filesystem::path dir_;
};

std::string Text(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST_F(FaultInjectionTest, OnlyTheLabelledPhaseFaultsAndScopesNest) {
  ScriptedInjector injector(IoOp::kWrite, ENOSPC);
  SetIoFaultInjector(&injector);
  EXPECT_EQ(CurrentIoPhase(), IoPhase::kOther);
  EXPECT_TRUE(WriteFileAtomically(PathOf("other"), "x").ok());
  {
    IoPhaseScope index(IoPhase::kIndexBuild);
    {
      IoPhaseScope journal(IoPhase::kJournal);
      EXPECT_EQ(CurrentIoPhase(), IoPhase::kJournal);
      EXPECT_TRUE(WriteFileAtomically(PathOf("journal"), "x").ok());
    }
    EXPECT_EQ(CurrentIoPhase(), IoPhase::kIndexBuild);
    EXPECT_EQ(WriteFileAtomically(PathOf("index"), "x").code(), StatusCode::kIoError);
    // Another thread starts unlabelled.
    std::thread([&] { EXPECT_EQ(CurrentIoPhase(), IoPhase::kOther); }).join();
  }
  EXPECT_EQ(CurrentIoPhase(), IoPhase::kOther);
  EXPECT_EQ(injector.fired(), 1u);
}

// EINTR on every call of each kind, and short transfers on every read and write: the same bytes
// land and read back as without a fault.
TEST_F(FaultInjectionTest, InterruptedAndShortCallsAreRetriedToTheSameResult) {
  const std::vector<std::byte> data = Pattern(3 << 20, 7);
  const struct {
    IoOp op;
    int error;
  } cases[] = {{IoOp::kOpenWrite, EINTR}, {IoOp::kRead, EINTR},   {IoOp::kWrite, EINTR},
               {IoOp::kSync, EINTR},      {IoOp::kRename, EINTR}, {IoOp::kRead, 0},
               {IoOp::kWrite, 0}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(IoOpName(c.op)) + (c.error != 0 ? " EINTR" : " short"));
    ScriptedInjector injector(c.op, c.error);
    SetIoFaultInjector(&injector);
    IoPhaseScope phase(IoPhase::kIndexBuild);
    const std::string path = PathOf("atomic");
    ASSERT_TRUE(WriteFileAtomically(path, Text(data)).ok());
    Result<std::string> back = ReadSmallFile(path, data.size());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, Text(data));

    // Append, and CopyRange (copy_file_range counts as a write).
    Result<File> appended = File::Open(PathOf("appended"), File::Mode::kCreate);
    ASSERT_TRUE(appended.ok());
    ASSERT_TRUE(appended->Append(data).ok());
    Result<File> source = File::Open(path, File::Mode::kRead);
    ASSERT_TRUE(source.ok());
    ASSERT_TRUE(CopyRange(*source, 0, *appended, data.size(), data.size()).ok());
    ASSERT_TRUE(appended->Close().ok());
    Result<std::string> twice = ReadSmallFile(PathOf("appended"), 2 * data.size());
    ASSERT_TRUE(twice.ok());
    EXPECT_EQ(*twice, Text(data) + Text(data));
    EXPECT_GT(injector.fired(), 0u);
    SetIoFaultInjector(nullptr);
  }
}

// A failure at any step of WriteFileAtomically, also after a short write, leaves the previous
// file and no temporary.
TEST_F(FaultInjectionTest, FailedAtomicWriteLeavesThePreviousFileAndNoTemporary) {
  const std::string path = PathOf("index.json");
  ASSERT_TRUE(WriteFileAtomically(path, "previous").ok());
  const std::vector<std::byte> data = Pattern(1 << 20, 3);
  const struct {
    IoOp op;
    int error;
    uint64_t first;
  } cases[] = {{IoOp::kOpenWrite, ENOSPC, 1},
               {IoOp::kWrite, ENOSPC, 1},
               {IoOp::kWrite, EIO, 2},
               {IoOp::kSync, EIO, 1},
               {IoOp::kRename, EIO, 1}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(IoOpName(c.op)) + " " + std::to_string(c.error));
    ScriptedInjector injector(c.op, c.error, c.first, 1, /*short_before=*/true);
    SetIoFaultInjector(&injector);
    {
      IoPhaseScope phase(IoPhase::kIndexBuild);
      EXPECT_EQ(WriteFileAtomically(path, Text(data)).code(), StatusCode::kIoError);
    }
    SetIoFaultInjector(nullptr);
    EXPECT_EQ(injector.fired(), c.first);
    Result<std::string> kept = ReadSmallFile(path, 100);
    ASSERT_TRUE(kept.ok());
    EXPECT_EQ(*kept, "previous");
    EXPECT_EQ(Names(), std::vector<std::string>{"index.json"});
  }
}

// The errno injected is the one reported, naming the operation and the file.
TEST_F(FaultInjectionTest, InjectedErrorsReadAsTheKernelsOwn) {
  ASSERT_TRUE(WriteFileAtomically(PathOf("a"), "0123456789").ok());
  ScriptedInjector injector(IoOp::kRead, EIO);
  SetIoFaultInjector(&injector);
  IoPhaseScope phase(IoPhase::kIndexBuild);
  Result<std::string> read = ReadSmallFile(PathOf("a"), 100);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kIoError);
  EXPECT_NE(read.status().message().find("pread 10 bytes at 0 of " + PathOf("a")),
            std::string::npos)
      << read.status().message();
  EXPECT_NE(read.status().message().find("Input/output error"), std::string::npos);
}

}  // namespace
}  // namespace ucp
