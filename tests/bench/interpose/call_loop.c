/* Makes one kind of libc call on a file ucp does not track, N times: the host program that
 * instructions.sh counts instructions of under valgrind, with and without the preload.
 * Usage: call_loop FILE N write|stat|open_read|open_write */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const char* path = argv[1];
  const long n = atol(argv[2]);
  const char* call = argv[3];
  char buffer[8] = {0};
  struct stat st;
  const int null_fd = open("/dev/null", O_WRONLY);
  if (null_fd < 0) return 1;
  for (long i = 0; i < n; ++i) {
    if (strcmp(call, "write") == 0) {
      if (write(null_fd, buffer, sizeof(buffer)) != (ssize_t)sizeof(buffer)) return 1;
    } else if (strcmp(call, "stat") == 0) {
      if (stat(path, &st) != 0) return 1;
    } else if (strcmp(call, "open_read") == 0 || strcmp(call, "open_write") == 0) {
      const int fd = open(path, call[5] == 'r' ? O_RDONLY : O_WRONLY);
      if (fd < 0 || close(fd) != 0) return 1;
    } else {
      return 2;
    }
  }
  return 0;
}
