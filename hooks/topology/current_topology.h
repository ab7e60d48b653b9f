// The topology this process's job runs at now (DESIGN.md §5), for deciding what to serve.
//
// Order of evidence, first that answers wins:
//   1. UCP_TOPOLOGY (Config::topology): the degrees it gives; the missing ones as below.
//   2. The NCCL communicators the hooks saw (TopologySummary): world size and global rank from
//      the world communicator.
//   3. The launcher's environment: WORLD_SIZE/RANK, else OMPI_COMM_WORLD_SIZE/_RANK, else
//      PMI_SIZE/PMI_RANK, else SLURM_NTASKS/SLURM_PROCID.
// tp and pp default to the source's; dp = world / (tp · pp). No evidence of the world at all (a
// process no launcher started, e.g. a notebook loading a tag) is kNotFound: nothing says the
// topology changed. A world that tp · pp does not divide is kFailedPrecondition.
// Disagreements (UCP_TOPOLOGY's dp against the world size, NCCL's world size against
// WORLD_SIZE) are warnings: the higher-ranked evidence is used.
//
// Thread-safety: a pure function of its arguments.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/util/status.h"
#include "hooks/config.h"
#include "hooks/topology/topology_registry.h"

namespace ucp::hooks {

struct CurrentTopology {
  Topology topology;  // dp, tp, pp, world; zero_stage copied from the source
  std::optional<int> global_rank;
  std::string evidence;               // e.g. "WORLD_SIZE=2 (launcher), tp=1 pp=1 (source)"
  std::vector<std::string> warnings;  // contradictions, one line each
};

// Resolves the current topology against the source's (the index's topology).
[[nodiscard]] Result<CurrentTopology> ResolveCurrentTopology(const TopologyOverride& override_spec,
                                                             const TopologySummary& nccl,
                                                             const EnvLookup& env,
                                                             const Topology& source);

}  // namespace ucp::hooks
