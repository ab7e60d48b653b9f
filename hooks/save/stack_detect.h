// Writer attribution by call stack (UCP_DETECT=stack): is the thread that is opening a file
// inside a checkpoint serializer (e.g. torch's caffe2::serialize::PyTorchStreamWriter)?
//
// StackDetector walks the calling thread's stack with libunwind (the nongnu one, libunwind.so.8)
// and matches each frame's symbol name, mangled and demangled, against substring patterns.
// libunwind is dlopen'ed with RTLD_LOCAL on first use, never linked: linking it into the preload
// would put its _Unwind_* exports ahead of libgcc_s's in the global scope and hand every C++
// exception of the host to a different unwinder. When libunwind cannot be loaded, no stack
// matches (the file is not tracked), and that is logged once.
//
// Thread-safety: IsCheckpointWriter() may be called from any thread concurrently. The
// per-instruction-address cache is guarded by a mutex held only for lookups and inserts.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/util/status.h"

namespace ucp::hooks {

// Decides, from the calling thread's context, whether the code opening a file is a checkpoint
// writer. Called from SaveObserver::OnOpenForWrite (inside a ReentrancyGuard).
class WriterCheck {
 public:
  virtual ~WriterCheck() = default;
  virtual bool IsCheckpointWriter() = 0;
};

// The frames' symbol names of the calling thread's stack, innermost first (the caller of this
// function first), demangled where they are C++ names; at most `max_frames`. Empty when
// libunwind is unavailable. For tests and diagnostics.
std::vector<std::string> CurrentStackSymbols(int max_frames);

class StackDetector final : public WriterCheck {
 public:
  // `patterns` are substrings; a frame matches when its mangled or its demangled name contains
  // one. InvalidArgument for an empty list or an empty pattern.
  static Result<std::unique_ptr<StackDetector>> Create(std::vector<std::string> patterns);

  StackDetector(const StackDetector&) = delete;
  StackDetector& operator=(const StackDetector&) = delete;

  // True when a frame of the calling thread's stack (up to 256 deep) matches a pattern.
  bool IsCheckpointWriter() override;

 private:
  explicit StackDetector(std::vector<std::string> patterns) : patterns_(std::move(patterns)) {}
  bool NameMatches(std::string_view name) const;

  const std::vector<std::string> patterns_;
  std::mutex cache_mutex_;
  // Instruction address → whether its function matches; code addresses of loaded objects do not
  // change while they stay loaded, and checkpoint writers are not unloaded mid-run.
  std::unordered_map<uintptr_t, bool> cache_;
};

}  // namespace ucp::hooks
