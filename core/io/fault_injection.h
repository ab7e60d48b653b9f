// Fault injection in ucp's own I/O, for tests. Every system call core/io makes on ucp's behalf
// (File's open for writing, pread, pwrite/write, copy_file_range, fsync, RenameFile's rename and
// FileLock's flock)
// first asks the installed IoFaultInjector whether to fail it with an errno or to shorten the
// transfer. Production libucp.so installs none: the question is one atomic load and a branch.
// The test-only preload libucp_faults.so (tests/faults/) links one more file that installs an
// injector armed from the environment; nothing in libucp.so reads such a variable.
//
// Each fault names the phase of ucp that made the call: a thread-local label that the phase's
// entry point sets with an IoPhaseScope (the index builder's thread, the atoms store's thread, the
// view server's build, a journal append). Threads a phase starts inherit it explicitly (the
// executor and the hashing pool do). Adding a phase's points is one IoPhaseScope line at its entry
// point, provided its I/O goes through core/io.
//
// Thread-safety: SetIoFaultInjector may be called at any time (tests install once, before any
// I/O); the injector is called concurrently from every thread doing I/O. IoPhaseScope is
// per-thread and strictly nested.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace ucp {

// Who is doing I/O. kOther: anything no phase claimed (the CLI, unit tests, the hooks' reads).
enum class IoPhase : uint8_t {
  kOther,
  kIndexBuild,     // the index builder: reading and hashing sources, writing index.json
  kAtoms,          // the atoms store (UCP_MODE=atoms): shares, markers, the rewritten index
  kViewBuild,      // the view server: reading the index and sources, building the view cache
  kJournal,        // appending a record to a tag's journal, replacing its save generation
  kDurableCommit,  // UCP_DURABLE's fsyncs and the commit signal's temporary/rename
};
inline constexpr int kIoPhaseCount = 6;

// The kind of system call asked about.
enum class IoOp : uint8_t {
  kOpenWrite,  // open(2) of a file for writing (File::Open with a mode other than kRead)
  kRead,       // pread(2)
  kWrite,      // pwrite(2), write(2), copy_file_range(2)
  kSync,       // fsync(2)
  kRename,     // rename(2)
  kLock,       // flock(2) (FileLock)
};
inline constexpr int kIoOpCount = 6;

// "other", "index", "atoms", "view", "journal", "durable".
std::string_view IoPhaseName(IoPhase phase);
// "open", "read", "write", "sync", "rename", "lock".
std::string_view IoOpName(IoOp op);

// The answer for one call. `error` != 0: the call fails with that errno without reaching the
// kernel. Otherwise a read or write moves at most `max_bytes` (core/io raises 0 to 1, so a short
// transfer never looks like end of file).
struct IoFault {
  int error = 0;
  size_t max_bytes = std::numeric_limits<size_t>::max();
};

class IoFaultInjector {
 public:
  virtual ~IoFaultInjector() = default;
  // Called before each system call of kind `op` on `path` in `phase`; `bytes` is the transfer
  // asked for (0 for open, fsync and rename). Must not do I/O through core/io.
  virtual IoFault Decide(IoPhase phase, IoOp op, std::string_view path, size_t bytes) noexcept = 0;
};

// Installs `injector` (nullptr: none); it must outlive every later I/O call. Tests only.
void SetIoFaultInjector(IoFaultInjector* injector) noexcept;

// The calling thread's phase (kOther outside every IoPhaseScope).
IoPhase CurrentIoPhase() noexcept;

// Labels the calling thread's I/O with `phase` for the scope's life, restoring the previous label.
class IoPhaseScope {
 public:
  explicit IoPhaseScope(IoPhase phase) noexcept;
  ~IoPhaseScope();
  IoPhaseScope(const IoPhaseScope&) = delete;
  IoPhaseScope& operator=(const IoPhaseScope&) = delete;

 private:
  IoPhase previous_;
};

namespace internal {
extern std::atomic<IoFaultInjector*> g_io_fault_injector;
}  // namespace internal

// core/io's question before a system call: no fault unless an injector is installed.
inline IoFault MaybeInjectFault(IoOp op, std::string_view path, size_t bytes) noexcept {
  IoFaultInjector* injector = internal::g_io_fault_injector.load(std::memory_order_acquire);
  if (__builtin_expect(injector == nullptr, 1)) return {};
  return injector->Decide(CurrentIoPhase(), op, path, bytes);
}

}  // namespace ucp
