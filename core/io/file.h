// File: the one place in core/ that turns POSIX file I/O into Status/Result.
//
// Thread-safety: a File is a move-only owner of one descriptor. Concurrent ReadAt/WriteAt calls on
// the same File from several threads are safe (they are pread/pwrite: no shared file position);
// Append, Close, Sync and moves must not race with any other call on the same File.
//
// Every call enters a ReentrancyGuard, so inside the preload these libc calls pass through the
// interposed wrappers untouched. Every failure is a Status whose message names the operation and
// the path ("file: pread 4096 bytes at 128 of /ckpt/x.pt: Input/output error"), built by
// PosixError (ENOENT → kNotFound, other errno → kIoError). Short reads at end of file are
// kCorrupt: every reader in ucp reads ranges that the file's own metadata promised exist.
// Every system call here first passes the fault-injection point of core/io/fault_injection.h
// (tests only; EINTR and short transfers are retried like the kernel's own).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/util/status.h"

namespace ucp {

class File {
 public:
  enum class Mode {
    kRead,             // O_RDONLY; the file must exist
    kReadWrite,        // O_RDWR; the file must exist
    kCreate,           // O_RDWR | O_CREAT | O_TRUNC: creates, or empties an existing file
    kCreateExclusive,  // O_RDWR | O_CREAT | O_EXCL: fails (kIoError, EEXIST) if the path exists
    kAppend,           // O_WRONLY | O_APPEND | O_CREAT: every Append lands at the end of file
  };

  // Opens `path` (always O_CLOEXEC). `permissions` applies only when the file is created.
  static Result<File> Open(std::string path, Mode mode, mode_t permissions = 0644);

  // Opens `relative` (read-only) inside directory `dir`, refusing every name that resolves outside
  // it: "..", an absolute path, a symlink whose target leaves `dir` (any absolute symlink
  // included), a /proc magic link. This is how ucp opens a file an untrusted index names, so that
  // a tag cannot make ucp read (and serve) bytes from elsewhere. A refusal is kInvalidArgument
  // naming both paths. Uses openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS); where the kernel
  // lacks it (ENOSYS, or a seccomp filter answering EPERM), the opened descriptor's own path
  // (/proc/self/fd) must lie under the real path of `dir`.
  static Result<File> OpenBeneath(const std::string& dir, const std::string& relative);

  // An empty (closed) File; every I/O call on it fails with kFailedPrecondition.
  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  // Closes the descriptor if still open, ignoring errors: call Close() to see them.
  ~File();

  bool is_open() const { return fd_ >= 0; }
  // The raw descriptor (-1 when closed), e.g. for posix_fadvise; the File keeps ownership.
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

  // Current size from fstat.
  Result<uint64_t> Size() const;

  // Reads exactly out.size() bytes at `offset` (retrying short reads and EINTR). Reaching end of
  // file first is kCorrupt ("... end of file after N bytes").
  Status ReadAt(uint64_t offset, std::span<std::byte> out) const;
  // Reads up to out.size() bytes at `offset`; fewer only at end of file. Returns the count.
  Result<size_t> ReadSomeAt(uint64_t offset, std::span<std::byte> out) const;

  // Writes all of `data` at `offset` (retrying short writes and EINTR). Does not move the file
  // position used by Append.
  Status WriteAt(uint64_t offset, std::span<const std::byte> data);
  // Writes all of `data` at the current file position (write(2)) and advances it.
  Status Append(std::span<const std::byte> data);

  // ftruncate to `size`.
  Status Truncate(uint64_t size);
  // fsync (data and metadata).
  Status Sync();
  // Closes the descriptor and reports close(2)'s error (e.g. a deferred write error on NFS).
  // The File is closed afterwards in every case. Closing a closed File is OK.
  Status Close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  Status CheckOpen(std::string_view operation) const;

  int fd_ = -1;
  std::string path_;
};

// Copies `length` bytes from [src_offset, src_offset + length) of `src` to `dst` at `dst_offset`.
// Uses copy_file_range(2) (in-kernel, may reflink) and falls back to a pread/pwrite loop through
// one bounded buffer (kCopyChunkBytes) when the kernel or file systems cannot (EXDEV, ENOSYS,
// EOPNOTSUPP, EINVAL, ...). The source ending before `length` bytes is kCorrupt. Neither file's
// position moves. `src` and `dst` may be the same File only when the ranges do not overlap.
inline constexpr size_t kCopyChunkBytes = size_t{1} << 20;
Status CopyRange(const File& src, uint64_t src_offset, File& dst, uint64_t dst_offset,
                 uint64_t length);

// rename(2) `from` to `to` (atomic replacement within one file system), retried on EINTR.
Status RenameFile(const std::string& from, const std::string& to);
// unlink(2) `path`; a path that does not exist is kNotFound.
Status RemoveFile(const std::string& path);
// fsyncs the directory `dir`, making a preceding create or rename in it durable.
Status SyncDirectory(const std::string& dir);

// Creates directory `dir` and any missing parents (mkdir -p); an existing directory is OK.
Status CreateDirectories(const std::string& dir);

// The whole of `path`, at most `limit` bytes (kOutOfRange naming the file above it).
Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit);

// Writes `contents` to `path` atomically: a temporary "<path>.ucp-tmp-<pid>-<n>" in the same
// directory (created exclusively), then, with `sync`, fsync; rename over `path`; with `sync`,
// fsync of the directory. On failure the temporary is removed and `path` is untouched.
Status WriteFileAtomically(const std::string& path, std::string_view contents, bool sync = true);

}  // namespace ucp
