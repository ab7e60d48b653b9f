#include "hooks/atoms_store.h"

#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/format/safetensors_reader.h"
#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/io/file_lock.h"
#include "core/plan/export_plan.h"
#include "core/util/checked.h"
#include "core/util/log.h"
#include "core/util/path.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/journal.h"

namespace ucp::hooks {
namespace {

constexpr uint64_t kMinShardBytes = uint64_t{16} << 20;
constexpr uint64_t kMaxShardBytes = uint64_t{4} << 30;
// A done marker lists a few files.
constexpr uint64_t kMaxMarkerBytes = uint64_t{16} << 20;

std::string StorePathOf(const std::string& tag_dir) {
  return tag_dir + "/" + std::string(kStoreDirectory);
}

std::string MarkerName(uint32_t rank, uint32_t world) {
  return "done." + std::to_string(rank) + "-of-" + std::to_string(world) + ".json";
}

// "carried." before the last component of `path`.
std::string CopyName(const std::string& path) {
  const size_t slash = path.rfind('/');
  const size_t last = slash == std::string::npos ? 0 : slash + 1;
  return path.substr(0, last) + "carried." + path.substr(last);
}

uint32_t LinearRank(const RankCoordinates& rank, const Topology& topology) {
  return rank.dp + topology.dp * (rank.tp + topology.tp * rank.pp);
}

bool HasSize(const std::string& path, uint64_t size) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
         static_cast<uint64_t>(info.st_size) == size;
}

// Moves every output of `plan` into a unit of its own, its path prefixed with `directory`/.
Status AddUnits(OutputPlan plan, const std::string& directory, std::vector<StoreUnit>& units) {
  if (!plan.archives.empty() || !plan.copies.empty()) {
    return Status::Internal("atoms store: a safetensors export planned other kinds of files");
  }
  for (SafetensorsOutput& output : plan.safetensors) {
    output.path = directory + "/" + output.path;
    StoreUnit unit{output.path, {}};
    unit.plan.safetensors.push_back(std::move(output));
    units.push_back(std::move(unit));
  }
  for (TextOutput& output : plan.texts) {
    output.path = directory + "/" + output.path;
    StoreUnit unit{output.path, {}};
    unit.plan.texts.push_back(std::move(output));
    units.push_back(std::move(unit));
  }
  return Status::Ok();
}

// Files of the store (paths relative to it) and their digests.
using WrittenFiles = std::map<std::string, FileDigest>;

// Path (relative to the store) → digest, from every rank's done marker for the index hashing to
// `index_hex`; nullopt when a marker is missing or belongs to another index.
Result<std::optional<WrittenFiles>> ReadMarkers(const std::string& store, uint32_t world,
                                                const std::string& index_hex) {
  WrittenFiles written;
  for (uint32_t rank = 0; rank < world; ++rank) {
    const std::string path = store + "/" + MarkerName(rank, world);
    Result<std::string> text = ReadSmallFile(path, kMaxMarkerBytes);
    if (!text.ok()) {
      if (text.status().code() == StatusCode::kNotFound) return std::optional<WrittenFiles>();
      return text.status();
    }
    const nlohmann::json marker = nlohmann::json::parse(*text, nullptr, false);
    const auto corrupt = [&](const std::string& what) {
      return Status::Corrupt("atoms store: done marker " + path + ": " + what);
    };
    if (!marker.is_object() || !marker.contains("index_xxh3") || !marker.contains("files") ||
        !marker["files"].is_array()) {
      return corrupt("not {\"index_xxh3\", \"files\"}");
    }
    if (marker["index_xxh3"] != index_hex) return std::optional<WrittenFiles>();
    for (const nlohmann::json& file : marker["files"]) {
      if (!file.is_object() || !file.contains("path") || !file["path"].is_string() ||
          !file.contains("size") || !file["size"].is_number_unsigned() || !file.contains("xxh3") ||
          !file["xxh3"].is_string()) {
        return corrupt("files: an entry is not {\"path\", \"size\", \"xxh3\"}");
      }
      const Result<uint64_t> xxh3 = ParseXxh3(file["xxh3"].get<std::string>());
      if (!xxh3.ok()) return corrupt("files: " + xxh3.status().message());
      written[file["path"].get<std::string>()] = {file["size"].get<uint64_t>(), *xxh3};
    }
  }
  return std::optional<WrittenFiles>(std::move(written));
}

// The index with the store recorded: every unit's file listed with its digest, the consolidated
// offsets taken from the safetensors headers written.
Result<AtomIndex> WithStore(const AtomIndex& index, const StorePlan& plan,
                            const WrittenFiles& written, const std::string& tag_dir,
                            const std::string& index_path) {
  const std::string store = StorePathOf(tag_dir);
  AtomIndexContents c = index.contents();
  c.store = AtomsStore{std::string(kStoreDirectory), plan.max_shard_bytes};
  for (const StoreUnit& unit : plan.units) {
    if (!unit.plan.texts.empty()) continue;  // export's index documents: no atom lives there
    const auto digest = written.find(unit.path);
    const std::string path = store + "/" + unit.path;
    if (digest == written.end()) {
      return Status::Corrupt("atoms store: no done marker lists " + path);
    }
    if (!HasSize(path, digest->second.size)) {
      return Status::Corrupt("atoms store: " + path + " is not the " +
                             std::to_string(digest->second.size) + " bytes its marker says");
    }
    IndexedFile file{std::string(kStoreDirectory) + "/" + unit.path, digest->second.size,
                     digest->second.xxh3, "", std::nullopt};
    if (!unit.plan.copies.empty()) {
      file.role = kStoreCopyRole;
      file.copy_of = unit.plan.copies.front().file;
      c.files.push_back(std::move(file));
      continue;
    }
    file.role = kStoreAtomsRole;
    const uint32_t file_index = static_cast<uint32_t>(c.files.size());
    c.files.push_back(std::move(file));
    const std::string state = unit.path.substr(0, unit.path.find('/'));
    UCP_ASSIGN_OR_RETURN(const SafetensorsHeader header, SafetensorsHeader::Read(path));
    for (const SafetensorsTensor& tensor : header.tensors()) {
      const Atom* atom = index.Find(tensor.name, state);
      if (atom == nullptr || atom->dtype != tensor.dtype || atom->shape != tensor.shape) {
        return Status::Corrupt("atoms store: " + path + ": tensor " + tensor.name +
                               " is no atom of state " + state + " with its dtype and shape");
      }
      c.atoms[static_cast<size_t>(atom - index.atoms().data())].consolidated =
          ConsolidatedCopy{file_index, tensor.offset};
    }
  }
  return AtomIndex::Create(std::move(c), index_path);
}

}  // namespace

std::string IndexLockPath(const std::string& tag_dir) {
  return JournalDirectory(tag_dir) + "/index.lock";
}

Result<StorePlan> PlanStore(const AtomIndex& index) {
  if (index.contents().store) {
    return Status::FailedPrecondition("atoms store of " + index.contents().tag + ": already made");
  }
  uint64_t total = 0;
  std::vector<std::string> states;
  for (const Atom& atom : index.atoms()) {
    UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(atom.shape));
    const std::optional<uint64_t> bytes = CheckedMul(numel, ItemSize(atom.dtype));
    const std::optional<uint64_t> sum = bytes ? CheckedAdd(total, *bytes) : std::nullopt;
    if (!sum) return Status::OutOfRange("atoms store: more than 2^64 bytes");
    total = *sum;
    if (std::find(states.begin(), states.end(), atom.state) != states.end()) continue;
    if (!IsNormalRelativePath(atom.state) || atom.state.find('/') != std::string::npos) {
      return Status::Unsupported("atoms store: state \"" + atom.state + "\" of " + atom.param +
                                 " is not a directory name");
    }
    states.push_back(atom.state);
  }
  const uint32_t world = index.contents().topology.world;
  StorePlan plan;
  plan.max_shard_bytes =
      std::clamp(total / world + (total % world != 0), kMinShardBytes, kMaxShardBytes);
  for (const std::string& state : states) {
    UCP_ASSIGN_OR_RETURN(OutputPlan exported,
                         PlanSafetensorsExport(index, state, plan.max_shard_bytes));
    UCP_RETURN_IF_ERROR(AddUnits(std::move(exported), state, plan.units));
  }
  std::set<uint32_t> copied;
  for (const CarriedObject& carried : index.contents().carried) {
    if (!copied.insert(carried.file).second) continue;
    StoreUnit unit{CopyName(index.files()[carried.file].path), {}};
    unit.plan.copies.push_back({unit.path, carried.file});
    plan.units.push_back(std::move(unit));
  }
  return plan;
}

Status WriteStoreShare(const AtomIndex& index, uint64_t index_xxh3, const std::string& tag_dir,
                       uint32_t rank, const ExecuteOptions& options) {
  const uint32_t world = index.contents().topology.world;
  if (rank >= world) {
    return Status::InvalidArgument("atoms store: rank " + std::to_string(rank) +
                                   " outside a world of " + std::to_string(world));
  }
  UCP_ASSIGN_OR_RETURN(const StorePlan plan, PlanStore(index));
  const std::string store = StorePathOf(tag_dir);
  UCP_RETURN_IF_ERROR(CreateDirectories(store));
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (size_t i = rank; i < plan.units.size(); i += world) {
    const StoreUnit& unit = plan.units[i];
    UCP_RETURN_IF_ERROR(
        ExecutePlan(unit.plan, index, tag_dir, store, options).WithContext("atoms store"));
    UCP_ASSIGN_OR_RETURN(const FileDigest digest, HashFile(store + "/" + unit.path));
    files.push_back(
        {{"path", unit.path}, {"size", digest.size}, {"xxh3", FormatXxh3(digest.xxh3)}});
  }
  const nlohmann::ordered_json marker = {{"index_xxh3", FormatXxh3(index_xxh3)},
                                         {"files", std::move(files)}};
  return WriteFileAtomically(store + "/" + MarkerName(rank, world), marker.dump(1) + "\n");
}

Result<bool> FinalizeStore(const std::string& tag_dir, uint64_t index_xxh3) {
  UCP_ASSIGN_OR_RETURN(const FileLock lock, FileLock::Acquire(IndexLockPath(tag_dir)));
  const std::string index_path = AtomIndexPath(tag_dir);
  Result<std::string> bytes = ReadSmallFile(index_path, kMaxAtomIndexBytes);
  if (!bytes.ok() && bytes.status().code() == StatusCode::kNotFound) return false;
  if (!bytes.ok()) return bytes.status();
  if (XXH3_64bits(bytes->data(), bytes->size()) != index_xxh3) return false;
  UCP_ASSIGN_OR_RETURN(const AtomIndex index, AtomIndex::Parse(*bytes, index_path));
  UCP_ASSIGN_OR_RETURN(const StorePlan plan, PlanStore(index));
  const uint32_t world = index.contents().topology.world;
  const std::string store = StorePathOf(tag_dir);
  UCP_ASSIGN_OR_RETURN(const auto written, ReadMarkers(store, world, FormatXxh3(index_xxh3)));
  if (!written) return false;
  UCP_ASSIGN_OR_RETURN(const AtomIndex with_store,
                       WithStore(index, plan, *written, tag_dir, index_path));
  UCP_RETURN_IF_ERROR(with_store.Write(index_path));
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (const Status removed = RemoveFile(store + "/" + MarkerName(rank, world)); !removed.ok()) {
      UCP_LOG_WARN("atoms: {}", removed.message());
    }
  }
  return true;
}

Result<std::optional<AtomIndex>> ReadableSources(const AtomIndex& index,
                                                 const std::string& tag_dir) {
  const IndexedFile* gone = nullptr;
  for (const IndexedFile& file : index.files()) {
    if (!AtomIndex::IsStoreFile(file) && !HasSize(tag_dir + "/" + file.path, file.size)) {
      gone = &file;
      break;
    }
  }
  if (gone == nullptr) return std::optional<AtomIndex>();
  const std::string why =
      tag_dir + "/" + gone->path + " is missing or changed since the tag was indexed";
  if (!index.contents().store) {
    return Status::FailedPrecondition(why + ", and the index has no atoms store");
  }
  for (const IndexedFile& file : index.files()) {
    if (AtomIndex::IsStoreFile(file) && !HasSize(tag_dir + "/" + file.path, file.size)) {
      return Status::FailedPrecondition(why + ", and so is the atoms store's " + file.path);
    }
  }
  UCP_ASSIGN_OR_RETURN(AtomIndex over, index.OverStore());
  return std::optional<AtomIndex>(std::move(over));
}

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
