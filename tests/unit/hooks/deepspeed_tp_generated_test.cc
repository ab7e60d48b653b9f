// The deepspeed-tp adapter against tags tests/deepspeed/tp_generator.py writes in DeepSpeed's
// layout from one state of full tensors: fused QKV (parameter_with_sub_params), SwiGLU
// (parameter_with_2_sub_params_cat_dim_0), row-parallel, column-parallel by name, vocabulary,
// replicated and averaged parameters; the generator's tags at other (tp, dp) are the reshard
// oracles, its full tensors the atoms'.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "hooks/deepspeed_tp.h"
#include "tests/unit/hooks/deepspeed_testing.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;
using deepspeed_testing::NoSync;
using deepspeed_testing::RenderOf;
using deepspeed_testing::SegmentBytes;
using deepspeed_testing::TempDir;
using deepspeed_testing::TensorBytes;
using ::testing::HasSubstr;

const DeepSpeedTpAdapter& Adapter() {
  static const DeepSpeedTpAdapter adapter;
  return adapter;
}

class DeepSpeedTpGeneratedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const std::string command = std::string(UCP_PYTHON) + " " + UCP_SOURCE_DIR +
                                "/tests/deepspeed/tp_generator.py " + dir_->path();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Tag(const std::string& variant, const std::string& topology) {
    return dir_->path() + "/" + variant + "/" + topology + "/global_step5";
  }
  static std::string Full(const std::string& param, const std::string& state) {
    return dir_->path() + "/full/" + param + "/" + state + ".pt";
  }

  static TempDir* dir_;
};

TempDir* DeepSpeedTpGeneratedTest::dir_ = nullptr;

// Every fp32 and optimizer-state atom is the full tensor the TP slices were cut from (the
// vocabulary without its padding rows); the module's bit16 atoms hold the same fp32 weights.
TEST_F(DeepSpeedTpGeneratedTest, AtomsAreTheFullTensors) {
  const std::string tag = Tag("ok", "tp2dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  size_t compared = 0;
  for (const Atom& atom : index->atoms()) {
    if (atom.state == "step") continue;
    SCOPED_TRACE(atom.param + "/" + atom.state);
    const std::string state = atom.state == "bit16" ? "fp32" : atom.state;
    Result<TorchArchiveReader> full = TorchArchiveReader::Open(Full(atom.param, state));
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const TorchTensor* tensor = full->TensorAt(full->root());
    ASSERT_NE(tensor, nullptr);
    EXPECT_EQ(atom.shape, tensor->shape);
    Result<Region> whole = Region::Whole(atom.shape);
    ASSERT_TRUE(whole.ok());
    Result<std::vector<Segment>> segments = PlanRegion(*index, atom, *whole);
    ASSERT_TRUE(segments.ok()) << segments.status().ToString();
    EXPECT_TRUE(SegmentBytes(*index, tag, *segments) == TensorBytes(*full, *tensor));
    ++compared;
  }
  EXPECT_EQ(compared, 9u * 4u);

  const nlohmann::json& params = index->contents().adapter_state["tp"]["params"];
  const nlohmann::json& qkv = params["layers.0.attention.query_key_value.weight"];
  EXPECT_EQ(qkv["sub_params"], nlohmann::json::array({8, 4, 4}));
  EXPECT_EQ(qkv["universal"], "sub_param_shape");
  EXPECT_EQ(params["layers.0.mlp.gate_up.bias"]["sub_params"], nlohmann::json::array({10, 10}));
  EXPECT_EQ(params["layers.0.norm.weight"]["rule"], "averaged");
  EXPECT_EQ(params["extra.scale"]["rule"], "replicated");
  EXPECT_EQ(params["layers.0.mlp.dense_h_to_4h.weight"]["dim"], 0);
  EXPECT_EQ(index->contents().adapter_state["tp"]["vocab"],
            (nlohmann::json{{"original", 11}, {"padded", 16}, {"divisible_by", 4}}));
}

// The universal export writes ds_to_universal's keys for each rule.
TEST_F(DeepSpeedTpGeneratedTest, ExportWritesDsToUniversalsKeys) {
  const std::string tag = Tag("ok", "tp2dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanUniversalExport(*index, tag);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::map<std::string, std::vector<std::string>> keys;
  for (const ArchiveOutput& archive : plan->archives) {
    const pickle::Value* root = archive.graph.root();
    if (root->kind() != pickle::Kind::kDict) continue;
    for (const auto& [key, value] : root->entries()) keys[archive.path].push_back(KeyText(key));
  }
  using Keys = std::vector<std::string>;
  EXPECT_EQ(keys["zero/layers.0.attention.query_key_value.weight/fp32.pt"],
            (Keys{"sub_param_shape", "param"}));
  EXPECT_EQ(keys["zero/layers.0.mlp.gate_up.weight/exp_avg.pt"],
            (Keys{"cat_dim", "param_n_sub_params", "param"}));
  EXPECT_EQ(keys["zero/word_embeddings.weight/fp32.pt"],
            (Keys{"cat_dim", "vocab_tensor", "param"}));
  EXPECT_EQ(keys["zero/layers.0.norm.weight/fp32.pt"], (Keys{"param"}));
  for (const ArchiveOutput& archive : plan->archives) {
    if (archive.path != "zero/layers.0.attention.query_key_value.weight/fp32.pt") continue;
    EXPECT_THAT(RenderOf(archive.graph.root()->Get("sub_param_shape")),
                HasSubstr("deepspeed.checkpoint.universal_checkpoint"));
  }
}

// Resharding to another (tp, dp) and executing the plan writes the generator's own tag at that
// size: every object and every tensor's bytes.
TEST_F(DeepSpeedTpGeneratedTest, ReshardEqualsTheTagSavedAtTheTarget) {
  const std::string tag = Tag("ok", "tp2dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  for (const auto& [tp, dp] :
       std::vector<std::pair<uint32_t, uint32_t>>{{1, 2}, {2, 1}, {1, 1}, {2, 3}, {2, 2}}) {
    const std::string name = "tp" + std::to_string(tp) + "dp" + std::to_string(dp);
    SCOPED_TRACE(name);
    Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, Topology{dp, tp, 1, 0, 0});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const TempDir out;
    const Status status = ExecutePlan(*plan, *index, tag, out.path(), NoSync());
    ASSERT_TRUE(status.ok()) << status.ToString();
    const std::string oracle = Tag("ok", name);
    size_t files = 0;
    for (const fs::directory_entry& entry : fs::directory_iterator(oracle)) {
      const std::string file = entry.path().filename().string();
      SCOPED_TRACE(file);
      ++files;
      Result<TorchArchiveReader> want = TorchArchiveReader::Open(entry.path().string());
      Result<TorchArchiveReader> got = TorchArchiveReader::Open(out.path() + "/" + file);
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(RenderOf(got->root()), RenderOf(want->root()));
      ASSERT_EQ(got->tensors().size(), want->tensors().size());
      for (size_t i = 0; i < want->tensors().size(); ++i) {
        EXPECT_TRUE(TensorBytes(*got, got->tensors()[i]) == TensorBytes(*want, want->tensors()[i]))
            << "tensor " << i;
      }
    }
    EXPECT_EQ(files, plan->archives.size());
  }
}

// A parameter no rule covers whose TP slices differ is refused, named: ds_to_universal would
// concatenate it on dim 0.
TEST_F(DeepSpeedTpGeneratedTest, RefusesAnUncoveredParameterNamingIt) {
  Result<AtomIndex> index = Adapter().BuildIndex(Tag("uncovered", "tp2dp2"), {});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(index.status().message(), HasSubstr("extra.proj: no rule"));
}

// Averaged parameters whose slices differ have a mean in no file: refused, named.
TEST_F(DeepSpeedTpGeneratedTest, RefusesAveragedSlicesThatDiffer) {
  Result<AtomIndex> index = Adapter().BuildIndex(Tag("averaged_differs", "tp2dp2"), {});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(index.status().message(), HasSubstr("layers.0.norm.weight: averaged"));
}

}  // namespace
}  // namespace ucp::hooks
