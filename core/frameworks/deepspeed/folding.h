// DeepSpeed 0.19's folded AutoEP + AutoTP layout (ZeRO-1/2): a run with
// "tensor_parallel": {"autotp_size": T} and "expert_parallel": {"autoep_size": E} at world size
// W = T · DP. Rank g is TP rank g mod T of TP group g div T (runs of T ranks), dense-data-parallel
// rank g div T (the dense groups strided over the TP lanes), expert-parallel rank g mod E (runs of
// E ranks, which may cross TP lanes) and expert-data-parallel rank g div E
// (deepspeed/module_inject/auto_ep_folding.py, expected_folding_group_tables). Its files:
//   mp_rank_<t>_model_states.pt        written by rank t: the dense parameters' TP slices
//   zero_pp_rank_<d>_mp_rank_<t>_…     written by rank d·T + t: group 0 lane t's dense flat
//                                      buffer, partition d of DP; group 1 ("ep_size_E") expert-
//                                      parallel rank g mod E's fused experts, partition g div E
//                                      of W / E
//   layer_<L>_expert_<G>_mp_rank_<t>_… written by every rank g with g div T < E, for the experts
//                                      of its expert-parallel rank, under its TP rank: one expert
//                                      can lie under several lanes, and two ranks can write one
//                                      file (engine.py's autoep_expert_writer)
// each with a "folding" dict (checkpoint/autoep_universal.py, make_folding_metadata).
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/autoep.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

// The key of the folding dict in each file of a folded save.
inline constexpr std::string_view kFolding = "folding";

struct FoldedGrid {
  uint32_t world = 1;
  uint32_t tp = 1;
  uint32_t ep = 1;
  // The expert ranks in use_data_before_expert_parallelism's order (ExpertRankOrder): native MoE
  // over an mpu's TP may take it, as its expert groups span the world; DeepSpeed folds no AutoEP
  // with it.
  bool data_before_expert = false;
  // Expert tensor parallelism (native MoE over an mpu's TP with enable_expert_tensor_parallelism):
  // DeepSpeed makes the expert-parallel groups inside each TP lane's dense-data-parallel group
  // (utils/groups.py, _create_expert_data_and_model_parallel), so the ranks are ordered over a
  // lane's D dense ranks, not over the world, and each lane holds its own slices of every expert.
  bool expert_tp = false;

  uint32_t DenseDp() const { return world / tp; }
  uint32_t ExpertDp() const { return Order().dp / ep; }
  uint32_t TpRank(uint32_t g) const { return g % tp; }
  uint32_t DenseRank(uint32_t g) const { return g / tp; }
  // Over the world, or with expert_tp over a lane's dense ranks.
  ExpertRankOrder Order() const { return {expert_tp ? DenseDp() : world, ep, data_before_expert}; }
  uint32_t OrderedRank(uint32_t g) const { return expert_tp ? DenseRank(g) : g; }
  uint32_t ExpertRank(uint32_t g) const { return Order().ExpertRank(OrderedRank(g)); }
  uint32_t ExpertDpRank(uint32_t g) const { return Order().IndexInGroup(OrderedRank(g)); }
  // The rank of expert-parallel rank e's expert-data-parallel index i that lane t's expert files
  // and slices concern: with expert_tp lane t's own, else the one rank of the world (any lane's).
  uint32_t ExpertMember(uint32_t e, uint32_t i, uint32_t t) const {
    return expert_tp ? Rank(Order().Rank(e, i), t) : Order().Rank(e, i);
  }
  uint32_t Rank(uint32_t dense_rank, uint32_t tp_rank) const { return dense_rank * tp + tp_rank; }
  bool WritesExperts(uint32_t g) const { return DenseRank(g) < ep; }

  // The ranks that write expert-parallel rank e's expert files under TP rank t, ascending (none
  // where no rank is both).
  std::vector<uint32_t> ExpertWriters(uint32_t t, uint32_t e) const;
  // The ranks of TP rank t that hold expert-parallel rank e's experts, ascending: those whose
  // load reads its expert files under t.
  std::vector<uint32_t> ExpertHolders(uint32_t t, uint32_t e) const;
};

// The folded grid of a save whose mp_rank_00 model states are `model`: nullopt where its
// checkpoint_parallel_dimensions record tp_degree 1 or its ds_autoep_layers are missing or None (a
// native MoE save's). kUnsupported
// for a pipeline, an expert-tensor-parallel size other than 1 and an E of 1 (DeepSpeed folds none
// of those); kCorrupt where the sizes do not divide as DeepSpeed's grid needs or the folding dict
// disagrees with them; both name the file and the field.
Result<std::optional<FoldedGrid>> ReadFoldedGrid(const TorchArchiveReader& model);

// The families of the folding dicts: the model states', the optimizer files', the expert files'.
inline constexpr std::string_view kDenseFamily = "dense";
inline constexpr std::string_view kZeroFamily = "zero_optimizer_state";
inline constexpr std::string_view kExpertFamily = "routed_expert";

// `reader`'s folding dict against the file it is, as DeepSpeed's load checks it: version 1, the
// grid's tp_size and ep_size, `family`, the writer's tp_rank and ep_rank, and where given its
// zero_partition_rank (two ranks race to write an expert file, so DeepSpeed leaves that one
// unchecked there). kCorrupt naming the file and the field.
Status CheckFolding(const TorchArchiveReader& reader, std::string_view family,
                    const FoldedGrid& grid, uint32_t tp_rank, uint32_t ep_rank,
                    std::optional<uint32_t> zero_rank);

// `root`'s folding dict (a file of a folded save, imported into `graph` from `reader`) as rank
// `writer` of `grid` writes it, its family kept: tp_size, tp_rank, ep_size, ep_rank, and the zero
// partition's rank and count of the dict's zero_partition_group (the model states' "dense_dp" and
// the optimizer files' "per_family": the dense DP; the expert files' "edp": the expert DP), and
// each of an optimizer file's param_families entries likewise by its own group. kCorrupt naming
// the file and the field for a dict without those keys or of another group.
Status SetFolding(pickle::Graph& graph, pickle::Value* root, const TorchArchiveReader& reader,
                  const FoldedGrid& grid, uint32_t writer);

// A file of a folded save (`root`, imported into `graph` from `reader`) as a run at tp 1 over the
// same ranks writes it: no folding dict, no ds_config tensor_parallel section, and of model states
// mp_world_size and tp_degree 1 and of universal_checkpoint_info only what AutoEP records at tp 1
// (its version, expert patterns and layers: AutoTP records nothing there). kCorrupt naming the
// file and the field for model states without those dicts.
Status UnfoldAutoTp(pickle::Graph& graph, pickle::Value* root, const TorchArchiveReader& reader);

}  // namespace ucp::deepspeed
