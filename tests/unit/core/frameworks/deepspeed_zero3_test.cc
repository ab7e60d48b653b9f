#include "core/frameworks/deepspeed/zero3.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/framework_adapter.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "core/tag/atoms_store.h"
#include "core/tag/file_hashing.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;
using deepspeed_testing::ExpectExportPlanLikeDsToUniversal;
using deepspeed_testing::ExpectFileOfAnotherSaveNamed;
using deepspeed_testing::ExpectPlannedSizes;
using deepspeed_testing::NoSync;
using deepspeed_testing::ReadBytes;
using deepspeed_testing::RenderOf;
using deepspeed_testing::SegmentBytes;
using deepspeed_testing::TempDir;
using deepspeed_testing::TensorBytes;
using deepspeed_testing::TensorMeta;
using deepspeed_testing::WritableCopy;
using ::testing::HasSubstr;
using ucp::testing::ReadAll;

const std::string kFixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";
const std::vector<std::string> kConfigs = {"z3_fp32", "z3_bf16", "z3_fp32_odd"};

std::string Tag(const std::string& config, const std::string& run) {
  return kFixtures + "/" + config + "/" + run + "/global_step5";
}

const DeepSpeedZero3Adapter& Adapter() {
  static const DeepSpeedZero3Adapter adapter;
  return adapter;
}

// The whole atom's bytes as the planner assembles them from the tag's files.
std::string AtomBytes(const AtomIndex& index, const std::string& tag, const Atom& atom) {
  Result<Region> whole = Region::Whole(atom.shape);
  EXPECT_TRUE(whole.ok());
  if (!whole.ok()) return {};
  Result<std::vector<Segment>> segments = PlanRegion(index, atom, *whole);
  EXPECT_TRUE(segments.ok()) << segments.status().ToString();
  return segments.ok() ? SegmentBytes(index, tag, *segments) : "";
}

// The bytes of the whole storage `tensor` of `reader` views.
std::string StorageBytes(const TorchArchiveReader& reader, const TorchTensor& tensor) {
  return ReadBytes(reader.path(), tensor.storage->offset, tensor.storage->size);
}

class Zero3FixtureTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

// Every fp32 / exp_avg / exp_avg_sq atom, assembled from the original per-rank partitions (the
// per-parameter padding skipped), equals what DeepSpeed's ds_to_universal wrote for it; the export
// plan names ds_to_universal's files with its object trees.
TEST_P(Zero3FixtureTest, AtomsAndExportMatchDsToUniversal) {
  const auto& [config, run] = GetParam();
  const std::string tag = Tag(config, run);
  const std::string universal = tag + "_universal";
  ASSERT_TRUE(Adapter().Recognizes(tag));
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  const uint32_t dp = run == "dp4" ? 4 : 2;
  EXPECT_EQ(index->contents().topology, (Topology{dp, 1, 1, dp, 3}));
  EXPECT_EQ(index->files().size(), 2 * dp);
  ASSERT_EQ(index->contents().groups.size(), 1u);
  EXPECT_EQ(index->contents().groups[0].params.size(), 29u);
  EXPECT_EQ(index->contents().groups[0].scalars, (nlohmann::json{{"step", 5.0}}));

  std::set<std::string> states;
  size_t compared = 0;
  for (const Atom& atom : index->atoms()) {
    states.insert(atom.state);
    if (atom.state == "step") continue;
    SCOPED_TRACE(atom.param + "/" + atom.state);
    Result<TorchArchiveReader> oracle =
        TorchArchiveReader::Open(universal + "/zero/" + atom.param + "/" + atom.state + ".pt");
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    const TorchTensor* tensor = oracle->TensorAt(oracle->root());
    ASSERT_NE(tensor, nullptr);
    Result<uint64_t> numel = NumElements(atom.shape);
    ASSERT_TRUE(numel.ok());
    EXPECT_EQ(tensor->shape, Shape{*numel});
    EXPECT_EQ(tensor->dtype, atom.dtype);
    EXPECT_TRUE(AtomBytes(*index, tag, atom) == TensorBytes(*oracle, *tensor));
    ++compared;
  }
  EXPECT_EQ(compared, 3u * 29u);
  EXPECT_EQ(states, (std::set<std::string>{"fp32", "exp_avg", "exp_avg_sq", "step"}));

  ExpectExportPlanLikeDsToUniversal(Adapter(), *index, tag, universal);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Zero3FixtureTest,
                         ::testing::Combine(::testing::ValuesIn(kConfigs),
                                            ::testing::Values("dp4", "dp2")),
                         [](const auto& test_param) {
                           return std::get<0>(test_param.param) + "_" +
                                  std::get<1>(test_param.param);
                         });

// Reshards `tag` to `dp` ranks into `out_tag` (created), executing the plan.
void Reshard(const std::string& tag, uint32_t dp, const std::string& out_tag) {
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, Topology{dp, 1, 1, dp, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  fs::create_directories(out_tag);
  const Status status = ExecutePlan(*plan, *index, tag, out_tag, NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(*plan, *index, out_tag);
}

// The file names directly in `dir`.
std::set<std::string> FileNames(const std::string& dir) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) names.insert(entry.path().filename().string());
  }
  return names;
}

// Every entry of dict `got` renders as `want`'s, except the keys in `skip` (compared apart).
void ExpectSameEntries(const pickle::Value* got, const pickle::Value* want,
                       const std::set<std::string>& skip) {
  ASSERT_EQ(got->entries().size(), want->entries().size());
  for (size_t i = 0; i < got->entries().size(); ++i) {
    const std::string name = KeyText(got->entries()[i].first);
    ASSERT_EQ(name, KeyText(want->entries()[i].first));
    if (skip.contains(name)) continue;
    EXPECT_EQ(RenderOf(got->entries()[i].second), RenderOf(want->entries()[i].second)) << name;
  }
}

// Tensor at `path` of both archives: same metadata (storage key aside) and storage bytes.
void ExpectSameTensor(const TorchArchiveReader& got, const TorchArchiveReader& want,
                      const std::string& path) {
  SCOPED_TRACE(path);
  Result<const pickle::Value*> got_node = got.Find(path);
  Result<const pickle::Value*> want_node = want.Find(path);
  ASSERT_TRUE(got_node.ok() && want_node.ok());
  const TorchTensor* got_tensor = got.TensorAt(*got_node);
  const TorchTensor* want_tensor = want.TensorAt(*want_node);
  ASSERT_TRUE(got_tensor != nullptr && want_tensor != nullptr);
  EXPECT_EQ(TensorMeta(*got_node), TensorMeta(*want_node));
  EXPECT_TRUE(StorageBytes(got, *got_tensor) == StorageBytes(want, *want_tensor));
}

class Zero3ResaveTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

// ucp's files at DP=M from the DP=N tag are DeepSpeed's own at DP=M (saved right after a
// universal load): same names, every object identical but the resaving run's ds_config, every
// partition (padding included: zeros in both) bit for bit.
TEST_P(Zero3ResaveTest, ReshardMatchesDeepSpeedsOwnSave) {
  const auto& [config, resave_case] = GetParam();
  const std::string source_run = resave_case.substr(resave_case.size() - 3);
  const uint32_t m = static_cast<uint32_t>(resave_case[2] - '0');
  const std::string oracle_tag =
      kFixtures + "/" + config + "/resaved/" + resave_case + "/global_step5";
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string ours = dir.path() + "/global_step5";
  Reshard(Tag(config, source_run), m, ours);
  ASSERT_EQ(FileNames(ours), FileNames(oracle_tag));
  const std::string osd = "optimizer_state_dict";
  for (const std::string& name : FileNames(oracle_tag)) {
    SCOPED_TRACE(name);
    Result<TorchArchiveReader> got = TorchArchiveReader::Open(ours + "/" + name);
    Result<TorchArchiveReader> want = TorchArchiveReader::Open(oracle_tag + "/" + name);
    ASSERT_TRUE(got.ok() && want.ok());
    if (name.find("model_states") != std::string::npos) {
      ExpectSameEntries(got->root(), want->root(), {"ds_config"});
      continue;
    }
    ExpectSameEntries(got->root(), want->root(), {"ds_config", osd});
    ExpectSameEntries(got->root()->Get(osd), want->root()->Get(osd), {osd, "fp32_flat_groups"});
    ExpectSameTensor(*got, *want, osd + "/fp32_flat_groups/0");
    EXPECT_EQ(RenderOf(got->root()->Get(osd)->Get(osd)->Get("param_groups")),
              RenderOf(want->root()->Get(osd)->Get(osd)->Get("param_groups")));
    // DeepSpeed's universal load restores the Adam state in no fixed key order.
    std::set<std::string> got_keys;
    std::set<std::string> want_keys;
    for (const auto& [key, value] : NamedChildren(*got->Find(osd + "/" + osd + "/state/0"))) {
      got_keys.insert(key);
    }
    for (const auto& [key, value] : NamedChildren(*want->Find(osd + "/" + osd + "/state/0"))) {
      want_keys.insert(key);
    }
    EXPECT_EQ(got_keys, want_keys);
    for (const std::string& key : want_keys) {
      ExpectSameTensor(*got, *want, osd + "/" + osd + "/state/0/" + key);
    }
  }
}

std::vector<std::tuple<std::string, std::string>> ResaveCases() {
  std::vector<std::tuple<std::string, std::string>> cases;
  for (const std::string& config : kConfigs) {
    for (const char* resave : {"dp2_from_dp4", "dp1_from_dp4", "dp4_from_dp2", "dp4_from_dp4"}) {
      cases.emplace_back(config, resave);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Zero3ResaveTest, ::testing::ValuesIn(ResaveCases()),
                         [](const auto& test_param) {
                           return std::get<0>(test_param.param) + "_" +
                                  std::get<1>(test_param.param);
                         });

class Zero3RoundTripTest : public ::testing::TestWithParam<std::tuple<std::string, uint32_t>> {};

// dp4 → dpM → dp4 through executed plans: the files' object trees are the original's and every
// atom (the real elements: the original's padding is uninitialised memory) holds the same bytes.
TEST_P(Zero3RoundTripTest, ReshardThereAndBackIsLossless) {
  const auto& [config, middle] = GetParam();
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string original = Tag(config, "dp4");
  const std::string back = dir.path() + "/back/global_step5";
  Reshard(original, middle, dir.path() + "/middle/global_step5");
  Reshard(dir.path() + "/middle/global_step5", 4, back);
  ASSERT_EQ(FileNames(back), FileNames(original));
  for (const std::string& name : FileNames(original)) {
    Result<TorchArchiveReader> got = TorchArchiveReader::Open(back + "/" + name);
    Result<TorchArchiveReader> want = TorchArchiveReader::Open(original + "/" + name);
    ASSERT_TRUE(got.ok() && want.ok());
    EXPECT_EQ(RenderOf(got->root()), RenderOf(want->root())) << name;
  }
  Result<AtomIndex> before = Adapter().BuildIndex(original, {});
  Result<AtomIndex> after = Adapter().BuildIndex(back, {});
  ASSERT_TRUE(before.ok() && after.ok());
  ASSERT_EQ(before->atoms().size(), after->atoms().size());
  for (const Atom& atom : before->atoms()) {
    const Atom* other = after->Find(atom.param, atom.state);
    ASSERT_NE(other, nullptr) << atom.param << "/" << atom.state;
    EXPECT_TRUE(AtomBytes(*before, original, atom) == AtomBytes(*after, back, *other))
        << atom.param << "/" << atom.state;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Zero3RoundTripTest,
                         ::testing::Combine(::testing::ValuesIn(kConfigs),
                                            ::testing::Values(2u, 1u, 3u)),
                         [](const auto& test_param) {
                           return std::get<0>(test_param.param) + "_dp" +
                                  std::to_string(std::get<1>(test_param.param));
                         });

// For every ZeRO-3 fixture tag (both runs and every resaved one) the files ExpectedFiles names
// are exactly the .pt files DeepSpeed wrote.
TEST(Zero3ExpectedFilesTest, NamesTheFilesDeepSpeedWrote) {
  size_t tags = 0;
  for (const std::string& config : kConfigs) {
    std::vector<std::string> dirs = {Tag(config, "dp4"), Tag(config, "dp2")};
    for (const fs::directory_entry& entry :
         fs::directory_iterator(kFixtures + "/" + config + "/resaved")) {
      if (fs::is_directory(entry.path() / "global_step5")) {
        dirs.push_back((entry.path() / "global_step5").string());
      }
    }
    for (const std::string& dir : dirs) {
      Result<std::vector<std::string>> files = Adapter().ExpectedFiles(dir);
      ASSERT_TRUE(files.ok()) << dir << ": " << files.status().ToString();
      std::set<std::string> pt;
      for (const std::string& name : FileNames(dir)) {
        if (name.ends_with(".pt")) pt.insert(name);
      }
      EXPECT_EQ(std::set<std::string>(files->begin(), files->end()), pt) << dir;
      EXPECT_EQ(files->size(), pt.size()) << dir;
      ++tags;
    }
  }
  EXPECT_EQ(tags, 6 * kConfigs.size());
}

// DetectAdapter gives ZeRO-3 tags to this adapter and ZeRO-1/2 tags to the other; neither
// claims the other's.
TEST(Zero3RegistryTest, DetectsZero3TagsOnly) {
  Result<const FrameworkAdapter*> found = FindAdapter("deepspeed-zero3");
  ASSERT_TRUE(found.ok());
  for (const std::string& config : kConfigs) {
    Result<const FrameworkAdapter*> detected = DetectAdapter(Tag(config, "dp2"));
    ASSERT_TRUE(detected.ok());
    EXPECT_EQ(*detected, *found);
  }
  for (const std::string config : {"z1_fp32", "z2_bf16", "pipe_z1_fp32"}) {
    const std::string tag =
        config == std::string("pipe_z1_fp32") ? Tag(config, "pp2dp2") : Tag(config, "dp2");
    EXPECT_FALSE(Adapter().Recognizes(tag)) << tag;
    Result<const FrameworkAdapter*> detected = DetectAdapter(tag);
    ASSERT_TRUE(detected.ok());
    EXPECT_EQ((*detected)->name(),
              config == std::string("pipe_z1_fp32") ? "deepspeed-tp" : "deepspeed-zero12");
  }
}

TEST(Zero3RefusalTest, RefusesTargetsItCannotProduce) {
  const std::string tag = Tag("z3_fp32_odd", "dp2");
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> tp = Adapter().PlanReshard(*index, tag, Topology{2, 2, 1, 4, 0});
  EXPECT_EQ(tp.status().code(), StatusCode::kUnsupported);
  Result<OutputPlan> pp = Adapter().PlanReshard(*index, tag, Topology{2, 1, 2, 4, 0});
  EXPECT_EQ(pp.status().code(), StatusCode::kUnsupported);
  Result<OutputPlan> none = Adapter().PlanReshard(*index, tag, Topology{0, 1, 1, 0, 0});
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  // An index of the other adapter is not this adapter's to plan from.
  Result<const FrameworkAdapter*> zero12_adapter = FindAdapter("deepspeed-zero12");
  ASSERT_TRUE(zero12_adapter.ok());
  Result<AtomIndex> zero12 = (*zero12_adapter)->BuildIndex(Tag("z1_fp32", "dp2"), {});
  ASSERT_TRUE(zero12.ok());
  Result<OutputPlan> other =
      Adapter().PlanReshard(*zero12, Tag("z1_fp32", "dp2"), Topology{2, 1, 1, 2, 0});
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
}

// UCP_MODE=atoms: with every rank's share of the store written and the framework's files gone,
// the index read from the store alone plans the same files (same bytes) as the tag as saved: the
// ZeRO-3 plans read nothing but atoms and carried files (every rank's model states).
TEST(Zero3AtomsStoreTest, ReshardsFromTheStoreAlone) {
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string tag = dir.path() + "/global_step5";
  WritableCopy(Tag("z3_fp32_odd", "dp4"), tag);
  const std::string saved = dir.path() + "/saved/global_step5";
  Reshard(tag, 2, saved);
  {
    Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    const std::string path = tag + "/" + std::string(kAtomIndexRelativePath);
    ASSERT_TRUE(index->Write(path).ok());
    Result<FileDigest> digest = HashFile(path);
    ASSERT_TRUE(digest.ok());
    for (uint32_t rank = 0; rank < 4; ++rank) {
      const Status written = WriteStoreShare(*index, digest->xxh3, tag, rank, NoSync());
      ASSERT_TRUE(written.ok()) << written.ToString();
      Result<bool> finalized = FinalizeStore(tag, digest->xxh3);
      ASSERT_TRUE(finalized.ok()) << finalized.status().ToString();
      EXPECT_EQ(*finalized, rank == 3);
    }
  }
  for (const std::string& name : FileNames(tag)) fs::remove(tag + "/" + name);
  Result<AtomIndex> index = AtomIndex::Read(tag + "/" + std::string(kAtomIndexRelativePath));
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<std::optional<AtomIndex>> store = ReadableSources(*index, tag);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE(store->has_value());
  Result<OutputPlan> plan = Adapter().PlanReshard(**store, tag, Topology{2, 1, 1, 2, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const std::string served = dir.path() + "/served";
  fs::create_directories(served);
  const Status status = ExecutePlan(*plan, **store, tag, served, NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(*plan, **store, served);
  ASSERT_EQ(FileNames(served), FileNames(saved));
  for (const std::string& name : FileNames(saved)) {
    EXPECT_TRUE(ReadAll(served + "/" + name) == ReadAll(saved + "/" + name)) << name;
  }
}

class Zero3BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    tag_ = dir_.path() + "/global_step5";
    WritableCopy(Tag("z3_fp32_odd", "dp4"), tag_);
  }

  Status Build() { return Adapter().BuildIndex(tag_, {}).status(); }

  const TempDir dir_;
  std::string tag_;
};

TEST_F(Zero3BadInputTest, TheCopyIsGood) { EXPECT_TRUE(Build().ok()); }

TEST_F(Zero3BadInputTest, MissingRankFilesAreNotFoundNamingThem) {
  for (const char* name :
       {"zero_pp_rank_2_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"}) {
    const std::string path = tag_ + "/" + name;
    fs::rename(path, path + ".away");
    const Status status = Build();
    EXPECT_EQ(status.code(), StatusCode::kNotFound) << name;
    EXPECT_THAT(status.message(), HasSubstr(name));
    fs::rename(path + ".away", path);
  }
}

TEST_F(Zero3BadInputTest, RankFileOfAnotherDpSizeNamesFileAndField) {
  ExpectFileOfAnotherSaveNamed(Adapter(), tag_, Tag("z3_fp32_odd", "dp2"),
                               "zero_pp_rank_1_mp_rank_00_optim_states.pt", "partition_count");
}

TEST_F(Zero3BadInputTest, OptimizerFileOfAnotherStageNamesFileAndField) {
  ExpectFileOfAnotherSaveNamed(Adapter(), tag_, Tag("z2_fp32_odd", "dp4"),
                               "zero_pp_rank_3_mp_rank_00_optim_states.pt", "zero_stage");
}

TEST_F(Zero3BadInputTest, ExtraRankFileIsAFileOfAnotherSave) {
  fs::copy_file(tag_ + "/zero_pp_rank_3_mp_rank_00_model_states.pt",
                tag_ + "/zero_pp_rank_4_mp_rank_00_model_states.pt");
  const Status status = Build();
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_THAT(status.message(), HasSubstr("zero_pp_rank_4_mp_rank_00_model_states.pt"));
}

}  // namespace
}  // namespace ucp
