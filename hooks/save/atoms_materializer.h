// The save side of UCP_MODE=atoms: each process writes its share of the atoms store
// (core/tag/atoms_store.h) once the index of the save it took part in is committed.
//
// Thread-safety: see AtomsMaterializer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "core/tag/atoms_store.h"
#include "hooks/save/save_tracker.h"

namespace ucp::hooks {

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
