#include "hooks/save/index_builder.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "core/format/atom_index.h"
#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/io/file_lock.h"
#include "core/tag/atoms_store.h"
#include "core/tag/journal.h"
#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"

namespace ucp::hooks {
namespace {

int64_t WallTimeNs() {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

// The files of `expected` that no record of this save shows closed at their size on disk now.
Result<std::vector<std::string>> NotYetClosed(const std::string& tag_dir,
                                              const std::vector<std::string>& expected,
                                              int64_t commit_time_ns) {
  Result<JournalContents> journals = ReadTagJournals(tag_dir);
  if (!journals.ok() && journals.status().code() != StatusCode::kNotFound) {
    return journals.status();
  }
  const std::vector<JournalRecord> none;
  const std::vector<JournalRecord>& records = journals.ok() ? journals->records : none;
  // The newest record decides: an older one may describe bytes since rewritten.
  const auto newest = NewestCloses(records, SaveStartNs(records, commit_time_ns));
  std::vector<std::string> missing;
  for (const std::string& path : expected) {
    const auto close = newest.find(path);
    struct stat st {};
    const std::string full = tag_dir + "/" + path;
    if (close == newest.end() || ::stat(full.c_str(), &st) != 0 ||
        static_cast<uint64_t>(st.st_size) != close->second->size) {
      missing.push_back(path);
    }
  }
  return missing;
}

std::string Joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// An index.json of an earlier save describes other bytes than the tag now holds.
void RemoveStaleIndex(const std::string& tag_dir) {
  const std::string path = AtomIndexPath(tag_dir);
  if (::unlink(path.c_str()) != 0) {
    if (errno != ENOENT) UCP_LOG_WARN("index: remove stale {}: errno {}", path, errno);
    return;
  }
  UCP_LOG_INFO("index: removed {} of an earlier save", path);
  if (const Status synced = SyncDirectory(JournalDirectory(tag_dir)); !synced.ok()) {
    UCP_LOG_WARN("index: {}", synced.message());
  }
}

}  // namespace

// This save's own commit record is the newest one this process appended before OnCommit ran
// (the tracker journals a commit before telling its listeners); when it is missing (its append
// failed) every commit record up to then is an earlier save's.
int64_t SaveStartNs(const std::vector<JournalRecord>& records, int64_t commit_time_ns) {
  const int64_t pid = ::getpid();
  std::optional<int64_t> own;
  for (const JournalRecord& record : records) {
    if (record.role == FileRole::kCommitSignal && record.pid == pid &&
        record.time_ns <= commit_time_ns) {
      own = std::max(own.value_or(record.time_ns), record.time_ns);
    }
  }
  const int64_t before = own ? *own : commit_time_ns + 1;
  int64_t start = 0;
  for (const JournalRecord& record : records) {
    if (record.role == FileRole::kCommitSignal && record.time_ns < before) {
      start = std::max(start, record.time_ns);
    }
  }
  return start;
}

IndexBuilder::IndexBuilder(IndexBuilderOptions options) : options_(std::move(options)) {}

IndexBuilder::~IndexBuilder() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_.clear();
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void IndexBuilder::OnCommit(const CommitEvent& event) noexcept {
  try {
    Pending pending{event, WallTimeNs(), 0};
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      UCP_LOG_INFO("index: {}: committed during teardown; not indexed", event.tag_dir);
      return;
    }
    // First the thread: a commit queued without one would keep Drain waiting.
    if (!worker_.joinable()) worker_ = std::thread(&IndexBuilder::Run, this);
    pending.seq = ++next_seq_;
    // A queued build of the same tag would only be abandoned when its turn comes.
    std::erase_if(queue_,
                  [&](const Pending& queued) { return queued.event.tag_dir == event.tag_dir; });
    queue_.push_back(pending);
    latest_[event.tag_dir] = pending.seq;
  } catch (const std::exception& error) {
    UCP_LOG_ERROR("index: {}: not indexed: {}", event.tag_dir, error.what());
    return;
  }
  wake_.notify_all();
}

void IndexBuilder::Drain(std::chrono::steady_clock::time_point deadline) noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  if (wake_.wait_until(lock, deadline, [this] { return queue_.empty() && !busy_; })) return;
  UCP_LOG_WARN("index: teardown deadline reached; {} queued and {} running build(s) abandoned",
               queue_.size(), busy_ ? 1 : 0);
  stopping_ = true;
  queue_.clear();
  lock.unlock();
  wake_.notify_all();
}

uint64_t IndexBuilder::committed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return committed_;
}

void IndexBuilder::Run() {
  // Everything this thread does is ucp's own I/O: the hooks must neither record nor serve it.
  ReentrancyGuard guard;
  IoPhaseScope phase(IoPhase::kIndexBuild);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const Pending pending = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const bool committed = Build(pending);
    lock.lock();
    busy_ = false;
    if (committed) ++committed_;
    const auto it = latest_.find(pending.event.tag_dir);
    if (it != latest_.end() && it->second == pending.seq) latest_.erase(it);
    wake_.notify_all();
  }
}

bool IndexBuilder::Abandoned(const Pending& pending) const {
  const auto it = latest_.find(pending.event.tag_dir);
  return stopping_ || it == latest_.end() || it->second != pending.seq;
}

bool IndexBuilder::PollWait(const Pending& pending, std::chrono::milliseconds interval) {
  std::unique_lock<std::mutex> lock(mutex_);
  return !wake_.wait_for(lock, interval, [&] { return Abandoned(pending); });
}

bool IndexBuilder::Build(const Pending& pending) {
  const std::string& tag_dir = pending.event.tag_dir;
  {
    // FinalizeStore (atoms_store.h) replaces index.json under the same lock.
    Result<FileLock> lock = FileLock::Acquire(IndexLockPath(tag_dir));
    if (!lock.ok()) {
      UCP_LOG_WARN("index: {}; not indexed", lock.status().message());
      return false;
    }
    RemoveStaleIndex(tag_dir);
  }
  Result<const FrameworkAdapter*> adapter = DetectAdapter(tag_dir);
  if (!adapter.ok()) {
    UCP_LOG_INFO("index: {} commit of {}: {}; not indexed", pending.event.framework, tag_dir,
                 adapter.status().message());
    return false;
  }
  const auto give_up = std::chrono::steady_clock::now() + options_.wait;
  std::string waiting;  // what the last poll still missed, for the give-up message
  for (std::chrono::milliseconds interval = kFirstPollInterval;;
       interval = std::min(2 * interval, kLastPollInterval)) {
    Result<std::vector<std::string>> expected = (*adapter)->ExpectedFiles(tag_dir);
    if (expected.ok()) {
      Result<std::vector<std::string>> missing =
          NotYetClosed(tag_dir, *expected, pending.commit_time_ns);
      if (!missing.ok()) {
        UCP_LOG_WARN("index: {}: {}; not indexed", tag_dir, missing.status().message());
        return false;
      }
      if (missing->empty()) break;
      waiting = "not closed yet: " + Joined(*missing);
    } else if (expected.status().code() == StatusCode::kFailedPrecondition ||
               expected.status().code() == StatusCode::kNotFound) {
      waiting = expected.status().message();
    } else {
      UCP_LOG_INFO("index: {}: {}; not indexed", tag_dir, expected.status().ToString());
      return false;
    }
    if (std::chrono::steady_clock::now() >= give_up) {
      UCP_LOG_WARN(
          "index: {}: gave up after {} ms waiting for the save to finish ({}); not indexed",
          tag_dir, options_.wait.count(), waiting);
      return false;
    }
    if (!PollWait(pending, interval)) {
      UCP_LOG_INFO("index: {}: build abandoned (a newer commit of the tag, or teardown)", tag_dir);
      return false;
    }
  }

  IndexOptions index_options;
  index_options.threads = options_.threads;
  index_options.trust_journal = true;
  Result<AtomIndex> index = (*adapter)->BuildIndex(tag_dir, index_options);
  if (!index.ok()) {
    UCP_LOG_WARN("index: {}: {}; not indexed, the checkpoint stays as written", tag_dir,
                 index.status().ToString());
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Abandoned(pending)) {
      UCP_LOG_INFO("index: {}: build abandoned (a newer commit of the tag, or teardown)", tag_dir);
      return false;
    }
  }
  const std::string path = AtomIndexPath(tag_dir);
  Result<FileLock> lock = FileLock::Acquire(IndexLockPath(tag_dir));
  if (!lock.ok()) {
    UCP_LOG_WARN("index: {}; not indexed", lock.status().message());
    return false;
  }
  if (const Status written = index->Write(path); !written.ok()) {
    UCP_LOG_WARN("index: {}; not indexed", written.ToString());
    return false;
  }
  UCP_LOG_INFO("index: committed {} ({} files, {} atoms)", path, index->files().size(),
               index->atoms().size());
  return true;
}

}  // namespace ucp::hooks
