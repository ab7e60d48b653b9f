// The DeepSpeed-MoE adapter ("deepspeed-moe", schema 4: schema 1 had no folded tags, schema 2 no
// lanes of an mpu's TP, schema 3 no expert tensor parallelism): DeepSpeed
// v0.14 checkpoints of models with deepspeed.moe.layer.MoE layers under ZeRO-1/2, as atoms,
// resharded to any DP size that the expert-parallel size divides; also those of MoE layers in a
// PipelineModule (DeepSpeed 0.19, below), at their pipeline degree, merged onto one stage or
// placed on another; AutoEP's folded over AutoTP (below), to T=1 or another folded grid; and
// native MoE over a Megatron-style mpu's TP (below), to any TP degree.
//
// A tag it reads (tp = pp = 1; N = dp_world_size, E = the expert-parallel size):
//   mp_rank_00_model_states.pt     written by rank 0 (engine._save_moe_checkpoint): module (the
//                                  non-expert tensors, views of the dense group's flat buffer),
//                                  dp_world_size, mp_world_size, num_experts (per MoE layer, in
//                                  module order); no param_shapes, ds_config or ds_version.
//   layer_<L>_expert_<G>_mp_rank_00_model_states.pt
//                                  MoE layer L's expert G (its GLOBAL id): that expert's module
//                                  tensors, whole, named with the global id.
//   expp_rank_<e>_mp_rank_00_optim_states.pt, e < E
//                                  {'optimizer': None} under ZeRO; one per expert-parallel rank
//                                  (DeepSpeed 0.14; 0.19 writes none).
//   [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt, r < N
//                                  ZeRO-1/2 optimizer files (deepspeed_zero.h) whose groups are
//                                  dense ones, partitioned over all N ranks, and one expert group
//                                  (param_groups[g]: moe True, name "ep_size_<E>": where E is
//                                  read).
// DeepSpeed's expert-parallel groups are runs of E consecutive ranks: rank r is expert-parallel
// rank e = r mod E and holds global experts [e·n_L, (e+1)·n_L) of each MoE layer L (n_L =
// num_experts[L] / E) as its LOCAL experts 0 .. n_L-1. Its expert group holds those, under their
// local ids, partitioned over the expert-data-parallel group of e (the N/E ranks r' ≡ e mod E,
// partition index r' div E) by ZeRO's rule. With use_data_before_expert_parallelism in the
// ds_config the expert-data-parallel groups are the runs of N/E consecutive ranks instead: rank r
// is expert-parallel rank r div (N/E), partition index r mod (N/E); a reshard keeps the source's
// order (the target files carry its ds_config). With no param_shapes, each group's flat layout
// comes from the ranks' param_slice_mappings, the shapes from the module tensors and the expert
// files; every rank's mappings, paddings and partition sizes are then checked against DeepSpeed's
// rules.
//
// DeepSpeed 0.19's AutoEP ("expert_parallel": {"autoep_size": E}) writes the same files, its
// experts fused: the model states record its layers (ds_autoep_layers: per MoE layer the experts
// module "<M>", the expert-parallel size, the placement, rank 0's coordinates), the expert group
// holds each layer's fused parameters "<M>.w1" ... of n_L rows (one per local expert, n_L =
// num_experts[L] / E), and expert G's file holds its rows as "<M>.w1.<G>". E is the layers'
// ep_size (DeepSpeed's universal load at another size keeps the saved group name, and so do its
// saves after it); ucp reads experts placed in runs (rank e: [e·n_L, (e+1)·n_L)), one file per
// expert ("per_expert_files"), and refuses anything else by name.
//
// MoE layers in a PipelineModule (DeepSpeed 0.19, which records checkpoint_parallel_dimensions
// {pp_degree: P, tp_degree: 1} and mp_world_size P in the model states): each stage s writes the
// files above with mp_rank_<s> for mp_rank_00, and no layer files: its model states' module holds
// its dense tensors under global layer names ("<LL>.<name>"), its expert files number its MoE
// layers from 0 (L is stage-local) and name the parameters globally, its optimizer files hold its
// own groups. Each stage is read as a tag of its own, every stage at the same DP and
// expert-parallel size; the index lists the stages' files and groups one stage after another
// (adapter_state "stages": per stage its groups, expert group, num_experts and template files).
// A reshard at the tag's pp reshards each stage alike. To pp = 1 the stages merge as DeepSpeed
// lays out a PipelineModule of one stage: a stage holds a consecutive run of layers, so every
// group is the stages' groups one after another, the MoE layers too (stage s's expert files
// renumbered after the earlier stages' layers), and the model states are stage 0's with every
// stage's module tensors, param_shapes and buffer_names, all num_experts, mp_world_size and
// pp_degree 1 (stages of other groups or hyperparameters, later stages' shared or frozen
// parameters: refused). To another pp > 1 (from a pipeline, or from pp = 1 where the parameters
// are numbered layers) the merged stage is split where DeepSpeed would place the layers: which
// layers each stage holds is in no file, so DeepSpeed's partition methods ('uniform',
// 'parameters' with an MoE layer's num_experts / E local experts at each side's E, 'type:') are
// replayed, and those that give the saved stages must agree at the target (else refused as
// ambiguous, unless the target names the trainer's: Topology::partition). A target stage without
// an MoE layer is refused (DeepSpeed sets up no such MoE pipeline). Each target stage's model
// states keep only its layers' entries. A tag of several mp ranks that does not record which axis
// they are (0.14) and AutoEP in a pipeline are refused. With an mpu's TP beside the pipeline
// (below) each stage is a grid of lanes.
//
// AutoEP with AutoTP (DeepSpeed 0.19's folded layout; folding.h has its files): one stage of T TP
// lanes, read lane by lane. Each lane's dense group is laid out over its dense-data-parallel ranks
// (g = d·T + t), each dense parameter's atoms are whole (AutoTP's affine map of lane 0 gives its
// shard map; the lanes' slices make it, lane 0's alone where it is replicated), the expert group
// and files are read as at T=1 over all W ranks (an expert under several lanes: the lowest gives
// its bit16 atom, the others must match it), and every file's folding dict is checked against its
// writer. PlanUniversalExport writes the T=1 universal checkpoint over the same W ranks (the model
// states as a T=1 run writes them); PlanReshard writes a T=1 run's files at any DP and E (the
// expert files each expert's lowest lane's, without folding dicts), or a folded run's at T' > 1
// (each lane's slices of the whole atoms in AutoTP's blocks at T', the experts as at T=1 over the
// W' ranks, every file's folding dict set for its writer).
//
// Native MoE with an mpu's tensor parallelism (Megatron-DeepSpeed; DeepSpeed 0.19 records
// checkpoint_parallel_dimensions {pp_degree: 1, tp_degree: T}) is read as the same grid of lanes:
// without expert tensor parallelism DeepSpeed's expert-parallel groups are runs of E consecutive
// ranks across the TP ranks (with use_data_before_expert_parallelism runs of W/E ranks are the
// expert-data-parallel groups, as at T=1), each expert whole. Its writers differ:
// expert-data-parallel rank 0 (rank e < E; e·W/E in the other order) writes expert-parallel rank
// e's expert files under its lane, and a lane's model states only where that rank is also
// dense-data-parallel rank 0 (lanes t < E; in the other order lanes t that W/E divides, so never
// lane 1 where E < W: a save that lacks some, which its own load needs, is refused by name). There
// are no folding dicts; the dense parameters' shard maps come from lane 0's
// universal_checkpoint_info as deepspeed-tp reads them (megatron_rules.h: split on a dimension,
// into sub-parameters, a padded vocabulary, or whole on every lane; averaged ones refused), and a
// tag of one TP rank that records those rules is read as one lane, so that it too can be placed at
// T > 1. PlanReshard writes any grid of one stage (W' = T'·D', E' dividing W' and every layer's
// experts): the folded layout's files without folding dicts, mp_world_size, tp_degree, the padded
// vocabulary size and Megatron's args at T', the expert group named ep_size_<E'>, and each expert's
// file under every lane whose ranks hold it (DeepSpeed's own save at T' > E' lacks lanes its load
// reads; ucp writes them).
//
// In a pipeline (a PipelineModule whose grid is the mpu; checkpoint_parallel_dimensions {pp P,
// tp T}, mp_world_size P·T) each stage is such a grid of lanes, its files under mp ranks s·T + t
// (DeepSpeed's grid: the model axis fastest), its MoE layers numbered from 0 as in any MoE pipeline
// and its expert groups runs within the stage's D·T ranks; a tag of one TP rank per stage that
// records Megatron's rules is read so too. The index lists the stages one after another, each with
// its lanes (adapter_state "stages" and "folded_tp"); PlanReshard writes each stage alike at the
// same pp (any T', D', E'), and at another pp restages them as above, the 'parameters' method
// counting each parameter as TP lane 0 holds it at either degree: each target stage's lanes are
// then written as a stage of the tag would be, their model states stage 0's lane 0's with the
// stage's module entries (each lane's slices of the atoms) and param_shapes, and each expert's
// files under its layer's number within the target stage.
//
// With expert tensor parallelism (enable_expert_tensor_parallelism; Megatron's experts are then its
// ParallelMLP, split over the TP ranks) DeepSpeed makes the expert groups inside each lane's dense
// data-parallel group (utils/groups.py, _create_expert_data_and_model_parallel): lane t's rank
// d·T + t is expert-parallel rank d mod E (d div (D/E) in the other order) and partition d div E
// of D/E (d mod (D/E)), and every lane's expert-data-parallel rank 0 writes that lane's slices of
// its experts (so every lane's model states and expert files are there). No file records it: at
// T > 1 the expert group's partition_count, D/E instead of W/E, tells; at T = 1 (one layout either
// way) Megatron's saved args' enable_expert_tensor_parallelism, which must agree at T > 1 too. The
// index reads each lane as a T = 1 stage of D ranks, each expert's atoms whole by the same rules
// as the dense ones (Megatron's naming splits an expert's dense_h_to_4h on dim 0), and records
// expert_tp; a reshard keeps it: each lane's expert group and expert files its slices at T', E'
// dividing D'.
//
// Atoms: per parameter (an expert's under its GLOBAL name, the expert files' name; an AutoEP
// expert's rows of each fused parameter), "fp32", every per-parameter optimizer state, "step"
// (the group's 0-d step) and "bit16" (the module tensor or the expert file's).
//
// Reshard: the expert files are copied (global ids are the same at any E), the model states get
// the target's dp_world_size and dense buffer, each target rank an optimizer file and, where the
// source had them, each target expert-parallel rank an expp_rank file. The target's E is
// Topology::ep, or the source's when 0; at another E the expert group is laid out anew (MoE layer
// after layer, local expert after local expert), renamed ep_size_<E> (AutoEP's keeps the saved
// name, as DeepSpeed's own saves after its universal load do), and 0.19's param_shapes
// entry lists the new local names (AutoEP: the fused parameters' new row counts; its
// ds_autoep_layers and ds_config's autoep_size are written as a run at the target records them,
// at any DP size). A change of E is refused for tags of DeepSpeed before 0.15.4,
// which scales expert gradients, and so Adam's moments, by E (deepspeedai/DeepSpeed#6545).
// ds_to_universal fails on deepspeed.moe.layer.MoE tags (it takes expp_rank_0's {'optimizer':
// None} for ZeRO's file; deepspeedai/DeepSpeed#5716), so DeepSpeed's universal format has no
// layout for them and PlanUniversalExport is kUnsupported. AutoEP tags it converts (0.19's
// autoep_universal.py): each fused parameter whole, and PlanUniversalExport writes the same.
// Refused with kUnsupported: round_robin_gradients, elastic checkpoints, expert groups of several
// expert-parallel sizes, AutoEP layers of another checkpoint_format or placement, tensor
// parallelism with a pipeline. Tags of DeepSpeed 0.19 hold no expp_rank files under
// ZeRO, and param_shapes in the model states (not needed, not read).
//
// Thread-safety: stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {

class DeepSpeedMoeAdapter final : public FrameworkAdapter {
 public:
  static constexpr std::string_view kName = "deepspeed-moe";
  static constexpr uint32_t kSchema = 4;

  std::string_view name() const override { return kName; }
  uint32_t schema() const override { return kSchema; }

  // True when `tag_dir` holds DeepSpeed-MoE expert files and no ZeRO-3 or pipeline file.
  bool Recognizes(const std::string& tag_dir) const override;

  // Per pipeline stage: the model states, one optimizer file per DP rank, every expert file
  // num_experts names and the expp_rank files there (whether a release writes them is in no
  // file; a rank writes its own before its optimizer file). kFailedPrecondition until each
  // stage's model states are a complete archive; over an mpu's TP also until rank 0's optimizer
  // file is (it tells whether the lanes split the experts).
  Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const override;

  // Validates the tag as the header says: kNotFound naming a missing file, kCorrupt naming the
  // file and field that disagree, kUnsupported for what is refused.
  Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                               const IndexOptions& options) const override;

  // The files DeepSpeed writes at DP size target.dp and expert-parallel size target.ep (0: the
  // source's): kInvalidArgument when that E does not divide target.dp or a layer's experts
  // (DeepSpeed cannot run there), kUnsupported for tp > 1 (but a tag of TP lanes': an mpu's at any
  // pp, AutoEP's folded grid at E > 1 dividing tp · dp and pp 1), a pp at which the saved stages'
  // placement is ambiguous or unknown (above), and a change of E on a tag of DeepSpeed before
  // 0.15.4.
  Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                 const Topology& target) const override;

  // ds_to_universal's files for an AutoEP tag; kUnsupported for others (see the header).
  Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                         const std::string& tag_dir) const override;
};

}  // namespace ucp
