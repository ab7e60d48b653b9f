// DeepSpeed 0.19's AutoEP layers as its checkpoints record them (ds_autoep_layers) and the rank
// order of its expert-parallel groups, shared by the adapters of the layouts AutoEP saves:
// deepspeed-moe (ZeRO-1/2, one file per expert) and deepspeed-zero3 (experts partitioned over the
// expert-data-parallel ranks).
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

// DeepSpeed 0.19's AutoEP records its layers in the model states under this key (and again in
// universal_checkpoint_info).
inline constexpr std::string_view kAutoEpLayers = "ds_autoep_layers";
// The name DeepSpeed gives an expert group (MoE.expert_group_name): "ep_size_<E>".
inline constexpr std::string_view kExpertGroupNamePrefix = "ep_size_";
// Bounds a corrupt num_experts entry (and the file names it makes).
inline constexpr int64_t kMaxExperts = int64_t{1} << 20;
// The ds_config entry that puts data-parallel before expert-parallel ranks (default false).
inline constexpr std::string_view kDataBeforeExpert = "use_data_before_expert_parallelism";

// Which expert-parallel rank each of dp ranks is, and its index in that rank's
// expert-data-parallel group (the dp / ep ranks its experts are partitioned over). By default runs
// of ep consecutive ranks are an expert-parallel group: rank r is expert-parallel rank r mod ep,
// index r div ep. With use_data_before_expert_parallelism runs of dp / ep consecutive ranks are an
// expert-data-parallel group: rank r is expert-parallel rank r div (dp / ep), index r mod (dp / ep)
// (deepspeed/utils/groups.py; ds_to_universal's _autoep_zero12_dp_ranks).
struct ExpertRankOrder {
  uint32_t dp = 1;
  uint32_t ep = 1;
  bool data_before_expert = false;

  uint32_t ExpertRank(uint32_t r) const { return data_before_expert ? r / (dp / ep) : r % ep; }
  uint32_t IndexInGroup(uint32_t r) const { return data_before_expert ? r % (dp / ep) : r / ep; }
  uint32_t Rank(uint32_t e, uint32_t i) const {
    return data_before_expert ? e * (dp / ep) + i : e + i * ep;
  }
};

// The model states' num_experts: each MoE layer's experts, in module order; kCorrupt naming the
// field where it is empty or a count is out of range.
Result<std::vector<uint32_t>> ReadNumExperts(const TorchArchiveReader& model);

// DeepSpeed 0.19's record of its AutoEP layers in `model` (rank 0's model states): one entry per
// MoE layer (moe_layer_id), each with `num_experts`' count for it, one expert-parallel size E for
// all that divides `dp`, expert-parallel rank e holding the run of experts [e·n, (e+1)·n), its
// experts saved in checkpoint_format `format`, and rank 0's own coordinates. Sets each layer's
// experts module (expert_key_prefix) and returns E; kUnsupported for another file format or
// placement, kCorrupt naming the field otherwise.
Result<uint32_t> ReadAutoEpLayers(const TorchArchiveReader& model,
                                  const std::vector<uint32_t>& num_experts, uint32_t dp,
                                  std::string_view format,
                                  std::vector<std::string>& experts_modules);

// The model states' ds_autoep_layers (and universal_checkpoint_info's, where a release writes
// them there too) as DeepSpeed records them on DP rank `rank` of a run at `order`'s DP and
// expert-parallel sizes: its local experts, the placement (rank e: [e·n, (e+1)·n)), the affine
// maps split along the expert dimension, the expert group's name, the rank's coordinates
// (ep_rank, expert_data_parallel_rank, global_expert_start/end) and the expert-data-parallel
// size. ReadAutoEpLayers checked what the source's hold.
Status SetAutoEpLayers(pickle::Graph& graph, pickle::Value* root, const ExpertRankOrder& order,
                       uint32_t rank, const TorchArchiveReader& reader);

}  // namespace ucp::deepspeed
