// Tests core/frameworks/deepspeed/file_names.cc: the one list of DeepSpeed's file names, parsed
// and written.
#include "core/frameworks/deepspeed/file_names.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

namespace ucp::deepspeed {
namespace {

TEST(DeepSpeedFileNamesTest, ParsesEveryKindDeepSpeedWrites) {
  struct Case {
    std::string name;
    FileKind kind;
    std::string prefix;
    uint32_t dp, mp, layer, expert;
    std::optional<uint32_t> model_rank = std::nullopt;
  };
  const std::vector<Case> cases = {
      {"mp_rank_03_model_states.pt", FileKind::kModelStates, "", 0, 3, 0, 0},
      // %02d prints a third digit from mp rank 100 on (tp × pp > 100).
      {"mp_rank_127_model_states.pt", FileKind::kModelStates, "", 0, 127, 0, 0},
      {"zero_pp_rank_12_mp_rank_01_model_states.pt", FileKind::kZero3ModelStates, "", 12, 1, 0, 0},
      {"zero_pp_rank_7_mp_rank_00_optim_states.pt", FileKind::kOptimStates, "", 7, 0, 0, 0},
      {"bf16_zero_pp_rank_4095_mp_rank_02_optim_states.pt", FileKind::kOptimStates, "bf16_", 4095,
       2, 0, 0},
      {"expp_rank_1_mp_rank_00_optim_states.pt", FileKind::kExpertOptimStates, "", 1, 0, 0, 0},
      {"layer_1_expert_3_mp_rank_00_model_states.pt", FileKind::kExpertModelStates, "", 0, 0, 1, 3},
      {"layer_05-model_states.pt", FileKind::kLayerStates, "", 0, 0, 5, 0},
      {"layer_17-model_01-model_states.pt", FileKind::kLayerStates, "", 0, 0, 17, 0, 1},
      {"layer_123-model_00-model_states.pt", FileKind::kLayerStates, "", 0, 0, 123, 0, 0},
      // A grid with an axis besides model: the layer, no TP rank.
      {"layer_02-model_01-seq_00-model_states.pt", FileKind::kLayerStates, "", 0, 0, 2, 0},
  };
  for (const Case& c : cases) {
    const std::optional<FileName> parsed = ParseFileName(c.name);
    ASSERT_TRUE(parsed.has_value()) << c.name;
    EXPECT_EQ(parsed->kind, c.kind) << c.name;
    EXPECT_EQ(parsed->prefix, c.prefix) << c.name;
    EXPECT_EQ(parsed->dp, c.dp) << c.name;
    EXPECT_EQ(parsed->mp, c.mp) << c.name;
    EXPECT_EQ(parsed->layer, c.layer) << c.name;
    EXPECT_EQ(parsed->expert, c.expert) << c.name;
    EXPECT_EQ(parsed->model_rank, c.model_rank) << c.name;
  }
}

TEST(DeepSpeedFileNamesTest, RejectsLookAlikes) {
  for (const std::string name : {
           "mp_rank_0_model_states.pt",  // the mp rank has two digits or more
           "mp_rank_00_model_states.pth",
           "mp_rank_00_model_states.pt.tmp",
           "xmp_rank_00_model_states.pt",
           "zero_pp_rank_a_mp_rank_00_optim_states.pt",
           "fp16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "bf16_zero_pp_rank_0_mp_rank_00_model_states.pt",  // only optimizer files are bf16_
           "layer_5-model_states.pt",                         // the layer has two digits or more
           "layer_05-model_states",
           "latest",
           "zero_pp_rank_1234567890_mp_rank_00_optim_states.pt",  // more than 9 digits
           "",
       }) {
    EXPECT_FALSE(ParseFileName(name).has_value()) << name;
  }
}

TEST(DeepSpeedFileNamesTest, WrittenNamesParseBackToTheirNumbers) {
  for (const uint32_t mp : {0u, 7u, 99u, 100u, 511u}) {
    const std::optional<FileName> model = ParseFileName(ModelStatesName(mp));
    ASSERT_TRUE(model.has_value()) << ModelStatesName(mp);
    EXPECT_EQ(model->kind, FileKind::kModelStates);
    EXPECT_EQ(model->mp, mp);
    for (const uint32_t dp : {0u, 3u, 4095u}) {
      const std::optional<FileName> zero3 = ParseFileName(Zero3ModelStatesName(dp, mp));
      ASSERT_TRUE(zero3.has_value()) << Zero3ModelStatesName(dp, mp);
      EXPECT_EQ(zero3->kind, FileKind::kZero3ModelStates);
      EXPECT_EQ(zero3->dp, dp);
      EXPECT_EQ(zero3->mp, mp);
      for (const std::string prefix : {"", "bf16_"}) {
        const std::optional<FileName> optim = ParseFileName(OptimName(prefix, dp, mp));
        ASSERT_TRUE(optim.has_value()) << OptimName(prefix, dp, mp);
        EXPECT_EQ(optim->kind, FileKind::kOptimStates);
        EXPECT_EQ(optim->prefix, prefix);
        EXPECT_EQ(optim->dp, dp);
        EXPECT_EQ(optim->mp, mp);
      }
    }
  }
  EXPECT_EQ(ModelStatesName(3), "mp_rank_03_model_states.pt");
  EXPECT_EQ(OptimName("bf16_", 12, 1), "bf16_zero_pp_rank_12_mp_rank_01_optim_states.pt");
  EXPECT_EQ(LayerStatesName(4), "layer_04-model_states.pt");
  const std::optional<FileName> layer = ParseFileName(LayerStatesName(140));
  ASSERT_TRUE(layer.has_value());
  EXPECT_EQ(layer->layer, 140u);
  EXPECT_EQ(layer->model_rank, std::nullopt);
  EXPECT_EQ(TpLayerStatesName(3, 1), "layer_03-model_01-model_states.pt");
  const std::optional<FileName> tp_layer = ParseFileName(TpLayerStatesName(140, 127));
  ASSERT_TRUE(tp_layer.has_value());
  EXPECT_EQ(tp_layer->layer, 140u);
  EXPECT_EQ(tp_layer->model_rank, 127u);
}

TEST(DeepSpeedFileNamesTest, NumberedLayersAndDecimals) {
  EXPECT_EQ(NumberedLayer("2.self_attention.dense.weight"), 2u);
  EXPECT_EQ(NumberedLayer("17.weight"), 17u);
  EXPECT_EQ(NumberedLayer("tied_modules.embed.word_embeddings.weight"), std::nullopt);
  EXPECT_EQ(NumberedLayer("2a.weight"), std::nullopt);
  EXPECT_EQ(NumberedLayer("1234567890.weight"), std::nullopt);  // more than 9 digits
  EXPECT_EQ(NumberedLayer("weight"), std::nullopt);
  EXPECT_EQ(Decimal("007"), 7u);
  EXPECT_EQ(Decimal(""), std::nullopt);
  EXPECT_EQ(Decimal("-1"), std::nullopt);
}

}  // namespace
}  // namespace ucp::deepspeed
