// 64 threads writing one DeepSpeed checkpoint tag (files whose names ucp tracks) through every
// write family (write through dup'd fds, stdio, writev, in-order and out-of-order pwrite) while
// the main thread forks in the middle of the save: half the threads are parked half-way through
// their file, the other half keep writing. The forked child writes a tracked name of its own and
// leaves with _exit. After every thread finished, the main thread writes `latest`, the commit
// signal.
//
// Usage: tracked_hammer_host SAVE_DIR MODEL_STATES. Writes SAVE_DIR/global_step1/<names> (64
// optimizer files of pseudo-random bytes, and the model states with MODEL_STATES' bytes) and
// SAVE_DIR/latest, prints "tracked NAME SIZE" per file the parent wrote (sorted), and exits
// non-zero when a call failed, a file's bytes are not what its thread wrote, or the child failed.

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kThreads = 64;
constexpr int kChunks = 96;
constexpr char kTag[] = "global_step1";

std::atomic<int> failures{0};
std::atomic<int> parked{0};
std::atomic<bool> forked{false};

void Check(bool ok) {
  if (!ok) failures.fetch_add(1);
}

// File `f` (0..kThreads): optimizer states of rank f, written by thread f, or for f == kThreads
// the model states, written by thread 0 after its optimizer states. How each is written:
enum class Family { kDupWrite, kStdio, kWritev, kPwrite, kPwriteOutOfOrder };

Family FamilyOf(int f) { return static_cast<Family>(f % 5); }

std::string NameOf(int f) {
  if (f == kThreads) return "mp_rank_00_model_states.pt";
  return "zero_pp_rank_" + std::to_string(f) + "_mp_rank_00_optim_states.pt";
}

// The model states' bytes (a real torch.save'd file given on the command line, so that ucp's
// index build after the commit finds a DeepSpeed tag of kThreads ranks).
std::string model_states;

// File `f`'s bytes: the model states, or 1..512 KiB of a per-file pseudo-random stream.
std::string Expected(int f) {
  if (f == kThreads) return model_states;
  uint64_t state = static_cast<uint64_t>(f) + 1;
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  };
  std::string bytes(1 + next() % (512 << 10), '\0');
  for (char& c : bytes) c = static_cast<char>(next());
  return bytes;
}

// Chunk `i` of kChunks of `bytes`.
std::string Chunk(const std::string& bytes, int i) {
  const size_t begin = bytes.size() * static_cast<size_t>(i) / kChunks;
  const size_t end = bytes.size() * static_cast<size_t>(i + 1) / kChunks;
  return bytes.substr(begin, end - begin);
}

// Parks even threads half-way through their file until the fork is done.
void MaybePark(int f, int i) {
  if (f % 2 != 0 || f == kThreads || i != kChunks / 2) return;
  parked.fetch_add(1);
  while (!forked.load()) std::this_thread::yield();
}

// Untracked traffic between tracked writes: fd numbers come and go while the tracked files live.
void Churn(const std::string& chunk) {
  const int null_fd = open("/dev/null", O_WRONLY);
  Check(null_fd >= 0 &&
        write(null_fd, chunk.data(), chunk.size()) == static_cast<ssize_t>(chunk.size()));
  Check(close(null_fd) == 0);
}

bool WriteAll(int fd, const std::string& bytes) {
  return write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
}

void WriteFile(const std::string& tag_dir, int t) {
  const std::string path = tag_dir + "/" + NameOf(t);
  const std::string bytes = Expected(t);
  switch (FamilyOf(t)) {
    case Family::kDupWrite: {
      // Writes through the original, a dup and a dup2 copy; the original is closed half-way, so
      // the last close is a dup's.
      int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      Check(fd >= 0);
      const int copy = dup(fd);
      const int high = 1000 + t;
      Check(copy >= 0 && dup2(fd, high) == high);
      for (int i = 0; i < kChunks; ++i) {
        MaybePark(t, i);
        const std::string chunk = Chunk(bytes, i);
        if (i == kChunks / 3) {
          Check(close(fd) == 0);
          fd = -1;
        }
        const int target = i % 3 == 0 && fd >= 0 ? fd : i % 3 == 1 ? copy : high;
        Check(WriteAll(target, chunk));
        Churn(chunk);
      }
      Check(close(copy) == 0);
      Check(close(high) == 0);
      break;
    }
    case Family::kStdio: {
      FILE* file = fopen(path.c_str(), "wb");
      Check(file != nullptr);
      if (file == nullptr) {
        MaybePark(t, kChunks / 2);  // the main thread waits for every even thread
        return;
      }
      for (int i = 0; i < kChunks; ++i) {
        MaybePark(t, i);
        const std::string chunk = Chunk(bytes, i);
        Check(fwrite(chunk.data(), 1, chunk.size(), file) == chunk.size());
        if (i % 16 == 0) Check(fflush(file) == 0);
        Churn(chunk);
      }
      Check(fclose(file) == 0);
      break;
    }
    case Family::kWritev: {
      const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      Check(fd >= 0);
      for (int i = 0; i < kChunks; i += 2) {
        MaybePark(t, i);
        std::string a = Chunk(bytes, i);
        std::string b = Chunk(bytes, i + 1);
        iovec iov[2] = {{a.data(), a.size()}, {b.data(), b.size()}};
        Check(writev(fd, iov, 2) == static_cast<ssize_t>(a.size() + b.size()));
        Churn(a);
      }
      Check(close(fd) == 0);
      break;
    }
    case Family::kPwrite:
    case Family::kPwriteOutOfOrder: {
      // In order, each pwrite at the end of the previous one; or the chunks' offsets computed
      // first and the chunks written last to first (ucp then hashes the file from disk).
      const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      Check(fd >= 0);
      std::vector<off_t> offsets;
      off_t end = 0;
      for (int i = 0; i < kChunks; ++i) {
        offsets.push_back(end);
        end += static_cast<off_t>(Chunk(bytes, i).size());
      }
      const bool reverse = FamilyOf(t) == Family::kPwriteOutOfOrder;
      for (int k = 0; k < kChunks; ++k) {
        MaybePark(t, k);
        const int i = reverse ? kChunks - 1 - k : k;
        const std::string chunk = Chunk(bytes, i);
        Check(pwrite(fd, chunk.data(), chunk.size(), offsets[i]) ==
              static_cast<ssize_t>(chunk.size()));
        Churn(chunk);
      }
      Check(close(fd) == 0);
      break;
    }
  }
}

void Worker(const std::string& tag_dir, int t) {
  WriteFile(tag_dir, t);
  if (t == 0) WriteFile(tag_dir, kThreads);
}

// Runs in the forked child, whatever the parent's threads were doing at the fork: a tracked name
// of its own in another tag (which must never reach a journal: a forked child passes through),
// and stdio.
int Child(const std::string& save_dir) {
  const std::string tag_dir = save_dir + "/global_step2";
  if (mkdir(tag_dir.c_str(), 0755) != 0) return 1;
  FILE* file = fopen((tag_dir + "/mp_rank_00_model_states.pt").c_str(), "wb");
  if (file == nullptr) return 1;
  for (int i = 0; i < 100; ++i) fwrite("child\n", 1, 6, file);
  if (fclose(file) != 0) return 1;
  const int fd = open((tag_dir + "/child.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || write(fd, "xyz", 3) != 3 || close(fd) != 0) return 1;
  return 0;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string save_dir = argv[1];
  model_states = Contents(argv[2]);
  const std::string tag_dir = save_dir + "/" + kTag;
  if (model_states.empty() || mkdir(tag_dir.c_str(), 0755) != 0) return 2;

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(Worker, tag_dir, t);
  // Every even thread holds a half-written tracked file open; the odd ones are still writing.
  while (parked.load() < kThreads / 2) std::this_thread::yield();
  const pid_t pid = fork();
  // _exit: exit() would flush the parent's half-written stdio buffers a second time.
  if (pid == 0) _exit(Child(save_dir));
  forked.store(true);
  int status = 0;
  Check(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
        WEXITSTATUS(status) == 0);
  for (auto& thread : threads) thread.join();

  const int latest = open((save_dir + "/latest").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Check(latest >= 0 && WriteAll(latest, kTag) && close(latest) == 0);

  std::vector<std::string> lines;
  for (int f = 0; f <= kThreads; ++f) {
    const std::string expected = Expected(f);
    Check(Contents(tag_dir + "/" + NameOf(f)) == expected);
    lines.push_back("tracked " + NameOf(f) + " " + std::to_string(expected.size()));
  }
  std::sort(lines.begin(), lines.end());
  for (const std::string& line : lines) std::cout << line << "\n";
  std::cout << "failures " << failures.load() << "\n";
  return failures.load() == 0 ? 0 : 1;
}
