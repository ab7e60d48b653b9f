// SaveTracker: the SaveObserver that records checkpoint files as the trainer writes them.
//
// Thread-safety: every SaveObserver method may be called from any thread concurrently, as the
// wrappers call them. Open files live in 64 fd-sharded maps, each with its own mutex held only to
// find, insert or erase an fd, so threads writing different files never contend. Hashing,
// journaling and commit notification run on one worker thread per tracker, in the order the
// closes happened. AddCommitListener is for start-up, before the tracker is installed with
// SetSaveObserver; Flush may be called from any thread.
//
// What happens to a written file:
//   1. OnOpenForWrite: the path is recognised by a CheckpointLayout (and lies in the roots); in
//      stack mode a data file is tracked only if the WriterCheck accepts the caller. Anything
//      else returns false and is never seen again.
//   2. Writes, seeks and syncs of a tracked fd cost nothing: the bytes are hashed after the close,
//      from the page cache, off the trainer's thread. (Hashing them on the fly would put XXH3 on
//      the write path; tests/bench/save measures what that cost.)
//   3. OnDup shares the open file between fds; OnClose of its last fd opens the file again
//      read-only (the host's fd is already closed) and queues it. The worker hashes it to its end
//      (XXH3-64) and appends a journal record to its tag's `.ucp/`. A commit signal's first bytes
//      are read at the close; the worker resolves them to a tag, journals a "commit" record after
//      every record queued before it, and tells each CommitListener.
//   4. OnRename onto a commit signal's name (DCP's .metadata.tmp → .metadata) commits the same way.
// Any internal failure (allocation, I/O, a malformed commit signal) drops that file or commit,
// logged; nothing here throws or changes what the host sees. Work still queued when the process
// exits without Flush() (e.g. _exit, a kill) is lost: its files have no journal record.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
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
  // Called on the tracker's worker thread (inside a ReentrancyGuard), after the commit record and
  // every record queued before it are journaled. Must not throw; long work delays later records.
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

  // Returns once every file and commit closed before the call is journaled and notified.
  void Flush();

  bool OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) override;
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
  class Worker;
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
  // One fd fewer refers to `file`; queues its journal record or commit when none is left.
  void Release(const std::shared_ptr<OpenFile>& file);
  void QueueData(const OpenFile& file);
  void QueueCommit(const PathMatch& signal, const std::string& signal_path);
  // On the worker: journals a data file from `fd` (read-only, closed here).
  void JournalData(const PathMatch& match, const std::string& path, int fd);
  // On the worker: resolves, journals and announces a commit.
  void Commit(const PathMatch& signal, const std::string& signal_path, const std::string& content,
              int fd);

  const SaveTrackerOptions options_;
  std::array<Shard, kShards> shards_;
  std::mutex listeners_mutex_;
  std::vector<CommitListener*> listeners_;
  std::unique_ptr<Worker> worker_;
};

}  // namespace ucp::hooks
