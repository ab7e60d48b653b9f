#include "hooks/topology/current_topology.h"

#include <charconv>
#include <cstdint>
#include <string_view>
#include <tuple>
#include <utility>

#include "core/util/checked.h"

namespace ucp::hooks {
namespace {

// A launcher's pair of variables: the world size and this process's rank.
struct LauncherVariables {
  const char* size;
  const char* rank;
};

constexpr LauncherVariables kLaunchers[] = {
    {"WORLD_SIZE", "RANK"},
    {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
    {"PMI_SIZE", "PMI_RANK"},
    {"SLURM_NTASKS", "SLURM_PROCID"},
};

// A decimal integer in [minimum, INT32_MAX], the whole string.
std::optional<int> ParseInt(const char* text, int minimum) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  const std::string_view view(text);
  int value = 0;
  const auto [end, error] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (error != std::errc() || end != view.data() + view.size() || value < minimum) {
    return std::nullopt;
  }
  return value;
}

// The world size and rank one source of evidence gives, and how it says it.
struct WorldEvidence {
  int size = 0;
  std::optional<int> rank;
  std::string text;
};

// The first launcher whose size variable is set and valid. Set but invalid variables are
// reported in `warnings` and skipped.
std::optional<WorldEvidence> FromLauncher(const EnvLookup& env,
                                          std::vector<std::string>& warnings) {
  for (const LauncherVariables& launcher : kLaunchers) {
    const char* size_text = env(launcher.size);
    if (size_text == nullptr || *size_text == '\0') continue;
    const std::optional<int> size = ParseInt(size_text, 1);
    if (!size) {
      warnings.push_back(std::string(launcher.size) + "=" + size_text +
                         " is not a positive integer; ignored");
      continue;
    }
    WorldEvidence evidence{*size, std::nullopt, std::string(launcher.size) + "=" + size_text};
    if (const char* rank_text = env(launcher.rank); rank_text != nullptr && *rank_text != '\0') {
      evidence.rank = ParseInt(rank_text, 0);
      if (!evidence.rank || *evidence.rank >= *size) {
        warnings.push_back(std::string(launcher.rank) + "=" + rank_text + " is not a rank below " +
                           launcher.size + "=" + size_text + "; ignored");
        evidence.rank.reset();
      } else {
        evidence.text += std::string(" ") + launcher.rank + "=" + rank_text;
      }
    }
    evidence.text += " (launcher)";
    return evidence;
  }
  return std::nullopt;
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
  if (world && world->rank && static_cast<uint64_t>(*world->rank) < world_size) {
    current.global_rank = world->rank;
  }
  for (size_t i = 0; i < evidence.size(); ++i) {
    current.evidence += (i == 0 ? "" : ", ") + evidence[i];
  }
  return current;
}

}  // namespace ucp::hooks
