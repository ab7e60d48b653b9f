// stdio streams. glibc's stdio reaches the kernel through internal calls that never pass
// through libucp.so, so the stream functions report for themselves: fopen the open, fwrite the
// bytes (when they enter the stream's buffer), fclose the close. libstdc++'s filebuf (torch.save's
// writer) opens with fopen64, writes with write/writev on the fd and closes with fclose.

#include <fcntl.h>
#include <stdio.h>

#include <string>

#include "interpose/dispatch.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"
#include "interpose/real.h"

namespace {

// open(2) flags equivalent to an fopen mode ("r", "w+", "ab", "wx", ...).
int FlagsOfMode(const char* mode) {
  if (mode == nullptr) return O_RDONLY;
  int flags = 0;
  switch (mode[0]) {
    case 'w':
      flags = O_WRONLY | O_CREAT | O_TRUNC;
      break;
    case 'a':
      flags = O_WRONLY | O_CREAT | O_APPEND;
      break;
    default:
      flags = O_RDONLY;
      break;
  }
  for (const char* c = mode + 1; *c != '\0' && *c != ','; ++c) {
    if (*c == '+') flags = (flags & ~O_ACCMODE) | O_RDWR;
    if (*c == 'x') flags |= O_EXCL;
  }
  return flags;
}

// The stream's fd, or -1 (memory streams have none). Read from glibc's public FILE layout:
// fileno() would cost a call and set errno for streams without an fd.
int FdOf(FILE* stream) { return stream == nullptr ? -1 : stream->_fileno; }

template <typename Call>
FILE* Fopen(const char* path, const char* mode, Call&& call) {
  if (!ucp::InterceptGate()) return call(path);
  const int flags = FlagsOfMode(mode);
  if (!ucp::dispatch::MayWatchOpen(path, flags)) {
    FILE* const stream = call(path);
    ucp::dispatch::OnOpenPassedThrough(FdOf(stream));
    return stream;
  }
  ucp::ReentrancyGuard guard;
  auto failed = [](FILE* ret) { return ret == nullptr; };
  std::string opened;  // UCP_DURABLE: where a commit signal's write-open went instead
  FILE* const stream =
      ucp::dispatch::IsPlainReadOpen(flags)
          ? ucp::dispatch::Served(AT_FDCWD, path, call, failed, static_cast<FILE*>(nullptr))
          : ucp::dispatch::RedirectedOpen<FILE*>(AT_FDCWD, path, flags, call, failed, &opened);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnOpen(FdOf(stream), AT_FDCWD, opened.empty() ? path : opened.c_str(), flags);
  return stream;
}

// freopen closes the stream's old fd inside glibc; a null path reopens the same file.
template <typename Call>
FILE* Freopen(const char* path, const char* mode, FILE* stream, Call&& call) {
  if (!ucp::InterceptGate()) return call(path);
  ucp::ReentrancyGuard guard;
  const int flags = FlagsOfMode(mode);
  ucp::dispatch::FdRelease release(FdOf(stream));
  FILE* const ret = ucp::dispatch::IsPlainReadOpen(flags) && ucp::dispatch::MayServePath(path)
                        ? ucp::dispatch::Served(
                              AT_FDCWD, path, call, [](FILE* f) { return f == nullptr; },
                              static_cast<FILE*>(nullptr))
                        : call(path);
  ucp::ErrnoPreserver keep;
  release.Closed();
  if (path != nullptr) {
    ucp::dispatch::OnOpen(FdOf(ret), AT_FDCWD, path, flags);
  } else if (ret != nullptr) {
    ucp::dispatch::OnFdopen(FdOf(ret), flags);
  }
  return ret;
}

}  // namespace

extern "C" UCP_EXPORT FILE* fopen(const char* path, const char* mode) {
  return Fopen(path, mode, [&](const char* p) { return ucp::real::fopen()(p, mode); });
}

extern "C" UCP_EXPORT FILE* fopen64(const char* path, const char* mode) {
  return Fopen(path, mode, [&](const char* p) { return ucp::real::fopen64()(p, mode); });
}

extern "C" UCP_EXPORT FILE* freopen(const char* path, const char* mode, FILE* stream) {
  return Freopen(path, mode, stream,
                 [&](const char* p) { return ucp::real::freopen()(p, mode, stream); });
}

extern "C" UCP_EXPORT FILE* freopen64(const char* path, const char* mode, FILE* stream) {
  return Freopen(path, mode, stream,
                 [&](const char* p) { return ucp::real::freopen64()(p, mode, stream); });
}

extern "C" UCP_EXPORT FILE* fdopen(int fd, const char* mode) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::fdopen()(fd, mode);
  ucp::ReentrancyGuard guard;
  FILE* const stream = ucp::real::fdopen()(fd, mode);
  ucp::ErrnoPreserver keep;
  if (stream != nullptr) ucp::dispatch::OnFdopen(fd, FlagsOfMode(mode));
  return stream;
}

extern "C" UCP_EXPORT int fclose(FILE* stream) {
  if (!ucp::InterceptGate()) return ucp::real::fclose()(stream);
  const int fd = FdOf(stream);
  if (!ucp::FdTable::Get().MaybeTracked(fd)) return ucp::real::fclose()(stream);
  ucp::ReentrancyGuard guard;
  ucp::dispatch::FdRelease release(fd);
  const int ret = ucp::real::fclose()(stream);
  ucp::ErrnoPreserver keep;
  release.Closed();
  return ret;
}

extern "C" UCP_EXPORT size_t fwrite(const void* data, size_t size, size_t count, FILE* stream) {
  if (!ucp::InterceptGate()) return ucp::real::fwrite()(data, size, count, stream);
  const int fd = FdOf(stream);
  if (!ucp::FdTable::Get().MaybeTracked(fd)) return ucp::real::fwrite()(data, size, count, stream);
  ucp::ReentrancyGuard guard;
  // fwrite's size * count cannot overflow for a buffer that exists; a call claiming more writes
  // nothing ucp could hash anyway.
  size_t bytes = 0;
  if (__builtin_mul_overflow(size, count, &bytes))
    return ucp::real::fwrite()(data, size, count, stream);
  ucp::dispatch::TrackedWrite tracked(fd, -1, data, bytes);
  const size_t ret = ucp::real::fwrite()(data, size, count, stream);
  ucp::ErrnoPreserver keep;
  tracked.Done(static_cast<ssize_t>(ret * size));
  return ret;
}
