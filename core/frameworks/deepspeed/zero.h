// The DeepSpeed ZeRO-1/2 adapter ("deepspeed-zero12", schema 1): DeepSpeed v0.14 checkpoints of
// DeepSpeedZeroOptimizer (fp32, fp16, bf16) and BF16_Optimizer as atoms, resharded to any DP size
// and exported as ds_to_universal does.
//
// A tag it reads (tp = pp = 1; `bf16_` is the prefix of every bf16 run):
//   mp_rank_00_model_states.pt                     module (bit16 weights, views of one flat
//                                                  buffer), param_shapes (flat-buffer order),
//                                                  dp_world_size, ds_config, ds_version, ...
//   [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt, r = 0 .. partition_count-1
//     optimizer_state_dict: base_optimizer_state {state: {g: {step, exp_avg, ...}}, param_groups},
//       single_partition_of_fp32_groups, group_paddings, partition_count, param_slice_mappings
//       (name → fragment_address(numel, start)), plus loss_scaler, zero_stage, clip_grad, ...
// DeepSpeed's rule, for every parameter group g at DP size N: the group's parameters, in
// param_shapes order, make one flat buffer of T elements, zero-padded at its END to a multiple of
// 2·N (nccl_start_alignment_factor 2); rank r owns elements [r·P, (r+1)·P) with P = padded/N.
// Every per-parameter optimizer state (any tensor of state[g] with P elements) follows that
// layout; DeepSpeedZeroOptimizer saves single_partition_of_fp32_groups without the padding (the
// last rank's tensor is a view of P - padding elements of a P-element storage), BF16_Optimizer
// with it. With zero_optimization.round_robin_gradients the flat order is DeepSpeed's round-robin
// permutation (over N) of the optimizer's parameter order; param_shapes records it.
//
// Atoms: per parameter, "fp32" (the master weights), every per-parameter optimizer state
// ("exp_avg", "exp_avg_sq", ...), "bit16" (the module tensor) and "step" (the group's 0-d step
// tensor, as ds_to_universal writes step.pt for every parameter).
//
// With zero_optimization.elastic_checkpoint, base_optimizer_state is instead a list of per-group
// states whose partition-shaped tensors leave out the rank's padding (as the fp32 partition
// does), with no param_groups; such tags are read and resharded into that form (the universal
// export refuses them: it needs param_groups).
//
// Refused with kUnsupported: ZeRO-3 tags (deepspeed_zero3.h reads them), pipeline tags
// and tp > 1 (tp.h reads them).
//
// Thread-safety: stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {

class DeepSpeedZeroAdapter final : public FrameworkAdapter {
 public:
  static constexpr std::string_view kName = "deepspeed-zero12";
  static constexpr uint32_t kSchema = 1;

  std::string_view name() const override { return kName; }
  uint32_t schema() const override { return kSchema; }

  // True when `tag_dir` holds DeepSpeed checkpoint file names (model or optimizer states), no
  // ZeRO-3 model-states file (zero_pp_rank_N_mp_rank_XX_model_states.pt: DeepSpeedZero3Adapter's),
  // no pipeline layer file (layer_XX[-model_TT]-model_states.pt: DeepSpeedTpAdapter's) and no
  // file of a TP rank > 0 (DeepSpeedTpAdapter's). DeepSpeedTpAdapter, registered before this one,
  // also takes TP=1 tags whose model states carry universal_checkpoint_info.
  bool Recognizes(const std::string& tag_dir) const override;

  // mp_rank_00_model_states.pt and [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt for r <
  // dp_world_size (the optimizer files are bf16_ when any such file exists, or the model
  // states' ds_config enables bf16). kFailedPrecondition when the model-states file is missing or
  // is not yet a complete archive; kUnsupported for what BuildIndex refuses (ZeRO-3, tp or pp >
  // 1: mp_world_size, layer files) and for a config without a ZeRO optimizer (stage 0, no bf16).
  Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const override;

  // Validates the tag: one model-states file, an optimizer file for every DP rank of
  // partition_count, every file of one save (ds_version, zero_stage, partition_count, param
  // groups agree), param_shapes consistent with the partitions, paddings and
  // param_slice_mappings. A missing rank file is kNotFound naming it; inconsistencies are
  // kCorrupt naming the file and the field.
  Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                               const IndexOptions& options) const override;

  // The files DeepSpeed v0.14.5 writes at DP size target.dp (tp = pp = 1): the model states
  // with dp_world_size rewritten (and param_shapes reordered when round_robin_gradients is on),
  // and one optimizer file per rank whose partitions, paddings, group_paddings,
  // partition_count and param_slice_mappings are those DeepSpeed computes at that size; every
  // other object is carried from the source's rank-0 file. target.world is 0 (unspecified) or
  // target.dp; a world that dp does not divide is kInvalidArgument, tp or pp other than 1
  // kUnsupported, dp = 0 kInvalidArgument. tp > 1 names why: kUnsupported when the model states
  // hold no universal_checkpoint_info (no rules to split by), kFailedPrecondition when they do
  // (an index this adapter built before DeepSpeedTpAdapter read such tags: to be rebuilt).
  Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                 const Topology& target) const override;

  // ds_to_universal's ZeRO-1/2 output (kUnsupported for an elastic tag): zero/<param>/<state>.pt
  // ({'cat_dim': 0, 'param': tensor}), zero/<param>/step.pt (the 0-d step tensor),
  // zero/optimizer_state.pt (rank 0's optimizer_state_dict without its partitioned entries, plus
  // param_groups) and copies of the model-states files.
  Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                         const std::string& tag_dir) const override;
};

}  // namespace ucp
