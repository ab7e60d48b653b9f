#include "core/io/file_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "core/io/fault_injection.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using namespace std::chrono_literals;

class FileLockTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = (testing::ScratchDirectory("file_lock") / "view.lock").string(); }
  std::string path_;
};

TEST_F(FileLockTest, ASecondHolderWaitsAtMostItsLimitThenFailsNamingTheLock) {
  Result<FileLock> held = FileLock::Acquire(path_);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  const auto begin = std::chrono::steady_clock::now();
  Result<FileLock> second = FileLock::Acquire(path_, 200ms);
  EXPECT_GE(std::chrono::steady_clock::now() - begin, 200ms);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(second.status().message(),
            "lock: " + path_ + ": still held by another process after 200 ms");
}

// Counts the flock calls on one path, failing none.
class LockTries : public IoFaultInjector {
 public:
  explicit LockTries(std::string path) : path_(std::move(path)) {}
  IoFault Decide(IoPhase, IoOp op, std::string_view path, size_t) noexcept override {
    if (op == IoOp::kLock && path == path_) tries_.fetch_add(1);
    return {};
  }
  int tries() const { return tries_.load(); }

 private:
  std::string path_;
  std::atomic<int> tries_{0};
};

// Every rank of a job takes a view's lock: a waiter's pauses grow with its wait (WaitBackoff),
// where a cap of 50 ms made about 85 tries in 4 s (1, 2, ..., 32 ms, then 50 ms each).
TEST_F(FileLockTest, AWaiterTriesLessOftenTheLongerItWaits) {
  Result<FileLock> held = FileLock::Acquire(path_);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  LockTries tries(path_);
  SetIoFaultInjector(&tries);
  Result<FileLock> waiter = FileLock::Acquire(path_, 4s);
  SetIoFaultInjector(nullptr);
  EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_GE(tries.tries(), 10);
  EXPECT_LE(tries.tries(), 62);
}

TEST_F(FileLockTest, AWaiterGetsTheLockOnceItsHolderLetsGo) {
  std::optional<Result<FileLock>> held(FileLock::Acquire(path_));
  ASSERT_TRUE(held->ok());
  std::thread release([&] {
    std::this_thread::sleep_for(100ms);
    held.reset();
  });
  Result<FileLock> waiter = FileLock::Acquire(path_, 60s);
  release.join();
  EXPECT_TRUE(waiter.ok()) << waiter.status().ToString();
}

// The holder of a view file's lock stopped mid-build (SIGSTOP) keeps its lock for ever; a waiter
// gives up after its limit instead of hanging with it.
TEST_F(FileLockTest, AStoppedHolderDoesNotHangItsWaiter) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<FileLock> lock = FileLock::Acquire(path_);
    if (!lock.ok()) ::_exit(1);
    ::raise(SIGSTOP);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));
  Result<FileLock> waiter = FileLock::Acquire(path_, 300ms);
  EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
  ::kill(child, SIGKILL);
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // The kernel releases a dead holder's flock.
  EXPECT_TRUE(FileLock::Acquire(path_, 10s).ok());
}

}  // namespace
}  // namespace ucp
