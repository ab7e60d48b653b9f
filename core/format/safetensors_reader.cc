#include "core/format/safetensors_reader.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <span>

#include "core/io/file.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using Json = nlohmann::json;

Status Corrupt(std::string_view path, std::string_view what) {
  return Status::Corrupt("safetensors: " + std::string(path) + ": " + std::string(what));
}

// nlohmann keeps the last of duplicate keys; the parser callback sees every key, so duplicates
// are caught here, per object, at any depth.
Result<Json> ParseJsonRejectingDuplicates(std::string_view path, std::string_view text,
                                          std::string_view what) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto callback = [&](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys_per_object.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys_per_object.empty()) keys_per_object.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys_per_object.empty() && duplicate.empty() &&
            !keys_per_object.back().insert(parsed.get_ref<const std::string&>()).second) {
          duplicate = parsed.get_ref<const std::string&>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json json = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Corrupt(path, std::string(what) + " is not valid JSON");
  if (!duplicate.empty()) {
    return Corrupt(path, std::string(what) + " has duplicate key \"" + duplicate + "\"");
  }
  return json;
}

uint64_t LoadLe64(std::string_view bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

Result<SafetensorsTensor> ParseTensorEntry(std::string_view path, const std::string& name,
                                           const Json& entry, uint64_t data_start) {
  const std::string where = "tensor \"" + name + "\"";
  if (!entry.is_object()) return Corrupt(path, where + ": entry is not an object");
  for (const auto& [key, unused] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Corrupt(path, where + ": unknown field \"" + key + "\"");
    }
  }
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return Corrupt(path, where + ": missing or non-string \"dtype\"");
  }
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return Corrupt(path, where + ": missing or non-array \"shape\"");
  }
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return Corrupt(path, where + ": \"data_offsets\" is not [begin, end]");
  }
  SafetensorsTensor tensor;
  tensor.name = name;
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = DTypeFromSafetensorsName(dtype_name);
  if (!dtype) return Corrupt(path, where + ": unsupported dtype \"" + dtype_name + "\"");
  tensor.dtype = *dtype;
  uint64_t numel = 1;
  for (const Json& dim : *shape_it) {
    if (!dim.is_number_unsigned()) return Corrupt(path, where + ": shape has a non-integer");
    const std::optional<uint64_t> product = CheckedMul(numel, dim.get<uint64_t>());
    if (!product) return Corrupt(path, where + ": shape overflows");
    numel = *product;
    tensor.shape.push_back(dim.get<uint64_t>());
  }
  const std::optional<uint64_t> size = CheckedMul(numel, ItemSize(tensor.dtype));
  if (!size) return Corrupt(path, where + ": byte size overflows");
  const Json& begin = (*offsets_it)[0];
  const Json& end = (*offsets_it)[1];
  if (!begin.is_number_unsigned() || !end.is_number_unsigned()) {
    return Corrupt(path, where + ": data_offsets are not unsigned integers");
  }
  if (end.get<uint64_t>() < begin.get<uint64_t>() ||
      end.get<uint64_t>() - begin.get<uint64_t>() != *size) {
    return Corrupt(path, where + ": data_offsets [" + std::to_string(begin.get<uint64_t>()) + ", " +
                             std::to_string(end.get<uint64_t>()) + ") do not hold " +
                             std::to_string(*size) + " bytes");
  }
  const std::optional<uint64_t> offset = CheckedAdd(data_start, begin.get<uint64_t>());
  if (!offset) return Corrupt(path, where + ": offset overflows");
  tensor.offset = *offset;
  tensor.size = *size;
  return tensor;
}

}  // namespace

Result<uint64_t> SafetensorsHeader::HeaderLength(std::string_view path, std::string_view first8,
                                                 uint64_t file_size) {
  if (first8.size() < 8 || file_size < 8) return Corrupt(path, "shorter than 8 bytes");
  const uint64_t length = LoadLe64(first8);
  if (length > kMaxSafetensorsHeader) {
    return Corrupt(path, "header length " + std::to_string(length) + " exceeds the limit of " +
                             std::to_string(kMaxSafetensorsHeader));
  }
  if (!RangeWithin(8, length, file_size)) {
    return Corrupt(path, "header length " + std::to_string(length) + " runs past the end of the " +
                             std::to_string(file_size) + "-byte file");
  }
  return length;
}

Result<SafetensorsHeader> SafetensorsHeader::Parse(std::string_view path, std::string_view header,
                                                   uint64_t file_size) {
  if (header.empty() || header.front() != '{')
    return Corrupt(path, "header does not begin with '{'");
  if (!RangeWithin(8, header.size(), file_size)) {
    return Corrupt(path, "header runs past the end of the file");
  }
  UCP_ASSIGN_OR_RETURN(Json json, ParseJsonRejectingDuplicates(path, header, "header"));
  if (!json.is_object()) return Corrupt(path, "header is not a JSON object");

  SafetensorsHeader out;
  out.data_start_ = 8 + header.size();
  for (const auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return Corrupt(path, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return Corrupt(path, "__metadata__ value of \"" + key + "\" is not a string");
        }
        out.metadata_.emplace(key, value.get<std::string>());
      }
      continue;
    }
    UCP_ASSIGN_OR_RETURN(SafetensorsTensor tensor,
                         ParseTensorEntry(path, name, entry, out.data_start_));
    out.tensors_.push_back(std::move(tensor));
  }
  // Sorting by (offset, size) puts empty tensors before a non-empty one at the same offset, so
  // the coverage walk below accepts them and still rejects any overlap.
  std::sort(out.tensors_.begin(), out.tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.offset != b.offset ? a.offset < b.offset : a.size < b.size;
            });
  uint64_t cursor = out.data_start_;
  for (const SafetensorsTensor& tensor : out.tensors_) {
    if (tensor.offset != cursor) {
      return Corrupt(path, "tensor \"" + tensor.name + "\" at buffer offset " +
                               std::to_string(tensor.offset - out.data_start_) +
                               (tensor.offset < cursor ? " overlaps the previous tensor"
                                                       : " leaves a hole before it"));
    }
    cursor += tensor.size;  // offset + size was bounded by the file check below
    if (cursor > file_size) {
      return Corrupt(path, "tensor \"" + tensor.name + "\" runs past the end of the file");
    }
  }
  if (cursor != file_size) {
    return Corrupt(
        path, std::to_string(file_size - cursor) + " bytes after the last tensor are not indexed");
  }
  for (size_t i = 0; i < out.tensors_.size(); ++i) out.by_name_.emplace(out.tensors_[i].name, i);
  return out;
}

Result<SafetensorsHeader> SafetensorsHeader::Read(const std::string& path) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  UCP_ASSIGN_OR_RETURN(uint64_t size, file.Size());
  std::string first8(std::min<uint64_t>(8, size), '\0');
  UCP_RETURN_IF_ERROR(file.ReadAt(0, std::as_writable_bytes(std::span(first8))));
  UCP_ASSIGN_OR_RETURN(uint64_t length, HeaderLength(path, first8, size));
  std::string header(length, '\0');
  UCP_RETURN_IF_ERROR(file.ReadAt(8, std::as_writable_bytes(std::span(header))));
  return Parse(path, header, size);
}

const SafetensorsTensor* SafetensorsHeader::Find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::string SafetensorsShardName(std::string_view stem, uint32_t index, uint32_t count) {
  char numbers[32];
  std::snprintf(numbers, sizeof(numbers), "-%05u-of-%05u", index, count);
  return std::string(stem) + numbers + ".safetensors";
}

Result<SafetensorsIndex> SafetensorsIndex::Parse(std::string_view path,
                                                 std::string_view json_text) {
  UCP_ASSIGN_OR_RETURN(Json json, ParseJsonRejectingDuplicates(path, json_text, "index"));
  if (!json.is_object()) return Corrupt(path, "index is not a JSON object");
  SafetensorsIndex index;
  if (const auto metadata = json.find("metadata"); metadata != json.end()) {
    if (!metadata->is_object()) return Corrupt(path, "\"metadata\" is not an object");
    for (const auto& [key, value] : metadata->items()) {
      if (key == "total_size") {
        if (!value.is_number_unsigned()) return Corrupt(path, "total_size is not an integer");
        index.total_size = value.get<uint64_t>();
      } else {
        index.metadata.emplace(key, value.dump());
      }
    }
  }
  const auto weight_map = json.find("weight_map");
  if (weight_map == json.end() || !weight_map->is_object()) {
    return Corrupt(path, "missing or non-object \"weight_map\"");
  }
  for (const auto& [name, file] : weight_map->items()) {
    if (!file.is_string()) return Corrupt(path, "weight_map[\"" + name + "\"] is not a string");
    const std::string& file_name = file.get_ref<const std::string&>();
    if (file_name.empty() || file_name.find('/') != std::string::npos || file_name == "." ||
        file_name == "..") {
      return Corrupt(path, "weight_map[\"" + name + "\"] is not a file name in the index's folder");
    }
    index.weight_map.emplace(name, file_name);
  }
  return index;
}

Result<SafetensorsIndex> SafetensorsIndex::Read(const std::string& path) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  UCP_ASSIGN_OR_RETURN(uint64_t size, file.Size());
  if (size > kMaxSafetensorsHeader) return Corrupt(path, "index file is too large");
  std::string text(size, '\0');
  UCP_RETURN_IF_ERROR(file.ReadAt(0, std::as_writable_bytes(std::span(text))));
  return Parse(path, text);
}

Result<SafetensorsShardedReader> SafetensorsShardedReader::Open(const std::string& index_path) {
  SafetensorsShardedReader reader;
  UCP_ASSIGN_OR_RETURN(reader.index_, SafetensorsIndex::Read(index_path));
  const size_t slash = index_path.rfind('/');
  reader.directory_ = slash == std::string::npos ? "" : index_path.substr(0, slash + 1);
  std::set<std::string> files;
  for (const auto& [name, file] : reader.index_.weight_map) files.insert(file);
  uint64_t total = 0;
  for (const std::string& file : files) {
    const std::string shard_path = reader.directory_ + file;
    UCP_ASSIGN_OR_RETURN(SafetensorsHeader header, SafetensorsHeader::Read(shard_path));
    for (const SafetensorsTensor& tensor : header.tensors()) {
      const auto mapped = reader.index_.weight_map.find(tensor.name);
      if (mapped == reader.index_.weight_map.end() || mapped->second != file) {
        return Corrupt(index_path,
                       "tensor \"" + tensor.name + "\" of " + file + " is not mapped to that file");
      }
      const std::optional<uint64_t> sum = CheckedAdd(total, tensor.size);
      if (!sum) return Corrupt(index_path, "total tensor size overflows");
      total = *sum;
    }
    reader.shards_.emplace(shard_path, std::move(header));
  }
  for (const auto& [name, file] : reader.index_.weight_map) {
    if (reader.shards_.at(reader.directory_ + file).Find(name) == nullptr) {
      return Corrupt(index_path, "tensor \"" + name + "\" is not in " + file);
    }
  }
  if (reader.index_.total_size && *reader.index_.total_size != total) {
    return Corrupt(index_path, "total_size " + std::to_string(*reader.index_.total_size) +
                                   " differs from the " + std::to_string(total) +
                                   " bytes of the shards' tensors");
  }
  return reader;
}

Result<SafetensorsShardedReader::Located> SafetensorsShardedReader::Find(
    std::string_view name) const {
  const auto mapped = index_.weight_map.find(std::string(name));
  if (mapped == index_.weight_map.end()) {
    return Status::NotFound("safetensors: no tensor \"" + std::string(name) + "\" in the index");
  }
  const auto shard = shards_.find(directory_ + mapped->second);
  return Located{&shard->first, shard->second.Find(name)};
}

}  // namespace ucp
