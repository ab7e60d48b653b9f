// Path metadata: the stat family (the glibc >= 2.33 exported functions and the older __xstat
// entry points still exported for old binaries) and access. On the load side these report the
// substitute's metadata when the serve policy names one (ResolveMetadata: a view's file not built
// yet is described by a placeholder of its size, so that a stat builds nothing); otherwise they
// pass through.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "interpose/dispatch.h"
#include "interpose/gate.h"
#include "interpose/libc_decls.h"
#include "interpose/real.h"

namespace {

bool Failed(int ret) { return ret != 0; }

// The call on a path the serve side may serve. Out of line, so that the common case in Meta
// saves no registers.
template <typename Call>
[[gnu::noinline]] int MetaConsidered(int dirfd, const char* path, Call& call) {
  ucp::ReentrancyGuard guard;
  return ucp::dispatch::Served(dirfd, path, call, &Failed, -1, ucp::dispatch::ServeUse::kMetadata);
}

// `call(path)` runs the real call on `path` or on its substitute.
template <typename Call>
int Meta(int dirfd, const char* path, Call&& call) {
  if (!ucp::InterceptGate() || !ucp::dispatch::MayServePath(path)) return call(path);
  return MetaConsidered(dirfd, path, call);
}

// fstatat(fd, "", AT_EMPTY_PATH) describes the fd itself: nothing to substitute.
bool NamesFdItself(const char* path, int flags) {
  return (flags & AT_EMPTY_PATH) != 0 && path != nullptr && path[0] == '\0';
}

}  // namespace

extern "C" UCP_EXPORT int stat(const char* __restrict path, struct stat* __restrict buf) __THROW {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::stat()(p, buf); });
}

extern "C" UCP_EXPORT int stat64(const char* __restrict path,
                                 struct stat64* __restrict buf) __THROW {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::stat64()(p, buf); });
}

extern "C" UCP_EXPORT int lstat(const char* __restrict path, struct stat* __restrict buf) __THROW {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::lstat()(p, buf); });
}

extern "C" UCP_EXPORT int lstat64(const char* __restrict path,
                                  struct stat64* __restrict buf) __THROW {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::lstat64()(p, buf); });
}

extern "C" UCP_EXPORT int fstatat(int dirfd, const char* __restrict path,
                                  struct stat* __restrict buf, int flags) __THROW {
  auto call = [&](const char* p) { return ucp::real::fstatat()(dirfd, p, buf, flags); };
  return NamesFdItself(path, flags) ? call(path) : Meta(dirfd, path, call);
}

extern "C" UCP_EXPORT int fstatat64(int dirfd, const char* __restrict path,
                                    struct stat64* __restrict buf, int flags) __THROW {
  auto call = [&](const char* p) { return ucp::real::fstatat64()(dirfd, p, buf, flags); };
  return NamesFdItself(path, flags) ? call(path) : Meta(dirfd, path, call);
}

extern "C" UCP_EXPORT int statx(int dirfd, const char* __restrict path, int flags,
                                unsigned int mask, struct statx* __restrict buf) __THROW {
  auto call = [&](const char* p) { return ucp::real::statx()(dirfd, p, flags, mask, buf); };
  return NamesFdItself(path, flags) ? call(path) : Meta(dirfd, path, call);
}

extern "C" UCP_EXPORT int __xstat(int version, const char* path, struct stat* buf) {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::__xstat()(version, p, buf); });
}

extern "C" UCP_EXPORT int __xstat64(int version, const char* path, struct stat64* buf) {
  return Meta(AT_FDCWD, path,
              [&](const char* p) { return ucp::real::__xstat64()(version, p, buf); });
}

extern "C" UCP_EXPORT int __lxstat(int version, const char* path, struct stat* buf) {
  return Meta(AT_FDCWD, path,
              [&](const char* p) { return ucp::real::__lxstat()(version, p, buf); });
}

extern "C" UCP_EXPORT int __lxstat64(int version, const char* path, struct stat64* buf) {
  return Meta(AT_FDCWD, path,
              [&](const char* p) { return ucp::real::__lxstat64()(version, p, buf); });
}

extern "C" UCP_EXPORT int __fxstatat(int version, int dirfd, const char* path, struct stat* buf,
                                     int flags) {
  auto call = [&](const char* p) { return ucp::real::__fxstatat()(version, dirfd, p, buf, flags); };
  return NamesFdItself(path, flags) ? call(path) : Meta(dirfd, path, call);
}

extern "C" UCP_EXPORT int __fxstatat64(int version, int dirfd, const char* path, struct stat64* buf,
                                       int flags) {
  auto call = [&](const char* p) {
    return ucp::real::__fxstatat64()(version, dirfd, p, buf, flags);
  };
  return NamesFdItself(path, flags) ? call(path) : Meta(dirfd, path, call);
}

extern "C" UCP_EXPORT int access(const char* path, int type) __THROW {
  return Meta(AT_FDCWD, path, [&](const char* p) { return ucp::real::access()(p, type); });
}

extern "C" UCP_EXPORT int faccessat(int dirfd, const char* path, int type, int flags) __THROW {
  return Meta(dirfd, path,
              [&](const char* p) { return ucp::real::faccessat()(dirfd, p, type, flags); });
}
