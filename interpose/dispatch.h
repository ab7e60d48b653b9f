// The one bridge from the libc wrappers into hooks/ (hooks/events.h).
//
// Call order and context: wrappers call these only after InterceptGate() said yes, inside a
// ReentrancyGuard, and (for the On* notifications) after the real call, with an ErrnoPreserver
// alive; the few that say they may be called outside a guard (the cheap pre-checks every open
// and stat makes) enter one themselves and keep errno. Every function is noexcept: a handler
// that throws is caught here, logged, and the whole layer switches to pass-through (DESIGN.md
// §6.2). Nothing here changes what the host's call returned.
//
// Thread-safety: all functions may be called concurrently. Lifecycle events of one fd number
// (open, dup onto it, close) are serialised by FdTable::FdLock (see fd_table.h).
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "hooks/events.h"
#include "hooks/topology/topology_registry.h"
#include "interpose/fd_table.h"

namespace ucp::dispatch {

// UCP_STRICT: a failed substitution fails the host's call with EIO instead of falling back.
void SetStrict(bool strict) noexcept;
bool Strict() noexcept;

// --- Save side ---------------------------------------------------------------------------

// True for open flags that may write the file (what the save side may track).
constexpr bool IsWriteOpen(int flags) noexcept {
  return (flags & O_ACCMODE) == O_WRONLY || (flags & O_ACCMODE) == O_RDWR;
}

namespace internal {
void OnOpenSlow(int fd, int dirfd, const char* path, int flags) noexcept;
void ForgetStaleFd(int fd) noexcept;
}  // namespace internal

// True when ucp may act on an open of `path` with open(2) `flags`: serve it (a plain read-open:
// MayServePath), or track or redirect it (a write-open: SaveObserver::MayTrackPath,
// WriteRedirect::MayRedirectPath), judged on the path as the host spelled it. False: the wrapper
// makes the plain call and reports only OnOpenPassedThrough; most opens end there. May be called
// outside a ReentrancyGuard (it enters one to ask the handlers). Keeps errno.
bool MayWatchOpen(const char* path, int flags) noexcept;

// An open that MayWatchOpen turned away returned `fd`: forgets whatever was tracked under that
// number before (a close ucp did not see). Inline: for an untracked number, a bit test. May be
// called outside a ReentrancyGuard. Keeps errno.
inline void OnOpenPassedThrough(int fd) noexcept {
  if (FdTable::Get().MaybeTracked(fd)) internal::ForgetStaleFd(fd);
}

// `fd` was returned by an open-like call (open family, creat, fopen/freopen's fileno) of `path`
// relative to `dirfd` with open(2) `flags`. Forgets whatever was tracked under that number
// before (a close ucp did not see), and for a write-open asks the SaveObserver whether to track
// it. Does nothing for fd < 0. Keeps errno, and may be called outside a ReentrancyGuard.
inline void OnOpen(int fd, int dirfd, const char* path, int flags) noexcept {
  if (fd < 0 || (!IsWriteOpen(flags) && !FdTable::Get().MaybeTracked(fd))) return;
  internal::OnOpenSlow(fd, dirfd, path, flags);
}

// UCP_DURABLE: for a write-open of `path` (relative to `dirfd`) that truncates (O_TRUNC), the
// absolute path to open instead; "" (the usual answer, and always without a WriteRedirect) for
// `path` itself. Keeps errno.
std::string RedirectedWrite(int dirfd, const char* path, int flags) noexcept;
// The open of `redirected`, which RedirectedWrite returned for `path`, failed.
void OnRedirectFailed(int dirfd, const char* path, const std::string& redirected) noexcept;

// Runs the write-open `call(path)`, on RedirectedWrite's path when it names one (falling back to
// `path` when that open fails). Returns the call's result; `*opened` is the path it opened.
template <typename Ret, typename Call, typename Failed>
Ret RedirectedOpen(int dirfd, const char* path, int flags, Call&& call, Failed&& failed,
                   std::string* opened) noexcept {
  *opened = RedirectedWrite(dirfd, path, flags);
  if (opened->empty()) return call(path);
  const Ret ret = call(opened->c_str());
  if (!failed(ret)) return ret;
  OnRedirectFailed(dirfd, path, *opened);
  opened->clear();
  return call(path);
}

// fdopen(fd, mode) succeeded with `flags` parsed from its mode: a writing stream on an
// untracked fd is offered to the SaveObserver under the path /proc/self/fd shows.
void OnFdopen(int fd, int flags) noexcept;

// The bytes `iov[0..iovcnt)` holds (saturating; 0 for iovcnt <= 0).
size_t IovecBytes(const struct iovec* iov, int iovcnt) noexcept;

// Brackets a write-like host call on `fd`: constructed right before it with what it is about to
// write (`offset`: the explicit file offset, or -1 for "at the current position"), Done(ret)
// right after it with what it returned (bytes, or -1). The bytes must stay valid until Done; a
// TrackedWrite that is never Done tells the observer at its destruction that nothing was
// written. Not copyable: one per call, on the calling thread.
class TrackedWrite {
 public:
  TrackedWrite(int fd, int64_t offset, const struct iovec* iov, int iovcnt, size_t size) noexcept;
  TrackedWrite(int fd, int64_t offset, const void* data, size_t size) noexcept;
  ~TrackedWrite();
  TrackedWrite(const TrackedWrite&) = delete;
  TrackedWrite& operator=(const TrackedWrite&) = delete;

  void Done(ssize_t ret) noexcept;

 private:
  void Begin(int64_t offset, const struct iovec* iov, int iovcnt, size_t size) noexcept;

  const int fd_;
  struct iovec single_ {};
  hooks::SaveObserver* observer_ = nullptr;  // set when OnWriteBegin was called
};

// The file position of `fd` before an lseek (-1 when unknown); keeps errno.
off_t PositionOf(int fd) noexcept;
// An lseek on `fd` moved the position from `before` to `after` (-1 = failed).
void OnSeek(int fd, off_t before, off_t after) noexcept;
// Bytes ucp cannot see went into `fd` (sendfile, copy_file_range returned `ret`).
void OnUnseenWrite(int fd, ssize_t ret) noexcept;
// fsync/fdatasync of `fd` returned `ret`.
void OnSync(int fd, int ret) noexcept;

// A dup-like call (dup, dup2, dup3, fcntl F_DUPFD*) made `new_fd` (the call's result, -1 on
// failure) refer to `old_fd`'s open file. A tracked number that `new_fd` replaced is reported
// closed first; `new_fd` is tracked when `old_fd` is.
void OnDup(int old_fd, int new_fd) noexcept;

// Brackets the real call that closes `fd` (close, fclose, freopen's old stream): untracks the
// number before the call and, after it, reports the close of a tracked fd. Holds FdLock(fd)
// between the two for a tracked fd, so that an open reusing the number waits for OnClose.
class FdRelease {
 public:
  explicit FdRelease(int fd) noexcept;
  FdRelease(const FdRelease&) = delete;
  FdRelease& operator=(const FdRelease&) = delete;

  // Call after the real close returned (whatever it returned): reports the close of a tracked
  // fd and releases FdLock(fd).
  void Closed() noexcept;

 private:
  const int fd_;
  std::unique_lock<std::mutex> lock_;
  bool was_tracked_ = false;
};

// Brackets close_range(first, last, flags) in the same way (CLOSE_RANGE_CLOEXEC closes nothing).
class RangeRelease {
 public:
  RangeRelease(unsigned first, unsigned last, int flags) noexcept;
  ~RangeRelease();
  RangeRelease(const RangeRelease&) = delete;
  RangeRelease& operator=(const RangeRelease&) = delete;

  // Call after the real close_range returned `ret`; on failure nothing was closed.
  void Closed(int ret) noexcept;

 private:
  bool closes_;
  unsigned first_;
  unsigned last_;
  int* fds_ = nullptr;  // the tracked fds it untracked (malloc'd; few)
  int count_ = 0;
};

// A successful rename of `from` (relative to `from_dirfd`) to `to`; `ret` is the call's result.
void OnRename(int from_dirfd, const char* from, int to_dirfd, const char* to, int ret) noexcept;

// --- Load side ----------------------------------------------------------------------------

// True when a ServePolicy is installed.
bool MayServe() noexcept;

// True when the installed ServePolicy may serve `path`, judged on the path as the host spelled
// it (ServePolicy::MayServePath): no getcwd, no allocation, no libc call that ucp hooks. False
// promises that Resolve would pass `path` through, so a wrapper makes the plain call at once:
// most stats and read-opens end here. Unlike the rest of this file it may be
// called outside a ReentrancyGuard (it enters one to ask the policy). Keeps errno.
bool MayServePath(const char* path) noexcept;

// What the host is about to do with a path the serve side may serve.
enum class ServeUse {
  kOpen,      // open it for reading (ServePolicy::Resolve)
  kMetadata,  // stat or access it (ServePolicy::ResolveMetadata)
};

// The ServePolicy's decision for `path` (relative to `dirfd`) and `use`: kPassThrough when there
// is no policy, or on any failure (kFail under UCP_STRICT). Keeps errno.
hooks::ServeDecision Resolve(int dirfd, const char* path, ServeUse use = ServeUse::kOpen) noexcept;

// The ServePolicy's change to the listing of directory `path` (relative to `dirfd`; "." with a
// directory fd names that directory): nullopt when there is no policy, when the path cannot be
// made absolute, or on any failure. Keeps errno.
std::optional<hooks::ListingChange> ChangeListing(int dirfd, const char* path) noexcept;

// True for open flags that only read an existing file (what the serve side may substitute).
// (O_TMPFILE includes O_DIRECTORY.)
constexpr bool IsPlainReadOpen(int flags) noexcept {
  return (flags & O_ACCMODE) == O_RDONLY && (flags & (O_CREAT | O_TRUNC | O_DIRECTORY)) == 0;
}

// Runs `call(path)`, for a `path` that MayServePath admitted, as the ServePolicy decides: on
// `path`, on its substitute, or not at all
// (kAbsent: `fail_result` with ENOENT; kFail: `fail_result` with EIO). A failing substituted call
// falls back to `path` (or fails with EIO under UCP_STRICT). `failed(ret)` says whether a result
// is a failure.
template <typename Call, typename Failed, typename Ret>
Ret Served(int dirfd, const char* path, Call&& call, Failed&& failed, Ret fail_result,
           ServeUse use = ServeUse::kOpen) noexcept {
  const hooks::ServeDecision decision = Resolve(dirfd, path, use);
  switch (decision.kind) {
    case hooks::ServeDecision::Kind::kPassThrough:
      return call(path);
    case hooks::ServeDecision::Kind::kAbsent:
      errno = ENOENT;
      return fail_result;
    case hooks::ServeDecision::Kind::kFail:
      errno = EIO;
      return fail_result;
    case hooks::ServeDecision::Kind::kSubstitute:
      break;
  }
  const Ret ret = call(decision.path.c_str());
  if (!failed(ret)) return ret;
  if (Strict()) {
    errno = EIO;
    return ret;
  }
  return call(path);
}

// --- NCCL (interpose/nccl.cc) --------------------------------------------------------------

// Communicators are their ncclComm_t values as integers, unique ids their raw bytes. Each call
// updates hooks::TopologyRegistry::Global(); creations also record the calling thread's CUDA
// device (hooks/topology/cuda_device.h), which is the device NCCL uses for them.

// ncclGetUniqueId wrote `size` bytes of a new unique id at `id`.
void OnNcclUniqueId(const void* id, size_t size) noexcept;
// `comm` (nranks ranks, this process `rank`) was created from the unique id(s) at `ids`.
void OnNcclInit(uintptr_t comm, hooks::CommOrigin origin, int nranks, int rank, const void* ids,
                size_t size) noexcept;
// ncclCommInitAll created `comms[0..ndev)` on `devlist` (nullptr: devices 0..ndev-1).
void OnNcclInitAll(const uintptr_t* comms, int ndev, const int* devlist) noexcept;
// `child` was split from `parent` with `color` and `key`.
void OnNcclSplit(uintptr_t parent, int color, int key, uintptr_t child) noexcept;
// NCCL reports `nranks` ranks and this process as `rank` for the split child `child`.
void OnNcclSplitResolved(uintptr_t child, int nranks, int rank) noexcept;
// The creation order of the alive communicator `comm`, or nullopt when ucp never saw it.
std::optional<uint64_t> NcclCommOrder(uintptr_t comm) noexcept;
// The communicator created `order`-th was finalized, destroyed or aborted (`state`).
void OnNcclEnd(uint64_t order, hooks::CommState state) noexcept;

}  // namespace ucp::dispatch
