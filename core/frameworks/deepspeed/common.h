// Pieces the DeepSpeed adapters share (zero.h: ZeRO-1/2; tp.h: the grid of pipeline stages and
// tensor-parallel ranks; zero3.h: ZeRO-3; moe.h: experts): file names of a tag, typed reads
// of pickle fields with errors naming the file and the field, ZeRO-1/2's partitioning rules and
// optimizer files, and the building blocks of plans over a template archive. Internal to hooks/;
// not an interface.
//
// Thread-safety: pure functions of their arguments (ListTag, OpenSource, ReadModelStates and
// ReadOptimStates read the file system).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/file_names.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

// Roles of the index's files and carried objects.
inline constexpr std::string_view kModelRole = "model_states";
inline constexpr std::string_view kOptimRole = "optim_states";
inline constexpr std::string_view kUniversalRole = "universal_optimizer_state";
inline constexpr std::string_view kLayerRole = "layer_states";
// The optimizer files' top-level entry.
inline constexpr std::string_view kOsd = "optimizer_state_dict";
// Under kOsd since DeepSpeed 0.19 (ZeRO-1/2): per group, the padding after each parameter.
inline constexpr std::string_view kParamAlignmentPaddings = "param_alignment_paddings";

// "deepspeed: <where>: ", the start of every message.
std::string Prefix(const std::string& where);

// A per-rank file of a tag, by name.
struct RankFile {
  std::string name;
  std::string prefix;  // "" or "bf16_" (optimizer files)
  uint32_t dp = 0;
  uint32_t mp = 0;
};

// The DeepSpeed file names directly in a tag directory.
struct TagListing {
  std::map<uint32_t, std::string> model_states;  // mp_rank_XX_model_states.pt: mp rank → name
  std::vector<RankFile> optim;                   // [bf16_]zero_pp_rank_N_mp_rank_XX_optim_states.pt
  std::vector<RankFile> zero3_model_states;      // zero_pp_rank_N_mp_rank_XX_model_states.pt
  std::vector<std::string> layer_files;          // layer_XX-model_states.pt
  // DeepSpeed-MoE's layer_L_expert_E_mp_rank_XX_model_states.pt, expp_rank_N_mp_rank_XX_optim_…
  std::vector<std::string> expert_files;
};

// Lists `tag_dir` (names only; no file is opened).
Result<TagListing> ListTag(const std::string& tag_dir);

// ListTag for an adapter about to read the tag's files: kUnsupported naming the tag and an expert
// file when it holds DeepSpeed-MoE's expert files (no adapter reads the experts' placement yet).
Result<TagListing> ListTagToRead(const std::string& tag_dir);

// Typed reads of the pickle field at `field` (a '/'-separated path, TorchArchiveReader::Find);
// kCorrupt naming the file and the field when it is missing or of another type.
Status FieldError(const TorchArchiveReader& reader, std::string_view field, std::string what);
Result<const pickle::Value*> Field(const TorchArchiveReader& reader, std::string_view field);
// nullptr when missing.
const pickle::Value* OptionalField(const TorchArchiveReader& reader, std::string_view field);
Result<int64_t> IntField(const TorchArchiveReader& reader, std::string_view field);
Result<std::string> StrField(const TorchArchiveReader& reader, std::string_view field);
Result<std::vector<int64_t>> IntListField(const TorchArchiveReader& reader, std::string_view field);

// "[1, 2, 3]"
std::string ListText(const std::vector<int64_t>& values);
std::string ShapeText(const Shape& shape);
// torch.Size((a, b)) as pickled (REDUCE(torch.Size, ((a, b),))), or a plain tuple/list of
// non-negative ints; nullopt otherwise.
std::optional<Shape> ShapeOf(const pickle::Value* node);
// ZeroStageEnum as pickled (getattr(ZeroStageEnum, 'weights'), ZeroStageEnum(3)) or a plain int.
std::optional<int64_t> ZeroStageOf(const pickle::Value* node);
// A pickled hyperparameter as JSON (numbers, strings, bools, None, lists, str-keyed dicts);
// anything else as its canonical rendering.
nlohmann::json JsonOf(const pickle::Value* node);
// The value of a 0-d float32, float64 or int64 tensor; nullopt for other dtypes or a read error.
std::optional<nlohmann::json> ScalarValue(const TorchArchiveReader& reader,
                                          const TorchTensor& tensor);
// The last component of `tag_dir` (a trailing '/' ignored).
std::string TagName(const std::string& tag_dir);

// Rank 0's model-states file `name` of a save that may still be running: kFailedPrecondition while
// `present` is false or the file is not yet a complete archive (its zip directory is written
// last); kUnsupported, at once, for a file in torch's legacy serialization, which is never read.
Result<TorchArchiveReader> OpenWrittenModelStates(const std::string& tag_dir,
                                                  const std::string& name, bool present);
// TP rank 0's model states of a tag, once a complete archive: its other TP ranks' files may be
// written after the commit, so until they are, only these tell a TP tag from a TP=1 one.
std::optional<TorchArchiveReader> WrittenRankZeroModelStates(const std::string& tag_dir,
                                                             const TagListing& listing);
// Whether a model-states file says mp_world_size > 1.
bool SaysTensorParallel(const TorchArchiveReader& model_states);
// dp_world_size of a model-states file, kCorrupt outside [1, 2^24] (bounding the per-rank file
// lists a corrupt value would make).
Result<uint32_t> DpWorldSize(const TorchArchiveReader& model_states);
// Whether the optimizer files of the save are bf16_ ones (engine._get_zero_ckpt_name: exactly
// when the config enables bf16, as "bf16" or the older "bfloat16" {"enabled": ...}); the config
// may be a path rather than a dict, so an optimizer file already named bf16_ also tells.
bool Bf16Prefix(const TagListing& listing, const TorchArchiveReader& model_states);

// Parameters laid out one after another in a flat buffer, in `names` order.
struct GroupLayout {
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  std::vector<uint64_t> offsets;  // element offset of each param in the flat buffer
  std::vector<uint64_t> numels;
  uint64_t total = 0;  // real elements
};
// kOutOfRange when the element counts overflow.
Result<GroupLayout> MakeLayout(std::vector<std::string> names, std::vector<Shape> shapes);

// What every adapter reads first from an index it planned from.
// kInvalidArgument naming both when the index was written by another adapter than `adapter`.
Status CheckIndexAdapter(const AtomIndex& index, std::string_view adapter);
// The index's carried model-states and optimizer-states templates (the last of each role);
// kCorrupt when either is missing.
struct StateTemplates {
  uint32_t model_file = 0;
  uint32_t optim_file = 0;
};
Result<StateTemplates> StateTemplatesOf(const AtomIndex& index);
// adapter_state's "file_prefix" of the optimizer files: "" or "bf16_"; kCorrupt otherwise. The
// member's presence and type are the caller's to check.
Result<std::string> OptimFilePrefix(const nlohmann::json& adapter_state);

// Opens index file `file` under `tag_dir` (File::OpenBeneath: never outside it), kCorrupt when
// its size is no longer the index's.
Result<TorchArchiveReader> OpenSource(const AtomIndex& index, const std::string& tag_dir,
                                      uint32_t file);
// The ('storage', cls, key, location, numel) tuple of a persistent-id node, or nullptr.
const pickle::Value* PidTuple(const pickle::Value* node);
// The storages of `root`'s archive: those in `replaced` as given, every other one carried from
// `template_reader`'s record (source file `file`). Every reference to one key must agree on its
// element count (a carried view of a rewritten storage would not): kInternal otherwise.
Result<std::vector<OutputStorage>> CollectStorages(
    pickle::Value* root, const TorchArchiveReader& template_reader, uint32_t file,
    std::map<std::string, std::vector<Segment>> replaced);
// Erases str key `key` from dict `dict` where it has it.
void EraseKey(pickle::Value* dict, std::string_view key);
// Replaces the value of str key `key` of dict `dict` (kCorrupt naming `where` when missing).
Status SetDictItem(pickle::Value* dict, std::string_view key, pickle::Value* value,
                   const std::string& where);
// A pickled list of ints.
pickle::Value* IntList(pickle::Graph& graph, const std::vector<uint64_t>& values);
// torch.Size((a, b, ...)) as torch pickles it.
pickle::Value* SizeNode(pickle::Graph& graph, const Shape& shape);
// A param_shapes (or frozen_param_shapes) entry's value `saved` for `shape`: AutoEP saves each
// shape as a tuple, other saves a torch.Size (kept so).
pickle::Value* ShapeNodeLike(pickle::Graph& graph, const pickle::Value* saved, const Shape& shape);
// Writes a ZeRO-1/2 rank's partition fields into its optimizer_state_dict `dict`, one entry per
// group: single_partition_of_fp32_groups (`fp32_partitions`), group_paddings, partition_count
// (`partition_counts`: the ranks each group is partitioned over) and param_slice_mappings
// (`mappings`), and, where the
// file has it (DeepSpeed >= 0.19), param_alignment_paddings: a zero after each of the
// `params_per_group` parameters (CheckNoParameterAlignment admitted only such files). kCorrupt
// naming `where` when `dict` lacks one of the first four.
Status SetPartitionFields(pickle::Graph& graph, pickle::Value* dict,
                          std::vector<pickle::Value*> fp32_partitions,
                          const std::vector<uint64_t>& group_paddings,
                          const std::vector<uint64_t>& partition_counts,
                          std::vector<pickle::Value*> mappings,
                          const std::vector<size_t>& params_per_group, const std::string& where);
// The fields of a ZeRO-1/2 optimizer file that SetPartitionFields rewrites, as paths under the
// root (kOsd/...): param_alignment_paddings only where `r` has it.
std::vector<std::string> RewrittenPartitionFields(const TorchArchiveReader& r);
// DeepSpeed >= 0.19 records in optimizer_state_dict/param_alignment_paddings, per group, the
// padding it put after each parameter in the flat buffer (zero_optimization.
// parameter_alignment; all zeros when it is off, the default). The flat groups ucp reads have no
// gaps: kUnsupported when any padding is not zero, kCorrupt when the field is malformed; Ok when
// it is absent (older releases).
Status CheckNoParameterAlignment(const TorchArchiveReader& r, size_t groups);
// A tensor node like template `tensor` (dtype, location, requires_grad, parameter-ness) of
// `shape`, viewing element 0 on of a storage of `storage_numel` elements under `key`.
Result<pickle::Value*> TensorLike(pickle::Graph& graph, const TorchTensor& tensor, std::string key,
                                  Shape shape, uint64_t storage_numel);
// A replacement for template tensor `tensor`: TensorLike under the same key, `numel` elements of
// a storage of `storage_numel`.
Result<pickle::Value*> PartitionTensor(pickle::Graph& graph, const TorchTensor& tensor,
                                       uint64_t numel, uint64_t storage_numel);
// zero/<param>/<state>.pt of ds_to_universal: the whole atom as one tensor of `shape` (the atom's
// element count) under storage key "0", pickled bare or, `wrapped`, as {'cat_dim': 0, 'param':
// tensor}.
Result<ArchiveOutput> UniversalAtomArchive(const AtomIndex& index, const Atom& atom,
                                           const Shape& shape, bool requires_grad, bool wrapped);
// Adds to `out` the requires_grad of "<name>/fp32" (the tensor at `fp32_field`) and of
// "<name>/<key>" for every tensor of the state dict at `states_field`, for every name of `names`
// (ds_to_universal saves clones of narrowed source tensors, which keep it).
Status CollectRequiresGrad(const TorchArchiveReader& reader, const std::string& fp32_field,
                           const std::string& states_field, const std::vector<std::string>& names,
                           std::map<std::string, bool>& out);
// CollectRequiresGrad for group g of a ZeRO-1/2 optimizer file (its fp32 partition and states).
Status CollectGroupRequiresGrad(const TorchArchiveReader& reader, size_t g,
                                const std::vector<std::string>& names,
                                std::map<std::string, bool>& out);
// A file's ds_config/<section>/<key>, where `root` (the file's object, imported from `reader`
// into `graph`) has one, set to `value`: DeepSpeed saves the config of the run, which trains at
// the target's sizes (tensor_parallel.autotp_size, expert_parallel.autoep_size).
Status SetConfigValue(pickle::Graph& graph, pickle::Value* root, std::string_view section,
                      std::string_view key, int64_t value, const TorchArchiveReader& reader);
// True when `version` ("M.m.p", as ds_version records it) is M.m.p or later; false when it does
// not parse.
bool VersionAtLeast(const std::string& version, int major, int minor, int patch);
// ds_to_universal from DeepSpeed 0.19.8 on also writes zero/<name>/fp32.pt, {'param':
// tensor.float()}, for every tensor of the model states' module that no optimizer state was
// written for (frozen parameters, buffers); earlier releases write none. Adds those archives to
// `plan` for a tag of `version`: every module tensor of `reader` (index file `file`; the first
// TP rank's model states where there are several) not in `grouped`, with its whole storage as
// the file holds it, or a bfloat16 one widened to float32 as .float() gives it (a new contiguous
// tensor). kUnsupported naming one of another dtype, or a bfloat16 view that is not contiguous.
Status AddUniversalModuleTensors(const TorchArchiveReader& reader, uint32_t file,
                                 const std::set<std::string>& grouped, const std::string& version,
                                 OutputPlan& plan);
// The same file for a module tensor the index holds as an atom alone (a frozen parameter whose
// bit16 atom is the whole parameter, merged from its TP slices): {'param': the atom} in float32
// (a bfloat16 atom widened); kUnsupported for another dtype.
Result<ArchiveOutput> UniversalModuleAtomArchive(const AtomIndex& index, const Atom& atom);
// The bytes of module atom `atom` (its bit16 state) whole as float32, as .float() gives them: a
// float32 atom's own, a bfloat16 one widened; kUnsupported for another dtype.
Result<std::vector<Segment>> Float32Segments(const AtomIndex& index, const Atom& atom);
// {'param': tensor, 'cat_dim': 0, 'is_expert_param': True, 'ep_num_experts': experts}, the
// entry ds_to_universal writes for an AutoEP fused expert parameter, as the root of `graph`.
void SetExpertParamRoot(pickle::Graph& graph, pickle::Value* tensor, uint32_t experts);
// kUnsupported when `target` names an expert-parallel size above 1 (Topology::ep): a tag without
// experts has none to place (at 1, as a trainer without MoE layers may state it, there is nothing
// to do).
Status RefuseExpertParallel(const Topology& target);
// The ZeRO stage `reader`'s ds_config records (0, DeepSpeedZeroConfig's default, where it gives
// none) against a ZeRO-1/2 layout: kUnsupported `zero3_refusal` at stage 3 or above, and at stage
// 0 without bf16 (no ZeRO optimizer: the optimizer is in the model states).
Status CheckZeroOptimizerStage(const TorchArchiveReader& reader, const std::string& tag_dir,
                               bool bf16, std::string_view zero3_refusal);
// A DeepSpeed data-parallel target: tp = pp = 1 (kUnsupported otherwise), dp > 0, world 0 or dp
// (kInvalidArgument / kUnsupported otherwise).
Status CheckTarget(const Topology& target);

// ---------------------------------------------------------------------------------------------
// ZeRO-1/2 (zero.h, and per pipeline stage and TP rank tp.h).

// DeepSpeed pads every flat buffer to a multiple of nccl_start_alignment_factor × DP.
inline constexpr uint64_t kAlignmentFactor = 2;

// A flat buffer partitioned over DP ranks: padded at the end to a multiple of
// kAlignmentFactor × ranks, rank r holding elements [begin(r), begin(r) + partition).
struct Partitioning {
  uint64_t padded = 0;     // flat buffer length
  uint64_t partition = 0;  // P: elements per rank
  uint64_t padding = 0;    // at the end, on the last rank
  uint32_t ranks = 1;
  uint64_t begin(uint32_t r) const { return uint64_t{r} * partition; }
  uint64_t padding_of(uint32_t r) const { return r + 1 == ranks ? padding : 0; }
};
// The partitioning of a flat buffer of `total` real elements over `dp` > 0 ranks; kOutOfRange
// when the padded length overflows.
Result<Partitioning> Partition(uint64_t total, uint32_t dp);
// Partition(total, dp) of a flat group DeepSpeed can save at dp: kUnsupported naming `what` (the
// group) where the padding leaves whole ranks empty.
Result<Partitioning> SavablePartition(uint64_t total, uint32_t dp, std::string_view what);

// The elements of parameter k of a flat `layout` that DP rank r's partition (of `p`) holds: local
// elements [begin, end) of the parameter at element `at` of the rank's partition tensor; one
// piece per rank holding any, in rank order. Tensor-parallel tags partition each TP rank's flat
// buffer so (they have no round-robin order).
struct Piece {
  uint32_t rank = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t at = 0;
};
std::vector<Piece> Pieces(const GroupLayout& layout, size_t k, const Partitioning& p);

// DeepSpeed's _round_robin_reorder: positions 0 .. n-1 grouped by i % parts, groups in order.
std::vector<size_t> RoundRobinOrder(size_t n, uint32_t parts);
// The optimizer's own parameter order, from a flat order saved at `dp` ranks: original[i] is the
// flat position of the optimizer's i-th parameter (the identity without round_robin).
std::vector<size_t> OptimizerOrder(size_t n, bool round_robin, uint32_t dp);
// `flat`, a group's items in the flat order of a round-robin save at `dp` ranks, in the
// optimizer's own order.
template <typename T>
std::vector<T> InOptimizerOrder(const std::vector<T>& flat, uint32_t dp) {
  std::vector<T> out;
  out.reserve(flat.size());
  for (const size_t position : OptimizerOrder(flat.size(), true, dp)) out.push_back(flat[position]);
  return out;
}
// `items`, in the optimizer's own order, in the flat order of a round-robin save at `dp` ranks.
template <typename T>
std::vector<T> InRoundRobinOrder(const std::vector<T>& items, uint32_t dp) {
  std::vector<T> out;
  out.reserve(items.size());
  for (const size_t i : RoundRobinOrder(items.size(), dp)) out.push_back(items[i]);
  return out;
}

// One entry of param_slice_mappings: `numel` elements of parameter `name` at element `start` of
// the rank's partition (DeepSpeed's fragment_address).
struct SliceMapping {
  std::string name;
  uint64_t numel = 0;
  uint64_t start = 0;
  bool operator==(const SliceMapping&) const = default;
};
// param_slice_mappings of rank r of `p` as DeepSpeed computes them (_init_lp_to_hp_mapping): over
// the optimizer's parameter order (OptimizerOrder at p.ranks) with offsets accumulated in THAT
// order. Without round robin that is the flat buffer's order. With round_robin_gradients the
// flat buffer is permuted but these offsets are not, so v0.14.5's mappings (and ds_to_universal's
// output) do not describe the data; the data follows param_shapes, which the index and the
// partitions use.
std::vector<SliceMapping> ExpectedMappings(const GroupLayout& layout, const Partitioning& p,
                                           uint32_t r, bool round_robin);
// The param_slice_mappings entry at `field` (name → fragment_address(numel, start)), in order;
// kCorrupt naming the field when it is missing or an entry is not a fragment_address.
Result<std::vector<SliceMapping>> ReadMappings(const TorchArchiveReader& reader,
                                               const std::string& field);
// OrderedDict(name → fragment_address(numel, start)) as DeepSpeed pickles it.
pickle::Value* MappingsNode(pickle::Graph& graph, const std::vector<SliceMapping>& mappings);

// Bytes of elements [begin, end) (end <= layout.total) of state `state`'s flat buffer laid out as
// `layout`, as segments of the index's files; kCorrupt when the index lacks an atom it needs.
Result<std::vector<Segment>> FlatSegments(const AtomIndex& index, const GroupLayout& layout,
                                          std::string_view state, uint64_t begin, uint64_t end);
// One per-rank state tensor of a group: a partition-shaped state (1-d, P elements) or a 0-d one.
struct StateTensor {
  std::string key;
  const TorchTensor* tensor = nullptr;
};

// One rank's partition of a parameter group, as read from its optimizer file.
struct RankPartition {
  const TorchTensor* fp32 = nullptr;                 // the fp32 master partition
  const std::vector<StateTensor>* states = nullptr;  // the group's states, in one key order
  uint32_t file = 0;                                 // the optimizer file's index in the index
};
// Appends to `atoms` the optimizer atoms of parameter k of `layout`, partitioned by `p` over
// `ranks` (one per rank of p, all with ranks[0]'s state keys): "fp32" and every partition-shaped
// state, fragments from every rank whose partition it meets, and every 0-d state (ds_to_universal's
// step.pt) from the first rank holding the parameter. kOutOfRange when an offset overflows.
Status AddParameterAtoms(std::vector<Atom>& atoms, const GroupLayout& layout, size_t k,
                         const Partitioning& p, const std::vector<RankPartition>& ranks);

// DeepSpeed's module tensors are views of each group's flat bit16 buffer, padded at the end to a
// multiple of 2·DP: at another DP only that padding changes. In `graph` (imported from `reader`,
// index file `file`) each group of `source_layouts` whose module views show such a buffer gets
// the storage DeepSpeed allocates at `target_dp` (zeros past the real elements; its segments in
// `replaced`) and every persistent id naming it the new element count. Other storages are left.
Status ResizeModuleBuffers(pickle::Graph& graph, const TorchArchiveReader& reader, uint32_t file,
                           const std::vector<GroupLayout>& source_layouts, uint32_t source_dp,
                           uint32_t target_dp,
                           std::map<std::string, std::vector<Segment>>& replaced);

// The optimizer files of model-parallel rank `mp` of a tag of `mp_ranks` such ranks (a pipeline's
// stages; 1 for a tag without model parallelism), by DP rank: one per rank < dp, all with one
// prefix (`model`, the model-states file that gives dp, for messages). kNotFound when there is
// none or a rank's is missing (naming it), kUnsupported for an mp rank above 0 of a tag of one (a
// tensor-parallel tag), kCorrupt for two prefixes, a rank >= dp or an mp rank >= `mp_ranks` > 1.
Result<std::vector<const RankFile*>> OptimFilesByRank(const std::string& tag_dir,
                                                      const TagListing& listing, uint32_t dp,
                                                      const std::string& model, uint32_t mp = 0,
                                                      uint32_t mp_ranks = 1);

// A model-states file mp_rank_XX_model_states.pt, read.
struct ModelStates {
  std::string name;
  TorchArchiveReader reader;
  std::string ds_version;
  uint32_t dp = 0;                      // dp_world_size
  std::vector<GroupLayout> groups;      // param_shapes, per parameter group
  std::optional<int64_t> config_stage;  // ds_config's zero_optimization.stage when an int
  bool round_robin = false;             // ds_config's zero_optimization.round_robin_gradients
};
// Reads `name` under `tag_dir`: kCorrupt naming the field when ds_version, dp_world_size
// (DpWorldSize) or param_shapes (a non-empty list of non-empty groups of torch.Size) is missing
// or mistyped, or a group's element count overflows.
Result<ModelStates> ReadModelStates(const std::string& tag_dir, const std::string& name);

// Parameter group g of an optimizer file.
struct OptimGroup {
  std::vector<StateTensor> states;             // GroupStatesField(elastic, g), pickle's order
  const TorchTensor* fp32 = nullptr;           // single_partition_of_fp32_groups/g
  std::vector<SliceMapping> mappings;          // param_slice_mappings/g
  const pickle::Value* param_group = nullptr;  // base_optimizer_state/param_groups/g; elastic: null
};

// An optimizer file [bf16_]zero_pp_rank_N_mp_rank_XX_optim_states.pt, read.
struct OptimStates {
  RankFile entry;
  TorchArchiveReader reader;
  bool bf16_optimizer = false;  // BF16_Optimizer (no loss_scaler), else DeepSpeedZeroOptimizer
  std::optional<int64_t> zero_stage;
  std::vector<int64_t> partition_count;
  std::vector<int64_t> group_paddings;
  std::string ds_version;
  std::vector<OptimGroup> groups;
  // zero_optimization.elastic_checkpoint (DeepSpeedZeroOptimizer._get_base_optimizer_state):
  // base_optimizer_state is a list of per-group states whose partition-shaped tensors leave out
  // the rank's DP padding (views of the padded storage, like the fp32 partition), with no
  // param_groups; base_optimizer_state_step sits beside it when the optimizer keeps its step in its
  // param groups.
  bool elastic = false;
};
// kUnsupported when `reader`'s base_optimizer_state is an elastic checkpoint's list, for the
// adapters that read only the rigid form (`layouts`, e.g. "tensor-parallel tags").
Status RefuseElasticForm(const TorchArchiveReader& reader, std::string_view layouts);
// Where group g's states are: optimizer_state_dict/base_optimizer_state/state/g, or
// optimizer_state_dict/base_optimizer_state/g in an elastic file.
std::string GroupStatesField(bool elastic, size_t g);
// The element count of a rank's partition-shaped state with partition P and `padding`: P, or
// P - padding in an elastic file.
uint64_t StateNumel(bool elastic, uint64_t partition, uint64_t padding);
// Reads `entry` under `tag_dir` with `groups` parameter groups, rigid or elastic: kUnsupported
// for a zero_stage of 3 or more (message Prefix(path) + `zero3`, the adapter's reason); kCorrupt
// naming the field that is missing or mistyped.
Result<OptimStates> ReadOptimStates(const std::string& tag_dir, const RankFile& entry,
                                    size_t groups, std::string_view zero3);
// Checks optimizer file `os` against its model states `ms` (ds_version, partition_count, and the
// group_paddings, partition sizes and param_slice_mappings DeepSpeed computes from param_shapes)
// and against `first`, the file every other is compared with (zero_stage, optimizer, state keys,
// shapes and dtypes): kCorrupt naming the field that disagrees; kUnsupported for a state that is
// neither 0-d nor the partition.
Status CheckOptimStates(const OptimStates& os, const ModelStates& ms, const OptimStates& first);
// What one rank's optimizer file must hold for one parameter group: the group's layout, its
// partitioning, and the file's partition index in it.
struct GroupExpectation {
  const GroupLayout* layout = nullptr;
  Partitioning partitioning;
  uint32_t rank = 0;
};
// CheckOptimStates's checks of `os` against `first` (zero_stage, optimizer, form, state keys,
// shapes and dtypes) and, per group, against `groups` (group_paddings, partition sizes and the
// param_slice_mappings DeepSpeed computes, with `round_robin`); `source` names where the layouts
// come from, for the messages. ds_version and partition_count are the caller's to check.
Status CheckOptimGroups(const OptimStates& os, const OptimStates& first,
                        const std::vector<GroupExpectation>& groups, bool round_robin,
                        const std::string& source);
// Puts each group's states of `os` in `first`'s key order where both hold the same keys:
// DeepSpeed's universal load fills them in no fixed order, so the files of one save made after it
// may differ there. Other differences are left for CheckOptimStates to name.
void OrderStatesAs(OptimStates& os, const OptimStates& first);
// The same for one group's states: `states` in `reference`'s key order when both hold the same
// keys.
void OrderStatesAs(std::vector<StateTensor>& states, const std::vector<StateTensor>& reference);

// zero/optimizer_state.pt of ds_to_universal: the optimizer_state_dict of `reader` (index file
// `file`) without its partitioned entries (base_optimizer_state, single_partition_of_fp32_groups,
// param_slice_mappings), plus the base optimizer's param_groups; kCorrupt when either is missing.
Result<ArchiveOutput> UniversalOptimizerState(const TorchArchiveReader& reader, uint32_t file);
// The start of zero/optimizer_state.pt: `out`'s path set, and `reader`'s optimizer_state_dict
// imported into its graph (not yet its root); kCorrupt when the dict is missing.
Result<pickle::Value*> ImportOptimizerStateDict(const TorchArchiveReader& reader,
                                                ArchiveOutput& out);

// A parameter group of the index without its params: the hyperparameters of `param_group` (a
// torch param_groups entry, every key but params; none when null, as in an elastic file) and the
// value of each 0-d state of `states` (read from `reader`) as a scalar.
ParamGroup GroupSettings(const pickle::Value* param_group, const TorchArchiveReader& reader,
                         const std::vector<StateTensor>& states);
// The flat layout of `names` in that order, with the shapes of their "fp32" atoms in `index`;
// kCorrupt when one has none.
Result<GroupLayout> IndexedLayout(const AtomIndex& index, const std::vector<std::string>& names);

// Group g's states in an optimizer_state_dict being planned (GroupStatesField's node), or null.
pickle::Value* GroupStatesNode(pickle::Value* optimizer_state_dict, bool elastic, size_t g);

// The sizes of one rank's partitions of a group in an optimizer file being planned.
struct GroupPartition {
  uint64_t partition = 0;                  // P: every partition tensor's storage
  uint64_t state_numel = 0;                // each partition-shaped state's elements (StateNumel)
  uint64_t fp32_numel = 0;                 // the fp32 master's elements (P, or P less the padding)
  uint64_t tail = 0;                       // zero elements after the rank's real ones (its padding)
  std::optional<uint64_t> template_numel;  // when set, the template's states must have it
};
// DP rank i's part of a flat group of `total` real elements partitioned as `p`: its real elements
// [begin, real_end), and the sizes of its partitions (`elastic`: partition-shaped states without
// the padding; `bf16_optimizer`: the fp32 partition with it). template_numel is left unset.
struct PlannedRankPart {
  uint64_t begin = 0;
  uint64_t real_end = 0;
  GroupPartition sizes;
};
PlannedRankPart PlanRankPart(const Partitioning& p, uint32_t i, uint64_t total, bool elastic,
                             bool bf16_optimizer);
// Plans group g of a rank's optimizer file: in `graph` (imported from the template `reader`,
// `dict` its optimizer_state_dict) every partition-shaped state of the group becomes a tensor of
// `sizes.state_numel` elements over a P-element storage and the fp32 partition one of
// `sizes.fp32_numel`; their bytes are `segments_of(state)` (the rank's real elements; "fp32" for
// the master) then `sizes.tail` zero elements, recorded in `replaced` by storage key. Returns the
// new fp32 partition node, for SetPartitionFields. kCorrupt naming the field where the template
// is not as expected.
Result<pickle::Value*> PlanGroupPartitions(
    pickle::Graph& graph, pickle::Value* dict, const TorchArchiveReader& reader, size_t g,
    bool elastic, const GroupPartition& sizes,
    const std::function<Result<std::vector<Segment>>(const std::string& state)>& segments_of,
    std::map<std::string, std::vector<Segment>>& replaced);

// One flat group of a rank's optimizer file, as PlanPartitionedOptimFile writes it.
struct RankGroupPart {
  PlannedRankPart part;                // the rank's elements of the group and its state sizes
  uint64_t padding = 0;                // group_paddings' entry
  std::vector<SliceMapping> mappings;  // param_slice_mappings' entry
  size_t params = 0;                   // the parameters as the optimizer holds them
  // Bytes of elements [begin, end) of state `state`'s flat buffer ("fp32" for the master).
  std::function<Result<std::vector<Segment>>(const std::string& state, uint64_t begin,
                                             uint64_t end)>
      segments_of;
};
// A ZeRO-1/2 optimizer file `path` planned from the template `reader` (index file
// `template_file`), as the ZeRO-1/2, MoE, pipeline and TP reshards write theirs: each of `groups`
// groups' partition as `group_of(g)` gives it (PlanGroupPartitions), then SetPartitionFields
// with `partition_counts`; `edit`, when given, then changes the root or its optimizer_state_dict
// further. kCorrupt naming optimizer_state_dict where the template lacks it.
Result<ArchiveOutput> PlanPartitionedOptimFile(
    const TorchArchiveReader& reader, uint32_t template_file, std::string path, bool elastic,
    size_t groups, const std::function<Result<RankGroupPart>(size_t g)>& group_of,
    const std::vector<uint64_t>& partition_counts,
    const std::function<Status(pickle::Graph& graph, pickle::Value* root, pickle::Value* dict)>&
        edit = nullptr);

// DeepSpeed's pipeline layer placement (runtime/utils.py partition_uniform, partition_balanced):
// stage boundaries, num_parts + 1 entries, stage s holding layers [bounds[s], bounds[s+1]).
std::vector<uint64_t> PartitionUniform(uint64_t items, uint64_t parts);
// partition_balanced: DeepSpeed's dynamic program minimising max - min of the parts' sums, in
// float64 with its tie-breaking (the last split of equal cost wins).
std::vector<uint64_t> PartitionBalanced(const std::vector<uint64_t>& weights, uint64_t parts);
// "[0, 4, 7]", for messages.
std::string BoundsText(const std::vector<uint64_t>& bounds);
// The stage holding `layer` when stage s holds [bounds[s], bounds[s+1]) (the last one the rest).
uint32_t StageOfLayer(const std::vector<uint64_t>& bounds, uint64_t layer);

// A partition method of PipelineModule as the checkpoint can replay it: the weights it balances
// per layer at the source and at the target (both empty: 'uniform'). They differ where a layer's
// trainable elements depend on the layout (an MoE layer's local experts).
struct PartitionMethod {
  LayerPartition kind = LayerPartition::kUniform;
  std::string name;  // for messages: "'uniform'", "'parameters'", "'type:' (...)"
  std::vector<uint64_t> source_weights;
  std::vector<uint64_t> target_weights;
};
// The 'type:' methods a pipeline's layers allow: one per kind of layer (`signature`: each
// numbered layer's parameter names and shapes) that at least two layers share, weighting its
// layers 1 of `count`. A kind of one layer is no block to balance: weighting it alone leaves every
// other layer's stage to the partitioner's ties, and would make any placement ambiguous.
std::vector<PartitionMethod> TypeMethods(const std::map<uint64_t, std::string>& signature,
                                         uint64_t count);
struct ChosenPartition {
  std::vector<uint64_t> bounds;  // at the target pp
  std::string method;
};
// The target's stage boundaries over `count` layers: those of the methods that reproduce the
// saved stages (`source_stage`: every placed layer's stage at `source_pp`) at `pp`, of `told`'s
// kind only where the user names one. kUnsupported when those that reproduce them disagree at the
// target (naming how to tell the trainer's), or none does: a custom partition is in no file.
Result<ChosenPartition> ChoosePartition(uint64_t count,
                                        const std::map<uint64_t, uint32_t>& source_stage,
                                        const std::vector<PartitionMethod>& methods,
                                        uint32_t source_pp, uint32_t pp, LayerPartition told);

// `length` bytes of the file at `path` from `offset` (a tensor's, to compare copies of it).
Result<std::string> ReadRange(const std::string& path, uint64_t offset, uint64_t length);
// A tensor of the file at `path`.
struct FileTensor {
  std::string path;
  const TorchTensor* tensor = nullptr;
};
// Whether every one of `copies` (each TP rank's of one module entry, say) is the first's: its
// shape, dtype and bytes (byte_size() from file_offset()); the first's bytes read once.
Result<bool> TensorsAlike(const std::vector<FileTensor>& copies);

}  // namespace ucp::deepspeed
