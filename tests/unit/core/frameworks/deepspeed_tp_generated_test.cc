// The deepspeed-tp adapter against tags tests/deepspeed/tp_generator.py writes in DeepSpeed's
// layout from one state of full tensors: fused QKV (parameter_with_sub_params), SwiGLU
// (parameter_with_2_sub_params_cat_dim_0), row-parallel, column-parallel by name, vocabulary,
// replicated and averaged parameters; the generator's tags at other (tp, dp) are the reshard
// oracles, its full tensors the atoms'. TP=1 tags that carry universal_checkpoint_info split to
// TP=2 and TP=4; one without it is left to deepspeed-zero12, which refuses tp > 1.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/tp.h"
#include "core/frameworks/deepspeed/zero.h"
#include "core/frameworks/framework_adapter.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;
using deepspeed_testing::ExpectPlannedSizes;
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

// Every fp32 and optimizer-state atom of `index` (of `tag`) is the full tensor the TP slices were
// cut from (the vocabulary without its padding rows); the module's bit16 atoms hold the same fp32
// weights; `frozen` frozen parameters have a bit16 atom alone.
void ExpectAtomsAreTheFullTensors(
    const AtomIndex& index, const std::string& tag,
    const std::function<std::string(const std::string&, const std::string&)>& full_of,
    size_t frozen = 0) {
  size_t compared = 0;
  for (const Atom& atom : index.atoms()) {
    if (atom.state == "step") continue;
    SCOPED_TRACE(atom.param + "/" + atom.state);
    const std::string state = atom.state == "bit16" ? "fp32" : atom.state;
    Result<TorchArchiveReader> full = TorchArchiveReader::Open(full_of(atom.param, state));
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const TorchTensor* tensor = full->TensorAt(full->root());
    ASSERT_NE(tensor, nullptr);
    EXPECT_EQ(atom.shape, tensor->shape);
    Result<Region> whole = Region::Whole(atom.shape);
    ASSERT_TRUE(whole.ok());
    Result<std::vector<Segment>> segments = PlanRegion(index, atom, *whole);
    ASSERT_TRUE(segments.ok()) << segments.status().ToString();
    EXPECT_TRUE(SegmentBytes(index, tag, *segments) == TensorBytes(*full, *tensor));
    ++compared;
  }
  EXPECT_EQ(compared, 9u * 4u + frozen);
}

// Executing `plan` (a reshard of `index`, of `tag`) writes the files of `oracle`: every object and
// every tensor's bytes.
void ExpectPlanWritesTheTag(const OutputPlan& plan, const AtomIndex& index, const std::string& tag,
                            const std::string& oracle) {
  const TempDir out;
  const Status status = ExecutePlan(plan, index, tag, out.path(), NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(plan, index, out.path());
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
  EXPECT_EQ(files, plan.archives.size());
}

TEST_F(DeepSpeedTpGeneratedTest, AtomsAreTheFullTensors) {
  const std::string tag = Tag("ok", "tp2dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ExpectAtomsAreTheFullTensors(*index, tag, Full);

  const nlohmann::json& params = index->contents().adapter_state["tp"]["params"];
  const nlohmann::json& qkv = params["layers.0.attention.query_key_value.weight"];
  EXPECT_EQ(qkv["sub_params"], nlohmann::json::array({8, 4, 4}));
  EXPECT_EQ(qkv["universal"], "sub_param_shape");
  EXPECT_EQ(params["layers.0.mlp.gate_up.bias"]["sub_params"], nlohmann::json::array({8, 8}));
  EXPECT_EQ(params["layers.0.norm.weight"]["rule"], "averaged");
  EXPECT_EQ(params["extra.scale"]["rule"], "replicated");
  EXPECT_EQ(params["layers.0.mlp.dense_h_to_4h.weight"]["dim"], 0);
  EXPECT_EQ(index->contents().adapter_state["tp"]["vocab"],
            (nlohmann::json{{"original", 35}, {"padded", 40}, {"divisible_by", 4}}));
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
    ExpectPlanWritesTheTag(*plan, *index, tag, Tag("ok", name));
  }
}

// A TP=1 tag whose model states carry universal_checkpoint_info is this adapter's: its atoms are
// the full tensors, the vocabulary's divisible_by is inferred from 35 rows padded to 36 (2 and 4
// fit; the largest, 4, pads to 40 at TP=2 and 48 at TP=4), and it splits to TP=2 and TP=4 at any DP
// size (fused QKV, SwiGLU, row-parallel, vocabulary, replicated and averaged parameters) as the
// generator's own tags.
TEST_F(DeepSpeedTpGeneratedTest, SplitsATp1TagToTp2AndTp4) {
  for (const char* source : {"tp1dp2", "tp1dp1"}) {
    SCOPED_TRACE(source);
    const std::string tag = Tag("ruled", source);
    Result<const FrameworkAdapter*> detected = DetectAdapter(tag);
    ASSERT_TRUE(detected.ok()) << detected.status().ToString();
    EXPECT_EQ((*detected)->name(), DeepSpeedTpAdapter::kName);
    Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    ExpectAtomsAreTheFullTensors(*index, tag, Full);
    EXPECT_EQ(index->contents().adapter_state["tp"]["vocab"],
              (nlohmann::json{{"original", 35}, {"padded", 36}, {"divisible_by", 4}}));
    for (const auto& [tp, dp] : std::vector<std::pair<uint32_t, uint32_t>>{
             {2, 2}, {2, 1}, {4, 2}, {4, 1}, {1, 1}, {1, 2}}) {
      const std::string name = "tp" + std::to_string(tp) + "dp" + std::to_string(dp);
      SCOPED_TRACE(name);
      Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, Topology{dp, tp, 1, 0, 0});
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      ExpectPlanWritesTheTag(*plan, *index, tag, Tag("ruled", name));
    }
  }
}

// And back: TP=4 merges to TP=1 as the generator's TP=1 tag.
TEST_F(DeepSpeedTpGeneratedTest, MergesTp4ToTp1) {
  const std::string tag = Tag("ruled", "tp4dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, Topology{2, 1, 1, 0, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectPlanWritesTheTag(*plan, *index, tag, Tag("ruled", "tp1dp2"));
}

// At TP=1 a parameter no pattern names has one slice: nothing says whether it is split or
// replicated. It is copied at TP=1 (exported with ds_to_universal's 'cat_dim': 0) and a TP=2
// target is refused, naming it.
TEST_F(DeepSpeedTpGeneratedTest, RefusesToSplitAnUnnamedParameterOfATp1Tag) {
  const std::string tag = Tag("ok", "tp1dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->contents().adapter_state["tp"]["params"]["extra.scale"]["rule"], "unnamed");
  Result<OutputPlan> same = Adapter().PlanReshard(*index, tag, Topology{1, 1, 1, 0, 0});
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  ExpectPlanWritesTheTag(*same, *index, tag, Tag("ok", "tp1dp1"));
  Result<OutputPlan> split = Adapter().PlanReshard(*index, tag, Topology{2, 2, 1, 0, 0});
  EXPECT_EQ(split.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(split.status().message(), HasSubstr("tp=2: extra.scale: no rule"));
  Result<OutputPlan> exported = Adapter().PlanUniversalExport(*index, tag);
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();
  size_t found = 0;
  for (const ArchiveOutput& archive : exported->archives) {
    if (archive.path != "zero/extra.scale/fp32.pt") continue;
    ++found;
    std::vector<std::string> keys;
    for (const auto& [key, value] : archive.graph.root()->entries()) keys.push_back(KeyText(key));
    EXPECT_EQ(keys, (std::vector<std::string>{"cat_dim", "param"}));
  }
  EXPECT_EQ(found, 1u);
}

// A save may be committed before its other TP ranks' files are written: TP rank 0's files alone
// are named as a TP=1 tag's, and only its model states (mp_world_size 2) tell the tag this
// adapter's, as the whole tag is, though it carries no universal_checkpoint_info. Before the
// model states are written the files read as a TP=1 ZeRO tag's.
TEST_F(DeepSpeedTpGeneratedTest, TpRankZerosFilesAloneAreThisAdapters) {
  const DeepSpeedZeroAdapter zero12;
  const std::string whole = Tag("no_info", "tp2dp2");
  const TempDir partial;
  const std::string optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt";
  fs::create_symlink(whole + "/" + optim, partial.path() + "/" + optim);
  EXPECT_FALSE(Adapter().Recognizes(partial.path()));
  EXPECT_TRUE(zero12.Recognizes(partial.path()));

  const std::string model = "mp_rank_00_model_states.pt";
  fs::create_symlink(whole + "/" + model, partial.path() + "/" + model);
  for (const std::string& tag : {partial.path(), whole}) {
    EXPECT_TRUE(Adapter().Recognizes(tag)) << tag;
    EXPECT_FALSE(zero12.Recognizes(tag)) << tag;
    Result<const FrameworkAdapter*> detected = DetectAdapter(tag);
    ASSERT_TRUE(detected.ok()) << detected.status().ToString();
    EXPECT_EQ((*detected)->name(), DeepSpeedTpAdapter::kName);
  }
}

// A TP=1 tag without universal_checkpoint_info is deepspeed-zero12's, which refuses tp > 1
// saying why; this adapter refuses to read it. An index deepspeed-zero12 built of a tag that
// carries the rules (before this adapter read TP=1 tags) asks to be rebuilt.
TEST_F(DeepSpeedTpGeneratedTest, LeavesATp1TagWithoutRulesToZero12) {
  const DeepSpeedZeroAdapter zero12;
  const std::string tag = Tag("no_info", "tp1dp2");
  EXPECT_FALSE(Adapter().Recognizes(tag));
  Result<const FrameworkAdapter*> detected = DetectAdapter(tag);
  ASSERT_TRUE(detected.ok()) << detected.status().ToString();
  EXPECT_EQ((*detected)->name(), DeepSpeedZeroAdapter::kName);
  Result<AtomIndex> mine = Adapter().BuildIndex(tag, {});
  EXPECT_EQ(mine.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(mine.status().message(), HasSubstr("without universal_checkpoint_info"));

  Result<AtomIndex> index = zero12.BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> split = zero12.PlanReshard(*index, tag, Topology{2, 2, 1, 0, 0});
  EXPECT_EQ(split.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(
      split.status().message(),
      HasSubstr("tp=2: " + tag + "/mp_rank_00_model_states.pt: no universal_checkpoint_info"));

  const std::string ruled = Tag("ruled", "tp1dp2");
  Result<AtomIndex> old = zero12.BuildIndex(ruled, {});
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  Result<OutputPlan> stale = zero12.PlanReshard(*old, ruled, Topology{2, 2, 1, 0, 0});
  EXPECT_EQ(stale.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.status().message(), HasSubstr("rebuild it"));
}

// Frozen parameters are in each TP rank's module alone (not in param_shapes, their own tensors):
// the split ones (row-parallel by pattern, column-parallel by Megatron's name) are indexed as their
// bit16 atoms, the full tensors, and written at every target's slices; the norm every rank holds
// whole is carried. From TP=2 and from TP=1 each reshard is the generator's tag at the target.
TEST_F(DeepSpeedTpGeneratedTest, FrozenParametersSplitOverTpRanksAreWrittenAtTheTargetsSlices) {
  const std::vector<std::string> split = {"layers.1.attention.dense.weight",
                                          "layers.1.mlp.dense_h_to_4h.weight"};
  for (const char* source : {"tp2dp2", "tp1dp2"}) {
    SCOPED_TRACE(source);
    const std::string tag = Tag("frozen", source);
    Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    EXPECT_EQ(index->contents().adapter_state["tp"]["frozen"], nlohmann::json(split));
    for (const std::string& name : split) {
      EXPECT_NE(index->Find(name, "bit16"), nullptr) << name;
      EXPECT_EQ(index->Find(name, "fp32"), nullptr) << name;
    }
    EXPECT_EQ(index->Find("layers.1.frozen_norm.weight", "bit16"), nullptr);
    ExpectAtomsAreTheFullTensors(*index, tag, Full, split.size());
    for (const char* target : {"tp2dp2", "tp1dp2", "tp4dp1"}) {
      SCOPED_TRACE(target);
      const Topology to = std::string(target) == "tp2dp2"   ? Topology{2, 2, 1, 0, 0}
                          : std::string(target) == "tp1dp2" ? Topology{2, 1, 1, 0, 0}
                                                            : Topology{1, 4, 1, 0, 0};
      Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, to);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      ExpectPlanWritesTheTag(*plan, *index, tag, Tag("frozen", target));
    }
  }
}

// A frozen parameter whose TP slices differ and that no rule splits cannot be placed at another
// size: refused, named.
TEST_F(DeepSpeedTpGeneratedTest, RefusesAnUncoveredFrozenParameterNamingIt) {
  Result<AtomIndex> index = Adapter().BuildIndex(Tag("frozen_uncovered", "tp2dp2"), {});
  ASSERT_FALSE(index.ok());
  EXPECT_EQ(index.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(index.status().message(),
              HasSubstr("module/extra.frozen_proj: not in param_shapes (a frozen parameter or a "
                        "buffer), its TP slices differ"));
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
}  // namespace ucp
