#include "core/frameworks/deepspeed/zero3.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "core/format/torch_archive_reader.h"
#include "core/format/torch_archive_writer.h"
#include "core/frameworks/deepspeed/autoep.h"
#include "core/frameworks/deepspeed/autotp.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/frameworks/deepspeed/folding.h"
#include "core/frameworks/deepspeed/megatron_rules.h"
#include "core/frameworks/deepspeed/tp_shards.h"
#include "core/plan/copy_plan.h"
#include "core/tag/file_hashing.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using deepspeed::AddSliceFragments;
using deepspeed::AppendSliceSegments;
using deepspeed::AutoTpMaps;
using deepspeed::AutoTpSplitRule;
using deepspeed::Bf16Prefix;
using deepspeed::CheckFolding;
using deepspeed::CheckIndexAdapter;
using deepspeed::CheckTarget;
using deepspeed::CollectRequiresGrad;
using deepspeed::CollectStorages;
using deepspeed::DpWorldSize;
using deepspeed::ExpertRankOrder;
using deepspeed::Field;
using deepspeed::FieldError;
using deepspeed::Geometry;
using deepspeed::GeometryAt;
using deepspeed::GroupLayout;
using deepspeed::HasAutoTpMaps;
using deepspeed::IntField;
using deepspeed::IntList;
using deepspeed::JsonOf;
using deepspeed::kAutoEpLayers;
using deepspeed::kDataBeforeExpert;
using deepspeed::kMaxExperts;
using deepspeed::kModelRole;
using deepspeed::kOptimRole;
using deepspeed::kOsd;
using deepspeed::kUniversalRole;
using deepspeed::ListTag;
using deepspeed::ListTagToRead;
using deepspeed::LocalShape;
using deepspeed::MakeLayout;
using deepspeed::MapBlocksAtDegree;
using deepspeed::MapFromJson;
using deepspeed::MapJson;
using deepspeed::OpenSource;
using deepspeed::OpenWrittenModelStates;
using deepspeed::OptimName;
using deepspeed::OptionalField;
using deepspeed::PartitionTensor;
using deepspeed::Prefix;
using deepspeed::RankFile;
using deepspeed::ReadAutoEpLayers;
using deepspeed::ReadAutoTpMaps;
using deepspeed::ReadAutoTpSplitRule;
using deepspeed::RefuseExpertParallel;
using deepspeed::Rule;
using deepspeed::ScalarValue;
using deepspeed::SetAutoEpLayers;
using deepspeed::SetAutoTpSize;
using deepspeed::SetBlocks;
using deepspeed::SetConfigValue;
using deepspeed::SetDictItem;
using deepspeed::SetTpDegree;
using deepspeed::ShapeNodeLike;
using deepspeed::ShapeOf;
using deepspeed::ShapeText;
using deepspeed::ShardMap;
using deepspeed::StrField;
using deepspeed::TagListing;
using deepspeed::TagName;
using deepspeed::TensorLike;
using deepspeed::UniversalAtomArchive;
using deepspeed::Vocab;
using deepspeed::WholeGeometry;
using deepspeed::Zero3ModelStatesName;
using deepspeed::ZeroStageOf;
using pickle::Kind;
using pickle::Value;

constexpr std::string_view kOptimizer = "DeepSpeedZeroOptimizer_Stage3";
// DeepSpeedZeroConfig.sub_group_size's default (pp_int(1e9)).
constexpr uint64_t kDefaultSubGroupSize = 1000000000;
constexpr std::string_view kFrozenState = "bit16";
// Bounds a corrupt mp_world_size before it sizes the per-rank file lists.
constexpr int64_t kMaxTpDegree = int64_t{1} << 16;
// AutoEP's checkpoint_format of experts that ZeRO-3 partitions over the expert-data-parallel ranks.
constexpr std::string_view kAutoEpZero3Format = "zero3_partitioned";
// The optimizer states' record of each flat group's partitioning (AutoEP tags only).
constexpr std::string_view kPartitionGroups = "ds_zero_partition_groups";
// ds_to_universal's universal_checkpoint_info/expert_parameter_patterns for a ZeRO-3 AutoEP tag.
constexpr std::string_view kZero3ExpertPattern = ".*\\.experts\\.w[123]$";

// ---------------------------------------------------------------------------------------------
// DeepSpeed's ZeRO-3 partitioning rules.

// Elements per rank of a parameter of `numel` elements at DP size `dp` (ceil(numel / dp)).
uint64_t PieceOf(uint64_t numel, uint32_t dp) { return numel / dp + (numel % dp != 0 ? 1 : 0); }

// One flat group at one DP size: where each parameter's piece sits in a rank's partition.
struct FlatLayout {
  GroupLayout params;
  std::vector<uint64_t> pieces;  // c_k
  std::vector<uint64_t> starts;  // element offset of piece k in the partition
  uint64_t partition = 0;        // P: Σ c_k
  uint32_t dp = 1;
};

Result<FlatLayout> LayoutAt(const GroupLayout& params, uint32_t dp) {
  FlatLayout out;
  out.params = params;
  out.dp = dp;
  for (const uint64_t numel : params.numels) {
    const uint64_t piece = PieceOf(numel, dp);
    out.starts.push_back(out.partition);
    out.pieces.push_back(piece);
    const std::optional<uint64_t> total = CheckedAdd(out.partition, piece);
    if (!total) return Status::OutOfRange("deepspeed: flat group: more than 2^64 elements");
    out.partition = *total;
  }
  return out;
}

// DeepSpeed's _create_fp16_sub_groups: the parameters of one optimizer group (their partition
// elements at `dp`), split where a sub group's elements reach `sub_group_size`. Returns the
// number of parameters of each sub group.
std::vector<size_t> SubGroupSizes(const std::vector<uint64_t>& numels, uint32_t dp,
                                  uint64_t sub_group_size) {
  uint64_t total = 0;
  for (const uint64_t numel : numels) total += PieceOf(numel, dp);
  if (sub_group_size >= total) return {numels.size()};
  std::vector<size_t> sizes;
  size_t count = 0;
  uint64_t elements = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    ++count;
    elements += PieceOf(numels[k], dp);
    if (elements >= sub_group_size || k + 1 == numels.size()) {
      sizes.push_back(count);
      count = 0;
      elements = 0;
    }
  }
  return sizes;
}

// Where TP rank t's slice of a parameter is in its atom (at tp = 1: the whole atom).
struct Slice {
  const ShardMap* map = nullptr;
  const Geometry* geometry = nullptr;
  uint32_t t = 0;
};

// The bytes of DP rank r's piece of state `state` of a TP slice of a parameter (`numel` elements
// in the slice; c elements of `item` bytes at DP size `dp`): its real elements from the atom,
// zeros for the padding.
Result<std::vector<Segment>> PieceSegments(const AtomIndex& index, const std::string& name,
                                           std::string_view state, uint64_t numel, uint32_t dp,
                                           uint32_t r, uint64_t item, const Slice& slice) {
  const Atom* atom = index.Find(name, state);
  if (atom == nullptr) {
    return Status::Corrupt("deepspeed: index: no atom " + name + "/" + std::string(state));
  }
  const uint64_t piece = PieceOf(numel, dp);
  const uint64_t lo = std::min(uint64_t{r} * piece, numel);
  const uint64_t hi = std::min(lo + piece, numel);
  std::vector<Segment> segments;
  if (lo < hi) {
    UCP_RETURN_IF_ERROR(
        AppendSliceSegments(index, *atom, *slice.map, *slice.geometry, slice.t, lo, hi, segments));
  }
  AppendZeros(segments, (piece - (hi - lo)) * item);
  return segments;
}

// Fragments of param k of a flat group from TP rank t's slice of it (`map` and `geometry` say
// where the slice's elements are in the parameter): each DP rank's real elements, at the byte of
// that rank's tensor where its piece starts.
Status AddPieceFragments(Atom& atom, const FlatLayout& layout, size_t k,
                         const std::vector<std::pair<uint32_t, const TorchTensor*>>& per_rank,
                         const ShardMap& map, const Geometry& geometry, uint32_t t) {
  const uint64_t numel = layout.params.numels[k];
  const uint64_t piece = layout.pieces[k];
  for (uint32_t r = 0; r < per_rank.size(); ++r) {
    const uint64_t lo = std::min(uint64_t{r} * piece, numel);
    const uint64_t hi = std::min(lo + piece, numel);
    if (lo >= hi) continue;
    const auto& [file, tensor] = per_rank[r];
    const std::optional<uint64_t> byte = CheckedMul(layout.starts[k], ItemSize(tensor->dtype));
    const std::optional<uint64_t> offset =
        byte ? CheckedAdd(tensor->file_offset(), *byte) : std::nullopt;
    if (!offset) {
      return Status::OutOfRange("deepspeed: " + atom.param + "/" + atom.state +
                                ": offset overflow");
    }
    UCP_RETURN_IF_ERROR(
        AddSliceFragments(atom, map, geometry, t, lo, hi, file, *offset, tensor->dtype));
  }
  return Status::Ok();
}

// The value of entry `key` (by KeyText: str keys by text, int keys in decimal) of a dict, or of
// an OrderedDict's items; nullptr when absent.
Value** MutableEntry(Value* node, std::string_view key) {
  if (node == nullptr) return nullptr;
  if (node->kind() == Kind::kDict) {
    for (auto& [k, value] : node->mutable_entries()) {
      if (KeyText(k) == key) return &value;
    }
  } else if (node->kind() == Kind::kObject) {
    for (pickle::Mutation& mutation : node->mutable_mutations()) {
      if (mutation.op == pickle::Mutation::Op::kSetItem && KeyText(mutation.first) == key) {
        return &mutation.second;
      }
    }
  }
  return nullptr;
}

// How a tag's flat groups are partitioned. Without AutoEP every flat group is over the DP ranks of
// its TP rank. AutoEP (DeepSpeed 0.19, checkpoint_format zero3_partitioned) gives each
// expert-parallel rank e its layers' experts [e·n, (e+1)·n) as fused parameters of n rows
// ("<experts module>.w1", ..., the same names on every rank), in flat groups of their own that
// ZeRO-3 partitions over e's expert-data-parallel ranks alone (ExpertRankOrder). With AutoTP
// DeepSpeed folds the expert ranks over the whole world (folding.h's grid): rank (t, r), TP rank t
// of DP rank r, is world rank r·tp + t, and the experts are not split over TP.
struct ExpertPlacement {
  uint32_t ep = 0;  // 0: no AutoEP layers
  uint32_t tp = 1;
  ExpertRankOrder order;                    // over the world's dp·tp ranks
  std::map<std::string, uint32_t> experts;  // fused expert parameter → its layer's experts
  std::vector<bool> expert_groups;          // per flat group: of fused expert parameters

  // DeepSpeed's folded grid of these ranks (at tp 1 its one lane).
  deepspeed::FoldedGrid Grid() const { return {order.dp, tp, order.ep, order.data_before_expert}; }
  uint32_t Dp() const { return Grid().DenseDp(); }
  uint32_t WorldRank(uint32_t t, uint32_t r) const { return Grid().Rank(r, t); }
  bool IsExpertGroup(size_t g) const { return g < expert_groups.size() && expert_groups[g]; }
  // The ranks an expert group is partitioned over: an expert-parallel rank's.
  uint32_t ExpertPartitionCount() const { return order.dp / order.ep; }
  uint32_t PartitionCount(size_t g) const {
    return IsExpertGroup(g) ? ExpertPartitionCount() : Dp();
  }
  uint32_t PartitionRank(size_t g, uint32_t t, uint32_t r) const {
    return IsExpertGroup(g) ? order.IndexInGroup(WorldRank(t, r)) : r;
  }
  // The world ranks over which rank (t, r)'s flat group g is partitioned, in partition order.
  std::vector<uint64_t> PartitionRanks(size_t g, uint32_t t, uint32_t r) const {
    std::vector<uint64_t> ranks;
    const uint32_t e = order.ExpertRank(WorldRank(t, r));
    for (uint32_t q = 0; q < PartitionCount(g); ++q) {
      ranks.push_back(IsExpertGroup(g) ? order.Rank(e, q) : WorldRank(t, q));
    }
    return ranks;
  }
  // Whose slice rank (t, r)'s flat group g holds: of an expert group the expert-parallel rank's
  // rows, else TP rank t's slices.
  uint32_t Holder(size_t g, uint32_t t, uint32_t r) const {
    return IsExpertGroup(g) ? order.ExpertRank(WorldRank(t, r)) : t;
  }
  // The (TP rank, DP rank) of world rank w.
  std::pair<uint32_t, uint32_t> Coordinates(uint32_t w) const {
    return {Grid().TpRank(w), Grid().DenseRank(w)};
  }
};

// How expert-parallel rank e's rows of a fused expert parameter of `experts` rows make it: a
// split of dimension 0 into equal parts, one per expert-parallel rank (GeometryAt at degree ep).
ShardMap ExpertRowsMap(uint32_t experts) {
  ShardMap map;
  map.rule = Rule::kSplit;
  map.dim = 0;
  map.sub_params = {experts};
  return map;
}

// ---------------------------------------------------------------------------------------------
// The files of a tag, read.

struct ModelStates {
  RankFile entry;
  TorchArchiveReader reader;
  std::string ds_version;
  uint32_t dp = 0;
  uint32_t tp = 1;                       // mp_world_size: AutoTP's degree (ZeRO-3 has no pipeline)
  std::vector<GroupLayout> flat_groups;  // param_shapes
  GroupLayout frozen;                    // frozen_param_shapes
  std::vector<const TorchTensor*> frozen_fragments;
  std::optional<int64_t> config_stage;
  uint64_t sub_group_size = kDefaultSubGroupSize;
};

// One state tensor of a flat group: partitioned (1-d, P elements) or 0-d.
struct StateTensor {
  std::string key;
  const TorchTensor* tensor = nullptr;
};

struct OptimStates {
  RankFile entry;
  TorchArchiveReader reader;
  std::string ds_version;
  std::vector<std::vector<StateTensor>> states;  // per flat group, in the pickle's order
  std::vector<const TorchTensor*> fp32;          // fp32_flat_groups
  std::vector<const Value*> param_groups;
  std::vector<std::vector<int64_t>> group_members;  // param_groups[pg]['params']
};

// Whether model states `r` record Megatron's TP rules: universal_checkpoint_info of a run without
// AutoTP (no affine map, no ds_config tensor_parallel.autotp_size) or AutoEP's layers
// (ds_autoep_layers, None in other saves).
bool RecordsMegatronRules(const TorchArchiveReader& r) {
  const Value* autoep = OptionalField(r, kAutoEpLayers);
  return OptionalField(r, std::string(deepspeed::kUniversalCheckpointInfo)) != nullptr &&
         !HasAutoTpMaps(r) &&
         OptionalField(r, "ds_config/tensor_parallel/autotp_size") == nullptr &&
         (autoep == nullptr || autoep->kind() == Kind::kNone);
}

// mp_world_size of a ZeRO-3 model-states file: the TP degree (ZeRO-3 has no pipeline), AutoTP's
// or an mpu's. kUnsupported above 1 without AutoTP's affine map or Megatron's rules: nothing else
// tells how the parameters were split.
Result<uint32_t> TpDegree(const TorchArchiveReader& r) {
  UCP_ASSIGN_OR_RETURN(const int64_t mp, IntField(r, "mp_world_size"));
  if (mp < 1 || mp > kMaxTpDegree) {
    return FieldError(r, "mp_world_size", "outside [1, " + std::to_string(kMaxTpDegree) + "]");
  }
  if (mp > 1 && !HasAutoTpMaps(r) && !RecordsMegatronRules(r)) {
    return Status::Unsupported(
        Prefix(r.path()) + "mp_world_size " + std::to_string(mp) +
        " without AutoTP's universal_checkpoint_info/affine_map or Megatron's patterns (the "
        "universal_checkpoint_info of a run without AutoTP): nothing says how the parameters were "
        "split over the TP ranks");
  }
  return static_cast<uint32_t>(mp);
}

Result<GroupLayout> ReadShapes(const TorchArchiveReader& r, const Value* node,
                               const std::string& field) {
  std::vector<std::string> names;
  std::vector<Shape> dims;
  for (const auto& [key, value] : NamedChildren(node)) {
    std::optional<Shape> shape = ShapeOf(value);
    if (!shape) return FieldError(r, field + "/" + key, "not a torch.Size");
    names.push_back(key);
    dims.push_back(std::move(*shape));
  }
  Result<GroupLayout> layout = MakeLayout(std::move(names), std::move(dims));
  if (!layout.ok()) return FieldError(r, field, layout.status().message());
  return layout;
}

Result<ModelStates> ReadModelStates(const std::string& tag_dir, const RankFile& entry) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader,
                       TorchArchiveReader::Open(tag_dir + "/" + entry.name));
  ModelStates ms{entry,        std::move(reader),   {}, 0, 1, {}, {}, {},
                 std::nullopt, kDefaultSubGroupSize};
  const TorchArchiveReader& r = ms.reader;
  UCP_ASSIGN_OR_RETURN(ms.ds_version, StrField(r, "ds_version"));
  UCP_ASSIGN_OR_RETURN(ms.dp, DpWorldSize(r));
  UCP_ASSIGN_OR_RETURN(ms.tp, TpDegree(r));
  UCP_ASSIGN_OR_RETURN(const Value* shapes, Field(r, "param_shapes"));
  if (shapes->kind() != Kind::kList) {
    return FieldError(r, "param_shapes", "not a list of flat groups");
  }
  for (size_t g = 0; g < shapes->items().size(); ++g) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout,
                         ReadShapes(r, shapes->items()[g], "param_shapes/" + std::to_string(g)));
    ms.flat_groups.push_back(std::move(layout));
  }
  if (const Value* frozen = OptionalField(r, "frozen_param_shapes");
      frozen != nullptr && frozen->kind() != Kind::kNone) {
    UCP_ASSIGN_OR_RETURN(ms.frozen, ReadShapes(r, frozen, "frozen_param_shapes"));
  }
  for (size_t k = 0; k < ms.frozen.names.size(); ++k) {
    const std::string field = "frozen_param_fragments/" + ms.frozen.names[k];
    UCP_ASSIGN_OR_RETURN(const Value* node, Field(r, field));
    const TorchTensor* tensor = r.TensorAt(node);
    const uint64_t piece = PieceOf(ms.frozen.numels[k], ms.dp);
    if (tensor == nullptr || tensor->shape != Shape{piece} || !tensor->contiguous()) {
      return FieldError(r, field,
                        "not a contiguous tensor of shape [" + std::to_string(piece) +
                            "] (frozen_param_shapes at dp_world_size " + std::to_string(ms.dp) +
                            ")");
    }
    ms.frozen_fragments.push_back(tensor);
  }
  if (const Value* stage = OptionalField(r, "ds_config/zero_optimization/stage")) {
    if (stage->kind() == Kind::kInt) ms.config_stage = stage->AsInt64();
  }
  if (const Value* size = OptionalField(r, "ds_config/zero_optimization/sub_group_size")) {
    if (size->kind() == Kind::kInt && size->AsInt64().value_or(-1) >= 0) {
      ms.sub_group_size = static_cast<uint64_t>(*size->AsInt64());
    } else if (size->kind() == Kind::kFloat && size->float_value() >= 0 &&
               size->float_value() < 1.8e19) {
      ms.sub_group_size = static_cast<uint64_t>(size->float_value());
    }
  }
  return ms;
}

// The placement of `head`'s flat groups (rank (0, 0)'s model states): from ds_autoep_layers where
// it has them, every flat group of fused expert parameters (named "<experts module>.<w>") or of
// none; with AutoTP, DeepSpeed's folded grid (its folding dict). kUnsupported for frozen expert
// parameters (DeepSpeed 0.19.8 does not save them) and a fold DeepSpeed does not make, kCorrupt
// naming the field otherwise.
Result<ExpertPlacement> ReadExpertPlacement(const ModelStates& head) {
  const TorchArchiveReader& r = head.reader;
  ExpertPlacement placement;
  placement.tp = head.tp;
  const uint32_t world = head.dp * head.tp;
  placement.order = {world, 1, false};
  placement.expert_groups.assign(head.flat_groups.size(), false);
  const Value* layers = OptionalField(r, kAutoEpLayers);
  if (layers == nullptr || layers->kind() == Kind::kNone) return placement;
  UCP_ASSIGN_OR_RETURN(const std::vector<uint32_t> num_experts, deepspeed::ReadNumExperts(r));
  std::vector<std::string> modules;
  UCP_ASSIGN_OR_RETURN(placement.ep,
                       ReadAutoEpLayers(r, num_experts, world, kAutoEpZero3Format, modules));
  const Value* order = OptionalField(r, "ds_config/" + std::string(kDataBeforeExpert));
  placement.order = {world, placement.ep,
                     order != nullptr && order->kind() == Kind::kBool && order->bool_value()};
  if (head.tp > 1) {
    UCP_ASSIGN_OR_RETURN(const std::optional<deepspeed::FoldedGrid> grid,
                         deepspeed::ReadFoldedGrid(r));
    if (!grid || grid->ep != placement.ep || placement.order.data_before_expert) {
      return FieldError(r, deepspeed::kFolding,
                        "not DeepSpeed's fold of AutoEP's expert-parallel size " +
                            std::to_string(placement.ep) + " over AutoTP's " +
                            std::to_string(head.tp) + " ranks");
    }
  }
  // The layer whose experts module holds `name` directly ("<module>.<w>"), or nullopt.
  const auto layer_of = [&](const std::string& name) -> std::optional<size_t> {
    for (size_t layer = 0; layer < modules.size(); ++layer) {
      const std::string& module = modules[layer];
      if (name.size() > module.size() + 1 && name.starts_with(module) &&
          name[module.size()] == '.' && name.find('.', module.size() + 1) == std::string::npos) {
        return layer;
      }
    }
    return std::nullopt;
  };
  for (size_t g = 0; g < head.flat_groups.size(); ++g) {
    size_t fused = 0;
    for (const std::string& name : head.flat_groups[g].names) {
      if (const std::optional<size_t> layer = layer_of(name)) {
        placement.experts[name] = num_experts[*layer];
        ++fused;
      }
    }
    if (fused != 0 && fused != head.flat_groups[g].names.size()) {
      return FieldError(r, "param_shapes/" + std::to_string(g),
                        "AutoEP's fused expert parameters and others in one flat group");
    }
    placement.expert_groups[g] = fused != 0;
  }
  if (placement.experts.empty()) {
    return FieldError(r, "param_shapes",
                      "no fused expert parameter of the experts modules ds_autoep_layers names");
  }
  for (const std::string& name : head.frozen.names) {
    if (layer_of(name)) {
      return Status::Unsupported(Prefix(r.path()) + "frozen_param_shapes/" + name +
                                 ": a frozen AutoEP expert parameter under ZeRO-3, which DeepSpeed "
                                 "0.19.8 refuses to save (\"frozen fragments are not stored in "
                                 "ZeRO optimizer shards\"); a tag of another writer");
    }
  }
  return placement;
}

// Rank (t, r)'s record of its place in `placement`: every AutoEP layer's ep_rank and
// expert_data_parallel_rank in its model states `ms`, each flat group's partition_count,
// partition_rank and partition_ranks in its optimizer states `os`, and where AutoTP folds the grid
// both files' folding dicts (DeepSpeed loads a ZeRO-3 AutoEP tag only where these are its own).
Status CheckRankPlacement(const ExpertPlacement& placement, uint32_t t, uint32_t r,
                          const ModelStates& ms, const TorchArchiveReader& os, size_t flat_groups) {
  const ExpertRankOrder& order = placement.order;
  const uint32_t w = placement.WorldRank(t, r);
  if (placement.tp > 1) {
    const deepspeed::FoldedGrid grid = placement.Grid();
    UCP_RETURN_IF_ERROR(
        CheckFolding(ms.reader, deepspeed::kDenseFamily, grid, t, order.ExpertRank(w), r));
    UCP_RETURN_IF_ERROR(CheckFolding(os, deepspeed::kZeroFamily, grid, t, order.ExpertRank(w), r));
  }
  UCP_ASSIGN_OR_RETURN(const Value* layers, Field(ms.reader, kAutoEpLayers));
  if (layers->kind() != Kind::kList) return FieldError(ms.reader, kAutoEpLayers, "not a list");
  for (size_t i = 0; i < layers->items().size(); ++i) {
    const std::string field = std::string(kAutoEpLayers) + "/" + std::to_string(i);
    for (const auto& [key, expected] :
         {std::pair{"ep_rank", order.ExpertRank(w)},
          std::pair{"expert_data_parallel_rank", order.IndexInGroup(w)}}) {
      UCP_ASSIGN_OR_RETURN(const int64_t value, IntField(ms.reader, field + "/" + key));
      if (value != expected) {
        return FieldError(ms.reader, field + "/" + key,
                          std::to_string(value) + ", but rank " + std::to_string(w) +
                              " is expert-parallel rank " + std::to_string(order.ExpertRank(w)) +
                              ", index " + std::to_string(order.IndexInGroup(w)) +
                              " of its expert-data-parallel group");
      }
    }
  }
  const std::string root = std::string(kOsd) + "/" + std::string(kPartitionGroups);
  UCP_ASSIGN_OR_RETURN(const Value* groups, Field(os, root));
  if (groups->kind() != Kind::kList || groups->items().size() != flat_groups) {
    return FieldError(os, root, "not a list of " + std::to_string(flat_groups) + " flat groups");
  }
  for (size_t g = 0; g < flat_groups; ++g) {
    const std::string field = root + "/" + std::to_string(g);
    const uint32_t count = placement.PartitionCount(g);
    const uint32_t rank = placement.PartitionRank(g, t, r);
    std::vector<int64_t> ranks;
    for (const uint64_t q : placement.PartitionRanks(g, t, r))
      ranks.push_back(static_cast<int64_t>(q));
    UCP_ASSIGN_OR_RETURN(const int64_t saved_count, IntField(os, field + "/partition_count"));
    UCP_ASSIGN_OR_RETURN(const int64_t saved_rank, IntField(os, field + "/partition_rank"));
    UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> saved_ranks,
                         deepspeed::IntListField(os, field + "/partition_ranks"));
    if (saved_count != count || saved_rank != rank || saved_ranks != ranks) {
      return FieldError(os, field,
                        "partition_count " + std::to_string(saved_count) + ", partition_rank " +
                            std::to_string(saved_rank) + ", partition_ranks " +
                            deepspeed::ListText(saved_ranks) + "; rank " + std::to_string(w) +
                            "'s are " + std::to_string(count) + ", " + std::to_string(rank) + ", " +
                            deepspeed::ListText(ranks));
    }
  }
  return Status::Ok();
}

Result<OptimStates> ReadOptimStates(const std::string& tag_dir, const RankFile& entry,
                                    const ModelStates& ms, const ExpertPlacement& placement) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader,
                       TorchArchiveReader::Open(tag_dir + "/" + entry.name));
  OptimStates os{entry, std::move(reader), {}, {}, {}, {}, {}};
  const TorchArchiveReader& r = os.reader;
  const std::string osd(kOsd);
  UCP_ASSIGN_OR_RETURN(const Value* stage_node, Field(r, osd + "/zero_stage"));
  const std::optional<int64_t> stage = ZeroStageOf(stage_node);
  if (!stage || *stage != 3) {
    return FieldError(r, osd + "/zero_stage", "not ZeroStageEnum.weights (3)");
  }
  UCP_ASSIGN_OR_RETURN(os.ds_version, StrField(r, "ds_version"));
  if (os.ds_version != ms.ds_version) {
    return FieldError(r, "ds_version",
                      "\"" + os.ds_version + "\", but " + ms.entry.name + " has \"" +
                          ms.ds_version + "\" (a file of another save)");
  }
  UCP_ASSIGN_OR_RETURN(const int64_t partitions, IntField(r, osd + "/partition_count"));
  if (partitions != ms.dp) {
    return FieldError(r, osd + "/partition_count",
                      std::to_string(partitions) + ", but " + ms.entry.name +
                          " has dp_world_size " + std::to_string(ms.dp) +
                          " (a file of another save)");
  }
  const size_t groups = ms.flat_groups.size();
  UCP_ASSIGN_OR_RETURN(const Value* fp32, Field(r, osd + "/fp32_flat_groups"));
  if (fp32->kind() != Kind::kList || fp32->items().size() != groups) {
    return FieldError(r, osd + "/fp32_flat_groups",
                      "not a list of " + std::to_string(groups) + " tensors (param_shapes in " +
                          ms.entry.name + ")");
  }
  const std::string inner = osd + "/" + osd;
  const Value* state = OptionalField(r, inner + "/state");
  if (state == nullptr || state->kind() != Kind::kDict || state->entries().size() != groups) {
    return FieldError(r, inner + "/state",
                      "not a dict of " + std::to_string(groups) + " flat groups' states");
  }
  for (size_t g = 0; g < groups; ++g) {
    const std::string gs = std::to_string(g);
    UCP_ASSIGN_OR_RETURN(const FlatLayout layout,
                         LayoutAt(ms.flat_groups[g], placement.PartitionCount(g)));
    const TorchTensor* flat = r.TensorAt(fp32->items()[g]);
    if (flat == nullptr || flat->shape != Shape{layout.partition} || !flat->contiguous()) {
      return FieldError(r, osd + "/fp32_flat_groups/" + gs,
                        "not a contiguous tensor of shape [" + std::to_string(layout.partition) +
                            "] (param_shapes/" + gs + " in " + ms.entry.name + ")");
    }
    os.fp32.push_back(flat);
    UCP_ASSIGN_OR_RETURN(const Value* states, Field(r, inner + "/state/" + gs));
    std::vector<StateTensor> tensors;
    for (const auto& [key, value] : NamedChildren(states)) {
      const TorchTensor* tensor = r.TensorAt(value);
      if (tensor == nullptr) continue;
      const std::string field = inner + "/state/" + gs + "/" + key;
      if (!tensor->contiguous()) return FieldError(r, field, "not contiguous");
      if (!tensor->shape.empty() && tensor->shape != Shape{layout.partition}) {
        return Status::Unsupported(
            Prefix(r.path()) + field + ": shape " + ShapeText(tensor->shape) +
            " is neither 0-d nor the partition [" + std::to_string(layout.partition) + "]");
      }
      tensors.push_back({key, tensor});
    }
    os.states.push_back(std::move(tensors));
  }
  UCP_ASSIGN_OR_RETURN(const Value* param_groups, Field(r, inner + "/param_groups"));
  if (param_groups->kind() != Kind::kList) {
    return FieldError(r, inner + "/param_groups", "not a list");
  }
  int64_t next = 0;
  for (size_t pg = 0; pg < param_groups->items().size(); ++pg) {
    const std::string field = inner + "/param_groups/" + std::to_string(pg) + "/params";
    UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> members, deepspeed::IntListField(r, field));
    for (const int64_t member : members) {
      if (member != next++) {
        return FieldError(r, field, "not the next flat groups in order");
      }
    }
    os.param_groups.push_back(param_groups->items()[pg]);
    os.group_members.push_back(members);
  }
  if (next != static_cast<int64_t>(groups)) {
    return FieldError(r, inner + "/param_groups",
                      "cover " + std::to_string(next) + " flat groups, param_shapes in " +
                          ms.entry.name + " has " + std::to_string(groups));
  }
  return os;
}

// ---------------------------------------------------------------------------------------------
// The index's facts.

struct IndexFacts {
  uint32_t dp = 0;
  uint32_t tp = 1;             // AutoTP's degree, or an mpu's (megatron)
  bool megatron = false;       // the split is Megatron's rules' (at tp 1 too), not AutoTP's
  std::optional<Vocab> vocab;  // megatron: the vocabulary's sizes where one is padded
  // tp > 1 or megatron: the vocabulary parameters, how each parameter's slices make it, and its
  // slices at tp.
  std::set<std::string> vocabulary;
  std::map<std::string, ShardMap> maps;
  std::map<std::string, Geometry> slices;
  std::string prefix;
  uint64_t sub_group_size = kDefaultSubGroupSize;
  std::vector<GroupLayout> flat_groups;  // of TP rank 0's slices' shapes (RankGroups: another's)
  std::vector<size_t> flat_group_of;     // param group of each flat group
  std::vector<std::vector<std::string>> param_groups;  // params of each param group
  GroupLayout frozen;
  ExpertPlacement placement;  // AutoEP's (ep 0 without), expert_groups per flat group
  std::map<std::string, ShardMap> expert_maps;    // a reshard's: each fused parameter's rows
  std::map<std::string, Geometry> expert_slices;  // ... at its expert-parallel size
  uint32_t model_file = 0;                        // rank (0, 0)'s model states
  uint32_t optim_file = 0;                        // rank (0, 0)'s optimizer states
  std::vector<uint32_t> model_files;  // every rank's, TP rank by TP rank in DP rank order
};

Result<Shape> AtomShape(const AtomIndex& index, const std::string& name, std::string_view state) {
  const Atom* atom = index.Find(name, state);
  if (atom == nullptr) {
    return Status::Corrupt("deepspeed: index: no atom " + name + "/" + std::string(state));
  }
  return atom->shape;
}

// TP rank t's slice of parameter `name`; `whole` is the geometry of a parameter of a tag without
// TP (its one slice).
Slice SliceOf(const IndexFacts& facts, const std::string& name, uint32_t t, const Geometry& whole) {
  static const ShardMap kWhole;
  if (const auto rows = facts.expert_slices.find(name); rows != facts.expert_slices.end()) {
    return {&facts.expert_maps.at(name), &rows->second, t};
  }
  // At tp 1 a parameter is whole, but a vocabulary Megatron pads there (FactsAtTp's slices).
  const auto slices = facts.slices.find(name);
  if (facts.tp == 1 && slices == facts.slices.end()) return {&kWhole, &whole, 0};
  return {&facts.maps.at(name), &slices->second, t};
}

// Partition r of state `state` of a flat group of holder t (a TP rank, or for AutoEP's experts
// the expert-parallel rank whose rows the group holds).
Result<std::vector<Segment>> PartitionSegments(const AtomIndex& index, const IndexFacts& facts,
                                               const FlatLayout& layout, std::string_view state,
                                               uint32_t r, uint64_t item, uint32_t t) {
  std::vector<Segment> segments;
  for (size_t k = 0; k < layout.params.names.size(); ++k) {
    const std::string& name = layout.params.names[k];
    const Geometry whole = WholeGeometry(1, layout.params.shapes[k]);
    UCP_ASSIGN_OR_RETURN(const std::vector<Segment> piece,
                         PieceSegments(index, name, state, layout.params.numels[k], layout.dp, r,
                                       item, SliceOf(facts, name, t, whole)));
    AppendSegments(segments, piece);
  }
  return segments;
}

Status BadAdapterState() {
  return Status::Corrupt(
      "deepspeed: index adapter_state: file_prefix, sub_group_size, flat_groups or "
      "frozen_params missing or mistyped");
}

// adapter_state.tp of a tag with TP: its vocabulary parameters and shard maps.
Status ReadTpFacts(const nlohmann::json& state, IndexFacts& facts) {
  const auto tp_state = state.find("tp");
  if (tp_state == state.end() || !tp_state->is_object() || !tp_state->contains("degree") ||
      (*tp_state)["degree"] != facts.tp || !tp_state->contains("vocabulary") ||
      !(*tp_state)["vocabulary"].is_array() || !tp_state->contains("params") ||
      !(*tp_state)["params"].is_object()) {
    return Status::Corrupt("deepspeed: index adapter_state.tp: missing, or not of degree " +
                           std::to_string(facts.tp) + " with shard maps and a vocabulary list");
  }
  for (const nlohmann::json& name : (*tp_state)["vocabulary"]) {
    if (!name.is_string()) return BadAdapterState();
    facts.vocabulary.insert(name.get<std::string>());
  }
  for (const auto& [name, json] : (*tp_state)["params"].items()) {
    UCP_ASSIGN_OR_RETURN(ShardMap map, MapFromJson(name, json));
    facts.maps.emplace(name, std::move(map));
  }
  const auto megatron = tp_state->find("megatron");
  if (megatron == tp_state->end() || !megatron->is_boolean()) {
    return Status::Corrupt("deepspeed: index adapter_state.tp: megatron missing or not a bool");
  }
  facts.megatron = megatron->get<bool>();
  if (const auto vocab = tp_state->find("vocab"); vocab != tp_state->end()) {
    for (const char* key : {"original", "padded", "divisible_by"}) {
      if (!vocab->is_object() || !vocab->contains(key) || !(*vocab)[key].is_number_unsigned() ||
          (*vocab)[key].get<uint64_t>() == 0) {
        return Status::Corrupt("deepspeed: index adapter_state.tp: vocab/" + std::string(key) +
                               " missing or mistyped");
      }
    }
    facts.vocab = Vocab{(*vocab)["original"].get<uint64_t>(), (*vocab)["padded"].get<uint64_t>(),
                        (*vocab)["divisible_by"].get<uint64_t>()};
  }
  return Status::Ok();
}

// adapter_state.autoep where the tag has AutoEP layers: the expert placement.
Status ReadAutoEpFacts(const nlohmann::json& state, IndexFacts& facts) {
  facts.placement.tp = facts.tp;
  facts.placement.order = {facts.dp * facts.tp, 1, false};
  const auto autoep = state.find("autoep");
  if (autoep == state.end()) return Status::Ok();
  const auto bad_autoep = [] {
    return Status::Corrupt(
        "deepspeed: index adapter_state.autoep: not an expert-parallel size, a rank order and "
        "each fused expert parameter's experts");
  };
  if (!autoep->is_object() || !autoep->contains("ep") || !(*autoep)["ep"].is_number_unsigned() ||
      !autoep->contains("data_before_expert") || !(*autoep)["data_before_expert"].is_boolean() ||
      !autoep->contains("experts") || !(*autoep)["experts"].is_object()) {
    return bad_autoep();
  }
  const uint64_t ep = (*autoep)["ep"].get<uint64_t>();
  if (ep == 0 || (facts.dp * facts.tp) % ep != 0) return bad_autoep();
  facts.placement.ep = static_cast<uint32_t>(ep);
  facts.placement.order = {facts.dp * facts.tp, facts.placement.ep,
                           (*autoep)["data_before_expert"].get<bool>()};
  for (const auto& [name, experts] : (*autoep)["experts"].items()) {
    if (!experts.is_number_unsigned() || experts.get<uint64_t>() % ep != 0 ||
        experts.get<uint64_t>() == 0 || experts.get<uint64_t>() > kMaxExperts) {
      return bad_autoep();
    }
    facts.placement.experts[name] = experts.get<uint32_t>();
  }
  return Status::Ok();
}

// `name`'s TP slices (from its shard map) recorded in facts.slices; returns TP rank 0's slice
// shape.
Result<Shape> RecordTpSlices(const std::string& name, const Shape& shape, IndexFacts& facts) {
  const auto map = facts.maps.find(name);
  if (map == facts.maps.end()) {
    return Status::Corrupt("deepspeed: index adapter_state.tp.params: no shard map of " + name);
  }
  UCP_ASSIGN_OR_RETURN(Geometry geometry, GeometryAt(name, map->second, shape, facts.tp,
                                                     facts.vocab, map->second.blocks));
  Shape local = geometry.local;
  facts.slices.emplace(name, std::move(geometry));
  return local;
}

// adapter_state.flat_groups: each flat group's parameters (the next ones of its parameter group)
// and their shapes as a rank holds them (an expert-parallel rank's rows, a TP rank's slice).
Status ReadFlatGroups(const AtomIndex& index, const nlohmann::json& state, IndexFacts& facts) {
  const AtomIndexContents& c = index.contents();
  for (const ParamGroup& group : c.groups) facts.param_groups.push_back(group.params);
  std::vector<size_t> taken(c.groups.size(), 0);
  for (const nlohmann::json& flat : state["flat_groups"]) {
    if (!flat.is_object() || !flat.contains("param_group") ||
        !flat["param_group"].is_number_unsigned() || !flat.contains("params") ||
        !flat["params"].is_number_unsigned()) {
      return BadAdapterState();
    }
    const size_t pg = flat["param_group"].get<size_t>();
    const size_t count = flat["params"].get<size_t>();
    // Flat groups come in parameter-group order, each group's parameters in order.
    if (pg >= c.groups.size() || count > c.groups[pg].params.size() - taken[pg] ||
        (!facts.flat_group_of.empty() && pg < facts.flat_group_of.back())) {
      return BadAdapterState();
    }
    std::vector<std::string> names(c.groups[pg].params.begin() + taken[pg],
                                   c.groups[pg].params.begin() + taken[pg] + count);
    taken[pg] += count;
    std::vector<Shape> shapes;
    size_t fused = 0;
    for (const std::string& name : names) {
      UCP_ASSIGN_OR_RETURN(Shape shape, AtomShape(index, name, "fp32"));
      if (const auto experts = facts.placement.experts.find(name);
          experts != facts.placement.experts.end()) {
        // An expert-parallel rank's rows of it, not split over TP.
        if (shape.empty() || shape.front() != experts->second) return BadAdapterState();
        shape.front() /= facts.placement.ep;
        ++fused;
      } else if (facts.tp > 1 || facts.megatron) {
        UCP_ASSIGN_OR_RETURN(shape, RecordTpSlices(name, shape, facts));
      }
      shapes.push_back(std::move(shape));
    }
    if (fused != 0 && fused != names.size()) return BadAdapterState();
    facts.placement.expert_groups.push_back(fused != 0);
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, MakeLayout(std::move(names), std::move(shapes)));
    facts.flat_groups.push_back(std::move(layout));
    facts.flat_group_of.push_back(pg);
  }
  for (size_t pg = 0; pg < c.groups.size(); ++pg) {
    if (taken[pg] != c.groups[pg].params.size()) return BadAdapterState();
  }
  return Status::Ok();
}

// adapter_state.frozen_params: their layout of whole shapes (each TP rank's slices in
// facts.slices).
Status ReadFrozenFacts(const AtomIndex& index, const nlohmann::json& state, IndexFacts& facts) {
  std::vector<std::string> frozen_names;
  std::vector<Shape> frozen_shapes;
  for (const nlohmann::json& name : state["frozen_params"]) {
    if (!name.is_string()) return BadAdapterState();
    frozen_names.push_back(name.get<std::string>());
    UCP_ASSIGN_OR_RETURN(Shape shape, AtomShape(index, frozen_names.back(), kFrozenState));
    if (facts.tp > 1 || facts.megatron) {
      UCP_RETURN_IF_ERROR(RecordTpSlices(frozen_names.back(), shape, facts).status());
    }
    frozen_shapes.push_back(std::move(shape));
  }
  UCP_ASSIGN_OR_RETURN(facts.frozen, MakeLayout(std::move(frozen_names), std::move(frozen_shapes)));
  return Status::Ok();
}

// The carried files: every rank's model states (TP rank by TP rank in DP rank order) and the
// optimizer-states template.
Status ReadCarriedFiles(const AtomIndexContents& c, IndexFacts& facts) {
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> model_by_rank;  // (tp, dp) → file
  bool have_optim = false;
  for (const CarriedObject& carried : c.carried) {
    const std::optional<RankCoordinates>& rank = c.files.at(carried.file).rank;
    if (carried.role == kModelRole && rank) {
      model_by_rank[{rank->tp, rank->dp}] = carried.file;
    }
    if (carried.role == kOptimRole) facts.optim_file = carried.file, have_optim = true;
  }
  const bool every_rank = model_by_rank.size() == uint64_t{facts.dp} * facts.tp &&
                          !model_by_rank.empty() &&
                          model_by_rank.rbegin()->first == std::pair{facts.tp - 1, facts.dp - 1};
  if (!have_optim || !every_rank) {
    return Status::Corrupt(
        "deepspeed: index carried: no optim_states template or not one model_states file per "
        "rank");
  }
  for (const auto& [rank, file] : model_by_rank) facts.model_files.push_back(file);
  facts.model_file = model_by_rank.begin()->second;
  return Status::Ok();
}

Result<IndexFacts> ReadFacts(const AtomIndex& index) {
  const AtomIndexContents& c = index.contents();
  UCP_RETURN_IF_ERROR(CheckIndexAdapter(index, DeepSpeedZero3Adapter::kName));
  IndexFacts facts;
  facts.dp = c.topology.dp;
  facts.tp = c.topology.tp;
  if (facts.dp == 0 || facts.tp == 0)
    return Status::Corrupt("deepspeed: index topology: dp or tp 0");
  const nlohmann::json& state = c.adapter_state;
  if (!state.is_object() || !state.contains("file_prefix") || !state["file_prefix"].is_string() ||
      !state.contains("sub_group_size") || !state["sub_group_size"].is_number_unsigned() ||
      !state.contains("flat_groups") || !state["flat_groups"].is_array() ||
      !state.contains("frozen_params") || !state["frozen_params"].is_array()) {
    return BadAdapterState();
  }
  facts.prefix = state["file_prefix"].get<std::string>();
  if (facts.prefix != "" && facts.prefix != "bf16_") return BadAdapterState();
  facts.sub_group_size = state["sub_group_size"].get<uint64_t>();
  // A tag of one TP rank records its TP state where Megatron's rules place it at another degree.
  if (facts.tp > 1 || state.contains("tp")) UCP_RETURN_IF_ERROR(ReadTpFacts(state, facts));
  UCP_RETURN_IF_ERROR(ReadAutoEpFacts(state, facts));
  UCP_RETURN_IF_ERROR(ReadFlatGroups(index, state, facts));
  UCP_RETURN_IF_ERROR(ReadFrozenFacts(index, state, facts));
  UCP_RETURN_IF_ERROR(ReadCarriedFiles(c, facts));
  return facts;
}

// A TP tag's facts at TP degree `tp`: each parameter's slices there (frozen ones' too), as AutoTP
// splits it by `rule` (Megatron's rules split at any degree: equal parts, the vocabulary padded
// for tp), and the flat groups of TP rank 0's slices' shapes (the whole parameters at tp = 1). The
// source's files stay as they are.
Result<IndexFacts> FactsAtTp(const IndexFacts& facts, uint32_t tp, const AutoTpSplitRule& rule) {
  IndexFacts out = facts;
  out.tp = tp;
  out.slices.clear();
  // Parameter `name`'s slices at `tp`: its map's blocks there, and their geometry.
  const auto reslice = [&](const std::string& name) -> Result<Shape> {
    const Geometry& saved = facts.slices.at(name);
    const Shape& whole = saved.atom;
    ShardMap& map = out.maps.at(name);
    if (map.rule == Rule::kSplit && !facts.megatron) {
      UCP_ASSIGN_OR_RETURN(std::vector<uint64_t> blocks, MapBlocksAtDegree(name, saved, tp, rule));
      SetBlocks(map, std::move(blocks));
    }
    UCP_ASSIGN_OR_RETURN(Geometry geometry,
                         GeometryAt(name, map, whole, tp, facts.vocab, map.blocks));
    Shape local = geometry.local;
    out.slices.emplace(name, std::move(geometry));
    return local;
  };
  for (GroupLayout& group : out.flat_groups) {
    std::vector<Shape> shapes;
    for (size_t k = 0; k < group.names.size(); ++k) {
      if (facts.placement.experts.contains(group.names[k])) {  // not split over TP
        shapes.push_back(group.shapes[k]);
        continue;
      }
      UCP_ASSIGN_OR_RETURN(Shape shape, reslice(group.names[k]));
      shapes.push_back(std::move(shape));
    }
    UCP_ASSIGN_OR_RETURN(group, MakeLayout(group.names, std::move(shapes)));
  }
  for (const std::string& name : out.frozen.names) UCP_RETURN_IF_ERROR(reslice(name).status());
  return out;
}

// frozen_param_shapes' entry of `name` in a model states' `root` set to `shape`: rank (0, 0)'s
// file is every TP rank's template at another TP degree.
Status SetFrozenShape(pickle::Graph& graph, Value* root, const std::string& name,
                      const Shape& shape, const TorchArchiveReader& reader) {
  Value* shapes = root->Get("frozen_param_shapes");
  if (shapes != nullptr && shapes->kind() == Kind::kObject) {
    for (pickle::Mutation& mutation : shapes->mutable_mutations()) {
      if (mutation.op == pickle::Mutation::Op::kSetItem && KeyText(mutation.first) == name) {
        mutation.second = ShapeNodeLike(graph, mutation.second, shape);
        return Status::Ok();
      }
    }
  }
  return FieldError(reader, "frozen_param_shapes/" + name, "missing");
}

// TP rank t's flat groups: `groups` (of TP rank 0's slices) with rank t's slices' shapes, which
// differ where AutoTP splits a parameter unevenly.
Result<std::vector<GroupLayout>> RankGroups(const IndexFacts& facts,
                                            const std::vector<GroupLayout>& groups, uint32_t t) {
  if (t == 0 || facts.tp == 1) return groups;
  std::vector<GroupLayout> out;
  for (const GroupLayout& group : groups) {
    std::vector<Shape> shapes;
    for (size_t k = 0; k < group.names.size(); ++k) {
      const auto slices = facts.slices.find(group.names[k]);
      // AutoEP's experts are not split over TP.
      shapes.push_back(slices == facts.slices.end() ? group.shapes[k]
                                                    : LocalShape(slices->second, t));
    }
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, MakeLayout(group.names, std::move(shapes)));
    out.push_back(std::move(layout));
  }
  return out;
}

// The flat groups DeepSpeed makes at `dp` on TP rank t: each parameter group's parameters split
// into sub groups by the partition elements of t's slices at that size (of AutoEP's experts at
// facts.placement's expert-parallel size).
Result<std::vector<GroupLayout>> FlatGroupsAt(const IndexFacts& facts, uint32_t dp, uint32_t t,
                                              std::vector<std::vector<uint64_t>>& members) {
  UCP_ASSIGN_OR_RETURN(const std::vector<GroupLayout> groups,
                       RankGroups(facts, facts.flat_groups, t));
  std::vector<GroupLayout> out;
  members.assign(facts.param_groups.size(), {});
  size_t flat = 0;
  for (size_t pg = 0; pg < facts.param_groups.size(); ++pg) {
    std::vector<std::string> names;
    std::vector<Shape> shapes;
    std::vector<uint64_t> numels;
    for (; flat < groups.size() && facts.flat_group_of[flat] == pg; ++flat) {
      const GroupLayout& group = groups[flat];
      names.insert(names.end(), group.names.begin(), group.names.end());
      shapes.insert(shapes.end(), group.shapes.begin(), group.shapes.end());
      numels.insert(numels.end(), group.numels.begin(), group.numels.end());
    }
    if (names.empty()) continue;
    // AutoEP's experts are partitioned over the expert-data-parallel ranks alone.
    const uint32_t parts = facts.placement.experts.contains(names.front())
                               ? facts.placement.ExpertPartitionCount()
                               : dp;
    size_t next = 0;
    for (const size_t count : SubGroupSizes(numels, parts, facts.sub_group_size)) {
      members[pg].push_back(out.size());
      UCP_ASSIGN_OR_RETURN(
          GroupLayout layout,
          MakeLayout(std::vector<std::string>(names.begin() + next, names.begin() + next + count),
                     std::vector<Shape>(shapes.begin() + next, shapes.begin() + next + count)));
      out.push_back(std::move(layout));
      next += count;
    }
  }
  return out;
}

// param_shapes for other flat groups: one OrderedDict per group, holding the source's
// name → torch.Size items regrouped, or with `resized` the groups' own shapes.
Status RegroupShapes(pickle::Graph& graph, Value* root, const std::vector<GroupLayout>& groups,
                     const TorchArchiveReader& reader, bool resized = false) {
  Value* shapes = root->Get("param_shapes");
  if (shapes == nullptr || shapes->kind() != Kind::kList || shapes->items().empty()) {
    return FieldError(reader, "param_shapes", "not a list of flat groups");
  }
  std::map<std::string, pickle::Mutation> items;
  for (const Value* group : shapes->items()) {
    if (group->kind() != Kind::kObject) {
      return FieldError(reader, "param_shapes", "not a list of OrderedDicts");
    }
    for (const pickle::Mutation& mutation : group->mutations()) {
      if (mutation.op == pickle::Mutation::Op::kSetItem) {
        items.emplace(KeyText(mutation.first), mutation);
      }
    }
  }
  const Value* model = shapes->items().front();
  std::vector<Value*> regrouped;
  for (const GroupLayout& group : groups) {
    Value* dict = graph.Object(model->construction(), model->callable(), graph.Tuple({}));
    for (size_t k = 0; k < group.names.size(); ++k) {
      const auto it = items.find(group.names[k]);
      if (it == items.end()) return FieldError(reader, "param_shapes/" + group.names[k], "missing");
      dict->mutable_mutations().push_back(it->second);
      if (resized) {
        Value*& shape = dict->mutable_mutations().back().second;
        shape = ShapeNodeLike(graph, shape, group.shapes[k]);
      }
    }
    regrouped.push_back(dict);
  }
  shapes->mutable_items() = std::move(regrouped);
  return Status::Ok();
}

// Storage keys not used by `reader`'s archive, as torch numbers them.
class FreshKeys {
 public:
  explicit FreshKeys(const TorchArchiveReader& reader) {
    for (const auto& [key, storage] : reader.storages()) {
      if (!key.empty() && key.size() < 18 && key.find_first_not_of("0123456789") == key.npos) {
        next_ = std::max<uint64_t>(next_, std::stoull(key) + 1);
      }
    }
  }
  std::string Next() { return std::to_string(next_++); }

 private:
  uint64_t next_ = 0;
};

// ---------------------------------------------------------------------------------------------
// A tag's ranks: every (TP rank, DP rank)'s model states and optimizer states.

// Which file is which rank's, [t][r]: all present, of one save's names.
struct RankGrid {
  std::vector<std::vector<const RankFile*>> models;
  std::vector<std::vector<const RankFile*>> optims;
  std::string prefix;
};

Result<RankGrid> GridOf(const std::string& tag_dir, const TagListing& listing,
                        const ModelStates& head) {
  const uint32_t dp = head.dp;
  const uint32_t tp = head.tp;
  const std::vector<std::vector<const RankFile*>> none(tp, std::vector<const RankFile*>(dp));
  RankGrid grid{none, none, ""};
  const auto beyond = [&](const RankFile& entry) {
    return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "rank beyond dp_world_size " +
                           std::to_string(dp) + " or mp_world_size " + std::to_string(tp) + " of " +
                           head.entry.name + " (a file of another save)");
  };
  for (const RankFile& entry : listing.zero3_model_states) {
    if (entry.dp >= dp || entry.mp >= tp) return beyond(entry);
    grid.models[entry.mp][entry.dp] = &entry;
  }
  if (listing.optim.empty()) {
    return Status::NotFound(Prefix(tag_dir) + "no zero_pp_rank_*_optim_states.pt files");
  }
  grid.prefix = listing.optim.front().prefix;
  for (const RankFile& entry : listing.optim) {
    if (entry.prefix != grid.prefix) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "name: prefix \"" + entry.prefix +
                             "\", but " + listing.optim.front().name + " has \"" + grid.prefix +
                             "\" (files of two saves)");
    }
    if (entry.dp >= dp || entry.mp >= tp) return beyond(entry);
    grid.optims[entry.mp][entry.dp] = &entry;
  }
  for (uint32_t t = 0; t < tp; ++t) {
    for (uint32_t r = 0; r < dp; ++r) {
      for (const auto& [found, name] :
           {std::pair{grid.models[t][r] != nullptr, Zero3ModelStatesName(r, t)},
            std::pair{grid.optims[t][r] != nullptr, OptimName(grid.prefix, r, t)}}) {
        if (!found) {
          return Status::NotFound(Prefix(tag_dir + "/" + name) + "not found (dp_world_size " +
                                  std::to_string(dp) + ", mp_world_size " + std::to_string(tp) +
                                  " in " + head.entry.name + ")");
        }
      }
    }
  }
  return grid;
}

// One TP rank's files, in DP rank order.
struct TpRank {
  std::vector<ModelStates> models;
  std::vector<OptimStates> optims;
};

// The model states of every rank (`head`, rank (0, 0)'s, first) and their optimizer states, each
// checked to be of the save `head` is of, and within a TP rank of the same layout.
Result<std::vector<TpRank>> ReadRanks(const std::string& tag_dir, const RankGrid& grid,
                                      ModelStates head, const ExpertPlacement& placement) {
  const uint32_t dp = head.dp;
  const uint32_t tp = head.tp;
  // Reserved, so that `first` stays where it is.
  std::vector<TpRank> ranks(1);
  ranks.reserve(tp);
  ranks.front().models.reserve(dp);
  ranks.front().models.push_back(std::move(head));
  const ModelStates& first = ranks.front().models.front();
  for (uint32_t t = 0; t < tp; ++t) {
    if (t > 0) ranks.emplace_back();
    for (uint32_t r = t == 0 ? 1 : 0; r < dp; ++r) {
      UCP_ASSIGN_OR_RETURN(ModelStates ms, ReadModelStates(tag_dir, *grid.models[t][r]));
      // A TP rank's DP ranks list its frozen slices alike; AutoTP's TP ranks may hold slices of
      // other shapes, which BuildIndex checks against their maps.
      const ModelStates& rank_first = ranks[t].models.empty() ? ms : ranks[t].models.front();
      if (ms.dp != dp || ms.tp != tp || ms.ds_version != first.ds_version ||
          ms.frozen.names != first.frozen.names || ms.frozen.shapes != rank_first.frozen.shapes) {
        return FieldError(ms.reader, "dp_world_size",
                          "dp_world_size, mp_world_size, ds_version or frozen_param_shapes differ "
                          "from " +
                              first.entry.name + " (a file of another save)");
      }
      ranks[t].models.push_back(std::move(ms));
    }
    const ModelStates& ms = ranks[t].models.front();
    if (t > 0) {
      bool same = ms.flat_groups.size() == first.flat_groups.size();
      for (size_t g = 0; same && g < ms.flat_groups.size(); ++g) {
        same = ms.flat_groups[g].names == first.flat_groups[g].names;
      }
      if (!same) {
        return FieldError(ms.reader, "param_shapes",
                          "other parameters or flat groups than " + first.entry.name);
      }
    }
    for (uint32_t r = 0; r < dp; ++r) {
      UCP_ASSIGN_OR_RETURN(OptimStates os,
                           ReadOptimStates(tag_dir, *grid.optims[t][r], ms, placement));
      if (placement.ep != 0) {
        UCP_RETURN_IF_ERROR(CheckRankPlacement(placement, t, r, ranks[t].models[r], os.reader,
                                               ms.flat_groups.size()));
      }
      const OptimStates& head_os = t == 0 && r == 0 ? os : ranks[0].optims.front();
      for (size_t g = 0; g < os.states.size(); ++g) {
        bool same = os.states[g].size() == head_os.states[g].size();
        for (size_t s = 0; same && s < os.states[g].size(); ++s) {
          same =
              os.states[g][s].key == head_os.states[g][s].key &&
              os.states[g][s].tensor->dtype == head_os.states[g][s].tensor->dtype &&
              (os.states[g][s].tensor->shape.empty() == head_os.states[g][s].tensor->shape.empty());
          if (r > 0) {
            same = same && os.states[g][s].tensor->shape ==
                               ranks[t].optims.front().states[g][s].tensor->shape;
          }
        }
        same = same && os.fp32[g]->dtype == head_os.fp32[g]->dtype;
        if (!same || os.group_members != head_os.group_members) {
          return FieldError(
              os.reader,
              std::string(kOsd) + "/" + std::string(kOsd) + "/state/" + std::to_string(g),
              "other state keys, shapes or dtypes than " + head_os.entry.name);
        }
      }
      ranks[t].optims.push_back(std::move(os));
    }
  }
  return ranks;
}

// The flat groups of every TP rank must be the sub groups DeepSpeed makes of each parameter
// group at that rank's slice sizes.
Status CheckSubGroups(const std::vector<TpRank>& ranks, const ExpertPlacement& placement) {
  for (const TpRank& rank : ranks) {
    const ModelStates& ms = rank.models.front();
    const OptimStates& os = rank.optims.front();
    for (size_t pg = 0; pg < os.group_members.size(); ++pg) {
      std::vector<uint64_t> numels;
      std::vector<size_t> sizes;
      const uint32_t parts =
          os.group_members[pg].empty()
              ? ms.dp
              : placement.PartitionCount(static_cast<size_t>(os.group_members[pg].front()));
      for (const int64_t g : os.group_members[pg]) {
        const GroupLayout& layout = ms.flat_groups[static_cast<size_t>(g)];
        numels.insert(numels.end(), layout.numels.begin(), layout.numels.end());
        sizes.push_back(layout.names.size());
      }
      if (!numels.empty() && SubGroupSizes(numels, parts, ms.sub_group_size) != sizes) {
        return Status::Unsupported(
            Prefix(ms.reader.path()) + "param_shapes: the flat groups of parameter group " +
            std::to_string(pg) + " are not DeepSpeed's sub groups at sub_group_size " +
            std::to_string(ms.sub_group_size) + " (ds_config not readable as a dict?)");
      }
    }
  }
  return Status::Ok();
}

// How Megatron's rules (universal_checkpoint_info's patterns, as an mpu's TP records them) make
// each parameter of TP rank 0's `layouts` at degree tp, and the padded vocabulary (`vocab`) where
// a rule names one. kUnsupported for a parameter no rule names and one averaged over the ranks:
// ZeRO-3's files keep one slice of each, so their TP ranks' copies cannot be compared or averaged.
Result<AutoTpMaps> MegatronMaps(const TorchArchiveReader& head, uint32_t tp,
                                const std::vector<const GroupLayout*>& layouts,
                                std::optional<Vocab>& vocab) {
  UCP_ASSIGN_OR_RETURN(const deepspeed::Patterns patterns, deepspeed::ReadPatterns(head));
  AutoTpMaps out;
  for (const GroupLayout* layout : layouts) {
    for (size_t k = 0; k < layout->names.size(); ++k) {
      const std::string& name = layout->names[k];
      UCP_ASSIGN_OR_RETURN(const deepspeed::Resolved resolved,
                           deepspeed::Resolve(head, patterns, name, layout->shapes[k], tp));
      if (!resolved.map || resolved.map->rule == Rule::kAveraged) {
        return Status::Unsupported(
            Prefix(head.path()) + name +
            (resolved.map ? ": averaged over the TP ranks (parameter_to_average_patterns)"
                          : ": no rule of universal_checkpoint_info names it") +
            "; under ZeRO-3 ucp reads one TP rank's copy of a parameter that is not split");
      }
      if (resolved.map->vocab && !vocab) {
        UCP_ASSIGN_OR_RETURN(vocab, deepspeed::ReadVocab(head, patterns, tp));
      }
      if (resolved.map->vocab) out.vocabulary.insert(name);
      out.maps.emplace(name, *resolved.map);
      out.whole_shapes.emplace(name, resolved.atom);
    }
  }
  return out;
}

// How each parameter's TP slices make it, the frozen ones' too (`megatron`: by Megatron's rules):
// Megatron's rules (MegatronMaps, which set `vocab`) where the model states record them, at tp = 1
// too, so that they place the save at another degree, unless they do not name every parameter;
// AutoTP's maps at tp > 1, but for AutoEP's fused experts, which it does not split; else at
// tp = 1 every parameter is its one slice.
Result<AutoTpMaps> SliceMaps(const std::vector<TpRank>& ranks, const ExpertPlacement& placement,
                             std::optional<Vocab>& vocab, bool& megatron) {
  const ModelStates& head = ranks[0].models.front();
  megatron = RecordsMegatronRules(head.reader);
  if (megatron) {
    std::vector<const GroupLayout*> layouts;
    for (const GroupLayout& group : head.flat_groups) layouts.push_back(&group);
    layouts.push_back(&head.frozen);
    Result<AutoTpMaps> maps = MegatronMaps(head.reader, head.tp, layouts, vocab);
    if (head.tp > 1) return maps;
    megatron = maps.ok();
    if (megatron) {
      // ds_to_universal keeps a ZeRO-3 save's padding rows at tp = 1 (at tp > 1 it drops them),
      // so there a vocabulary atom holds them: rows past them are padding at the target.
      for (const std::string& name : maps->vocabulary) maps->whole_shapes[name][0] = vocab->padded;
      return maps;
    }
    vocab.reset();
  }
  // Each parameter of `group` whole in `out` (at tp = 1, or AutoEP's experts), or else named in
  // `split`.
  const auto add = [&](const GroupLayout& group, AutoTpMaps& out, std::vector<std::string>& split) {
    for (size_t k = 0; k < group.names.size(); ++k) {
      if (head.tp > 1 && !placement.experts.contains(group.names[k])) {
        split.push_back(group.names[k]);
        continue;
      }
      out.maps.emplace(group.names[k], ShardMap{});
      out.whole_shapes.emplace(group.names[k], group.shapes[k]);
    }
  };
  AutoTpMaps whole;
  std::vector<std::string> split;
  for (const GroupLayout& group : head.flat_groups) add(group, whole, split);
  add(head.frozen, whole, split);
  if (split.empty()) return whole;
  UCP_ASSIGN_OR_RETURN(AutoTpMaps maps, ReadAutoTpMaps(head.reader, head.tp, split));
  maps.maps.merge(whole.maps);
  maps.whole_shapes.merge(whole.whole_shapes);
  return maps;
}

// A model-states file (`root`, imported into `graph` from `reader`) as ds_to_universal writes it
// for an AutoEP tag under ZeRO-3 (unlike ZeRO-1/2's, moe.cc's UniversalAutoEpModelStates, no
// digest of the layers): loaded and saved again with universal_checkpoint_info's
// expert_parameter_patterns its own pattern and its ds_autoep_layers the file's own list (one
// object, pickled once).
Status MarkUniversalZero3AutoEp(pickle::Graph& graph, Value* root,
                                const TorchArchiveReader& reader) {
  Value* layers = root->Get(kAutoEpLayers);
  if (layers == nullptr || layers->kind() != Kind::kList) {
    return FieldError(reader, kAutoEpLayers, "not a list");
  }
  Value* info = root->Get(deepspeed::kUniversalCheckpointInfo);
  if (info == nullptr) {
    // ds_to_universal adds the entry where the file has none.
    info = graph.Dict({});
    root->mutable_entries().emplace_back(
        graph.Str(std::string(deepspeed::kUniversalCheckpointInfo)), info);
  }
  if (info->kind() != Kind::kDict) {
    return FieldError(reader, deepspeed::kUniversalCheckpointInfo, "not a dict");
  }
  // Python's item assignment: the entry replaced where the dict has it, else added last.
  const auto put = [&](const std::string& key, Value* value) {
    for (auto& [k, v] : info->mutable_entries()) {
      if (k->kind() == Kind::kStr && k->data() == key) {
        v = value;
        return;
      }
    }
    info->mutable_entries().emplace_back(graph.Str(key), value);
  };
  put("expert_parameter_patterns", graph.List({graph.Str(std::string(kZero3ExpertPattern))}));
  put(std::string(kAutoEpLayers), layers);
  return Status::Ok();
}

// ds_zero_partition_groups of rank (t, r)'s optimizer states `dict` (imported from `reader`, the
// source's template) for the flat groups of `placement` (the target's): per flat group g the
// source's entry of a flat group of its kind with sub_group g, partition_count, partition_rank and
// partition_ranks (t, r)'s at the target, and an expert group's group_names the target's group
// name.
Status SetPartitionGroups(pickle::Graph& graph, Value* dict, const ExpertPlacement& placement,
                          uint32_t t, uint32_t r, const IndexFacts& facts,
                          const TorchArchiveReader& reader) {
  const std::string field = std::string(kOsd) + "/" + std::string(kPartitionGroups);
  Value** groups = MutableEntry(dict, kPartitionGroups);
  if (groups == nullptr || (*groups)->kind() != Kind::kList ||
      (*groups)->items().size() != facts.flat_groups.size()) {
    return FieldError(reader, field, "not a list of the index's flat groups");
  }
  const ExpertRankOrder& order = placement.order;
  std::vector<Value*> rebuilt;
  for (size_t g = 0; g < placement.expert_groups.size(); ++g) {
    const bool experts = placement.IsExpertGroup(g);
    size_t model = 0;
    while (model < facts.flat_groups.size() && facts.placement.IsExpertGroup(model) != experts) {
      ++model;
    }
    const Value* source = model < facts.flat_groups.size() ? (*groups)->items()[model] : nullptr;
    if (source == nullptr || source->kind() != Kind::kDict) {
      return FieldError(reader, field,
                        "no flat group of the kind of target flat group " + std::to_string(g));
    }
    Value* entry = graph.Dict(source->entries());
    const std::string where = reader.path();
    const auto integer = [&](uint64_t value) { return graph.Int(static_cast<int64_t>(value)); };
    UCP_RETURN_IF_ERROR(SetDictItem(entry, "sub_group", integer(g), where));
    UCP_RETURN_IF_ERROR(
        SetDictItem(entry, "partition_count", integer(placement.PartitionCount(g)), where));
    UCP_RETURN_IF_ERROR(
        SetDictItem(entry, "partition_rank", integer(placement.PartitionRank(g, t, r)), where));
    UCP_RETURN_IF_ERROR(SetDictItem(entry, "partition_ranks",
                                    IntList(graph, placement.PartitionRanks(g, t, r)), where));
    if (experts) {
      UCP_RETURN_IF_ERROR(
          SetDictItem(entry, "group_names",
                      graph.List({graph.Str(std::string(deepspeed::kExpertGroupNamePrefix) +
                                            std::to_string(order.ep))}),
                      where));
    }
    rebuilt.push_back(entry);
  }
  *groups = graph.List(std::move(rebuilt));
  return Status::Ok();
}

// Phase 1 of PlanReshard: `target` checked against the tag (kInvalidArgument where DeepSpeed
// cannot run there, kUnsupported where ucp cannot write it). Returns AutoEP's expert-parallel size
// at the target (the tag's by default), 0 for a tag without AutoEP.
Result<uint32_t> CheckReshardTarget(const IndexFacts& facts, const Topology& target) {
  const uint32_t ep = facts.placement.ep == 0 ? 0 : target.ep == 0 ? facts.placement.ep : target.ep;
  const uint32_t tp = target.tp;
  if (ep == 0) {
    UCP_RETURN_IF_ERROR(RefuseExpertParallel(target));
  } else {
    // With AutoTP DeepSpeed folds the expert ranks over the world (folding.h).
    const uint64_t world = uint64_t{target.dp} * tp;
    for (const auto& [name, experts] : facts.placement.experts) {
      if (world % ep != 0 || experts % ep != 0) {
        return Status::InvalidArgument(
            "deepspeed: ep=" + std::to_string(ep) + " does not divide the world " +
            std::to_string(world) + " (tp=" + std::to_string(tp) +
            " x dp=" + std::to_string(target.dp) + ") and the " + std::to_string(experts) +
            " experts of " + name + ": DeepSpeed's AutoEP cannot run there");
      }
    }
    if (tp > 1 && ep == 1) {
      return Status::Unsupported("deepspeed: tp=" + std::to_string(tp) +
                                 ",ep=1: DeepSpeed folds AutoEP over AutoTP only at an "
                                 "expert-parallel size above 1");
    }
    if (tp > 1 && facts.tp == 1) {
      return Status::Unsupported("deepspeed: tp=" + std::to_string(tp) +
                                 ": an AutoEP tag saved at tp 1 records no AutoTP split");
    }
  }
  if (facts.tp == 1 && !facts.megatron) {
    if (tp > 1) {
      return Status::Unsupported(
          "deepspeed: tp=" + std::to_string(tp) +
          ": a ZeRO-3 tag of one TP rank is placed at another TP degree only by Megatron's rules "
          "(universal_checkpoint_info's patterns) naming every parameter; this tag's index "
          "records none (an index ucp wrote before it read a vocabulary padded at tp 1 so: "
          "rebuild it with `ucp index`)");
    }
    UCP_RETURN_IF_ERROR(CheckTarget(target));
  } else {
    if (tp == 0 || (target.world != 0 && target.world % tp != 0)) {
      return Status::InvalidArgument("deepspeed: world=" + std::to_string(target.world) +
                                     " is not a multiple of tp=" + std::to_string(tp));
    }
    UCP_RETURN_IF_ERROR(
        CheckTarget({target.dp, 1, target.pp, target.world == 0 ? 0 : target.world / tp,
                     target.zero_stage, target.ep}));
  }
  return ep;
}

// What a reshard writes at the target: the facts at its TP degree, DP size and expert-parallel
// size, each TP rank's flat groups and how they differ from the source's.
struct ReshardLayout {
  IndexFacts at;
  uint32_t tp = 1;
  uint32_t m = 1;                // the target's DP size
  uint32_t ep = 0;               // AutoEP's expert-parallel size; 0 without AutoEP
  bool reshaped = false;         // another TP degree: each parameter's slices change
  bool experts_resized = false;  // another expert-parallel size: the fused parameters' rows
  bool regrouped = false;        // other flat groups (DeepSpeed's sub groups at m)
  std::vector<std::vector<uint64_t>> members;           // per parameter group, its flat groups
  std::vector<std::vector<GroupLayout>> rank_groups;    // per TP rank, its flat groups
  std::map<std::string, std::vector<uint64_t>> uneven;  // reshaped: the blocks of uneven splits
};

// AutoEP at expert-parallel size `ep`: each fused parameter's rows split over ep ranks
// (at.expert_maps, at.expert_slices) and the flat groups of the rows one rank holds.
Status PlaceExpertsAt(const AtomIndex& index, IndexFacts& at, uint32_t ep) {
  at.placement.ep = ep;
  for (const auto& [name, experts] : at.placement.experts) {
    ShardMap map = ExpertRowsMap(experts);
    UCP_ASSIGN_OR_RETURN(const Shape whole, AtomShape(index, name, "fp32"));
    UCP_ASSIGN_OR_RETURN(Geometry geometry,
                         GeometryAt(name, map, whole, ep, std::nullopt, map.blocks));
    at.expert_maps.emplace(name, std::move(map));
    at.expert_slices.emplace(name, std::move(geometry));
  }
  for (GroupLayout& group : at.flat_groups) {
    std::vector<Shape> shapes;
    for (size_t k = 0; k < group.names.size(); ++k) {
      const auto rows = at.expert_slices.find(group.names[k]);
      shapes.push_back(rows == at.expert_slices.end() ? group.shapes[k]
                                                      : LocalShape(rows->second, 0));
    }
    UCP_ASSIGN_OR_RETURN(group, MakeLayout(group.names, std::move(shapes)));
  }
  return Status::Ok();
}

// Phase 2 of PlanReshard: the layout at `target` (checked by CheckReshardTarget, which gave `ep`).
Result<ReshardLayout> LayoutAtTarget(const AtomIndex& index, const std::string& tag_dir,
                                     const IndexFacts& facts, const Topology& target, uint32_t ep) {
  const uint32_t tp = target.tp;
  // At another TP degree each parameter's slices, and so the flat groups, are those at `tp`.
  const bool reshaped = tp != facts.tp;
  AutoTpSplitRule rule;
  if (reshaped && !facts.megatron) {
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader head,
                         OpenSource(index, tag_dir, facts.model_file));
    UCP_ASSIGN_OR_RETURN(rule, ReadAutoTpSplitRule(head, tag_dir));
  }
  UCP_ASSIGN_OR_RETURN(IndexFacts at, reshaped ? FactsAtTp(facts, tp, rule) : facts);
  const uint32_t m = target.dp;
  const bool experts_resized = ep != facts.placement.ep;
  at.placement.tp = tp;
  at.placement.order = {m * tp, ep == 0 ? 1 : ep, facts.placement.order.data_before_expert};
  if (ep != 0) UCP_RETURN_IF_ERROR(PlaceExpertsAt(index, at, ep));
  // Each TP rank's flat groups; DeepSpeed makes each rank's sub groups of its own slices, and
  // ucp writes one group structure for all (rank (0, 0)'s files are the templates).
  std::vector<std::vector<uint64_t>> members;
  UCP_ASSIGN_OR_RETURN(const std::vector<GroupLayout> flat_groups, FlatGroupsAt(at, m, 0, members));
  std::vector<std::vector<GroupLayout>> rank_groups = {flat_groups};
  for (uint32_t t = 1; t < tp; ++t) {
    std::vector<std::vector<uint64_t>> rank_members;
    UCP_ASSIGN_OR_RETURN(std::vector<GroupLayout> groups, FlatGroupsAt(at, m, t, rank_members));
    bool same = rank_members == members && groups.size() == flat_groups.size();
    for (size_t g = 0; same && g < groups.size(); ++g) {
      same = groups[g].names == flat_groups[g].names;
    }
    if (!same) {
      return Status::Unsupported(
          "deepspeed: tp=" + std::to_string(tp) + ", dp=" + std::to_string(m) +
          ": DeepSpeed's sub groups (sub_group_size " + std::to_string(at.sub_group_size) +
          ") of TP rank " + std::to_string(t) + "'s slices differ from TP rank 0's");
    }
    rank_groups.push_back(std::move(groups));
  }
  // Which target flat groups hold AutoEP's experts.
  at.placement.expert_groups.clear();
  for (const GroupLayout& group : flat_groups) {
    at.placement.expert_groups.push_back(at.placement.experts.contains(group.names.front()));
  }
  bool regrouped = flat_groups.size() != facts.flat_groups.size();
  for (size_t g = 0; !regrouped && g < flat_groups.size(); ++g) {
    regrouped = flat_groups[g].names != facts.flat_groups[g].names;
  }
  std::map<std::string, std::vector<uint64_t>> uneven;  // reshaped: the blocks of uneven splits
  for (const auto& [name, map] : at.maps) {
    if (!map.blocks.empty()) uneven.emplace(name, map.blocks);
  }
  return ReshardLayout{std::move(at),
                       tp,
                       m,
                       ep,
                       reshaped,
                       experts_resized,
                       regrouped,
                       std::move(members),
                       std::move(rank_groups),
                       std::move(uneven)};
}

// An mpu's TP degree where the model states (imported into `graph` as `root` from `reader`) record
// it: mp_world_size, checkpoint_parallel_dimensions' tp_degree, universal_checkpoint_info's
// padded_vocab_size (Megatron pads by the degree) and Megatron's arguments where the client saved
// them (SetMegatronTopology).
Status SetMegatronTpDegree(pickle::Graph& graph, Value* root, const std::optional<Vocab>& vocab,
                           const ReshardLayout& to, const TorchArchiveReader& reader) {
  UCP_RETURN_IF_ERROR(SetDictItem(root, "mp_world_size", graph.Int(to.tp), reader.path()));
  if (Value* dimensions = root->Get("checkpoint_parallel_dimensions");
      dimensions != nullptr && dimensions->kind() == Kind::kDict) {
    UCP_RETURN_IF_ERROR(SetDictItem(dimensions, "tp_degree", graph.Int(to.tp), reader.path()));
  }
  return deepspeed::SetMegatronTopology(graph, root, vocab, {to.m, to.tp, 1, to.m * to.tp},
                                        reader.path());
}

// The folding dict of rank (t, r)'s file (`root`, imported from `reader`) at the target: where
// AutoTP folds AutoEP there, the rank's place in DeepSpeed's grid (SetFolding); at tp 1, where a
// run records none, with the rest of what AutoTP records (UnfoldAutoTp).
Status SetFoldingAt(pickle::Graph& graph, Value* root, const TorchArchiveReader& reader,
                    const ReshardLayout& to, uint32_t t, uint32_t r) {
  if (root->Get(deepspeed::kFolding) == nullptr) return Status::Ok();
  if (to.tp == 1) return deepspeed::UnfoldAutoTp(graph, root, reader);
  const ExpertPlacement& placement = to.at.placement;
  return deepspeed::SetFolding(graph, root, reader, placement.Grid(), placement.WorldRank(t, r));
}

// AutoTP's record in model states `root` (imported into `graph` from `reader`) at the target's TP
// degree (SetTpDegree): with AutoEP's experts, which AutoTP records whole at their rows per
// expert-parallel rank, at the target's; but AutoEP at tp 1, which SetFoldingAt unfolds as a run
// there records it.
Status SetAutoTpRecord(pickle::Graph& graph, Value* root, const TorchArchiveReader& reader,
                       const ReshardLayout& to) {
  if (to.ep == 0) return SetTpDegree(graph, root, to.tp, reader, to.uneven);
  if (to.tp == 1) return Status::Ok();
  std::map<std::string, Shape> expert_rows;
  for (const auto& [name, geometry] : to.at.expert_slices) {
    expert_rows[name] = LocalShape(geometry, 0);
  }
  UCP_RETURN_IF_ERROR(deepspeed::SetReplicatedShapes(graph, root, reader, expert_rows));
  return SetTpDegree(graph, root, to.tp, reader, to.uneven);
}

// Phase 3 of PlanReshard: every target rank's model states.
Status PlanModelStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const ReshardLayout& to, OutputPlan& plan) {
  // Model states: DP rank 0's of each TP rank (at another TP degree rank (0, 0)'s, its TP facts
  // rewritten), with dp_world_size and each rank's frozen fragments.
  for (uint32_t t = 0; t < to.tp; ++t) {
    const uint32_t model_file = to.reshaped ? facts.model_file : facts.model_files[t * facts.dp];
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, model_file));
    std::vector<const TorchTensor*> frozen_templates;
    for (const std::string& name : facts.frozen.names) {
      UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, "frozen_param_fragments/" + name));
      const TorchTensor* tensor = reader.TensorAt(node);
      if (tensor == nullptr) {
        return FieldError(reader, "frozen_param_fragments/" + name, "not a tensor");
      }
      frozen_templates.push_back(tensor);
    }
    for (uint32_t r = 0; r < to.m; ++r) {
      ArchiveOutput out;
      out.path = Zero3ModelStatesName(r, t);
      Value* root = out.graph.Import(reader.root());
      out.graph.set_root(root);
      UCP_RETURN_IF_ERROR(SetDictItem(root, "dp_world_size", out.graph.Int(to.m), reader.path()));
      if (to.regrouped || to.reshaped || to.experts_resized) {
        UCP_RETURN_IF_ERROR(RegroupShapes(out.graph, root, to.rank_groups[t], reader,
                                          to.reshaped || to.experts_resized));
      }
      if (to.reshaped && facts.megatron) {
        UCP_RETURN_IF_ERROR(SetMegatronTpDegree(out.graph, root, facts.vocab, to, reader));
      } else if (to.reshaped || (to.tp > 1 && to.experts_resized)) {
        UCP_RETURN_IF_ERROR(SetAutoTpRecord(out.graph, root, reader, to));
      }
      if (to.ep != 0) {  // rank (t, r)'s place at (tp, m, ep), as DeepSpeed's run there records it
        UCP_RETURN_IF_ERROR(SetAutoEpLayers(out.graph, root, to.at.placement.order,
                                            to.at.placement.WorldRank(t, r), reader));
        UCP_RETURN_IF_ERROR(
            SetConfigValue(out.graph, root, "expert_parallel", "autoep_size", to.ep, reader));
        UCP_RETURN_IF_ERROR(SetFoldingAt(out.graph, root, reader, to, t, r));
      }
      // engine._get_shared_params fills the map on global rank 0 only.
      if (r > 0 || t > 0) {
        if (Value** shared = MutableEntry(root, "shared_params");
            shared != nullptr && (*shared)->kind() == Kind::kDict) {
          *shared = out.graph.Dict({});
        }
      }
      std::map<std::string, std::vector<Segment>> replaced;
      Value* fragments = root->Get("frozen_param_fragments");
      for (size_t k = 0; k < facts.frozen.names.size(); ++k) {
        const std::string& name = facts.frozen.names[k];
        const TorchTensor& tensor = *frozen_templates[k];
        Value** slot = MutableEntry(fragments, name);
        if (slot == nullptr) return FieldError(reader, "frozen_param_fragments/" + name, "missing");
        const Geometry whole = WholeGeometry(1, facts.frozen.shapes[k]);
        const Slice slice = SliceOf(to.at, name, t, whole);
        const Shape local = LocalShape(*slice.geometry, slice.t);
        UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(local));
        const uint64_t piece = PieceOf(numel, to.m);
        UCP_ASSIGN_OR_RETURN(*slot, PartitionTensor(out.graph, tensor, piece, piece));
        UCP_ASSIGN_OR_RETURN(replaced[tensor.storage->key],
                             PieceSegments(index, name, kFrozenState, numel, to.m, r,
                                           ItemSize(tensor.dtype), slice));
        if (to.reshaped) {
          UCP_RETURN_IF_ERROR(SetFrozenShape(out.graph, root, name, local, reader));
        }
      }
      UCP_ASSIGN_OR_RETURN(out.storages,
                           CollectStorages(root, reader, model_file, std::move(replaced)));
      plan.archives.push_back(std::move(out));
    }
  }
  return Status::Ok();
}

// Phase 4 of PlanReshard: every target rank's optimizer states.
Status PlanOptimStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const ReshardLayout& to, OutputPlan& plan) {
  // Optimizer states: rank 0's, with partition_count and each rank's partitions of each flat
  // group; where the sub groups change, the flat groups' lists are rebuilt, new groups' tensors
  // like group 0's.
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  const std::string osd(kOsd);
  std::vector<std::vector<FlatLayout>> rank_layouts(to.tp);
  for (uint32_t t = 0; t < to.tp; ++t) {
    for (size_t g = 0; g < to.rank_groups[t].size(); ++g) {
      UCP_ASSIGN_OR_RETURN(FlatLayout layout,
                           LayoutAt(to.rank_groups[t][g], to.at.placement.PartitionCount(g)));
      rank_layouts[t].push_back(std::move(layout));
    }
  }
  // Rank (0, 0)'s file is every rank's template: every TP rank's files differ only in the
  // tensors written here, sized by that rank's slices.
  for (uint32_t i = 0; i < to.m * to.tp; ++i) {
    const uint32_t r = i % to.m;
    const uint32_t t = i / to.m;
    const std::vector<FlatLayout>& layouts = rank_layouts[t];
    ArchiveOutput out;
    out.path = OptimName(facts.prefix, r, t);
    Value* root = out.graph.Import(reader.root());
    out.graph.set_root(root);
    Value* dict = root->Get(kOsd);
    UCP_RETURN_IF_ERROR(SetDictItem(dict, "partition_count", out.graph.Int(to.m), reader.path()));
    if (to.reshaped) UCP_RETURN_IF_ERROR(SetAutoTpSize(out.graph, root, to.tp, reader));
    if (to.ep != 0) {
      UCP_RETURN_IF_ERROR(
          SetConfigValue(out.graph, root, "expert_parallel", "autoep_size", to.ep, reader));
      UCP_RETURN_IF_ERROR(
          SetPartitionGroups(out.graph, dict, to.at.placement, t, r, facts, reader));
      UCP_RETURN_IF_ERROR(SetFoldingAt(out.graph, root, reader, to, t, r));
    }
    Value* inner = dict->Get(kOsd);
    Value* states = inner == nullptr ? nullptr : inner->Get("state");
    Value* fp32 = dict->Get("fp32_flat_groups");
    Value* param_groups = inner == nullptr ? nullptr : inner->Get("param_groups");
    if (states == nullptr || states->kind() != Kind::kDict || fp32 == nullptr ||
        fp32->kind() != Kind::kList || param_groups == nullptr ||
        param_groups->kind() != Kind::kList || fp32->items().size() != facts.flat_groups.size() ||
        param_groups->items().size() != to.members.size()) {
      return FieldError(reader, osd, "not the flat groups the index describes");
    }
    FreshKeys keys(reader);
    std::map<std::string, std::vector<Segment>> replaced;
    std::vector<std::pair<Value*, Value*>> new_states;
    std::vector<Value*> new_fp32;
    for (size_t g = 0; g < layouts.size(); ++g) {
      const FlatLayout& layout = layouts[g];
      // The source's flat group g, or group 0 as the model of one DeepSpeed adds here.
      const size_t model = g < facts.flat_groups.size() ? g : 0;
      const std::string ms = std::to_string(model);
      Value** model_states = MutableEntry(states, ms);
      if (model_states == nullptr || (*model_states)->kind() != Kind::kDict) {
        return FieldError(reader, osd + "/" + osd + "/state/" + ms, "missing");
      }
      Value* group_states = g == model ? *model_states : out.graph.Dict((*model_states)->entries());
      std::vector<std::pair<std::string, Value**>> tensors;
      new_fp32.push_back(fp32->items()[model]);
      tensors.emplace_back("fp32", &new_fp32.back());
      for (auto& [key, value] : group_states->mutable_entries()) {
        tensors.emplace_back(KeyText(key), &value);
      }
      for (auto& [state, slot] : tensors) {
        const std::string field = state == "fp32" ? osd + "/fp32_flat_groups/" + ms
                                                  : osd + "/" + osd + "/state/" + ms + "/" + state;
        UCP_ASSIGN_OR_RETURN(const Value* template_node, Field(reader, field));
        const TorchTensor* tensor = reader.TensorAt(template_node);
        if (tensor == nullptr) continue;
        if (tensor->shape.empty()) {
          if (g == model) continue;
          // A 0-d state (Adam's step) of a new group: a copy of group 0's.
          const std::string key = keys.Next();
          UCP_ASSIGN_OR_RETURN(*slot, TensorLike(out.graph, *tensor, key, {}, 1));
          replaced[key] = {
              Segment{facts.optim_file, tensor->file_offset(), ItemSize(tensor->dtype)}};
          continue;
        }
        const std::string key = g == model ? tensor->storage->key : keys.Next();
        const ExpertPlacement& placement = to.at.placement;
        UCP_ASSIGN_OR_RETURN(
            replaced[key],
            PartitionSegments(index, to.at, layout, state, placement.PartitionRank(g, t, r),
                              ItemSize(tensor->dtype), placement.Holder(g, t, r)));
        UCP_ASSIGN_OR_RETURN(
            *slot, TensorLike(out.graph, *tensor, key, {layout.partition}, layout.partition));
      }
      new_states.emplace_back(out.graph.Int(static_cast<int64_t>(g)), group_states);
    }
    if (to.regrouped) {
      states->mutable_entries() = std::move(new_states);
      fp32->mutable_items() = std::move(new_fp32);
      for (size_t pg = 0; pg < to.members.size(); ++pg) {
        UCP_RETURN_IF_ERROR(SetDictItem(param_groups->items()[pg], "params",
                                        IntList(out.graph, to.members[pg]), reader.path()));
      }
    } else {
      fp32->mutable_items() = std::move(new_fp32);
    }
    UCP_ASSIGN_OR_RETURN(out.storages,
                         CollectStorages(root, reader, facts.optim_file, std::move(replaced)));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

// A ZeRO-3 tag as BuildIndex's phases read it: every rank's files, checked to be one save's.
struct Zero3Tag {
  uint32_t dp = 0;
  uint32_t tp = 1;
  ExpertPlacement placement;
  RankGrid grid;
  std::vector<TpRank> ranks;
  AutoTpMaps slices;           // how each parameter's TP slices make it
  bool megatron = false;       // the slices are Megatron's rules' (RecordsMegatronRules)
  std::optional<Vocab> vocab;  // Megatron's rules: the vocabulary's sizes where one is padded

  // The index's files: every rank's model states, then its optimizer states, each TP rank's in
  // DP rank order.
  uint32_t ModelFile(uint32_t t, uint32_t r) const { return t * dp + r; }
  uint32_t OptimFile(uint32_t t, uint32_t r) const { return (tp + t) * dp + r; }
};

// What the atom phases of BuildIndex record for adapter_state.
struct IndexRecords {
  std::set<std::string> seen;  // every parameter, to refuse one listed twice
  nlohmann::json flat_groups = nlohmann::json::array();
  nlohmann::json shard_maps = nlohmann::json::object();
  nlohmann::json frozen_params = nlohmann::json::array();

  // kCorrupt naming `field` of `reader` where parameter `name` was seen before.
  Status Once(const std::string& name, const TorchArchiveReader& reader, const std::string& field) {
    if (!seen.insert(name).second) return FieldError(reader, field, "listed twice");
    return Status::Ok();
  }
};

// Phase 1 of BuildIndex: the ranks' files, read and checked to be one save's.
Result<Zero3Tag> ReadTag(const std::string& tag_dir) {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  if (!listing.model_states.empty() || !listing.layer_files.empty()) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "mp_rank_XX_model_states.pt or layer files beside ZeRO-3 model "
                               "states: pipeline or mixed tags are not supported");
  }
  const auto head_entry =
      std::find_if(listing.zero3_model_states.begin(), listing.zero3_model_states.end(),
                   [](const RankFile& entry) { return entry.dp == 0 && entry.mp == 0; });
  if (head_entry == listing.zero3_model_states.end()) {
    return Status::NotFound(Prefix(tag_dir) + Zero3ModelStatesName(0, 0) + ": not found");
  }
  UCP_ASSIGN_OR_RETURN(ModelStates head, ReadModelStates(tag_dir, *head_entry));
  if (head.config_stage && *head.config_stage != 3) {
    return FieldError(head.reader, "ds_config/zero_optimization/stage",
                      "not 3, but the file is named as ZeRO-3's");
  }
  Zero3Tag tag;
  tag.dp = head.dp;
  tag.tp = head.tp;
  UCP_ASSIGN_OR_RETURN(tag.placement, ReadExpertPlacement(head));
  UCP_ASSIGN_OR_RETURN(tag.grid, GridOf(tag_dir, listing, head));
  UCP_ASSIGN_OR_RETURN(tag.ranks, ReadRanks(tag_dir, tag.grid, std::move(head), tag.placement));
  UCP_RETURN_IF_ERROR(CheckSubGroups(tag.ranks, tag.placement));
  UCP_ASSIGN_OR_RETURN(tag.slices, SliceMaps(tag.ranks, tag.placement, tag.vocab, tag.megatron));
  return tag;
}

// Phase 2 of BuildIndex: what the index is of, and its files.
Status AddFiles(const std::string& tag_dir, const Zero3Tag& tag, const IndexOptions& options,
                AtomIndexContents& c) {
  const uint32_t dp = tag.dp;
  const uint32_t tp = tag.tp;
  const std::vector<TpRank>& ranks = tag.ranks;
  const ModelStates& ms = ranks[0].models.front();
  c.framework = "deepspeed";
  c.framework_version = ms.ds_version;
  c.adapter = std::string(DeepSpeedZero3Adapter::kName);
  c.adapter_schema = DeepSpeedZero3Adapter::kSchema;
  c.tag = TagName(tag_dir);
  c.topology = {dp, tp, 1, dp * tp, 3};
  std::vector<std::string> paths;
  for (const bool model : {true, false}) {
    for (const TpRank& rank : ranks) {
      for (uint32_t r = 0; r < dp; ++r) {
        paths.push_back(model ? rank.models[r].entry.name : rank.optims[r].entry.name);
      }
    }
  }
  UCP_ASSIGN_OR_RETURN(const std::vector<FileDigest> digests,
                       HashTagFiles(tag_dir, paths, {options.threads, options.trust_journal}));
  for (uint32_t i = 0; i < paths.size(); ++i) {
    const bool model = i < dp * tp;
    const uint32_t rank = model ? i : i - dp * tp;
    c.files.push_back({paths[i], digests[i].size, digests[i].xxh3,
                       std::string(model ? kModelRole : kOptimRole),
                       RankCoordinates{rank % dp, rank / dp, 0}});
    c.files.back().chunks = digests[i].chunks;
  }
  return Status::Ok();
}

// Phase 3 of BuildIndex: the atoms of each trainable parameter, whole, from the DP pieces of its
// TP slices (of TP rank 0 alone when every rank holds it whole; of every expert-parallel rank's
// rows for AutoEP's fused experts), and the parameter groups.
Status AddTrainableAtoms(const Zero3Tag& tag, AtomIndexContents& c, IndexRecords& records) {
  const uint32_t tp = tag.tp;
  const std::vector<TpRank>& ranks = tag.ranks;
  const ModelStates& ms = ranks[0].models.front();
  const OptimStates& first = ranks[0].optims.front();
  const ExpertPlacement& placement = tag.placement;
  const AutoTpMaps& slices = tag.slices;
  for (const std::vector<int64_t>& members : first.group_members) {
    ParamGroup group;
    const Value* param_group = first.param_groups[c.groups.size()];
    for (const auto& [key, value] : NamedChildren(param_group)) {
      if (key != "params") group.hyperparameters[key] = JsonOf(value);
    }
    for (const int64_t member : members) {
      const size_t g = static_cast<size_t>(member);
      const std::string gs = std::to_string(g);
      const bool experts = placement.IsExpertGroup(g);
      const uint32_t parts = placement.PartitionCount(g);
      std::vector<FlatLayout> layouts;  // per TP rank
      for (const TpRank& rank : ranks) {
        UCP_ASSIGN_OR_RETURN(FlatLayout layout,
                             LayoutAt(rank.models.front().flat_groups[g], parts));
        layouts.push_back(std::move(layout));
      }
      records.flat_groups.push_back(
          {{"param_group", c.groups.size()}, {"params", layouts[0].params.names.size()}});
      if (group.scalars.empty()) {
        for (const StateTensor& st : first.states[g]) {
          if (!st.tensor->shape.empty()) continue;
          if (std::optional<nlohmann::json> value = ScalarValue(first.reader, *st.tensor)) {
            group.scalars[st.key] = *value;
          }
        }
      }
      for (size_t k = 0; k < layouts[0].params.names.size(); ++k) {
        const std::string& name = layouts[0].params.names[k];
        UCP_RETURN_IF_ERROR(records.Once(name, ms.reader, "param_shapes/" + gs + "/" + name));
        group.params.push_back(name);
        // A fused expert parameter's atom is the whole of it: every expert-parallel rank's rows.
        const ShardMap map =
            experts ? ExpertRowsMap(placement.experts.at(name)) : slices.maps.at(name);
        Shape whole = slices.whole_shapes.at(name);
        if (experts && !whole.empty()) whole.front() = placement.experts.at(name);
        const uint32_t degree = experts ? placement.ep : tp;
        UCP_ASSIGN_OR_RETURN(
            const Geometry geometry,
            GeometryAt(name, map, whole, degree, experts ? std::nullopt : tag.vocab, map.blocks));
        for (uint32_t t = 0; t < tp; ++t) {
          if (layouts[t].params.shapes[k] != LocalShape(geometry, t)) {
            return FieldError(ranks[t].models.front().reader, "param_shapes/" + gs + "/" + name,
                              ShapeText(layouts[t].params.shapes[k]) + ", but " +
                                  (experts ? "ds_autoep_layers gives each expert-parallel rank "
                                           : "universal_checkpoint_info gives TP rank " +
                                                 std::to_string(t) + " ") +
                                  "a slice of " + ShapeText(LocalShape(geometry, t)));
          }
        }
        if ((tp > 1 || tag.megatron) && !experts) records.shard_maps[name] = MapJson(map);
        // Who holds the parameter's slices: every expert-parallel rank its rows, partitioned over
        // its expert-data-parallel ranks; every TP rank of a split its slice, over its DP ranks.
        const uint32_t holders = experts ? placement.ep : map.rule == Rule::kSplit ? tp : 1;
        // Every DP piece of every holder's slice of the state that `tensor_of` gives.
        const auto add_pieces = [&](Atom& atom, const auto& tensor_of) -> Status {
          for (uint32_t h = 0; h < holders; ++h) {
            std::vector<std::pair<uint32_t, const TorchTensor*>> per_rank;
            for (uint32_t q = 0; q < parts; ++q) {
              const auto [t, r] =
                  experts ? placement.Coordinates(placement.order.Rank(h, q)) : std::pair{h, q};
              per_rank.emplace_back(tag.OptimFile(t, r), tensor_of(ranks[t].optims[r]));
            }
            // An expert group's layout is every TP rank's.
            UCP_RETURN_IF_ERROR(
                AddPieceFragments(atom, layouts[experts ? 0 : h], k, per_rank, map, geometry, h));
          }
          return Status::Ok();
        };
        Atom fp32{name, "fp32", first.fp32[g]->dtype, whole, {}};
        UCP_RETURN_IF_ERROR(add_pieces(fp32, [g](const OptimStates& os) { return os.fp32[g]; }));
        c.atoms.push_back(std::move(fp32));
        for (size_t s = 0; s < first.states[g].size(); ++s) {
          const StateTensor& st = first.states[g][s];
          Atom atom{name, st.key, st.tensor->dtype, {}, {}};
          if (st.tensor->shape.empty()) {
            // ds_to_universal's ZeRO-1/2 step.pt: the flat group's 0-d state, here rank 0's.
            UCP_ASSIGN_OR_RETURN(Region region, Region::Whole(atom.shape));
            atom.fragments.push_back(
                {tag.OptimFile(0, 0), st.tensor->file_offset(), st.tensor->dtype, region});
          } else {
            atom.shape = whole;
            UCP_RETURN_IF_ERROR(
                add_pieces(atom, [g, s](const OptimStates& os) { return os.states[g][s].tensor; }));
          }
          c.atoms.push_back(std::move(atom));
        }
      }
    }
    c.groups.push_back(std::move(group));
  }
  return Status::Ok();
}

// Phase 4 of BuildIndex: the frozen parameters, each whole, from the DP pieces of its TP slices
// (frozen_param_fragments, each a tensor of its own) as for the trainable ones.
Status AddFrozenAtoms(const Zero3Tag& tag, AtomIndexContents& c, IndexRecords& records) {
  const uint32_t dp = tag.dp;
  const uint32_t tp = tag.tp;
  const std::vector<TpRank>& ranks = tag.ranks;
  const ModelStates& ms = ranks[0].models.front();
  const AutoTpMaps& slices = tag.slices;
  std::vector<FlatLayout> frozen_layouts;  // per TP rank, each piece starting at element 0
  for (const TpRank& rank : ranks) {
    UCP_ASSIGN_OR_RETURN(FlatLayout layout, LayoutAt(rank.models.front().frozen, dp));
    layout.starts.assign(layout.starts.size(), 0);
    frozen_layouts.push_back(std::move(layout));
  }
  for (size_t k = 0; k < ms.frozen.names.size(); ++k) {
    const std::string& name = ms.frozen.names[k];
    UCP_RETURN_IF_ERROR(records.Once(name, ms.reader, "frozen_param_shapes/" + name));
    records.frozen_params.push_back(name);
    const ShardMap& map = slices.maps.at(name);
    const Shape& whole = slices.whole_shapes.at(name);
    UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                         GeometryAt(name, map, whole, tp, tag.vocab, map.blocks));
    if (tp > 1 || tag.megatron) records.shard_maps[name] = MapJson(map);
    Atom atom{name, std::string(kFrozenState), ms.frozen_fragments[k]->dtype, whole, {}};
    for (uint32_t t = 0; t < (map.rule == Rule::kSplit ? tp : 1); ++t) {
      const std::vector<ModelStates>& models = ranks[t].models;
      if (models.front().frozen.shapes[k] != LocalShape(geometry, t)) {
        return FieldError(models.front().reader, "frozen_param_shapes/" + name,
                          ShapeText(models.front().frozen.shapes[k]) +
                              ", but universal_checkpoint_info gives TP rank " + std::to_string(t) +
                              " a slice of " + ShapeText(LocalShape(geometry, t)));
      }
      std::vector<std::pair<uint32_t, const TorchTensor*>> per_rank;
      for (uint32_t r = 0; r < dp; ++r) {
        const TorchTensor* tensor = models[r].frozen_fragments[k];
        if (tensor->dtype != atom.dtype) {
          return FieldError(models[r].reader, "frozen_param_fragments/" + name,
                            "another dtype than in " + ms.entry.name);
        }
        per_rank.emplace_back(tag.ModelFile(t, r), tensor);
      }
      UCP_RETURN_IF_ERROR(
          AddPieceFragments(atom, frozen_layouts[t], k, per_rank, map, geometry, t));
    }
    c.atoms.push_back(std::move(atom));
  }
  return Status::Ok();
}

// Phase 5 of BuildIndex: what the plans carry from the source files, and adapter_state.
void AddCarried(const Zero3Tag& tag, AtomIndexContents& c, IndexRecords& records) {
  const ModelStates& ms = tag.ranks[0].models.front();
  const OptimStates& first = tag.ranks[0].optims.front();
  std::vector<std::string> rewritten_optim = {std::string(kOsd) + "/partition_count",
                                              std::string(kOsd) + "/fp32_flat_groups"};
  for (size_t g = 0; g < first.states.size(); ++g) {
    for (const StateTensor& st : first.states[g]) {
      if (!st.tensor->shape.empty()) {
        rewritten_optim.push_back(std::string(kOsd) + "/" + std::string(kOsd) + "/state/" +
                                  std::to_string(g) + "/" + st.key);
      }
    }
  }
  std::vector<std::string> rewritten_model = {"dp_world_size", "frozen_param_fragments"};
  if (tag.placement.ep != 0) {  // a rank's place at the target's DP and expert-parallel sizes
    const std::string autoep_size = "ds_config/expert_parallel/autoep_size";
    rewritten_model.insert(
        rewritten_model.end(),
        {"param_shapes", std::string(kAutoEpLayers),
         std::string(deepspeed::kUniversalCheckpointInfo) + "/" + std::string(kAutoEpLayers),
         autoep_size});
    rewritten_optim.insert(rewritten_optim.end(),
                           {std::string(kOsd) + "/" + std::string(kPartitionGroups), autoep_size});
  }
  for (uint32_t t = 0; t < tag.tp; ++t) {
    for (uint32_t r = 0; r < tag.dp; ++r) {
      c.carried.push_back({std::string(kModelRole), tag.ModelFile(t, r), rewritten_model});
    }
  }
  c.carried.push_back({std::string(kOptimRole), tag.OptimFile(0, 0), rewritten_optim});
  c.carried.push_back({std::string(kUniversalRole), tag.OptimFile(0, 0), {"param_groups"}});
  c.adapter_state = {
      {"optimizer", std::string(kOptimizer)},
      {"file_prefix", tag.grid.prefix},
      {"mp_rank", 0},
      {"zero_stage", 3},
      {"sub_group_size", ms.sub_group_size},
      {"flat_groups", std::move(records.flat_groups)},
      {"frozen_params", std::move(records.frozen_params)},
  };
  if (tag.tp > 1 || tag.megatron) {
    c.adapter_state["tp"] = {{"degree", tag.tp},
                             {"params", std::move(records.shard_maps)},
                             {"vocabulary", tag.slices.vocabulary},
                             {"megatron", tag.megatron}};
    if (tag.vocab) {
      c.adapter_state["tp"]["vocab"] = {{"original", tag.vocab->original},
                                        {"padded", tag.vocab->padded},
                                        {"divisible_by", tag.vocab->divisible_by}};
    }
  }
  if (tag.placement.ep != 0) {
    c.adapter_state["autoep"] = {{"ep", tag.placement.ep},
                                 {"data_before_expert", tag.placement.order.data_before_expert},
                                 {"experts", tag.placement.experts}};
  }
}

// ---------------------------------------------------------------------------------------------
// PlanUniversalExport's phases.

// Whether each "<param>/<state>" of the flat groups requires grad in the template optimizer file
// `reader`.
Result<std::map<std::string, bool>> UniversalRequiresGrad(const TorchArchiveReader& reader,
                                                          const IndexFacts& facts) {
  const std::string osd(kOsd);
  std::map<std::string, bool> requires_grad;
  for (size_t g = 0; g < facts.flat_groups.size(); ++g) {
    const std::string gs = std::to_string(g);
    UCP_RETURN_IF_ERROR(CollectRequiresGrad(reader, osd + "/fp32_flat_groups/" + gs,
                                            osd + "/" + osd + "/state/" + gs,
                                            facts.flat_groups[g].names, requires_grad));
  }
  return requires_grad;
}

// zero/<param>/<state>.pt of `atom` as ds_to_universal writes it for the tag's layout: AutoEP's
// fused expert parameter whole with its expert marks; at tp = 1 a bare 1-d tensor (also where
// Megatron's rules are recorded); with Megatron's rules at tp > 1 (`megatron_model`: rank (0, 0)'s
// model states) merged as its ZeRO-1/2 path merges slices; with AutoTP {'param': the whole
// parameter}, marked 'vocab_tensor' first where vocabulary_parameter_patterns names it.
Result<ArchiveOutput> UniversalZero3Atom(const AtomIndex& index, const IndexFacts& facts,
                                         const std::optional<TorchArchiveReader>& megatron_model,
                                         const Atom& atom, bool requires_grad) {
  if (const auto experts = facts.placement.experts.find(atom.param);
      experts != facts.placement.experts.end()) {
    // ds_to_universal's AutoEP ZeRO-3 consolidation: every expert-parallel rank's rows in order.
    UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                         UniversalAtomArchive(index, atom, atom.shape, requires_grad, false));
    deepspeed::SetExpertParamRoot(out.graph, out.graph.root(), experts->second);
    return out;
  }
  if (facts.tp == 1) {
    UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(atom.shape));
    return UniversalAtomArchive(index, atom, {numel}, requires_grad, false);
  }
  if (megatron_model) {
    const auto map = facts.maps.find(atom.param);
    if (map == facts.maps.end()) {
      return Status::Corrupt("deepspeed: index adapter_state.tp.params: no shard map of " +
                             atom.param);
    }
    return deepspeed::UniversalShardedAtom(index, map->second, facts.vocab,
                                           facts.vocabulary.contains(atom.param), *megatron_model,
                                           atom, requires_grad);
  }
  UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                       UniversalAtomArchive(index, atom, atom.shape, requires_grad, false));
  pickle::Graph& graph = out.graph;
  std::vector<std::pair<Value*, Value*>> entries;
  if (facts.vocabulary.contains(atom.param)) {
    entries.emplace_back(graph.Str("vocab_tensor"), graph.Bool(true));
  }
  entries.emplace_back(graph.Str("param"), graph.root());
  graph.set_root(graph.Dict(std::move(entries)));
  return out;
}

// zero/optimizer_state.pt: rank 0's whole optimizer_state_dict (the template `reader`'s), plus
// its inner state_dict's param_groups (the same list object, pickled once).
Result<ArchiveOutput> UniversalZero3OptimizerState(const TorchArchiveReader& reader,
                                                   const IndexFacts& facts) {
  const std::string osd(kOsd);
  ArchiveOutput out;
  UCP_ASSIGN_OR_RETURN(Value * dict, deepspeed::ImportOptimizerStateDict(reader, out));
  Value* inner = dict->Get(kOsd);
  Value* param_groups = inner == nullptr ? nullptr : inner->Get("param_groups");
  if (param_groups == nullptr) {
    return FieldError(reader, osd + "/" + osd + "/param_groups", "missing");
  }
  dict->mutable_entries().emplace_back(out.graph.Str("param_groups"), param_groups);
  out.graph.set_root(dict);
  UCP_ASSIGN_OR_RETURN(out.storages, CollectStorages(dict, reader, facts.optim_file, {}));
  return out;
}

// Every rank's model states: copied, or with AutoEP as ds_to_universal saves them again
// (MarkUniversalZero3AutoEp). A tag of AutoEP folded over AutoTP (which ds_to_universal does not
// convert) has them as a run at tp 1 over its ranks writes them, the reshard's there, as ucp's
// ZeRO-1/2 folded export has: DeepSpeed's universal load runs at tp 1 (a folded run refuses model
// states of another grid than its own).
Status AddUniversalZero3ModelStates(const AtomIndex& index, const std::string& tag_dir,
                                    const IndexFacts& facts, OutputPlan& plan) {
  const uint32_t ep = facts.placement.ep;
  if (ep == 0) {
    for (uint32_t i = 0; i < facts.model_files.size(); ++i) {
      plan.copies.push_back(
          {Zero3ModelStatesName(i % facts.dp, i / facts.dp), facts.model_files[i]});
    }
    return Status::Ok();
  }
  if (facts.tp > 1) {
    const uint32_t world = facts.dp * facts.tp;
    UCP_ASSIGN_OR_RETURN(const ReshardLayout to,
                         LayoutAtTarget(index, tag_dir, facts, {world, 1, 1, world, 3, ep}, ep));
    OutputPlan models;
    UCP_RETURN_IF_ERROR(PlanModelStates(index, tag_dir, facts, to, models));
    // Every one made from rank (0, 0)'s.
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                         OpenSource(index, tag_dir, facts.model_file));
    for (ArchiveOutput& model : models.archives) {
      UCP_RETURN_IF_ERROR(MarkUniversalZero3AutoEp(model.graph, model.graph.root(), reader));
      plan.archives.push_back(std::move(model));
    }
    return Status::Ok();
  }
  for (uint32_t r = 0; r < facts.dp; ++r) {
    const uint32_t file = facts.model_files[r];
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, file));
    ArchiveOutput out;
    out.path = Zero3ModelStatesName(r, 0);
    Value* root = out.graph.Import(reader.root());
    out.graph.set_root(root);
    UCP_RETURN_IF_ERROR(MarkUniversalZero3AutoEp(out.graph, root, reader));
    UCP_ASSIGN_OR_RETURN(out.storages, CollectStorages(root, reader, file, {}));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

}  // namespace

bool DeepSpeedZero3Adapter::Recognizes(const std::string& tag_dir) const {
  Result<TagListing> listing = ListTag(tag_dir);
  return listing.ok() && !listing->zero3_model_states.empty();
}

Result<std::vector<std::string>> DeepSpeedZero3Adapter::ExpectedFiles(
    const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  const std::string model = Zero3ModelStatesName(0, 0);
  const bool have_model =
      std::any_of(listing.zero3_model_states.begin(), listing.zero3_model_states.end(),
                  [&](const RankFile& file) { return file.name == model; });
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenWrittenModelStates(tag_dir, model, have_model));
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(reader));
  UCP_ASSIGN_OR_RETURN(const uint32_t tp, TpDegree(reader));
  if (const Value* stage = OptionalField(reader, "ds_config/zero_optimization/stage")) {
    if (stage->kind() == Kind::kInt && stage->AsInt64() != 3) {
      return FieldError(reader, "ds_config/zero_optimization/stage",
                        "not 3, but the file is named as ZeRO-3's");
    }
  }
  const bool bf16 = Bf16Prefix(listing, reader);
  std::vector<std::string> files;
  const std::string prefix = bf16 ? "bf16_" : "";
  for (uint32_t t = 0; t < tp; ++t) {
    for (uint32_t r = 0; r < dp; ++r) files.push_back(Zero3ModelStatesName(r, t));
  }
  for (uint32_t t = 0; t < tp; ++t) {
    for (uint32_t r = 0; r < dp; ++r) files.push_back(OptimName(prefix, r, t));
  }
  return files;
}

Result<AtomIndex> DeepSpeedZero3Adapter::BuildIndex(const std::string& tag_dir,
                                                    const IndexOptions& options) const {
  UCP_ASSIGN_OR_RETURN(const Zero3Tag tag, ReadTag(tag_dir));
  AtomIndexContents c;
  UCP_RETURN_IF_ERROR(AddFiles(tag_dir, tag, options, c));
  IndexRecords records;
  UCP_RETURN_IF_ERROR(AddTrainableAtoms(tag, c, records));
  UCP_RETURN_IF_ERROR(AddFrozenAtoms(tag, c, records));
  AddCarried(tag, c, records);
  return AtomIndex::Create(std::move(c), Prefix(tag_dir) + "index");
}

Result<OutputPlan> DeepSpeedZero3Adapter::PlanReshard(const AtomIndex& index,
                                                      const std::string& tag_dir,
                                                      const Topology& target) const {
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const uint32_t ep, CheckReshardTarget(facts, target));
  UCP_ASSIGN_OR_RETURN(const ReshardLayout to, LayoutAtTarget(index, tag_dir, facts, target, ep));
  OutputPlan plan;
  UCP_RETURN_IF_ERROR(PlanModelStates(index, tag_dir, facts, to, plan));
  UCP_RETURN_IF_ERROR(PlanOptimStates(index, tag_dir, facts, to, plan));
  return plan;
}

Result<OutputPlan> DeepSpeedZero3Adapter::PlanUniversalExport(const AtomIndex& index,
                                                              const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  // 1. Every parameter's states, as ds_to_universal writes each layout's.
  using RequiresGrad = std::map<std::string, bool>;  // "<param>/<state>"
  UCP_ASSIGN_OR_RETURN(RequiresGrad requires_grad, UniversalRequiresGrad(reader, facts));
  // Megatron's rules at tp > 1: rank (0, 0)'s model states hold the entries some maps name.
  std::optional<TorchArchiveReader> megatron_model;
  if (facts.megatron && facts.tp > 1) {
    UCP_ASSIGN_OR_RETURN(megatron_model, OpenSource(index, tag_dir, facts.model_file));
  }
  OutputPlan plan;
  for (const Atom& atom : index.atoms()) {
    if (atom.shape.empty() || atom.state == kFrozenState) continue;
    UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                         UniversalZero3Atom(index, facts, megatron_model, atom,
                                            requires_grad[atom.param + "/" + atom.state]));
    plan.archives.push_back(std::move(out));
  }
  // 2. zero/optimizer_state.pt, then the model states.
  UCP_ASSIGN_OR_RETURN(ArchiveOutput optimizer, UniversalZero3OptimizerState(reader, facts));
  plan.archives.push_back(std::move(optimizer));
  UCP_RETURN_IF_ERROR(AddUniversalZero3ModelStates(index, tag_dir, facts, plan));
  return plan;
}

}  // namespace ucp
