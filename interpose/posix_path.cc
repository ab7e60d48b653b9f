// Renames (a commit signal for some frameworks: DCP renames .metadata into place) and unlinks.
// unlink/unlinkat pass through today; they are exported so that the save side can learn about
// deleted checkpoint files without a change to the exported symbol list.

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include "interpose/dispatch.h"
#include "interpose/gate.h"
#include "interpose/real.h"

extern "C" UCP_EXPORT int rename(const char* from, const char* to) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::rename()(from, to);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::rename()(from, to);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnRename(AT_FDCWD, from, AT_FDCWD, to, ret);
  return ret;
}

extern "C" UCP_EXPORT int renameat(int from_dirfd, const char* from, int to_dirfd,
                                   const char* to) __THROW {
  if (!ucp::InterceptGate()) return ucp::real::renameat()(from_dirfd, from, to_dirfd, to);
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::renameat()(from_dirfd, from, to_dirfd, to);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnRename(from_dirfd, from, to_dirfd, to, ret);
  return ret;
}

extern "C" UCP_EXPORT int renameat2(int from_dirfd, const char* from, int to_dirfd, const char* to,
                                    unsigned int flags) __THROW {
  if (!ucp::InterceptGate()) {
    return ucp::real::renameat2()(from_dirfd, from, to_dirfd, to, flags);
  }
  ucp::ReentrancyGuard guard;
  const int ret = ucp::real::renameat2()(from_dirfd, from, to_dirfd, to, flags);
  ucp::ErrnoPreserver keep;
  ucp::dispatch::OnRename(from_dirfd, from, to_dirfd, to, ret);
  return ret;
}

extern "C" UCP_EXPORT int unlink(const char* path) __THROW { return ucp::real::unlink()(path); }

extern "C" UCP_EXPORT int unlinkat(int dirfd, const char* path, int flags) __THROW {
  return ucp::real::unlinkat()(dirfd, path, flags);
}
