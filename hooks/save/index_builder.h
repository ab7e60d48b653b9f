// IndexBuilder: the save side's CommitListener. When a framework commits a tag, it builds the tag's
// universal index (<tag>/.ucp/index.json) in a background thread of the process that wrote the
// commit signal, without delaying or altering anything the trainer does.
//
// Why it waits: DeepSpeed v0.14.5's rank 0 writes `latest` right after its own files and before
// the final barrier of engine.save_checkpoint, so other ranks may still be writing theirs. The
// builder asks the tag's adapter which files a complete save holds (ExpectedFiles) and waits until
// each is recorded closed in the tag's journals by a record of this save: one whose size, inode
// and mtime equal the file's on disk now, unless the tag's save generation record says an earlier
// commit already consisted of those bytes (core/tag/save_generation.h; no clocks of different
// nodes are compared). Once they all are, it records this commit's generation. It polls up to
// options.wait, backing off from kFirstPollInterval to kLastPollInterval (each poll reads every
// rank's journal once, O(ranks), so a save of thousands of ranks that takes minutes costs a few
// hundred polls, not thousands); past that it gives up, logged, and the tag stays unindexed.
//
// Then it builds the index with the adapter (hashes come from those journal records), checks that
// no file changed meanwhile (a rank that reopened its file after the match: the build waits again),
// and commits it atomically (temporary name, fsync, rename, fsync of .ucp/). A second commit of the
// same tag while a build of it is pending or running supersedes it: the newer commit's build is the
// one that lands, so the index always describes the tag's latest save. Any index.json an earlier
// save of the tag left is removed when the build starts (it describes the bytes being replaced), so
// a build that fails or gives up (a file the adapter rejects, an I/O error, the wait) leaves no
// index and the tag exactly as the framework wrote it, logged.
//
// Threads: one worker thread, started on the first commit, holding a ReentrancyGuard for its
// whole life (its own file I/O must never be seen or served by the hooks); builds run one at a
// time, in commit order.
//
// Thread-safety: OnCommit may be called from any thread (it only queues); Drain from one thread
// at a time. Call order: Create → any OnCommit → Drain (at process exit) → destruction.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/frameworks/framework_adapter.h"
#include "core/tag/journal.h"
#include "core/tag/save_generation.h"
#include "core/util/status.h"
#include "hooks/save/save_tracker.h"

namespace ucp::hooks {

struct IndexBuilderOptions {
  // The longest a build waits for the other ranks' files.
  std::chrono::milliseconds wait{std::chrono::minutes(10)};
  // Hashing threads for files the journals do not cover (IndexOptions::threads).
  unsigned threads = 0;
};

class IndexBuilder final : public CommitListener {
 public:
  static constexpr std::chrono::milliseconds kFirstPollInterval{50};
  static constexpr std::chrono::milliseconds kLastPollInterval{1000};

  explicit IndexBuilder(IndexBuilderOptions options);
  ~IndexBuilder() override;  // stops waiting, abandons queued builds, joins the worker
  IndexBuilder(const IndexBuilder&) = delete;
  IndexBuilder& operator=(const IndexBuilder&) = delete;

  // Queues the build of event.tag_dir (frameworks without an adapter are logged and ignored).
  void OnCommit(const CommitEvent& event) noexcept override;

  // Waits until every queued build has finished or given up, or `deadline` passed (then the
  // builds still running are abandoned: their tags stay unindexed). For the preload's teardown,
  // so that a trainer that exits right after its last save still gets that save indexed.
  void Drain(std::chrono::steady_clock::time_point deadline) noexcept;

  // Builds that committed an index, for tests and logs.
  uint64_t committed() const;

 private:
  // One commit waiting for its build; `seq` orders commits.
  struct Pending {
    CommitEvent event;
    uint64_t seq = 0;
  };

  // A save whose every file is closed, and the adapter that reads it.
  struct WrittenSave {
    const FrameworkAdapter* adapter = nullptr;
    SaveFiles files;
  };

  void Run();
  // Polls until every file the tag's adapter expects is closed by this save (MatchSave); nullopt,
  // logged, when no adapter reads the tag or the build gives up, fails or is abandoned. `records`
  // holds the journal records the result points into.
  std::optional<WrittenSave> WaitForSave(const Pending& pending,
                                         std::chrono::steady_clock::time_point give_up,
                                         std::vector<JournalRecord>* records);
  // Waits for the tag's files, builds and commits the index, logging the outcome; true when it
  // committed one.
  bool Build(const Pending& pending);
  // True when `pending` must stop: a newer commit of its tag, or Drain's deadline, or teardown.
  bool Abandoned(const Pending& pending) const;  // caller holds mutex_
  // Sleeps up to `interval`; false when the build is abandoned meanwhile.
  bool PollWait(const Pending& pending, std::chrono::milliseconds interval);

  const IndexBuilderOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // queue_, busy_, stopping_ or latest_ changed
  std::deque<Pending> queue_;
  std::map<std::string, uint64_t> latest_;  // tag_dir → seq of its newest commit not yet built
  uint64_t next_seq_ = 0;
  bool busy_ = false;
  bool stopping_ = false;
  uint64_t committed_ = 0;
  std::thread worker_;
};

}  // namespace ucp::hooks
