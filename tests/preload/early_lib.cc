// A preloaded library whose constructor does file I/O. Preloaded beside libucp.so, it calls
// ucp's wrappers; in one LD_PRELOAD order it does so before ucp's own constructor ran.

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace {

__attribute__((constructor)) void EarlyIo() {
  const char* path = getenv("UCP_TEST_EARLY_FILE");
  if (path == nullptr) return;
  std::string report = "early:";
  const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  report +=
      fd >= 0 && write(fd, "early\n", 6) == 6 && close(fd) == 0 ? " write ok" : " write failed";
  struct stat st;
  report += stat(path, &st) == 0 && st.st_size == 6 ? " stat ok" : " stat failed";
  errno = 0;
  report += stat("/nonexistent/early", &st) == -1 && errno == ENOENT ? " ENOENT ok" : " errno bad";
  report += "\n";
  if (write(STDOUT_FILENO, report.data(), report.size()) < 0) abort();
}

}  // namespace
