#include "core/frameworks/deepspeed/tp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/tp_shards.h"
#include "core/frameworks/framework_adapter.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;
using deepspeed_testing::ExpectExportPlanLikeDsToUniversal;
using deepspeed_testing::ExpectPlannedSizes;
using deepspeed_testing::NoSync;
using deepspeed_testing::ReadBytes;
using deepspeed_testing::RenderOf;
using deepspeed_testing::SegmentBytes;
using deepspeed_testing::StorageKey;
using deepspeed_testing::TempDir;
using deepspeed_testing::TensorBytes;
using deepspeed_testing::TensorMeta;
using ::testing::HasSubstr;

const std::string kFixture = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed/tp2_z1_fp32";
const std::string kTag = kFixture + "/tp2dp2/global_step5";

const DeepSpeedTpAdapter& Adapter() {
  static const DeepSpeedTpAdapter adapter;
  return adapter;
}

// Every fp32 / optimizer-state / step atom, assembled by the planner from the TP × DP rank
// files, equals the tensor ds_to_universal wrote for it (merged over TP, the vocabulary cut to
// its real rows), with ds_to_universal's cat_dim and vocab_tensor; the export plan has
// ds_to_universal's files and object trees.
TEST(DeepSpeedTpFixtureTest, AtomsAndExportMatchDsToUniversal) {
  const std::string universal = kTag + "_universal";
  ASSERT_TRUE(Adapter().Recognizes(kTag));
  Result<AtomIndex> index = Adapter().BuildIndex(kTag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->contents().topology, (Topology{2, 2, 1, 4, 1}));
  EXPECT_EQ(index->files().size(), 2u + 4u);

  std::set<std::string> states;
  size_t vocab_tensors = 0;
  std::set<std::string> cat_dims;
  for (const Atom& atom : index->atoms()) {
    states.insert(atom.state);
    if (atom.state == "bit16") continue;
    SCOPED_TRACE(atom.param + "/" + atom.state);
    Result<TorchArchiveReader> oracle =
        TorchArchiveReader::Open(universal + "/zero/" + atom.param + "/" + atom.state + ".pt");
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    const pickle::Value* node = oracle->root();
    if (atom.state != "step") {
      if (const pickle::Value* cat_dim = node->Get("cat_dim")) {
        cat_dims.insert(atom.param + ":" + RenderOf(cat_dim));
      }
      if (node->Get("vocab_tensor") != nullptr) ++vocab_tensors;
      node = node->Get("param");
    }
    const TorchTensor* tensor = oracle->TensorAt(node);
    ASSERT_NE(tensor, nullptr);
    EXPECT_EQ(tensor->shape, atom.shape);
    EXPECT_EQ(tensor->dtype, atom.dtype);
    Result<Region> whole = Region::Whole(atom.shape);
    ASSERT_TRUE(whole.ok());
    Result<std::vector<Segment>> segments = PlanRegion(*index, atom, *whole);
    ASSERT_TRUE(segments.ok()) << segments.status().ToString();
    EXPECT_TRUE(SegmentBytes(*index, kTag, *segments) == TensorBytes(*oracle, *tensor));
  }
  EXPECT_EQ(states, (std::set<std::string>{"fp32", "exp_avg", "exp_avg_sq", "step", "bit16"}));
  // word_embeddings and output_layer, three states each.
  EXPECT_EQ(vocab_tensors, 6u);
  EXPECT_TRUE(cat_dims.contains("layers.0.attention.dense.weight:1"));
  EXPECT_TRUE(cat_dims.contains("layers.1.mlp.dense_h_to_4h.weight:0"));
  EXPECT_FALSE(cat_dims.contains("position_embeddings.weight:0"));

  ExpectExportPlanLikeDsToUniversal(Adapter(), *index, kTag, universal);
}

// The shard maps the index states for each kind of parameter.
TEST(DeepSpeedTpFixtureTest, IndexStatesTheShardMaps) {
  Result<AtomIndex> index = Adapter().BuildIndex(kTag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  const nlohmann::json& tp = index->contents().adapter_state["tp"];
  EXPECT_EQ(tp["degree"], 2);
  EXPECT_EQ(tp["vocab"], (nlohmann::json{{"original", 67}, {"padded", 72}, {"divisible_by", 4}}));
  const nlohmann::json& params = tp["params"];
  EXPECT_EQ(params["position_embeddings.weight"], (nlohmann::json{{"rule", "replicated"}}));
  EXPECT_EQ(params["word_embeddings.weight"]["sub_params"], nlohmann::json::array({72}));
  EXPECT_EQ(params["word_embeddings.weight"]["vocab"], true);
  EXPECT_EQ(params["layers.1.attention.dense.weight"]["dim"], 1);
  EXPECT_EQ(params["layers.1.attention.query_key_value.weight"]["dim"], 0);
  EXPECT_EQ(params["layers.1.attention.query_key_value.weight"]["sub_params"],
            nlohmann::json::array({144}));
}

class DeepSpeedTpResaveTest : public ::testing::TestWithParam<std::string> {};

// PlanReshard to (tp, dp) describes DeepSpeed's own files saved after a universal load at that
// size: every optimizer object tree is identical and every partition tensor holds the same bytes;
// the model states differ only in ds_config (the new run's) and hold the same module values.
TEST_P(DeepSpeedTpResaveTest, ReshardMatchesDeepSpeedsOwnSave) {
  const std::string resave_case = GetParam();
  const uint32_t tp = static_cast<uint32_t>(resave_case[2] - '0');
  const uint32_t dp = static_cast<uint32_t>(resave_case[5] - '0');
  const std::string oracle_tag = kFixture + "/resaved/" + resave_case + "/global_step5";
  Result<AtomIndex> index = Adapter().BuildIndex(kTag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanReshard(*index, kTag, Topology{dp, tp, 1, dp * tp, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->archives.size(), tp + tp * dp);

  std::set<std::string> oracle_files;
  for (const fs::directory_entry& entry : fs::directory_iterator(oracle_tag)) {
    oracle_files.insert(entry.path().filename().string());
  }
  std::set<std::string> planned;
  for (const ArchiveOutput& archive : plan->archives) planned.insert(archive.path);
  EXPECT_EQ(planned, oracle_files);

  for (const ArchiveOutput& archive : plan->archives) {
    SCOPED_TRACE(archive.path);
    Result<TorchArchiveReader> oracle = TorchArchiveReader::Open(oracle_tag + "/" + archive.path);
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    const pickle::Value* root = archive.graph.root();
    std::map<std::string, std::string> storage_bytes;
    for (const OutputStorage& storage : archive.storages) {
      storage_bytes[storage.key] = SegmentBytes(*index, kTag, storage.segments);
    }
    if (archive.path.find("model_states") != std::string::npos) {
      for (const auto& [key, value] : root->entries()) {
        const std::string name = KeyText(key);
        if (name == "ds_config" || name == "module") continue;
        EXPECT_EQ(RenderOf(value), RenderOf(oracle->root()->Get(name))) << name;
      }
      size_t items = 0;
      for (const pickle::Mutation& item : root->Get("module")->mutations()) {
        if (item.op != pickle::Mutation::Op::kSetItem) continue;
        ++items;
        const std::string name = KeyText(item.first);
        Result<const pickle::Value*> oracle_node = oracle->Find("module/" + name);
        ASSERT_TRUE(oracle_node.ok()) << name;
        const TorchTensor* want = oracle->TensorAt(*oracle_node);
        ASSERT_NE(want, nullptr) << name;
        // Same view (storage size, offset, shape, stride, requires_grad) of the same bytes.
        EXPECT_EQ(TensorMeta(item.second), TensorMeta(*oracle_node)) << name;
        const std::string& bytes = storage_bytes[StorageKey(item.second)];
        EXPECT_TRUE(bytes == ReadBytes(oracle->path(), want->storage->offset, want->storage->size))
            << name;
      }
      size_t oracle_items = 0;
      for (const pickle::Mutation& item : oracle->root()->Get("module")->mutations()) {
        oracle_items += item.op == pickle::Mutation::Op::kSetItem ? 1 : 0;
      }
      EXPECT_EQ(items, oracle_items);
      continue;
    }
    const pickle::Value* osd = root->Get("optimizer_state_dict");
    const pickle::Value* oracle_osd = oracle->root()->Get("optimizer_state_dict");
    ASSERT_NE(osd, nullptr);
    ASSERT_NE(oracle_osd, nullptr);
    ASSERT_EQ(osd->entries().size(), oracle_osd->entries().size());
    for (size_t i = 0; i < osd->entries().size(); ++i) {
      const std::string name = KeyText(osd->entries()[i].first);
      ASSERT_EQ(name, KeyText(oracle_osd->entries()[i].first));
      if (name == "base_optimizer_state") continue;
      EXPECT_EQ(RenderOf(osd->entries()[i].second), RenderOf(oracle_osd->entries()[i].second))
          << name;
    }
    EXPECT_EQ(RenderOf(osd->Get("base_optimizer_state")->Get("param_groups")),
              RenderOf(oracle_osd->Get("base_optimizer_state")->Get("param_groups")));
    std::vector<std::pair<std::string, const pickle::Value*>> tensors;
    const pickle::Value* states = osd->Get("base_optimizer_state")->Get("state");
    for (const auto& [key, value] : NamedChildren(states->entries().front().second)) {
      tensors.emplace_back("base_optimizer_state/state/0/" + key, value);
    }
    tensors.emplace_back("single_partition_of_fp32_groups/0",
                         osd->Get("single_partition_of_fp32_groups")->Item(0));
    for (const auto& [path, node] : tensors) {
      SCOPED_TRACE(path);
      Result<const pickle::Value*> oracle_node = oracle->Find("optimizer_state_dict/" + path);
      ASSERT_TRUE(oracle_node.ok());
      const TorchTensor* oracle_tensor = oracle->TensorAt(*oracle_node);
      ASSERT_NE(oracle_tensor, nullptr);
      EXPECT_EQ(TensorMeta(node), TensorMeta(*oracle_node));
      EXPECT_TRUE(storage_bytes.at(StorageKey(node)) == ReadBytes(oracle->path(),
                                                                  oracle_tensor->storage->offset,
                                                                  oracle_tensor->storage->size));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixture, DeepSpeedTpResaveTest,
                         ::testing::Values("tp1dp2_from_tp2dp2", "tp2dp1_from_tp2dp2",
                                           "tp1dp1_from_tp2dp2", "tp2dp2_from_tp2dp2"),
                         [](const auto& test_param) { return test_param.param.substr(0, 6); });

// tp2dp2 → tp2dp1 → tp2dp2 and tp2dp2 → tp1dp1 → tp2dp2 through executed plans reproduce every
// object and tensor of the original (the intermediate tag is itself indexed, i.e. validated as a
// tensor-parallel tag; at tp1dp1 by its universal_checkpoint_info, its vocabulary padded to 68).
class DeepSpeedTpRoundTripTest : public ::testing::TestWithParam<Topology> {};

TEST_P(DeepSpeedTpRoundTripTest, ReshardThereAndBackIsLossless) {
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const auto reshard = [](const std::string& tag, const Topology& target,
                          const std::string& out_tag) {
    Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, target);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    fs::create_directories(out_tag);
    const Status status = ExecutePlan(*plan, *index, tag, out_tag, NoSync());
    ASSERT_TRUE(status.ok()) << status.ToString();
    ExpectPlannedSizes(*plan, *index, out_tag);
  };
  reshard(kTag, GetParam(), dir.path() + "/middle/global_step5");
  reshard(dir.path() + "/middle/global_step5", Topology{2, 2, 1, 4, 0},
          dir.path() + "/back/global_step5");
  for (const fs::directory_entry& entry : fs::directory_iterator(kTag)) {
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    Result<TorchArchiveReader> want = TorchArchiveReader::Open(entry.path().string());
    Result<TorchArchiveReader> got =
        TorchArchiveReader::Open(dir.path() + "/back/global_step5/" + name);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(RenderOf(got->root()), RenderOf(want->root()));
    ASSERT_EQ(got->tensors().size(), want->tensors().size());
    for (size_t i = 0; i < want->tensors().size(); ++i) {
      EXPECT_TRUE(TensorBytes(*got, got->tensors()[i]) == TensorBytes(*want, want->tensors()[i]))
          << "tensor " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixture, DeepSpeedTpRoundTripTest,
                         ::testing::Values(Topology{1, 2, 1, 2, 0}, Topology{1, 1, 1, 1, 0}),
                         [](const auto& test_param) {
                           return "tp" + std::to_string(test_param.param.tp) + "dp" +
                                  std::to_string(test_param.param.dp);
                         });

// DeepSpeed's TP=1 resaves carry universal_checkpoint_info: this adapter reads them, with the
// vocabulary's divisible_by inferred as 4 from 67 rows padded to 68 (the only divisor that gives
// the original save's 72 at TP=2; the README of the fixture says 4).
TEST(DeepSpeedTpSplitTest, ReadsDeepSpeedsTp1Resaves) {
  for (const char* resave : {"tp1dp2_from_tp2dp2", "tp1dp1_from_tp2dp2"}) {
    const std::string tag = kFixture + "/resaved/" + resave + "/global_step5";
    SCOPED_TRACE(tag);
    Result<const FrameworkAdapter*> detected = DetectAdapter(tag);
    ASSERT_TRUE(detected.ok()) << detected.status().ToString();
    EXPECT_EQ((*detected)->name(), DeepSpeedTpAdapter::kName);
    Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    EXPECT_EQ(index->contents().topology.tp, 1u);
    EXPECT_EQ(index->contents().adapter_state["tp"]["vocab"],
              (nlohmann::json{{"original", 67}, {"padded", 68}, {"divisible_by", 4}}));
    const nlohmann::json& params = index->contents().adapter_state["tp"]["params"];
    EXPECT_EQ(params["layers.0.attention.dense.weight"]["dim"], 1);
    EXPECT_EQ(params["layers.0.attention.query_key_value.weight"]["dim"], 0);
    EXPECT_EQ(params["final_layernorm.weight"]["rule"], "replicated");
  }
}

// A vocabulary's atom holds its original rows, or with them the padding rows a ZeRO-3 save of one
// TP rank keeps (67 tokens padded to 68 at tp 1): at tp=2 (72 rows) rank 1's rows past the atom's
// are padding, and an atom of fewer rows than the vocabulary's or more than its padding is corrupt.
TEST(DeepSpeedTpVocabTest, AtomMayHoldThePaddingRowsOfOneTpRank) {
  using deepspeed::Geometry;
  using deepspeed::GlobalRun;
  using deepspeed::Rule;
  deepspeed::ShardMap map;
  map.rule = Rule::kSplit;
  map.sub_params = {67};
  map.vocab = true;
  const deepspeed::Vocab vocab{67, 68, 4};
  for (const uint64_t rows : {67u, 68u}) {
    SCOPED_TRACE(rows);
    Result<Geometry> geometry = deepspeed::GeometryAt("wte", map, {rows, 3}, 2, vocab);
    ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
    EXPECT_EQ(deepspeed::LocalShape(*geometry, 1), (Shape{36, 3}));
    Result<std::vector<GlobalRun>> runs = deepspeed::MapLocalRange(map, *geometry, 1, 0, 36 * 3);
    ASSERT_TRUE(runs.ok()) << runs.status().ToString();
    ASSERT_EQ(runs->size(), 2u);
    ASSERT_TRUE(runs->front().region);
    EXPECT_EQ(runs->front().region->Runs(), (std::vector<FlatRange>{{36 * 3, rows * 3}}));
    EXPECT_FALSE(runs->back().region);
    EXPECT_EQ(runs->back().count, (72 - rows) * 3);
  }
  for (const uint64_t rows : {66u, 73u}) {
    EXPECT_EQ(deepspeed::GeometryAt("wte", map, {rows, 3}, 2, vocab).status().code(),
              StatusCode::kCorrupt)
        << rows;
  }
}

TEST(DeepSpeedTpRegistryTest, FindsAndDetectsTheAdapter) {
  Result<const FrameworkAdapter*> found = FindAdapter("deepspeed-tp");
  ASSERT_TRUE(found.ok());
  Result<const FrameworkAdapter*> detected = DetectAdapter(kTag);
  ASSERT_TRUE(detected.ok());
  EXPECT_EQ(*detected, *found);
  const std::string fixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";
  for (const char* other : {"z1_fp32/dp2", "z3_fp32/dp2"}) {
    EXPECT_FALSE(Adapter().Recognizes(fixtures + "/" + other + "/global_step5")) << other;
  }
  // A pipeline without a model axis (layer files naming no TP rank) is this adapter's too.
  EXPECT_TRUE(Adapter().Recognizes(fixtures + "/pipe_z1_fp32/pp2dp2/global_step5"));
}

TEST(DeepSpeedTpExpectedFilesTest, NamesTheFilesDeepSpeedWrote) {
  for (const std::string& tag : {kTag, kFixture + "/resaved/tp2dp1_from_tp2dp2/global_step5"}) {
    Result<std::vector<std::string>> files = Adapter().ExpectedFiles(tag);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    std::set<std::string> on_disk;
    for (const fs::directory_entry& entry : fs::directory_iterator(tag)) {
      on_disk.insert(entry.path().filename().string());
    }
    EXPECT_EQ(std::set<std::string>(files->begin(), files->end()), on_disk) << tag;
  }
}

TEST(DeepSpeedTpRefusalTest, RefusesTargetsItCannotProduce) {
  Result<AtomIndex> index = Adapter().BuildIndex(kTag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> pp = Adapter().PlanReshard(*index, kTag, Topology{2, 1, 2, 4, 0});
  EXPECT_EQ(pp.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(pp.status().message(), HasSubstr("pp=2"));
  Result<OutputPlan> world = Adapter().PlanReshard(*index, kTag, Topology{2, 2, 1, 8, 0});
  EXPECT_EQ(world.status().code(), StatusCode::kInvalidArgument);
  Result<OutputPlan> none = Adapter().PlanReshard(*index, kTag, Topology{2, 0, 1, 0, 0});
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  // 144 rows of query_key_value do not split over 5 ranks.
  Result<OutputPlan> uneven = Adapter().PlanReshard(*index, kTag, Topology{1, 5, 1, 5, 0});
  EXPECT_EQ(uneven.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(uneven.status().message(), HasSubstr("does not split evenly"));
}

}  // namespace
}  // namespace ucp
