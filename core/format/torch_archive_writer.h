// TorchArchiveWriter: writes a torch.save file (layout: torch_archive_reader.h) from a pickle
// object tree whose storages are backed by byte ranges of other files or by memory.
//
// Layout written, as torch 1.13's torch.save writes it (through ZipWriter: stored records,
// data 64-byte aligned, ZIP64 end records):
//   <stem>/data.pkl      protocol 2 pickle of the tree (pickle_writer.h)
//   <stem>/data/<key>    one record per storage, keys in string order ("0" "1" "10" "2")
//   <stem>/version       "3\n"
// where <stem> is the file name without its last extension (Options::archive_name overrides).
// The tree is written as given: objects ucp does not interpret are carried unchanged.
//
// Atomicity: as ZipWriter (temporary file, fsync, rename): `path` is untouched or complete.
//
// Thread-safety: none; one thread drives a writer. Call order: Create → AddStorage* → Finish.
// Storage bytes are read and written in Finish, through ZipWriter's bounded copy buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/format/dtype.h"
#include "core/format/pickle_value.h"
#include "core/format/zip_writer.h"
#include "core/io/byte_run.h"
#include "core/io/file.h"
#include "core/util/status.h"

namespace ucp {

class TorchArchiveReader;

class TorchArchiveWriter {
 public:
  struct Options {
    std::string archive_name;  // empty: the stem of the path
    bool sync = true;          // fsync before the rename (ZipWriter::Options::sync)
    size_t copy_buffer_bytes = ZipWriter::Options{}.copy_buffer_bytes;  // ZipWriter's
    std::function<void(uint64_t)> progress;  // storage bytes written (ZipWriter::Options)
  };

  static Result<TorchArchiveWriter> Create(std::string path, Options options);
  static Result<TorchArchiveWriter> Create(std::string path) {
    return Create(std::move(path), Options{});
  }

  TorchArchiveWriter(TorchArchiveWriter&&) = default;
  TorchArchiveWriter& operator=(TorchArchiveWriter&&) = delete;
  TorchArchiveWriter(const TorchArchiveWriter&) = delete;
  TorchArchiveWriter& operator=(const TorchArchiveWriter&) = delete;

  // Storage `key` holds bytes [offset, offset + size) of `source`, which must stay open until
  // Finish returns. With `crc32` known (e.g. from the source archive's directory) the bytes move
  // in the kernel without being read. A key may be added once.
  Status AddStorageFromFile(std::string key, const File& source, uint64_t offset, uint64_t size,
                            std::optional<uint32_t> crc32 = std::nullopt);
  // Storage `key` holds the concatenation of `runs` (ranges of open files, runs of zeros); every
  // run's File must stay open until Finish returns. Its bytes are read and CRC'd in Finish.
  Status AddStorageFromRuns(std::string key, std::span<const ByteRun> runs);
  // Storage `key` holds `data`, kept alive and unchanged by the caller until Finish returns.
  Status AddStorageFromMemory(std::string key, std::span<const std::byte> data);

  // Pickles `root` and writes the archive. Every storage persistent id in the tree must name an
  // added key whose byte size is numel × itemsize of its storage type, and every added key must
  // be referenced (kInvalidArgument otherwise). Returns the archive's size.
  Result<uint64_t> Finish(const pickle::Value* root);

  // The size Finish would return for an archive at `path` (`options.archive_name` as in Create)
  // of `root` whose storages have these byte sizes, computed without reading or writing a
  // storage byte: `root` is pickled in memory, the zip layout is ZipWriter::PlannedSize.
  static Result<uint64_t> PlannedSize(const std::string& path, const Options& options,
                                      const pickle::Value* root,
                                      const std::map<std::string, uint64_t>& storage_sizes);

  // An archive whose storages' bytes several processes write into one file (ZipWriter's parts):
  // where each storage's data starts in the archive Finish would write (arguments as for
  // PlannedSize).
  static Result<std::map<std::string, uint64_t>> PlannedStorageOffsets(
      const std::string& path, const Options& options, const pickle::Value* root,
      const std::map<std::string, uint64_t>& storage_sizes);
  // Completes that archive in `file`, where every storage's bytes were written and
  // `storage_crcs` holds each one's CRC-32: data.pkl, version, the headers and the directory
  // (ZipWriter::FinishParts), then `file` renamed to `path`. Returns the archive's size.
  static Result<uint64_t> FinishParts(const std::string& path, const Options& options,
                                      const pickle::Value* root,
                                      const std::map<std::string, uint64_t>& storage_sizes,
                                      const std::map<std::string, uint32_t>& storage_crcs,
                                      File file);

 private:
  struct Source {
    const File* file = nullptr;  // null: memory, or `runs` when there are any
    uint64_t offset = 0;
    uint64_t size = 0;
    std::optional<uint32_t> crc32;
    std::span<const std::byte> memory;
    std::vector<ByteRun> runs;
  };
  TorchArchiveWriter(std::string path, ZipWriter zip)
      : path_(std::move(path)), zip_(std::move(zip)) {}
  Status AddSource(std::string key, Source source);

  std::string path_;
  ZipWriter zip_;
  std::map<std::string, Source> sources_;
};

// Writes `reader`'s object tree (as it is now, e.g. after edits through mutable_graph()) to
// `path`, every storage streamed from the reader's file ranges. Returns the archive's size.
Result<uint64_t> RewriteArchive(const TorchArchiveReader& reader, std::string path,
                                TorchArchiveWriter::Options options = {});

// What a new tensor leaf looks like; MakeTensorNode turns it into pickle nodes.
struct TensorNodeSpec {
  std::string storage_key;
  DType dtype = DType::kFloat32;
  std::string location = "cpu";
  uint64_t storage_numel = 0;
  uint64_t storage_offset = 0;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> stride;  // empty: contiguous (row-major) strides
  bool requires_grad = false;
  bool parameter = false;  // wrap in torch._utils._rebuild_parameter
};

// Builds, in `graph`, the reduction torch.save pickles for such a tensor:
// _rebuild_tensor_v2(('storage', torch.<T>Storage, key, location, numel), offset, size, stride,
// requires_grad, OrderedDict()), wrapped in _rebuild_parameter(tensor, requires_grad,
// OrderedDict()) for a parameter. kUnsupported for a dtype torch 1.13 has no storage type for.
Result<pickle::Value*> MakeTensorNode(pickle::Graph& graph, const TensorNodeSpec& spec);

}  // namespace ucp
