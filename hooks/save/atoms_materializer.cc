#include "hooks/save/atoms_materializer.h"

#include <xxhash.h>

#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"

namespace ucp::hooks {
namespace {

// The rank whose share of the store this process writes (atoms_store.h's numbering).
uint32_t LinearRank(const RankCoordinates& rank, const Topology& topology) {
  return rank.dp + topology.dp * (rank.tp + topology.tp * rank.pp);
}

}  // namespace

AtomsMaterializer::AtomsMaterializer(AtomsMaterializerOptions options)
    : options_(options), worker_([this] { Run(); }) {}

AtomsMaterializer::~AtomsMaterializer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    jobs_.clear();
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void AtomsMaterializer::OnCommit(const CommitEvent& /*event*/) noexcept {}

void AtomsMaterializer::OnFileSaved(const SavedFileEvent& event) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    Job& job = jobs_[event.tag_dir];
    job.saved[event.path] = {event.size, event.xxh3};
    job.give_up = std::chrono::steady_clock::now() + options_.wait;
    ++job.generation;
  } catch (...) {
    // Out of memory: this tag gets no share from this process, like a rank that died.
    return;
  }
  wake_.notify_all();
}

void AtomsMaterializer::Drain(std::chrono::steady_clock::time_point deadline) noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  draining_ = std::chrono::steady_clock::now();
  if (wake_.wait_until(lock, deadline, [this] { return jobs_.empty() && !busy_; })) return;
  UCP_LOG_WARN("atoms: teardown deadline reached; {} tag(s) left without this process's share",
               jobs_.size());
  stopping_ = true;
  jobs_.clear();
  lock.unlock();
  wake_.notify_all();
}

uint64_t AtomsMaterializer::shares_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return shares_written_;
}

void AtomsMaterializer::Run() {
  // Everything this thread does is ucp's own I/O: the hooks must neither record nor serve it.
  ReentrancyGuard guard;
  IoPhaseScope phase(IoPhase::kAtoms);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (stopping_) return;
    const std::map<std::string, Job> jobs = jobs_;
    const std::optional<std::chrono::steady_clock::time_point> draining = draining_;
    busy_ = true;
    lock.unlock();
    std::vector<std::pair<std::string, uint64_t>> finished;  // tag, generation attempted
    for (const auto& [tag_dir, job] : jobs) {
      if (Attempt(tag_dir, job) == Outcome::kDone) {
        finished.emplace_back(tag_dir, job.generation);
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= job.give_up) {
        UCP_LOG_WARN("atoms: {}: gave up after {} ms waiting for an index of this save; no share",
                     tag_dir, options_.wait.count());
        finished.emplace_back(tag_dir, job.generation);
      } else if (draining && now >= *draining + options_.wait_at_exit) {
        UCP_LOG_WARN(
            "atoms: {}: exiting, and no index of this save appeared within {} ms; no "
            "share",
            tag_dir, options_.wait_at_exit.count());
        finished.emplace_back(tag_dir, job.generation);
      }
    }
    lock.lock();
    busy_ = false;
    for (const auto& [tag_dir, generation] : finished) {
      const auto it = jobs_.find(tag_dir);
      if (it != jobs_.end() && it->second.generation == generation) jobs_.erase(it);
    }
    wake_.notify_all();
    if (!jobs_.empty()) wake_.wait_for(lock, options_.poll, [this] { return stopping_; });
  }
}

AtomsMaterializer::Outcome AtomsMaterializer::Attempt(const std::string& tag_dir, const Job& job) {
  const std::string index_path = AtomIndexPath(tag_dir);
  Result<std::string> bytes = ReadSmallFile(index_path, kMaxAtomIndexBytes);
  if (!bytes.ok()) {
    if (bytes.status().code() == StatusCode::kNotFound) return Outcome::kWaiting;
    UCP_LOG_WARN("atoms: {}; no share", bytes.status().message());
    return Outcome::kDone;
  }
  // An index the builder may still replace (an earlier save's, or an invalid one): wait.
  Result<AtomIndex> index = AtomIndex::Parse(*bytes, index_path);
  if (!index.ok()) return Outcome::kWaiting;
  const Topology& topology = index->contents().topology;
  std::optional<uint32_t> rank;
  for (const auto& [path, digest] : job.saved) {
    const IndexedFile* file = index->FindFile(path);
    if (file == nullptr || file->size != digest.size || file->xxh3 != digest.xxh3) {
      return Outcome::kWaiting;
    }
    if (!file->rank) continue;
    const uint32_t linear = LinearRank(*file->rank, topology);
    if (rank && *rank != linear) {
      UCP_LOG_WARN("atoms: {}: this process saved files of ranks {} and {}; no share", tag_dir,
                   *rank, linear);
      return Outcome::kDone;
    }
    rank = linear;
  }
  if (index->contents().store) return Outcome::kDone;
  if (!rank) {
    UCP_LOG_WARN("atoms: {}: no file this process saved has a rank in the index; no share",
                 tag_dir);
    return Outcome::kDone;
  }
  const uint64_t index_xxh3 = XXH3_64bits(bytes->data(), bytes->size());
  ExecuteOptions execute;
  execute.threads = options_.threads;
  if (const Status written = WriteStoreShare(*index, index_xxh3, tag_dir, *rank, execute);
      !written.ok()) {
    UCP_LOG_WARN("atoms: {}: share of rank {}: {}; the store stays incomplete", tag_dir, *rank,
                 written.ToString());
    return Outcome::kDone;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++shares_written_;
  }
  Result<bool> finalized = FinalizeStore(tag_dir, index_xxh3);
  if (!finalized.ok()) {
    UCP_LOG_WARN("atoms: {}: recording the store: {}", tag_dir, finalized.status().ToString());
  } else if (*finalized) {
    UCP_LOG_INFO("atoms: {}: store complete, recorded in {}", tag_dir, index_path);
  } else {
    UCP_LOG_INFO("atoms: {}: share of rank {} of {} written", tag_dir, *rank, topology.world);
  }
  return Outcome::kDone;
}

}  // namespace ucp::hooks
