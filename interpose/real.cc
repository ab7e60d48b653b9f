#include "interpose/real.h"

#include <dlfcn.h>
#include <errno.h>
#include <linux/stat.h>
#include <stdarg.h>
#include <sys/syscall.h>

#include <cstring>

namespace ucp::real {
namespace fallback {

// Used only when neither RTLD_NEXT nor libc.so.6 has the symbol (a libc too old for
// close_range, say). Each one is the raw system call the libc function wraps, or, for pure
// library functions, a failure with ENOSYS: never a crash.

int ModeArg(int flags, va_list args) {
  return (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(args, int) : 0;
}

int open(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int mode = ModeArg(flags, args);
  va_end(args);
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags, mode));
}
int open64(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int mode = ModeArg(flags, args);
  va_end(args);
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags | O_LARGEFILE, mode));
}
int openat(int dirfd, const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int mode = ModeArg(flags, args);
  va_end(args);
  return static_cast<int>(::syscall(SYS_openat, dirfd, path, flags, mode));
}
int openat64(int dirfd, const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int mode = ModeArg(flags, args);
  va_end(args);
  return static_cast<int>(::syscall(SYS_openat, dirfd, path, flags | O_LARGEFILE, mode));
}
int __open_2(const char* path, int flags) {
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags, 0));
}
int __open64_2(const char* path, int flags) {
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags | O_LARGEFILE, 0));
}
int __openat_2(int dirfd, const char* path, int flags) {
  return static_cast<int>(::syscall(SYS_openat, dirfd, path, flags, 0));
}
int __openat64_2(int dirfd, const char* path, int flags) {
  return static_cast<int>(::syscall(SYS_openat, dirfd, path, flags | O_LARGEFILE, 0));
}
int creat(const char* path, mode_t mode) {
  return static_cast<int>(
      ::syscall(SYS_openat, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode));
}
int creat64(const char* path, mode_t mode) {
  return static_cast<int>(
      ::syscall(SYS_openat, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC | O_LARGEFILE, mode));
}

template <typename T>
T Unavailable(T failure) {
  errno = ENOSYS;
  return failure;
}
FILE* fopen(const char*, const char*) { return Unavailable<FILE*>(nullptr); }
FILE* fopen64(const char*, const char*) { return Unavailable<FILE*>(nullptr); }
FILE* freopen(const char*, const char*, FILE*) { return Unavailable<FILE*>(nullptr); }
FILE* freopen64(const char*, const char*, FILE*) { return Unavailable<FILE*>(nullptr); }
FILE* fdopen(int, const char*) __THROW { return Unavailable<FILE*>(nullptr); }
int fclose(FILE*) { return Unavailable(EOF); }
size_t fwrite(const void*, size_t, size_t, FILE*) { return Unavailable<size_t>(0); }
DIR* opendir(const char*) { return Unavailable<DIR*>(nullptr); }
DIR* fdopendir(int) { return Unavailable<DIR*>(nullptr); }
struct dirent* readdir(DIR*) {
  return Unavailable<struct dirent*>(nullptr);
}
struct dirent64* readdir64(DIR*) {
  return Unavailable<struct dirent64*>(nullptr);
}
// Without a libc rewinddir the stream cannot be rewound; it has no way to report that.
void rewinddir(DIR*) __THROW {}
int closedir(DIR*) { return Unavailable(-1); }

ssize_t write(int fd, const void* buf, size_t n) { return ::syscall(SYS_write, fd, buf, n); }
ssize_t writev(int fd, const struct iovec* iov, int iovcnt) {
  return ::syscall(SYS_writev, fd, iov, iovcnt);
}
ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  return ::syscall(SYS_pwrite64, fd, buf, n, offset);
}
ssize_t pwrite64(int fd, const void* buf, size_t n, off64_t offset) {
  return ::syscall(SYS_pwrite64, fd, buf, n, offset);
}
// The kernel takes the offset as (low, high) words; on 64-bit the low word holds all of it.
ssize_t pwritev(int fd, const struct iovec* iov, int iovcnt, off_t offset) {
  return ::syscall(SYS_pwritev, fd, iov, iovcnt, offset, 0);
}
ssize_t pwritev64(int fd, const struct iovec* iov, int iovcnt, off64_t offset) {
  return ::syscall(SYS_pwritev, fd, iov, iovcnt, offset, 0);
}
ssize_t pwritev2(int fd, const struct iovec* iov, int iovcnt, off_t offset, int flags) {
  return ::syscall(SYS_pwritev2, fd, iov, iovcnt, offset, 0, flags);
}
off_t lseek(int fd, off_t offset, int whence) __THROW {
  return ::syscall(SYS_lseek, fd, offset, whence);
}
off64_t lseek64(int fd, off64_t offset, int whence) __THROW {
  return ::syscall(SYS_lseek, fd, offset, whence);
}
ssize_t sendfile(int out_fd, int in_fd, off_t* offset, size_t count) __THROW {
  return ::syscall(SYS_sendfile, out_fd, in_fd, offset, count);
}
ssize_t sendfile64(int out_fd, int in_fd, off64_t* offset, size_t count) __THROW {
  return ::syscall(SYS_sendfile, out_fd, in_fd, offset, count);
}
ssize_t copy_file_range(int in_fd, off64_t* in_off, int out_fd, off64_t* out_off, size_t n,
                        unsigned int flags) {
  return ::syscall(SYS_copy_file_range, in_fd, in_off, out_fd, out_off, n, flags);
}
int fsync(int fd) { return static_cast<int>(::syscall(SYS_fsync, fd)); }
int fdatasync(int fd) { return static_cast<int>(::syscall(SYS_fdatasync, fd)); }

int close(int fd) { return static_cast<int>(::syscall(SYS_close, fd)); }
int dup(int fd) __THROW { return static_cast<int>(::syscall(SYS_dup, fd)); }
int dup2(int fd, int fd2) __THROW { return static_cast<int>(::syscall(SYS_dup2, fd, fd2)); }
int dup3(int fd, int fd2, int flags) __THROW {
  return static_cast<int>(::syscall(SYS_dup3, fd, fd2, flags));
}
// Every fcntl command takes at most one argument, an int or a pointer: read it as a word.
int fcntl(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  const long arg = va_arg(args, long);
  va_end(args);
  return static_cast<int>(::syscall(SYS_fcntl, fd, cmd, arg));
}
int fcntl64(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  const long arg = va_arg(args, long);
  va_end(args);
  return static_cast<int>(::syscall(SYS_fcntl, fd, cmd, arg));
}
int close_range(unsigned int first, unsigned int last, int flags) __THROW {
  return static_cast<int>(::syscall(SYS_close_range, first, last, flags));
}

// x86_64's struct stat is the kernel's, which newfstatat fills.
int stat(const char* __restrict path, struct stat* __restrict buf) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0));
}
int stat64(const char* __restrict path, struct stat64* __restrict buf) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0));
}
int lstat(const char* __restrict path, struct stat* __restrict buf) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, AT_SYMLINK_NOFOLLOW));
}
int lstat64(const char* __restrict path, struct stat64* __restrict buf) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, AT_SYMLINK_NOFOLLOW));
}
int fstatat(int dirfd, const char* __restrict path, struct stat* __restrict buf,
            int flags) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, dirfd, path, buf, flags));
}
int fstatat64(int dirfd, const char* __restrict path, struct stat64* __restrict buf,
              int flags) __THROW {
  return static_cast<int>(::syscall(SYS_newfstatat, dirfd, path, buf, flags));
}
int statx(int dirfd, const char* __restrict path, int flags, unsigned int mask,
          struct statx* __restrict buf) __THROW {
  return static_cast<int>(::syscall(SYS_statx, dirfd, path, flags, mask, buf));
}
int __xstat(int, const char* path, struct stat* buf) {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0));
}
int __xstat64(int, const char* path, struct stat64* buf) {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0));
}
int __lxstat(int, const char* path, struct stat* buf) {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, AT_SYMLINK_NOFOLLOW));
}
int __lxstat64(int, const char* path, struct stat64* buf) {
  return static_cast<int>(::syscall(SYS_newfstatat, AT_FDCWD, path, buf, AT_SYMLINK_NOFOLLOW));
}
int __fxstatat(int, int dirfd, const char* path, struct stat* buf, int flags) {
  return static_cast<int>(::syscall(SYS_newfstatat, dirfd, path, buf, flags));
}
int __fxstatat64(int, int dirfd, const char* path, struct stat64* buf, int flags) {
  return static_cast<int>(::syscall(SYS_newfstatat, dirfd, path, buf, flags));
}
int access(const char* path, int type) __THROW {
  return static_cast<int>(::syscall(SYS_faccessat, AT_FDCWD, path, type));
}
int faccessat(int dirfd, const char* path, int type, int flags) __THROW {
  return static_cast<int>(::syscall(SYS_faccessat2, dirfd, path, type, flags));
}

int rename(const char* from, const char* to) __THROW {
  return static_cast<int>(::syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, 0));
}
int renameat(int from_dirfd, const char* from, int to_dirfd, const char* to) __THROW {
  return static_cast<int>(::syscall(SYS_renameat2, from_dirfd, from, to_dirfd, to, 0));
}
int renameat2(int from_dirfd, const char* from, int to_dirfd, const char* to,
              unsigned int flags) __THROW {
  return static_cast<int>(::syscall(SYS_renameat2, from_dirfd, from, to_dirfd, to, flags));
}
int unlink(const char* path) __THROW {
  return static_cast<int>(::syscall(SYS_unlinkat, AT_FDCWD, path, 0));
}
int unlinkat(int dirfd, const char* path, int flags) __THROW {
  return static_cast<int>(::syscall(SYS_unlinkat, dirfd, path, flags));
}

}  // namespace fallback

namespace internal {

std::atomic<void*> g_slots[kSymbolCount];

}  // namespace internal

namespace {

struct Entry {
  const char* name;
  void* fallback;
};

// Each fallback, typed as the libc function it replaces: a signature mismatch fails to compile.
#define UCP_REAL_FALLBACK(name) constexpr decltype(&::name) kFallback_##name = &fallback::name;
UCP_REAL_SYMBOLS(UCP_REAL_FALLBACK)
#undef UCP_REAL_FALLBACK

const Entry kEntries[internal::kSymbolCount] = {
#define UCP_REAL_ENTRY(name) Entry{#name, reinterpret_cast<void*>(kFallback_##name)},
    UCP_REAL_SYMBOLS(UCP_REAL_ENTRY)
#undef UCP_REAL_ENTRY
};

enum class Source : int { kUnresolved = 0, kNext, kLibc, kFallback };
std::atomic<int> g_sources[internal::kSymbolCount];

// libc.so.6 by handle: RTLD_NEXT can come up empty when libucp.so is itself loaded in an
// unusual order (dlmopen, static PIE hosts); libc is always mapped, libucp.so needs it.
void* LibcHandle() {
  static void* const handle = ::dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  return handle;
}

}  // namespace

namespace internal {

void* Resolve(Symbol symbol) noexcept {
  const int index = static_cast<int>(symbol);
  const int saved_errno = errno;
  Source source = Source::kNext;
  void* fn = ::dlsym(RTLD_NEXT, kEntries[index].name);
  if (fn == nullptr && LibcHandle() != nullptr) {
    source = Source::kLibc;
    fn = ::dlsym(LibcHandle(), kEntries[index].name);
  }
  if (fn == nullptr) {
    source = Source::kFallback;
    fn = kEntries[index].fallback;
  }
  // Two threads may race here; both store the same pointer.
  g_sources[index].store(static_cast<int>(source), std::memory_order_relaxed);
  g_slots[index].store(fn, std::memory_order_release);
  errno = saved_errno;
  return fn;
}

}  // namespace internal

void ResolveAll() noexcept {
  for (int i = 0; i < internal::kSymbolCount; ++i) {
    if (internal::g_slots[i].load(std::memory_order_acquire) == nullptr) {
      internal::Resolve(static_cast<internal::Symbol>(i));
    }
  }
}

const char* ResolutionOf(const char* name) noexcept {
  for (int i = 0; i < internal::kSymbolCount; ++i) {
    if (std::strcmp(kEntries[i].name, name) != 0) continue;
    switch (static_cast<Source>(g_sources[i].load(std::memory_order_relaxed))) {
      case Source::kNext:
        return "next";
      case Source::kLibc:
        return "libc";
      case Source::kFallback:
        return "fallback";
      case Source::kUnresolved:
        return "unresolved";
    }
  }
  return "unresolved";
}

}  // namespace ucp::real
