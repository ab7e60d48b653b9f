// Calls that end or copy fd numbers: close, the dup family, fcntl's F_DUPFD, close_range. They
// keep the fd table in step with the kernel's, so tracked state follows dups and never outlives
// its fd.

#include <fcntl.h>
#include <stdarg.h>
#include <unistd.h>

#include "interpose/dispatch.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"
#include "interpose/real.h"

namespace {

bool IsDupCommand(int cmd) { return cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC; }

// The close of a number ucp may track. Out of line, so that close() of any other saves no
// registers.
[[gnu::noinline]] int CloseTracked(int fd) {
  ucp::ReentrancyGuard guard;
  ucp::dispatch::FdRelease release(fd);
  const int ret = ucp::real::close()(fd);
  ucp::ErrnoPreserver keep;
  release.Closed();
  return ret;
}

}  // namespace

extern "C" UCP_EXPORT int close(int fd) {
  if (!ucp::InterceptGate() || !ucp::FdTable::Get().MaybeTracked(fd)) {
    return ucp::real::close()(fd);
  }
  return CloseTracked(fd);
}

extern "C" UCP_EXPORT int dup(int fd) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::dup()(fd);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::dup()(fd);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnDup(fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int dup2(int fd, int fd2) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::dup2()(fd, fd2);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::dup2()(fd, fd2);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnDup(fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int dup3(int fd, int fd2, int flags) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::dup3()(fd, fd2, flags);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::dup3()(fd, fd2, flags);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnDup(fd, ret);
  return ret;
}

// fcntl's optional argument is an int or a pointer; like glibc, read it as a pointer and pass
// it on untouched.
extern "C" UCP_EXPORT int fcntl(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  void* const arg = va_arg(args, void*);
  va_end(args);
  if (!ucp::InterceptGate() || !IsDupCommand(cmd)) return ucp::real::fcntl()(fd, cmd, arg);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::fcntl()(fd, cmd, arg);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnDup(fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int fcntl64(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  void* const arg = va_arg(args, void*);
  va_end(args);
  if (!ucp::InterceptGate() || !IsDupCommand(cmd)) return ucp::real::fcntl64()(fd, cmd, arg);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::fcntl64()(fd, cmd, arg);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnDup(fd, ret);
  return ret;
}

extern "C" UCP_EXPORT int close_range(unsigned int first, unsigned int last, int flags) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::close_range()(first, last, flags);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::RangeRelease release(first, last, flags);
  const int ret = ucp::real::close_range()(first, last, flags);
  ucp::ErrnoPreserver keep;
  release.Closed(ret);
  return ret;
}
