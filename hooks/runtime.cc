#include "hooks/runtime.h"

#include "core/util/log.h"

namespace ucp::hooks {

Status Start(const Config& config) {
  UCP_LOG_DEBUG("hooks: starting (mode {}, {} root(s), detect {})", static_cast<int>(config.mode),
                config.roots.size(), config.detect == Detect::kStack ? "stack" : "name");
  return Status::Ok();
}

void Stop() noexcept { UCP_LOG_DEBUG("hooks: stopping"); }

}  // namespace ucp::hooks
