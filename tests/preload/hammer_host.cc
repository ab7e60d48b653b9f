// 64 threads writing, dup'ing and closing files (and /dev/null) while the main thread forks a
// child that does file I/O of its own. Prints the resulting sizes; exits non-zero when a size
// is not what the threads wrote or the child failed.

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kThreads = 64;
constexpr int kIterations = 300;
constexpr int kChunk = 64;

std::atomic<int> failures{0};

void Check(bool ok) {
  if (!ok) failures.fetch_add(1);
}

void Worker(const std::string& dir, int t) {
  const std::string path = dir + "/t" + std::to_string(t) + ".bin";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Check(fd >= 0);
  const std::string chunk(kChunk, static_cast<char>('a' + t % 26));
  for (int i = 0; i < kIterations; ++i) {
    if (i % 10 == 0) {
      const int copy = dup(fd);
      Check(write(copy, chunk.data(), kChunk) == kChunk);
      Check(close(copy) == 0);
    } else if (i % 25 == 1) {
      const int high = 1000 + t;
      Check(dup2(fd, high) == high);
      Check(write(high, chunk.data(), kChunk) == kChunk);
      Check(close(high) == 0);
    } else {
      Check(write(fd, chunk.data(), kChunk) == kChunk);
    }
    const int null_fd = open("/dev/null", O_WRONLY);
    Check(write(null_fd, chunk.data(), kChunk) == kChunk);
    Check(close(null_fd) == 0);
    struct stat st;
    Check(fstat(fd, &st) == 0);
  }
  Check(close(fd) == 0);
}

// Runs in the forked child, whatever the other threads of the parent were doing at the fork.
int Child(const std::string& dir) {
  FILE* f = fopen((dir + "/child.txt").c_str(), "w");
  if (f == nullptr) return 1;
  for (int i = 0; i < 100; ++i) fwrite("child\n", 1, 6, f);
  if (fclose(f) != 0) return 1;
  const int fd = open((dir + "/child.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || write(fd, "xyz", 3) != 3 || close(fd) != 0) return 1;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back(Worker, dir, t);
    if (t == kThreads / 2) {
      const pid_t pid = fork();
      if (pid == 0) exit(Child(dir));
      int status = 0;
      Check(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    struct stat st;
    Check(stat((dir + "/t" + std::to_string(t) + ".bin").c_str(), &st) == 0 &&
          st.st_size == kIterations * kChunk);
  }
  struct stat st;
  Check(stat((dir + "/child.txt").c_str(), &st) == 0 && st.st_size == 600);
  std::cout << "threads " << kThreads << " bytes each " << kIterations * kChunk << " failures "
            << failures.load() << "\n";
  return failures.load() == 0 ? 0 : 1;
}
