#include "hooks/save/index_builder.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
#include "core/tag/save_generation.h"
#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/save/run_job.h"

namespace ucp::hooks {
namespace {

// This save's files (MatchSave) among the closes the tag's journals record now.
Result<SaveFiles> MatchThisSave(const std::string& tag_dir,
                                const std::vector<std::string>& expected, const std::string& commit,
                                std::vector<JournalRecord>* records) {
  Result<JournalContents> journals = ReadTagJournals(tag_dir);
  if (!journals.ok() && journals.status().code() != StatusCode::kNotFound) {
    return journals.status();
  }
  *records = journals.ok() ? std::move(journals->records) : std::vector<JournalRecord>{};
  UCP_ASSIGN_OR_RETURN(std::optional<SaveGeneration> earlier, ReadSaveGeneration(tag_dir));
  // No bound from this process's start: the index may be built by a process that started after
  // the other ranks closed their files (nothing in the index builder's use waits for a
  // rendezvous). The run's job (the launcher's id, else the NCCL world's) bounds it instead where
  // there is one: the committing process belongs to the run whose save it commits.
  return MatchSave(
      *records, expected,
      SaveBounds{commit, std::move(earlier), "", 0, RunJob(TopologyRegistry::Global())},
      TagFilesOnDisk(tag_dir));
}

// The files of `closes` whose bytes on disk are no longer the ones their close describes.
std::vector<std::string> ChangedSince(
    const std::string& tag_dir,
    const std::unordered_map<std::string, const JournalRecord*>& closes) {
  std::vector<std::string> changed;
  for (const auto& [path, record] : closes) {
    if (StatFileOnDisk(tag_dir + "/" + path) != FileOnDisk{record->size, *record->stamp}) {
      changed.push_back(path);
    }
  }
  std::sort(changed.begin(), changed.end());
  return changed;
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
    Pending pending{event, 0};
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

std::optional<IndexBuilder::WrittenSave> IndexBuilder::WaitForSave(
    const Pending& pending, std::chrono::steady_clock::time_point give_up,
    std::vector<JournalRecord>* records) {
  const std::string& tag_dir = pending.event.tag_dir;
  std::string waiting;  // what the last poll still missed, for the give-up message
  const FrameworkAdapter* previous = nullptr;
  for (std::chrono::milliseconds interval = kFirstPollInterval;;
       interval = std::min(2 * interval, kLastPollInterval)) {
    // Detected again at every poll: until the files rank 0 writes first are complete (the model
    // states, under an engine whose writers are not rank 0 alone), a TP tag reads as a TP=1 one.
    Result<const FrameworkAdapter*> adapter = DetectAdapter(tag_dir);
    if (!adapter.ok()) {
      UCP_LOG_INFO("index: {} commit of {}: {}; not indexed", pending.event.framework, tag_dir,
                   adapter.status().message());
      return std::nullopt;
    }
    if (previous != nullptr && previous != *adapter) {
      UCP_LOG_INFO("index: {}: the files written since read as {}'s, not {}'s", tag_dir,
                   (*adapter)->name(), previous->name());
    }
    previous = *adapter;
    Result<std::vector<std::string>> expected = (*adapter)->ExpectedFiles(tag_dir);
    if (expected.ok()) {
      Result<SaveFiles> save = MatchThisSave(tag_dir, *expected, pending.event.commit_id, records);
      if (!save.ok()) {
        UCP_LOG_WARN("index: {}: {}; not indexed", tag_dir, save.status().message());
        return std::nullopt;
      }
      if (save->missing.empty()) return WrittenSave{*adapter, std::move(save).value()};
      waiting = "not closed yet: " + Joined(save->missing);
    } else if (expected.status().code() == StatusCode::kFailedPrecondition ||
               expected.status().code() == StatusCode::kNotFound) {
      waiting = expected.status().message();
    } else if (Result<const FrameworkAdapter*> now = DetectAdapter(tag_dir);
               now.ok() && *now != *adapter) {
      // Files written between the detection and ExpectedFiles's reading: the next poll follows.
      waiting = expected.status().message();
    } else {
      UCP_LOG_INFO("index: {}: {}; not indexed", tag_dir, expected.status().ToString());
      return std::nullopt;
    }
    if (std::chrono::steady_clock::now() >= give_up) {
      UCP_LOG_WARN(
          "index: {}: gave up after {} ms waiting for the save to finish ({}); not indexed",
          tag_dir, options_.wait.count(), waiting);
      return std::nullopt;
    }
    if (!PollWait(pending, interval)) {
      UCP_LOG_INFO("index: {}: build abandoned (a newer commit of the tag, or teardown)", tag_dir);
      return std::nullopt;
    }
  }
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
  const auto give_up = std::chrono::steady_clock::now() + options_.wait;
  Result<AtomIndex> index = Status::Internal("not built");
  for (;;) {
    std::vector<JournalRecord> records;  // what `save` points into
    const std::optional<WrittenSave> save = WaitForSave(pending, give_up, &records);
    if (!save) return false;
    const SaveGeneration generation = GenerationOf(pending.event.commit_id, save->files.closes);
    if (const Status recorded = WriteSaveGeneration(tag_dir, generation); !recorded.ok()) {
      // Only a later save of the tag needs it, and it then waits for its own closes.
      UCP_LOG_WARN("index: {}", recorded.message());
    }
    IndexOptions index_options;
    index_options.threads = options_.threads;
    index_options.trust_journal = true;
    index = save->adapter->BuildIndex(tag_dir, index_options);
    if (!index.ok()) {
      UCP_LOG_WARN("index: {}: {}; not indexed, the checkpoint stays as written", tag_dir,
                   index.status().ToString());
      return false;
    }
    const std::vector<std::string> changed = ChangedSince(tag_dir, save->files.closes);
    if (changed.empty()) break;
    UCP_LOG_INFO("index: {}: {} rewritten while indexed; waiting for the save again", tag_dir,
                 Joined(changed));
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
