// safetensors reader: tensor names, dtypes, shapes and byte ranges, without reading tensor data.
//
// Byte layout (huggingface/safetensors "Format"; all integers little-endian):
//   [0, 8)        N: u64, the header length. ucp refuses N > kMaxSafetensorsHeader (100 MB).
//   [8, 8 + N)    UTF-8 JSON object. It MUST begin with '{' and MAY be padded at the end with
//                 spaces (0x20). Keys are tensor names, each mapping to
//                   {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
//                 plus at most one "__metadata__": {string: string}. Duplicate keys are invalid.
//   [8 + N, EOF)  the byte buffer. data_offsets are relative to its start, end exclusive. Taken
//                 in offset order, the tensors cover the buffer exactly: no holes, no overlaps,
//                 nothing after the last tensor. Each tensor's length equals
//                 product(shape) × itemsize (computed with overflow checks). Data is C-order,
//                 little-endian; empty and 0-d tensors are allowed.
//
// A sharded checkpoint (Hugging Face convention) is several such files named
// "model-00001-of-00004.safetensors" ... plus "model.safetensors.index.json":
//   {"metadata": {"total_size": <sum of tensor bytes>, ...}, "weight_map": {tensor: file, ...}}
//
// Thread-safety: the parsed objects are immutable values; concurrent const use is safe.
// Call order: SafetensorsHeader::Read(path) (or HeaderLength + Parse on bytes already in memory),
// then look tensors up.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/dtype.h"
#include "core/util/status.h"

namespace ucp {

inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

// One tensor of a safetensors file, located in the file (not relative to the byte buffer).
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute file offset of the first byte
  uint64_t size = 0;    // bytes: product(shape) × ItemSize(dtype)
};

// The validated header of one safetensors file.
class SafetensorsHeader {
 public:
  // Validates the first 8 bytes of a file of `file_size` bytes and returns N, the header length.
  // `path` only names the file in messages.
  static Result<uint64_t> HeaderLength(std::string_view path, std::string_view first8,
                                       uint64_t file_size);

  // Parses and validates the N header bytes (`header` = bytes [8, 8 + N)) of a file of
  // `file_size` bytes against every rule of the layout above.
  static Result<SafetensorsHeader> Parse(std::string_view path, std::string_view header,
                                         uint64_t file_size);

  // Reads the length and the header of `path` (two preads) and parses them.
  static Result<SafetensorsHeader> Read(const std::string& path);

  // Tensors in byte-buffer order (ascending offsets).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The tensor called `name`, or nullptr.
  const SafetensorsTensor* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Absolute offset of the byte buffer: 8 + N.
  uint64_t data_start() const { return data_start_; }

 private:
  SafetensorsHeader() = default;

  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_start_ = 0;
};

// "model-00001-of-00004.safetensors" for shard `index` (1-based) of `count`.
std::string SafetensorsShardName(std::string_view stem, uint32_t index, uint32_t count);

// model.safetensors.index.json: which shard file holds each tensor.
struct SafetensorsIndex {
  std::optional<uint64_t> total_size;             // metadata.total_size, when present
  std::map<std::string, std::string> metadata;    // the other metadata entries, as JSON text
  std::map<std::string, std::string> weight_map;  // tensor name → file name (same directory)

  // Parses an index document; `path` names it in messages.
  static Result<SafetensorsIndex> Parse(std::string_view path, std::string_view json);
  static Result<SafetensorsIndex> Read(const std::string& path);
};

// A sharded checkpoint opened through its index: every shard's header read and checked against
// the weight map (each mapped tensor exists in its shard, every shard tensor is mapped to that
// shard, and total_size, when present, equals the sum of the tensor sizes).
class SafetensorsShardedReader {
 public:
  static Result<SafetensorsShardedReader> Open(const std::string& index_path);

  struct Located {
    const std::string* file;  // absolute or index-relative path of the shard
    const SafetensorsTensor* tensor;
  };
  // The shard and header entry of tensor `name`.
  Result<Located> Find(std::string_view name) const;
  const SafetensorsIndex& index() const { return index_; }
  // Shard paths (directory of the index + file name) → parsed headers.
  const std::map<std::string, SafetensorsHeader>& shards() const { return shards_; }

 private:
  SafetensorsShardedReader() = default;

  SafetensorsIndex index_;
  std::string directory_;
  std::map<std::string, SafetensorsHeader> shards_;
};

}  // namespace ucp
