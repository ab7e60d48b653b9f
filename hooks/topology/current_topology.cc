#include "hooks/topology/current_topology.h"

#include <cstdint>
#include <string_view>
#include <tuple>
#include <utility>

#include "core/util/checked.h"
#include "core/util/launcher.h"

namespace ucp::hooks {
namespace {

// The world size and rank one source of evidence gives, and how it says it.
struct WorldEvidence {
  int size = 0;
  std::optional<int> rank;
  std::string text;
};

std::optional<WorldEvidence> FromLauncher(const EnvLookup& env,
                                          std::vector<std::string>& warnings) {
  std::optional<LauncherPosition> position = LauncherPositionFromEnv(env, warnings);
  if (!position) return std::nullopt;
  return WorldEvidence{position->size, position->rank, std::move(position->text)};
}

std::optional<WorldEvidence> FromNccl(const TopologySummary& nccl) {
  if (!nccl.world_size || *nccl.world_size < 1) return std::nullopt;
  WorldEvidence evidence{
      *nccl.world_size, nccl.global_rank,
      "NCCL world communicator of " + std::to_string(*nccl.world_size) + " ranks"};
  if (nccl.global_rank) evidence.text += ", rank " + std::to_string(*nccl.global_rank);
  return evidence;
}

std::string Degree(const char* name, uint32_t value, const std::string& from) {
  return std::string(name) + "=" + std::to_string(value) + " (" + from + ")";
}

}  // namespace

Result<CurrentTopology> ResolveCurrentTopology(const TopologyOverride& override_spec,
                                               const TrainerDegrees& trainer,
                                               const TopologySummary& nccl, const EnvLookup& env,
                                               const Topology& source) {
  CurrentTopology current;
  const std::optional<WorldEvidence> from_nccl = FromNccl(nccl);
  const std::optional<WorldEvidence> from_launcher = FromLauncher(env, current.warnings);
  if (from_nccl && from_launcher && from_nccl->size != from_launcher->size) {
    current.warnings.push_back("NCCL says " + from_nccl->text + " but " + from_launcher->text +
                               "; using NCCL's");
  }
  const std::optional<WorldEvidence>& world = from_nccl ? from_nccl : from_launcher;

  const auto positive = [](std::optional<int> value) {
    return value && *value > 0 ? std::optional<uint32_t>(static_cast<uint32_t>(*value))
                               : std::nullopt;
  };
  const std::optional<uint32_t> tp_given = positive(override_spec.tp);
  const std::optional<uint32_t> pp_given = positive(override_spec.pp);
  const std::optional<uint32_t> dp_given = positive(override_spec.dp);
  for (const auto& [name, given, stated, stated_by] :
       {std::tuple{"tp", tp_given, trainer.tp, &trainer.tp_evidence},
        std::tuple{"pp", pp_given, trainer.pp, &trainer.pp_evidence}}) {
    if (given && stated && *given != *stated) {
      current.warnings.push_back(std::string("UCP_TOPOLOGY gives ") + name + "=" +
                                 std::to_string(*given) + " but the trainer's " + *stated_by +
                                 "; using UCP_TOPOLOGY's");
    }
  }
  const uint32_t tp = tp_given.value_or(trainer.tp.value_or(source.tp));
  const uint32_t pp = pp_given.value_or(trainer.pp.value_or(source.pp));
  const std::optional<uint64_t> model = CheckedMul<uint64_t>(tp, pp);
  if (!model || *model == 0) {
    return Status::FailedPrecondition("current topology: tp=" + std::to_string(tp) +
                                      " pp=" + std::to_string(pp) + " is not a topology");
  }

  std::vector<std::string> evidence;
  uint32_t dp = 0;
  uint64_t world_size = 0;
  if (dp_given) {
    dp = *dp_given;
    const std::optional<uint64_t> product = CheckedMul<uint64_t>(*model, dp);
    if (!product || *product > UINT32_MAX) {
      return Status::FailedPrecondition(
          "current topology: UCP_TOPOLOGY's dp=" + std::to_string(dp) + " makes a world too large");
    }
    world_size = *product;
    evidence.push_back(Degree("dp", dp, "UCP_TOPOLOGY"));
    if (world && static_cast<uint64_t>(world->size) != world_size) {
      current.warnings.push_back("UCP_TOPOLOGY gives a world of " + std::to_string(world_size) +
                                 " ranks but " + world->text + "; using UCP_TOPOLOGY's");
    }
  } else if (world) {
    world_size = static_cast<uint64_t>(world->size);
    if (world_size % *model != 0) {
      return Status::FailedPrecondition("current topology: a world of " +
                                        std::to_string(world_size) + " ranks (" + world->text +
                                        ") is not a multiple of tp·pp = " + std::to_string(*model));
    }
    dp = static_cast<uint32_t>(world_size / *model);
    evidence.push_back(world->text);
  } else {
    return Status::NotFound(
        "current topology: no evidence of the world size (no UCP_TOPOLOGY dp, no NCCL "
        "communicator, no WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_NTASKS)");
  }
  const auto from = [](bool given, const std::optional<uint32_t>& stated,
                       const std::string& stated_by) {
    return given ? std::string("UCP_TOPOLOGY") : stated ? stated_by : std::string("source");
  };
  evidence.push_back(Degree("tp", tp, from(tp_given.has_value(), trainer.tp, trainer.tp_evidence)));
  evidence.push_back(Degree("pp", pp, from(pp_given.has_value(), trainer.pp, trainer.pp_evidence)));

  current.topology.dp = dp;
  current.topology.tp = tp;
  current.topology.pp = pp;
  current.topology.world = static_cast<uint32_t>(world_size);
  current.topology.zero_stage = source.zero_stage;
  // The expert-parallel size only where something states it: 0 leaves an MoE tag's own.
  const std::optional<uint32_t> ep_given = positive(override_spec.ep);
  if (ep_given && trainer.ep && *ep_given != *trainer.ep) {
    current.warnings.push_back("UCP_TOPOLOGY gives ep=" + std::to_string(*ep_given) +
                               " but the trainer's " + trainer.ep_evidence +
                               "; using UCP_TOPOLOGY's");
  }
  if (const std::optional<uint32_t> ep = ep_given ? ep_given : trainer.ep) {
    current.topology.ep = *ep;
    evidence.push_back(
        Degree("ep", *ep, ep_given ? std::string("UCP_TOPOLOGY") : trainer.ep_evidence));
  }
  if (override_spec.partition) {
    current.topology.partition = *override_spec.partition;
    evidence.push_back("partition=" + std::string(LayerPartitionName(*override_spec.partition)) +
                       " (UCP_TOPOLOGY)");
  }
  if (world && world->rank && static_cast<uint64_t>(*world->rank) < world_size) {
    current.global_rank = world->rank;
  }
  for (size_t i = 0; i < evidence.size(); ++i) {
    current.evidence += (i == 0 ? "" : ", ") + evidence[i];
  }
  return current;
}

}  // namespace ucp::hooks
