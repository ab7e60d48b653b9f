#include "core/format/torch_archive_writer.h"

#include <string_view>
#include <utility>

#include "core/format/pickle_writer.h"
#include "core/format/torch_archive_reader.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using pickle::Kind;
using pickle::Value;

// The file name without folders and without its last extension, as torch 1.13 names the folder.
std::string Stem(const std::string& path) {
  const size_t slash = path.rfind('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

constexpr std::string_view kPickleRecord = "data.pkl";
constexpr std::string_view kVersionRecord = "version";
constexpr std::string_view kVersionContents = "3\n";

std::string StorageRecord(const std::string& key) { return "data/" + key; }

// Every storage persistent id in `root` names a key of `storage_sizes` whose size is numel ×
// itemsize of its storage type, and every key is referenced (kInvalidArgument naming `path`).
Status CheckStorageReferences(const std::string& path, const Value* root,
                              const std::map<std::string, uint64_t>& storage_sizes) {
  if (root == nullptr) return Status::InvalidArgument("torch archive " + path + ": no object");
  std::map<std::string, uint64_t> referenced;  // key → bytes its persistent ids promise
  UCP_RETURN_IF_ERROR(
      pickle::ForEachReachable(const_cast<Value*>(root), [&](Value* node) -> Status {
        if (node->kind() != Kind::kPersistentId) return Status::Ok();
        const Value* pid = node->pid();
        if (pid == nullptr || pid->kind() != Kind::kTuple || pid->items().size() != 5 ||
            pid->Item(1)->kind() != Kind::kGlobal || pid->Item(2)->kind() != Kind::kStr ||
            pid->Item(4)->kind() != Kind::kInt) {
          return Status::InvalidArgument("torch archive " + path +
                                         ": persistent id is not a torch storage");
        }
        const std::optional<DType> dtype = StorageElementType(pid->Item(1)->name());
        const std::optional<int64_t> numel = pid->Item(4)->AsInt64();
        const std::optional<uint64_t> size =
            dtype && numel && *numel >= 0
                ? CheckedMul(static_cast<uint64_t>(*numel), ItemSize(*dtype))
                : std::nullopt;
        const std::string& key = pid->Item(2)->data();
        if (!size) {
          return Status::InvalidArgument("torch archive " + path + ": storage " + key +
                                         " has an unknown type or a bad size");
        }
        const auto [it, added] = referenced.emplace(key, *size);
        if (!added && it->second != *size) {
          return Status::InvalidArgument("torch archive " + path + ": storage " + key +
                                         " is referenced with two sizes");
        }
        return Status::Ok();
      }));
  for (const auto& [key, size] : referenced) {
    const auto added = storage_sizes.find(key);
    if (added == storage_sizes.end()) {
      return Status::InvalidArgument("torch archive " + path + ": storage " + key +
                                     " is referenced but was not added");
    }
    if (added->second != size) {
      return Status::InvalidArgument("torch archive " + path + ": storage " + key + " has " +
                                     std::to_string(added->second) + " bytes, its references say " +
                                     std::to_string(size));
    }
  }
  for (const auto& [key, size] : storage_sizes) {
    if (referenced.count(key) == 0) {
      return Status::InvalidArgument("torch archive " + path + ": storage " + key +
                                     " was added but nothing references it");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<TorchArchiveWriter> TorchArchiveWriter::Create(std::string path, Options options) {
  ZipWriter::Options zip_options;
  zip_options.archive_name = options.archive_name.empty() ? Stem(path) : options.archive_name;
  zip_options.sync = options.sync;
  zip_options.copy_buffer_bytes = options.copy_buffer_bytes;
  zip_options.progress = std::move(options.progress);
  if (zip_options.archive_name.empty()) {
    return Status::InvalidArgument("torch archive " + path + ": empty archive name");
  }
  UCP_ASSIGN_OR_RETURN(ZipWriter zip, ZipWriter::Create(path, std::move(zip_options)));
  return TorchArchiveWriter(std::move(path), std::move(zip));
}

Status TorchArchiveWriter::AddSource(std::string key, Source source) {
  if (key.empty() || key.find('/') != std::string::npos) {
    return Status::InvalidArgument("torch archive " + path_ + ": bad storage key \"" + key + "\"");
  }
  if (!sources_.emplace(key, std::move(source)).second) {
    return Status::InvalidArgument("torch archive " + path_ + ": storage " + key + " added twice");
  }
  return Status::Ok();
}

Status TorchArchiveWriter::AddStorageFromFile(std::string key, const File& source, uint64_t offset,
                                              uint64_t size, std::optional<uint32_t> crc32) {
  return AddSource(std::move(key), Source{&source, offset, size, crc32, {}, {}});
}

Status TorchArchiveWriter::AddStorageFromRuns(std::string key, std::span<const ByteRun> runs) {
  const Result<uint64_t> size = ByteRunsLength(runs);
  if (!size.ok()) return size.status().WithContext("torch archive " + path_ + ": storage " + key);
  return AddSource(std::move(key),
                   Source{nullptr, 0, *size, std::nullopt, {}, {runs.begin(), runs.end()}});
}

Status TorchArchiveWriter::AddStorageFromMemory(std::string key, std::span<const std::byte> data) {
  return AddSource(std::move(key), Source{nullptr, 0, data.size(), std::nullopt, data, {}});
}

Result<uint64_t> TorchArchiveWriter::Finish(const Value* root) {
  std::map<std::string, uint64_t> storage_sizes;
  for (const auto& [key, source] : sources_) storage_sizes[key] = source.size;
  UCP_RETURN_IF_ERROR(CheckStorageReferences(path_, root, storage_sizes));
  // The record order (PlannedSize follows it): data.pkl, the storages by key, version.
  UCP_ASSIGN_OR_RETURN(std::string pickle_bytes, pickle::WritePickle(root));
  UCP_RETURN_IF_ERROR(zip_.AddRecord(kPickleRecord, std::string_view(pickle_bytes)));
  for (const auto& [key, source] : sources_) {
    const std::string name = StorageRecord(key);
    if (source.file != nullptr) {
      UCP_RETURN_IF_ERROR(
          zip_.AddRecordFromFile(name, *source.file, source.offset, source.size, source.crc32));
    } else if (!source.runs.empty()) {
      UCP_RETURN_IF_ERROR(zip_.AddRecordFromRuns(name, source.runs));
    } else {
      UCP_RETURN_IF_ERROR(zip_.AddRecord(name, source.memory));
    }
  }
  UCP_RETURN_IF_ERROR(zip_.AddRecord(kVersionRecord, kVersionContents));
  return zip_.Finish();
}

namespace {

// The records Finish writes for `root` with storages of these sizes, in its order; `names` and
// `pickle` own the bytes the records view.
struct RecordPlan {
  std::string archive_name;
  std::string pickle;
  std::vector<std::string> names;  // reserved whole: the views below never move
  std::vector<ZipWriter::PlannedRecord> records;
};

Result<RecordPlan> PlanRecords(const std::string& path, const TorchArchiveWriter::Options& options,
                               const Value* root,
                               const std::map<std::string, uint64_t>& storage_sizes) {
  if (root == nullptr) return Status::InvalidArgument("torch archive " + path + ": no object");
  RecordPlan plan;
  plan.archive_name = options.archive_name.empty() ? Stem(path) : options.archive_name;
  UCP_ASSIGN_OR_RETURN(plan.pickle, pickle::WritePickle(root));
  plan.names.reserve(storage_sizes.size());
  plan.records.push_back({kPickleRecord, plan.pickle.size()});
  for (const auto& [key, size] : storage_sizes) {
    plan.records.push_back({plan.names.emplace_back(StorageRecord(key)), size});
  }
  plan.records.push_back({kVersionRecord, kVersionContents.size()});
  return plan;
}

}  // namespace

Result<uint64_t> TorchArchiveWriter::PlannedSize(
    const std::string& path, const Options& options, const Value* root,
    const std::map<std::string, uint64_t>& storage_sizes) {
  UCP_ASSIGN_OR_RETURN(const RecordPlan plan, PlanRecords(path, options, root, storage_sizes));
  return ZipWriter::PlannedSize(plan.archive_name, plan.records);
}

Result<std::map<std::string, uint64_t>> TorchArchiveWriter::PlannedStorageOffsets(
    const std::string& path, const Options& options, const Value* root,
    const std::map<std::string, uint64_t>& storage_sizes) {
  UCP_RETURN_IF_ERROR(CheckStorageReferences(path, root, storage_sizes));
  UCP_ASSIGN_OR_RETURN(const RecordPlan plan, PlanRecords(path, options, root, storage_sizes));
  UCP_ASSIGN_OR_RETURN(const std::vector<uint64_t> offsets,
                       ZipWriter::PlannedDataOffsets(plan.archive_name, plan.records));
  std::map<std::string, uint64_t> storage_offsets;
  size_t record = 1;  // after data.pkl, the storages in key order
  for (const auto& [key, size] : storage_sizes) storage_offsets[key] = offsets[record++];
  return storage_offsets;
}

Result<uint64_t> TorchArchiveWriter::FinishParts(
    const std::string& path, const Options& options, const Value* root,
    const std::map<std::string, uint64_t>& storage_sizes,
    const std::map<std::string, uint32_t>& storage_crcs, File file) {
  UCP_RETURN_IF_ERROR(CheckStorageReferences(path, root, storage_sizes));
  UCP_ASSIGN_OR_RETURN(const RecordPlan plan, PlanRecords(path, options, root, storage_sizes));
  std::vector<ZipWriter::PartsRecord> records;
  records.push_back({kPickleRecord, plan.pickle.size(), 0,
                     std::as_bytes(std::span(plan.pickle.data(), plan.pickle.size()))});
  size_t record = 1;
  for (const auto& [key, size] : storage_sizes) {
    const auto crc = storage_crcs.find(key);
    if (crc == storage_crcs.end()) {
      return Status::InvalidArgument("torch archive " + path + ": no CRC-32 for storage " + key);
    }
    records.push_back({plan.records[record++].name, size, crc->second, std::nullopt});
  }
  records.push_back({kVersionRecord, kVersionContents.size(), 0,
                     std::as_bytes(std::span(kVersionContents.data(), kVersionContents.size()))});
  ZipWriter::Options zip_options;
  zip_options.archive_name = plan.archive_name;
  zip_options.sync = options.sync;
  return ZipWriter::FinishParts(path, std::move(file), std::move(zip_options), records);
}

Result<uint64_t> RewriteArchive(const TorchArchiveReader& reader, std::string path,
                                TorchArchiveWriter::Options options) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveWriter writer,
                       TorchArchiveWriter::Create(std::move(path), std::move(options)));
  for (const auto& [key, storage] : reader.storages()) {
    UCP_RETURN_IF_ERROR(writer.AddStorageFromFile(key, reader.zip().file(), storage.offset,
                                                  storage.size, storage.crc32));
  }
  return writer.Finish(reader.root());
}

Result<Value*> MakeTensorNode(pickle::Graph& graph, const TensorNodeSpec& spec) {
  const std::optional<std::string_view> storage_class = TorchStorageClass(spec.dtype);
  if (!storage_class) {
    return Status::Unsupported("torch archive: torch 1.13 has no storage type for " +
                               std::string(TorchName(spec.dtype)));
  }
  std::vector<uint64_t> stride = spec.stride;
  if (stride.empty()) {
    stride.resize(spec.shape.size());
    uint64_t step = 1;
    for (size_t i = spec.shape.size(); i-- > 0;) {
      stride[i] = step;
      step *= spec.shape[i];
    }
  }
  if (stride.size() != spec.shape.size()) {
    return Status::InvalidArgument("torch archive: tensor shape and stride differ in rank");
  }
  auto int_tuple = [&graph](const std::vector<uint64_t>& values) {
    std::vector<Value*> items;
    for (uint64_t value : values) items.push_back(graph.Int(static_cast<int64_t>(value)));
    return graph.Tuple(std::move(items));
  };
  auto empty_ordered_dict = [&graph] {
    return graph.Object(pickle::Construction::kReduce, graph.Global("collections", "OrderedDict"),
                        graph.Tuple({}));
  };
  Value* pid = graph.PersistentId(
      graph.Tuple({graph.Str("storage"), graph.Global("torch", std::string(*storage_class)),
                   graph.Str(spec.storage_key), graph.Str(spec.location),
                   graph.Int(static_cast<int64_t>(spec.storage_numel))}));
  Value* tensor = graph.Object(
      pickle::Construction::kReduce, graph.Global("torch._utils", "_rebuild_tensor_v2"),
      graph.Tuple({pid, graph.Int(static_cast<int64_t>(spec.storage_offset)), int_tuple(spec.shape),
                   int_tuple(stride), graph.Bool(spec.parameter ? false : spec.requires_grad),
                   empty_ordered_dict()}));
  if (!spec.parameter) return tensor;
  return graph.Object(pickle::Construction::kReduce,
                      graph.Global("torch._utils", "_rebuild_parameter"),
                      graph.Tuple({tensor, graph.Bool(spec.requires_grad), empty_ordered_dict()}));
}

}  // namespace ucp
