#include "interpose/dispatch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/close_range.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "hooks/events.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"

namespace ucp::dispatch {
namespace {

// Records every event as a line; tracks write-opens under `prefix`.
class Recorder : public hooks::SaveObserver {
 public:
  explicit Recorder(std::string prefix) : prefix_(std::move(prefix)) {}

  // The pre-check turns away ".log" files, as the save tracker turns away names no layout knows.
  bool MayTrackPath(std::string_view path) override { return !path.ends_with(".log"); }
  bool OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) override {
    Add("open " + std::to_string(fd) + " " + std::string(path) + (truncated ? " trunc" : "") +
        (append ? " append" : ""));
    return path.substr(0, prefix_.size()) == prefix_;
  }
  void OnWriteBegin(int fd, int64_t offset, const struct iovec*, int iovcnt, size_t size) override {
    Add("begin " + std::to_string(fd) + " " + std::to_string(offset) + " " +
        std::to_string(iovcnt) + " " + std::to_string(size));
  }
  void OnWriteEnd(int fd, ssize_t ret) override {
    Add("end " + std::to_string(fd) + " " + std::to_string(ret));
  }
  void OnNonSequential(int fd) override { Add("nonseq " + std::to_string(fd)); }
  void OnDup(int old_fd, int new_fd) override {
    Add("dup " + std::to_string(old_fd) + " " + std::to_string(new_fd));
  }
  void OnClose(int fd) override { Add("close " + std::to_string(fd)); }
  void OnSync(int fd) override { Add("sync " + std::to_string(fd)); }
  void OnRename(std::string_view from, std::string_view to) override {
    Add("rename " + std::string(from) + " " + std::string(to));
  }

  std::vector<std::string> Take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(events_);
  }

 private:
  void Add(std::string event) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(event));
  }

  const std::string prefix_;
  std::mutex mutex_;
  std::vector<std::string> events_;
};

// A write-like host call of `data` on `fd` that returned `ret`, as the wrappers bracket it.
void Write(int fd, int64_t offset, std::string_view data, ssize_t ret) {
  TrackedWrite write(fd, offset, data.data(), data.size());
  write.Done(ret);
}

class DispatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ucp_dispatch_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    recorder_ = std::make_unique<Recorder>(dir_ + "/");
    FdTable::Get().Clear();
    hooks::SetSaveObserver(recorder_.get());
  }
  void TearDown() override {
    hooks::SetSaveObserver(nullptr);
    hooks::SetServePolicy(nullptr);
    hooks::SetWriteRedirect(nullptr);
    FdTable::Get().Clear();
    SetStrict(false);
    std::system(("rm -rf " + dir_).c_str());
  }

  // Opens `name` in the temp dir for writing and dispatches it like the open wrapper does.
  int OpenForWrite(const std::string& name, int extra_flags = 0) {
    const int flags = O_WRONLY | O_CREAT | extra_flags;
    const int fd = ::open((dir_ + "/" + name).c_str(), flags, 0644);
    OnOpen(fd, AT_FDCWD, (dir_ + "/" + name).c_str(), flags);
    return fd;
  }
  // Closes like the close wrapper does.
  static void Close(int fd) {
    FdRelease release(fd);
    ::close(fd);
    release.Closed();
  }
  static std::string N(int fd) { return std::to_string(fd); }

  std::string dir_;
  std::unique_ptr<Recorder> recorder_;
};

TEST_F(DispatchTest, WriteOpenIsOfferedWithAnAbsoluteNormalisedPath) {
  ASSERT_EQ(::mkdir((dir_ + "/sub").c_str(), 0755), 0);
  const int dirfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
  const int fd = ::openat(dirfd, "sub/.././/a.pt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  OnOpen(fd, dirfd, "sub/.././/a.pt", O_WRONLY | O_CREAT | O_TRUNC);
  EXPECT_EQ(recorder_->Take(),
            std::vector<std::string>{"open " + N(fd) + " " + dir_ + "/a.pt trunc"});
  EXPECT_TRUE(FdTable::Get().IsTracked(fd));
  Close(fd);
  EXPECT_EQ(recorder_->Take(), std::vector<std::string>{"close " + N(fd)});

  // Appending to a non-empty file is neither truncated nor tracked from byte 0.
  ::close(::open((dir_ + "/log").c_str(), O_WRONLY | O_CREAT, 0644));
  ASSERT_EQ(::truncate((dir_ + "/log").c_str(), 3), 0);
  const int log_fd = ::openat(dirfd, "log", O_WRONLY | O_APPEND);
  OnOpen(log_fd, dirfd, "log", O_WRONLY | O_APPEND);
  EXPECT_EQ(recorder_->Take(),
            std::vector<std::string>{"open " + N(log_fd) + " " + dir_ + "/log append"});
  Close(log_fd);
  recorder_->Take();

  // Read-only opens are not offered.
  const int read_fd = ::openat(dirfd, "a.pt", O_RDONLY);
  OnOpen(read_fd, dirfd, "a.pt", O_RDONLY);
  EXPECT_TRUE(recorder_->Take().empty());
  EXPECT_FALSE(FdTable::Get().MaybeTracked(read_fd));
  ::close(read_fd);
  ::close(dirfd);
}

TEST_F(DispatchTest, UntrackedFilesReportNothingButTheirOpen) {
  Recorder outside("/nonexistent-prefix/");
  hooks::SetSaveObserver(&outside);
  const int fd = OpenForWrite("x");
  Write(fd, -1, "abc", 3);
  Close(fd);
  EXPECT_EQ(outside.Take(), std::vector<std::string>{"open " + N(fd) + " " + dir_ + "/x trunc"});
}

TEST_F(DispatchTest, WritesOfTrackedFds) {
  const int fd = OpenForWrite("w.pt");
  Write(fd, -1, "abc", 3);
  Write(fd, -1, "abc", -1);
  Write(fd, 4096, "abc", 2);
  struct iovec iov[2] = {{const_cast<char*>("ab"), 2}, {const_cast<char*>("cd"), 2}};
  {
    TrackedWrite vectored(fd, -1, iov, 2, IovecBytes(iov, 2));
    vectored.Done(3);
  }
  {
    TrackedWrite abandoned(fd, -1, "xy", 2);  // never Done: the observer hears of no bytes
  }
  OnSync(fd, 0);
  OnSync(fd, -1);
  OnUnseenWrite(fd, 10);
  OnUnseenWrite(fd, 0);
  Close(fd);
  EXPECT_EQ(recorder_->Take(),
            (std::vector<std::string>{
                "open " + N(fd) + " " + dir_ + "/w.pt trunc", "begin " + N(fd) + " -1 1 3",
                "end " + N(fd) + " 3", "begin " + N(fd) + " -1 1 3", "end " + N(fd) + " -1",
                "begin " + N(fd) + " 4096 1 3", "end " + N(fd) + " 2", "begin " + N(fd) + " -1 2 4",
                "end " + N(fd) + " 3", "begin " + N(fd) + " -1 1 2", "end " + N(fd) + " -1",
                "sync " + N(fd), "nonseq " + N(fd), "close " + N(fd)}));
}

TEST_F(DispatchTest, PositionQueriesAreNotMoves) {
  const int fd = OpenForWrite("s.pt");
  ASSERT_EQ(::write(fd, "hello", 5), 5);
  recorder_->Take();
  off_t before = PositionOf(fd);
  EXPECT_EQ(before, 5);
  OnSeek(fd, before, ::lseek(fd, 0, SEEK_CUR));
  OnSeek(fd, before, ::lseek(fd, 5, SEEK_SET));
  OnSeek(fd, before, -1);
  EXPECT_TRUE(recorder_->Take().empty());
  before = PositionOf(fd);
  OnSeek(fd, before, ::lseek(fd, 1, SEEK_SET));
  EXPECT_EQ(recorder_->Take(), std::vector<std::string>{"nonseq " + N(fd)});
  Close(fd);
}

TEST_F(DispatchTest, DupChainsFollowTheOpenFile) {
  const int a = OpenForWrite("d.pt");
  const int b = ::dup(a);
  OnDup(a, b);
  const int c = ::fcntl(b, F_DUPFD_CLOEXEC, 100);
  OnDup(b, c);
  EXPECT_GE(c, 100);
  Close(a);
  EXPECT_FALSE(FdTable::Get().IsTracked(a));
  EXPECT_TRUE(FdTable::Get().IsTracked(b));
  EXPECT_TRUE(FdTable::Get().IsTracked(c));
  Write(c, -1, "x", 1);
  Close(b);
  Close(c);
  EXPECT_EQ(recorder_->Take(),
            (std::vector<std::string>{"open " + N(a) + " " + dir_ + "/d.pt trunc",
                                      "dup " + N(a) + " " + N(b), "dup " + N(b) + " " + N(c),
                                      "close " + N(a), "begin " + N(c) + " -1 1 1",
                                      "end " + N(c) + " 1", "close " + N(b), "close " + N(c)}));
}

TEST_F(DispatchTest, DupOfAnUntrackedFdOntoATrackedOneClosesIt) {
  const int tracked = OpenForWrite("t.pt");
  const int other = ::open("/dev/null", O_RDONLY);
  recorder_->Take();
  ASSERT_EQ(::dup2(other, tracked), tracked);
  OnDup(other, tracked);
  EXPECT_EQ(recorder_->Take(), std::vector<std::string>{"close " + N(tracked)});
  EXPECT_FALSE(FdTable::Get().IsTracked(tracked));
  OnDup(tracked, tracked);  // dup2(fd, fd) changes nothing
  EXPECT_TRUE(recorder_->Take().empty());
  ::close(other);
  ::close(tracked);
}

TEST_F(DispatchTest, Dup2BetweenTrackedFds) {
  const int x = OpenForWrite("x.pt");
  const int y = OpenForWrite("y.pt");
  recorder_->Take();
  ASSERT_EQ(::dup3(x, y, O_CLOEXEC), y);
  OnDup(x, y);
  EXPECT_EQ(recorder_->Take(),
            (std::vector<std::string>{"close " + N(y), "dup " + N(x) + " " + N(y)}));
  Close(x);
  Close(y);
}

TEST_F(DispatchTest, AReusedNumberForgetsItsStaleState) {
  const int fd = OpenForWrite("stale.pt");
  ::close(fd);  // a close ucp does not see (a raw syscall, glibc internals)
  const int again = ::open("/dev/null", O_RDONLY);
  ASSERT_EQ(again, fd);
  OnOpen(again, AT_FDCWD, "/dev/null", O_RDONLY);
  EXPECT_EQ(recorder_->Take(),
            (std::vector<std::string>{"open " + N(fd) + " " + dir_ + "/stale.pt trunc",
                                      "close " + N(fd)}));
  EXPECT_FALSE(FdTable::Get().MaybeTracked(again));
  Write(again, -1, "x", 1);
  EXPECT_TRUE(recorder_->Take().empty());
  ::close(again);
}

// Redirects nothing, but its pre-check admits names ending in "latest".
class LatestRedirect : public hooks::WriteRedirect {
 public:
  bool MayRedirectPath(std::string_view path) override { return path.ends_with("latest"); }
  std::optional<std::string> Redirect(std::string_view) override { return std::nullopt; }
  void RedirectFailed(std::string_view, std::string_view) override {}
};

TEST_F(DispatchTest, OpensNoHandlerMayWantPassThrough) {
  const int write = O_WRONLY | O_CREAT | O_TRUNC;
  EXPECT_TRUE(MayWatchOpen("ckpt/a.pt", write));
  EXPECT_TRUE(MayWatchOpen("ckpt/a.pt", O_RDWR));
  EXPECT_FALSE(MayWatchOpen("ckpt/train.log", write));
  EXPECT_FALSE(MayWatchOpen(nullptr, write));
  // Reads are the serve policy's: none is installed.
  EXPECT_FALSE(MayWatchOpen("ckpt/a.pt", O_RDONLY));
  // Reads that are not plain are neither served nor tracked.
  EXPECT_FALSE(MayWatchOpen("ckpt/a.pt", O_RDONLY | O_CREAT));

  // Without a save observer only a truncating open the redirect may want is watched.
  hooks::SetSaveObserver(nullptr);
  EXPECT_FALSE(MayWatchOpen("ckpt/a.pt", write));
  LatestRedirect redirect;
  hooks::SetWriteRedirect(&redirect);
  EXPECT_TRUE(MayWatchOpen("ckpt/latest", write));
  EXPECT_FALSE(MayWatchOpen("ckpt/latest", O_WRONLY | O_APPEND));
  EXPECT_FALSE(MayWatchOpen("ckpt/a.pt", write));
}

TEST_F(DispatchTest, AnOpenPassedThroughForgetsTheStaleStateOfItsNumber) {
  const int fd = OpenForWrite("stale.pt");
  ::close(fd);  // a close ucp does not see
  const int again = ::open((dir_ + "/train.log").c_str(), O_WRONLY | O_CREAT, 0644);
  ASSERT_EQ(again, fd);
  OnOpenPassedThrough(again);
  EXPECT_EQ(recorder_->Take(),
            (std::vector<std::string>{"open " + N(fd) + " " + dir_ + "/stale.pt trunc",
                                      "close " + N(fd)}));
  EXPECT_FALSE(FdTable::Get().MaybeTracked(again));
  OnOpenPassedThrough(again);  // an untracked number: nothing to say
  OnOpenPassedThrough(-1);
  EXPECT_TRUE(recorder_->Take().empty());
  ::close(again);
}

TEST_F(DispatchTest, CloseRangeReportsTheTrackedFdsItClosed) {
  const int base = OpenForWrite("r.pt");
  for (int fd : {500, 502, 504, 506}) ASSERT_EQ(::fcntl(base, F_DUPFD, fd), fd);
  OnDup(base, 502);
  OnDup(base, 506);
  Close(base);
  recorder_->Take();
  {
    RangeRelease release(502, 505, CLOSE_RANGE_CLOEXEC);
    release.Closed(::close_range(502, 505, CLOSE_RANGE_CLOEXEC));
  }
  EXPECT_TRUE(recorder_->Take().empty());
  EXPECT_TRUE(FdTable::Get().IsTracked(502));
  {
    RangeRelease release(502, 505, 0);
    release.Closed(::close_range(502, 505, 0));
  }
  EXPECT_EQ(recorder_->Take(), std::vector<std::string>{"close 502"});
  EXPECT_EQ(::fcntl(502, F_GETFD), -1);
  EXPECT_EQ(::fcntl(504, F_GETFD), -1);
  EXPECT_TRUE(FdTable::Get().IsTracked(506));
  {
    RangeRelease release(506, 400, 0);  // EINVAL: nothing closed, nothing forgotten
    release.Closed(::close_range(506, 400, 0));
  }
  EXPECT_TRUE(FdTable::Get().IsTracked(506));
  ::close(500);
  Close(506);
  EXPECT_EQ(recorder_->Take(), std::vector<std::string>{"close 506"});
}

TEST_F(DispatchTest, RenamesAreReportedWithAbsolutePaths) {
  const std::string from = dir_ + "/.metadata.tmp";
  ::close(::open(from.c_str(), O_WRONLY | O_CREAT, 0644));
  const int dirfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
  OnRename(dirfd, ".metadata.tmp", dirfd, "./.metadata",
           ::renameat(dirfd, ".metadata.tmp", dirfd, ".metadata"));
  OnRename(dirfd, "missing", dirfd, "other", ::renameat(dirfd, "missing", dirfd, "other"));
  EXPECT_EQ(recorder_->Take(),
            std::vector<std::string>{"rename " + from + " " + dir_ + "/.metadata"});
  ::close(dirfd);
}

class ThrowingObserver : public Recorder {
 public:
  using Recorder::Recorder;
  void OnWriteBegin(int, int64_t, const struct iovec*, int, size_t) override {
    throw std::runtime_error("boom");
  }
};

TEST_F(DispatchTest, AThrowingHandlerSwitchesTheLayerOff) {
  ThrowingObserver throwing(dir_ + "/");
  hooks::SetSaveObserver(&throwing);
  SetLayerOn(true);
  const int fd = OpenForWrite("boom.pt");
  EXPECT_TRUE(InterceptGate());
  errno = EINTR;
  Write(fd, -1, "x", 1);
  EXPECT_FALSE(InterceptGate());
  Close(fd);
}

class MapPolicy : public hooks::ServePolicy {
 public:
  std::map<std::string, std::string> map;
  hooks::ServeDecision Resolve(std::string_view path) override {
    const auto it = map.find(std::string(path));
    if (it == map.end()) return {};
    return {hooks::ServeDecision::Kind::kSubstitute, it->second};
  }
  std::optional<hooks::ListingChange> ChangeListing(std::string_view) override {
    return std::nullopt;
  }
};

TEST_F(DispatchTest, ServedCallsUseTheSubstitute) {
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  ::close(::open(a.c_str(), O_WRONLY | O_CREAT, 0644));
  ::close(::open(b.c_str(), O_WRONLY | O_CREAT, 0644));
  ASSERT_EQ(::truncate(b.c_str(), 42), 0);
  auto size_of = [](const char* path) {
    struct stat st;
    return ::stat(path, &st) == 0 ? st.st_size : -1;
  };
  auto failed = [](off_t ret) { return ret < 0; };
  EXPECT_EQ(Served(AT_FDCWD, a.c_str(), size_of, failed, off_t{-1}), 0);
  MapPolicy policy;
  policy.map[a] = b;
  policy.map[dir_ + "/gone"] = dir_ + "/missing";
  hooks::SetServePolicy(&policy);
  const int dirfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
  EXPECT_EQ(Served(AT_FDCWD, a.c_str(), size_of, failed, off_t{-1}), 42);
  errno = 0;
  EXPECT_EQ(Resolve(dirfd, "./a").path, b);
  EXPECT_EQ(errno, 0);
  // A substitute that fails falls back to the original (here: missing too, so ENOENT).
  errno = 0;
  EXPECT_EQ(Served(AT_FDCWD, (dir_ + "/gone").c_str(), size_of, failed, off_t{-1}), -1);
  EXPECT_EQ(errno, ENOENT);
  SetStrict(true);
  EXPECT_EQ(Served(AT_FDCWD, (dir_ + "/gone").c_str(), size_of, failed, off_t{-1}), -1);
  EXPECT_EQ(errno, EIO);
  ::close(dirfd);
}

TEST_F(DispatchTest, ConcurrentOpensAndClosesReportEachNumberInOrder) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Appended, not `"c" + std::to_string(t)`: g++ 12 at -O3 warns falsely (-Wrestrict) on it.
      const std::string name = std::string("c").append(std::to_string(t));
      for (int i = 0; i < kRounds; ++i) {
        const int fd = OpenForWrite(name, O_TRUNC);
        Write(fd, -1, "x", 1);
        if (i % 3 == 0) {
          const int copy = ::dup(fd);
          OnDup(fd, copy);
          Close(copy);
        }
        Close(fd);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  // For every fd number: open/dup-into, then only writes, then its close, and so on.
  std::map<int, bool> open;
  int opens = 0;
  for (const std::string& event : recorder_->Take()) {
    const size_t space = event.find(' ');
    const std::string kind = event.substr(0, space);
    const int fd = std::stoi(event.substr(space + 1));
    if (kind == "open") {
      EXPECT_FALSE(open[fd]) << event;
      open[fd] = true;
      ++opens;
    } else if (kind == "dup") {
      const int new_fd = std::stoi(event.substr(event.rfind(' ') + 1));
      EXPECT_TRUE(open[fd]) << event;
      EXPECT_FALSE(open[new_fd]) << event;
      open[new_fd] = true;
    } else if (kind == "close") {
      EXPECT_TRUE(open[fd]) << event;
      open[fd] = false;
    } else {
      EXPECT_TRUE(open[fd]) << event;
    }
  }
  EXPECT_EQ(opens, kThreads * kRounds);
  for (const auto& [fd, is_open] : open) EXPECT_FALSE(is_open) << fd;
}

}  // namespace
}  // namespace ucp::dispatch
