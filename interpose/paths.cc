#include "interpose/paths.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <cstdio>

#include "core/util/path.h"

namespace ucp {

std::string PathOfFd(int fd) noexcept {
  const int saved_errno = errno;
  char link[64];
  char target[PATH_MAX];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  const ssize_t length = ::readlink(link, target, sizeof(target));
  errno = saved_errno;
  if (length <= 0 || length >= static_cast<ssize_t>(sizeof(target)) || target[0] != '/') return {};
  try {
    return std::string(target, static_cast<size_t>(length));
  } catch (...) {
    return {};
  }
}

std::string AbsolutePath(int dirfd, const char* path) noexcept {
  if (path == nullptr || path[0] == '\0') return {};
  try {
    if (path[0] == '/') return LexicallyNormal(path);
    std::string base;
    if (dirfd == AT_FDCWD) {
      const int saved_errno = errno;
      char cwd[PATH_MAX];
      const char* got = ::getcwd(cwd, sizeof(cwd));
      errno = saved_errno;
      if (got == nullptr) return {};
      base = cwd;
    } else {
      base = PathOfFd(dirfd);
      if (base.empty()) return {};
    }
    return JoinAndNormalize(base, path);
  } catch (...) {
    return {};
  }
}

}  // namespace ucp
