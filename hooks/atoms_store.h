// The atoms store of UCP_MODE=atoms: every atom of a tag written whole, split across the ranks
// that saved it, recorded in the tag's index once complete (atom_index.h, "store"), so that the
// tag can be served after its framework files are gone.
//
// Layout (normative; README "Atoms store"), under <tag>/.ucp/atoms/:
//   <state>/                      for each atom state, in the index's atom order: exactly what
//                                 `ucp export --format safetensors --state <state>
//                                 --max-shard-size <max_shard_bytes>` writes (export_plan.h)
//   carried.<name>                a byte copy of each framework file <name> that a carried
//                                 entry names (the prefix on the last component, as view_cache.h
//                                 puts "served.": tools that collect a tag's files by name prefix
//                                 through the whole tree must not take it for one of the tag's)
//   done.<rank>-of-<world>.json   {"index_xxh3": "<16 hex>", "files": [{"path": <relative to
//                                 the store>, "size": N, "xxh3": "<16 hex>"}, ...]}: that rank
//                                 has written its share for the index.json with that hash
// and <tag>/.ucp/index.lock, flock(2)ed while index.json is replaced (by IndexBuilder too).
// max_shard_bytes is the store's total bytes over the world size, clamped to [16 MiB, 4 GiB].
// The work is a list of units, one per output file (each state's shards, then its
// model.safetensors.index.json, then the copies); unit i is rank (i mod world)'s, ranks numbered
// dp + dp_size × (tp + tp_size × pp). Every unit is written under a temporary name and renamed.
// The rank that finds every done marker of the current index.json rewrites index.json with the
// store (consolidated offsets read back from the safetensors headers) and removes the markers.
//
// Thread-safety: the free functions may be called from any thread; concurrent callers for one tag
// are serialised by the index lock where they touch index.json.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"
#include "hooks/save_tracker.h"

namespace ucp::hooks {

// Where the store lives, relative to the tag directory.
inline constexpr std::string_view kStoreDirectory = ".ucp/atoms";

// "<tag_dir>/.ucp/index.lock".
std::string IndexLockPath(const std::string& tag_dir);

// One output file of the store: `plan` writes exactly it, at `path` relative to the store.
struct StoreUnit {
  std::string path;
  OutputPlan plan;
};

struct StorePlan {
  uint64_t max_shard_bytes = 0;
  std::vector<StoreUnit> units;
};

// The store of `index`. kUnsupported when a state is no directory name or a dtype has no
// safetensors name; kFailedPrecondition for an index that already has a store.
[[nodiscard]] Result<StorePlan> PlanStore(const AtomIndex& index);

// Writes rank `rank`'s units of PlanStore(index) under <tag_dir>/.ucp/atoms, then its done
// marker. `index_xxh3` is the XXH3 of the index.json bytes `index` was parsed from.
[[nodiscard]] Status WriteStoreShare(const AtomIndex& index, uint64_t index_xxh3,
                                     const std::string& tag_dir, uint32_t rank,
                                     const ExecuteOptions& options);

// Under the index lock: when index.json still hashes to `index_xxh3` and every rank's done marker
// for it is there, rewrites index.json atomically with the store recorded and removes the
// markers; true when this call did so. False when a share is missing (its rank will finish the
// store) or index.json changed (a newer save: its own shares make its store).
[[nodiscard]] Result<bool> FinalizeStore(const std::string& tag_dir, uint64_t index_xxh3);

// The index to plan with for the tag as it is on disk now: nullopt (plan with `index` itself)
// while every framework file it lists is there with its size; else index.OverStore() when the
// index has a store whose files are all there with their sizes; else kFailedPrecondition naming
// the first file missing or changed. Hashes are not checked here (ViewCache and `ucp verify` do).
[[nodiscard]] Result<std::optional<AtomIndex>> ReadableSources(const AtomIndex& index,
                                                               const std::string& tag_dir);

struct AtomsMaterializerOptions {
  // The longest a tag waits for the index that covers this process's files.
  std::chrono::milliseconds wait{std::chrono::minutes(10)};
  std::chrono::milliseconds poll{100};
  // Once Drain is called, how much longer a tag still waiting for its index may wait: the index
  // of a save that finished lands within a second, and a job whose index never comes (its build
  // failed, or the framework has no adapter) must not hold the process's exit to Drain's deadline.
  std::chrono::milliseconds wait_at_exit{std::chrono::seconds(30)};
  // Executor threads for this process's share: a background job beside the training.
  unsigned threads = 1;
};

// The save side of UCP_MODE=atoms, one per process. Every rank learns of a commit the same way,
// whichever rank wrote the commit signal: when a data file it saved is journaled, its tag gets a
// job that waits (polling, up to options.wait, then a logged give-up) for a committed
// index.json listing every file this process saved in that tag with the size and XXH3 it wrote;
// then the process writes its share (WriteStoreShare, its rank told by its files' coordinates in
// the index) and tries FinalizeStore. A later save of the same tag restarts the tag's job.
//
// Threads: one worker, started with the object, holding a ReentrancyGuard for its whole life.
// Thread-safety: OnFileSaved from any thread (it only queues); Drain from one thread at a time.
// Call order: construction → any OnFileSaved → Drain (at process exit) → destruction.
class AtomsMaterializer final : public CommitListener {
 public:
  explicit AtomsMaterializer(AtomsMaterializerOptions options);
  ~AtomsMaterializer() override;  // abandons waiting jobs, joins the worker
  AtomsMaterializer(const AtomsMaterializer&) = delete;
  AtomsMaterializer& operator=(const AtomsMaterializer&) = delete;

  // Nothing: every rank waits for the index instead (only one rank writes the signal).
  void OnCommit(const CommitEvent& event) noexcept override;
  void OnFileSaved(const SavedFileEvent& event) noexcept override;

  // Waits until every job has finished or given up, or `deadline` passed (then they are
  // abandoned: their stores stay incomplete, and their indexes without a store). A job still
  // waiting for its index gives up options.wait_at_exit after the call.
  void Drain(std::chrono::steady_clock::time_point deadline) noexcept;

  // Shares this process wrote, for tests and logs.
  uint64_t shares_written() const;

 private:
  struct Digest {
    uint64_t size = 0;
    uint64_t xxh3 = 0;
  };
  struct Job {
    std::map<std::string, Digest> saved;  // this process's files of the tag, relative to it
    std::chrono::steady_clock::time_point give_up;
    uint64_t generation = 0;  // bumped by every OnFileSaved, so a running attempt sees changes
  };
  enum class Outcome { kWaiting, kDone };

  void Run();
  Outcome Attempt(const std::string& tag_dir, const Job& job);

  const AtomsMaterializerOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // jobs_, busy_ or stopping_ changed
  std::map<std::string, Job> jobs_;
  bool busy_ = false;
  bool stopping_ = false;
  std::optional<std::chrono::steady_clock::time_point> draining_;  // when Drain was called
  uint64_t shares_written_ = 0;
  std::thread worker_;
};

}  // namespace ucp::hooks
