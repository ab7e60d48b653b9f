// A host program that exercises every hooked libc family in the directory argv[1] and prints
// what each call returned (value and errno name) and what ended up on disk. Its output must be
// byte-identical with and without libucp.so preloaded.

#include <dirent.h>
#include <fcntl.h>
#include <linux/close_range.h>
#include <stdio.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string dir;

std::string P(const std::string& name) { return dir + "/" + name; }

// "name = ret" or "name = -1 (ENOENT)".
void Report(const char* what, long ret) {
  const int err = errno;
  std::cout << what << " = " << ret;
  if (ret < 0) std::cout << " (" << strerrorname_np(err) << ")";
  std::cout << "\n";
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void Listing() {
  DIR* d = opendir(dir.c_str());
  std::vector<std::string> names;
  while (struct dirent* entry = readdir(d)) names.emplace_back(entry->d_name);
  closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    if (name == "." || name == "..") continue;
    struct stat st;
    stat(P(name).c_str(), &st);
    const std::string contents = Contents(P(name));
    std::cout << "file " << name << " size " << st.st_size << " ";
    if (contents.size() <= 64) {
      std::cout << "[" << contents << "]\n";
    } else {
      std::cout << "hash " << std::hash<std::string>()(contents) << "\n";
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  dir = argv[1];

  // Errors: the host must see exactly the errno it would see without ucp.
  errno = 0;
  Report("open missing", open(P("missing/x").c_str(), O_RDONLY));
  Report("open missing for write", open(P("missing/x").c_str(), O_WRONLY | O_CREAT, 0644));
  Report("write closed fd", write(999, "x", 1));
  Report("close closed fd", close(999));
  Report("close -1", close(-1));
  Report("pwrite closed fd", pwrite(998, "x", 1, 0));
  Report("lseek closed fd", lseek(997, 0, SEEK_SET));
  Report("dup closed fd", dup(996));
  Report("dup2 closed fd", dup2(996, 100));
  Report("fcntl closed fd", fcntl(996, F_DUPFD, 0));
  Report("fsync closed fd", fsync(995));
  struct stat st;
  Report("stat missing", stat(P("missing").c_str(), &st));
  Report("lstat missing", lstat(P("missing").c_str(), &st));
  Report("access bad mode", access(dir.c_str(), 0x100));
  Report("access missing", access(P("missing").c_str(), F_OK));
  Report("rename missing", rename(P("missing").c_str(), P("other").c_str()));
  Report("unlink missing", unlink(P("missing").c_str()));
  // A null path is the kernel's to refuse (EFAULT); volatile keeps the compiler from seeing it.
  const char* volatile null_path = nullptr;
  Report("open null", open(null_path, O_RDONLY));
  Report("open null for write", open(null_path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  Report("stat null", stat(null_path, &st));
  Report("access null", access(null_path, F_OK));
  errno = 0;
  FILE* missing = fopen(P("missing/x").c_str(), "r");
  Report("fopen missing", missing == nullptr ? -1 : 0);
  Report("opendir missing", opendir(P("missing").c_str()) == nullptr ? -1 : 0);
  int pipe_fds[2];
  Report("pipe", pipe(pipe_fds));
  Report("lseek pipe", lseek(pipe_fds[0], 0, SEEK_SET));
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  // errno untouched by successful calls (the host's own value survives).
  errno = 12345;
  const int dev_null = open("/dev/null", O_WRONLY);
  const bool wrote = write(dev_null, "x", 1) == 1;
  close(dev_null);
  std::cout << "wrote /dev/null = " << wrote << "\n";
  std::cout << "errno after successful calls = " << errno << "\n";

  // The open family and writes.
  int fd = open(P("a.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Report("write", write(fd, "hello ", 6));
  struct iovec iov[2] = {{const_cast<char*>("wor"), 3}, {const_cast<char*>("ld"), 2}};
  Report("writev", writev(fd, iov, 2));
  Report("pwrite", pwrite(fd, "H", 1, 0));
  Report("pwritev", pwritev(fd, iov, 1, 6));
  Report("pwritev2", pwritev2(fd, iov + 1, 1, -1, 0));
  Report("lseek query", lseek(fd, 0, SEEK_CUR));
  Report("lseek end", lseek64(fd, 0, SEEK_END));
  Report("fsync", fsync(fd));
  Report("fdatasync", fdatasync(fd));
  const int copy = dup(fd);
  Report("write dup", write(copy, "!", 1));
  Report("dup2", dup2(fd, 50));
  Report("write dup2", write(50, "?", 1));
  Report("dup3", dup3(fd, 51, O_CLOEXEC));
  Report("fcntl dupfd", fcntl(fd, F_DUPFD_CLOEXEC, 60) >= 60 ? 0 : -1);
  Report("fcntl getfl", fcntl(fd, F_GETFL) & O_ACCMODE);
  Report("close_range", close_range(50, 70, 0));
  Report("close dup", close(copy));
  Report("close", close(fd));

  const int dirfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  fd = openat(dirfd, "./sub/../b.bin", O_RDWR | O_CREAT | O_EXCL, 0600);
  Report("openat missing sub", fd);
  fd = openat(dirfd, "b.bin", O_RDWR | O_CREAT | O_EXCL, 0600);
  Report("write b", write(fd, "bbbb", 4));
  Report("openat excl again", openat(dirfd, "b.bin", O_RDWR | O_CREAT | O_EXCL, 0600));
  close(fd);
  fd = creat(P("c.bin").c_str(), 0644);
  Report("write c", write(fd, "cc", 2));
  close(fd);
  fd = open64(P("c.bin").c_str(), O_WRONLY | O_APPEND);
  Report("append c", write(fd, "C", 1));
  close(fd);

  // sendfile / copy_file_range from a into d.
  const int in = open(P("a.bin").c_str(), O_RDONLY);
  const int out = open(P("d.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Report("sendfile", sendfile(out, in, nullptr, 5));
  off64_t in_offset = 0;
  Report("copy_file_range", copy_file_range(in, &in_offset, out, nullptr, 3, 0));
  close(in);
  close(out);

  // stdio and libstdc++ streams.
  FILE* f = fopen(P("e.txt").c_str(), "w");
  Report("fwrite", static_cast<long>(fwrite("stdio line\n", 1, 11, f)));
  Report("fclose", fclose(f));
  f = fopen64(P("e.txt").c_str(), "a+");
  Report("fwrite append", static_cast<long>(fwrite("more\n", 5, 1, f)));
  f = freopen(P("f.txt").c_str(), "w", f);
  Report("fwrite after freopen", static_cast<long>(fwrite("reopened\n", 1, 9, f)));
  fclose(f);
  fd = open(P("g.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  f = fdopen(fd, "w");
  Report("fwrite fdopen", static_cast<long>(fwrite("fdopen\n", 1, 7, f)));
  fclose(f);
  {
    std::ofstream stream(P("h.bin"), std::ios::binary);
    stream << "ofstream " << 3.5 << std::string(10000, 'z');
  }
  f = fopen(P("h.bin").c_str(), "r");
  char buffer[9] = {};
  Report("fread", static_cast<long>(fread(buffer, 1, 8, f)));
  std::cout << "read [" << buffer << "]\n";
  fclose(f);

  // Metadata.
  Report("stat size", stat(P("a.bin").c_str(), &st) == 0 ? st.st_size : -1);
  Report("lstat size", lstat(P("b.bin").c_str(), &st) == 0 ? st.st_size : -1);
  Report("fstatat size", fstatat(dirfd, "c.bin", &st, 0) == 0 ? st.st_size : -1);
  Report("fstatat empty path",
         fstatat(dirfd, "", &st, AT_EMPTY_PATH) == 0 ? S_ISDIR(st.st_mode) : -1);
  struct statx stx;
  Report("statx size",
         statx(dirfd, "d.bin", 0, STATX_SIZE, &stx) == 0 ? static_cast<long>(stx.stx_size) : -1);
  Report("access", access(P("a.bin").c_str(), R_OK | W_OK));
  Report("faccessat", faccessat(dirfd, "b.bin", R_OK, AT_EACCESS));

  // Renames and unlinks.
  Report("rename", rename(P("c.bin").c_str(), P("c2.bin").c_str()));
  Report("renameat", renameat(dirfd, "c2.bin", dirfd, "c3.bin"));
  Report("renameat2 noreplace", renameat2(dirfd, "c3.bin", dirfd, "a.bin", RENAME_NOREPLACE));
  Report("unlink", unlink(P("b.bin").c_str()));
  Report("unlinkat", unlinkat(dirfd, "d.bin", 0));
  close(dirfd);

  Listing();
  return 0;
}
