// The DeepSpeed pipeline adapter ("deepspeed-pipe", schema 1): DeepSpeed v0.14 checkpoints of a
// PipelineModule trained by PipelineEngine with DeepSpeedZeroOptimizer (ZeRO stage 1, fp32 or
// bf16) as atoms, resharded to any (pp, dp) and exported as ds_to_universal does.
//
// A tag it reads (PP stages s = 0 .. mp_world_size-1, DP ranks r = 0 .. dp_world_size-1):
//   layer_<LL>-model_states.pt            the state_dict of pipeline layer LL (global layer
//                                         index), names without the layer prefix; written by DP
//                                         rank 0 of the layer's stage; independent of (pp, dp)
//   mp_rank_<s:02>_model_states.pt        module None, param_shapes [OrderedDict] of stage s's
//                                         parameters named "<LL>.<name in layer>" in flat order,
//                                         dp_world_size, mp_world_size (= PP), ds_config, ...
//   [bf16_]zero_pp_rank_<r>_mp_rank_<s:02>_optim_states.pt
//                                         the ZeRO-1 optimizer file of (r, s) exactly as
//                                         deepspeed_zero.h describes it, over stage s's flat
//                                         buffer: padded to a multiple of 2·DP, P = padded/DP.
//
// Layer placement: DeepSpeed assigns layers [parts[s], parts[s+1]) to stage s with the
// PipelineModule's partition_method, which no file records. At the source's pp the saved stages
// are kept, whatever placed them. At another pp ucp takes the two methods that need nothing but
// the checkpoint, "uniform" (partition_uniform over the layer count) and "parameters"
// (DeepSpeed's partition_balanced over each layer's trainable element count), and keeps those
// that put every parameter of the source on the stage whose param_shapes list it. The target's
// placement is theirs when they put every parameter on the same stage at the target's pp; when
// they do not, the reshard is refused as ambiguous, and when neither reproduces the source
// ("type:" methods, custom partitions) it is refused too. The layer count is one past the highest
// layer index named by a layer file or parameter (stateless layers, e.g. functions, past the last
// one are invisible).
//
// Atoms: per parameter (global name "<LL>.<name>"), "fp32", "exp_avg", "exp_avg_sq" (every
// per-parameter optimizer state), "step" (its stage's 0-d step) and "bit16" (the layer file's
// tensor, of the module dtype).
//
// Refused with kUnsupported: tp > 1, ZeRO stage other than 1, BF16_Optimizer files (bf16 at ZeRO
// stage 0 or with fp32 gradient accumulation), more than one parameter group, parameters not named
// "<layer index>.<name>" (tied layers), round_robin_gradients.
//
// Thread-safety: stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {

class DeepSpeedPipeAdapter final : public FrameworkAdapter {
 public:
  static constexpr std::string_view kName = "deepspeed-pipe";
  static constexpr uint32_t kSchema = 1;

  std::string_view name() const override { return kName; }
  uint32_t schema() const override { return kSchema; }

  // True when `tag_dir` holds a pipeline layer file (layer_XX-model_states.pt).
  bool Recognizes(const std::string& tag_dir) const override;

  // mp_rank_<s>_model_states.pt and zero_pp_rank_<r>_mp_rank_<s>_optim_states.pt for every
  // stage s < mp_world_size and rank r < dp_world_size of mp_rank_00, plus the layer files of
  // every layer the stages' param_shapes name and those already present. kFailedPrecondition
  // while a model-states file is missing or not yet a complete archive; kUnsupported for what
  // BuildIndex refuses.
  Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const override;

  // Validates the tag: every stage's model states (one save: ds_version, dp_world_size,
  // mp_world_size agree), every (r, s) optimizer file consistent with its stage's param_shapes
  // (partition sizes, paddings, param_slice_mappings), a layer file for every layer holding a
  // parameter whose tensors have param_shapes' shapes. A missing file is kNotFound naming it;
  // inconsistencies are kCorrupt naming the file and the field.
  Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                               const IndexOptions& options) const override;

  // The files DeepSpeed v0.14.5 writes at (target.pp, target.dp): the layer files unchanged,
  // one model-states file per stage (param_shapes of the stage's layers, dp_world_size,
  // mp_world_size rewritten) and one optimizer file per (rank, stage) with DeepSpeed's
  // partitions, group_paddings, partition_count and param_slice_mappings at that size; every
  // other object is carried from the source's stage-0 files. target.world is 0 or pp·dp;
  // tp ≠ 1, an ambiguous or unknown layer placement (see above), or a stage without parameters
  // is kUnsupported; dp = 0 or pp = 0 kInvalidArgument.
  Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                 const Topology& target) const override;

  // ds_to_universal's output for a pipeline tag: zero/<param>/<state>.pt ({'cat_dim': 0,
  // 'param': tensor}), zero/<param>/step.pt, zero/optimizer_state.pt (optimizer file (0, 0)
  // without its partitioned entries, plus param_groups) and copies of every mp_rank file.
  Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                         const std::string& tag_dir) const override;
};

}  // namespace ucp
