#include "core/format/torch_archive_reader.h"

#include <array>
#include <cstring>
#include <string_view>
#include <utility>

#include "core/util/checked.h"

namespace ucp {
namespace {

using pickle::Kind;
using pickle::Value;

constexpr std::string_view kUtils = "torch._utils";
// torch 2.x pickles a plain tensor that carries Python attributes (DeepSpeed's ds_id on ZeRO-3
// flat groups) as _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, (args...), {attrs}).
constexpr std::string_view kTensorModule = "torch._tensor";
constexpr std::string_view kFromType = "_rebuild_from_type_v2";

Status Corrupt(std::string_view path, std::string_view what) {
  return Status::Corrupt("torch archive " + std::string(path) + ": " + std::string(what));
}

Result<uint64_t> NonNegative(std::string_view path, const Value* value, std::string_view what) {
  std::optional<int64_t> number;
  if (value != nullptr && value->kind() == Kind::kInt) number = value->AsInt64();
  if (!number || *number < 0)
    return Corrupt(path, std::string(what) + " is not a non-negative int");
  return static_cast<uint64_t>(*number);
}

Result<std::vector<uint64_t>> IntTuple(std::string_view path, const Value* value,
                                       std::string_view what, uint32_t max_dims) {
  if (value == nullptr || (value->kind() != Kind::kTuple && value->kind() != Kind::kList)) {
    return Corrupt(path, std::string(what) + " is not a tuple");
  }
  if (value->items().size() > max_dims) {
    return Status::OutOfRange("torch archive " + std::string(path) + ": " + std::string(what) +
                              " has more than " + std::to_string(max_dims) + " dimensions");
  }
  std::vector<uint64_t> out;
  for (const Value* item : value->items()) {
    UCP_ASSIGN_OR_RETURN(uint64_t number, NonNegative(path, item, what));
    out.push_back(number);
  }
  return out;
}

bool IsUtilsCall(const Value* node, std::string_view name) {
  return node->kind() == Kind::kObject && node->IsCallOf(kUtils, name);
}

}  // namespace

uint64_t TorchTensor::numel() const {
  uint64_t count = 1;
  for (uint64_t dim : shape) count *= dim;  // bounded by the storage when Open validated it
  return count;
}

uint64_t TorchTensor::byte_size() const { return numel() * ItemSize(dtype); }

uint64_t TorchTensor::file_offset() const {
  return storage->offset + storage_offset * ItemSize(dtype);
}

bool TorchTensor::contiguous() const {
  uint64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expected) return numel() == 0;
    expected *= shape[i];
  }
  return true;
}

Result<TorchArchiveReader> TorchArchiveReader::Open(std::string path, const Limits& limits) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(std::move(path), File::Mode::kRead));
  return Open(std::move(file), limits);
}

Result<TorchArchiveReader> TorchArchiveReader::Open(File file, const Limits& limits) {
  // torch.save(..., _use_new_zipfile_serialization=False) opens the file with its magic number
  // 0x1950a86a20f9469cfc6c pickled at protocol 2. Refused by name, so that a caller waiting for a
  // zip archive still being written does not wait for one that never comes.
  constexpr std::string_view kLegacyMagic(
      "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 14);
  std::array<std::byte, kLegacyMagic.size()> head{};
  UCP_ASSIGN_OR_RETURN(const size_t got, file.ReadSomeAt(0, head));
  if (got == head.size() && std::memcmp(head.data(), kLegacyMagic.data(), head.size()) == 0) {
    return Status::Unsupported("torch archive " + file.path() +
                               ": torch's legacy (non-zip) serialization (torch.save with "
                               "_use_new_zipfile_serialization=False; DeepSpeed's "
                               "checkpoint.checkpoint_serialization: false) is not read");
  }
  UCP_ASSIGN_OR_RETURN(ZipReader zip, ZipReader::Open(std::move(file), limits.zip));
  TorchArchiveReader reader(std::move(zip));
  if (const ZipRecord* byteorder = reader.zip_.Find("byteorder")) {
    UCP_ASSIGN_OR_RETURN(std::string order, reader.zip_.ReadRecord(*byteorder, 64));
    if (order != "little") {
      return Status::Unsupported("torch archive " + reader.path() + ": byteorder \"" + order +
                                 "\" (only little-endian archives are supported)");
    }
  }
  UCP_ASSIGN_OR_RETURN(const ZipRecord* data_pkl, reader.zip_.Get("data.pkl"));
  UCP_ASSIGN_OR_RETURN(std::string pickle_bytes,
                       reader.zip_.ReadRecord(*data_pkl, limits.max_pickle_bytes));
  pickle::ReadOptions options;
  options.name = reader.path() + ":" + data_pkl->name;
  options.limits = limits.pickle;
  UCP_ASSIGN_OR_RETURN(reader.graph_, pickle::ReadPickle(pickle_bytes, options));
  UCP_RETURN_IF_ERROR(reader.Locate(limits));
  return reader;
}

Result<const TorchStorage*> TorchArchiveReader::StorageOf(const Value* pid_node) {
  const Value* pid = pid_node->pid();
  if (pid == nullptr || pid->kind() != Kind::kTuple || pid->items().size() != 5 ||
      pid->Item(0)->kind() != Kind::kStr || pid->Item(0)->data() != "storage" ||
      pid->Item(1)->kind() != Kind::kGlobal || pid->Item(2)->kind() != Kind::kStr ||
      pid->Item(3)->kind() != Kind::kStr) {
    return Corrupt(path(), "persistent id is not ('storage', type, key, location, numel)");
  }
  const Value* type = pid->Item(1);
  std::optional<DType> dtype;
  if (type->module() == "torch") dtype = StorageElementType(type->name());
  if (!dtype) {
    return Status::Unsupported("torch archive " + path() + ": storage type " + type->module() +
                               "." + type->name());
  }
  const std::string& key = pid->Item(2)->data();
  UCP_ASSIGN_OR_RETURN(uint64_t numel, NonNegative(path(), pid->Item(4), "storage numel"));
  const std::optional<uint64_t> size = CheckedMul(numel, ItemSize(*dtype));
  if (!size) return Corrupt(path(), "storage " + key + ": size overflows");
  if (const auto it = storages_.find(key); it != storages_.end()) {
    if (it->second.dtype != *dtype || it->second.numel != numel) {
      return Corrupt(path(), "storage " + key + " is pickled with two dtypes or sizes");
    }
    return &it->second;
  }
  UCP_ASSIGN_OR_RETURN(const ZipRecord* record, zip_.Get("data/" + key));
  if (record->size != *size) {
    return Corrupt(path(), "storage " + key + " holds " + std::to_string(record->size) +
                               " bytes, its pickle says " + std::to_string(numel) + " × " +
                               std::to_string(ItemSize(*dtype)));
  }
  TorchStorage storage{key,   *dtype,       pid->Item(3)->data(), numel, record->data_offset,
                       *size, record->crc32};
  return &storages_.emplace(key, std::move(storage)).first->second;
}

Status TorchArchiveReader::AddTensor(const Value* node, const Value* rebuild, const Value* args,
                                     bool v2, bool parameter, bool requires_grad,
                                     const Limits& limits) {
  if (args->items().size() < (v2 ? 6u : 4u) || args->Item(0)->kind() != Kind::kPersistentId) {
    return Corrupt(path(), "tensor reduction has malformed arguments");
  }
  UCP_ASSIGN_OR_RETURN(const TorchStorage* storage, StorageOf(args->Item(0)));
  TorchTensor tensor{node, storage, storage->dtype, 0, {}, {}, false, parameter};
  UCP_ASSIGN_OR_RETURN(tensor.storage_offset, NonNegative(path(), args->Item(1), "storage offset"));
  UCP_ASSIGN_OR_RETURN(tensor.shape, IntTuple(path(), args->Item(2), "size", limits.max_dims));
  UCP_ASSIGN_OR_RETURN(tensor.stride, IntTuple(path(), args->Item(3), "stride", limits.max_dims));
  if (tensor.shape.size() != tensor.stride.size()) {
    return Corrupt(path(),
                   "tensor of storage " + storage->key + ": size and stride differ in rank");
  }
  if (parameter) {
    tensor.requires_grad = requires_grad;
  } else if (v2) {
    if (args->Item(4)->kind() != Kind::kBool) return Corrupt(path(), "requires_grad is not a bool");
    tensor.requires_grad = args->Item(4)->bool_value();
  }
  // The last element, storage_offset + Σ (size_i - 1) × stride_i, must lie inside the storage.
  std::optional<uint64_t> numel = 1;
  std::optional<uint64_t> last = tensor.storage_offset;
  for (size_t i = 0; i < tensor.shape.size(); ++i) {
    numel = numel ? CheckedMul(*numel, tensor.shape[i]) : std::nullopt;
    if (tensor.shape[i] > 0 && last) {
      const std::optional<uint64_t> step = CheckedMul(tensor.shape[i] - 1, tensor.stride[i]);
      last = step ? CheckedAdd(*last, *step) : std::nullopt;
    }
  }
  if (!numel || (*numel > 0 && (!last || *last >= storage->numel))) {
    return Corrupt(path(), "tensor view (offset " + std::to_string(tensor.storage_offset) +
                               ") reaches past the " + std::to_string(storage->numel) +
                               " elements of storage " + storage->key);
  }
  tensor_by_node_.emplace(node, tensors_.size());
  tensor_by_node_.emplace(rebuild, tensors_.size());
  tensors_.push_back(std::move(tensor));
  return Status::Ok();
}

Status TorchArchiveReader::Locate(const Limits& limits) {
  if (graph_.root() == nullptr) return Corrupt(path(), "data.pkl holds no object");
  return pickle::ForEachReachable(graph_.root(), [&](Value* node) -> Status {
    if (node->kind() == Kind::kPersistentId) return StorageOf(node).status();
    if (node->kind() != Kind::kObject || node->callable()->kind() != Kind::kGlobal ||
        tensor_by_node_.count(node) != 0) {
      return Status::Ok();
    }
    if (node->IsCallOf(kTensorModule, kFromType)) {
      // Only a plain torch.Tensor rebuilt by _rebuild_tensor(_v2) is a tensor here; its
      // attribute dict (args[3]) stays in the graph and is written back unchanged.
      const Value* args = node->args();
      const Value* function = args->Item(0);
      const Value* type = args->Item(1);
      const Value* rebuild_args = args->Item(2);
      const bool plain_tensor =
          args->items().size() == 4 && function != nullptr && function->kind() == Kind::kGlobal &&
          function->module() == kUtils &&
          (function->name() == "_rebuild_tensor_v2" || function->name() == "_rebuild_tensor") &&
          type != nullptr && type->kind() == Kind::kGlobal && type->module() == "torch" &&
          type->name() == "Tensor" && rebuild_args != nullptr &&
          rebuild_args->kind() == Kind::kTuple;
      if (!plain_tensor) {
        unsupported_.push_back(node);
        return Status::Ok();
      }
      return AddTensor(node, node, rebuild_args, function->name() == "_rebuild_tensor_v2", false,
                       false, limits);
    }
    if (node->callable()->module() != kUtils) return Status::Ok();
    const std::string& name = node->callable()->name();
    if (name == "_rebuild_tensor_v2" || name == "_rebuild_tensor") {
      return AddTensor(node, node, node->args(), name == "_rebuild_tensor_v2", false, false,
                       limits);
    }
    if (name == "_rebuild_parameter" || name == "_rebuild_parameter_with_state") {
      const Value* args = node->args();
      const Value* inner = args->Item(0);
      if (inner == nullptr || args->items().size() < 2 || args->Item(1)->kind() != Kind::kBool ||
          !(IsUtilsCall(inner, "_rebuild_tensor_v2") || IsUtilsCall(inner, "_rebuild_tensor"))) {
        unsupported_.push_back(node);
        return Status::Ok();
      }
      return AddTensor(node, inner, inner->args(), IsUtilsCall(inner, "_rebuild_tensor_v2"), true,
                       args->Item(1)->bool_value(), limits);
    }
    if (name.rfind("_rebuild_", 0) == 0) unsupported_.push_back(node);
    return Status::Ok();
  });
}

const TorchTensor* TorchArchiveReader::TensorAt(const Value* node) const {
  const auto it = tensor_by_node_.find(node);
  return it == tensor_by_node_.end() ? nullptr : &tensors_[it->second];
}

std::string KeyText(const Value* key) {
  switch (key->kind()) {
    case Kind::kStr:
      return key->data();
    case Kind::kInt:
      return key->IntDecimal();
    case Kind::kBool:
      return key->bool_value() ? "True" : "False";
    case Kind::kNone:
      return "None";
    default: {
      Result<std::string> text = pickle::Render(key);
      if (text.ok()) return *std::move(text);
      // Appended piece by piece: g++ 12 at -O3 reports a false -Wrestrict overlap for
      // `"<" + std::string(...)` (GCC bug 105329).
      std::string placeholder = "<";
      placeholder.append(pickle::KindName(key->kind()));
      placeholder.push_back('>');
      return placeholder;
    }
  }
}

std::vector<std::pair<std::string, const Value*>> NamedChildren(const Value* node) {
  std::vector<std::pair<std::string, const Value*>> out;
  auto add_dict = [&out](const Value* dict) {
    if (dict != nullptr && dict->kind() == Kind::kDict) {
      for (const auto& [key, value] : dict->entries()) out.emplace_back(KeyText(key), value);
    }
  };
  switch (node->kind()) {
    case Kind::kDict:
      add_dict(node);
      break;
    case Kind::kList:
    case Kind::kTuple:
      for (size_t i = 0; i < node->items().size(); ++i) {
        out.emplace_back(std::to_string(i), node->items()[i]);
      }
      break;
    case Kind::kObject: {
      const Value* callable = node->callable();
      if (callable->kind() == Kind::kGlobal &&
          (callable->module() == kUtils || node->IsCallOf(kTensorModule, kFromType))) {
        break;  // a tensor is a leaf
      }
      size_t index = 0;
      for (const pickle::Mutation& mutation : node->mutations()) {
        if (mutation.op == pickle::Mutation::Op::kSetItem) {
          out.emplace_back(KeyText(mutation.first), mutation.second);
        } else if (mutation.op == pickle::Mutation::Op::kAppend) {
          out.emplace_back(std::to_string(index++), mutation.first);
        }
      }
      const Value* state = node->State();
      if (state != nullptr && state->kind() == Kind::kTuple && state->items().size() == 2) {
        add_dict(state->Item(0));  // (instance dict, slots dict) of classes with __slots__
        add_dict(state->Item(1));
      } else {
        add_dict(state);
      }
      break;
    }
    default:
      break;
  }
  return out;
}

Result<const Value*> TorchArchiveReader::Find(std::string_view path_in_object) const {
  const Value* node = graph_.root();
  std::string_view rest = path_in_object;
  while (!rest.empty()) {
    const size_t slash = rest.find('/');
    const std::string_view component = rest.substr(0, slash);
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    if (component.empty()) continue;
    const Value* next = nullptr;
    if (TensorAt(node) == nullptr) {
      for (const auto& [key, child] : NamedChildren(node)) {
        if (key == component) next = child;  // the last duplicate wins, as in Python
      }
    }
    if (next == nullptr) {
      return Status::NotFound(
          "torch archive " + path() + ": no \"" + std::string(component) + "\" in \"" +
          std::string(path_in_object.substr(0, component.data() - path_in_object.data())) + "\"");
    }
    node = next;
  }
  return node;
}

Status TorchArchiveReader::ReadStorage(const TorchStorage& storage, uint64_t offset,
                                       std::span<std::byte> out) const {
  if (!RangeWithin(offset, out.size(), storage.size)) {
    return Status::OutOfRange("torch archive " + path() + ": read past storage " + storage.key);
  }
  return zip_.file().ReadAt(storage.offset + offset, out);
}

}  // namespace ucp
