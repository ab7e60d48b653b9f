// Start-up and teardown of libucp.so, and what a fork does to it.
//
// The constructor reads the configuration, configures logging, starts hooks/ and only then
// switches the layer on; until then every wrapper is a pass-through (calls made from other
// libraries' constructors included). The destructor switches the layer off before any teardown
// I/O. A forked child passes through from the fork on (DataLoader workers never save).

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "hooks/config.h"
#include "hooks/runtime.h"
#include "interpose/dispatch.h"
#include "interpose/fd_table.h"
#include "interpose/gate.h"
#include "interpose/real.h"

namespace ucp {
namespace {

bool g_started = false;

// The one line ucp ever prints: a configuration it cannot run with.
void PrintDisabled(const Status& status) {
  const std::string line = "ucp: " + status.message() + "; ucp is disabled for this process\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = real::write()(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Keeps the fd table consistent across the fork: no thread is half-way through changing it.
void AtforkPrepare() { FdTable::Get().LockForFork(); }
void AtforkParent() { FdTable::Get().UnlockAfterFork(); }
void AtforkChild() {
  SetLayerOn(false);
  g_started = false;  // the parent's hooks state is the parent's to finish, not the child's
  FdTable::Get().UnlockAfterFork();
  FdTable::Get().Clear();
  log::ResetAfterFork();
}

__attribute__((constructor)) void StartUcp() {
  ReentrancyGuard guard;
  ErrnoPreserver keep;
  real::ResolveAll();
  Result<hooks::Config> config = hooks::ParseConfig(&::getenv);
  if (!config.ok()) {
    PrintDisabled(config.status());
    return;
  }
  if (!config->active()) return;
  log::Configure(config->log_level, config->log_dir);
  dispatch::SetStrict(config->strict);
  if (const Status started = hooks::Start(*config); !started.ok()) {
    UCP_LOG_ERROR("ucp: start-up failed, passing everything through: {}", started.ToString());
    return;
  }
  if (::pthread_atfork(&AtforkPrepare, &AtforkParent, &AtforkChild) != 0) {
    UCP_LOG_ERROR("ucp: pthread_atfork failed, passing everything through");
    hooks::Stop();
    return;
  }
  g_started = true;
  SetLayerOn(true);
  UCP_LOG_INFO("ucp {} started in pid {}", UCP_VERSION, ::getpid());
}

__attribute__((destructor)) void StopUcp() {
  if (!g_started) return;
  SetLayerOn(false);
  ReentrancyGuard guard;
  ErrnoPreserver keep;
  UCP_LOG_INFO("ucp stopping in pid {}", ::getpid());
  hooks::Stop();
  log::Shutdown();
}

}  // namespace
}  // namespace ucp

extern "C" UCP_EXPORT const char* ucp_version(void) { return UCP_VERSION; }
