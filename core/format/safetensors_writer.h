// safetensors writer: streams tensors from memory or from byte ranges of other files into one
// safetensors file (layout: safetensors_reader.h), written under a temporary name, fsynced and
// renamed, so `path` either keeps its old contents or holds the complete new file.
//
// Header written: tensors in the order they were added, data_offsets back to back from 0,
// "__metadata__" first when any metadata was set, spaces padding the header so that the byte
// buffer starts at a multiple of 8.
//
// File-sourced bytes move with copy_file_range (CopyRange), never through ucp's memory; runs of
// zeros are left as holes of the new file.
//
// Thread-safety: not thread-safe; one thread builds and writes. Call order: Add*/SetMetadata in
// any order, then Write() (which may be called again, e.g. to write the same file elsewhere).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/dtype.h"
#include "core/format/safetensors_reader.h"
#include "core/io/byte_run.h"
#include "core/util/status.h"

namespace ucp {

class SafetensorsWriter {
 public:
  SafetensorsWriter() = default;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Adds tensor `name` whose bytes are `data`, which the caller keeps alive and unchanged until
  // the last Write() returns. Fails if the name is empty, "__metadata__", not UTF-8 or already
  // added, if the dtype has no safetensors name, or if data.size() != product(shape) × itemsize.
  Status AddFromMemory(std::string name, DType dtype, std::vector<uint64_t> shape,
                       std::span<const std::byte> data);

  // Adds tensor `name` whose bytes are [offset, offset + product(shape) × itemsize) of the file
  // `source`, read when Write() runs (the range is checked then). Same name rules as above.
  Status AddFromFile(std::string name, DType dtype, std::vector<uint64_t> shape, std::string source,
                     uint64_t offset);

  // Adds tensor `name` whose bytes are the concatenation of `runs` (ranges of open files, runs of
  // zeros), copied when Write() runs; every run's File must stay open until the last Write()
  // returns. Same name rules as above; the runs must total product(shape) × itemsize bytes.
  Status AddFromRuns(std::string name, DType dtype, std::vector<uint64_t> shape,
                     std::span<const ByteRun> runs);

  // Sets a "__metadata__" entry (both strings UTF-8).
  Status SetMetadata(std::string key, std::string value);

  // Sum of the tensors' byte sizes.
  uint64_t data_size() const { return data_size_; }

  struct WriteOptions {
    bool sync = true;  // fsync the temporary before the rename
    // When set, called with a byte count as tensor data from files or runs lands (at least
    // every 64 MiB of a long copy).
    std::function<void(uint64_t)> progress;
  };
  // Writes the file to `path` (temporary "<path>.tmp.<pid>", fsync, rename).
  Status Write(const std::string& path) const { return Write(path, WriteOptions{}); }
  Status Write(const std::string& path, const WriteOptions& options) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<uint64_t> shape;
    uint64_t size;
    std::span<const std::byte> memory;  // used when source is empty
    std::string source;
    uint64_t source_offset = 0;
    std::vector<ByteRun> runs;  // used when not empty
  };
  Status Add(Entry entry);
  std::string Header() const;

  std::vector<Entry> entries_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_size_ = 0;
};

// The text of model.safetensors.index.json for `index` ({"metadata": {"total_size": N, ...},
// "weight_map": {...}}, two-space indent, newline-terminated); kInvalidArgument for text that
// is not UTF-8 or metadata that is not JSON.
Result<std::string> SafetensorsIndexJson(const SafetensorsIndex& index);
// Writes SafetensorsIndexJson(index) to `path` (temporary name + rename).
Status WriteSafetensorsIndex(const std::string& path, const SafetensorsIndex& index);

}  // namespace ucp
