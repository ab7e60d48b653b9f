// NCCL wrappers: communicator creation and teardown, reported to the topology registry.
//
// Each wrapper forwards to the next definition of its name, returns that result unchanged, and
// on success (or ncclInProgress, a non-blocking call that created its communicator) tells
// dispatch what was created or ended. NCCL is never linked: the next definition is resolved at
// the first call (a host may dlopen NCCL late), in this order, skipping anything inside
// libucp.so: dlsym(RTLD_NEXT, "ncclX"), dlsym(RTLD_NEXT, "pncclX"), dlsym(RTLD_DEFAULT, "pncclX"),
// then "ncclX"/"pncclX" in an already loaded libnccl.so.2 (a host that dlopened NCCL with
// RTLD_LOCAL still calls our global definitions). A successful resolution is cached; a failed
// one is retried at the next call.
//
// No NCCL loaded at all: a host that links NCCL cannot get here without it, so only a host that
// found our exported name by dlsym(RTLD_DEFAULT) can. It gets ncclSystemError (the result NCCL
// gives when a system library or call is unavailable), its outputs untouched, errno unchanged.
//
// ncclGroupStart/ncclGroupEnd are wrapped only to know whether a split happened inside a group:
// the child of a split is not ready, and its size and rank cannot be asked, until the outermost
// ncclGroupEnd returned ncclSuccess. Children of non-blocking splits (ncclInProgress) are not
// asked at all: their size and rank stay unknown in the registry.
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/util/log.h"
#include "core/util/reentrancy_guard.h"
#include "interpose/dispatch.h"
#include "interpose/gate.h"
#include "interpose/nccl_abi.h"

namespace ucp {
namespace {

constexpr ncclResult_t kNcclNotLoaded = ncclSystemError;

// The load address of libucp.so, to refuse resolving a name to our own wrapper.
void* OwnBase() noexcept {
  static void* const base = [] {
    Dl_info info{};
    return ::dladdr(reinterpret_cast<void*>(&OwnBase), &info) != 0 ? info.dli_fbase : nullptr;
  }();
  return base;
}

bool Foreign(void* fn) noexcept {
  if (fn == nullptr) return false;
  Dl_info info{};
  return ::dladdr(fn, &info) == 0 || info.dli_fbase != OwnBase();
}

void* FindNext(const char* name, const char* pname) noexcept {
  for (void* fn :
       {::dlsym(RTLD_NEXT, name), ::dlsym(RTLD_NEXT, pname), ::dlsym(RTLD_DEFAULT, pname)}) {
    if (Foreign(fn)) return fn;
  }
  void* nccl = ::dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
  if (nccl == nullptr) return nullptr;
  void* found = nullptr;
  for (const char* symbol : {name, pname}) {
    void* fn = ::dlsym(nccl, symbol);
    if (Foreign(fn)) {
      found = fn;
      break;
    }
  }
  // Drops only the reference RTLD_NOLOAD added; the host's keeps the library mapped.
  ::dlclose(nccl);
  return found;
}

// The next definition of one NCCL entry point, typed as `Fn` and cached once found.
template <typename Fn>
class NcclNext {
 public:
  constexpr NcclNext(const char* name, const char* pname) : name_(name), pname_(pname) {}

  // nullptr when no NCCL is loaded (yet). Keeps errno.
  Fn Get() noexcept {
    void* fn = slot_.load(std::memory_order_acquire);
    if (__builtin_expect(fn == nullptr, 0)) fn = Resolve();
    return reinterpret_cast<Fn>(fn);
  }

 private:
  void* Resolve() noexcept {
    ReentrancyGuard guard;
    ErrnoPreserver keep;
    void* fn = FindNext(name_, pname_);
    if (fn != nullptr) {
      slot_.store(fn, std::memory_order_release);
    } else {
      UCP_LOG_WARN("nccl: {} called but no NCCL is loaded; returning ncclSystemError", name_);
    }
    return fn;
  }

  const char* const name_;
  const char* const pname_;
  std::atomic<void*> slot_{nullptr};
};

#define UCP_NCCL_NEXT(name) constinit NcclNext<decltype(&::name)> next_##name(#name, "p" #name)
UCP_NCCL_NEXT(ncclGetUniqueId);
UCP_NCCL_NEXT(ncclCommInitRank);
UCP_NCCL_NEXT(ncclCommInitRankConfig);
UCP_NCCL_NEXT(ncclCommInitAll);
UCP_NCCL_NEXT(ncclCommInitRankScalable);
UCP_NCCL_NEXT(ncclCommSplit);
UCP_NCCL_NEXT(ncclCommFinalize);
UCP_NCCL_NEXT(ncclCommDestroy);
UCP_NCCL_NEXT(ncclCommAbort);
UCP_NCCL_NEXT(ncclCommCount);
UCP_NCCL_NEXT(ncclCommUserRank);
UCP_NCCL_NEXT(ncclGroupStart);
UCP_NCCL_NEXT(ncclGroupEnd);
#undef UCP_NCCL_NEXT

// ncclGroupStart depth of this thread (NCCL's own is thread-local too), and the split children
// created inside the current group, asked for their size and rank when it ends. A fixed array:
// thread-local storage of a preload must not need a destructor; children beyond it stay unknown.
constexpr int kMaxPendingSplits = 64;
thread_local int t_group_depth __attribute__((tls_model("initial-exec"))) = 0;
thread_local int t_pending_count __attribute__((tls_model("initial-exec"))) = 0;
thread_local ncclComm_t t_pending[kMaxPendingSplits] __attribute__((tls_model("initial-exec")));

bool Created(ncclResult_t result) { return result == ncclSuccess || result == ncclInProgress; }

uintptr_t Handle(ncclComm_t comm) { return reinterpret_cast<uintptr_t>(comm); }

// Asks NCCL for the size and rank of a ready split child. Caller holds a guard and keeps errno.
void ResolveSplit(ncclComm_t child) noexcept {
  auto count = next_ncclCommCount.Get();
  auto user_rank = next_ncclCommUserRank.Get();
  if (count == nullptr || user_rank == nullptr) return;
  int nranks = 0;
  int rank = 0;
  if (count(child, &nranks) != ncclSuccess || user_rank(child, &rank) != ncclSuccess) return;
  dispatch::OnNcclSplitResolved(Handle(child), nranks, rank);
}

// Finalize, destroy, abort: the creation order of `comm` is read before the call (once NCCL
// freed it, its address may already belong to another thread's new communicator), the end is
// reported after it.
template <typename Fn>
ncclResult_t EndLife(Fn next, ncclComm_t comm, hooks::CommState state) {
  if (!InterceptGate()) return next(comm);
  ReentrancyGuard guard;
  std::optional<uint64_t> order;
  {
    ErrnoPreserver keep;
    order = dispatch::NcclCommOrder(Handle(comm));
  }
  const ncclResult_t result = next(comm);
  ErrnoPreserver keep;
  if (order && Created(result)) dispatch::OnNcclEnd(*order, state);
  return result;
}

}  // namespace
}  // namespace ucp

using ucp::ErrnoPreserver;
using ucp::InterceptGate;
using ucp::ReentrancyGuard;
namespace dispatch = ucp::dispatch;

extern "C" UCP_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  const auto next = ucp::next_ncclGetUniqueId.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(uniqueId);
  ReentrancyGuard guard;
  const ncclResult_t result = next(uniqueId);
  ErrnoPreserver keep;
  if (result == ncclSuccess && uniqueId != nullptr) {
    dispatch::OnNcclUniqueId(uniqueId, sizeof(*uniqueId));
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks,
                                                    ncclUniqueId commId, int rank) {
  const auto next = ucp::next_ncclCommInitRank.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(comm, nranks, commId, rank);
  ReentrancyGuard guard;
  const ncclResult_t result = next(comm, nranks, commId, rank);
  ErrnoPreserver keep;
  if (ucp::Created(result) && comm != nullptr && *comm != nullptr) {
    dispatch::OnNcclInit(ucp::Handle(*comm), ucp::hooks::CommOrigin::kInitRank, nranks, rank,
                         &commId, sizeof(commId));
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks,
                                                          ncclUniqueId commId, int rank,
                                                          ncclConfig_t* config) {
  const auto next = ucp::next_ncclCommInitRankConfig.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(comm, nranks, commId, rank, config);
  ReentrancyGuard guard;
  const ncclResult_t result = next(comm, nranks, commId, rank, config);
  ErrnoPreserver keep;
  if (ucp::Created(result) && comm != nullptr && *comm != nullptr) {
    dispatch::OnNcclInit(ucp::Handle(*comm), ucp::hooks::CommOrigin::kInitRankConfig, nranks, rank,
                         &commId, sizeof(commId));
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  const auto next = ucp::next_ncclCommInitAll.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(comm, ndev, devlist);
  ReentrancyGuard guard;
  const ncclResult_t result = next(comm, ndev, devlist);
  ErrnoPreserver keep;
  if (ucp::Created(result) && comm != nullptr && ndev > 0) {
    // ncclComm_t and uintptr_t have the same size and representation on every NCCL platform.
    static_assert(sizeof(ncclComm_t) == sizeof(uintptr_t));
    dispatch::OnNcclInitAll(reinterpret_cast<const uintptr_t*>(comm), ndev, devlist);
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks,
                                                            int myrank, int nId,
                                                            ncclUniqueId* commIds,
                                                            ncclConfig_t* config) {
  const auto next = ucp::next_ncclCommInitRankScalable.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(newcomm, nranks, myrank, nId, commIds, config);
  ReentrancyGuard guard;
  const ncclResult_t result = next(newcomm, nranks, myrank, nId, commIds, config);
  ErrnoPreserver keep;
  if (ucp::Created(result) && newcomm != nullptr && *newcomm != nullptr && commIds != nullptr &&
      nId > 0) {
    dispatch::OnNcclInit(ucp::Handle(*newcomm), ucp::hooks::CommOrigin::kInitRankScalable, nranks,
                         myrank, commIds, static_cast<size_t>(nId) * sizeof(ncclUniqueId));
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key,
                                                 ncclComm_t* newcomm, ncclConfig_t* config) {
  const auto next = ucp::next_ncclCommSplit.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  if (!InterceptGate()) return next(comm, color, key, newcomm, config);
  ReentrancyGuard guard;
  const ncclResult_t result = next(comm, color, key, newcomm, config);
  ErrnoPreserver keep;
  if (!ucp::Created(result) || newcomm == nullptr || *newcomm == nullptr) return result;
  dispatch::OnNcclSplit(ucp::Handle(comm), color, key, ucp::Handle(*newcomm));
  if (result != ncclSuccess) return result;
  if (ucp::t_group_depth == 0) {
    ucp::ResolveSplit(*newcomm);
  } else if (ucp::t_pending_count < ucp::kMaxPendingSplits) {
    ucp::t_pending[ucp::t_pending_count++] = *newcomm;
  }
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  const auto next = ucp::next_ncclCommFinalize.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  return ucp::EndLife(next, comm, ucp::hooks::CommState::kFinalized);
}

extern "C" UCP_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const auto next = ucp::next_ncclCommDestroy.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  return ucp::EndLife(next, comm, ucp::hooks::CommState::kDestroyed);
}

extern "C" UCP_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  const auto next = ucp::next_ncclCommAbort.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  return ucp::EndLife(next, comm, ucp::hooks::CommState::kAborted);
}

extern "C" UCP_EXPORT ncclResult_t ncclGroupStart() {
  const auto next = ucp::next_ncclGroupStart.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  const ncclResult_t result = next();
  if (result == ncclSuccess) ++ucp::t_group_depth;
  return result;
}

extern "C" UCP_EXPORT ncclResult_t ncclGroupEnd() {
  const auto next = ucp::next_ncclGroupEnd.Get();
  if (next == nullptr) return ucp::kNcclNotLoaded;
  const ncclResult_t result = next();
  // NCCL leaves the group whatever the result, as long as it was in one.
  if (ucp::t_group_depth == 0 || --ucp::t_group_depth > 0) return result;
  const int pending = ucp::t_pending_count;
  ucp::t_pending_count = 0;
  if (result != ncclSuccess || pending == 0 || !InterceptGate()) return result;
  ReentrancyGuard guard;
  ErrnoPreserver keep;
  for (int i = 0; i < pending; ++i) ucp::ResolveSplit(ucp::t_pending[i]);
  return result;
}
