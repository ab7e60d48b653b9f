// Declarations of glibc entry points that its headers no longer declare (or declare only under
// _FORTIFY_SOURCE), copied from the glibc versions that exported them. libucp.so defines them
// because binaries built against older or fortified headers still call them.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

extern "C" {
// <bits/fcntl2.h> (fortified open): fail when O_CREAT/O_TMPFILE is given without a mode.
int __open_2(const char* path, int flags);
int __open64_2(const char* path, int flags);
int __openat_2(int dirfd, const char* path, int flags);
int __openat64_2(int dirfd, const char* path, int flags);

// glibc < 2.33 <sys/stat.h>: stat and friends were inline calls of these, with a struct
// version number as first argument (1 on x86_64, the kernel's struct stat).
int __xstat(int version, const char* path, struct stat* buf);
int __xstat64(int version, const char* path, struct stat64* buf);
int __lxstat(int version, const char* path, struct stat* buf);
int __lxstat64(int version, const char* path, struct stat64* buf);
int __fxstatat(int version, int dirfd, const char* path, struct stat* buf, int flags);
int __fxstatat64(int version, int dirfd, const char* path, struct stat64* buf, int flags);
}
