#include "core/io/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <thread>
#include <utility>

#include "core/io/fault_injection.h"
#include "core/io/wait_backoff.h"

namespace ucp {

Result<FileLock> FileLock::Acquire(const std::string& path, std::chrono::milliseconds wait) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError("lock: open " + path, errno);
  const auto deadline = std::chrono::steady_clock::now() + wait;
  WaitBackoff backoff;
  while (true) {
    const int injected = MaybeInjectFault(IoOp::kLock, path, 0).error;
    if (injected == 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = injected != 0 ? injected : errno;
    if (err == EINTR) continue;
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
      ::close(fd);
      OwnerLease::Options options;
      options.wait = wait;
      UCP_ASSIGN_OR_RETURN(std::optional<OwnerLease> lease,
                           OwnerLease::Acquire(path + ".lease", options));
      return FileLock(std::move(*lease));
    }
    if (err != EWOULDBLOCK) {
      ::close(fd);
      return PosixError("lock: flock " + path, err);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      ::close(fd);
      return Status::FailedPrecondition(
          "lock: " + path + ": still held by another process after " +
          std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()) +
          " ms");
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(backoff.Next(now), deadline - now));
  }
  return FileLock(fd);
}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), lease_(std::move(other.lease_)) {
  other.lease_.reset();
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace ucp
