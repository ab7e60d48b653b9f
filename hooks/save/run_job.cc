#include "hooks/save/run_job.h"

#include <fmt/format.h>

#include <optional>

#include "core/tag/journal.h"

namespace ucp::hooks {

std::string RunJob(const TopologyRegistry& registry) {
  std::string job = LauncherJob();
  if (!job.empty()) return job;
  const std::optional<CommRecord> world = registry.World();
  if (!world || !world->unique_id_hash) return job;
  return fmt::format("nccl={:016x}", *world->unique_id_hash);
}

}  // namespace ucp::hooks
