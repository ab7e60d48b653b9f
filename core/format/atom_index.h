// The universal atom index: one checkpoint tag described as per-parameter, per-state global
// tensors ("atoms") whose bytes are fragments of the framework's own files.
//
// On disk: `<tag>/.ucp/index.json`, UTF-8 JSON, normative spec in README.md ("The atom index").
// Shape of the document (every field required unless marked optional):
//   {
//     "format": "ucp-atom-index", "version": 1,
//     "framework": {"name": "deepspeed", "version": "0.14.5"},
//     "adapter":   {"name": "deepspeed-zero12", "schema": 1},
//     "tag": "global_step5",
//     "topology":  {"dp": 4, "tp": 1, "pp": 1, "world": 4, "zero_stage": 2},
//     "files":  [{"path": "mp_rank_00_model_states.pt", "size": 123, "xxh3": "0123456789abcdef",
//                 "role": "model_states", "rank": {"dp": 0, "tp": 0, "pp": 0}}, ...],
//     "atoms":  [{"param": "wte.weight", "state": "fp32", "dtype": "float32", "shape": [67, 48],
//                 "fragments": [{"file": 1, "offset": 4096, "dtype": "float32",
//                                "region": {"flat": [0, 3216]}}            // or
//                                "region": {"box": {"offsets": [0, 0], "extents": [34, 48]}}
//                               , ...]}, ...],
//     "groups": [{"params": ["wte.weight", ...], "hyperparameters": {"lr": 0.003, ...},
//                 "scalars": {"step": 5}}],
//     "carried": [{"role": "model_states", "file": 0, "rewritten": ["dp_world_size"]}, ...],
//     "adapter_state": { ...adapter-specific, opaque to core... },
//     "checksum": "0123456789abcdef"
//   }
// "checksum" (optional on read: indexes written before it lack it; always written) is XXH3-64, as
// 16 lower-case hex digits, of the document without it, dumped compactly with members in sorted
// order (nlohmann::json's dump()); a document that no longer hashes to it is refused, so a changed
// offset or shape that still validates is never served.
// "xxh3" is XXH3-64 of the whole file as 16 lower-case hex digits. "rank" is optional (files
// shared by all ranks have none). Paths are relative to the tag directory.
//
// Version 2 adds the atoms store (UCP_MODE=atoms): every atom also held whole, and the carried
// files copied, under one directory of the tag, so the tag can be served once its framework
// files are gone. An index without a store is written as version 1.
//     "store": {"directory": ".ucp/atoms", "max_shard_bytes": 16777216},
//     "files": [..., {"path": ".ucp/atoms/fp32/model.safetensors", ..., "role": "ucp-atoms"},
//                    {"path": ".ucp/atoms/carried.mp_rank_00_model_states.pt", ...,
//                     "role": "ucp-copy", "copy_of": 0}],
//     "atoms": [{..., "consolidated": {"file": 7, "offset": 128}}, ...]
// "consolidated" is the whole atom, row-major, at `offset` of a "ucp-atoms" file; "copy_of"
// marks a byte-identical copy (same size and xxh3) of a framework file. With a store, every atom
// has "consolidated", every carried file has exactly one copy, and the store's files lie in its
// directory; without one, neither member appears.
//
// Version 3 adds chunk hashes to files (optional per file; an index is written as version 3 when
// any file has them): "chunk_bytes" and "chunks", as in the save journal (core/tag/journal.h):
// XXH3-64 of each chunk_bytes-long piece of the file, the last one possibly shorter, 16 lower-case
// hex digits each, concatenated. Readers check the byte ranges they read against them; a file
// without them is checked whole before it is read.
//
// Validation (Create, and therefore Read) establishes, before anything is trusted:
//   - every file path is relative, normalised, inside the tag (no "..", no leading "/", no "."
//     components, no empty components) and listed once;
//   - every (param, state) pair is unique; shapes' element counts fit in 64 bits;
//   - every fragment names an existing file, has the atom's dtype, a region of the atom's
//     shape, and lies within its file: offset + numel × itemsize <= size (checked arithmetic);
//   - the fragments of every atom tile it exactly: every element held once (CheckTiling);
//   - every group param names an atom's param; every carried entry names an existing file;
//   - the store rules above, consolidated ranges within their files (checked arithmetic).
// Members not listed above are rejected (the "version" is the compatibility gate: a reader
// rejects a higher one). Create reports invalid contents as kInvalidArgument; Parse and Read
// report a malformed or invalid document as kCorrupt and a newer version as kUnsupported.
// Errors name the index's source (path or "<memory>") and the JSON field, e.g.
//   atom index /ck/global_step5/.ucp/index.json: atoms[3].fragments[1].offset: beyond the end of
//   file zero_pp_rank_1_mp_rank_00_optim_states.pt (size 130112)
//
// Thread-safety: immutable after Create; concurrent const use is safe.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/format/dtype.h"
#include "core/layout/region.h"
#include "core/util/chunked_xxh3.h"
#include "core/util/status.h"

namespace ucp {

inline constexpr std::string_view kAtomIndexFormat = "ucp-atom-index";
// The newest version this code reads; it writes version 1 unless the index has a store.
inline constexpr uint32_t kAtomIndexVersion = 3;
// The roles of the atoms store's files.
inline constexpr std::string_view kStoreAtomsRole = "ucp-atoms";
inline constexpr std::string_view kStoreCopyRole = "ucp-copy";
// The largest index document any reader loads (a bound on what an untrusted file can make ucp
// allocate).
inline constexpr uint64_t kMaxAtomIndexBytes = uint64_t{1} << 30;
// Where the index of a tag lives, relative to the tag directory.
inline constexpr std::string_view kAtomIndexRelativePath = ".ucp/index.json";
// "<tag_dir>/.ucp/index.json".
inline std::string AtomIndexPath(std::string_view tag_dir) {
  return std::string(tag_dir) + "/" + std::string(kAtomIndexRelativePath);
}

// How a pipeline's layers are placed on the stages of another pp: inferred from the saved
// stages, or PipelineModule's partition_method as the user names it ("uniform", "parameters",
// "type": the 'type:' of the one kind of layer that repeats). A target's only, never indexed.
enum class LayerPartition : uint8_t { kInferred, kUniform, kParameters, kType };

// "uniform", "parameters", "type"; "" for kInferred.
inline std::string_view LayerPartitionName(LayerPartition partition) {
  switch (partition) {
    case LayerPartition::kUniform:
      return "uniform";
    case LayerPartition::kParameters:
      return "parameters";
    case LayerPartition::kType:
      return "type";
    case LayerPartition::kInferred:
      break;
  }
  return "";
}

// The partition a name gives (LayerPartitionName's), or nullopt.
inline std::optional<LayerPartition> ParseLayerPartition(std::string_view name) {
  for (const LayerPartition partition :
       {LayerPartition::kUniform, LayerPartition::kParameters, LayerPartition::kType}) {
    if (name == LayerPartitionName(partition)) return partition;
  }
  return std::nullopt;
}

// The parallel layout a checkpoint was written with (or is wanted in).
struct Topology {
  uint32_t dp = 1;
  uint32_t tp = 1;
  uint32_t pp = 1;
  uint32_t world = 1;
  uint32_t zero_stage = 0;
  // A target's expert-parallel size; 0: the tag's own. Only MoE tags have one (their adapter
  // keeps the source's in adapter_state); an index never stores this field.
  uint32_t ep = 0;
  // A target's layer placement at another pp (kInferred: from the saved stages).
  LayerPartition partition = LayerPartition::kInferred;
  bool operator==(const Topology&) const = default;
};

// A rank's coordinates in a Topology.
struct RankCoordinates {
  uint32_t dp = 0;
  uint32_t tp = 0;
  uint32_t pp = 0;
  bool operator==(const RankCoordinates&) const = default;
};

// One file of the tag.
struct IndexedFile {
  std::string path;  // relative to the tag directory
  uint64_t size = 0;
  uint64_t xxh3 = 0;  // XXH3-64 of the whole file
  std::string role;   // adapter-defined: "model_states", "optim_states", ...; or a store role
  std::optional<RankCoordinates> rank;
  std::optional<uint32_t> copy_of = std::nullopt;  // a store copy of files[*copy_of]
  ChunkHashes chunks = {};  // version 3; none recorded: readers check the whole file
};

// A piece of an atom stored contiguously in a file: the elements of `region`, in the region's
// storage order (region.h), starting at byte `offset` of file `file`.
struct Fragment {
  uint32_t file = 0;  // index into AtomIndexContents::files
  uint64_t offset = 0;
  DType dtype = DType::kFloat32;
  Region region;
};

// Where the atoms store holds a whole atom: row-major at byte `offset` of file `file`.
struct ConsolidatedCopy {
  uint32_t file = 0;
  uint64_t offset = 0;
  bool operator==(const ConsolidatedCopy&) const = default;
};

// One global tensor: state `state` ("fp32", "bit16", "exp_avg", "exp_avg_sq", "step", ...) of
// parameter `param`.
struct Atom {
  std::string param;
  std::string state;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<Fragment> fragments;
  std::optional<ConsolidatedCopy> consolidated = std::nullopt;  // exactly when there is a store
};

// The atoms store (UCP_MODE=atoms): a directory of the tag holding every atom whole, as
// safetensors files sharded at `max_shard_bytes` (what `ucp export --format safetensors
// --state S --max-shard-size max_shard_bytes` writes, one subdirectory per state), and a copy of
// every carried file.
struct AtomsStore {
  std::string directory;  // relative to the tag, e.g. ".ucp/atoms"
  uint64_t max_shard_bytes = 0;
};

// One optimizer parameter group.
struct ParamGroup {
  std::vector<std::string> params;  // in the framework's order (flat-buffer order for ZeRO)
  nlohmann::json hyperparameters = nlohmann::json::object();  // lr, betas, eps, ...
  nlohmann::json scalars = nlohmann::json::object();          // per-group counters, e.g. step
};

// How a file of another topology gets its non-tensor objects: from the pickle of source file
// `file`, with the objects at `rewritten` (adapter-defined paths) recomputed for that topology
// and everything else carried unchanged.
struct CarriedObject {
  std::string role;
  uint32_t file = 0;
  std::vector<std::string> rewritten;
};

// Everything an index says, as plain data (what Create validates).
struct AtomIndexContents {
  std::string framework;
  std::string framework_version;
  std::string adapter;
  uint32_t adapter_schema = 1;
  std::string tag;
  Topology topology;
  std::vector<IndexedFile> files;
  std::vector<Atom> atoms;
  std::vector<ParamGroup> groups;
  std::vector<CarriedObject> carried;
  nlohmann::json adapter_state = nlohmann::json::object();
  std::optional<AtomsStore> store;
};

class AtomIndex {
 public:
  // Validates `contents` (see the file comment); `source` names it in errors.
  static Result<AtomIndex> Create(AtomIndexContents contents, std::string source = "<memory>");
  // Parses and validates a JSON document.
  static Result<AtomIndex> Parse(std::string_view json, std::string source);
  // Reads `path` (bounded: kOutOfRange above kMaxAtomIndexBytes) and parses it.
  static Result<AtomIndex> Read(const std::string& path);

  AtomIndex(AtomIndex&&) = default;
  AtomIndex& operator=(AtomIndex&&) = default;
  AtomIndex(const AtomIndex&) = delete;
  AtomIndex& operator=(const AtomIndex&) = delete;

  const AtomIndexContents& contents() const { return contents_; }
  const std::vector<IndexedFile>& files() const { return contents_.files; }
  const std::vector<Atom>& atoms() const { return contents_.atoms; }
  // The atom (param, state), or nullptr.
  const Atom* Find(std::string_view param, std::string_view state) const;
  // The file with relative path `path`, or nullptr.
  const IndexedFile* FindFile(std::string_view path) const;
  // True for a file of the atoms store (a consolidated file or a copy).
  static bool IsStoreFile(const IndexedFile& file);

  // The same state read from the atoms store alone: every atom has one fragment, its
  // consolidated copy; every carried file is replaced by its copy (same index, role and rank,
  // the copy's path); the other framework files stay listed but nothing refers to them; no
  // store. Plans made against it read only store files. kFailedPrecondition without a store.
  Result<AtomIndex> OverStore() const;

  // The JSON document (deterministic: same contents, same bytes).
  std::string ToJson() const;
  // Writes ToJson() to `path` atomically: temporary name in the same directory, fsync, rename,
  // fsync of the directory. Creates the parent directory when missing.
  Status Write(const std::string& path) const;

 private:
  explicit AtomIndex(AtomIndexContents contents) : contents_(std::move(contents)) {}

  AtomIndexContents contents_;
  std::map<std::pair<std::string, std::string>, size_t, std::less<>> atom_by_name_;
  std::map<std::string, size_t, std::less<>> file_by_path_;
};

// The atoms with bytes in [begin, end) of file `file` of `index`, for messages about damage there:
// "exp_avg of wte.weight, fp32 of wte.weight" (the first four, then "and N more"); "" when none.
std::string AtomsWithin(const AtomIndex& index, uint32_t file, uint64_t begin, uint64_t end);

}  // namespace ucp
