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
#include <vector>

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

  // A cheap test on a path about to be opened for writing, as the host spelled it (relative or
  // absolute), made before ucp computes the absolute path and stats the fd: false promises that
  // OnOpenForWrite would decline the file, so the write-open of an ordinary file costs almost
  // nothing. A path ending in '/', "." or ".." names a directory: it may be refused.
  virtual bool MayTrackPath(std::string_view path) {
    static_cast<void>(path);
    return true;
  }

  // The host is about to write `size` bytes of `iov[0..iovcnt)` to tracked `fd` (every write-like
  // call: write, writev, pwrite*, fwrite). `offset` is the explicit file offset for pwrite-style
  // calls, or -1 for "at the current file position". The bytes stay valid and unchanged until
  // the matching OnWriteEnd, which the wrapper calls on this same thread right after the host's
  // call returns, whatever it returned: the observer may read them on another thread meanwhile.
  virtual void OnWriteBegin(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                            size_t size) = 0;
  // The host's call that OnWriteBegin announced returned `ret`: the first `ret` bytes were
  // written, or nothing (0, -1).
  virtual void OnWriteEnd(int fd, ssize_t ret) = 0;
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

// Save side, UCP_DURABLE only: a write-open that lands under another name, so that a commit
// signal becomes visible only once its tag is complete and durable (hooks/save/durable_commit.h).
class WriteRedirect {
 public:
  virtual ~WriteRedirect() = default;

  // A cheap test on a path about to be opened for writing, as the host spelled it: false
  // promises that Redirect would return nullopt.
  virtual bool MayRedirectPath(std::string_view path) = 0;

  // The host is about to open `path` for writing and truncating it (O_TRUNC, fopen "w"): the
  // absolute path the call opens instead, or nullopt for the host's own path. The caller reports
  // the open to the SaveObserver under the returned path.
  virtual std::optional<std::string> Redirect(std::string_view path) = 0;

  // The open of `redirected` (returned by Redirect for `path`) failed; the call then runs on
  // `path` itself.
  virtual void RedirectFailed(std::string_view path, std::string_view redirected) = 0;
};

// Load side: what the host reads. Decides whether a path is served from another file, and what a
// directory listing shows.
//
// What the host sees at a path.
struct ServeDecision {
  enum class Kind {
    kPassThrough,  // the call runs on the host's path, unchanged
    kSubstitute,   // the call runs on `path` instead (falls back to the host's path if it fails)
    kAbsent,       // the name does not exist for the host: the call fails with ENOENT
    kFail,         // UCP_STRICT only: serving failed; the call fails with EIO
  };
  Kind kind = Kind::kPassThrough;
  std::string path;  // kSubstitute: absolute path of the file to use
};

// How a directory's listing differs from the real one.
struct ListingChange {
  std::vector<std::string> hide;  // real entries (names, no '/') the listing leaves out
  std::vector<std::string> add;   // names (not among the real entries) the listing adds, as files
};

class ServePolicy {
 public:
  virtual ~ServePolicy() = default;

  // The host is about to open `path` read-only. A kSubstitute file exists when this returns (it
  // is built before returning, if it must be built).
  virtual ServeDecision Resolve(std::string_view path) = 0;

  // The host is about to stat or access `path` without opening it: a kSubstitute file need only
  // describe what an open would get (a regular file of its size), not hold its bytes, so nothing
  // has to be built. The default resolves as for an open.
  virtual ServeDecision ResolveMetadata(std::string_view path) { return Resolve(path); }

  // A cheap test on a path about to be resolved, as the host spelled it (relative or absolute),
  // made before ucp computes the absolute path: false promises that Resolve would pass it
  // through, so most opens and stats of the process cost no getcwd and no allocation. A path
  // ending in '/', "." or ".." names a directory, which is never served: it may be refused.
  virtual bool MayServePath(std::string_view path) {
    static_cast<void>(path);
    return true;
  }

  // The host is opening directory `dir` for listing (opendir/fdopendir). nullopt: the real
  // listing. Consistent with Resolve: an added name resolves to kSubstitute, a hidden one to
  // kAbsent.
  virtual std::optional<ListingChange> ChangeListing(std::string_view dir) = 0;
};

// The registered handlers (nullptr = none). Set during start-up only.
SaveObserver* GetSaveObserver() noexcept;
ServePolicy* GetServePolicy() noexcept;
WriteRedirect* GetWriteRedirect() noexcept;
void SetSaveObserver(SaveObserver* observer) noexcept;
void SetServePolicy(ServePolicy* policy) noexcept;
void SetWriteRedirect(WriteRedirect* redirect) noexcept;

}  // namespace ucp::hooks
