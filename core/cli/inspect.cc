// `ucp inspect`: prints what a checkpoint file holds.
//
// The --json form is a contract (tests/fixtures/check_archive.py compares it with torch.load):
//   torch:       {"format": "torch", "path", "archive_name",
//                 "storages": {key: {"dtype", "location", "numel", "offset", "size"}},
//                 "root": NODE}
//   safetensors: {"format": "safetensors", "path", "metadata": {..},
//                 "tensors": {name: {"dtype", "shape", "offset", "size"}}}
// NODE is one of
//   {"type": "none"} {"type": "bool", "value"} {"type": "int", "value": "<decimal>"}
//   {"type": "float", "bits": "<16 hex digits, IEEE-754 big-endian>"} {"type": "str", "value"}
//   {"type": "bytes"|"bytearray", "hex"} {"type": "tuple"|"list"|"set"|"frozenset", "items"}
//   {"type": "dict", "entries": [[KEY, VALUE], ...]}
//   {"type": "global", "module", "name"}
//   {"type": "object", "construction": "reduce"|"newobj"|"newobj_ex"|"inst"|"obj",
//    "callable", "args": [...], ["kwargs"], ["appends": [...]], ["setitems": [[K, V], ...]],
//    ["state"]}
//   {"type": "tensor", "parameter", "dtype", "shape", "stride", "storage_offset",
//    "requires_grad", "bytes", "storage", "location", "file_offset", "contiguous"}
//   {"type": "persistent_id", "pid"} {"type": "extension", "code"} {"type": "cycle"}
// Protocol 2 spells bytes and sets as reductions; they are shown as what they build:
// _codecs.encode(str, 'latin1') and (__builtin__|builtins).bytes() as "bytes", bytearray(those)
// as "bytearray",
// (__builtin__|builtins).set/frozenset([items]) as "set"/"frozenset".
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/cli/commands.h"
#include "core/cli/inspect_tag.h"
#include "core/cli/terminal.h"
#include "core/format/safetensors_reader.h"
#include "core/format/torch_archive_reader.h"
#include "core/io/file.h"

namespace ucp::cli {
namespace {

using Json = nlohmann::ordered_json;
using pickle::Kind;
using pickle::Value;

struct InspectOptions {
  std::string path;
  bool json = false;
  std::string tensor;
  bool tensor_given = false;
  uint64_t count = 16;
};

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string FloatBits(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(bits));
  return text;
}

// The shortest text that reads back as the same double, with ".0" on integral values so that
// floats stay distinguishable from ints (Python's repr style).
std::string FloatText(double value) {
  char text[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(text, sizeof(text), "%.*g", precision, value);
    if (std::strtod(text, nullptr) == value || std::isnan(value)) break;
  }
  std::string out = text;
  if (std::isfinite(value) && out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

bool IsBuiltin(const Value* callable, std::string_view name) {
  return callable->kind() == Kind::kGlobal &&
         (callable->module() == "__builtin__" || callable->module() == "builtins") &&
         callable->name() == name;
}

// A protocol-2 reduction that builds bytes: the bytes, else nullopt.
std::optional<std::string> ReducedBytes(const Value* node) {
  if (node->kind() != Kind::kObject || !node->mutations().empty()) return std::nullopt;
  const Value* args = node->args();
  if (IsBuiltin(node->callable(), "bytes") && args->items().empty()) return std::string();
  if (!node->IsCallOf("_codecs", "encode") || args->items().size() != 2 ||
      args->Item(0)->kind() != Kind::kStr || args->Item(1)->kind() != Kind::kStr ||
      args->Item(1)->data() != "latin1") {
    return std::nullopt;
  }
  // The str holds code points < 256 as UTF-8; each is one byte.
  std::string out;
  const std::string& text = args->Item(0)->data();
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if ((c == 0xC2 || c == 0xC3) && i + 1 < text.size()) {
      out += static_cast<char>(((c & 0x03) << 6) | (static_cast<unsigned char>(text[++i]) & 0x3F));
    } else {
      return std::nullopt;
    }
  }
  return out;
}

// A protocol-2 bytearray: (__builtin__|builtins).bytearray() or bytearray(<bytes reduction>).
std::optional<std::string> ReducedByteArray(const Value* node) {
  if (node->kind() != Kind::kObject || !node->mutations().empty() ||
      !IsBuiltin(node->callable(), "bytearray")) {
    return std::nullopt;
  }
  const Value* args = node->args();
  if (args->items().empty()) return std::string();
  if (args->items().size() != 1) return std::nullopt;
  if (args->Item(0)->kind() == Kind::kBytes) return args->Item(0)->data();
  return ReducedBytes(args->Item(0));
}

// A protocol-2 reduction that builds a set or frozenset: its kind and element list.
const Value* ReducedSetItems(const Value* node, std::string* type) {
  if (node->kind() != Kind::kObject || !node->mutations().empty()) return nullptr;
  const Value* args = node->args();
  for (const char* name : {"set", "frozenset"}) {
    if (IsBuiltin(node->callable(), name) && args->items().size() == 1 &&
        args->Item(0)->kind() == Kind::kList) {
      *type = name;
      return args->Item(0);
    }
  }
  return nullptr;
}

std::string_view ConstructionName(pickle::Construction construction) {
  switch (construction) {
    case pickle::Construction::kReduce:
      return "reduce";
    case pickle::Construction::kNewObj:
      return "newobj";
    case pickle::Construction::kNewObjEx:
      return "newobj_ex";
    case pickle::Construction::kInst:
      return "inst";
    case pickle::Construction::kObj:
      return "obj";
  }
  return "reduce";
}

Json TensorJson(const TorchTensor& tensor) {
  return Json{{"type", "tensor"},
              {"parameter", tensor.parameter},
              {"dtype", std::string(TorchName(tensor.dtype))},
              {"shape", tensor.shape},
              {"stride", tensor.stride},
              {"storage_offset", tensor.storage_offset},
              {"requires_grad", tensor.requires_grad},
              {"bytes", tensor.byte_size()},
              {"storage", tensor.storage->key},
              {"location", tensor.storage->location},
              {"file_offset", tensor.file_offset()},
              {"contiguous", tensor.contiguous()}};
}

class JsonTree {
 public:
  explicit JsonTree(const TorchArchiveReader& reader) : reader_(reader) {}

  Result<Json> Node(const Value* node, uint32_t depth) {
    if (depth > pickle::kMaxDepth) return Status::OutOfRange("inspect: object nested too deeply");
    if (const TorchTensor* tensor = reader_.TensorAt(node)) return TensorJson(*tensor);
    if (!active_.insert(node).second) return Json{{"type", "cycle"}};
    Result<Json> out = Build(node, depth);
    active_.erase(node);
    return out;
  }

 private:
  Result<Json> List(const std::vector<Value*>& items, uint32_t depth) {
    Json out = Json::array();
    for (const Value* item : items) {
      UCP_ASSIGN_OR_RETURN(Json child, Node(item, depth + 1));
      out.push_back(std::move(child));
    }
    return out;
  }

  Result<Json> Build(const Value* node, uint32_t depth) {
    switch (node->kind()) {
      case Kind::kNone:
        return Json{{"type", "none"}};
      case Kind::kBool:
        return Json{{"type", "bool"}, {"value", node->bool_value()}};
      case Kind::kInt:
        return Json{{"type", "int"}, {"value", node->IntDecimal()}};
      case Kind::kFloat:
        return Json{{"type", "float"}, {"bits", FloatBits(node->float_value())}};
      case Kind::kStr:
        return Json{{"type", "str"}, {"value", node->data()}};
      case Kind::kBytes:
        return Json{{"type", "bytes"}, {"hex", Hex(node->data())}};
      case Kind::kByteArray:
        return Json{{"type", "bytearray"}, {"hex", Hex(node->data())}};
      case Kind::kTuple:
      case Kind::kList:
      case Kind::kSet:
      case Kind::kFrozenSet: {
        UCP_ASSIGN_OR_RETURN(Json items, List(node->items(), depth));
        return Json{{"type", pickle::KindName(node->kind())}, {"items", std::move(items)}};
      }
      case Kind::kDict: {
        Json entries = Json::array();
        for (const auto& [key, value] : node->entries()) {
          UCP_ASSIGN_OR_RETURN(Json key_json, Node(key, depth + 1));
          UCP_ASSIGN_OR_RETURN(Json value_json, Node(value, depth + 1));
          entries.push_back(Json::array({std::move(key_json), std::move(value_json)}));
        }
        return Json{{"type", "dict"}, {"entries", std::move(entries)}};
      }
      case Kind::kGlobal:
        return Json{{"type", "global"}, {"module", node->module()}, {"name", node->name()}};
      case Kind::kPersistentId: {
        UCP_ASSIGN_OR_RETURN(Json pid, Node(node->pid(), depth + 1));
        return Json{{"type", "persistent_id"}, {"pid", std::move(pid)}};
      }
      case Kind::kExtension:
        return Json{{"type", "extension"}, {"code", node->extension_code()}};
      case Kind::kObject:
        return Object(node, depth);
    }
    return Status::Internal("inspect: unknown node kind");
  }

  Result<Json> Object(const Value* node, uint32_t depth) {
    if (std::optional<std::string> bytes = ReducedBytes(node)) {
      return Json{{"type", "bytes"}, {"hex", Hex(*bytes)}};
    }
    if (std::optional<std::string> bytes = ReducedByteArray(node)) {
      return Json{{"type", "bytearray"}, {"hex", Hex(*bytes)}};
    }
    std::string set_type;
    if (const Value* items = ReducedSetItems(node, &set_type)) {
      UCP_ASSIGN_OR_RETURN(Json list, List(items->items(), depth));
      return Json{{"type", set_type}, {"items", std::move(list)}};
    }
    UCP_ASSIGN_OR_RETURN(Json callable, Node(node->callable(), depth + 1));
    UCP_ASSIGN_OR_RETURN(Json args, List(node->args()->items(), depth));
    Json out{{"type", "object"},
             {"construction", ConstructionName(node->construction())},
             {"callable", std::move(callable)},
             {"args", std::move(args)}};
    if (node->kwargs() != nullptr) {
      UCP_ASSIGN_OR_RETURN(out["kwargs"], Node(node->kwargs(), depth + 1));
    }
    Json appends = Json::array();
    Json setitems = Json::array();
    const Value* state = nullptr;
    for (const pickle::Mutation& mutation : node->mutations()) {
      switch (mutation.op) {
        case pickle::Mutation::Op::kAppend: {
          UCP_ASSIGN_OR_RETURN(Json item, Node(mutation.first, depth + 1));
          appends.push_back(std::move(item));
          break;
        }
        case pickle::Mutation::Op::kSetItem: {
          UCP_ASSIGN_OR_RETURN(Json key, Node(mutation.first, depth + 1));
          UCP_ASSIGN_OR_RETURN(Json value, Node(mutation.second, depth + 1));
          setitems.push_back(Json::array({std::move(key), std::move(value)}));
          break;
        }
        case pickle::Mutation::Op::kBuild:
          state = mutation.first;
          break;
      }
    }
    if (!appends.empty()) out["appends"] = std::move(appends);
    if (!setitems.empty()) out["setitems"] = std::move(setitems);
    if (state != nullptr) {
      UCP_ASSIGN_OR_RETURN(out["state"], Node(state, depth + 1));
    }
    return out;
  }

  const TorchArchiveReader& reader_;
  std::unordered_set<const Value*> active_;
};

// One line per node, children indented; tensors and opaque objects summarised.
class TextTree {
 public:
  explicit TextTree(const TorchArchiveReader& reader) : reader_(reader) {}

  void Print(const std::string& key, const Value* node, int indent) {
    std::string line(static_cast<size_t>(indent) * 2, ' ');
    if (!key.empty()) line += key + ": ";
    if (indent > static_cast<int>(pickle::kMaxDepth)) {
      std::cout << line << "...\n";
      return;
    }
    if (const TorchTensor* tensor = reader_.TensorAt(node)) {
      std::cout << line << TensorSummary(*tensor) << "\n";
      return;
    }
    if (!active_.insert(node).second) {
      std::cout << line << "<cycle>\n";
      return;
    }
    const std::vector<std::pair<std::string, const Value*>> children = NamedChildren(node);
    std::cout << line << Summary(node, children.size()) << "\n";
    if (!Leaf(node)) {
      for (const auto& [child_key, child] : children) Print(child_key, child, indent + 1);
    }
    active_.erase(node);
  }

 private:
  static bool Leaf(const Value* node) {
    std::string set_type;
    return node->kind() == Kind::kObject && (ReducedBytes(node) || ReducedByteArray(node) ||
                                             ReducedSetItems(node, &set_type) != nullptr);
  }

  static std::string Quoted(const std::string& text) {
    if (text.size() > 80) return "\"" + text.substr(0, 77) + "...\"";
    return "\"" + text + "\"";
  }

  static std::string ClassName(const Value* callable) {
    if (callable->kind() != Kind::kGlobal)
      return "<" + std::string(KindName(callable->kind())) + ">";
    return callable->module() + "." + callable->name();
  }

  std::string Summary(const Value* node, size_t children) const {
    switch (node->kind()) {
      case Kind::kNone:
        return "None";
      case Kind::kBool:
        return node->bool_value() ? "True" : "False";
      case Kind::kInt:
        return node->IntDecimal();
      case Kind::kFloat:
        return FloatText(node->float_value());
      case Kind::kStr:
        return Quoted(node->data());
      case Kind::kBytes:
        return "bytes (" + std::to_string(node->data().size()) + ")";
      case Kind::kByteArray:
        return "bytearray (" + std::to_string(node->data().size()) + ")";
      case Kind::kTuple:
      case Kind::kList:
      case Kind::kDict:
        return std::string(KindName(node->kind())) + " (" + std::to_string(children) + ")";
      case Kind::kSet:
      case Kind::kFrozenSet:
        return std::string(KindName(node->kind())) + " (" + std::to_string(node->items().size()) +
               ")";
      case Kind::kGlobal:
        return "global " + node->module() + "." + node->name();
      case Kind::kPersistentId:
        return "persistent id";
      case Kind::kExtension:
        return "extension " + std::to_string(node->extension_code());
      case Kind::kObject:
        break;
    }
    if (std::optional<std::string> bytes = ReducedBytes(node)) {
      return "bytes (" + std::to_string(bytes->size()) + ")";
    }
    if (std::optional<std::string> bytes = ReducedByteArray(node)) {
      return "bytearray (" + std::to_string(bytes->size()) + ")";
    }
    std::string set_type;
    if (const Value* items = ReducedSetItems(node, &set_type)) {
      return set_type + " (" + std::to_string(items->items().size()) + ")";
    }
    std::string out = ClassName(node->callable());
    if (node->callable()->kind() == Kind::kGlobal && node->callable()->module() == "torch._utils") {
      return out + " (unsupported tensor form, carried unchanged)";
    }
    const Value* args = node->args();
    if (children == 0 && !args->items().empty()) {
      Result<std::string> rendered = pickle::Render(args);
      if (rendered.ok())
        out += rendered->size() > 100 ? rendered->substr(0, 97) + "..." : *rendered;
    }
    if (children > 0) out += " (" + std::to_string(children) + ")";
    return out;
  }

  static std::string Dims(const std::vector<uint64_t>& dims) {
    std::string out = "[";
    for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
    return out + "]";
  }

  static std::string TensorSummary(const TorchTensor& tensor) {
    return std::string(tensor.parameter ? "Parameter " : "tensor ") +
           std::string(TorchName(tensor.dtype)) + " " + Dims(tensor.shape) + " stride " +
           Dims(tensor.stride) + " " + std::to_string(tensor.byte_size()) + " B, storage " +
           tensor.storage->key + "+" + std::to_string(tensor.storage_offset) + " @" +
           std::to_string(tensor.file_offset()) + (tensor.requires_grad ? " requires_grad" : "") +
           (tensor.storage->location != "cpu" ? " " + tensor.storage->location : "");
  }

  const TorchArchiveReader& reader_;
  std::unordered_set<const Value*> active_;
};

float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half >> 15) << 31;
  const int exponent = (half >> 10) & 0x1F;
  const uint32_t mantissa = half & 0x3FF;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits |= sign;
  std::memcpy(&value, &bits, sizeof(bits));
  return value;
}

template <typename T>
T Load(const std::byte* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

// One element as text; 16-bit floats are widened to float for display.
std::string ElementText(DType dtype, const std::byte* bytes) {
  switch (dtype) {
    case DType::kBool:
      return Load<uint8_t>(bytes) ? "True" : "False";
    case DType::kUInt8:
      return std::to_string(Load<uint8_t>(bytes));
    case DType::kInt8:
      return std::to_string(Load<int8_t>(bytes));
    case DType::kInt16:
      return std::to_string(Load<int16_t>(bytes));
    case DType::kUInt16:
      return std::to_string(Load<uint16_t>(bytes));
    case DType::kInt32:
      return std::to_string(Load<int32_t>(bytes));
    case DType::kUInt32:
      return std::to_string(Load<uint32_t>(bytes));
    case DType::kInt64:
      return std::to_string(Load<int64_t>(bytes));
    case DType::kUInt64:
      return std::to_string(Load<uint64_t>(bytes));
    case DType::kFloat16:
      return FloatText(HalfToFloat(Load<uint16_t>(bytes)));
    case DType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(Load<uint16_t>(bytes)) << 16;
      return FloatText(std::bit_cast<float>(bits));
    }
    case DType::kFloat32:
      return FloatText(Load<float>(bytes));
    case DType::kFloat64:
      return FloatText(Load<double>(bytes));
    case DType::kComplex64:
      return FloatText(Load<float>(bytes)) + (Load<float>(bytes + 4) < 0 ? "" : "+") +
             FloatText(Load<float>(bytes + 4)) + "j";
    case DType::kComplex128:
      return FloatText(Load<double>(bytes)) + (Load<double>(bytes + 8) < 0 ? "" : "+") +
             FloatText(Load<double>(bytes + 8)) + "j";
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3:
      return "0x" + Hex(std::string_view(reinterpret_cast<const char*>(bytes), 1));
  }
  return "?";
}

// Reads the first `count` elements (row-major order of the view) with one ranged read of the
// bytes they span, or one read per element when that span is large (a transposed view).
Result<std::vector<std::string>> FirstValues(const File& file, uint64_t base_offset, DType dtype,
                                             const std::vector<uint64_t>& shape,
                                             const std::vector<uint64_t>& stride,
                                             uint64_t storage_offset, uint64_t count) {
  uint64_t numel = 1;
  for (uint64_t dim : shape) numel *= dim;
  count = std::min(count, numel);
  std::vector<uint64_t> offsets;  // element offsets in the storage
  std::vector<uint64_t> index(shape.size(), 0);
  for (uint64_t n = 0; n < count; ++n) {
    uint64_t element = storage_offset;
    for (size_t d = 0; d < shape.size(); ++d) element += index[d] * stride[d];
    offsets.push_back(element);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  std::vector<std::string> out;
  if (offsets.empty()) return out;
  const uint64_t item = ItemSize(dtype);
  const auto [low, high] = std::minmax_element(offsets.begin(), offsets.end());
  const uint64_t span = (*high - *low + 1) * item;
  std::vector<std::byte> buffer;
  if (span <= (uint64_t{16} << 20)) {
    buffer.resize(span);
    UCP_RETURN_IF_ERROR(file.ReadAt(base_offset + *low * item, buffer));
    for (uint64_t element : offsets) {
      out.push_back(ElementText(dtype, buffer.data() + (element - *low) * item));
    }
  } else {
    buffer.resize(item);
    for (uint64_t element : offsets) {
      UCP_RETURN_IF_ERROR(file.ReadAt(base_offset + element * item, buffer));
      out.push_back(ElementText(dtype, buffer.data()));
    }
  }
  return out;
}

void PrintValues(const std::vector<std::string>& values, uint64_t numel) {
  std::cout << "values (" << values.size() << " of " << numel << "):";
  for (const std::string& value : values) std::cout << " " << value;
  std::cout << "\n";
}

Status InspectTorch(const InspectOptions& options) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader, TorchArchiveReader::Open(options.path));
  if (options.tensor_given) {
    UCP_ASSIGN_OR_RETURN(const Value* node, reader.Find(options.tensor));
    const TorchTensor* tensor = reader.TensorAt(node);
    if (tensor == nullptr) {
      return Status::InvalidArgument("inspect: \"" + options.tensor + "\" in " + options.path +
                                     " is not a tensor");
    }
    UCP_ASSIGN_OR_RETURN(
        std::vector<std::string> values,
        FirstValues(reader.zip().file(), tensor->storage->offset, tensor->dtype, tensor->shape,
                    tensor->stride, tensor->storage_offset, options.count));
    if (options.json) {
      Json out = TensorJson(*tensor);
      out["values"] = values;
      std::cout << out.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
    } else {
      std::cout << options.tensor << ": " << TorchName(tensor->dtype) << " shape "
                << Json(tensor->shape).dump() << " stride " << Json(tensor->stride).dump()
                << " storage " << tensor->storage->key << " @" << tensor->file_offset() << "\n";
      PrintValues(values, tensor->numel());
    }
    return Status::Ok();
  }
  if (options.json) {
    Json storages = Json::object();
    for (const auto& [key, storage] : reader.storages()) {
      storages[key] = {{"dtype", std::string(TorchName(storage.dtype))},
                       {"location", storage.location},
                       {"numel", storage.numel},
                       {"offset", storage.offset},
                       {"size", storage.size}};
    }
    JsonTree tree(reader);
    UCP_ASSIGN_OR_RETURN(Json root, tree.Node(reader.root(), 0));
    const Json out{{"format", "torch"},
                   {"path", options.path},
                   {"archive_name", reader.archive_name()},
                   {"storages", std::move(storages)},
                   {"root", std::move(root)}};
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    return Status::Ok();
  }
  uint64_t storage_bytes = 0;
  for (const auto& [key, storage] : reader.storages()) storage_bytes += storage.size;
  std::cout << options.path << ": torch archive \"" << reader.archive_name() << "\", "
            << reader.storages().size() << " storages (" << storage_bytes << " B), "
            << reader.tensors().size() << " tensors";
  if (!reader.unsupported_tensors().empty()) {
    std::cout << ", " << reader.unsupported_tensors().size() << " unsupported tensor forms";
  }
  std::cout << "\n";
  TextTree(reader).Print("", reader.root(), 0);
  return Status::Ok();
}

Status InspectSafetensors(const InspectOptions& options) {
  UCP_ASSIGN_OR_RETURN(SafetensorsHeader header, SafetensorsHeader::Read(options.path));
  if (options.tensor_given) {
    const SafetensorsTensor* tensor = header.Find(options.tensor);
    if (tensor == nullptr) {
      return Status::NotFound("inspect: no tensor \"" + options.tensor + "\" in " + options.path);
    }
    std::vector<uint64_t> stride(tensor->shape.size());
    uint64_t step = 1;
    for (size_t i = tensor->shape.size(); i-- > 0;) {
      stride[i] = step;
      step *= tensor->shape[i];
    }
    UCP_ASSIGN_OR_RETURN(File file, File::Open(options.path, File::Mode::kRead));
    UCP_ASSIGN_OR_RETURN(
        std::vector<std::string> values,
        FirstValues(file, tensor->offset, tensor->dtype, tensor->shape, stride, 0, options.count));
    std::cout << options.tensor << ": " << *SafetensorsName(tensor->dtype) << " shape "
              << Json(tensor->shape).dump() << " @" << tensor->offset << "\n";
    PrintValues(values, step);
    return Status::Ok();
  }
  if (options.json) {
    Json tensors = Json::object();
    for (const SafetensorsTensor& tensor : header.tensors()) {
      tensors[tensor.name] = {{"dtype", std::string(*SafetensorsName(tensor.dtype))},
                              {"shape", tensor.shape},
                              {"offset", tensor.offset},
                              {"size", tensor.size}};
    }
    const Json out{{"format", "safetensors"},
                   {"path", options.path},
                   {"metadata", header.metadata()},
                   {"tensors", std::move(tensors)}};
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    return Status::Ok();
  }
  std::cout << options.path << ": safetensors, " << header.tensors().size() << " tensors, data at "
            << header.data_start() << "\n";
  for (const auto& [key, value] : header.metadata()) {
    std::cout << "  __metadata__ " << key << ": \"" << value << "\"\n";
  }
  for (const SafetensorsTensor& tensor : header.tensors()) {
    std::cout << "  " << tensor.name << ": " << *SafetensorsName(tensor.dtype) << " "
              << Json(tensor.shape).dump() << " " << tensor.size << " B @" << tensor.offset << "\n";
  }
  return Status::Ok();
}

Status Inspect(const InspectOptions& options) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(options.path, File::Mode::kRead));
  UCP_ASSIGN_OR_RETURN(uint64_t size, file.Size());
  std::byte magic[4] = {};
  if (size >= sizeof(magic)) UCP_RETURN_IF_ERROR(file.ReadAt(0, magic));
  if (std::memcmp(magic, "PK\x03\x04", 4) == 0) return InspectTorch(options);
  if (size >= 2 && static_cast<unsigned char>(magic[0]) == 0x80 &&
      static_cast<unsigned char>(magic[1]) == 0x02) {
    return Status::Unsupported("inspect: " + options.path +
                               " is a legacy (pre-1.6, non-zip) torch.save file");
  }
  return InspectSafetensors(options);
}

}  // namespace

void AddInspectCommand(CLI::App& app, Run* run) {
  auto options = std::make_shared<InspectOptions>();
  CLI::App* command = app.add_subcommand(
      "inspect",
      "Print the object tree of a .pt (torch.save) or .safetensors file, or a checkpoint tag "
      "directory as atoms");
  command->add_option("path", options->path, "the file, or the tag directory")->required();
  command->add_flag("--json", options->json, "machine-readable JSON");
  command->add_option("--tensor", options->tensor,
                      "print one tensor's first values; PATH like optimizer_state_dict/state/0/"
                      "exp_avg (list indices as numbers), or the safetensors name");
  command->add_option("--count", options->count, "how many values --tensor prints")
      ->default_val(16);
  command->callback([options, command, run] {
    options->tensor_given = command->count("--tensor") > 0;
    *run = [options] {
      struct stat info;
      if (::stat(options->path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
        if (options->tensor_given) {
          return PrintError("inspect", Status::InvalidArgument("--tensor takes a file"),
                            kExitUsage);
        }
        return InspectTag(options->path, options->json);
      }
      const Status status = Inspect(*options);
      return status.ok() ? kExitOk : PrintError("inspect", status, kExitInput);
    };
  });
}

}  // namespace ucp::cli
