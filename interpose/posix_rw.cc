// Writes, seeks, copies and syncs. Only tracked fds go past the first line.

#include <sys/sendfile.h>
#include <sys/uio.h>
#include <unistd.h>

#include "interpose/dispatch.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"
#include "interpose/real.h"

namespace {

bool Watched(int fd) { return ucp::InterceptGate() && ucp::FdTable::Get().MaybeTracked(fd); }

}  // namespace

extern "C" UCP_EXPORT ssize_t write(int fd, const void* buf, size_t n) {
  if (!Watched(fd)) return ucp::real::write()(fd, buf, n);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, -1, buf, n);
  const ssize_t ret = ucp::real::write()(fd, buf, n);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t writev(int fd, const struct iovec* iov, int iovcnt) {
  if (!Watched(fd)) return ucp::real::writev()(fd, iov, iovcnt);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, -1, iov, iovcnt, ucp::dispatch::IovecBytes(iov, iovcnt));
  const ssize_t ret = ucp::real::writev()(fd, iov, iovcnt);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  if (!Watched(fd)) return ucp::real::pwrite()(fd, buf, n, offset);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, offset, buf, n);
  const ssize_t ret = ucp::real::pwrite()(fd, buf, n, offset);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t pwrite64(int fd, const void* buf, size_t n, off64_t offset) {
  if (!Watched(fd)) return ucp::real::pwrite64()(fd, buf, n, offset);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, offset, buf, n);
  const ssize_t ret = ucp::real::pwrite64()(fd, buf, n, offset);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t pwritev(int fd, const struct iovec* iov, int iovcnt, off_t offset) {
  if (!Watched(fd)) return ucp::real::pwritev()(fd, iov, iovcnt, offset);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, offset, iov, iovcnt,
                                      ucp::dispatch::IovecBytes(iov, iovcnt));
  const ssize_t ret = ucp::real::pwritev()(fd, iov, iovcnt, offset);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t pwritev64(int fd, const struct iovec* iov, int iovcnt,
                                        off64_t offset) {
  if (!Watched(fd)) return ucp::real::pwritev64()(fd, iov, iovcnt, offset);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, offset, iov, iovcnt,
                                      ucp::dispatch::IovecBytes(iov, iovcnt));
  const ssize_t ret = ucp::real::pwritev64()(fd, iov, iovcnt, offset);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

// offset -1 writes at the current position, which is what TrackedWrite's -1 means too.
extern "C" UCP_EXPORT ssize_t pwritev2(int fd, const struct iovec* iov, int iovcnt, off_t offset,
                                       int flags) {
  if (!Watched(fd)) return ucp::real::pwritev2()(fd, iov, iovcnt, offset, flags);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::TrackedWrite tracked(fd, offset < 0 ? -1 : offset, iov, iovcnt,
                                      ucp::dispatch::IovecBytes(iov, iovcnt));
  const ssize_t ret = ucp::real::pwritev2()(fd, iov, iovcnt, offset, flags);
  ucp::ErrnoPreserver keep;
  tracked.Done(ret);
  return ret;
}

extern "C" UCP_EXPORT off_t lseek(int fd, off_t offset, int whence) __THROW {
  if (!Watched(fd)) return ucp::real::lseek()(fd, offset, whence);
  ucp::ReentrancyGuard guard;
  const off_t before = ucp::dispatch::PositionOf(fd);
  const off_t ret = ucp::real::lseek()(fd, offset, whence);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnSeek(fd, before, ret);
  return ret;
}

extern "C" UCP_EXPORT off64_t lseek64(int fd, off64_t offset, int whence) __THROW {
  if (!Watched(fd)) return ucp::real::lseek64()(fd, offset, whence);
  ucp::ReentrancyGuard guard;
  const off_t before = ucp::dispatch::PositionOf(fd);
  const off64_t ret = ucp::real::lseek64()(fd, offset, whence);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnSeek(fd, before, ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t sendfile(int out_fd, int in_fd, off_t* offset, size_t count) __THROW {
  if (!Watched(out_fd)) return ucp::real::sendfile()(out_fd, in_fd, offset, count);
  ucp::ReentrancyGuard guard;
  const ssize_t ret = ucp::real::sendfile()(out_fd, in_fd, offset, count);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnUnseenWrite(out_fd, ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t sendfile64(int out_fd, int in_fd, off64_t* offset,
                                         size_t count) __THROW {
  if (!Watched(out_fd)) return ucp::real::sendfile64()(out_fd, in_fd, offset, count);
  ucp::ReentrancyGuard guard;
  const ssize_t ret = ucp::real::sendfile64()(out_fd, in_fd, offset, count);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnUnseenWrite(out_fd, ret);
  return ret;
}

extern "C" UCP_EXPORT ssize_t copy_file_range(int in_fd, off64_t* in_offset, int out_fd,
                                              off64_t* out_offset, size_t n, unsigned int flags) {
  if (!Watched(out_fd)) {
    return ucp::real::copy_file_range()(in_fd, in_offset, out_fd, out_offset, n, flags);
  }
  ucp::ReentrancyGuard guard;
  const ssize_t ret = ucp::real::copy_file_range()(in_fd, in_offset, out_fd, out_offset, n, flags);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnUnseenWrite(out_fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int fsync(int fd) {
  if (!Watched(fd)) return ucp::real::fsync()(fd);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::fsync()(fd);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnSync(fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int fdatasync(int fd) {
  if (!Watched(fd)) return ucp::real::fdatasync()(fd);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::fdatasync()(fd);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnSync(fd, ret);
  return ret;
}
