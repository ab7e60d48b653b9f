// FdTable: which file descriptors ucp tracks (the save side decided to watch them).
//
// Thread-safety: every method may be called from any thread. MaybeTracked() is lock-free and
// allocation-free: one relaxed atomic load for fds below kDirectFds, one more beyond; it is what
// every hot wrapper (write, close, lseek) asks first. Track/Untrack are atomic per fd: of two
// threads untracking the same fd, exactly one is told it was tracked.
//
// Ordering per fd number: the lifecycle of an fd number (open → tracked writes → close → the
// number reused by the next open) is reported to the observer in order only if every step that
// changes tracking runs under FdLock(fd). dispatch.cc does that: a close holds the lock from
// before the real close until after OnClose, so an open that reuses the number in another thread
// reports its OnOpenForWrite after that OnClose.
//
// Fork: the lifecycle code calls LockForFork() in the prepare handler, UnlockAfterFork() in the
// parent and the child.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_set>

namespace ucp {

class FdTable {
 public:
  // fds below this live in a bitmap; above, in a locked set (rare: ulimit -n is usually lower).
  static constexpr int kDirectFds = 1 << 16;

  FdTable() = default;
  FdTable(const FdTable&) = delete;
  FdTable& operator=(const FdTable&) = delete;

  // The process-wide table. Never destroyed (wrappers run during teardown).
  static FdTable& Get() noexcept {
    static FdTable* const table = new FdTable();
    return *table;
  }

  // False means certainly untracked. True means "look closer" (IsTracked()).
  bool MaybeTracked(int fd) const noexcept {
    if (fd < 0) return false;
    if (fd < kDirectFds) {
      return (bits_[fd >> 6].load(std::memory_order_relaxed) & (uint64_t{1} << (fd & 63))) != 0;
    }
    return overflow_count_.load(std::memory_order_relaxed) != 0;
  }

  bool IsTracked(int fd) const noexcept;
  // Marks `fd` tracked. False when it could not be recorded (negative, or out of memory).
  bool Track(int fd) noexcept;
  // Marks `fd` untracked; true when it was tracked.
  bool Untrack(int fd) noexcept;
  // Untracks every tracked fd in [first, last] (close_range's bounds) and calls
  // `on_untracked(fd)` for each, in increasing order below kDirectFds.
  template <typename Fn>
  void UntrackRange(unsigned first, unsigned last, Fn&& on_untracked) noexcept;
  // Untracks everything.
  void Clear() noexcept;

  // The lock that orders lifecycle events of one fd number (striped: fds share locks).
  std::mutex& FdLock(int fd) noexcept { return stripes_[static_cast<unsigned>(fd) % kStripes]; }

  // Every FdLock at once, in a fixed order (close_range).
  void LockAllFds() noexcept;
  void UnlockAllFds() noexcept;

  void LockForFork() noexcept;
  void UnlockAfterFork() noexcept;

 private:
  static constexpr int kWords = kDirectFds / 64;
  // LockForFork and LockAllFds hold every stripe at once (and LockForFork the overflow mutex):
  // 32 leaves room under the 64 locks one thread may hold in ThreadSanitizer's deadlock detector
  // (beyond, it aborts) for what the forking thread already holds (CPython's import lock).
  static constexpr unsigned kStripes = 32;

  // Collects the tracked overflow fds in [first, last], removing them. Returns how many it put
  // in `out` (at most `capacity`); call again while it returns `capacity`.
  int TakeOverflowRange(unsigned first, unsigned last, int* out, int capacity) noexcept;

  std::atomic<uint64_t> bits_[kWords] = {};
  std::atomic<int> overflow_count_{0};
  mutable std::mutex overflow_mutex_;
  std::unordered_set<int> overflow_;
  std::mutex stripes_[kStripes];
};

template <typename Fn>
void FdTable::UntrackRange(unsigned first, unsigned last, Fn&& on_untracked) noexcept {
  if (first > last) return;
  if (first < static_cast<unsigned>(kDirectFds)) {
    const unsigned direct_last = last < static_cast<unsigned>(kDirectFds) ? last : kDirectFds - 1;
    for (unsigned word = first / 64; word <= direct_last / 64; ++word) {
      uint64_t mask = ~uint64_t{0};
      if (word == first / 64) mask &= ~uint64_t{0} << (first % 64);
      if (word == direct_last / 64 && direct_last % 64 != 63) {
        mask &= (uint64_t{1} << (direct_last % 64 + 1)) - 1;
      }
      if ((bits_[word].load(std::memory_order_relaxed) & mask) == 0) continue;
      uint64_t taken = bits_[word].fetch_and(~mask, std::memory_order_acq_rel) & mask;
      while (taken != 0) {
        const int bit = __builtin_ctzll(taken);
        taken &= taken - 1;
        on_untracked(static_cast<int>(word * 64 + bit));
      }
    }
  }
  if (last < static_cast<unsigned>(kDirectFds) ||
      overflow_count_.load(std::memory_order_relaxed) == 0) {
    return;
  }
  constexpr int kBatch = 64;
  int batch[kBatch];
  int count = 0;
  do {
    count = TakeOverflowRange(first, last, batch, kBatch);
    for (int i = 0; i < count; ++i) on_untracked(batch[i]);
  } while (count == kBatch);
}

}  // namespace ucp
