// FileLock: an exclusive flock(2) on a lock file, held while the object lives. It excludes other
// processes, and other threads of the same process too: each holder opens its own descriptor.
//
// Thread-safety: a FileLock is owned by one thread; any number may Acquire the same path.
#pragma once

#include <string>

#include "core/util/status.h"

namespace ucp {

class FileLock {
 public:
  // Opens `path` (creating it, mode 0644) and blocks until the lock is held.
  [[nodiscard]] static Result<FileLock> Acquire(const std::string& path);

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
