// DeepSpeed-MoE tags (the fixtures moe_z1_fp32 and moe_z2_fp32, written by DeepSpeed v0.14.5):
// the deepspeed-moe adapter takes them (its reshards: tests/deepspeed/check_moe.py) and names every
// file of a complete save; every other DeepSpeed adapter refuses them, naming the tag and an
// expert file, before it reads any file (their model states hold none of the fields a ZeRO tag's
// do: no ds_version, no param_shapes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/frameworks/framework_adapter.h"

namespace ucp {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

const std::string kFixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";

class DeepSpeedMoeTagTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeepSpeedMoeTagTest, EveryAdapterRefusesTheTagNamingAnExpertFile) {
  const std::string tag = kFixtures + "/" + GetParam() + "/global_step5";
  for (const std::string name : {"deepspeed-zero12", "deepspeed-zero3", "deepspeed-tp"}) {
    Result<const FrameworkAdapter*> adapter = FindAdapter(name);
    ASSERT_TRUE(adapter.ok()) << name;
    for (const Status& status :
         {(*adapter)->ExpectedFiles(tag).status(), (*adapter)->BuildIndex(tag, {}).status()}) {
      EXPECT_EQ(status.code(), StatusCode::kUnsupported) << name << ": " << status.ToString();
      EXPECT_THAT(status.message(), HasSubstr(tag + ": a DeepSpeed-MoE tag")) << name;
      EXPECT_THAT(status.message(), HasSubstr("expp_rank_0_mp_rank_00_optim_states.pt first"))
          << name;
    }
  }
}

TEST_P(DeepSpeedMoeTagTest, TheMoeAdapterTakesTheTagAndNamesEveryFileOfTheSave) {
  const std::string tag = kFixtures + "/" + GetParam() + "/global_step5";
  Result<const FrameworkAdapter*> adapter = DetectAdapter(tag);
  ASSERT_TRUE(adapter.ok()) << adapter.status().ToString();
  EXPECT_EQ((*adapter)->name(), "deepspeed-moe");
  Result<std::vector<std::string>> files = (*adapter)->ExpectedFiles(tag);
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  const int dp = GetParam().ends_with("dp4") ? 4 : 2;
  std::vector<std::string> expected = {"mp_rank_00_model_states.pt"};
  for (int r = 0; r < dp; ++r) {
    expected.push_back("zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt");
  }
  for (int layer = 0; layer < 2; ++layer) {
    for (int expert = 0; expert < 4; ++expert) {
      expected.push_back("layer_" + std::to_string(layer) + "_expert_" + std::to_string(expert) +
                         "_mp_rank_00_model_states.pt");
    }
  }
  for (int e = 0; e < 2; ++e) {
    expected.push_back("expp_rank_" + std::to_string(e) + "_mp_rank_00_optim_states.pt");
  }
  EXPECT_THAT(*files, ElementsAreArray(expected));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSpeedMoeTagTest,
                         ::testing::Values("moe_z1_fp32/dp4", "moe_z1_fp32/dp2", "moe_z2_fp32/dp4",
                                           "moe_z2_fp32/dp2"),
                         [](const auto& test_param) {
                           std::string name = test_param.param;
                           name[name.find('/')] = '_';
                           return name;
                         });

}  // namespace
}  // namespace ucp
