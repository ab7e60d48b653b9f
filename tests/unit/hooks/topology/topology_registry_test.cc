#include "hooks/topology/topology_registry.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <xxhash.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ucp::hooks {
namespace {

// A 128-byte ncclUniqueId-like blob filled from `seed`.
std::array<std::byte, 128> MakeId(unsigned seed) {
  std::array<std::byte, 128> id{};
  for (size_t i = 0; i < id.size(); ++i)
    id[i] = static_cast<std::byte>((seed * 131 + i * 7) & 0xff);
  return id;
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "ucp_topology_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(TopologyRegistryTest, RecordsInitWithHashOfTheUniqueId) {
  TopologyRegistry registry;
  const auto id = MakeId(1);
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 8, 3, id, 2);

  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), 1u);
  EXPECT_EQ(comms[0].order, 0u);
  EXPECT_EQ(comms[0].handle, 0x1000u);
  EXPECT_EQ(comms[0].origin, CommOrigin::kInitRank);
  EXPECT_EQ(comms[0].nranks, 8);
  EXPECT_EQ(comms[0].rank, 3);
  EXPECT_EQ(comms[0].cuda_device, 2);
  EXPECT_EQ(comms[0].state, CommState::kLive);
  EXPECT_FALSE(comms[0].split.has_value());
  ASSERT_TRUE(comms[0].unique_id_hash.has_value());
  EXPECT_EQ(*comms[0].unique_id_hash, XXH3_64bits(id.data(), id.size()));
}

TEST(TopologyRegistryTest, EqualIdsHashEqualAndDifferentIdsDiffer) {
  const auto a = MakeId(1);
  const auto b = MakeId(1);
  auto c = MakeId(1);
  c[127] ^= std::byte{1};
  EXPECT_EQ(HashUniqueId(a), HashUniqueId(b));
  EXPECT_NE(HashUniqueId(a), HashUniqueId(c));
}

TEST(TopologyRegistryTest, SplitRecordsParentAndIsResolvedLater) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 8, 5, MakeId(1), std::nullopt);
  registry.RecordSplit(0x1000, /*color=*/1, /*key=*/5, 0x2000, std::nullopt);

  auto child = registry.Find(0x2000);
  ASSERT_TRUE(child.has_value());
  EXPECT_EQ(child->origin, CommOrigin::kSplit);
  ASSERT_TRUE(child->split.has_value());
  EXPECT_EQ(child->split->parent_order, 0u);
  EXPECT_EQ(child->split->color, 1);
  EXPECT_EQ(child->split->key, 5);
  EXPECT_FALSE(child->unique_id_hash.has_value());
  EXPECT_FALSE(child->nranks.has_value());

  registry.ResolveSplit(0x2000, 4, 2);
  child = registry.Find(0x2000);
  EXPECT_EQ(child->nranks, 4);
  EXPECT_EQ(child->rank, 2);
}

TEST(TopologyRegistryTest, SplitOfUnknownParentHasNoSplitInfo) {
  TopologyRegistry registry;
  registry.RecordSplit(0x1000, 0, 0, 0x2000, std::nullopt);
  const auto child = registry.Find(0x2000);
  ASSERT_TRUE(child.has_value());
  EXPECT_FALSE(child->split.has_value());
}

TEST(TopologyRegistryTest, LifecycleStates) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 2, 0, MakeId(1), std::nullopt);
  registry.RecordInit(0x2000, CommOrigin::kInitRankConfig, 2, 0, MakeId(2), std::nullopt);

  registry.RecordEnd(0, CommState::kFinalized);
  EXPECT_EQ(registry.Find(0x1000)->state, CommState::kFinalized);
  registry.RecordEnd(0, CommState::kLive);  // not an end: ignored
  EXPECT_EQ(registry.Find(0x1000)->state, CommState::kFinalized);
  registry.RecordEnd(0, CommState::kDestroyed);
  EXPECT_FALSE(registry.Find(0x1000).has_value());
  registry.RecordEnd(0, CommState::kAborted);  // already dead: ignored
  registry.RecordEnd(1, CommState::kAborted);
  registry.RecordEnd(7, CommState::kDestroyed);  // never created: ignored

  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), 2u);
  EXPECT_EQ(comms[0].state, CommState::kDestroyed);
  EXPECT_EQ(comms[1].state, CommState::kAborted);
}

TEST(TopologyRegistryTest, ReusedHandleIsANewCommunicator) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 2, 0, MakeId(1), std::nullopt);
  registry.RecordEnd(0, CommState::kDestroyed);
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 4, 1, MakeId(2), std::nullopt);
  // An address handed out again without a destroy we saw: the old record is closed.
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 6, 1, MakeId(3), std::nullopt);

  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), 3u);
  EXPECT_EQ(comms[0].state, CommState::kDestroyed);
  EXPECT_EQ(comms[1].state, CommState::kDestroyed);
  EXPECT_EQ(comms[2].state, CommState::kLive);
  EXPECT_EQ(registry.Find(0x1000)->order, 2u);
  EXPECT_EQ(registry.Find(0x1000)->nranks, 6);
  // A destroy of the communicator created 1st that is recorded late leaves the new one alive.
  registry.RecordEnd(1, CommState::kDestroyed);
  EXPECT_EQ(registry.Find(0x1000)->state, CommState::kLive);
}

TEST(TopologyRegistryTest, InitAllSharesAGroupAndRanksFollowTheOrder) {
  TopologyRegistry registry;
  const std::vector<uintptr_t> handles = {0x10, 0x20, 0x30};
  const std::vector<int> devices = {2, 0, 1};
  registry.RecordInitAll(handles, devices);
  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), 3u);
  for (size_t i = 0; i < comms.size(); ++i) {
    EXPECT_EQ(comms[i].handle, handles[i]);
    EXPECT_EQ(comms[i].nranks, 3);
    EXPECT_EQ(comms[i].rank, static_cast<int>(i));
    EXPECT_EQ(comms[i].cuda_device, devices[i]);
    EXPECT_EQ(comms[i].init_all_group, comms[0].order);
    EXPECT_FALSE(comms[i].unique_id_hash.has_value());
  }
}

TEST(TopologyRegistryTest, WorldIsTheLargestLiveCommunicatorFirstAmongEquals) {
  TopologyRegistry registry;
  EXPECT_FALSE(registry.World().has_value());
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 4, 1, MakeId(1), std::nullopt);
  registry.RecordInit(0x2000, CommOrigin::kInitRank, 16, 9, MakeId(2), std::nullopt);
  registry.RecordInit(0x3000, CommOrigin::kInitRank, 16, 3, MakeId(3), std::nullopt);
  registry.RecordSplit(0x2000, 0, 0, 0x4000, std::nullopt);  // size unknown: never the world
  EXPECT_EQ(registry.World()->handle, 0x2000u);

  const TopologySummary summary = registry.Summary();
  EXPECT_EQ(summary.world_size, 16);
  EXPECT_EQ(summary.global_rank, 9);

  registry.RecordEnd(registry.Find(0x2000)->order, CommState::kDestroyed);
  EXPECT_EQ(registry.World()->handle, 0x3000u);
  EXPECT_EQ(registry.Summary().global_rank, 3);
}

TEST(TopologyRegistryTest, SummaryGroupsLiveCommunicatorsByUniqueId) {
  TopologyRegistry registry;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 2, 0, MakeId(1), 0);
  registry.RecordInit(0x2000, CommOrigin::kInitRank, 2, 1, MakeId(1), 1);
  registry.RecordInit(0x3000, CommOrigin::kInitRank, 2, 0, MakeId(2), 0);
  registry.RecordInit(0x4000, CommOrigin::kInitRank, 2, 0, MakeId(3), 0);
  registry.RecordEnd(3, CommState::kAborted);

  const auto groups = registry.Summary().unique_id_groups;
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups.at(HashUniqueId(MakeId(1))), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(groups.at(HashUniqueId(MakeId(2))), (std::vector<uint64_t>{2}));
}

TEST(TopologyRegistryTest, ForgetsTheOldestDeadRecordsBeyondTheCap) {
  TopologyRegistry registry;
  registry.RecordInit(0x1, CommOrigin::kInitRank, 2, 0, MakeId(0), std::nullopt);
  const size_t churn = TopologyRegistry::kMaxDeadRecords + 10;
  for (size_t i = 0; i < churn; ++i) {
    registry.RecordInit(0x2, CommOrigin::kInitRank, 2, 0, MakeId(1), std::nullopt);
    registry.RecordEnd(registry.Find(0x2)->order, CommState::kDestroyed);
  }
  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), TopologyRegistry::kMaxDeadRecords + 1);
  EXPECT_EQ(comms.front().handle, 0x1u);  // alive records are never forgotten
  EXPECT_EQ(comms[1].order, 11u);         // orders 1..10 were the oldest dead ones
  EXPECT_EQ(comms.back().order, churn);
}

TEST(TopologyRegistryTest, ConcurrentRecordsAllLandWithDistinctOrders) {
  TopologyRegistry registry;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 100;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&registry, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const uintptr_t handle = 0x100000u * (t + 1) + i;
        registry.RecordInit(handle, CommOrigin::kInitRank, kThreads, t, MakeId(i), std::nullopt);
        (void)registry.Summary();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const auto comms = registry.Communicators();
  ASSERT_EQ(comms.size(), static_cast<size_t>(kThreads * kPerThread));
  for (size_t i = 0; i < comms.size(); ++i) EXPECT_EQ(comms[i].order, i);
}

TEST(TopologyRegistryTest, DumpFollowsEveryChangeAndLeavesNoTemporaryFile) {
  TempDir dir;
  const auto path = dir.path() / "topology.json";
  TopologyRegistry registry;
  registry.SetDumpPath(path.string());
  EXPECT_FALSE(std::filesystem::exists(path));  // nothing happened yet

  const auto id = MakeId(7);
  registry.RecordGeneratedUniqueId(id);
  auto doc = nlohmann::json::parse(ReadFile(path));
  EXPECT_EQ(doc["version"], 1);
  EXPECT_EQ(doc["pid"], ::getpid());
  EXPECT_TRUE(doc["communicators"].empty());

  registry.RecordInit(0xabc0, CommOrigin::kInitRank, 4, 2, id, 1);
  registry.RecordSplit(0xabc0, 3, 1, 0xdef0, std::nullopt);
  doc = nlohmann::json::parse(ReadFile(path));
  const std::string hash = fmt::format("{:016x}", XXH3_64bits(id.data(), id.size()));
  EXPECT_EQ(doc["generated_unique_ids"], nlohmann::json::array({hash}));
  ASSERT_EQ(doc["communicators"].size(), 2u);
  const auto& world = doc["communicators"][0];
  EXPECT_EQ(world["handle"], "0xabc0");
  EXPECT_EQ(world["origin"], "init_rank");
  EXPECT_EQ(world["nranks"], 4);
  EXPECT_EQ(world["rank"], 2);
  EXPECT_EQ(world["unique_id_hash"], hash);
  EXPECT_EQ(world["cuda_device"], 1);
  EXPECT_EQ(world["state"], "live");
  EXPECT_TRUE(world["split"].is_null());
  const auto& child = doc["communicators"][1];
  EXPECT_EQ(child["origin"], "split");
  EXPECT_TRUE(child["nranks"].is_null());
  EXPECT_TRUE(child["unique_id_hash"].is_null());
  EXPECT_EQ(child["split"], nlohmann::json({{"parent", 0}, {"color", 3}, {"key", 1}}));
  EXPECT_EQ(doc["summary"]["world"], 0);
  EXPECT_EQ(doc["summary"]["world_size"], 4);
  EXPECT_EQ(doc["summary"]["global_rank"], 2);
  EXPECT_EQ(doc["summary"]["unique_id_groups"],
            nlohmann::json::array({{{"unique_id_hash", hash}, {"communicators", {0}}}}));

  registry.RecordEnd(0, CommState::kDestroyed);
  doc = nlohmann::json::parse(ReadFile(path));
  EXPECT_EQ(doc["communicators"][0]["state"], "destroyed");
  EXPECT_TRUE(doc["summary"]["world"].is_null());

  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1u);
}

TEST(TopologyRegistryTest, DumpPathExpandsThePid) {
  TempDir dir;
  TopologyRegistry registry;
  registry.SetDumpPath((dir.path() / "topo.%p.json").string());
  registry.RecordGeneratedUniqueId(MakeId(1));
  EXPECT_TRUE(
      std::filesystem::exists(dir.path() / ("topo." + std::to_string(::getpid()) + ".json")));
}

TEST(TopologyRegistryTest, UnwritableDumpPathChangesNothingForTheCaller) {
  TempDir dir;
  TopologyRegistry registry;
  registry.SetDumpPath((dir.path() / "missing" / "topology.json").string());
  errno = 1234;
  registry.RecordInit(0x1000, CommOrigin::kInitRank, 2, 1, MakeId(1), std::nullopt);
  EXPECT_EQ(errno, 1234);
  EXPECT_EQ(registry.Communicators().size(), 1u);
}

}  // namespace
}  // namespace ucp::hooks
