// The contract between interpose/ (which sees libc calls) and hooks/ (which knows what they mean).
//
// interpose/dispatch.cc turns intercepted calls into calls on the handlers registered here.
// Handlers are installed once, at start-up, before any hooked call is dispatched, and are never
// destroyed (wrappers may run during process teardown).
//
// Every handler method:
//   - is called inside a ReentrancyGuard, with the caller's errno saved and restored around it;
//   - must not throw (the dispatcher catches and disables itself if one does, but don't);
//   - must not block on anything another thread of the host may hold;
//   - never changes what the host's call returned.
// Paths are absolute and lexically normalised ("." and ".." resolved, no trailing slash);
// symbolic links are not resolved.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ucp::hooks {

// Save side: files being written.
class SaveObserver {
 public:
  virtual ~SaveObserver() = default;

  // `fd` was just opened for writing `path` (open/openat/creat with O_WRONLY or O_RDWR, or a
  // writing fopen/freopen/fdopen). `truncated` is true when the open truncated or created the
  // file (O_TRUNC/O_CREAT on a new file, fopen "w"), `append` for O_APPEND/"a". Returns true to
  // track the fd: only tracked fds report writes, seeks, dups and closes below.
  virtual bool OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) = 0;

  // A cheap test on the last component of a path about to be opened for writing, made before
  // ucp computes the absolute path and stats the fd: false promises that OnOpenForWrite would
  // decline the file, so the write-open of an ordinary file costs almost nothing.
  virtual bool MayTrackFileName(std::string_view file_name) {
    static_cast<void>(file_name);
    return true;
  }

  // `size` bytes of `data` were written to tracked `fd` (the host call's successful return).
  // `offset` is the explicit file offset for pwrite-style calls, or -1 for "at the current file
  // position" (write, fwrite on the fd's FILE).
  virtual void OnWrite(int fd, int64_t offset, const void* data, size_t size) = 0;
  // Same for vectored writes: the first `size` bytes of `iov[0..iovcnt)` were written.
  virtual void OnWriteVector(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                             size_t size) = 0;
  // The host moved the file position of a tracked fd (lseek/fseek), or wrote bytes ucp cannot
  // see (sendfile/copy_file_range into it): sequential hashing is no longer valid.
  virtual void OnNonSequential(int fd) = 0;
  // `new_fd` now refers to the same open file as tracked `old_fd` (dup, dup2, dup3, fcntl).
  virtual void OnDup(int old_fd, int new_fd) = 0;
  // `fd` was closed (close, fclose, close_range, or implicitly by dup2 onto it). Called after
  // the host's close returned, whatever it returned.
  virtual void OnClose(int fd) = 0;
  // fsync/fdatasync of a tracked fd succeeded.
  virtual void OnSync(int fd) = 0;
  // A successful rename of `from` to `to` (rename/renameat/renameat2), tracked or not: some
  // frameworks commit by renaming (DCP's .metadata).
  virtual void OnRename(std::string_view from, std::string_view to) = 0;
};

// Load side: what the host reads. Decides whether a path is served from another file.
class ServePolicy {
 public:
  virtual ~ServePolicy() = default;

  // The host is about to open `path` read-only, or stat/access it. Returns the absolute path of
  // the file to use in its place, or nullopt to pass the call through unchanged. The returned
  // file must exist when this returns (it is built before returning, if it must be built).
  virtual std::optional<std::string> Substitute(std::string_view path) = 0;
};

// The registered handlers (nullptr = none). Set during start-up only.
SaveObserver* GetSaveObserver() noexcept;
ServePolicy* GetServePolicy() noexcept;
void SetSaveObserver(SaveObserver* observer) noexcept;
void SetServePolicy(ServePolicy* policy) noexcept;

}  // namespace ucp::hooks
