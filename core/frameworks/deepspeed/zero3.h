// The DeepSpeed ZeRO-3 adapter ("deepspeed-zero3", schema 1): DeepSpeed v0.14 checkpoints of
// DeepSpeedZeroOptimizer_Stage3 (fp32, fp16, bf16) as atoms, resharded to any DP size and
// exported as ds_to_universal does.
//
// A tag it reads (pp = 1; the optimizer files are `bf16_` ones exactly when bf16 is on), per DP
// rank r and, with AutoTP tensor parallelism (DeepSpeed 0.19), per TP rank t < mp_world_size:
//   zero_pp_rank_<r>_mp_rank_<t:02>_model_states.pt, r = 0 .. dp_world_size-1
//     module (buffers; every ZeRO-3 parameter an empty tensor), param_shapes (one OrderedDict
//     name → torch.Size per flat group, in flat order), frozen_param_shapes and
//     frozen_param_fragments (name → rank r's partition of every parameter without
//     requires_grad), shared_params (filled on rank 0 only), dp_world_size, ds_config, ...
//   [bf16_]zero_pp_rank_<r>_mp_rank_<t:02>_optim_states.pt
//     optimizer_state_dict: zero_stage (weights), loss_scaler, dynamic_loss_scale, overflow,
//       partition_count (an int: the DP size), optimizer_state_dict (the torch optimizer's
//       state_dict: state {i: {step, exp_avg, ...}} per flat group i, param_groups whose params
//       list the flat groups of each optimizer parameter group), fp32_flat_groups [fp32[P_i]]
// DeepSpeed's rule at DP size N: every parameter of n elements is zero-padded to a multiple of N
// and rank r holds its elements [r·c, (r+1)·c), c = ceil(n/N) (the last ranks hold the padding,
// which is uninitialised memory in fp32_flat_groups of a training save: ucp never reads it and
// writes zeros). Flat group i of rank r is the concatenation of those pieces over param_shapes[i]
// (P_i = Σ c); every per-parameter optimizer state (a 1-d tensor of state[i] with P_i elements)
// follows it. A frozen parameter's piece is a tensor of its own (c elements, the module dtype).
// Flat groups are DeepSpeed's sub groups: an optimizer parameter group is split where its
// partition elements at N reach zero_optimization.sub_group_size (default 1e9).
//
// Atoms: per trainable parameter "fp32", every per-parameter optimizer state ("exp_avg",
// "exp_avg_sq", ...) and "step" (its flat group's 0-d step); per frozen parameter "bit16" (the
// module dtype). Index groups are the optimizer's parameter groups (their flat groups' params
// in flat order); any number of groups and of frozen parameters.
//
// With AutoTP every rule above holds per TP rank t over t's slices (param_shapes are the slices'
// shapes), and the model states carry universal_checkpoint_info with AutoTP's affine map, which
// says how the slices make each parameter (autotp.h): an atom is the whole parameter, made of
// the DP pieces of every TP rank's slice (of TP rank 0's where every rank holds it whole), and
// the index keeps each rule in adapter_state["tp"] = {"degree": T, "params": {<name>: shard map
// (tp_shards.h MapJson)}, "vocabulary": [<names>], "megatron": false}.
//
// With an mpu's TP (Megatron-DeepSpeed's ZeRO-3 with TP) the same holds, the model states'
// universal_checkpoint_info recording Megatron's patterns instead (and no ds_config
// tensor_parallel.autotp_size): the maps are megatron_rules.h's, the vocabulary's atoms unpadded,
// and adapter_state["tp"] says "megatron": true with the vocabulary's sizes ("vocab"). A save of
// one TP rank whose patterns name every parameter, its vocabulary not padded there, is read so too
// (degree 1), so that it can be split; else whole, as any tp = 1 save. A reshard to T' writes the
// rules' slices at T' and the Megatron records of the degree (mp_world_size, tp_degree,
// padded_vocab_size, the client's args); the universal export at T > 1 is deepspeed-tp's.
//
// With AutoEP (DeepSpeed 0.19, ds_autoep_layers of checkpoint_format zero3_partitioned) each
// expert-parallel rank e's fused expert parameters ("<experts module>.w1", ... of n rows: its
// experts [e·n, (e+1)·n)) are flat groups of their own, partitioned by the rule above over e's
// expert-data-parallel ranks alone (ExpertRankOrder); each optimizer file's
// ds_zero_partition_groups records every flat group's partition count, rank and ranks, checked
// against that order, as every model states' coordinates are. A fused parameter's atom is the
// whole of it (every expert-parallel rank's rows, a split of dimension 0 in E parts), and the
// index keeps adapter_state["autoep"] = {"ep": E, "data_before_expert": bool, "experts":
// {<fused parameter>: its layer's experts}}.
//
// Refused with kUnsupported: pp > 1; mp_world_size > 1 without an affine map or Megatron's
// patterns; AutoTP layouts autotp.h refuses; with Megatron's rules at tp > 1 a parameter no
// pattern names or one averaged over the ranks; a target TP degree that does not divide a split
// (tp > 1 at all for a tag of one TP rank read whole); AutoEP with AutoTP, frozen AutoEP expert
// parameters.
//
// Thread-safety: stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {

class DeepSpeedZero3Adapter final : public FrameworkAdapter {
 public:
  static constexpr std::string_view kName = "deepspeed-zero3";
  static constexpr uint32_t kSchema = 2;

  std::string_view name() const override { return kName; }
  uint32_t schema() const override { return kSchema; }

  // True when `tag_dir` holds a ZeRO-3 model-states file
  // (zero_pp_rank_N_mp_rank_XX_model_states.pt).
  bool Recognizes(const std::string& tag_dir) const override;

  // zero_pp_rank_<r>_mp_rank_<t:02>_model_states.pt and [bf16_]zero_pp_rank_<r>_mp_rank_<t:02>_
  // optim_states.pt for r < dp_world_size and t < mp_world_size of rank (0, 0)'s model states
  // (bf16_ when such a file exists or ds_config enables bf16). kFailedPrecondition while that
  // file is missing or not a complete archive; kUnsupported for mp_world_size > 1 without
  // AutoTP's affine map; kCorrupt for a ds_config stage other than 3.
  Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const override;

  // Validates the tag: a model-states and an optimizer file for every DP rank, all of one save
  // (ds_version, dp_world_size, partition_count, zero_stage 3, one prefix), fp32_flat_groups,
  // every partitioned state and every frozen fragment of the sizes param_shapes and
  // frozen_param_shapes give at that DP size, param_groups covering the flat groups in order.
  // A missing rank file is kNotFound naming it; inconsistencies are kCorrupt naming the file and
  // the field.
  Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                               const IndexOptions& options) const override;

  // The files DeepSpeed v0.14.5 writes at DP size target.dp: per rank the model states (rank 0's,
  // with dp_world_size, that rank's frozen_param_fragments, and shared_params empty off rank 0)
  // and the optimizer states (rank 0's, with partition_count, that rank's fp32_flat_groups and
  // partitioned states, padding zeros). Where the sub groups at target.dp differ from the
  // source's, param_shapes, fp32_flat_groups, the state dict and param_groups' params follow
  // them (a new flat group's tensors and 0-d states like flat group 0's). Targets as
  // DeepSpeedZeroAdapter::PlanReshard. An AutoTP tag goes to any target.tp its splits divide:
  // the same per TP rank over the slices at target.tp, each rank's model states from its DP rank
  // 0's (at another degree rank (0, 0)'s, with param_shapes, mp_world_size, the parallel
  // dimensions, autotp_size and the affine map of target.tp; no universal_checkpoint_info at
  // tp 1), its optimizer states from rank (0, 0)'s holding its slices (DeepSpeed 0.19's files at
  // that size). An AutoEP tag goes to any target.dp and expert-parallel size target.ep (0: the
  // tag's) that divides it and every layer's experts (kInvalidArgument otherwise): each rank's
  // model states from rank 0's with its ds_autoep_layers coordinates, param_shapes and
  // autoep_size at that size, its optimizer states with its ds_zero_partition_groups.
  Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                 const Topology& target) const override;

  // ds_to_universal's ZeRO-3 output: zero/<param>/<state>.pt (a bare 1-d tensor of the
  // parameter's elements; with AutoTP {'param': the whole parameter}, 'vocab_tensor': True first
  // for a vocabulary parameter, as DeepSpeed 0.19's) for fp32 and every partitioned optimizer
  // state (no step.pt, no frozen parameters, as ds_to_universal), zero/optimizer_state.pt (rank
  // (0, 0)'s whole
  // optimizer_state_dict plus param_groups, shared with its inner state_dict's) and copies of
  // every model-states file. Unlike ds_to_universal (v0.14.5 reads state[0] and
  // fp32_flat_groups[0] only), every flat group is exported. An AutoEP tag's fused expert
  // parameters are {'param': whole, 'cat_dim': 0, 'is_expert_param': True, 'ep_num_experts': n},
  // its model states saved again with universal_checkpoint_info naming the experts (0.19.8's).
  Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                         const std::string& tag_dir) const override;
};

}  // namespace ucp
