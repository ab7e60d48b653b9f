#include "hooks/save/run_job.h"

#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <vector>

#include "core/tag/journal.h"
#include "core/util/launcher.h"

namespace ucp::hooks {

std::string RunJob(const TopologyRegistry& registry) {
  std::string job = LauncherJob();
  if (!job.empty()) return job;
  const std::optional<CommRecord> world = registry.World();
  if (!world || !world->unique_id_hash || !world->nranks) return job;
  // Before the job's first collective over all its ranks, the largest communicator may be a
  // group of some ranks only, whose id other groups' ranks do not share.
  std::vector<std::string> warnings;
  const std::optional<LauncherPosition> launcher =
      LauncherPositionFromEnv([](const char* name) { return std::getenv(name); }, warnings);
  if (!launcher || launcher->size != *world->nranks) return job;
  return fmt::format("nccl={:016x}", *world->unique_id_hash);
}

}  // namespace ucp::hooks
