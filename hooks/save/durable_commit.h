// DurableCommit (UCP_DURABLE=1): a commit signal becomes visible only once its tag is complete
// on every rank and durable, so that a crash at any moment leaves the signal naming a complete
// tag.
//
// What it does, in each process of the job:
//   1. Durability (every rank): each data file the SaveTracker journals (OnFileSaved) is queued;
//      a background thread fsyncs it, then its directories up to the save directory (the tag's
//      entry included), then appends a copy of the file's close record with "durable": true to
//      this process's journal (journal.h).
//   2. Holding the signal back (the rank that writes it): a truncating write-open of a commit
//      signal whose content names the tag (DeepSpeed's <save>/latest, Megatron's
//      latest_checkpointed_iteration.txt) is redirected to a pending name in the same directory,
//      PendingSignalPath(). The write, its close and the tracker's commit run on that file; the
//      signal keeps its previous content meanwhile. A read-open or stat of the signal by this
//      process sees the pending file instead (PendingSignalServe), as if the write had landed.
//   3. Publishing: on the commit (OnCommit, with written_path the pending name) the background
//      thread waits until the tag's journals show every file of the adapter's ExpectedFiles
//      closed by this save (the IndexBuilder's rule, MatchSave in core/tag/save_generation.h: a
//      close whose size, inode and mtime are the file's on disk now, and not bytes an earlier
//      commit of the tag consisted of) and durable (a "durable" copy of that very
//      record). Then it fsyncs the pending file, renames it onto the signal and fsyncs the
//      directory, and only then tells the downstream listeners (the IndexBuilder, the
//      AtomsMaterializer) of the commit. A tag no adapter recognises (or one its adapter refuses)
//      is published once every data file its journals show for this save is durable: ranks that
//      never closed a file cannot be waited for then.
//   The first commit of a signal in a process removes the pending files of that signal left by
//   processes no longer alive on this host (killed before their publish).
//   A newer commit of the same signal that completes first supersedes the older ones (their
//   pending files are removed): the signal never moves backwards. A commit that does not complete
//   within options.wait (a rank died) is never published: its pending file is removed, logged.
//   Signals committed by a rename (DCP's .metadata) are not held back; their data files are still
//   made durable, and the commit is passed downstream at once.
//
// Once a commit is complete it records the tag's save generation (which bytes the save consisted
// of), so that a later save of the same tag does not count files its ranks have not rewritten yet.
// Files a killed run closed but never committed count only when another node journaled them
// (SaveBounds: this host's records before this process started are an earlier run's). No clocks
// of different nodes are compared.
//
// Threads: one worker, started on first use, holding a ReentrancyGuard for its whole life. The
// host's threads only queue (OnFileSaved, OnCommit) or look up a map (Redirect, PendingFor).
//
// Thread-safety: every method may be called from any thread; AddDownstream only before the
// tracker is installed. Call order: construction → AddDownstream → any other call → Drain (at
// process exit) → destruction.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/frameworks/checkpoint_layout.h"
#include "core/tag/journal.h"
#include "core/tag/save_generation.h"
#include "hooks/events.h"
#include "hooks/save/save_tracker.h"

namespace ucp::hooks {

// "<dir>/.<name>.ucp-pending-<pid>-<n>": where the redirected write of commit signal <dir>/<name>
// lands. `signal_path` is absolute.
std::string PendingSignalPath(std::string_view signal_path, int64_t pid, uint64_t n);
// The commit signal whose pending name is `path` ("<dir>/<name>"), or nullopt for any other path.
std::optional<std::string> SignalOfPendingPath(std::string_view path);
// True when `file_name` (no '/') has the form of a pending name.
bool IsPendingSignalName(std::string_view file_name);

// The files of a save that are not closed by it and durable: `save.missing`, then each matched
// close without a "durable" copy of that very record (same path, pid, time_ns, size, xxh3) among
// `records`.
std::vector<std::string> NotYetDurable(const std::vector<JournalRecord>& records,
                                       const SaveFiles& save);

struct DurableCommitOptions {
  const LayoutRegistry* layouts = &LayoutRegistry::Builtin();
  RootSet roots;  // UCP_ROOTS
  // The longest a commit waits for the other ranks before it is dropped, unpublished.
  std::chrono::milliseconds wait{std::chrono::minutes(10)};
};

class DurableCommit final : public CommitListener, public WriteRedirect {
 public:
  // While a publish waits for other ranks' files: polls of the journals, backing off while this
  // process closes nothing new.
  static constexpr std::chrono::milliseconds kFirstPollInterval{20};
  static constexpr std::chrono::milliseconds kLastPollInterval{1000};

  explicit DurableCommit(DurableCommitOptions options);
  ~DurableCommit() override;  // stops waiting (pending files stay), joins the worker
  DurableCommit(const DurableCommit&) = delete;
  DurableCommit& operator=(const DurableCommit&) = delete;

  // A listener told of each commit once it is published (or at once, for a commit that was not
  // held back), and of every saved file at once. Not owned; must outlive this.
  void AddDownstream(CommitListener* listener);

  // CommitListener (from the SaveTracker): both only queue.
  void OnFileSaved(const SavedFileEvent& event) noexcept override;
  void OnCommit(const CommitEvent& event) noexcept override;

  // WriteRedirect: a commit signal named by its content, in the roots, goes to a fresh pending
  // name; everything else is nullopt.
  bool MayRedirectPath(std::string_view path) override;
  std::optional<std::string> Redirect(std::string_view path) override;
  void RedirectFailed(std::string_view path, std::string_view redirected) override;

  // The newest pending file of commit signal `path` not yet published or dropped, or nullopt.
  std::optional<std::string> PendingFor(std::string_view path) const;
  // False promises PendingFor(path) is nullopt (cheap: `path` as the host spelled it, or a file
  // name).
  bool MayHavePending(std::string_view path) const;

  // Waits until every queued fsync and publish is done, or `deadline` passed; then the commits
  // still waiting are dropped (their pending files removed, logged): at process exit a tag that
  // did not complete in time is not published.
  void Drain(std::chrono::steady_clock::time_point deadline) noexcept;

  // Commits published so far, for tests and logs.
  uint64_t published() const;

 private:
  struct Publish {
    CommitEvent event;
    std::chrono::steady_clock::time_point committed;  // at OnCommit
    std::chrono::steady_clock::time_point give_up;
  };

  void Run();
  void StartWorker();  // caller holds mutex_
  // fsyncs the files and their directories, then journals them durable.
  void MakeDurable(const std::vector<SavedFileEvent>& files);
  // Publishes the newest complete commit of each signal, drops the expired ones. True when some
  // commit still waits.
  bool PublishReady();
  // Whether `publish` is complete and durable (then recording the tag's save generation);
  // `waiting` says what is missing when not.
  bool Complete(const Publish& publish, std::string* waiting) const;
  // Removes the pending files of `signal_path` that processes no longer alive on this host left
  // (a SIGKILL between the write of the signal and its publish).
  void SweepStale(const std::string& signal_path) const;
  // Renames the pending file onto the signal, durably. False (logged) on failure.
  bool Rename(const Publish& publish) const;
  // Forgets pending file `pending` of `signal_path` (caller holds mutex_).
  void ForgetPending(const std::string& signal_path, const std::string& pending);
  void Downstream(const CommitEvent& event);

  const DurableCommitOptions options_;
  const int64_t pid_;
  std::vector<CommitListener*> downstream_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;  // queue_, publishes_, busy_ or stopping_ changed
  std::deque<SavedFileEvent> queue_;
  std::map<std::string, std::vector<Publish>> publishes_;  // signal path → commits, oldest first
  std::map<std::string, std::vector<std::string>> pending_;  // signal path → pending files
  std::set<std::string> swept_;           // signal paths whose stale pending files were removed
  std::atomic<size_t> pending_files_{0};  // the entries of pending_, read without mutex_
  uint64_t next_pending_ = 0;
  uint64_t published_ = 0;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

// The ServePolicy under UCP_DURABLE: a read of a commit signal held back by `durable` sees its
// pending file; everything else is `inner`'s decision. Neither is owned.
class PendingSignalServe final : public ServePolicy {
 public:
  PendingSignalServe(const DurableCommit* durable, ServePolicy* inner)
      : durable_(durable), inner_(inner) {}

  ServeDecision Resolve(std::string_view path) override;
  ServeDecision ResolveMetadata(std::string_view path) override;
  bool MayServePath(std::string_view path) override;
  std::optional<ListingChange> ChangeListing(std::string_view dir) override;

 private:
  const DurableCommit* durable_;
  ServePolicy* inner_;
};

}  // namespace ucp::hooks
