// The gate every wrapper passes first, and errno preservation.
//
// InterceptGate() is true only while the layer is switched on (after the constructor finished
// starting ucp, before the destructor begins, never in a forked child, never when ucp is
// disabled) and the calling thread is not already inside ucp (no ReentrancyGuard alive). When it
// is false, a wrapper is a pure pass-through to ucp::real.
//
// Thread-safety: InterceptGate() and ErrnoPreserver may be used anywhere, at any time.
// SetLayerOn() is called by the lifecycle code only (constructor, destructor, atfork child).
#pragma once

#include <errno.h>

#include <atomic>

#include "core/util/reentrancy_guard.h"

// Marks an extern "C" wrapper as exported (everything else in libucp.so is hidden, and the
// version script interpose/exports.map has the final word).
#define UCP_EXPORT __attribute__((visibility("default")))

namespace ucp {

namespace internal {
extern std::atomic<bool> g_layer_on;
}  // namespace internal

// The one switch of the layer.
void SetLayerOn(bool on) noexcept;

inline bool InterceptGate() noexcept {
  return internal::g_layer_on.load(std::memory_order_relaxed) && !ReentrancyGuard::Active();
}

// Saves errno on construction and restores it on destruction: constructed right after a real
// call, it hands the host exactly the errno that call set, whatever ucp does afterwards.
class ErrnoPreserver {
 public:
  ErrnoPreserver() noexcept : saved_(errno) {}
  ~ErrnoPreserver() { errno = saved_; }
  ErrnoPreserver(const ErrnoPreserver&) = delete;
  ErrnoPreserver& operator=(const ErrnoPreserver&) = delete;

 private:
  const int saved_;
};

}  // namespace ucp
