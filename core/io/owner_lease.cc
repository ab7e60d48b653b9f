#include "core/io/owner_lease.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <random>
#include <sstream>
#include <utility>

namespace ucp {
namespace {

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  return host;
}

// The whole small file at `path`; empty when it cannot be read.
std::string ReadSmallFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buffer[512];
  const ssize_t n = ::read(fd, buffer, sizeof(buffer));
  ::close(fd);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
}

// What a waiter watches of a lease to tell a live owner from a hung one: any change of it.
struct Sighting {
  std::string record;
  int64_t mtime_ns = 0;
  ino_t inode = 0;
  bool operator==(const Sighting&) const = default;
};

std::optional<Sighting> Look(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return std::nullopt;
  return Sighting{ReadSmallFile(path),
                  int64_t{info.st_mtim.tv_sec} * 1000000000 + info.st_mtim.tv_nsec, info.st_ino};
}

// Whether the record names a process of this host that no longer exists.
bool OwnerIsDeadHere(const std::string& record) {
  std::istringstream in(record);
  std::string host;
  long pid = 0;
  if (!(in >> host >> pid) || pid <= 0 || host != HostName()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

std::string NewLeaseRecord() {
  static std::atomic<uint64_t> counter{0};
  std::random_device random;
  std::ostringstream out;
  out << HostName() << ' ' << ::getpid() << ' ' << std::hex << random() << random() << '-'
      << counter.fetch_add(1);
  return out.str();
}

struct OwnerLease::State {
  std::string path;
  std::string record;
  std::chrono::milliseconds heartbeat{1000};
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
  std::atomic<bool> lost{false};
  std::thread beat;

  void Beat() {
    std::unique_lock lock(mutex);
    while (!wake.wait_for(lock, heartbeat, [this] { return stopping; })) {
      if (ReadSmallFile(path) != record) {
        lost.store(true);
        return;
      }
      ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // now, by the file system's clock
    }
  }
};

Result<std::optional<OwnerLease>> OwnerLease::Acquire(const std::string& path,
                                                      const Options& options,
                                                      const std::function<bool()>& done) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options.wait;
  WaitBackoff backoff(options.max_poll);
  std::optional<Sighting> watched;
  auto watched_since = start;
  std::string last_owner;
  const std::string record = NewLeaseRecord();
  while (true) {
    if (done && done()) return std::optional<OwnerLease>();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const bool written =
          ::write(fd, record.data(), record.size()) == static_cast<ssize_t>(record.size());
      ::close(fd);
      if (!written) {
        ::unlink(path.c_str());
        return Status::Internal("lease: write " + path);
      }
      auto state = std::make_unique<State>();
      state->path = path;
      state->record = record;
      state->heartbeat = options.heartbeat;
      State* raw = state.get();
      state->beat = std::thread([raw] { raw->Beat(); });
      return std::optional<OwnerLease>(OwnerLease(std::move(state)));
    }
    if (errno != EEXIST) return PosixError("lease: create " + path, errno);

    const auto now = std::chrono::steady_clock::now();
    const std::optional<Sighting> seen = Look(path);
    if (seen) {
      last_owner = seen->record;
      if (!watched || !(*watched == *seen)) {
        watched = seen;
        watched_since = now;
      }
      const bool dead = OwnerIsDeadHere(seen->record);
      const bool hung = now - watched_since >= options.stale_after;
      if (dead || hung) {
        // Move the stale lease aside under a name of ours, then try again to create it. When
        // what moved is not the lease judged stale (another waiter took over first and created
        // a fresh one), put it back if the name is still free.
        static std::atomic<uint64_t> asides{0};
        const std::string aside = path + ".stale-" + std::to_string(::getpid()) + "-" +
                                  std::to_string(asides.fetch_add(1));
        if (::rename(path.c_str(), aside.c_str()) == 0) {
          if (ReadSmallFile(aside) != seen->record) (void)::link(aside.c_str(), path.c_str());
          ::unlink(aside.c_str());
          watched.reset();
          continue;
        }
      }
    }
    if (now >= deadline) {
      return Status::FailedPrecondition(
          "lease: " + path + ": still held by " + (last_owner.empty() ? "another" : last_owner) +
          " after " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
          " ms");
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(backoff.Next(now), deadline - now));
  }
}

OwnerLease::OwnerLease(std::unique_ptr<State> state) : state_(std::move(state)) {}

OwnerLease::OwnerLease(OwnerLease&& other) noexcept : state_(std::move(other.state_)) {}

OwnerLease::~OwnerLease() {
  if (state_ == nullptr) return;
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->wake.notify_all();
  if (state_->beat.joinable()) state_->beat.join();
  if (ReadSmallFile(state_->path) == state_->record) ::unlink(state_->path.c_str());
}

bool OwnerLease::lost() const { return state_ != nullptr && state_->lost.load(); }

}  // namespace ucp
