#include "hooks/save/save_tracker.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>

#include "core/tag/journal.h"
#include "core/tag/save_generation.h"
#include "core/util/chunked_xxh3.h"
#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/save/durable_commit.h"
#include "hooks/save/run_job.h"

namespace ucp::hooks {
namespace {

// Commit signals name a tag in a few bytes; more than this is not a commit signal.
constexpr size_t kMaxSignalBytes = 4096;

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

  std::mutex mutex;
  ChunkedXxh3 hash;       // guarded by mutex
  uint64_t hashed = 0;    // bytes fed to `hash`: [0, hashed) of the file
  uint64_t position = 0;  // the file position that write() uses
  bool append = false;    // O_APPEND: every write lands at the end
  bool streaming = true;  // false once a write did not land at `hashed`
};

// One big write's bytes, hashed by whichever thread claims the job first: the hasher thread, or
// the writer in OnWriteEnd when the hasher has not started it.
struct SaveTracker::HashJob {
  enum Phase : int { kQueued, kRunning, kDone };

  // Feeds the first `size` bytes of `pieces` to `state`.
  void Run() {
    size_t left = size;
    for (const struct iovec& piece : pieces) {
      const size_t take = std::min(left, piece.iov_len);
      state.Update(piece.iov_base, take);
      left -= take;
    }
    phase.store(kDone, std::memory_order_release);
    phase.notify_all();
  }
  // True when this thread won the job and must Run it.
  bool Claim() {
    int expected = kQueued;
    return phase.compare_exchange_strong(expected, kRunning, std::memory_order_acq_rel);
  }
  // Returns once the job is done, running it here if nobody has started it.
  void Finish() {
    if (Claim()) {
      Run();
      return;
    }
    for (int seen = phase.load(std::memory_order_acquire); seen != kDone;
         seen = phase.load(std::memory_order_acquire)) {
      phase.wait(seen, std::memory_order_acquire);
    }
  }

  std::atomic<int> phase{kQueued};
  ChunkedXxh3 state;  // the file's hash at the begin of the write, then with its bytes
  std::vector<struct iovec> pieces;
  size_t size = 0;
};

struct SaveTracker::WriteInFlight {
  const SaveTracker* tracker = nullptr;  // null: no write in flight on this thread
  int fd = -1;
  std::shared_ptr<OpenFile> file;
  uint64_t start = 0;        // where the bytes land
  bool at_position = false;  // a write at (and moving) the file position
  const struct iovec* iov = nullptr;
  int iovcnt = 0;
  size_t size = 0;
  std::shared_ptr<HashJob> job;  // for a big write that starts where the hashed bytes end
};

thread_local SaveTracker::WriteInFlight SaveTracker::in_flight_;

SaveTracker::SaveTracker(SaveTrackerOptions options) : options_(std::move(options)) {}

SaveTracker::~SaveTracker() {
  {
    std::lock_guard<std::mutex> lock(hasher_mutex_);
    hasher_stopping_ = true;
  }
  hasher_wake_.notify_all();
  if (hasher_.joinable()) hasher_.join();
}

void SaveTracker::AddCommitListener(CommitListener* listener) {
  std::lock_guard<std::mutex> lock(listeners_mutex_);
  listeners_.push_back(listener);
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

bool SaveTracker::MayTrackPath(std::string_view path) {
  return options_.layouts->MayMatchPath(path) ||
         (options_.pending_signals && IsPendingSignalName(path.substr(path.rfind('/') + 1)));
}

std::string SaveTracker::SignalPathOf(std::string_view path) const {
  if (options_.pending_signals) {
    if (std::optional<std::string> signal = SignalOfPendingPath(path)) return std::move(*signal);
  }
  return std::string(path);
}

bool SaveTracker::OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) {
  bool tracked = false;
  Contain("open", [&] {
    auto match = options_.layouts->Recognise(SignalPathOf(path), options_.roots);
    if (!match) return;
    if (match->role == FileRole::kData && options_.writer_check != nullptr &&
        !options_.writer_check->IsCheckpointWriter()) {
      UCP_LOG_DEBUG("save: {}: not written by a checkpoint writer (stack); not tracked", path);
      return;
    }
    // `new`, not make_shared: XXH3_state_t is over-aligned.
    std::shared_ptr<OpenFile> file(new OpenFile(path, std::move(*match)));
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

void SaveTracker::OnWriteBegin(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                               size_t size) {
  Contain("write", [&] {
    std::shared_ptr<OpenFile> file = Find(fd);
    if (file == nullptr) return;
    WriteInFlight write;
    {
      std::lock_guard<std::mutex> lock(file->mutex);
      // Where these bytes land: O_APPEND writes (pwrite included, on Linux) go to the end; a
      // pwrite does not move the file position.
      write.at_position = !file->append && offset < 0;
      if (file->append) {
        write.start = file->hashed;
      } else if (offset < 0) {
        write.start = file->position;
      } else {
        write.start = static_cast<uint64_t>(offset);
      }
      if (file->streaming && write.start == file->hashed && size >= kParallelHashBytes) {
        // `new`, not make_shared: XXH3_state_t is over-aligned.
        write.job.reset(new HashJob);
        write.job->state = file->hash;
        write.job->pieces.assign(iov, iov + std::max(iovcnt, 0));
        write.job->size = size;
      }
    }
    write.tracker = this;
    write.fd = fd;
    write.file = std::move(file);
    write.iov = iov;
    write.iovcnt = iovcnt;
    write.size = size;
    in_flight_ = write;
    if (write.job != nullptr) PostHashJob(std::move(write.job));
  });
}

void SaveTracker::OnWriteEnd(int fd, ssize_t ret) {
  if (in_flight_.tracker != this || in_flight_.fd != fd) return;
  WriteInFlight write = std::move(in_flight_);
  in_flight_ = WriteInFlight{};
  Contain("write", [&] {
    // First the job: the host's bytes must not be read after this returns.
    if (write.job != nullptr) write.job->Finish();
    OpenFile& file = *write.file;
    std::lock_guard<std::mutex> lock(file.mutex);
    if (ret <= 0) return;
    const auto written = static_cast<uint64_t>(ret);
    if (write.at_position) file.position = write.start + written;
    if (!file.streaming) return;
    // Writes of one file from two threads at once that both claim the hashed end (two writes at
    // the file position) cannot both pass this test: whichever ends second stops streaming.
    if (write.start != file.hashed) {
      UCP_LOG_DEBUG("save: {}: write at {} after {} hashed bytes; hashing at close instead",
                    file.path, write.start, file.hashed);
      file.streaming = false;
      return;
    }
    if (write.job != nullptr && written == write.size) {
      file.hash = std::move(write.job->state);
      file.hashed += written;
      return;
    }
    size_t left = std::min<uint64_t>(written, write.size);
    for (int i = 0; i < write.iovcnt && left > 0; ++i) {
      const size_t take = std::min(left, write.iov[i].iov_len);
      file.hash.Update(write.iov[i].iov_base, take);
      left -= take;
    }
    file.hashed += written - left;
    if (left != 0 || written > write.size) file.streaming = false;  // more written than shown
  });
}

void SaveTracker::PostHashJob(std::shared_ptr<HashJob> job) {
  {
    std::lock_guard<std::mutex> lock(hasher_mutex_);
    if (!hasher_.joinable()) hasher_ = std::thread(&SaveTracker::RunHasher, this);
    hasher_queue_.push_back(std::move(job));
  }
  hasher_wake_.notify_one();
}

void SaveTracker::RunHasher() {
  // Hashing touches no file, but the thread is ucp's own: nothing it does is the host's.
  ReentrancyGuard guard;
  std::unique_lock<std::mutex> lock(hasher_mutex_);
  for (;;) {
    hasher_wake_.wait(lock, [this] { return hasher_stopping_ || !hasher_queue_.empty(); });
    if (hasher_stopping_) return;
    std::shared_ptr<HashJob> job = std::move(hasher_queue_.front());
    hasher_queue_.pop_front();
    lock.unlock();
    if (job->Claim()) job->Run();
    job.reset();
    lock.lock();
  }
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
    if (match && match->role == FileRole::kCommitSignal) {
      Commit(*match, std::string(to), std::string(to));
    }
  });
}

void SaveTracker::Release(const std::shared_ptr<OpenFile>& file) {
  if (file->fds.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (file->match.role == FileRole::kData) {
    std::lock_guard<std::mutex> lock(file->mutex);
    FinishData(*file);
  } else {
    // No lock: a commit uses only the immutable path and match, and listeners run lock-free.
    Commit(file->match, SignalPathOf(file->path), file->path);
  }
}

std::vector<CommitListener*> SaveTracker::Listeners() {
  std::lock_guard<std::mutex> lock(listeners_mutex_);
  return listeners_;
}

void SaveTracker::FinishData(OpenFile& file) {
  struct stat st {};
  if (::stat(file.path.c_str(), &st) != 0) {
    UCP_LOG_WARN("save: {}: {}; not journaled", file.path,
                 PosixError("stat after close", errno).message());
    return;
  }
  FileDigest digest;
  if (file.streaming && file.hashed == static_cast<uint64_t>(st.st_size)) {
    digest = {file.hashed, file.hash.Whole(), file.hash.Chunks()};
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
  record.chunks = digest.chunks;
  record.stamp = FileOnDiskOf(st).stamp;
  record.rank = LauncherRank();
  record.job = RunJob(TopologyRegistry::Global());
  record.pid = ::getpid();
  record.time_ns = WallClockNs();
  record.framework = file.match.framework;
  record.role = FileRole::kData;
  const Status status = AppendJournalRecord(file.match.tag_dir, record);
  if (!status.ok()) {
    UCP_LOG_WARN("save: {}: {}", file.path, status.message());
    return;
  }
  UCP_LOG_DEBUG("save: journaled {} ({} bytes, xxh3 {})", file.path, digest.size,
                FormatXxh3(digest.xxh3));
  const SavedFileEvent event{file.match.framework, file.match.tag_dir, record.path,
                             digest.size,          digest.xxh3,        record.time_ns,
                             record.chunks,        record.stamp,       record.job};
  for (CommitListener* listener : Listeners()) listener->OnFileSaved(event);
}

void SaveTracker::Commit(const PathMatch& signal, const std::string& signal_path,
                         const std::string& written_path) {
  const CheckpointLayout* layout = options_.layouts->Find(signal.framework);
  if (layout == nullptr) return;
  auto content = ReadPrefix(written_path, kMaxSignalBytes);
  if (!content.ok()) {
    UCP_LOG_WARN("save: {}", content.status().message());
    return;
  }
  auto target = layout->ResolveCommit(signal, *content);
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
  auto digest = HashFile(written_path);
  if (!digest.ok()) {
    UCP_LOG_WARN("save: {}", digest.status().message());
    return;
  }
  JournalRecord record;
  record.path = std::filesystem::path(signal_path).lexically_relative(target->tag_dir).string();
  record.size = digest->size;
  record.xxh3 = digest->xxh3;
  record.rank = LauncherRank();
  record.job = RunJob(TopologyRegistry::Global());
  record.pid = ::getpid();
  record.time_ns = WallClockNs();
  record.framework = signal.framework;
  record.role = FileRole::kCommitSignal;
  const Status status = AppendJournalRecord(target->tag_dir, record);
  if (!status.ok()) UCP_LOG_WARN("save: {}: {}", signal_path, status.message());

  const CommitEvent event{signal.framework, signal.save_dir, target->tag_dir, target->tag,
                          signal_path,      written_path,    NewCommitId()};
  UCP_LOG_INFO("save: {} commit of tag {} in {} ({})", event.framework, event.tag, event.save_dir,
               event.signal_path);
  for (CommitListener* listener : Listeners()) listener->OnCommit(event);
}

}  // namespace ucp::hooks
