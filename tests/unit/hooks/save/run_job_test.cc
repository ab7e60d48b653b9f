#include "hooks/save/run_job.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <string>

#include "core/tag/journal.h"

namespace ucp::hooks {
namespace {

constexpr const char* kLauncherVariables[] = {"SLURM_JOB_ID",         "SLURM_STEP_ID",
                                              "SLURM_RESTART_COUNT",  "PMIX_NAMESPACE",
                                              "TORCHELASTIC_RUN_ID",  "TORCHELASTIC_RESTART_COUNT",
                                              "WORLD_SIZE",           "RANK",
                                              "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                              "SLURM_NTASKS"};

class RunJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kLauncherVariables) ::unsetenv(name);
  }
  void TearDown() override {
    for (const char* name : kLauncherVariables) ::unsetenv(name);
  }
};

std::array<std::byte, 128> UniqueId(unsigned seed) {
  std::array<std::byte, 128> id{};
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::byte>((seed * 67 + i) & 0xff);
  return id;
}

std::string NcclJob(const std::array<std::byte, 128>& id) {
  return fmt::format("nccl={:016x}", HashUniqueId(id));
}

TEST_F(RunJobTest, NoLauncherAndNoNcclNameNoJob) {
  TopologyRegistry registry;
  EXPECT_EQ(RunJob(registry), "");
}

// Ranks started without a launcher that names the run: the world communicator's unique id,
// which one rank drew for this run, names it; a restarted run draws another.
TEST_F(RunJobTest, WithoutALauncherTheNcclWorldsUniqueIdNamesTheRun) {
  ::setenv("WORLD_SIZE", "8", 1);
  TopologyRegistry run;
  run.RecordInit(0x1000, CommOrigin::kInitRankConfig, 8, 3, UniqueId(1), 0);
  // A smaller communicator made later (a data-parallel group) is not the world.
  run.RecordInit(0x2000, CommOrigin::kInitRankConfig, 2, 1, UniqueId(2), 0);
  EXPECT_EQ(RunJob(run), NcclJob(UniqueId(1)));

  TopologyRegistry other_rank;
  other_rank.RecordInit(0x7000, CommOrigin::kInitRankConfig, 8, 5, UniqueId(1), 1);
  EXPECT_EQ(RunJob(other_rank), RunJob(run));

  TopologyRegistry restarted;
  restarted.RecordInit(0x1000, CommOrigin::kInitRankConfig, 8, 3, UniqueId(9), 0);
  EXPECT_NE(RunJob(restarted), RunJob(run));
}

TEST_F(RunJobTest, TheLaunchersIdWins) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 4, 0, UniqueId(1), 0);
  ::setenv("TORCHELASTIC_RUN_ID", "r", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  EXPECT_EQ(RunJob(registry), LauncherJob());
  EXPECT_EQ(RunJob(registry), "torchelastic=r.2");
}

// Before a collective over all the ranks, the largest communicator is a group of some of them,
// whose id the other groups' ranks do not share: no job, rather than one that differs by rank.
TEST_F(RunJobTest, ACommunicatorSmallerThanTheLaunchersWorldNamesNoJob) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRankConfig, 4, 1, UniqueId(1), 0);
  ::setenv("WORLD_SIZE", "8", 1);
  EXPECT_EQ(RunJob(registry), "");
  ::setenv("WORLD_SIZE", "4", 1);
  EXPECT_EQ(RunJob(registry), NcclJob(UniqueId(1)));
  ::unsetenv("WORLD_SIZE");  // no launcher size to compare with
  EXPECT_EQ(RunJob(registry), "");
}

TEST_F(RunJobTest, NoLiveWorldWithAUniqueIdNamesNoJob) {
  ::setenv("WORLD_SIZE", "4", 1);
  TopologyRegistry destroyed;
  destroyed.RecordInit(0x1000, CommOrigin::kInitRank, 4, 0, UniqueId(1), 0);
  destroyed.RecordEnd(0, CommState::kDestroyed);
  EXPECT_EQ(RunJob(destroyed), "");

  // ncclCommInitAll: one process's communicators, no id drawn for a job.
  TopologyRegistry init_all;
  const std::array<uintptr_t, 2> handles = {0x1000, 0x2000};
  const std::array<int, 2> devices = {0, 1};
  init_all.RecordInitAll(handles, devices);
  EXPECT_EQ(RunJob(init_all), "");
}

}  // namespace
}  // namespace ucp::hooks
