#include "hooks/runtime.h"

#include <chrono>

#include "core/util/log.h"
#include "hooks/checkpoint_layout.h"
#include "hooks/events.h"
#include "hooks/index_builder.h"
#include "hooks/save_tracker.h"
#include "hooks/stack_detect.h"
#include "hooks/topology_registry.h"

namespace ucp::hooks {
namespace {

// How long Stop() lets the index builder finish. DeepSpeed's ranks all close their files before
// save_checkpoint's final barrier, so a trainer that exits right after its last save has every
// file journaled and its build takes only the pickle parses (the hashes come from the journals):
// well under this bound. It matters when another rank died mid-save, and then the exit waits no
// longer than this.
constexpr std::chrono::minutes kDrainBound{2};

// Created by Start() when the mode indexes, never destroyed: wrappers may run during teardown.
IndexBuilder* g_index_builder = nullptr;

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
  auto* tracker = new SaveTracker(std::move(options));
  g_index_builder = new IndexBuilder(IndexBuilderOptions{});
  tracker->AddCommitListener(g_index_builder);
  SetSaveObserver(tracker);
  return Status::Ok();
}

// Journal records are appended when each file closes; what is left is the index of a save
// committed just before the exit.
void Stop() noexcept {
  UCP_LOG_INFO("hooks: stopping");
  if (g_index_builder != nullptr) {
    g_index_builder->Drain(std::chrono::steady_clock::now() + kDrainBound);
  }
}

}  // namespace ucp::hooks
