#include "core/frameworks/deepspeed/tp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/framework_adapter.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "core/tag/atoms_store.h"
#include "core/tag/journal.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"

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
using deepspeed_testing::StorageKey;
using deepspeed_testing::TempDir;
using deepspeed_testing::TensorBytes;
using deepspeed_testing::TensorMeta;
using deepspeed_testing::WritableCopy;
using ::testing::HasSubstr;

const std::string kPipe = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed/pipe_z1_fp32";
const std::string kSource = kPipe + "/pp2dp2/global_step5";

const DeepSpeedTpAdapter& Adapter() {
  static const DeepSpeedTpAdapter adapter;
  return adapter;
}

Result<AtomIndex> SourceIndex() { return Adapter().BuildIndex(kSource, {}); }

std::string FileBytes(const std::string& path) { return ReadBytes(path, 0, fs::file_size(path)); }

// Every fp32 / optimizer-state / step atom, assembled from the per-(rank, stage) files, equals the
// tensor ds_to_universal wrote for it (under the global "<layer>.<name>" name); every bit16 atom
// (the layer file's tensor) equals the fp32 master, as in an fp32 run; the export plan has
// ds_to_universal's files and object trees.
TEST(DeepSpeedPipeFixtureTest, AtomsAndExportMatchDsToUniversal) {
  const std::string universal = kSource + "_universal";
  ASSERT_TRUE(Adapter().Recognizes(kSource));
  Result<AtomIndex> index = SourceIndex();
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->contents().topology, (Topology{2, 1, 2, 4, 1}));
  EXPECT_EQ(index->files().size(), 2 + 4 + 4);

  std::set<std::string> states;
  std::set<std::string> params;
  for (const Atom& atom : index->atoms()) {
    states.insert(atom.state);
    params.insert(atom.param);
    SCOPED_TRACE(atom.param + "/" + atom.state);
    const std::string oracle_state = atom.state == "bit16" ? "fp32" : atom.state;
    Result<TorchArchiveReader> oracle =
        TorchArchiveReader::Open(universal + "/zero/" + atom.param + "/" + oracle_state + ".pt");
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    const pickle::Value* node = oracle->root();
    if (oracle_state != "step") {
      ASSERT_EQ(RenderOf(node->Get("cat_dim")), "0");
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
    EXPECT_TRUE(SegmentBytes(*index, kSource, *segments) == TensorBytes(*oracle, *tensor));
  }
  EXPECT_EQ(states, (std::set<std::string>{"fp32", "exp_avg", "exp_avg_sq", "step", "bit16"}));
  std::set<std::string> universal_params;
  for (const fs::directory_entry& entry : fs::directory_iterator(universal + "/zero")) {
    if (entry.is_directory()) universal_params.insert(entry.path().filename().string());
  }
  EXPECT_EQ(params, universal_params);
  EXPECT_EQ(params.size(), 29u);

  ExpectExportPlanLikeDsToUniversal(Adapter(), *index, kSource, universal);
}

// The executed export writes what ds_to_universal wrote: same files, trees and tensor bytes.
TEST(DeepSpeedPipeFixtureTest, ExecutedExportEqualsDsToUniversal) {
  Result<AtomIndex> index = SourceIndex();
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanUniversalExport(*index, kSource);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const Status status = ExecutePlan(*plan, *index, kSource, dir.path(), NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(*plan, *index, dir.path());
  size_t files = 0;
  for (const fs::directory_entry& entry :
       fs::recursive_directory_iterator(kSource + "_universal")) {
    if (!entry.is_regular_file()) continue;
    const std::string relative = fs::relative(entry.path(), kSource + "_universal").string();
    SCOPED_TRACE(relative);
    Result<TorchArchiveReader> want = TorchArchiveReader::Open(entry.path().string());
    Result<TorchArchiveReader> got = TorchArchiveReader::Open(dir.path() + "/" + relative);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(RenderOf(got->root()), RenderOf(want->root()));
    ASSERT_EQ(got->tensors().size(), want->tensors().size());
    for (size_t i = 0; i < want->tensors().size(); ++i) {
      EXPECT_TRUE(TensorBytes(*got, got->tensors()[i]) == TensorBytes(*want, want->tensors()[i]));
    }
    ++files;
  }
  EXPECT_EQ(files, 2 + 1 + 29 * 4u);
}

struct ResaveCase {
  std::string name;
  uint32_t pp;
  uint32_t dp;
};

class DeepSpeedPipeResaveTest : public ::testing::TestWithParam<ResaveCase> {};

// PlanReshard(pp, dp) of the pp2dp2 tag describes DeepSpeed's own files at (pp, dp) (saved after
// a universal load): the same file names; layer files byte-identical; every model-states entry
// but ds_config (the new run's) identical; every optimizer object tree identical and every
// partition tensor holding the same bytes.
TEST_P(DeepSpeedPipeResaveTest, ReshardMatchesDeepSpeedsOwnSave) {
  const ResaveCase& c = GetParam();
  const std::string oracle_tag = kPipe + "/resaved/" + c.name + "/global_step5";
  Result<AtomIndex> index = SourceIndex();
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanReshard(*index, kSource, Topology{c.dp, 1, c.pp, 0, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->archives.size(), c.pp * (1 + c.dp));

  std::set<std::string> oracle_files;
  for (const fs::directory_entry& entry : fs::directory_iterator(oracle_tag)) {
    oracle_files.insert(entry.path().filename().string());
  }
  std::set<std::string> planned;
  for (const ArchiveOutput& archive : plan->archives) planned.insert(archive.path);
  for (const CopyOutput& copy : plan->copies) {
    planned.insert(copy.path);
    EXPECT_TRUE(FileBytes(kSource + "/" + index->files()[copy.file].path) ==
                FileBytes(oracle_tag + "/" + copy.path))
        << copy.path;
  }
  EXPECT_EQ(planned, oracle_files);
  EXPECT_EQ(plan->copies.size(), 4u);

  for (const ArchiveOutput& archive : plan->archives) {
    SCOPED_TRACE(archive.path);
    Result<TorchArchiveReader> oracle = TorchArchiveReader::Open(oracle_tag + "/" + archive.path);
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    const pickle::Value* root = archive.graph.root();
    if (archive.path.starts_with("mp_rank_")) {
      ASSERT_EQ(root->entries().size(), oracle->root()->entries().size());
      for (const auto& [key, value] : root->entries()) {
        const std::string name = KeyText(key);
        if (name == "ds_config") continue;
        EXPECT_EQ(RenderOf(value), RenderOf(oracle->root()->Get(name))) << name;
      }
      EXPECT_TRUE(archive.storages.empty());
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

    std::map<std::string, const OutputStorage*> storages;
    for (const OutputStorage& storage : archive.storages) storages[storage.key] = &storage;
    std::vector<std::pair<std::string, const pickle::Value*>> tensors;
    const pickle::Value* states = osd->Get("base_optimizer_state")->Get("state");
    for (const auto& [key, value] : NamedChildren(states->entries().front().second)) {
      tensors.emplace_back("base_optimizer_state/state/0/" + key, value);
    }
    tensors.emplace_back("single_partition_of_fp32_groups/0",
                         osd->Get("single_partition_of_fp32_groups")->Item(0));
    ASSERT_EQ(tensors.size(), 4u);
    for (const auto& [path, node] : tensors) {
      SCOPED_TRACE(path);
      Result<const pickle::Value*> oracle_node = oracle->Find("optimizer_state_dict/" + path);
      ASSERT_TRUE(oracle_node.ok());
      const TorchTensor* oracle_tensor = oracle->TensorAt(*oracle_node);
      ASSERT_NE(oracle_tensor, nullptr);
      EXPECT_EQ(TensorMeta(node), TensorMeta(*oracle_node));
      const OutputStorage* storage = storages.at(StorageKey(node));
      EXPECT_TRUE(
          SegmentBytes(*index, kSource, storage->segments) ==
          ReadBytes(oracle->path(), oracle_tensor->storage->offset, oracle_tensor->storage->size));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSpeedPipeResaveTest,
                         ::testing::Values(ResaveCase{"pp1dp2_from_pp2dp2", 1, 2},
                                           ResaveCase{"pp2dp1_from_pp2dp2", 2, 1},
                                           ResaveCase{"pp4dp1_from_pp2dp2", 4, 1},
                                           ResaveCase{"pp2dp2_from_pp2dp2", 2, 2}),
                         [](const auto& test_param) { return test_param.param.name; });

// Reshards `tag` to (pp, dp) into `out_tag` (created), executing the plan.
void Reshard(const std::string& tag, uint32_t pp, uint32_t dp, const std::string& out_tag) {
  Result<AtomIndex> index = Adapter().BuildIndex(tag, {});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> plan = Adapter().PlanReshard(*index, tag, Topology{dp, 1, pp, pp * dp, 0});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  fs::create_directories(out_tag);
  const Status status = ExecutePlan(*plan, *index, tag, out_tag, NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(*plan, *index, out_tag);
}

class DeepSpeedPipeRoundTripTest : public ::testing::TestWithParam<std::pair<uint32_t, uint32_t>> {
};

// pp2dp2 → (pp, dp) → pp2dp2 through executed plans reproduces every file of the original: same
// names, object trees and tensor bytes (the intermediate tag is itself indexed, i.e. validated).
TEST_P(DeepSpeedPipeRoundTripTest, ReshardThereAndBackIsLossless) {
  const auto& [pp, dp] = GetParam();
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  Reshard(kSource, pp, dp, dir.path() + "/middle/global_step5");
  Reshard(dir.path() + "/middle/global_step5", 2, 2, dir.path() + "/back/global_step5");
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(kSource)) {
    const std::string name = entry.path().filename().string();
    names.insert(name);
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
  std::set<std::string> back;
  for (const fs::directory_entry& entry :
       fs::directory_iterator(dir.path() + "/back/global_step5")) {
    back.insert(entry.path().filename().string());
  }
  EXPECT_EQ(back, names);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSpeedPipeRoundTripTest,
                         ::testing::Values(std::pair{1u, 2u}, std::pair{2u, 1u}, std::pair{4u, 1u},
                                           std::pair{1u, 1u}, std::pair{4u, 3u}),
                         [](const auto& test_param) {
                           return "pp" + std::to_string(test_param.param.first) + "dp" +
                                  std::to_string(test_param.param.second);
                         });

// At pp=3 DeepSpeed's 'uniform' placement gives layers [0, 2, 3, 4] and 'parameters'
// (partition_balanced over 3984, 28272, 28272, 3312 elements) [0, 1, 2, 4]; both give the
// checkpoint's pp=2 stages, so the target is ambiguous. At pp=5 a stage has no layer.
TEST(DeepSpeedPipeRefusalTest, RefusesAmbiguousAndImpossibleTargets) {
  Result<AtomIndex> index = SourceIndex();
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  Result<OutputPlan> three = Adapter().PlanReshard(*index, kSource, Topology{1, 1, 3, 3, 0});
  EXPECT_EQ(three.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(three.status().message(), HasSubstr("pp=3: ambiguous layer placement"));
  EXPECT_THAT(three.status().message(),
              HasSubstr("'uniform' [0, 2, 3, 4] and 'parameters' [0, 1, 2, 4]"));
  Result<OutputPlan> five = Adapter().PlanReshard(*index, kSource, Topology{1, 1, 5, 5, 0});
  EXPECT_EQ(five.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(
      five.status().message(),
      HasSubstr("stage 4 holds no parameter by the 'uniform' placement [0, 1, 2, 3, 4, 4]"));
  Result<OutputPlan> tp = Adapter().PlanReshard(*index, kSource, Topology{1, 2, 2, 4, 0});
  EXPECT_EQ(tp.status().code(), StatusCode::kUnsupported);
  EXPECT_THAT(tp.status().message(), HasSubstr("tp=2: the tag's pipeline grid has no model axis"));
  EXPECT_EQ(Adapter().PlanReshard(*index, kSource, Topology{0, 1, 2, 0, 0}).status().code(),
            StatusCode::kInvalidArgument);
  Result<OutputPlan> uneven = Adapter().PlanReshard(*index, kSource, Topology{3, 1, 2, 8, 0});
  EXPECT_EQ(uneven.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(uneven.status().message(), HasSubstr("world=8 is not dp=3 × tp=1 × pp=2"));
}

// The pipeline tag is the grid adapter's (deepspeed-tp); the ZeRO-1/2 and ZeRO-3 tags are not.
// An index of an earlier ucp's deepspeed-pipe adapter is refused naming the way to rebuild it.
TEST(DeepSpeedPipeRegistryTest, DetectsThePipelineTagOnly) {
  Result<const FrameworkAdapter*> found = FindAdapter("deepspeed-tp");
  ASSERT_TRUE(found.ok());
  Result<const FrameworkAdapter*> retired = FindAdapter("deepspeed-pipe");
  EXPECT_EQ(retired.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(retired.status().message(), HasSubstr("ucp index"));
  Result<const FrameworkAdapter*> detected = DetectAdapter(kSource);
  ASSERT_TRUE(detected.ok());
  EXPECT_EQ(*detected, *found);
  for (const std::string config : {"z1_fp32", "z3_fp32"}) {
    const std::string tag =
        std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed/" + config + "/dp4/global_step5";
    EXPECT_FALSE(Adapter().Recognizes(tag)) << tag;
    EXPECT_EQ(Adapter().BuildIndex(tag, {}).status().code(), StatusCode::kUnsupported) << tag;
  }
}

// The names DeepSpeed wrote, for the training save and every resaved topology, follow from the
// model-states files.
TEST(DeepSpeedPipeExpectedFilesTest, NamesTheFilesDeepSpeedWrote) {
  std::vector<std::string> tags = {kSource};
  for (const fs::directory_entry& entry : fs::directory_iterator(kPipe + "/resaved")) {
    if (entry.is_directory()) tags.push_back(entry.path().string() + "/global_step5");
  }
  ASSERT_EQ(tags.size(), 5u);
  for (const std::string& tag : tags) {
    Result<std::vector<std::string>> files = Adapter().ExpectedFiles(tag);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    std::set<std::string> on_disk;
    for (const fs::directory_entry& entry : fs::directory_iterator(tag)) {
      on_disk.insert(entry.path().filename().string());
    }
    EXPECT_EQ(std::set<std::string>(files->begin(), files->end()), on_disk) << tag;
    EXPECT_EQ(files->size(), on_disk.size()) << tag;
  }
}

// Executes `plan` of `index` over `tag` into `out` (created).
void Execute(const Result<OutputPlan>& plan, const AtomIndex& index, const std::string& tag,
             const std::string& out) {
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  fs::create_directories(out);
  const Status status = ExecutePlan(*plan, index, tag, out, NoSync());
  ASSERT_TRUE(status.ok()) << status.ToString();
  ExpectPlannedSizes(*plan, index, out);
}

// The regular files under `a` and `b`: the same relative paths, the same bytes.
void ExpectSameTree(const std::string& a, const std::string& b) {
  std::set<std::string> paths;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(a)) {
    if (entry.is_regular_file()) paths.insert(fs::relative(entry.path(), a).string());
  }
  std::set<std::string> other;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(b)) {
    if (entry.is_regular_file()) other.insert(fs::relative(entry.path(), b).string());
  }
  EXPECT_EQ(paths, other);
  EXPECT_FALSE(paths.empty());
  for (const std::string& path : paths) {
    EXPECT_TRUE(FileBytes(a + "/" + path) == FileBytes(b + "/" + path)) << path;
  }
}

// With UCP_MODE=atoms' store written by every rank and DeepSpeed's files deleted, the reshard and
// the export planned over the store alone write the bytes they write from the files (the layer
// files, carried, come from the store's copies).
TEST(DeepSpeedPipeAtomsStoreTest, ReshardAndExportFromTheStoreAloneAsFromTheFiles) {
  const TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string tag = dir.path() + "/ckpt/global_step5";
  fs::create_directories(dir.path() + "/ckpt");
  WritableCopy(kSource, tag);
  IndexOptions options;
  options.trust_journal = false;
  Result<AtomIndex> index = Adapter().BuildIndex(tag, options);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ASSERT_TRUE(index->Write(AtomIndexPath(tag)).ok());
  Result<FileDigest> digest = HashFile(AtomIndexPath(tag));
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  ExecuteOptions one_thread = NoSync();
  one_thread.threads = 1;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    const Status written = WriteStoreShare(*index, digest->xxh3, tag, rank, one_thread);
    ASSERT_TRUE(written.ok()) << written.ToString();
    Result<bool> finalized = FinalizeStore(tag, digest->xxh3);
    ASSERT_TRUE(finalized.ok()) << finalized.status().ToString();
    EXPECT_EQ(*finalized, rank == 3);
  }
  Result<AtomIndex> stored = AtomIndex::Read(AtomIndexPath(tag));
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  const Topology pp1dp2{2, 1, 1, 2, 0};
  Execute(Adapter().PlanReshard(*stored, tag, pp1dp2), *stored, tag, dir.path() + "/files");
  Execute(Adapter().PlanUniversalExport(*stored, tag), *stored, tag, dir.path() + "/files_u");

  for (const fs::directory_entry& entry : fs::directory_iterator(kSource)) {
    fs::remove(tag + "/" + entry.path().filename().string());
  }
  Result<std::optional<AtomIndex>> readable = ReadableSources(*stored, tag);
  ASSERT_TRUE(readable.ok()) << readable.status().ToString();
  ASSERT_TRUE(readable->has_value());
  const AtomIndex& over = **readable;
  Execute(Adapter().PlanReshard(over, tag, pp1dp2), over, tag, dir.path() + "/store");
  Execute(Adapter().PlanUniversalExport(over, tag), over, tag, dir.path() + "/store_u");
  ExpectSameTree(dir.path() + "/files", dir.path() + "/store");
  ExpectSameTree(dir.path() + "/files_u", dir.path() + "/store_u");
}

class DeepSpeedPipeBadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    WritableCopy(kSource, tag_);
  }
  Status Build() const { return Adapter().BuildIndex(tag_, {}).status(); }
  const TempDir dir_;
  const std::string tag_ = dir_.path() + "/global_step5";
};

TEST_F(DeepSpeedPipeBadInputTest, TheCopyIsGood) { EXPECT_TRUE(Build().ok()); }

TEST_F(DeepSpeedPipeBadInputTest, MissingFilesAreNotFoundNamingThem) {
  for (const std::string name : {"zero_pp_rank_1_mp_rank_01_optim_states.pt",
                                 "layer_02-model_states.pt", "mp_rank_01_model_states.pt"}) {
    SCOPED_TRACE(name);
    const std::string moved = dir_.path() + "/" + name;
    fs::rename(tag_ + "/" + name, moved);
    const Status status = Build();
    EXPECT_EQ(status.code(), StatusCode::kNotFound) << status.ToString();
    EXPECT_THAT(status.message(), HasSubstr(name));
    fs::rename(moved, tag_ + "/" + name);
  }
}

TEST_F(DeepSpeedPipeBadInputTest, RankFileOfAnotherTopologyNamesFileAndField) {
  ExpectFileOfAnotherSaveNamed(Adapter(), tag_, kPipe + "/resaved/pp2dp1_from_pp2dp2/global_step5",
                               "zero_pp_rank_0_mp_rank_01_optim_states.pt", "partition_count");
}

TEST_F(DeepSpeedPipeBadInputTest, StageFileOfAnotherPlacementNamesFileAndField) {
  ExpectFileOfAnotherSaveNamed(Adapter(), tag_, kPipe + "/resaved/pp4dp1_from_pp2dp2/global_step5",
                               "mp_rank_01_model_states.pt", "dp_world_size");
}

TEST_F(DeepSpeedPipeBadInputTest, LayerFileOfAnotherLayerNamesFileAndTensor) {
  fs::copy_file(kSource + "/layer_00-model_states.pt", tag_ + "/layer_01-model_states.pt",
                fs::copy_options::overwrite_existing);
  const Status status = Build();
  EXPECT_EQ(status.code(), StatusCode::kCorrupt) << status.ToString();
  EXPECT_THAT(status.message(), HasSubstr("layer_01-model_states.pt"));
  EXPECT_THAT(status.message(), HasSubstr("ln1.weight: missing"));
}

}  // namespace
}  // namespace ucp
