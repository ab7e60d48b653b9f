// ReentrancyGuard: marks the current thread as running ucp's own code.
//
// While any guard is alive on a thread, every interposed libc wrapper on that thread is a pure
// pass-through (InterceptGate() is false). That is what lets ucp's internals, spdlog's file sink
// and the codecs use plain libc calls without recursing into the hooks. It lives in core/ only
// because every layer must be able to enter it; it knows nothing about interposition.
//
// Thread-safety: the depth is thread-local; guards are strictly nested (RAII).
#pragma once

namespace ucp {

class ReentrancyGuard {
 public:
  ReentrancyGuard() noexcept { ++depth_; }
  ~ReentrancyGuard() { --depth_; }
  ReentrancyGuard(const ReentrancyGuard&) = delete;
  ReentrancyGuard& operator=(const ReentrancyGuard&) = delete;

  // True when this thread is already inside ucp.
  static bool Active() noexcept { return depth_ > 0; }

 private:
  // initial-exec: the preload is loaded at start-up, and the default TLS model would route
  // every access through __tls_get_addr on the hot path of every hooked call. constinit tells
  // other translation units there is no dynamic initializer, so they skip the TLS wrapper call.
  static constinit thread_local int depth_ __attribute__((tls_model("initial-exec")));
};

}  // namespace ucp
