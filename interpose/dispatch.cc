#include "interpose/dispatch.h"

#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <vector>

#include "core/util/log.h"
#include "hooks/events.h"
#include "hooks/topology/cuda_device.h"
#include "hooks/topology/topology_registry.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"
#include "interpose/paths.h"
#include "interpose/real.h"

namespace ucp::dispatch {
namespace {

std::atomic<bool> g_strict{false};

// A handler broke the contract: from now on the process runs without ucp.
void Broken(const char* what, const char* why) noexcept {
  SetLayerOn(false);
  UCP_LOG_ERROR("dispatch: {} threw ({}); ucp passes everything through from now on", what, why);
}

template <typename Fn>
void Guarded(const char* what, Fn&& fn) noexcept {
  try {
    fn();
  } catch (const std::exception& e) {
    Broken(what, e.what());
  } catch (...) {
    Broken(what, "unknown exception");
  }
}

// The file behind a just-opened fd is empty: sequential writes start from byte 0.
bool IsEmpty(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && st.st_size == 0;
}

// Forgets a tracked number whose close ucp did not see. Caller holds FdLock(fd).
void ForgetStale(int fd, hooks::SaveObserver* observer) {
  if (!FdTable::Get().Untrack(fd)) return;
  UCP_LOG_DEBUG("dispatch: fd {} was reused without a close ucp saw", fd);
  if (observer != nullptr) Guarded("OnClose", [&] { observer->OnClose(fd); });
}

// The observer's cheap verdict on `path` as the host spelled it.
bool MayTrack(hooks::SaveObserver* observer, const char* path) {
  bool may = true;
  Guarded("MayTrackPath", [&] { may = observer->MayTrackPath(path); });
  return may;
}

// Offers a write-open to the observer. Caller holds FdLock(fd).
void OfferForWrite(int fd, const std::string& path, bool truncated, bool append,
                   hooks::SaveObserver* observer) {
  bool track = false;
  Guarded("OnOpenForWrite", [&] { track = observer->OnOpenForWrite(fd, path, truncated, append); });
  if (track && FdTable::Get().Track(fd)) UCP_LOG_DEBUG("dispatch: tracking fd {} ({})", fd, path);
}

}  // namespace

void SetStrict(bool strict) noexcept { g_strict.store(strict, std::memory_order_relaxed); }
bool Strict() noexcept { return g_strict.load(std::memory_order_relaxed); }

void internal::OnOpenSlow(int fd, int dirfd, const char* path, int flags) noexcept {
  ReentrancyGuard guard;
  ErrnoPreserver keep;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  FdTable& table = FdTable::Get();
  const bool offer = observer != nullptr && IsWriteOpen(flags) && MayTrack(observer, path);
  if (!offer && !table.MaybeTracked(fd)) return;
  const std::string absolute = offer ? AbsolutePath(dirfd, path) : std::string();
  std::lock_guard<std::mutex> lock(table.FdLock(fd));
  ForgetStale(fd, observer);
  if (!offer || absolute.empty()) return;
  const bool truncated = (flags & O_TRUNC) != 0 || IsEmpty(fd);
  OfferForWrite(fd, absolute, truncated, (flags & O_APPEND) != 0, observer);
}

void internal::ForgetStaleFd(int fd) noexcept {
  ReentrancyGuard guard;
  ErrnoPreserver keep;
  std::lock_guard<std::mutex> lock(FdTable::Get().FdLock(fd));
  ForgetStale(fd, hooks::GetSaveObserver());
}

bool MayWatchOpen(const char* path, int flags) noexcept {
  if (IsPlainReadOpen(flags)) return MayServePath(path);
  // A null path fails in the real call (EFAULT); other reads are neither served nor tracked.
  if (path == nullptr || !IsWriteOpen(flags)) return false;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  hooks::WriteRedirect* redirect = (flags & O_TRUNC) != 0 ? hooks::GetWriteRedirect() : nullptr;
  if (observer == nullptr && redirect == nullptr) return false;
  ReentrancyGuard guard;
  bool may = true;
  Guarded("MayWatchOpen", [&] {
    may = (observer != nullptr && observer->MayTrackPath(path)) ||
          (redirect != nullptr && redirect->MayRedirectPath(path));
  });
  return may;
}

std::string RedirectedWrite(int dirfd, const char* path, int flags) noexcept {
  hooks::WriteRedirect* redirect = hooks::GetWriteRedirect();
  // A null path fails in the real call (EFAULT).
  if (redirect == nullptr || path == nullptr || !IsWriteOpen(flags) || (flags & O_TRUNC) == 0) {
    return {};
  }
  bool may = false;
  Guarded("MayRedirectPath", [&] { may = redirect->MayRedirectPath(path); });
  if (!may) return {};
  const int saved_errno = errno;
  std::string redirected;
  Guarded("Redirect", [&] {
    const std::string absolute = AbsolutePath(dirfd, path);
    if (absolute.empty()) return;
    if (std::optional<std::string> to = redirect->Redirect(absolute)) redirected = std::move(*to);
  });
  errno = saved_errno;
  return redirected;
}

void OnRedirectFailed(int dirfd, const char* path, const std::string& redirected) noexcept {
  hooks::WriteRedirect* redirect = hooks::GetWriteRedirect();
  if (redirect == nullptr) return;
  const int saved_errno = errno;
  Guarded("RedirectFailed", [&] {
    const std::string absolute = AbsolutePath(dirfd, path);
    redirect->RedirectFailed(absolute, redirected);
  });
  errno = saved_errno;
}

void OnFdopen(int fd, int flags) noexcept {
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (fd < 0 || observer == nullptr || !IsWriteOpen(flags)) return;
  FdTable& table = FdTable::Get();
  std::lock_guard<std::mutex> lock(table.FdLock(fd));
  if (table.IsTracked(fd)) return;
  const std::string path = PathOfFd(fd);
  if (path.empty()) return;
  OfferForWrite(fd, path, IsEmpty(fd), (flags & O_APPEND) != 0, observer);
}

TrackedWrite::TrackedWrite(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                           size_t size) noexcept
    : fd_(fd) {
  Begin(offset, iov, iovcnt, size);
}

TrackedWrite::TrackedWrite(int fd, int64_t offset, const void* data, size_t size) noexcept
    : fd_(fd), single_{const_cast<void*>(data), size} {
  Begin(offset, &single_, 1, size);
}

size_t IovecBytes(const struct iovec* iov, int iovcnt) noexcept {
  size_t total = 0;
  for (int i = 0; i < iovcnt; ++i) {
    if (__builtin_add_overflow(total, iov[i].iov_len, &total)) return SIZE_MAX;
  }
  return total;
}

void TrackedWrite::Begin(int64_t offset, const struct iovec* iov, int iovcnt,
                         size_t size) noexcept {
  if (!FdTable::Get().IsTracked(fd_)) return;
  ErrnoPreserver keep;  // before the host's call: its errno must be all the host sees
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (observer == nullptr) return;
  // Set before the call: whatever OnWriteBegin did, OnWriteEnd must follow before the bytes go.
  observer_ = observer;
  Guarded("OnWriteBegin", [&] { observer->OnWriteBegin(fd_, offset, iov, iovcnt, size); });
}

TrackedWrite::~TrackedWrite() { Done(-1); }

void TrackedWrite::Done(ssize_t ret) noexcept {
  hooks::SaveObserver* observer = observer_;
  if (observer == nullptr) return;
  observer_ = nullptr;
  Guarded("OnWriteEnd", [&] { observer->OnWriteEnd(fd_, ret); });
}

off_t PositionOf(int fd) noexcept {
  if (!FdTable::Get().IsTracked(fd)) return -1;
  const int saved_errno = errno;
  const off_t position = real::lseek()(fd, 0, SEEK_CUR);
  errno = saved_errno;
  return position;
}

void OnSeek(int fd, off_t before, off_t after) noexcept {
  // A position query (lseek(fd, 0, SEEK_CUR), as std::filebuf's tellp does) is not a move.
  if (after < 0 || after == before) return;
  OnUnseenWrite(fd, 1);
}

void OnUnseenWrite(int fd, ssize_t ret) noexcept {
  if (ret <= 0 || !FdTable::Get().IsTracked(fd)) return;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (observer == nullptr) return;
  Guarded("OnNonSequential", [&] { observer->OnNonSequential(fd); });
}

void OnSync(int fd, int ret) noexcept {
  if (ret != 0 || !FdTable::Get().IsTracked(fd)) return;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (observer == nullptr) return;
  Guarded("OnSync", [&] { observer->OnSync(fd); });
}

void OnDup(int old_fd, int new_fd) noexcept {
  if (new_fd < 0 || new_fd == old_fd) return;
  FdTable& table = FdTable::Get();
  if (!table.MaybeTracked(new_fd) && !table.MaybeTracked(old_fd)) return;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  std::lock_guard<std::mutex> lock(table.FdLock(new_fd));
  ForgetStale(new_fd, observer);
  if (!table.IsTracked(old_fd) || observer == nullptr || !table.Track(new_fd)) return;
  Guarded("OnDup", [&] { observer->OnDup(old_fd, new_fd); });
}

FdRelease::FdRelease(int fd) noexcept : fd_(fd) {
  FdTable& table = FdTable::Get();
  if (!table.MaybeTracked(fd)) return;
  lock_ = std::unique_lock<std::mutex>(table.FdLock(fd));
  was_tracked_ = table.Untrack(fd);
  if (!was_tracked_) lock_.unlock();
}

void FdRelease::Closed() noexcept {
  if (!was_tracked_) return;
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (observer != nullptr) Guarded("OnClose", [&] { observer->OnClose(fd_); });
  lock_.unlock();
}

RangeRelease::RangeRelease(unsigned first, unsigned last, int flags) noexcept
    : closes_((flags & CLOSE_RANGE_CLOEXEC) == 0), first_(first), last_(last) {
  if (!closes_) return;
  FdTable& table = FdTable::Get();
  table.LockAllFds();
  int capacity = 0;
  table.UntrackRange(first_, last_, [&](int fd) {
    if (count_ == capacity) {
      const int grown = capacity == 0 ? 16 : capacity * 2;
      auto* larger =
          static_cast<int*>(std::realloc(fds_, sizeof(int) * static_cast<size_t>(grown)));
      // Out of memory: that fd's close goes unreported; its number is cleared on reuse anyway.
      if (larger == nullptr) return;
      fds_ = larger;
      capacity = grown;
    }
    fds_[count_++] = fd;
  });
}

RangeRelease::~RangeRelease() {
  if (!closes_) return;
  FdTable::Get().UnlockAllFds();
  std::free(fds_);
}

void RangeRelease::Closed(int ret) noexcept {
  if (!closes_) return;
  FdTable& table = FdTable::Get();
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  for (int i = 0; i < count_; ++i) {
    const int fd = fds_[i];
    if (ret != 0) {
      table.Track(fd);
    } else if (observer != nullptr) {
      Guarded("OnClose", [&] { observer->OnClose(fd); });
    }
  }
}

void OnRename(int from_dirfd, const char* from, int to_dirfd, const char* to, int ret) noexcept {
  hooks::SaveObserver* observer = hooks::GetSaveObserver();
  if (ret != 0 || observer == nullptr) return;
  const std::string from_path = AbsolutePath(from_dirfd, from);
  const std::string to_path = AbsolutePath(to_dirfd, to);
  if (from_path.empty() || to_path.empty()) return;
  Guarded("OnRename", [&] { observer->OnRename(from_path, to_path); });
}

bool MayServe() noexcept { return hooks::GetServePolicy() != nullptr; }

bool MayServePath(const char* path) noexcept {
  hooks::ServePolicy* policy = hooks::GetServePolicy();
  // A null path fails in the real call (EFAULT).
  if (policy == nullptr || path == nullptr) return false;
  ReentrancyGuard guard;
  bool may = true;
  Guarded("MayServePath", [&] { may = policy->MayServePath(path); });
  return may;
}

hooks::ServeDecision Resolve(int dirfd, const char* path, ServeUse use) noexcept {
  hooks::ServePolicy* policy = hooks::GetServePolicy();
  if (policy == nullptr) return {};
  const int saved_errno = errno;
  hooks::ServeDecision decision;
  const std::string absolute = AbsolutePath(dirfd, path);
  if (!absolute.empty()) {
    Guarded("Resolve", [&] {
      decision = use == ServeUse::kMetadata ? policy->ResolveMetadata(absolute)
                                            : policy->Resolve(absolute);
    });
  }
  if (decision.kind == hooks::ServeDecision::Kind::kSubstitute) {
    UCP_LOG_DEBUG("dispatch: serving {} from {}", absolute, decision.path);
  }
  errno = saved_errno;
  return decision;
}

std::optional<hooks::ListingChange> ChangeListing(int dirfd, const char* path) noexcept {
  hooks::ServePolicy* policy = hooks::GetServePolicy();
  if (policy == nullptr) return std::nullopt;
  const int saved_errno = errno;
  std::optional<hooks::ListingChange> change;
  const std::string absolute = AbsolutePath(dirfd, path);
  if (!absolute.empty()) {
    Guarded("ChangeListing", [&] { change = policy->ChangeListing(absolute); });
  }
  errno = saved_errno;
  return change;
}

void OnNcclUniqueId(const void* id, size_t size) noexcept {
  Guarded("OnNcclUniqueId", [&] {
    hooks::TopologyRegistry::Global().RecordGeneratedUniqueId(
        {static_cast<const std::byte*>(id), size});
  });
}

void OnNcclInit(uintptr_t comm, hooks::CommOrigin origin, int nranks, int rank, const void* ids,
                size_t size) noexcept {
  Guarded("OnNcclInit", [&] {
    hooks::TopologyRegistry::Global().RecordInit(comm, origin, nranks, rank,
                                                 {static_cast<const std::byte*>(ids), size},
                                                 hooks::CurrentCudaDevice());
  });
}

void OnNcclInitAll(const uintptr_t* comms, int ndev, const int* devlist) noexcept {
  Guarded("OnNcclInitAll", [&] {
    const auto count = static_cast<size_t>(ndev);
    std::vector<int> devices(count);
    for (size_t i = 0; i < count; ++i) {
      devices[i] = devlist != nullptr ? devlist[i] : static_cast<int>(i);
    }
    hooks::TopologyRegistry::Global().RecordInitAll({comms, count}, devices);
  });
}

void OnNcclSplit(uintptr_t parent, int color, int key, uintptr_t child) noexcept {
  Guarded("OnNcclSplit", [&] {
    hooks::TopologyRegistry::Global().RecordSplit(parent, color, key, child,
                                                  hooks::CurrentCudaDevice());
  });
}

void OnNcclSplitResolved(uintptr_t child, int nranks, int rank) noexcept {
  Guarded("OnNcclSplitResolved",
          [&] { hooks::TopologyRegistry::Global().ResolveSplit(child, nranks, rank); });
}

std::optional<uint64_t> NcclCommOrder(uintptr_t comm) noexcept {
  std::optional<uint64_t> order;
  Guarded("NcclCommOrder", [&] {
    if (const auto record = hooks::TopologyRegistry::Global().Find(comm)) order = record->order;
  });
  return order;
}

void OnNcclEnd(uint64_t order, hooks::CommState state) noexcept {
  Guarded("OnNcclEnd", [&] { hooks::TopologyRegistry::Global().RecordEnd(order, state); });
}

}  // namespace ucp::dispatch
