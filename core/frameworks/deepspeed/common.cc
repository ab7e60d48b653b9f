#include "core/frameworks/deepspeed/common.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <regex>
#include <tuple>

#include "core/format/torch_archive_writer.h"
#include "core/io/file.h"
#include "core/util/checked.h"

namespace ucp::deepspeed {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

constexpr int64_t kMaxDpWorldSize = int64_t{1} << 24;

std::string Prefix(const std::string& where) { return "deepspeed: " + where + ": "; }

Result<TagListing> ListTag(const std::string& tag_dir) {
  std::error_code error;
  fs::directory_iterator it(tag_dir, error);
  if (error) return PosixError(Prefix(tag_dir) + "list", error.value());
  TagListing listing;
  for (const fs::directory_entry& entry : it) {
    if (!entry.is_regular_file(error)) continue;
    const std::string name = entry.path().filename().string();
    const std::optional<FileName> parsed = ParseFileName(name);
    if (!parsed) continue;
    switch (parsed->kind) {
      case FileKind::kModelStates:
        listing.model_states[parsed->mp] = name;
        break;
      case FileKind::kOptimStates:
        listing.optim.push_back({name, parsed->prefix, parsed->dp, parsed->mp});
        break;
      case FileKind::kZero3ModelStates:
        listing.zero3_model_states.push_back({name, "", parsed->dp, parsed->mp});
        break;
      case FileKind::kLayerStates:
        listing.layer_files.push_back(name);
        break;
      case FileKind::kExpertOptimStates:
      case FileKind::kExpertModelStates:
        listing.expert_files.push_back(name);
        break;
    }
  }
  // Directory order is the file system's: the first named in a refusal is the same everywhere.
  std::sort(listing.expert_files.begin(), listing.expert_files.end());
  return listing;
}

Result<TagListing> ListTagToRead(const std::string& tag_dir) {
  UCP_ASSIGN_OR_RETURN(TagListing listing, ListTag(tag_dir));
  if (listing.expert_files.empty()) return listing;
  return Status::Unsupported(
      Prefix(tag_dir) + "a DeepSpeed-MoE tag (" + std::to_string(listing.expert_files.size()) +
      " expert files, " + listing.expert_files.front() +
      " first): expert parallelism with pipeline or tensor parallelism or ZeRO-3 is not supported "
      "yet (the deepspeed-moe adapter reads MoE tags of ZeRO-1/2 without them); the tag is left "
      "as DeepSpeed wrote it");
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
  if (!opened.ok() && opened.status().code() != StatusCode::kUnsupported) {
    return Status::FailedPrecondition(opened.status().message() + " (not a complete archive yet)");
  }
  return opened;
}

std::optional<TorchArchiveReader> WrittenRankZeroModelStates(const std::string& tag_dir,
                                                             const TagListing& listing) {
  const auto model = listing.model_states.find(0);
  if (model == listing.model_states.end()) return std::nullopt;
  Result<TorchArchiveReader> reader = TorchArchiveReader::Open(tag_dir + "/" + model->second);
  if (!reader.ok()) return std::nullopt;
  return std::move(reader).value();
}

bool SaysTensorParallel(const TorchArchiveReader& model_states) {
  const Result<int64_t> mp = IntField(model_states, "mp_world_size");
  return mp.ok() && *mp > 1;
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

Status CheckIndexAdapter(const AtomIndex& index, std::string_view adapter) {
  const std::string& written_by = index.contents().adapter;
  if (written_by == adapter) return Status::Ok();
  return Status::InvalidArgument("deepspeed: index of adapter \"" + written_by + "\", not " +
                                 std::string(adapter));
}

Result<StateTemplates> StateTemplatesOf(const AtomIndex& index) {
  StateTemplates templates;
  bool have_model = false;
  bool have_optim = false;
  for (const CarriedObject& carried : index.contents().carried) {
    if (carried.role == kModelRole) templates.model_file = carried.file, have_model = true;
    if (carried.role == kOptimRole) templates.optim_file = carried.file, have_optim = true;
  }
  if (!have_model || !have_optim) {
    return Status::Corrupt("deepspeed: index carried: no model_states or optim_states template");
  }
  return templates;
}

Result<std::string> OptimFilePrefix(const nlohmann::json& adapter_state) {
  std::string prefix = adapter_state["file_prefix"].get<std::string>();
  if (prefix != "" && prefix != "bf16_") {
    return Status::Corrupt("deepspeed: index adapter_state: file_prefix \"" + prefix +
                           "\" is neither \"\" nor \"bf16_\"");
  }
  return prefix;
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
void EraseKey(Value* dict, std::string_view key) {
  if (dict == nullptr || dict->kind() != Kind::kDict) return;
  std::erase_if(dict->mutable_entries(), [&](const std::pair<Value*, Value*>& entry) {
    return entry.first->kind() == Kind::kStr && entry.first->data() == key;
  });
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

Status SetPartitionFields(pickle::Graph& graph, Value* dict, std::vector<Value*> fp32_partitions,
                          const std::vector<uint64_t>& group_paddings,
                          const std::vector<uint64_t>& partition_counts,
                          std::vector<Value*> mappings, const std::vector<size_t>& params_per_group,
                          const std::string& where) {
  if (dict != nullptr && dict->kind() == Kind::kDict &&
      dict->Get(kParamAlignmentPaddings) != nullptr) {
    std::vector<Value*> per_group;
    for (const size_t params : params_per_group) {
      per_group.push_back(IntList(graph, std::vector<uint64_t>(params, 0)));
    }
    UCP_RETURN_IF_ERROR(
        SetDictItem(dict, kParamAlignmentPaddings, graph.List(std::move(per_group)), where));
  }
  UCP_RETURN_IF_ERROR(SetDictItem(dict, "single_partition_of_fp32_groups",
                                  graph.List(std::move(fp32_partitions)), where));
  UCP_RETURN_IF_ERROR(SetDictItem(dict, "group_paddings", IntList(graph, group_paddings), where));
  UCP_RETURN_IF_ERROR(
      SetDictItem(dict, "partition_count", IntList(graph, partition_counts), where));
  return SetDictItem(dict, "param_slice_mappings", graph.List(std::move(mappings)), where);
}

std::vector<std::string> RewrittenPartitionFields(const TorchArchiveReader& r) {
  std::vector<std::string> fields;
  for (const std::string_view field :
       {std::string_view("single_partition_of_fp32_groups"), std::string_view("group_paddings"),
        std::string_view("partition_count"), std::string_view("param_slice_mappings"),
        kParamAlignmentPaddings}) {
    std::string path = std::string(kOsd) + "/" + std::string(field);
    if (field != kParamAlignmentPaddings || OptionalField(r, path) != nullptr) {
      fields.push_back(std::move(path));
    }
  }
  return fields;
}

Status CheckNoParameterAlignment(const TorchArchiveReader& r, size_t groups) {
  const std::string field = std::string(kOsd) + "/" + std::string(kParamAlignmentPaddings);
  const Value* paddings = OptionalField(r, field);
  if (paddings == nullptr) return Status::Ok();
  if (paddings->kind() != Kind::kList || paddings->items().size() != groups) {
    return FieldError(r, field, "not a list of " + std::to_string(groups) + " groups' paddings");
  }
  for (size_t g = 0; g < groups; ++g) {
    const Value* group = paddings->Item(g);
    if (group->kind() != Kind::kList) {
      return FieldError(r, field + "/" + std::to_string(g), "not a list of ints");
    }
    for (const Value* padding : group->items()) {
      const std::optional<int64_t> value =
          padding->kind() == Kind::kInt ? padding->AsInt64() : std::nullopt;
      if (!value) return FieldError(r, field + "/" + std::to_string(g), "not a list of ints");
      if (*value != 0) {
        return Status::Unsupported(
            Prefix(r.path()) + field + "/" + std::to_string(g) +
            ": parameters padded apart in the flat group (zero_optimization.parameter_alignment) "
            "are not supported yet");
      }
    }
  }
  return Status::Ok();
}

Value* IntList(pickle::Graph& graph, const std::vector<uint64_t>& values) {
  std::vector<Value*> items;
  for (const uint64_t value : values) items.push_back(graph.Int(static_cast<int64_t>(value)));
  return graph.List(std::move(items));
}

Value* SizeNode(pickle::Graph& graph, const Shape& shape) {
  std::vector<Value*> dims;
  for (const uint64_t d : shape) dims.push_back(graph.Int(static_cast<int64_t>(d)));
  return graph.Object(pickle::Construction::kReduce, graph.Global("torch", "Size"),
                      graph.Tuple({graph.Tuple(std::move(dims))}));
}
Value* ShapeNodeLike(pickle::Graph& graph, const Value* saved, const Shape& shape) {
  if (saved->kind() != Kind::kTuple) return SizeNode(graph, shape);
  std::vector<Value*> extents;
  for (const uint64_t extent : shape) extents.push_back(graph.Int(static_cast<int64_t>(extent)));
  return graph.Tuple(std::move(extents));
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

Status SetConfigValue(pickle::Graph& graph, Value* root, std::string_view section,
                      std::string_view key, int64_t value, const TorchArchiveReader& reader) {
  Value* config = root->Get("ds_config");
  if (Value* entries = config == nullptr ? nullptr : config->Get(section);
      entries != nullptr && entries->kind() == Kind::kDict && entries->Get(key)) {
    return SetDictItem(entries, key, graph.Int(value), reader.path());
  }
  return Status::Ok();
}

bool VersionAtLeast(const std::string& version, int major, int minor, int patch) {
  int got_major = 0, got_minor = 0, got_patch = 0;
  if (std::sscanf(version.c_str(), "%d.%d.%d", &got_major, &got_minor, &got_patch) != 3) {
    return false;
  }
  return std::tie(got_major, got_minor, got_patch) >= std::tie(major, minor, patch);
}

namespace {

// The refusal of module tensor `name` (at `field` of `where`) of `dtype`, which ds_to_universal
// converts to float32 and ucp cannot: float32 is copied, bfloat16 widened (its bits the high
// half); others are refused.
Status RefuseUnconvertible(const std::string& where, const std::string& field,
                           const std::string& name, DType dtype) {
  return Status::Unsupported(Prefix(where) + field + ": " + std::string(TorchName(dtype)) +
                             "; ds_to_universal writes it converted to float32 in zero/" + name +
                             "/fp32.pt, which ucp does for float32 and contiguous bfloat16 only");
}

// {'param': tensor} of zero/<name>/fp32.pt, `tensor` a float32 tensor node of `out`'s graph.
void SetModuleTensorRoot(ArchiveOutput& out, Value* tensor) {
  out.graph.set_root(out.graph.Dict({{out.graph.Str("param"), tensor}}));
}

}  // namespace

Status AddUniversalModuleTensors(const TorchArchiveReader& reader, uint32_t file,
                                 const std::set<std::string>& grouped, const std::string& version,
                                 OutputPlan& plan) {
  if (!VersionAtLeast(version, 0, 19, 8)) return Status::Ok();
  const Value* module = OptionalField(reader, "module");
  if (module == nullptr) return Status::Ok();
  for (const auto& [name, value] : NamedChildren(module)) {
    const TorchTensor* tensor = reader.TensorAt(value);
    if (tensor == nullptr || grouped.contains(name)) continue;
    const bool widen = tensor->dtype == DType::kBFloat16;
    if ((!widen && tensor->dtype != DType::kFloat32) || (widen && !tensor->contiguous())) {
      return RefuseUnconvertible(reader.path(), "module/" + name, name, tensor->dtype);
    }
    ArchiveOutput out;
    out.path = "zero/" + name + "/fp32.pt";
    TensorNodeSpec spec;
    spec.storage_key = "0";
    spec.dtype = DType::kFloat32;
    spec.shape = tensor->shape;
    spec.requires_grad = tensor->requires_grad;
    Segment bytes{file, tensor->storage->offset, tensor->storage->size};
    if (widen) {
      // .float() makes a new contiguous tensor of the view's elements alone.
      spec.storage_numel = tensor->numel();
      bytes = {file, tensor->file_offset(), 4 * tensor->numel(), /*widen_bf16=*/true};
    } else {
      // .float() of a float32 tensor is the tensor: torch.save keeps its whole storage.
      spec.storage_numel = tensor->storage->numel;
      spec.storage_offset = tensor->storage_offset;
      spec.stride = tensor->stride;
    }
    UCP_ASSIGN_OR_RETURN(Value * node, MakeTensorNode(out.graph, spec));
    SetModuleTensorRoot(out, node);
    out.storages.push_back({"0", {bytes}});
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

Result<std::vector<Segment>> Float32Segments(const AtomIndex& index, const Atom& atom) {
  const bool widen = atom.dtype == DType::kBFloat16;
  if (!widen && atom.dtype != DType::kFloat32) {
    return RefuseUnconvertible("index", atom.param + "/bit16", atom.param, atom.dtype);
  }
  UCP_ASSIGN_OR_RETURN(const Region whole, Region::Whole(atom.shape));
  UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, PlanRegion(index, atom, whole));
  if (widen) {
    for (Segment& segment : segments) {
      segment.length *= 2;
      segment.widen_bf16 = !segment.zero_fill();
    }
  }
  return segments;
}

void SetExpertParamRoot(pickle::Graph& graph, Value* tensor, uint32_t experts) {
  graph.set_root(graph.Dict({{graph.Str("param"), tensor},
                             {graph.Str("cat_dim"), graph.Int(0)},
                             {graph.Str("is_expert_param"), graph.Bool(true)},
                             {graph.Str("ep_num_experts"), graph.Int(experts)}}));
}

Result<ArchiveOutput> UniversalModuleAtomArchive(const AtomIndex& index, const Atom& atom) {
  UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, Float32Segments(index, atom));
  ArchiveOutput out;
  out.path = "zero/" + atom.param + "/fp32.pt";
  TensorNodeSpec spec;
  spec.storage_key = "0";
  spec.dtype = DType::kFloat32;
  UCP_ASSIGN_OR_RETURN(spec.storage_numel, NumElements(atom.shape));
  spec.shape = atom.shape;
  UCP_ASSIGN_OR_RETURN(Value * node, MakeTensorNode(out.graph, spec));
  SetModuleTensorRoot(out, node);
  out.storages.push_back({"0", std::move(segments)});
  return out;
}

Status CheckZeroOptimizerStage(const TorchArchiveReader& reader, const std::string& tag_dir,
                               bool bf16, std::string_view zero3_refusal) {
  int64_t stage = 0;
  if (const Value* node = OptionalField(reader, "ds_config/zero_optimization/stage")) {
    if (node->kind() == Kind::kInt) stage = node->AsInt64().value_or(0);
  }
  if (stage >= 3) return Status::Unsupported(Prefix(tag_dir) + std::string(zero3_refusal));
  if (stage == 0 && !bf16) {
    return Status::Unsupported(Prefix(reader.path()) +
                               "ds_config: no ZeRO optimizer (zero_optimization.stage 0 without "
                               "bf16 keeps the optimizer in the model states); not supported");
  }
  return Status::Ok();
}

Status RefuseExpertParallel(const Topology& target) {
  if (target.ep <= 1) return Status::Ok();
  return Status::Unsupported("deepspeed: ep=" + std::to_string(target.ep) +
                             ": the tag has no experts (an expert-parallel size applies to "
                             "DeepSpeed-MoE tags only)");
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

Result<Partitioning> Partition(uint64_t total, uint32_t dp) {
  Partitioning p;
  p.ranks = dp;
  const uint64_t alignment = kAlignmentFactor * dp;
  const uint64_t remainder = total % alignment;
  p.padding = remainder == 0 ? 0 : alignment - remainder;
  const std::optional<uint64_t> padded = CheckedAdd(total, p.padding);
  if (!padded) {
    return Status::OutOfRange("deepspeed: flat buffer of " + std::to_string(total) +
                              " elements: too large");
  }
  p.padded = *padded;
  p.partition = p.padded / dp;
  return p;
}

Result<Partitioning> SavablePartition(uint64_t total, uint32_t dp, std::string_view what) {
  UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(total, dp));
  if (p.padding > p.partition) {
    return Status::Unsupported("deepspeed: dp=" + std::to_string(dp) + ": " + std::string(what) +
                               " of " + std::to_string(total) +
                               " elements leaves whole ranks empty (DeepSpeed cannot save it)");
  }
  return p;
}

std::vector<Piece> Pieces(const GroupLayout& layout, size_t k, const Partitioning& p) {
  std::vector<Piece> out;
  const uint64_t off = layout.offsets[k];
  const uint64_t end = off + layout.numels[k];
  for (uint32_t r = 0; r < p.ranks; ++r) {
    const uint64_t lo = std::max(off, p.begin(r));
    const uint64_t hi = std::min(end, p.begin(r) + p.partition);
    if (lo < hi) out.push_back({r, lo - off, hi - off, lo - p.begin(r)});
  }
  return out;
}

PlannedRankPart PlanRankPart(const Partitioning& p, uint32_t i, uint64_t total, bool elastic,
                             bool bf16_optimizer) {
  PlannedRankPart part;
  part.begin = p.begin(i);
  part.real_end = std::min(part.begin + p.partition, total);
  const uint64_t padding = p.padding_of(i);
  part.sizes.partition = p.partition;
  part.sizes.state_numel = StateNumel(elastic, p.partition, padding);
  part.sizes.fp32_numel = bf16_optimizer ? p.partition : p.partition - padding;
  part.sizes.tail = part.begin + p.partition - std::max(part.begin, part.real_end);
  return part;
}

std::vector<size_t> RoundRobinOrder(size_t n, uint32_t parts) {
  std::vector<size_t> order;
  order.reserve(n);
  for (size_t j = 0; j < std::min<size_t>(parts, n); ++j) {
    for (size_t i = j; i < n; i += parts) order.push_back(i);
  }
  return order;
}

std::vector<size_t> OptimizerOrder(size_t n, bool round_robin, uint32_t dp) {
  std::vector<size_t> original(n);
  if (!round_robin) {
    for (size_t i = 0; i < n; ++i) original[i] = i;
    return original;
  }
  const std::vector<size_t> order = RoundRobinOrder(n, dp);
  for (size_t position = 0; position < n; ++position) original[order[position]] = position;
  return original;
}

std::vector<SliceMapping> ExpectedMappings(const GroupLayout& layout, const Partitioning& p,
                                           uint32_t r, bool round_robin) {
  std::vector<SliceMapping> out;
  const uint64_t begin = p.begin(r);
  const uint64_t end = begin + p.partition;
  uint64_t offset = 0;
  for (const size_t k : OptimizerOrder(layout.names.size(), round_robin, p.ranks)) {
    const uint64_t lo = std::max(offset, begin);
    const uint64_t hi = std::min(offset + layout.numels[k], end);
    if (lo < hi) out.push_back({layout.names[k], hi - lo, lo - begin});
    offset += layout.numels[k];
  }
  return out;
}

Result<std::vector<SliceMapping>> ReadMappings(const TorchArchiveReader& reader,
                                               const std::string& field) {
  UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, field));
  std::vector<SliceMapping> out;
  for (const auto& [name, address] : NamedChildren(node)) {
    int64_t numel = -1;
    int64_t start = -1;
    for (const auto& [attr, value] : NamedChildren(address)) {
      if (value->kind() != Kind::kInt) continue;
      if (attr == "numel") numel = value->AsInt64().value_or(-1);
      if (attr == "start") start = value->AsInt64().value_or(-1);
    }
    if (numel < 0 || start < 0) {
      return FieldError(reader, field + "/" + name, "not a fragment_address(numel, start)");
    }
    out.push_back({name, static_cast<uint64_t>(numel), static_cast<uint64_t>(start)});
  }
  return out;
}

Value* MappingsNode(pickle::Graph& graph, const std::vector<SliceMapping>& mappings) {
  Value* dict = graph.Object(pickle::Construction::kReduce,
                             graph.Global("collections", "OrderedDict"), graph.Tuple({}));
  Value* cls = graph.Global("deepspeed.utils.tensor_fragment", "fragment_address");
  for (const SliceMapping& m : mappings) {
    Value* address = graph.Object(pickle::Construction::kNewObj, cls, graph.Tuple({}));
    Value* state = graph.Dict({{graph.Str("numel"), graph.Int(static_cast<int64_t>(m.numel))},
                               {graph.Str("start"), graph.Int(static_cast<int64_t>(m.start))}});
    address->mutable_mutations().push_back({pickle::Mutation::Op::kBuild, state, nullptr});
    dict->mutable_mutations().push_back(
        {pickle::Mutation::Op::kSetItem, graph.Str(m.name), address});
  }
  return dict;
}

Result<std::vector<Segment>> FlatSegments(const AtomIndex& index, const GroupLayout& layout,
                                          std::string_view state, uint64_t begin, uint64_t end) {
  std::vector<Segment> segments;
  for (size_t k = 0; k < layout.names.size(); ++k) {
    const uint64_t off = layout.offsets[k];
    const uint64_t lo = std::max(off, begin);
    const uint64_t hi = std::min(off + layout.numels[k], end);
    if (lo >= hi) continue;
    const Atom* atom = index.Find(layout.names[k], state);
    if (atom == nullptr) {
      return Status::Corrupt("deepspeed: index: no atom " + layout.names[k] + "/" +
                             std::string(state));
    }
    UCP_ASSIGN_OR_RETURN(const Region region, Region::Flat(lo - off, hi - off, atom->shape));
    UCP_ASSIGN_OR_RETURN(const std::vector<Segment> more, PlanRegion(index, *atom, region));
    AppendSegments(segments, more);
  }
  return segments;
}

namespace {

// Adds to `atom` (shape atom.shape) the fragments of flat state parameter k of `layout`: the
// intersection of its range with every rank's partition of `p`, at the byte of that rank's
// tensor (`tensor_of(rank)`, in index file ranks[r].file) where it starts.
Status AddPartitionFragments(
    Atom& atom, const GroupLayout& layout, size_t k, const Partitioning& p,
    const std::vector<RankPartition>& ranks,
    const std::function<const TorchTensor*(const RankPartition&)>& tensor_of) {
  const uint64_t off = layout.offsets[k];
  const uint64_t end = off + layout.numels[k];
  for (uint32_t r = 0; r < p.ranks; ++r) {
    const uint64_t lo = std::max(off, p.begin(r));
    const uint64_t hi = std::min(end, p.begin(r) + p.partition);
    if (lo >= hi) continue;
    const TorchTensor* tensor = tensor_of(ranks[r]);
    UCP_ASSIGN_OR_RETURN(Region region, Region::Flat(lo - off, hi - off, atom.shape));
    const std::optional<uint64_t> byte = CheckedMul(lo - p.begin(r), ItemSize(tensor->dtype));
    const std::optional<uint64_t> offset =
        byte ? CheckedAdd(tensor->file_offset(), *byte) : std::nullopt;
    if (!offset) {
      return Status::OutOfRange("deepspeed: " + atom.param + "/" + atom.state +
                                ": offset overflow");
    }
    atom.fragments.push_back({ranks[r].file, *offset, tensor->dtype, std::move(region)});
  }
  return Status::Ok();
}

}  // namespace

Status AddParameterAtoms(std::vector<Atom>& atoms, const GroupLayout& layout, size_t k,
                         const Partitioning& p, const std::vector<RankPartition>& ranks) {
  const std::string& name = layout.names[k];
  const RankPartition& first = ranks.front();
  Atom fp32{name, "fp32", first.fp32->dtype, layout.shapes[k], {}};
  UCP_RETURN_IF_ERROR(AddPartitionFragments(fp32, layout, k, p, ranks,
                                            [](const RankPartition& rank) { return rank.fp32; }));
  atoms.push_back(std::move(fp32));
  for (size_t s = 0; s < first.states->size(); ++s) {
    const StateTensor& st = (*first.states)[s];
    Atom atom{name, st.key, st.tensor->dtype, {}, {}};
    if (st.tensor->shape.empty()) {
      // ds_to_universal's step.pt: the 0-d state of the first rank holding the parameter.
      const uint32_t r =
          std::min(static_cast<uint32_t>(layout.offsets[k] / p.partition), p.ranks - 1);
      const TorchTensor* tensor = (*ranks[r].states)[s].tensor;
      UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(atom.shape));
      atom.fragments.push_back(
          {ranks[r].file, tensor->file_offset(), tensor->dtype, std::move(whole)});
    } else {
      atom.shape = layout.shapes[k];
      UCP_RETURN_IF_ERROR(AddPartitionFragments(
          atom, layout, k, p, ranks,
          [s](const RankPartition& rank) { return (*rank.states)[s].tensor; }));
    }
    atoms.push_back(std::move(atom));
  }
  return Status::Ok();
}

// Storages that are not such a buffer (no module view of the group, another element count, a
// round-robin order that moves the views) are carried unchanged.
Status ResizeModuleBuffers(pickle::Graph& graph, const TorchArchiveReader& reader, uint32_t file,
                           const std::vector<GroupLayout>& source_layouts, uint32_t source_dp,
                           uint32_t target_dp,
                           std::map<std::string, std::vector<Segment>>& replaced) {
  std::map<std::string, uint64_t> new_numel;
  for (const GroupLayout& layout : source_layouts) {
    if (layout.names.empty()) continue;
    auto found = reader.Find("module/" + layout.names.front());
    if (!found.ok()) continue;
    const TorchTensor* view = reader.TensorAt(*found);
    if (view == nullptr) continue;
    const TorchStorage& storage = *view->storage;
    UCP_ASSIGN_OR_RETURN(const Partitioning source, Partition(layout.total, source_dp));
    UCP_ASSIGN_OR_RETURN(const Partitioning target, Partition(layout.total, target_dp));
    if (storage.numel != source.padded || target.padded == source.padded) continue;
    const uint64_t item = ItemSize(storage.dtype);
    std::vector<Segment> segments = {
        Segment{file, storage.offset, std::min(source.padded, target.padded) * item}};
    if (target.padded > source.padded)
      AppendZeros(segments, (target.padded - source.padded) * item);
    replaced[storage.key] = std::move(segments);
    new_numel[storage.key] = target.padded;
  }
  if (new_numel.empty()) return Status::Ok();
  return pickle::ForEachReachable(graph.root(), [&](Value* node) -> Status {
    const Value* pid = PidTuple(node);
    if (pid == nullptr) return Status::Ok();
    const auto it = new_numel.find(pid->Item(2)->data());
    if (it != new_numel.end()) {
      node->pid()->mutable_items()[4] = graph.Int(static_cast<int64_t>(it->second));
    }
    return Status::Ok();
  });
}

Result<std::vector<const RankFile*>> OptimFilesByRank(const std::string& tag_dir,
                                                      const TagListing& listing, uint32_t dp,
                                                      const std::string& model, uint32_t mp,
                                                      uint32_t mp_ranks) {
  if (listing.optim.empty()) {
    return Status::NotFound(Prefix(tag_dir) + "no zero_pp_rank_*_optim_states.pt files");
  }
  const std::string& prefix = listing.optim.front().prefix;
  std::vector<const RankFile*> by_rank(dp, nullptr);
  for (const RankFile& entry : listing.optim) {
    if (entry.mp >= mp_ranks && mp_ranks > 1) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "mp rank " +
                             std::to_string(entry.mp) + " >= mp_world_size " +
                             std::to_string(mp_ranks) + " of " + model +
                             " (a file of another save)");
    }
    if (entry.mp >= mp_ranks) {
      return Status::Unsupported(Prefix(tag_dir) + "tp=" + std::to_string(entry.mp + 1) +
                                 ": a tensor-parallel tag (the deepspeed-tp adapter reads it)");
    }
    if (entry.mp != mp) continue;
    if (entry.prefix != prefix) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "name: prefix \"" + entry.prefix +
                             "\", but " + listing.optim.front().name + " has \"" + prefix +
                             "\" (files of two saves)");
    }
    if (entry.dp >= dp) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "dp rank " +
                             std::to_string(entry.dp) + " >= dp_world_size " + std::to_string(dp) +
                             " of " + model + " (a file of another save)");
    }
    by_rank[entry.dp] = &entry;
  }
  for (uint32_t r = 0; r < dp; ++r) {
    if (by_rank[r] == nullptr) {
      return Status::NotFound(Prefix(tag_dir + "/" + OptimName(prefix, r, mp)) +
                              "not found (dp_world_size " + std::to_string(dp) + " in " + model +
                              ")");
    }
  }
  return by_rank;
}

Result<ModelStates> ReadModelStates(const std::string& tag_dir, const std::string& name) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader, TorchArchiveReader::Open(tag_dir + "/" + name));
  ModelStates ms{name, std::move(reader), {}, 0, {}, std::nullopt, false};
  const TorchArchiveReader& r = ms.reader;
  UCP_ASSIGN_OR_RETURN(ms.ds_version, StrField(r, "ds_version"));
  UCP_ASSIGN_OR_RETURN(ms.dp, DpWorldSize(r));
  UCP_ASSIGN_OR_RETURN(const Value* shapes, Field(r, "param_shapes"));
  const Value* optimizer = OptionalField(r, "optimizer");
  if (shapes->kind() == Kind::kNone && optimizer != nullptr && optimizer->kind() == Kind::kDict) {
    // DeepSpeed 0.19's engine writes param_shapes only when zero_optimization() holds; bf16 at
    // ZeRO stage 0 (its BF16 optimizer) saves DP rank 0's optimizer state here instead, which
    // 0.19.8's own load indexes by DP rank as a list (BF16_Optimizer._load_legacy_checkpoint:
    // KeyError 0, seen at pp2dp2 on CPU), so no DeepSpeed resume of it exists to serve.
    return Status::Unsupported(
        Prefix(r.path()) +
        "param_shapes None, the optimizer state in the model states: a BF16 optimizer run at "
        "ZeRO stage 0 saved by a DeepSpeed that records no parameter shapes for it (0.19); "
        "DeepSpeed resumes such a tag neither by its plain load (KeyError in "
        "BF16_Optimizer._load_legacy_checkpoint) nor through ds_to_universal (which fails on "
        "it); not supported");
  }
  if (shapes->kind() != Kind::kList || shapes->items().empty()) {
    return FieldError(r, "param_shapes", "not a non-empty list of parameter groups");
  }
  for (size_t g = 0; g < shapes->items().size(); ++g) {
    std::vector<std::string> names;
    std::vector<Shape> dims;
    const std::string field = "param_shapes/" + std::to_string(g);
    for (const auto& [key, value] : NamedChildren(shapes->items()[g])) {
      std::optional<Shape> shape = ShapeOf(value);
      if (!shape) return FieldError(r, field + "/" + key, "not a torch.Size");
      names.push_back(key);
      dims.push_back(std::move(*shape));
    }
    if (names.empty()) return FieldError(r, field, "no parameters");
    Result<GroupLayout> layout = MakeLayout(std::move(names), std::move(dims));
    if (!layout.ok()) return FieldError(r, field, layout.status().message());
    ms.groups.push_back(std::move(*layout));
  }
  if (const Value* stage = OptionalField(r, "ds_config/zero_optimization/stage")) {
    if (stage->kind() == Kind::kInt) ms.config_stage = stage->AsInt64();
  }
  if (const Value* rr = OptionalField(r, "ds_config/zero_optimization/round_robin_gradients")) {
    ms.round_robin = rr->kind() == Kind::kBool && rr->bool_value();
  }
  return ms;
}

Result<OptimStates> ReadOptimStates(const std::string& tag_dir, const RankFile& entry,
                                    size_t groups, std::string_view zero3) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader,
                       TorchArchiveReader::Open(tag_dir + "/" + entry.name));
  OptimStates os{entry, std::move(reader), false, std::nullopt, {}, {}, {}, {}};
  const TorchArchiveReader& r = os.reader;
  const std::string osd(kOsd);
  if (const Value* stage = OptionalField(r, osd + "/zero_stage")) {
    os.zero_stage = ZeroStageOf(stage);
    if (!os.zero_stage) return FieldError(r, osd + "/zero_stage", "not a ZeroStageEnum");
    if (*os.zero_stage >= 3) return Status::Unsupported(Prefix(r.path()) + std::string(zero3));
  }
  os.bf16_optimizer = OptionalField(r, osd + "/loss_scaler") == nullptr;
  UCP_ASSIGN_OR_RETURN(os.ds_version, StrField(r, osd + "/ds_version"));
  UCP_ASSIGN_OR_RETURN(os.partition_count, IntListField(r, osd + "/partition_count"));
  UCP_ASSIGN_OR_RETURN(os.group_paddings, IntListField(r, osd + "/group_paddings"));
  UCP_RETURN_IF_ERROR(CheckNoParameterAlignment(r, groups));
  UCP_ASSIGN_OR_RETURN(const Value* base, Field(r, osd + "/base_optimizer_state"));
  os.elastic = base->kind() == Kind::kList;
  if (os.elastic && base->items().size() != groups) {
    return FieldError(r, osd + "/base_optimizer_state",
                      "an elastic list of " + std::to_string(base->items().size()) +
                          " group states, but param_shapes has " + std::to_string(groups));
  }
  if (!os.elastic) {
    const Value* state = base->Get("state");
    if (base->kind() != Kind::kDict || state == nullptr || state->kind() != Kind::kDict) {
      return FieldError(r, osd + "/base_optimizer_state",
                        "neither a torch optimizer state_dict nor an elastic checkpoint's list "
                        "of group states");
    }
  }
  for (size_t g = 0; g < groups; ++g) {
    OptimGroup group;
    const std::string gs = std::to_string(g);
    UCP_ASSIGN_OR_RETURN(const Value* states, Field(r, GroupStatesField(os.elastic, g)));
    if (states->kind() != Kind::kDict) {
      return FieldError(r, GroupStatesField(os.elastic, g), "not a dict of states");
    }
    for (const auto& [key, value] : NamedChildren(states)) {
      const TorchTensor* tensor = r.TensorAt(value);
      if (tensor != nullptr) group.states.push_back({key, tensor});
    }
    UCP_ASSIGN_OR_RETURN(const Value* fp32,
                         Field(r, osd + "/single_partition_of_fp32_groups/" + gs));
    group.fp32 = r.TensorAt(fp32);
    if (group.fp32 == nullptr) {
      return FieldError(r, osd + "/single_partition_of_fp32_groups/" + gs, "not a tensor");
    }
    UCP_ASSIGN_OR_RETURN(group.mappings, ReadMappings(r, osd + "/param_slice_mappings/" + gs));
    if (!os.elastic) {
      UCP_ASSIGN_OR_RETURN(group.param_group,
                           Field(r, osd + "/base_optimizer_state/param_groups/" + gs));
    }
    os.groups.push_back(std::move(group));
  }
  return os;
}

Status RefuseElasticForm(const TorchArchiveReader& reader, std::string_view layouts) {
  const Value* base = OptionalField(reader, std::string(kOsd) + "/base_optimizer_state");
  if (base == nullptr || base->kind() != Kind::kList) return Status::Ok();
  return Status::Unsupported(Prefix(reader.path()) + std::string(kOsd) +
                             "/base_optimizer_state: an elastic checkpoint "
                             "(zero_optimization.elastic_checkpoint); for " +
                             std::string(layouts) + " ucp reads only the rigid form");
}

std::string GroupStatesField(bool elastic, size_t g) {
  return std::string(kOsd) + (elastic ? "/base_optimizer_state/" : "/base_optimizer_state/state/") +
         std::to_string(g);
}

uint64_t StateNumel(bool elastic, uint64_t partition, uint64_t padding) {
  return elastic ? partition - padding : partition;
}

void OrderStatesAs(std::vector<StateTensor>& states, const std::vector<StateTensor>& reference) {
  if (states.size() != reference.size()) return;
  std::vector<StateTensor> ordered;
  for (const StateTensor& want : reference) {
    const auto it = std::find_if(states.begin(), states.end(),
                                 [&](const StateTensor& st) { return st.key == want.key; });
    if (it == states.end()) return;
    ordered.push_back(*it);
  }
  states = std::move(ordered);
}

void OrderStatesAs(OptimStates& os, const OptimStates& first) {
  for (size_t g = 0; g < os.groups.size() && g < first.groups.size(); ++g) {
    OrderStatesAs(os.groups[g].states, first.groups[g].states);
  }
}

Status CheckOptimStates(const OptimStates& os, const ModelStates& ms, const OptimStates& first) {
  const TorchArchiveReader& r = os.reader;
  const std::string osd(kOsd);
  const size_t groups = ms.groups.size();
  if (os.ds_version != ms.ds_version) {
    return FieldError(r, osd + "/ds_version",
                      "\"" + os.ds_version + "\", but " + ms.name + " has \"" + ms.ds_version +
                          "\" (a file of another save)");
  }
  if (os.partition_count != std::vector<int64_t>(groups, ms.dp)) {
    return FieldError(r, osd + "/partition_count",
                      ListText(os.partition_count) + ", but " + ms.name + " has dp_world_size " +
                          std::to_string(ms.dp) + " and " + std::to_string(groups) +
                          " parameter group(s) (a file of another save)");
  }
  std::vector<GroupExpectation> expectations;
  for (const GroupLayout& layout : ms.groups) {
    UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(layout.total, ms.dp));
    expectations.push_back({&layout, p, os.entry.dp});
  }
  return CheckOptimGroups(os, first, expectations, ms.round_robin, "param_shapes in " + ms.name);
}

Status CheckOptimGroups(const OptimStates& os, const OptimStates& first,
                        const std::vector<GroupExpectation>& groups, bool round_robin,
                        const std::string& source) {
  const TorchArchiveReader& r = os.reader;
  const std::string osd(kOsd);
  if (os.zero_stage != first.zero_stage || os.bf16_optimizer != first.bf16_optimizer) {
    return FieldError(r, osd + "/zero_stage",
                      "differs from " + first.entry.name + " (a file of another save)");
  }
  if (os.elastic != first.elastic) {
    return FieldError(r, osd + "/base_optimizer_state",
                      std::string(os.elastic ? "elastic" : "rigid") + ", but " + first.entry.name +
                          "'s is " + (first.elastic ? "elastic" : "rigid") +
                          " (a file of another save)");
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string gs = std::to_string(g);
    const GroupLayout& layout = *groups[g].layout;
    const Partitioning& p = groups[g].partitioning;
    const uint64_t padding = p.padding_of(groups[g].rank);
    if (os.group_paddings.size() != groups.size() ||
        static_cast<uint64_t>(os.group_paddings[g]) != padding) {
      return FieldError(r, osd + "/group_paddings",
                        ListText(os.group_paddings) + ", expected " + std::to_string(padding) +
                            " for group " + gs + " from " + source);
    }
    const OptimGroup& group = os.groups[g];
    const uint64_t fp32_numel = os.bf16_optimizer ? p.partition : p.partition - padding;
    if (group.fp32->shape.size() != 1 || group.fp32->numel() != fp32_numel ||
        !group.fp32->contiguous()) {
      return FieldError(r, osd + "/single_partition_of_fp32_groups/" + gs,
                        "shape " + ShapeText(group.fp32->shape) + ", expected [" +
                            std::to_string(fp32_numel) + "] from " + source);
    }
    if (group.states.size() != first.groups[g].states.size()) {
      return FieldError(r, GroupStatesField(os.elastic, g),
                        "other state keys than " + first.entry.name);
    }
    // An elastic file's last ranks leave their padding out, so its partitions differ in length.
    const uint64_t state_numel = StateNumel(os.elastic, p.partition, padding);
    for (size_t k = 0; k < group.states.size(); ++k) {
      const StateTensor& st = group.states[k];
      const std::string field = GroupStatesField(os.elastic, g) + "/" + st.key;
      const StateTensor& reference = first.groups[g].states[k];
      if (st.key != reference.key || st.tensor->shape.empty() != reference.tensor->shape.empty() ||
          st.tensor->dtype != reference.tensor->dtype) {
        return FieldError(r, field, "differs in name, shape or dtype from " + first.entry.name);
      }
      if (!st.tensor->contiguous()) return FieldError(r, field, "not contiguous");
      const bool scalar = st.tensor->shape.empty();
      const bool partition = st.tensor->shape.size() == 1 && st.tensor->numel() == state_numel;
      if (!scalar && !partition) {
        return Status::Unsupported(
            Prefix(r.path()) + field + ": shape " + ShapeText(st.tensor->shape) +
            " is neither 0-d nor the partition [" + std::to_string(state_numel) + "]");
      }
    }
    const std::vector<SliceMapping> expected =
        ExpectedMappings(layout, p, groups[g].rank, round_robin);
    const std::string field = osd + "/param_slice_mappings/" + gs;
    for (size_t i = 0; i < std::max(expected.size(), group.mappings.size()); ++i) {
      if (i < expected.size() && i < group.mappings.size() && expected[i] == group.mappings[i]) {
        continue;
      }
      if (i >= group.mappings.size()) {
        return FieldError(
            r, field,
            "no entry for " + expected[i].name + ", which " + source + " places in this partition");
      }
      const SliceMapping& got = group.mappings[i];
      std::string want = "nothing";
      if (i < expected.size()) {
        want = expected[i].name + " numel " + std::to_string(expected[i].numel) + " start " +
               std::to_string(expected[i].start);
      }
      return FieldError(r, field + "/" + got.name,
                        "numel " + std::to_string(got.numel) + " start " +
                            std::to_string(got.start) + ", but " + source + " gives " + want);
    }
  }
  return Status::Ok();
}

ParamGroup GroupSettings(const Value* param_group, const TorchArchiveReader& reader,
                         const std::vector<StateTensor>& states) {
  ParamGroup group;
  if (param_group != nullptr) {
    for (const auto& [key, value] : NamedChildren(param_group)) {
      if (key != "params") group.hyperparameters[key] = JsonOf(value);
    }
  }
  for (const StateTensor& st : states) {
    if (!st.tensor->shape.empty()) continue;
    if (std::optional<nlohmann::json> value = ScalarValue(reader, *st.tensor)) {
      group.scalars[st.key] = *value;
    }
  }
  return group;
}

Result<GroupLayout> IndexedLayout(const AtomIndex& index, const std::vector<std::string>& names) {
  std::vector<Shape> shapes;
  for (const std::string& name : names) {
    const Atom* atom = index.Find(name, "fp32");
    if (atom == nullptr) return Status::Corrupt("deepspeed: index: no fp32 atom of " + name);
    shapes.push_back(atom->shape);
  }
  return MakeLayout(names, std::move(shapes));
}

Result<Value*> ImportOptimizerStateDict(const TorchArchiveReader& reader, ArchiveOutput& out) {
  out.path = "zero/optimizer_state.pt";
  const Value* template_dict = reader.root()->Get(kOsd);
  if (template_dict == nullptr || template_dict->kind() != Kind::kDict) {
    return FieldError(reader, kOsd, "missing");
  }
  return out.graph.Import(template_dict);
}

Result<ArchiveOutput> UniversalOptimizerState(const TorchArchiveReader& reader, uint32_t file) {
  const std::string osd(kOsd);
  ArchiveOutput out;
  UCP_ASSIGN_OR_RETURN(Value * dict, ImportOptimizerStateDict(reader, out));
  Value* base = dict->Get("base_optimizer_state");
  Value* param_groups = base == nullptr ? nullptr : base->Get("param_groups");
  if (param_groups == nullptr) {
    return FieldError(reader, osd + "/base_optimizer_state/param_groups", "missing");
  }
  std::vector<std::pair<Value*, Value*>> entries;
  for (const auto& [key, value] : dict->entries()) {
    const std::string name = KeyText(key);
    if (name == "base_optimizer_state" || name == "single_partition_of_fp32_groups" ||
        name == "param_slice_mappings") {
      continue;
    }
    entries.emplace_back(key, value);
  }
  entries.emplace_back(out.graph.Str("param_groups"), param_groups);
  out.graph.set_root(out.graph.Dict(std::move(entries)));
  UCP_ASSIGN_OR_RETURN(out.storages, CollectStorages(out.graph.root(), reader, file, {}));
  return out;
}

// Stage boundaries (num_parts + 1 entries) of partition_uniform.
std::vector<uint64_t> PartitionUniform(uint64_t items, uint64_t parts) {
  std::vector<uint64_t> bounds(parts + 1);
  if (items <= parts) {
    for (uint64_t p = 0; p <= parts; ++p) bounds[p] = std::min(p, items);
    return bounds;
  }
  const uint64_t chunk = items / parts;
  const uint64_t residual = items - chunk * parts;
  for (uint64_t p = 0; p <= parts; ++p) bounds[p] = p * chunk + std::min(p, residual);
  return bounds;
}

// partition_balanced: DeepSpeed's dynamic program minimising max - min of the parts' sums, in
// float64 with its tie-breaking (the last split of equal cost wins).
std::vector<uint64_t> PartitionBalanced(const std::vector<uint64_t>& weights, uint64_t parts) {
  const size_t n = weights.size();
  const size_t m = parts;
  if (n <= m) return PartitionUniform(n, m);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto at = [m](size_t i, size_t j) { return i * (m + 1) + j; };
  std::vector<double> dp_max((n + 1) * (m + 1), kInf);
  std::vector<double> dp_min((n + 1) * (m + 1), kInf);
  std::vector<double> dp_cost((n + 1) * (m + 1), kInf);
  std::vector<size_t> position((n + 1) * (m + 1), 0);
  std::vector<double> prefix(n + 1, 0.0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(weights[i]);
  dp_max[at(0, 0)] = 0;
  dp_cost[at(0, 0)] = 0;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= std::min(i, m); ++j) {
      for (size_t k = 0; k < i; ++k) {
        const double max_sum = std::max(dp_max[at(k, j - 1)], prefix[i] - prefix[k]);
        const double min_sum = std::min(dp_min[at(k, j - 1)], prefix[i] - prefix[k]);
        const double cost = max_sum - min_sum;
        if (dp_cost[at(i, j)] >= cost) {
          dp_cost[at(i, j)] = cost;
          dp_max[at(i, j)] = max_sum;
          dp_min[at(i, j)] = min_sum;
          position[at(i, j)] = k;
        }
      }
    }
  }
  std::vector<uint64_t> bounds = {n};
  for (size_t i = m; i >= 1; --i) bounds.push_back(position[at(bounds.back(), i)]);
  std::reverse(bounds.begin(), bounds.end());
  return bounds;
}

std::string BoundsText(const std::vector<uint64_t>& bounds) {
  std::vector<int64_t> values(bounds.begin(), bounds.end());
  return ListText(values);
}

uint32_t StageOfLayer(const std::vector<uint64_t>& bounds, uint64_t layer) {
  uint32_t s = 0;
  while (s + 2 < bounds.size() && layer >= bounds[s + 1]) ++s;
  return s;
}

std::vector<PartitionMethod> TypeMethods(const std::map<uint64_t, std::string>& signature,
                                         uint64_t count) {
  std::map<std::string, std::vector<uint64_t>> kinds;
  for (const auto& [layer, text] : signature) {
    std::vector<uint64_t>& weights = kinds[text];
    weights.resize(count, 0);
    weights[layer] = 1;
  }
  std::vector<PartitionMethod> methods;
  for (auto& [text, weights] : kinds) {
    if (std::count(weights.begin(), weights.end(), uint64_t{1}) < 2) continue;
    uint64_t first = 0;
    while (weights[first] == 0) ++first;
    methods.push_back({LayerPartition::kType,
                       "'type:' (the kind of layer " + std::to_string(first) + ")", weights,
                       weights});
  }
  return methods;
}

Result<ChosenPartition> ChoosePartition(uint64_t count,
                                        const std::map<uint64_t, uint32_t>& source_stage,
                                        const std::vector<PartitionMethod>& methods,
                                        uint32_t source_pp, uint32_t pp, LayerPartition told) {
  const auto bounds_of = [count](const std::vector<uint64_t>& weights, uint64_t parts) {
    return weights.empty() ? PartitionUniform(count, parts) : PartitionBalanced(weights, parts);
  };
  const auto stages_by = [&source_stage](const std::vector<uint64_t>& bounds) {
    std::vector<uint32_t> stages;
    for (const auto& [layer, source] : source_stage) stages.push_back(StageOfLayer(bounds, layer));
    return stages;
  };
  std::vector<uint32_t> source;
  for (const auto& [layer, s] : source_stage) source.push_back(s);
  const std::string what = "deepspeed: pp=" + std::to_string(pp) + ": ";
  const std::string told_text = told == LayerPartition::kInferred
                                    ? std::string()
                                    : "partition=" + std::string(LayerPartitionName(told));
  std::optional<ChosenPartition> chosen;
  std::string tried;
  for (const PartitionMethod& method : methods) {
    if (told != LayerPartition::kInferred && method.kind != told) continue;
    const std::vector<uint64_t> at_source = bounds_of(method.source_weights, source_pp);
    tried += (tried.empty() ? "" : ", ") + method.name + " " + BoundsText(at_source);
    if (stages_by(at_source) != source) continue;
    std::vector<uint64_t> at_target = bounds_of(method.target_weights, pp);
    if (chosen && stages_by(chosen->bounds) != stages_by(at_target)) {
      return Status::Unsupported(
          what + "ambiguous layer placement: " + chosen->method + " " + BoundsText(chosen->bounds) +
          " and " + method.name + " " + BoundsText(at_target) +
          " both give the saved stages at pp=" + std::to_string(source_pp) + " but differ here" +
          (told_text.empty() ? "; name the trainer's partition_method in the target with "
                               "partition=uniform, parameters or type"
                             : " (" + told_text + ": kinds of layer that repeat disagree)"));
    }
    if (!chosen) chosen = ChosenPartition{std::move(at_target), method.name};
  }
  if (!chosen && !told_text.empty()) {
    return Status::Unsupported(
        what + told_text + " does not give the saved stages at pp=" + std::to_string(source_pp) +
        " over " + std::to_string(count) + " layers (" +
        (tried.empty() ? "no kind of layer repeats" : tried) + ")");
  }
  if (!chosen) {
    return Status::Unsupported(what +
                               "no partition method DeepSpeed has gives the saved stages "
                               "at pp=" +
                               std::to_string(source_pp) + " over " + std::to_string(count) +
                               " layers (" + tried +
                               "); a custom partition is in no file, so its placement at another "
                               "pp is unknown");
  }
  return *std::move(chosen);
}

Value* GroupStatesNode(Value* optimizer_state_dict, bool elastic, size_t g) {
  Value* base =
      optimizer_state_dict == nullptr ? nullptr : optimizer_state_dict->Get("base_optimizer_state");
  if (base == nullptr) return nullptr;
  if (elastic) return base->kind() == Kind::kList ? base->Item(g) : nullptr;
  Value* all = base->Get("state");
  if (all == nullptr || all->kind() != Kind::kDict) return nullptr;
  for (auto& [key, value] : all->mutable_entries()) {
    if (KeyText(key) == std::to_string(g)) return value;
  }
  return nullptr;
}

Result<Value*> PlanGroupPartitions(
    pickle::Graph& graph, Value* dict, const TorchArchiveReader& reader, size_t g, bool elastic,
    const GroupPartition& sizes,
    const std::function<Result<std::vector<Segment>>(const std::string& state)>& segments_of,
    std::map<std::string, std::vector<Segment>>& replaced) {
  const std::string field = GroupStatesField(elastic, g);
  UCP_ASSIGN_OR_RETURN(const Value* template_states, Field(reader, field));
  Value* states = GroupStatesNode(dict, elastic, g);
  if (states == nullptr || states->kind() != Kind::kDict ||
      states->entries().size() != template_states->entries().size()) {
    return FieldError(reader, field, "not a dict of states");
  }
  for (size_t s = 0; s < states->entries().size(); ++s) {
    const TorchTensor* tensor = reader.TensorAt(template_states->entries()[s].second);
    if (tensor == nullptr || tensor->shape.size() != 1) continue;
    if (sizes.template_numel && tensor->numel() != *sizes.template_numel) {
      return FieldError(reader, field + "/" + KeyText(template_states->entries()[s].first),
                        "not a partition of " + std::to_string(*sizes.template_numel));
    }
    const std::string state = KeyText(states->entries()[s].first);
    UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, segments_of(state));
    AppendZeros(segments, sizes.tail * ItemSize(tensor->dtype));
    UCP_ASSIGN_OR_RETURN(states->mutable_entries()[s].second,
                         PartitionTensor(graph, *tensor, sizes.state_numel, sizes.partition));
    replaced[tensor->storage->key] = std::move(segments);
  }
  // single_partition_of_fp32_groups: DeepSpeedZeroOptimizer strips the padding from the tensor
  // but keeps the P-element storage it is a view of.
  const std::string fp32_field =
      std::string(kOsd) + "/single_partition_of_fp32_groups/" + std::to_string(g);
  UCP_ASSIGN_OR_RETURN(const Value* fp32_node, Field(reader, fp32_field));
  const TorchTensor* fp32 = reader.TensorAt(fp32_node);
  if (fp32 == nullptr) return FieldError(reader, fp32_field, "not a tensor");
  UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, segments_of("fp32"));
  AppendZeros(segments, sizes.tail * ItemSize(fp32->dtype));
  UCP_ASSIGN_OR_RETURN(Value * node,
                       PartitionTensor(graph, *fp32, sizes.fp32_numel, sizes.partition));
  replaced[fp32->storage->key] = std::move(segments);
  return node;
}

Result<ArchiveOutput> PlanPartitionedOptimFile(
    const TorchArchiveReader& reader, uint32_t template_file, std::string path, bool elastic,
    size_t groups, const std::function<Result<RankGroupPart>(size_t g)>& group_of,
    const std::vector<uint64_t>& partition_counts,
    const std::function<Status(pickle::Graph& graph, Value* root, Value* dict)>& edit) {
  ArchiveOutput out;
  out.path = std::move(path);
  Value* root = out.graph.Import(reader.root());
  out.graph.set_root(root);
  Value* dict = root->Get(kOsd);
  if (dict == nullptr) return FieldError(reader, std::string(kOsd), "missing");
  std::map<std::string, std::vector<Segment>> replaced;
  std::vector<uint64_t> paddings;
  std::vector<Value*> fp32_items;
  std::vector<Value*> mapping_items;
  std::vector<size_t> params_per_group;
  for (size_t g = 0; g < groups; ++g) {
    UCP_ASSIGN_OR_RETURN(const RankGroupPart group, group_of(g));
    UCP_ASSIGN_OR_RETURN(Value * fp32, PlanGroupPartitions(
                                           out.graph, dict, reader, g, elastic, group.part.sizes,
                                           [&](const std::string& state) {
                                             return group.segments_of(state, group.part.begin,
                                                                      group.part.real_end);
                                           },
                                           replaced));
    fp32_items.push_back(fp32);
    paddings.push_back(group.padding);
    mapping_items.push_back(MappingsNode(out.graph, group.mappings));
    params_per_group.push_back(group.params);
  }
  UCP_RETURN_IF_ERROR(SetPartitionFields(out.graph, dict, std::move(fp32_items), paddings,
                                         partition_counts, std::move(mapping_items),
                                         params_per_group, reader.path()));
  if (edit) UCP_RETURN_IF_ERROR(edit(out.graph, root, dict));
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, reader, template_file, std::move(replaced)));
  return out;
}

Status CollectGroupRequiresGrad(const TorchArchiveReader& reader, size_t g,
                                const std::vector<std::string>& names,
                                std::map<std::string, bool>& out) {
  const std::string osd(kOsd);
  const std::string gs = std::to_string(g);
  return CollectRequiresGrad(reader, osd + "/single_partition_of_fp32_groups/" + gs,
                             osd + "/base_optimizer_state/state/" + gs, names, out);
}

Result<std::string> ReadRange(const std::string& path, uint64_t offset, uint64_t length) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  std::string bytes(length, '\0');
  UCP_RETURN_IF_ERROR(
      file.ReadAt(offset, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}));
  return bytes;
}

Result<bool> TensorsAlike(const std::vector<FileTensor>& copies) {
  if (copies.size() < 2) return true;
  const TorchTensor& first = *copies.front().tensor;
  for (const FileTensor& copy : copies) {
    if (copy.tensor->shape != first.shape || copy.tensor->dtype != first.dtype) return false;
  }
  UCP_ASSIGN_OR_RETURN(const std::string reference,
                       ReadRange(copies.front().path, first.file_offset(), first.byte_size()));
  for (size_t i = 1; i < copies.size(); ++i) {
    const TorchTensor& tensor = *copies[i].tensor;
    UCP_ASSIGN_OR_RETURN(const std::string bytes,
                         ReadRange(copies[i].path, tensor.file_offset(), tensor.byte_size()));
    if (bytes != reference) return false;
  }
  return true;
}

}  // namespace ucp::deepspeed
