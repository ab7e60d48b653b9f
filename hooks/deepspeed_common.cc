#include "hooks/deepspeed_common.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>

#include "core/format/torch_archive_writer.h"
#include "core/util/checked.h"

namespace ucp::hooks::deepspeed {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

constexpr int64_t kMaxDpWorldSize = int64_t{1} << 24;

std::string Prefix(const std::string& where) { return "deepspeed: " + where + ": "; }

std::string ModelStatesName(uint32_t mp) {
  char name[64];
  std::snprintf(name, sizeof(name), "mp_rank_%02u_model_states.pt", mp);
  return name;
}

std::string OptimName(std::string_view prefix, uint32_t dp, uint32_t mp) {
  char name[96];
  std::snprintf(name, sizeof(name), "zero_pp_rank_%u_mp_rank_%02u_optim_states.pt", dp, mp);
  return std::string(prefix) + name;
}
std::optional<uint32_t> ParseIndex(const std::string& digits) {
  if (digits.empty() || digits.size() > 9) return std::nullopt;
  return static_cast<uint32_t>(std::stoul(digits));
}

// The statics an adapter uses are never destroyed: inside the preload, the index builder's
// thread may run while the process exits, after function-local statics were destroyed.
Result<TagListing> ListTag(const std::string& tag_dir) {
  static const std::regex& kModel = *new std::regex(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex& kOptim =
      *new std::regex(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex& kZero3Model =
      *new std::regex(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex& kLayer = *new std::regex(R"(layer_\d+-model(_\d+-model)?_states\.pt)");
  std::error_code error;
  fs::directory_iterator it(tag_dir, error);
  if (error) return PosixError(Prefix(tag_dir) + "list", error.value());
  TagListing listing;
  for (const fs::directory_entry& entry : it) {
    if (!entry.is_regular_file(error)) continue;
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, kModel)) {
      const std::optional<uint32_t> mp = ParseIndex(m[1].str());
      if (mp) listing.model_states[*mp] = name;
    } else if (std::regex_match(name, m, kOptim)) {
      const std::optional<uint32_t> dp = ParseIndex(m[2].str());
      const std::optional<uint32_t> mp = ParseIndex(m[3].str());
      if (dp && mp) listing.optim.push_back({name, m[1].str(), *dp, *mp});
    } else if (std::regex_match(name, m, kZero3Model)) {
      const std::optional<uint32_t> dp = ParseIndex(m[1].str());
      const std::optional<uint32_t> mp = ParseIndex(m[2].str());
      if (dp && mp) listing.zero3_model_states.push_back({name, "", *dp, *mp});
    } else if (std::regex_match(name, kLayer)) {
      listing.layer_files.push_back(name);
    }
  }
  return listing;
}
Status FieldError(const TorchArchiveReader& reader, std::string_view field, std::string what) {
  return Status::Corrupt(Prefix(reader.path()) + std::string(field) + ": " + what);
}

Result<const Value*> Field(const TorchArchiveReader& reader, std::string_view field) {
  Result<const Value*> node = reader.Find(field);
  if (!node.ok()) return FieldError(reader, field, "missing");
  return *node;
}

const Value* OptionalField(const TorchArchiveReader& reader, std::string_view field) {
  Result<const Value*> node = reader.Find(field);
  return node.ok() ? *node : nullptr;
}

Result<int64_t> IntField(const TorchArchiveReader& reader, std::string_view field) {
  UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, field));
  std::optional<int64_t> value;
  if (node->kind() == Kind::kInt) value = node->AsInt64();
  if (!value) return FieldError(reader, field, "not an int");
  return *value;
}

Result<std::string> StrField(const TorchArchiveReader& reader, std::string_view field) {
  UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, field));
  if (node->kind() != Kind::kStr) return FieldError(reader, field, "not a str");
  return node->data();
}

Result<std::vector<int64_t>> IntListField(const TorchArchiveReader& reader,
                                          std::string_view field) {
  UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, field));
  if (node->kind() != Kind::kList && node->kind() != Kind::kTuple) {
    return FieldError(reader, field, "not a list");
  }
  std::vector<int64_t> out;
  for (const Value* item : node->items()) {
    std::optional<int64_t> value;
    if (item->kind() == Kind::kInt) value = item->AsInt64();
    if (!value) return FieldError(reader, field, "an element is not an int");
    out.push_back(*value);
  }
  return out;
}

std::string ListText(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(values[i]);
  }
  return text + "]";
}

std::string ShapeText(const Shape& shape) {
  std::vector<int64_t> dims(shape.begin(), shape.end());
  return ListText(dims);
}

std::optional<Shape> ShapeOf(const Value* node) {
  if (node->kind() == Kind::kObject && node->IsCallOf("torch", "Size") &&
      node->args()->items().size() == 1) {
    node = node->args()->Item(0);
  }
  if (node->kind() != Kind::kTuple && node->kind() != Kind::kList) return std::nullopt;
  Shape shape;
  for (const Value* dim : node->items()) {
    std::optional<int64_t> value;
    if (dim->kind() == Kind::kInt) value = dim->AsInt64();
    if (!value || *value < 0) return std::nullopt;
    shape.push_back(static_cast<uint64_t>(*value));
  }
  return shape;
}

std::optional<int64_t> ZeroStageOf(const Value* node) {
  if (node->kind() == Kind::kInt) return node->AsInt64();
  if (node->kind() != Kind::kObject) return std::nullopt;
  const Value* args = node->args();
  if (node->IsCallOf("__builtin__", "getattr") || node->IsCallOf("builtins", "getattr")) {
    if (args->items().size() != 2 || args->Item(1)->kind() != Kind::kStr) return std::nullopt;
    static const auto& kStages =
        *new std::map<std::string, int64_t, std::less<>>{{"disabled", 0},
                                                         {"optimizer_states", 1},
                                                         {"gradients", 2},
                                                         {"weights", 3},
                                                         {"max_stage", 3}};
    const auto it = kStages.find(args->Item(1)->data());
    if (it == kStages.end()) return std::nullopt;
    return it->second;
  }
  if (args->items().size() == 1 && args->Item(0)->kind() == Kind::kInt) {
    return args->Item(0)->AsInt64();
  }
  return std::nullopt;
}

nlohmann::json JsonOf(const Value* node) {
  switch (node->kind()) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return node->bool_value();
    case Kind::kInt: {
      const std::optional<int64_t> value = node->AsInt64();
      if (value) return *value;
      return node->IntDecimal();
    }
    case Kind::kFloat:
      return node->float_value();
    case Kind::kStr:
      return node->data();
    case Kind::kTuple:
    case Kind::kList: {
      nlohmann::json array = nlohmann::json::array();
      for (const Value* item : node->items()) array.push_back(JsonOf(item));
      return array;
    }
    case Kind::kDict: {
      nlohmann::json object = nlohmann::json::object();
      for (const auto& [key, value] : node->entries()) object[KeyText(key)] = JsonOf(value);
      return object;
    }
    default: {
      Result<std::string> text = pickle::Render(node);
      return text.ok() ? *text : std::string(pickle::KindName(node->kind()));
    }
  }
}
Result<TorchArchiveReader> OpenWrittenModelStates(const std::string& tag_dir,
                                                  const std::string& name, bool present) {
  if (!present) return Status::FailedPrecondition(Prefix(tag_dir + "/" + name) + "not written yet");
  Result<TorchArchiveReader> opened = TorchArchiveReader::Open(tag_dir + "/" + name);
  if (!opened.ok()) {
    return Status::FailedPrecondition(opened.status().message() + " (not a complete archive yet)");
  }
  return opened;
}

Result<uint32_t> DpWorldSize(const TorchArchiveReader& model_states) {
  UCP_ASSIGN_OR_RETURN(const int64_t dp, IntField(model_states, "dp_world_size"));
  if (dp <= 0 || dp > kMaxDpWorldSize) {
    return FieldError(model_states, "dp_world_size", std::to_string(dp) + ": out of range");
  }
  return static_cast<uint32_t>(dp);
}

bool Bf16Prefix(const TagListing& listing, const TorchArchiveReader& model_states) {
  bool bf16 = std::any_of(listing.optim.begin(), listing.optim.end(),
                          [](const RankFile& entry) { return !entry.prefix.empty(); });
  for (const char* key : {"ds_config/bf16/enabled", "ds_config/bfloat16/enabled"}) {
    const Value* enabled = OptionalField(model_states, key);
    bf16 = bf16 || (enabled != nullptr && enabled->kind() == Kind::kBool && enabled->bool_value());
  }
  return bf16;
}

Result<GroupLayout> MakeLayout(std::vector<std::string> names, std::vector<Shape> shapes) {
  GroupLayout layout;
  layout.names = std::move(names);
  layout.shapes = std::move(shapes);
  for (const Shape& shape : layout.shapes) {
    UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
    layout.offsets.push_back(layout.total);
    layout.numels.push_back(numel);
    const std::optional<uint64_t> total = CheckedAdd(layout.total, numel);
    if (!total) return Status::OutOfRange("deepspeed: parameter group: more than 2^64 elements");
    layout.total = *total;
  }
  return layout;
}
std::optional<nlohmann::json> ScalarValue(const TorchArchiveReader& reader,
                                          const TorchTensor& tensor) {
  std::byte bytes[8] = {};
  const uint64_t size = ItemSize(tensor.dtype);
  if (size > sizeof(bytes) ||
      !reader.ReadStorage(*tensor.storage, tensor.storage_offset * size, {bytes, size}).ok()) {
    return std::nullopt;
  }
  switch (tensor.dtype) {
    case DType::kFloat32: {
      float value;
      std::memcpy(&value, bytes, sizeof(value));
      return static_cast<double>(value);
    }
    case DType::kFloat64: {
      double value;
      std::memcpy(&value, bytes, sizeof(value));
      return value;
    }
    case DType::kInt64: {
      int64_t value;
      std::memcpy(&value, bytes, sizeof(value));
      return value;
    }
    default:
      return std::nullopt;
  }
}

std::string TagName(const std::string& tag_dir) {
  fs::path path = fs::path(tag_dir).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  return path.filename().string();
}
Result<TorchArchiveReader> OpenSource(const AtomIndex& index, const std::string& tag_dir,
                                      uint32_t file) {
  const IndexedFile& indexed = index.files().at(file);
  UCP_ASSIGN_OR_RETURN(File source, File::OpenBeneath(tag_dir, indexed.path));
  UCP_ASSIGN_OR_RETURN(const uint64_t size, source.Size());
  if (size != indexed.size) {
    return Status::Corrupt(Prefix(source.path()) + std::to_string(size) +
                           " bytes, the index says " + std::to_string(indexed.size) +
                           " (changed since it was indexed)");
  }
  return TorchArchiveReader::Open(std::move(source), {});
}

const Value* PidTuple(const Value* node) {
  if (node->kind() != Kind::kPersistentId) return nullptr;
  const Value* pid = node->pid();
  if (pid->kind() != Kind::kTuple || pid->items().size() < 5 ||
      pid->Item(2)->kind() != Kind::kStr) {
    return nullptr;
  }
  return pid;
}

Result<std::vector<OutputStorage>> CollectStorages(
    Value* root, const TorchArchiveReader& template_reader, uint32_t file,
    std::map<std::string, std::vector<Segment>> replaced) {
  std::map<std::string, std::string> numel_by_key;
  UCP_RETURN_IF_ERROR(pickle::ForEachReachable(root, [&](Value* node) -> Status {
    const Value* pid = PidTuple(node);
    if (pid == nullptr) return Status::Ok();
    const std::string numel = KeyText(pid->Item(4));
    const auto [it, inserted] = numel_by_key.emplace(pid->Item(2)->data(), numel);
    if (!inserted && it->second != numel) {
      return Status::Internal(Prefix(template_reader.path()) + "storage " + it->first +
                              ": referenced with " + it->second + " and " + numel + " elements");
    }
    return Status::Ok();
  }));
  std::vector<OutputStorage> storages;
  for (const auto& [key, numel] : numel_by_key) {
    auto it = replaced.find(key);
    if (it != replaced.end()) {
      storages.push_back({key, std::move(it->second)});
      continue;
    }
    const auto record = template_reader.storages().find(key);
    if (record == template_reader.storages().end()) {
      return Status::Corrupt(Prefix(template_reader.path()) + "storage " + key + ": no record");
    }
    storages.push_back({key, {Segment{file, record->second.offset, record->second.size}}});
  }
  return storages;
}
Status SetDictItem(Value* dict, std::string_view key, Value* value, const std::string& where) {
  if (dict == nullptr || dict->kind() != Kind::kDict) {
    return Status::Corrupt(Prefix(where) + "not a dict where " + std::string(key) + " belongs");
  }
  for (auto it = dict->mutable_entries().rbegin(); it != dict->mutable_entries().rend(); ++it) {
    if (it->first->kind() == Kind::kStr && it->first->data() == key) {
      it->second = value;
      return Status::Ok();
    }
  }
  return Status::Corrupt(Prefix(where) + std::string(key) + ": missing");
}

Value* IntList(pickle::Graph& graph, const std::vector<uint64_t>& values) {
  std::vector<Value*> items;
  for (const uint64_t value : values) items.push_back(graph.Int(static_cast<int64_t>(value)));
  return graph.List(std::move(items));
}
Result<Value*> TensorLike(pickle::Graph& graph, const TorchTensor& tensor, std::string key,
                          Shape shape, uint64_t storage_numel) {
  TensorNodeSpec spec;
  spec.storage_key = std::move(key);
  spec.dtype = tensor.dtype;
  spec.location = tensor.storage->location;
  spec.storage_numel = storage_numel;
  spec.shape = std::move(shape);
  spec.requires_grad = tensor.requires_grad;
  spec.parameter = tensor.parameter;
  return MakeTensorNode(graph, spec);
}

Result<Value*> PartitionTensor(pickle::Graph& graph, const TorchTensor& tensor, uint64_t numel,
                               uint64_t storage_numel) {
  return TensorLike(graph, tensor, tensor.storage->key, {numel}, storage_numel);
}

Result<ArchiveOutput> UniversalAtomArchive(const AtomIndex& index, const Atom& atom,
                                           const Shape& shape, bool requires_grad, bool wrapped) {
  ArchiveOutput out;
  out.path = "zero/" + atom.param + "/" + atom.state + ".pt";
  UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(atom.shape));
  TensorNodeSpec spec;
  spec.storage_key = "0";
  spec.dtype = atom.dtype;
  spec.storage_numel = numel;
  spec.shape = shape;
  spec.requires_grad = requires_grad;
  UCP_ASSIGN_OR_RETURN(Value * tensor, MakeTensorNode(out.graph, spec));
  if (wrapped) {
    out.graph.set_root(out.graph.Dict(
        {{out.graph.Str("cat_dim"), out.graph.Int(0)}, {out.graph.Str("param"), tensor}}));
  } else {
    out.graph.set_root(tensor);
  }
  UCP_ASSIGN_OR_RETURN(const Region whole, Region::Whole(atom.shape));
  UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, PlanRegion(index, atom, whole));
  out.storages.push_back({"0", std::move(segments)});
  return out;
}

Status CollectRequiresGrad(const TorchArchiveReader& reader, const std::string& fp32_field,
                           const std::string& states_field, const std::vector<std::string>& names,
                           std::map<std::string, bool>& out) {
  std::vector<std::pair<std::string, const TorchTensor*>> tensors;
  UCP_ASSIGN_OR_RETURN(const Value* fp32, Field(reader, fp32_field));
  tensors.emplace_back("fp32", reader.TensorAt(fp32));
  UCP_ASSIGN_OR_RETURN(const Value* states, Field(reader, states_field));
  for (const auto& [key, value] : NamedChildren(states)) {
    tensors.emplace_back(key, reader.TensorAt(value));
  }
  for (const std::string& name : names) {
    for (const auto& [state, tensor] : tensors) {
      if (tensor != nullptr) out[name + "/" + state] = tensor->requires_grad;
    }
  }
  return Status::Ok();
}

Status CheckTarget(const Topology& target) {
  if (target.tp != 1) {
    return Status::Unsupported("deepspeed: tp=" + std::to_string(target.tp) +
                               ": tensor-parallel resharding is not supported yet");
  }
  if (target.pp != 1) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(target.pp) +
                               ": pipeline-parallel resharding is not supported yet");
  }
  if (target.dp == 0) return Status::InvalidArgument("deepspeed: dp=0: no ranks to reshard to");
  if (target.world != 0 && target.world % target.dp != 0) {
    return Status::InvalidArgument("deepspeed: dp=" + std::to_string(target.dp) +
                                   " does not divide world=" + std::to_string(target.world));
  }
  if (target.world != 0 && target.world != target.dp) {
    return Status::Unsupported("deepspeed: world=" + std::to_string(target.world) +
                               " with dp=" + std::to_string(target.dp) +
                               ": only pure data parallelism (world = dp) is supported");
  }
  return Status::Ok();
}

}  // namespace ucp::hooks::deepspeed
