// DeepSpeed's checkpoint file names: the one list, read by the layout that recognises a save's
// files as they are written (checkpoint_layout.cc) and by the adapters that list and write tags.
//
// The names DeepSpeed's engine writes in a tag directory (runtime/engine.py get_ckpt_name,
// _get_zero_ckpt_name, _get_optimizer_ckpt_name, _get_expert_ckpt_name,
// _get_expert_optimizer_ckpt_name; PipelineModule.ckpt_layer_path). <mp> is printed with %02d
// (two digits or more), <dp>, <ep>, <L> and <E> with %d, <LL> with %02d:
//   kModelStates        mp_rank_<mp>_model_states.pt
//   kZero3ModelStates   zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt
//   kOptimStates        [bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt
//   kExpertOptimStates  expp_rank_<ep>_mp_rank_<mp>_optim_states.pt
//   kExpertModelStates  layer_<L>_expert_<E>_mp_rank_<mp>_model_states.pt
//   kLayerStates        layer_<LL>[-<axis>_<rank:02>]...-model_states.pt (the grid's rank
//                       representation: "-model_01" under tensor parallelism)
// and, beside the tags, the commit signal <save>/latest holding the tag's name.
//
// Thread-safety: functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ucp::deepspeed {

// The commit signal's name, beside the tag directories.
inline constexpr std::string_view kLatestName = "latest";
// Every data file's name ends so.
inline constexpr std::string_view kStatesSuffix = "_states.pt";

enum class FileKind {
  kModelStates,
  kZero3ModelStates,
  kOptimStates,
  kExpertOptimStates,
  kExpertModelStates,
  kLayerStates,
};

// A data file's name taken apart. Fields a kind's name does not hold are 0 (prefix empty).
struct FileName {
  FileKind kind = FileKind::kModelStates;
  std::string prefix;   // kOptimStates: "" or "bf16_"
  uint32_t dp = 0;      // kZero3ModelStates, kOptimStates; the ep rank for kExpertOptimStates
  uint32_t mp = 0;      // every kind but kLayerStates
  uint32_t layer = 0;   // kExpertModelStates, kLayerStates
  uint32_t expert = 0;  // kExpertModelStates
  // kLayerStates named layer_<LL>-model_<TT>-model_states.pt: TT, the tensor-parallel rank.
  std::optional<uint32_t> model_rank;
};

// The name's kind and numbers; nullopt for any other name, and for a number of more than 9 digits.
std::optional<FileName> ParseFileName(std::string_view name);

// 1 to 9 decimal digits, nothing else; nullopt otherwise.
std::optional<uint32_t> Decimal(std::string_view digits);

// The layer index of a pipeline parameter named "<LL>.<name>" (LL: 1 to 9 digits); nullopt for
// any other name (a tied module's "tied_modules.<key>.<name>").
std::optional<uint32_t> NumberedLayer(std::string_view name);

// mp_rank_<mp:02>_model_states.pt
std::string ModelStatesName(uint32_t mp);
// zero_pp_rank_<dp>_mp_rank_<mp:02>_model_states.pt
std::string Zero3ModelStatesName(uint32_t dp, uint32_t mp);
// <prefix>zero_pp_rank_<dp>_mp_rank_<mp:02>_optim_states.pt
std::string OptimName(std::string_view prefix, uint32_t dp, uint32_t mp);
// layer_<layer:02>-model_states.pt (a pipeline without tensor parallelism)
std::string LayerStatesName(uint32_t layer);
// layer_<layer:02>-model_<tp:02>-model_states.pt (a pipeline with tensor parallelism)
std::string TpLayerStatesName(uint32_t layer, uint32_t tp);
// layer_<layer>_expert_<expert>_mp_rank_<mp:02>_model_states.pt (DeepSpeed-MoE: MoE layer
// `layer`'s global expert `expert`)
std::string ExpertModelStatesName(uint32_t layer, uint32_t expert, uint32_t mp);
// expp_rank_<ep>_mp_rank_<mp:02>_optim_states.pt (DeepSpeed-MoE: expert-parallel rank `ep`)
std::string ExpertOptimName(uint32_t ep, uint32_t mp);

}  // namespace ucp::deepspeed
