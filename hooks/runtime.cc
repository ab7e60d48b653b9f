#include "hooks/runtime.h"

#include <cstdlib>

#include "core/util/log.h"
#include "hooks/checkpoint_layout.h"
#include "hooks/events.h"
#include "hooks/save_tracker.h"
#include "hooks/stack_detect.h"
#include "hooks/topology_registry.h"
#include "hooks/view_server.h"

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
  if (config.mode == Mode::kOff) return Status::Ok();
  SaveTrackerOptions options;
  UCP_ASSIGN_OR_RETURN(options.roots, RootSet::Create(config.roots));
  if (config.detect == Detect::kStack) {
    UCP_ASSIGN_OR_RETURN(std::unique_ptr<StackDetector> detector,
                         StackDetector::Create(config.stack_patterns));
    // Handlers are never destroyed: wrappers may still run during process teardown.
    options.writer_check = detector.release();
  }
  ViewServerOptions serve;
  serve.roots = options.roots;
  serve.cache_dir = config.cache_dir;
  serve.strict = config.strict;
  serve.current_topology = [topology = config.topology](const Topology& source) {
    return ResolveCurrentTopology(topology, TopologyRegistry::Global().Summary(), &::getenv,
                                  source);
  };
  SetSaveObserver(new SaveTracker(std::move(options)));
  SetServePolicy(new ViewServer(std::move(serve)));
  return Status::Ok();
}

// Journal records are appended when each file closes, so there is nothing left to flush.
void Stop() noexcept { UCP_LOG_INFO("hooks: stopping"); }

}  // namespace ucp::hooks
