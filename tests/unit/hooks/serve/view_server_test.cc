#include "hooks/serve/view_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "core/tag/atoms_store.h"
#include "core/tag/journal.h"
#include "tests/unit/core/test_bytes.h"
#include "tests/unit/hooks/serve/served_tag.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;
using testing::FixtureTag;
using ::testing::IsEmpty;
using testing::PrepareTag;
using ::testing::UnorderedElementsAre;
using ucp::testing::ReadAll;
using ucp::testing::ScratchDirectory;
using Kind = ServeDecision::Kind;

constexpr const char* kModel = "mp_rank_00_model_states.pt";

std::string Optim(int rank) {
  return "zero_pp_rank_" + std::to_string(rank) + "_mp_rank_00_optim_states.pt";
}

class ViewServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = ScratchDirectory("view_server");
    tag_ = (scratch_ / "ckpt" / "global_step5").string();
    PrepareTag(FixtureTag("z2_fp32", "dp4"), tag_);
  }

  // A server whose current topology is dp=`dp` (0: unresolvable, with `unresolved`).
  ViewServer Server(uint32_t dp, bool strict = false, std::string cache_dir = "",
                    StatusCode unresolved = StatusCode::kFailedPrecondition) {
    ViewServerOptions options;
    options.strict = strict;
    options.cache_dir = std::move(cache_dir);
    options.current_topology = [dp, unresolved](const Topology& source) -> Result<CurrentTopology> {
      if (dp == 0) return Status(unresolved, "unresolvable");
      CurrentTopology current;
      current.topology = source;
      current.topology.dp = dp;
      current.topology.world = dp;
      current.evidence = "test";
      return current;
    };
    return ViewServer(std::move(options));
  }

  std::string Path(const std::string& name) const { return tag_ + "/" + name; }

  fs::path scratch_;
  std::string tag_;
};

TEST_F(ViewServerTest, SameTopologyPassesThroughWithoutCreatingViews) {
  ViewServer server = Server(4);
  for (const std::string& name : {std::string(kModel), Optim(0), Optim(3)}) {
    EXPECT_EQ(server.Resolve(Path(name)).kind, Kind::kPassThrough) << name;
  }
  EXPECT_EQ(server.ChangeListing(tag_), std::nullopt);
  EXPECT_FALSE(fs::exists(tag_ + "/.ucp/views"));
}

TEST_F(ViewServerTest, FewerRanksSubstituteTheirFilesAndHideTheRest) {
  ViewServer server = Server(2);
  const ServeDecision model = server.Resolve(Path(kModel));
  ASSERT_EQ(model.kind, Kind::kSubstitute);
  EXPECT_EQ(model.path, tag_ + "/.ucp/views/tp1-pp1-dp2/served." + kModel);
  EXPECT_FALSE(ReadAll(model.path).empty());
  const ServeDecision rank1 = server.Resolve(Path(Optim(1)));
  ASSERT_EQ(rank1.kind, Kind::kSubstitute);
  EXPECT_EQ(rank1.path, tag_ + "/.ucp/views/tp1-pp1-dp2/served." + Optim(1));
  EXPECT_TRUE(fs::is_regular_file(rank1.path));
  EXPECT_EQ(server.Resolve(Path(Optim(2))).kind, Kind::kAbsent);
  EXPECT_EQ(server.Resolve(Path(Optim(3))).kind, Kind::kAbsent);

  const std::optional<ListingChange> change = server.ChangeListing(tag_);
  ASSERT_TRUE(change.has_value());
  EXPECT_THAT(change->hide, UnorderedElementsAre(Optim(2), Optim(3)));
  EXPECT_THAT(change->add, IsEmpty());
}

TEST_F(ViewServerTest, MoreRanksAddTheirFilesToTheListing) {
  ViewServer server = Server(8);
  const std::optional<ListingChange> change = server.ChangeListing(tag_);
  ASSERT_TRUE(change.has_value());
  EXPECT_THAT(change->hide, IsEmpty());
  EXPECT_THAT(change->add, UnorderedElementsAre(Optim(4), Optim(5), Optim(6), Optim(7)));
  for (const std::string& name : change->add) {
    const ServeDecision decision = server.Resolve(Path(name));
    EXPECT_EQ(decision.kind, Kind::kSubstitute) << name;
    EXPECT_TRUE(fs::is_regular_file(decision.path)) << name;
  }
}

// A stat of a view's file builds nothing: it describes the file by a placeholder of the size the
// build then gives (DeepSpeed stats every rank's optimizer file before any rank reads its own).
TEST_F(ViewServerTest, MetadataOfAViewFileIsAnsweredWithoutBuildingIt) {
  ViewServer server = Server(8);
  const std::string views = tag_ + "/.ucp/views/tp1-pp1-dp8/";
  std::map<std::string, uint64_t> described;
  for (const std::string& name : {std::string(kModel), Optim(0), Optim(5), Optim(7)}) {
    const ServeDecision decision = server.ResolveMetadata(Path(name));
    ASSERT_EQ(decision.kind, Kind::kSubstitute) << name;
    EXPECT_EQ(decision.path, views + ".planned/served." + name);
    struct stat info;
    ASSERT_EQ(::stat(decision.path.c_str(), &info), 0) << decision.path;
    EXPECT_TRUE(S_ISREG(info.st_mode));
    described[name] = static_cast<uint64_t>(info.st_size);
    EXPECT_FALSE(fs::exists(views + "served." + name)) << name << " was built by a stat";
    // The placeholder holds no data: nothing is written, whatever its size.
    EXPECT_LT(static_cast<uint64_t>(info.st_blocks) * 512, std::max<uint64_t>(info.st_size, 1));
  }
  // Opening builds; the file has the size its stat gave, and a stat now names the built file.
  for (const auto& [name, size] : described) {
    const ServeDecision opened = server.Resolve(Path(name));
    ASSERT_EQ(opened.kind, Kind::kSubstitute) << name;
    EXPECT_EQ(opened.path, views + "served." + name);
    EXPECT_EQ(fs::file_size(opened.path), size) << name;
  }
  ViewServer later = Server(8);
  EXPECT_EQ(later.ResolveMetadata(Path(Optim(5))).path, views + "served." + Optim(5));
  // Source files the view lacks, and unrelated paths, answer as for an open.
  ViewServer fewer = Server(2);
  EXPECT_EQ(fewer.ResolveMetadata(Path(Optim(3))).kind, Kind::kAbsent);
  EXPECT_EQ(fewer.ResolveMetadata(tag_ + "/notes.txt").kind, Kind::kPassThrough);
}

// UCP_MODE=atoms's store made by every rank, then the framework's files removed.
void KeepOnlyTheStore(const std::string& tag) {
  const uint64_t index_xxh3 = HashFile(tag + "/.ucp/index.json").value().xxh3;
  const std::shared_ptr<const AtomIndex> index = testing::ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  for (uint32_t rank = 0; rank < index->contents().topology.world; ++rank) {
    ASSERT_TRUE(WriteStoreShare(*index, index_xxh3, tag, rank, ExecuteOptions{}).ok());
  }
  ASSERT_TRUE(FinalizeStore(tag, index_xxh3).value());
  for (const std::string& name : testing::FilesIn(tag)) fs::remove(tag + "/" + name);
}

TEST_F(ViewServerTest, WithTheFilesGoneTheStoreIsServedAtTheSameTopology) {
  KeepOnlyTheStore(tag_);
  ViewServer server = Server(4);
  const ServeDecision model = server.Resolve(Path(kModel));
  ASSERT_EQ(model.kind, Kind::kSubstitute);
  EXPECT_EQ(model.path, tag_ + "/.ucp/views/tp1-pp1-dp4/served." + kModel);
  EXPECT_FALSE(ReadAll(model.path).empty());
  const std::optional<ListingChange> change = server.ChangeListing(tag_);
  ASSERT_TRUE(change.has_value());
  EXPECT_THAT(change->hide, IsEmpty());
  EXPECT_THAT(change->add, UnorderedElementsAre(kModel, Optim(0), Optim(1), Optim(2), Optim(3)));
}

TEST_F(ViewServerTest, WithTheFilesGoneTheStoreIsServedAtAnotherTopology) {
  KeepOnlyTheStore(tag_);
  ViewServer server = Server(2);
  EXPECT_EQ(server.Resolve(Path(Optim(1))).kind, Kind::kSubstitute);
  EXPECT_EQ(server.Resolve(Path(Optim(3))).kind, Kind::kAbsent);
  const std::optional<ListingChange> change = server.ChangeListing(tag_);
  ASSERT_TRUE(change.has_value());
  EXPECT_THAT(change->hide, UnorderedElementsAre(Optim(2), Optim(3)));
  EXPECT_THAT(change->add, UnorderedElementsAre(kModel, Optim(0), Optim(1)));
}

TEST_F(ViewServerTest, AFileGoneWithoutAStorePassesThroughOrFailsWhenStrict) {
  fs::remove(Path(Optim(3)));
  EXPECT_EQ(Server(4).Resolve(Path(Optim(0))).kind, Kind::kPassThrough);
  EXPECT_EQ(Server(4, /*strict=*/true).Resolve(Path(Optim(0))).kind, Kind::kPassThrough);
  EXPECT_EQ(Server(2).Resolve(Path(Optim(0))).kind, Kind::kPassThrough);
  EXPECT_EQ(Server(2, /*strict=*/true).Resolve(Path(Optim(0))).kind, Kind::kFail);
  EXPECT_FALSE(fs::exists(tag_ + "/.ucp/views"));
}

TEST_F(ViewServerTest, UnrelatedPathsAndOtherDirectoriesPassThrough) {
  ViewServer server = Server(2);
  EXPECT_EQ(server.Resolve("/usr/lib/python3/dist-packages/torch/__init__.py").kind,
            Kind::kPassThrough);
  EXPECT_EQ(server.Resolve(tag_ + "/notes.txt").kind, Kind::kPassThrough);
  // The pre-check the interposer makes on the path as the host spelled it, before it computes an
  // absolute path.
  EXPECT_FALSE(server.MayServePath("notes.txt"));
  EXPECT_FALSE(server.MayServePath("/usr/lib/python3/dist-packages/torch/__init__.py"));
  EXPECT_FALSE(server.MayServePath(Path(kModel) + "/."));
  EXPECT_TRUE(server.MayServePath(Optim(1)));
  EXPECT_TRUE(server.MayServePath(Path(kModel)));
  EXPECT_TRUE(server.MayServePath("global_step5/" + std::string(kModel)));
  EXPECT_EQ(server.ChangeListing(scratch_.string()), std::nullopt);
  EXPECT_FALSE(fs::exists(tag_ + "/.ucp/views"));
}

TEST_F(ViewServerTest, TagWithoutIndexPassesThroughEvenWhenStrict) {
  fs::remove(tag_ + "/.ucp/index.json");
  ViewServer server = Server(2, /*strict=*/true);
  EXPECT_EQ(server.Resolve(Path(Optim(3))).kind, Kind::kPassThrough);
  EXPECT_EQ(server.ChangeListing(tag_), std::nullopt);
}

TEST_F(ViewServerTest, FailuresPassThroughOrFailWhenStrict) {
  // Unresolvable topology.
  EXPECT_EQ(Server(0).Resolve(Path(kModel)).kind, Kind::kPassThrough);
  EXPECT_EQ(Server(0, /*strict=*/true).Resolve(Path(kModel)).kind, Kind::kFail);
  // No evidence of a job at all: nothing says the topology changed, even under UCP_STRICT.
  EXPECT_EQ(Server(0, /*strict=*/true, "", StatusCode::kNotFound).Resolve(Path(kModel)).kind,
            Kind::kPassThrough);

  // A source file that no longer matches the index.
  {
    std::FILE* file = std::fopen(Path(Optim(0)).c_str(), "r+b");
    ASSERT_NE(file, nullptr);
    ASSERT_EQ(std::fseek(file, 1000, SEEK_SET), 0);
    const int c = std::fgetc(file);
    ASSERT_EQ(std::fseek(file, 1000, SEEK_SET), 0);
    std::fputc(c ^ 1, file);
    std::fclose(file);
  }
  ViewServer lenient = Server(2);
  EXPECT_EQ(lenient.Resolve(Path(Optim(1))).kind, Kind::kPassThrough);
  EXPECT_EQ(lenient.Resolve(Path(Optim(3))).kind, Kind::kPassThrough);
  EXPECT_EQ(lenient.ChangeListing(tag_), std::nullopt);
  ViewServer strict = Server(2, /*strict=*/true);
  EXPECT_EQ(strict.Resolve(Path(Optim(1))).kind, Kind::kFail);
}

TEST_F(ViewServerTest, ResavedIndexIsReadAgain) {
  ViewServer server = Server(2);
  EXPECT_EQ(server.Resolve(Path(Optim(3))).kind, Kind::kAbsent);
  // Saved again at dp2 (the current topology): pass-through from now on.
  PrepareTag(FixtureTag("z2_fp32", "dp2"), tag_);
  EXPECT_EQ(server.Resolve(Path(Optim(1))).kind, Kind::kPassThrough);
  EXPECT_EQ(server.ChangeListing(tag_), std::nullopt);
}

TEST_F(ViewServerTest, CacheDirectoryHoldsTheViews) {
  const std::string cache = (scratch_ / "cache").string();
  ViewServer server = Server(2, false, cache);
  const ServeDecision decision = server.Resolve(Path(kModel));
  ASSERT_EQ(decision.kind, Kind::kSubstitute);
  EXPECT_EQ(decision.path,
            ViewDirectory(tag_, cache, Topology{.dp = 2, .tp = 1, .pp = 1, .world = 2}) + "/" +
                StoredName(kModel));
  EXPECT_FALSE(fs::exists(tag_ + "/.ucp/views"));
  // The cache's own files are never taken for a tag's.
  EXPECT_EQ(server.Resolve(decision.path).kind, Kind::kPassThrough);
}

}  // namespace
}  // namespace ucp::hooks
