// FileLock: an exclusive lock on a lock file, held while the object lives. It excludes other
// processes, and other threads of the same process too: each holder opens its own descriptor.
// Acquiring waits for a time limit, never for ever: a holder that hangs (a stopped process, a
// wedged file system) costs its waiters that long and then an error, not a hung trainer.
//
// The lock is flock(2) where the file system has it. Where flock fails as unsupported (ENOLCK,
// EOPNOTSUPP, ENOSYS, EINVAL: Lustre mounted noflock, BeeGFS by default) the lock is an
// OwnerLease on "<path>.lease" instead, which also takes over from a dead or hung holder; its
// rare double ownership (owner_lease.h) is harmless to ucp's users of FileLock, which replace
// whole files by renaming identical contents into place.
//
// Thread-safety: a FileLock is owned by one thread; any number may Acquire the same path.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "core/io/owner_lease.h"
#include "core/util/status.h"

namespace ucp {

// How long ucp's own locks are waited for: as long as the index builder waits for a save's files,
// and longer than a holder works (building one view file, writing one index).
inline constexpr std::chrono::milliseconds kLockWaitLimit = std::chrono::minutes(10);

class FileLock {
 public:
  // Opens `path` (creating it, mode 0644) and takes the lock, retrying while another holder has
  // it with WaitBackoff's pauses (every rank of a job takes a view's lock, to see the view's
  // files made), for at most `wait`; then kFailedPrecondition naming the path and the wait.
  [[nodiscard]] static Result<FileLock> Acquire(const std::string& path,
                                                std::chrono::milliseconds wait = kLockWaitLimit);

  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&&) = delete;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  // Closing the only descriptor of the open file releases the flock; a lease is released by its
  // own destructor.
  ~FileLock();

  // Whether the lock is the lease that stands in for a missing flock.
  bool is_lease() const { return lease_.has_value(); }

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  explicit FileLock(OwnerLease lease) : fd_(-1), lease_(std::move(lease)) {}
  int fd_;
  std::optional<OwnerLease> lease_;
};

}  // namespace ucp
