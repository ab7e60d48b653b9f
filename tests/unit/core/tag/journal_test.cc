#include "core/tag/journal.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ucp {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class JournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ucp_journal_test.XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    tag_dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(tag_dir_); }

  static JournalRecord Record(std::string path, uint64_t size) {
    JournalRecord record;
    record.path = std::move(path);
    record.size = size;
    record.xxh3 = 0x0123456789abcdefull ^ size;
    record.rank = 3;
    record.pid = ::getpid();
    record.time_ns = 1763757000123456789;
    record.framework = "deepspeed";
    record.role = FileRole::kData;
    return record;
  }

  std::string tag_dir_;
};

void ExpectSameRecord(const JournalRecord& a, const JournalRecord& b) {
  EXPECT_EQ(a.path, b.path);
  EXPECT_EQ(a.size, b.size);
  EXPECT_EQ(a.xxh3, b.xxh3);
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.pid, b.pid);
  EXPECT_EQ(a.time_ns, b.time_ns);
  EXPECT_EQ(a.framework, b.framework);
  EXPECT_EQ(a.role, b.role);
  EXPECT_EQ(a.chunks, b.chunks);
  EXPECT_EQ(a.stamp, b.stamp);
  EXPECT_EQ(a.job, b.job);
}

TEST_F(JournalTest, AppendsOneLinePerRecordAndReadsThemBack) {
  const JournalRecord first = Record("mp_rank_00_model_states.pt", 1234);
  JournalRecord second = Record("../latest", 12);
  second.role = FileRole::kCommitSignal;
  second.rank = -1;
  ASSERT_TRUE(AppendJournalRecord(tag_dir_, first).ok());
  ASSERT_TRUE(AppendJournalRecord(tag_dir_, second).ok());

  EXPECT_EQ(fs::status(JournalDirectory(tag_dir_)).permissions() & fs::perms::all, fs::perms(0755));
  const auto contents = ReadTagJournals(tag_dir_);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  EXPECT_TRUE(contents->warnings.empty());
  ASSERT_EQ(contents->records.size(), 2u);
  ExpectSameRecord(contents->records[0], first);
  ExpectSameRecord(contents->records[1], second);

  // The exact line, member order included, as README documents it.
  const auto line = EncodeJournalRecord(first);
  ASSERT_TRUE(line.ok());
  EXPECT_EQ(*line,
            "{\"v\":1,\"path\":\"mp_rank_00_model_states.pt\",\"size\":1234,"
            "\"xxh3\":\"0123456789abc93d\",\"rank\":3,\"pid\":" +
                std::to_string(::getpid()) +
                ",\"time_ns\":1763757000123456789,\"framework\":\"deepspeed\","
                "\"role\":\"data\"}\n");
}

TEST_F(JournalTest, ConcurrentAppendsNeverInterleave) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      for (int i = 0; i < kPerThread; ++i) {
        // Long paths make each line several hundred bytes.
        const std::string path = "dir_" + std::string(300, 'a' + t) + "/" + std::to_string(i);
        ASSERT_TRUE(AppendJournalRecord(tag_dir_, Record(path, i)).ok());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const auto contents = ReadTagJournals(tag_dir_);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  EXPECT_EQ(contents->records.size(), static_cast<size_t>(kThreads * kPerThread));
}

TEST_F(JournalTest, TornLastLineIsSkippedWithAWarning) {
  const std::string good = *EncodeJournalRecord(Record("a.pt", 1));
  const std::string torn = EncodeJournalRecord(Record("b.pt", 2))->substr(0, 30);
  const auto contents = ParseJournal("j", good + torn);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  ASSERT_EQ(contents->records.size(), 1u);
  EXPECT_EQ(contents->records[0].path, "a.pt");
  ASSERT_EQ(contents->warnings.size(), 1u);
  EXPECT_NE(contents->warnings[0].find("line 2"), std::string::npos) << contents->warnings[0];
}

TEST_F(JournalTest, MalformedLinesAreErrorsNamingTheLine) {
  const std::string good = *EncodeJournalRecord(Record("a.pt", 1));
  auto replaced = [&good](std::string_view from, std::string_view to) {
    std::string line = good;
    line.replace(line.find(from), from.size(), to);
    return line;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"v\":1,\n", "not JSON"},
      {"[1,2]\n", "not a JSON object"},
      {replaced("\"v\":1", "\"v\":2"), "\"v\" is not 1"},
      {replaced("\"path\":\"a.pt\"", "\"path\":\"/abs/a.pt\""), "\"path\""},
      {replaced("\"size\":1", "\"size\":-1"), "\"size\""},
      {replaced("\"xxh3\":\"", "\"xxh3\":\"A"), "xxh3"},
      {replaced("\"role\":\"data\"", "\"role\":\"other\""), "\"role\""},
      {replaced("\"rank\":3,", ""), "\"rank\""},
  };
  for (const auto& [line, expected] : cases) {
    const auto contents = ParseJournal("j", good + line + good);
    ASSERT_FALSE(contents.ok()) << line;
    EXPECT_EQ(contents.status().code(), StatusCode::kCorrupt);
    EXPECT_NE(contents.status().message().find("j: line 2: "), std::string::npos)
        << contents.status().message();
    EXPECT_NE(contents.status().message().find(expected), std::string::npos)
        << contents.status().message();
  }
}

TEST_F(JournalTest, ChunkHashesRoundTripAndMustFitTheSize) {
  JournalRecord record = Record("zero_pp_rank_0_mp_rank_00_optim_states.pt", 2500);
  record.chunks = {1000, {0x1111, 0x2222, 0xabcdef0123456789ull}};
  const auto line = EncodeJournalRecord(record);
  ASSERT_TRUE(line.ok());
  EXPECT_NE(line->find(",\"chunk_bytes\":1000,\"chunks\":\"0000000000001111000000000000222"
                       "2abcdef0123456789\"}"),
            std::string::npos)
      << *line;
  const auto contents = ParseJournal("j", *line);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  ExpectSameRecord(contents->records.at(0), record);

  const auto corrupt = [&](std::string_view from, std::string_view to) {
    std::string changed = *line;
    changed.replace(changed.find(from), from.size(), to);
    return ParseJournal("j", changed).status();
  };
  EXPECT_THAT(corrupt("\"chunk_bytes\":1000", "\"chunk_bytes\":500").message(),
              HasSubstr("\"chunks\": 3 chunk hashes for 2500 bytes in chunks of 500 (5 chunks)"));
  EXPECT_THAT(corrupt("\"chunk_bytes\":1000,", "").message(),
              HasSubstr("\"chunk_bytes\" and \"chunks\" come together"));
  EXPECT_THAT(corrupt("\"chunk_bytes\":1000", "\"chunk_bytes\":0").message(),
              HasSubstr("\"chunk_bytes\" is not a positive integer"));
  EXPECT_THAT(corrupt("\"chunks\":\"0", "\"chunks\":\"X").message(), HasSubstr("hex digit"));
}

TEST_F(JournalTest, StampRoundTripsAndItsMembersComeTogether) {
  JournalRecord record = Record("a.pt", 10);
  record.stamp = FileStamp{1234567, 1763757000987654321};
  const Result<std::string> line = EncodeJournalRecord(record);
  ASSERT_TRUE(line.ok());
  EXPECT_THAT(*line, HasSubstr("\"ino\":1234567,\"mtime_ns\":1763757000987654321"));
  const auto contents = ParseJournal("j", *line);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  ExpectSameRecord(contents->records.at(0), record);

  const auto corrupt = [&](const std::string& from, const std::string& to) {
    std::string bad = *line;
    bad.replace(bad.find(from), from.size(), to);
    return ParseJournal("j", bad).status();
  };
  EXPECT_THAT(corrupt(",\"mtime_ns\":1763757000987654321", "").message(),
              HasSubstr("\"ino\" and \"mtime_ns\" come together"));
  EXPECT_THAT(corrupt("\"ino\":1234567", "\"ino\":-1").message(),
              HasSubstr("\"ino\" is not a non-negative integer"));
  EXPECT_THAT(corrupt("\"mtime_ns\":1763757000987654321", "\"mtime_ns\":\"x\"").message(),
              HasSubstr("\"mtime_ns\" is not an integer"));
}

TEST_F(JournalTest, TheLaunchersJobRoundTripsAndIsLeftOutWhenUnknown) {
  JournalRecord record = Record("a.pt", 10);
  const Result<std::string> without = EncodeJournalRecord(record);
  ASSERT_TRUE(without.ok());
  EXPECT_THAT(*without, Not(HasSubstr("\"job\"")));
  record.job = "slurm=812.0.0";
  const Result<std::string> line = EncodeJournalRecord(record);
  ASSERT_TRUE(line.ok());
  EXPECT_THAT(*line, HasSubstr("\"job\":\"slurm=812.0.0\""));
  const auto contents = ParseJournal("j", *line);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  EXPECT_EQ(contents->records.at(0).job, "slurm=812.0.0");
  std::string bad = *line;
  bad.replace(bad.find("\"slurm=812.0.0\""), 15, "812");
  EXPECT_THAT(ParseJournal("j", bad).status().message(),
              AllOf(HasSubstr("j: line 1"), HasSubstr("\"job\" is not a string")));
}

TEST_F(JournalTest, ClosesOnDiskMatchTheFileByEqualityNotByTime) {
  // What stat(2) says of each file now.
  std::map<std::string, FileOnDisk> disk{{"a.pt", {2, {7, 500}}},
                                         {"b.pt", {5, {8, 600}}},
                                         {"c.pt", {7, {9, 700}}},
                                         {"d.pt", {1, {10, 800}}}};
  std::map<std::string, int> stats;
  std::vector<JournalRecord> records;
  records.reserve(16);
  const auto add = [&](const std::string& path, uint64_t size, FileStamp stamp, int64_t time_ns) {
    JournalRecord record = Record(path, size);
    record.stamp = stamp;
    record.time_ns = time_ns;
    records.push_back(record);
    return &records.back();
  };
  const JournalRecord* a = add("a.pt", 2, {7, 500}, 100);  // the oldest clock, yet the bytes
  add("a.pt", 2, {7, 400}, 900);                           // a newer clock, other bytes
  JournalRecord* repeat = add("a.pt", 2, {7, 500}, 100);
  repeat->durable = true;         // repeats a close: never the close itself
  add("b.pt", 5, {8, 599}, 300);  // another mtime: not what the disk holds
  add("b.pt", 4, {8, 600}, 300);  // another size
  add("c.pt", 7, {9, 700}, 300);
  JournalRecord* other_bytes = add("c.pt", 7, {9, 700}, 301);
  other_bytes->xxh3 ^= 1;  // rewritten within one timestamp tick: which one is on disk?
  JournalRecord* unstamped = add("d.pt", 1, {}, 300);
  unstamped->stamp.reset();  // written before stamps were recorded: describes nothing
  JournalRecord* commit = add("../latest", 8, {11, 900}, 500);
  commit->role = FileRole::kCommitSignal;
  const auto closes = ClosesOnDisk(records, [&](const std::string& path) {
    ++stats[path];
    const auto it = disk.find(path);
    return it == disk.end() ? std::nullopt : std::optional<FileOnDisk>(it->second);
  });
  EXPECT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes.at("a.pt"), a);
  // One stat per path, none for the commit signal.
  EXPECT_EQ(stats, (std::map<std::string, int>{{"a.pt", 1}, {"b.pt", 1}, {"c.pt", 1}}));
}

TEST_F(JournalTest, RecordsReadFromAJournalFileCarryItsHost) {
  ASSERT_TRUE(AppendJournalRecord(tag_dir_, Record("a.pt", 1)).ok());
  // Another node's journal; host names may hold dots.
  const std::string other = JournalDirectory(tag_dir_) + "/journal.node7.cluster.org.42.jsonl";
  std::ofstream(other) << *EncodeJournalRecord(Record("b.pt", 2));
  const auto contents = ReadTagJournals(tag_dir_);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  std::map<std::string, std::string> hosts;
  for (const JournalRecord& record : contents->records) hosts[record.path] = record.host;
  EXPECT_EQ(hosts, (std::map<std::string, std::string>{{"a.pt", JournalHostName()},
                                                       {"b.pt", "node7.cluster.org"}}));
  EXPECT_FALSE(JournalHostName().empty());
  EXPECT_EQ(JournalHostName().find('/'), std::string::npos);
}

TEST_F(JournalTest, TagFilesOnDiskStatsTheTagsFiles) {
  std::ofstream(tag_dir_ + "/a.pt") << "abc";
  struct stat st {};
  ASSERT_EQ(::stat((tag_dir_ + "/a.pt").c_str(), &st), 0);
  const auto on_disk = TagFilesOnDisk(tag_dir_)("a.pt");
  ASSERT_TRUE(on_disk.has_value());
  EXPECT_EQ(on_disk->size, 3u);
  EXPECT_EQ(on_disk->stamp.ino, st.st_ino);
  EXPECT_EQ(on_disk->stamp.mtime_ns,
            int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec);
  EXPECT_FALSE(TagFilesOnDisk(tag_dir_)("missing.pt").has_value());
}

TEST_F(JournalTest, UnknownMembersAreIgnored) {
  std::string line = *EncodeJournalRecord(Record("a.pt", 1));
  line.insert(1, "\"future\":{\"x\":[1]},");
  const auto contents = ParseJournal("j", line);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  ASSERT_EQ(contents->records.size(), 1u);
}

TEST_F(JournalTest, RejectsAbsolutePathsAndInvalidUtf8) {
  EXPECT_FALSE(EncodeJournalRecord(Record("/abs", 1)).ok());
  EXPECT_FALSE(EncodeJournalRecord(Record("", 1)).ok());
  EXPECT_FALSE(EncodeJournalRecord(Record("bad\xff.pt", 1)).ok());
  EXPECT_FALSE(ReadTagJournals(tag_dir_ + "/missing").ok());
}

TEST(JournalFormatTest, Xxh3IsSixteenLowercaseHexDigits) {
  EXPECT_EQ(FormatXxh3(0), "0000000000000000");
  EXPECT_EQ(FormatXxh3(0x9555E8555C62DCFDull), "9555e8555c62dcfd");
}

TEST(JournalFormatTest, LauncherRankTakesTheFirstVariableSet) {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    ::unsetenv(name);
  }
  EXPECT_EQ(LauncherRank(), -1);
  ::setenv("SLURM_PROCID", "7", 1);
  EXPECT_EQ(LauncherRank(), 7);
  ::setenv("RANK", "2", 1);
  EXPECT_EQ(LauncherRank(), 2);
  ::setenv("RANK", "x", 1);
  EXPECT_EQ(LauncherRank(), 7);
  ::unsetenv("RANK");
  ::unsetenv("SLURM_PROCID");
}

TEST(JournalFormatTest, LauncherJobJoinsEveryLaunchersIdOfThisRun) {
  const char* const kVariables[] = {"SLURM_JOB_ID",        "SLURM_STEP_ID",
                                    "SLURM_RESTART_COUNT", "PMIX_NAMESPACE",
                                    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"};
  for (const char* name : kVariables) ::unsetenv(name);
  EXPECT_EQ(LauncherJob(), "");
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
  EXPECT_EQ(LauncherJob(), "torchelastic=none.0");
  ::setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);  // torchrun restarted its workers
  EXPECT_EQ(LauncherJob(), "torchelastic=none.1");
  ::setenv("SLURM_JOB_ID", "812", 1);  // torchrun under sbatch: no step
  EXPECT_EQ(LauncherJob(), "slurm=812..;torchelastic=none.1");
  ::setenv("SLURM_STEP_ID", "3", 1);
  ::setenv("SLURM_RESTART_COUNT", "2", 1);  // requeued twice
  ::setenv("PMIX_NAMESPACE", "slurm.pmix.812.3", 1);
  EXPECT_EQ(LauncherJob(), "slurm=812.3.2;pmix=slurm.pmix.812.3;torchelastic=none.1");
  ::setenv("PMIX_NAMESPACE", "ns\xff\n", 1);  // not valid UTF-8 and not one line
  EXPECT_EQ(LauncherJob(), "slurm=812.3.2;pmix=ns??;torchelastic=none.1");
  JournalRecord record;
  record.path = "a.pt";
  record.job = LauncherJob();
  EXPECT_TRUE(EncodeJournalRecord(record).ok());
  for (const char* name : kVariables) ::unsetenv(name);
}

}  // namespace
}  // namespace ucp
