// Absolute paths for what the host names relative to its cwd or to a directory fd.
//
// Thread-safety: reentrant; uses only getcwd/readlink, which ucp does not hook.
#pragma once

#include <string>

namespace ucp {

// The absolute, lexically normalised form of `path` as the kernel resolves it against `dirfd`
// (AT_FDCWD or a directory fd; ignored when `path` is absolute). Symbolic links are not
// resolved. Empty when it cannot be known (no cwd, dirfd not a directory, null path). Keeps
// errno.
std::string AbsolutePath(int dirfd, const char* path) noexcept;

// The path the fd was opened with, as /proc/self/fd shows it; empty when unknown. Keeps errno.
std::string PathOfFd(int fd) noexcept;

}  // namespace ucp
