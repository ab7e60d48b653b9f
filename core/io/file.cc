#include "core/io/file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "core/io/fault_injection.h"
#include "core/util/reentrancy_guard.h"

namespace ucp {
namespace {

std::string Describe(std::string_view operation, const std::string& path) {
  std::string out = "file: ";
  out += operation;
  out += " ";
  out += path;
  return out;
}

std::string DescribeRange(std::string_view operation, uint64_t length, uint64_t offset,
                          const std::string& path) {
  return "file: " + std::string(operation) + " " + std::to_string(length) + " bytes at " +
         std::to_string(offset) + " of " + path;
}

int FlagsFor(File::Mode mode) {
  switch (mode) {
    case File::Mode::kRead:
      return O_RDONLY;
    case File::Mode::kReadWrite:
      return O_RDWR;
    case File::Mode::kCreate:
      return O_RDWR | O_CREAT | O_TRUNC;
    case File::Mode::kCreateExclusive:
      return O_RDWR | O_CREAT | O_EXCL;
    case File::Mode::kAppend:
      return O_WRONLY | O_APPEND | O_CREAT;
  }
  return O_RDONLY;
}

// Errors after which copy_file_range cannot work for this pair of files at all, so the
// user-space loop takes over (cross-device on old kernels, special files, unsupported fs).
bool CopyFileRangeUnsupported(int err) {
  return err == EXDEV || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL || err == EBADF ||
         err == ETXTBSY || err == EPERM;
}

// One read or write through the fault-injection point (fault_injection.h): an injected error
// fails as the kernel would (-1, errno), an injected short transfer asks `call` for fewer bytes.
template <typename Call>
ssize_t Transfer(IoOp op, const std::string& path, size_t want, Call call) {
  const IoFault fault = MaybeInjectFault(op, path, want);
  if (fault.error != 0) {
    errno = fault.error;
    return -1;
  }
  return call(std::min(want, std::max<size_t>(fault.max_bytes, 1)));
}

// A call other than a transfer through the fault-injection point: 0 to go ahead, or the errno.
int InjectedError(IoOp op, const std::string& path) { return MaybeInjectFault(op, path, 0).error; }

}  // namespace

Result<File> File::Open(std::string path, Mode mode, mode_t permissions) {
  ReentrancyGuard guard;
  int fd;
  do {
    const int injected = mode == Mode::kRead ? 0 : InjectedError(IoOp::kOpenWrite, path);
    if (injected != 0) {
      errno = injected;
      fd = -1;
    } else {
      fd = ::open(path.c_str(), FlagsFor(mode) | O_CLOEXEC, permissions);
    }
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return PosixError(Describe("open", path), errno);
  return File(fd, std::move(path));
}

namespace {

Status RefuseEscape(const std::string& dir, const std::string& relative) {
  return Status::InvalidArgument("file: open " + relative + " beneath " + dir +
                                 ": resolves outside the directory (\"..\", an absolute path or "
                                 "a symlink leaving it): refused");
}

// The fallback of OpenBeneath: `fd` is already open; its path must lie under `dir`'s real path.
Status CheckOpenedBeneath(int fd, const std::string& dir, const std::string& relative) {
  std::error_code error;
  const std::filesystem::path real_dir = std::filesystem::canonical(dir, error);
  if (error) return PosixError(Describe("resolve", dir), error.value());
  const std::filesystem::path opened =
      std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(fd), error);
  if (error) return PosixError(Describe("resolve the descriptor of", relative), error.value());
  const auto [dir_end, unused] =
      std::mismatch(real_dir.begin(), real_dir.end(), opened.begin(), opened.end());
  if (dir_end != real_dir.end() || opened == real_dir) return RefuseEscape(dir, relative);
  return Status::Ok();
}

}  // namespace

Result<File> File::OpenBeneath(const std::string& dir, const std::string& relative) {
  ReentrancyGuard guard;
  const std::string path = dir + "/" + relative;
  const int dir_fd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return PosixError(Describe("open directory", dir), errno);
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd;
  do {
    fd = ::syscall(SYS_openat2, dir_fd, relative.c_str(), &how, sizeof(how));
  } while (fd < 0 && (errno == EINTR || errno == EAGAIN));
  const int err = errno;
  ::close(dir_fd);
  if (fd >= 0) return File(static_cast<int>(fd), path);
  if (err == EXDEV) return RefuseEscape(dir, relative);
  if (err != ENOSYS && err != EPERM) return PosixError(Describe("open", path), err);
  UCP_ASSIGN_OR_RETURN(File file, Open(path, Mode::kRead));
  UCP_RETURN_IF_ERROR(CheckOpenedBeneath(file.fd(), dir, relative));
  return file;
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      ReentrancyGuard guard;
      ::close(fd_);
    }
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) {
    ReentrancyGuard guard;
    ::close(fd_);
  }
}

Status File::CheckOpen(std::string_view operation) const {
  if (fd_ >= 0) return Status::Ok();
  return Status::FailedPrecondition(Describe(operation, path_) + ": file is closed");
}

Result<uint64_t> File::Size() const {
  UCP_RETURN_IF_ERROR(CheckOpen("fstat"));
  ReentrancyGuard guard;
  struct stat st;
  if (::fstat(fd_, &st) != 0) return PosixError(Describe("fstat", path_), errno);
  return static_cast<uint64_t>(st.st_size);
}

Result<size_t> File::ReadSomeAt(uint64_t offset, std::span<std::byte> out) const {
  UCP_RETURN_IF_ERROR(CheckOpen("pread"));
  ReentrancyGuard guard;
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = Transfer(IoOp::kRead, path_, out.size() - done, [&](size_t want) {
      return ::pread(fd_, out.data() + done, want, static_cast<off_t>(offset + done));
    });
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError(DescribeRange("pread", out.size(), offset, path_), errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Status File::ReadAt(uint64_t offset, std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(const size_t done, ReadSomeAt(offset, out));
  if (done != out.size()) {
    return Status::Corrupt(DescribeRange("pread", out.size(), offset, path_) +
                           ": end of file after " + std::to_string(done) + " bytes");
  }
  return Status::Ok();
}

Status File::WriteAt(uint64_t offset, std::span<const std::byte> data) {
  UCP_RETURN_IF_ERROR(CheckOpen("pwrite"));
  ReentrancyGuard guard;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = Transfer(IoOp::kWrite, path_, data.size() - done, [&](size_t want) {
      return ::pwrite(fd_, data.data() + done, want, static_cast<off_t>(offset + done));
    });
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError(DescribeRange("pwrite", data.size(), offset, path_), errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status File::Append(std::span<const std::byte> data) {
  UCP_RETURN_IF_ERROR(CheckOpen("write"));
  ReentrancyGuard guard;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = Transfer(IoOp::kWrite, path_, data.size() - done,
                               [&](size_t want) { return ::write(fd_, data.data() + done, want); });
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError(Describe("write " + std::to_string(data.size()) + " bytes to", path_),
                        errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status File::Truncate(uint64_t size) {
  UCP_RETURN_IF_ERROR(CheckOpen("ftruncate"));
  ReentrancyGuard guard;
  int rc;
  do {
    rc = ::ftruncate(fd_, static_cast<off_t>(size));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    return PosixError(Describe("ftruncate to " + std::to_string(size) + " bytes", path_), errno);
  }
  return Status::Ok();
}

Status File::Sync() {
  UCP_RETURN_IF_ERROR(CheckOpen("fsync"));
  ReentrancyGuard guard;
  int rc;
  do {
    const int injected = InjectedError(IoOp::kSync, path_);
    if (injected != 0) {
      errno = injected;
      rc = -1;
    } else {
      rc = ::fsync(fd_);
    }
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return PosixError(Describe("fsync", path_), errno);
  return Status::Ok();
}

Status File::Close() {
  if (fd_ < 0) return Status::Ok();
  ReentrancyGuard guard;
  // close(2) must not be retried on EINTR on Linux: the descriptor is already released.
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0 && errno != EINTR) return PosixError(Describe("close", path_), errno);
  return Status::Ok();
}

Status CopyRange(const File& src, uint64_t src_offset, File& dst, uint64_t dst_offset,
                 uint64_t length) {
  if (!src.is_open() || !dst.is_open()) {
    return Status::FailedPrecondition("file: copy " + src.path() + " to " + dst.path() +
                                      ": file is closed");
  }
  ReentrancyGuard guard;
  uint64_t done = 0;
  bool kernel_copy = true;
  while (done < length && kernel_copy) {
    loff_t in = static_cast<loff_t>(src_offset + done);
    loff_t out = static_cast<loff_t>(dst_offset + done);
    const size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, 1u << 30));
    const ssize_t n = Transfer(IoOp::kWrite, dst.path(), want, [&](size_t asked) {
      return ::copy_file_range(src.fd(), &in, dst.fd(), &out, asked, 0);
    });
    if (n < 0) {
      if (errno == EINTR) continue;
      if (CopyFileRangeUnsupported(errno)) {
        kernel_copy = false;
        break;
      }
      return PosixError("file: copy_file_range " + std::to_string(length) + " bytes from " +
                            src.path() + " to " + dst.path(),
                        errno);
    }
    if (n == 0) {
      return Status::Corrupt(DescribeRange("copy", length, src_offset, src.path()) +
                             ": end of file after " + std::to_string(done) + " bytes");
    }
    done += static_cast<uint64_t>(n);
  }
  if (done == length) return Status::Ok();

  const size_t buffer_size =
      static_cast<size_t>(std::min<uint64_t>(length - done, kCopyChunkBytes));
  std::unique_ptr<std::byte[]> buffer(new std::byte[buffer_size]);
  while (done < length) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(length - done, buffer_size));
    UCP_RETURN_IF_ERROR(src.ReadAt(src_offset + done, {buffer.get(), chunk}));
    UCP_RETURN_IF_ERROR(dst.WriteAt(dst_offset + done, {buffer.get(), chunk}));
    done += chunk;
  }
  return Status::Ok();
}

Status RenameFile(const std::string& from, const std::string& to) {
  ReentrancyGuard guard;
  int rc;
  do {
    const int injected = InjectedError(IoOp::kRename, to);
    if (injected != 0) {
      errno = injected;
      rc = -1;
    } else {
      rc = ::rename(from.c_str(), to.c_str());
    }
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return PosixError("file: rename " + from + " to " + to, errno);
  return Status::Ok();
}

Status RemoveFile(const std::string& path) {
  ReentrancyGuard guard;
  if (::unlink(path.c_str()) != 0) return PosixError(Describe("unlink", path), errno);
  return Status::Ok();
}

Status SyncDirectory(const std::string& dir) {
  UCP_ASSIGN_OR_RETURN(File directory, File::Open(dir, File::Mode::kRead));
  UCP_RETURN_IF_ERROR(directory.Sync());
  return directory.Close();
}

Status CreateDirectories(const std::string& dir) {
  ReentrancyGuard guard;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return PosixError("file: create directory " + dir, error.value());
  return Status::Ok();
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  UCP_ASSIGN_OR_RETURN(const uint64_t size, file.Size());
  if (size > limit) {
    return Status::OutOfRange(path + ": " + std::to_string(size) + " bytes, more than the " +
                              std::to_string(limit) + "-byte limit");
  }
  std::string text(static_cast<size_t>(size), '\0');
  UCP_RETURN_IF_ERROR(file.ReadAt(0, std::as_writable_bytes(std::span(text))));
  return text;
}

Status WriteFileAtomically(const std::string& path, std::string_view contents, bool sync) {
  static std::atomic<uint64_t> counter{0};
  const std::string temp =
      path + ".ucp-tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
  UCP_ASSIGN_OR_RETURN(File file, File::Open(temp, File::Mode::kCreateExclusive));
  Status status = file.WriteAt(0, std::as_bytes(std::span(contents.data(), contents.size())));
  if (status.ok() && sync) status = file.Sync();
  if (status.ok()) status = file.Close();
  if (status.ok()) status = RenameFile(temp, path);
  if (!status.ok()) {
    (void)file.Close();  // already failing: the first error is the one reported
    (void)RemoveFile(temp);
    return status;
  }
  if (!sync) return Status::Ok();
  std::string dir = std::filesystem::path(path).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir);
}

}  // namespace ucp
