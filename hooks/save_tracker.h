// SaveTracker: the SaveObserver that records checkpoint files as the trainer writes them.
//
// Thread-safety: every SaveObserver method may be called from any thread concurrently, as the
// wrappers call them. Open files live in 64 fd-sharded maps, each with its own mutex held only to
// find, insert or erase an fd; a write takes its open file's own mutex just long enough to note
// where the bytes landed, so writers of different files never contend. AddCommitListener is for
// start-up, before the tracker is installed with SetSaveObserver. Flush and Stop may be called
// from any thread except the worker's (listeners must not call them).
//
// The trainer's thread never hashes: one worker thread per tracker (started at the first tracked
// file) reads what was just written back from the page cache, through its own read-only descriptor,
// and feeds it to a streaming XXH3-64, so hashing overlaps the save instead of adding to it. The
// worker also writes the journal and tells the commit listeners, in close order: a commit is
// announced only after every file closed before it is journaled.
//
// What happens to a written file:
//   1. OnOpenForWrite: the path is recognised by a CheckpointLayout (and lies in the roots); in
//      stack mode a data file is tracked only if the WriterCheck accepts the caller. Anything
//      else returns false and is never seen again.
//   2. OnWrite/OnWriteVector: while every write lands exactly at the end of the bytes written so
//      far (write at the file position, pwrite at an explicit offset equal to it, O_APPEND), the
//      worker hashes the file's prefix [0, end) as it grows. Anything else (a seek, a gap, an
//      overlap, a write ucp cannot see) stops on-the-fly hashing for that file.
//   3. OnDup shares the open file between fds; OnClose of its last fd finishes it: the worker
//      stats the file by path, and if the streamed hash does not cover exactly its size, hashes
//      it again from disk. A data file gets a journal record in its tag's `.ucp/`; a commit
//      signal is read (on the closing thread, before the next save can rewrite it) and resolved
//      to its tag, which gets a "commit" record, and every CommitListener is told.
//   4. OnRename onto a commit signal's name (DCP's .metadata.tmp → .metadata) commits the same way.
// If the worker cannot be started, files are hashed from disk and journaled on the closing thread.
// Any internal failure (allocation, I/O, a malformed commit signal) drops that file or commit,
// logged; nothing here throws or changes what the host sees.
#pragma once

#include <sys/types.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hooks/checkpoint_layout.h"
#include "hooks/events.h"
#include "hooks/stack_detect.h"

namespace ucp::hooks {

// A tag that its framework has just declared complete.
struct CommitEvent {
  std::string framework;    // "deepspeed", "megatron", "dcp"
  std::string save_dir;     // the directory holding the tags
  std::string tag_dir;      // the committed tag's directory
  std::string tag;          // its name, e.g. "global_step5"
  std::string signal_path;  // the commit signal's path, e.g. <save_dir>/latest
};

class CommitListener {
 public:
  virtual ~CommitListener() = default;
  // Called on the tracker's worker thread (on the thread that closed or renamed the commit
  // signal when there is no worker), after the journal records of every file closed before the
  // signal, with no tracker lock held. Must not throw, nor call Flush or Stop; should return
  // quickly (hand long work to a thread: it delays the journaling of later files).
  virtual void OnCommit(const CommitEvent& event) noexcept = 0;
};

struct SaveTrackerOptions {
  const LayoutRegistry* layouts = &LayoutRegistry::Builtin();
  RootSet roots;  // UCP_ROOTS; empty = everywhere
  // UCP_DETECT=stack: consulted for data files; nullptr = by name only. Not owned; outlives the
  // tracker.
  WriterCheck* writer_check = nullptr;
};

class SaveTracker final : public SaveObserver {
 public:
  explicit SaveTracker(SaveTrackerOptions options);
  ~SaveTracker() override;
  SaveTracker(const SaveTracker&) = delete;
  SaveTracker& operator=(const SaveTracker&) = delete;

  // Adds a listener told of every commit from now on. Not owned; must outlive the tracker.
  void AddCommitListener(CommitListener* listener);

  // Returns once every file closed so far is journaled, every commit so far announced, and the
  // bytes written so far to files still open are hashed.
  void Flush() noexcept;
  // Flushes, then ends the worker (process teardown). Files still open are not journaled. Does
  // nothing in a forked child, which has no worker. The tracker keeps working afterwards, as if
  // the worker could not be started.
  void Stop() noexcept;

  bool OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) override;
  bool MayTrackFileName(std::string_view file_name) override;
  void OnWrite(int fd, int64_t offset, const void* data, size_t size) override;
  void OnWriteVector(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                     size_t size) override;
  void OnNonSequential(int fd) override;
  void OnDup(int old_fd, int new_fd) override;
  void OnClose(int fd) override;
  void OnSync(int fd) override;
  void OnRename(std::string_view from, std::string_view to) override;

 private:
  struct OpenFile;
  struct Shard {
    std::mutex mutex;
    std::unordered_map<int, std::shared_ptr<OpenFile>> files;
  };
  static constexpr size_t kShards = 64;

  Shard& ShardOf(int fd) { return shards_[static_cast<size_t>(fd) % kShards]; }
  std::shared_ptr<OpenFile> Find(int fd);
  // Maps `fd` to `file`; returns what `fd` mapped to before (a close ucp did not see).
  std::shared_ptr<OpenFile> Insert(int fd, std::shared_ptr<OpenFile> file);
  std::shared_ptr<OpenFile> Erase(int fd);
  struct PendingCommit;
  // A closed file to journal, or a commit to announce, in close order.
  struct Task {
    std::shared_ptr<OpenFile> file;         // a data file, or
    std::shared_ptr<PendingCommit> commit;  // a commit
  };

  // One fd fewer refers to `file`; finishes it when none is left.
  void Release(const std::shared_ptr<OpenFile>& file);
  // Starts the worker unless it runs or could not be started; true when it runs.
  bool EnsureWorker();
  // Hands `task` to the worker, or runs it here when there is none.
  void Submit(Task task);
  void WorkerLoop() noexcept;
  // Hashes up to a burst of `file`'s written, unhashed bytes (worker only); true if more remain.
  bool HashWritten(OpenFile& file, std::byte* buffer);
  // Whether the worker may finish `task` now (caller holds worker_mutex_).
  static bool Ready(const Task& task);
  void RunTask(const Task& task);
  // Journals a closed data file.
  void FinishData(OpenFile& file);
  // Reads and resolves a commit signal on the closing thread; null when it names no tag.
  std::shared_ptr<PendingCommit> ResolveCommit(const PathMatch& signal,
                                               const std::string& signal_path);
  // Journals and announces a resolved commit.
  void Announce(const PendingCommit& commit);

  const SaveTrackerOptions options_;
  std::array<Shard, kShards> shards_;
  std::mutex listeners_mutex_;
  std::vector<CommitListener*> listeners_;

  std::mutex worker_mutex_;
  std::condition_variable wake_;  // the worker waits for work
  std::condition_variable idle_;  // Flush waits for the worker to catch up
  std::thread worker_;
  pid_t worker_pid_ = 0;
  enum class WorkerState {
    kNotStarted,
    kRunning,
    kUnavailable
  } worker_state_ = WorkerState::kNotStarted;
  bool poked_ = false;             // new bytes or tasks since the worker last looked
  bool stopping_ = false;          // Stop: drain, then exit
  bool behind_ = false;            // the worker has bytes or tasks it has not finished
  uint64_t flush_generation_ = 0;  // bumped each time the worker finds itself caught up
  std::vector<std::shared_ptr<OpenFile>> hashing_;  // files the worker hashes as they grow
  std::deque<Task> tasks_;
};

}  // namespace ucp::hooks
