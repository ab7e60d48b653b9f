#include "hooks/runtime.h"

#include <chrono>
#include <cstdlib>

#include "core/frameworks/checkpoint_layout.h"
#include "core/io/file.h"
#include "core/util/log.h"
#include "hooks/events.h"
#include "hooks/save/atoms_materializer.h"
#include "hooks/save/durable_commit.h"
#include "hooks/save/index_builder.h"
#include "hooks/save/save_tracker.h"
#include "hooks/save/stack_detect.h"
#include "hooks/serve/view_server.h"
#include "hooks/topology/topology_registry.h"
#include "hooks/topology/trainer_degrees.h"

namespace ucp::hooks {
namespace {

// How long Stop() lets the index builder (and, in atoms mode, this process's share of the store)
// finish. DeepSpeed's ranks all close their files before
// save_checkpoint's final barrier, so a trainer that exits right after its last save has every
// file journaled and its build takes only the pickle parses (the hashes come from the journals):
// well under this bound. It matters when another rank died mid-save, and then the exit waits no
// longer than this. A share bigger than the bound allows is abandoned, logged: the index then
// stays without a store.
constexpr std::chrono::minutes kDrainBound{2};

// Bounds on what is read of the trainer's arguments and of the DeepSpeed config they name.
constexpr uint64_t kMaxArgumentBytes = 1 << 20;
constexpr uint64_t kMaxTrainerConfigBytes = 16 << 20;

// Created by Start() when the mode indexes, never destroyed: wrappers may run during teardown.
IndexBuilder* g_index_builder = nullptr;
// Created by Start() under UCP_DURABLE, never destroyed, for the same reason.
DurableCommit* g_durable_commit = nullptr;
// Created by Start() in atoms mode, never destroyed, for the same reason.
AtomsMaterializer* g_atoms_materializer = nullptr;

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
  UCP_LOG_INFO("hooks: starting (mode {}, {} root(s), detect {}, strict {}, durable {})",
               ModeName(config.mode), config.roots.size(),
               config.detect == Detect::kStack ? "stack" : "name", config.strict, config.durable);
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
  serve.lease.stale_after = config.lease_stale;
  serve.build_part_bytes = config.build_part_bytes;
  serve.strict = config.strict;
  // Read here, once, outside any serve: a process's arguments do not change.
  Result<TrainerDegrees> trainer = DegreesFromArguments(
      ProcessArguments(kMaxArgumentBytes),
      [](const std::string& path) { return ReadSmallFile(path, kMaxTrainerConfigBytes); });
  serve.current_topology = [topology = config.topology,
                            trainer = std::move(trainer)](const Topology& source) {
    if (!trainer.ok()) return Result<CurrentTopology>(trainer.status());
    return ResolveCurrentTopology(topology, *trainer, TopologyRegistry::Global().Summary(),
                                  &::getenv, source);
  };
  options.pending_signals = config.durable;
  ServePolicy* policy = new ViewServer(std::move(serve));
  if (config.durable) {
    // Every other listener hears of a commit once it is published.
    DurableCommitOptions durable;
    durable.layouts = options.layouts;
    durable.roots = options.roots;
    g_durable_commit = new DurableCommit(std::move(durable));
    policy = new PendingSignalServe(g_durable_commit, policy);
  }
  auto* tracker = new SaveTracker(std::move(options));
  auto listen = [tracker](CommitListener* listener) {
    if (g_durable_commit != nullptr) {
      g_durable_commit->AddDownstream(listener);
    } else {
      tracker->AddCommitListener(listener);
    }
  };
  if (g_durable_commit != nullptr) tracker->AddCommitListener(g_durable_commit);
  g_index_builder = new IndexBuilder(IndexBuilderOptions{});
  listen(g_index_builder);
  if (config.mode == Mode::kAtoms) {
    g_atoms_materializer = new AtomsMaterializer(AtomsMaterializerOptions{});
    listen(g_atoms_materializer);
  }
  SetSaveObserver(tracker);
  SetServePolicy(policy);
  if (g_durable_commit != nullptr) SetWriteRedirect(g_durable_commit);
  return Status::Ok();
}

// Journal records are appended when each file closes; what is left is the index of a save
// committed just before the exit.
void Stop() noexcept {
  UCP_LOG_INFO("hooks: stopping");
  // One bound for both: a rank's share waits for the index rank 0's builder commits.
  const auto deadline = std::chrono::steady_clock::now() + kDrainBound;
  // First the publish: the index build of a save committed just before the exit follows it.
  if (g_durable_commit != nullptr) g_durable_commit->Drain(deadline);
  if (g_index_builder != nullptr) g_index_builder->Drain(deadline);
  if (g_atoms_materializer != nullptr) g_atoms_materializer->Drain(deadline);
}

}  // namespace ucp::hooks
