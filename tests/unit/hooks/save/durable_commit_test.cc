#include "hooks/save/durable_commit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
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

class NotYetDurableTest : public ::testing::Test {
 protected:
  std::vector<std::string> Missing(const std::vector<JournalRecord>& records,
                                   int64_t start_ns = 100) {
    return NotYetDurable(records, {"a.pt", "b.pt"}, start_ns,
                         [this](const std::string& path) -> std::optional<uint64_t> {
                           const auto it = sizes_.find(path);
                           if (it == sizes_.end()) return std::nullopt;
                           return it->second;
                         });
  }
  std::map<std::string, uint64_t> sizes_{{"a.pt", 10}, {"b.pt", 20}};
};

TEST_F(NotYetDurableTest, EveryFileClosedAndDurable) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b = Close("b.pt", 2, 300, 20);
  EXPECT_TRUE(Missing({a, b, Durable(b), Durable(a)}).empty());
}

TEST_F(NotYetDurableTest, ClosedButNotDurable) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b = Close("b.pt", 2, 300, 20);
  EXPECT_EQ(Missing({a, b, Durable(a)}), std::vector<std::string>{"b.pt"});
  EXPECT_EQ(Missing({a, Durable(a)}), std::vector<std::string>{"b.pt"});
}

TEST_F(NotYetDurableTest, DurableCopyMustMatchTheNewestClose) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b_old = Close("b.pt", 2, 300, 20);
  const JournalRecord b_new = Close("b.pt", 2, 400, 20);
  // The file was rewritten after the durable close: its new bytes are not known durable.
  EXPECT_EQ(Missing({a, Durable(a), b_old, Durable(b_old), b_new}),
            std::vector<std::string>{"b.pt"});
  EXPECT_TRUE(Missing({a, Durable(a), b_old, Durable(b_old), b_new, Durable(b_new)}).empty());
  // A copy from another process, or of other bytes, does not count.
  JournalRecord other_pid = Durable(b_new);
  other_pid.pid = 3;
  JournalRecord other_hash = Durable(b_new);
  other_hash.xxh3 ^= 1;
  EXPECT_EQ(Missing({a, Durable(a), b_new, other_pid, other_hash}),
            std::vector<std::string>{"b.pt"});
}

TEST_F(NotYetDurableTest, RecordsOfAnEarlierSaveDoNotCount) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b = Close("b.pt", 2, 50, 20);  // before start: an earlier save's
  EXPECT_EQ(Missing({a, Durable(a), b, Durable(b)}), std::vector<std::string>{"b.pt"});
  EXPECT_TRUE(Missing({a, Durable(a), b, Durable(b)}, 40).empty());
}

TEST_F(NotYetDurableTest, SizeOnDiskMustBeTheClosedSize) {
  const JournalRecord a = Close("a.pt", 1, 200, 10);
  const JournalRecord b = Close("b.pt", 2, 300, 20);
  sizes_["b.pt"] = 7;  // being rewritten
  EXPECT_EQ(Missing({a, Durable(a), b, Durable(b)}), std::vector<std::string>{"b.pt"});
  sizes_.erase("b.pt");  // removed
  EXPECT_EQ(Missing({a, Durable(a), b, Durable(b)}), std::vector<std::string>{"b.pt"});
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
    durable_.AddDownstream(&listener_);
  }
  void TearDown() override { fs::remove_all(dir_); }

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
    ASSERT_TRUE(AppendJournalRecord(tag_, record).ok());
    durable_.OnFileSaved({"deepspeed", tag_, name, record.size, record.xxh3, record.time_ns});
  }

  // Rank 0 writes `latest`: redirected, written, closed, journaled, committed.
  std::string WriteLatest() {
    const std::optional<std::string> pending = durable_.Redirect(dir_ + "/latest");
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
    durable_.OnCommit({"deepspeed", dir_, tag_, "global_step5", dir_ + "/latest", *pending});
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
  DurableCommit durable_{DurableCommitOptions{}};
};

TEST_F(DurableCommitTest, RedirectsOnlyCommitSignalsNamedByContent) {
  const std::optional<std::string> pending = durable_.Redirect(dir_ + "/latest");
  ASSERT_TRUE(pending.has_value());
  EXPECT_EQ(SignalOfPendingPath(*pending), dir_ + "/latest");
  EXPECT_EQ(durable_.PendingFor(dir_ + "/latest"), pending);
  EXPECT_TRUE(durable_.MayHavePending("latest"));
  // A second write of the same signal gets its own file, and reads see the newest.
  const std::optional<std::string> second = durable_.Redirect(dir_ + "/latest");
  ASSERT_TRUE(second.has_value());
  EXPECT_NE(*second, *pending);
  EXPECT_EQ(durable_.PendingFor(dir_ + "/latest"), second);
  durable_.RedirectFailed(dir_ + "/latest", *second);
  EXPECT_EQ(durable_.PendingFor(dir_ + "/latest"), pending);

  EXPECT_EQ(durable_.Redirect(tag_ + "/mp_rank_00_model_states.pt"), std::nullopt);
  EXPECT_EQ(durable_.Redirect(tag_ + "/.metadata"), std::nullopt);  // DCP renames it
  EXPECT_EQ(durable_.Redirect(dir_ + "/notes.txt"), std::nullopt);
  EXPECT_NE(durable_.Redirect(dir_ + "/latest_checkpointed_iteration.txt"), std::nullopt);
  // The pre-check on the path as the host spelled it admits every signal Redirect takes.
  EXPECT_TRUE(durable_.MayRedirectPath(dir_ + "/latest"));
  EXPECT_TRUE(durable_.MayRedirectPath("latest_checkpointed_iteration.txt"));
  EXPECT_FALSE(durable_.MayRedirectPath(dir_ + "/notes.txt"));
  EXPECT_FALSE(durable_.MayRedirectPath(dir_ + "/latest/."));

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
  PendingSignalServe serve(&durable_, &inner);
  EXPECT_FALSE(serve.MayServePath(dir_ + "/latest"));
  EXPECT_TRUE(serve.MayServePath(dir_ + "/served"));
  EXPECT_EQ(serve.Resolve(dir_ + "/latest").kind, ServeDecision::Kind::kPassThrough);

  for (const std::string& name : names_) Close(name);
  WriteLatest();
  ASSERT_TRUE(LatestBecomes("global_step5"));
  durable_.Drain(std::chrono::steady_clock::now() + kPublishLimit);
  EXPECT_EQ(serve.Resolve(dir_ + "/latest").kind, ServeDecision::Kind::kPassThrough);
  EXPECT_FALSE(serve.MayServePath(dir_ + "/latest"));
  EXPECT_EQ(inner.asked.back(), dir_ + "/latest");
}

TEST_F(DurableCommitTest, ReadsSeeThePendingFileUntilThePublish) {
  PassThrough inner;
  PendingSignalServe serve(&durable_, &inner);
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
  EXPECT_EQ(durable_.PendingFor(dir_ + "/latest"), pending);
  std::this_thread::sleep_for(kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_EQ(durable_.published(), 0u);

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
  durable_.Drain(std::chrono::steady_clock::now() + kPublishLimit);
  EXPECT_FALSE(fs::exists(pending));
  EXPECT_EQ(durable_.PendingFor(dir_ + "/latest"), std::nullopt);
  EXPECT_EQ(durable_.published(), 1u);
  std::lock_guard<std::mutex> lock(listener_.mutex);
  ASSERT_EQ(listener_.commits.size(), 1u);
  EXPECT_EQ(listener_.commits[0].written_path, dir_ + "/latest");
  EXPECT_EQ(listener_.saved, (std::vector<std::string>{names_[0], names_[1]}));

  // This process's own closes were journaled durable by the worker.
  Result<JournalContents> journals = ReadTagJournals(tag_);
  ASSERT_TRUE(journals.ok());
  size_t own_durable = 0;
  for (const JournalRecord& record : journals->records) {
    own_durable += record.durable && record.pid == ::getpid() ? 1 : 0;
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
  durable_.Drain(std::chrono::steady_clock::now() + kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_FALSE(fs::exists(pending));
  EXPECT_EQ(durable_.published(), 0u);
  std::lock_guard<std::mutex> lock(listener_.mutex);
  EXPECT_TRUE(listener_.commits.empty());
}

TEST_F(DurableCommitTest, FilesLeftByAnEarlierRunDoNotCount) {
  // Every file closed and durable, but before this process started (a killed run of the same
  // tag): they say nothing about this save.
  for (const std::string& name : names_) Close(name);
  durable_.Drain(std::chrono::steady_clock::now() + kPublishLimit);
  DurableCommit restarted{DurableCommitOptions{}};
  const std::optional<std::string> pending = restarted.Redirect(dir_ + "/latest");
  ASSERT_TRUE(pending.has_value());
  std::ofstream(*pending) << "global_step5";
  restarted.OnCommit({"deepspeed", dir_, tag_, "global_step5", dir_ + "/latest", *pending});
  restarted.Drain(std::chrono::steady_clock::now() + kSettle);
  EXPECT_EQ(Slurp(dir_ + "/latest"), "global_step4");
  EXPECT_EQ(restarted.published(), 0u);
}

}  // namespace
}  // namespace ucp::hooks
