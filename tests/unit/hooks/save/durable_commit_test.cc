#include "hooks/save/durable_commit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/frameworks/framework_adapter.h"
#include "core/tag/journal.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

const std::string kFixture =
    std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed/z2_fp32/dp2/global_step5";
// A hang shows as this, not forever.
constexpr auto kPublishLimit = std::chrono::seconds(30);
// Many of the publisher's polls.
constexpr milliseconds kSettle{300};
// Longer than the file system's timestamp granularity: a file rewritten after it has a new mtime.
constexpr milliseconds kTimestampTick{20};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

TEST(PendingSignalNameTest, RoundTrips) {
  const std::string pending = PendingSignalPath("/ckpt/run/latest", 4242, 7);
  EXPECT_EQ(pending, "/ckpt/run/.latest.ucp-pending-4242-7");
  EXPECT_EQ(SignalOfPendingPath(pending), "/ckpt/run/latest");
  EXPECT_TRUE(IsPendingSignalName(".latest.ucp-pending-4242-7"));
  EXPECT_EQ(SignalOfPendingPath(PendingSignalPath("/s/latest_checkpointed_iteration.txt", 1, 2)),
            "/s/latest_checkpointed_iteration.txt");
}

TEST(PendingSignalNameTest, RejectsOtherNames) {
  for (const char* path :
       {"/s/latest", "/s/.latest", "/s/.latest.ucp-pending-12", "/s/.latest.ucp-pending-x-3",
        "/s/.latest.ucp-pending-1-", "/s/..ucp-pending-1-2", "/s/latest.ucp-pending-1-2",
        "/s/.latest.ucp-pending-1-2/x", ".latest.ucp-pending-1-2"}) {
    EXPECT_EQ(SignalOfPendingPath(path), std::nullopt) << path;
  }
  EXPECT_FALSE(IsPendingSignalName("latest"));
  EXPECT_FALSE(IsPendingSignalName(".latest.ucp-pending-1-2x"));
}

// Records for NotYetDurable: a close of `path` by `pid` at `time_ns`, and its durable copy.
JournalRecord Close(const std::string& path, int64_t pid, int64_t time_ns, uint64_t size) {
  JournalRecord record;
  record.path = path;
  record.size = size;
  record.xxh3 = static_cast<uint64_t>(time_ns) * 31 + size;
  record.pid = pid;
  record.time_ns = time_ns;
  record.framework = "deepspeed";
  return record;
}
JournalRecord Durable(JournalRecord close) {
  close.durable = true;
  return close;
}

// The matching itself (which close is this save's) is MatchSave's, tested with it.
TEST(NotYetDurableTest, EachCloseOfTheSaveNeedsADurableCopyOfItself) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b = Close("b.pt", 2, 300, 20);
  const SaveFiles save{{{"a.pt", &a}, {"b.pt", &b}}, {}};
  EXPECT_TRUE(NotYetDurable({a, b, Durable(b), Durable(a)}, save).empty());
  EXPECT_EQ(NotYetDurable({a, b, Durable(a)}, save), std::vector<std::string>{"b.pt"});
  EXPECT_EQ(NotYetDurable({a, b}, save), (std::vector<std::string>{"a.pt", "b.pt"}));
  // A copy of an earlier close of the file, from another process, or of other bytes does not
  // count.
  JournalRecord earlier = Durable(b);
  earlier.time_ns = 250;
  JournalRecord other_pid = Durable(b);
  other_pid.pid = 3;
  JournalRecord other_hash = Durable(b);
  other_hash.xxh3 ^= 1;
  EXPECT_EQ(NotYetDurable({a, Durable(a), b, earlier, other_pid, other_hash}, save),
            std::vector<std::string>{"b.pt"});
}

TEST(NotYetDurableTest, FilesNotClosedComeFirst) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const SaveFiles save{{{"a.pt", &a}}, {"c.pt"}};
  EXPECT_EQ(NotYetDurable({a}, save), (std::vector<std::string>{"c.pt", "a.pt"}));
  EXPECT_EQ(NotYetDurable({a, Durable(a)}, save), std::vector<std::string>{"c.pt"});
}

class RecordingListener final : public CommitListener {
 public:
  void OnCommit(const CommitEvent& event) noexcept override {
    std::lock_guard<std::mutex> lock(mutex);
    commits.push_back(event);
  }
  void OnFileSaved(const SavedFileEvent& event) noexcept override {
    std::lock_guard<std::mutex> lock(mutex);
    saved.push_back(event.path);
  }
  std::mutex mutex;
  std::vector<CommitEvent> commits;
  std::vector<std::string> saved;
};

// A save directory holding tag global_step5 (the dp2 ZeRO-2 fixture's files) and an older
// `latest`, as rank 0 of a DeepSpeed job sees it when it writes `latest` under UCP_DURABLE.
class DurableCommitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::ScratchDirectory("ucp_durable_commit").string();
    tag_ = dir_ + "/global_step5";
    fs::create_directories(tag_);
    for (const fs::directory_entry& entry : fs::directory_iterator(kFixture)) {
      if (entry.path().extension() != ".pt") continue;
      names_.push_back(entry.path().filename().string());
      fs::copy_file(entry.path(), tag_ + "/" + names_.back());
    }
    std::sort(names_.begin(), names_.end());
    std::ofstream(dir_ + "/latest") << "global_step4";
    durable_->AddDownstream(&listener_);
  }
  void TearDown() override {
    durable_.reset();
    fs::remove_all(dir_);
  }

  // What the tracker does at the close of `name`: its close record, then OnFileSaved.
  void Close(const std::string& name) {
    Result<FileDigest> digest = HashFile(tag_ + "/" + name);
    ASSERT_TRUE(digest.ok()) << digest.status().ToString();
    JournalRecord record;
    record.path = name;
    record.size = digest->size;
    record.xxh3 = digest->xxh3;
    record.pid = ::getpid();
    record.time_ns = NowNs();
    record.framework = "deepspeed";
    record.stamp = StampOf(name);
    ASSERT_TRUE(AppendJournalRecord(tag_, record).ok());
    durable_->OnFileSaved(
        {"deepspeed", tag_, name, record.size, record.xxh3, record.time_ns, {}, record.stamp});
  }

  FileStamp StampOf(const std::string& name) const {
    return StatFileOnDisk(tag_ + "/" + name).value_or(FileOnDisk{}).stamp;
  }

  // Rank 0 writes `latest`: redirected, written, closed, journaled, committed.
  std::string WriteLatest() { return WriteLatest(*durable_); }
  std::string WriteLatest(DurableCommit& durable) {
    const std::optional<std::string> pending = durable.Redirect(dir_ + "/latest");
    EXPECT_TRUE(pending.has_value());
    if (!pending) return "";
    std::ofstream(*pending) << "global_step5";
    JournalRecord record;
    record.path = "../latest";
    record.size = fs::file_size(*pending);
    record.pid = ::getpid();
    record.time_ns = NowNs();
    record.framework = "deepspeed";
    record.role = FileRole::kCommitSignal;
    EXPECT_TRUE(AppendJournalRecord(tag_, record).ok());
    durable.OnCommit(
        {"deepspeed", dir_, tag_, "global_step5", dir_ + "/latest", *pending, NewCommitId()});
    return *pending;
  }

  // Waits until `latest` holds `content` or the limit passed.
  bool LatestBecomes(const std::string& content) {
    const auto limit = std::chrono::steady_clock::now() + kPublishLimit;
    while (std::chrono::steady_clock::now() < limit) {
      if (Slurp(dir_ + "/latest") == content) return true;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return false;
  }

  std::string dir_;
  std::string tag_;
  std::vector<std::string> names_;
  RecordingListener listener_;
  // Destroyed (its worker joined) in TearDown, before the scratch folder it may still write
  // into is removed.
  std::optional<DurableCommit> durable_{std::in_place, DurableCommitOptions{}};
};

TEST_F(DurableCommitTest, RedirectsOnlyCommitSignalsNamedByContent) {
  const std::optional<std::string> pending = durable_->Redirect(dir_ + "/latest");
  ASSERT_TRUE(pending.has_value());
  EXPECT_EQ(SignalOfPendingPath(*pending), dir_ + "/latest");
  EXPECT_EQ(durable_->PendingFor(dir_ + "/latest"), pending);
  EXPECT_TRUE(durable_->MayHavePending("latest"));
  // A second write of the same signal gets its own file, and reads see the newest.
  const std::optional<std::string> second = durable_->Redirect(dir_ + "/latest");
  ASSERT_TRUE(second.has_value());
  EXPECT_NE(*second, *pending);
  EXPECT_EQ(durable_->PendingFor(dir_ + "/latest"), second);
  durable_->RedirectFailed(dir_ + "/latest", *second);
  EXPECT_EQ(durable_->PendingFor(dir_ + "/latest"), pending);

  EXPECT_EQ(durable_->Redirect(tag_ + "/mp_rank_00_model_states.pt"), std::nullopt);
  EXPECT_EQ(durable_->Redirect(tag_ + "/.metadata"), std::nullopt);  // DCP renames it
  EXPECT_EQ(durable_->Redirect(dir_ + "/notes.txt"), std::nullopt);
  EXPECT_NE(durable_->Redirect(dir_ + "/latest_checkpointed_iteration.txt"), std::nullopt);
  // The pre-check on the path as the host spelled it admits every signal Redirect takes.
  EXPECT_TRUE(durable_->MayRedirectPath(dir_ + "/latest"));
  EXPECT_TRUE(durable_->MayRedirectPath("latest_checkpointed_iteration.txt"));
  EXPECT_FALSE(durable_->MayRedirectPath(dir_ + "/notes.txt"));
  EXPECT_FALSE(durable_->MayRedirectPath(dir_ + "/latest/."));

  DurableCommitOptions elsewhere;
  Result<RootSet> roots = RootSet::Create({"/nonexistent/root"});
  ASSERT_TRUE(roots.ok());
  elsewhere.roots = *roots;
  DurableCommit outside(std::move(elsewhere));
  EXPECT_EQ(outside.Redirect(dir_ + "/latest"), std::nullopt);
}

// The view server's stand-in: passes everything through, and says which paths it was asked.
class PassThrough final : public ServePolicy {
 public:
  ServeDecision Resolve(std::string_view path) override {
    asked.emplace_back(path);
    return {};
  }
  bool MayServePath(std::string_view path) override { return path.ends_with("/served"); }
  std::optional<ListingChange> ChangeListing(std::string_view) override { return std::nullopt; }
  std::vector<std::string> asked;
};

TEST_F(DurableCommitTest, ReadsPassThroughWhenNothingIsHeldBack) {
  PassThrough inner;
  PendingSignalServe serve(&*durable_, &inner);
  EXPECT_FALSE(serve.MayServePath(dir_ + "/latest"));
  EXPECT_TRUE(serve.MayServePath(dir_ + "/served"));
  EXPECT_EQ(serve.Resolve(dir_ + "/latest").kind, ServeDecision::Kind::kPassThrough);

  for (const std::string& name : names_) Close(name);
  WriteLatest();
  ASSERT_TRUE(LatestBecomes("global_step5"));
  durable_->Drain(std::chrono::steady_clock::now() + kPublishLimit);
  EXPECT_EQ(serve.Resolve(dir_ + "/latest").kind, ServeDecision::Kind::kPassThrough);
  EXPECT_FALSE(serve.MayServePath(dir_ + "/latest"));
  EXPECT_EQ(inner.asked.back(), dir_ + "/latest");
}

TEST_F(DurableCommitTest, ReadsSeeThePendingFileUntilThePublish) {
  PassThrough inner;
  PendingSignalServe serve(&*durable_, &inner);
  Close(names_[0]);
  const std::string pending = WriteLatest();  // rank 1's and 2's files never come
  const ServeDecision decision = serve.Resolve(dir_ + "/latest");
  EXPECT_EQ(decision.kind, ServeDecision::Kind::kSubstitute);
  EXPECT_EQ(decision.path, pending);
  EXPECT_EQ(Slurp(decision.path), "global_step5");
  EXPECT_TRUE(inner.asked.empty());
}

TEST_F(DurableCommitTest, PublishesOnlyOnceEveryFileIsDurable) {
  ASSERT_EQ(names_.size(), 3u);  // model states, zero_pp_rank_0, zero_pp_rank_1
  // Rank 0's files, then its `latest`, before rank 1 closed its file (DeepSpeed's order).
  Close(names_[0]);
  Close(names_[1]);
  const std::string pending = WriteLatest();
  ASSERT_FALSE(pending.empty());
  EXPECT_EQ(durable_->PendingFor(dir_ + "/latest"), pending);
  std::this_thread::sleep_for(kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_EQ(durable_->published(), 0u);

  // Rank 1's close is journaled, but not yet durable: another process's record without a copy.
  Result<FileDigest> digest = HashFile(tag_ + "/" + names_[2]);
  ASSERT_TRUE(digest.ok());
  JournalRecord close;
  close.path = names_[2];
  close.size = digest->size;
  close.xxh3 = digest->xxh3;
  close.pid = ::getpid() + 1;
  close.time_ns = NowNs();
  close.framework = "deepspeed";
  close.stamp = StampOf(names_[2]);
  const std::string rank1_journal = tag_ + "/.ucp/journal.rank1.jsonl";
  Result<std::string> line = EncodeJournalRecord(close);
  ASSERT_TRUE(line.ok());
  std::ofstream(rank1_journal, std::ios::app) << *line;
  std::this_thread::sleep_for(kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");

  // Its durable copy: now the tag is complete and durable.
  close.durable = true;
  line = EncodeJournalRecord(close);
  ASSERT_TRUE(line.ok());
  std::ofstream(rank1_journal, std::ios::app) << *line;
  ASSERT_TRUE(LatestBecomes("global_step5"));
  durable_->Drain(std::chrono::steady_clock::now() + kPublishLimit);
  EXPECT_FALSE(fs::exists(pending));
  EXPECT_EQ(durable_->PendingFor(dir_ + "/latest"), std::nullopt);
  EXPECT_EQ(durable_->published(), 1u);
  std::lock_guard<std::mutex> lock(listener_.mutex);
  ASSERT_EQ(listener_.commits.size(), 1u);
  EXPECT_EQ(listener_.commits[0].written_path, dir_ + "/latest");
  EXPECT_EQ(listener_.saved, (std::vector<std::string>{names_[0], names_[1]}));

  // This process's own closes were journaled durable by the worker.
  Result<JournalContents> journals = ReadTagJournals(tag_);
  ASSERT_TRUE(journals.ok());
  size_t own_durable = 0;
  for (const JournalRecord& record : journals->records) {
    if (!record.durable || record.pid != ::getpid()) continue;
    ++own_durable;
    // A durable copy repeats its close member for member, the stamp included.
    EXPECT_EQ(record.stamp, StampOf(record.path)) << record.path;
  }
  EXPECT_EQ(own_durable, 2u);
}

TEST_F(DurableCommitTest, RemovesPendingFilesOfDeadProcesses) {
  // Above any pid_max: no such process. The parent process is alive.
  const std::string dead = dir_ + "/.latest.ucp-pending-999999999-4";
  const std::string alive = PendingSignalPath(dir_ + "/latest", ::getppid(), 1);
  const std::string other_signal = dir_ + "/.latest_universal.ucp-pending-999999999-4";
  for (const std::string& path : {dead, alive, other_signal}) std::ofstream(path) << "global_step3";
  for (const std::string& name : names_) Close(name);
  WriteLatest();
  ASSERT_TRUE(LatestBecomes("global_step5"));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(alive));
  EXPECT_TRUE(fs::exists(other_signal));
}

TEST_F(DurableCommitTest, NeverPublishesAnIncompleteTag) {
  Close(names_[0]);
  Close(names_[1]);
  const std::string pending = WriteLatest();
  // Rank 1 died before closing its file; the process exits.
  durable_->Drain(std::chrono::steady_clock::now() + kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_FALSE(fs::exists(pending));
  EXPECT_EQ(durable_->published(), 0u);
  std::lock_guard<std::mutex> lock(listener_.mutex);
  EXPECT_TRUE(listener_.commits.empty());
}

TEST_F(DurableCommitTest, FilesLeftByAKilledRunOnThisHostDoNotCount) {
  // Every file closed and durable by a process of this host that ran before this one started and
  // never committed (killed): no generation records them, yet they are not this save's.
  const std::string killed =
      tag_ + "/.ucp/journal." + JournalHostName() + "." + std::to_string(::getpid() + 1) + ".jsonl";
  fs::create_directories(tag_ + "/.ucp");
  for (const std::string& name : names_) {
    Result<FileDigest> digest = HashFile(tag_ + "/" + name);
    ASSERT_TRUE(digest.ok());
    JournalRecord close;
    close.path = name;
    close.size = digest->size;
    close.xxh3 = digest->xxh3;
    close.pid = ::getpid() + 1;
    close.time_ns = NowNs() - 3'600'000'000'000;  // an hour before this process started
    close.framework = "deepspeed";
    close.stamp = StampOf(name);
    std::ofstream(killed, std::ios::app) << *EncodeJournalRecord(close);
    close.durable = true;
    std::ofstream(killed, std::ios::app) << *EncodeJournalRecord(close);
  }
  const std::string pending = WriteLatest();
  durable_->Drain(std::chrono::steady_clock::now() + kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_EQ(durable_->published(), 0u);
  EXPECT_FALSE(fs::exists(pending));
}

TEST_F(DurableCommitTest, FilesOfAnEarlierCommitOfTheTagDoNotCount) {
  // A complete, published save of the tag.
  for (const std::string& name : names_) Close(name);
  WriteLatest();
  ASSERT_TRUE(LatestBecomes("global_step5"));
  std::ofstream(dir_ + "/latest") << "global_step4";

  // The tag saved again, by a restarted run: rank 0 rewrites its files and commits before rank 1
  // reopened its file, whose bytes and record (of the earlier save) still agree.
  std::this_thread::sleep_for(kTimestampTick);
  const auto rewrite = [&](const std::string& name) {
    fs::copy_file(kFixture + "/" + name, tag_ + "/" + name, fs::copy_options::overwrite_existing);
    Close(name);
  };
  rewrite(names_[0]);
  rewrite(names_[1]);
  DurableCommit restarted{DurableCommitOptions{}};
  const std::string pending = WriteLatest(restarted);
  std::this_thread::sleep_for(kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_EQ(restarted.published(), 0u);

  // Rank 1's file of this save: now the tag is complete.
  rewrite(names_[2]);
  EXPECT_TRUE(LatestBecomes("global_step5"));
  restarted.Drain(std::chrono::steady_clock::now() + kPublishLimit);
  EXPECT_EQ(restarted.published(), 1u);
  EXPECT_FALSE(fs::exists(pending));
}

}  // namespace
}  // namespace ucp::hooks
