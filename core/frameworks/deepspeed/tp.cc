#include "core/frameworks/deepspeed/tp.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <tuple>
#include <utility>

#include "core/format/torch_archive_reader.h"
#include "core/format/torch_archive_writer.h"
#include "core/frameworks/deepspeed/autotp.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/frameworks/deepspeed/megatron_rules.h"
#include "core/frameworks/deepspeed/tp_shards.h"
#include "core/plan/copy_plan.h"
#include "core/tag/file_hashing.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using deepspeed::AddSliceFragments;
using deepspeed::AddUniversalModuleTensors;
using deepspeed::AnyMatch;
using deepspeed::AppendSliceSegments;
using deepspeed::AutoTpMaps;
using deepspeed::AutoTpSplitRule;
using deepspeed::Bf16Prefix;
using deepspeed::BoundsText;
using deepspeed::CheckIndexAdapter;
using deepspeed::CheckOptimStates;
using deepspeed::CheckZeroOptimizerStage;
using deepspeed::ChoosePartition;
using deepspeed::ChosenPartition;
using deepspeed::CollectGroupRequiresGrad;
using deepspeed::CollectStorages;
using deepspeed::DpWorldSize;
using deepspeed::ExpectedMappings;
using deepspeed::Field;
using deepspeed::FieldError;
using deepspeed::FileName;
using deepspeed::FileTensor;
using deepspeed::Geometry;
using deepspeed::GeometryAt;
using deepspeed::GroupLayout;
using deepspeed::GroupSettings;
using deepspeed::HasAutoTpMaps;
using deepspeed::InOptimizerOrder;
using deepspeed::InRoundRobinOrder;
using deepspeed::IntField;
using deepspeed::kAlignmentFactor;
using deepspeed::kLayerRole;
using deepspeed::kModelRole;
using deepspeed::kOptimRole;
using deepspeed::kOsd;
using deepspeed::kUniversalRole;
using deepspeed::LayerStatesName;
using deepspeed::ListTag;
using deepspeed::ListTagToRead;
using deepspeed::LocalShape;
using deepspeed::MapFromJson;
using deepspeed::MapJson;
using deepspeed::MapsAtDegree;
using deepspeed::ModelStates;
using deepspeed::ModelStatesName;
using deepspeed::NumberedLayer;
using deepspeed::OpenSource;
using deepspeed::OpenWrittenModelStates;
using deepspeed::OptimFilePrefix;
using deepspeed::OptimGroup;
using deepspeed::OptimName;
using deepspeed::OptimStates;
using deepspeed::OptionalField;
using deepspeed::OrderStatesAs;
using deepspeed::PaddedVocab;
using deepspeed::ParseFileName;
using deepspeed::Partition;
using deepspeed::Partitioning;
using deepspeed::PartitionMethod;
using deepspeed::Patterns;
using deepspeed::Piece;
using deepspeed::Pieces;
using deepspeed::PlanPartitionedOptimFile;
using deepspeed::PlanRankPart;
using deepspeed::Prefix;
using deepspeed::RankFile;
using deepspeed::RankGroupPart;
using deepspeed::ReadAutoTpMaps;
using deepspeed::ReadAutoTpSplitRule;
using deepspeed::ReadModelStates;
using deepspeed::ReadOptimStates;
using deepspeed::ReadPatterns;
using deepspeed::ReadRange;
using deepspeed::ReadVocab;
using deepspeed::RefuseElasticForm;
using deepspeed::RefuseExpertParallel;
using deepspeed::Resolve;
using deepspeed::Resolved;
using deepspeed::RewrittenPartitionFields;
using deepspeed::Rule;
using deepspeed::SaysTensorParallel;
using deepspeed::SetAutoTpSize;
using deepspeed::SetDictItem;
using deepspeed::SetMegatronTopology;
using deepspeed::SetTpDegree;
using deepspeed::ShapeText;
using deepspeed::ShardMap;
using deepspeed::SizeNode;
using deepspeed::SliceFlatSegments;
using deepspeed::SliceSegments;
using deepspeed::StageOfLayer;
using deepspeed::StateTemplates;
using deepspeed::StateTemplatesOf;
using deepspeed::StateTensor;
using deepspeed::TagListing;
using deepspeed::TagName;
using deepspeed::TargetGroup;
using deepspeed::TargetGroupAt;
using deepspeed::TensorsAlike;
using deepspeed::TpLayerStatesName;
using deepspeed::TypeMethods;
using deepspeed::UniversalAtomArchive;
using deepspeed::UniversalModuleAtomArchive;
using deepspeed::UniversalOptimizerState;
using deepspeed::VersionAtLeast;
using deepspeed::Vocab;
using deepspeed::WrittenRankZeroModelStates;
using pickle::Kind;
using pickle::Value;

constexpr std::string_view kBf16Optimizer = "BF16_Optimizer";
constexpr std::string_view kZeroOptimizer = "DeepSpeedZeroOptimizer";
constexpr std::string_view kInfo = deepspeed::kUniversalCheckpointInfo;
// PipelineModule's name prefix of a tied module's parameters: tied_modules.<key>.<name>.
constexpr std::string_view kTiedPrefix = "tied_modules.";
constexpr char kZero3Refusal[] = "zero_stage=3: ZeRO-3 with tensor parallelism is not supported";
// The model states of TP ranks > 0: copied unchanged by the universal export.
constexpr std::string_view kCopiedModelRole = "model_states_copy";
// Bounds a corrupt mp_world_size before it sizes the per-rank file lists.
constexpr int64_t kMaxTpWorldSize = int64_t{1} << 16;

// ---------------------------------------------------------------------------------------------
// The files of a tag, read.

// A parameter's module tensor (its bit16 atom's source) and the file holding it: the model
// states, or in a pipeline tag the layer file of its layer and TP rank.
struct ModuleTensor {
  const TorchTensor* tensor = nullptr;
  std::string file;  // its name in the tag
  std::string path;
  std::string key;  // its name in the file's state_dict
};

// One TP rank's model states: its mp_world_size and module tensors besides the ZeRO-1/2 facts.
struct TpModelStates : ModelStates {
  uint32_t mp = 0;
  std::map<std::string, ModuleTensor> module;
};

Result<TpModelStates> ReadTpModelStates(const std::string& tag_dir, const std::string& name) {
  UCP_ASSIGN_OR_RETURN(ModelStates base, ReadModelStates(tag_dir, name));
  TpModelStates ms{std::move(base), 0, {}};
  const TorchArchiveReader& r = ms.reader;
  UCP_ASSIGN_OR_RETURN(const int64_t mp, IntField(r, "mp_world_size"));
  if (mp < 1 || mp > kMaxTpWorldSize) {
    return FieldError(r, "mp_world_size", std::to_string(mp) + " is not in [1, 65536]");
  }
  ms.mp = static_cast<uint32_t>(mp);
  if (const Value* node = OptionalField(r, "module")) {
    for (const auto& [key, value] : NamedChildren(node))
      ms.module[key] = {r.TensorAt(value), name, r.path(), "module/" + key};
  }
  return ms;
}

// AutoTP at a TP degree above the model's key/value head count leaves a rank empty slices of its
// attention layers, and ZeRO leaves those out of the rank's parameter groups. kUnsupported naming
// the first parameter of `names` (group g of another TP rank) that `ms` holds as an empty slice
// outside its group g.
Status RefuseEmptySlices(const TpModelStates& ms, size_t g, const std::vector<std::string>& names) {
  const std::vector<std::string>& held = ms.groups[g].names;
  for (const std::string& name : names) {
    const auto module = ms.module.find(name);
    if (std::find(held.begin(), held.end(), name) != held.end() || module == ms.module.end() ||
        module->second.tensor == nullptr || module->second.tensor->numel() != 0) {
      continue;
    }
    return Status::Unsupported(
        Prefix(ms.reader.path()) + "module/" + name + ": an empty slice " +
        ShapeText(module->second.tensor->shape) + ", left out of param_shapes/" +
        std::to_string(g) +
        " (AutoTP at a TP degree above the model's key/value head count); ucp reads no empty "
        "slices, and DeepSpeed's ds_to_universal fails on such a save");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// A whole tag.

// One pipeline stage of a tag (the whole tag when pp = 1): its TP ranks' files.
struct TpTag {
  std::vector<TpModelStates> models;            // by TP rank
  std::vector<std::vector<OptimStates>> optim;  // [tp][dp]
};

// Which tensor of a parameter: the fp32 master, optimizer state s, or the module's.
constexpr int kFp32 = -1;
constexpr int kBit16 = -2;

// The bytes of TP rank t's slice of parameter k of group g, in its own order.
Result<std::string> SliceBytes(const TpTag& tag, size_t t, size_t g, size_t k, int which) {
  const TpModelStates& ms = tag.models[t];
  const GroupLayout& layout = ms.groups[g];
  if (which == kBit16) {
    const ModuleTensor& module = ms.module.at(layout.names[k]);
    return ReadRange(module.path, module.tensor->file_offset(), module.tensor->byte_size());
  }
  UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(layout.total, ms.dp));
  std::string out;
  for (const Piece& piece : Pieces(layout, k, p)) {
    const OptimStates& os = tag.optim[t][piece.rank];
    const TorchTensor* tensor =
        which == kFp32 ? os.groups[g].fp32 : os.groups[g].states[static_cast<size_t>(which)].tensor;
    const uint64_t item = ItemSize(tensor->dtype);
    UCP_ASSIGN_OR_RETURN(std::string bytes,
                         ReadRange(os.reader.path(), tensor->file_offset() + piece.at * item,
                                   (piece.end - piece.begin) * item));
    out += bytes;
  }
  return out;
}

// ds_to_universal's average of identical float32 slices (sum(slices) / len(slices): 0 + s0 +
// s1 + ..., then one division) reproduces the slice bit for bit.
bool MeanIsSlice(const std::string& slice, uint32_t tp) {
  for (size_t i = 0; i + 4 <= slice.size(); i += 4) {
    float x;
    std::memcpy(&x, slice.data() + i, 4);
    float sum = 0.0f + x;
    for (uint32_t t = 1; t < tp; ++t) sum += x;
    const float mean = sum / static_cast<float>(tp);
    if (std::bit_cast<uint32_t>(mean) != std::bit_cast<uint32_t>(x)) return false;
  }
  return true;
}

// Compares every TP rank's slices of a parameter no split covers with rank 0's; the state whose
// slices differ, or nullopt.
Result<std::optional<std::string>> DifferingState(const TpTag& tag, size_t g, size_t k,
                                                  bool averaged) {
  const OptimStates& first = tag.optim[0][0];
  std::vector<std::pair<int, std::string>> which = {{kFp32, "fp32"}, {kBit16, "bit16"}};
  for (size_t s = 0; s < first.groups[g].states.size(); ++s) {
    if (!first.groups[g].states[s].tensor->shape.empty()) {
      which.emplace_back(static_cast<int>(s), first.groups[g].states[s].key);
    }
  }
  for (const auto& [w, state] : which) {
    UCP_ASSIGN_OR_RETURN(const std::string reference, SliceBytes(tag, 0, g, k, w));
    for (size_t t = 1; t < tag.models.size(); ++t) {
      UCP_ASSIGN_OR_RETURN(const std::string other, SliceBytes(tag, t, g, k, w));
      if (other != reference) return std::optional<std::string>(state);
    }
    if (averaged && w != kBit16) {
      const TorchTensor* tensor =
          w == kFp32 ? first.groups[g].fp32 : first.groups[g].states[static_cast<size_t>(w)].tensor;
      if (tensor->dtype != DType::kFloat32 ||
          !MeanIsSlice(reference, static_cast<uint32_t>(tag.models.size()))) {
        return std::optional<std::string>(state + " (its mean is not the slice itself)");
      }
    }
  }
  return std::optional<std::string>();
}

// ---------------------------------------------------------------------------------------------
// What an index says.

struct IndexFacts {
  uint32_t dp = 0;
  uint32_t tp = 0;
  uint32_t pp = 1;
  bool bf16_optimizer = false;
  std::string prefix;
  uint32_t model_file = 0;
  uint32_t optim_file = 0;
  std::optional<Vocab> vocab;
  std::map<std::string, ShardMap> maps;
  // AutoTP (DeepSpeed 0.19): the maps are its affine map's, which the target's model states get
  // at the target's degree; and the parameters vocabulary_parameter_patterns names.
  bool autotp = false;
  std::set<std::string> vocabulary;
  // DeepSpeed's ZeRO optimizer with round_robin_gradients: its flat buffers round-robin over the
  // DP ranks (TargetGroups lays them out so at the target's).
  bool round_robin = false;
  // Parameter names: the optimizer's own order (the flat buffer's, without round robin).
  std::vector<std::vector<std::string>> groups;
  // Frozen parameters split over the TP ranks: in `module` alone, each its own storage; their
  // bit16 atoms are what the target's module entries hold.
  std::vector<std::string> frozen;
  // A pipeline tag (its module in layer files): every stage's groups, copies of pipeline-
  // replicated parameters included, and every layer file of TP rank 0 with its parameters.
  bool pipeline = false;
  bool layer_names_tp = true;  // GridTag::layer_names_tp, from adapter_state.pipeline
  std::vector<std::vector<std::vector<std::string>>> stages;  // [stage][group] → names
  struct Layer {
    uint32_t layer = 0;
    uint32_t file = 0;                          // the index's file of layer_LL-model_00
    std::map<std::string, std::string> params;  // name in the layer's state_dict → parameter
  };
  std::vector<Layer> layers;
};

// adapter_state.pipeline: {"stages": [[[names of group 0], ...], ...],
//                          "layers": [{"layer": 1, "file": 12, "params": {"<key>": "<param>"}}],
//                          "layer_names_tp": false}  (GridTag::layer_names_tp; default true)
Status ReadPipelineFacts(const AtomIndex& index, const nlohmann::json& pipeline,
                         IndexFacts& facts) {
  const Status bad = Status::Corrupt("deepspeed: index adapter_state.pipeline: malformed");
  if (!pipeline.is_object() || !pipeline.contains("stages") || !pipeline["stages"].is_array() ||
      pipeline["stages"].size() != index.contents().topology.pp || !pipeline.contains("layers") ||
      !pipeline["layers"].is_array()) {
    return bad;
  }
  facts.pipeline = true;
  if (pipeline.contains("layer_names_tp")) {  // absent in indexes of 3D tags before it was added
    if (!pipeline["layer_names_tp"].is_boolean()) return bad;
    facts.layer_names_tp = pipeline["layer_names_tp"].get<bool>();
  }
  for (const nlohmann::json& stage : pipeline["stages"]) {
    if (!stage.is_array() || stage.size() != facts.groups.size()) return bad;
    std::vector<std::vector<std::string>> groups;
    for (const nlohmann::json& group : stage) {
      if (!group.is_array()) return bad;
      std::vector<std::string> names;
      for (const nlohmann::json& name : group) {
        if (!name.is_string() || !facts.maps.contains(name.get<std::string>())) return bad;
        names.push_back(name.get<std::string>());
      }
      groups.push_back(std::move(names));
    }
    facts.stages.push_back(std::move(groups));
  }
  for (const nlohmann::json& layer : pipeline["layers"]) {
    if (!layer.is_object() || !layer.contains("layer") || !layer["layer"].is_number_unsigned() ||
        !layer.contains("file") || !layer["file"].is_number_unsigned() ||
        layer["file"].get<uint64_t>() >= index.files().size() ||
        index.files()[layer["file"].get<uint64_t>()].role != kLayerRole ||
        !layer.contains("params") || !layer["params"].is_object()) {
      return bad;
    }
    IndexFacts::Layer entry{static_cast<uint32_t>(layer["layer"].get<uint64_t>()),
                            static_cast<uint32_t>(layer["file"].get<uint64_t>()),
                            {}};
    for (const auto& [key, param] : layer["params"].items()) {
      if (!param.is_string() || !facts.maps.contains(param.get<std::string>())) return bad;
      entry.params[key] = param.get<std::string>();
    }
    facts.layers.push_back(std::move(entry));
  }
  return Status::Ok();
}

// A round-robin tag's groups, read in their flat order, put in the optimizer's own order: each
// stage's, and the groups over all stages, each parameter where the first stage that lists it
// does (its owner).
void PutInOptimizerOrder(IndexFacts& facts) {
  if (!facts.pipeline) {
    for (std::vector<std::string>& names : facts.groups) names = InOptimizerOrder(names, facts.dp);
    return;
  }
  for (std::vector<std::vector<std::string>>& stage : facts.stages) {
    for (std::vector<std::string>& names : stage) names = InOptimizerOrder(names, facts.dp);
  }
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    const std::set<std::string> owned(facts.groups[g].begin(), facts.groups[g].end());
    std::set<std::string> placed;
    std::vector<std::string> names;
    for (const std::vector<std::vector<std::string>>& stage : facts.stages) {
      for (const std::string& name : stage[g]) {
        if (owned.contains(name) && placed.insert(name).second) names.push_back(name);
      }
    }
    facts.groups[g] = std::move(names);
  }
}

Result<IndexFacts> ReadFacts(const AtomIndex& index) {
  const AtomIndexContents& c = index.contents();
  UCP_RETURN_IF_ERROR(CheckIndexAdapter(index, DeepSpeedTpAdapter::kName));
  IndexFacts facts;
  facts.dp = c.topology.dp;
  facts.tp = c.topology.tp;
  facts.pp = c.topology.pp;
  const nlohmann::json& state = c.adapter_state;
  const Status bad = Status::Corrupt(
      "deepspeed: index adapter_state: optimizer, file_prefix or tp missing or mistyped");
  if (!state.is_object() || !state.contains("optimizer") || !state["optimizer"].is_string() ||
      !state.contains("file_prefix") || !state["file_prefix"].is_string() ||
      !state.contains("tp") || !state["tp"].is_object()) {
    return bad;
  }
  facts.bf16_optimizer = state["optimizer"].get<std::string>() == kBf16Optimizer;
  UCP_ASSIGN_OR_RETURN(facts.prefix, OptimFilePrefix(state));
  const nlohmann::json& tp = state["tp"];
  if (!tp.contains("degree") || !tp["degree"].is_number_unsigned() ||
      tp["degree"].get<uint64_t>() != facts.tp || !tp.contains("params") ||
      !tp["params"].is_object()) {
    return Status::Corrupt(
        "deepspeed: index adapter_state.tp: degree or params missing, or a "
        "degree other than the topology's");
  }
  if (tp.contains("vocab")) {
    const nlohmann::json& v = tp["vocab"];
    if (!v.is_object() || !v.contains("original") || !v["original"].is_number_unsigned() ||
        !v.contains("padded") || !v["padded"].is_number_unsigned() || !v.contains("divisible_by") ||
        !v["divisible_by"].is_number_unsigned() || v["divisible_by"].get<uint64_t>() == 0) {
      return Status::Corrupt("deepspeed: index adapter_state.tp.vocab: malformed");
    }
    facts.vocab = Vocab{v["original"].get<uint64_t>(), v["padded"].get<uint64_t>(),
                        v["divisible_by"].get<uint64_t>()};
  }
  if (tp.contains("autotp")) {
    const nlohmann::json& autotp = tp["autotp"];
    if (!autotp.is_object() || !autotp.contains("vocabulary") || !autotp["vocabulary"].is_array()) {
      return Status::Corrupt("deepspeed: index adapter_state.tp.autotp: no vocabulary list");
    }
    facts.autotp = true;
    for (const nlohmann::json& name : autotp["vocabulary"]) {
      if (!name.is_string()) {
        return Status::Corrupt("deepspeed: index adapter_state.tp.autotp.vocabulary: not names");
      }
      facts.vocabulary.insert(name.get<std::string>());
    }
  }
  for (const auto& [name, json] : tp["params"].items()) {
    UCP_ASSIGN_OR_RETURN(ShardMap map, MapFromJson(name, json));
    if (map.vocab && !facts.vocab) {
      return Status::Corrupt("deepspeed: index adapter_state.tp: vocabulary parameter " + name +
                             " without tp.vocab");
    }
    facts.maps.emplace(name, std::move(map));
  }
  if (tp.contains("frozen")) {
    for (const nlohmann::json& name : tp["frozen"]) {
      if (!name.is_string() || !facts.maps.contains(name.get<std::string>()) ||
          index.Find(name.get<std::string>(), "bit16") == nullptr) {
        return Status::Corrupt(
            "deepspeed: index adapter_state.tp.frozen: not parameters with a shard map and a "
            "bit16 atom");
      }
      facts.frozen.push_back(name.get<std::string>());
    }
  }
  UCP_ASSIGN_OR_RETURN(const StateTemplates templates, StateTemplatesOf(index));
  facts.model_file = templates.model_file;
  facts.optim_file = templates.optim_file;
  for (const ParamGroup& group : c.groups) {
    for (const std::string& name : group.params) {
      if (!facts.maps.contains(name)) {
        return Status::Corrupt("deepspeed: index adapter_state.tp.params: no shard map of " + name);
      }
      if (index.Find(name, "fp32") == nullptr || index.Find(name, "bit16") == nullptr) {
        return Status::Corrupt("deepspeed: index: no fp32 or bit16 atom of " + name);
      }
    }
    facts.groups.push_back(group.params);
  }
  if (const auto round_robin = state.find("round_robin_gradients"); round_robin != state.end()) {
    if (!round_robin->is_boolean()) {
      return Status::Corrupt("deepspeed: index adapter_state.round_robin_gradients: not a bool");
    }
    facts.round_robin = round_robin->get<bool>();
  }
  if (state.contains("pipeline")) {
    UCP_RETURN_IF_ERROR(ReadPipelineFacts(index, state["pipeline"], facts));
  } else if (facts.pp != 1) {
    return Status::Corrupt("deepspeed: index adapter_state: pp=" + std::to_string(facts.pp) +
                           " without pipeline");
  }
  if (facts.round_robin) PutInOptimizerOrder(facts);
  return facts;
}

// The groups of one target stage (`names`: per group, its parameters in flat order) at
// (target.tp, target.dp) for TP rank t; `facts` at target.tp (AutoTpFactsAt).
Result<std::vector<TargetGroup>> TargetGroups(const AtomIndex& index, const IndexFacts& facts,
                                              const std::vector<std::vector<std::string>>& stage,
                                              const Topology& target, uint32_t t) {
  std::vector<TargetGroup> out;
  for (const std::vector<std::string>& names : stage) {
    UCP_ASSIGN_OR_RETURN(
        TargetGroup group,
        TargetGroupAt(index, facts.maps, facts.vocab,
                      facts.round_robin ? InRoundRobinOrder(names, target.dp) : names, target.tp, t,
                      target.dp));
    out.push_back(std::move(group));
  }
  return out;
}

// An AutoTP tag's facts at TP degree `tp`: each split parameter's blocks there, as AutoTP splits
// it by `rule` (MapsAtDegree). Only the maps change: the atoms are the whole parameters.
Result<IndexFacts> AutoTpFactsAt(const AtomIndex& index, const IndexFacts& facts, uint32_t tp,
                                 const AutoTpSplitRule& rule) {
  IndexFacts out = facts;
  UCP_RETURN_IF_ERROR(MapsAtDegree(index, facts.tp, tp, rule, out.maps));
  return out;
}

// Whether every TP rank of `stage` holds module entry `name` alike (shape, dtype and bytes): a
// buffer or a frozen parameter each rank keeps whole; false for one split over them.
Result<bool> ModuleSlicesAlike(const TpTag& stage, const std::string& name) {
  const ModuleTensor& first = stage.models[0].module.at(name);
  std::vector<FileTensor> copies = {{first.path, first.tensor}};
  for (size_t t = 1; t < stage.models.size(); ++t) {
    const auto it = stage.models[t].module.find(name);
    if (it == stage.models[t].module.end() || it->second.tensor == nullptr) {
      return FieldError(stage.models[t].reader, "module/" + name,
                        "missing (" + first.file + " holds it)");
    }
    copies.push_back({it->second.path, it->second.tensor});
  }
  return TensorsAlike(copies);
}

// Whether a model-states file holds the client's universal_checkpoint_info.
bool CarriesRules(const TorchArchiveReader& model_states) {
  const Value* info = OptionalField(model_states, kInfo);
  return info != nullptr && info->kind() == Kind::kDict;
}

// ZeRO-3 tags are not this adapter's.
Status RefuseListing(const std::string& tag_dir, const TagListing& listing) {
  if (!listing.zero3_model_states.empty()) {
    return Status::Unsupported(Prefix(tag_dir) + kZero3Refusal);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// A tag read whole: its grid of pp pipeline stages × tp TP ranks × dp DP ranks.

struct LayerFile {
  TorchArchiveReader reader;
  std::map<std::string, const TorchTensor*> tensors;  // the layer's state_dict
};

struct GridTag {
  uint32_t tp = 1;
  uint32_t pp = 1;
  uint32_t dp = 0;
  // DeepSpeed 0.19's AutoTP: the splits are in universal_checkpoint_info/affine_map, uneven ones
  // too (TP ranks' slices of other shapes).
  bool autotp = false;
  std::string prefix;                    // of the optimizer files: "" or "bf16_"
  std::vector<TpTag> stages;             // by pipeline stage
  std::vector<std::string> layer_names;  // pipeline: every layer file, sorted
  // Whether the layer files name their TP rank (layer_LL-model_TT-model_states.pt, Megatron's
  // grid with a model axis) or not (layer_LL-model_states.pt: PipelineModule's own grid, whose
  // only axes are pipe and data, so tp = 1).
  bool layer_names_tp = true;
  std::map<std::string, LayerFile> layer_files;  // pipeline: those read, by name
  // Where each parameter's atoms come from: (stage, group, position in the group's flat order).
  std::map<std::string, std::tuple<uint32_t, size_t, size_t>> owner;
};

// DeepSpeed's pipeline grid (PipeModelDataParallelTopology, axes pipe, data, model) numbers the
// model-states and optimizer files of stage s and TP rank t as mp rank s·tp + t.
uint32_t MpRank(uint32_t s, uint32_t t, uint32_t tp) { return s * tp + t; }

// The name of layer `layer`'s file of TP rank t in a tag whose layer files do (named_tp) or do
// not name their TP rank.
std::string LayerFileName(bool named_tp, uint32_t layer, uint32_t t) {
  return named_tp ? TpLayerStatesName(layer, t) : LayerStatesName(layer);
}

// The TP degree a pipeline tag's layer files name: one past their highest TT where they are
// layer_LL-model_TT-model_states.pt, 1 where none names a TP rank (`named_tp` false); nullopt
// without layer files (pp = 1: mp_world_size is the TP degree).
Result<std::optional<uint32_t>> LayerFileTpDegree(const std::string& tag_dir,
                                                  const TagListing& listing, bool& named_tp) {
  std::optional<uint32_t> degree;
  size_t unnamed = 0;
  for (const std::string& name : listing.layer_files) {
    const std::optional<FileName> parsed = ParseFileName(name);
    if (parsed && parsed->model_rank) {
      degree = std::max(degree.value_or(0), *parsed->model_rank + 1);
    } else {
      ++unnamed;
    }
    if (unnamed > 0 && degree) {
      return Status::Unsupported(Prefix(tag_dir + "/" + name) +
                                 "layer files with a TP rank (layer_LL-model_TT-model_states.pt) "
                                 "and without one (layer_LL-model_states.pt): files of two grids");
    }
  }
  named_tp = unnamed == 0;
  if (unnamed > 0) return std::optional<uint32_t>{1};
  return degree;
}

// The grid's degrees from rank 0's model states and the layer files' names, checked against
// what the tag can be read as.
Status ReadGridShape(const std::string& tag_dir, const TagListing& listing,
                     const TpModelStates& ms0, GridTag& grid) {
  grid.autotp = HasAutoTpMaps(ms0.reader);
  UCP_ASSIGN_OR_RETURN(const std::optional<uint32_t> layer_tp,
                       LayerFileTpDegree(tag_dir, listing, grid.layer_names_tp));
  if (grid.autotp && layer_tp) {
    return Status::Unsupported(Prefix(ms0.reader.path()) + std::string(kInfo) +
                               "/affine_map: AutoTP beside pipeline layer files is not supported");
  }
  const uint32_t mp = ms0.mp;
  grid.tp = layer_tp.value_or(mp);
  if (mp % grid.tp != 0) {
    return FieldError(ms0.reader, "mp_world_size",
                      std::to_string(mp) + " is not a multiple of the " + std::to_string(grid.tp) +
                          " TP ranks the layer files name");
  }
  grid.pp = mp / grid.tp;
  grid.dp = ms0.dp;
  if (const Value* node = OptionalField(ms0.reader, "args/tensor_model_parallel_size")) {
    if (node->kind() == Kind::kInt && node->AsInt64() != int64_t{grid.tp}) {
      return FieldError(ms0.reader, "args/tensor_model_parallel_size",
                        std::to_string(node->AsInt64().value_or(0)) + ", but the files are of " +
                            std::to_string(grid.tp) + " TP ranks");
    }
  }
  // A pipeline needs no rules to change its pp and dp; without them tp stays 1 (PlanReshard).
  if (grid.tp == 1 && !layer_tp && !CarriesRules(ms0.reader)) {
    return Status::Unsupported(Prefix(ms0.reader.path()) +
                               "TP degree 1 without universal_checkpoint_info: no rules to split "
                               "it over TP ranks by (the deepspeed-zero12 adapter reads such "
                               "tags)");
  }
  if (ms0.config_stage && *ms0.config_stage >= 3) {
    return Status::Unsupported(Prefix(tag_dir) + kZero3Refusal);
  }
  return Status::Ok();
}

// Every stage's TP ranks' model states (`ms0` the first), checked to be of one save and, within
// a stage, of the same parameters.
Status ReadGridModels(const std::string& tag_dir, const TagListing& listing, TpModelStates ms0,
                      GridTag& grid) {
  const uint32_t mp = ms0.mp;
  for (const auto& [rank, name] : listing.model_states) {
    if (rank >= mp) {
      return Status::Corrupt(Prefix(tag_dir + "/" + name) + "mp rank " + std::to_string(rank) +
                             " >= mp_world_size " + std::to_string(mp) + " of " + ms0.name +
                             " (a file of another save)");
    }
  }
  grid.stages.resize(grid.pp);
  for (uint32_t s = 0; s < grid.pp; ++s) {
    std::vector<TpModelStates>& models = grid.stages[s].models;
    models.reserve(grid.tp);  // models.front() stays valid while the other ranks are added
    for (uint32_t t = 0; t < grid.tp; ++t) {
      if (s == 0 && t == 0) {
        models.push_back(std::move(ms0));
        continue;
      }
      const uint32_t rank = MpRank(s, t, grid.tp);
      if (!listing.model_states.contains(rank)) {
        return Status::NotFound(Prefix(tag_dir + "/" + ModelStatesName(rank)) +
                                "not found (mp_world_size " + std::to_string(mp) + " in " +
                                grid.stages[0].models[0].name + ")");
      }
      UCP_ASSIGN_OR_RETURN(TpModelStates ms,
                           ReadTpModelStates(tag_dir, listing.model_states.at(rank)));
      const TpModelStates& first = grid.stages[0].models[0];
      if (ms.dp != first.dp || ms.mp != first.mp || ms.ds_version != first.ds_version) {
        return FieldError(ms.reader, "dp_world_size",
                          "dp_world_size, mp_world_size or ds_version differ from " + first.name +
                              " (a file of another save)");
      }
      if (ms.groups.size() != first.groups.size()) {
        return FieldError(ms.reader, "param_shapes", "other parameter groups than " + first.name);
      }
      if (t > 0) {  // the TP ranks of a stage hold slices of the same parameters
        // AutoTP's uneven slices differ in shape: BuildIndex checks each against its map.
        const TpModelStates& stage_first = models.front();
        for (size_t g = 0; g < ms.groups.size(); ++g) {
          const bool other_names = ms.groups[g].names != stage_first.groups[g].names;
          if (other_names && grid.autotp) {
            UCP_RETURN_IF_ERROR(RefuseEmptySlices(ms, g, stage_first.groups[g].names));
          }
          if (other_names ||
              (!grid.autotp && ms.groups[g].shapes != stage_first.groups[g].shapes)) {
            return FieldError(ms.reader, "param_shapes/" + std::to_string(g),
                              "other parameters or slice shapes than " + stage_first.name);
          }
        }
      }
      models.push_back(std::move(ms));
    }
  }

  return Status::Ok();
}

// Every (stage, TP rank, DP rank)'s optimizer file, by its name's ranks.
Status ReadGridOptims(const std::string& tag_dir, const TagListing& listing, GridTag& grid) {
  const uint32_t mp = grid.tp * grid.pp;
  if (listing.optim.empty()) {
    return Status::NotFound(Prefix(tag_dir) + "no zero_pp_rank_*_optim_states.pt files");
  }
  grid.prefix = listing.optim.front().prefix;
  std::map<std::pair<uint32_t, uint32_t>, const RankFile*> by_rank;  // (mp, dp)
  for (const RankFile& entry : listing.optim) {
    if (entry.prefix != grid.prefix) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "name: prefix \"" + entry.prefix +
                             "\", but " + listing.optim.front().name + " has \"" + grid.prefix +
                             "\" (files of two saves)");
    }
    if (entry.dp >= grid.dp || entry.mp >= mp) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "rank (dp " +
                             std::to_string(entry.dp) + ", mp " + std::to_string(entry.mp) +
                             ") outside dp_world_size " + std::to_string(grid.dp) +
                             " × mp_world_size " + std::to_string(mp) + " of " +
                             grid.stages[0].models[0].name + " (a file of another save)");
    }
    by_rank[{entry.mp, entry.dp}] = &entry;
  }
  for (uint32_t s = 0; s < grid.pp; ++s) {
    TpTag& stage = grid.stages[s];
    for (uint32_t t = 0; t < grid.tp; ++t) {
      const uint32_t rank = MpRank(s, t, grid.tp);
      stage.optim.emplace_back();
      for (uint32_t r = 0; r < grid.dp; ++r) {
        const auto it = by_rank.find({rank, r});
        if (it == by_rank.end()) {
          return Status::NotFound(Prefix(tag_dir + "/" + OptimName(grid.prefix, r, rank)) +
                                  "not found (dp_world_size " + std::to_string(grid.dp) +
                                  ", mp_world_size " + std::to_string(mp) + ")");
        }
        UCP_ASSIGN_OR_RETURN(
            OptimStates os,
            ReadOptimStates(tag_dir, *it->second, stage.models[t].groups.size(), kZero3Refusal));
        UCP_RETURN_IF_ERROR(RefuseElasticForm(os.reader, "pipeline and tensor-parallel tags"));
        stage.optim.back().push_back(std::move(os));
      }
    }
  }
  return Status::Ok();
}

// Reads every model-states and optimizer file of the grid and checks them against each other.
Result<GridTag> ReadGrid(const std::string& tag_dir, const TagListing& listing) {
  if (!listing.model_states.contains(0)) {
    return Status::NotFound(Prefix(tag_dir + "/" + ModelStatesName(0)) + "not found");
  }
  GridTag grid;
  UCP_ASSIGN_OR_RETURN(TpModelStates ms0, ReadTpModelStates(tag_dir, listing.model_states.at(0)));
  UCP_RETURN_IF_ERROR(ReadGridShape(tag_dir, listing, ms0, grid));
  UCP_RETURN_IF_ERROR(ReadGridModels(tag_dir, listing, std::move(ms0), grid));
  UCP_RETURN_IF_ERROR(ReadGridOptims(tag_dir, listing, grid));
  const OptimStates& first = grid.stages[0].optim[0][0];
  for (TpTag& stage : grid.stages) {
    for (uint32_t t = 0; t < grid.tp; ++t) {
      for (OptimStates& os : stage.optim[t]) {
        OrderStatesAs(os, first);
        UCP_RETURN_IF_ERROR(CheckOptimStates(os, stage.models[t], first));
      }
    }
  }
  grid.layer_names = listing.layer_files;
  std::sort(grid.layer_names.begin(), grid.layer_names.end());
  return grid;
}

// The stage each parameter's atoms come from: the first that lists it. A later stage may list it
// again only when pipeline_replicated_parameter_patterns names it: a tied module's copy, whose
// gradients are reduced with the first stage's; ds_to_universal takes the first stage's too.
Status AssignOwners(GridTag& grid, const std::vector<std::regex>& pipeline_replicated) {
  for (uint32_t s = 0; s < grid.pp; ++s) {
    const TpModelStates& ms = grid.stages[s].models[0];
    for (size_t g = 0; g < ms.groups.size(); ++g) {
      for (size_t k = 0; k < ms.groups[g].names.size(); ++k) {
        const std::string& name = ms.groups[g].names[k];
        const auto [it, inserted] = grid.owner.emplace(name, std::tuple{s, g, k});
        if (inserted) continue;
        const auto [owner, owner_g, owner_k] = it->second;
        const std::string field = "param_shapes/" + std::to_string(g) + "/" + name;
        if (!AnyMatch(pipeline_replicated, name)) {
          return FieldError(ms.reader, field,
                            "listed by stage " + std::to_string(owner) +
                                " too, and pipeline_replicated_parameter_patterns does not name "
                                "it");
        }
        if (owner_g != g ||
            grid.stages[owner].models[0].groups[g].shapes[owner_k] != ms.groups[g].shapes[k]) {
          return FieldError(ms.reader, field,
                            "in another group or of another shape than stage " +
                                std::to_string(owner) + "'s copy");
        }
      }
    }
  }
  return Status::Ok();
}

// "tied_modules.<key>.<name>" taken apart: (key, name); nullopt for any other name.
std::optional<std::pair<std::string, std::string>> SplitTiedName(const std::string& name) {
  const size_t dot = name.find('.', kTiedPrefix.size());
  if (!name.starts_with(kTiedPrefix) || dot == std::string::npos) return std::nullopt;
  return std::pair{name.substr(kTiedPrefix.size(), dot - kTiedPrefix.size()), name.substr(dot + 1)};
}

Result<const LayerFile*> OpenLayerFile(GridTag& grid, const std::string& tag_dir,
                                       const std::string& name) {
  const auto found = grid.layer_files.find(name);
  if (found != grid.layer_files.end()) return &found->second;
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader, TorchArchiveReader::Open(tag_dir + "/" + name));
  LayerFile file{std::move(reader), {}};
  for (const auto& [key, value] : NamedChildren(file.reader.root())) {
    if (const TorchTensor* tensor = file.reader.TensorAt(value)) file.tensors[key] = tensor;
  }
  return &grid.layer_files.emplace(name, std::move(file)).first->second;
}

// The layer-file tensors of a parameter owned by a pipeline stage: "<LL>.<name>" is <name> in
// layer LL's file; "tied_modules.<key>.<name>" is <name> in the file of the stage's tied layer,
// the one layer of the stage's span (between the neighbouring stages' numbered layers) that holds
// no numbered parameter and whose state_dict holds every name of the key.
Status AttachLayerTensors(GridTag& grid, const std::string& tag_dir) {
  std::set<std::string> present(grid.layer_names.begin(), grid.layer_names.end());
  // Numbered layers per stage, and every layer some numbered parameter names.
  std::vector<std::set<uint32_t>> numbered(grid.pp);
  std::set<uint32_t> all_numbered;
  for (const auto& [name, where] : grid.owner) {
    if (const std::optional<uint32_t> layer = NumberedLayer(name)) {
      numbered[std::get<0>(where)].insert(*layer);
      all_numbered.insert(*layer);
    }
  }
  for (uint32_t s = 0; s < grid.pp; ++s) {
    // The stage's span: past the previous stages' numbered layers, before the next stages'.
    uint64_t lo = 0;
    uint64_t hi = std::numeric_limits<uint32_t>::max();
    for (uint32_t o = 0; o < grid.pp; ++o) {
      if (numbered[o].empty() || o == s) continue;
      if (o < s) lo = std::max<uint64_t>(lo, *numbered[o].rbegin() + uint64_t{1});
      if (o > s) hi = std::min<uint64_t>(hi, *numbered[o].begin());
    }
    TpTag& stage = grid.stages[s];
    for (uint32_t t = 0; t < grid.tp; ++t) {
      TpModelStates& ms = stage.models[t];
      // Each tied key's names on this stage.
      std::map<std::string, std::vector<std::pair<std::string, std::string>>> tied;
      for (const GroupLayout& layout : ms.groups) {
        for (const std::string& name : layout.names) {
          if (std::get<0>(grid.owner.at(name)) != s) continue;
          if (const std::optional<uint32_t> layer = NumberedLayer(name)) {
            const std::string file = LayerFileName(grid.layer_names_tp, *layer, t);
            if (!present.contains(file)) {
              return Status::NotFound(Prefix(tag_dir + "/" + file) + "not found (" + ms.name +
                                      " names " + name + ")");
            }
            UCP_ASSIGN_OR_RETURN(const LayerFile* layer_file, OpenLayerFile(grid, tag_dir, file));
            const std::string key = name.substr(name.find('.') + 1);
            const auto it = layer_file->tensors.find(key);
            if (it == layer_file->tensors.end()) {
              return FieldError(layer_file->reader, key,
                                "missing (" + ms.name + " names " + name + ")");
            }
            ms.module[name] = {it->second, file, layer_file->reader.path(), key};
            continue;
          }
          const std::optional<std::pair<std::string, std::string>> split = SplitTiedName(name);
          if (!split) {
            return Status::Unsupported(Prefix(ms.reader.path()) + "param_shapes: " + name +
                                       ": neither \"<layer index>.<name>\" nor \"tied_modules."
                                       "<key>.<name>\": no layer file to find it in");
          }
          tied[split->first].emplace_back(name, split->second);
        }
      }
      for (const auto& [key, names] : tied) {
        std::vector<std::string> matches;
        for (const std::string& file : grid.layer_names) {
          const std::optional<FileName> parsed = ParseFileName(file);
          if (!parsed || parsed->model_rank.value_or(0) != t || parsed->layer < lo ||
              parsed->layer >= hi || all_numbered.contains(parsed->layer)) {
            continue;
          }
          UCP_ASSIGN_OR_RETURN(const LayerFile* layer_file, OpenLayerFile(grid, tag_dir, file));
          bool holds = true;
          for (const auto& [name, in_layer] : names) {
            holds = holds && layer_file->tensors.contains(in_layer);
          }
          if (holds) matches.push_back(file);
        }
        if (matches.size() != 1) {
          return Status::Unsupported(
              Prefix(tag_dir) + "tied module \"" + key + "\" of stage " + std::to_string(s) + ": " +
              (matches.empty() ? "no layer file"
                               : std::to_string(matches.size()) + " layer files") +
              " of the stage without numbered parameters hold its tensors; ucp cannot tell which "
              "layer it is");
        }
        const LayerFile& layer_file = grid.layer_files.at(matches.front());
        for (const auto& [name, in_layer] : names) {
          ms.module[name] = {layer_file.tensors.at(in_layer), matches.front(),
                             layer_file.reader.path(), in_layer};
        }
      }
    }
  }
  return Status::Ok();
}

// A pipeline's layer files keep their entries that are no trained parameter (buffers, frozen
// parameters) per TP rank; a reshard carries TP rank 0's to every TP rank. Refused, naming the
// entry, where another TP rank's differs: a frozen parameter split over the TP ranks.
Status RefuseSplitLayerEntries(GridTag& grid, const std::string& tag_dir) {
  std::map<std::string, std::set<std::string>> trained;  // layer file → its parameters' keys
  for (const TpTag& stage : grid.stages) {
    for (const TpModelStates& ms : stage.models) {
      for (const auto& [name, module] : ms.module) trained[module.file].insert(module.key);
    }
  }
  for (const std::string& file : grid.layer_names) {
    const std::optional<FileName> parsed = ParseFileName(file);
    if (!parsed || parsed->model_rank.value_or(0) != 0) continue;
    UCP_ASSIGN_OR_RETURN(const LayerFile* first, OpenLayerFile(grid, tag_dir, file));
    for (const auto& [key, tensor] : first->tensors) {
      if (trained[file].contains(key)) continue;
      UCP_ASSIGN_OR_RETURN(
          const std::string reference,
          ReadRange(first->reader.path(), tensor->file_offset(), tensor->byte_size()));
      for (uint32_t t = 1; t < grid.tp; ++t) {
        UCP_ASSIGN_OR_RETURN(
            const LayerFile* other,
            OpenLayerFile(grid, tag_dir, LayerFileName(grid.layer_names_tp, parsed->layer, t)));
        const auto it = other->tensors.find(key);
        if (it == other->tensors.end()) {
          return FieldError(other->reader, key, "missing (" + file + " holds it)");
        }
        bool alike = it->second->shape == tensor->shape && it->second->dtype == tensor->dtype;
        if (alike) {
          UCP_ASSIGN_OR_RETURN(
              const std::string bytes,
              ReadRange(other->reader.path(), it->second->file_offset(), it->second->byte_size()));
          alike = bytes == reference;
        }
        if (!alike) {
          const std::string what =
              ": not a trained parameter (a frozen parameter or a buffer), and its TP slices "
              "differ from " +
              file + "'s";
          return Status::Unsupported(
              Prefix(other->reader.path()) + key + what +
              ": frozen parameters split over the TP ranks of a pipeline are not supported");
        }
      }
    }
  }
  return Status::Ok();
}

// Outside a pipeline the model states hold the module, every group's tensors views of one flat
// buffer: its tensors rewritten in `graph` (the imported template) at TP rank t's slices of the
// target's tp, and the buffers' bytes by storage key; the frozen parameters split over TP ranks
// likewise, each in its own storage.
Result<std::map<std::string, std::vector<Segment>>> PlanModuleBuffers(
    const AtomIndex& index, const IndexFacts& facts, const TorchArchiveReader& model,
    const std::vector<TargetGroup>& groups, uint32_t t, uint32_t tp, pickle::Graph& graph) {
  std::map<std::string, std::pair<size_t, size_t>> position;  // name → (group, index)
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t k = 0; k < groups[g].layout.names.size(); ++k) {
      position[groups[g].layout.names[k]] = {g, k};
    }
  }
  std::vector<const TorchTensor*> buffer_of(groups.size(), nullptr);
  for (const auto& [name, at] : position) {
    Result<const Value*> node = model.Find("module/" + name);
    const TorchTensor* tensor = node.ok() ? model.TensorAt(*node) : nullptr;
    if (tensor == nullptr) return FieldError(model, "module/" + name, "not a tensor");
    const TorchTensor*& buffer = buffer_of[at.first];
    if (buffer != nullptr && buffer->storage->key != tensor->storage->key) {
      return Status::Unsupported(Prefix(model.path()) + "module/" + name +
                                 ": not a view of its group's flat buffer");
    }
    buffer = tensor;
  }
  Value* root = graph.root();
  Value* module = root->Get("module");
  if (module == nullptr || module->kind() != Kind::kObject) {
    return FieldError(model, "module", "not an OrderedDict");
  }
  std::map<std::string, std::vector<Segment>> replaced;
  const std::set<std::string> frozen(facts.frozen.begin(), facts.frozen.end());
  for (pickle::Mutation& mutation : module->mutable_mutations()) {
    if (mutation.op != pickle::Mutation::Op::kSetItem) continue;
    const std::string name = KeyText(mutation.first);
    if (frozen.contains(name)) {
      Result<const Value*> node = model.Find("module/" + name);
      const TorchTensor* tensor = node.ok() ? model.TensorAt(*node) : nullptr;
      const Atom* atom = index.Find(name, "bit16");
      if (tensor == nullptr) return FieldError(model, "module/" + name, "not a tensor");
      const ShardMap& map = facts.maps.at(name);
      UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                           GeometryAt(name, map, atom->shape, tp, facts.vocab, map.blocks));
      const Shape local = LocalShape(geometry, t);
      UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(local));
      TensorNodeSpec spec;
      spec.storage_key = tensor->storage->key;
      spec.dtype = tensor->dtype;
      spec.location = tensor->storage->location;
      spec.storage_numel = numel;
      spec.shape = local;
      spec.requires_grad = tensor->requires_grad;
      spec.parameter = tensor->parameter;
      UCP_ASSIGN_OR_RETURN(mutation.second, MakeTensorNode(graph, spec));
      std::vector<Segment>& segments = replaced[tensor->storage->key];
      UCP_RETURN_IF_ERROR(AppendSliceSegments(index, *atom, map, geometry, t, 0, numel, segments));
      continue;
    }
    const auto it = position.find(name);
    if (it == position.end()) continue;  // a buffer: carried
    const auto [g, k] = it->second;
    const TorchTensor& buffer = *buffer_of[g];
    TensorNodeSpec spec;
    spec.storage_key = buffer.storage->key;
    spec.dtype = buffer.dtype;
    spec.location = buffer.storage->location;
    spec.storage_numel = groups[g].partition.padded;
    spec.storage_offset = groups[g].layout.offsets[k];
    spec.shape = groups[g].layout.shapes[k];
    spec.requires_grad = buffer.requires_grad;
    spec.parameter = buffer.parameter;
    UCP_ASSIGN_OR_RETURN(mutation.second, MakeTensorNode(graph, spec));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const TargetGroup& group = groups[g];
    UCP_ASSIGN_OR_RETURN(
        std::vector<Segment> segments,
        SliceFlatSegments(index, facts.maps, group, t, "bit16", 0, group.layout.total));
    AppendZeros(segments,
                (group.partition.padded - group.layout.total) * ItemSize(buffer_of[g]->dtype));
    replaced[buffer_of[g]->storage->key] = std::move(segments);
  }
  return replaced;
}

// The model states of one target stage's TP rank t (its groups `groups`) from the template
// `model` of a tag of source_tp TP ranks (`facts` at the target's degree): dp_world_size,
// mp_world_size (tp·pp), the vocabulary's padded size, AutoTP's record of the degree where it
// changes, param_shapes of the stage's slices and, outside a pipeline, the module's flat buffers.
Result<ArchiveOutput> PlanModelStates(const AtomIndex& index, const IndexFacts& facts,
                                      uint32_t source_tp, const TorchArchiveReader& model,
                                      const std::vector<TargetGroup>& groups, uint32_t t,
                                      const Topology& target, std::string path) {
  ArchiveOutput out;
  out.path = std::move(path);
  Value* root = out.graph.Import(model.root());
  out.graph.set_root(root);
  UCP_RETURN_IF_ERROR(SetDictItem(root, "dp_world_size", out.graph.Int(target.dp), model.path()));
  UCP_RETURN_IF_ERROR(SetDictItem(root, "mp_world_size",
                                  out.graph.Int(int64_t{target.tp} * target.pp), model.path()));
  UCP_RETURN_IF_ERROR(SetMegatronTopology(out.graph, root, facts.vocab, target, model.path()));
  if (facts.autotp && target.tp != source_tp) {
    std::map<std::string, std::vector<uint64_t>> uneven;
    for (const auto& [name, map] : facts.maps) {
      if (!map.blocks.empty()) uneven.emplace(name, map.blocks);
    }
    UCP_RETURN_IF_ERROR(SetTpDegree(out.graph, root, target.tp, model, uneven));
  }
  Value* shapes = root->Get("param_shapes");
  for (size_t g = 0; g < groups.size(); ++g) {
    Value* group = shapes == nullptr ? nullptr : shapes->Item(g);
    if (group == nullptr || group->kind() != Kind::kObject) {
      return FieldError(model, "param_shapes/" + std::to_string(g), "not an OrderedDict");
    }
    std::vector<pickle::Mutation> items;
    for (size_t k = 0; k < groups[g].layout.names.size(); ++k) {
      items.push_back({pickle::Mutation::Op::kSetItem, out.graph.Str(groups[g].layout.names[k]),
                       SizeNode(out.graph, groups[g].layout.shapes[k])});
    }
    for (const pickle::Mutation& mutation : group->mutations()) {
      if (mutation.op != pickle::Mutation::Op::kSetItem) items.push_back(mutation);
    }
    group->mutable_mutations() = std::move(items);
  }
  std::map<std::string, std::vector<Segment>> replaced;
  if (!facts.pipeline) {
    UCP_ASSIGN_OR_RETURN(replaced,
                         PlanModuleBuffers(index, facts, model, groups, t, target.tp, out.graph));
  }
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, model, facts.model_file, std::move(replaced)));
  return out;
}

// The optimizer file of DP rank r of one target stage's TP rank t (its groups `groups`, target.dp
// DP ranks), from the template `reader` of a tag of source_tp TP ranks: partitions, paddings,
// partition_count, param_slice_mappings, and AutoTP's autotp_size where the degree changes.
Result<ArchiveOutput> PlanOptimFile(const AtomIndex& index, const IndexFacts& facts,
                                    uint32_t source_tp, const TorchArchiveReader& reader,
                                    const std::vector<TargetGroup>& groups, uint32_t t, uint32_t r,
                                    const Topology& target, std::string path) {
  const auto group_of = [&](size_t g) -> Result<RankGroupPart> {
    const GroupLayout& layout = groups[g].layout;
    const Partitioning& p = groups[g].partition;
    RankGroupPart group;
    group.part = PlanRankPart(p, r, layout.total, /*elastic=*/false, facts.bf16_optimizer);
    group.padding = p.padding_of(r);
    group.mappings = ExpectedMappings(layout, p, r, facts.round_robin);
    group.params = layout.names.size();
    group.segments_of = [&, g](const std::string& state, uint64_t begin, uint64_t end) {
      return SliceFlatSegments(index, facts.maps, groups[g], t, state, begin, end);
    };
    return group;
  };
  const auto edit = [&](pickle::Graph& graph, Value* root, Value*) -> Status {
    if (!facts.autotp || target.tp == source_tp) return Status::Ok();
    return SetAutoTpSize(graph, root, target.tp, reader);
  };
  return PlanPartitionedOptimFile(reader, facts.optim_file, std::move(path), /*elastic=*/false,
                                  groups.size(), group_of,
                                  std::vector<uint64_t>(groups.size(), target.dp), edit);
}

// The layer files of a pipeline tag at TP rank t of the target: each layer's state_dict from its
// TP rank 0 file, every parameter's tensor replaced by its slice at target.tp (its own storage,
// as DeepSpeed's clone before saving leaves it), other entries carried.
Status PlanLayerFiles(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                      uint32_t t, const Topology& target, OutputPlan& plan) {
  for (const IndexFacts::Layer& layer : facts.layers) {
    const std::string path = LayerFileName(facts.layer_names_tp, layer.layer, t);
    // Nothing of it is split, or its parameters whole at both degrees: the file as saved.
    if (layer.params.empty() || (facts.tp == 1 && target.tp == 1)) {
      plan.copies.push_back({path, layer.file});
      continue;
    }
    UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader, OpenSource(index, tag_dir, layer.file));
    ArchiveOutput out;
    out.path = path;
    Value* root = out.graph.Import(reader.root());
    out.graph.set_root(root);
    if (root->kind() != Kind::kObject) return FieldError(reader, "", "not an OrderedDict");
    std::map<std::string, std::vector<Segment>> replaced;
    size_t found = 0;
    for (pickle::Mutation& mutation : root->mutable_mutations()) {
      if (mutation.op != pickle::Mutation::Op::kSetItem) continue;
      const std::string key = KeyText(mutation.first);
      const auto it = layer.params.find(key);
      if (it == layer.params.end()) continue;  // a buffer: carried
      ++found;
      const std::string& name = it->second;
      UCP_ASSIGN_OR_RETURN(const Value* node, Field(reader, key));
      const TorchTensor* tensor = reader.TensorAt(node);
      const Atom* atom = index.Find(name, "bit16");
      if (tensor == nullptr || atom == nullptr) return FieldError(reader, key, "not a tensor");
      UCP_ASSIGN_OR_RETURN(
          const Geometry geometry,
          GeometryAt(name, facts.maps.at(name), atom->shape, target.tp, facts.vocab));
      UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(geometry.local));
      TensorNodeSpec spec;
      spec.storage_key = tensor->storage->key;
      spec.dtype = tensor->dtype;
      spec.location = tensor->storage->location;
      spec.storage_numel = numel;
      spec.shape = geometry.local;
      spec.requires_grad = tensor->requires_grad;
      spec.parameter = tensor->parameter;
      UCP_ASSIGN_OR_RETURN(mutation.second, MakeTensorNode(out.graph, spec));
      std::vector<Segment>& segments = replaced[tensor->storage->key];
      UCP_RETURN_IF_ERROR(SliceSegments(index, facts.maps.at(name), name, geometry, t, "bit16", 0,
                                        numel, segments));
    }
    if (found != layer.params.size()) {
      return Status::Corrupt(Prefix(reader.path()) + "holds " + std::to_string(found) + " of the " +
                             std::to_string(layer.params.size()) + " parameters the index names");
    }
    UCP_ASSIGN_OR_RETURN(out.storages,
                         CollectStorages(root, reader, layer.file, std::move(replaced)));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

using StageNames = std::vector<std::vector<std::string>>;  // per group, names in flat order

// A pipeline's layers as the checkpoint shows them, for placing them at another pp. Layers that
// hold no parameter and no file (functions) are invisible but for one: a tied module's copy on the
// last stage without a layer file (an output head tied to the embedding, as GPT's) sits past every
// visible layer, one more layer.
struct PipelineLayers {
  uint64_t count = 0;                         // visible layers, plus the tail copy's
  std::map<uint64_t, uint32_t> source_stage;  // every placed layer's stage at the source
  std::map<uint64_t, uint64_t> params;        // trainable elements per placed layer
  std::map<uint64_t, std::string> signature;  // numbered layers: parameter names and shapes
  std::map<std::string, std::set<uint64_t>> tied_layers;  // tied key → its layers
  std::vector<std::string> tied_order;                    // keys, by first appearance
};

// The key of a tied parameter's module; empty for any other name.
std::string TiedKey(const std::string& name) {
  const std::optional<std::pair<std::string, std::string>> split = SplitTiedName(name);
  return split ? split->first : std::string();
}

Result<PipelineLayers> ReadPipelineLayers(const AtomIndex& index, const IndexFacts& facts) {
  PipelineLayers out;
  std::map<std::string, uint64_t> tied_file_layer;
  for (const IndexFacts::Layer& layer : facts.layers) {
    for (const auto& [in_layer, name] : layer.params) {
      if (const std::string key = TiedKey(name); !key.empty()) tied_file_layer[key] = layer.layer;
    }
  }
  uint64_t visible = 0;
  for (const IndexFacts::Layer& layer : facts.layers)
    visible = std::max<uint64_t>(visible, layer.layer + 1);
  const uint32_t last = static_cast<uint32_t>(facts.stages.size() - 1);
  std::map<std::string, std::set<uint32_t>> tied_stages;
  for (uint32_t s = 0; s < facts.stages.size(); ++s) {
    for (const std::vector<std::string>& group : facts.stages[s]) {
      for (const std::string& name : group) {
        if (const std::string key = TiedKey(name); !key.empty()) {
          if (tied_stages[key].insert(s).second && tied_stages[key].size() == 1) {
            out.tied_order.push_back(key);
          }
          continue;
        }
        const std::optional<uint32_t> layer = NumberedLayer(name);
        if (!layer) {
          return Status::Corrupt("deepspeed: index: " + name + " is no pipeline parameter name");
        }
        const Shape& shape = index.Find(name, "fp32")->shape;
        UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
        out.source_stage[*layer] = s;
        out.params[*layer] += numel;
        out.signature[*layer] += name.substr(name.find('.')) + ShapeText(shape) + ";";
      }
    }
  }
  bool tail = false;
  for (const std::string& key : out.tied_order) {
    uint64_t numel = 0;
    for (const auto& [name, map] : facts.maps) {
      if (TiedKey(name) != key) continue;
      UCP_ASSIGN_OR_RETURN(const uint64_t more, NumElements(index.Find(name, "fp32")->shape));
      numel += more;
    }
    const auto file = tied_file_layer.find(key);
    for (const uint32_t s : tied_stages[key]) {
      if (file != tied_file_layer.end() && s == *tied_stages[key].begin()) {
        out.source_stage[file->second] = s;
        out.params[file->second] = numel;
        out.tied_layers[key].insert(file->second);
      } else if (s == last && last > 0) {
        tail = true;
        out.source_stage[visible] = s;
        out.params[visible] = numel;
        out.tied_layers[key].insert(visible);
      } else {
        return Status::Unsupported("deepspeed: tied module \"" + key + "\" on stage " +
                                   std::to_string(s) +
                                   " has no layer file to place it by at another pp");
      }
    }
  }
  out.count = visible + (tail ? 1 : 0);
  return out;
}

// A tag saved at pp = 1 with a tied module, to another pp: refused. The module's later uses (a
// TiedLayerSpec with a forward_fn: the LM head tied to the embedding) have no layer file, and on
// one stage no copy either: nothing shows which stages hold its copies at pp > 1.
Status RefuseTiedFromOneStage(const IndexFacts& facts, uint32_t pp) {
  if (facts.stages.size() != 1) return Status::Ok();
  for (const std::vector<std::string>& group : facts.groups) {
    for (const std::string& name : group) {
      if (const std::string key = TiedKey(name); !key.empty()) {
        return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": tied module \"" +
                                   key +
                                   "\" in a tag saved at pp=1, where its uses past the first "
                                   "have no layer file: the stages holding its copies at pp=" +
                                   std::to_string(pp) + " are unknown");
      }
    }
  }
  return Status::Ok();
}

// The target's stages, per stage per group its parameters in flat order. Outside a pipeline there
// is one. A pipeline keeps its stages at the source's pp. At another pp its layers are placed by
// the partition methods of DeepSpeed that reproduce the source's stages from what the checkpoint
// shows: "uniform" over the layer count, "parameters" (partition_balanced over trainable elements)
// and "type:" (partition_balanced weighting the layers of one kind, told by their parameters'
// names and shapes), only `partition`'s where the user names one; when those that reproduce it
// disagree at the target, or none does, the reshard is refused. A stage lists its tied modules'
// parameters first (each once), then its numbered layers', as PipelineModule orders them.
Result<std::vector<StageNames>> TargetStages(const AtomIndex& index, const IndexFacts& facts,
                                             uint32_t pp, LayerPartition partition) {
  if (!facts.pipeline) {
    if (pp != 1) {
      return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) +
                                 ": the tag's model is no PipelineModule (no layer files)");
    }
    return std::vector<StageNames>{facts.groups};
  }
  if (pp == facts.stages.size()) return facts.stages;
  if (pp == 1) {  // every layer on one stage, whatever placed them
    StageNames groups(facts.groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<std::string> numbered;
      for (const std::string& name : facts.groups[g]) {
        (TiedKey(name).empty() ? numbered : groups[g]).push_back(name);
      }
      groups[g].insert(groups[g].end(), numbered.begin(), numbered.end());
    }
    return std::vector<StageNames>{std::move(groups)};
  }
  UCP_RETURN_IF_ERROR(RefuseTiedFromOneStage(facts, pp));
  UCP_ASSIGN_OR_RETURN(const PipelineLayers layers, ReadPipelineLayers(index, facts));
  std::vector<PartitionMethod> methods = {{LayerPartition::kUniform, "'uniform'", {}, {}}};
  std::vector<uint64_t> by_params(layers.count, 0);
  for (const auto& [layer, numel] : layers.params) by_params[layer] = numel;
  methods.push_back({LayerPartition::kParameters, "'parameters'", by_params, by_params});
  for (PartitionMethod& method : TypeMethods(layers.signature, layers.count)) {
    methods.push_back(std::move(method));
  }
  UCP_ASSIGN_OR_RETURN(const ChosenPartition chosen,
                       ChoosePartition(layers.count, layers.source_stage, methods,
                                       static_cast<uint32_t>(facts.stages.size()), pp, partition));
  const std::vector<uint64_t>& bounds = chosen.bounds;
  const std::string& chosen_by = chosen.method;
  const auto stage_of = [&](uint64_t layer) { return StageOfLayer(bounds, layer); };
  std::vector<StageNames> stages(pp, StageNames(facts.groups.size()));
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    for (uint32_t s = 0; s < pp; ++s) {
      for (const std::string& key : layers.tied_order) {
        bool here = false;
        for (const uint64_t layer : layers.tied_layers.at(key)) here = here || stage_of(layer) == s;
        if (!here) continue;
        for (const std::string& name : facts.groups[g]) {
          if (TiedKey(name) == key) stages[s][g].push_back(name);
        }
      }
      for (const std::string& name : facts.groups[g]) {
        const std::optional<uint32_t> layer = NumberedLayer(name);
        if (layer && stage_of(*layer) == s) stages[s][g].push_back(name);
      }
    }
  }
  for (uint32_t s = 0; s < pp; ++s) {
    bool any = false;
    for (const std::vector<std::string>& group : stages[s]) any = any || !group.empty();
    if (!any) {
      return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": stage " +
                                 std::to_string(s) + " holds no parameter by the " + chosen_by +
                                 " placement " + BoundsText(bounds) +
                                 " (DeepSpeed's optimizer cannot save it)");
    }
  }
  return stages;
}

// A tensor- or pipeline-parallel tag as BuildIndex's phases read it.
struct TpIndexTag {
  GridTag grid;
  Patterns patterns;
  int64_t zero_stage = 1;
  uint32_t world = 1;  // dp × tp × pp
  // ZeRO's round_robin_gradients (DeepSpeed's BF16 optimizer ignores it): each group's flat order
  // round-robin over the DP ranks, as param_shapes lists it.
  bool round_robin = false;
};

// Each file's number in the index, by name.
using FileIndex = std::map<std::string, uint32_t>;

// Each parameter's shard map, as BuildIndex's phase 2 resolves it.
struct ShardRules {
  std::optional<AutoTpMaps> autotp;
  std::map<std::string, ShardMap> maps;
  std::map<std::string, Shape> atom_shapes;
  // Module tensors outside param_shapes split over the TP ranks (frozen parameters), indexed as
  // their bit16 atoms.
  std::vector<std::string> frozen;
  std::optional<Vocab> vocab;
};

// The index file of stage s, TP rank t, DP rank r's optimizer states: after the model states of
// every mp rank, each mp rank's DP ranks in order.
uint32_t OptimFileOf(const GridTag& grid, uint32_t s, uint32_t t, uint32_t r) {
  return grid.tp * grid.pp + MpRank(s, t, grid.tp) * grid.dp + r;
}

// Phase 1 of BuildIndex: every file of the grid read and cross-checked; each parameter's owning
// stage and, in a pipeline tag, its layer-file tensors.
Result<TpIndexTag> ReadTpTag(const std::string& tag_dir) {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  UCP_RETURN_IF_ERROR(RefuseListing(tag_dir, listing));
  TpIndexTag tag;
  UCP_ASSIGN_OR_RETURN(tag.grid, ReadGrid(tag_dir, listing));
  GridTag& grid = tag.grid;
  const TpModelStates& ms0 = grid.stages[0].models[0];
  UCP_ASSIGN_OR_RETURN(tag.patterns, ReadPatterns(ms0.reader));
  std::vector<std::regex> pipeline_replicated = tag.patterns.pipeline_replicated;
  if (!CarriesRules(ms0.reader)) {
    // Without the client's rules, the copies DeepSpeed's PipelineModule keeps of a tied module
    // (TiedLayerSpec) on each stage that holds one: the engine reduces their gradients together.
    pipeline_replicated.emplace_back(R"(tied_modules\.)");
  }
  UCP_RETURN_IF_ERROR(AssignOwners(grid, pipeline_replicated));
  if (!grid.layer_names.empty()) {
    UCP_RETURN_IF_ERROR(AttachLayerTensors(grid, tag_dir));
    UCP_RETURN_IF_ERROR(RefuseSplitLayerEntries(grid, tag_dir));
  }
  const OptimStates& first = grid.stages[0].optim[0][0];
  tag.zero_stage = ms0.config_stage.value_or(first.zero_stage.value_or(1));
  tag.round_robin = ms0.round_robin && !first.bf16_optimizer;
  const std::optional<uint64_t> world = CheckedMul(uint64_t{grid.dp}, uint64_t{grid.tp} * grid.pp);
  if (!world || *world > std::numeric_limits<uint32_t>::max()) {
    return FieldError(ms0.reader, "dp_world_size",
                      "dp_world_size × mp_world_size exceeds 4294967295");
  }
  tag.world = static_cast<uint32_t>(*world);
  return tag;
}

// Phase 2 of BuildIndex: the shard map of every parameter, from AutoTP's affine map or from the
// rules and its owning stage's slices; then the module entries outside param_shapes (buffers,
// frozen parameters): ZeRO-1/2 keeps them only in each TP rank's `module`, whole slices. Those
// every TP rank holds alike are carried with the template (at tp = 1, those no rule splits); a
// frozen parameter split over the TP ranks is indexed as its bit16 atom, to be written at the
// target's slices.
Result<ShardRules> ResolveShardRules(const std::string& tag_dir, const TpIndexTag& tag) {
  const GridTag& grid = tag.grid;
  const TpModelStates& ms0 = grid.stages[0].models[0];
  const uint32_t tp = grid.tp;
  const Patterns& patterns = tag.patterns;
  ShardRules rules;
  std::optional<AutoTpMaps>& autotp = rules.autotp;
  if (grid.autotp) {
    std::vector<std::string> names;
    for (const auto& [name, where] : grid.owner) names.push_back(name);
    UCP_ASSIGN_OR_RETURN(autotp, ReadAutoTpMaps(ms0.reader, tp, names));
  }
  std::map<std::string, ShardMap>& maps = rules.maps;
  std::map<std::string, Shape>& atom_shapes = rules.atom_shapes;
  bool any_vocab = false;
  for (const auto& [name, where] : grid.owner) {
    const auto [s, g, k] = where;
    const TpTag& stage = grid.stages[s];
    const TpModelStates& owner = stage.models[0];
    Resolved resolved;
    if (autotp) {
      resolved.map = autotp->maps.at(name);
      resolved.atom = autotp->whole_shapes.at(name);
      resolved.check_slices = resolved.map->rule == Rule::kReplicated;
    } else {
      UCP_ASSIGN_OR_RETURN(resolved,
                           Resolve(owner.reader, patterns, name, owner.groups[g].shapes[k], tp));
    }
    for (const TpModelStates& ms : stage.models) {
      const auto it = ms.module.find(name);
      if (it == ms.module.end() || it->second.tensor == nullptr) {
        return FieldError(ms.reader, "module/" + name,
                          "missing (param_shapes/" + std::to_string(g) + " names it)");
      }
      const Shape& listed = ms.groups[g].shapes[k];
      if (it->second.tensor->shape != listed || !it->second.tensor->contiguous()) {
        return Status::Corrupt(
            Prefix(it->second.path) + name + ": shape " + ShapeText(it->second.tensor->shape) +
            " or strides disagree with param_shapes " + ShapeText(listed) + " of " + ms.name);
      }
    }
    const bool averaged = resolved.map && resolved.map->rule == Rule::kAveraged;
    if (resolved.check_slices && !resolved.map && tp == 1) {
      // One slice, nothing to compare it with: whole at tp = 1, refused at tp > 1.
      resolved.map = ShardMap{};
      resolved.map->rule = Rule::kUnnamed;
    } else if (resolved.check_slices && (tp > 1 || averaged)) {
      UCP_ASSIGN_OR_RETURN(const std::optional<std::string> differing,
                           DifferingState(stage, g, k, averaged));
      if (differing && !resolved.map) {
        return Status::Unsupported(
            Prefix(tag_dir) + name + ": no rule of " + std::string(kInfo) +
            " covers this parameter and its TP slices differ (" + *differing +
            "); ds_to_universal would concatenate them on dim 0, ucp does not guess: name it "
            "in the client's universal_checkpoint_info patterns");
      }
      if (differing && resolved.map->rule == Rule::kReplicated) {
        return Status::Corrupt(Prefix(tag_dir) + name +
                               ": tp_replicated_parameter_patterns names it, but its TP slices "
                               "differ (" +
                               *differing + ")");
      }
      if (differing) {
        return Status::Unsupported(Prefix(tag_dir) + name +
                                   ": averaged over TP ranks whose slices differ (" + *differing +
                                   "): their mean is in no file; not supported");
      }
      if (!resolved.map) resolved.map = ShardMap{};
    }
    any_vocab = any_vocab || resolved.map->vocab;
    maps.emplace(name, *resolved.map);
    atom_shapes.emplace(name, std::move(resolved.atom));
  }
  // The module entries outside param_shapes.
  std::vector<std::string> candidates;  // at tp > 1 those whose slices differ; at tp = 1 all
  for (const auto& [name, module0] : ms0.module) {
    if (grid.owner.contains(name) || module0.tensor == nullptr) continue;
    if (tp > 1) {
      UCP_ASSIGN_OR_RETURN(const bool alike, ModuleSlicesAlike(grid.stages[0], name));
      if (alike) continue;
    }
    candidates.push_back(name);
  }
  std::optional<AutoTpMaps> candidate_maps;  // one read of the affine map for all of them
  if (autotp && !candidates.empty()) {
    UCP_ASSIGN_OR_RETURN(candidate_maps, ReadAutoTpMaps(ms0.reader, tp, candidates));
  }
  for (const std::string& name : candidates) {
    const ModuleTensor& module0 = ms0.module.at(name);
    Resolved resolved;
    if (candidate_maps) {
      resolved.map = candidate_maps->maps.at(name);
      resolved.atom = candidate_maps->whole_shapes.at(name);
    } else {
      UCP_ASSIGN_OR_RETURN(resolved,
                           Resolve(ms0.reader, patterns, name, module0.tensor->shape, tp));
    }
    if (!resolved.map || resolved.map->rule != Rule::kSplit || resolved.map->vocab) {
      if (tp == 1) continue;  // one slice, and no rule splits it: whole at any tp
      return Status::Unsupported(
          Prefix(module0.path) + "module/" + name +
          ": not in param_shapes (a frozen parameter or a buffer), its TP slices differ, and no "
          "rule of " +
          std::string(kInfo) + " splits it; ucp cannot place it at another size");
    }
    maps.emplace(name, *resolved.map);
    atom_shapes.emplace(name, std::move(resolved.atom));
    rules.frozen.push_back(name);
  }
  if (any_vocab) {
    UCP_ASSIGN_OR_RETURN(rules.vocab, ReadVocab(ms0.reader, patterns, tp));
  }
  return rules;
}

// Phase 3 of BuildIndex: what the index is of, and its files, hashed: model states by mp rank,
// optimizer files by (mp rank, dp rank), then the layer files. Returns each file's index.
Result<FileIndex> AddTpFiles(const std::string& tag_dir, const TpIndexTag& tag,
                             const IndexOptions& options, AtomIndexContents& c) {
  const GridTag& grid = tag.grid;
  const TpModelStates& ms0 = grid.stages[0].models[0];
  const uint32_t tp = grid.tp;
  const uint32_t pp = grid.pp;
  const uint32_t dp = grid.dp;
  const uint32_t mp = tp * pp;
  c.framework = "deepspeed";
  c.framework_version = ms0.ds_version;
  c.adapter = std::string(DeepSpeedTpAdapter::kName);
  c.adapter_schema = DeepSpeedTpAdapter::kSchema;
  c.tag = TagName(tag_dir);
  c.topology = {dp, tp, pp, tag.world, static_cast<uint32_t>(tag.zero_stage)};
  std::vector<std::string> paths;
  for (const TpTag& stage : grid.stages) {
    for (const TpModelStates& ms : stage.models) paths.push_back(ms.name);
  }
  for (const TpTag& stage : grid.stages) {
    for (const std::vector<OptimStates>& row : stage.optim) {
      for (const OptimStates& os : row) paths.push_back(os.entry.name);
    }
  }
  paths.insert(paths.end(), grid.layer_names.begin(), grid.layer_names.end());
  UCP_ASSIGN_OR_RETURN(const std::vector<FileDigest> digests,
                       HashTagFiles(tag_dir, paths, {options.threads, options.trust_journal}));
  FileIndex file_index;
  for (size_t i = 0; i < paths.size(); ++i) {
    const uint32_t at = static_cast<uint32_t>(i);
    file_index[paths[i]] = at;
    IndexedFile file{paths[i], digests[i].size, digests[i].xxh3, std::string(kLayerRole),
                     std::nullopt};
    file.chunks = digests[i].chunks;
    if (at < mp) {
      file.role = kModelRole;
      file.rank = RankCoordinates{0, at % tp, at / tp};
    } else if (at < mp + uint64_t{mp} * dp) {
      const uint32_t j = at - mp;
      file.role = kOptimRole;
      file.rank = RankCoordinates{j % dp, (j / dp) % tp, j / dp / tp};
    }
    c.files.push_back(std::move(file));
  }
  return file_index;
}

// Phase 4 of BuildIndex: the atoms of each parameter from its owning stage's files, groups in
// stage order; the frozen ones' bit16 atoms after them. `params` gets each one's shard map.
Status AddTpAtoms(const TpIndexTag& tag, const ShardRules& rules, const FileIndex& file_index,
                  AtomIndexContents& c, nlohmann::json& params) {
  const GridTag& grid = tag.grid;
  const TpModelStates& ms0 = grid.stages[0].models[0];
  const OptimStates& first = grid.stages[0].optim[0][0];
  const uint32_t tp = grid.tp;
  const uint32_t pp = grid.pp;
  const uint32_t dp = grid.dp;
  const std::map<std::string, ShardMap>& maps = rules.maps;
  const std::map<std::string, Shape>& atom_shapes = rules.atom_shapes;
  const std::optional<Vocab>& vocab = rules.vocab;
  // The bit16 atom of `name` from its TP slices in `stage`'s module tensors (rank 0's alone
  // unless split).
  const auto add_module_atom = [&](const TpTag& stage, const std::string& name, const ShardMap& map,
                                   const Geometry& geometry) -> Status {
    const ModuleTensor& module0 = stage.models[0].module.at(name);
    Atom bit16{name, "bit16", module0.tensor->dtype, geometry.atom, {}};
    const uint32_t ranks = map.rule == Rule::kSplit ? tp : 1;
    for (uint32_t t = 0; t < ranks; ++t) {
      const ModuleTensor& module = stage.models[t].module.at(name);
      if (module.tensor->dtype != bit16.dtype) {
        return Status::Corrupt(Prefix(module.path) + name + ": dtype differs from " + module0.file +
                               "'s");
      }
      UCP_RETURN_IF_ERROR(AddSliceFragments(bit16, map, geometry, t, 0, module.tensor->numel(),
                                            file_index.at(module.file),
                                            module.tensor->file_offset(), module.tensor->dtype));
    }
    c.atoms.push_back(std::move(bit16));
    return Status::Ok();
  };
  for (size_t g = 0; g < ms0.groups.size(); ++g) {
    ParamGroup group =
        GroupSettings(first.groups[g].param_group, first.reader, first.groups[g].states);
    for (uint32_t s = 0; s < pp; ++s) {
      const TpTag& stage = grid.stages[s];
      const GroupLayout& layout = stage.models[0].groups[g];
      // Each TP rank's flat buffer and its partitions: AutoTP's uneven slices make them differ.
      std::vector<Partitioning> parts;
      for (const TpModelStates& ms : stage.models) {
        UCP_ASSIGN_OR_RETURN(Partitioning part, Partition(ms.groups[g].total, dp));
        parts.push_back(std::move(part));
      }
      const Partitioning& p = parts[0];
      for (size_t k = 0; k < layout.names.size(); ++k) {
        const std::string& name = layout.names[k];
        if (std::get<0>(grid.owner.at(name)) != s) continue;
        group.params.push_back(name);
        const ShardMap& map = maps.at(name);
        params[name] = MapJson(map);
        const Shape& shape = atom_shapes.at(name);
        UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                             GeometryAt(name, map, shape, tp, vocab, map.blocks));
        for (uint32_t t = 0; t < tp; ++t) {
          const Shape& listed = stage.models[t].groups[g].shapes[k];
          if (LocalShape(geometry, t) != listed) {
            return Status::Corrupt(Prefix(stage.models[t].reader.path()) + "param_shapes/" +
                                   std::to_string(g) + "/" + name + ": " + ShapeText(listed) +
                                   ", but its shard map gives TP rank " + std::to_string(t) + " " +
                                   ShapeText(LocalShape(geometry, t)));
          }
        }
        const uint32_t ranks = map.rule == Rule::kSplit ? tp : 1;
        const auto add_partitioned = [&](Atom& atom, int which) -> Status {
          for (uint32_t t = 0; t < ranks; ++t) {
            for (const Piece& piece : Pieces(stage.models[t].groups[g], k, parts[t])) {
              const OptimGroup& og = stage.optim[t][piece.rank].groups[g];
              const TorchTensor* tensor =
                  which == kFp32 ? og.fp32 : og.states[static_cast<size_t>(which)].tensor;
              UCP_RETURN_IF_ERROR(AddSliceFragments(
                  atom, map, geometry, t, piece.begin, piece.end,
                  OptimFileOf(grid, s, t, piece.rank),
                  tensor->file_offset() + piece.at * ItemSize(tensor->dtype), tensor->dtype));
            }
          }
          return Status::Ok();
        };
        const OptimGroup& stage_first = stage.optim[0][0].groups[g];
        Atom fp32{name, "fp32", stage_first.fp32->dtype, shape, {}};
        UCP_RETURN_IF_ERROR(add_partitioned(fp32, kFp32));
        c.atoms.push_back(std::move(fp32));
        for (size_t i = 0; i < stage_first.states.size(); ++i) {
          const StateTensor& st = stage_first.states[i];
          Atom atom{name, st.key, st.tensor->dtype, {}, {}};
          if (st.tensor->shape.empty()) {
            // ds_to_universal's step.pt: the 0-d state of the first rank holding the parameter.
            const uint32_t r =
                std::min(static_cast<uint32_t>(layout.offsets[k] / p.partition), dp - 1);
            const TorchTensor* tensor = stage.optim[0][r].groups[g].states[i].tensor;
            UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(atom.shape));
            atom.fragments.push_back({OptimFileOf(grid, s, 0, r), tensor->file_offset(),
                                      tensor->dtype, std::move(whole)});
          } else {
            atom.shape = shape;
            UCP_RETURN_IF_ERROR(add_partitioned(atom, static_cast<int>(i)));
          }
          c.atoms.push_back(std::move(atom));
        }
        UCP_RETURN_IF_ERROR(add_module_atom(stage, name, map, geometry));
      }
    }
    c.groups.push_back(std::move(group));
  }
  for (const std::string& name : rules.frozen) {
    const ShardMap& map = maps.at(name);
    params[name] = MapJson(map);
    UCP_ASSIGN_OR_RETURN(const Geometry geometry,
                         GeometryAt(name, map, atom_shapes.at(name), tp, vocab, map.blocks));
    for (uint32_t t = 0; t < tp; ++t) {
      const ModuleTensor& module = grid.stages[0].models[t].module.at(name);
      if (LocalShape(geometry, t) != module.tensor->shape || !module.tensor->contiguous()) {
        return Status::Corrupt(Prefix(module.path) + "module/" + name + ": " +
                               ShapeText(module.tensor->shape) +
                               ", but its shard map gives TP rank " + std::to_string(t) + " " +
                               ShapeText(LocalShape(geometry, t)));
      }
      // A reshard writes the slice as the whole of the template's storage.
      if (module.tensor->storage_offset != 0 ||
          module.tensor->storage->numel != module.tensor->numel()) {
        return Status::Unsupported(Prefix(module.path) + "module/" + name +
                                   ": a frozen parameter split over the TP ranks that shares its "
                                   "storage with other tensors; not supported");
      }
    }
    UCP_RETURN_IF_ERROR(add_module_atom(grid.stages[0], name, map, geometry));
  }
  return Status::Ok();
}

// Phase 5 of BuildIndex: what the plans carry from the source files, and adapter_state (the
// rules, the pipeline's stages and layer files).
Status AddTpCarried(const std::string& tag_dir, const TpIndexTag& tag, const ShardRules& rules,
                    const FileIndex& file_index, AtomIndexContents& c, nlohmann::json params) {
  const GridTag& grid = tag.grid;
  const TpModelStates& ms0 = grid.stages[0].models[0];
  const OptimStates& first = grid.stages[0].optim[0][0];
  const uint32_t tp = grid.tp;
  const uint32_t pp = grid.pp;
  const uint32_t mp = tp * pp;
  const std::optional<AutoTpMaps>& autotp = rules.autotp;
  const std::optional<Vocab>& vocab = rules.vocab;
  std::vector<std::string> rewritten_optim;
  for (size_t g = 0; g < ms0.groups.size(); ++g) {
    for (const StateTensor& st : first.groups[g].states) {
      if (!st.tensor->shape.empty()) {
        rewritten_optim.push_back(std::string(kOsd) + "/base_optimizer_state/state/" +
                                  std::to_string(g) + "/" + st.key);
      }
    }
  }
  for (std::string& field : RewrittenPartitionFields(first.reader)) {
    rewritten_optim.push_back(std::move(field));
  }
  std::vector<std::string> rewritten_model = {"module", "param_shapes", "dp_world_size",
                                              "mp_world_size"};
  if (vocab) rewritten_model.push_back(std::string(kInfo) + "/padded_vocab_size");
  if (autotp) {
    for (const char* field :
         {"checkpoint_parallel_dimensions/tp_degree", "ds_config/tensor_parallel/autotp_size",
          "universal_checkpoint_info"}) {
      rewritten_model.push_back(field);
    }
    rewritten_optim.push_back("ds_config/tensor_parallel/autotp_size");
  }
  nlohmann::json pipeline;  // null unless a pipeline tag
  c.carried = {
      {std::string(kModelRole), 0, rewritten_model},
      {std::string(kOptimRole), mp, rewritten_optim},
      {std::string(kUniversalRole),
       mp,
       {std::string(kOsd) + "/base_optimizer_state", std::string(kOsd) + "/param_slice_mappings",
        std::string(kOsd) + "/single_partition_of_fp32_groups", "param_groups"}}};
  // The universal export copies every mp rank's model states.
  for (uint32_t i = 1; i < mp; ++i) c.carried.push_back({std::string(kCopiedModelRole), i, {}});
  nlohmann::json tp_state = {{"degree", tp}, {"params", std::move(params)}};
  if (autotp) tp_state["autotp"] = {{"vocabulary", autotp->vocabulary}};
  if (!rules.frozen.empty()) tp_state["frozen"] = rules.frozen;
  if (vocab) {
    tp_state["vocab"] = {{"original", vocab->original},
                         {"padded", vocab->padded},
                         {"divisible_by", vocab->divisible_by}};
  }
  if (!grid.layer_names.empty()) {
    nlohmann::json stages = nlohmann::json::array();
    for (const TpTag& stage : grid.stages) {
      nlohmann::json groups = nlohmann::json::array();
      for (const GroupLayout& layout : stage.models[0].groups) groups.push_back(layout.names);
      stages.push_back(std::move(groups));
    }
    // Every layer file of TP rank 0, with the parameters it holds: the target's layer files'
    // templates.
    std::map<uint32_t, nlohmann::json> layers;
    for (const std::string& file : grid.layer_names) {
      const std::optional<FileName> parsed = ParseFileName(file);
      if (parsed->model_rank.value_or(0) != 0) continue;
      layers[parsed->layer] = {{"layer", parsed->layer},
                               {"file", file_index.at(file)},
                               {"params", nlohmann::json::object()}};
    }
    for (const auto& [name, where] : grid.owner) {
      const ModuleTensor& module = grid.stages[std::get<0>(where)].models[0].module.at(name);
      const std::optional<FileName> parsed = ParseFileName(module.file);
      if (!layers.contains(parsed->layer)) {
        return Status::NotFound(
            Prefix(tag_dir + "/" + LayerFileName(grid.layer_names_tp, parsed->layer, 0)) +
            "not found (" + module.file + " holds " + name + ")");
      }
      layers[parsed->layer]["params"][module.key] = name;
    }
    nlohmann::json layer_list = nlohmann::json::array();
    for (auto& [layer, entry] : layers) {
      std::vector<std::string> keys;
      for (const auto& [key, param] : entry["params"].items()) keys.push_back(key);
      c.carried.push_back(
          {std::string(kLayerRole), entry["file"].get<uint32_t>(), std::move(keys)});
      layer_list.push_back(std::move(entry));
    }
    pipeline = {{"stages", std::move(stages)},
                {"layers", std::move(layer_list)},
                {"layer_names_tp", grid.layer_names_tp}};
  }
  c.adapter_state = {
      {"optimizer", std::string(first.bf16_optimizer ? kBf16Optimizer : kZeroOptimizer)},
      {"file_prefix", grid.prefix},
      {"alignment_factor", kAlignmentFactor},
      {"fp32_padding_stripped", !first.bf16_optimizer},
      {"zero_stage", tag.zero_stage},
      {"round_robin_gradients", tag.round_robin},
      {"tp", std::move(tp_state)},
  };
  if (!pipeline.is_null()) c.adapter_state["pipeline"] = std::move(pipeline);
  return Status::Ok();
}

// A grid DeepSpeed can train at: no expert parallelism, every degree at least 1, tp·pp within
// the mp ranks' limit, and world (where given) dp·tp·pp.
Status CheckGridTarget(const Topology& target) {
  UCP_RETURN_IF_ERROR(RefuseExpertParallel(target));
  if (target.dp == 0 || target.tp == 0 || target.pp == 0) {
    return Status::InvalidArgument("deepspeed: dp=" + std::to_string(target.dp) +
                                   " tp=" + std::to_string(target.tp) +
                                   " pp=" + std::to_string(target.pp) + ": no ranks to reshard to");
  }
  const std::optional<uint64_t> world =
      CheckedMul(uint64_t{target.dp}, uint64_t{target.tp} * target.pp);
  if (target.tp > kMaxTpWorldSize || target.pp > kMaxTpWorldSize ||
      uint64_t{target.tp} * target.pp > kMaxTpWorldSize || !world ||
      (target.world != 0 && target.world != *world)) {
    return Status::InvalidArgument("deepspeed: world=" + std::to_string(target.world) +
                                   " is not dp=" + std::to_string(target.dp) +
                                   " × tp=" + std::to_string(target.tp) +
                                   " × pp=" + std::to_string(target.pp));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// PlanUniversalExport's parts.

// Module tensors without optimizer state, where the release writes them: a frozen parameter
// whole from its atom (rank 0's module holds only its slice), the others (alike on every TP
// rank) from rank 0's model states; then the model-states files, copied.
Status AddUniversalModuleFiles(const AtomIndex& index, const IndexFacts& facts,
                               const TorchArchiveReader& model, OutputPlan& plan) {
  const std::string& version = index.contents().framework_version;
  std::set<std::string> indexed;
  for (const Atom& atom : index.atoms()) indexed.insert(atom.param);
  if (VersionAtLeast(version, 0, 19, 8)) {
    for (const std::string& name : facts.frozen) {
      const Atom* atom = index.Find(name, "bit16");
      if (atom == nullptr) {
        return Status::Corrupt("deepspeed: index adapter_state.tp.frozen: no bit16 atom of " +
                               name);
      }
      UCP_ASSIGN_OR_RETURN(ArchiveOutput frozen, UniversalModuleAtomArchive(index, *atom));
      plan.archives.push_back(std::move(frozen));
    }
  }
  UCP_RETURN_IF_ERROR(AddUniversalModuleTensors(model, facts.model_file, indexed, version, plan));

  // Named, not taken from the index: over an atoms store the files are read from their copies.
  plan.copies.push_back({ModelStatesName(0), facts.model_file});
  for (const CarriedObject& carried : index.contents().carried) {
    if (carried.role != kCopiedModelRole) continue;
    const std::optional<RankCoordinates>& rank = index.files()[carried.file].rank;
    if (!rank) return Status::Corrupt("deepspeed: index: model states copy without a rank");
    plan.copies.push_back({ModelStatesName(MpRank(rank->pp, rank->tp, facts.tp)), carried.file});
  }
  return Status::Ok();
}

}  // namespace

bool DeepSpeedTpAdapter::Recognizes(const std::string& tag_dir) const {
  Result<TagListing> listing = ListTag(tag_dir);
  if (!listing.ok() || !listing->zero3_model_states.empty()) return false;
  if (!listing->layer_files.empty()) return true;  // a pipeline, with TP ranks or without
  if (!listing->model_states.empty() && listing->model_states.rbegin()->first > 0) return true;
  for (const RankFile& entry : listing->optim) {
    if (entry.mp > 0) return true;
  }
  // TP rank 0's files alone: this adapter's when its model states say mp_world_size > 1 (the
  // other ranks' files not written yet) or carry the rules to split a TP=1 tag by.
  const std::optional<TorchArchiveReader> model = WrittenRankZeroModelStates(tag_dir, *listing);
  return model && (SaysTensorParallel(*model) || CarriesRules(*model));
}

Result<std::vector<std::string>> DeepSpeedTpAdapter::ExpectedFiles(
    const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  UCP_RETURN_IF_ERROR(RefuseListing(tag_dir, listing));
  // DeepSpeed's rank 0 writes the model states before its optimizer file and the commit signal.
  UCP_ASSIGN_OR_RETURN(
      const TorchArchiveReader reader,
      OpenWrittenModelStates(tag_dir, ModelStatesName(0), listing.model_states.contains(0)));
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(reader));
  UCP_ASSIGN_OR_RETURN(const int64_t mp, IntField(reader, "mp_world_size"));
  if (mp < 1 || mp > kMaxTpWorldSize) {
    return FieldError(reader, "mp_world_size", std::to_string(mp) + " is not in [1, 65536]");
  }
  const bool bf16 = Bf16Prefix(listing, reader);
  UCP_RETURN_IF_ERROR(CheckZeroOptimizerStage(reader, tag_dir, bf16, kZero3Refusal));
  std::vector<std::string> files;
  for (uint32_t t = 0; t < mp; ++t) files.push_back(ModelStatesName(t));
  const std::string prefix = bf16 ? "bf16_" : "";
  for (uint32_t t = 0; t < mp; ++t) {
    for (uint32_t r = 0; r < dp; ++r) files.push_back(OptimName(prefix, r, t));
  }
  if (!listing.layer_files.empty()) {
    // A pipeline stage's rank writes its layer files before its model states: once every model
    // states file is whole, every layer file is there.
    for (uint32_t i = 1; i < mp; ++i) {
      UCP_RETURN_IF_ERROR(
          OpenWrittenModelStates(tag_dir, ModelStatesName(i), listing.model_states.contains(i))
              .status());
    }
    UCP_ASSIGN_OR_RETURN(const TagListing written, ListTagToRead(tag_dir));
    std::vector<std::string> layers = written.layer_files;
    std::sort(layers.begin(), layers.end());
    files.insert(files.end(), layers.begin(), layers.end());
  }
  return files;
}

Result<AtomIndex> DeepSpeedTpAdapter::BuildIndex(const std::string& tag_dir,
                                                 const IndexOptions& options) const {
  UCP_ASSIGN_OR_RETURN(const TpIndexTag tag, ReadTpTag(tag_dir));
  UCP_ASSIGN_OR_RETURN(const ShardRules rules, ResolveShardRules(tag_dir, tag));
  AtomIndexContents c;
  UCP_ASSIGN_OR_RETURN(const FileIndex file_index, AddTpFiles(tag_dir, tag, options, c));
  nlohmann::json params = nlohmann::json::object();
  UCP_RETURN_IF_ERROR(AddTpAtoms(tag, rules, file_index, c, params));
  UCP_RETURN_IF_ERROR(AddTpCarried(tag_dir, tag, rules, file_index, c, std::move(params)));
  return AtomIndex::Create(std::move(c), Prefix(tag_dir) + "index");
}

Result<OutputPlan> DeepSpeedTpAdapter::PlanReshard(const AtomIndex& index,
                                                   const std::string& tag_dir,
                                                   const Topology& target) const {
  UCP_RETURN_IF_ERROR(CheckGridTarget(target));
  // 1. Where every parameter goes: the target's stages, their groups laid out at (tp, dp).
  UCP_ASSIGN_OR_RETURN(const IndexFacts source, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model,
                       OpenSource(index, tag_dir, source.model_file));
  // AutoTP re-splits each parameter at another degree by its own rule.
  IndexFacts facts = source;
  if (source.autotp && target.tp != source.tp) {
    UCP_ASSIGN_OR_RETURN(const AutoTpSplitRule rule, ReadAutoTpSplitRule(model, tag_dir));
    UCP_ASSIGN_OR_RETURN(facts, AutoTpFactsAt(index, source, target.tp, rule));
  }
  if (facts.pipeline && !facts.layer_names_tp && target.tp != 1) {
    return Status::Unsupported(
        "deepspeed: tp=" + std::to_string(target.tp) +
        ": the tag's pipeline grid has no model axis (layer files without a TP rank, "
        "layer_LL-model_states.pt), so its trainer runs at tp = 1 only");
  }
  UCP_ASSIGN_OR_RETURN(const auto stages, TargetStages(index, facts, target.pp, target.partition));
  // [stage][TP rank]: the groups laid out at (tp, dp).
  std::vector<std::vector<std::vector<TargetGroup>>> stage_groups;
  for (const std::vector<std::vector<std::string>>& stage : stages) {
    stage_groups.emplace_back();
    for (uint32_t t = 0; t < target.tp; ++t) {
      UCP_ASSIGN_OR_RETURN(std::vector<TargetGroup> groups,
                           TargetGroups(index, facts, stage, target, t));
      stage_groups.back().push_back(std::move(groups));
    }
  }
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader optim,
                       OpenSource(index, tag_dir, facts.optim_file));
  OutputPlan plan;
  // 2. Per target stage and TP rank: the model states, then the DP ranks' optimizer files.
  for (uint32_t s = 0; s < target.pp; ++s) {
    for (uint32_t t = 0; t < target.tp; ++t) {
      UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                           PlanModelStates(index, facts, source.tp, model, stage_groups[s][t], t,
                                           target, ModelStatesName(MpRank(s, t, target.tp))));
      plan.archives.push_back(std::move(out));
    }
  }
  for (uint32_t s = 0; s < target.pp; ++s) {
    for (uint32_t t = 0; t < target.tp; ++t) {
      for (uint32_t r = 0; r < target.dp; ++r) {
        UCP_ASSIGN_OR_RETURN(
            ArchiveOutput out,
            PlanOptimFile(index, facts, source.tp, optim, stage_groups[s][t], t, r, target,
                          OptimName(facts.prefix, r, MpRank(s, t, target.tp))));
        plan.archives.push_back(std::move(out));
      }
    }
  }
  // 3. A pipeline's layer files, per TP rank.
  if (facts.pipeline) {
    for (uint32_t t = 0; t < target.tp; ++t) {
      UCP_RETURN_IF_ERROR(PlanLayerFiles(index, tag_dir, facts, t, target, plan));
    }
  }
  return plan;
}

Result<OutputPlan> DeepSpeedTpAdapter::PlanUniversalExport(const AtomIndex& index,
                                                           const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model,
                       OpenSource(index, tag_dir, facts.model_file));
  std::map<std::string, bool> requires_grad;  // "<param>/<state>"
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    UCP_RETURN_IF_ERROR(CollectGroupRequiresGrad(reader, g, facts.groups[g], requires_grad));
  }

  OutputPlan plan;
  for (const Atom& atom : index.atoms()) {
    if (atom.state == "bit16") continue;
    const bool grad = requires_grad[atom.param + "/" + atom.state];
    if (atom.shape.empty()) {  // step.pt: the bare 0-d tensor
      UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                           UniversalAtomArchive(index, atom, atom.shape, grad, false));
      plan.archives.push_back(std::move(out));
      continue;
    }
    const auto map = facts.maps.find(atom.param);
    if (map == facts.maps.end()) {
      return Status::Corrupt("deepspeed: index adapter_state.tp.params: no shard map of " +
                             atom.param);
    }
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        deepspeed::UniversalShardedAtom(index, map->second, facts.vocab,
                                        facts.vocabulary.contains(atom.param), model, atom, grad));
    plan.archives.push_back(std::move(out));
  }

  // zero/optimizer_state.pt from rank (0, 0)'s optimizer_state_dict.
  UCP_ASSIGN_OR_RETURN(ArchiveOutput out, UniversalOptimizerState(reader, facts.optim_file));
  plan.archives.push_back(std::move(out));
  UCP_RETURN_IF_ERROR(AddUniversalModuleFiles(index, facts, model, plan));
  return plan;
}

}  // namespace ucp
