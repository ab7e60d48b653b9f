// SaveTracker: the SaveObserver that records checkpoint files as the trainer writes them.
//
// Thread-safety: every SaveObserver method may be called from any thread concurrently, as the
// wrappers call them (OnWriteBegin and its OnWriteEnd on one thread). Open files live in 64
// fd-sharded maps, each with its own mutex held only to find, insert or erase an fd; the bytes of
// a write are hashed under that open file's own mutex, so writers of different files never
// contend. AddCommitListener is for start-up, before the tracker is installed with
// SetSaveObserver.
//
// What happens to a written file:
//   1. OnOpenForWrite: the path is recognised by a CheckpointLayout (and lies in the roots); in
//      stack mode a data file is tracked only if the WriterCheck accepts the caller. Anything
//      else returns false and is never seen again.
//   2. OnWriteBegin/OnWriteEnd: while every write lands exactly at the end of the bytes hashed so
//      far (write at the file position, pwrite at an explicit offset equal to it, O_APPEND), the
//      bytes are fed to a streaming XXH3-64. Anything else (a seek, a gap, an overlap, a write
//      ucp cannot see) stops on-the-fly hashing for that file. A write of at least
//      kParallelHashBytes is hashed by the hasher thread while the kernel copies it (OnWriteBegin
//      hands it over, OnWriteEnd waits for it, or hashes it itself if the hasher has not started
//      it): torch.save writes each tensor in one call, so its bytes are hashed at no cost to the
//      trainer's thread, where hashing them after the call made torch.save of 1 GiB 1.15× slower.
//      Smaller writes are hashed in OnWriteEnd.
//   3. OnDup shares the open file between fds; OnClose of its last fd finishes it: the file is
//      stat'ed by path (the fd is already closed), and if the streamed hash does not cover exactly
//      its size, the file is hashed again from disk. A data file gets a journal record in its
//      tag's `.ucp/`; a commit signal is read and resolved to its tag, which gets a "commit"
//      record, and every CommitListener is told.
//   4. OnRename onto a commit signal's name (DCP's .metadata.tmp → .metadata) commits the same way.
// Any internal failure (allocation, I/O, a malformed commit signal) drops that file or commit,
// logged; nothing here throws or changes what the host sees.
//
// Threads: one hasher thread, started by the first write of kParallelHashBytes or more, holding
// a ReentrancyGuard for its whole life; the destructor stops and joins it.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/frameworks/checkpoint_layout.h"
#include "core/tag/journal.h"
#include "core/util/chunked_xxh3.h"
#include "hooks/events.h"
#include "hooks/save/stack_detect.h"

namespace ucp::hooks {

// A tag that its framework has just declared complete.
struct CommitEvent {
  std::string framework;    // "deepspeed", "megatron", "dcp"
  std::string save_dir;     // the directory holding the tags
  std::string tag_dir;      // the committed tag's directory
  std::string tag;          // its name, e.g. "global_step5"
  std::string signal_path;  // the commit signal's path, e.g. <save_dir>/latest
  // Where the signal's bytes are: signal_path, or under UCP_DURABLE its pending name
  // (hooks/save/durable_commit.h), which becomes signal_path only once the tag is durable.
  std::string written_path;
  // Tells this commit from every other (core/tag/save_generation.h): the listeners' record of
  // which bytes made up the save.
  std::string commit_id;
};

// A data file of a tag that this process wrote, closed and journaled.
struct SavedFileEvent {
  std::string framework;
  std::string tag_dir;
  std::string path;  // relative to tag_dir
  uint64_t size = 0;
  uint64_t xxh3 = 0;
  int64_t time_ns = 0;                            // the journal record's "time_ns"
  ChunkHashes chunks = {};                        // the journal record's, when recorded
  std::optional<FileStamp> stamp = std::nullopt;  // the journal record's
  std::string job = {};                           // the journal record's (RunJob)
};

class CommitListener {
 public:
  virtual ~CommitListener() = default;
  // Called on the thread that closed (or renamed) the commit signal, inside the hooks, with no
  // tracker lock held. Must not throw; should return quickly (hand long work to a thread).
  virtual void OnCommit(const CommitEvent& event) noexcept = 0;
  // Called on the thread that closed a data file, inside the hooks, once its journal record is
  // written, with that file's lock held. Must not throw; must only queue. Default: ignored.
  virtual void OnFileSaved(const SavedFileEvent& /*event*/) noexcept {}
};

struct SaveTrackerOptions {
  const LayoutRegistry* layouts = &LayoutRegistry::Builtin();
  RootSet roots;  // UCP_ROOTS; empty = everywhere
  // UCP_DETECT=stack: consulted for data files; nullptr = by name only. Not owned; outlives the
  // tracker.
  WriterCheck* writer_check = nullptr;
  // UCP_DURABLE: a write of a commit signal's pending name (hooks/save/durable_commit.h) is that
  // signal's write; its bytes are read from the pending file.
  bool pending_signals = false;
};

class SaveTracker final : public SaveObserver {
 public:
  // The smallest write hashed on the hasher thread: below it, handing the bytes over costs more
  // than hashing them (a few microseconds either way).
  static constexpr size_t kParallelHashBytes = 1 << 20;

  explicit SaveTracker(SaveTrackerOptions options);
  ~SaveTracker() override;
  SaveTracker(const SaveTracker&) = delete;
  SaveTracker& operator=(const SaveTracker&) = delete;

  // Adds a listener told of every commit from now on. Not owned; must outlive the tracker.
  void AddCommitListener(CommitListener* listener);

  bool OnOpenForWrite(int fd, std::string_view path, bool truncated, bool append) override;
  bool MayTrackPath(std::string_view path) override;
  void OnWriteBegin(int fd, int64_t offset, const struct iovec* iov, int iovcnt,
                    size_t size) override;
  void OnWriteEnd(int fd, ssize_t ret) override;
  void OnNonSequential(int fd) override;
  void OnDup(int old_fd, int new_fd) override;
  void OnClose(int fd) override;
  void OnSync(int fd) override;
  void OnRename(std::string_view from, std::string_view to) override;

 private:
  struct OpenFile;
  struct HashJob;
  struct WriteInFlight;
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
  // One fd fewer refers to `file`; finishes it when none is left.
  void Release(const std::shared_ptr<OpenFile>& file);
  // Journals a closed data file (caller holds file.mutex).
  void FinishData(OpenFile& file);
  // Queues `job` for the hasher thread, starting it on first use.
  void PostHashJob(std::shared_ptr<HashJob> job);
  // The hasher thread: runs queued jobs that no writer has claimed.
  void RunHasher();
  // A snapshot of the listeners, so that none is called with listeners_mutex_ held.
  std::vector<CommitListener*> Listeners();
  // Resolves, journals, logs and announces a commit signal, whose bytes are at `written_path`.
  void Commit(const PathMatch& signal, const std::string& signal_path,
              const std::string& written_path);
  // The commit signal that `path` stands for: itself, or the signal of a pending name.
  std::string SignalPathOf(std::string_view path) const;

  const SaveTrackerOptions options_;
  std::array<Shard, kShards> shards_;

  // The write between OnWriteBegin and OnWriteEnd on this thread. The wrappers never nest writes
  // on one thread (they run under a ReentrancyGuard), so one slot per thread is enough.
  static thread_local WriteInFlight in_flight_;

  std::mutex hasher_mutex_;
  std::condition_variable hasher_wake_;                // a job queued, or stopping
  std::deque<std::shared_ptr<HashJob>> hasher_queue_;  // guarded by hasher_mutex_
  bool hasher_stopping_ = false;                       // guarded by hasher_mutex_
  std::thread hasher_;                                 // started under hasher_mutex_
  std::mutex listeners_mutex_;
  std::vector<CommitListener*> listeners_;
};

}  // namespace ucp::hooks
