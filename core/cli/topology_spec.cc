#include "core/cli/topology_spec.h"

#include <string>

#include "core/util/checked.h"

namespace ucp::cli {
namespace {

Result<uint32_t> ParseCount(std::string_view key, std::string_view value) {
  // At most 10 digits, so the value cannot wrap before the range check.
  bool valid = !value.empty() && value.size() <= 10;
  uint64_t number = 0;
  for (size_t i = 0; valid && i < value.size(); ++i) {
    valid = value[i] >= '0' && value[i] <= '9';
    number = number * 10 + static_cast<uint64_t>(value[i] - '0');
  }
  if (!valid || number == 0 || number > UINT32_MAX) {
    return Status::InvalidArgument("--to: " + std::string(key) + "=" + std::string(value) + ": " +
                                   std::string(key) + " must be a whole number from 1 to " +
                                   std::to_string(UINT32_MAX));
  }
  return static_cast<uint32_t>(number);
}

}  // namespace

Result<TopologySpec> ParseTopologySpec(std::string_view text) {
  TopologySpec spec;
  bool dp_seen = false;
  if (text.empty()) return Status::InvalidArgument("--to: empty; expected e.g. dp=2");
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string_view pair = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const size_t equals = pair.find('=');
    if (equals == std::string_view::npos) {
      return Status::InvalidArgument(
          "--to: \"" + std::string(pair) +
          "\": expected KEY=VALUE with KEY one of dp, tp, pp, ep, world, partition");
    }
    const std::string_view key = pair.substr(0, equals);
    if (key == "partition") {
      const std::string_view name = pair.substr(equals + 1);
      const std::optional<LayerPartition> partition = ParseLayerPartition(name);
      if (!partition) {
        return Status::InvalidArgument("--to: partition=" + std::string(name) +
                                       ": expected uniform, parameters or type");
      }
      if (spec.partition) return Status::InvalidArgument("--to: partition given twice");
      spec.partition = partition;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
      continue;
    }
    UCP_ASSIGN_OR_RETURN(const uint32_t value, ParseCount(key, pair.substr(equals + 1)));
    std::optional<uint32_t>* slot = nullptr;
    if (key == "dp") {
      if (dp_seen) return Status::InvalidArgument("--to: dp given twice");
      dp_seen = true;
      spec.dp = value;
    } else if (key == "tp") {
      slot = &spec.tp;
    } else if (key == "pp") {
      slot = &spec.pp;
    } else if (key == "world") {
      slot = &spec.world;
    } else if (key == "ep") {
      slot = &spec.ep;
    } else {
      return Status::InvalidArgument("--to: unknown key \"" + std::string(key) +
                                     "\" (known: dp, tp, pp, ep, world, partition)");
    }
    if (slot != nullptr) {
      if (slot->has_value()) {
        return Status::InvalidArgument("--to: " + std::string(key) + " given twice");
      }
      *slot = value;
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (!dp_seen) return Status::InvalidArgument("--to: dp is required, e.g. dp=2");
  return spec;
}

Result<Topology> ResolveTopology(const TopologySpec& spec, const Topology& source) {
  Topology target = source;
  target.dp = spec.dp;
  target.tp = spec.tp.value_or(source.tp);
  target.pp = spec.pp.value_or(source.pp);
  target.ep = spec.ep.value_or(0);
  target.partition = spec.partition.value_or(LayerPartition::kInferred);
  const auto dp_tp = CheckedMul<uint64_t>(target.dp, target.tp);
  const auto ranks = dp_tp ? CheckedMul<uint64_t>(*dp_tp, target.pp) : std::nullopt;
  if (!ranks || *ranks > UINT32_MAX) {
    return Status::InvalidArgument("--to: dp × tp × pp exceeds 4294967295");
  }
  if (!spec.world.has_value()) {
    target.world = static_cast<uint32_t>(*ranks);
  } else if (*spec.world % *ranks != 0) {
    return Status::InvalidArgument(
        "--to: world=" + std::to_string(*spec.world) +
        " is not a multiple of dp × tp × pp = " + std::to_string(*ranks));
  } else {
    target.world = *spec.world;
  }
  return target;
}

std::string TopologyText(const Topology& topology) {
  return "dp=" + std::to_string(topology.dp) + " tp=" + std::to_string(topology.tp) +
         " pp=" + std::to_string(topology.pp) +
         (topology.ep != 0 ? " ep=" + std::to_string(topology.ep) : std::string()) +
         " world=" + std::to_string(topology.world) +
         " zero_stage=" + std::to_string(topology.zero_stage) +
         (topology.partition != LayerPartition::kInferred
              ? " partition=" + std::string(LayerPartitionName(topology.partition))
              : std::string());
}

}  // namespace ucp::cli
