#include "hooks/runtime.h"

#include "core/util/log.h"
#include "hooks/topology_registry.h"

namespace ucp::hooks {
namespace {

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kIndex:
      return "index";
    case Mode::kAtoms:
      return "atoms";
    case Mode::kOff:
      return "off";
  }
  return "?";
}

}  // namespace

Status Start(const Config& config) {
  UCP_LOG_INFO("hooks: starting (mode {}, {} root(s), detect {}, strict {})", ModeName(config.mode),
               config.roots.size(), config.detect == Detect::kStack ? "stack" : "name",
               config.strict);
  TopologyRegistry::Global().SetDumpPath(config.dump_topology);
  return Status::Ok();
}

void Stop() noexcept { UCP_LOG_INFO("hooks: stopping"); }

}  // namespace ucp::hooks
