#include "core/io/fault_injection.h"

namespace ucp {
namespace {

// initial-exec for the same reason as ReentrancyGuard's depth: the preload is loaded at start-up.
constinit thread_local IoPhase current_phase __attribute__((tls_model("initial-exec"))) =
    IoPhase::kOther;

}  // namespace

namespace internal {
constinit std::atomic<IoFaultInjector*> g_io_fault_injector{nullptr};
}  // namespace internal

std::string_view IoPhaseName(IoPhase phase) {
  switch (phase) {
    case IoPhase::kOther:
      return "other";
    case IoPhase::kIndexBuild:
      return "index";
    case IoPhase::kAtoms:
      return "atoms";
    case IoPhase::kViewBuild:
      return "view";
    case IoPhase::kJournal:
      return "journal";
    case IoPhase::kDurableCommit:
      return "durable";
  }
  return "other";
}

std::string_view IoOpName(IoOp op) {
  switch (op) {
    case IoOp::kOpenWrite:
      return "open";
    case IoOp::kRead:
      return "read";
    case IoOp::kWrite:
      return "write";
    case IoOp::kSync:
      return "sync";
    case IoOp::kRename:
      return "rename";
    case IoOp::kLock:
      return "lock";
  }
  return "open";
}

void SetIoFaultInjector(IoFaultInjector* injector) noexcept {
  internal::g_io_fault_injector.store(injector, std::memory_order_release);
}

IoPhase CurrentIoPhase() noexcept { return current_phase; }

IoPhaseScope::IoPhaseScope(IoPhase phase) noexcept : previous_(current_phase) {
  current_phase = phase;
}

IoPhaseScope::~IoPhaseScope() { current_phase = previous_; }

}  // namespace ucp
