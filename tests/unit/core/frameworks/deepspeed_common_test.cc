// Tests core/frameworks/deepspeed/common.cc: OrderStatesAs, which lets the optimizer files of a
// save made after DeepSpeed's universal load (its per-parameter states in no fixed key order) be
// read as one save; ChoosePartition, which places a pipeline's layers at another pp by the
// partition methods that reproduce the saved stages (expected bounds: DeepSpeed 0.19's
// partition_uniform and partition_balanced on the same weights).
#include "core/frameworks/deepspeed/common.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace ucp::deepspeed {
namespace {

std::vector<std::string> Keys(const std::vector<StateTensor>& states) {
  std::vector<std::string> keys;
  for (const StateTensor& st : states) keys.push_back(st.key);
  return keys;
}

TEST(DeepSpeedCommonTest, OrderStatesAsTakesTheReferenceOrderOfTheSameKeys) {
  TorchTensor step, exp_avg, exp_avg_sq;
  const std::vector<StateTensor> reference = {
      {"step", &step}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  std::vector<StateTensor> states = {
      {"step", &step}, {"exp_avg_sq", &exp_avg_sq}, {"exp_avg", &exp_avg}};
  OrderStatesAs(states, reference);
  EXPECT_EQ(Keys(states), Keys(reference));
  EXPECT_EQ(states[1].tensor, &exp_avg);  // each key keeps its own tensor
  EXPECT_EQ(states[2].tensor, &exp_avg_sq);
}

TEST(DeepSpeedCommonTest, OrderStatesAsLeavesOtherKeysForTheCheckToName) {
  TorchTensor a, b, c;
  const std::vector<StateTensor> reference = {{"exp_avg", &a}, {"exp_avg_sq", &b}};
  std::vector<StateTensor> other = {{"exp_avg_sq", &b}, {"momentum_buffer", &c}};
  OrderStatesAs(other, reference);
  EXPECT_EQ(Keys(other), (std::vector<std::string>{"exp_avg_sq", "momentum_buffer"}));
  std::vector<StateTensor> fewer = {{"exp_avg_sq", &b}};
  OrderStatesAs(fewer, reference);
  EXPECT_EQ(Keys(fewer), (std::vector<std::string>{"exp_avg_sq"}));
}

// Six layers saved on two stages, three each.
const std::map<uint64_t, uint32_t> kThreeAndThree = {{0, 0}, {1, 0}, {2, 0},
                                                     {3, 1}, {4, 1}, {5, 1}};

// DeepSpeed's _round_robin_reorder over 2 ranks takes the optimizer's parameters 0, 2, 4, then
// 1, 3; a save at 2 ranks read back to the optimizer's order and laid out at 3 ranks is the
// order a save at 3 ranks has.
TEST(DeepSpeedCommonTest, RoundRobinOrdersGoBetweenDpSizesThroughTheOptimizersOrder) {
  const std::vector<std::string> optimizer = {"a", "b", "c", "d", "e"};
  const std::vector<std::string> at2 = InRoundRobinOrder(optimizer, 2);
  EXPECT_EQ(at2, (std::vector<std::string>{"a", "c", "e", "b", "d"}));
  EXPECT_EQ(InOptimizerOrder(at2, 2), optimizer);
  EXPECT_EQ(InRoundRobinOrder(InOptimizerOrder(at2, 2), 3),
            (std::vector<std::string>{"a", "d", "b", "e", "c"}));
  EXPECT_EQ(InRoundRobinOrder(optimizer, 1), optimizer);
  EXPECT_EQ(InRoundRobinOrder(optimizer, 8), optimizer);
}

TEST(DeepSpeedCommonTest, ChoosePartitionPlacesByTheMethodThatGivesTheSavedStages) {
  // 'uniform' gives [0, 3, 6]; weights heavy at the front give [0, 1, 6] and are no candidate.
  const std::vector<PartitionMethod> methods = {
      {LayerPartition::kUniform, "'uniform'", {}, {}},
      {LayerPartition::kParameters, "'parameters'", {9, 9, 1, 1, 1, 1}, {}}};
  const Result<ChosenPartition> chosen =
      ChoosePartition(6, kThreeAndThree, methods, 2, 3, LayerPartition::kInferred);
  ASSERT_TRUE(chosen.ok()) << chosen.status().ToString();
  EXPECT_EQ(chosen->bounds, (std::vector<uint64_t>{0, 2, 4, 6}));
  EXPECT_EQ(chosen->method, "'uniform'");
}

TEST(DeepSpeedCommonTest, ChoosePartitionRefusesMethodsThatAgreeAtTheSourceButNotAtTheTarget) {
  // Both give [0, 3, 6] at pp=2; at pp=4 'uniform' gives [0, 2, 4, 5, 6], the weights
  // [0, 2, 3, 4, 6].
  const std::vector<uint64_t> weights = {1, 4, 4, 4, 4, 1};
  const std::vector<PartitionMethod> methods = {
      {LayerPartition::kUniform, "'uniform'", {}, {}},
      {LayerPartition::kParameters, "'parameters'", weights, weights}};
  const Result<ChosenPartition> chosen =
      ChoosePartition(6, kThreeAndThree, methods, 2, 4, LayerPartition::kInferred);
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(chosen.status().message().find("ambiguous layer placement: 'uniform' [0, 2, 4, 5, 6] "
                                           "and 'parameters' [0, 2, 3, 4, 6]"),
            std::string::npos)
      << chosen.status().ToString();
  // At pp=3 they agree ([0, 2, 4, 6]): no ambiguity.
  const Result<ChosenPartition> three =
      ChoosePartition(6, kThreeAndThree, methods, 2, 3, LayerPartition::kInferred);
  ASSERT_TRUE(three.ok()) << three.status().ToString();
  EXPECT_EQ(three->bounds, (std::vector<uint64_t>{0, 2, 4, 6}));
}

TEST(DeepSpeedCommonTest, ChoosePartitionWeighsTheSourceAndTheTargetEachByItsOwnWeights) {
  // An MoE layer's local experts differ with E: at the source [1, 1, 1, 1] gives the saved
  // [0, 2, 4]; the target's [3, 1, 1, 1] places [0, 1, 4].
  const std::map<uint64_t, uint32_t> saved = {{0, 0}, {1, 0}, {2, 1}, {3, 1}};
  const std::vector<PartitionMethod> methods = {
      {LayerPartition::kParameters, "'parameters'", {1, 1, 1, 1}, {3, 1, 1, 1}}};
  const Result<ChosenPartition> chosen =
      ChoosePartition(4, saved, methods, 2, 2, LayerPartition::kInferred);
  ASSERT_TRUE(chosen.ok()) << chosen.status().ToString();
  EXPECT_EQ(chosen->bounds, (std::vector<uint64_t>{0, 1, 4}));
}

TEST(DeepSpeedCommonTest, ChoosePartitionRefusesWhenNoMethodGivesTheSavedStages) {
  const std::map<uint64_t, uint32_t> saved = {{0, 0}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}};
  const Result<ChosenPartition> chosen = ChoosePartition(
      6, saved, {{LayerPartition::kUniform, "'uniform'", {}, {}}}, 2, 3, LayerPartition::kInferred);
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(chosen.status().message().find("no partition method DeepSpeed has gives the saved "
                                           "stages at pp=2 over 6 layers ('uniform' [0, 3, 6])"),
            std::string::npos)
      << chosen.status().ToString();
}

TEST(DeepSpeedCommonTest, ChoosePartitionTakesTheMethodTheUserNames) {
  // The ambiguous case above, told: each named method places the layers its own way.
  const std::vector<uint64_t> weights = {1, 4, 4, 4, 4, 1};
  const std::vector<PartitionMethod> methods = {
      {LayerPartition::kUniform, "'uniform'", {}, {}},
      {LayerPartition::kParameters, "'parameters'", weights, weights}};
  const Result<ChosenPartition> uniform =
      ChoosePartition(6, kThreeAndThree, methods, 2, 4, LayerPartition::kUniform);
  ASSERT_TRUE(uniform.ok()) << uniform.status().ToString();
  EXPECT_EQ(uniform->bounds, (std::vector<uint64_t>{0, 2, 4, 5, 6}));
  const Result<ChosenPartition> parameters =
      ChoosePartition(6, kThreeAndThree, methods, 2, 4, LayerPartition::kParameters);
  ASSERT_TRUE(parameters.ok()) << parameters.status().ToString();
  EXPECT_EQ(parameters->bounds, (std::vector<uint64_t>{0, 2, 3, 4, 6}));
  // A named method that does not give the saved stages is refused, naming its placement.
  const std::vector<PartitionMethod> heavy = {
      {LayerPartition::kParameters, "'parameters'", {9, 9, 1, 1, 1, 1}, {}}};
  const Result<ChosenPartition> refused =
      ChoosePartition(6, kThreeAndThree, heavy, 2, 4, LayerPartition::kParameters);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("partition=parameters does not give the saved stages "
                                            "at pp=2 over 6 layers ('parameters' [0, 1, 6])"),
            std::string::npos)
      << refused.status().ToString();
  // No kind of layer repeats: nothing for partition=type.
  const Result<ChosenPartition> no_type =
      ChoosePartition(6, kThreeAndThree, methods, 2, 4, LayerPartition::kType);
  ASSERT_FALSE(no_type.ok());
  EXPECT_NE(no_type.status().message().find("(no kind of layer repeats)"), std::string::npos)
      << no_type.status().ToString();
}

TEST(DeepSpeedCommonTest, TypeMethodsWeighEachKindOfAtLeastTwoLayers) {
  const std::map<uint64_t, std::string> signature = {
      {0, "embed"}, {1, "block"}, {2, "block"}, {3, "block"}, {4, "head"}};
  const std::vector<PartitionMethod> methods = TypeMethods(signature, 5);
  ASSERT_EQ(methods.size(), 1u);  // the embedding and the head are kinds of one layer
  EXPECT_EQ(methods[0].name, "'type:' (the kind of layer 1)");
  EXPECT_EQ(methods[0].source_weights, (std::vector<uint64_t>{0, 1, 1, 1, 0}));
  EXPECT_EQ(methods[0].target_weights, methods[0].source_weights);
}

}  // namespace
}  // namespace ucp::deepspeed
