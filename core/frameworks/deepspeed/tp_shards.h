// Tensor-parallel shard maps of DeepSpeed checkpoints: how the TP slices of a parameter make its
// atom (the whole parameter), as rules (replicated, averaged, split on a dimension into
// sub-parameters, a padded vocabulary), the geometry of the slices at a TP degree, and the mapping
// of a range of a slice's elements to regions of the atom. The adapters of tensor-parallel layouts
// (deepspeed-tp: Megatron-DeepSpeed; deepspeed-zero3: AutoTP) read their rules from the files and
// share these.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/layout/region.h"
#include "core/plan/copy_plan.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

// The model states' entry of a client's TP rules (Megatron-DeepSpeed, AutoTP).
inline constexpr std::string_view kUniversalCheckpointInfo = "universal_checkpoint_info";

// kUnnamed: no pattern names the parameter and the tag has one TP rank, so nothing tells whether
// it is split or replicated; whole at tp = 1, refused at tp > 1.
enum class Rule { kReplicated, kAveraged, kSplit, kUnnamed };
// Which keys ds_to_universal writes beside 'param'.
enum class UniversalForm { kNone, kCatDim, kNSubParams, kSubParamShape };

struct ShardMap {
  Rule rule = Rule::kReplicated;
  uint32_t dim = 0;
  std::vector<uint64_t> sub_params;  // kSplit: global extents along dim
  bool vocab = false;
  UniversalForm universal = UniversalForm::kNone;
  uint32_t sub_param_shape = 0;  // kSubParamShape: entry of parameter_with_sub_params
  // kSplit where AutoTP split a sub-parameter unevenly: each TP rank's extent along dim at the
  // tag's degree, sub-parameter by sub-parameter (tp extents each, in rank order); empty where it
  // split every sub-parameter in equal blocks.
  std::vector<uint64_t> blocks;
};

struct Vocab {
  uint64_t original = 0;
  uint64_t padded = 0;
  uint64_t divisible_by = 1;
};

// Megatron's _vocab_size_with_padding: `original` rounded up to a multiple of divisible_by · tp.
Result<uint64_t> PaddedVocab(const Vocab& vocab, uint32_t tp);

constexpr const char* RuleName(Rule rule) {
  switch (rule) {
    case Rule::kReplicated:
      return "replicated";
    case Rule::kAveraged:
      return "averaged";
    case Rule::kSplit:
      return "split";
    case Rule::kUnnamed:
      return "unnamed";
  }
  return "";
}

constexpr const char* FormName(UniversalForm form) {
  switch (form) {
    case UniversalForm::kNone:
      return "none";
    case UniversalForm::kCatDim:
      return "cat_dim";
    case UniversalForm::kNSubParams:
      return "n_sub_params";
    case UniversalForm::kSubParamShape:
      return "sub_param_shape";
  }
  return "";
}

// The map as the index's adapter_state keeps it, and back (kCorrupt naming the parameter).
nlohmann::json MapJson(const ShardMap& map);
Result<ShardMap> MapFromJson(const std::string& name, const nlohmann::json& json);

// A parameter's slices at TP degree `tp`: each rank's local shape (rank 0's where `blocks` are
// uneven: LocalShape gives each rank's), the atom's shape, the global extents of the
// sub-parameters along the split dimension (vocabulary: padded for tp), and for one sub-parameter
// split unevenly each rank's extent along it.
struct Geometry {
  uint32_t tp = 1;
  Shape local;
  Shape atom;
  std::vector<uint64_t> sub_params;
  std::vector<uint64_t> blocks;  // uneven: as ShardMap::blocks, at tp
  uint32_t dim = 0;
};

// TP rank t's local shape.
Shape LocalShape(const Geometry& g, uint32_t t);

// Sets map.blocks to `blocks` (as ShardMap::blocks: each sub-parameter's extents in rank order)
// where a sub-parameter's are not all equal, else to none (equal parts).
void SetBlocks(ShardMap& map, std::vector<uint64_t> blocks);

// Each TP rank's extent along the split dimension of sub-parameter `part` of `g`, a kSplit
// geometry.
std::vector<uint64_t> SplitBlocks(const Geometry& g, size_t part);

// The geometry of a parameter of shape `shape` that every one of `tp` ranks holds whole.
Geometry WholeGeometry(uint32_t tp, const Shape& shape);

// The geometry of `map`'s slices of an atom of shape `atom` at TP degree `tp`: equal parts of each
// sub-parameter, or the `blocks` given (as ShardMap::blocks, not of a vocabulary: tp extents of
// each sub-parameter, none empty, summing to its size). A vocabulary is padded to `vocab`'s size at
// tp, its atom holding the original rows or some of the padding rows after them (a ZeRO-3 save of
// one TP rank keeps them): the rows past the atom's are zeros. kUnsupported for an unnamed
// parameter at tp > 1 and for sub-parameters that do not split evenly; kCorrupt for blocks that do
// not fit.
Result<Geometry> GeometryAt(const std::string& name, const ShardMap& map, const Shape& atom,
                            uint32_t tp, const std::optional<Vocab>& vocab,
                            const std::vector<uint64_t>& blocks = {});

// A run of `count` elements of a TP slice, in the slice's order: where they are in the atom
// (nullopt: vocabulary padding rows, in no atom).
struct GlobalRun {
  std::optional<Region> region;
  uint64_t count = 0;
};

// Local elements [begin, end) of TP rank t's slice (geometry `g` of `map`) as runs of the atom.
Result<std::vector<GlobalRun>> MapLocalRange(const ShardMap& map, const Geometry& g, uint32_t t,
                                             uint64_t begin, uint64_t end);

// Fragments of `atom` (of `map`, source geometry `geometry`) from TP rank t's local elements
// [begin, end) stored from byte `byte` of index file `file`.
Status AddSliceFragments(Atom& atom, const ShardMap& map, const Geometry& geometry, uint32_t t,
                         uint64_t begin, uint64_t end, uint32_t file, uint64_t byte, DType dtype);

// Appends to `segments` the bytes of TP rank t's local elements [begin, end) of `atom` (of
// `map`, target geometry `geometry`): the atom's bytes, zeros for vocabulary padding rows.
Status AppendSliceSegments(const AtomIndex& index, const Atom& atom, const ShardMap& map,
                           const Geometry& geometry, uint32_t t, uint64_t begin, uint64_t end,
                           std::vector<Segment>& segments);

// Appends the bytes of local elements [begin, end) of TP rank t's slice (geometry `geometry`) of
// parameter `name`'s state `state` (of `map`); vocabulary padding rows are zeros.
Status SliceSegments(const AtomIndex& index, const ShardMap& map, const std::string& name,
                     const Geometry& geometry, uint32_t t, std::string_view state, uint64_t begin,
                     uint64_t end, std::vector<Segment>& segments);

// A parameter group laid out for one target TP rank: each parameter's geometry at the target's
// degree, the rank's flat layout of its local shapes, and its partition over the DP ranks.
struct TargetGroup {
  GroupLayout layout;
  std::vector<Geometry> geometry;
  Partitioning partition;
};

// The group of parameters `names` (in flat order) for TP rank t at TP degree tp (`maps` at that
// degree), partitioned over dp ranks.
Result<TargetGroup> TargetGroupAt(const AtomIndex& index,
                                  const std::map<std::string, ShardMap>& maps,
                                  const std::optional<Vocab>& vocab,
                                  const std::vector<std::string>& names, uint32_t tp, uint32_t t,
                                  uint32_t dp);

// Bytes of elements [begin, end) (end <= total) of state `state`'s flat buffer of TP rank t.
Result<std::vector<Segment>> SliceFlatSegments(const AtomIndex& index,
                                               const std::map<std::string, ShardMap>& maps,
                                               const TargetGroup& group, uint32_t t,
                                               std::string_view state, uint64_t begin,
                                               uint64_t end);

}  // namespace ucp::deepspeed
