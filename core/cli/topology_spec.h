// The target topology of `ucp reshard --to`, e.g. "dp=2" or "dp=2,tp=1,pp=1,world=2".
//
// Grammar: KEY=VALUE pairs separated by commas, KEY one of dp, tp, pp, ep, world (each at most
// once, dp required), VALUE a decimal integer in [1, 2^32); or partition=uniform|parameters|type
// (how a pipeline's layers are placed at another pp; default: inferred from the saved stages).
// Nothing else: no spaces, no signs, no empty pairs.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/format/atom_index.h"
#include "core/util/status.h"

namespace ucp::cli {

struct TopologySpec {
  uint32_t dp = 1;
  std::optional<uint32_t> tp;
  std::optional<uint32_t> pp;
  std::optional<uint32_t> world;
  std::optional<uint32_t> ep;  // MoE tags: the expert-parallel size (default: the tag's)
  std::optional<LayerPartition> partition;  // pipelines at another pp (default: inferred)
};

// Parses `text`; kInvalidArgument naming the offending pair, key or value.
[[nodiscard]] Result<TopologySpec> ParseTopologySpec(std::string_view text);

// The target for a checkpoint saved at `source`: tp and pp default to the source's, ep to 0 (the
// tag's own), the partition to kInferred, world to dp × tp × pp, the ZeRO stage is the source's.
// kInvalidArgument when world is not a multiple of dp × tp × pp (or the product overflows).
[[nodiscard]] Result<Topology> ResolveTopology(const TopologySpec& spec, const Topology& source);

// "dp=4 tp=1 pp=1 world=4 zero_stage=2", for summaries.
std::string TopologyText(const Topology& topology);

}  // namespace ucp::cli
