#include "core/tag/save_generation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

JournalRecord Close(const std::string& path, uint64_t size, FileStamp stamp) {
  JournalRecord record;
  record.path = path;
  record.size = size;
  record.xxh3 = stamp.ino * 31 + size;
  record.pid = 1;
  record.framework = "deepspeed";
  record.stamp = stamp;
  return record;
}

class SaveGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override { tag_ = testing::ScratchDirectory("ucp_save_generation").string(); }
  void TearDown() override { fs::remove_all(tag_); }

  SaveFiles Match(const std::optional<SaveGeneration>& earlier, const std::string& commit) {
    return Match(SaveBounds{commit, earlier, "", 0, ""});
  }
  SaveFiles Match(const SaveBounds& bounds) {
    return MatchSave(records_, {"a.pt", "b.pt"}, bounds,
                     [this](const std::string& path) -> std::optional<FileOnDisk> {
                       const auto it = disk_.find(path);
                       if (it == disk_.end()) return std::nullopt;
                       return it->second;
                     });
  }

  std::string tag_;
  std::map<std::string, FileOnDisk> disk_{{"a.pt", {10, {1, 100}}}, {"b.pt", {20, {2, 200}}}};
  std::vector<JournalRecord> records_{Close("a.pt", 10, {1, 100}), Close("b.pt", 20, {2, 200})};
};

TEST_F(SaveGenerationTest, RoundTripsAndIsAbsentUntilWritten) {
  Result<std::optional<SaveGeneration>> none = ReadSaveGeneration(tag_);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_FALSE(none->has_value());
  const SaveGeneration written{"host.12.1", {{"a.pt", {10, {1, 100}}}, {"b/c.pt", {0, {2, -5}}}}};
  ASSERT_TRUE(WriteSaveGeneration(tag_, written).ok());
  Result<std::optional<SaveGeneration>> read = ReadSaveGeneration(tag_);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->commit, written.commit);
  EXPECT_EQ((*read)->files, written.files);

  // The same record again (the durable commit's, then the index builder's) writes nothing: the
  // file keeps its inode, where a write renames a new one into place.
  const auto inode = [&] {
    struct stat info {};
    EXPECT_EQ(::stat(SaveGenerationPath(tag_).c_str(), &info), 0);
    return info.st_ino;
  };
  const ino_t first = inode();
  ASSERT_TRUE(WriteSaveGeneration(tag_, written).ok());
  EXPECT_EQ(inode(), first);
  SaveGeneration next = written;
  next.commit = "host.12.2";
  ASSERT_TRUE(WriteSaveGeneration(tag_, next).ok());
  EXPECT_NE(inode(), first);
  Result<std::optional<SaveGeneration>> replaced = ReadSaveGeneration(tag_);
  ASSERT_TRUE(replaced.ok() && replaced->has_value());
  EXPECT_EQ((*replaced)->commit, "host.12.2");
}

TEST_F(SaveGenerationTest, RefusesMalformedRecordsNamingTheFileAndMember) {
  const auto read_text = [&](const std::string& text) {
    fs::create_directories(tag_ + "/.ucp");
    std::ofstream(SaveGenerationPath(tag_)) << text;
    return ReadSaveGeneration(tag_).status();
  };
  const Status not_json = read_text("{");
  EXPECT_EQ(not_json.code(), StatusCode::kCorrupt);
  EXPECT_THAT(not_json.message(), HasSubstr(SaveGenerationPath(tag_)));
  EXPECT_THAT(read_text(R"({"v":2,"commit":"c","files":[]})").message(),
              HasSubstr("\"v\" is not 1"));
  EXPECT_THAT(read_text(R"({"v":1,"files":[]})").message(), HasSubstr("\"commit\" is missing"));
  EXPECT_THAT(
      read_text(R"({"v":1,"commit":"c","files":[{"path":"a","size":1,"mtime_ns":3}]})").message(),
      HasSubstr("\"files\"[0].ino is missing or not a non-negative integer"));
  EXPECT_THAT(
      read_text(R"({"v":1,"commit":"c","files":[{"path":"a","size":1,"ino":2,"mtime_ns":0.5}]})")
          .message(),
      HasSubstr("\"files\"[0].mtime_ns is missing or not an integer"));
}

TEST_F(SaveGenerationTest, CommitIdsDiffer) { EXPECT_NE(NewCommitId(), NewCommitId()); }

TEST_F(SaveGenerationTest, AFreshTagTakesTheClosesOnDisk) {
  const SaveFiles save = Match(std::nullopt, "c2");
  EXPECT_TRUE(save.missing.empty());
  ASSERT_EQ(save.closes.size(), 2u);
  EXPECT_EQ(save.closes.at("a.pt"), &records_[0]);
  const SaveGeneration generation = GenerationOf("c2", save.closes);
  EXPECT_EQ(generation.files, disk_);
}

// Two ranks writing one file at once (DeepSpeed's folded AutoEP expert files) can both close it
// after its last write: two closes that match the disk and name different bytes. The file is
// closed all the same (the index build hashes it from disk); waiting for it would never end.
TEST_F(SaveGenerationTest, AFileTwoClosesDisagreeOnIsClosed) {
  JournalRecord other = records_[1];
  other.pid += 1;
  other.xxh3 ^= 1;
  records_.push_back(other);
  const SaveFiles save = Match(std::nullopt, "c2");
  EXPECT_TRUE(save.missing.empty());
  EXPECT_EQ(save.closes.count("b.pt"), 1u);
}

TEST_F(SaveGenerationTest, BytesAnEarlierCommitConsistedOfAreNotThisSaves) {
  // The earlier save consisted of b.pt as it still is: its rank has not rewritten it yet.
  const SaveGeneration earlier{"c1", {{"a.pt", {10, {1, 50}}}, {"b.pt", {20, {2, 200}}}}};
  SaveFiles save = Match(earlier, "c2");
  EXPECT_EQ(save.missing, std::vector<std::string>{"b.pt"});
  EXPECT_EQ(save.closes.count("a.pt"), 1u);

  // The rank rewrites it (a new mtime) and journals the close: now the save is whole.
  disk_["b.pt"] = {20, {2, 250}};
  records_.push_back(Close("b.pt", 20, {2, 250}));
  save = Match(earlier, "c2");
  EXPECT_TRUE(save.missing.empty());
  EXPECT_EQ(save.closes.at("b.pt"), &records_.back());

  // The record of this very commit (another listener matched it first) excludes nothing.
  disk_["b.pt"] = {20, {2, 200}};
  EXPECT_TRUE(Match(SaveGeneration{"c2", earlier.files}, "c2").missing.empty());
}

TEST_F(SaveGenerationTest, ClosesOnThisHostBeforeThisProcessStartedAreAnEarlierRuns) {
  // A killed run's closes, which no commit (so no generation) records.
  for (JournalRecord& record : records_) {
    record.host = "node1";
    record.time_ns = 50;
  }
  records_[1].host = "node2";  // another node's clock: never compared
  EXPECT_EQ(Match(SaveBounds{"c2", std::nullopt, "node1", 100, ""}).missing,
            std::vector<std::string>{"a.pt"});
  records_[0].time_ns = 150;  // closed after this process started: this save's
  EXPECT_TRUE(Match(SaveBounds{"c2", std::nullopt, "node1", 100, ""}).missing.empty());
  const SaveBounds here = BoundsOfThisProcess("c3", std::nullopt, LauncherJob());
  EXPECT_EQ(here.host, JournalHostName());
  EXPECT_GT(here.host_start_ns, 0);
  EXPECT_EQ(here.commit, "c3");
}

TEST_F(SaveGenerationTest, ClosesOfAnotherRunOfTheJobAreAnEarlierRunsOnAnyNode) {
  // A killed run's close on another node, after this process started by that node's clock: only
  // the launcher's job id tells it from this run's.
  for (JournalRecord& record : records_) {
    record.host = "node2";
    record.time_ns = 500;
    record.job = "slurm=812.0.1";
  }
  records_[0].job = "slurm=812.0.0";  // the run before the requeue
  const SaveBounds this_run{"c2", std::nullopt, "node1", 100, "slurm=812.0.1"};
  EXPECT_EQ(Match(this_run).missing, std::vector<std::string>{"a.pt"});
  records_[0].job = "";  // a writer whose launcher gave no id: not compared
  EXPECT_TRUE(Match(this_run).missing.empty());
  records_[0].job = "slurm=812.0.0";
  EXPECT_TRUE(Match(SaveBounds{"c2", std::nullopt, "node1", 100, ""}).missing.empty());
  ::setenv("TORCHELASTIC_RUN_ID", "r", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "4", 1);
  EXPECT_THAT(BoundsOfThisProcess("c3", std::nullopt, LauncherJob()).job,
              HasSubstr("torchelastic=r.4"));
  ::unsetenv("TORCHELASTIC_RUN_ID");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
}

TEST_F(SaveGenerationTest, AFileNotClosedAsItIsOnDiskIsMissing) {
  disk_["a.pt"] = {3, {1, 300}};  // truncated, being rewritten
  disk_.erase("b.pt");            // removed
  EXPECT_EQ(Match(std::nullopt, "c2").missing, (std::vector<std::string>{"a.pt", "b.pt"}));
}

}  // namespace
}  // namespace ucp
