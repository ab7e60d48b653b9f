#include "hooks/save/save_tracker.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/tag/journal.h"
#include "hooks/save/durable_commit.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;

// The independent oracle: xxhsum's own XXH3-64 of the file ("XXH3 (path) = <hex>").
std::string XxhsumH3(const std::string& path) {
  const std::string command = "xxhsum -H3 '" + path + "'";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return "popen failed";
  char line[4096] = {};
  const bool read = std::fgets(line, sizeof(line), pipe) != nullptr;
  ::pclose(pipe);
  if (!read) return "no output from " + command;
  std::string text(line);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text.substr(text.rfind(' ') + 1);
}

std::string RandomBytes(size_t size, unsigned seed) {
  std::mt19937 generator(seed);
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(generator());
  return bytes;
}

class RecordingListener final : public CommitListener {
 public:
  void OnCommit(const CommitEvent& event) noexcept override { events.push_back(event); }
  std::vector<CommitEvent> events;
};

class RejectingCheck final : public WriterCheck {
 public:
  bool IsCheckpointWriter() override {
    ++calls;
    return false;
  }
  int calls = 0;
};

class SaveTrackerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ucp_save_tracker_test.XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    save_dir_ = pattern;
    tag_dir_ = save_dir_ + "/global_step5";
    fs::create_directory(tag_dir_);
  }
  void TearDown() override { fs::remove_all(save_dir_); }

  // Opens `path` as the host would, and tells the tracker.
  int Open(SaveTracker& tracker, const std::string& path, int flags, bool expect_tracked = true) {
    const int fd = ::open(path.c_str(), flags, 0644);
    EXPECT_GE(fd, 0) << path;
    const bool tracked =
        tracker.OnOpenForWrite(fd, path, (flags & O_TRUNC) != 0, (flags & O_APPEND) != 0);
    EXPECT_EQ(tracked, expect_tracked) << path;
    return fd;
  }
  // Writes as the host would, bracketed as the wrappers bracket it.
  static void Write(SaveTracker& tracker, int fd, std::string_view bytes) {
    const struct iovec piece = {const_cast<char*>(bytes.data()), bytes.size()};
    tracker.OnWriteBegin(fd, -1, &piece, 1, bytes.size());
    const ssize_t ret = ::write(fd, bytes.data(), bytes.size());
    tracker.OnWriteEnd(fd, ret);
    ASSERT_EQ(ret, static_cast<ssize_t>(bytes.size()));
  }
  static void PWrite(SaveTracker& tracker, int fd, std::string_view bytes, off_t offset) {
    const struct iovec piece = {const_cast<char*>(bytes.data()), bytes.size()};
    tracker.OnWriteBegin(fd, offset, &piece, 1, bytes.size());
    const ssize_t ret = ::pwrite(fd, bytes.data(), bytes.size(), offset);
    tracker.OnWriteEnd(fd, ret);
    ASSERT_EQ(ret, static_cast<ssize_t>(bytes.size()));
  }
  static void Close(SaveTracker& tracker, int fd) {
    ASSERT_EQ(::close(fd), 0);
    tracker.OnClose(fd);
  }

  std::vector<JournalRecord> Records() const {
    auto contents = ReadTagJournals(tag_dir_);
    if (!contents.ok()) return {};
    EXPECT_TRUE(contents->warnings.empty());
    return contents->records;
  }

  // XXH3-64 of each kHashChunkBytes slice of the file at `path`, one call each: the reference
  // for a record's chunk hashes.
  static ChunkHashes SliceHashesOf(const std::string& path) {
    const std::string bytes = testing::ReadAll(path);
    ChunkHashes chunks{kHashChunkBytes, {}};
    for (size_t at = 0; at < bytes.size(); at += kHashChunkBytes) {
      chunks.hashes.push_back(
          XXH3_64bits(bytes.data() + at, std::min<size_t>(kHashChunkBytes, bytes.size() - at)));
    }
    return chunks;
  }

  // The one journal record of `name`, checked against the file on disk and xxhsum.
  void ExpectJournaled(const std::string& name) const {
    const std::string path = tag_dir_ + "/" + name;
    int found = 0;
    for (const JournalRecord& record : Records()) {
      if (record.path != name) continue;
      ++found;
      EXPECT_EQ(record.size, fs::file_size(path)) << name;
      EXPECT_EQ(FormatXxh3(record.xxh3), XxhsumH3(path)) << name;
      EXPECT_EQ(record.chunks, SliceHashesOf(path)) << name;
      EXPECT_EQ(record.stamp, StatFileOnDisk(path).value_or(FileOnDisk{}).stamp) << name;
      EXPECT_EQ(record.framework, "deepspeed");
      EXPECT_EQ(record.role, FileRole::kData);
      EXPECT_EQ(record.pid, ::getpid());
      EXPECT_GT(record.time_ns, 0);
    }
    EXPECT_EQ(found, 1) << name;
  }

  // Copies `name` aside, then flips its first byte on disk behind the tracker's back: a record
  // whose hash is the copy's was hashed on the fly, not read back from disk.
  std::string CopyAsideAndTamper(const std::string& name) const {
    const std::string path = tag_dir_ + "/" + name;
    const std::string copy = save_dir_ + "/copy_of_" + name;
    fs::copy_file(path, copy);
    const int fd = ::open(path.c_str(), O_RDWR);
    char byte = 0;
    EXPECT_EQ(::pread(fd, &byte, 1, 0), 1);
    byte = static_cast<char>(~byte);
    EXPECT_EQ(::pwrite(fd, &byte, 1, 0), 1);
    ::close(fd);
    return copy;
  }

  std::string save_dir_;
  std::string tag_dir_;
};

constexpr int kCreate = O_WRONLY | O_CREAT | O_TRUNC;

TEST_F(SaveTrackerTest, SequentialWritesAreHashedOnTheFly) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_00_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  for (unsigned i = 0; i < 5; ++i) Write(tracker, fd, RandomBytes(100000 + i, i));
  EXPECT_TRUE(Records().empty()) << "journaled before the close";
  const std::string copy = CopyAsideAndTamper(name);
  Close(tracker, fd);
  const auto records = Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].path, name);
  EXPECT_EQ(records[0].size, fs::file_size(copy));
  EXPECT_EQ(FormatXxh3(records[0].xxh3), XxhsumH3(copy));
  EXPECT_NE(FormatXxh3(records[0].xxh3), XxhsumH3(tag_dir_ + "/" + name));
  EXPECT_EQ(records[0].chunks, SliceHashesOf(copy));
}

TEST_F(SaveTrackerTest, BigWritesAreHashedWhileTheKernelCopiesThem) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_00_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  // Big and small writes interleaved, and a big vectored one: each big one is a hasher job.
  Write(tracker, fd, RandomBytes(SaveTracker::kParallelHashBytes, 30));
  Write(tracker, fd, RandomBytes(100, 31));
  Write(tracker, fd, RandomBytes(3 * SaveTracker::kParallelHashBytes + 17, 32));
  const std::string a = RandomBytes(SaveTracker::kParallelHashBytes / 2, 33);
  const std::string b = RandomBytes(SaveTracker::kParallelHashBytes, 34);
  struct iovec iov[2] = {{const_cast<char*>(a.data()), a.size()},
                         {const_cast<char*>(b.data()), b.size()}};
  tracker.OnWriteBegin(fd, -1, iov, 2, a.size() + b.size());
  ASSERT_EQ(::writev(fd, iov, 2), static_cast<ssize_t>(a.size() + b.size()));
  tracker.OnWriteEnd(fd, static_cast<ssize_t>(a.size() + b.size()));
  const std::string copy = CopyAsideAndTamper(name);
  Close(tracker, fd);
  const auto records = Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].size, fs::file_size(copy));
  EXPECT_EQ(FormatXxh3(records[0].xxh3), XxhsumH3(copy)) << "not hashed on the fly";
  // Chunk boundaries fall inside the hasher's jobs and between writes.
  EXPECT_EQ(records[0].chunks, SliceHashesOf(copy));
  EXPECT_EQ(records[0].chunks.hashes.size(), 6u);
}

TEST_F(SaveTrackerTest, AShortOrFailedBigWriteHashesOnlyWhatLanded) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_00_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  const std::string big = RandomBytes(2 * SaveTracker::kParallelHashBytes, 35);
  const struct iovec piece = {const_cast<char*>(big.data()), big.size()};
  // The kernel took only the first half (as a full disk or a signal can make it).
  tracker.OnWriteBegin(fd, -1, &piece, 1, big.size());
  const ssize_t half = static_cast<ssize_t>(big.size() / 2);
  ASSERT_EQ(::write(fd, big.data(), static_cast<size_t>(half)), half);
  tracker.OnWriteEnd(fd, half);
  // A failed call writes nothing.
  tracker.OnWriteBegin(fd, -1, &piece, 1, big.size());
  tracker.OnWriteEnd(fd, -1);
  Write(tracker, fd, std::string_view(big).substr(static_cast<size_t>(half)));
  const std::string copy = CopyAsideAndTamper(name);
  Close(tracker, fd);
  const auto records = Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].size, big.size());
  EXPECT_EQ(FormatXxh3(records[0].xxh3), XxhsumH3(copy)) << "not hashed on the fly";
  EXPECT_EQ(records[0].chunks, SliceHashesOf(copy));
}

TEST_F(SaveTrackerTest, TwoThreadsWritingOneFileAtItsPositionAtOnce) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_00_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  const std::string first = RandomBytes(SaveTracker::kParallelHashBytes, 36);
  const std::string second = RandomBytes(5000, 37);
  // Both writes begin at position 0; the kernel puts `second` first, and its call ends last.
  std::atomic<bool> begun{false};
  std::atomic<bool> other_done{false};
  std::thread writer([&] {
    const struct iovec piece = {const_cast<char*>(second.data()), second.size()};
    tracker.OnWriteBegin(fd, -1, &piece, 1, second.size());
    const ssize_t ret = ::write(fd, second.data(), second.size());
    begun = true;
    while (!other_done) std::this_thread::yield();
    tracker.OnWriteEnd(fd, ret);
  });
  while (!begun) std::this_thread::yield();
  Write(tracker, fd, first);
  other_done = true;
  writer.join();
  Close(tracker, fd);
  ExpectJournaled(name);
  EXPECT_EQ(fs::file_size(tag_dir_ + "/" + name), first.size() + second.size());
}

TEST_F(SaveTrackerTest, PwriteAtTheRunningPositionAndWriteVector) {
  SaveTracker tracker({});
  const std::string name = "zero_pp_rank_0_mp_rank_00_optim_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  Write(tracker, fd, RandomBytes(1000, 1));
  PWrite(tracker, fd, RandomBytes(500, 2), 1000);
  const std::string a = RandomBytes(300, 3);
  const std::string b = RandomBytes(700, 4);
  struct iovec iov[2] = {{const_cast<char*>(a.data()), a.size()},
                         {const_cast<char*>(b.data()), b.size()}};
  tracker.OnWriteBegin(fd, 1500, iov, 2, 1000);
  ASSERT_EQ(::pwritev(fd, iov, 2, 1500), 1000);
  tracker.OnWriteEnd(fd, 1000);
  const std::string copy = CopyAsideAndTamper(name);
  Close(tracker, fd);
  const auto records = Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].size, 2500u);
  EXPECT_EQ(FormatXxh3(records[0].xxh3), XxhsumH3(copy)) << "not hashed on the fly";
}

TEST_F(SaveTrackerTest, OverwriteAfterASeekIsHashedFromDisk) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_01_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  Write(tracker, fd, RandomBytes(4096, 5));
  // Same size at the end, different bytes: only a hash from disk gets it right.
  ASSERT_EQ(::lseek(fd, 100, SEEK_SET), 100);
  tracker.OnNonSequential(fd);
  Write(tracker, fd, RandomBytes(50, 6));
  Close(tracker, fd);
  ExpectJournaled(name);
}

TEST_F(SaveTrackerTest, GapsAndOverlappingPwritesAreHashedFromDisk) {
  SaveTracker tracker({});
  const int fd = Open(tracker, tag_dir_ + "/layer_00-model_states.pt", kCreate);
  Write(tracker, fd, RandomBytes(1000, 7));
  PWrite(tracker, fd, RandomBytes(10, 8), 2000);  // a hole
  PWrite(tracker, fd, RandomBytes(10, 9), 10);    // an overlap
  Close(tracker, fd);
  ExpectJournaled("layer_00-model_states.pt");
}

TEST_F(SaveTrackerTest, WriteAfterPwriteLandsAtTheUnmovedPosition) {
  SaveTracker tracker({});
  const std::string name = "layer_01-model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  Write(tracker, fd, RandomBytes(1000, 18));
  PWrite(tracker, fd, RandomBytes(500, 19), 1000);
  // pwrite did not move the file position: this lands at 1000, over the pwrite's bytes.
  Write(tracker, fd, RandomBytes(500, 20));
  Close(tracker, fd);
  ExpectJournaled(name);
  EXPECT_EQ(fs::file_size(tag_dir_ + "/" + name), 1500u);
}

TEST_F(SaveTrackerTest, DupsShareTheFileAndTheLastCloseRecords) {
  SaveTracker tracker({});
  const std::string name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, kCreate);
  Write(tracker, fd, RandomBytes(777, 10));
  const int copy = ::dup(fd);
  ASSERT_GE(copy, 0);
  tracker.OnDup(fd, copy);
  Close(tracker, fd);
  EXPECT_TRUE(Records().empty()) << "journaled while a dup was still open";
  // The dup shares the file position: this lands right after the first write.
  Write(tracker, copy, RandomBytes(333, 11));
  Close(tracker, copy);
  ExpectJournaled(name);
  tracker.OnClose(copy);  // a second close of a closed fd changes nothing
  EXPECT_EQ(Records().size(), 1u);
}

TEST_F(SaveTrackerTest, AppendToAnExistingFileIsHashedWhole) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_02_model_states.pt";
  const std::string path = tag_dir_ + "/" + name;
  {
    const int fd = ::open(path.c_str(), kCreate, 0644);
    ASSERT_EQ(::write(fd, "prefix", 6), 6);
    ::close(fd);
  }
  const int fd = Open(tracker, path, O_WRONLY | O_APPEND);
  Write(tracker, fd, RandomBytes(100, 12));
  PWrite(tracker, fd, RandomBytes(100, 13), 0);  // O_APPEND: lands at the end anyway
  Close(tracker, fd);
  ExpectJournaled(name);
  EXPECT_EQ(fs::file_size(path), 206u);
}

TEST_F(SaveTrackerTest, AppendToANewFileIsSequential) {
  SaveTracker tracker({});
  const std::string name = "mp_rank_03_model_states.pt";
  const int fd = Open(tracker, tag_dir_ + "/" + name, O_WRONLY | O_CREAT | O_APPEND);
  Write(tracker, fd, RandomBytes(100, 14));
  PWrite(tracker, fd, RandomBytes(100, 15), 0);
  Close(tracker, fd);
  ExpectJournaled(name);
}

TEST_F(SaveTrackerTest, UnrecognisedAndOutOfRootFilesAreNotTracked) {
  auto roots = RootSet::Create({save_dir_ + "/inside"});
  ASSERT_TRUE(roots.ok());
  SaveTrackerOptions options;
  options.roots = *roots;
  SaveTracker tracker(options);
  const int unrecognised = Open(tracker, tag_dir_ + "/notes.txt", kCreate, false);
  const int outside = Open(tracker, tag_dir_ + "/mp_rank_00_model_states.pt", kCreate, false);
  Write(tracker, outside, "bytes");
  Close(tracker, outside);
  Close(tracker, unrecognised);
  fs::create_directories(save_dir_ + "/inside/global_step1");
  const int inside =
      Open(tracker, save_dir_ + "/inside/global_step1/mp_rank_00_model_states.pt", kCreate);
  Close(tracker, inside);
  EXPECT_FALSE(fs::exists(JournalDirectory(tag_dir_)));
  EXPECT_TRUE(fs::exists(JournalDirectory(save_dir_ + "/inside/global_step1")));
}

// The pre-check the interposer makes on the path as the host spelled it, before it computes an
// absolute path: it admits every name the layouts know, and pending signals only under
// UCP_DURABLE.
TEST_F(SaveTrackerTest, PathPrecheckAdmitsLayoutNamesAndPendingSignals) {
  SaveTracker tracker{SaveTrackerOptions{}};
  EXPECT_TRUE(tracker.MayTrackPath(tag_dir_ + "/mp_rank_00_model_states.pt"));
  EXPECT_TRUE(tracker.MayTrackPath("global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  EXPECT_TRUE(tracker.MayTrackPath("latest"));
  EXPECT_FALSE(tracker.MayTrackPath(tag_dir_ + "/notes.txt"));
  EXPECT_FALSE(tracker.MayTrackPath(tag_dir_ + "/."));
  const std::string pending = PendingSignalPath(save_dir_ + "/latest", ::getpid(), 1);
  EXPECT_FALSE(tracker.MayTrackPath(pending));
  SaveTrackerOptions durable;
  durable.pending_signals = true;
  EXPECT_TRUE(SaveTracker(durable).MayTrackPath(pending));
}

TEST_F(SaveTrackerTest, StackModeAsksTheWriterCheckForDataFilesOnly) {
  RejectingCheck check;
  SaveTrackerOptions options;
  options.writer_check = &check;
  SaveTracker tracker(options);
  RecordingListener listener;
  tracker.AddCommitListener(&listener);
  const int data = Open(tracker, tag_dir_ + "/mp_rank_00_model_states.pt", kCreate, false);
  Close(tracker, data);
  EXPECT_EQ(check.calls, 1);
  const int latest = Open(tracker, save_dir_ + "/latest", kCreate);
  Write(tracker, latest, "global_step5");
  Close(tracker, latest);
  EXPECT_EQ(check.calls, 1);
  EXPECT_EQ(listener.events.size(), 1u);
}

TEST_F(SaveTrackerTest, DeepSpeedLatestCommitsItsTag) {
  SaveTracker tracker({});
  RecordingListener listener;
  tracker.AddCommitListener(&listener);
  const int data = Open(tracker, tag_dir_ + "/mp_rank_00_model_states.pt", kCreate);
  Write(tracker, data, "weights");
  Close(tracker, data);
  EXPECT_TRUE(listener.events.empty());

  const int latest = Open(tracker, save_dir_ + "/latest", kCreate);
  Write(tracker, latest, "global_step5");
  EXPECT_TRUE(listener.events.empty()) << "committed before the close";
  Close(tracker, latest);
  ASSERT_EQ(listener.events.size(), 1u);
  const CommitEvent& event = listener.events[0];
  EXPECT_EQ(event.framework, "deepspeed");
  EXPECT_EQ(event.save_dir, save_dir_);
  EXPECT_EQ(event.tag_dir, tag_dir_);
  EXPECT_EQ(event.tag, "global_step5");
  EXPECT_EQ(event.signal_path, save_dir_ + "/latest");

  const auto records = Records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[1].path, "../latest");
  EXPECT_EQ(records[1].role, FileRole::kCommitSignal);
  EXPECT_EQ(records[1].size, 12u);
  EXPECT_EQ(FormatXxh3(records[1].xxh3), XxhsumH3(save_dir_ + "/latest"));
}

TEST_F(SaveTrackerTest, CommitSignalsNamingNoTagAreIgnored) {
  SaveTracker tracker({});
  RecordingListener listener;
  tracker.AddCommitListener(&listener);
  for (const char* content : {"global_step6", "", "../../etc"}) {
    const int latest = Open(tracker, save_dir_ + "/latest", kCreate);
    Write(tracker, latest, content);
    Close(tracker, latest);
  }
  EXPECT_TRUE(listener.events.empty());
}

TEST_F(SaveTrackerTest, MegatronTrackerFileCommitsItsIteration) {
  SaveTracker tracker({});
  RecordingListener listener;
  tracker.AddCommitListener(&listener);
  const std::string rank_dir = save_dir_ + "/iter_0000020/mp_rank_00_001";
  fs::create_directories(rank_dir);
  const int data = Open(tracker, rank_dir + "/model_optim_rng.pt", kCreate);
  Write(tracker, data, RandomBytes(4000, 16));
  Close(tracker, data);
  const int signal = Open(tracker, save_dir_ + "/latest_checkpointed_iteration.txt", kCreate);
  Write(tracker, signal, "20");
  Close(tracker, signal);
  ASSERT_EQ(listener.events.size(), 1u);
  EXPECT_EQ(listener.events[0].framework, "megatron");
  EXPECT_EQ(listener.events[0].tag_dir, save_dir_ + "/iter_0000020");
  auto contents = ReadTagJournals(save_dir_ + "/iter_0000020");
  ASSERT_TRUE(contents.ok());
  ASSERT_EQ(contents->records.size(), 2u);
  EXPECT_EQ(contents->records[0].path, "mp_rank_00_001/model_optim_rng.pt");
  EXPECT_EQ(FormatXxh3(contents->records[0].xxh3), XxhsumH3(rank_dir + "/model_optim_rng.pt"));
  EXPECT_EQ(contents->records[1].path, "../latest_checkpointed_iteration.txt");
}

TEST_F(SaveTrackerTest, DcpMetadataRenameCommits) {
  SaveTracker tracker({});
  RecordingListener listener;
  tracker.AddCommitListener(&listener);
  const std::string dir = save_dir_ + "/step_3";
  fs::create_directory(dir);
  const int data = Open(tracker, dir + "/__0_0.distcp", kCreate);
  Write(tracker, data, RandomBytes(5000, 17));
  Close(tracker, data);
  // DCP writes .metadata.tmp (not a checkpoint name) and renames it.
  const int tmp = Open(tracker, dir + "/.metadata.tmp", kCreate, false);
  ASSERT_EQ(::write(tmp, "pickled metadata", 16), 16);
  ::close(tmp);
  ASSERT_EQ(::rename((dir + "/.metadata.tmp").c_str(), (dir + "/.metadata").c_str()), 0);
  EXPECT_TRUE(listener.events.empty());
  tracker.OnRename(dir + "/.metadata.tmp", dir + "/.metadata");
  ASSERT_EQ(listener.events.size(), 1u);
  EXPECT_EQ(listener.events[0].framework, "dcp");
  EXPECT_EQ(listener.events[0].tag_dir, dir);
  EXPECT_EQ(listener.events[0].tag, "step_3");
  EXPECT_EQ(listener.events[0].save_dir, save_dir_);
  auto contents = ReadTagJournals(dir);
  ASSERT_TRUE(contents.ok());
  ASSERT_EQ(contents->records.size(), 2u);
  EXPECT_EQ(contents->records[0].path, "__0_0.distcp");
  EXPECT_EQ(contents->records[1].path, ".metadata");
  EXPECT_EQ(FormatXxh3(contents->records[1].xxh3), XxhsumH3(dir + "/.metadata"));
}

TEST_F(SaveTrackerTest, ThreadsWritingTheirOwnFiles) {
  SaveTracker tracker({});
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string path =
          tag_dir_ + "/zero_pp_rank_" + std::to_string(t) + "_mp_rank_00_optim_states.pt";
      const int fd = Open(tracker, path, kCreate);
      for (unsigned i = 0; i < 50; ++i) Write(tracker, fd, RandomBytes(1000 + t, t * 100 + i));
      Close(tracker, fd);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(Records().size(), static_cast<size_t>(kThreads));
  for (int t = 0; t < kThreads; ++t) {
    ExpectJournaled("zero_pp_rank_" + std::to_string(t) + "_mp_rank_00_optim_states.pt");
  }
}

TEST_F(SaveTrackerTest, EventsForUnknownFdsAreIgnored) {
  SaveTracker tracker({});
  const struct iovec piece = {const_cast<char*>("x"), 1};
  tracker.OnWriteBegin(12345, -1, &piece, 1, 1);
  tracker.OnWriteEnd(12345, 1);
  tracker.OnNonSequential(12345);
  tracker.OnDup(12345, 12346);
  tracker.OnSync(12345);
  tracker.OnClose(12346);
  tracker.OnClose(12345);
  tracker.OnRename("/nowhere/a", "/nowhere/b");
  EXPECT_FALSE(fs::exists(JournalDirectory(tag_dir_)));
}

}  // namespace
}  // namespace ucp::hooks
