#include "core/frameworks/deepspeed/zero.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <utility>

#include "core/format/torch_archive_reader.h"
#include "core/format/torch_archive_writer.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/plan/copy_plan.h"
#include "core/tag/file_hashing.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;
using deepspeed::AddParameterAtoms;
using deepspeed::AddUniversalModuleTensors;
using deepspeed::Bf16Prefix;
using deepspeed::CheckIndexAdapter;
using deepspeed::CheckOptimStates;
using deepspeed::CheckTarget;
using deepspeed::CheckZeroOptimizerStage;
using deepspeed::CollectGroupRequiresGrad;
using deepspeed::CollectStorages;
using deepspeed::DpWorldSize;
using deepspeed::ExpectedMappings;
using deepspeed::FieldError;
using deepspeed::FlatSegments;
using deepspeed::GroupLayout;
using deepspeed::GroupSettings;
using deepspeed::GroupStatesField;
using deepspeed::IndexedLayout;
using deepspeed::InOptimizerOrder;
using deepspeed::InRoundRobinOrder;
using deepspeed::IntField;
using deepspeed::kAlignmentFactor;
using deepspeed::kModelRole;
using deepspeed::kOptimRole;
using deepspeed::kOsd;
using deepspeed::kUniversalRole;
using deepspeed::ListTag;
using deepspeed::ListTagToRead;
using deepspeed::MakeLayout;
using deepspeed::ModelStates;
using deepspeed::ModelStatesName;
using deepspeed::OpenSource;
using deepspeed::OpenWrittenModelStates;
using deepspeed::OptimFilePrefix;
using deepspeed::OptimFilesByRank;
using deepspeed::OptimName;
using deepspeed::OptimStates;
using deepspeed::OptionalField;
using deepspeed::OrderStatesAs;
using deepspeed::Partition;
using deepspeed::Partitioning;
using deepspeed::PlanPartitionedOptimFile;
using deepspeed::PlanRankPart;
using deepspeed::Prefix;
using deepspeed::RankFile;
using deepspeed::RankGroupPart;
using deepspeed::RankPartition;
using deepspeed::ReadModelStates;
using deepspeed::ReadOptimStates;
using deepspeed::RefuseExpertParallel;
using deepspeed::ResizeModuleBuffers;
using deepspeed::RewrittenPartitionFields;
using deepspeed::SavablePartition;
using deepspeed::SaysTensorParallel;
using deepspeed::SetDictItem;
using deepspeed::ShapeText;
using deepspeed::StateNumel;
using deepspeed::StateTemplates;
using deepspeed::StateTemplatesOf;
using deepspeed::StateTensor;
using deepspeed::TagListing;
using deepspeed::TagName;
using deepspeed::UniversalAtomArchive;
using deepspeed::UniversalOptimizerState;
using deepspeed::WrittenRankZeroModelStates;
using pickle::Kind;
using pickle::Value;

constexpr std::string_view kBf16Optimizer = "BF16_Optimizer";
constexpr std::string_view kZeroOptimizer = "DeepSpeedZeroOptimizer";
constexpr char kZero3Refusal[] =
    "zero_stage=3: a ZeRO-3 tag (the deepspeed-zero3 adapter reads it)";

// ---------------------------------------------------------------------------------------------
// Plans.

// A layout's parameters in the flat order DeepSpeed uses at `dp` ranks.
Result<GroupLayout> Relayout(const GroupLayout& source, bool round_robin, uint32_t source_dp,
                             uint32_t dp) {
  if (!round_robin) return MakeLayout(source.names, source.shapes);
  return MakeLayout(InRoundRobinOrder(InOptimizerOrder(source.names, source_dp), dp),
                    InRoundRobinOrder(InOptimizerOrder(source.shapes, source_dp), dp));
}

// The index's layout of every group (source flat order) and the facts PlanReshard needs.
struct IndexFacts {
  std::vector<GroupLayout> groups;
  uint32_t dp = 0;
  bool round_robin = false;
  bool bf16_optimizer = false;
  bool elastic = false;  // OptimStates::elastic
  std::string prefix;
  uint32_t model_file = 0;
  uint32_t optim_file = 0;
};

Result<IndexFacts> ReadFacts(const AtomIndex& index) {
  const AtomIndexContents& c = index.contents();
  UCP_RETURN_IF_ERROR(CheckIndexAdapter(index, DeepSpeedZeroAdapter::kName));
  IndexFacts facts;
  facts.dp = c.topology.dp;
  const nlohmann::json& state = c.adapter_state;
  if (!state.is_object() || !state.contains("optimizer") || !state["optimizer"].is_string() ||
      !state.contains("file_prefix") || !state["file_prefix"].is_string() ||
      !state.contains("round_robin_gradients") || !state["round_robin_gradients"].is_boolean()) {
    return Status::Corrupt(
        "deepspeed: index adapter_state: optimizer, file_prefix or "
        "round_robin_gradients missing or mistyped");
  }
  facts.bf16_optimizer = state["optimizer"].get<std::string>() == kBf16Optimizer;
  UCP_ASSIGN_OR_RETURN(facts.prefix, OptimFilePrefix(state));
  facts.round_robin = state["round_robin_gradients"].get<bool>();
  // Indexes written before elastic tags were read have no such key, and hold rigid tags.
  if (state.contains("elastic_checkpoint")) {
    if (!state["elastic_checkpoint"].is_boolean()) {
      return Status::Corrupt("deepspeed: index adapter_state: elastic_checkpoint not a boolean");
    }
    facts.elastic = state["elastic_checkpoint"].get<bool>();
  }
  UCP_ASSIGN_OR_RETURN(const StateTemplates templates, StateTemplatesOf(index));
  facts.model_file = templates.model_file;
  facts.optim_file = templates.optim_file;
  for (const ParamGroup& group : c.groups) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, IndexedLayout(index, group.params));
    facts.groups.push_back(std::move(layout));
  }
  return facts;
}

// ZeRO-3, pipeline and tensor-parallel tags, told apart by their file names.
Status RefuseListing(const std::string& tag_dir, const TagListing& listing) {
  if (!listing.zero3_model_states.empty()) {
    return Status::Unsupported(Prefix(tag_dir) + kZero3Refusal);
  }
  if (!listing.layer_files.empty()) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "a pipeline tag (the deepspeed-tp adapter reads it)");
  }
  if (listing.model_states.size() > 1) {
    return Status::Unsupported(Prefix(tag_dir) +
                               "tp=" + std::to_string(listing.model_states.size()) +
                               ": a tensor-parallel tag (the deepspeed-tp adapter reads it)");
  }
  return Status::Ok();
}

// Why a TP=1 tag of this adapter cannot be split over `tp` ranks: the client's
// universal_checkpoint_info (Megatron-DeepSpeed's) says which parameters are split on which
// dimension, and the deepspeed-tp adapter reads tags that carry it.
Status RefuseTensorParallel(const AtomIndex& index, const std::string& tag_dir, uint32_t model_file,
                            uint32_t tp) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model, OpenSource(index, tag_dir, model_file));
  const std::string what = "deepspeed: tp=" + std::to_string(tp) + ": " + model.path() + ": ";
  const Value* info = OptionalField(model, "universal_checkpoint_info");
  if (info == nullptr || info->kind() != Kind::kDict) {
    return Status::Unsupported(
        what +
        "no universal_checkpoint_info in the model states: no rules say which parameters are "
        "split over TP ranks, on which dimension, or replicated, so a TP=1 tag without it cannot "
        "be split (Megatron-DeepSpeed saves it in the client state)");
  }
  return Status::FailedPrecondition(
      what +
      "the tag carries universal_checkpoint_info, but this index was built by the "
      "deepspeed-zero12 adapter, which keeps no shard maps: rebuild it (`ucp index` on the tag) "
      "so that the deepspeed-tp adapter reads it");
}

// ---------------------------------------------------------------------------------------------
// BuildIndex's phases.

// A ZeRO-1/2 tag, read: rank 0's model states and every DP rank's optimizer file (rank order,
// their states in the first's order, each checked against the model states).
struct ZeroTag {
  ModelStates ms;
  std::vector<OptimStates> ranks;
  int64_t zero_stage = 1;
};

Result<ZeroTag> ReadZeroTag(const std::string& tag_dir) {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  UCP_RETURN_IF_ERROR(RefuseListing(tag_dir, listing));
  if (listing.model_states.empty() || listing.model_states.begin()->first != 0) {
    return Status::NotFound(Prefix(tag_dir) + ModelStatesName(0) + ": not found");
  }
  if (listing.optim.empty()) {
    return Status::NotFound(Prefix(tag_dir) + "no zero_pp_rank_*_optim_states.pt files");
  }
  UCP_ASSIGN_OR_RETURN(ModelStates ms,
                       ReadModelStates(tag_dir, listing.model_states.begin()->second));
  if (ms.config_stage && *ms.config_stage >= 3) {
    return Status::Unsupported(Prefix(tag_dir) + kZero3Refusal);
  }
  UCP_ASSIGN_OR_RETURN(const std::vector<const RankFile*> by_rank,
                       OptimFilesByRank(tag_dir, listing, ms.dp, ms.name));
  std::vector<OptimStates> ranks;
  for (uint32_t r = 0; r < ms.dp; ++r) {
    UCP_ASSIGN_OR_RETURN(OptimStates os,
                         ReadOptimStates(tag_dir, *by_rank[r], ms.groups.size(), kZero3Refusal));
    ranks.push_back(std::move(os));
  }
  // ReadModelStates admits no dp_world_size below 1; saying so also tells the compiler.
  if (ranks.empty()) return Status::Internal(Prefix(tag_dir) + "no optimizer files read");
  // DeepSpeed's BF16 optimizer ignores round_robin_gradients: its flat groups keep the order.
  if (ranks.front().bf16_optimizer) ms.round_robin = false;
  for (OptimStates& os : ranks) {
    OrderStatesAs(os, ranks.front());
    UCP_RETURN_IF_ERROR(CheckOptimStates(os, ms, ranks.front()));
  }
  const int64_t zero_stage = ms.config_stage.value_or(ranks.front().zero_stage.value_or(1));
  return ZeroTag{std::move(ms), std::move(ranks), zero_stage};
}

// The model states, then each rank's optimizer file, hashed.
Status AddZeroFiles(const std::string& tag_dir, const ZeroTag& tag, const IndexOptions& options,
                    AtomIndexContents& c) {
  std::vector<std::string> paths = {tag.ms.name};
  for (const OptimStates& os : tag.ranks) paths.push_back(os.entry.name);
  UCP_ASSIGN_OR_RETURN(const std::vector<FileDigest> digests,
                       HashTagFiles(tag_dir, paths, {options.threads, options.trust_journal}));
  for (size_t i = 0; i < paths.size(); ++i) {
    IndexedFile file{paths[i], digests[i].size, digests[i].xxh3,
                     std::string(i == 0 ? kModelRole : kOptimRole), std::nullopt};
    if (i > 0) file.rank = RankCoordinates{static_cast<uint32_t>(i - 1), 0, 0};
    file.chunks = digests[i].chunks;
    c.files.push_back(std::move(file));
  }
  return Status::Ok();
}

// `name`'s bit16 atom: its module tensor, checked against param_shapes' shape and place.
Status AddBit16Atom(const ModelStates& ms, const std::map<std::string, const TorchTensor*>& module,
                    size_t g, size_t k, const Partitioning& p, std::vector<Atom>& atoms) {
  const GroupLayout& layout = ms.groups[g];
  const std::string& name = layout.names[k];
  const std::string gs = std::to_string(g);
  const auto it = module.find(name);
  if (it == module.end() || it->second == nullptr) {
    return FieldError(ms.reader, "module/" + name, "missing (param_shapes/" + gs + " names it)");
  }
  const TorchTensor& bit16 = *it->second;
  if (bit16.shape != layout.shapes[k]) {
    return FieldError(
        ms.reader, "param_shapes/" + gs + "/" + name,
        ShapeText(layout.shapes[k]) + ", but module/" + name + " is " + ShapeText(bit16.shape));
  }
  if (!bit16.contiguous()) return FieldError(ms.reader, "module/" + name, "not contiguous");
  // Module tensors saved as views of the flat buffer show where the data really is.
  if (bit16.storage->numel == p.padded && bit16.storage_offset != layout.offsets[k]) {
    return FieldError(ms.reader, "module/" + name,
                      "a view at element " + std::to_string(bit16.storage_offset) +
                          " of the flat buffer, but param_shapes/" + gs + " places it at " +
                          std::to_string(layout.offsets[k]));
  }
  UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(bit16.shape));
  atoms.push_back(
      {name, "bit16", bit16.dtype, bit16.shape, {{0, bit16.file_offset(), bit16.dtype, whole}}});
  return Status::Ok();
}

// Per parameter group its settings, and per parameter its optimizer states' atoms (made of the
// DP ranks' partitions) and its bit16 atom.
Status AddZeroAtoms(const ZeroTag& tag, AtomIndexContents& c) {
  const ModelStates& ms = tag.ms;
  const OptimStates& first = tag.ranks.front();
  std::map<std::string, const TorchTensor*> module;
  if (const Value* node = OptionalField(ms.reader, "module")) {
    for (const auto& [name, value] : NamedChildren(node)) module[name] = ms.reader.TensorAt(value);
  }
  std::set<std::string> seen;
  for (size_t g = 0; g < ms.groups.size(); ++g) {
    const GroupLayout& layout = ms.groups[g];
    UCP_ASSIGN_OR_RETURN(const Partitioning p, Partition(layout.total, ms.dp));
    // An elastic file keeps no param_groups, so no hyperparameters.
    ParamGroup group =
        GroupSettings(first.groups[g].param_group, first.reader, first.groups[g].states);
    group.params = layout.names;
    c.groups.push_back(std::move(group));

    std::vector<RankPartition> partitions;
    for (uint32_t r = 0; r < ms.dp; ++r) {
      partitions.push_back({tag.ranks[r].groups[g].fp32, &tag.ranks[r].groups[g].states, 1 + r});
    }
    for (size_t k = 0; k < layout.names.size(); ++k) {
      if (!seen.insert(layout.names[k]).second) {
        return FieldError(ms.reader, "param_shapes/" + std::to_string(g) + "/" + layout.names[k],
                          "listed twice");
      }
      UCP_RETURN_IF_ERROR(AddParameterAtoms(c.atoms, layout, k, p, partitions));
      UCP_RETURN_IF_ERROR(AddBit16Atom(ms, module, g, k, p, c.atoms));
    }
  }
  return Status::Ok();
}

// What a reshard rewrites in the model states, the optimizer files and the universal export.
std::vector<CarriedObject> ZeroCarried(const ZeroTag& tag) {
  const OptimStates& first = tag.ranks.front();
  std::vector<std::string> rewritten_optim;
  for (size_t g = 0; g < tag.ms.groups.size(); ++g) {
    for (const StateTensor& st : first.groups[g].states) {
      if (!st.tensor->shape.empty()) {
        rewritten_optim.push_back(GroupStatesField(first.elastic, g) + "/" + st.key);
      }
    }
  }
  for (std::string& field : RewrittenPartitionFields(first.reader)) {
    rewritten_optim.push_back(std::move(field));
  }
  std::vector<std::string> rewritten_model = {"dp_world_size"};
  if (tag.ms.round_robin) rewritten_model.push_back("param_shapes");
  return {
      {std::string(kModelRole), 0, rewritten_model},
      {std::string(kOptimRole), 1, rewritten_optim},
      {std::string(kUniversalRole),
       1,
       {std::string(kOsd) + "/base_optimizer_state", std::string(kOsd) + "/param_slice_mappings",
        std::string(kOsd) + "/single_partition_of_fp32_groups", "param_groups"}}};
}

// ---------------------------------------------------------------------------------------------
// PlanReshard's phases.

// Every group's flat order and partitioning at the target's `dp` ranks.
struct TargetLayout {
  uint32_t dp = 0;
  std::vector<GroupLayout> groups;
  std::vector<Partitioning> partitions;
};

Result<TargetLayout> LayoutAtTarget(const IndexFacts& facts, uint32_t dp) {
  TargetLayout at;
  at.dp = dp;
  for (const GroupLayout& source : facts.groups) {
    UCP_ASSIGN_OR_RETURN(GroupLayout layout, Relayout(source, facts.round_robin, facts.dp, dp));
    UCP_ASSIGN_OR_RETURN(const Partitioning p, SavablePartition(layout.total, dp, "a group"));
    at.groups.push_back(std::move(layout));
    at.partitions.push_back(p);
  }
  return at;
}

// param_shapes' groups put in `layouts`' order, as a round-robin save at the target lists them.
Status ReorderParamShapes(Value* root, const std::vector<GroupLayout>& layouts,
                          const std::string& path) {
  Value* shapes = root->Get("param_shapes");
  for (size_t g = 0; g < layouts.size() && shapes != nullptr; ++g) {
    Value* group = shapes->Item(g);
    if (group == nullptr || group->kind() != Kind::kObject) {
      return Status::Corrupt(Prefix(path) + "param_shapes/" + std::to_string(g) +
                             ": not an OrderedDict");
    }
    std::map<std::string, pickle::Mutation> by_name;
    for (const pickle::Mutation& mutation : group->mutations()) {
      if (mutation.op == pickle::Mutation::Op::kSetItem) {
        by_name.emplace(KeyText(mutation.first), mutation);
      }
    }
    std::vector<pickle::Mutation> reordered;
    for (const std::string& name : layouts[g].names) {
      const auto it = by_name.find(name);
      if (it == by_name.end()) {
        return Status::Corrupt(Prefix(path) + "param_shapes/" + std::to_string(g) + "/" + name +
                               ": missing");
      }
      reordered.push_back(it->second);
    }
    group->mutable_mutations() = std::move(reordered);
  }
  return Status::Ok();
}

// Model states: dp_world_size (and a round-robin flat order) rewritten, the rest carried.
Status PlanModelStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const TargetLayout& at, OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.model_file));
  ArchiveOutput out;
  // Named, not taken from the index: over an atoms store the file is read from its copy.
  out.path = ModelStatesName(0);
  Value* root = out.graph.Import(reader.root());
  out.graph.set_root(root);
  UCP_RETURN_IF_ERROR(SetDictItem(root, "dp_world_size", out.graph.Int(at.dp), reader.path()));
  std::map<std::string, std::vector<Segment>> resized;
  if (facts.round_robin) {
    UCP_RETURN_IF_ERROR(ReorderParamShapes(root, at.groups, reader.path()));
  } else {
    UCP_RETURN_IF_ERROR(ResizeModuleBuffers(out.graph, reader, facts.model_file, facts.groups,
                                            facts.dp, at.dp, resized));
  }
  UCP_ASSIGN_OR_RETURN(out.storages,
                       CollectStorages(root, reader, facts.model_file, std::move(resized)));
  plan.archives.push_back(std::move(out));
  return Status::Ok();
}

// One optimizer file per target rank, rank 0's file its template: each group's partition of
// every state, and the partition fields (fp32 partitions, paddings, slice mappings).
Status PlanOptimStates(const AtomIndex& index, const std::string& tag_dir, const IndexFacts& facts,
                       const TargetLayout& at, OutputPlan& plan) {
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  const std::vector<uint64_t> counts(at.groups.size(), at.dp);
  for (uint32_t r = 0; r < at.dp; ++r) {
    const auto group_of = [&](size_t g) -> Result<RankGroupPart> {
      const GroupLayout& layout = at.groups[g];
      const Partitioning& p = at.partitions[g];
      RankGroupPart group;
      group.part = PlanRankPart(p, r, layout.total, facts.elastic, facts.bf16_optimizer);
      UCP_ASSIGN_OR_RETURN(const Partitioning source_p, Partition(facts.groups[g].total, facts.dp));
      // The template is rank 0's file.
      group.part.sizes.template_numel =
          StateNumel(facts.elastic, source_p.partition, source_p.padding_of(0));
      group.padding = p.padding_of(r);
      group.mappings = ExpectedMappings(layout, p, r, facts.round_robin);
      group.params = layout.names.size();
      group.segments_of = [&index, &layout](const std::string& state, uint64_t begin,
                                            uint64_t end) {
        return FlatSegments(index, layout, state, begin, end);
      };
      return group;
    };
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        PlanPartitionedOptimFile(reader, facts.optim_file, OptimName(facts.prefix, r, 0),
                                 facts.elastic, at.groups.size(), group_of, counts));
    plan.archives.push_back(std::move(out));
  }
  return Status::Ok();
}

}  // namespace

bool DeepSpeedZeroAdapter::Recognizes(const std::string& tag_dir) const {
  Result<TagListing> listing = ListTag(tag_dir);
  if (!listing.ok() || !listing->zero3_model_states.empty() || !listing->layer_files.empty() ||
      !listing->expert_files.empty()) {
    return false;
  }
  // Tensor-parallel tags (mp ranks > 0 without pipeline layer files) are DeepSpeedTpAdapter's,
  // told by the model states while only TP rank 0's files are written.
  const bool tensor_parallel =
      (!listing->model_states.empty() && listing->model_states.rbegin()->first > 0) ||
      std::any_of(listing->optim.begin(), listing->optim.end(),
                  [](const RankFile& entry) { return entry.mp > 0; });
  if (tensor_parallel || (listing->model_states.empty() && listing->optim.empty())) return false;
  const std::optional<TorchArchiveReader> model = WrittenRankZeroModelStates(tag_dir, *listing);
  return !model || !SaysTensorParallel(*model);
}

Result<std::vector<std::string>> DeepSpeedZeroAdapter::ExpectedFiles(
    const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const TagListing listing, ListTagToRead(tag_dir));
  UCP_RETURN_IF_ERROR(RefuseListing(tag_dir, listing));
  const std::string model = ModelStatesName(0);
  // DeepSpeed's rank 0 writes the model states before its optimizer file and the commit signal.
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenWrittenModelStates(tag_dir, model, listing.model_states.contains(0)));
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(reader));
  UCP_ASSIGN_OR_RETURN(const int64_t mp, IntField(reader, "mp_world_size"));
  if (mp != 1) {
    return Status::Unsupported(Prefix(reader.path()) + "mp_world_size " + std::to_string(mp) +
                               ": tp=" + std::to_string(mp) +
                               ": a tensor-parallel tag (the deepspeed-tp adapter reads it)");
  }
  const bool bf16 = Bf16Prefix(listing, reader);
  const Value* config = OptionalField(reader, "ds_config");
  if (config != nullptr && config->kind() == Kind::kDict) {
    UCP_RETURN_IF_ERROR(CheckZeroOptimizerStage(reader, tag_dir, bf16, kZero3Refusal));
  }
  std::vector<std::string> files = {model};
  const std::string prefix = bf16 ? "bf16_" : "";
  for (uint32_t r = 0; r < dp; ++r) files.push_back(OptimName(prefix, r, 0));
  return files;
}

Result<AtomIndex> DeepSpeedZeroAdapter::BuildIndex(const std::string& tag_dir,
                                                   const IndexOptions& options) const {
  UCP_ASSIGN_OR_RETURN(const ZeroTag tag, ReadZeroTag(tag_dir));
  const OptimStates& first = tag.ranks.front();
  AtomIndexContents c;
  c.framework = "deepspeed";
  c.framework_version = tag.ms.ds_version;
  c.adapter = std::string(kName);
  c.adapter_schema = kSchema;
  c.tag = TagName(tag_dir);
  c.topology = {tag.ms.dp, 1, 1, tag.ms.dp, static_cast<uint32_t>(tag.zero_stage)};
  UCP_RETURN_IF_ERROR(AddZeroFiles(tag_dir, tag, options, c));
  UCP_RETURN_IF_ERROR(AddZeroAtoms(tag, c));
  c.carried = ZeroCarried(tag);
  c.adapter_state = {
      {"optimizer", std::string(first.bf16_optimizer ? kBf16Optimizer : kZeroOptimizer)},
      {"file_prefix", first.entry.prefix},
      {"mp_rank", 0},
      {"alignment_factor", kAlignmentFactor},
      {"round_robin_gradients", tag.ms.round_robin},
      {"fp32_padding_stripped", !first.bf16_optimizer},
      {"zero_stage", tag.zero_stage},
      {"elastic_checkpoint", first.elastic},
  };
  return AtomIndex::Create(std::move(c), Prefix(tag_dir) + "index");
}

Result<OutputPlan> DeepSpeedZeroAdapter::PlanReshard(const AtomIndex& index,
                                                     const std::string& tag_dir,
                                                     const Topology& target) const {
  UCP_RETURN_IF_ERROR(RefuseExpertParallel(target));
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  if (target.tp > 1 && target.pp == 1) {
    return RefuseTensorParallel(index, tag_dir, facts.model_file, target.tp);
  }
  UCP_RETURN_IF_ERROR(CheckTarget(target));
  UCP_ASSIGN_OR_RETURN(const TargetLayout at, LayoutAtTarget(facts, target.dp));
  OutputPlan plan;
  UCP_RETURN_IF_ERROR(PlanModelStates(index, tag_dir, facts, at, plan));
  UCP_RETURN_IF_ERROR(PlanOptimStates(index, tag_dir, facts, at, plan));
  return plan;
}

Result<OutputPlan> DeepSpeedZeroAdapter::PlanUniversalExport(const AtomIndex& index,
                                                             const std::string& tag_dir) const {
  UCP_ASSIGN_OR_RETURN(const IndexFacts facts, ReadFacts(index));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader reader,
                       OpenSource(index, tag_dir, facts.optim_file));
  const std::string osd(kOsd);
  if (facts.elastic) {
    return Status::Unsupported(
        Prefix(reader.path()) + osd +
        "/base_optimizer_state: an elastic checkpoint keeps no param_groups, which "
        "zero/optimizer_state.pt carries (ds_to_universal cannot convert it either); reshard it "
        "(`ucp reshard`) or resume it under the preload instead");
  }

  std::map<std::string, bool> requires_grad;  // "<param>/<state>"
  for (size_t g = 0; g < facts.groups.size(); ++g) {
    UCP_RETURN_IF_ERROR(CollectGroupRequiresGrad(reader, g, facts.groups[g].names, requires_grad));
  }

  OutputPlan plan;
  std::set<std::string> grouped;  // every parameter of a group
  for (const Atom& atom : index.atoms()) {
    grouped.insert(atom.param);
    if (atom.state == "bit16") continue;
    // step.pt is the bare 0-d tensor.
    UCP_ASSIGN_OR_RETURN(
        ArchiveOutput out,
        UniversalAtomArchive(index, atom, atom.shape, requires_grad[atom.param + "/" + atom.state],
                             !atom.shape.empty()));
    plan.archives.push_back(std::move(out));
  }

  // zero/optimizer_state.pt from rank 0's optimizer_state_dict.
  UCP_ASSIGN_OR_RETURN(ArchiveOutput out, UniversalOptimizerState(reader, facts.optim_file));
  plan.archives.push_back(std::move(out));
  UCP_ASSIGN_OR_RETURN(const TorchArchiveReader model,
                       OpenSource(index, tag_dir, facts.model_file));
  UCP_RETURN_IF_ERROR(AddUniversalModuleTensors(model, facts.model_file, grouped,
                                                index.contents().framework_version, plan));

  // Named, not taken from the index: over an atoms store the file is read from its copy.
  plan.copies.push_back({ModelStatesName(0), facts.model_file});
  return plan;
}

}  // namespace ucp
