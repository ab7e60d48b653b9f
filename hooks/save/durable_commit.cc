#include "hooks/save/durable_commit.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <set>
#include <tuple>
#include <utility>

#include "core/frameworks/framework_adapter.h"
#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/save/run_job.h"

namespace ucp::hooks {
namespace {

constexpr std::string_view kPendingMarker = ".ucp-pending-";

std::string_view Parent(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string_view() : path.substr(0, slash);
}

std::string Joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

bool AllDigits(std::string_view text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
}

struct PendingName {
  std::string_view signal;  // the signal's file name
  int64_t pid = 0;          // the process that wrote it
};

// Parses pending name `file_name` (".<name>.ucp-pending-<pid>-<n>").
std::optional<PendingName> ParsePendingName(std::string_view file_name) {
  if (file_name.size() < 2 || file_name[0] != '.') return std::nullopt;
  const size_t marker = file_name.rfind(kPendingMarker);
  if (marker == std::string_view::npos || marker < 2) return std::nullopt;
  const std::string_view numbers = file_name.substr(marker + kPendingMarker.size());
  const size_t dash = numbers.find('-');
  if (dash == std::string_view::npos || !AllDigits(numbers.substr(0, dash)) ||
      !AllDigits(numbers.substr(dash + 1)) || dash > 18) {
    return std::nullopt;
  }
  return PendingName{file_name.substr(1, marker - 1),
                     std::stoll(std::string(numbers.substr(0, dash)))};
}

double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

std::string PendingSignalPath(std::string_view signal_path, int64_t pid, uint64_t n) {
  const std::string_view dir = Parent(signal_path);
  const std::string_view name = signal_path.substr(dir.size() + 1);
  return std::string(dir) + "/." + std::string(name) + std::string(kPendingMarker) +
         std::to_string(pid) + "-" + std::to_string(n);
}

std::optional<std::string> SignalOfPendingPath(std::string_view path) {
  const std::string_view dir = Parent(path);
  if (dir.empty()) return std::nullopt;
  const std::optional<PendingName> name = ParsePendingName(path.substr(dir.size() + 1));
  if (!name) return std::nullopt;
  return std::string(dir) + "/" + std::string(name->signal);
}

bool IsPendingSignalName(std::string_view file_name) {
  return ParsePendingName(file_name).has_value();
}

std::vector<std::string> NotYetDurable(const std::vector<JournalRecord>& records,
                                       const SaveFiles& save) {
  // The closes a durable repeat vouches for, as (path, pid, time_ns, size, xxh3).
  using Close = std::tuple<std::string_view, int64_t, int64_t, uint64_t, uint64_t>;
  std::set<Close> durable;
  for (const JournalRecord& record : records) {
    if (record.durable && record.role == FileRole::kData) {
      durable.emplace(record.path, record.pid, record.time_ns, record.size, record.xxh3);
    }
  }
  std::vector<std::string> missing = save.missing;
  std::vector<std::string> not_durable;
  for (const auto& [path, record] : save.closes) {
    if (!durable.contains(
            Close{record->path, record->pid, record->time_ns, record->size, record->xxh3})) {
      not_durable.push_back(path);
    }
  }
  std::sort(not_durable.begin(), not_durable.end());
  missing.insert(missing.end(), not_durable.begin(), not_durable.end());
  return missing;
}

DurableCommit::DurableCommit(DurableCommitOptions options)
    : options_(std::move(options)), pid_(::getpid()) {}

DurableCommit::~DurableCommit() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void DurableCommit::AddDownstream(CommitListener* listener) { downstream_.push_back(listener); }

void DurableCommit::StartWorker() {
  if (!worker_.joinable()) worker_ = std::thread(&DurableCommit::Run, this);
}

void DurableCommit::OnFileSaved(const SavedFileEvent& event) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      UCP_LOG_WARN("durable: {}/{} closed during teardown; not fsynced", event.tag_dir, event.path);
    } else {
      StartWorker();
      queue_.push_back(event);
    }
  } catch (const std::exception& error) {
    UCP_LOG_ERROR("durable: {}/{}: not fsynced: {}", event.tag_dir, event.path, error.what());
  }
  wake_.notify_all();
  for (CommitListener* listener : downstream_) listener->OnFileSaved(event);
}

void DurableCommit::OnCommit(const CommitEvent& event) noexcept {
  if (event.written_path.empty() || event.written_path == event.signal_path) {
    Downstream(event);  // not held back (a rename commit, or a redirect that failed)
    return;
  }
  try {
    const auto now = std::chrono::steady_clock::now();
    Publish publish{event, now, now + options_.wait};
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      UCP_LOG_WARN("durable: {} committed during teardown; {} not published", event.tag_dir,
                   event.signal_path);
      return;
    }
    StartWorker();
    publishes_[event.signal_path].push_back(std::move(publish));
  } catch (const std::exception& error) {
    UCP_LOG_ERROR("durable: {}: {} not published: {}", event.tag_dir, event.signal_path,
                  error.what());
    return;
  }
  wake_.notify_all();
}

bool DurableCommit::MayRedirectPath(std::string_view path) {
  return options_.layouts->MayMatchPath(path);
}

std::optional<std::string> DurableCommit::Redirect(std::string_view path) {
  const std::optional<PathMatch> match = options_.layouts->Recognise(path, options_.roots);
  // Signals whose content names the tag are written in place; the others commit by a rename.
  if (!match || match->role != FileRole::kCommitSignal || !match->tag_dir.empty()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::string pending = PendingSignalPath(path, pid_, ++next_pending_);
  pending_[std::string(path)].push_back(pending);
  pending_files_.fetch_add(1, std::memory_order_relaxed);
  UCP_LOG_DEBUG("durable: write of {} goes to {} until its tag is durable", path, pending);
  return pending;
}

void DurableCommit::RedirectFailed(std::string_view path, std::string_view redirected) {
  std::lock_guard<std::mutex> lock(mutex_);
  ForgetPending(std::string(path), std::string(redirected));
  UCP_LOG_WARN("durable: cannot create {}; {} is written in place, not held back", redirected,
               path);
}

std::optional<std::string> DurableCommit::PendingFor(std::string_view path) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = pending_.find(std::string(path));
  if (it == pending_.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

bool DurableCommit::MayHavePending(std::string_view path) const {
  return pending_files_.load(std::memory_order_relaxed) != 0 &&
         options_.layouts->MayMatchPath(path);
}

void DurableCommit::ForgetPending(const std::string& signal_path, const std::string& pending) {
  const auto it = pending_.find(signal_path);
  if (it == pending_.end()) return;
  const auto erased = std::erase(it->second, pending);
  pending_files_.fetch_sub(erased, std::memory_order_relaxed);
  if (it->second.empty()) pending_.erase(it);
}

void DurableCommit::Drain(std::chrono::steady_clock::time_point deadline) noexcept {
  std::vector<Publish> dropped;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (wake_.wait_until(lock, deadline,
                         [this] { return queue_.empty() && publishes_.empty() && !busy_; })) {
      return;
    }
    stopping_ = true;
    for (auto& [signal, list] : publishes_) {
      for (Publish& publish : list) {
        ForgetPending(publish.event.signal_path, publish.event.written_path);
        dropped.push_back(std::move(publish));
      }
    }
    publishes_.clear();
    if (!queue_.empty()) {
      UCP_LOG_WARN("durable: teardown deadline reached; {} file(s) not fsynced", queue_.size());
    }
    queue_.clear();
  }
  wake_.notify_all();
  for (const Publish& publish : dropped) {
    UCP_LOG_ERROR(
        "durable: teardown deadline reached before {} was complete and durable; {} not "
        "published",
        publish.event.tag_dir, publish.event.signal_path);
    static_cast<void>(RemoveFile(publish.event.written_path));
  }
}

uint64_t DurableCommit::published() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return published_;
}

void DurableCommit::Run() {
  // Everything this thread does is ucp's own I/O: the hooks must neither record nor serve it.
  ReentrancyGuard guard;
  IoPhaseScope phase(IoPhase::kDurableCommit);
  std::unique_lock<std::mutex> lock(mutex_);
  std::chrono::milliseconds poll = kFirstPollInterval;
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty() || !publishes_.empty(); });
    if (stopping_) return;
    std::vector<SavedFileEvent> files(std::make_move_iterator(queue_.begin()),
                                      std::make_move_iterator(queue_.end()));
    queue_.clear();
    busy_ = true;
    lock.unlock();
    if (!files.empty()) MakeDurable(files);
    const bool waiting = PublishReady();
    lock.lock();
    busy_ = false;
    wake_.notify_all();
    // Newly closed files of this process restart the backoff: they are what a publish waits on.
    poll = files.empty() ? std::min(2 * poll, kLastPollInterval) : kFirstPollInterval;
    if (waiting) {
      wake_.wait_for(lock, poll, [this] { return stopping_ || !queue_.empty(); });
    }
  }
}

void DurableCommit::MakeDurable(const std::vector<SavedFileEvent>& files) {
  const auto start = std::chrono::steady_clock::now();
  std::set<std::string> dirs;
  std::vector<const SavedFileEvent*> synced;
  uint64_t bytes = 0;
  for (const SavedFileEvent& event : files) {
    const std::string path = event.tag_dir + "/" + event.path;
    Result<File> file = File::Open(path, File::Mode::kRead);
    Status status = file.ok() ? file->Sync() : file.status();
    if (status.ok()) status = file->Close();
    if (!status.ok()) {
      UCP_LOG_WARN("durable: {}; its tag will not be published", status.message());
      continue;
    }
    synced.push_back(&event);
    bytes += event.size;
    // Its directory entry, and the entries of every directory up to the save directory.
    const std::string_view save_dir = Parent(event.tag_dir);
    for (std::string_view dir = Parent(path); dir.size() >= save_dir.size() && !dir.empty();
         dir = Parent(dir)) {
      dirs.emplace(dir);
      if (dir == save_dir) break;
    }
  }
  for (const std::string& dir : dirs) {
    if (const Status status = SyncDirectory(dir); !status.ok()) {
      UCP_LOG_WARN("durable: {}; {} file(s) under it not journaled durable", status.message(),
                   synced.size());
      return;
    }
  }
  for (const SavedFileEvent* event : synced) {
    JournalRecord record;
    record.path = event->path;
    record.size = event->size;
    record.xxh3 = event->xxh3;
    record.chunks = event->chunks;
    record.stamp = event->stamp;
    record.rank = LauncherRank();
    record.job = event->job;
    record.pid = pid_;
    record.time_ns = event->time_ns;
    record.framework = event->framework;
    record.role = FileRole::kData;
    record.durable = true;
    if (const Status status = AppendJournalRecord(event->tag_dir, record); !status.ok()) {
      UCP_LOG_WARN("durable: {}/{}: {}", event->tag_dir, event->path, status.message());
    }
  }
  UCP_LOG_INFO("durable: fsynced {} file(s), {} bytes, and {} directories in {:.1f} ms",
               synced.size(), bytes, dirs.size(), MillisecondsSince(start));
}

bool DurableCommit::Complete(const Publish& publish, std::string* waiting) const {
  const std::string& tag_dir = publish.event.tag_dir;
  Result<JournalContents> journals = ReadTagJournals(tag_dir);
  if (!journals.ok() && journals.status().code() != StatusCode::kNotFound) {
    *waiting = journals.status().message();
    return false;
  }
  const std::vector<JournalRecord> none;
  const std::vector<JournalRecord>& records = journals.ok() ? journals->records : none;
  Result<std::optional<SaveGeneration>> earlier = ReadSaveGeneration(tag_dir);
  if (!earlier.ok()) {
    *waiting = earlier.status().message();
    return false;
  }
  const std::string& commit = publish.event.commit_id;
  const SaveBounds bounds =
      BoundsOfThisProcess(commit, std::move(earlier).value(), RunJob(TopologyRegistry::Global()));
  const FileOnDiskLookup on_disk = TagFilesOnDisk(tag_dir);
  Result<const FrameworkAdapter*> adapter = DetectAdapter(tag_dir);
  Result<std::vector<std::string>> files = adapter.ok()
                                               ? (*adapter)->ExpectedFiles(tag_dir)
                                               : Result<std::vector<std::string>>(adapter.status());
  SaveFiles save;
  if (files.ok()) {
    save = MatchSave(records, *files, bounds, on_disk);
  } else if (adapter.ok() && (files.status().code() == StatusCode::kFailedPrecondition ||
                              files.status().code() == StatusCode::kNotFound)) {
    *waiting = files.status().message();
    return false;
  } else {
    // No adapter can tell which files a complete save holds: those journaled for this save.
    std::set<std::string> journaled;
    for (const JournalRecord& record : records) {
      if (record.role == FileRole::kData) journaled.insert(record.path);
    }
    save = MatchSave(records, {journaled.begin(), journaled.end()}, bounds, on_disk);
    save.missing.clear();
  }
  const std::vector<std::string> missing = NotYetDurable(records, save);
  if (!missing.empty()) {
    *waiting = "not closed and durable yet: " + Joined(missing);
    return false;
  }
  if (const Status recorded = WriteSaveGeneration(tag_dir, GenerationOf(commit, save.closes));
      !recorded.ok()) {
    // Only a later save of the tag needs it, and it then waits for its own closes.
    UCP_LOG_WARN("durable: {}", recorded.message());
  }
  return true;
}

bool DurableCommit::Rename(const Publish& publish) const {
  const std::string& pending = publish.event.written_path;
  const std::string& signal = publish.event.signal_path;
  Result<File> file = File::Open(pending, File::Mode::kRead);
  Status status = file.ok() ? file->Sync() : file.status();
  if (status.ok()) status = file->Close();
  if (status.ok()) status = RenameFile(pending, signal);
  if (status.ok()) status = SyncDirectory(std::string(Parent(signal)));
  if (!status.ok()) {
    UCP_LOG_ERROR("durable: {}; {} not published", status.message(), signal);
    return false;
  }
  return true;
}

void DurableCommit::SweepStale(const std::string& signal_path) const {
  const std::string dir(Parent(signal_path));
  const std::string_view signal = std::string_view(signal_path).substr(dir.size() + 1);
  DIR* stream = ::opendir(dir.c_str());
  if (stream == nullptr) return;
  std::vector<std::string> stale;
  while (const dirent* entry = ::readdir(stream)) {
    const std::optional<PendingName> name = ParsePendingName(entry->d_name);
    // A process that no longer exists (killed mid-save) left it; its tag was never published.
    if (name && name->signal == signal && name->pid != pid_ &&
        ::kill(static_cast<pid_t>(name->pid), 0) != 0 && errno == ESRCH) {
      stale.push_back(dir + "/" + entry->d_name);
    }
  }
  ::closedir(stream);
  for (const std::string& path : stale) {
    if (RemoveFile(path).ok()) UCP_LOG_INFO("durable: removed {}, left by a dead process", path);
  }
}

bool DurableCommit::PublishReady() {
  std::map<std::string, std::vector<Publish>> snapshot;
  std::vector<std::string> unswept;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot = publishes_;
    for (const auto& [signal, list] : publishes_) {
      if (swept_.insert(signal).second) unswept.push_back(signal);
    }
  }
  for (const std::string& signal : unswept) SweepStale(signal);
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [signal, list] : snapshot) {
    // The newest complete commit wins; the older ones it supersedes are never published.
    std::optional<size_t> ready;
    std::string waiting;
    for (size_t i = list.size(); i-- > 0;) {
      std::string missing;
      if (Complete(list[i], &missing)) {
        ready = i;
        break;
      }
      if (i + 1 == list.size()) waiting = std::move(missing);
    }
    std::vector<const Publish*> done;  // leave publishes_, their pending files removed
    std::vector<const Publish*> expired;
    bool published = false;
    if (ready) {
      published = Rename(list[*ready]);
      for (size_t i = 0; i <= *ready; ++i) done.push_back(&list[i]);
    }
    for (size_t i = ready ? *ready + 1 : 0; i < list.size(); ++i) {
      if (now >= list[i].give_up) expired.push_back(&list[i]);
    }
    for (const Publish* publish : expired) {
      UCP_LOG_ERROR("durable: {} still incomplete after {} ms ({}); {} not published",
                    publish->event.tag_dir, options_.wait.count(), waiting,
                    publish->event.signal_path);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<Publish>& live = publishes_[signal];
      for (const std::vector<const Publish*>* gone : {&done, &expired}) {
        for (const Publish* publish : *gone) {
          ForgetPending(publish->event.signal_path, publish->event.written_path);
          std::erase_if(live, [&](const Publish& entry) {
            return entry.event.written_path == publish->event.written_path;
          });
        }
      }
      if (live.empty()) publishes_.erase(signal);
      if (published) ++published_;
    }
    for (const std::vector<const Publish*>* gone : {&done, &expired}) {
      for (const Publish* publish : *gone) {
        if (published && publish == &list[*ready]) continue;
        static_cast<void>(RemoveFile(publish->event.written_path));
      }
    }
    if (published) {
      const Publish& publish = list[*ready];
      UCP_LOG_INFO("durable: published {} (tag {}) {:.1f} ms after its commit", signal,
                   publish.event.tag,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                             publish.committed)
                       .count());
      CommitEvent event = publish.event;
      event.written_path = signal;
      Downstream(event);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return !publishes_.empty();
}

void DurableCommit::Downstream(const CommitEvent& event) {
  for (CommitListener* listener : downstream_) listener->OnCommit(event);
}

ServeDecision PendingSignalServe::Resolve(std::string_view path) {
  if (std::optional<std::string> pending = durable_->PendingFor(path)) {
    return ServeDecision{ServeDecision::Kind::kSubstitute, std::move(*pending)};
  }
  return inner_->Resolve(path);
}

ServeDecision PendingSignalServe::ResolveMetadata(std::string_view path) {
  if (std::optional<std::string> pending = durable_->PendingFor(path)) {
    return ServeDecision{ServeDecision::Kind::kSubstitute, std::move(*pending)};
  }
  return inner_->ResolveMetadata(path);
}

bool PendingSignalServe::MayServePath(std::string_view path) {
  return durable_->MayHavePending(path) || inner_->MayServePath(path);
}

std::optional<ListingChange> PendingSignalServe::ChangeListing(std::string_view dir) {
  return inner_->ChangeListing(dir);
}

}  // namespace ucp::hooks
