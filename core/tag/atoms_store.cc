#include "core/tag/atoms_store.h"

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
#include "core/tag/journal.h"
#include "core/util/checked.h"
#include "core/util/log.h"
#include "core/util/path.h"

namespace ucp {
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
      FileDigest digest{file["size"].get<uint64_t>(), *xxh3, {}};
      Result<ChunkHashes> chunks = ChunkHashesFromJson(file, digest.size);
      if (!chunks.ok()) return corrupt("files: " + chunks.status().message());
      digest.chunks = std::move(chunks).value();
      written[file["path"].get<std::string>()] = std::move(digest);
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
    file.chunks = digest->second.chunks;
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
    nlohmann::ordered_json entry = {
        {"path", unit.path}, {"size", digest.size}, {"xxh3", FormatXxh3(digest.xxh3)}};
    PutChunkHashes(digest.chunks, entry);
    files.push_back(std::move(entry));
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

}  // namespace ucp
