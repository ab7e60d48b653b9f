// Pieces the DeepSpeed adapters share (deepspeed_zero.h: ZeRO-1/2; deepspeed_zero3.h: ZeRO-3):
// file names of a tag, typed reads of pickle fields with errors naming the file and the field,
// and the building blocks of plans over a template archive. Internal to hooks/; not an interface.
//
// Thread-safety: pure functions of their arguments (ListTag and OpenSource read the file system).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp::hooks::deepspeed {

// Roles of the index's files and carried objects.
inline constexpr std::string_view kModelRole = "model_states";
inline constexpr std::string_view kOptimRole = "optim_states";
inline constexpr std::string_view kUniversalRole = "universal_optimizer_state";
// The optimizer files' top-level entry.
inline constexpr std::string_view kOsd = "optimizer_state_dict";

// "deepspeed: <where>: ", the start of every message.
std::string Prefix(const std::string& where);
// mp_rank_<mp:02>_model_states.pt
std::string ModelStatesName(uint32_t mp);
// <prefix>zero_pp_rank_<dp>_mp_rank_<mp:02>_optim_states.pt
std::string OptimName(std::string_view prefix, uint32_t dp, uint32_t mp);

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
};

// Lists `tag_dir` (names only; no file is opened).
Result<TagListing> ListTag(const std::string& tag_dir);

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
// last).
Result<TorchArchiveReader> OpenWrittenModelStates(const std::string& tag_dir,
                                                  const std::string& name, bool present);
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
// Replaces the value of str key `key` of dict `dict` (kCorrupt naming `where` when missing).
Status SetDictItem(pickle::Value* dict, std::string_view key, pickle::Value* value,
                   const std::string& where);
// A pickled list of ints.
pickle::Value* IntList(pickle::Graph& graph, const std::vector<uint64_t>& values);
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
// A DeepSpeed data-parallel target: tp = pp = 1 (kUnsupported otherwise), dp > 0, world 0 or dp
// (kInvalidArgument / kUnsupported otherwise).
Status CheckTarget(const Topology& target);

}  // namespace ucp::hooks::deepspeed
