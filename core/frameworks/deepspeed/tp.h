// The DeepSpeed grid adapter ("deepspeed-tp", schema 1): checkpoints of ZeRO-1/2
// (DeepSpeedZeroOptimizer, BF16_Optimizer) on DeepSpeed's grid of pipeline stages × TP ranks ×
// DP ranks, as atoms, resharded to any (pp, tp, dp) and exported as ds_to_universal does: every
// pipeline tag, and outside a pipeline Megatron-DeepSpeed's at tensor-parallel degree tp > 1, or
// at tp = 1 when the model states carry universal_checkpoint_info (the rules to split by). A
// pp = 1, TP = 1 tag without it is the deepspeed-zero12 adapter's, which refuses tp > 1 targets.
//
// A tag it reads at pp = 1 (per TP rank t < mp_world_size, per DP rank r < dp_world_size):
//   mp_rank_<t:02>_model_states.pt   module (rank t's slices, views of one flat buffer),
//                                    param_shapes (local shapes, flat-buffer order),
//                                    dp_world_size, mp_world_size, ds_config, and in rank 0's the
//                                    client's universal_checkpoint_info (below)
//   [bf16_]zero_pp_rank_<r>_mp_rank_<t:02>_optim_states.pt   rank (r, t)'s ZeRO-1/2 partition of
//                                    TP rank t's flat buffer (deepspeed_zero.h describes it)
// A pipeline tag with tensor parallelism (3D: a PipelineModule on DeepSpeed's pipeline grid, every
// layer file named with its TP rank) holds per stage s < pp and TP rank t < tp, at mp rank
// m = s·tp + t (mp_world_size = tp·pp; tp is one past the layer files' highest TT). A
// PipelineModule on its own grid (PipeDataParallelTopology: axes pipe and data, no model axis)
// names no TP rank (layer_<LL>-model_states.pt): tp = 1, and a reshard keeps it 1.
//   mp_rank_<m:02>_model_states.pt   module None, param_shapes of stage s's slices, as above
//   [bf16_]zero_pp_rank_<r>_mp_rank_<m:02>_optim_states.pt   as above, over stage s's buffer
//   layer_<LL>-model_<t:02>-model_states.pt   layer LL's state_dict on TP rank t: the module
//                                    tensors of "<LL>.<name>", and of "tied_modules.<key>.<name>"
//                                    in the one layer of the stage's span that holds no numbered
//                                    parameter and holds every such <name>
// A parameter's atoms come from the first stage listing it; a later stage may list it again only
// when pipeline_replicated_parameter_patterns names it (a tied module's copy, which
// ds_to_universal skips too: the last stage's never-used position embeddings differ), or, in a
// tag without universal_checkpoint_info, when it is a tied module's (tied_modules.<key>.<name>).
// universal_checkpoint_info (every entry optional; Python regexes matched at the start of a name):
//   tp_replicated_parameter_patterns        every TP rank holds the whole parameter (slices must
//                                           be bit-identical; ds_to_universal asserts the same)
//   parameter_to_average_patterns           the parameter is the mean of the TP slices
//   parameter_with_row_parallelism_patterns split on dim 1
//   parameter_with_2_sub_params_cat_dim_0   two sub-parameters stacked on dim 0, each split on
//                                           dim 0 (SwiGLU's fused gate and up projections)
//   parameter_with_sub_params               [{patterns, shape, partition_dim}]: the sub-parameters
//                                           whose sizes shape[partition_dim] lists are each split
//                                           on partition_dim (fused QKV)
//   vocabulary_parameter_patterns           split on dim 0 and padded to padded_vocab_size rows,
//   original_vocab_size, padded_vocab_size  of which the first original_vocab_size are real
// A parameter no pattern names is split on dim 0 when its name is one of the column-parallel
// names DeepSpeed's MegatronSDLoader splits so (attention.query_key_value, mlp.dense_h_to_4h.*,
// word_embeddings.weight, final_linear.weight). Any other parameter whose TP slices are not
// bit-identical is refused, naming it (kUnsupported): ds_to_universal would silently concatenate
// it on dim 0, which may be wrong. Bit-identical slices are treated as replicated. At tp = 1 there
// is one slice to judge by: such a parameter is "unnamed", copied whole at tp = 1 and refused,
// named, at tp > 1 (its universal export has ds_to_universal's 'cat_dim': 0).
//
// The index holds every rule explicitly, per parameter, in adapter_state["tp"] (the atom index's
// adapter-specific member, opaque to core):
//   {"degree": 2,
//    "vocab": {"original": 67, "padded": 72, "divisible_by": 4},          // optional
//    "params": {"<name>": {"rule": "replicated" | "averaged" | "split" | "unnamed",
//                          "dim": 0,                     // split: the dimension cut over TP
//                          "sub_params": [72, 72],       // split: global extents along dim of
//                                                        // the sub-parameters (one: plain split)
//                          "vocab": true,                // split on dim 0 with padding rows
//                          "universal": "cat_dim" | "n_sub_params" | "sub_param_shape",
//                          "sub_param_shape": 0          // with "universal": "sub_param_shape":
//                                                        // its parameter_with_sub_params entry
//                         }, ...}}
// TP rank t's slice of a split parameter holds, for every sub-parameter i of global extent S_i,
// the elements [G_i + t·S_i/tp, G_i + (t+1)·S_i/tp) along dim (G_i: the extents before i), in
// that order. The vocabulary's padded rows [original, padded) are in no atom; a target TP degree
// tp' gets Megatron's _vocab_size_with_padding(original, divisible_by · tp') rows, the new ones
// zero (what DeepSpeed's universal load writes). divisible_by is the model states'
// args.make_vocab_size_divisible_by when saved, else inferred from the source's padded size at its
// degree: Megatron's default 128 when it gives that size, else the largest power of two that
// does, else the smallest integer (at tp = 1, 67 rows padded to 68 fit 2 and 4, which disagree at
// tp = 2: a tag without args can only be told apart by that rule).
//
// Atoms: as deepspeed_zero.h, per parameter of the full (merged, vocabulary-unpadded) shape:
// "fp32", every optimizer state, "bit16" (the module) and "step".
//
// With zero_optimization.round_robin_gradients (ZeRO-1/2) every TP rank's flat buffers are
// round-robin over the DP ranks, as deepspeed_zero.h says: read in param_shapes' order, written
// in the target DP size's round-robin order with DeepSpeed's param_slice_mappings of that mode
// (a pipeline's stages each so).
//
// Refused with kUnsupported: a pipeline tag to a pp its saved stages do not place it at, ZeRO-3,
// averaged parameters whose slices differ (their mean is no byte range of
// the files), uneven splits, a tied module whose layer file is not the one candidate.
//
// Thread-safety: stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {

class DeepSpeedTpAdapter final : public FrameworkAdapter {
 public:
  static constexpr std::string_view kName = "deepspeed-tp";
  static constexpr uint32_t kSchema = 1;

  std::string_view name() const override { return kName; }
  uint32_t schema() const override { return kSchema; }

  // True when every pipeline layer file of `tag_dir` names a TP rank; else when it holds neither
  // pipeline layer files nor ZeRO-3 model states, and either
  // files of more than one TP rank (mp_rank_XX_model_states.pt, XX > 0) or one TP rank whose
  // mp_rank_00_model_states.pt holds universal_checkpoint_info (this reads that file's pickle,
  // never tensor data).
  bool Recognizes(const std::string& tag_dir) const override;

  // mp_rank_<t>_model_states.pt for t < mp_world_size and
  // [bf16_]zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt for r < dp_world_size, from rank 0's
  // model states (kFailedPrecondition while it is missing or incomplete; kUnsupported for ZeRO-3
  // or stage 0 configs); in a pipeline tag, once every model-states file is whole, the layer files
  // too.
  Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const override;

  // Validates every TP rank's files as deepspeed_zero.h does for one, checks that the TP ranks
  // are of one save (same parameters, groups, dp and mp sizes) and that every parameter's local
  // shapes agree with its rule, and merges the slices into atoms. Reads the data of parameters
  // that must be replicated, averaged or are named by no rule to compare their slices.
  Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                               const IndexOptions& options) const override;

  // The files DeepSpeed v0.14.5 writes at (target.tp, target.pp, target.dp) after a universal
  // load: per target stage and TP rank its model states (param_shapes of its slices, mp_world_size
  // tp·pp, dp_world_size, universal_checkpoint_info.padded_vocab_size, the client's Megatron args'
  // tensor/pipeline/data-parallel sizes and padded_vocab_size where saved; outside a pipeline the
  // module's slices in a flat buffer of the new size) and its DP ranks' optimizer files
  // (partitions, paddings, partition_count, param_slice_mappings); in a pipeline, per TP rank
  // every layer file with its parameters' slices. Every other object is carried from the source's
  // first files. A pipeline keeps its stages at the source's pp and puts every parameter on one
  // stage at pp = 1 (PipelineModule's order: tied modules first). At another pp its layers go
  // where the partition methods that reproduce the saved stages put them ('uniform' over the layer
  // count, 'parameters', and 'type:' for each kind of layer, told by its parameters' names and
  // shapes; a tied module's copy on the last stage without a layer file is one more layer past
  // the visible ones). The pipeline copies of tied parameters get the first stage's values, as
  // DeepSpeed's universal load gives them. target.world is 0 or tp·pp·dp. kUnsupported: another
  // pp where no method gives the saved stages or those that do disagree, a target stage without
  // parameters, pp > 1 outside a pipeline, a split that target.tp does not divide, an "unnamed"
  // parameter (of a TP=1 source) at target.tp > 1.
  Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                 const Topology& target) const override;

  // ds_to_universal's output: zero/<param>/<state>.pt as {'cat_dim', ['param_n_sub_params' |
  // 'sub_param_shape'], ['vocab_tensor'], 'param'} by the parameter's rule ({'param'} alone for
  // replicated and averaged ones), zero/<param>/step.pt, zero/optimizer_state.pt (rank (0, 0)'s)
  // and copies of every model-states file. A vocabulary tensor views the first
  // original_vocab_size rows of a storage of padded_vocab_size rows, whose padding rows are
  // written as zeros.
  Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                         const std::string& tag_dir) const override;
};

}  // namespace ucp
