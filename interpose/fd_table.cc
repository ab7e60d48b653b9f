#include "interpose/fd_table.h"

#include <new>

namespace ucp {

bool FdTable::IsTracked(int fd) const noexcept {
  if (fd < 0) return false;
  if (fd < kDirectFds) return MaybeTracked(fd);
  if (overflow_count_.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  return overflow_.count(fd) != 0;
}

bool FdTable::Track(int fd) noexcept {
  if (fd < 0) return false;
  if (fd < kDirectFds) {
    bits_[fd >> 6].fetch_or(uint64_t{1} << (fd & 63), std::memory_order_acq_rel);
    return true;
  }
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  try {
    if (overflow_.insert(fd).second) overflow_count_.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

bool FdTable::Untrack(int fd) noexcept {
  if (fd < 0) return false;
  if (fd < kDirectFds) {
    const uint64_t bit = uint64_t{1} << (fd & 63);
    return (bits_[fd >> 6].fetch_and(~bit, std::memory_order_acq_rel) & bit) != 0;
  }
  if (overflow_count_.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  if (overflow_.erase(fd) == 0) return false;
  overflow_count_.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

int FdTable::TakeOverflowRange(unsigned first, unsigned last, int* out, int capacity) noexcept {
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  int count = 0;
  for (auto it = overflow_.begin(); it != overflow_.end() && count < capacity;) {
    const auto fd = static_cast<unsigned>(*it);
    if (fd >= first && fd <= last) {
      out[count++] = *it;
      it = overflow_.erase(it);
      overflow_count_.fetch_sub(1, std::memory_order_relaxed);
    } else {
      ++it;
    }
  }
  return count;
}

void FdTable::Clear() noexcept {
  for (auto& word : bits_) word.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  overflow_.clear();
  overflow_count_.store(0, std::memory_order_relaxed);
}

void FdTable::LockAllFds() noexcept {
  for (auto& stripe : stripes_) stripe.lock();
}

void FdTable::UnlockAllFds() noexcept {
  for (auto& stripe : stripes_) stripe.unlock();
}

void FdTable::LockForFork() noexcept {
  LockAllFds();
  overflow_mutex_.lock();
}

void FdTable::UnlockAfterFork() noexcept {
  overflow_mutex_.unlock();
  UnlockAllFds();
}

}  // namespace ucp
