#include "core/io/file_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>

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
