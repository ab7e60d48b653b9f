// DeepSpeed-MoE tags (the fixtures moe_z1_fp32 and moe_z2_fp32, written by DeepSpeed v0.14.5):
// no adapter reads the experts' placement yet, so every DeepSpeed adapter refuses them, naming the
// tag and an expert file, before it reads any file (their model states hold none of the fields a
// ZeRO tag's do: no ds_version, no param_shapes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "core/frameworks/framework_adapter.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;

const std::string kFixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";

class DeepSpeedMoeRefusalTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeepSpeedMoeRefusalTest, EveryAdapterRefusesTheTagNamingAnExpertFile) {
  const std::string tag = kFixtures + "/" + GetParam() + "/global_step5";
  for (const std::string name :
       {"deepspeed-zero12", "deepspeed-zero3", "deepspeed-pipe", "deepspeed-tp"}) {
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

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSpeedMoeRefusalTest,
                         ::testing::Values("moe_z1_fp32/dp4", "moe_z1_fp32/dp2", "moe_z2_fp32/dp4",
                                           "moe_z2_fp32/dp2"),
                         [](const auto& test_param) {
                           std::string name = test_param.param;
                           name[name.find('/')] = '_';
                           return name;
                         });

}  // namespace
}  // namespace ucp
