#include "core/frameworks/checkpoint_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace ucp {
namespace {

namespace fs = std::filesystem;

std::optional<PathMatch> Recognise(std::string_view path, const RootSet& roots = RootSet()) {
  auto match = LayoutRegistry::Builtin().Recognise(path, roots);
  // The open and stat pre-filter must never turn away a path that the layouts recognise, whether
  // it is given whole or as its file name.
  if (match.has_value()) {
    EXPECT_TRUE(LayoutRegistry::Builtin().MayMatchPath(path)) << path;
    EXPECT_TRUE(LayoutRegistry::Builtin().MayMatchPath(path.substr(path.rfind('/') + 1))) << path;
  }
  return match;
}

// Every file DeepSpeed itself wrote in the shared fixtures (training saves, not the
// ds_to_universal output) is a DeepSpeed data file of its tag.
TEST(CheckpointLayoutTest, RecognisesEveryDeepSpeedFixtureFile) {
  const fs::path root = fs::path(UCP_SHARED_DIR) / "fixtures/deepspeed";
  if (!fs::exists(root)) GTEST_SKIP() << root << " is missing";
  int seen = 0;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    const fs::path& path = entry.path();
    if (!entry.is_regular_file() || path.extension() != ".pt") continue;
    if (path.string().find("/resaved") != std::string::npos) continue;
    // ds_to_universal's per-parameter files are not a training save's names.
    if (path.string().find("_universal/zero/") != std::string::npos) {
      EXPECT_FALSE(Recognise(path.string())) << path;
      continue;
    }
    ++seen;
    const auto match = Recognise(path.string());
    ASSERT_TRUE(match.has_value()) << path;
    EXPECT_EQ(match->framework, "deepspeed") << path;
    EXPECT_EQ(match->role, FileRole::kData) << path;
    EXPECT_EQ(match->tag_dir, path.parent_path().string()) << path;
    EXPECT_EQ(match->save_dir, path.parent_path().parent_path().string()) << path;
  }
  EXPECT_GT(seen, 50);
}

TEST(CheckpointLayoutTest, DeepSpeedNames) {
  const std::vector<std::string> data = {
      "/c/global_step5/mp_rank_00_model_states.pt",
      "/c/global_step5/mp_rank_13_model_states.pt",
      "/c/global_step5/zero_pp_rank_0_mp_rank_00_model_states.pt",
      "/c/global_step5/zero_pp_rank_12_mp_rank_01_optim_states.pt",
      "/c/global_step5/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt",
      "/c/global_step5/layer_00-model_states.pt",
      "/c/global_step5/layer_17-model_01-model_states.pt",
      "/c/global_step5/expp_rank_2_mp_rank_00_optim_states.pt",
      "/c/global_step5/layer_0_expert_3_mp_rank_00_model_states.pt",
      "/c/my tag/mp_rank_00_model_states.pt",
      "/c/global_step5/mp_rank_100_model_states.pt",  // %02d from mp rank 100 on
  };
  for (const std::string& path : data) {
    const auto match = Recognise(path);
    ASSERT_TRUE(match.has_value()) << path;
    EXPECT_EQ(match->framework, "deepspeed");
    EXPECT_EQ(match->role, FileRole::kData);
    EXPECT_EQ(match->tag_dir, fs::path(path).parent_path().string());
    EXPECT_EQ(match->save_dir, "/c");
  }
  const std::vector<std::string> look_alikes = {
      "/c/global_step5/mp_rank_0_model_states.pt",  // mp rank has two digits
      "/c/global_step5/mp_rank_00_model_states.pth",
      "/c/global_step5/mp_rank_00_model_states.pt.tmp",
      "/c/global_step5/xmp_rank_00_model_states.pt",
      "/c/global_step5/zero_pp_rank_a_mp_rank_00_optim_states.pt",
      "/c/global_step5/fp16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "/c/global_step5/layer_00-model_states.pt/x",
      "/c/global_step5/layer_00_model_states.pt",
      "/c/global_step5/model_states.pt",
      "/c/global_step5/optimizer.pt",
      "/mp_rank_00_model_states.pt",  // no tag directory above it
      "/c/latest_universal",
      "/c/latest.tmp",
  };
  for (const std::string& path : look_alikes) EXPECT_FALSE(Recognise(path)) << path;
}

TEST(CheckpointLayoutTest, DeepSpeedLatestCommitsTheTagItNames) {
  const auto match = Recognise("/c/run/latest");
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->framework, "deepspeed");
  EXPECT_EQ(match->role, FileRole::kCommitSignal);
  EXPECT_EQ(match->save_dir, "/c/run");
  const CheckpointLayout* layout = LayoutRegistry::Builtin().Find("deepspeed");
  ASSERT_NE(layout, nullptr);
  // The fixture's own `latest` file.
  const fs::path latest = fs::path(UCP_SHARED_DIR) / "fixtures/deepspeed/z1_fp32/dp4/latest";
  if (fs::exists(latest)) {
    std::string content(fs::file_size(latest), '\0');
    FILE* file = std::fopen(latest.c_str(), "rb");
    ASSERT_NE(file, nullptr);
    ASSERT_EQ(std::fread(content.data(), 1, content.size(), file), content.size());
    std::fclose(file);
    const auto target = layout->ResolveCommit(*match, content);
    ASSERT_TRUE(target.ok()) << target.status().ToString();
    EXPECT_EQ(target->tag, "global_step5");
    EXPECT_EQ(target->tag_dir, "/c/run/global_step5");
  }
  const auto with_newline = layout->ResolveCommit(*match, "global_step7\n");
  ASSERT_TRUE(with_newline.ok());
  EXPECT_EQ(with_newline->tag_dir, "/c/run/global_step7");
  for (const char* bad : {"", "\n", "a/b", "..", "."}) {
    EXPECT_FALSE(layout->ResolveCommit(*match, bad).ok()) << bad;
  }
}

TEST(CheckpointLayoutTest, MegatronNames) {
  const std::vector<std::pair<std::string, std::string>> data = {
      {"/m/iter_0000100/mp_rank_00/model_optim_rng.pt", "/m/iter_0000100"},
      {"/m/iter_0000100/mp_rank_01_002/model_optim_rng.pt", "/m/iter_0000100"},
      {"/m/iter_0000100/mp_rank_01_002_003/distrib_optim.pt", "/m/iter_0000100"},
      {"/m/iter_12345678/mp_rank_00/distrib_optim.pt", "/m/iter_12345678"},
      {"/m/release/mp_rank_00/model_optim_rng.pt", "/m/release"},
  };
  for (const auto& [path, tag_dir] : data) {
    const auto match = Recognise(path);
    ASSERT_TRUE(match.has_value()) << path;
    EXPECT_EQ(match->framework, "megatron");
    EXPECT_EQ(match->role, FileRole::kData);
    EXPECT_EQ(match->tag_dir, tag_dir);
    EXPECT_EQ(match->save_dir, "/m");
  }
  for (const char* path : {
           "/m/iter_100/mp_rank_00/model_optim_rng.pt",  // iteration has seven digits or more
           "/m/iter_0000100/mp_rank_0/model_optim_rng.pt",
           "/m/iter_0000100/mp_rank_00_01/model_optim_rng.pt",
           "/m/iter_0000100/model_optim_rng.pt",
           "/m/iter_0000100/mp_rank_00/model_optim.pt",
           "/m/step_0000100/mp_rank_00/model_optim_rng.pt",
       }) {
    EXPECT_FALSE(Recognise(path)) << path;
  }
  const auto tracker = Recognise("/m/latest_checkpointed_iteration.txt");
  ASSERT_TRUE(tracker.has_value());
  EXPECT_EQ(tracker->framework, "megatron");
  EXPECT_EQ(tracker->role, FileRole::kCommitSignal);
  const CheckpointLayout* layout = LayoutRegistry::Builtin().Find("megatron");
  ASSERT_NE(layout, nullptr);
  auto target = layout->ResolveCommit(*tracker, "100");
  ASSERT_TRUE(target.ok());
  EXPECT_EQ(target->tag_dir, "/m/iter_0000100");
  EXPECT_EQ(target->tag, "iter_0000100");
  target = layout->ResolveCommit(*tracker, "release\n");
  ASSERT_TRUE(target.ok());
  EXPECT_EQ(target->tag_dir, "/m/release");
  EXPECT_FALSE(layout->ResolveCommit(*tracker, "-1").ok());
  EXPECT_FALSE(layout->ResolveCommit(*tracker, "12x").ok());
}

TEST(CheckpointLayoutTest, DcpNames) {
  const auto data = Recognise("/d/step_10/__0_0.distcp");
  ASSERT_TRUE(data.has_value());
  EXPECT_EQ(data->framework, "dcp");
  EXPECT_EQ(data->role, FileRole::kData);
  EXPECT_EQ(data->tag_dir, "/d/step_10");
  const auto metadata = Recognise("/d/step_10/.metadata");
  ASSERT_TRUE(metadata.has_value());
  EXPECT_EQ(metadata->role, FileRole::kCommitSignal);
  const auto target =
      LayoutRegistry::Builtin().Find("dcp")->ResolveCommit(*metadata, std::string_view());
  ASSERT_TRUE(target.ok());
  EXPECT_EQ(target->tag_dir, "/d/step_10");
  EXPECT_EQ(target->tag, "step_10");
  for (const char* path :
       {"/d/step_10/.metadata.tmp", "/d/step_10/.distcp", "/d/x.distcp.tmp", "/x.distcp"}) {
    EXPECT_FALSE(Recognise(path)) << path;
  }
}

TEST(CheckpointLayoutTest, FileNamePrefilterTurnsAwayOrdinaryFiles) {
  const LayoutRegistry& layouts = LayoutRegistry::Builtin();
  for (const char* name : {"train.log", "events.out.tfevents.1", "model.safetensors", "x.pt",
                           "latest.txt", "optim_states.pt.tmp", ".metadata.tmp", "distcp"}) {
    EXPECT_FALSE(layouts.MayMatchPath(name)) << name;
  }
  for (const char* name :
       {"latest", "mp_rank_00_model_states.pt", "model_optim_rng.pt", "distrib_optim.pt",
        "latest_checkpointed_iteration.txt", ".metadata", "__0_0.distcp"}) {
    EXPECT_TRUE(layouts.MayMatchPath(name)) << name;
  }
}

TEST(CheckpointLayoutTest, PathPrefilterDecidesOnTheLastComponent) {
  const LayoutRegistry& layouts = LayoutRegistry::Builtin();
  for (const char* path : {"ckpt/latest", "/ckpt/global_step5/mp_rank_00_model_states.pt",
                           "../iter_0000010/mp_rank_00/model_optim_rng.pt", "/a/.metadata"}) {
    EXPECT_TRUE(layouts.MayMatchPath(path)) << path;
  }
  // Whole names match a whole component only; directories ('/', "." and "..") never match.
  for (const char* path : {"ckpt/notlatest", "ckpt/latest/", "ckpt/latest/.", "latest/..",
                           "/latest/notes.txt", "/ckpt/mp_rank_00_model_states.pt/", "", "/"}) {
    EXPECT_FALSE(layouts.MayMatchPath(path)) << path;
  }
}

TEST(CheckpointLayoutTest, RootsLimitWhereNamesCount) {
  auto roots = RootSet::Create({"/ckpt/a/", "/data/./b"});
  ASSERT_TRUE(roots.ok());
  EXPECT_THAT(roots->roots(), ::testing::ElementsAre("/ckpt/a", "/data/b"));
  EXPECT_TRUE(Recognise("/ckpt/a/global_step5/mp_rank_00_model_states.pt", *roots));
  EXPECT_TRUE(Recognise("/data/b/x/global_step5/mp_rank_00_model_states.pt", *roots));
  EXPECT_TRUE(Recognise("/ckpt/a/latest", *roots));
  EXPECT_FALSE(Recognise("/ckpt/ab/global_step5/mp_rank_00_model_states.pt", *roots));
  EXPECT_FALSE(Recognise("/ckpt/global_step5/mp_rank_00_model_states.pt", *roots));
  EXPECT_FALSE(Recognise("/tmp/global_step5/mp_rank_00_model_states.pt", *roots));
  EXPECT_FALSE(RootSet::Create({"relative/dir"}).ok());
  EXPECT_FALSE(RootSet::Create({""}).ok());
}

TEST(CheckpointLayoutTest, RegistryRejectsDuplicateNames) {
  LayoutRegistry registry;
  ASSERT_TRUE(registry.Register(MakeDcpLayout()).ok());
  EXPECT_FALSE(registry.Register(MakeDcpLayout()).ok());
  EXPECT_NE(registry.Find("dcp"), nullptr);
  EXPECT_EQ(registry.Find("deepspeed"), nullptr);
  EXPECT_FALSE(registry.Recognise("/c/global_step5/mp_rank_00_model_states.pt", RootSet()));
}

// A layout known only by the file names it declares.
class NamedLayout final : public CheckpointLayout {
 public:
  NamedLayout(std::string name, FileNamePatterns patterns)
      : name_(std::move(name)), patterns_(std::move(patterns)) {}
  std::string_view name() const override { return name_; }
  std::optional<PathMatch> Recognise(std::string_view) const override { return std::nullopt; }
  FileNamePatterns FileNames() const override { return patterns_; }
  Result<CommitTarget> ResolveCommit(const PathMatch&, std::string_view) const override {
    return Status::Unsupported("no commits");
  }

 private:
  std::string name_;
  FileNamePatterns patterns_;
};

TEST(CheckpointLayoutTest, FileNameFilterIsTheUnionOfTheLayoutsPatterns) {
  LayoutRegistry registry;
  EXPECT_FALSE(registry.MayMatchPath("latest"));  // no layout, no name
  ASSERT_TRUE(
      registry
          .Register(std::make_unique<NamedLayout>("a", FileNamePatterns{{"done", "x"}, {".ckpt"}}))
          .ok());
  ASSERT_TRUE(
      registry.Register(std::make_unique<NamedLayout>("b", FileNamePatterns{{}, {"_part"}})).ok());
  for (const char* name : {"done", "x", "model.ckpt", ".ckpt", "shard_part", "_part"}) {
    EXPECT_TRUE(registry.MayMatchPath(name)) << name;
  }
  // Same last byte as a pattern but not the pattern; whole names only match whole.
  for (const char* name :
       {"", "e", "undone", "xx", "model.ckpt2", "model.cpt", "part", "shard_party", "done.tmp"}) {
    EXPECT_FALSE(registry.MayMatchPath(name)) << name;
  }
}

// The filter compares patterns with a path's last component: an empty one, or one holding a '/',
// could never match, and the filter would turn away that layout's files.
TEST(CheckpointLayoutTest, RegistryRejectsAPatternThatNoLastComponentCanMatch) {
  LayoutRegistry registry;
  const Status empty_name =
      registry.Register(std::make_unique<NamedLayout>("a", FileNamePatterns{{""}, {}}));
  EXPECT_EQ(empty_name.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_name.message(),
              ::testing::HasSubstr("\"a\": file name pattern \"\" is empty or holds a '/'"));
  EXPECT_FALSE(
      registry.Register(std::make_unique<NamedLayout>("b", FileNamePatterns{{"ok"}, {""}})).ok());
  const Status slash =
      registry.Register(std::make_unique<NamedLayout>("c", FileNamePatterns{{"ok"}, {"/x.pt"}}));
  EXPECT_EQ(slash.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(slash.message(), ::testing::HasSubstr("\"/x.pt\" is empty or holds a '/'"));
  // None was registered, nor left a pattern behind.
  EXPECT_EQ(registry.Find("a"), nullptr);
  EXPECT_EQ(registry.Find("b"), nullptr);
  EXPECT_EQ(registry.Find("c"), nullptr);
  EXPECT_FALSE(registry.MayMatchPath("ok"));
}

}  // namespace
}  // namespace ucp
