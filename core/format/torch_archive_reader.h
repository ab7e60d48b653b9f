// TorchArchiveReader: a torch.save file (zip format, torch >= 1.6) as an object tree whose tensors
// are located in the file, without reading tensor data.
//
// Byte layout (records of the zip container, see zip_reader.h; "<root>" is the archive folder,
// the saved file's stem in torch 1.x, "archive" in newer torch):
//   <root>/data.pkl              pickle (protocol 2) of the saved object; each storage appears
//                                as persistent id ('storage', torch.<Type>Storage, key: str,
//                                location: str, numel: int)
//   <root>/data/<key>            a storage's raw bytes, little-endian, 64-byte aligned in the file
//   <root>/byteorder             optional, "little" (torch >= 2.x); "big" is kUnsupported
//   <root>/.format_version, .storage_alignment, .data/serialization_id   optional (newer torch)
//   <root>/version               "3\n" in torch 1.13
// Tensors are reductions in data.pkl:
//   torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
//                                   backward_hooks[, metadata])
//   torch._utils._rebuild_tensor(storage, storage_offset, size, stride)
//   torch._utils._rebuild_parameter(tensor, requires_grad, backward_hooks)
//   torch._utils._rebuild_parameter_with_state(tensor, requires_grad, backward_hooks, state)
//   torch._tensor._rebuild_from_type_v2(torch._utils._rebuild_tensor_v2, torch.Tensor,
//                                       (rebuild args...), attributes)   (torch 2.x: a plain
//                                       tensor with Python attributes; they are carried)
// All other torch._utils._rebuild_* forms (quantized, sparse, meta, ...) are carried as opaque
// objects: they are listed in unsupported_tensors() and written back unchanged.
//
// What Open guarantees: every storage referenced by a tensor has a data/<key> record whose size
// is numel × itemsize of its storage type; every tensor's elements (storage_offset, shape,
// stride, computed with checked arithmetic) lie within its storage; one key is never used with
// two dtypes.
//
// Thread-safety: immutable after Open (except through mutable_graph()); concurrent const use is
// safe. Call order: Open, then any accessor.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/format/dtype.h"
#include "core/format/pickle_reader.h"
#include "core/format/pickle_value.h"
#include "core/format/zip_reader.h"
#include "core/util/status.h"

namespace ucp {

// One storage of the archive: the data/<key> record.
struct TorchStorage {
  std::string key;       // "0", "1", ...
  DType dtype;           // element layout of the pickled storage type (StorageElementType)
  std::string location;  // "cpu", "cuda:0", ...
  uint64_t numel;        // elements, as pickled
  uint64_t offset;       // absolute file offset of the record's data
  uint64_t size;         // bytes (= numel × ItemSize(dtype))
  uint32_t crc32;        // from the zip central directory
};

// One tensor leaf: a view (storage_offset, shape, stride in elements) into a storage.
struct TorchTensor {
  const pickle::Value* node;  // the reduction: _rebuild_tensor*(...) or _rebuild_parameter*(...)
  const TorchStorage* storage;
  DType dtype;
  uint64_t storage_offset;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> stride;
  bool requires_grad;
  bool parameter;  // built by _rebuild_parameter*

  uint64_t numel() const;
  // numel × itemsize: the bytes of the tensor's own elements.
  uint64_t byte_size() const;
  // Absolute file offset of element 0 (storage data offset + storage_offset × itemsize).
  uint64_t file_offset() const;
  // True when the elements are laid out row-major without gaps (strides of a contiguous tensor;
  // size-1 dimensions' strides do not matter), i.e. they are bytes [file_offset, + byte_size).
  bool contiguous() const;
};

class TorchArchiveReader {
 public:
  struct Limits {
    ZipReader::Limits zip;
    pickle::ReadLimits pickle;
    uint64_t max_pickle_bytes = uint64_t{1} << 31;
    uint32_t max_dims = 64;
  };

  // Opens `path`, reads the zip directory and data.pkl, and locates every storage and tensor.
  static Result<TorchArchiveReader> Open(std::string path, const Limits& limits);
  static Result<TorchArchiveReader> Open(std::string path) { return Open(std::move(path), {}); }
  // Same over an already opened file (the reader takes it); its path() names it in messages.
  static Result<TorchArchiveReader> Open(File file, const Limits& limits);

  TorchArchiveReader(TorchArchiveReader&&) = default;
  TorchArchiveReader& operator=(TorchArchiveReader&&) = default;
  TorchArchiveReader(const TorchArchiveReader&) = delete;
  TorchArchiveReader& operator=(const TorchArchiveReader&) = delete;

  const std::string& path() const { return zip_.path(); }
  const ZipReader& zip() const { return zip_; }
  const std::string& archive_name() const { return zip_.archive_name(); }
  // The unpickled data.pkl. Tensors point into it: mutating nodes they point to invalidates them.
  const pickle::Graph& graph() const { return graph_; }
  pickle::Graph& mutable_graph() { return graph_; }
  const pickle::Value* root() const { return graph_.root(); }

  // Storages by key, in key order as torch writes them (string order: "0" < "1" < "10" < "2").
  const std::map<std::string, TorchStorage>& storages() const { return storages_; }
  // Tensors in order of first appearance in the pickle.
  const std::vector<TorchTensor>& tensors() const { return tensors_; }
  // The tensor whose reduction node is `node`, or nullptr. For a parameter both the
  // _rebuild_parameter node and its inner _rebuild_tensor_v2 node map to the parameter.
  const TorchTensor* TensorAt(const pickle::Value* node) const;
  // Reductions by torch._utils._rebuild_* functions this reader does not interpret.
  const std::vector<const pickle::Value*>& unsupported_tensors() const { return unsupported_; }

  // The node at `path`: components separated by '/', each a dict key (str keys by text, int
  // keys by their decimal text), a list/tuple index, or an attribute of an object's BUILD state
  // dict (argparse.Namespace, custom classes). "" is the root. kNotFound names the first
  // component that does not resolve.
  Result<const pickle::Value*> Find(std::string_view path) const;

  // Reads `length` bytes at byte `offset` of `storage` (ranged read of the record).
  Status ReadStorage(const TorchStorage& storage, uint64_t offset, std::span<std::byte> out) const;

 private:
  explicit TorchArchiveReader(ZipReader zip) : zip_(std::move(zip)) {}
  Status Locate(const Limits& limits);
  Result<const TorchStorage*> StorageOf(const pickle::Value* pid);
  // `node` is what TensorAt answers for, `rebuild` its _rebuild_tensor* reduction (the same
  // node, or the one a parameter wraps), `args` the rebuild's arguments.
  Status AddTensor(const pickle::Value* node, const pickle::Value* rebuild,
                   const pickle::Value* args, bool v2, bool parameter, bool requires_grad,
                   const Limits& limits);

  ZipReader zip_;
  pickle::Graph graph_;
  std::map<std::string, TorchStorage> storages_;
  std::vector<TorchTensor> tensors_;
  std::unordered_map<const pickle::Value*, size_t> tensor_by_node_;
  std::vector<const pickle::Value*> unsupported_;
};

// Children of `node` for path navigation and display: a dict's or OrderedDict's entries, a
// list's/tuple's items with their index as key, an object's BUILD-state dict entries. Other
// nodes have none.
std::vector<std::pair<std::string, const pickle::Value*>> NamedChildren(const pickle::Value* node);

// The decimal or text form of a dict key used in paths: str as is, int in base 10, others
// rendered as "<kind>".
std::string KeyText(const pickle::Value* key);

}  // namespace ucp
