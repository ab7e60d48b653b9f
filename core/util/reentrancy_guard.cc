#include "core/util/reentrancy_guard.h"

namespace ucp {

constinit thread_local int ReentrancyGuard::depth_ __attribute__((tls_model("initial-exec"))) = 0;

}  // namespace ucp
