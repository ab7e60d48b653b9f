#include "hooks/save_tracker.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <ctime>
#include <filesystem>

#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/journal.h"

namespace ucp::hooks {
namespace {

// Commit signals name a tag in a few bytes; more than this is not a commit signal.
constexpr size_t kMaxSignalBytes = 4096;

int64_t WallTimeNs() {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

Result<std::string> ReadPrefix(const std::string& path, size_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError("commit: open " + path, errno);
  std::string bytes(limit, '\0');
  size_t filled = 0;
  while (filled < limit) {
    const ssize_t n = ::read(fd, bytes.data() + filled, limit - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return PosixError("commit: read " + path, err);
    }
    if (n == 0) break;
    filled += static_cast<size_t>(n);
  }
  ::close(fd);
  bytes.resize(filled);
  return bytes;
}

// A read-only descriptor of the file open as `fd` (which is often write-only): through
// /proc/self/fd, so it is the same file even if `path` is renamed meanwhile; by path without /proc.
int OpenForReading(int fd, const std::string& path) {
  const std::string proc_path = "/proc/self/fd/" + std::to_string(fd);
  const int read_fd = ::open(proc_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (read_fd >= 0 || errno != ENOENT) return read_fd;
  return ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
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

// Bytes the worker reads per pread: small enough to stay in L2 between the copy and the hash.
constexpr size_t kHashChunk = size_t{256} << 10;
// Bytes the worker hashes of one file before looking at the others and at closed files.
constexpr uint64_t kHashBurst = uint64_t{16} << 20;

struct SaveTracker::OpenFile {
  OpenFile(std::string_view file_path, PathMatch file_match)
      : path(file_path), match(std::move(file_match)) {}
  ~OpenFile() {
    if (read_fd >= 0) ::close(read_fd);
  }
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  const std::string path;
  const PathMatch match;
  // How many fds refer to this open file (dups included); the last close finishes it.
  std::atomic<int> fds{1};

  std::mutex mutex;       // guards the fields below up to `written`
  uint64_t position = 0;  // the file position that write() uses
  bool append = false;    // O_APPEND: every write lands at the end
  bool streaming = true;  // false once a write did not land at `written`
  uint64_t written = 0;   // [0, written) was written sequentially

  // The worker's own: a read-only descriptor of the same file (the host may close its fd at any
  // time) and the hash of [0, hashed).
  int read_fd = -1;
  XXH3_state_t hash;
  uint64_t hashed = 0;
};

struct SaveTracker::PendingCommit {
  JournalRecord record;
  CommitEvent event;
};

SaveTracker::SaveTracker(SaveTrackerOptions options) : options_(std::move(options)) {}
SaveTracker::~SaveTracker() { Stop(); }

void SaveTracker::AddCommitListener(CommitListener* listener) {
  std::lock_guard<std::mutex> lock(listeners_mutex_);
  listeners_.push_back(listener);
}

bool SaveTracker::EnsureWorker() {
  std::lock_guard<std::mutex> lock(worker_mutex_);
  if (worker_state_ == WorkerState::kNotStarted) {
    try {
      worker_ = std::thread([this] { WorkerLoop(); });
      worker_pid_ = ::getpid();
      worker_state_ = WorkerState::kRunning;
    } catch (const std::exception& error) {
      UCP_LOG_WARN("save: no hashing thread ({}); files are hashed at close", error.what());
      worker_state_ = WorkerState::kUnavailable;
    }
  }
  return worker_state_ == WorkerState::kRunning;
}

void SaveTracker::Submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    if (worker_state_ == WorkerState::kRunning) {
      tasks_.push_back(std::move(task));
      poked_ = true;
      wake_.notify_one();
      return;
    }
  }
  RunTask(task);
}

void SaveTracker::Flush() noexcept {
  std::unique_lock<std::mutex> lock(worker_mutex_);
  if (worker_state_ != WorkerState::kRunning || std::this_thread::get_id() == worker_.get_id()) {
    return;
  }
  const uint64_t generation = flush_generation_;
  poked_ = true;
  wake_.notify_one();
  idle_.wait(lock, [&] {
    return flush_generation_ != generation || worker_state_ != WorkerState::kRunning;
  });
}

void SaveTracker::Stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(worker_mutex_);
    if (worker_state_ != WorkerState::kRunning || worker_pid_ != ::getpid()) return;
    stopping_ = true;
    wake_.notify_one();
  }
  Contain("stop", [&] { worker_.join(); });
}

void SaveTracker::WorkerLoop() noexcept {
  // The worker's reads, stats and journal appends are ucp's own I/O: never seen by the hooks.
  ReentrancyGuard guard;
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[kHashChunk]);
  std::unique_lock<std::mutex> lock(worker_mutex_);
  for (;;) {
    if (!poked_ && !behind_) {
      ++flush_generation_;
      idle_.notify_all();
      if (stopping_ && tasks_.empty()) break;
      wake_.wait(lock, [&] { return poked_ || stopping_; });
      continue;
    }
    poked_ = false;
    const std::vector<std::shared_ptr<OpenFile>> files = hashing_;
    lock.unlock();
    bool more = false;
    for (const std::shared_ptr<OpenFile>& file : files) {
      Contain("hash", [&] { more |= HashWritten(*file, buffer.get()); });
    }
    lock.lock();
    while (!tasks_.empty() && Ready(tasks_.front())) {
      const Task task = std::move(tasks_.front());
      tasks_.pop_front();
      if (task.file != nullptr) std::erase(hashing_, task.file);
      lock.unlock();
      RunTask(task);
      lock.lock();
    }
    behind_ = more || !tasks_.empty();
  }
  // Later closes are finished by the closing thread.
  worker_state_ = WorkerState::kUnavailable;
  idle_.notify_all();
}

bool SaveTracker::HashWritten(OpenFile& file, std::byte* buffer) {
  uint64_t written;
  {
    std::lock_guard<std::mutex> lock(file.mutex);
    if (!file.streaming || file.read_fd < 0 || buffer == nullptr) {
      file.streaming = false;
      return false;
    }
    written = file.written;
  }
  const uint64_t burst_end = std::min(written, file.hashed + kHashBurst);
  while (file.hashed < burst_end) {
    const size_t want =
        static_cast<size_t>(std::min<uint64_t>(kHashChunk, burst_end - file.hashed));
    const ssize_t n = ::pread(file.read_fd, buffer, want, static_cast<off_t>(file.hashed));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // Shorter than what was written (truncated behind our back) or unreadable: the close
      // hashes whatever is on disk then.
      UCP_LOG_DEBUG("save: {}: read back at {} failed; hashing at close instead", file.path,
                    file.hashed);
      std::lock_guard<std::mutex> lock(file.mutex);
      file.streaming = false;
      return false;
    }
    XXH3_64bits_update(&file.hash, buffer, static_cast<size_t>(n));
    file.hashed += static_cast<uint64_t>(n);
  }
  return file.hashed < written;
}

bool SaveTracker::Ready(const Task& task) {
  if (task.file == nullptr) return true;
  OpenFile& file = *task.file;
  std::lock_guard<std::mutex> lock(file.mutex);
  return !file.streaming || file.hashed == file.written;
}

void SaveTracker::RunTask(const Task& task) {
  if (task.file != nullptr) {
    Contain("close", [&] { FinishData(*task.file); });
  } else {
    Contain("commit", [&] { Announce(*task.commit); });
  }
}

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

bool SaveTracker::MayTrackFileName(std::string_view file_name) {
  return options_.layouts->MayMatchFileName(file_name);
}

bool SaveTracker::OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) {
  bool tracked = false;
  Contain("open", [&] {
    auto match = options_.layouts->Recognise(path, options_.roots);
    if (!match) return;
    if (match->role == FileRole::kData && options_.writer_check != nullptr &&
        !options_.writer_check->IsCheckpointWriter()) {
      UCP_LOG_DEBUG("save: {}: not written by a checkpoint writer (stack); not tracked", path);
      return;
    }
    // `new`, not make_shared: XXH3_state_t is over-aligned.
    std::shared_ptr<OpenFile> file(new OpenFile(path, std::move(*match)));
    XXH3_64bits_reset(&file->hash);
    file->append = append;
    // Hashing on the fly needs the file to start empty at the first write; otherwise (appending
    // to an existing file, fdopen of a moved fd) the close hashes the file from disk.
    if (file->match.role != FileRole::kData) {
      file->streaming = false;
    } else if (append) {
      struct stat st {};
      file->streaming = ::fstat(fd, &st) == 0 && st.st_size == 0;
    } else if (!truncated) {
      const off_t position = ::lseek(fd, 0, SEEK_CUR);
      file->streaming = position == 0;
      file->position = position > 0 ? static_cast<uint64_t>(position) : 0;
    }
    if (file->streaming) {
      file->read_fd = EnsureWorker() ? OpenForReading(fd, file->path) : -1;
      file->streaming = file->read_fd >= 0;
    }
    UCP_LOG_DEBUG("save: tracking {} fd {} ({} {})", path, fd, file->match.framework,
                  FileRoleName(file->match.role));
    if (file->streaming) {
      std::lock_guard<std::mutex> lock(worker_mutex_);
      hashing_.push_back(file);
    }
    if (std::shared_ptr<OpenFile> stale = Insert(fd, std::move(file))) {
      UCP_LOG_WARN("save: fd {} reopened while tracked as {}; the old file is finished now", fd,
                   stale->path);
      Release(stale);
    }
    tracked = true;
  });
  return tracked;
}

void SaveTracker::OnWrite(int fd, int64_t offset, const void*, size_t size) {
  OnWriteVector(fd, offset, nullptr, 0, size);
}

// The worker reads the bytes back from the file, so the buffers themselves are not needed.
void SaveTracker::OnWriteVector(int fd, int64_t offset, const struct iovec*, int, size_t size) {
  Contain("write", [&] {
    const std::shared_ptr<OpenFile> file = Find(fd);
    if (file == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(file->mutex);
      // Where these bytes landed: O_APPEND writes (pwrite included, on Linux) go to the end; a
      // pwrite does not move the file position.
      uint64_t start;
      if (file->append) {
        start = file->written;
      } else if (offset < 0) {
        start = file->position;
        file->position += size;
      } else {
        start = static_cast<uint64_t>(offset);
      }
      if (!file->streaming) return;
      if (start != file->written) {
        UCP_LOG_DEBUG("save: {}: write at {} after {} sequential bytes; hashing at close instead",
                      file->path, start, file->written);
        file->streaming = false;
        return;
      }
      file->written += size;
    }
    std::lock_guard<std::mutex> lock(worker_mutex_);
    poked_ = true;
    wake_.notify_one();
  });
}

void SaveTracker::OnNonSequential(int fd) {
  Contain("seek", [&] {
    const std::shared_ptr<OpenFile> file = Find(fd);
    if (file == nullptr) return;
    std::lock_guard<std::mutex> lock(file->mutex);
    // The position is unknown from now on; only a hash from disk can be trusted.
    file->streaming = false;
  });
}

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

// Durability is the framework's choice; the journal records what was closed.
void SaveTracker::OnSync(int) {}

void SaveTracker::OnRename(std::string_view, std::string_view to) {
  Contain("rename", [&] {
    const auto match = options_.layouts->Recognise(to, options_.roots);
    if (!match || match->role != FileRole::kCommitSignal) return;
    if (auto commit = ResolveCommit(*match, std::string(to))) Submit(Task{nullptr, commit});
  });
}

void SaveTracker::Release(const std::shared_ptr<OpenFile>& file) {
  if (file->fds.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (file->match.role == FileRole::kData) {
    Submit(Task{file, nullptr});
  } else if (auto commit = ResolveCommit(file->match, file->path)) {
    Submit(Task{nullptr, commit});
  }
}

void SaveTracker::FinishData(OpenFile& file) {
  struct stat st {};
  if (::stat(file.path.c_str(), &st) != 0) {
    UCP_LOG_WARN("save: {}: {}; not journaled", file.path,
                 PosixError("stat after close", errno).message());
    return;
  }
  bool streamed;
  {
    std::lock_guard<std::mutex> lock(file.mutex);
    streamed = file.streaming && file.hashed == static_cast<uint64_t>(st.st_size);
  }
  if (streamed) {
    // The bytes were read through the dup: they are this path's only if it is still that file.
    struct stat read_st {};
    streamed = ::fstat(file.read_fd, &read_st) == 0 && read_st.st_dev == st.st_dev &&
               read_st.st_ino == st.st_ino;
  }
  FileDigest digest;
  if (streamed) {
    digest = {file.hashed, XXH3_64bits_digest(&file.hash)};
  } else {
    UCP_LOG_DEBUG("save: {}: {} of {} bytes hashed on the fly; hashing from disk", file.path,
                  file.hashed, st.st_size);
    auto from_disk = HashFile(file.path);
    if (!from_disk.ok()) {
      UCP_LOG_WARN("save: {}; not journaled", from_disk.status().message());
      return;
    }
    digest = *from_disk;
  }
  JournalRecord record;
  record.path = file.path.substr(file.match.tag_dir.size() + 1);
  record.size = digest.size;
  record.xxh3 = digest.xxh3;
  record.rank = LauncherRank();
  record.pid = ::getpid();
  record.time_ns = WallTimeNs();
  record.framework = file.match.framework;
  record.role = FileRole::kData;
  const Status status = AppendJournalRecord(file.match.tag_dir, record);
  if (!status.ok()) {
    UCP_LOG_WARN("save: {}: {}", file.path, status.message());
    return;
  }
  UCP_LOG_DEBUG("save: journaled {} ({} bytes, xxh3 {})", file.path, digest.size,
                FormatXxh3(digest.xxh3));
}

std::shared_ptr<SaveTracker::PendingCommit> SaveTracker::ResolveCommit(
    const PathMatch& signal, const std::string& signal_path) {
  const CheckpointLayout* layout = options_.layouts->Find(signal.framework);
  if (layout == nullptr) return nullptr;
  auto content = ReadPrefix(signal_path, kMaxSignalBytes);
  if (!content.ok()) {
    UCP_LOG_WARN("save: {}", content.status().message());
    return nullptr;
  }
  auto target = layout->ResolveCommit(signal, *content);
  if (!target.ok()) {
    UCP_LOG_WARN("save: {}; not a commit", target.status().message());
    return nullptr;
  }
  struct stat st {};
  if (::stat(target->tag_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    UCP_LOG_WARN("save: {} names tag {}, which is not a directory; not a commit", signal_path,
                 target->tag_dir);
    return nullptr;
  }
  auto digest = HashFile(signal_path);
  if (!digest.ok()) {
    UCP_LOG_WARN("save: {}", digest.status().message());
    return nullptr;
  }
  auto commit = std::make_shared<PendingCommit>();
  JournalRecord& record = commit->record;
  record.path = std::filesystem::path(signal_path).lexically_relative(target->tag_dir).string();
  record.size = digest->size;
  record.xxh3 = digest->xxh3;
  record.rank = LauncherRank();
  record.pid = ::getpid();
  record.time_ns = WallTimeNs();
  record.framework = signal.framework;
  record.role = FileRole::kCommitSignal;
  commit->event =
      CommitEvent{signal.framework, signal.save_dir, target->tag_dir, target->tag, signal_path};
  return commit;
}

void SaveTracker::Announce(const PendingCommit& commit) {
  const CommitEvent& event = commit.event;
  const Status status = AppendJournalRecord(event.tag_dir, commit.record);
  if (!status.ok()) UCP_LOG_WARN("save: {}: {}", event.signal_path, status.message());
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
