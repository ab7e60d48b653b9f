#include "hooks/topology/topology_registry.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>

#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"

namespace ucp::hooks {
namespace {

std::string HexHandle(uintptr_t handle) { return fmt::format("{:#x}", handle); }
std::string HexHash(uint64_t hash) { return fmt::format("{:016x}", hash); }

template <typename T>
nlohmann::json OrNull(const std::optional<T>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

nlohmann::json RecordJson(const CommRecord& record) {
  nlohmann::json split = nullptr;
  if (record.split) {
    split = {{"parent", record.split->parent_order},
             {"color", record.split->color},
             {"key", record.split->key}};
  }
  return {{"order", record.order},
          {"handle", HexHandle(record.handle)},
          {"origin", CommOriginName(record.origin)},
          {"nranks", OrNull(record.nranks)},
          {"rank", OrNull(record.rank)},
          {"unique_id_hash",
           record.unique_id_hash ? nlohmann::json(HexHash(*record.unique_id_hash)) : nullptr},
          {"split", split},
          {"init_all_group", OrNull(record.init_all_group)},
          {"cuda_device", OrNull(record.cuda_device)},
          {"state", CommStateName(record.state)}};
}

std::string ExpandPid(const std::string& path) {
  std::string out;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 1 < path.size() && path[i + 1] == 'p') {
      out += std::to_string(::getpid());
      ++i;
    } else {
      out += path[i];
    }
  }
  return out;
}

}  // namespace

const char* CommOriginName(CommOrigin origin) noexcept {
  switch (origin) {
    case CommOrigin::kInitRank:
      return "init_rank";
    case CommOrigin::kInitRankConfig:
      return "init_rank_config";
    case CommOrigin::kInitRankScalable:
      return "init_rank_scalable";
    case CommOrigin::kInitAll:
      return "init_all";
    case CommOrigin::kSplit:
      return "split";
  }
  return "unknown";
}

const char* CommStateName(CommState state) noexcept {
  switch (state) {
    case CommState::kLive:
      return "live";
    case CommState::kFinalized:
      return "finalized";
    case CommState::kDestroyed:
      return "destroyed";
    case CommState::kAborted:
      return "aborted";
  }
  return "unknown";
}

uint64_t HashUniqueId(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
}

TopologyRegistry& TopologyRegistry::Global() noexcept {
  static TopologyRegistry* registry = new TopologyRegistry();
  return *registry;
}

void TopologyRegistry::SetDumpPath(const std::string& path) noexcept {
  std::lock_guard lock(mutex_);
  try {
    dump_path_ = ExpandPid(path);
  } catch (...) {
    dump_path_.clear();
  }
  dump_failure_logged_ = false;
}

void TopologyRegistry::RecordGeneratedUniqueId(std::span<const std::byte> unique_id) noexcept {
  std::lock_guard lock(mutex_);
  try {
    if (generated_ids_.size() == kMaxGeneratedIds) generated_ids_.erase(generated_ids_.begin());
    generated_ids_.push_back(HashUniqueId(unique_id));
  } catch (...) {
    return;
  }
  DumpLocked();
}

void TopologyRegistry::RecordInit(uintptr_t handle, CommOrigin origin, int nranks, int rank,
                                  std::span<const std::byte> unique_ids,
                                  std::optional<int> cuda_device) noexcept {
  std::lock_guard lock(mutex_);
  try {
    CommRecord& record = AppendLocked(handle, origin);
    record.nranks = nranks;
    record.rank = rank;
    record.unique_id_hash = HashUniqueId(unique_ids);
    record.cuda_device = cuda_device;
  } catch (...) {
    return;
  }
  DumpLocked();
}

void TopologyRegistry::RecordInitAll(std::span<const uintptr_t> handles,
                                     std::span<const int> devices) noexcept {
  std::lock_guard lock(mutex_);
  try {
    std::optional<uint64_t> group;
    const int nranks = static_cast<int>(handles.size());
    for (size_t i = 0; i < handles.size(); ++i) {
      CommRecord& record = AppendLocked(handles[i], CommOrigin::kInitAll);
      if (!group) group = record.order;
      record.nranks = nranks;
      record.rank = static_cast<int>(i);
      record.init_all_group = group;
      if (i < devices.size()) record.cuda_device = devices[i];
    }
  } catch (...) {
    return;
  }
  DumpLocked();
}

void TopologyRegistry::RecordSplit(uintptr_t parent, int color, int key, uintptr_t child,
                                   std::optional<int> cuda_device) noexcept {
  std::lock_guard lock(mutex_);
  try {
    std::optional<uint64_t> parent_order;
    if (const CommRecord* found = FindAliveLocked(parent)) parent_order = found->order;
    CommRecord& record = AppendLocked(child, CommOrigin::kSplit);
    if (parent_order) record.split = SplitInfo{*parent_order, color, key};
    record.cuda_device = cuda_device;
  } catch (...) {
    return;
  }
  DumpLocked();
}

void TopologyRegistry::ResolveSplit(uintptr_t handle, int nranks, int rank) noexcept {
  std::lock_guard lock(mutex_);
  CommRecord* record = FindAliveLocked(handle);
  if (record == nullptr) return;
  record->nranks = nranks;
  record->rank = rank;
  DumpLocked();
}

void TopologyRegistry::RecordEnd(uint64_t order, CommState state) noexcept {
  if (state == CommState::kLive) return;
  std::lock_guard lock(mutex_);
  // Records are sorted by order (appended in creation order, erased from anywhere).
  const auto it = std::lower_bound(records_.begin(), records_.end(), order,
                                   [](const CommRecord& r, uint64_t o) { return r.order < o; });
  if (it == records_.end() || it->order != order || !it->alive()) return;
  if (state == CommState::kFinalized) {
    it->state = state;
  } else {
    EndLifeLocked(*it, state);
  }
  DumpLocked();
}

std::vector<CommRecord> TopologyRegistry::Communicators() const {
  std::lock_guard lock(mutex_);
  return records_;
}

std::optional<CommRecord> TopologyRegistry::Find(uintptr_t handle) const {
  std::lock_guard lock(mutex_);
  const CommRecord* record = FindAliveLocked(handle);
  if (record == nullptr) return std::nullopt;
  return *record;
}

std::optional<CommRecord> TopologyRegistry::World() const {
  std::lock_guard lock(mutex_);
  return SummaryLocked().world;
}

TopologySummary TopologyRegistry::Summary() const {
  std::lock_guard lock(mutex_);
  return SummaryLocked();
}

std::vector<uint64_t> TopologyRegistry::GeneratedUniqueIds() const {
  std::lock_guard lock(mutex_);
  return generated_ids_;
}

std::string TopologyRegistry::DumpJson() const {
  std::lock_guard lock(mutex_);
  return DumpJsonLocked();
}

CommRecord* TopologyRegistry::FindAliveLocked(uintptr_t handle) {
  // Newest first: the alive record of a reused address is the last one.
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->handle == handle && it->alive()) return &*it;
  }
  return nullptr;
}

const CommRecord* TopologyRegistry::FindAliveLocked(uintptr_t handle) const {
  return const_cast<TopologyRegistry*>(this)->FindAliveLocked(handle);
}

CommRecord& TopologyRegistry::AppendLocked(uintptr_t handle, CommOrigin origin) {
  // NCCL hands out an address again only after freeing the communicator that had it; a destroy
  // we did not see (a call made before ucp was loaded, or a failed record) must not leave two
  // alive records with one handle.
  if (CommRecord* stale = FindAliveLocked(handle)) EndLifeLocked(*stale, CommState::kDestroyed);
  CommRecord record;
  record.order = next_order_++;
  record.handle = handle;
  record.origin = origin;
  records_.push_back(record);
  return records_.back();
}

void TopologyRegistry::EndLifeLocked(CommRecord& record, CommState state) {
  record.state = state;
  if (++dead_count_ <= kMaxDeadRecords) return;
  const auto oldest = std::find_if(records_.begin(), records_.end(),
                                   [](const CommRecord& r) { return !r.alive(); });
  records_.erase(oldest);
  --dead_count_;
}

TopologySummary TopologyRegistry::SummaryLocked() const {
  TopologySummary summary;
  for (const CommRecord& record : records_) {
    if (record.state != CommState::kLive) continue;
    if (record.unique_id_hash)
      summary.unique_id_groups[*record.unique_id_hash].push_back(record.order);
    if (!record.nranks) continue;
    // Records are in creation order, so a strict comparison keeps the first among equals.
    if (!summary.world || *record.nranks > *summary.world->nranks) summary.world = record;
  }
  if (summary.world) {
    summary.world_size = summary.world->nranks;
    summary.global_rank = summary.world->rank;
  }
  return summary;
}

std::string TopologyRegistry::DumpJsonLocked() const {
  nlohmann::json communicators = nlohmann::json::array();
  for (const CommRecord& record : records_) communicators.push_back(RecordJson(record));
  nlohmann::json generated = nlohmann::json::array();
  for (uint64_t hash : generated_ids_) generated.push_back(HexHash(hash));

  const TopologySummary summary = SummaryLocked();
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& [hash, orders] : summary.unique_id_groups) {
    groups.push_back({{"unique_id_hash", HexHash(hash)}, {"communicators", orders}});
  }
  nlohmann::json world = summary.world ? nlohmann::json(summary.world->order) : nullptr;
  nlohmann::json doc = {{"version", 1},
                        {"pid", ::getpid()},
                        {"communicators", std::move(communicators)},
                        {"generated_unique_ids", std::move(generated)},
                        {"summary",
                         {{"world", std::move(world)},
                          {"world_size", OrNull(summary.world_size)},
                          {"global_rank", OrNull(summary.global_rank)},
                          {"unique_id_groups", std::move(groups)}}}};
  return doc.dump(2) + "\n";
}

void TopologyRegistry::DumpLocked() noexcept {
  if (dump_path_.empty()) return;
  // The dump's own open/write/rename must pass through ucp's wrappers untouched.
  ReentrancyGuard guard;
  const int saved_errno = errno;
  Status status;
  try {
    status = WriteDumpLocked(DumpJsonLocked());
  } catch (...) {
    status = Status::Internal("topology: dump of " + dump_path_ + ": out of memory");
  }
  if (!status.ok() && !dump_failure_logged_) {
    dump_failure_logged_ = true;
    UCP_LOG_WARN("{}", status.ToString());
  }
  errno = saved_errno;
}

Status TopologyRegistry::WriteDumpLocked(const std::string& json) const {
  const std::string temp = dump_path_ + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError("topology: open " + temp, errno);
  size_t done = 0;
  while (done < json.size()) {
    const ssize_t n = ::write(fd, json.data() + done, json.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(temp.c_str());
      return PosixError("topology: write " + temp, err);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return PosixError("topology: close " + temp, err);
  }
  if (::rename(temp.c_str(), dump_path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return PosixError("topology: rename " + temp + " to " + dump_path_, err);
  }
  return Status::Ok();
}

}  // namespace ucp::hooks
