// ucp::real: typed, cached pointers to the definitions that libucp.so's wrappers hide.
//
// `ucp::real::write()` returns the next definition of write after libucp.so (glibc's, usually),
// typed as decltype(&::write). Every pointer is resolved by ResolveAll() in the constructor;
// a wrapper that runs earlier (another preloaded library's constructor calling open) resolves
// its symbol lazily with one atomic store. Resolution never fails fatally: dlsym(RTLD_NEXT),
// then libc.so.6 by handle, then a local fallback: the raw system call for the syscall-backed
// functions, an ENOSYS failure for the pure-library ones (stdio, dirent), which libc always has.
//
// ucp's own code must call these, never the hooked names (DESIGN.md §6.4).
//
// Thread-safety: every accessor may be called from any thread at any time, also before
// ResolveAll() and after the destructor ran; the pointers never change once resolved.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>

#include "interpose/libc_decls.h"

// Every real symbol, in one list, by wrapper family: the name of the libc function only.
// clang-format off
#define UCP_REAL_SYMBOLS(X)                                                                   \
  X(open) X(open64) X(openat) X(openat64) X(__open_2) X(__open64_2) X(__openat_2)            \
  X(__openat64_2) X(creat) X(creat64)                                                        \
  X(fopen) X(fopen64) X(freopen) X(freopen64) X(fdopen) X(fclose) X(fwrite)                  \
  X(write) X(writev) X(pwrite) X(pwrite64) X(pwritev) X(pwritev64) X(pwritev2)               \
  X(lseek) X(lseek64) X(sendfile) X(sendfile64) X(copy_file_range) X(fsync) X(fdatasync)     \
  X(close) X(dup) X(dup2) X(dup3) X(fcntl) X(fcntl64) X(close_range)                         \
  X(stat) X(stat64) X(lstat) X(lstat64) X(fstatat) X(fstatat64) X(statx) X(__xstat)          \
  X(__xstat64) X(__lxstat) X(__lxstat64) X(__fxstatat) X(__fxstatat64) X(access)             \
  X(faccessat)                                                                               \
  X(opendir) X(fdopendir) X(readdir) X(readdir64) X(rewinddir) X(closedir)                  \
  X(rename) X(renameat) X(renameat2) X(unlink) X(unlinkat)
// clang-format on

namespace ucp::real {

namespace internal {

enum class Symbol : int {
#define UCP_REAL_ENUM(name) k_##name,
  UCP_REAL_SYMBOLS(UCP_REAL_ENUM)
#undef UCP_REAL_ENUM
      kCount
};

inline constexpr int kSymbolCount = static_cast<int>(Symbol::kCount);

// The resolved pointers (nullptr = not yet resolved).
extern std::atomic<void*> g_slots[kSymbolCount];

// Resolves one symbol (keeping errno), stores and returns it. Never returns nullptr.
void* Resolve(Symbol symbol) noexcept;

}  // namespace internal

// Resolves every symbol now (the constructor calls this, so wrappers never hit the slow path).
void ResolveAll() noexcept;

// How `name` was resolved: "next", "libc", "fallback", or "unresolved" (for logs and tests).
const char* ResolutionOf(const char* name) noexcept;

#define UCP_REAL_ACCESSOR(name)                                                                 \
  inline decltype(&::name) name() noexcept {                                                    \
    constexpr int kIndex = static_cast<int>(internal::Symbol::k_##name);                        \
    void* fn = internal::g_slots[kIndex].load(std::memory_order_acquire);                       \
    if (__builtin_expect(fn == nullptr, 0)) fn = internal::Resolve(internal::Symbol::k_##name); \
    return reinterpret_cast<decltype(&::name)>(fn);                                             \
  }
UCP_REAL_SYMBOLS(UCP_REAL_ACCESSOR)
#undef UCP_REAL_ACCESSOR

}  // namespace ucp::real
