// FileLock: an exclusive flock(2) on a lock file, held while the object lives. It excludes other
// processes, and other threads of the same process too: each holder opens its own descriptor.
// Acquiring waits for a time limit, never for ever: a holder that hangs (a stopped process, a
// wedged file system) costs its waiters that long and then an error, not a hung trainer.
//
// Thread-safety: a FileLock is owned by one thread; any number may Acquire the same path.
#pragma once

#include <chrono>
#include <string>

#include "core/util/status.h"

namespace ucp {

// How long ucp's own locks are waited for: as long as the index builder waits for a save's files,
// and longer than a holder works (building one view file, writing one index).
inline constexpr std::chrono::milliseconds kLockWaitLimit = std::chrono::minutes(10);

class FileLock {
 public:
  // Opens `path` (creating it, mode 0644) and takes the lock, retrying with backoff (1 ms doubling
  // to 50 ms) while another descriptor holds it, for at most `wait`; then kFailedPrecondition
  // naming the path and the wait.
  [[nodiscard]] static Result<FileLock> Acquire(const std::string& path,
                                                std::chrono::milliseconds wait = kLockWaitLimit);

  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&&) = delete;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  // Closing the only descriptor of the open file releases the lock.
  ~FileLock();

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace ucp
