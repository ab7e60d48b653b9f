// TopologyRegistry: the NCCL communicators this process has created, as the NCCL wrappers in
// interpose/nccl.cc observed them, and what they say about the job's topology (DESIGN.md §5).
//
// Thread-safety: every method may be called from any thread at any time; one internal mutex
// serialises them, and a dump is written while it is held, so the file always shows the latest
// state. Mutators are noexcept and never fail the caller: a record that cannot be stored (out of
// memory) or a dump that cannot be written is logged and dropped.
// Call order: SetDumpPath() any time (the preload sets it from UCP_DUMP_TOPOLOGY at start-up);
// then any sequence of Record*() calls, each followed by a dump when a path is set. A forked
// child never calls in (the preload passes everything through there).
//
// Identity: a communicator is named by its handle (the ncclComm_t pointer value) while it is
// alive (live or finalized); NCCL may hand the same address to a later communicator once the
// first is destroyed, so records carry a creation order, which never repeats. The end of a life is
// recorded by order (taken before the NCCL call that ends it), so an address reused by another
// thread in between cannot be mistaken for it.
//
// Dump file (UCP_DUMP_TOPOLOGY): one JSON object, replaced atomically (temporary file in the same
// directory, then rename) after every change:
//   {"version": 1, "pid": <int>,
//    "communicators": [ {"order": <int>, "handle": "0x<hex>", "origin": "init_rank" |
//        "init_rank_config" | "init_rank_scalable" | "init_all" | "split",
//        "nranks": <int>|null, "rank": <int>|null, "unique_id_hash": "<16 hex>"|null,
//        "split": {"parent": <order>, "color": <int>, "key": <int>}|null,
//        "init_all_group": <order of the first comm of its ncclCommInitAll call>|null,
//        "cuda_device": <int>|null, "state": "live"|"finalized"|"destroyed"|"aborted"}, ...],
//    "generated_unique_ids": ["<16 hex>", ...],
//    "summary": {"world": <order>|null, "world_size": <int>|null, "global_rank": <int>|null,
//        "unique_id_groups": [{"unique_id_hash": "<16 hex>", "communicators": [<order>, ...]}]}}
// Hashes are XXH3-64 of the unique id's bytes (all nId ids, in order, for the scalable init), as
// 16 lower-case hex digits, the form `xxhsum -H3` prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/util/status.h"

namespace ucp::hooks {

// How a communicator came to be.
enum class CommOrigin { kInitRank, kInitRankConfig, kInitRankScalable, kInitAll, kSplit };

// Where a communicator is in its life. kFinalized comms are still alive (ncclCommDestroy follows).
enum class CommState { kLive, kFinalized, kDestroyed, kAborted };

// "init_rank", "live", ...: the names the dump uses.
const char* CommOriginName(CommOrigin origin) noexcept;
const char* CommStateName(CommState state) noexcept;

// Where a split child came from: the parent's creation order and the split arguments.
struct SplitInfo {
  uint64_t parent_order = 0;
  int color = 0;
  int key = 0;
};

// One communicator as observed.
struct CommRecord {
  uint64_t order = 0;    // creation order in this process, from 0
  uintptr_t handle = 0;  // the ncclComm_t value
  CommOrigin origin = CommOrigin::kInitRank;
  std::optional<int> nranks;  // unknown for a split child until ResolveSplit()
  std::optional<int> rank;
  std::optional<uint64_t> unique_id_hash;  // absent for splits and ncclCommInitAll
  std::optional<SplitInfo> split;
  std::optional<uint64_t> init_all_group;  // order of the first comm of the same ncclCommInitAll
  std::optional<int> cuda_device;
  CommState state = CommState::kLive;

  bool alive() const { return state == CommState::kLive || state == CommState::kFinalized; }
};

// What the records say about the job, from the live communicators.
struct TopologySummary {
  // The world communicator: the live one with the most ranks, the first created among equals.
  std::optional<CommRecord> world;
  std::optional<int> world_size;   // world->nranks
  std::optional<int> global_rank;  // world->rank
  // Live communicators (by order) grouped by the hash of the unique id they were created from.
  std::map<uint64_t, std::vector<uint64_t>> unique_id_groups;
};

// XXH3-64 of `bytes`: the hash the registry keeps for a unique id.
uint64_t HashUniqueId(std::span<const std::byte> bytes) noexcept;

class TopologyRegistry {
 public:
  // The process-wide registry the NCCL wrappers feed. Never destroyed (wrappers may run during
  // teardown).
  static TopologyRegistry& Global() noexcept;

  TopologyRegistry() = default;
  TopologyRegistry(const TopologyRegistry&) = delete;
  TopologyRegistry& operator=(const TopologyRegistry&) = delete;

  // Sets the dump file; "%p" in `path` is replaced by the process id (one file per rank when
  // ranks share a path). An empty path turns dumping off. The file is first written at the next
  // change, so a process that never touches NCCL (a launcher) leaves no file behind.
  void SetDumpPath(const std::string& path) noexcept;

  // ncclGetUniqueId produced `unique_id` (this process is the root of some communicator).
  void RecordGeneratedUniqueId(std::span<const std::byte> unique_id) noexcept;

  // A communicator `handle` of `nranks` ranks was created with this process as `rank`, from
  // `unique_ids` (the 128-byte ncclUniqueId, or the nId ids of ncclCommInitRankScalable), by
  // `origin` (one of the init_rank kinds). A handle still alive in the registry is first marked
  // destroyed: NCCL only reuses the address of a freed communicator.
  void RecordInit(uintptr_t handle, CommOrigin origin, int nranks, int rank,
                  std::span<const std::byte> unique_ids, std::optional<int> cuda_device) noexcept;

  // ncclCommInitAll created `handles[i]` as rank i of handles.size() ranks on `devices[i]`.
  void RecordInitAll(std::span<const uintptr_t> handles, std::span<const int> devices) noexcept;

  // `child` was split from the live communicator `parent` with `color` and `key`; its size and
  // rank come later through ResolveSplit(). An unknown parent is recorded without split info.
  void RecordSplit(uintptr_t parent, int color, int key, uintptr_t child,
                   std::optional<int> cuda_device) noexcept;

  // The split child `handle` (alive) has `nranks` ranks and this process is `rank` in it.
  void ResolveSplit(uintptr_t handle, int nranks, int rank) noexcept;

  // The communicator created `order`-th was finalized (kFinalized), destroyed (kDestroyed) or
  // aborted (kAborted). Ignored when that record is not alive or was forgotten; kLive is ignored.
  void RecordEnd(uint64_t order, CommState state) noexcept;

  // All records in creation order, dead ones included (the oldest dead records are forgotten
  // beyond kMaxDeadRecords).
  std::vector<CommRecord> Communicators() const;
  // The record of the alive communicator `handle`, if any.
  std::optional<CommRecord> Find(uintptr_t handle) const;
  // The world communicator (see TopologySummary::world).
  std::optional<CommRecord> World() const;
  TopologySummary Summary() const;
  // Hashes of the unique ids ncclGetUniqueId returned here, oldest first.
  std::vector<uint64_t> GeneratedUniqueIds() const;

  // The dump document (see the file comment) of the current state.
  std::string DumpJson() const;

  // How many destroyed/aborted records are kept for the dump.
  static constexpr size_t kMaxDeadRecords = 256;
  // How many generated unique-id hashes are kept.
  static constexpr size_t kMaxGeneratedIds = 1024;

 private:
  // Caller holds mutex_.
  CommRecord* FindAliveLocked(uintptr_t handle);
  const CommRecord* FindAliveLocked(uintptr_t handle) const;
  CommRecord& AppendLocked(uintptr_t handle, CommOrigin origin);
  // Marks the alive `record` destroyed or aborted, and forgets the oldest dead record when there
  // are more than kMaxDeadRecords (which may be `record` itself: do not use it afterwards).
  void EndLifeLocked(CommRecord& record, CommState state);
  TopologySummary SummaryLocked() const;
  std::string DumpJsonLocked() const;
  void DumpLocked() noexcept;
  Status WriteDumpLocked(const std::string& json) const;

  mutable std::mutex mutex_;
  std::vector<CommRecord> records_;
  std::vector<uint64_t> generated_ids_;
  uint64_t next_order_ = 0;
  size_t dead_count_ = 0;  // records that are neither live nor finalized
  std::string dump_path_;
  bool dump_failure_logged_ = false;
};

}  // namespace ucp::hooks
