// OwnerLease: one owner, among processes on one node or many, of a piece of shared work (building
// one view file), without flock(2): flock is missing on some cluster file systems (Lustre mounted
// noflock, BeeGFS by default) and per node on others (Lustre localflock, NFS local_lock), where it
// excludes nothing across nodes.
//
// The lease is a file created with O_CREAT|O_EXCL, which the file system decides once for all
// nodes, holding "<host> <pid> <nonce>". While it is held, a heartbeat thread rewrites its
// modification time every `heartbeat`. A waiter takes the lease over when its owner is dead (on
// the waiter's host, its pid is gone) or hung (the lease has not changed for `stale_after` on the
// waiter's own monotonic clock: no clocks of two nodes are compared): it renames the lease aside
// to a name of its own and creates a fresh one. Two waiters that judge the same stale owner at once
// may both take over, or one may move aside the other's fresh lease, which that owner finds at its
// next heartbeat (lost()); the lease makes shared work happen once in the common case, and its
// users stay correct when it happens twice (a view file is built under a temporary name and
// renamed: identical bytes either way).
//
// Thread-safety: a lease is owned by one thread; any number may Acquire the same path.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "core/io/wait_backoff.h"
#include "core/util/status.h"

namespace ucp {

class OwnerLease {
 public:
  struct Options {
    // How long Acquire waits in all, as FileLock does (kLockWaitLimit).
    std::chrono::milliseconds wait = std::chrono::minutes(10);
    std::chrono::milliseconds heartbeat = std::chrono::seconds(1);
    // A lease unchanged for this long belongs to a hung or dead owner.
    std::chrono::milliseconds stale_after = std::chrono::seconds(30);
    // The longest pause between a waiter's looks at the lease (WaitBackoff).
    std::chrono::milliseconds max_poll = kMaxPoll;
  };

  // Takes the lease at `path` (creating it, mode 0644), waiting with backoff while a live owner
  // holds it and taking over a dead or hung one, its pauses between looks WaitBackoff's (the end
  // of a build seen at most about 5% late; the thousands of ranks of a job waiting minutes for
  // one owner, the model states of a large model, look about once per `max_poll` each). `done` (may
  // be empty) is asked between tries: when it says the work is finished, Acquire returns nullopt
  // without the lease. kFailedPrecondition naming the path, the owner and the wait after
  // `options.wait`; a system error creating the lease otherwise.
  [[nodiscard]] static Result<std::optional<OwnerLease>> Acquire(
      const std::string& path, const Options& options, const std::function<bool()>& done = {});

  OwnerLease(OwnerLease&& other) noexcept;
  OwnerLease& operator=(OwnerLease&&) = delete;
  OwnerLease(const OwnerLease&) = delete;
  OwnerLease& operator=(const OwnerLease&) = delete;
  // Stops the heartbeat and removes the lease file if it is still this owner's.
  ~OwnerLease();

  // Whether the heartbeat found the lease file gone or another owner's (taken over).
  bool lost() const;

 private:
  struct State;
  explicit OwnerLease(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// "<host> <pid> <nonce>", this process's lease record with a fresh nonce.
std::string NewLeaseRecord();

}  // namespace ucp
