// Tests core/io/owner_lease.cc, and FileLock's use of it where flock(2) is missing: one owner of a
// shared build among processes, a dead owner taken over at once, a hung one after stale_after,
// and never a wait without a limit.
#include "core/io/owner_lease.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "core/io/fault_injection.h"
#include "core/io/file_lock.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using namespace std::chrono_literals;

class OwnerLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (testing::ScratchDirectory("owner_lease") / "file.lease").string();
  }
  // A child process that takes the lease, reports it through a pipe, then does `then`.
  pid_t ForkOwner(void (*then)()) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(fds[0]);
      OwnerLease::Options options;
      options.heartbeat = 20ms;
      Result<std::optional<OwnerLease>> lease = OwnerLease::Acquire(path_, options);
      const char ok = lease.ok() && lease->has_value() ? 'y' : 'n';
      (void)::write(fds[1], &ok, 1);
      then();
      ::_exit(0);
    }
    ::close(fds[1]);
    char ok = 0;
    EXPECT_EQ(::read(fds[0], &ok, 1), 1);
    ::close(fds[0]);
    EXPECT_EQ(ok, 'y');
    return child;
  }
  std::string path_;
};

TEST_F(OwnerLeaseTest, OneOwnerAtATimeAndTheFileGoesWithIt) {
  OwnerLease::Options options;
  options.wait = 200ms;
  Result<std::optional<OwnerLease>> first = OwnerLease::Acquire(path_, options);
  ASSERT_TRUE(first.ok() && first->has_value()) << first.status().ToString();
  EXPECT_TRUE(std::filesystem::exists(path_));
  Result<std::optional<OwnerLease>> second = OwnerLease::Acquire(path_, options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("still held by "), std::string::npos);
  first->reset();
  EXPECT_FALSE(std::filesystem::exists(path_));
  EXPECT_TRUE(OwnerLease::Acquire(path_, options).ok());
}

TEST_F(OwnerLeaseTest, AWaiterStopsWaitingWhenTheWorkIsDone) {
  Result<std::optional<OwnerLease>> owner = OwnerLease::Acquire(path_, {});
  ASSERT_TRUE(owner.ok() && owner->has_value());
  std::atomic<bool> built{false};
  std::thread builder([&] {
    std::this_thread::sleep_for(100ms);
    built = true;
  });
  OwnerLease::Options options;
  options.wait = 30s;
  const auto begin = std::chrono::steady_clock::now();
  Result<std::optional<OwnerLease>> waiter =
      OwnerLease::Acquire(path_, options, [&] { return built.load(); });
  builder.join();
  ASSERT_TRUE(waiter.ok());
  EXPECT_FALSE(waiter->has_value());  // no lease: someone else did the work
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 10s);
}

// A waiter looks at the lease less often the longer it waits: about 55 looks in 4 s (a twentieth
// of the time waited, after 1 s at 50 ms), where a fixed 50 ms pause made about 86.
TEST_F(OwnerLeaseTest, AWaiterLooksLessOftenTheLongerItWaits) {
  Result<std::optional<OwnerLease>> owner = OwnerLease::Acquire(path_, {});
  ASSERT_TRUE(owner.ok() && owner->has_value());
  const auto looks_in = [&](std::chrono::milliseconds max_poll) {
    OwnerLease::Options options;
    options.wait = 4s;
    options.max_poll = max_poll;
    int looks = 0;
    Result<std::optional<OwnerLease>> waiter = OwnerLease::Acquire(path_, options, [&] {
      ++looks;
      return false;
    });
    EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
    return looks;
  };
  const int growing = looks_in(2s);
  const int fixed = looks_in(50ms);  // the pause of before
  EXPECT_GE(growing, 10);
  EXPECT_LE(growing, 62);
  EXPECT_LT(growing * 5, fixed * 4);
}

// The owner killed mid-build (SIGKILL: no destructor) leaves its lease file; a waiter on the same
// host sees its pid gone and takes over at once, not after stale_after.
TEST_F(OwnerLeaseTest, AKilledOwnerIsTakenOverAtOnce) {
  const pid_t child = ForkOwner([] { ::raise(SIGKILL); });
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_TRUE(std::filesystem::exists(path_));
  OwnerLease::Options options;
  options.wait = 30s;
  options.stale_after = 20s;
  const auto begin = std::chrono::steady_clock::now();
  Result<std::optional<OwnerLease>> waiter = OwnerLease::Acquire(path_, options);
  ASSERT_TRUE(waiter.ok() && waiter->has_value()) << waiter.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 5s);
}

// A hung owner (SIGSTOP: its heartbeat stops with it) is taken over once its lease has not
// changed for stale_after; the owner, resumed, finds the lease lost.
TEST_F(OwnerLeaseTest, AStoppedOwnerIsTakenOverAfterStaleAfter) {
  const pid_t child = ForkOwner([] {
    ::raise(SIGSTOP);
    ::_exit(0);
  });
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));
  OwnerLease::Options options;
  options.wait = 30s;
  options.stale_after = 400ms;
  const auto begin = std::chrono::steady_clock::now();
  Result<std::optional<OwnerLease>> waiter = OwnerLease::Acquire(path_, options);
  const auto waited = std::chrono::steady_clock::now() - begin;
  ASSERT_TRUE(waiter.ok() && waiter->has_value()) << waiter.status().ToString();
  EXPECT_GE(waited, 400ms);
  EXPECT_LT(waited, 10s);
  ::kill(child, SIGKILL);
  ASSERT_EQ(::waitpid(child, &status, 0), child);
}

// A live owner's heartbeat keeps its lease from looking stale, however long it works.
TEST_F(OwnerLeaseTest, ALiveOwnerIsNotTakenOver) {
  const pid_t child = ForkOwner([] { std::this_thread::sleep_for(1500ms); });
  OwnerLease::Options options;
  options.wait = 800ms;
  options.stale_after = 300ms;  // longer than the owner's 20 ms heartbeat
  Result<std::optional<OwnerLease>> waiter = OwnerLease::Acquire(path_, options);
  EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
}

TEST_F(OwnerLeaseTest, AnOwnerWhoseLeaseWasTakenFindsItLost) {
  OwnerLease::Options options;
  options.heartbeat = 20ms;
  Result<std::optional<OwnerLease>> owner = OwnerLease::Acquire(path_, options);
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_FALSE((*owner)->lost());
  std::filesystem::remove(path_);
  std::ofstream(path_) << "elsewhere 1 other";
  for (int i = 0; i < 200 && !(*owner)->lost(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE((*owner)->lost());
  owner->reset();
  EXPECT_TRUE(std::filesystem::exists(path_));  // the other owner's lease stays
}

// flock failing as unsupported (ENOLCK: Lustre's noflock, BeeGFS): FileLock is the lease.
class NoFlock : public IoFaultInjector {
 public:
  IoFault Decide(IoPhase, IoOp op, std::string_view, size_t) noexcept override {
    return op == IoOp::kLock ? IoFault{ENOLCK} : IoFault{};
  }
};

TEST_F(OwnerLeaseTest, FileLockWithoutFlockExcludesThroughTheLease) {
  NoFlock no_flock;
  SetIoFaultInjector(&no_flock);
  const std::string lock_path = path_ + ".lock";
  {
    Result<FileLock> held = FileLock::Acquire(lock_path);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    EXPECT_TRUE(held->is_lease());
    EXPECT_TRUE(std::filesystem::exists(lock_path + ".lease"));
    Result<FileLock> second = FileLock::Acquire(lock_path, 200ms);
    EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_FALSE(std::filesystem::exists(lock_path + ".lease"));
  EXPECT_TRUE(FileLock::Acquire(lock_path, 1s).ok());
  SetIoFaultInjector(nullptr);
  Result<FileLock> with_flock = FileLock::Acquire(lock_path);
  ASSERT_TRUE(with_flock.ok());
  EXPECT_FALSE(with_flock->is_lease());
}

}  // namespace
}  // namespace ucp
