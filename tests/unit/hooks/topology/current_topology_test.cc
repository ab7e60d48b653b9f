#include "hooks/topology/current_topology.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

namespace ucp::hooks {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

using Vars = std::map<std::string, std::string>;

// An environment made of `vars` only.
class FakeEnv {
 public:
  explicit FakeEnv(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}
  EnvLookup Lookup() const {
    return [this](const char* name) -> const char* {
      const auto found = vars_.find(name);
      return found == vars_.end() ? nullptr : found->second.c_str();
    };
  }

 private:
  std::map<std::string, std::string> vars_;
};

Topology Source(uint32_t dp, uint32_t tp = 1, uint32_t pp = 1) {
  return Topology{.dp = dp, .tp = tp, .pp = pp, .world = dp * tp * pp, .zero_stage = 2};
}

TopologySummary Nccl(int world_size, int rank) {
  TopologySummary summary;
  summary.world_size = world_size;
  summary.global_rank = rank;
  return summary;
}

TEST(CurrentTopologyTest, LauncherWorldSizeGivesDpWithSourceTpPp) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}, {"RANK", "1"}});
  Result<CurrentTopology> current = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology, (Topology{.dp = 2, .tp = 1, .pp = 1, .world = 2, .zero_stage = 2}));
  EXPECT_EQ(current->global_rank, 1);
  EXPECT_THAT(current->evidence, HasSubstr("WORLD_SIZE=2"));
  EXPECT_THAT(current->evidence, HasSubstr("tp=1 (source)"));
  EXPECT_THAT(current->warnings, IsEmpty());
}

TEST(CurrentTopologyTest, ExpertParallelSizeOnlyFromUcpTopology) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}});
  Result<CurrentTopology> plain = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->topology.ep, 0u);  // the tag's own
  TopologyOverride given;
  given.ep = 1;
  Result<CurrentTopology> current = ResolveCurrentTopology(given, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.ep, 1u);
  EXPECT_EQ(current->topology.dp, 2u);
  EXPECT_THAT(current->evidence, HasSubstr("ep=1 (UCP_TOPOLOGY)"));
}

TEST(CurrentTopologyTest, PartitionOnlyFromUcpTopology) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "4"}});
  Result<CurrentTopology> plain = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->topology.partition, LayerPartition::kInferred);
  TopologyOverride given;
  given.pp = 4;
  given.partition = LayerPartition::kParameters;
  Result<CurrentTopology> current = ResolveCurrentTopology(given, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.partition, LayerPartition::kParameters);
  EXPECT_EQ(current->topology.pp, 4u);
  EXPECT_THAT(current->evidence, HasSubstr("partition=parameters (UCP_TOPOLOGY)"));
}

TEST(CurrentTopologyTest, ExpertParallelSizeFromTheTrainerUnlessUcpTopologySaysOtherwise) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}});
  TrainerDegrees trainer;
  trainer.ep = 2;
  trainer.ep_evidence = "--ep-world-size 2";
  Result<CurrentTopology> stated = ResolveCurrentTopology({}, trainer, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(stated.ok()) << stated.status().ToString();
  EXPECT_EQ(stated->topology.ep, 2u);
  EXPECT_THAT(stated->evidence, HasSubstr("ep=2 (--ep-world-size 2)"));
  TopologyOverride given;
  given.ep = 1;
  Result<CurrentTopology> overridden =
      ResolveCurrentTopology(given, trainer, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(overridden.ok()) << overridden.status().ToString();
  EXPECT_EQ(overridden->topology.ep, 1u);
  ASSERT_THAT(overridden->warnings, SizeIs(1));
  EXPECT_THAT(overridden->warnings[0], HasSubstr("but the trainer's --ep-world-size 2"));
}

TEST(CurrentTopologyTest, SourceTpAndPpDivideTheWorld) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "8"}});
  Result<CurrentTopology> current =
      ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(2, 2, 1));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.dp, 4u);
  EXPECT_EQ(current->topology.tp, 2u);
  EXPECT_EQ(current->topology.world, 8u);
  EXPECT_FALSE(current->global_rank.has_value());
}

TEST(CurrentTopologyTest, LaunchersInOrder) {
  const std::map<std::string, std::string> cases[] = {
      {{"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_RANK", "2"}, {"PMI_SIZE", "5"}},
      {{"PMI_SIZE", "3"}, {"PMI_RANK", "2"}, {"SLURM_NTASKS", "5"}},
      {{"SLURM_NTASKS", "3"}, {"SLURM_PROCID", "2"}},
  };
  for (const auto& vars : cases) {
    const FakeEnv env(vars);
    Result<CurrentTopology> current = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
    ASSERT_TRUE(current.ok()) << current.status().ToString();
    EXPECT_EQ(current->topology.dp, 3u) << vars.begin()->first;
    EXPECT_EQ(current->global_rank, 2) << vars.begin()->first;
  }
}

TEST(CurrentTopologyTest, NcclOutranksTheLauncherWithAWarning) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "4"}, {"RANK", "0"}});
  Result<CurrentTopology> current =
      ResolveCurrentTopology({}, {}, Nccl(2, 1), env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.dp, 2u);
  EXPECT_EQ(current->global_rank, 1);
  EXPECT_THAT(current->evidence, HasSubstr("NCCL"));
  ASSERT_THAT(current->warnings, SizeIs(1));
  EXPECT_THAT(current->warnings[0], HasSubstr("WORLD_SIZE=4"));
}

TEST(CurrentTopologyTest, NcclAgreeingWithTheLauncherIsNoWarning) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}});
  Result<CurrentTopology> current =
      ResolveCurrentTopology({}, {}, Nccl(2, 0), env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok());
  EXPECT_THAT(current->warnings, IsEmpty());
}

TEST(CurrentTopologyTest, OverrideOutranksEverythingWithAWarning) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}});
  TopologyOverride override_spec;
  override_spec.dp = 8;
  Result<CurrentTopology> current =
      ResolveCurrentTopology(override_spec, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.dp, 8u);
  EXPECT_EQ(current->topology.world, 8u);
  EXPECT_THAT(current->evidence, HasSubstr("dp=8 (UCP_TOPOLOGY)"));
  ASSERT_THAT(current->warnings, SizeIs(1));
  EXPECT_THAT(current->warnings[0], HasSubstr("UCP_TOPOLOGY"));
}

TEST(CurrentTopologyTest, OverrideTpWithLauncherWorld) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "8"}});
  TopologyOverride override_spec;
  override_spec.tp = 2;
  Result<CurrentTopology> current =
      ResolveCurrentTopology(override_spec, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.tp, 2u);
  EXPECT_EQ(current->topology.dp, 4u);
  EXPECT_THAT(current->evidence, HasSubstr("tp=2 (UCP_TOPOLOGY)"));
}

TEST(CurrentTopologyTest, NoEvidenceIsNotFound) {
  const FakeEnv env(Vars{});
  Result<CurrentTopology> current = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
  ASSERT_FALSE(current.ok());
  EXPECT_EQ(current.status().code(), StatusCode::kNotFound);
}

TEST(CurrentTopologyTest, WorldThatTpPpDoNotDivideIsFailedPrecondition) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "3"}});
  Result<CurrentTopology> current = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(2, 2));
  ASSERT_FALSE(current.ok());
  EXPECT_EQ(current.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(current.status().message(), HasSubstr("WORLD_SIZE=3"));
}

TEST(CurrentTopologyTest, MalformedLauncherVariablesAreSkippedWithWarnings) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "two"}, {"PMI_SIZE", "2"}, {"PMI_RANK", "7"}});
  Result<CurrentTopology> current = ResolveCurrentTopology({}, {}, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.dp, 2u);
  EXPECT_FALSE(current->global_rank.has_value());
  ASSERT_THAT(current->warnings, SizeIs(2));
  EXPECT_THAT(current->warnings[0], HasSubstr("WORLD_SIZE=two"));
  EXPECT_THAT(current->warnings[1], HasSubstr("PMI_RANK=7"));
}

TEST(CurrentTopologyTest, TrainerDegreesReplaceTheSourcesAndDivideTheWorld) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "2"}});
  TrainerDegrees trainer;
  trainer.pp = 1;
  trainer.pp_evidence = "--pipeline-model-parallel-size 1";
  Result<CurrentTopology> current =
      ResolveCurrentTopology({}, trainer, {}, env.Lookup(), Source(2, 1, 2));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology, (Topology{.dp = 2, .tp = 1, .pp = 1, .world = 2, .zero_stage = 2}));
  EXPECT_THAT(current->evidence, HasSubstr("pp=1 (--pipeline-model-parallel-size 1)"));
  EXPECT_THAT(current->evidence, HasSubstr("tp=1 (source)"));
  EXPECT_THAT(current->warnings, IsEmpty());
}

TEST(CurrentTopologyTest, UcpTopologyOverridesTheTrainerWithAWarning) {
  const FakeEnv env(Vars{{"WORLD_SIZE", "8"}});
  TopologyOverride override_spec;
  override_spec.tp = 4;
  TrainerDegrees trainer;
  trainer.tp = 2;
  trainer.tp_evidence = "--tensor-model-parallel-size 2";
  Result<CurrentTopology> current =
      ResolveCurrentTopology(override_spec, trainer, {}, env.Lookup(), Source(4));
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_EQ(current->topology.tp, 4u);
  EXPECT_EQ(current->topology.dp, 2u);
  ASSERT_THAT(current->warnings, SizeIs(1));
  EXPECT_THAT(current->warnings[0], HasSubstr("UCP_TOPOLOGY gives tp=4"));
  EXPECT_THAT(current->warnings[0], HasSubstr("--tensor-model-parallel-size 2"));
}

}  // namespace
}  // namespace ucp::hooks
