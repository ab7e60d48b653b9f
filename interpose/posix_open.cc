// The open(2) family. Every entry point funnels into Open(), which calls the matching real
// function: the fortified __open_2 family keeps its own checks.

#include <fcntl.h>
#include <stdarg.h>

#include <string>

#include "interpose/dispatch.h"
#include "interpose/gate.h"
#include "interpose/libc_decls.h"
#include "interpose/real.h"

namespace {

// The mode argument exists only when the flags create a file: read it only then.
mode_t ModeArg(int flags, va_list args) {
  const bool creates = (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE;
  return creates ? va_arg(args, mode_t) : 0;
}

// Open for an open that MayWatchOpen admitted. Out of line, so that the common case in Open
// saves no registers and builds no strings.
template <typename Call>
[[gnu::noinline]] int OpenConsidered(int dirfd, const char* path, int flags, Call& call) {
  ucp::ReentrancyGuard guard;
  auto failed = [](int ret) { return ret < 0; };
  std::string opened;  // UCP_DURABLE: where a commit signal's write-open went instead
  const int fd =
      ucp::dispatch::IsPlainReadOpen(flags)
          ? ucp::dispatch::Served(dirfd, path, call, failed, -1)
          : ucp::dispatch::RedirectedOpen<int>(dirfd, path, flags, call, failed, &opened);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnOpen(fd, dirfd, opened.empty() ? path : opened.c_str(), flags);
  return fd;
}

// `call(path)` runs the real open on `path` (or on the serve side's substitute).
template <typename Call>
int Open(int dirfd, const char* path, int flags, Call&& call) {
  if (!ucp::InterceptGate()) return call(path);
  if (ucp::dispatch::MayWatchOpen(path, flags)) return OpenConsidered(dirfd, path, flags, call);
  const int fd = call(path);
  ucp::dispatch::OnOpenPassedThrough(fd);
  return fd;
}

}  // namespace

extern "C" UCP_EXPORT int open(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeArg(flags, args);
  va_end(args);
  return Open(AT_FDCWD, path, flags,
              [&](const char* p) { return ucp::real::open()(p, flags, mode); });
}

extern "C" UCP_EXPORT int open64(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeArg(flags, args);
  va_end(args);
  return Open(AT_FDCWD, path, flags,
              [&](const char* p) { return ucp::real::open64()(p, flags, mode); });
}

extern "C" UCP_EXPORT int openat(int dirfd, const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeArg(flags, args);
  va_end(args);
  return Open(dirfd, path, flags,
              [&](const char* p) { return ucp::real::openat()(dirfd, p, flags, mode); });
}

extern "C" UCP_EXPORT int openat64(int dirfd, const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeArg(flags, args);
  va_end(args);
  return Open(dirfd, path, flags,
              [&](const char* p) { return ucp::real::openat64()(dirfd, p, flags, mode); });
}

extern "C" UCP_EXPORT int __open_2(const char* path, int flags) {
  return Open(AT_FDCWD, path, flags,
              [&](const char* p) { return ucp::real::__open_2()(p, flags); });
}

extern "C" UCP_EXPORT int __open64_2(const char* path, int flags) {
  return Open(AT_FDCWD, path, flags,
              [&](const char* p) { return ucp::real::__open64_2()(p, flags); });
}

extern "C" UCP_EXPORT int __openat_2(int dirfd, const char* path, int flags) {
  return Open(dirfd, path, flags,
              [&](const char* p) { return ucp::real::__openat_2()(dirfd, p, flags); });
}

extern "C" UCP_EXPORT int __openat64_2(int dirfd, const char* path, int flags) {
  return Open(dirfd, path, flags,
              [&](const char* p) { return ucp::real::__openat64_2()(dirfd, p, flags); });
}

extern "C" UCP_EXPORT int creat(const char* path, mode_t mode) {
  return Open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC,
              [&](const char* p) { return ucp::real::creat()(p, mode); });
}

extern "C" UCP_EXPORT int creat64(const char* path, mode_t mode) {
  return Open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC,
              [&](const char* p) { return ucp::real::creat64()(p, mode); });
}
