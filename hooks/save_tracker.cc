#include "hooks/save_tracker.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <system_error>
#include <thread>

#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/journal.h"

namespace ucp::hooks {
namespace {

// Commit signals name a tag in a few bytes; more than this is not a tag name.
constexpr size_t kMaxSignalBytes = 4096;

int64_t WallTimeNs() {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

Result<std::string> ReadPrefix(int fd, const std::string& path, size_t limit) {
  std::string bytes(limit, '\0');
  size_t filled = 0;
  while (filled < limit) {
    const ssize_t n =
        ::pread(fd, bytes.data() + filled, limit - filled, static_cast<off_t>(filled));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("commit: read " + path, errno);
    if (n == 0) break;
    filled += static_cast<size_t>(n);
  }
  bytes.resize(filled);
  return bytes;
}

// Runs `body`, turning any exception into a log line: the host never sees one.
template <typename Body>
void Contain(const char* what, Body&& body) noexcept {
  try {
    body();
  } catch (const std::exception& error) {
    UCP_LOG_ERROR("save: {}: {}; the file is no longer tracked", what, error.what());
  } catch (...) {
    UCP_LOG_ERROR("save: {}: unknown exception; the file is no longer tracked", what);
  }
}

}  // namespace

struct SaveTracker::OpenFile {
  OpenFile(std::string_view file_path, PathMatch file_match)
      : path(file_path), match(std::move(file_match)) {}

  const std::string path;
  const PathMatch match;
  // How many fds refer to this open file (dups included); the last close finishes it.
  std::atomic<int> fds{1};
};

// One thread running posted jobs in order, started on the first Post (a process that saves
// nothing never gets a thread). In the preload it is never stopped: like every handler, it lives
// until the process ends.
class SaveTracker::Worker {
 public:
  Worker() = default;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      wake_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

  // Queues `job`. If the thread cannot be started, runs it on the caller's thread instead.
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable() && !start_failed_) {
        try {
          thread_ = std::thread(&Worker::Run, this);
        } catch (const std::system_error& error) {
          start_failed_ = true;
          UCP_LOG_WARN("save: cannot start the journal thread ({}); journaling inline",
                       error.what());
        }
      }
      if (!start_failed_) {
        jobs_.push_back(std::move(job));
        ++posted_;
        wake_.notify_one();
        return;
      }
    }
    job();
  }

  // Waits until every job posted before the call has run.
  void Drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t target = posted_;
    done_.wait(lock, [&] { return finished_ >= target; });
  }

 private:
  void Run() {
    // Everything this thread does (file I/O, logging) must pass through the wrappers.
    ReentrancyGuard guard;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return !jobs_.empty() || stopping_; });
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      Contain("journal", job);
      lock.lock();
      ++finished_;
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::deque<std::function<void()>> jobs_;
  std::thread thread_;
  bool start_failed_ = false;
  bool stopping_ = false;
  uint64_t posted_ = 0;
  uint64_t finished_ = 0;
};

SaveTracker::SaveTracker(SaveTrackerOptions options)
    : options_(std::move(options)), worker_(std::make_unique<Worker>()) {}

// The preload never destroys its tracker (handlers live forever); tests do.
SaveTracker::~SaveTracker() { Flush(); }

void SaveTracker::AddCommitListener(CommitListener* listener) {
  std::lock_guard<std::mutex> lock(listeners_mutex_);
  listeners_.push_back(listener);
}

void SaveTracker::Flush() { worker_->Drain(); }

std::shared_ptr<SaveTracker::OpenFile> SaveTracker::Find(int fd) {
  Shard& shard = ShardOf(fd);
  std::lock_guard<std::mutex> lock(shard.mutex);
  const auto it = shard.files.find(fd);
  return it == shard.files.end() ? nullptr : it->second;
}

std::shared_ptr<SaveTracker::OpenFile> SaveTracker::Insert(int fd, std::shared_ptr<OpenFile> file) {
  Shard& shard = ShardOf(fd);
  std::lock_guard<std::mutex> lock(shard.mutex);
  std::shared_ptr<OpenFile>& slot = shard.files[fd];
  std::swap(slot, file);
  return file;
}

std::shared_ptr<SaveTracker::OpenFile> SaveTracker::Erase(int fd) {
  Shard& shard = ShardOf(fd);
  std::lock_guard<std::mutex> lock(shard.mutex);
  const auto it = shard.files.find(fd);
  if (it == shard.files.end()) return nullptr;
  std::shared_ptr<OpenFile> file = std::move(it->second);
  shard.files.erase(it);
  return file;
}

bool SaveTracker::OnOpenForWrite(int fd, std::string_view path, bool, bool) {
  bool tracked = false;
  Contain("open", [&] {
    auto match = options_.layouts->Recognise(path, options_.roots);
    if (!match) return;
    if (match->role == FileRole::kData && options_.writer_check != nullptr &&
        !options_.writer_check->IsCheckpointWriter()) {
      UCP_LOG_DEBUG("save: {}: not written by a checkpoint writer (stack); not tracked", path);
      return;
    }
    auto file = std::make_shared<OpenFile>(path, std::move(*match));
    UCP_LOG_DEBUG("save: tracking {} fd {} ({} {})", path, fd, file->match.framework,
                  FileRoleName(file->match.role));
    if (std::shared_ptr<OpenFile> stale = Insert(fd, std::move(file))) {
      UCP_LOG_WARN("save: fd {} reopened while tracked as {}; the old file is finished now", fd,
                   stale->path);
      Release(stale);
    }
    tracked = true;
  });
  return tracked;
}

// The bytes are read back after the close (see the header): writes and seeks change nothing.
void SaveTracker::OnWrite(int, int64_t, const void*, size_t) {}
void SaveTracker::OnWriteVector(int, int64_t, const struct iovec*, int, size_t) {}
void SaveTracker::OnNonSequential(int) {}
void SaveTracker::OnSync(int) {}

void SaveTracker::OnDup(int old_fd, int new_fd) {
  Contain("dup", [&] {
    std::shared_ptr<OpenFile> file = Find(old_fd);
    if (file == nullptr) return;
    file->fds.fetch_add(1, std::memory_order_relaxed);
    if (std::shared_ptr<OpenFile> replaced = Insert(new_fd, std::move(file))) Release(replaced);
  });
}

void SaveTracker::OnClose(int fd) {
  Contain("close", [&] {
    if (const std::shared_ptr<OpenFile> file = Erase(fd)) Release(file);
  });
}

void SaveTracker::OnRename(std::string_view, std::string_view to) {
  Contain("rename", [&] {
    const auto match = options_.layouts->Recognise(to, options_.roots);
    if (match && match->role == FileRole::kCommitSignal) QueueCommit(*match, std::string(to));
  });
}

void SaveTracker::Release(const std::shared_ptr<OpenFile>& file) {
  if (file->fds.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (file->match.role == FileRole::kData) {
    QueueData(*file);
  } else {
    QueueCommit(file->match, file->path);
  }
}

// The file is opened again now, so that a rename or unlink right after the close does not lose
// the bytes that were written.
void SaveTracker::QueueData(const OpenFile& file) {
  const int fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    UCP_LOG_WARN("save: {}; not journaled", PosixError("reopen " + file.path, errno).message());
    return;
  }
  worker_->Post([this, match = file.match, path = file.path, fd] { JournalData(match, path, fd); });
}

// The signal's content is read now: the next save rewrites it.
void SaveTracker::QueueCommit(const PathMatch& signal, const std::string& signal_path) {
  const int fd = ::open(signal_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    UCP_LOG_WARN("save: {}; not a commit",
                 PosixError("commit: open " + signal_path, errno).message());
    return;
  }
  auto content = ReadPrefix(fd, signal_path, kMaxSignalBytes);
  if (!content.ok()) {
    ::close(fd);
    UCP_LOG_WARN("save: {}; not a commit", content.status().message());
    return;
  }
  worker_->Post([this, signal, signal_path, content = std::move(content).value(), fd] {
    Commit(signal, signal_path, content, fd);
  });
}

void SaveTracker::JournalData(const PathMatch& match, const std::string& path, int fd) {
  auto digest = HashOpenFile(fd, path);
  ::close(fd);
  if (!digest.ok()) {
    UCP_LOG_WARN("save: {}; not journaled", digest.status().message());
    return;
  }
  JournalRecord record;
  record.path = path.substr(match.tag_dir.size() + 1);
  record.size = digest->size;
  record.xxh3 = digest->xxh3;
  record.rank = LauncherRank();
  record.pid = ::getpid();
  record.time_ns = WallTimeNs();
  record.framework = match.framework;
  record.role = FileRole::kData;
  const Status status = AppendJournalRecord(match.tag_dir, record);
  if (!status.ok()) {
    UCP_LOG_WARN("save: {}: {}", path, status.message());
    return;
  }
  UCP_LOG_DEBUG("save: journaled {} ({} bytes, xxh3 {})", path, digest->size,
                FormatXxh3(digest->xxh3));
}

void SaveTracker::Commit(const PathMatch& signal, const std::string& signal_path,
                         const std::string& content, int fd) {
  auto digest = HashOpenFile(fd, signal_path);
  ::close(fd);
  if (!digest.ok()) {
    UCP_LOG_WARN("save: {}; not a commit", digest.status().message());
    return;
  }
  const CheckpointLayout* layout = options_.layouts->Find(signal.framework);
  if (layout == nullptr) return;
  auto target = layout->ResolveCommit(signal, content);
  if (!target.ok()) {
    UCP_LOG_WARN("save: {}; not a commit", target.status().message());
    return;
  }
  struct stat st {};
  if (::stat(target->tag_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    UCP_LOG_WARN("save: {} names tag {}, which is not a directory; not a commit", signal_path,
                 target->tag_dir);
    return;
  }
  JournalRecord record;
  record.path = std::filesystem::path(signal_path).lexically_relative(target->tag_dir).string();
  record.size = digest->size;
  record.xxh3 = digest->xxh3;
  record.rank = LauncherRank();
  record.pid = ::getpid();
  record.time_ns = WallTimeNs();
  record.framework = signal.framework;
  record.role = FileRole::kCommitSignal;
  const Status status = AppendJournalRecord(target->tag_dir, record);
  if (!status.ok()) UCP_LOG_WARN("save: {}: {}", signal_path, status.message());

  const CommitEvent event{signal.framework, signal.save_dir, target->tag_dir, target->tag,
                          signal_path};
  UCP_LOG_INFO("save: {} commit of tag {} in {} ({})", event.framework, event.tag, event.save_dir,
               event.signal_path);
  std::vector<CommitListener*> listeners;
  {
    std::lock_guard<std::mutex> lock(listeners_mutex_);
    listeners = listeners_;
  }
  for (CommitListener* listener : listeners) listener->OnCommit(event);
}

}  // namespace ucp::hooks
