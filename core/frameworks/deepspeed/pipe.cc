#include "core/frameworks/deepspeed/pipe.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/plan/copy_plan.h"
#include "core/tag/file_hashing.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using deepspeed::AddParameterAtoms;
using deepspeed::Bf16Prefix;
using deepspeed::BoundsText;
using deepspeed::CheckIndexAdapter;
using deepspeed::CheckNoParameterAlignment;
using deepspeed::CollectGroupRequiresGrad;
using deepspeed::CollectStorages;
using deepspeed::Decimal;
using deepspeed::DpWorldSize;
using deepspeed::ExpectedMappings;
using deepspeed::Field;
using deepspeed::FieldError;
using deepspeed::FileKind;
using deepspeed::FileName;
using deepspeed::FlatSegments;
using deepspeed::GroupLayout;
using deepspeed::GroupSettings;
using deepspeed::IntField;
using deepspeed::IntListField;
using deepspeed::kAlignmentFactor;
using deepspeed::kLayerRole;
using deepspeed::kModelRole;
using deepspeed::kOptimRole;
using deepspeed::kOsd;
using deepspeed::kUniversalRole;
using deepspeed::LayerStatesName;
using deepspeed::ListTag;
using deepspeed::ListTagToRead;
using deepspeed::ListText;
using deepspeed::MakeLayout;
using deepspeed::ModelStatesName;
using deepspeed::NumberedLayer;
using deepspeed::OpenSource;
using deepspeed::OpenWrittenModelStates;
using deepspeed::OptimName;
using deepspeed::OptionalField;
using deepspeed::OrderStatesAs;
using deepspeed::ParseFileName;
using deepspeed::Partition;
using deepspeed::PartitionBalanced;
using deepspeed::Partitioning;
using deepspeed::PartitionUniform;
using deepspeed::PlanPartitionedOptimFile;
using deepspeed::PlanRankPart;
using deepspeed::Prefix;
using deepspeed::RankFile;
using deepspeed::RankGroupPart;
using deepspeed::RankPartition;
using deepspeed::ReadMappings;
using deepspeed::RefuseElasticForm;
using deepspeed::RefuseExpertParallel;
using deepspeed::RewrittenPartitionFields;
using deepspeed::SavablePartition;
using deepspeed::SetDictItem;
using deepspeed::ShapeOf;
using deepspeed::ShapeText;
using deepspeed::SliceMapping;
using deepspeed::StateTensor;
using deepspeed::StrField;
using deepspeed::TagListing;
using deepspeed::TagName;
using deepspeed::UniversalAtomArchive;
using deepspeed::UniversalOptimizerState;
using deepspeed::ZeroStageOf;
using pickle::Kind;
using pickle::Value;

// Bounds the per-stage file lists a corrupt mp_world_size would make.
constexpr int64_t kMaxStages = 1 << 16;
// Bounds the layer placement's work (DeepSpeed's partition_balanced is quadratic in the layers).
constexpr uint64_t kMaxLayers = 1 << 12;

// The layer of a file named exactly LayerStatesName(layer).
std::optional<uint32_t> LayerOfFile(const std::string& name) {
  const std::optional<FileName> parsed = ParseFileName(name);
  if (!parsed || parsed->kind != FileKind::kLayerStates || LayerStatesName(parsed->layer) != name) {
    return std::nullopt;
  }
  return parsed->layer;
}

// ---------------------------------------------------------------------------------------------
// The files of a tag, read.

struct StageModel {
  std::string name;
  TorchArchiveReader reader;
  std::string ds_version;
  uint32_t dp = 0;
  int64_t pp = 0;
  GroupLayout layout;
};

struct StageOptim {
  RankFile entry;
  TorchArchiveReader reader;
  std::optional<int64_t> zero_stage;
  std::vector<int64_t> partition_count;
  std::vector<int64_t> group_paddings;
  std::string ds_version;
  std::vector<StateTensor> states;  // group 0's, in the pickle's order
  const TorchTensor* fp32 = nullptr;
  std::vector<SliceMapping> mappings;
  const Value* param_group = nullptr;
};

Result<StageModel> ReadStageModel(const std::string& tag_dir, const std::string& name) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader, TorchArchiveReader::Open(tag_dir + "/" + name));
  StageModel sm{name, std::move(reader), {}, 0, 0, {}};
  const TorchArchiveReader& r = sm.reader;
  UCP_ASSIGN_OR_RETURN(sm.ds_version, StrField(r, "ds_version"));
  UCP_ASSIGN_OR_RETURN(sm.dp, DpWorldSize(r));
  UCP_ASSIGN_OR_RETURN(sm.pp, IntField(r, "mp_world_size"));
  if (sm.pp < 1 || sm.pp > kMaxStages) {
    return FieldError(r, "mp_world_size", std::to_string(sm.pp) + " is outside [1, 65536]");
  }
  if (const Value* stage = OptionalField(r, "ds_config/zero_optimization/stage")) {
    if (stage->kind() == Kind::kInt && stage->AsInt64() != 1) {
      return Status::Unsupported(Prefix(r.path()) + "ds_config/zero_optimization/stage " +
                                 std::to_string(stage->AsInt64().value_or(-1)) +
                                 ": pipeline tags are supported with ZeRO stage 1 only");
    }
  }
  if (const Value* rr = OptionalField(r, "ds_config/zero_optimization/round_robin_gradients")) {
    if (rr->kind() == Kind::kBool && rr->bool_value()) {
      return Status::Unsupported(Prefix(r.path()) +
                                 "round_robin_gradients: not supported with pipeline parallelism");
    }
  }
  UCP_ASSIGN_OR_RETURN(const Value* shapes, Field(r, "param_shapes"));
  if (shapes->kind() != Kind::kList || shapes->items().size() != 1) {
    return Status::Unsupported(Prefix(r.path()) +
                               "param_shapes: not exactly one parameter group (several groups "
                               "are not supported with pipeline parallelism)");
  }
  std::vector<std::string> names;
  std::vector<Shape> dims;
  for (const auto& [key, value] : NamedChildren(shapes->items()[0])) {
    std::optional<Shape> shape = ShapeOf(value);
    if (!shape) return FieldError(r, "param_shapes/0/" + key, "not a torch.Size");
    if (!NumberedLayer(key)) {
      return Status::Unsupported(Prefix(r.path()) + "param_shapes/0/" + key +
                                 ": not \"<layer index>.<name>\" (tied layers are not supported)");
    }
    names.push_back(key);
    dims.push_back(std::move(*shape));
  }
  if (names.empty()) return FieldError(r, "param_shapes/0", "no parameters");
  Result<GroupLayout> layout = MakeLayout(std::move(names), std::move(dims));
  if (!layout.ok()) return FieldError(r, "param_shapes/0", layout.status().message());
  sm.layout = std::move(*layout);
  return sm;
}

Result<StageOptim> ReadStageOptim(const std::string& tag_dir, const RankFile& entry) {
  UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader,
                       TorchArchiveReader::Open(tag_dir + "/" + entry.name));
  StageOptim so{entry, std::move(reader), std::nullopt, {}, {}, {}, {}, nullptr, {}, nullptr};
  const TorchArchiveReader& r = so.reader;
  const std::string osd(kOsd);
  if (OptionalField(r, osd + "/loss_scaler") == nullptr) {
    return Status::Unsupported(Prefix(r.path()) + osd +
                               ": a BF16_Optimizer file (bf16 at ZeRO stage 0, or with fp32 "
                               "gradient accumulation); pipeline tags are supported with "
                               "DeepSpeedZeroOptimizer (fp32 or bf16) only");
  }
  UCP_ASSIGN_OR_RETURN(const Value* stage, Field(r, osd + "/zero_stage"));
  so.zero_stage = ZeroStageOf(stage);
  if (!so.zero_stage) return FieldError(r, osd + "/zero_stage", "not a ZeroStageEnum");
  if (*so.zero_stage != 1) {
    return Status::Unsupported(Prefix(r.path()) + osd + "/zero_stage " +
                               std::to_string(*so.zero_stage) +
                               ": pipeline tags are supported with ZeRO stage 1 only");
  }
  UCP_ASSIGN_OR_RETURN(so.ds_version, StrField(r, osd + "/ds_version"));
  UCP_ASSIGN_OR_RETURN(so.partition_count, IntListField(r, osd + "/partition_count"));
  UCP_ASSIGN_OR_RETURN(so.group_paddings, IntListField(r, osd + "/group_paddings"));
  UCP_RETURN_IF_ERROR(CheckNoParameterAlignment(r, 1));
  UCP_RETURN_IF_ERROR(RefuseElasticForm(r, "pipeline tags"));
  UCP_ASSIGN_OR_RETURN(const Value* states, Field(r, osd + "/base_optimizer_state/state/0"));
  for (const auto& [key, value] : NamedChildren(states)) {
    if (const TorchTensor* tensor = r.TensorAt(value)) so.states.push_back({key, tensor});
  }
  UCP_ASSIGN_OR_RETURN(const Value* fp32, Field(r, osd + "/single_partition_of_fp32_groups/0"));
  so.fp32 = r.TensorAt(fp32);
  if (so.fp32 == nullptr) {
    return FieldError(r, osd + "/single_partition_of_fp32_groups/0", "not a tensor");
  }
  UCP_ASSIGN_OR_RETURN(so.mappings, ReadMappings(r, osd + "/param_slice_mappings/0"));
  UCP_ASSIGN_OR_RETURN(so.param_group, Field(r, osd + "/base_optimizer_state/param_groups/0"));
  return so;
}

// Checks the optimizer file of (r, s) against stage s's param_shapes and file (0, 0).
Status CheckStageOptim(const StageOptim& so, const StageModel& sm, const StageOptim& first) {
  const TorchArchiveReader& r = so.reader;
  const std::string osd(kOsd);
  if (so.ds_version != sm.ds_version) {
    return FieldError(r, osd + "/ds_version",
                      "\"" + so.ds_version + "\", but " + sm.name + " has \"" + sm.ds_version +
                          "\" (a file of another save)");
  }
  if (so.partition_count != std::vector<int64_t>{sm.dp}) {
    return FieldError(r, osd + "/partition_count",
                      ListText(so.partition_count) + ", but " + sm.name + " has dp_world_size " +
                          std::to_string(sm.dp) + " (a file of another save)");
  }
  UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(sm.layout.total, sm.dp));
  const uint64_t padding = p.padding_of(so.entry.dp);
  if (so.group_paddings != std::vector<int64_t>{static_cast<int64_t>(padding)}) {
    return FieldError(r, osd + "/group_paddings",
                      ListText(so.group_paddings) + ", expected [" + std::to_string(padding) +
                          "] from param_shapes in " + sm.name);
  }
  if (so.fp32->shape.size() != 1 || so.fp32->numel() != p.partition - padding ||
      !so.fp32->contiguous()) {
    return FieldError(r, osd + "/single_partition_of_fp32_groups/0",
                      "shape " + ShapeText(so.fp32->shape) + ", expected [" +
                          std::to_string(p.partition - padding) + "] from param_shapes in " +
                          sm.name);
  }
  if (so.states.size() != first.states.size()) {
    return FieldError(r, osd + "/base_optimizer_state/state/0",
                      "other state keys than " + first.entry.name);
  }
  for (size_t k = 0; k < so.states.size(); ++k) {
    const StateTensor& st = so.states[k];
    const std::string field = osd + "/base_optimizer_state/state/0/" + st.key;
    if (st.key != first.states[k].key || st.tensor->dtype != first.states[k].tensor->dtype ||
        st.tensor->shape.size() != first.states[k].tensor->shape.size()) {
      return FieldError(r, field, "differs in name, rank or dtype from " + first.entry.name);
    }
    if (!st.tensor->contiguous()) return FieldError(r, field, "not contiguous");
    const bool scalar = st.tensor->shape.empty();
    if (!scalar && (st.tensor->shape.size() != 1 || st.tensor->numel() != p.partition)) {
      return Status::Unsupported(
          Prefix(r.path()) + field + ": shape " + ShapeText(st.tensor->shape) +
          " is neither 0-d nor the partition [" + std::to_string(p.partition) + "]");
    }
  }
  const std::vector<SliceMapping> expected =
      ExpectedMappings(sm.layout, p, so.entry.dp, /*round_robin=*/false);
  if (so.mappings != expected) {
    std::string want;
    for (const SliceMapping& m : expected) {
      want += (want.empty() ? "" : ", ") + m.name + " numel " + std::to_string(m.numel) +
              " start " + std::to_string(m.start);
    }
    return FieldError(r, osd + "/param_slice_mappings/0",
                      "not what param_shapes in " + sm.name + " gives (" + want + ")");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Plans.

// What the plans need from an index: the parameters in stage order, each stage's count, the
// layer count and the files.
struct IndexFacts {
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  std::vector<uint32_t> layer_of;  // per name
  std::vector<uint64_t> stage_sizes;
  uint64_t layers = 0;
  uint32_t dp = 0;
  std::vector<uint32_t> model_files;         // per source stage
  uint32_t optim_file = 0;                   // (0, 0): the template
  std::map<uint32_t, uint32_t> layer_files;  // layer → index file
  std::string prefix;                        // of the optimizer files: "" or "bf16_"
};

Result<IndexFacts> ReadFacts(const AtomIndex& index) {
  const AtomIndexContents& c = index.contents();
  UCP_RETURN_IF_ERROR(CheckIndexAdapter(index, DeepSpeedPipeAdapter::kName));
  IndexFacts facts;
  facts.dp = c.topology.dp;
  const nlohmann::json& state = c.adapter_state;
  if (!state.is_object() || !state.contains("stage_sizes") || !state["stage_sizes"].is_array() ||
      !state.contains("layers") || !state["layers"].is_number_unsigned() || c.groups.size() != 1) {
    return Status::Corrupt(
        "deepspeed: index adapter_state: stage_sizes or layers missing or mistyped, or not one "
        "parameter group");
  }
  facts.layers = state["layers"].get<uint64_t>();
  if (facts.layers > kMaxLayers) return Status::Corrupt("deepspeed: index adapter_state: layers");
  uint64_t total = 0;
  for (const nlohmann::json& size : state["stage_sizes"]) {
    if (!size.is_number_unsigned()) return Status::Corrupt("deepspeed: index: stage_sizes");
    facts.stage_sizes.push_back(size.get<uint64_t>());
    total += facts.stage_sizes.back();
  }
  if (facts.stage_sizes.size() != c.topology.pp || total != c.groups[0].params.size()) {
    return Status::Corrupt("deepspeed: index: stage_sizes disagree with pp or the group");
  }
  std::map<uint32_t, uint32_t> model_by_stage;
  bool have_optim = false;
  for (const CarriedObject& carried : c.carried) {
    const IndexedFile& file = index.files()[carried.file];
    if (carried.role == kModelRole && file.rank) model_by_stage[file.rank->pp] = carried.file;
    if (carried.role == kOptimRole) facts.optim_file = carried.file, have_optim = true;
  }
  if (!have_optim || model_by_stage.size() != c.topology.pp) {
    return Status::Corrupt(
        "deepspeed: index carried: not every stage's model states, or no "
        "optim_states template");
  }
  for (const auto& [stage, file] : model_by_stage) facts.model_files.push_back(file);
  // The layer of each layer file, recorded: over an atoms store the file's path is its copy's.
  if (!state.contains("layer_files") || !state["layer_files"].is_object()) {
    return Status::Corrupt("deepspeed: index adapter_state: layer_files missing or mistyped");
  }
  for (const auto& [layer, file] : state["layer_files"].items()) {
    const std::optional<uint32_t> parsed = Decimal(layer);
    if (!parsed || std::to_string(*parsed) != layer || !file.is_number_unsigned() ||
        file.get<uint64_t>() >= index.files().size() ||
        index.files()[file.get<uint64_t>()].role != kLayerRole) {
      return Status::Corrupt("deepspeed: index adapter_state: layer_files: " + layer);
    }
    facts.layer_files[*parsed] = static_cast<uint32_t>(file.get<uint64_t>());
  }
  // Indexes written before bf16 pipeline tags were read have no prefix, and hold fp32 tags.
  if (state.contains("file_prefix")) {
    if (!state["file_prefix"].is_string() ||
        (state["file_prefix"] != "" && state["file_prefix"] != "bf16_")) {
      return Status::Corrupt(
          "deepspeed: index adapter_state: file_prefix is neither \"\" nor "
          "\"bf16_\"");
    }
    facts.prefix = state["file_prefix"].get<std::string>();
  }
  for (const std::string& name : c.groups[0].params) {
    const Atom* atom = index.Find(name, "fp32");
    const std::optional<uint32_t> layer = NumberedLayer(name);
    if (atom == nullptr || !layer || *layer >= facts.layers) {
      return Status::Corrupt("deepspeed: index: no fp32 atom of " + name +
                             " or not in a known layer");
    }
    facts.names.push_back(name);
    facts.shapes.push_back(atom->shape);
    facts.layer_of.push_back(*layer);
  }
  return facts;
}

// Where the target puts each parameter (facts.names order), by the rule in deepspeed_pipe.h;
// `placement` says how, for messages.
struct Placement {
  std::vector<uint32_t> stage_of;
  std::string placement;
};

// The stage of each parameter when stage s holds layers [bounds[s], bounds[s+1]).
std::vector<uint32_t> StagesOf(const IndexFacts& facts, const std::vector<uint64_t>& bounds) {
  std::vector<uint32_t> stage_of;
  for (const uint32_t layer : facts.layer_of) {
    uint32_t s = 0;
    while (s + 1 < bounds.size() - 1 && layer >= bounds[s + 1]) ++s;
    stage_of.push_back(s);
  }
  return stage_of;
}

Result<Placement> TargetPlacement(const IndexFacts& facts, uint32_t pp) {
  std::vector<uint32_t> source;
  for (uint32_t s = 0; s < facts.stage_sizes.size(); ++s) {
    source.insert(source.end(), facts.stage_sizes[s], s);
  }
  const uint64_t source_pp = facts.stage_sizes.size();
  // The same stage count keeps the saved stages, whatever placed them.
  if (pp == source_pp) return Placement{std::move(source), "as saved"};

  std::vector<uint64_t> weights(facts.layers, 0);
  for (size_t k = 0; k < facts.names.size(); ++k) {
    uint64_t numel = 1;
    for (const int64_t d : facts.shapes[k]) numel *= static_cast<uint64_t>(d);
    weights[facts.layer_of[k]] += numel;
  }
  const std::vector<uint64_t> uniform_source = PartitionUniform(facts.layers, source_pp);
  const std::vector<uint64_t> balanced_source = PartitionBalanced(weights, source_pp);
  const bool uniform = StagesOf(facts, uniform_source) == source;
  const bool balanced = StagesOf(facts, balanced_source) == source;
  if (!uniform && !balanced) {
    return Status::Unsupported(
        "deepspeed: pp=" + std::to_string(pp) + ": the checkpoint's stages are neither " +
        "DeepSpeed's 'uniform' " + BoundsText(uniform_source) + " nor its 'parameters' " +
        BoundsText(balanced_source) + " layer placement at pp=" + std::to_string(source_pp) +
        " (a 'type:' or custom partition is not recorded in the checkpoint)");
  }
  const std::vector<uint64_t> by_uniform = PartitionUniform(facts.layers, pp);
  const std::vector<uint64_t> by_balanced = PartitionBalanced(weights, pp);
  std::vector<uint32_t> uniform_stages = StagesOf(facts, by_uniform);
  std::vector<uint32_t> balanced_stages = StagesOf(facts, by_balanced);
  if (uniform && balanced && uniform_stages != balanced_stages) {
    return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) +
                               ": ambiguous layer placement: the checkpoint's stages are both "
                               "DeepSpeed's 'uniform' and 'parameters' placement at pp=" +
                               std::to_string(source_pp) +
                               ", which differ at pp=" + std::to_string(pp) + " (" +
                               BoundsText(by_uniform) + " and " + BoundsText(by_balanced) + ")");
  }
  if (uniform) return Placement{std::move(uniform_stages), "'uniform' " + BoundsText(by_uniform)};
  return Placement{std::move(balanced_stages), "'parameters' " + BoundsText(by_balanced)};
}

Status CheckPipeTarget(const Topology& target) {
  if (target.tp != 1) {
    return Status::Unsupported("deepspeed: tp=" + std::to_string(target.tp) +
                               ": tensor-parallel resharding is not supported yet");
  }
  if (target.dp == 0 || target.pp == 0) {
    return Status::InvalidArgument("deepspeed: dp=" + std::to_string(target.dp) +
                                   " pp=" + std::to_string(target.pp) + ": no ranks to reshard to");
  }
  const uint64_t ranks = uint64_t{target.dp} * target.pp;
  if (target.world != 0 && target.world % ranks != 0) {
    return Status::InvalidArgument("deepspeed: dp×pp=" + std::to_string(ranks) +
                                   " does not divide world=" + std::to_string(target.world));
  }
  if (target.world != 0 && target.world != ranks) {
    return Status::Unsupported("deepspeed: world=" + std::to_string(target.world) + " with dp×pp=" +
                               std::to_string(ranks) + ": only world = dp×pp is supported");
  }
  return Status::Ok();
}

// The optimizer file of (r, stage) at `dp` ranks over `layout`, from the template (0, 0), named
// with `prefix`.
Result<ArchiveOutput> StageOptimFile(const AtomIndex& index, const TorchArchiveReader& reader,
                                     uint32_t template_file, const GroupLayout& layout, uint32_t r,
                                     uint32_t stage, uint32_t dp, const std::string& prefix) {
  UCP_ASSIGN_OR_RETURN(const Partitioning p,
                       SavablePartition(layout.total, dp, "stage " + std::to_string(stage)));
  const auto group_of = [&](size_t) -> Result<RankGroupPart> {
    RankGroupPart group;
    group.part = PlanRankPart(p, r, layout.total, /*elastic=*/false, /*bf16_optimizer=*/false);
    group.padding = p.padding_of(r);
    group.mappings = ExpectedMappings(layout, p, r, /*round_robin=*/false);
    group.params = layout.names.size();
    group.segments_of = [&](const std::string& state, uint64_t begin, uint64_t end) {
      return FlatSegments(index, layout, state, begin, end);
    };
    return group;
  };
  return PlanPartitionedOptimFile(reader, template_file, OptimName(prefix, r, stage),
                                  /*elastic=*/false, 1, group_of, {dp});
}

// Each layer's file number in the index.
using LayerFileIndex = std::map<uint32_t, uint32_t>;

// A pipeline tag as BuildIndex's phases read it.
struct PipeTag {
  std::vector<StageModel> stages;               // by stage
  std::vector<StageOptim> optims;               // stage-major, each stage's DP ranks in order
  std::string prefix;                           // of the optimizer files: "" or "bf16_"
  std::map<uint32_t, std::string> layer_files;  // layer → its file
  uint64_t layers = 0;                          // one past the highest layer
  uint32_t pp = 1;
  uint32_t dp = 1;
  uint32_t world = 1;
};

// Phase 1 of BuildIndex: every stage's model states, checked to be of one save.
Status ReadStages(const std::string& tag_dir, const TagListing& listing, PipeTag& tag) {
  std::vector<StageModel>& stages = tag.stages;
  UCP_ASSIGN_OR_RETURN(StageModel first_model, ReadStageModel(tag_dir, ModelStatesName(0)));
  tag.pp = static_cast<uint32_t>(first_model.pp);
  tag.dp = first_model.dp;
  const uint32_t pp = tag.pp;
  const uint32_t dp = tag.dp;
  stages.push_back(std::move(first_model));
  for (uint32_t s = 1; s < pp; ++s) {
    const std::string name = ModelStatesName(s);
    if (!listing.model_states.contains(s)) {
      return Status::NotFound(Prefix(tag_dir + "/" + name) + "not found (mp_world_size " +
                              std::to_string(pp) + " in " + stages.front().name + ")");
    }
    UCP_ASSIGN_OR_RETURN(StageModel sm, ReadStageModel(tag_dir, name));
    for (const auto& [field, same] :
         {std::pair{"ds_version", sm.ds_version == stages.front().ds_version},
          std::pair{"dp_world_size", sm.dp == dp}, std::pair{"mp_world_size", sm.pp == pp}}) {
      if (!same) {
        return FieldError(sm.reader, field,
                          "differs from " + stages.front().name + " (a file of another save)");
      }
    }
    stages.push_back(std::move(sm));
  }
  for (const auto& [mp, name] : listing.model_states) {
    if (mp >= pp) {
      return Status::Corrupt(Prefix(tag_dir + "/" + name) + "stage " + std::to_string(mp) +
                             " >= mp_world_size " + std::to_string(pp) + " of " +
                             stages.front().name + " (a file of another save)");
    }
  }
  return Status::Ok();
}

// Phase 2 of BuildIndex: one optimizer file per (rank, stage), all with one prefix (bf16_ in a
// bf16 run), each checked against its stage.
Status ReadStageOptims(const std::string& tag_dir, const TagListing& listing, PipeTag& tag) {
  const std::vector<StageModel>& stages = tag.stages;
  const uint32_t pp = tag.pp;
  const uint32_t dp = tag.dp;
  tag.prefix = listing.optim.empty() ? "" : listing.optim.front().prefix;
  const std::string& prefix = tag.prefix;
  std::map<std::pair<uint32_t, uint32_t>, const RankFile*> by_rank;
  for (const RankFile& entry : listing.optim) {
    if (entry.prefix != prefix) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "name: prefix \"" + entry.prefix +
                             "\", but " + listing.optim.front().name + " has \"" + prefix +
                             "\" (files of two saves)");
    }
    if (entry.dp >= dp || entry.mp >= pp) {
      return Status::Corrupt(Prefix(tag_dir + "/" + entry.name) + "rank (" +
                             std::to_string(entry.dp) + ", " + std::to_string(entry.mp) +
                             ") outside dp_world_size " + std::to_string(dp) + " × mp_world_size " +
                             std::to_string(pp) + " of " + stages.front().name +
                             " (a file of another save)");
    }
    by_rank[{entry.mp, entry.dp}] = &entry;
  }
  std::vector<StageOptim>& optims = tag.optims;
  for (uint32_t s = 0; s < pp; ++s) {
    for (uint32_t r = 0; r < dp; ++r) {
      const auto it = by_rank.find({s, r});
      if (it == by_rank.end()) {
        return Status::NotFound(Prefix(tag_dir + "/" + OptimName(prefix, r, s)) +
                                "not found (dp_world_size " + std::to_string(dp) +
                                ", mp_world_size " + std::to_string(pp) + ")");
      }
      UCP_ASSIGN_OR_RETURN(StageOptim so, ReadStageOptim(tag_dir, *it->second));
      optims.push_back(std::move(so));
    }
  }
  for (uint32_t s = 0; s < pp; ++s) {
    for (uint32_t r = 0; r < dp; ++r) {
      OrderStatesAs(optims[uint64_t{s} * dp + r].states, optims.front().states);
      UCP_RETURN_IF_ERROR(CheckStageOptim(optims[uint64_t{s} * dp + r], stages[s], optims.front()));
    }
  }
  return Status::Ok();
}

// Phase 3 of BuildIndex: the layer files, one per layer holding a parameter, named with two or
// more digits, each parameter's layer among them and named by one stage.
Status ReadLayerFiles(const std::string& tag_dir, const TagListing& listing, PipeTag& tag) {
  const std::vector<StageModel>& stages = tag.stages;
  const uint32_t pp = tag.pp;
  const uint32_t dp = tag.dp;
  std::map<uint32_t, std::string>& layer_files = tag.layer_files;
  for (const std::string& name : listing.layer_files) {
    const std::optional<uint32_t> layer = LayerOfFile(name);
    if (!layer) {
      return Status::Unsupported(Prefix(tag_dir + "/" + name) +
                                 "not layer_<LL>-model_states.pt (tensor-parallel layer files "
                                 "are not supported yet)");
    }
    layer_files[*layer] = name;
  }
  uint64_t& layers = tag.layers;
  layers = layer_files.rbegin()->first + uint64_t{1};
  const std::optional<uint64_t> world = CheckedMul<uint64_t>(dp, pp);
  if (!world || *world > std::numeric_limits<uint32_t>::max()) {
    return FieldError(stages.front().reader, "dp_world_size",
                      "dp_world_size × mp_world_size exceeds 4294967295");
  }
  tag.world = static_cast<uint32_t>(*world);
  std::set<std::string> seen;
  for (const StageModel& sm : stages) {
    for (const std::string& name : sm.layout.names) {
      const uint32_t layer = *NumberedLayer(name);
      layers = std::max<uint64_t>(layers, layer + uint64_t{1});
      if (!layer_files.contains(layer)) {
        return Status::NotFound(Prefix(tag_dir + "/" + LayerStatesName(layer)) + "not found (" +
                                sm.name + " names " + name + ")");
      }
      if (!seen.insert(name).second) {
        return FieldError(sm.reader, "param_shapes/0/" + name, "listed by two stages");
      }
    }
  }
  if (layers > kMaxLayers) {
    return Status::Unsupported(Prefix(tag_dir) + "layer " + std::to_string(layers - 1) +
                               ": more than 4096 pipeline layers are not supported");
  }
  return Status::Ok();
}

// Phase 4 of BuildIndex: what the index is of, and its files: the stages' model states, the
// optimizer files, the layer files. Returns each layer's file in the index.
Result<LayerFileIndex> AddPipeFiles(const std::string& tag_dir, const PipeTag& tag,
                                    const IndexOptions& options, AtomIndexContents& c) {
  const std::map<uint32_t, std::string>& layer_files = tag.layer_files;
  const std::vector<StageModel>& stages = tag.stages;
  const std::vector<StageOptim>& optims = tag.optims;
  const uint32_t pp = tag.pp;
  const uint32_t dp = tag.dp;
  c.framework = "deepspeed";
  c.framework_version = stages.front().ds_version;
  c.adapter = std::string(DeepSpeedPipeAdapter::kName);
  c.adapter_schema = DeepSpeedPipeAdapter::kSchema;
  c.tag = TagName(tag_dir);
  c.topology = {dp, 1, pp, tag.world, 1};

  std::vector<std::string> paths;
  for (const StageModel& sm : stages) paths.push_back(sm.name);
  for (const StageOptim& so : optims) paths.push_back(so.entry.name);
  LayerFileIndex layer_file_index;  // layer → its file in the index
  for (const auto& [layer, name] : layer_files) {
    layer_file_index[layer] = static_cast<uint32_t>(paths.size());
    paths.push_back(name);
  }
  UCP_ASSIGN_OR_RETURN(const std::vector<FileDigest> digests,
                       HashTagFiles(tag_dir, paths, {options.threads, options.trust_journal}));
  for (size_t i = 0; i < paths.size(); ++i) {
    std::string role(kLayerRole);
    std::optional<RankCoordinates> rank;
    if (i < pp) {
      role = kModelRole;
      rank = RankCoordinates{0, 0, static_cast<uint32_t>(i)};
    } else if (i < pp + optims.size()) {
      role = kOptimRole;
      const StageOptim& so = optims[i - pp];
      rank = RankCoordinates{so.entry.dp, 0, so.entry.mp};
    }
    c.files.push_back({paths[i], digests[i].size, digests[i].xxh3, role, rank});
    c.files.back().chunks = digests[i].chunks;
  }
  return layer_file_index;
}

// Phase 5 of BuildIndex: each parameter's atoms (its ZeRO-1 partitions and its layer file's
// bit16 tensor), one group in stage order; `stage_sizes` gets each stage's parameter count.
Status AddPipeAtoms(const std::string& tag_dir, const PipeTag& tag,
                    const LayerFileIndex& layer_file_index, AtomIndexContents& c,
                    nlohmann::json& stage_sizes) {
  const std::map<uint32_t, std::string>& layer_files = tag.layer_files;
  const std::vector<StageModel>& stages = tag.stages;
  const std::vector<StageOptim>& optims = tag.optims;
  const uint32_t pp = tag.pp;
  const uint32_t dp = tag.dp;
  ParamGroup group =
      GroupSettings(optims.front().param_group, optims.front().reader, optims.front().states);

  std::map<uint32_t, TorchArchiveReader> layer_readers;
  for (uint32_t s = 0; s < pp; ++s) {
    const StageModel& sm = stages[s];
    const GroupLayout& layout = sm.layout;
    stage_sizes.push_back(layout.names.size());
    UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(layout.total, dp));
    const uint32_t first_file = pp + s * dp;  // rank r's optimizer file: first_file + r
    const StageOptim* stage_optims = &optims[uint64_t{s} * dp];
    std::vector<RankPartition> partitions;
    for (uint32_t r = 0; r < dp; ++r) {
      partitions.push_back({stage_optims[r].fp32, &stage_optims[r].states, first_file + r});
    }
    for (size_t k = 0; k < layout.names.size(); ++k) {
      const std::string& name = layout.names[k];
      group.params.push_back(name);
      UCP_RETURN_IF_ERROR(AddParameterAtoms(c.atoms, layout, k, p, partitions));

      // bit16: the layer file's tensor of the parameter.
      const uint32_t layer = *NumberedLayer(name);
      auto reader = layer_readers.find(layer);
      if (reader == layer_readers.end()) {
        UCP_ASSIGN_OR_RETURN(TorchArchiveReader opened,
                             TorchArchiveReader::Open(tag_dir + "/" + layer_files.at(layer)));
        reader = layer_readers.emplace(layer, std::move(opened)).first;
      }
      const std::string local = name.substr(name.find('.') + 1);
      const Value* node = OptionalField(reader->second, local);
      const TorchTensor* tensor = node == nullptr ? nullptr : reader->second.TensorAt(node);
      if (tensor == nullptr) {
        return FieldError(reader->second, local, "missing (" + sm.name + " names " + name + ")");
      }
      if (tensor->shape != layout.shapes[k] || !tensor->contiguous()) {
        return FieldError(reader->second, local,
                          ShapeText(tensor->shape) + " (or not contiguous), but " + sm.name +
                              " gives " + name + " " + ShapeText(layout.shapes[k]));
      }
      UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(tensor->shape));
      c.atoms.push_back(
          {name,
           "bit16",
           tensor->dtype,
           tensor->shape,
           {{layer_file_index.at(layer), tensor->file_offset(), tensor->dtype, std::move(whole)}}});
    }
  }
  c.groups.push_back(std::move(group));
  return Status::Ok();
}

// Phase 6 of BuildIndex: what the plans carry from the source files, and adapter_state.
void AddPipeCarried(const PipeTag& tag, const LayerFileIndex& layer_file_index,
                    nlohmann::json stage_sizes, AtomIndexContents& c) {
  const std::vector<StageOptim>& optims = tag.optims;
  const uint32_t pp = tag.pp;
  std::vector<std::string> rewritten_optim;
  for (const StateTensor& st : optims.front().states) {
    if (!st.tensor->shape.empty()) {
      rewritten_optim.push_back(std::string(kOsd) + "/base_optimizer_state/state/0/" + st.key);
    }
  }
  for (std::string& field : RewrittenPartitionFields(optims.front().reader)) {
    rewritten_optim.push_back(std::move(field));
  }
  for (uint32_t s = 0; s < pp; ++s) {
    c.carried.push_back(
        {std::string(kModelRole), s, {"param_shapes", "dp_world_size", "mp_world_size"}});
  }
  c.carried.push_back({std::string(kOptimRole), pp, rewritten_optim});
  c.carried.push_back(
      {std::string(kUniversalRole),
       pp,
       {std::string(kOsd) + "/base_optimizer_state", std::string(kOsd) + "/param_slice_mappings",
        std::string(kOsd) + "/single_partition_of_fp32_groups", "param_groups"}});
  nlohmann::json layer_file_state = nlohmann::json::object();
  for (const auto& [layer, file] : layer_file_index) {
    c.carried.push_back({std::string(kLayerRole), file, {}});
    layer_file_state[std::to_string(layer)] = file;
  }
  c.adapter_state = {
      {"optimizer", "DeepSpeedZeroOptimizer"},
      {"alignment_factor", kAlignmentFactor},
      {"zero_stage", 1},
      {"layers", tag.layers},
      {"stage_sizes", stage_sizes},
      {"layer_files", layer_file_state},
      {"file_prefix", tag.prefix},
  };
}

// ---------------------------------------------------------------------------------------------
// PlanReshard's phases.

// The target stages' layouts: their parameters, in the source's order.
Result<std::vector<GroupLayout>> StageLayouts(const IndexFacts& facts, const Placement& placement,
                                              uint32_t pp) {
  std::vector<GroupLayout> layouts;
  for (uint32_t s = 0; s < pp; ++s) {
    std::vector<std::string> names;
    std::vector<Shape> shapes;
    for (size_t k = 0; k < facts.names.size(); ++k) {
      if (placement.stage_of[k] == s) {
        names.push_back(facts.names[k]);
        shapes.push_back(facts.shapes[k]);
      }
    }
    if (names.empty()) {
      return Status::Unsupported("deepspeed: pp=" + std::to_string(pp) + ": stage " +
                                 std::to_string(s) + " holds no parameter by the " +
                                 placement.placement +
                                 " layer placement (DeepSpeed's optimizer cannot save it)");
    }
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, MakeLayout(std::move(names), std::move(shapes)));
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

// One model-states file per target stage, the first stage's its template: dp_world_size,
// mp_world_size and param_shapes (the stage's parameters, each torch.Size node from the source
// stage file naming it).
Status PlanStageModelStates(const AtomIndex& index, const std::string& tag_dir,
                            const IndexFacts& facts, const std::vector<GroupLayout>& layouts,
                            const Topology& target, OutputPlan& plan) {
  std::vector<TorchArchiveReader> sources;
  std::map<std::string, const Value*> size_nodes;
  for (const uint32_t file : facts.model_files) {
    UCP_ASSIGN_OR_RETURN(TorchArchiveReader reader, OpenSource(index, tag_dir, file));
    sources.push_back(std::move(reader));
  }
  for (const TorchArchiveReader& reader : sources) {
    UCP_ASSIGN_OR_RETURN(const Value* shapes, Field(reader, "param_shapes/0"));
    for (const auto& [name, value] : NamedChildren(shapes)) size_nodes[name] = value;
  }
  const TorchArchiveReader& model_template = sources.front();
  for (uint32_t s = 0; s < target.pp; ++s) {
    ArchiveOutput out;
    out.path = ModelStatesName(s);
    Value* root = out.graph.Import(model_template.root());
    out.graph.set_root(root);
    UCP_RETURN_IF_ERROR(
        SetDictItem(root, "dp_world_size", out.graph.Int(target.dp), model_template.path()));
    UCP_RETURN_IF_ERROR(
        SetDictItem(root, "mp_world_size", out.graph.Int(target.pp), model_template.path()));
    Value* shapes = root->Get("param_shapes");
    Value* group = shapes == nullptr ? nullptr : shapes->Item(0);
    if (group == nullptr || group->kind() != Kind::kObject) {
      return FieldError(model_template, "param_shapes/0", "not an OrderedDict");
    }
    std::vector<pickle::Mutation> items;
    for (const std::string& name : layouts[s].names) {
      const auto it = size_nodes.find(name);
      if (it == size_nodes.end()) {
        return Status::Corrupt(Prefix(tag_dir) + "param_shapes: no stage names " + name);
      }
      items.push_back(
          {pickle::Mutation::Op::kSetItem, out.graph.Str(name), out.graph.Import(it->second)});
    }
    for (const pickle::Mutation& mutation : group->mutations()) {
      if (mutation.op != pickle::Mutation::Op::kSetItem) items.push_back(mutation);
    }
    group->mutable_mutations() = std::move(items);
    UCP_ASSIGN_OR_RETURN(out.storages,
                         CollectStorages(root, model_template, facts.model_files.front(), {}));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

// Every target stage's optimizer file per DP rank.
Status PlanStageOptimStates(const AtomIndex& index, const std::string& tag_dir,
                            const IndexFacts& facts, const std::vector<GroupLayout>& layouts,
                            const Topology& target, OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader optim_template,
                       OpenSource(index, tag_dir, facts.optim_file));
  for (uint32_t s = 0; s < target.pp; ++s) {
    for (uint32_t r = 0; r < target.dp; ++r) {
      UCP_ASSIGN_OR_RETURN(ArchiveOutput out,
                           StageOptimFile(index, optim_template, facts.optim_file, layouts[s], r, s,
                                          target.dp, facts.prefix));
      plan.archives.push_back(std::move(out));
    }
  }
  return Status::Ok();
}

}  // namespace

bool DeepSpeedPipeAdapter::Recognizes(const std::string& tag_dir) const {
  Result<TagListing> listing = ListTag(tag_dir);
  if (!listing.ok()) return false;
  // Layer files that all name a TP rank are a pipeline with tensor parallelism: deepspeed-tp's.
  for (const std::string& name : listing->layer_files) {
    const std::optional<FileName> parsed = ParseFileName(name);
    if (!parsed || !parsed->model_rank) return true;
  }
  return false;
}

Result<std::vector<std::string>> DeepSpeedPipeAdapter::ExpectedFiles(
    const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  UCP_ASSIGN_OR_RETURN(
      const TorchArchiveReader first,
      OpenWrittenModelStates(tag_dir, ModelStatesName(0), listing.model_states.contains(0)));
  const std::string prefix = Bf16Prefix(listing, first) ? "bf16_" : "";
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(first));
  UCP_ASSIGN_OR_RETURN(const int64_t pp, IntField(first, "mp_world_size"));
  if (pp < 1 || pp > kMaxStages) {
    return FieldError(first, "mp_world_size", std::to_string(pp) + " is outside [1, 65536]");
  }
  std::set<std::string> layers(listing.layer_files.begin(), listing.layer_files.end());
  std::vector<std::string> files;
  for (uint32_t s = 0; s < pp; ++s) {
    files.push_back(ModelStatesName(s));
    // Every stage's rank 0 writes its model states before its optimizer file.
    UCP_RETURN_IF_ERROR(
        OpenWrittenModelStates(tag_dir, files.back(), listing.model_states.contains(s)).status());
    UCP_ASSIGN_OR_RETURN(const StageModel sm, ReadStageModel(tag_dir, files.back()));
    for (const std::string& name : sm.layout.names)
      layers.insert(LayerStatesName(*NumberedLayer(name)));
  }
  for (uint32_t s = 0; s < pp; ++s) {
    for (uint32_t r = 0; r < dp; ++r) files.push_back(OptimName(prefix, r, s));
  }
  files.insert(files.end(), layers.begin(), layers.end());
  return files;
}

Result<AtomIndex> DeepSpeedPipeAdapter::BuildIndex(const std::string& tag_dir,
                                                   const IndexOptions& options) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  if (!listing.zero3_model_states.empty()) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "zero_stage=3: a ZeRO-3 tag (the deepspeed-zero3 adapter reads it)");
  }
  if (listing.layer_files.empty()) {
    return Status::NotFound(Prefix(tag_dir) + "no layer_XX-model_states.pt files");
  }
  if (!listing.model_states.contains(0)) {
    return Status::NotFound(Prefix(tag_dir) + ModelStatesName(0) + ": not found");
  }
  PipeTag tag;
  UCP_RETURN_IF_ERROR(ReadStages(tag_dir, listing, tag));
  UCP_RETURN_IF_ERROR(ReadStageOptims(tag_dir, listing, tag));
  UCP_RETURN_IF_ERROR(ReadLayerFiles(tag_dir, listing, tag));
  AtomIndexContents c;
  UCP_ASSIGN_OR_RETURN(const LayerFileIndex layer_file_index,
                       AddPipeFiles(tag_dir, tag, options, c));
  nlohmann::json stage_sizes = nlohmann::json::array();
  UCP_RETURN_IF_ERROR(AddPipeAtoms(tag_dir, tag, layer_file_index, c, stage_sizes));
  AddPipeCarried(tag, layer_file_index, std::move(stage_sizes), c);
  return AtomIndex::Create(std::move(c), Prefix(tag_dir) + "index");
}

Result<OutputPlan> DeepSpeedPipeAdapter::PlanReshard(const AtomIndex& index,
                                                     const std::string& tag_dir,
                                                     const Topology& target) const {
  UCP_RETURN_IF_ERROR(RefuseExpertParallel(target));
  UCP_RETURN_IF_ERROR(CheckPipeTarget(target));
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const Placement placement, TargetPlacement(facts, target.pp));
  UCP_ASSIGN_OR_RETURN(const std::vector<GroupLayout> layouts,
                       StageLayouts(facts, placement, target.pp));
  OutputPlan plan;
  UCP_RETURN_IF_ERROR(PlanStageModelStates(index, tag_dir, facts, layouts, target, plan));
  UCP_RETURN_IF_ERROR(PlanStageOptimStates(index, tag_dir, facts, layouts, target, plan));
  // Layer files do not depend on the topology. Named, not taken from the index: over an atoms
  // store the file is read from its copy.
  for (const auto& [layer, file] : facts.layer_files) {
    plan.copies.push_back({LayerStatesName(layer), file});
  }
  return plan;
}

Result<OutputPlan> DeepSpeedPipeAdapter::PlanUniversalExport(const AtomIndex& index,
                                                             const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  std::map<std::string, bool> requires_grad;  // "<param>/<state>"
  UCP_RETURN_IF_ERROR(CollectGroupRequiresGrad(reader, 0, facts.names, requires_grad));
  OutputPlan plan;
  for (const Atom& atom : index.atoms()) {
    if (atom.state == "bit16") continue;
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        UniversalAtomArchive(index, atom, atom.shape, requires_grad[atom.param + "/" + atom.state],
                             !atom.shape.empty()));
    plan.archives.push_back(std::move(out));
  }

  // zero/optimizer_state.pt from optimizer file (0, 0)'s optimizer_state_dict.
  UCP_ASSIGN_OR_RETURN(ArchiveOutput out, UniversalOptimizerState(reader, facts.optim_file));
  plan.archives.push_back(std::move(out));

  for (uint32_t s = 0; s < facts.model_files.size(); ++s) {
    plan.copies.push_back({ModelStatesName(s), facts.model_files[s]});
  }
  return plan;
}

}  // namespace ucp
