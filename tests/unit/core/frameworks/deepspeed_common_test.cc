// Tests core/frameworks/deepspeed/common.cc: OrderStatesAs, which lets the optimizer files of a
// save made after DeepSpeed's universal load (its per-parameter states in no fixed key order) be
// read as one save.
#include "core/frameworks/deepspeed/common.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ucp::deepspeed
