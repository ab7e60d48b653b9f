#include "hooks/topology/trainer_degrees.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace ucp::hooks {
namespace {

using ::testing::HasSubstr;

using Files = std::map<std::string, std::string>;

// A file system made of `files` only.
ReadFileFunction Reader(const Files& files) {
  return [&files](const std::string& path) -> Result<std::string> {
    const auto found = files.find(path);
    if (found == files.end()) return Status::NotFound(path + ": no such file");
    return found->second;
  };
}

Result<TrainerDegrees> Degrees(const std::vector<std::string>& arguments, const Files& files = {}) {
  return DegreesFromArguments(arguments, Reader(files));
}

TEST(TrainerDegreesTest, MegatronFlagsInBothSpellingsTheLastOneCounting) {
  Result<TrainerDegrees> degrees =
      Degrees({"python", "pretrain_gpt.py", "--tensor-model-parallel-size", "4",
               "--pipeline-model-parallel-size=2", "--tensor-model-parallel-size=2"});
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->tp, 2u);
  EXPECT_EQ(degrees->pp, 2u);
  EXPECT_EQ(degrees->tp_evidence, "--tensor-model-parallel-size 2");
  EXPECT_EQ(degrees->pp_evidence, "--pipeline-model-parallel-size 2");
}

TEST(TrainerDegreesTest, ExpertParallelSizeFromMegatronOrDeepSpeedFlags) {
  Result<TrainerDegrees> megatron =
      Degrees({"python", "pretrain_gpt.py", "--expert-model-parallel-size", "4"});
  ASSERT_TRUE(megatron.ok()) << megatron.status().ToString();
  EXPECT_EQ(megatron->ep, 4u);
  EXPECT_EQ(megatron->ep_evidence, "--expert-model-parallel-size 4");
  Result<TrainerDegrees> deepspeed =
      Degrees({"python", "train.py", "--moe", "--ep-world-size=2", "--num-experts", "8"});
  ASSERT_TRUE(deepspeed.ok()) << deepspeed.status().ToString();
  EXPECT_EQ(deepspeed->ep, 2u);
  EXPECT_EQ(deepspeed->ep_evidence, "--ep-world-size 2");
  EXPECT_FALSE(deepspeed->tp.has_value());
  Result<TrainerDegrees> bad = Degrees({"python", "train.py", "--ep-world-size", "0"});
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
}

TEST(TrainerDegreesTest, ArgumentsThatStateNothingGiveNothing) {
  Result<TrainerDegrees> degrees =
      Degrees({"python", "train.py", "--tp", "2", "--deepspeed", "--pipeline-model-parallel-size"});
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_FALSE(degrees->tp.has_value());
  EXPECT_FALSE(degrees->pp.has_value());
  EXPECT_TRUE(Degrees({}).ok());
}

TEST(TrainerDegreesTest, DeepSpeedConfigAutoTpSizeGivesTp) {
  const Files files = {{"/job/ds.json", R"({"tensor_parallel": {"autotp_size": 2}})"}};
  for (const std::vector<std::string>& arguments :
       {std::vector<std::string>{"train.py", "--deepspeed_config", "/job/ds.json"},
        std::vector<std::string>{"train.py", "--deepspeed=/job/ds.json"},
        // DeepSpeed's --deepspeed switch followed by the config argument.
        std::vector<std::string>{"train.py", "--deepspeed", "--deepspeed_config",
                                 "/job/ds.json"}}) {
    Result<TrainerDegrees> degrees = Degrees(arguments, files);
    ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
    EXPECT_EQ(degrees->tp, 2u);
    EXPECT_EQ(degrees->tp_evidence, "/job/ds.json tensor_parallel.autotp_size 2");
  }
}

TEST(TrainerDegreesTest, DeepSpeedConfigAutoEpSizeGivesEpWhereEnabled) {
  const Files files = {{"ep.json", R"({"expert_parallel": {"enabled": true, "autoep_size": 4}})"},
                       {"off.json", R"({"expert_parallel": {"enabled": false, "autoep_size": 4}})"},
                       // DeepSpeed's default: off.
                       {"unset.json", R"({"expert_parallel": {"autoep_size": 4}})"}};
  Result<TrainerDegrees> degrees = Degrees({"train.py", "--deepspeed_config", "ep.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->ep, 4u);
  EXPECT_EQ(degrees->ep_evidence, "ep.json expert_parallel.autoep_size 4");
  // A flag stating the same size keeps its own evidence.
  degrees = Degrees({"--ep-world-size", "4", "--deepspeed_config", "ep.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->ep, 4u);
  EXPECT_EQ(degrees->ep_evidence, "--ep-world-size 4");
  for (const char* off : {"off.json", "unset.json"}) {
    degrees = Degrees({"train.py", "--deepspeed_config", off}, files);
    ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
    EXPECT_FALSE(degrees->ep.has_value()) << off;
  }
}

// DeepSpeed runs AutoEP at its AutoTP size only (it refuses an mpu's tensor parallelism): 1 where
// the config names none, which a tp flag given beside it overrides.
TEST(TrainerDegreesTest, AutoEpWithoutAutoTpGivesTpOne) {
  const Files files = {
      {"ep.json", R"({"expert_parallel": {"enabled": true, "autoep_size": 2}})"},
      {"folded.json",
       R"({"expert_parallel": {"enabled": true}, "tensor_parallel": {"autotp_size": 4}})"},
      {"off.json", R"({"expert_parallel": {"enabled": false, "autoep_size": 2}})"}};
  Result<TrainerDegrees> degrees = Degrees({"train.py", "--deepspeed_config", "ep.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->tp, 1u);
  EXPECT_THAT(degrees->tp_evidence,
              HasSubstr("ep.json expert_parallel enabled without tensor_parallel.autotp_size"));
  degrees = Degrees({"train.py", "--deepspeed_config", "folded.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->tp, 4u);
  degrees = Degrees({"--tensor-model-parallel-size", "2", "--deepspeed_config", "ep.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_EQ(degrees->tp, 2u);
  EXPECT_EQ(degrees->tp_evidence, "--tensor-model-parallel-size 2");
  degrees = Degrees({"train.py", "--deepspeed_config", "off.json"}, files);
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_FALSE(degrees->tp.has_value());
}

TEST(TrainerDegreesTest, AConfigWithoutAutoTpStatesNothing) {
  Result<TrainerDegrees> degrees = Degrees({"train.py", "--deepspeed", "ds.json"},
                                           {{"ds.json", R"({"zero_optimization": {}})"}});
  ASSERT_TRUE(degrees.ok()) << degrees.status().ToString();
  EXPECT_FALSE(degrees->tp.has_value());
}

TEST(TrainerDegreesTest, BadEvidenceIsFailedPreconditionNamingIt) {
  const struct {
    std::vector<std::string> arguments;
    Files files;
    std::string names;
  } cases[] = {
      {{"--tensor-model-parallel-size", "two"}, {}, "--tensor-model-parallel-size \"two\""},
      {{"--pipeline-model-parallel-size=0"}, {}, "--pipeline-model-parallel-size \"0\""},
      {{"--deepspeed_config", "missing.json"}, {}, "missing.json: no such file"},
      {{"--deepspeed_config", "bad.json"}, {{"bad.json", "{"}}, "bad.json: not a JSON object"},
      {{"--deepspeed_config", "zero.json"},
       {{"zero.json", R"({"tensor_parallel": {"autotp_size": 0}})"}},
       "tensor_parallel.autotp_size 0"},
      {{"--tensor-model-parallel-size", "4", "--deepspeed_config", "tp2.json"},
       {{"tp2.json", R"({"tensor_parallel": {"autotp_size": 2}})"}},
       "disagree on tp: --tensor-model-parallel-size 4, but tp2.json"},
      {{"--expert-model-parallel-size", "2", "--deepspeed_config", "ep1.json"},
       {{"ep1.json", R"({"expert_parallel": {"enabled": true, "autoep_size": 1}})"}},
       "disagree on ep: --expert-model-parallel-size 2, but ep1.json expert_parallel.autoep_size "
       "1"},
      {{"--deepspeed_config", "ep.json"},
       {{"ep.json", R"({"expert_parallel": {"enabled": true, "autoep_size": "2"}})"}},
       "ep.json: expert_parallel.autoep_size \"2\" is not a positive integer"},
  };
  for (const auto& c : cases) {
    Result<TrainerDegrees> degrees = Degrees(c.arguments, c.files);
    ASSERT_FALSE(degrees.ok()) << c.names;
    EXPECT_EQ(degrees.status().code(), StatusCode::kFailedPrecondition) << c.names;
    EXPECT_THAT(degrees.status().message(), HasSubstr(c.names));
  }
}

TEST(TrainerDegreesTest, CommandLineSplitsAtNuls) {
  EXPECT_EQ(SplitCommandLine(std::string("python\0train.py\0--pp\0\0", 22)),
            (std::vector<std::string>{"python", "train.py", "--pp", ""}));
  EXPECT_TRUE(SplitCommandLine("").empty());
}

TEST(TrainerDegreesTest, ThisProcessArgumentsAreReadFromProc) {
  const std::vector<std::string> arguments = ProcessArguments(1 << 20);
  ASSERT_FALSE(arguments.empty());
  EXPECT_THAT(arguments.front(), HasSubstr("trainer_degrees_test"));
}

}  // namespace
}  // namespace ucp::hooks
