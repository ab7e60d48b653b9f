#include "hooks/save/index_builder.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/format/atom_index.h"
#include "core/frameworks/framework_adapter.h"
#include "core/tag/journal.h"
#include "core/util/log.h"
#include "hooks/save/run_job.h"
#include "hooks/topology/topology_registry.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::steady_clock;
using ::testing::HasSubstr;

const std::string kFixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";
// Long enough for a build of a fixture on a loaded machine; a hang shows as this, not forever.
constexpr auto kDrainLimit = std::chrono::seconds(60);
// Between the closes of two ranks' files: several of the builder's polls.
constexpr milliseconds kRankDelay{150};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A save directory <dir>/ with tag global_step5/, written file by file as DeepSpeed does: each
// rank's files, then a journal record per file (what the tracker appends at close), rank 0's
// `latest` and its commit record.
class IndexBuilderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::ScratchDirectory("ucp_index_builder").string();
    tag_ = dir_ + "/global_step5";
    fs::create_directories(tag_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string Source(const std::string& config, const std::string& run) {
    return kFixtures + "/" + config + "/" + run + "/global_step5";
  }

  // The names of the .pt files of fixture config/run, rank 0's (its model states and optimizer
  // file) first.
  static std::vector<std::string> SaveNames(const std::string& config, const std::string& run) {
    std::vector<std::string> names;
    for (const fs::directory_entry& entry : fs::directory_iterator(Source(config, run))) {
      if (entry.path().extension() == ".pt") names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
      return std::make_tuple(!IsRankZero(a), a) < std::make_tuple(!IsRankZero(b), b);
    });
    return names;
  }

  // Copies file `name` of fixture config/run into the tag.
  void Write(const std::string& config, const std::string& run, const std::string& name) {
    const std::string target = tag_ + "/" + name;
    fs::copy_file(Source(config, run) + "/" + name, target, fs::copy_options::overwrite_existing);
    fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write);
  }

  // Copies the .pt files of fixture config/run into the tag; returns their names as SaveNames.
  std::vector<std::string> Save(const std::string& config, const std::string& run) {
    // Longer than the file system's timestamp granularity: a rewrite gets a new mtime.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::vector<std::string> names = SaveNames(config, run);
    for (const std::string& name : names) Write(config, run, name);
    return names;
  }

  // Rank 0 (TP rank 0, DP rank 0) writes the model states and its own optimizer file.
  static bool IsRankZero(const std::string& name) {
    return name.find("mp_rank_00_model_states") != std::string::npos ||
           name.find("zero_pp_rank_0_mp_rank_00_") != std::string::npos;
  }

  void Journal(const std::string& name) {
    Result<FileDigest> digest = HashFile(tag_ + "/" + name);
    ASSERT_TRUE(digest.ok()) << digest.status().ToString();
    JournalRecord record;
    record.path = name;
    record.size = digest->size;
    record.xxh3 = digest->xxh3;
    record.pid = ::getpid();
    record.time_ns = NowNs();
    record.framework = "deepspeed";
    record.role = FileRole::kData;
    record.stamp = StatFileOnDisk(tag_ + "/" + name).value_or(FileOnDisk{}).stamp;
    record.job = job_;
    const Status status = AppendJournalRecord(tag_, record);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }

  // Rank 0 writes `latest`; the tracker journals it and tells the builder.
  void Commit(IndexBuilder& builder) {
    std::ofstream(dir_ + "/latest") << "global_step5";
    JournalRecord record;
    record.path = "../latest";
    record.size = fs::file_size(dir_ + "/latest");
    record.pid = ::getpid();
    record.time_ns = NowNs();
    record.framework = "deepspeed";
    record.role = FileRole::kCommitSignal;
    const Status status = AppendJournalRecord(tag_, record);
    ASSERT_TRUE(status.ok()) << status.ToString();
    builder.OnCommit({"deepspeed", dir_, tag_, "global_step5", dir_ + "/latest", dir_ + "/latest",
                      NewCommitId()});
  }

  // Journals the files of the other ranks from another thread, kRankDelay apart, each first
  // written by `write` when given; before the last one, notes whether an index was there already.
  std::thread JournalLater(std::vector<std::string> names, bool* index_before_last,
                           std::function<void(const std::string&)> write = nullptr) {
    return std::thread([this, names = std::move(names), index_before_last, write] {
      for (size_t i = 0; i < names.size(); ++i) {
        std::this_thread::sleep_for(kRankDelay);
        if (i + 1 == names.size()) *index_before_last = fs::exists(IndexPath());
        if (write) write(names[i]);
        Journal(names[i]);
      }
    });
  }

  static std::vector<std::string> OtherRanks(const std::vector<std::string>& names) {
    std::vector<std::string> others;
    for (const std::string& name : names) {
      if (!IsRankZero(name)) others.push_back(name);
    }
    return others;
  }

  std::string IndexPath() const { return AtomIndexPath(tag_); }

  // What the adapter itself makes of the tag now, as `ucp index` would write it.
  std::string AdapterIndex() const {
    Result<const FrameworkAdapter*> adapter = DetectAdapter(tag_);
    EXPECT_TRUE(adapter.ok()) << adapter.status().ToString();
    if (!adapter.ok()) return "";
    Result<AtomIndex> index = (*adapter)->BuildIndex(tag_, {});
    EXPECT_TRUE(index.ok()) << index.status().ToString();
    return index.ok() ? index->ToJson() : "";
  }

  // Every name in the tag's .ucp/ other than the journals.
  std::set<std::string> UcpEntriesBesideJournals() const {
    std::set<std::string> names;
    for (const fs::directory_entry& entry : fs::directory_iterator(tag_ + "/.ucp")) {
      const std::string name = entry.path().filename().string();
      if (!name.starts_with("journal.")) names.insert(name);
    }
    return names;
  }

  std::string dir_;
  std::string tag_;
  std::string job_;  // the run of the job that Journal's records name (RunJob)

  void KilledRunsFilesDoNotCount(const std::string& killed_job,
                                 const std::function<void()>& start_next_run);
};

class IndexBuilderFixtureTest : public IndexBuilderTest,
                                public ::testing::WithParamInterface<std::string> {};

// Rank 0's files and the commit first, the other ranks' files written later: no index until the
// last of them is journaled, then exactly the adapter's index of the complete tag. At the commit
// a TP tag shows only TP rank 0's files, named as a TP=1 tag's are.
TEST_P(IndexBuilderFixtureTest, WaitsForEveryRankThenCommitsTheAdaptersIndex) {
  const std::string config = GetParam().substr(0, GetParam().rfind('/'));
  const std::string run = GetParam().substr(GetParam().rfind('/') + 1);
  IndexBuilder builder(IndexBuilderOptions{});
  const std::vector<std::string> names = SaveNames(config, run);
  for (const std::string& name : names) {
    if (!IsRankZero(name)) continue;
    Write(config, run, name);
    Journal(name);
  }
  Commit(builder);
  bool index_before_last = true;
  std::thread others = JournalLater(OtherRanks(names), &index_before_last,
                                    [&](const std::string& name) { Write(config, run, name); });
  others.join();
  builder.Drain(steady_clock::now() + kDrainLimit);

  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 1u);
  const std::string index = testing::ReadAll(IndexPath());
  EXPECT_FALSE(index.empty());
  EXPECT_TRUE(index == AdapterIndex());
  EXPECT_EQ(UcpEntriesBesideJournals(),
            (std::set<std::string>{"generation.json", "index.json", "index.lock"}));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, IndexBuilderFixtureTest,
                         ::testing::Values("z2_fp32/dp4", "z2_bf16/dp4", "z1_bf16_bf16opt/dp2",
                                           "tp2_z1_fp32/tp2dp2"),
                         [](const auto& test_param) {
                           std::string name = test_param.param;
                           std::replace(name.begin(), name.end(), '/', '_');
                           return name;
                         });

// An engine whose writers are not rank 0 alone (DeepSpeed's FastCheckpointEngine) may commit
// before TP rank 0's model states are written: the files then read as a TP=1 ZeRO tag's until
// the model states say mp_world_size 2. The builder follows the files to the adapter that reads
// the complete tag.
TEST_F(IndexBuilderTest, ModelStatesWrittenAfterTheCommitOfATpTag) {
  IndexBuilder builder(IndexBuilderOptions{});
  const std::vector<std::string> names = SaveNames("tp2_z1_fp32", "tp2dp2");
  const std::string first = "zero_pp_rank_0_mp_rank_00_optim_states.pt";
  Write("tp2_z1_fp32", "tp2dp2", first);
  Journal(first);
  Commit(builder);
  std::vector<std::string> later;
  std::copy_if(names.begin(), names.end(), std::back_inserter(later),
               [&](const std::string& name) { return name != first; });
  bool index_before_last = true;
  JournalLater(later, &index_before_last, [&](const std::string& name) {
    Write("tp2_z1_fp32", "tp2dp2", name);
  }).join();
  builder.Drain(steady_clock::now() + kDrainLimit);

  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 1u);
  const std::string index = testing::ReadAll(IndexPath());
  EXPECT_THAT(index, HasSubstr("\"deepspeed-tp\""));
  EXPECT_TRUE(index == AdapterIndex());
}

TEST_F(IndexBuilderTest, GivesUpAfterTheWaitLogged) {
  log::Configure(log::Level::kInfo, dir_);
  IndexBuilderOptions options;
  options.wait = milliseconds(300);
  IndexBuilder builder(options);
  const std::vector<std::string> names = Save("z2_fp32", "dp4");
  for (const std::string& name : names) {
    if (IsRankZero(name)) Journal(name);
  }
  Commit(builder);
  builder.Drain(steady_clock::now() + kDrainLimit);
  log::Flush();
  log::Configure(log::Level::kOff, "");

  EXPECT_FALSE(fs::exists(IndexPath()));
  EXPECT_EQ(builder.committed(), 0u);
  const std::string log_text =
      testing::ReadAll(dir_ + "/ucp." + std::to_string(::getpid()) + ".log");
  EXPECT_THAT(log_text, HasSubstr("gave up after 300 ms"));
  EXPECT_THAT(log_text, HasSubstr("zero_pp_rank_3_mp_rank_00_optim_states.pt"));
}

// Saving again to the tag: the records of the earlier save, even of files with the size they
// still have, are not this save's; the new index replaces the old one.
TEST_F(IndexBuilderTest, RecommitWaitsForThisSavesRecordsAndReplacesTheIndex) {
  IndexBuilder builder(IndexBuilderOptions{});
  const std::vector<std::string> first = Save("z2_fp32_odd", "dp4");
  for (const std::string& name : first) Journal(name);
  Commit(builder);
  builder.Drain(steady_clock::now() + kDrainLimit);
  ASSERT_EQ(builder.committed(), 1u);
  const std::string first_index = testing::ReadAll(IndexPath());
  ASSERT_TRUE(first_index == AdapterIndex());

  // The same bytes again (every size matches the earlier records).
  const std::vector<std::string> again = Save("z2_fp32_odd", "dp4");
  for (const std::string& name : again) {
    if (IsRankZero(name)) Journal(name);
  }
  Commit(builder);
  bool index_before_last = true;
  JournalLater(OtherRanks(again), &index_before_last).join();
  builder.Drain(steady_clock::now() + kDrainLimit);
  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 2u);
  EXPECT_TRUE(testing::ReadAll(IndexPath()) == AdapterIndex());

  // Other bytes: the index follows them.
  const std::vector<std::string> other = Save("z2_fp32", "dp4");
  for (const std::string& name : other) {
    if (IsRankZero(name)) Journal(name);
  }
  Commit(builder);
  JournalLater(OtherRanks(other), &index_before_last).join();
  builder.Drain(steady_clock::now() + kDrainLimit);
  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 3u);
  const std::string replaced = testing::ReadAll(IndexPath());
  EXPECT_TRUE(replaced == AdapterIndex());
  EXPECT_FALSE(replaced == first_index);
}

// A run killed after every rank closed its files but before rank 0 committed (its records naming
// `killed_job`), and the job's next run (`start_next_run` makes this process one of its ranks)
// saving the same tag, its ranks other than 0 not yet at their files when rank 0 commits: the
// killed run's files and records still agree, and no generation records them, yet they are not
// this save's. The builder compares no clocks, so only the job tells them apart.
void IndexBuilderTest::KilledRunsFilesDoNotCount(const std::string& killed_job,
                                                 const std::function<void()>& start_next_run) {
  IndexBuilder builder(IndexBuilderOptions{});
  job_ = killed_job;
  const std::vector<std::string> names = Save("z2_fp32_odd", "dp4");
  for (const std::string& name : names) Journal(name);

  start_next_run();
  job_ = RunJob(TopologyRegistry::Global());
  EXPECT_NE(job_, killed_job);
  const auto rewrite = [&](const std::string& name) {
    Write("z2_fp32_odd", "dp4", name);
    Journal(name);
  };
  std::this_thread::sleep_for(milliseconds(20));  // past the timestamp granularity
  for (const std::string& name : names) {
    if (IsRankZero(name)) rewrite(name);
  }
  Commit(builder);
  bool index_before_last = true;
  std::thread later([&] {
    const std::vector<std::string> others = OtherRanks(names);
    for (size_t i = 0; i < others.size(); ++i) {
      std::this_thread::sleep_for(kRankDelay);
      if (i + 1 == others.size()) index_before_last = fs::exists(IndexPath());
      rewrite(others[i]);
    }
  });
  later.join();
  builder.Drain(steady_clock::now() + kDrainLimit);
  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 1u);
  EXPECT_TRUE(testing::ReadAll(IndexPath()) == AdapterIndex());
}

// A requeue: same Slurm job, next restart count.
TEST_F(IndexBuilderTest, FilesOfAKilledRunOfTheJobDoNotCount) {
  KilledRunsFilesDoNotCount("slurm=77.0.0", [] {
    ::setenv("SLURM_JOB_ID", "77", 1);
    ::setenv("SLURM_STEP_ID", "0", 1);
    ::setenv("SLURM_RESTART_COUNT", "1", 1);
  });
  for (const char* name : {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"}) {
    ::unsetenv(name);
  }
}

// Ranks no launcher names (started by hand, pdsh): the next run's NCCL world, from a unique id
// of its own, tells the runs apart.
TEST_F(IndexBuilderTest, FilesOfAKilledRunWithoutALauncherIdDoNotCountUnderNccl) {
  std::array<std::byte, 128> id{};
  id.fill(std::byte{0x5a});
  const std::string killed = "nccl=" + std::string(16, '0');
  KilledRunsFilesDoNotCount(killed, [&] {
    ::setenv("WORLD_SIZE", "4", 1);
    TopologyRegistry::Global().RecordInit(0x5a00, CommOrigin::kInitRankConfig, 4, 0, id, 0);
  });
  const std::optional<CommRecord> world = TopologyRegistry::Global().World();
  ASSERT_TRUE(world.has_value());
  EXPECT_EQ(RunJob(TopologyRegistry::Global()), "nccl=" + fmt::format("{:016x}", HashUniqueId(id)));
  TopologyRegistry::Global().RecordEnd(world->order, CommState::kDestroyed);
  ::unsetenv("WORLD_SIZE");
}

// A second save to the tag while the first build still waits for its other ranks: only the
// newer one builds.
TEST_F(IndexBuilderTest, NewerCommitSupersedesAWaitingBuild) {
  IndexBuilder builder(IndexBuilderOptions{});
  std::vector<std::string> names = Save("z2_bf16", "dp4");
  for (const std::string& name : names) {
    if (IsRankZero(name)) Journal(name);
  }
  Commit(builder);
  std::this_thread::sleep_for(3 * IndexBuilder::kFirstPollInterval);
  names = Save("z2_bf16", "dp4");
  for (const std::string& name : names) {
    if (IsRankZero(name)) Journal(name);
  }
  Commit(builder);
  bool index_before_last = true;
  JournalLater(OtherRanks(names), &index_before_last).join();
  builder.Drain(steady_clock::now() + kDrainLimit);
  EXPECT_FALSE(index_before_last);
  EXPECT_EQ(builder.committed(), 1u);
  EXPECT_TRUE(testing::ReadAll(IndexPath()) == AdapterIndex());
}

// A save the adapter rejects (rank 1's file from a save at another DP size): no index, not even
// the earlier save's, and the tag's files as written.
TEST_F(IndexBuilderTest, FailingBuildRemovesTheEarlierIndexAndTouchesNothingElse) {
  IndexBuilder builder(IndexBuilderOptions{});
  std::vector<std::string> names = Save("z2_fp32", "dp4");
  for (const std::string& name : names) Journal(name);
  Commit(builder);
  builder.Drain(steady_clock::now() + kDrainLimit);
  ASSERT_TRUE(fs::exists(IndexPath()));

  // Saved again, with rank 1's file from another run: the adapter refuses the tag.
  names = Save("z2_fp32", "dp4");
  const std::string rank1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
  fs::copy_file(kFixtures + "/z2_fp32/dp2/global_step5/" + rank1, tag_ + "/" + rank1,
                fs::copy_options::overwrite_existing);
  std::map<std::string, std::string> written;
  for (const std::string& name : names) {
    Journal(name);
    written[name] = testing::ReadAll(tag_ + "/" + name);
  }
  Commit(builder);
  builder.Drain(steady_clock::now() + kDrainLimit);

  EXPECT_EQ(builder.committed(), 1u);
  EXPECT_FALSE(fs::exists(IndexPath()));
  EXPECT_EQ(UcpEntriesBesideJournals(), (std::set<std::string>{"generation.json", "index.lock"}));
  std::set<std::string> listed;
  for (const fs::directory_entry& entry : fs::directory_iterator(tag_)) {
    listed.insert(entry.path().filename().string());
  }
  std::set<std::string> expected(names.begin(), names.end());
  expected.insert(".ucp");
  EXPECT_EQ(listed, expected);
  for (const auto& [name, bytes] : written) {
    EXPECT_TRUE(testing::ReadAll(tag_ + "/" + name) == bytes) << name;
  }
}

// Teardown cannot wait for ranks that never finish: a past deadline abandons the build at once
// (the failure would be a hang of the 10-minute default wait).
TEST_F(IndexBuilderTest, DrainWithAPastDeadlineAbandonsTheWaitingBuild) {
  const auto start = steady_clock::now();
  {
    IndexBuilder builder(IndexBuilderOptions{});
    const std::vector<std::string> names = Save("z2_fp32", "dp4");
    for (const std::string& name : names) {
      if (IsRankZero(name)) Journal(name);
    }
    Commit(builder);
    std::this_thread::sleep_for(3 * IndexBuilder::kFirstPollInterval);
    builder.Drain(steady_clock::now() - std::chrono::seconds(1));
    EXPECT_EQ(builder.committed(), 0u);
  }
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_FALSE(fs::exists(IndexPath()));
}

// A commit of a tag no adapter reads is ignored.
TEST_F(IndexBuilderTest, IgnoresTagsWithoutAnAdapter) {
  IndexBuilder builder(IndexBuilderOptions{});
  std::ofstream(tag_ + "/model_optim_rng.pt") << "not a deepspeed file";
  Commit(builder);
  builder.Drain(steady_clock::now() + kDrainLimit);
  EXPECT_EQ(builder.committed(), 0u);
  EXPECT_FALSE(fs::exists(IndexPath()));
}

}  // namespace
}  // namespace ucp::hooks
