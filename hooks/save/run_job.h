// The "job" member of this process's journal records (core/tag/journal.h): what tells the files
// of this run of a job from those a killed earlier run of it left behind.
//
// Thread-safety: callable from any thread (the registry serialises its reads).
#pragma once

#include <string>

#include "hooks/topology/topology_registry.h"

namespace ucp::hooks {

// The launcher's job id (LauncherJob) where the launcher gives one. Else, under NCCL,
// "nccl=<16 hex digits>": the XXH3-64 of the unique id `registry`'s live world communicator was
// created from, which every process of one run shares (one rank draws it, ncclGetUniqueId, and the
// others receive it) and a restarted run draws anew; the id NCCL gives jobs that a launcher does
// not name (started by hand, DeepSpeed's pdsh launcher). Only a world of as many ranks as the
// launcher's environment states (WORLD_SIZE, ...: LauncherPositionFromEnv) counts. Else empty:
// no launcher id, and no such world with a unique id of its own (gloo, no collective over all
// ranks yet, no launcher size, a world made by ncclCommInitAll).
std::string RunJob(const TopologyRegistry& registry);

}  // namespace ucp::hooks
