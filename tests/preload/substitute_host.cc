// Reads argv[1] every way a loader might (open/read, openat, fopen/fread, ifstream, stat, lstat,
// statx, access) and prints what it saw.

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace {

// What read() returned as a string ("" on failure).
std::string ReadAll(int fd) {
  char buffer[256];
  const ssize_t n = fd < 0 ? -1 : read(fd, buffer, sizeof(buffer));
  return n <= 0 ? std::string() : std::string(buffer, static_cast<size_t>(n));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const char* path = argv[1];
  char buffer[256] = {};
  int fd = open(path, O_RDONLY);
  std::cout << "open/read: [" << ReadAll(fd) << "]\n";
  if (fd >= 0) close(fd);
  fd = openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
  std::cout << "openat/read: [" << ReadAll(fd) << "]\n";
  if (fd >= 0) close(fd);
  FILE* f = fopen(path, "rb");
  std::cout << "fopen/fread: ["
            << std::string(buffer, f == nullptr ? 0 : fread(buffer, 1, sizeof(buffer), f)) << "]\n";
  if (f != nullptr) fclose(f);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  std::cout << "ifstream: [" << text.str() << "]\n";
  struct stat st;
  std::cout << "stat: " << (stat(path, &st) == 0 ? st.st_size : -1) << "\n";
  std::cout << "lstat: " << (lstat(path, &st) == 0 ? st.st_size : -1) << "\n";
  struct statx stx;
  std::cout << "statx: "
            << (statx(AT_FDCWD, path, 0, STATX_SIZE, &stx) == 0 ? static_cast<long>(stx.stx_size)
                                                                : -1L)
            << "\n";
  std::cout << "access: " << access(path, R_OK) << "\n";
  return 0;
}
