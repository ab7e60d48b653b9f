#include "core/frameworks/deepspeed/moe.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
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
#include "core/layout/region.h"
#include "core/plan/copy_plan.h"
#include "core/tag/file_hashing.h"

namespace ucp {
namespace {

using deepspeed::AddParameterAtoms;
using deepspeed::AddSliceFragments;
using deepspeed::AddUniversalModuleTensors;
using deepspeed::AppendSliceSegments;
using deepspeed::AutoTpSplitRule;
using deepspeed::BoundsText;
using deepspeed::CheckFolding;
using deepspeed::CheckIndexAdapter;
using deepspeed::CheckOptimGroups;
using deepspeed::CheckTarget;
using deepspeed::ChoosePartition;
using deepspeed::ChosenPartition;
using deepspeed::CollectGroupRequiresGrad;
using deepspeed::CollectStorages;
using deepspeed::DpWorldSize;
using deepspeed::EraseKey;
using deepspeed::ExpectedMappings;
using deepspeed::ExpertModelStatesName;
using deepspeed::ExpertOptimName;
using deepspeed::ExpertRankOrder;
using deepspeed::Field;
using deepspeed::FieldError;
using deepspeed::FileKind;
using deepspeed::FlatSegments;
using deepspeed::Float32Segments;
using deepspeed::Geometry;
using deepspeed::GeometryAt;
using deepspeed::GroupExpectation;
using deepspeed::GroupLayout;
using deepspeed::GroupSettings;
using deepspeed::IndexedLayout;
using deepspeed::IntField;
using deepspeed::IntListField;
using deepspeed::kAutoEpLayers;
using deepspeed::kDataBeforeExpert;
using deepspeed::kExpertGroupNamePrefix;
using deepspeed::kMaxExperts;
using deepspeed::kModelRole;
using deepspeed::kOptimRole;
using deepspeed::kOsd;
using deepspeed::ListTag;
using deepspeed::ListText;
using deepspeed::LocalShape;
using deepspeed::MakeLayout;
using deepspeed::MapFromJson;
using deepspeed::MapJson;
using deepspeed::MapsAtDegree;
using deepspeed::ModelStatesName;
using deepspeed::NumberedLayer;
using deepspeed::OpenSource;
using deepspeed::OpenWrittenModelStates;
using deepspeed::OptimFilesByRank;
using deepspeed::OptimGroup;
using deepspeed::OptimName;
using deepspeed::OptimStates;
using deepspeed::OptionalField;
using deepspeed::OrderStatesAs;
using deepspeed::ParseFileName;
using deepspeed::Partition;
using deepspeed::Partitioning;
using deepspeed::PartitionMethod;
using deepspeed::PidTuple;
using deepspeed::Piece;
using deepspeed::Pieces;
using deepspeed::PlanPartitionedOptimFile;
using deepspeed::PlanRankPart;
using deepspeed::Prefix;
using deepspeed::RankFile;
using deepspeed::RankGroupPart;
using deepspeed::RankPartition;
using deepspeed::ReadAutoEpLayers;
using deepspeed::ReadAutoTpMaps;
using deepspeed::ReadAutoTpSplitRule;
using deepspeed::ReadNumExperts;
using deepspeed::ReadOptimStates;
using deepspeed::ReadRange;
using deepspeed::ResizeModuleBuffers;
using deepspeed::RewrittenPartitionFields;
using deepspeed::Rule;
using deepspeed::RuleName;
using deepspeed::SavablePartition;
using deepspeed::SetAutoEpLayers;
using deepspeed::SetAutoTpSize;
using deepspeed::SetConfigValue;
using deepspeed::SetDictItem;
using deepspeed::SetExpertParamRoot;
using deepspeed::SetFolding;
using deepspeed::SetReplicatedShapes;
using deepspeed::SetTpDegree;
using deepspeed::ShapeNodeLike;
using deepspeed::ShapeText;
using deepspeed::ShardMap;
using deepspeed::SliceFlatSegments;
using deepspeed::SliceMapping;
using deepspeed::StateTemplates;
using deepspeed::StateTemplatesOf;
using deepspeed::StateTensor;
using deepspeed::TagListing;
using deepspeed::TagName;
using deepspeed::TargetGroup;
using deepspeed::TargetGroupAt;
using deepspeed::TensorLike;
using deepspeed::TypeMethods;
using deepspeed::UniversalAtomArchive;
using deepspeed::UniversalOptimizerState;
using deepspeed::VersionAtLeast;
using deepspeed::Vocab;
using pickle::Kind;
using pickle::Value;

constexpr std::string_view kExpertStatesRole = "expert_states";
constexpr std::string_view kExpertOptimRole = "expert_optim_states";
// What precedes an expert's id in its parameters' names (DeepSpeed's moe_str_prefix).
constexpr std::string_view kExpertsInfix = ".deepspeed_moe.experts.deepspeed_experts.";
constexpr char kZero3Refusal[] = "zero_stage=3: MoE with ZeRO-3 is not supported";
// AutoEP's checkpoint_format of experts saved one file per expert (ZeRO-1/2).
constexpr std::string_view kAutoEpFileFormat = "per_expert_files";
// Why a native MoE save over an mpu's TP may lack a TP rank's model states.
constexpr std::string_view kMpuModelStatesWriters =
    "; DeepSpeed writes a TP rank's model states from a rank of expert- and dense-data-parallel "
    "rank 0 only, so without expert tensor parallelism a save at a TP degree above its "
    "expert-parallel size (with use_data_before_expert_parallelism: above 1, at an "
    "expert-parallel size below the world) lacks some, and DeepSpeed's own load fails on it";
// Bounds the per-stage file lists a corrupt mp_world_size would make.
constexpr int64_t kMaxStages = int64_t{1} << 16;

// Where an expert parameter's name holds the expert's id: digits [begin, end).
struct ExpertIdAt {
  size_t module_end = 0;  // the MoE module's name is name[0, module_end)
  size_t begin = 0;
  size_t end = 0;
  uint32_t id = 0;
};

std::optional<ExpertIdAt> FindExpertId(const std::string& name) {
  const size_t at = name.find(kExpertsInfix);
  if (at == std::string::npos) return std::nullopt;
  ExpertIdAt found{at, at + kExpertsInfix.size(), at + kExpertsInfix.size(), 0};
  while (found.end < name.size() && std::isdigit(static_cast<unsigned char>(name[found.end]))) {
    ++found.end;
  }
  const std::optional<uint32_t> id =
      deepspeed::Decimal(std::string_view(name).substr(found.begin, found.end - found.begin));
  if (!id) return std::nullopt;
  found.id = *id;
  return found;
}

// An AutoEP expert's parameter in its file: "<experts module>.<fused parameter>.<G>", the rows of
// expert G of the fused "<experts module>.<fused parameter>" (one row per expert).
std::optional<ExpertIdAt> FindFusedExpertId(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || dot == 0) return std::nullopt;
  const size_t module_end = name.rfind('.', dot - 1);
  const std::optional<uint32_t> id = deepspeed::Decimal(std::string_view(name).substr(dot + 1));
  if (module_end == std::string::npos || !id) return std::nullopt;
  return ExpertIdAt{module_end, dot + 1, name.size(), *id};
}

std::optional<ExpertIdAt> ExpertIdOf(const std::string& name, bool fused) {
  return fused ? FindFusedExpertId(name) : FindExpertId(name);
}

std::string WithExpertId(const std::string& name, const ExpertIdAt& at, uint32_t id) {
  return name.substr(0, at.begin) + std::to_string(id) + name.substr(at.end);
}

// The expert files of a tag's pipeline stage (mp rank; at pp = 1 the tag's).
struct ExpertFiles {
  uint32_t mp = 0;
  std::vector<uint32_t> num_experts;              // per MoE layer, from the model states
  std::set<std::pair<uint32_t, uint32_t>> model;  // (layer, global expert) of each file
  std::set<uint32_t> optim;                       // the expp_rank files' expert-parallel ranks
  // A tag of TP lanes: the lanes (mp ranks) whose files hold each (layer, global expert).
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint32_t>> lanes_of;
};

// Stage `mp`'s expert files of a tag of `stages` pipeline stages (`model`: the stage's model
// states); with `lanes` > 0 each stage has that many TP lanes, and its expert files are those under
// its mp ranks mp·lanes .. mp·lanes + lanes - 1 (lanes_of: by lane).
Result<ExpertFiles> ListExpertFiles(const std::string& tag_dir, const TagListing& listing,
                                    const TorchArchiveReader& model, uint32_t mp, uint32_t stages,
                                    uint32_t lanes = 0) {
  ExpertFiles files;
  files.mp = mp;
  UCP_ASSIGN_OR_RETURN(files.num_experts, ReadNumExperts(model));
  const std::vector<int64_t> counts(files.num_experts.begin(), files.num_experts.end());
  for (const std::string& name : listing.expert_files) {
    const std::optional<deepspeed::FileName> parsed = ParseFileName(name);
    if (!parsed || (parsed->mp != 0 && stages == 1 && lanes <= 1)) {
      return Status::Unsupported(Prefix(tag_dir + "/" + name) +
                                 "an expert file of an mp rank above 0: MoE with tensor "
                                 "parallelism is not supported");
    }
    const uint32_t per_stage = std::max(lanes, 1u);
    const uint32_t mp_ranks = stages * per_stage;
    if (parsed->mp >= mp_ranks) {
      return Status::Corrupt(Prefix(tag_dir + "/" + name) + "mp rank " +
                             std::to_string(parsed->mp) + " >= mp_world_size " +
                             std::to_string(mp_ranks) + " (a file of another save)");
    }
    if (parsed->mp / per_stage != mp) continue;  // another stage's
    if (parsed->kind == FileKind::kExpertOptimStates) {
      files.optim.insert(parsed->dp);
      continue;
    }
    if (parsed->layer >= files.num_experts.size() ||
        parsed->expert >= files.num_experts[parsed->layer]) {
      return Status::Corrupt(
          Prefix(tag_dir + "/" + name) + "MoE layer " + std::to_string(parsed->layer) +
          ", expert " + std::to_string(parsed->expert) + " is outside num_experts " +
          ListText(counts) + " of " + model.path() + " (a file of another save)");
    }
    files.model.insert({parsed->layer, parsed->expert});
    if (lanes > 0) {
      files.lanes_of[{parsed->layer, parsed->expert}].push_back(parsed->mp % per_stage);
    }
  }
  for (auto& [expert, held_by] : files.lanes_of) std::sort(held_by.begin(), held_by.end());
  return files;
}

// The TP lanes of `grid` under which expert-parallel rank e's expert files must be, and may be:
// a folded save's exactly those of the ranks that write them (FoldedGrid::ExpertWriters). With an
// mpu's TP (`mpu`) DeepSpeed's writer is rank e's expert-data-parallel rank 0 (rank e, or e·W/E
// in use_data_before_expert_parallelism's order), so that rank's lane must hold them; another
// lane may where its ranks hold the experts (ucp writes every lane the load reads: DeepSpeed's
// save lacks some where T does not divide E).
std::pair<bool, bool> ExpertLanes(const deepspeed::FoldedGrid& grid, bool mpu, uint32_t t,
                                  uint32_t e) {
  if (!mpu) {
    const bool written = !grid.ExpertWriters(t, e).empty();
    return {written, written};
  }
  return {t == grid.TpRank(grid.ExpertMember(e, 0, t)), !grid.ExpertHolders(t, e).empty()};
}

// A lanes stage's expert files against its grid (ExpertLanes; its lane t is mp rank first_mp + t),
// and no expp_rank file there (DeepSpeed 0.19 writes none).
Status CheckFoldedExpertFiles(const std::string& tag_dir, const ExpertFiles& files,
                              const deepspeed::FoldedGrid& grid, bool mpu, uint32_t first_mp) {
  for (uint32_t layer = 0; layer < files.num_experts.size(); ++layer) {
    if (files.num_experts[layer] % grid.ep != 0) {
      return Status::Corrupt(Prefix(tag_dir) + "MoE layer " + std::to_string(layer) + "'s " +
                             std::to_string(files.num_experts[layer]) +
                             " experts (num_experts) are not a multiple of the folding's ep_size " +
                             std::to_string(grid.ep));
    }
    const uint32_t per_rank = files.num_experts[layer] / grid.ep;
    for (uint32_t g = 0; g < files.num_experts[layer]; ++g) {
      const auto it = files.lanes_of.find({layer, g});
      const std::vector<uint32_t> held_by =
          it == files.lanes_of.end() ? std::vector<uint32_t>{} : it->second;
      for (uint32_t t = 0; t < grid.tp; ++t) {
        const auto [required, allowed] = ExpertLanes(grid, mpu, t, g / per_rank);
        const bool there = std::find(held_by.begin(), held_by.end(), t) != held_by.end();
        if (there ? allowed : !required) continue;
        const std::string name = tag_dir + "/" + ExpertModelStatesName(layer, g, first_mp + t);
        const std::string save = std::string(mpu ? "a save" : "a folded save") + " at tp " +
                                 std::to_string(grid.tp) + ", ep " + std::to_string(grid.ep);
        if (required) return Status::NotFound(Prefix(name) + "not found (" + save + " writes it)");
        return Status::Corrupt(Prefix(name) + "no rank of " + save + (mpu ? " reads" : " writes") +
                               " it (a file of another save)");
      }
    }
  }
  if (!files.optim.empty()) {
    return Status::Corrupt(Prefix(tag_dir + "/" + ExpertOptimName(*files.optim.begin(), 0)) +
                           "an expp_rank file in a save with TP lanes (DeepSpeed writes none)");
  }
  return Status::Ok();
}

// `files` against the expert-parallel size `ep`: every MoE layer's experts a multiple of it, every
// expert's file present, and expp_rank files (DeepSpeed 0.14 writes them, {'optimizer': None}
// under ZeRO; later releases none) for exactly the ranks below it when there are any.
Status CheckExpertFiles(const std::string& tag_dir, const ExpertFiles& files, uint32_t ep,
                        const TorchArchiveReader& model) {
  const std::vector<int64_t> counts(files.num_experts.begin(), files.num_experts.end());
  for (uint32_t layer = 0; layer < files.num_experts.size(); ++layer) {
    if (files.num_experts[layer] % ep != 0) {
      return FieldError(model, "num_experts",
                        ListText(counts) + ": layer " + std::to_string(layer) +
                            "'s experts are not a multiple of the expert-parallel size " +
                            std::to_string(ep));
    }
    for (uint32_t g = 0; g < files.num_experts[layer]; ++g) {
      if (!files.model.contains({layer, g})) {
        return Status::NotFound(Prefix(tag_dir + "/" + ExpertModelStatesName(layer, g, files.mp)) +
                                "not found (num_experts " + ListText(counts) + " in " +
                                model.path() + ")");
      }
    }
  }
  if (files.optim.empty()) return Status::Ok();
  for (uint32_t e = 0; e < ep; ++e) {
    if (!files.optim.contains(e)) {
      return Status::NotFound(Prefix(tag_dir + "/" + ExpertOptimName(e, files.mp)) +
                              "not found (the expert-parallel size is " + std::to_string(ep) +
                              " and other expp_rank files are there)");
    }
  }
  if (*files.optim.rbegin() >= ep) {
    return Status::Corrupt(
        Prefix(tag_dir + "/" + ExpertOptimName(*files.optim.rbegin(), files.mp)) +
        "an expert-parallel rank beyond the expert-parallel size " + std::to_string(ep) +
        " (a file of another save)");
  }
  return Status::Ok();
}

// The expert-parallel size an expert group's name gives ("ep_size_<E>"), or nullopt.
std::optional<uint32_t> ExpertGroupSize(const Value* param_group) {
  const Value* name = param_group == nullptr ? nullptr : param_group->Get("name");
  if (name == nullptr || name->kind() != Kind::kStr) return std::nullopt;
  const std::string& text = name->data();
  if (!text.starts_with(kExpertGroupNamePrefix)) return std::nullopt;
  return deepspeed::Decimal(std::string_view(text).substr(kExpertGroupNamePrefix.size()));
}

bool IsExpertGroup(const Value* param_group) {
  const Value* moe = param_group == nullptr ? nullptr : param_group->Get("moe");
  return moe != nullptr && moe->kind() == Kind::kBool && moe->bool_value();
}

// The flat layout of group g over `ranks` (its partitions in partition order, each P elements)
// from their param_slice_mappings: every parameter's fragments must follow one another, and the
// parameters each other from element 0. Shapes from `shape_of` (nullopt: no such tensor).
Result<GroupLayout> LayoutFromMappings(
    const std::vector<const OptimStates*>& ranks, size_t g, uint64_t partition,
    const std::function<std::optional<Shape>(const std::string&)>& shape_of) {
  const std::string field = std::string(kOsd) + "/param_slice_mappings/" + std::to_string(g);
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  uint64_t next = 0;  // the flat element where the next fragment must start
  uint64_t param_numel = 0;
  std::string open;  // the parameter whose fragments are being read
  const auto close = [&](const OptimStates& os) -> Status {
    if (open.empty()) return Status::Ok();
    const std::optional<Shape> shape = shape_of(open);
    if (!shape) return FieldError(os.reader, field + "/" + open, "no module tensor of that name");
    UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(*shape));
    if (numel != param_numel) {
      return FieldError(os.reader, field + "/" + open,
                        std::to_string(param_numel) +
                            " elements over the partitions, but its "
                            "tensor is " +
                            ShapeText(*shape));
    }
    names.push_back(open);
    shapes.push_back(*shape);
    open.clear();
    return Status::Ok();
  };
  for (size_t r = 0; r < ranks.size(); ++r) {
    const OptimStates& os = *ranks[r];
    for (const SliceMapping& m : os.groups[g].mappings) {
      const uint64_t flat = r * partition + m.start;
      if (flat != next || m.numel == 0) {
        return FieldError(os.reader, field + "/" + m.name,
                          "numel " + std::to_string(m.numel) + " start " + std::to_string(m.start) +
                              ": not where the group's previous fragment ends (flat element " +
                              std::to_string(next) + ")");
      }
      if (m.name != open) {
        UCP_RETURN_IF_ERROR(close(os));
        if (std::find(names.begin(), names.end(), m.name) != names.end()) {
          return FieldError(os.reader, field + "/" + m.name, "a second, separate fragment");
        }
        open = m.name;
        param_numel = 0;
      }
      param_numel += m.numel;
      next += m.numel;
    }
  }
  UCP_RETURN_IF_ERROR(close(*ranks.back()));
  return MakeLayout(std::move(names), std::move(shapes));
}

// A group's partition size P in `os`: the fp32 master's elements plus the padding it leaves
// out (DeepSpeedZeroOptimizer) or not (BF16_Optimizer).
uint64_t PartitionSize(const OptimStates& os, size_t g) {
  const uint64_t fp32 = os.groups[g].fp32->numel();
  if (os.bf16_optimizer || g >= os.group_paddings.size() || os.group_paddings[g] < 0) return fp32;
  return fp32 + static_cast<uint64_t>(os.group_paddings[g]);
}

// The degree `key` of checkpoint_parallel_dimensions (DeepSpeed 0.19's record of the axes:
// pp_degree, tp_degree) in `model`; 0 where it is not recorded (0.14).
int64_t RecordedDegree(const TorchArchiveReader& model, const char* key) {
  const Value* node = OptionalField(model, std::string("checkpoint_parallel_dimensions/") + key);
  return node != nullptr && node->kind() == Kind::kInt ? node->AsInt64().value_or(0) : 0;
}

// The TP lanes of each pipeline stage of a native MoE tag whose model states `model` give
// mp_world_size `mp` (AutoEP's folded layout is read by ReadFoldedGrid before): tp_degree of
// checkpoint_parallel_dimensions, an mpu's tensor parallelism (Megatron-DeepSpeed's, or a
// PipelineModule's grid), where it is above 1; 1 for a tag of one TP rank that carries Megatron's
// TP rules (universal_checkpoint_info of no AutoTP affine map and no AutoEP layers) and records
// tp_degree 1, which the lanes read to place the parameters at another degree; else nullopt.
// kCorrupt where mp_world_size is not tp_degree x pp_degree.
Result<std::optional<uint32_t>> MpuLanes(const TorchArchiveReader& model, int64_t mp) {
  const int64_t tp = RecordedDegree(model, "tp_degree");
  const int64_t pp = std::max<int64_t>(RecordedDegree(model, "pp_degree"), 1);
  if (tp <= 1) {
    // AutoEP records its layers there too (ds_autoep_layers: None in a native save).
    const Value* autoep = OptionalField(model, kAutoEpLayers);
    const bool rules = OptionalField(model, deepspeed::kUniversalCheckpointInfo) != nullptr &&
                       !deepspeed::HasAutoTpMaps(model) &&
                       (autoep == nullptr || autoep->kind() == Kind::kNone);
    // Only a release that records the axes (0.19) is read so: 0.14's expp_rank files have no lanes.
    if (mp == pp && rules && tp == 1) return std::optional<uint32_t>(1);
    return std::optional<uint32_t>();
  }
  if (mp != tp * pp || tp > kMaxStages || pp > kMaxStages) {
    return FieldError(model, "mp_world_size",
                      std::to_string(mp) +
                          ", but checkpoint_parallel_dimensions records tp_degree " +
                          std::to_string(tp) + " and pp_degree " + std::to_string(pp));
  }
  return std::optional<uint32_t>(static_cast<uint32_t>(tp));
}

// The pipeline stages of an MoE tag of one TP rank whose model states `model` give mp_world_size
// `mp`. MoE layers in a PipelineModule write no layer files (each stage's dense tensors are its
// model states' module), so only DeepSpeed 0.19's record of the axes tells a pipeline from tensor
// parallelism. kUnsupported where the tag does not record the axis (0.14).
Result<uint32_t> PipelineStages(const TorchArchiveReader& model, int64_t mp) {
  if (mp == 1) return 1;
  const int64_t pp = RecordedDegree(model, "pp_degree");
  if (pp > 1 && pp == mp && pp <= kMaxStages) return static_cast<uint32_t>(pp);
  if (pp > 1) {
    return FieldError(model, "checkpoint_parallel_dimensions/pp_degree",
                      std::to_string(pp) + ", but mp_world_size is " + std::to_string(mp));
  }
  return Status::Unsupported(Prefix(model.path()) + "mp_world_size " + std::to_string(mp) +
                             ": MoE with tensor or pipeline parallelism, and the tag does not "
                             "record which (checkpoint_parallel_dimensions, written from "
                             "DeepSpeed 0.19 on), is not supported");
}

// Refusals by file name: ZeRO-3 tags and pipelines with layer files (a tag of several model
// states is read by PipelineStages).
Status RefuseListing(const std::string& tag_dir, const TagListing& listing) {
  if (!listing.zero3_model_states.empty()) {
    return Status::Unsupported(Prefix(tag_dir) + kZero3Refusal);
  }
  if (!listing.layer_files.empty()) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "MoE with pipeline parallelism (layer files) is not supported");
  }
  if (!listing.model_states.contains(0)) {
    return Status::NotFound(Prefix(tag_dir) + ModelStatesName(0) + ": not found");
  }
  return Status::Ok();
}

// The index's facts PlanReshard needs, of one pipeline stage (at pp = 1 the tag's).
struct IndexFacts {
  uint32_t mp = 0;  // the stage
  uint32_t dp = 0;
  uint32_t ep = 0;
  // TP lanes (AutoEP folded over AutoTP, or with mpu_tp native MoE over an mpu's TP): the TP
  // degree; dp is the dense DP.
  uint32_t folded_tp = 1;
  bool mpu_tp = false;
  bool expert_tp = false;  // mpu_tp with expert tensor parallelism (FoldedGrid::expert_tp)
  // Lanes: each dense parameter's (and with expert_tp each expert's), at folded_tp.
  std::map<std::string, ShardMap> folded_maps;
  std::optional<Vocab> vocab;  // mpu_tp: the vocabulary's sizes where one is
  size_t expert_group = 0;     // in `groups`
  std::string prefix;
  bool bf16_optimizer = false;
  bool fused = false;  // AutoEP's fused experts (MoeTag::fused)
  // AutoEP's frozen fused expert parameters, by name: their experts (each "<name>.<G>" a bit16
  // atom of expert G's rows, in no group).
  std::map<std::string, uint32_t> frozen_experts;
  bool data_before_expert = false;  // the rank order (ExpertRankOrder)
  std::vector<GroupLayout> groups;  // the stage's: dense as indexed; the expert group: all EP ranks
  GroupLayout local;                // the expert group of one EP rank, under local names
  std::vector<uint32_t> num_experts;  // per MoE layer of the stage
  uint32_t model_file = 0;
  uint32_t optim_file = 0;
  // Per group, the elements of the template optimizer file's flat group (the expert group: one
  // EP rank's).
  std::vector<uint64_t> template_totals;
  std::vector<uint32_t> expert_files;     // layer_<L>_expert_<G> files, the same at any E
  std::vector<std::string> expert_names;  // each one's name at the target
  std::vector<uint32_t> expp_files;       // expp_rank_<e> files, in e order
  // A stage restaged at another pp (RestageStages): the target's stages, and at pp > 1 the
  // layers [first_layer, end_layer) this one holds (at pp = 1 all); 0 otherwise.
  uint32_t target_stages = 0;
  uint64_t first_layer = 0;
  uint64_t end_layer = 0;
};

// A stage's entry of adapter_state (at pp = 1 the state itself): its expert group and experts
// per MoE layer; a pipeline's also its groups and template files.
Status ReadStageEntry(const nlohmann::json& entry, bool pipeline, IndexFacts& facts,
                      size_t& groups) {
  const std::string what = "deepspeed: index adapter_state: ";
  if (!entry.is_object() || !entry.contains("expert_group") ||
      !entry["expert_group"].is_number_unsigned() || !entry.contains("num_experts") ||
      !entry["num_experts"].is_array()) {
    return Status::Corrupt(what + "expert_group or num_experts missing or mistyped");
  }
  facts.expert_group = entry["expert_group"].get<size_t>();
  for (const nlohmann::json& n : entry["num_experts"]) {
    if (!n.is_number_unsigned() || n.get<uint64_t>() == 0 || n.get<uint64_t>() > kMaxExperts) {
      return Status::Corrupt(what + "num_experts: not a list of expert counts");
    }
    facts.num_experts.push_back(n.get<uint32_t>());
  }
  if (!pipeline) return Status::Ok();
  for (const auto& [key, value] :
       {std::pair{"model_file", &facts.model_file}, std::pair{"optim_file", &facts.optim_file}}) {
    if (!entry.contains(key) || !entry[key].is_number_unsigned()) {
      return Status::Corrupt(what + "stages: " + key + " missing or mistyped");
    }
    *value = entry[key].get<uint32_t>();
  }
  if (!entry.contains("groups") || !entry["groups"].is_number_unsigned()) {
    return Status::Corrupt(what + "stages: groups missing or mistyped");
  }
  groups = entry["groups"].get<size_t>();
  return Status::Ok();
}

// Every stage's facts, in stage order.
Result<std::vector<IndexFacts>> ReadFacts(const AtomIndex& index) {
  const AtomIndexContents& c = index.contents();
  const std::string what = "deepspeed: index adapter_state: ";
  UCP_RETURN_IF_ERROR(CheckIndexAdapter(index, DeepSpeedMoeAdapter::kName));
  const nlohmann::json& state = c.adapter_state;
  if (!state.is_object() || !state.contains("expert_parallel") ||
      !state["expert_parallel"].is_number_unsigned() || !state.contains("file_prefix") ||
      !state["file_prefix"].is_string() || !state.contains("optimizer") ||
      !state["optimizer"].is_string()) {
    return Status::Corrupt(what + "expert_parallel, file_prefix or optimizer missing or mistyped");
  }
  IndexFacts common;
  common.dp = c.topology.dp;
  common.ep = state["expert_parallel"].get<uint32_t>();
  common.prefix = state["file_prefix"].get<std::string>();
  common.bf16_optimizer = state["optimizer"].get<std::string>() == "BF16_Optimizer";
  for (const auto& [key, flag] : {std::pair{"fused_experts", &common.fused},
                                  std::pair{"data_before_expert", &common.data_before_expert}}) {
    if (!state.contains(key)) continue;
    if (!state[key].is_boolean()) return Status::Corrupt(what + key + ": not a bool");
    *flag = state[key].get<bool>();
  }
  if (state.contains("frozen_experts")) {
    const nlohmann::json& frozen = state["frozen_experts"];
    if (!frozen.is_object() || !common.fused) {
      return Status::Corrupt(what + "frozen_experts: not an object of an AutoEP index");
    }
    for (const auto& [name, experts] : frozen.items()) {
      if (!experts.is_number_unsigned() || experts.get<uint64_t>() == 0 ||
          experts.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
        return Status::Corrupt(what + "frozen_experts/" + name + ": not a count of experts");
      }
      common.frozen_experts[name] = experts.get<uint32_t>();
    }
  }
  if (state.contains("folded_tp")) {
    const nlohmann::json& folded = state["folded_tp"];
    const auto flag = [&folded](const char* key) {
      return folded.is_object() && folded.contains(key) && folded[key].is_boolean() &&
             folded[key].get<bool>();
    };
    common.mpu_tp = flag("mpu");
    common.expert_tp = flag("expert_tp");
    if (!folded.is_object() || !folded.contains("degree") ||
        !folded["degree"].is_number_unsigned() ||
        folded["degree"].get<uint64_t>() < (common.mpu_tp ? 1 : 2) ||
        folded["degree"].get<uint64_t>() != c.topology.tp ||
        (c.topology.pp != 1 && !common.mpu_tp) || common.fused == common.mpu_tp ||
        (common.expert_tp && !common.mpu_tp)) {
      return Status::Corrupt(what +
                             "folded_tp: not the index's TP degree of one AutoEP stage, or of "
                             "native MoE stages (mpu)");
    }
    common.folded_tp = c.topology.tp;
    if (folded.contains("vocab")) {
      const nlohmann::json& vocab = folded["vocab"];
      for (const char* key : {"original", "padded", "divisible_by"}) {
        if (!vocab.is_object() || !vocab.contains(key) || !vocab[key].is_number_unsigned() ||
            vocab[key].get<uint64_t>() == 0) {
          return Status::Corrupt(what + "folded_tp: vocab/" + key + " missing or mistyped");
        }
      }
      common.vocab = Vocab{vocab["original"].get<uint64_t>(), vocab["padded"].get<uint64_t>(),
                           vocab["divisible_by"].get<uint64_t>()};
    }
    if (!folded.contains("params") || !folded["params"].is_object()) {
      return Status::Corrupt(what + "folded_tp: params missing or not an object");
    }
    for (const auto& [name, json] : folded["params"].items()) {
      UCP_ASSIGN_OR_RETURN(common.folded_maps[name], MapFromJson(name, json));
    }
  } else if (c.topology.tp != 1) {
    return Status::Corrupt(what + "tp " + std::to_string(c.topology.tp) + " without folded_tp");
  }
  if (common.ep == 0 || (common.dp * common.folded_tp) % common.ep != 0 ||
      (common.prefix != "" && common.prefix != "bf16_")) {
    return Status::Corrupt(what + "expert_parallel " + std::to_string(common.ep) +
                           " or file_prefix inconsistent with the index");
  }
  std::vector<GroupLayout> layouts;
  for (const ParamGroup& group : c.groups) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, IndexedLayout(index, group.params));
    layouts.push_back(std::move(layout));
  }
  const bool pipeline = state.contains("stages");
  const uint32_t pp = c.topology.pp;
  if (pipeline != (pp > 1) ||
      (pipeline && (!state["stages"].is_array() || state["stages"].size() != pp || common.fused))) {
    return Status::Corrupt(what + "stages: not one entry per stage of pp " + std::to_string(pp));
  }
  // Each stage's expert and expp_rank files, in one pass over the files.
  std::vector<std::vector<uint32_t>> expert_files(pp);
  std::vector<std::vector<uint32_t>> expp_files(pp);
  for (uint32_t f = 0; f < c.files.size(); ++f) {
    const bool expert = c.files[f].role == kExpertStatesRole;
    if (!expert && c.files[f].role != kExpertOptimRole) continue;
    const std::optional<deepspeed::FileName> parsed = ParseFileName(c.files[f].path);
    // A stage of TP lanes holds its expert files under each of its lanes' mp ranks.
    if (!parsed || parsed->mp >= pp * common.folded_tp) {
      return Status::Corrupt("deepspeed: index: " + c.files[f].path +
                             ": not an expert file of a stage below pp " + std::to_string(pp));
    }
    (expert ? expert_files : expp_files)[parsed->mp / common.folded_tp].push_back(f);
  }
  std::vector<IndexFacts> stages;
  size_t next_group = 0;
  for (uint32_t mp = 0; mp < pp; ++mp) {
    IndexFacts facts = common;
    facts.mp = mp;
    size_t groups = layouts.size();
    UCP_RETURN_IF_ERROR(
        ReadStageEntry(pipeline ? state["stages"][mp] : state, pipeline, facts, groups));
    if (!pipeline) {
      UCP_ASSIGN_OR_RETURN(const StateTemplates templates, StateTemplatesOf(index));
      facts.model_file = templates.model_file;
      facts.optim_file = templates.optim_file;
    }
    if (groups > layouts.size() - next_group || facts.expert_group >= groups ||
        facts.model_file >= c.files.size() || facts.optim_file >= c.files.size() ||
        c.files[facts.model_file].path != ModelStatesName(mp * common.folded_tp) ||
        c.files[facts.optim_file].role != kOptimRole) {
      return Status::Corrupt(what + "stage " + std::to_string(mp) +
                             ": groups, expert_group or files inconsistent with the index");
    }
    facts.groups.assign(layouts.begin() + next_group, layouts.begin() + next_group + groups);
    next_group += groups;
    // Expert-parallel rank 0's experts come first, and their global ids are their local ones.
    const GroupLayout& experts = facts.groups[facts.expert_group];
    const size_t per_rank = experts.names.size() / facts.ep;
    if (per_rank * facts.ep != experts.names.size()) {
      return Status::Corrupt("deepspeed: index: an expert group of " +
                             std::to_string(experts.names.size()) + " parameters over " +
                             std::to_string(facts.ep) + " expert-parallel ranks");
    }
    UCP_ASSIGN_OR_RETURN(
        facts.local,
        MakeLayout(
            std::vector<std::string>(experts.names.begin(), experts.names.begin() + per_rank),
            std::vector<Shape>(experts.shapes.begin(), experts.shapes.begin() + per_rank)));
    for (size_t g = 0; g < facts.groups.size(); ++g) {
      facts.template_totals.push_back(g == facts.expert_group ? facts.local.total
                                                              : facts.groups[g].total);
    }
    facts.expert_files = std::move(expert_files[mp]);
    for (const uint32_t f : facts.expert_files) facts.expert_names.push_back(c.files[f].path);
    facts.expp_files = std::move(expp_files[mp]);
    stages.push_back(std::move(facts));
  }
  if (next_group != layouts.size()) {
    return Status::Corrupt(what + "stages: " + std::to_string(next_group) + " groups, but the " +
                           "index has " + std::to_string(layouts.size()));
  }
  return stages;
}

// The expert group at expert-parallel size `ep`: one rank's layout under local expert ids, and
// each rank's under global ids.
struct ExpertLayouts {
  GroupLayout local;
  std::vector<GroupLayout> global;
};

// kInvalidArgument naming the first MoE layer whose experts the expert-parallel size `ep` does not
// divide: DeepSpeed cannot run there.
Status CheckExpertsDivide(const std::vector<uint32_t>& num_experts, uint32_t ep) {
  for (size_t layer = 0; layer < num_experts.size(); ++layer) {
    if (num_experts[layer] % ep != 0) {
      return Status::InvalidArgument(
          "deepspeed: ep=" + std::to_string(ep) + ": MoE layer " + std::to_string(layer) + "'s " +
          std::to_string(num_experts[layer]) + " experts are not a multiple of it");
    }
  }
  return Status::Ok();
}

// AutoEP's expert group holds, MoE layer after MoE layer, each fused parameter of the layer's
// experts module (its n local experts' rows one after another). The source's layout of
// expert-parallel rank 0 (its experts' rows under global names "<fused>.<G>", G < n) gives each
// fused parameter and its row, and those the layout at any `ep` that divides every layer's
// experts: locally "<fused>" of n' = experts / ep rows, rank e's rows "<fused>.<e·n' + k>".
Result<ExpertLayouts> FusedExpertLayoutsAt(const IndexFacts& facts, uint32_t ep) {
  struct Fused {
    std::string name;
    Shape row;
    uint32_t experts = 0;  // rows seen on rank 0
    size_t layer = 0;
  };
  std::vector<Fused> fused;
  std::vector<std::string> modules;  // per MoE layer
  const std::string what = "deepspeed: index: expert group: ";
  for (size_t k = 0; k < facts.local.names.size(); ++k) {
    const std::string& name = facts.local.names[k];
    const std::optional<ExpertIdAt> at = FindFusedExpertId(name);
    if (!at) return Status::Corrupt(what + name + ": no expert id");
    const std::string module = name.substr(0, at->module_end);
    const std::string fused_name = name.substr(0, at->begin - 1);
    if (modules.empty() || modules.back() != module) modules.push_back(module);
    if (fused.empty() || fused.back().name != fused_name) {
      fused.push_back({fused_name, facts.local.shapes[k], 0, modules.size() - 1});
    }
    if (at->id != fused.back().experts || facts.local.shapes[k] != fused.back().row) {
      return Status::Corrupt(what + name + ": not row " + std::to_string(fused.back().experts) +
                             " of " + fused_name + " (" + ShapeText(fused.back().row) + ")");
    }
    ++fused.back().experts;
  }
  if (modules.size() != facts.num_experts.size()) {
    return Status::Corrupt(what + std::to_string(modules.size()) +
                           " experts modules, but num_experts lists " +
                           std::to_string(facts.num_experts.size()) + " layers");
  }
  for (const Fused& f : fused) {
    if (f.experts * facts.ep != facts.num_experts[f.layer]) {
      return Status::Corrupt(what + f.name + ": " + std::to_string(f.experts) +
                             " rows, but num_experts gives " +
                             std::to_string(facts.num_experts[f.layer]) + " over " +
                             std::to_string(facts.ep) + " expert-parallel ranks");
    }
  }
  UCP_RETURN_IF_ERROR(CheckExpertsDivide(facts.num_experts, ep));
  std::vector<std::string> local;
  std::vector<Shape> local_shapes;
  std::vector<std::vector<std::string>> global(ep);
  std::vector<Shape> global_shapes;
  for (const Fused& f : fused) {
    const uint32_t per_rank = facts.num_experts[f.layer] / ep;
    local.push_back(f.name);
    local_shapes.push_back(f.row);
    local_shapes.back().insert(local_shapes.back().begin(), per_rank);
    for (uint32_t k = 0; k < per_rank; ++k) {
      global_shapes.push_back(f.row);
      for (uint32_t e = 0; e < ep; ++e) {
        global[e].push_back(f.name + "." + std::to_string(e * per_rank + k));
      }
    }
  }
  ExpertLayouts layouts;
  for (uint32_t e = 0; e < ep; ++e) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, MakeLayout(std::move(global[e]), global_shapes));
    layouts.global.push_back(std::move(layout));
  }
  UCP_ASSIGN_OR_RETURN(layouts.local, MakeLayout(std::move(local), std::move(local_shapes)));
  return layouts;
}

// DeepSpeed's expert group holds, MoE layer after MoE layer (module order, which is the layer
// order of num_experts), each local expert's parameters in the expert's own order. So the
// source's local layout gives each MoE module's per-expert parameters (those of its local expert
// 0), and those the layout at any `ep` that divides every layer's experts.
Result<ExpertLayouts> ExpertLayoutsAt(const IndexFacts& facts, uint32_t ep) {
  if (facts.fused) return FusedExpertLayoutsAt(facts, ep);
  struct Module {
    std::string prefix;                                 // the parameter names up to the expert id
    std::vector<std::pair<std::string, Shape>> params;  // after the id, of local expert 0
    uint32_t experts = 0;                               // local experts seen
  };
  std::vector<Module> modules;
  const std::string what = "deepspeed: index: expert group: ";
  for (size_t k = 0; k < facts.local.names.size(); ++k) {
    const std::string& name = facts.local.names[k];
    const std::optional<ExpertIdAt> at = FindExpertId(name);
    if (!at) return Status::Corrupt(what + name + ": no expert id");
    const std::string prefix = name.substr(0, at->begin);
    if (modules.empty() || modules.back().prefix != prefix) modules.push_back({prefix, {}, 0});
    Module& module = modules.back();
    if (at->id == 0) module.params.emplace_back(name.substr(at->end), facts.local.shapes[k]);
    module.experts = std::max(module.experts, at->id + 1);
  }
  if (modules.size() != facts.num_experts.size()) {
    return Status::Corrupt(what + std::to_string(modules.size()) +
                           " MoE modules, but num_experts " + "lists " +
                           std::to_string(facts.num_experts.size()) + " layers");
  }
  for (size_t layer = 0; layer < modules.size(); ++layer) {
    if (modules[layer].experts * facts.ep != facts.num_experts[layer]) {
      return Status::Corrupt(
          what + modules[layer].prefix + ": " + std::to_string(modules[layer].experts) +
          " local experts, but num_experts gives " + std::to_string(facts.num_experts[layer]) +
          " over " + std::to_string(facts.ep) + " expert-parallel ranks");
    }
  }
  UCP_RETURN_IF_ERROR(CheckExpertsDivide(facts.num_experts, ep));
  ExpertLayouts layouts;
  std::vector<std::string> local;
  std::vector<Shape> shapes;
  std::vector<std::vector<std::string>> global(ep);
  for (size_t layer = 0; layer < modules.size(); ++layer) {
    const uint32_t per_rank = facts.num_experts[layer] / ep;
    for (uint32_t k = 0; k < per_rank; ++k) {
      for (const auto& [rest, shape] : modules[layer].params) {
        local.push_back(modules[layer].prefix + std::to_string(k) + rest);
        shapes.push_back(shape);
        for (uint32_t e = 0; e < ep; ++e) {
          global[e].push_back(modules[layer].prefix + std::to_string(e * per_rank + k) + rest);
        }
      }
    }
  }
  for (uint32_t e = 0; e < ep; ++e) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, MakeLayout(std::move(global[e]), shapes));
    layouts.global.push_back(std::move(layout));
  }
  UCP_ASSIGN_OR_RETURN(layouts.local, MakeLayout(std::move(local), std::move(shapes)));
  return layouts;
}

// The model states' param_shapes, where a release records them (0.19): the expert group's entry
// lists one rank's experts under local ids, so at another E it becomes `local`'s names, each
// with the shape entry of its counterpart in local expert 0 (as the release pickled it); AutoEP's
// (`fused`) lists its fused parameters, each then a tuple of its shape in `local`, and so is each
// entry with expert tensor parallelism (`slices`: `local` holds a TP rank's slices).
Status SetLocalExpertShapes(pickle::Graph& graph, Value* root, const TorchArchiveReader& reader,
                            size_t expert_group, const GroupLayout& local, bool fused,
                            bool slices = false) {
  Value* shapes = root->Get("param_shapes");
  if (shapes == nullptr || shapes->kind() == Kind::kNone) return Status::Ok();
  Value* group = shapes->Item(expert_group);
  const std::string field = "param_shapes/" + std::to_string(expert_group);
  if (group == nullptr || group->kind() != Kind::kObject) {
    return FieldError(reader, field, "not an OrderedDict");
  }
  std::map<std::string, Value*> saved;
  for (const pickle::Mutation& mutation : group->mutations()) {
    if (mutation.op == pickle::Mutation::Op::kSetItem) {
      saved.emplace(KeyText(mutation.first), mutation.second);
    }
  }
  std::vector<pickle::Mutation> items;
  for (size_t k = 0; k < local.names.size(); ++k) {
    const std::string& name = local.names[k];
    const std::optional<ExpertIdAt> at = fused ? std::nullopt : FindExpertId(name);
    const auto entry = fused ? saved.find(name)
                       : at  ? saved.find(WithExpertId(name, *at, 0))
                             : saved.end();
    if (entry == saved.end()) {
      return FieldError(
          reader, field,
          fused ? "no entry for " + name : "no entry for local expert 0's counterpart of " + name);
    }
    Value* shape = entry->second;
    if (fused || slices) {
      std::vector<Value*> extents;
      for (const uint64_t extent : local.shapes[k]) {
        extents.push_back(graph.Int(static_cast<int64_t>(extent)));
      }
      shape = graph.Tuple(std::move(extents));
    }
    items.push_back({pickle::Mutation::Op::kSetItem, graph.Str(name), shape});
  }
  for (const pickle::Mutation& mutation : group->mutations()) {
    if (mutation.op != pickle::Mutation::Op::kSetItem) items.push_back(mutation);
  }
  group->mutable_mutations() = std::move(items);
  return Status::Ok();
}

// DeepSpeed before 0.15.4 divided an expert's ZeRO-1/2 gradient by its expert-data-parallel size,
// not the DP size (deepspeedai/DeepSpeed#6545, fixed by #6546 in 0.15.4): the gradients, and so
// Adam's moments, scale with E. Moments saved at one E then do not fit a run at another (0.14.5,
// E 2 -> 1: 5.2e-3 off the uninterrupted run's loss two steps on; 1.5e-6 with the moments
// rescaled by hand), so a change of E is refused for such tags.
Status RefuseOldExpertGradientScale(const AtomIndex& index, uint32_t ep, uint32_t source_ep) {
  const std::string& version = index.contents().framework_version;
  if (VersionAtLeast(version, 0, 15, 4)) return Status::Ok();
  return Status::Unsupported(
      "deepspeed: ep=" + std::to_string(ep) + ": the tag was saved at expert-parallel size " +
      std::to_string(source_ep) + " by DeepSpeed " + version +
      ", which scales expert gradients (and Adam's moments) by that size "
      "(deepspeedai/DeepSpeed#6545, fixed in 0.15.4); its optimizer state would not fit a run at "
      "another size. Resume it at ep=" +
      std::to_string(source_ep));
}

// At another E the expp_rank files are made from the source's: refused unless they hold no
// optimizer state ({'optimizer': None}, as every ZeRO run writes them).
Status CheckNoExpertOptimizer(const AtomIndex& index, const std::string& tag_dir,
                              const IndexFacts& facts) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.expp_files.front()));
  const Value* optimizer = OptionalField(reader, "optimizer");
  if (optimizer == nullptr || optimizer->kind() != Kind::kNone) {
    return Status::Unsupported(Prefix(reader.path()) +
                               "optimizer: not None; expert optimizer states outside ZeRO's files "
                               "cannot be placed at another expert-parallel size");
  }
  return Status::Ok();
}

// A tensor of a file of the tag, and that file (in MoeTag::paths).
struct TagTensor {
  const TorchTensor* tensor = nullptr;
  uint32_t file = 0;
};

// One TP lane of a stage (at tp = 1 the stage itself): its model states, their module tensors, and
// the dense groups' flat layouts partitioned over the dense-data-parallel ranks; with expert
// tensor parallelism also its expert files' tensors (its slices of each expert), by global name.
struct MoeLane {
  std::string model_name;
  std::optional<TorchArchiveReader> model;
  uint32_t model_file = 0;  // in MoeTag::paths
  std::map<std::string, const TorchTensor*> module;
  std::vector<GroupLayout> dense;  // per group; the expert group's empty
  std::vector<Partitioning> dense_p;
  std::map<std::string, TagTensor> expert_slices;
};

// One pipeline stage of a DeepSpeed-MoE tag as BuildIndex's phases read it (at pp = 1 the tag):
// its files are those of mp rank `mp`, each one a pp = 1 tag's.
struct MoeStage {
  uint32_t mp = 0;
  std::deque<MoeLane> lanes;  // a folded tag's TP lanes in rank order; else one
  size_t groups = 0;
  size_t expert_group = 0;
  ExpertFiles experts;
  std::vector<OptimStates> ranks;  // by rank (folded: global rank d·T + t)
  uint32_t optim_file = 0;         // ranks[r]'s file is MoeTag::paths[optim_file + r]
  std::deque<TorchArchiveReader> expert_readers;  // a deque: the tensors below point into them
  // By global name, of each expert's lowest lane's file (with expert tensor parallelism lane 0's
  // slices).
  std::map<std::string, TagTensor> expert_tensors;
  std::map<std::string, uint32_t> moe_layer_of;  // MoE module name → its layer index
  std::vector<GroupLayout> local;                // per EP rank, local names
  std::vector<GroupLayout> global;               // per EP rank, global names
  Partitioning expert_p;
  // TP lanes: the module tensors outside the groups whose lanes' copies differ (frozen parameters
  // split over TP, which ZeRO-1/2 keeps in the module alone), each indexed as its bit16 atom.
  std::vector<std::string> frozen_split;

  const MoeLane& first_lane() const { return lanes.front(); }
  const TorchArchiveReader& model() const { return *lanes.front().model; }
  const std::string& model_name() const { return lanes.front().model_name; }
};

// A DeepSpeed-MoE tag as BuildIndex's phases read it.
struct MoeTag {
  std::string dir;
  uint32_t dp = 0;
  uint32_t ep = 0;
  // The ranks each expert group is partitioned over: W / E, with expert tensor parallelism D / E.
  uint32_t expert_dp = 0;
  ExpertRankOrder order;
  std::string prefix;  // the optimizer files' ("" or "bf16_")
  // AutoEP (ds_autoep_layers): each expert-parallel rank's experts are rows of fused parameters
  // ("<experts module>.w1" of n rows), each expert file holding its rows ("….w1.<G>").
  bool fused = false;
  std::vector<std::string> experts_modules;  // AutoEP: per MoE layer, its expert_key_prefix
  std::deque<MoeStage> stages;               // a deque: tensors point into its readers
  std::vector<std::string> paths;  // the index's files: per stage models, optimizers, experts, expp
  // TP lanes: AutoEP with AutoTP (DeepSpeed's folded layout), or native MoE with an mpu's tensor
  // parallelism (mpu_tp: Megatron-DeepSpeed's); one stage of grid.tp lanes, dp the dense DP. Both
  // place ranks alike: rank d·T + t; its expert ranks are the grid's (FoldedGrid::Order).
  std::optional<deepspeed::FoldedGrid> folded;
  bool mpu_tp = false;
  // Lanes: how the dense parameters' TP slices (with expert tensor parallelism the experts' too)
  // make them.
  deepspeed::AutoTpMaps autotp;
  std::optional<Vocab> vocab;  // mpu_tp: the vocabulary's sizes, where a parameter is one

  // What records the dense parameters' TP layout, for messages.
  std::string_view RuleSource() const {
    return mpu_tp ? "universal_checkpoint_info" : "AutoTP's affine map";
  }

  uint32_t world() const { return folded ? folded->world : dp; }
  uint32_t tp() const { return folded ? folded->tp : 1; }
  bool expert_tp() const { return folded && folded->expert_tp; }
  // The mp rank of pipeline stage s's TP lane t (DeepSpeed's grid: s·T + t), and of them all.
  uint32_t MpRank(uint32_t s, uint32_t t) const { return s * tp() + t; }
  uint32_t MpRanks() const { return static_cast<uint32_t>(stages.size()) * tp(); }
  uint32_t ExpertRankOf(uint32_t r) const {
    return folded ? folded->ExpertRank(r) : order.ExpertRank(r);
  }
  uint32_t ExpertDpRankOf(uint32_t r) const {
    return folded ? folded->ExpertDpRank(r) : order.IndexInGroup(r);
  }
  // The rank holding partition i of expert-parallel rank e's experts (FoldedGrid::ExpertMember).
  uint32_t ExpertMember(uint32_t e, uint32_t i, uint32_t t) const {
    return folded ? folded->ExpertMember(e, i, t) : order.Rank(e, i);
  }
};

// Megatron-DeepSpeed's argument that gives its MoE layers expert tensor parallelism, as its
// client state saves it (args, an argparse.Namespace).
constexpr std::string_view kExpertTpArg = "args/enable_expert_tensor_parallelism";

// Whether a save over an mpu's TP (`grid`, its expert-parallel size read; `model` its lane-0 model
// states) has expert tensor parallelism (enable_expert_tensor_parallelism), which DeepSpeed records
// nowhere: at T > 1 its expert group g (`partition_count` of optimizer file `optim`) is then
// partitioned over the D/E ranks of a lane's expert-data-parallel group, not over the W/E of the
// world's (W/E = T·D/E), and Megatron's saved args must agree where they record it; at T = 1,
// where the layouts are one, the args alone tell (false without them), so a reshard to T > 1
// splits the experts as the run will.
Result<bool> ExpertTensorParallel(const TorchArchiveReader& model, const TorchArchiveReader& optim,
                                  const std::vector<int64_t>& partition_count, size_t g,
                                  const deepspeed::FoldedGrid& grid) {
  const Value* arg = OptionalField(model, kExpertTpArg);
  if (arg != nullptr && arg->kind() != Kind::kBool) {
    return FieldError(model, std::string(kExpertTpArg), "not a bool");
  }
  const std::optional<bool> recorded =
      arg == nullptr ? std::nullopt : std::optional<bool>(arg->bool_value());
  if (grid.tp == 1) return recorded.value_or(false);
  if (g >= partition_count.size()) {
    return FieldError(optim, std::string(kOsd) + "/partition_count",
                      "no entry for group " + std::to_string(g));
  }
  const bool partitioned =
      grid.DenseDp() % grid.ep == 0 && partition_count[g] == int64_t{grid.DenseDp() / grid.ep};
  if (recorded && *recorded != partitioned) {
    return FieldError(model, std::string(kExpertTpArg),
                      std::string(*recorded ? "True" : "False") + ", but " + optim.path() + "'s " +
                          std::string(kOsd) + "/partition_count/" + std::to_string(g) + " is " +
                          std::to_string(partition_count[g]) + ": " + (partitioned ? "" : "not ") +
                          "the dense-data-parallel size over ep, as expert tensor parallelism "
                          "partitions the expert group");
  }
  return partitioned;
}

// ExpertTensorParallel of a save over an mpu's TP while it may still be written: from its rank 0's
// optimizer file (`prefix`: its name's), kFailedPrecondition until that file is complete.
Result<bool> SavedExpertTensorParallel(const std::string& tag_dir, const TagListing& listing,
                                       const TorchArchiveReader& model, const std::string& prefix,
                                       const deepspeed::FoldedGrid& grid) {
  const std::string name = OptimName(prefix, 0, 0);
  const bool present = std::any_of(listing.optim.begin(), listing.optim.end(),
                                   [&name](const RankFile& entry) { return entry.name == name; });
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader optim,
                       OpenWrittenModelStates(tag_dir, name, present));
  UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> partition_count,
                       IntListField(optim, std::string(kOsd) + "/partition_count"));
  const std::string groups_field = std::string(kOsd) + "/base_optimizer_state/param_groups";
  UCP_ASSIGN_OR_RETURN(const Value* groups, Field(optim, groups_field));
  for (size_t g = 0; g < groups->items().size(); ++g) {
    if (IsExpertGroup(groups->items()[g])) {
      return ExpertTensorParallel(model, optim, partition_count, g, grid);
    }
  }
  return FieldError(optim, groups_field, "no group with moe True, but the tag holds expert files");
}

// A folded tag's optimizer files by global rank g = d·T + t: lane t's dense-data-parallel rank d's.
Result<std::vector<const RankFile*>> FoldedOptimFiles(const MoeTag& tag, const TagListing& listing,
                                                      const MoeStage& stage) {
  const uint32_t tp = tag.tp();
  std::vector<const RankFile*> by_rank(tag.world());
  for (uint32_t t = 0; t < tp; ++t) {
    UCP_ASSIGN_OR_RETURN(const std::vector<const RankFile*> lane,
                         OptimFilesByRank(tag.dir, listing, tag.dp, stage.lanes[t].model_name,
                                          tag.MpRank(stage.mp, t), tag.MpRanks()));
    for (uint32_t d = 0; d < tag.dp; ++d) by_rank[tag.folded->Rank(d, t)] = lane[d];
  }
  for (const RankFile* file : by_rank) {
    if (file->prefix != by_rank.front()->prefix) {
      return Status::Corrupt(Prefix(tag.dir + "/" + file->name) + "another prefix than " +
                             by_rank.front()->name + " (files of two saves)");
    }
  }
  return by_rank;
}

// Phase 1, per stage: the stage's model states, expert files' names and every rank's optimizer
// file, with what is refused; the expert group and the expert-parallel size its name gives (the
// tag's: every stage's must agree).
Status ReadStage(const TagListing& listing, MoeTag& tag, MoeStage& stage) {
  const std::string& tag_dir = tag.dir;
  const TorchArchiveReader& model = stage.model();
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(model));
  if (stage.mp > 0 && dp != tag.dp) {
    return FieldError(model, "dp_world_size",
                      std::to_string(dp) + ", but " + tag.stages.front().model_name() + " has " +
                          std::to_string(tag.dp) + " (a file of another save)");
  }
  const uint32_t world = tag.world();
  UCP_ASSIGN_OR_RETURN(stage.experts,
                       ListExpertFiles(tag_dir, listing, model, stage.mp, tag.stages.size(),
                                       tag.folded ? tag.tp() : 0));
  std::optional<uint32_t> autoep_size;
  if (const Value* autoep = OptionalField(model, kAutoEpLayers);
      autoep != nullptr && autoep->kind() != Kind::kNone) {
    if (tag.stages.size() > 1) {
      return Status::Unsupported(Prefix(model.path()) + std::string(kAutoEpLayers) +
                                 ": AutoEP layers in a pipeline are not supported");
    }
    tag.fused = true;
    // The layers record the run's expert-data-parallel size: over every rank, TP lanes included.
    UCP_ASSIGN_OR_RETURN(autoep_size, ReadAutoEpLayers(model, stage.experts.num_experts, world,
                                                       kAutoEpFileFormat, tag.experts_modules));
  }

  std::vector<const RankFile*> by_rank;
  if (tag.folded) {
    UCP_ASSIGN_OR_RETURN(by_rank, FoldedOptimFiles(tag, listing, stage));
  } else {
    UCP_ASSIGN_OR_RETURN(by_rank, OptimFilesByRank(tag_dir, listing, dp, stage.model_name(),
                                                   stage.mp, tag.stages.size()));
  }
  tag.prefix = by_rank.front()->prefix;
  size_t group_count = 0;
  {
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader probe,
                         TorchArchiveReader::Open(tag_dir + "/" + by_rank.front()->name));
    UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> counts,
                         IntListField(probe, std::string(kOsd) + "/partition_count"));
    group_count = counts.size();
  }
  stage.groups = group_count;
  std::vector<OptimStates>& ranks = stage.ranks;
  for (uint32_t r = 0; r < world; ++r) {
    UCP_ASSIGN_OR_RETURN(OptimStates os,
                         ReadOptimStates(tag_dir, *by_rank[r], group_count, kZero3Refusal));
    if (os.elastic) {
      return Status::Unsupported(Prefix(os.reader.path()) + std::string(kOsd) +
                                 "/base_optimizer_state: an elastic checkpoint; for MoE tags ucp "
                                 "reads only the rigid form");
    }
    ranks.push_back(std::move(os));
  }
  for (OptimStates& os : ranks) OrderStatesAs(os, ranks.front());
  const OptimStates& first = ranks.front();
  if (const Value* rr =
          OptionalField(first.reader, "ds_config/zero_optimization/round_robin_gradients");
      rr != nullptr && rr->kind() == Kind::kBool && rr->bool_value()) {
    return Status::Unsupported(Prefix(first.reader.path()) +
                               "ds_config/zero_optimization/round_robin_gradients: with MoE "
                               "not supported");
  }

  const Value* order = OptionalField(first.reader, "ds_config/" + std::string(kDataBeforeExpert));
  const bool data_before_expert =
      order != nullptr && order->kind() == Kind::kBool && order->bool_value();
  if (data_before_expert && tag.folded && !tag.mpu_tp) {
    return Status::Unsupported(Prefix(first.reader.path()) + "ds_config/" +
                               std::string(kDataBeforeExpert) +
                               ": with AutoEP folded over AutoTP (DeepSpeed does not fold it)");
  }

  // Which group holds the experts; its name gives the expert-parallel size.
  std::optional<size_t> expert_group;
  uint32_t ep = 0;
  for (size_t g = 0; g < group_count; ++g) {
    const Value* param_group = first.groups[g].param_group;
    if (!IsExpertGroup(param_group)) continue;
    const std::string field =
        std::string(kOsd) + "/base_optimizer_state/param_groups/" + std::to_string(g);
    if (expert_group) {
      return Status::Unsupported(Prefix(first.reader.path()) + field +
                                 ": a second expert group (MoE layers of several "
                                 "expert-parallel sizes) is not supported");
    }
    // AutoEP's size is its layers' ep_size: DeepSpeed's universal load at another size keeps the
    // saved group's name, and so do its saves after it.
    const std::optional<uint32_t> size = autoep_size ? autoep_size : ExpertGroupSize(param_group);
    if (!size || *size == 0 || world % *size != 0) {
      return FieldError(first.reader, field + "/name",
                        "not ep_size_<N> with N dividing the " + std::to_string(world) + " ranks");
    }
    if (stage.mp > 0 && *size != tag.ep) {
      return FieldError(first.reader, field + "/name",
                        "expert-parallel size " + std::to_string(*size) + ", but stage 0's is " +
                            std::to_string(tag.ep) +
                            " (MoE layers of several expert-parallel sizes are not supported)");
    }
    if (tag.mpu_tp) {
      tag.folded->ep = *size;
      tag.folded->data_before_expert = data_before_expert;
      UCP_ASSIGN_OR_RETURN(
          tag.folded->expert_tp,
          ExpertTensorParallel(model, first.reader, first.partition_count, g, *tag.folded));
    }
    if (tag.folded && *size != tag.folded->ep) {
      return FieldError(first.reader, field + "/name",
                        "expert-parallel size " + std::to_string(*size) + ", but the folding of " +
                            stage.model_name() + " records " + std::to_string(tag.folded->ep));
    }
    expert_group = g;
    ep = *size;
  }
  if (!expert_group) {
    return FieldError(first.reader, std::string(kOsd) + "/base_optimizer_state/param_groups",
                      "no group with moe True, but the tag holds expert files");
  }
  if (tag.folded) {
    UCP_RETURN_IF_ERROR(CheckFoldedExpertFiles(tag_dir, stage.experts, *tag.folded, tag.mpu_tp,
                                               tag.MpRank(stage.mp, 0)));
  }
  if (tag.folded && !tag.mpu_tp) {
    for (uint32_t g = 0; g < world; ++g) {
      const deepspeed::FoldedGrid& grid = *tag.folded;
      UCP_RETURN_IF_ERROR(CheckFolding(ranks[g].reader, deepspeed::kZeroFamily, grid,
                                       grid.TpRank(g), grid.ExpertRank(g), grid.DenseRank(g)));
    }
  }
  UCP_RETURN_IF_ERROR(CheckExpertFiles(tag_dir, stage.experts, ep, model));
  tag.ep = ep;
  tag.order = tag.folded ? tag.folded->Order() : ExpertRankOrder{world, ep, data_before_expert};
  tag.expert_dp = tag.order.dp / ep;
  stage.expert_group = *expert_group;
  return Status::Ok();
}

// A stage's model states of TP lanes 1 .. T-1 (lane 0's read), each written by the stage's rank
// t: the same sizes, and a folded tag's its folding dict.
Status ReadFoldedLanes(const TagListing& listing, MoeTag& tag, MoeStage& stage) {
  const deepspeed::FoldedGrid& grid = *tag.folded;
  if (!tag.mpu_tp) {
    UCP_RETURN_IF_ERROR(CheckFolding(stage.model(), deepspeed::kDenseFamily, grid, 0, 0, 0));
  }
  for (uint32_t t = 1; t < grid.tp; ++t) {
    const uint32_t mp = tag.MpRank(stage.mp, t);
    const auto name = listing.model_states.find(mp);
    if (name == listing.model_states.end()) {
      return Status::NotFound(Prefix(tag.dir) + ModelStatesName(mp) + ": not found (tp_degree " +
                              std::to_string(grid.tp) + " in " + stage.model_name() + ")" +
                              (tag.mpu_tp ? std::string(kMpuModelStatesWriters) : std::string()));
    }
    MoeLane& lane = stage.lanes.emplace_back();
    lane.model_name = name->second;
    UCP_ASSIGN_OR_RETURN(TorchArchiveReader opened,
                         TorchArchiveReader::Open(tag.dir + "/" + lane.model_name));
    const TorchArchiveReader& model = lane.model.emplace(std::move(opened));
    UCP_ASSIGN_OR_RETURN(const int64_t mp_world_size, IntField(model, "mp_world_size"));
    UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(model));
    if (mp_world_size != tag.MpRanks() || dp != tag.dp) {
      return FieldError(model, "mp_world_size",
                        std::to_string(mp_world_size) + " with dp_world_size " +
                            std::to_string(dp) + ", but " + stage.model_name() + " has " +
                            std::to_string(tag.MpRanks()) + " and " + std::to_string(tag.dp) +
                            " (a file of another save)");
    }
    if (!tag.mpu_tp) {
      UCP_RETURN_IF_ERROR(
          CheckFolding(model, deepspeed::kDenseFamily, grid, t, grid.ExpertRank(t), 0));
    }
  }
  return Status::Ok();
}

// Phase 1: the model states of every stage (their mp_world_size: the pipeline's stages, or a
// folded tag's TP lanes), then each stage as ReadStage reads it.
Status ReadSave(const std::string& tag_dir, MoeTag& tag) {
  tag.dir = tag_dir;
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTag(tag_dir));
  UCP_RETURN_IF_ERROR(RefuseListing(tag_dir, listing));
  tag.stages.resize(1);
  // Growing a deque at its end keeps references to its elements.
  for (uint32_t s = 0; s < tag.stages.size(); ++s) {
    const uint32_t mp = tag.MpRank(s, 0);  // tag.tp() is 1 until stage 0 is read
    const auto name = listing.model_states.find(mp);
    if (name == listing.model_states.end()) {
      return Status::NotFound(Prefix(tag_dir) + ModelStatesName(mp) +
                              ": not found (mp_world_size " + std::to_string(tag.MpRanks()) +
                              " in " + tag.stages.front().model_name() + ")");
    }
    MoeStage& stage = tag.stages[s];
    stage.mp = s;
    MoeLane& lane = stage.lanes.emplace_back();
    lane.model_name = name->second;
    UCP_ASSIGN_OR_RETURN(TorchArchiveReader opened,
                         TorchArchiveReader::Open(tag_dir + "/" + lane.model_name));
    const TorchArchiveReader& model = lane.model.emplace(std::move(opened));
    UCP_ASSIGN_OR_RETURN(const int64_t mp_world_size, IntField(model, "mp_world_size"));
    if (mp == 0) {
      UCP_ASSIGN_OR_RETURN(tag.dp, DpWorldSize(model));
      UCP_ASSIGN_OR_RETURN(tag.folded, deepspeed::ReadFoldedGrid(model));
      UCP_ASSIGN_OR_RETURN(const std::optional<uint32_t> mpu_tp,
                           tag.folded ? std::optional<uint32_t>() : MpuLanes(model, mp_world_size));
      if (mpu_tp) {
        // The expert-parallel size comes from the expert group's name (ReadStage); MpuLanes
        // checked that mp_world_size is the lanes of every stage.
        tag.folded = deepspeed::FoldedGrid{tag.dp * *mpu_tp, *mpu_tp, 0};
        tag.mpu_tp = true;
        tag.stages.resize(static_cast<size_t>(mp_world_size / *mpu_tp));
      } else if (!tag.folded) {
        UCP_ASSIGN_OR_RETURN(const uint32_t stages, PipelineStages(model, mp_world_size));
        tag.stages.resize(stages);
      }
    } else if (mp_world_size != static_cast<int64_t>(tag.MpRanks())) {
      return FieldError(model, "mp_world_size",
                        std::to_string(mp_world_size) + ", but " + tag.stages.front().model_name() +
                            " has " + std::to_string(tag.MpRanks()) + " (a file of another save)");
    }
  }
  const uint32_t mp_ranks = tag.MpRanks();
  for (const auto& [mp, name] : listing.model_states) {
    if (mp >= mp_ranks) {
      return Status::Corrupt(Prefix(tag_dir + "/" + name) + "mp rank " + std::to_string(mp) +
                             " >= mp_world_size " + std::to_string(mp_ranks) + " of " +
                             tag.stages.front().model_name() + " (a file of another save)");
    }
  }
  for (MoeStage& stage : tag.stages) {
    if (tag.folded) UCP_RETURN_IF_ERROR(ReadFoldedLanes(listing, tag, stage));
  }
  for (MoeStage& stage : tag.stages) UCP_RETURN_IF_ERROR(ReadStage(listing, tag, stage));
  return Status::Ok();
}

// Phase 2, per stage: every lane's module tensors and each expert file's, by global name; the
// stage's files appended to the index's (its lanes' model states, its ranks' optimizer files,
// its expert files, its expp_rank files). A folded tag's expert lies under several lanes: all of
// those files are the save's, and the lowest lane's gives the tensors, the others' must match it.
Status ReadExpertTensors(MoeTag& tag, MoeStage& stage) {
  std::vector<std::string>& paths = tag.paths;
  for (MoeLane& lane : stage.lanes) {
    const TorchArchiveReader& model = *lane.model;
    if (const Value* node = OptionalField(model, "module")) {
      for (const auto& [name, value] : NamedChildren(node))
        lane.module[name] = model.TensorAt(value);
    }
    lane.model_file = static_cast<uint32_t>(paths.size());
    paths.push_back(lane.model_name);
  }
  stage.optim_file = static_cast<uint32_t>(paths.size());
  for (const OptimStates& os : stage.ranks) paths.push_back(os.entry.name);
  for (const auto& [layer, expert] : stage.experts.model) {
    const auto lanes = stage.experts.lanes_of.find({layer, expert});
    const std::vector<uint32_t> mps =
        lanes == stage.experts.lanes_of.end() ? std::vector<uint32_t>{stage.mp} : lanes->second;
    size_t first_file_tensors = 0;
    // A lanes stage's file of lane t is its mp rank s·T + t's; a pipeline stage's its own.
    const auto file_mp = [&](uint32_t mp) { return tag.folded ? tag.MpRank(stage.mp, mp) : mp; };
    for (const uint32_t mp : mps) {
      const std::string name = ExpertModelStatesName(layer, expert, file_mp(mp));
      UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader,
                           TorchArchiveReader::Open(tag.dir + "/" + name));
      stage.expert_readers.push_back(std::move(reader));
      const TorchArchiveReader& r = stage.expert_readers.back();
      const uint32_t file = static_cast<uint32_t>(paths.size());
      paths.push_back(name);
      if (tag.folded && !tag.mpu_tp) {
        const uint32_t per_rank = stage.experts.num_experts[layer] / tag.folded->ep;
        UCP_RETURN_IF_ERROR(CheckFolding(r, deepspeed::kExpertFamily, *tag.folded, mp,
                                         expert / per_rank, std::nullopt));
      }
      size_t tensors = 0;  // a later lane's file must hold as many as the first lane's
      for (const auto& [param, value] : NamedChildren(r.root())) {
        if (tag.folded && !tag.mpu_tp && param == deepspeed::kFolding) continue;
        ++tensors;
        const TorchTensor* tensor = r.TensorAt(value);
        const std::optional<ExpertIdAt> at = ExpertIdOf(param, tag.fused);
        if (tensor == nullptr || !at || at->id != expert) {
          return FieldError(r, param, "not a tensor of expert " + std::to_string(expert));
        }
        if (tag.expert_tp()) stage.lanes[mp].expert_slices[param] = {tensor, file};
        if (mp != mps.front()) {
          const auto first = stage.expert_tensors.find(param);
          if (first == stage.expert_tensors.end() || first->second.tensor->shape != tensor->shape ||
              first->second.tensor->dtype != tensor->dtype) {
            return FieldError(
                r, param,
                "not the tensor " +
                    paths[first == stage.expert_tensors.end() ? file : first->second.file] +
                    " holds for this expert (a file of another save)");
          }
          continue;
        }
        const std::string module_name = param.substr(0, at->module_end);
        if (tag.fused && module_name != tag.experts_modules[layer]) {
          return FieldError(r, param,
                            "not of MoE layer " + std::to_string(layer) + "'s experts " +
                                tag.experts_modules[layer] + " (ds_autoep_layers of " +
                                stage.model_name() + ")");
        }
        if (const auto [it, added] = stage.moe_layer_of.emplace(module_name, layer);
            !added && it->second != layer) {
          return FieldError(r, param,
                            "MoE module " + module_name + " is layer " +
                                std::to_string(it->second) + " in other expert files");
        }
        stage.expert_tensors[param] = {tensor, file};
      }
      if (mp == mps.front()) {
        first_file_tensors = tensors;
      } else if (tensors != first_file_tensors) {
        return Status::Corrupt(
            Prefix(tag.dir + "/" + name) + std::to_string(tensors) + " tensors, but " +
            ExpertModelStatesName(layer, expert, file_mp(mps.front())) + " holds " +
            std::to_string(first_file_tensors) + " (a file of another save)");
      }
    }
  }
  for (const uint32_t e : stage.experts.optim) paths.push_back(ExpertOptimName(e, stage.mp));
  return Status::Ok();
}

// Phase 3, per stage: each group's flat layout from the ranks' param_slice_mappings: the dense
// groups over every rank, the expert group per expert-parallel rank over its expert-data-parallel
// ranks.
Status LayOutGroups(const MoeTag& tag, MoeStage& stage) {
  // A local expert parameter's global name on expert-parallel rank e (nullopt: not an expert's).
  const uint32_t ep = tag.ep;
  const size_t group_count = stage.groups;
  const std::vector<OptimStates>& ranks = stage.ranks;
  const auto global_name = [&](const std::string& local, uint32_t e) -> std::optional<std::string> {
    const std::optional<ExpertIdAt> at = FindExpertId(local);
    if (!at) return std::nullopt;
    const auto layer = stage.moe_layer_of.find(local.substr(0, at->module_end));
    if (layer == stage.moe_layer_of.end()) return std::nullopt;
    const uint32_t per_rank = stage.experts.num_experts[layer->second] / ep;
    if (at->id >= per_rank) return std::nullopt;
    return WithExpertId(local, *at, e * per_rank + at->id);
  };
  // AutoEP: the rows of fused parameter `local` (per expert) on expert-parallel rank e, the first
  // one's global name, and how many (nullopt: not a fused expert parameter).
  struct FusedRows {
    Shape row;
    uint32_t first = 0;
    uint32_t count = 0;
  };
  const auto fused_rows = [&](const std::string& local, uint32_t e) -> std::optional<FusedRows> {
    const size_t dot = local.rfind('.');
    const auto layer = dot == std::string::npos ? stage.moe_layer_of.end()
                                                : stage.moe_layer_of.find(local.substr(0, dot));
    if (layer == stage.moe_layer_of.end()) return std::nullopt;
    const uint32_t per_rank = stage.experts.num_experts[layer->second] / ep;
    const auto it = stage.expert_tensors.find(local + "." + std::to_string(e * per_rank));
    if (it == stage.expert_tensors.end()) return std::nullopt;
    return FusedRows{it->second.tensor->shape, e * per_rank, per_rank};
  };

  // Layouts: the dense groups of each lane over its dense-data-parallel ranks (at tp = 1 every
  // rank); the expert group per EP rank, over its ranks.
  for (uint32_t t = 0; t < stage.lanes.size(); ++t) {
    MoeLane& lane = stage.lanes[t];
    lane.dense.resize(group_count);
    lane.dense_p.resize(group_count);
    std::vector<const OptimStates*> members;
    for (uint32_t d = 0; d < tag.dp; ++d) members.push_back(&ranks[d * tag.tp() + t]);
    for (size_t g = 0; g < group_count; ++g) {
      if (g == stage.expert_group) continue;
      UCP_ASSIGN_OR_RETURN(
          lane.dense[g],
          LayoutFromMappings(members, g, PartitionSize(*members.front(), g),
                             [&](const std::string& name) -> std::optional<Shape> {
                               const auto it = lane.module.find(name);
                               if (it == lane.module.end() || it->second == nullptr) {
                                 return std::nullopt;
                               }
                               return it->second->shape;
                             }));
      if (lane.dense[g].names != stage.first_lane().dense[g].names) {
        return FieldError(members.front()->reader,
                          std::string(kOsd) + "/param_slice_mappings/" + std::to_string(g),
                          "other parameters than " + ranks[0].entry.name +
                              "'s (TP lanes must "
                              "hold slices of the same parameters)");
      }
      UCP_ASSIGN_OR_RETURN(lane.dense_p[g], Partition(lane.dense[g].total, tag.dp));
    }
  }
  std::vector<GroupLayout>& local = stage.local;
  std::vector<GroupLayout>& global = stage.global;
  local.resize(ep);
  global.resize(ep);
  for (uint32_t e = 0; e < ep; ++e) {
    // With expert tensor parallelism every lane holds slices of rank e's experts, as lane 0's in
    // shape (ReadExpertTensors).
    for (uint32_t t = 0; t < (tag.expert_tp() ? tag.tp() : 1); ++t) {
      std::vector<const OptimStates*> members;
      for (uint32_t i = 0; i < tag.expert_dp; ++i) {
        members.push_back(&ranks[tag.ExpertMember(e, i, t)]);
      }
      UCP_ASSIGN_OR_RETURN(
          const GroupLayout layout,
          LayoutFromMappings(members, stage.expert_group,
                             PartitionSize(*members.front(), stage.expert_group),
                             [&](const std::string& name) -> std::optional<Shape> {
                               if (tag.fused) {
                                 const std::optional<FusedRows> rows = fused_rows(name, e);
                                 if (!rows) return std::nullopt;
                                 Shape shape = rows->row;
                                 shape.insert(shape.begin(), rows->count);
                                 return shape;
                               }
                               const std::optional<std::string> g = global_name(name, e);
                               if (!g) return std::nullopt;
                               const auto it = stage.expert_tensors.find(*g);
                               if (it == stage.expert_tensors.end()) return std::nullopt;
                               return it->second.tensor->shape;
                             }));
      if (t == 0) local[e] = layout;
      if (layout.names != local[0].names || layout.shapes != local[0].shapes) {
        return FieldError(
            members.front()->reader,
            std::string(kOsd) + "/param_slice_mappings/" + std::to_string(stage.expert_group),
            "other local experts than " + ranks[0].entry.name +
                "'s (expert-parallel ranks and TP lanes must hold alike experts)");
      }
    }
    if (!tag.fused) {
      std::vector<std::string> names;
      for (const std::string& name : local[e].names) names.push_back(*global_name(name, e));
      UCP_ASSIGN_OR_RETURN(global[e], MakeLayout(std::move(names), local[e].shapes));
      continue;
    }
    // A fused parameter's rows are its experts one after another: expert after expert, each the
    // expert file's tensor.
    std::vector<std::string> names;
    std::vector<Shape> shapes;
    for (const std::string& name : local[e].names) {
      const FusedRows rows = *fused_rows(name, e);
      for (uint32_t k = 0; k < rows.count; ++k) {
        names.push_back(name + "." + std::to_string(rows.first + k));
        const auto it = stage.expert_tensors.find(names.back());
        if (it == stage.expert_tensors.end() || it->second.tensor->shape != rows.row) {
          return Status::Corrupt(Prefix(tag.dir) + names.back() + ": no expert file holds it as " +
                                 ShapeText(rows.row) + ", the rows of " + name + " in " +
                                 ranks[tag.ExpertMember(e, 0, 0)].entry.name);
        }
        shapes.push_back(rows.row);
      }
    }
    UCP_ASSIGN_OR_RETURN(global[e], MakeLayout(std::move(names), std::move(shapes)));
  }
  UCP_ASSIGN_OR_RETURN(stage.expert_p, Partition(local[0].total, tag.expert_dp));
  return Status::Ok();
}

// Phase 4, per stage: every rank's optimizer file against the layouts by DeepSpeed's rules.
Status CheckRanks(const MoeTag& tag, const MoeStage& stage) {
  const OptimStates& first = stage.ranks.front();
  std::vector<int64_t> partition_count;
  for (size_t g = 0; g < stage.groups; ++g) {
    partition_count.push_back(g == stage.expert_group ? tag.expert_dp : tag.dp);
  }
  const std::string source = "the param_slice_mappings of " + first.entry.name + "'s save";
  const OptimStates& tag_first = tag.stages.front().ranks.front();
  for (uint32_t r = 0; r < tag.world(); ++r) {
    const OptimStates& os = stage.ranks[r];
    if (os.ds_version != tag_first.ds_version) {
      return FieldError(os.reader, std::string(kOsd) + "/ds_version",
                        "\"" + os.ds_version + "\", but " + tag_first.entry.name + " has \"" +
                            tag_first.ds_version + "\" (a file of another save)");
    }
    if (os.partition_count != partition_count) {
      return FieldError(os.reader, std::string(kOsd) + "/partition_count",
                        ListText(os.partition_count) + ", expected " + ListText(partition_count) +
                            " (dp_world_size " + std::to_string(tag.dp) + " in " +
                            stage.model_name() + ", " + std::to_string(tag.ep) +
                            " expert-parallel ranks)");
    }
    std::vector<GroupExpectation> expectations;
    for (size_t g = 0; g < stage.groups; ++g) {
      if (g == stage.expert_group) {
        expectations.push_back(
            {&stage.local[tag.ExpertRankOf(r)], stage.expert_p, tag.ExpertDpRankOf(r)});
      } else {
        const MoeLane& lane = stage.lanes[r % tag.tp()];
        expectations.push_back({&lane.dense[g], lane.dense_p[g], r / tag.tp()});
      }
    }
    UCP_RETURN_IF_ERROR(CheckOptimGroups(os, first, expectations, false, source));
  }
  return Status::Ok();
}

// Phase 5, per stage: its files' entries (model states, optimizer files, expert files, expp_rank
// files, in MoeTag::paths order) with their roles and ranks: a folded tag's by (dense-data-
// parallel rank, TP lane).
void AddStageFiles(const MoeTag& tag, const MoeStage& stage, const std::vector<FileDigest>& digests,
                   AtomIndexContents& c) {
  const size_t begin = stage.first_lane().model_file;
  const size_t end = stage.mp + 1 < tag.stages.size()
                         ? tag.stages[stage.mp + 1].first_lane().model_file
                         : tag.paths.size();
  const size_t optim_end = stage.optim_file + stage.ranks.size();
  const uint32_t tp = tag.tp();
  for (size_t i = begin; i < end; ++i) {
    std::string role(kModelRole);
    std::optional<RankCoordinates> rank;
    if (i < stage.optim_file) {
      if (tag.folded) rank = RankCoordinates{0, static_cast<uint32_t>(i - begin), stage.mp};
    } else if (i < optim_end) {
      const uint32_t r = static_cast<uint32_t>(i - stage.optim_file);
      role = kOptimRole;
      rank =
          tag.folded ? RankCoordinates{r / tp, r % tp, stage.mp} : RankCoordinates{r, 0, stage.mp};
    } else {
      role = i + stage.experts.optim.size() >= end ? kExpertOptimRole : kExpertStatesRole;
    }
    c.files.push_back({tag.paths[i], digests[i].size, digests[i].xxh3, role, rank});
    c.files.back().chunks = digests[i].chunks;
  }
}

// Where TP lane t holds its slices of a group's parameters: their flat layout, partitioned over
// ranks (partition i on global rank `rank(i)`), and each one's module tensor (bit16), which is
// field `field_prefix` + name of its file.
struct LaneSlices {
  const GroupLayout* layout = nullptr;
  const Partitioning* partitioning = nullptr;
  std::function<uint32_t(uint32_t)> rank;
  std::function<TagTensor(const std::string&)> bit16;
  std::string field_prefix;
};
using LaneSlicesOf = std::function<LaneSlices(uint32_t t)>;

// Lane t's slices of dense group g: over its dense-data-parallel ranks, in its model states'
// module.
LaneSlices DenseSlices(const MoeTag& tag, const MoeStage& stage, size_t g, uint32_t t) {
  const MoeLane& lane = stage.lanes[t];
  return {&lane.dense[g], &lane.dense_p[g],
          [&tag, t](uint32_t d) { return tag.folded->Rank(d, t); },
          [&lane](const std::string& name) {
            return TagTensor{lane.module.at(name), lane.model_file};
          },
          "module/"};
}

// Lane t's slices of expert-parallel rank e's experts (expert tensor parallelism): over the
// lane's expert-data-parallel ranks of e, in the lane's expert files.
LaneSlices ExpertSlices(const MoeTag& tag, const MoeStage& stage, uint32_t e, uint32_t t) {
  const MoeLane& lane = stage.lanes[t];
  return {&stage.global[e], &stage.expert_p,
          [&tag, e, t](uint32_t i) { return tag.ExpertMember(e, i, t); },
          [&lane](const std::string& name) { return lane.expert_slices.at(name); }, ""};
}

// Which copy of a lanes tag's parameter: the fp32 master, an optimizer state (its index in the
// group's states), or the module's.
constexpr int kLaneFp32 = -1;
constexpr int kLaneBit16 = -2;

// The bytes of `lane`'s copy `which` of parameter k of group g, in its flat order.
Result<std::string> LaneBytes(const MoeTag& tag, const MoeStage& stage, const LaneSlices& lane,
                              size_t g, size_t k, int which) {
  if (which == kLaneBit16) {
    const TagTensor module = lane.bit16(lane.layout->names[k]);
    return ReadRange(tag.dir + "/" + tag.paths[module.file], module.tensor->file_offset(),
                     module.tensor->byte_size());
  }
  std::string out;
  for (const Piece& piece : Pieces(*lane.layout, k, *lane.partitioning)) {
    const OptimStates& os = stage.ranks[lane.rank(piece.rank)];
    const TorchTensor* tensor = which == kLaneFp32
                                    ? os.groups[g].fp32
                                    : os.groups[g].states[static_cast<size_t>(which)].tensor;
    const uint64_t item = ItemSize(tensor->dtype);
    UCP_ASSIGN_OR_RETURN(const std::string bytes,
                         ReadRange(os.reader.path(), tensor->file_offset() + piece.at * item,
                                   (piece.end - piece.begin) * item));
    out += bytes;
  }
  return out;
}

// Of a parameter every TP lane holds whole, the first copy (fp32, each partitioned optimizer
// state, bit16) whose bytes on some lane differ from lane 0's, naming that lane; nullopt where
// they are alike, as DeepSpeed's tensor-parallel training keeps them.
Result<std::optional<std::string>> DifferingLane(const MoeTag& tag, const MoeStage& stage,
                                                 const LaneSlicesOf& lanes, size_t g, size_t k) {
  const OptimGroup& first = stage.ranks.front().groups[g];
  std::vector<std::pair<int, std::string>> copies = {{kLaneFp32, "fp32"}};
  for (size_t i = 0; i < first.states.size(); ++i) {
    if (!first.states[i].tensor->shape.empty()) {
      copies.emplace_back(static_cast<int>(i), first.states[i].key);
    }
  }
  copies.emplace_back(kLaneBit16, "bit16");
  const LaneSlices lane0 = lanes(0);
  for (const auto& [which, copy] : copies) {
    UCP_ASSIGN_OR_RETURN(const std::string reference, LaneBytes(tag, stage, lane0, g, k, which));
    for (uint32_t t = 1; t < tag.tp(); ++t) {
      UCP_ASSIGN_OR_RETURN(const std::string other, LaneBytes(tag, stage, lanes(t), g, k, which));
      if (other != reference) {
        return std::optional<std::string>(copy + " of TP lane " + std::to_string(t));
      }
    }
  }
  return std::optional<std::string>();
}

// The bit16 atom of parameter `name` (`shape` whole, its slices placed by `map` and `geometry`)
// from `modules`: the module tensor of each lane holding a slice of it (lane t's slice t; lane 0's
// alone where every lane holds it whole), each with its field for errors.
Status AddModuleAtom(const MoeTag& tag, const std::string& name, const ShardMap& map,
                     const Geometry& geometry, const Shape& shape,
                     const std::vector<std::pair<TagTensor, std::string>>& modules,
                     AtomIndexContents& c) {
  const TagTensor& module0 = modules.front().first;
  Atom bit16{name, "bit16", module0.tensor->dtype, shape, {}};
  for (uint32_t t = 0; t < modules.size(); ++t) {
    const auto& [module, field] = modules[t];
    if (module.tensor->dtype != bit16.dtype || !module.tensor->contiguous()) {
      return Status::Corrupt(Prefix(tag.dir + "/" + tag.paths[module.file]) + field +
                             ": not contiguous, or its dtype differs from " +
                             tag.paths[module0.file] + "'s");
    }
    UCP_RETURN_IF_ERROR(AddSliceFragments(bit16, map, geometry, t, 0, module.tensor->numel(),
                                          module.file, module.tensor->file_offset(),
                                          module.tensor->dtype));
  }
  c.atoms.push_back(std::move(bit16));
  return Status::Ok();
}

// Phase 5 of a tag of TP lanes, parameters of group g that each lane holds slices of (`lanes`:
// where): each parameter's atoms whole (AutoTP's logical shape; a vocabulary's unpadded), from
// every lane's slices where the rules split it and from lane 0's where every lane holds it whole
// (each copy alike on every lane, else refused naming it), as deepspeed-tp indexes its tags: fp32
// and the optimizer states from each lane's partitions, "step" the 0-d state of lane 0's first
// rank holding it, bit16 from the lanes' module tensors. `tp_params` gets each one's shard map.
Status AddLaneAtoms(const MoeTag& tag, const MoeStage& stage, size_t g, const LaneSlicesOf& lanes,
                    std::set<std::string>& seen, ParamGroup& group, AtomIndexContents& c,
                    nlohmann::json& tp_params) {
  const uint32_t tp = tag.tp();
  std::vector<LaneSlices> slices;
  for (uint32_t t = 0; t < tp; ++t) slices.push_back(lanes(t));
  const GroupLayout& layout = *slices.front().layout;
  const OptimGroup& first = stage.ranks.front().groups[g];
  for (size_t k = 0; k < layout.names.size(); ++k) {
    const std::string& name = layout.names[k];
    const std::string field =
        std::string(kOsd) + "/param_slice_mappings/" + std::to_string(g) + "/" + name;
    if (!seen.insert(name).second) {
      return FieldError(stage.ranks.front().reader, field, "a parameter of two groups");
    }
    group.params.push_back(name);
    const ShardMap& map = tag.autotp.maps.at(name);
    tp_params[name] = MapJson(map);
    const Shape& shape = tag.autotp.whole_shapes.at(name);
    UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                         GeometryAt(name, map, shape, tp, tag.vocab, map.blocks));
    for (uint32_t t = 0; t < tp; ++t) {
      const LaneSlices& lane = slices[t];
      const Shape& held = lane.layout->shapes[k];
      if (lane.layout->names[k] != name || LocalShape(geometry, t) != held) {
        return Status::Corrupt(Prefix(tag.dir + "/" + tag.paths[lane.bit16(name).file]) +
                               lane.field_prefix + name + ": " + ShapeText(held) + ", but " +
                               std::string(tag.RuleSource()) + " gives TP rank " +
                               std::to_string(t) + " " + ShapeText(LocalShape(geometry, t)));
      }
    }
    if (map.rule == Rule::kReplicated) {
      UCP_ASSIGN_OR_RETURN(const std::optional<std::string> differing,
                           DifferingLane(tag, stage, lanes, g, k));
      if (differing) {
        return Status::Corrupt(Prefix(tag.dir) + name + ": " + std::string(tag.RuleSource()) +
                               " has every TP rank hold it whole" +
                               (tag.mpu_tp ? " (or names it in no rule)" : "") + ", but its " +
                               *differing + " differs from lane 0's; ucp does not pick one");
      }
    }
    const uint32_t split_lanes = map.rule == Rule::kSplit ? tp : 1;
    const auto add_partitioned = [&](Atom& atom, int which) -> Status {
      for (uint32_t t = 0; t < split_lanes; ++t) {
        const LaneSlices& lane = slices[t];
        for (const Piece& piece : Pieces(*lane.layout, k, *lane.partitioning)) {
          const uint32_t r = lane.rank(piece.rank);
          const OptimGroup& og = stage.ranks[r].groups[g];
          const TorchTensor* tensor =
              which < 0 ? og.fp32 : og.states[static_cast<size_t>(which)].tensor;
          UCP_RETURN_IF_ERROR(AddSliceFragments(
              atom, map, geometry, t, piece.begin, piece.end, stage.optim_file + r,
              tensor->file_offset() + piece.at * ItemSize(tensor->dtype), tensor->dtype));
        }
      }
      return Status::Ok();
    };
    Atom fp32{name, "fp32", first.fp32->dtype, shape, {}};
    UCP_RETURN_IF_ERROR(add_partitioned(fp32, -1));
    c.atoms.push_back(std::move(fp32));
    for (size_t i = 0; i < first.states.size(); ++i) {
      const StateTensor& st = first.states[i];
      Atom atom{name, st.key, st.tensor->dtype, {}, {}};
      if (st.tensor->shape.empty()) {
        // ds_to_universal's step.pt: the 0-d state of the first rank holding the parameter.
        const Partitioning& p = *slices.front().partitioning;
        const uint32_t d =
            std::min(static_cast<uint32_t>(layout.offsets[k] / p.partition), p.ranks - 1);
        const uint32_t r = slices.front().rank(d);
        const TorchTensor* tensor = stage.ranks[r].groups[g].states[i].tensor;
        UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(atom.shape));
        atom.fragments.push_back(
            {stage.optim_file + r, tensor->file_offset(), tensor->dtype, std::move(whole)});
      } else {
        atom.shape = shape;
        UCP_RETURN_IF_ERROR(add_partitioned(atom, static_cast<int>(i)));
      }
      c.atoms.push_back(std::move(atom));
    }
    std::vector<std::pair<TagTensor, std::string>> modules;
    for (uint32_t t = 0; t < split_lanes; ++t) {
      modules.emplace_back(slices[t].bit16(name), slices[t].field_prefix + name);
    }
    UCP_RETURN_IF_ERROR(AddModuleAtom(tag, name, map, geometry, shape, modules, c));
  }
  return Status::Ok();
}

// A frozen parameter split over TP lanes (stage.frozen_split: in each lane's module alone): its
// bit16 atom whole from the lanes' slices, by its map (`tp_params` gets it).
Status AddFrozenSplitAtoms(const MoeTag& tag, const MoeStage& stage, std::set<std::string>& seen,
                           AtomIndexContents& c, nlohmann::json& tp_params) {
  for (const std::string& name : stage.frozen_split) {
    if (!seen.insert(name).second) {
      return FieldError(stage.model(), "module/" + name, "a parameter of a group, and frozen");
    }
    const ShardMap& map = tag.autotp.maps.at(name);
    tp_params[name] = MapJson(map);
    const Shape& shape = tag.autotp.whole_shapes.at(name);
    UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                         GeometryAt(name, map, shape, tag.tp(), tag.vocab, map.blocks));
    std::vector<std::pair<TagTensor, std::string>> modules;
    for (uint32_t t = 0; t < tag.tp(); ++t) {
      const MoeLane& lane = stage.lanes[t];
      const TorchTensor* tensor = lane.module.at(name);
      if (tensor->shape != LocalShape(geometry, t)) {
        return FieldError(*lane.model, "module/" + name,
                          ShapeText(tensor->shape) + ", but " + std::string(tag.RuleSource()) +
                              " gives TP rank " + std::to_string(t) + " " +
                              ShapeText(LocalShape(geometry, t)));
      }
      // A reshard writes the slice as the whole of the template's storage.
      if (tensor->storage_offset != 0 || tensor->storage->numel != tensor->numel()) {
        return Status::Unsupported(Prefix(lane.model->path()) + "module/" + name +
                                   ": a frozen parameter split over the TP ranks that shares its "
                                   "storage with other tensors; not supported");
      }
      modules.emplace_back(TagTensor{tensor, lane.model_file}, "module/" + name);
    }
    UCP_RETURN_IF_ERROR(AddModuleAtom(tag, name, map, geometry, shape, modules, c));
  }
  return Status::Ok();
}

// An mpu's TP: universal_checkpoint_info's rules (lane 0's, as deepspeed-tp reads them) of how the
// TP slices make each parameter `names` (dense, or with expert tensor parallelism an expert's
// under its global name): split (on a dimension, into sub-parameters, a padded vocabulary) or
// whole on every lane, where no rule names it as well (its lanes' copies must then be alike:
// AddLaneAtoms compares them). kUnsupported for one the ranks average.
Status ResolveMpuMaps(MoeTag& tag, const MoeStage& stage, const std::vector<std::string>& names) {
  const TorchArchiveReader& model = stage.model();
  UCP_ASSIGN_OR_RETURN(const deepspeed::Patterns patterns, deepspeed::ReadPatterns(model));
  for (const std::string& name : names) {
    const auto dense = stage.first_lane().module.find(name);
    const auto expert = stage.expert_tensors.find(name);
    const TorchTensor* tensor = dense != stage.first_lane().module.end() ? dense->second
                                : expert != stage.expert_tensors.end()   ? expert->second.tensor
                                                                         : nullptr;
    if (tensor == nullptr) {
      return FieldError(model, "module/" + name, "missing (a parameter of the optimizer's groups)");
    }
    UCP_ASSIGN_OR_RETURN(const deepspeed::Resolved resolved,
                         deepspeed::Resolve(model, patterns, name, tensor->shape, tag.tp()));
    ShardMap map;  // no rule: whole on every lane; on one, nothing tells (whole there only)
    if (resolved.map) {
      map = *resolved.map;
    } else if (tag.tp() == 1) {
      map.rule = Rule::kUnnamed;
    }
    if (map.rule == Rule::kAveraged) {
      return Status::Unsupported(Prefix(model.path()) + name +
                                 ": averaged over the TP ranks (parameter_to_average_patterns); "
                                 "with MoE not supported");
    }
    if (map.vocab && !tag.vocab) {
      UCP_ASSIGN_OR_RETURN(tag.vocab, deepspeed::ReadVocab(model, patterns, tag.tp()));
    }
    tag.autotp.maps[name] = map;
    tag.autotp.whole_shapes[name] = resolved.atom;
  }
  return Status::Ok();
}

// Phase 3 of a tag of TP lanes: how the TP slices make each dense parameter (and with expert
// tensor parallelism each expert's). A folded tag's from AutoTP's record (lane 0's affine map):
// AutoTP's whole-rank layouts (replicated, or split along one dimension, a fused parameter part
// by part), no vocabulary padding; an mpu's TP from ResolveMpuMaps. Every lane's module tensor
// outside the groups (buffers, the router's unused gate) alike on every lane (ds_to_universal and
// a reshard take lane 0's), but frozen parameters split over TP (stage.frozen_split), which the
// same record must split.
Status ResolveFoldedMaps(MoeTag& tag, MoeStage& stage) {
  std::vector<std::string> names;
  std::set<std::string> grouped;
  for (size_t g = 0; g < stage.groups; ++g) {
    if (g == stage.expert_group) continue;
    const GroupLayout& layout = stage.first_lane().dense[g];
    names.insert(names.end(), layout.names.begin(), layout.names.end());
  }
  grouped.insert(names.begin(), names.end());
  if (tag.mpu_tp) {
    std::vector<std::string> resolved = names;
    for (uint32_t e = 0; e < (tag.expert_tp() ? tag.ep : 0); ++e) {
      resolved.insert(resolved.end(), stage.global[e].names.begin(), stage.global[e].names.end());
    }
    UCP_RETURN_IF_ERROR(ResolveMpuMaps(tag, stage, resolved));
  } else {
    UCP_ASSIGN_OR_RETURN(tag.autotp, ReadAutoTpMaps(stage.model(), tag.tp(), names));
    for (const std::string& name : names) {
      const ShardMap& map = tag.autotp.maps.at(name);
      if (map.vocab || (map.rule != Rule::kSplit && map.rule != Rule::kReplicated)) {
        return Status::Unsupported(Prefix(stage.model().path()) +
                                   "universal_checkpoint_info/affine_map: " + name + " is " +
                                   (map.vocab ? "a padded vocabulary" : RuleName(map.rule)) +
                                   " over the TP ranks; AutoEP with AutoTP is read with "
                                   "whole-rank slices only");
      }
    }
  }
  // The module tensors outside the groups (buffers, the router's unused gate, frozen parameters):
  // those alike on every lane are carried with lane 0's file; those whose lanes' copies differ
  // are frozen parameters split over TP, placed by their rules.
  std::vector<std::string> differing;
  for (const auto& [name, tensor] : stage.first_lane().module) {
    if (grouped.contains(name) || tensor == nullptr) continue;
    std::vector<deepspeed::FileTensor> copies;
    for (const MoeLane& lane : stage.lanes) {
      const auto it = lane.module.find(name);
      if (it == lane.module.end() || it->second == nullptr) {
        return FieldError(*lane.model, "module/" + name,
                          "missing (" + stage.model_name() + " has it)");
      }
      if (!it->second->contiguous()) {
        return FieldError(*lane.model, "module/" + name,
                          "not contiguous (a tensor outside the optimizer's groups)");
      }
      copies.push_back({lane.model->path(), it->second});
    }
    UCP_ASSIGN_OR_RETURN(const bool alike, deepspeed::TensorsAlike(copies));
    if (!alike) differing.push_back(name);
  }
  if (differing.empty()) return Status::Ok();
  const auto refuse = [&](const std::string& name, const std::string& why) {
    return Status::Unsupported(Prefix(stage.model().path()) + "module/" + name +
                               ": not in the optimizer's groups (a frozen parameter or a buffer) "
                               "and its TP lanes' copies differ, " +
                               why + "; ucp cannot place it at another size");
  };
  if (tag.stages.size() > 1) return refuse(differing.front(), "in a pipeline");
  if (tag.mpu_tp) {
    UCP_RETURN_IF_ERROR(ResolveMpuMaps(tag, stage, differing));
  } else {
    UCP_ASSIGN_OR_RETURN(deepspeed::AutoTpMaps frozen,
                         ReadAutoTpMaps(stage.model(), tag.tp(), differing));
    tag.autotp.maps.merge(frozen.maps);
    tag.autotp.whole_shapes.merge(frozen.whole_shapes);
  }
  for (const std::string& name : differing) {
    const ShardMap& map = tag.autotp.maps.at(name);
    if (map.rule != Rule::kSplit || map.vocab) {
      return refuse(name, "and " + std::string(tag.RuleSource()) + " does not split it");
    }
  }
  stage.frozen_split = std::move(differing);
  return Status::Ok();
}

// Phase 5, per stage: its groups after the earlier stages' (experts under global names), each
// parameter's atoms and bit16 atom; `seen`: every parameter so far. Then the frozen expert
// tensors (in their experts' files alone, in no group; outside expert tensor parallelism, where
// a file holds the whole tensor): a bit16 atom each, counted in `frozen_experts` by fused
// parameter where AutoEP fuses them. A reshard carries them with their expert's file.
Status AddStageGroups(const MoeTag& tag, const MoeStage& stage, std::set<std::string>& seen,
                      AtomIndexContents& c, nlohmann::json& tp_params,
                      std::map<std::string, uint32_t>& frozen_experts) {
  const OptimStates& first = stage.ranks.front();
  for (size_t g = 0; g < stage.groups; ++g) {
    ParamGroup group =
        GroupSettings(first.groups[g].param_group, first.reader, first.groups[g].states);
    const bool experts_group = g == stage.expert_group;
    if (tag.folded && !experts_group) {
      UCP_RETURN_IF_ERROR(AddLaneAtoms(
          tag, stage, g, [&](uint32_t t) { return DenseSlices(tag, stage, g, t); }, seen, group, c,
          tp_params));
      c.groups.push_back(std::move(group));
      continue;
    }
    if (experts_group && tag.expert_tp()) {
      for (uint32_t e = 0; e < tag.ep; ++e) {
        UCP_RETURN_IF_ERROR(AddLaneAtoms(
            tag, stage, g, [&](uint32_t t) { return ExpertSlices(tag, stage, e, t); }, seen, group,
            c, tp_params));
      }
      c.groups.push_back(std::move(group));
      continue;
    }
    for (uint32_t e = 0; e < (experts_group ? tag.ep : 1); ++e) {
      const GroupLayout& layout = experts_group ? stage.global[e] : stage.first_lane().dense[g];
      const Partitioning& p = experts_group ? stage.expert_p : stage.first_lane().dense_p[g];
      std::vector<RankPartition> partitions;
      for (uint32_t i = 0; i < p.ranks; ++i) {
        const uint32_t r = experts_group ? tag.ExpertMember(e, i, 0) : i;
        const OptimStates& os = stage.ranks[r];
        partitions.push_back({os.groups[g].fp32, &os.groups[g].states, stage.optim_file + r});
      }
      for (size_t k = 0; k < layout.names.size(); ++k) {
        const std::string& name = layout.names[k];
        if (!seen.insert(name).second) {
          return FieldError(
              first.reader,
              std::string(kOsd) + "/param_slice_mappings/" + std::to_string(g) + "/" + name,
              "a parameter of two groups");
        }
        group.params.push_back(name);
        UCP_RETURN_IF_ERROR(AddParameterAtoms(c.atoms, layout, k, p, partitions));
        const TorchTensor* bit16 = nullptr;
        uint32_t file = stage.first_lane().model_file;
        if (experts_group) {
          bit16 = stage.expert_tensors.at(name).tensor;
          file = stage.expert_tensors.at(name).file;
        } else {
          bit16 = stage.first_lane().module.at(name);
        }
        if (!bit16->contiguous()) {
          return Status::Corrupt(Prefix(tag.dir + "/" + tag.paths[file]) + name +
                                 ": not contiguous");
        }
        UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(bit16->shape));
        c.atoms.push_back({name,
                           "bit16",
                           bit16->dtype,
                           bit16->shape,
                           {{file, bit16->file_offset(), bit16->dtype, whole}}});
      }
    }
    c.groups.push_back(std::move(group));
  }
  UCP_RETURN_IF_ERROR(AddFrozenSplitAtoms(tag, stage, seen, c, tp_params));
  if (tag.expert_tp()) return Status::Ok();
  for (const auto& [name, expert] : stage.expert_tensors) {
    if (!seen.insert(name).second) continue;
    const TorchTensor& tensor = *expert.tensor;
    if (!tensor.contiguous()) {
      return Status::Corrupt(Prefix(tag.dir + "/" + tag.paths[expert.file]) + name +
                             ": not contiguous");
    }
    UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(tensor.shape));
    c.atoms.push_back({name,
                       "bit16",
                       tensor.dtype,
                       tensor.shape,
                       {{expert.file, tensor.file_offset(), tensor.dtype, whole}}});
    if (tag.fused) ++frozen_experts[name.substr(0, name.rfind('.'))];
  }
  return Status::Ok();
}

// Phase 5, per stage: the templates a target's files are made from (its model states, its rank
// 0's optimizer file) and the objects rewritten in them.
void AddStageCarried(const MoeTag& tag, const MoeStage& stage, AtomIndexContents& c) {
  const OptimStates& first = stage.ranks.front();
  std::vector<std::string> rewritten_optim;
  for (size_t g = 0; g < stage.groups; ++g) {
    for (const StateTensor& st : first.groups[g].states) {
      if (!st.tensor->shape.empty()) {
        rewritten_optim.push_back(deepspeed::GroupStatesField(false, g) + "/" + st.key);
      }
    }
  }
  for (std::string& field : RewrittenPartitionFields(first.reader)) {
    rewritten_optim.push_back(std::move(field));
  }
  std::vector<std::string> rewritten_model = {"dp_world_size"};
  if (tag.fused) {
    rewritten_model.insert(rewritten_model.end(),
                           {std::string(kAutoEpLayers), "ds_config/expert_parallel/autoep_size"});
  }
  c.carried.push_back(
      {std::string(kModelRole), stage.first_lane().model_file, std::move(rewritten_model)});
  c.carried.push_back({std::string(kOptimRole), stage.optim_file, std::move(rewritten_optim)});
}

// Phase 5: the index: files, groups and atoms, carried objects, stage after stage.
Result<AtomIndex> MakeIndex(const MoeTag& tag, const IndexOptions& options) {
  const OptimStates& first = tag.stages.front().ranks.front();
  const uint32_t pp = static_cast<uint32_t>(tag.stages.size());
  AtomIndexContents c;
  c.framework = "deepspeed";
  c.framework_version = first.ds_version;
  c.adapter = std::string(DeepSpeedMoeAdapter::kName);
  c.adapter_schema = DeepSpeedMoeAdapter::kSchema;
  c.tag = TagName(tag.dir);
  const int64_t zero_stage = first.zero_stage.value_or(1);
  c.topology = {tag.dp, tag.tp(), pp, tag.world() * pp, static_cast<uint32_t>(zero_stage)};
  UCP_ASSIGN_OR_RETURN(const std::vector<FileDigest> digests,
                       HashTagFiles(tag.dir, tag.paths, {options.threads, options.trust_journal}));
  std::set<std::string> seen;
  nlohmann::json stages = nlohmann::json::array();
  nlohmann::json tp_params = nlohmann::json::object();
  std::map<std::string, uint32_t> frozen_experts;
  for (const MoeStage& stage : tag.stages) {
    AddStageFiles(tag, stage, digests, c);
    UCP_RETURN_IF_ERROR(AddStageGroups(tag, stage, seen, c, tp_params, frozen_experts));
    AddStageCarried(tag, stage, c);
    stages.push_back({{"model_file", stage.first_lane().model_file},
                      {"optim_file", stage.optim_file},
                      {"groups", stage.groups},
                      {"expert_group", stage.expert_group},
                      {"num_experts", stage.experts.num_experts}});
  }
  c.adapter_state = {
      {"optimizer", first.bf16_optimizer ? "BF16_Optimizer" : "DeepSpeedZeroOptimizer"},
      {"file_prefix", tag.prefix},
      {"zero_stage", zero_stage},
      {"expert_parallel", tag.ep},
  };
  // A pipeline's stages each list their groups (consecutive in the index) and files; at pp = 1
  // the tag's one stage is the state itself, as before pipelines were read.
  if (pp == 1) {
    c.adapter_state["expert_group"] = tag.stages.front().expert_group;
    c.adapter_state["num_experts"] = tag.stages.front().experts.num_experts;
  } else {
    c.adapter_state["stages"] = std::move(stages);
  }
  if (tag.fused) c.adapter_state["fused_experts"] = true;
  if (!frozen_experts.empty()) c.adapter_state["frozen_experts"] = std::move(frozen_experts);
  if (tag.folded) {
    nlohmann::json& lanes = c.adapter_state["folded_tp"];
    lanes = {{"degree", tag.tp()}, {"params", tp_params}};
    if (tag.mpu_tp) lanes["mpu"] = true;
    if (tag.expert_tp()) lanes["expert_tp"] = true;
    if (tag.vocab) {
      lanes["vocab"] = {{"original", tag.vocab->original},
                        {"padded", tag.vocab->padded},
                        {"divisible_by", tag.vocab->divisible_by}};
    }
  }
  if (tag.order.data_before_expert) c.adapter_state["data_before_expert"] = true;
  return AtomIndex::Create(std::move(c), Prefix(tag.dir) + "index");
}

// zero/<fused>/<state>.pt of ds_to_universal for an AutoEP tag: the fused parameter whole, its
// experts' rows one after another, as {'param': tensor, 'cat_dim': 0, 'is_expert_param': True,
// 'ep_num_experts': E} (DeepSpeed's autoep_universal.py). `module_copy`: state "bit16" of a
// frozen fused parameter, written as zero/<fused>/fp32.pt, float32 (bfloat16 widened), as
// ds_to_universal writes a module tensor outside the optimizer's groups.
Result<ArchiveOutput> FusedExpertArchive(const AtomIndex& index, const std::string& fused,
                                         const std::string& state, uint32_t experts,
                                         bool requires_grad, bool module_copy = false) {
  ArchiveOutput out;
  out.path = "zero/" + fused + "/" + (module_copy ? "fp32" : state) + ".pt";
  const Atom* first = index.Find(fused + ".0", state);
  if (first == nullptr) {
    return Status::Corrupt("deepspeed: index: " + fused + ".0 " + state + ": missing");
  }
  const DType dtype = first->dtype;
  Shape whole = {experts};
  whole.insert(whole.end(), first->shape.begin(), first->shape.end());
  std::vector<Segment> segments;
  for (uint32_t g = 0; g < experts; ++g) {
    const Atom* atom = index.Find(fused + "." + std::to_string(g), state);
    if (atom == nullptr || atom->shape != first->shape || atom->dtype != dtype) {
      return Status::Corrupt("deepspeed: index: " + fused + "." + std::to_string(g) + " " + state +
                             ": missing, or unlike expert 0's");
    }
    std::vector<Segment> rows;
    if (module_copy) {
      UCP_ASSIGN_OR_RETURN(rows, Float32Segments(index, *atom));
    } else {
      UCP_ASSIGN_OR_RETURN(const Region region, Region::Whole(atom->shape));
      UCP_ASSIGN_OR_RETURN(rows, PlanRegion(index, *atom, region));
    }
    AppendSegments(segments, rows);
  }
  TensorNodeSpec spec;
  spec.storage_key = "0";
  spec.dtype = module_copy ? DType::kFloat32 : dtype;
  UCP_ASSIGN_OR_RETURN(spec.storage_numel, NumElements(whole));
  spec.shape = whole;
  spec.requires_grad = requires_grad;
  UCP_ASSIGN_OR_RETURN(Value * tensor, MakeTensorNode(out.graph, spec));
  SetExpertParamRoot(out.graph, tensor, experts);
  out.storages.push_back({"0", std::move(segments)});
  return out;
}

// TP rank t's geometry and slice shape, at degree tp, of each parameter `maps` names (at tp 1
// every one whole).
struct SliceShapes {
  std::map<std::string, Geometry> geometries;
  std::map<std::string, Shape> local;
};

Result<SliceShapes> SliceShapesAt(const AtomIndex& index,
                                  const std::map<std::string, ShardMap>& maps,
                                  const std::optional<Vocab>& vocab, uint32_t tp, uint32_t t) {
  SliceShapes at;
  for (const auto& [name, map] : maps) {
    const Atom* atom = index.Find(name, "bit16");
    if (atom == nullptr) return Status::Corrupt("deepspeed: index: no bit16 atom of " + name);
    // At tp 1 no parameter is split: the blocks are the source's, of another degree.
    UCP_ASSIGN_OR_RETURN(at.geometries[name],
                         GeometryAt(name, map, atom->shape, tp, vocab,
                                    tp == 1 ? std::vector<uint64_t>{} : map.blocks));
    at.local[name] = LocalShape(at.geometries[name], t);
  }
  return at;
}

// Each tensor of `dict` (field `field` of `reader`, imported into `graph`) that `maps` splits
// replaced by TP rank t's slice of its bit16 atom (`at`: rank t's), in a storage of its own as
// DeepSpeed saves a TP slice; a replicated one's is kept. Appends the new storages' bytes to
// `replaced`.
Status SliceTensors(const AtomIndex& index, const std::map<std::string, ShardMap>& maps,
                    const SliceShapes& at, uint32_t t, Value* dict, const std::string& field,
                    const TorchArchiveReader& reader, pickle::Graph& graph,
                    std::map<std::string, std::vector<Segment>>& replaced) {
  const auto slice = [&](const Value* key, Value*& value) -> Status {
    const std::string name = KeyText(key);
    const auto map = maps.find(name);
    if (map == maps.end() || map->second.rule != Rule::kSplit) return Status::Ok();
    Result<const Value*> node = reader.Find(field + name);
    const TorchTensor* tensor = node.ok() ? reader.TensorAt(*node) : nullptr;
    if (tensor == nullptr) return FieldError(reader, field + name, "not a tensor");
    if (tensor->storage_offset != 0 || tensor->storage->numel != tensor->numel()) {
      return FieldError(reader, field + name,
                        "a TP slice sharing its storage with other tensors; DeepSpeed saves each "
                        "in its own");
    }
    const Shape& local = at.local.at(name);
    TensorNodeSpec spec;
    spec.storage_key = tensor->storage->key;
    spec.dtype = tensor->dtype;
    spec.location = tensor->storage->location;
    UCP_ASSIGN_OR_RETURN(spec.storage_numel, NumElements(local));
    spec.shape = local;
    spec.requires_grad = tensor->requires_grad;
    spec.parameter = tensor->parameter;
    UCP_ASSIGN_OR_RETURN(value, MakeTensorNode(graph, spec));
    return AppendSliceSegments(index, *index.Find(name, "bit16"), map->second,
                               at.geometries.at(name), t, 0, spec.storage_numel,
                               replaced[spec.storage_key]);
  };
  // A dict (an expert file's) or an OrderedDict (the model states' module).
  if (dict->kind() == Kind::kDict) {
    for (auto& [key, value] : dict->mutable_entries()) UCP_RETURN_IF_ERROR(slice(key, value));
    return Status::Ok();
  }
  for (pickle::Mutation& mutation : dict->mutable_mutations()) {
    if (mutation.op == pickle::Mutation::Op::kSetItem) {
      UCP_RETURN_IF_ERROR(slice(mutation.first, mutation.second));
    }
  }
  return Status::Ok();
}

// A folded tag's lane-0 model states (imported into `graph` as its root from `reader`) with the
// dense parameters at TP rank t (`at`: its SliceShapesAt of `maps`; at tp 1 every parameter
// whole): each split parameter's module tensor its slice (SliceTensors), and each dense
// param_shapes entry the slice's shape. Returns the replaced storages' bytes.
Result<std::map<std::string, std::vector<Segment>>> SliceDenseModule(
    const AtomIndex& index, const std::map<std::string, ShardMap>& maps, const SliceShapes& at,
    uint32_t t, const TorchArchiveReader& reader, pickle::Graph& graph) {
  Value* root = graph.root();
  // The dense group's param_shapes (the first: the expert group comes after it).
  Value* shapes = root->Get("param_shapes");
  Value* dense_shapes = shapes == nullptr ? nullptr : shapes->Item(0);
  Value* module = root->Get("module");
  if (dense_shapes == nullptr || dense_shapes->kind() != Kind::kObject || module == nullptr ||
      module->kind() != Kind::kObject) {
    return FieldError(reader, "param_shapes/0 or module", "not an OrderedDict");
  }
  for (pickle::Mutation& mutation : dense_shapes->mutable_mutations()) {
    if (mutation.op != pickle::Mutation::Op::kSetItem) continue;
    const auto shape = at.local.find(KeyText(mutation.first));
    if (shape != at.local.end())
      mutation.second = ShapeNodeLike(graph, mutation.second, shape->second);
  }
  std::map<std::string, std::vector<Segment>> replaced;
  UCP_RETURN_IF_ERROR(SliceTensors(index, maps, at, t, module, "module/", reader, graph, replaced));
  return replaced;
}

// A folded tag's lane-0 model states (imported into `graph` as its root) as a run at tp 1 over
// the same ranks writes them, the AutoEP save ds_to_universal converts: every dense parameter's
// module tensor whole (its bit16 atom, in a storage of its own as AutoEP saves them) and its
// param_shapes entry the whole shape; dp_world_size every rank, mp_world_size and tp_degree 1; no
// folding dict, no ds_config tensor_parallel section, and of universal_checkpoint_info only what
// AutoEP records at tp 1 (its version, expert patterns and layers: AutoTP records nothing there).
// Returns the replaced storages' bytes.
Result<std::map<std::string, std::vector<Segment>>> UnfoldModelStates(
    const AtomIndex& index, const IndexFacts& facts, const TorchArchiveReader& reader,
    pickle::Graph& graph) {
  Value* root = graph.root();
  UCP_RETURN_IF_ERROR(deepspeed::UnfoldAutoTp(graph, root, reader));
  UCP_RETURN_IF_ERROR(SetDictItem(root, "dp_world_size",
                                  graph.Int(int64_t{facts.dp} * facts.folded_tp), reader.path()));
  UCP_ASSIGN_OR_RETURN(const SliceShapes whole,
                       SliceShapesAt(index, facts.folded_maps, std::nullopt, 1, 0));
  return SliceDenseModule(index, facts.folded_maps, whole, 0, reader, graph);
}

// mp_rank_00_model_states.pt as ds_to_universal writes it for an AutoEP tag: the model states
// loaded and saved again with universal_checkpoint_info's expert_parameter_patterns its own
// pattern and its ds_autoep_layers DeepSpeedCheckpoint's digest of each layer (the fields
// AUTOEP_METADATA_FIELDS lists that the layer has, in that order).
Result<ArchiveOutput> UniversalAutoEpModelStates(const AtomIndex& index, const IndexFacts& facts,
                                                 const TorchArchiveReader& reader) {
  static constexpr std::string_view kDigestFields[] = {"moe_layer_id",      "module_path",
                                                       "expert_key_prefix", "num_experts",
                                                       "num_local_experts", "ep_size"};
  ArchiveOutput out;
  out.path = ModelStatesName(0);
  pickle::Graph& graph = out.graph;
  Value* root = graph.Import(reader.root());
  graph.set_root(root);
  std::map<std::string, std::vector<Segment>> replaced;
  if (facts.folded_tp > 1) {
    UCP_ASSIGN_OR_RETURN(replaced, UnfoldModelStates(index, facts, reader, graph));
  }
  Value* info = root->Get(deepspeed::kUniversalCheckpointInfo);
  const Value* layers = root->Get(kAutoEpLayers);
  if (info == nullptr || info->kind() != Kind::kDict || layers == nullptr ||
      layers->kind() != Kind::kList) {
    return FieldError(reader, deepspeed::kUniversalCheckpointInfo,
                      "missing, or no ds_autoep_layers list beside it");
  }
  // DeepSpeed builds the digest from another load of the file: its keys are one set of objects
  // for every layer (the constants' strings), its values objects of their own.
  std::vector<Value*> keys;
  for (const std::string_view field : kDigestFields) keys.push_back(graph.Str(std::string(field)));
  std::vector<Value*> digests;
  for (const Value* layer : layers->items()) {
    std::vector<std::pair<Value*, Value*>> entries;
    for (size_t f = 0; f < keys.size(); ++f) {
      const Value* value = layer->Get(kDigestFields[f]);
      if (value == nullptr) continue;
      if (value->kind() == Kind::kStr) {
        entries.emplace_back(keys[f], graph.Str(value->data()));
      } else if (value->kind() == Kind::kInt && value->AsInt64()) {
        entries.emplace_back(keys[f], graph.Int(*value->AsInt64()));
      } else {
        return FieldError(reader, std::string(kAutoEpLayers) + "/" + std::string(kDigestFields[f]),
                          "not a str or an int");
      }
    }
    digests.push_back(graph.Dict(std::move(entries)));
  }
  UCP_RETURN_IF_ERROR(SetDictItem(info, "expert_parameter_patterns",
                                  graph.List({graph.Str("\\.experts\\.w[123]$")}), reader.path()));
  UCP_RETURN_IF_ERROR(
      SetDictItem(info, std::string(kAutoEpLayers), graph.List(std::move(digests)), reader.path()));
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, reader, facts.model_file, std::move(replaced)));
  return out;
}

// An AutoEP tag as DeepSpeed 0.19's ds_to_universal converts it (ZeRO-1/2): every dense
// parameter's states as for deepspeed-zero12, each fused expert parameter whole
// (FusedExpertArchive) with its group's step, every module tensor outside the groups as its fp32
// copy (AddUniversalModuleTensors), zero/optimizer_state.pt, and the model states as saved
// (DeepSpeed loads and saves them again, UniversalAutoEpModelStates).
Result<OutputPlan> PlanAutoEpUniversalExport(const AtomIndex& index, const std::string& tag_dir,
                                             const IndexFacts& facts) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  UCP_ASSIGN_OR_RETURN(const ExpertLayouts experts, ExpertLayoutsAt(facts, facts.ep));
  const std::string osd(kOsd);
  std::map<std::string, bool> requires_grad;  // "<param>/<state>"; experts by fused name
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    UCP_RETURN_IF_ERROR(CollectGroupRequiresGrad(
        reader, g, g == facts.expert_group ? experts.local.names : facts.groups[g].names,
        requires_grad));
  }
  const GroupLayout& expert_rows = facts.groups[facts.expert_group];
  const std::set<std::string> rows(expert_rows.names.begin(), expert_rows.names.end());
  std::set<std::string> grouped;  // every parameter of a group
  OutputPlan plan;
  for (const Atom& atom : index.atoms()) {
    grouped.insert(atom.param);
    if (atom.state == "bit16" || rows.contains(atom.param)) continue;
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        UniversalAtomArchive(index, atom, atom.shape, requires_grad[atom.param + "/" + atom.state],
                             !atom.shape.empty()));
    plan.archives.push_back(std::move(out));
  }
  for (size_t k = 0; k < experts.local.names.size(); ++k) {
    const std::string& fused = experts.local.names[k];
    const uint32_t count = static_cast<uint32_t>(experts.local.shapes[k].front()) * facts.ep;
    const std::string first = fused + ".0";
    for (const Atom& atom : index.atoms()) {
      if (atom.param != first || atom.state == "bit16") continue;
      if (atom.shape.empty()) {  // step.pt: the bare 0-d tensor, the group's
        UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                             UniversalAtomArchive(index, atom, atom.shape,
                                                  requires_grad[fused + "/" + atom.state], false));
        out.path = "zero/" + fused + "/" + atom.state + ".pt";
        plan.archives.push_back(std::move(out));
        continue;
      }
      UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                           FusedExpertArchive(index, fused, atom.state, count,
                                              requires_grad[fused + "/" + atom.state]));
      plan.archives.push_back(std::move(out));
    }
  }
  for (const auto& [fused, count] : facts.frozen_experts) {
    UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                         FusedExpertArchive(index, fused, "bit16", count, /*requires_grad=*/false,
                                            /*module_copy=*/true));
    plan.archives.push_back(std::move(out));
  }
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model,
                       OpenSource(index, tag_dir, facts.model_file));
  UCP_RETURN_IF_ERROR(AddUniversalModuleTensors(model, facts.model_file, grouped,
                                                index.contents().framework_version, plan));
  // DeepSpeed's merged rank-0 state gives every group its DP size (ZeROCheckpoint's
  // _update_partition_count), the expert group too.
  UCP_ASSIGN_OR_RETURN(ArchiveOutput optimizer, UniversalOptimizerState(reader, facts.optim_file));
  std::vector<Value*> counts;
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    counts.push_back(optimizer.graph.Int(int64_t{facts.dp} * facts.folded_tp));
  }
  UCP_RETURN_IF_ERROR(SetDictItem(optimizer.graph.root(), "partition_count",
                                  optimizer.graph.List(std::move(counts)), reader.path()));
  plan.archives.push_back(std::move(optimizer));
  UCP_ASSIGN_OR_RETURN(ArchiveOutput states, UniversalAutoEpModelStates(index, facts, model));
  plan.archives.push_back(std::move(states));
  return plan;
}

// ---------------------------------------------------------------------------------------------
// PlanReshard's phases.

// The target's expert-parallel size (its own, or the tag's where it names none), once the
// target is one DeepSpeed can train the tag at.
Result<uint32_t> CheckMoeTarget(const AtomIndex& index, const IndexFacts& facts,
                                const Topology& target) {
  if (target.tp > 1 && facts.fused) {
    return Status::Unsupported("deepspeed: tp=" + std::to_string(target.tp) +
                               ": an AutoEP tag saved at tp 1 records no AutoTP split (DeepSpeed "
                               "writes no affine map there), so it is not folded over AutoTP");
  }
  if (target.tp > 1) {
    return Status::Unsupported("deepspeed: tp=" + std::to_string(target.tp) +
                               ": the MoE tag records no tensor-parallel rules (Megatron's "
                               "universal_checkpoint_info) to split its parameters by");
  }
  if (target.pp == 0 || target.world % target.pp != 0) {
    return Status::InvalidArgument("deepspeed: world=" + std::to_string(target.world) +
                                   " is not a multiple of pp=" + std::to_string(target.pp));
  }
  // Each stage is resharded as a tag of its own, over the stage's ranks.
  UCP_RETURN_IF_ERROR(CheckTarget(
      {target.dp, target.tp, 1, target.world / target.pp, target.zero_stage, target.ep}));
  const uint32_t ep = target.ep != 0 ? target.ep : facts.ep;
  if (target.dp % ep != 0) {
    return Status::InvalidArgument("deepspeed: dp=" + std::to_string(target.dp) +
                                   " is not a multiple of the expert-parallel size " +
                                   std::to_string(ep) + (target.ep != 0 ? "" : " (the tag's)") +
                                   ": DeepSpeed requires it");
  }
  if (ep != facts.ep) UCP_RETURN_IF_ERROR(RefuseOldExpertGradientScale(index, ep, facts.ep));
  return ep;
}

// The groups at the target: the experts' layouts at its expert-parallel size, every group's
// partitioning (the expert group's over the dp/ep ranks of an expert's data-parallel group).
struct MoeLayout {
  ExpertRankOrder order;  // the target's dp, ep and rank order
  ExpertLayouts experts;
  std::vector<Partitioning> partitions;
  std::vector<uint64_t> partition_counts;
};

Result<MoeLayout> LayoutAtTarget(const IndexFacts& facts, uint32_t dp, uint32_t ep) {
  MoeLayout at;
  at.order = {dp, ep, facts.data_before_expert};
  UCP_ASSIGN_OR_RETURN(at.experts, ExpertLayoutsAt(facts, ep));
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    const bool experts = g == facts.expert_group;
    const uint64_t total = experts ? at.experts.local.total : facts.groups[g].total;
    const uint32_t count = experts ? dp / ep : dp;
    UCP_ASSIGN_OR_RETURN(const Partitioning p, SavablePartition(total, count, "a group"));
    at.partitions.push_back(p);
    at.partition_counts.push_back(count);
  }
  return at;
}

// A pipeline's stages as one stage of all its layers (at pp = 1 the target's), as DeepSpeed lays
// that out: a stage holds a consecutive run of layers, and each of its groups holds them in module
// order, so every group is the stages' groups one after another, and so are the MoE layers (each
// stage's expert files renumbered after the earlier stages' layers). The templates are stage 0's.
// kUnsupported where the stages' groups differ in number, expert group or hyperparameters (one
// optimizer file cannot hold both) and for expp_rank files; `pp`, the target's, names it.
Result<IndexFacts> MergeStages(const AtomIndex& index, const std::vector<IndexFacts>& stages,
                               uint32_t pp) {
  const std::vector<ParamGroup>& indexed = index.contents().groups;
  IndexFacts merged = stages.front();
  std::vector<std::vector<std::string>> names(merged.groups.size());
  std::vector<std::vector<Shape>> shapes(merged.groups.size());
  std::vector<std::string> local_names;
  std::vector<Shape> local_shapes;
  merged.num_experts.clear();
  merged.expert_files.clear();
  merged.expert_names.clear();
  size_t first_group = 0;  // the stage's first group in the index
  for (const IndexFacts& stage : stages) {
    const std::string what =
        "deepspeed: pp=" + std::to_string(pp) + ": stage " + std::to_string(stage.mp) + " ";
    if (stage.groups.size() != merged.groups.size() || stage.expert_group != merged.expert_group) {
      return Status::Unsupported(what + "has other parameter groups than stage 0");
    }
    if (!stage.expp_files.empty()) {
      return Status::Unsupported(what + "has expp_rank files, which are not merged");
    }
    for (size_t g = 0; g < stage.groups.size(); ++g) {
      if (indexed[first_group + g].hyperparameters != indexed[g].hyperparameters) {
        return Status::Unsupported(what + "group " + std::to_string(g) +
                                   ": other hyperparameters than stage 0's (one optimizer file "
                                   "cannot hold both)");
      }
      names[g].insert(names[g].end(), stage.groups[g].names.begin(), stage.groups[g].names.end());
      shapes[g].insert(shapes[g].end(), stage.groups[g].shapes.begin(),
                       stage.groups[g].shapes.end());
    }
    first_group += stage.groups.size();
    local_names.insert(local_names.end(), stage.local.names.begin(), stage.local.names.end());
    local_shapes.insert(local_shapes.end(), stage.local.shapes.begin(), stage.local.shapes.end());
    const uint32_t layers_before = static_cast<uint32_t>(merged.num_experts.size());
    merged.num_experts.insert(merged.num_experts.end(), stage.num_experts.begin(),
                              stage.num_experts.end());
    for (const uint32_t file : stage.expert_files) {
      const std::string& path = index.contents().files[file].path;
      const std::optional<deepspeed::FileName> parsed = ParseFileName(path);
      if (!parsed || parsed->kind != FileKind::kExpertModelStates) {
        return Status::Corrupt("deepspeed: index: " + path + ": not an expert file's name");
      }
      merged.expert_files.push_back(file);
      merged.expert_names.push_back(
          ExpertModelStatesName(layers_before + parsed->layer, parsed->expert, 0));
    }
  }
  merged.mp = 0;
  for (size_t g = 0; g < merged.groups.size(); ++g) {
    UCP_ASSIGN_OR_RETURN(merged.groups[g], MakeLayout(std::move(names[g]), std::move(shapes[g])));
  }
  UCP_ASSIGN_OR_RETURN(merged.local, MakeLayout(std::move(local_names), std::move(local_shapes)));
  return merged;
}

// A pipeline's layers as PipelineModule's partition methods weigh them, from the saved stages:
// each layer with trainable parameters, numbered by its parameters' names.
struct MoePipelineLayers {
  uint64_t count = 0;                         // the last such layer's number plus one
  std::map<uint64_t, uint32_t> source_stage;  // each layer's stage at the source
  std::map<uint64_t, uint64_t> dense;         // its elements outside experts
  std::map<uint64_t, uint64_t> per_expert;    // an MoE layer's: one expert's elements
  std::vector<uint64_t> moe_layers;           // each MoE layer's (num_experts' order) number
  std::map<uint64_t, std::string> signature;  // its parameter names and shapes (one EP rank's)
};

// The layer a pipeline parameter's name numbers; kUnsupported for any other name (at pp > 1 a
// PipelineModule's stages hold numbered layers; the target's placement of others is unknown).
Result<uint64_t> LayerOf(const std::string& name, uint32_t pp) {
  const std::optional<uint32_t> layer = NumberedLayer(name);
  if (!layer) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": " + name +
                               " names no numbered layer: the tag's model is no PipelineModule, "
                               "so the layers each stage would hold at pp=" +
                               std::to_string(pp) + " are unknown");
  }
  return *layer;
}

// `lane0`: TP lane 0's slice of each parameter it names (a stage of TP lanes builds its layers of
// those, so the 'parameters' method counts them); the others whole.
Result<MoePipelineLayers> ReadPipelineLayers(const std::vector<IndexFacts>& stages, uint32_t pp,
                                             const std::map<std::string, Shape>& lane0) {
  MoePipelineLayers out;
  for (const IndexFacts& stage : stages) {
    std::vector<uint64_t> moe_layers;  // the stage's
    for (size_t g = 0; g < stage.groups.size(); ++g) {
      const GroupLayout& layout = g == stage.expert_group ? stage.local : stage.groups[g];
      for (size_t i = 0; i < layout.names.size(); ++i) {
        UCP_ASSIGN_OR_RETURN(const uint64_t layer, LayerOf(layout.names[i], pp));
        const auto slice = lane0.find(layout.names[i]);
        UCP_ASSIGN_OR_RETURN(const uint64_t numel,
                             NumElements(slice != lane0.end() ? slice->second : layout.shapes[i]));
        out.source_stage[layer] = stage.mp;
        out.count = std::max(out.count, layer + 1);
        const std::string& name = layout.names[i];
        out.signature[layer] += name.substr(name.find('.')) + ShapeText(layout.shapes[i]) + ";";
        if (g != stage.expert_group) {
          out.dense[layer] += numel;
          continue;
        }
        if (moe_layers.empty() || moe_layers.back() != layer) moe_layers.push_back(layer);
        out.per_expert[layer] += numel;
      }
    }
    if (moe_layers.size() != stage.num_experts.size()) {
      return Status::Corrupt("deepspeed: index: stage " + std::to_string(stage.mp) +
                             ": the expert group holds " + std::to_string(moe_layers.size()) +
                             " MoE layers, num_experts " +
                             std::to_string(stage.num_experts.size()));
    }
    // The expert group holds one EP rank's num_experts / E experts per layer.
    for (size_t k = 0; k < moe_layers.size(); ++k) {
      out.per_expert[moe_layers[k]] /= stage.num_experts[k] / stage.ep;
    }
    out.moe_layers.insert(out.moe_layers.end(), moe_layers.begin(), moe_layers.end());
  }
  return out;
}

// Each layer's trainable elements as PipelineModule's 'parameters' method counts them at
// expert-parallel size `ep`: it builds every layer, an MoE layer with num_experts / ep local
// experts.
std::vector<uint64_t> LayerWeights(const MoePipelineLayers& layers,
                                   const std::vector<uint32_t>& num_experts, uint32_t ep) {
  std::vector<uint64_t> weights(layers.count, 0);
  for (const auto& [layer, numel] : layers.dense) weights[layer] = numel;
  for (size_t k = 0; k < layers.moe_layers.size(); ++k) {
    const uint64_t layer = layers.moe_layers[k];
    weights[layer] += num_experts[k] / ep * layers.per_expert.at(layer);
  }
  return weights;
}

// The merged stage's names and shapes in `layout` whose layer is in [first, end).
Result<GroupLayout> LayoutOfLayers(const GroupLayout& layout, uint64_t first, uint64_t end) {
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (size_t i = 0; i < layout.names.size(); ++i) {
    const std::optional<uint32_t> layer = NumberedLayer(layout.names[i]);
    if (layer && *layer >= first && *layer < end) {
      names.push_back(layout.names[i]);
      shapes.push_back(layout.shapes[i]);
    }
  }
  return MakeLayout(std::move(names), std::move(shapes));
}

// Target stage t of `pp` (its layers [bounds[t], bounds[t+1]) of `chosen`) cut from the merged
// stage: its groups' and local experts' parameters, its MoE layers' num_experts and expert files
// renumbered from 0. kUnsupported for a stage without parameters or without an MoE layer.
Result<IndexFacts> SplitStage(const IndexFacts& merged, const MoePipelineLayers& layers,
                              const ChosenPartition& chosen, uint32_t t, uint32_t pp) {
  IndexFacts facts = merged;
  facts.mp = t;
  facts.target_stages = pp;
  facts.first_layer = chosen.bounds[t];
  facts.end_layer = t + 1 == pp ? std::numeric_limits<uint64_t>::max() : chosen.bounds[t + 1];
  bool any = false;
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    UCP_ASSIGN_OR_RETURN(facts.groups[g],
                         LayoutOfLayers(merged.groups[g], facts.first_layer, facts.end_layer));
    any = any || !facts.groups[g].names.empty();
  }
  if (!any) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": stage " +
                               std::to_string(t) + " holds no parameter by the " + chosen.method +
                               " placement " + BoundsText(chosen.bounds) +
                               " (DeepSpeed's optimizer cannot save it)");
  }
  UCP_ASSIGN_OR_RETURN(facts.local,
                       LayoutOfLayers(merged.local, facts.first_layer, facts.end_layer));
  facts.num_experts.clear();
  facts.expert_files.clear();
  facts.expert_names.clear();
  std::optional<uint32_t> first_moe;  // the stage's first MoE layer in the merged numbering
  for (uint32_t k = 0; k < layers.moe_layers.size(); ++k) {
    if (layers.moe_layers[k] < facts.first_layer || layers.moe_layers[k] >= facts.end_layer) {
      continue;
    }
    if (!first_moe) first_moe = k;
    facts.num_experts.push_back(merged.num_experts[k]);
  }
  // DeepSpeed 0.19.8 sets up an MoE pipeline only where every stage holds an MoE layer: with
  // train_moe_pipe.py at pp=4 'uniform' (the head alone on the last stage) every rank waited
  // at engine set-up until killed.
  if (facts.num_experts.empty()) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": stage " +
                               std::to_string(t) + " holds no MoE layer by the " + chosen.method +
                               " placement " + BoundsText(chosen.bounds) +
                               " (DeepSpeed does not set up an MoE pipeline with such a stage)");
  }
  for (size_t i = 0; i < merged.expert_files.size(); ++i) {
    const std::optional<deepspeed::FileName> parsed = ParseFileName(merged.expert_names[i]);
    if (!parsed) {
      return Status::Internal("deepspeed: merged expert file name " + merged.expert_names[i] +
                              " does not parse");
    }
    if (parsed->layer < *first_moe || parsed->layer >= *first_moe + facts.num_experts.size()) {
      continue;
    }
    facts.expert_files.push_back(merged.expert_files[i]);
    facts.expert_names.push_back(
        ExpertModelStatesName(parsed->layer - *first_moe, parsed->expert, t));
  }
  return facts;
}

// TP lane 0's slice shapes (SliceShapesAt's `local`) at the saved and the target TP degree, for
// the 'parameters' method's weights; empty maps: every parameter whole.
struct LaneZeroShapes {
  std::map<std::string, Shape> saved;
  std::map<std::string, Shape> target;
};

// A pipeline's stages at another pp (the tag's own pp keeps them): merged (MergeStages), then,
// at pp > 1, split at the boundaries of the partition method that reproduces the saved stages
// (ChoosePartition: 'uniform', 'parameters' with every MoE layer's local experts at the source's
// and the target's E and each parameter as `lane0` slices it there, 'type:'; only `partition`'s
// where the user names one). Each target stage keeps its layers' parameters in the merged order,
// and its MoE layers' expert files renumbered from 0 (its model states: RestageModelStates).
// kUnsupported for AutoEP, a model that is no PipelineModule of numbered layers, an ambiguous or
// unknown placement and a stage left without parameters or without an MoE layer.
Result<std::vector<IndexFacts>> RestageStages(const AtomIndex& index,
                                              const std::vector<IndexFacts>& stages, uint32_t pp,
                                              uint32_t ep, LayerPartition partition,
                                              const LaneZeroShapes& lane0 = {}) {
  if (stages.front().fused) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) +
                               ": AutoEP layers in a pipeline are not supported");
  }
  if (pp == 1) {
    UCP_ASSIGN_OR_RETURN(IndexFacts merged, MergeStages(index, stages, pp));
    merged.target_stages = 1;  // holds every entry (HoldsEntry): no layer range
    return std::vector<IndexFacts>{std::move(merged)};
  }
  UCP_ASSIGN_OR_RETURN(const MoePipelineLayers layers, ReadPipelineLayers(stages, pp, lane0.saved));
  // Counted again only where TP lane 0 holds other slices at the target (another TP degree).
  std::optional<MoePipelineLayers> recounted;
  if (lane0.target != lane0.saved) {
    UCP_ASSIGN_OR_RETURN(recounted, ReadPipelineLayers(stages, pp, lane0.target));
  }
  const MoePipelineLayers& target_layers = recounted ? *recounted : layers;
  UCP_ASSIGN_OR_RETURN(const IndexFacts merged, MergeStages(index, stages, pp));
  std::vector<PartitionMethod> methods = {{LayerPartition::kUniform, "'uniform'", {}, {}},
                                          {LayerPartition::kParameters, "'parameters'",
                                           LayerWeights(layers, merged.num_experts, merged.ep),
                                           LayerWeights(target_layers, merged.num_experts, ep)}};
  for (PartitionMethod& method : TypeMethods(layers.signature, layers.count)) {
    methods.push_back(std::move(method));
  }
  UCP_ASSIGN_OR_RETURN(const ChosenPartition chosen,
                       ChoosePartition(layers.count, layers.source_stage, methods,
                                       static_cast<uint32_t>(stages.size()), pp, partition));
  std::vector<IndexFacts> out;
  for (uint32_t t = 0; t < pp; ++t) {
    UCP_ASSIGN_OR_RETURN(IndexFacts facts, SplitStage(merged, layers, chosen, t, pp));
    out.push_back(std::move(facts));
  }
  return out;
}

// The largest decimal storage key `root` references, plus one: a key no storage of it has.
uint64_t NextStorageKey(Value* root) {
  uint64_t next = 0;
  const Status walked = pickle::ForEachReachable(root, [&](Value* node) -> Status {
    const Value* pid = PidTuple(node);
    if (pid == nullptr) return Status::Ok();
    const std::optional<uint32_t> key = deepspeed::Decimal(pid->Item(2)->data());
    if (key) next = std::max<uint64_t>(next, uint64_t{*key} + 1);
    return Status::Ok();
  });
  (void)walked;  // the visitor never fails
  return next;
}

// Whether a restaged stage (`target`) holds the model states' entry `name`: at pp = 1 every
// one; at pp > 1 those of its layers, and kUnsupported for a name of no numbered layer.
Result<bool> HoldsEntry(const IndexFacts& target, const std::string& name) {
  if (target.target_stages == 1) return true;
  UCP_ASSIGN_OR_RETURN(const uint64_t layer, LayerOf(name, target.target_stages));
  return layer >= target.first_layer && layer < target.end_layer;
}

// The OrderedDict `dict`'s items those of `target`'s layers (HoldsEntry).
Status KeepEntriesOf(const IndexFacts& target, Value* dict) {
  std::vector<pickle::Mutation>& items = dict->mutable_mutations();
  std::vector<pickle::Mutation> kept;
  for (pickle::Mutation& item : items) {
    if (item.op == pickle::Mutation::Op::kSetItem) {
      UCP_ASSIGN_OR_RETURN(const bool held, HoldsEntry(target, KeyText(item.first)));
      if (!held) continue;
    }
    kept.push_back(std::move(item));
  }
  items = std::move(kept);
  return Status::Ok();
}

// The template's module, param_shapes groups and buffer_names (read by `reader`) kept to the
// entries of `target`'s layers (HoldsEntry).
Status KeepLayersOf(const IndexFacts& target, Value* module, Value* shapes, Value* buffers,
                    const TorchArchiveReader& reader) {
  UCP_RETURN_IF_ERROR(KeepEntriesOf(target, module));
  for (size_t g = 0; g < shapes->items().size(); ++g) {
    Value* group = shapes->Item(g);
    if (group == nullptr || group->kind() != Kind::kObject) {
      return FieldError(reader, "param_shapes/" + std::to_string(g), "not an OrderedDict");
    }
    UCP_RETURN_IF_ERROR(KeepEntriesOf(target, group));
  }
  std::vector<Value*> kept;
  for (Value* buffer : buffers->items()) {
    if (buffer->kind() != Kind::kStr) return FieldError(reader, "buffer_names", "not names");
    UCP_ASSIGN_OR_RETURN(const bool held, HoldsEntry(target, buffer->data()));
    if (held) kept.push_back(buffer);
  }
  buffers->mutable_items() = std::move(kept);
  return Status::Ok();
}

// kUnsupported where `stage`'s model states hold shared or frozen parameters: they name
// stage-local objects, which are not restaged.
Status RefuseSharedOrFrozen(const TorchArchiveReader& stage) {
  for (const char* field : {"shared_params", "frozen_param_shapes"}) {
    const Value* value = OptionalField(stage, field);
    if (value != nullptr && value->kind() != Kind::kNone &&
        !(value->kind() == Kind::kDict && value->entries().empty())) {
      return Status::Unsupported(Prefix(stage.path()) + field +
                                 ": not empty; a pipeline stage's shared or frozen parameters "
                                 "are not moved to other stages");
    }
  }
  return Status::Ok();
}

// A TP lane's slices for a restaged stage of TP lanes: TP rank t's (`shapes`, SliceShapesAt's) of
// the parameters `maps` splits.
struct RestagedLane {
  const std::map<std::string, ShardMap>& maps;
  const SliceShapes& shapes;
  uint32_t t = 0;
};

// Stage 0's model states (`root`, read by `reader`) made those of a restaged stage (`target`,
// RestageStages), as DeepSpeed writes a PipelineModule's stage: of stage 0's module tensors,
// param_shapes and buffer_names entries those of its layers, then those of the later stages'
// (the module tensors each in a storage of its own, from its bit16 atom, keys after the
// template's, in `storages`; with `lane` its slice of each parameter the lane's maps split, and
// the param_shapes entry the slice's); num_experts its MoE layers'; mp_world_size and
// checkpoint_parallel_dimensions' pp_degree the target's stages. kUnsupported for shared or
// frozen parameters of a stage that is not kept whole (at pp = 1 every later stage's), and at
// pp > 1 for a tag that does not record its axes (DeepSpeed 0.14: the stages written could not
// be told from tensor-parallel ranks).
Status RestageModelStates(const AtomIndex& index, const std::string& tag_dir,
                          const std::vector<IndexFacts>& stages, const IndexFacts& target,
                          pickle::Graph& graph, Value* root, const TorchArchiveReader& reader,
                          std::map<std::string, std::vector<Segment>>& storages,
                          const std::optional<RestagedLane>& lane = std::nullopt) {
  // The lane's slice of a parameter its maps split; nullptr: the parameter whole.
  const auto split = [&lane](const std::string& name) -> const ShardMap* {
    if (!lane) return nullptr;
    const auto map = lane->maps.find(name);
    return map == lane->maps.end() || map->second.rule != Rule::kSplit ? nullptr : &map->second;
  };
  Value* module = root->Get("module");
  Value* shapes = root->Get("param_shapes");
  Value* buffers = root->Get("buffer_names");
  if (module == nullptr || module->kind() != Kind::kObject || shapes == nullptr ||
      shapes->kind() != Kind::kList || buffers == nullptr || buffers->kind() != Kind::kList) {
    return FieldError(reader, "module", "not an OrderedDict beside param_shapes and buffer_names");
  }
  Value* dimensions = root->Get("checkpoint_parallel_dimensions");
  if (target.target_stages > 1 && dimensions == nullptr) {
    return Status::Unsupported(
        Prefix(reader.path()) +
        "checkpoint_parallel_dimensions: missing (DeepSpeed before 0.15); an MoE pipeline's "
        "stages are told from tensor parallelism only by it, so ucp writes them only for tags "
        "that record it");
  }
  if (target.target_stages > 1) UCP_RETURN_IF_ERROR(RefuseSharedOrFrozen(reader));
  uint64_t next_key = NextStorageKey(root);
  UCP_RETURN_IF_ERROR(KeepLayersOf(target, module, shapes, buffers, reader));
  for (size_t s = 1; s < stages.size(); ++s) {
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader stage,
                         OpenSource(index, tag_dir, stages[s].model_file));
    UCP_RETURN_IF_ERROR(RefuseSharedOrFrozen(stage));
    UCP_ASSIGN_OR_RETURN(const Value* stage_module, Field(stage, "module"));
    for (const auto& [name, value] : NamedChildren(stage_module)) {
      UCP_ASSIGN_OR_RETURN(const bool held, HoldsEntry(target, name));
      if (!held) continue;
      const Atom* atom = index.Find(name, "bit16");
      const TorchTensor* saved = stage.TensorAt(value);
      if (atom == nullptr || saved == nullptr) {
        return Status::Corrupt("deepspeed: index: " + name +
                               " bit16: missing (a module tensor of " + stage.path() + ")");
      }
      const std::string key = std::to_string(next_key++);
      const ShardMap* map = split(name);
      const Shape& shape = map != nullptr ? lane->shapes.local.at(name) : atom->shape;
      UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
      UCP_ASSIGN_OR_RETURN(Value * tensor, TensorLike(graph, *saved, key, shape, numel));
      if (map != nullptr) {
        UCP_RETURN_IF_ERROR(AppendSliceSegments(index, *atom, *map,
                                                lane->shapes.geometries.at(name), lane->t, 0, numel,
                                                storages[key]));
      } else {
        UCP_ASSIGN_OR_RETURN(const Region whole, Region::Whole(atom->shape));
        UCP_ASSIGN_OR_RETURN(storages[key], PlanRegion(index, *atom, whole));
      }
      module->mutable_mutations().push_back(
          {pickle::Mutation::Op::kSetItem, graph.Str(name), tensor});
    }
    UCP_ASSIGN_OR_RETURN(const Value* stage_shapes, Field(stage, "param_shapes"));
    for (size_t g = 0; g < shapes->items().size(); ++g) {
      Value* group = shapes->Item(g);
      const Value* stage_group = stage_shapes->Item(g);
      if (stage_group == nullptr || stage_group->kind() != Kind::kObject) {
        return FieldError(stage, "param_shapes/" + std::to_string(g),
                          "not an OrderedDict as stage 0's is");
      }
      for (const pickle::Mutation& item : stage_group->mutations()) {
        if (item.op != pickle::Mutation::Op::kSetItem) continue;
        const std::string name = KeyText(item.first);
        UCP_ASSIGN_OR_RETURN(const bool held, HoldsEntry(target, name));
        if (!held) continue;
        Value* shape = graph.Import(item.second);
        if (split(name) != nullptr)
          shape = ShapeNodeLike(graph, shape, lane->shapes.local.at(name));
        group->mutable_mutations().push_back({item.op, graph.Import(item.first), shape});
      }
    }
    UCP_ASSIGN_OR_RETURN(const Value* stage_buffers, Field(stage, "buffer_names"));
    for (const Value* buffer : stage_buffers->items()) {
      if (buffer->kind() != Kind::kStr) return FieldError(stage, "buffer_names", "not names");
      UCP_ASSIGN_OR_RETURN(const bool held, HoldsEntry(target, buffer->data()));
      if (held) buffers->mutable_items().push_back(graph.Import(buffer));
    }
  }
  std::vector<Value*> experts;
  for (const uint32_t count : target.num_experts) experts.push_back(graph.Int(count));
  UCP_RETURN_IF_ERROR(
      SetDictItem(root, "num_experts", graph.List(std::move(experts)), reader.path()));
  const int64_t pp = target.target_stages;
  UCP_RETURN_IF_ERROR(SetDictItem(root, "mp_world_size", graph.Int(pp), reader.path()));
  if (dimensions == nullptr) return Status::Ok();  // a pp = 1 target of a 0.14 tag
  return SetDictItem(dimensions, "pp_degree", graph.Int(pp), reader.path());
}

// The model states: dp_world_size, the dense groups' module buffers, and at another
// expert-parallel size the local experts' shapes (AutoEP's: its layers' coordinates and
// autoep_size). `restaged_from`: the pipeline's stages that `facts`, one of RestageStages', is
// made from (its model states from stage 0's, RestageModelStates); empty otherwise.
Status PlanModelStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const std::vector<IndexFacts>& restaged_from, const MoeLayout& at,
                       OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.model_file));
  ArchiveOutput out;
  out.path = ModelStatesName(facts.mp);
  Value* root = out.graph.Import(reader.root());
  out.graph.set_root(root);
  std::map<std::string, std::vector<Segment>> resized;
  // A folded tag's module tensors each have a storage of their own: made whole, nothing to resize.
  if (facts.folded_tp > 1) {
    UCP_ASSIGN_OR_RETURN(resized, UnfoldModelStates(index, facts, reader, out.graph));
  }
  UCP_RETURN_IF_ERROR(
      SetDictItem(root, "dp_world_size", out.graph.Int(at.order.dp), reader.path()));
  std::vector<GroupLayout> dense;
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    if (g != facts.expert_group) dense.push_back(facts.groups[g]);
  }
  if (!restaged_from.empty()) {
    UCP_RETURN_IF_ERROR(
        RestageModelStates(index, tag_dir, restaged_from, facts, out.graph, root, reader, resized));
  }
  if (facts.folded_tp == 1) {
    UCP_RETURN_IF_ERROR(ResizeModuleBuffers(out.graph, reader, facts.model_file, dense, facts.dp,
                                            at.order.dp, resized));
  }
  if (at.order.ep != facts.ep) {
    UCP_RETURN_IF_ERROR(SetLocalExpertShapes(out.graph, root, reader, facts.expert_group,
                                             at.experts.local, facts.fused));
  }
  if (facts.fused) {
    UCP_RETURN_IF_ERROR(SetAutoEpLayers(out.graph, root, at.order, 0, reader));
    UCP_RETURN_IF_ERROR(
        SetConfigValue(out.graph, root, "expert_parallel", "autoep_size", at.order.ep, reader));
  }
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, reader, facts.model_file, std::move(resized)));
  plan.archives.push_back(std::move(out));
  return Status::Ok();
}

// A folded tag's expert files at tp 1: each expert's file of its lowest TP lane (the index lists
// an expert's files lane after lane) as mp_rank_00's, without its folding dict, as a tp 1 run
// writes it.
Status PlanUnfoldedExpertFiles(const AtomIndex& index, const std::string& tag_dir,
                               const IndexFacts& facts, OutputPlan& plan) {
  std::set<std::pair<uint32_t, uint32_t>> written;
  for (const uint32_t file : facts.expert_files) {
    const std::optional<deepspeed::FileName> parsed =
        ParseFileName(index.contents().files[file].path);
    if (!parsed || !written.insert({parsed->layer, parsed->expert}).second) continue;
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, file));
    ArchiveOutput out;
    out.path = ExpertModelStatesName(parsed->layer, parsed->expert, 0);
    Value* root = out.graph.Import(reader.root());
    out.graph.set_root(root);
    EraseKey(root, deepspeed::kFolding);
    UCP_ASSIGN_OR_RETURN(out.storages, CollectStorages(root, reader, file, {}));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

// The expert files, copied: they name experts by global id, the same at any E; and the expp_rank
// files ({'optimizer': None} under ZeRO, alike on every rank), one per target expert rank.
Status PlanExpertFiles(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const MoeLayout& at, OutputPlan& plan) {
  if (facts.folded_tp > 1) return PlanUnfoldedExpertFiles(index, tag_dir, facts, plan);
  for (size_t i = 0; i < facts.expert_files.size(); ++i) {
    plan.copies.push_back({facts.expert_names[i], facts.expert_files[i]});
  }
  if (facts.expp_files.empty()) return Status::Ok();
  if (at.order.ep != facts.ep) UCP_RETURN_IF_ERROR(CheckNoExpertOptimizer(index, tag_dir, facts));
  for (uint32_t e = 0; e < at.order.ep; ++e) {
    plan.copies.push_back(
        {ExpertOptimName(e, facts.mp), facts.expp_files[e % facts.expp_files.size()]});
  }
  return Status::Ok();
}

// DeepSpeed names the expert group after the expert-parallel size: `dict`'s expert param group
// renamed for `ep`.
Status RenameExpertGroup(pickle::Graph& graph, Value* dict, const TorchArchiveReader& reader,
                         size_t expert_group, uint32_t ep) {
  Value* group = nullptr;
  if (Value* base = dict->Get("base_optimizer_state"); base != nullptr) {
    if (Value* groups = base->Get("param_groups"); groups != nullptr) {
      group = groups->Item(expert_group);
    }
  }
  if (group == nullptr) {
    return FieldError(
        reader,
        std::string(kOsd) + "/base_optimizer_state/param_groups/" + std::to_string(expert_group),
        "missing");
  }
  return SetDictItem(group, "name",
                     graph.Str(std::string(kExpertGroupNamePrefix) + std::to_string(ep)),
                     reader.path());
}

// One optimizer file per target rank, rank 0's its template: each group's partition (the
// expert group's of the rank's expert-parallel rank's experts), the partition fields,
// autoep_size and the expert group's name.
Status PlanOptimStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const MoeLayout& at, OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  for (uint32_t r = 0; r < at.order.dp; ++r) {
    const auto group_of = [&](size_t g) -> Result<RankGroupPart> {
      const bool experts = g == facts.expert_group;
      const GroupLayout& layout =
          experts ? at.experts.global[at.order.ExpertRank(r)] : facts.groups[g];
      const Partitioning& p = at.partitions[g];
      const uint32_t index_in_group = experts ? at.order.IndexInGroup(r) : r;
      RankGroupPart group;
      group.part =
          PlanRankPart(p, index_in_group, layout.total, /*elastic=*/false, facts.bf16_optimizer);
      // The template is rank 0's file; a folded tag's holds its lane's slices (not checked).
      if (facts.folded_tp == 1) {
        UCP_ASSIGN_OR_RETURN(
            const Partitioning source_p,
            Partition(facts.template_totals[g], experts ? facts.dp / facts.ep : facts.dp));
        group.part.sizes.template_numel = source_p.partition;
      }
      group.padding = p.padding_of(index_in_group);
      // DeepSpeed's mappings name an expert by its local id.
      group.mappings =
          ExpectedMappings(experts ? at.experts.local : layout, p, index_in_group, false);
      // One padding per parameter as the optimizer holds them: AutoEP's fused, not their rows.
      group.params = experts ? at.experts.local.names.size() : layout.names.size();
      group.segments_of = [&index, &layout](const std::string& state, uint64_t begin,
                                            uint64_t end) {
        return FlatSegments(index, layout, state, begin, end);
      };
      return group;
    };
    const auto edit = [&](pickle::Graph& graph, Value* root, Value* dict) -> Status {
      UCP_RETURN_IF_ERROR(
          SetConfigValue(graph, root, "expert_parallel", "autoep_size", at.order.ep, reader));
      if (facts.folded_tp > 1) {  // as a tp 1 run writes it
        UCP_RETURN_IF_ERROR(deepspeed::UnfoldAutoTp(graph, root, reader));
      }
      // AutoEP's universal load at another size keeps the saved name (ReadSave), and so do its
      // saves, which ucp's files are.
      if (at.order.ep != facts.ep && !facts.fused) {
        UCP_RETURN_IF_ERROR(
            RenameExpertGroup(graph, dict, reader, facts.expert_group, at.order.ep));
      }
      return Status::Ok();
    };
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        PlanPartitionedOptimFile(reader, facts.optim_file, OptimName(facts.prefix, r, facts.mp),
                                 /*elastic=*/false, facts.groups.size(), group_of,
                                 at.partition_counts, edit));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// A folded tag to another folded grid (T' > 1): PlanFoldedReshard's phases.

// A folded target's layout: its grid, the dense parameters' maps at its TP degree, each TP lane's
// dense groups (its slices' flat layout, partitioned over the dense DP ranks), and the experts at
// its expert-parallel size, each expert-parallel rank's group partitioned over its expert DP ranks
// (with expert tensor parallelism each lane's slices of it).
struct FoldedLayout {
  deepspeed::FoldedGrid grid;
  std::map<std::string, ShardMap> maps;
  std::vector<std::vector<TargetGroup>> lanes;  // [TP rank][group]; the expert group's entry empty
  ExpertLayouts experts;
  Partitioning expert_partition;
  // expert_tp: [TP rank][expert-parallel rank] (rank 0's names are the local ones).
  std::vector<std::vector<TargetGroup>> expert_slices;
  // The pipeline's stages, and the mp rank of this stage's lane 0 (DeepSpeed's grid: s·T').
  uint32_t pp = 1;
  uint32_t first_mp = 0;
};

// The grid of TP lanes of each stage a target names, once DeepSpeed can run the tag's model there:
// any pp for native MoE over an mpu's TP (AutoEP: the tag's one stage), world = tp · dp a stage,
// an expert-parallel size dividing that world (with expert tensor parallelism dp) and every
// layer's experts (AutoEP folds over AutoTP only at one above 1).
Result<deepspeed::FoldedGrid> CheckFoldedTarget(const AtomIndex& index, const IndexFacts& facts,
                                                const Topology& target) {
  const std::string at = "deepspeed: tp=" + std::to_string(target.tp) +
                         ",pp=" + std::to_string(target.pp) + ",dp=" + std::to_string(target.dp);
  if (target.pp != 1 && !facts.mpu_tp) {
    return Status::Unsupported(at +
                               ": AutoEP with AutoTP in a pipeline (DeepSpeed does not fold one)");
  }
  if (target.pp == 0 || target.dp == 0 ||
      (target.world != 0 && target.world != target.dp * target.tp * target.pp)) {
    return Status::InvalidArgument(at + ": the world of a grid of TP lanes is tp · dp · pp, not " +
                                   std::to_string(target.world));
  }
  deepspeed::FoldedGrid grid{target.dp * target.tp, target.tp,
                             target.ep != 0 ? target.ep : facts.ep, facts.data_before_expert,
                             facts.expert_tp};
  if (grid.ep == 1 && !facts.mpu_tp) {
    return Status::Unsupported(at +
                               ",ep=1: DeepSpeed folds AutoEP over AutoTP only at an "
                               "expert-parallel size above 1");
  }
  if (grid.Order().dp % grid.ep != 0) {
    return Status::InvalidArgument(
        at + ": the " + (grid.expert_tp ? "dense-data-parallel size " : "world ") +
        std::to_string(grid.Order().dp) + " is not a multiple of the expert-parallel size " +
        std::to_string(grid.ep) + ": DeepSpeed requires it" +
        (grid.expert_tp ? " (with expert tensor parallelism)" : ""));
  }
  UCP_RETURN_IF_ERROR(CheckExpertsDivide(facts.num_experts, grid.ep));
  if (grid.ep != facts.ep) {
    UCP_RETURN_IF_ERROR(RefuseOldExpertGradientScale(index, grid.ep, facts.ep));
  }
  return grid;
}

// `model`: the tag's lane-0 model states, whose ds_config (and the config.json beside the tag)
// give AutoTP's split rule.
Result<FoldedLayout> FoldedLayoutAt(const AtomIndex& index, const std::string& tag_dir,
                                    const IndexFacts& facts, const TorchArchiveReader& model,
                                    const deepspeed::FoldedGrid& grid) {
  FoldedLayout at;
  at.grid = grid;
  at.maps = facts.folded_maps;
  // Megatron's rules are of any degree (GeometryAt divides them); AutoTP's are of its own.
  if (grid.tp != facts.folded_tp && !facts.mpu_tp) {
    UCP_ASSIGN_OR_RETURN(const AutoTpSplitRule rule, ReadAutoTpSplitRule(model, tag_dir));
    UCP_RETURN_IF_ERROR(MapsAtDegree(index, facts.folded_tp, grid.tp, rule, at.maps));
  }
  for (uint32_t t = 0; t < grid.tp; ++t) {
    std::vector<TargetGroup> groups;
    for (size_t g = 0; g < facts.groups.size(); ++g) {
      if (g == facts.expert_group) {
        groups.emplace_back();
        continue;
      }
      UCP_ASSIGN_OR_RETURN(TargetGroup group,
                           TargetGroupAt(index, at.maps, facts.vocab, facts.groups[g].names,
                                         grid.tp, t, grid.DenseDp()));
      groups.push_back(std::move(group));
    }
    at.lanes.push_back(std::move(groups));
  }
  UCP_ASSIGN_OR_RETURN(at.experts, ExpertLayoutsAt(facts, grid.ep));
  UCP_ASSIGN_OR_RETURN(at.expert_partition,
                       SavablePartition(at.experts.local.total, grid.ExpertDp(), "a group"));
  if (!grid.expert_tp) return at;
  for (uint32_t t = 0; t < grid.tp; ++t) {
    std::vector<TargetGroup> ranks;
    for (const GroupLayout& global : at.experts.global) {
      UCP_ASSIGN_OR_RETURN(
          TargetGroup group,
          TargetGroupAt(index, at.maps, facts.vocab, global.names, grid.tp, t, grid.ExpertDp()));
      ranks.push_back(std::move(group));
    }
    at.expert_slices.push_back(std::move(ranks));
  }
  return at;
}

// An mpu's TP degree where the model states record it (imported into `graph` as `root` from
// `reader`): mp_world_size, checkpoint_parallel_dimensions' tp_degree, the vocabulary's padding
// (universal_checkpoint_info's padded_vocab_size; Megatron pads by the degree) and Megatron's
// arguments where the client saved them.
Status SetMpuTpDegree(pickle::Graph& graph, Value* root, const deepspeed::FoldedGrid& grid,
                      uint32_t pp, const std::optional<Vocab>& vocab,
                      const TorchArchiveReader& reader) {
  UCP_RETURN_IF_ERROR(
      SetDictItem(root, "mp_world_size", graph.Int(int64_t{grid.tp} * pp), reader.path()));
  Value* dimensions = root->Get("checkpoint_parallel_dimensions");
  if (dimensions == nullptr || dimensions->kind() != Kind::kDict) {
    return FieldError(reader, "checkpoint_parallel_dimensions", "not a dict");
  }
  UCP_RETURN_IF_ERROR(SetDictItem(dimensions, "tp_degree", graph.Int(grid.tp), reader.path()));
  return deepspeed::SetMegatronTopology(
      graph, root, vocab, {grid.DenseDp(), grid.tp, pp, grid.world * pp}, reader.path());
}

// The model states of TP rank t (written by rank t, dense DP rank 0): lane 0's with the dense
// parameters' slices at the target's (SliceDenseModule), restaged where `restaged_from` names the
// pipeline's saved stages (RestageModelStates, at lane t's slices), dp_world_size the dense DP,
// the local experts' shapes; with an mpu's TP the degree where Megatron records it
// (SetMpuTpDegree); folded, the TP degree and AutoTP's affine map at it (the fused experts'
// entries at the target's experts per rank), AutoEP's layers for rank t, autoep_size, and the
// folding dict of rank t. `reader`: the lane-0 model states of the stage `facts` is (restaged:
// of saved stage 0).
Status PlanFoldedModelStates(const AtomIndex& index, const std::string& tag_dir,
                             const IndexFacts& facts, const std::vector<IndexFacts>& restaged_from,
                             const TorchArchiveReader& reader, const FoldedLayout& at, uint32_t t,
                             OutputPlan& plan) {
  ArchiveOutput out;
  out.path = ModelStatesName(at.first_mp + t);
  pickle::Graph& graph = out.graph;
  Value* root = graph.Import(reader.root());
  graph.set_root(root);
  UCP_ASSIGN_OR_RETURN(const SliceShapes shapes,
                       SliceShapesAt(index, at.maps, facts.vocab, at.grid.tp, t));
  using Replaced = std::map<std::string, std::vector<Segment>>;
  UCP_ASSIGN_OR_RETURN(Replaced replaced,
                       SliceDenseModule(index, at.maps, shapes, t, reader, graph));
  if (!restaged_from.empty()) {
    UCP_RETURN_IF_ERROR(RestageModelStates(index, tag_dir, restaged_from, facts, graph, root,
                                           reader, replaced, RestagedLane{at.maps, shapes, t}));
  }
  UCP_RETURN_IF_ERROR(
      SetDictItem(root, "dp_world_size", graph.Int(at.grid.DenseDp()), reader.path()));
  const GroupLayout& local = at.experts.local;
  if (at.grid.expert_tp) {
    // Rank 0's slices under their global names, which are its local ones.
    UCP_RETURN_IF_ERROR(SetLocalExpertShapes(graph, root, reader, facts.expert_group,
                                             at.expert_slices[t][0].layout, false,
                                             /*slices=*/true));
  } else if (at.grid.ep != facts.ep) {
    UCP_RETURN_IF_ERROR(
        SetLocalExpertShapes(graph, root, reader, facts.expert_group, local, facts.fused));
  }
  if (facts.mpu_tp) {
    UCP_RETURN_IF_ERROR(SetMpuTpDegree(graph, root, at.grid, at.pp, facts.vocab, reader));
    UCP_ASSIGN_OR_RETURN(out.storages,
                         CollectStorages(root, reader, facts.model_file, std::move(replaced)));
    plan.archives.push_back(std::move(out));
    return Status::Ok();
  }
  std::map<std::string, Shape> expert_shapes;
  for (size_t k = 0; k < local.names.size(); ++k) {
    expert_shapes[local.names[k]] = local.shapes[k];
  }
  UCP_RETURN_IF_ERROR(SetReplicatedShapes(graph, root, reader, expert_shapes));
  std::map<std::string, std::vector<uint64_t>> uneven;
  for (const auto& [name, map] : at.maps) {
    if (!map.blocks.empty()) uneven.emplace(name, map.blocks);
  }
  UCP_RETURN_IF_ERROR(SetTpDegree(graph, root, at.grid.tp, reader, uneven));
  UCP_RETURN_IF_ERROR(SetAutoEpLayers(graph, root, at.grid.Order(), t, reader));
  UCP_RETURN_IF_ERROR(
      SetConfigValue(graph, root, "expert_parallel", "autoep_size", at.grid.ep, reader));
  UCP_RETURN_IF_ERROR(SetFolding(graph, root, reader, at.grid, t));
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, reader, facts.model_file, std::move(replaced)));
  plan.archives.push_back(std::move(out));
  return Status::Ok();
}

// The optimizer file of every rank g = d·T' + t: the dense groups' lane t slices, partition d of
// the dense DP; the expert group of expert-parallel rank g mod E', partition g div E' of its
// expert DP; folded, autotp_size, autoep_size and rank g's folding dict; with an mpu's TP the
// expert group's name.
Status PlanFoldedOptimStates(const AtomIndex& index, const std::string& tag_dir,
                             const IndexFacts& facts, const FoldedLayout& at, OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  const deepspeed::FoldedGrid& grid = at.grid;
  std::vector<uint64_t> counts;
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    counts.push_back(g == facts.expert_group ? grid.ExpertDp() : grid.DenseDp());
  }
  for (uint32_t rank = 0; rank < grid.world; ++rank) {
    const uint32_t t = grid.TpRank(rank);
    const auto group_of = [&](size_t g) -> Result<RankGroupPart> {
      RankGroupPart group;
      if (g == facts.expert_group && grid.expert_tp) {
        const TargetGroup& slices = at.expert_slices[t][grid.ExpertRank(rank)];
        const uint32_t i = grid.ExpertDpRank(rank);
        group.part = PlanRankPart(slices.partition, i, slices.layout.total, /*elastic=*/false,
                                  facts.bf16_optimizer);
        group.padding = slices.partition.padding_of(i);
        // Named by local id: rank 0's slices, whose global names are the local ones.
        group.mappings =
            ExpectedMappings(at.expert_slices[t][0].layout, slices.partition, i, false);
        group.params = slices.layout.names.size();
        group.segments_of = [&index, &at, &slices, t](const std::string& state, uint64_t begin,
                                                      uint64_t end) {
          return SliceFlatSegments(index, at.maps, slices, t, state, begin, end);
        };
        return group;
      }
      if (g == facts.expert_group) {
        const GroupLayout& layout = at.experts.global[grid.ExpertRank(rank)];
        const uint32_t i = grid.ExpertDpRank(rank);
        group.part = PlanRankPart(at.expert_partition, i, layout.total, /*elastic=*/false,
                                  facts.bf16_optimizer);
        group.padding = at.expert_partition.padding_of(i);
        // DeepSpeed's mappings name an expert by its local id; one padding per fused parameter.
        group.mappings = ExpectedMappings(at.experts.local, at.expert_partition, i, false);
        group.params = at.experts.local.names.size();
        group.segments_of = [&index, &layout](const std::string& state, uint64_t begin,
                                              uint64_t end) {
          return FlatSegments(index, layout, state, begin, end);
        };
        return group;
      }
      const TargetGroup& lane = at.lanes[t][g];
      const uint32_t d = grid.DenseRank(rank);
      group.part = PlanRankPart(lane.partition, d, lane.layout.total, /*elastic=*/false,
                                facts.bf16_optimizer);
      group.padding = lane.partition.padding_of(d);
      group.mappings = ExpectedMappings(lane.layout, lane.partition, d, false);
      group.params = lane.layout.names.size();
      group.segments_of = [&index, &at, &lane, t](const std::string& state, uint64_t begin,
                                                  uint64_t end) {
        return SliceFlatSegments(index, at.maps, lane, t, state, begin, end);
      };
      return group;
    };
    const auto edit = [&](pickle::Graph& graph, Value* root, Value* dict) -> Status {
      if (facts.mpu_tp) {  // DeepSpeed names the expert group after the expert-parallel size
        return grid.ep == facts.ep
                   ? Status::Ok()
                   : RenameExpertGroup(graph, dict, reader, facts.expert_group, grid.ep);
      }
      UCP_RETURN_IF_ERROR(
          SetConfigValue(graph, root, "expert_parallel", "autoep_size", grid.ep, reader));
      UCP_RETURN_IF_ERROR(SetAutoTpSize(graph, root, grid.tp, reader));
      return SetFolding(graph, root, reader, grid, rank);
    };
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        PlanPartitionedOptimFile(reader, facts.optim_file,
                                 OptimName(facts.prefix, grid.DenseRank(rank), at.first_mp + t),
                                 /*elastic=*/false, facts.groups.size(), group_of, counts, edit));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

// Each expert's files at the target: under every TP rank t whose ranks write its expert-parallel
// rank's experts (FoldedGrid::ExpertWriters), its lowest-lane file with the folding dict of the
// lowest of those writers (where two write it, DeepSpeed's own save keeps whichever lands last);
// with an mpu's TP under every TP rank whose ranks hold them, the same file: DeepSpeed writes it
// under lane e mod T alone, which are those lanes where T divides E, and its load reads each. With
// expert tensor parallelism under every TP rank, its lowest-lane file with each tensor the rules
// split TP rank t's slice of its bit16 atom.
Status PlanFoldedExpertFiles(const AtomIndex& index, const std::string& tag_dir,
                             const IndexFacts& facts, const FoldedLayout& at, OutputPlan& plan) {
  std::vector<SliceShapes> lane_shapes;
  for (uint32_t t = 0; t < (at.grid.expert_tp ? at.grid.tp : 0); ++t) {
    UCP_ASSIGN_OR_RETURN(lane_shapes.emplace_back(),
                         SliceShapesAt(index, at.maps, facts.vocab, at.grid.tp, t));
  }
  std::set<std::pair<uint32_t, uint32_t>> written;
  for (size_t i = 0; i < facts.expert_files.size(); ++i) {
    const uint32_t file = facts.expert_files[i];
    // The layer as the stage numbers it at the target (restaged: RestageStages').
    const std::optional<deepspeed::FileName> parsed = ParseFileName(facts.expert_names[i]);
    if (!parsed || !written.insert({parsed->layer, parsed->expert}).second) continue;
    if (parsed->layer >= facts.num_experts.size()) {
      return Status::Corrupt("deepspeed: index: " + index.contents().files[file].path +
                             ": a layer the index's num_experts does not list");
    }
    const uint32_t per_rank = facts.num_experts[parsed->layer] / at.grid.ep;
    if (at.grid.expert_tp) {
      UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, file));
      for (uint32_t t = 0; t < at.grid.tp; ++t) {
        ArchiveOutput out;
        out.path = ExpertModelStatesName(parsed->layer, parsed->expert, at.first_mp + t);
        Value* root = out.graph.Import(reader.root());
        out.graph.set_root(root);
        std::map<std::string, std::vector<Segment>> replaced;
        UCP_RETURN_IF_ERROR(
            SliceTensors(index, at.maps, lane_shapes[t], t, root, "", reader, out.graph, replaced));
        UCP_ASSIGN_OR_RETURN(out.storages,
                             CollectStorages(root, reader, file, std::move(replaced)));
        plan.archives.push_back(std::move(out));
      }
      continue;
    }
    if (facts.mpu_tp) {
      // Under each lane whose ranks hold the expert, as they read it; no folding dict.
      for (uint32_t t = 0; t < at.grid.tp; ++t) {
        if (at.grid.ExpertHolders(t, parsed->expert / per_rank).empty()) continue;
        plan.copies.push_back(
            {ExpertModelStatesName(parsed->layer, parsed->expert, at.first_mp + t), file});
      }
      continue;
    }
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, file));
    for (uint32_t t = 0; t < at.grid.tp; ++t) {
      const std::vector<uint32_t> writers = at.grid.ExpertWriters(t, parsed->expert / per_rank);
      if (writers.empty()) continue;
      ArchiveOutput out;
      out.path = ExpertModelStatesName(parsed->layer, parsed->expert, at.first_mp + t);
      Value* root = out.graph.Import(reader.root());
      out.graph.set_root(root);
      UCP_RETURN_IF_ERROR(SetFolding(out.graph, root, reader, at.grid, writers.front()));
      UCP_ASSIGN_OR_RETURN(out.storages, CollectStorages(root, reader, file, {}));
      plan.archives.push_back(std::move(out));
    }
  }
  return Status::Ok();
}

// A tag of TP lanes at another grid of lanes (a folded one's at T' > 1; an mpu's at any T' and
// pp, each stage alike, its files under mp ranks s·T' + t; at another pp the stages restaged,
// RestageStages, with each lane's slices): every lane's model states, every rank's optimizer
// file, and each expert's files under the lanes of its writers.
Result<OutputPlan> PlanFoldedReshard(const AtomIndex& index, const std::string& tag_dir,
                                     const std::vector<IndexFacts>& stages,
                                     const Topology& target) {
  const IndexFacts& first = stages.front();
  UCP_ASSIGN_OR_RETURN(const deepspeed::FoldedGrid grid, CheckFoldedTarget(index, first, target));
  const bool restaged = target.pp != stages.size();
  std::vector<IndexFacts> restaged_stages;
  if (restaged) {
    // Megatron's rules are of any degree: the saved maps split at the target's too.
    LaneZeroShapes lane0;
    UCP_ASSIGN_OR_RETURN(const SliceShapes saved,
                         SliceShapesAt(index, first.folded_maps, first.vocab, first.folded_tp, 0));
    UCP_ASSIGN_OR_RETURN(const SliceShapes at_target,
                         SliceShapesAt(index, first.folded_maps, first.vocab, grid.tp, 0));
    lane0.saved = saved.local;
    lane0.target = at_target.local;
    UCP_ASSIGN_OR_RETURN(restaged_stages,
                         RestageStages(index, stages, target.pp, grid.ep, target.partition, lane0));
  }
  const std::vector<IndexFacts> kept;  // no restaging: PlanFoldedModelStates keeps each stage
  const std::vector<IndexFacts>& restaged_from = restaged ? stages : kept;
  OutputPlan plan;
  for (const IndexFacts& facts : restaged ? restaged_stages : stages) {
    // Read once: the split rule and every lane's model states come from it.
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model,
                         OpenSource(index, tag_dir, facts.model_file));
    UCP_ASSIGN_OR_RETURN(FoldedLayout at, FoldedLayoutAt(index, tag_dir, facts, model, grid));
    at.pp = target.pp;
    at.first_mp = facts.mp * grid.tp;
    for (uint32_t t = 0; t < grid.tp; ++t) {
      UCP_RETURN_IF_ERROR(
          PlanFoldedModelStates(index, tag_dir, facts, restaged_from, model, at, t, plan));
    }
    UCP_RETURN_IF_ERROR(PlanFoldedExpertFiles(index, tag_dir, facts, at, plan));
    UCP_RETURN_IF_ERROR(PlanFoldedOptimStates(index, tag_dir, facts, at, plan));
  }
  return plan;
}

// The expert-parallel size of a native MoE save from its model states `model`: param_shapes names
// one rank's local experts, every MoE layer's experts spread over the same size (one expert
// group), so it is the experts of every layer (num_experts) over the local ones.
Result<uint32_t> ExpertParallelSizeOf(const TorchArchiveReader& model) {
  UCP_ASSIGN_OR_RETURN(const std::vector<uint32_t> num_experts, ReadNumExperts(model));
  UCP_ASSIGN_OR_RETURN(const Value* groups, Field(model, "param_shapes"));
  std::set<std::pair<std::string, uint32_t>> local;  // (MoE module, local id)
  for (const Value* group : groups->items()) {
    for (const auto& [name, shape] : NamedChildren(group)) {
      if (const std::optional<ExpertIdAt> at = FindExpertId(name)) {
        local.insert({name.substr(0, at->module_end), at->id});
      }
    }
  }
  uint64_t experts = 0;
  for (const uint32_t n : num_experts) experts += n;
  if (local.empty() || experts % local.size() != 0) {
    return FieldError(model, "param_shapes",
                      std::to_string(local.size()) + " local experts, which do not divide the " +
                          std::to_string(experts) + " of num_experts");
  }
  return static_cast<uint32_t>(experts / local.size());
}

// The files of a stage of TP lanes (its lane 0's model states `model`, mp rank `first_mp`;
// `mpu`: an mpu's TP): every lane's model states, every rank's optimizer file, and each expert's
// files under the lanes of its writers.
Result<std::vector<std::string>> FoldedFiles(const deepspeed::FoldedGrid& grid, bool mpu,
                                             const TorchArchiveReader& model,
                                             const std::string& prefix, uint32_t first_mp = 0) {
  UCP_ASSIGN_OR_RETURN(const std::vector<uint32_t> num_experts, ReadNumExperts(model));
  std::vector<std::string> files;
  for (uint32_t t = 0; t < grid.tp; ++t) files.push_back(ModelStatesName(first_mp + t));
  for (uint32_t t = 0; t < grid.tp; ++t) {
    for (uint32_t d = 0; d < grid.DenseDp(); ++d) {
      files.push_back(OptimName(prefix, d, first_mp + t));
    }
  }
  for (uint32_t layer = 0; layer < num_experts.size(); ++layer) {
    if (num_experts[layer] % grid.ep != 0) {
      return FieldError(
          model, "num_experts",
          "layer " + std::to_string(layer) + "'s " + std::to_string(num_experts[layer]) +
              " experts are not a multiple of the expert-parallel size " + std::to_string(grid.ep));
    }
    const uint32_t per_rank = num_experts[layer] / grid.ep;
    for (uint32_t g = 0; g < num_experts[layer]; ++g) {
      for (uint32_t t = 0; t < grid.tp; ++t) {
        if (ExpertLanes(grid, mpu, t, g / per_rank).first) {
          files.push_back(ExpertModelStatesName(layer, g, first_mp + t));
        }
      }
    }
  }
  return files;
}

}  // namespace

bool DeepSpeedMoeAdapter::Recognizes(const std::string& tag_dir) const {
  Result<TagListing> listing = ListTag(tag_dir);
  return listing.ok() && !listing->expert_files.empty() && listing->zero3_model_states.empty() &&
         listing->layer_files.empty();
}

Result<std::vector<std::string>> DeepSpeedMoeAdapter::ExpectedFiles(
    const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTag(tag_dir));
  if (!listing.zero3_model_states.empty() || !listing.layer_files.empty()) {
    return RefuseListing(tag_dir, listing);
  }
  UCP_ASSIGN_OR_RETURN(
      const TorchArchiveReader model,
      OpenWrittenModelStates(tag_dir, ModelStatesName(0), listing.model_states.contains(0)));
  UCP_ASSIGN_OR_RETURN(const int64_t mp_world_size, IntField(model, "mp_world_size"));
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(model));
  const auto first = std::find_if(listing.optim.begin(), listing.optim.end(),
                                  [](const RankFile& entry) { return entry.dp == 0; });
  const std::string prefix = first == listing.optim.end() ? "" : first->prefix;
  UCP_ASSIGN_OR_RETURN(const std::optional<deepspeed::FoldedGrid> folded,
                       deepspeed::ReadFoldedGrid(model));
  if (folded) return FoldedFiles(*folded, false, model, prefix);
  UCP_ASSIGN_OR_RETURN(const std::optional<uint32_t> lanes, MpuLanes(model, mp_world_size));
  if (const uint32_t mpu_tp = lanes.value_or(1); mpu_tp > 1) {
    UCP_ASSIGN_OR_RETURN(const uint32_t ep, ExpertParallelSizeOf(model));
    deepspeed::FoldedGrid grid{dp * mpu_tp, mpu_tp, ep};
    UCP_ASSIGN_OR_RETURN(grid.expert_tp,
                         SavedExpertTensorParallel(tag_dir, listing, model, prefix, grid));
    // With expert tensor parallelism every lane's model states are written (by its dense- and
    // expert-data-parallel rank 0).
    if (mpu_tp > ep && !grid.expert_tp) {
      return Status::Unsupported(Prefix(tag_dir) + "tp " + std::to_string(mpu_tp) + " above ep " +
                                 std::to_string(ep) + " (from " + model.path() + ")" +
                                 std::string(kMpuModelStatesWriters));
    }
    // Each pipeline stage's lanes (MpuLanes checked mp_world_size = tp x stages).
    std::vector<std::string> files;
    for (uint32_t first_mp = 0; first_mp < mp_world_size; first_mp += mpu_tp) {
      std::optional<TorchArchiveReader> stage_model;
      if (first_mp > 0) {
        UCP_ASSIGN_OR_RETURN(stage_model,
                             OpenWrittenModelStates(tag_dir, ModelStatesName(first_mp),
                                                    listing.model_states.contains(first_mp)));
      }
      UCP_ASSIGN_OR_RETURN(
          const std::vector<std::string> stage,
          FoldedFiles(grid, true, first_mp > 0 ? *stage_model : model, prefix, first_mp));
      files.insert(files.end(), stage.begin(), stage.end());
    }
    return files;
  }
  UCP_ASSIGN_OR_RETURN(const uint32_t stages, PipelineStages(model, mp_world_size));
  std::vector<std::string> files;
  for (uint32_t mp = 0; mp < stages; ++mp) {
    std::optional<TorchArchiveReader> stage_model;
    if (mp > 0) {
      UCP_ASSIGN_OR_RETURN(stage_model, OpenWrittenModelStates(tag_dir, ModelStatesName(mp),
                                                               listing.model_states.contains(mp)));
    }
    UCP_ASSIGN_OR_RETURN(
        const ExpertFiles experts,
        ListExpertFiles(tag_dir, listing, mp > 0 ? *stage_model : model, mp, stages));
    files.push_back(ModelStatesName(mp));
    for (uint32_t r = 0; r < dp; ++r) files.push_back(OptimName(prefix, r, mp));
    for (uint32_t layer = 0; layer < experts.num_experts.size(); ++layer) {
      for (uint32_t g = 0; g < experts.num_experts[layer]; ++g) {
        files.push_back(ExpertModelStatesName(layer, g, mp));
      }
    }
    // Whether a release writes expp_rank files is in no file: those there belong to the save. A
    // rank writes its own before its optimizer file, so once every optimizer file is closed (what
    // a caller waits for) each is listed.
    for (const uint32_t e : experts.optim) files.push_back(ExpertOptimName(e, mp));
  }
  return files;
}

Result<AtomIndex> DeepSpeedMoeAdapter::BuildIndex(const std::string& tag_dir,
                                                  const IndexOptions& options) const {
  MoeTag tag;
  UCP_RETURN_IF_ERROR(ReadSave(tag_dir, tag));
  for (MoeStage& stage : tag.stages) {
    UCP_RETURN_IF_ERROR(ReadExpertTensors(tag, stage));
    UCP_RETURN_IF_ERROR(LayOutGroups(tag, stage));
    if (tag.folded) UCP_RETURN_IF_ERROR(ResolveFoldedMaps(tag, stage));
    UCP_RETURN_IF_ERROR(CheckRanks(tag, stage));
  }
  return MakeIndex(tag, options);
}

Result<OutputPlan> DeepSpeedMoeAdapter::PlanReshard(const AtomIndex& index,
                                                    const std::string& tag_dir,
                                                    const Topology& target) const {
  UCP_ASSIGN_OR_RETURN(const std::vector<IndexFacts> stages, ReadFacts(index));
  // An mpu's TP lanes are written by the same rules at any TP degree and pp, 1 included.
  const IndexFacts& first = stages.front();
  if ((first.folded_tp > 1 && target.tp > 1) || first.mpu_tp) {
    return PlanFoldedReshard(index, tag_dir, stages, target);
  }
  if (stages.front().folded_tp > 1 && target.pp != 1) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "AutoEP with AutoTP (DeepSpeed's folded layout) "
                               "to pp=" +
                               std::to_string(target.pp) +
                               ": DeepSpeed runs AutoEP in no pipeline");
  }
  UCP_ASSIGN_OR_RETURN(const uint32_t ep, CheckMoeTarget(index, stages.front(), target));
  OutputPlan plan;
  if (target.pp != stages.size()) {
    UCP_ASSIGN_OR_RETURN(const std::vector<IndexFacts> restaged,
                         RestageStages(index, stages, target.pp, ep, target.partition));
    for (const IndexFacts& facts : restaged) {
      UCP_ASSIGN_OR_RETURN(const MoeLayout at, LayoutAtTarget(facts, target.dp, ep));
      UCP_RETURN_IF_ERROR(PlanModelStates(index, tag_dir, facts, stages, at, plan));
      UCP_RETURN_IF_ERROR(PlanExpertFiles(index, tag_dir, facts, at, plan));
      UCP_RETURN_IF_ERROR(PlanOptimStates(index, tag_dir, facts, at, plan));
    }
    return plan;
  }
  // At a fixed pp each stage's files are a pp = 1 tag's, resharded alike.
  for (const IndexFacts& facts : stages) {
    UCP_ASSIGN_OR_RETURN(const MoeLayout at, LayoutAtTarget(facts, target.dp, ep));
    UCP_RETURN_IF_ERROR(PlanModelStates(index, tag_dir, facts, {}, at, plan));
    UCP_RETURN_IF_ERROR(PlanExpertFiles(index, tag_dir, facts, at, plan));
    UCP_RETURN_IF_ERROR(PlanOptimStates(index, tag_dir, facts, at, plan));
  }
  return plan;
}

Result<OutputPlan> DeepSpeedMoeAdapter::PlanUniversalExport(const AtomIndex& index,
                                                            const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const std::vector<IndexFacts> stages, ReadFacts(index));
  const IndexFacts& facts = stages.front();
  if (!facts.fused) {
    return Status::Unsupported(
        Prefix(tag_dir) +
        "a DeepSpeed-MoE tag: DeepSpeed's universal checkpoint has no layout for expert "
        "parallelism (ds_to_universal fails on these tags, deepspeedai/DeepSpeed#5716); reshard "
        "it (`ucp reshard`) or resume it under the preload instead");
  }
  return PlanAutoEpUniversalExport(index, tag_dir, facts);
}

}  // namespace ucp
