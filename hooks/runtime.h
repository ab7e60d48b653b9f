// The hooks layer's lifecycle inside libucp.so.
//
// Call order: Start() once, from the preload's constructor, after logging is configured and
// before the wrappers are switched on; Stop() once, from its destructor, after the wrappers are
// switched off. Neither is called in a process where ucp is disabled. Both run inside a
// ReentrancyGuard and must not be called concurrently with each other.
#pragma once

#include "core/util/status.h"
#include "hooks/config.h"

namespace ucp::hooks {

// Installs the handlers of hooks/events.h that `config` asks for (and that exist). A non-OK
// result leaves nothing installed; the caller then runs as a pure pass-through.
[[nodiscard]] Status Start(const Config& config);

// Finishes what the installed handlers can finish (flushes journals) before the process tears
// down. Handlers stay installed (wrappers may still run) but the wrappers no longer call them.
void Stop() noexcept;

}  // namespace ucp::hooks
