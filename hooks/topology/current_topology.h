// The topology this process's job runs at now (DESIGN.md §5), for deciding what to serve.
//
// Order of evidence, first that answers wins:
//   1. UCP_TOPOLOGY (Config::topology): the degrees it gives; the missing ones as below.
//   2. tp and pp: the trainer's own arguments (trainer_degrees.h), else the source's.
//   3. The world: the NCCL communicators the hooks saw (TopologySummary): world size and global
//      rank from the world communicator; else the launcher's environment: WORLD_SIZE/RANK, else
//      OMPI_COMM_WORLD_SIZE/_RANK, else PMI_SIZE/PMI_RANK, else SLURM_NTASKS/SLURM_PROCID.
// dp = world / (tp · pp). No evidence of the world at all (a process no launcher started, e.g. a
// notebook loading a tag) is kNotFound: nothing says the topology changed. A world that tp · pp
// does not divide is kFailedPrecondition. Disagreements (UCP_TOPOLOGY's degrees against the
// trainer's or the world size, NCCL's world size against WORLD_SIZE) are warnings: the
// higher-ranked evidence is used.
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
#include "hooks/topology/trainer_degrees.h"

namespace ucp::hooks {

struct CurrentTopology {
  Topology topology;  // dp, tp, pp, world; zero_stage copied from the source
  std::optional<int> global_rank;
  std::string evidence;               // e.g. "WORLD_SIZE=2 (launcher), tp=1 pp=1 (source)"
  std::vector<std::string> warnings;  // contradictions, one line each
};

// Resolves the current topology against the source's (the index's topology).
[[nodiscard]] Result<CurrentTopology> ResolveCurrentTopology(const TopologyOverride& override_spec,
                                                             const TrainerDegrees& trainer,
                                                             const TopologySummary& nccl,
                                                             const EnvLookup& env,
                                                             const Topology& source);

}  // namespace ucp::hooks
