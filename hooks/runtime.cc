#include "hooks/runtime.h"

#include "core/util/log.h"
#include "hooks/checkpoint_layout.h"
#include "hooks/events.h"
#include "hooks/save_tracker.h"
#include "hooks/stack_detect.h"
#include "hooks/topology_registry.h"

namespace ucp::hooks {
namespace {

// The installed tracker, stopped at teardown; never destroyed (wrappers may still run).
SaveTracker* g_tracker = nullptr;

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
  g_tracker = new SaveTracker(std::move(options));
  SetSaveObserver(g_tracker);
  return Status::Ok();
}

// The tracker's worker may still be hashing or journaling files closed just before the exit.
void Stop() noexcept {
  UCP_LOG_INFO("hooks: stopping");
  if (g_tracker != nullptr) g_tracker->Stop();
}

}  // namespace ucp::hooks
