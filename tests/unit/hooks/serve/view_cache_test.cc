#include "hooks/serve/view_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/frameworks/deepspeed/zero.h"
#include "core/io/file.h"
#include "tests/unit/core/test_bytes.h"
#include "tests/unit/hooks/serve/served_tag.h"

namespace ucp::hooks {
namespace {

namespace fs = std::filesystem;
using testing::Dp;
using testing::FilesIn;
using testing::FixtureTag;
using ::testing::HasSubstr;
using testing::PrepareTag;
using testing::ReadIndex;
using testing::Reshard;
using ucp::testing::ReadAll;
using ucp::testing::ScratchDirectory;

const DeepSpeedZeroAdapter kAdapter;

// Every file of `view` (materialized first) has the bytes of the same file in `expected_dir`, and
// the view has exactly the files of expected_dir.
void ExpectViewEquals(View& view, const std::string& expected_dir) {
  EXPECT_EQ(view.names(), FilesIn(expected_dir));
  for (const std::string& name : view.names()) {
    Result<std::string> path = view.Materialize(name);
    ASSERT_TRUE(path.ok()) << path.status().ToString();
    EXPECT_EQ(*path, view.directory() + "/served." + name);
    const std::string bytes = ReadAll(*path);
    EXPECT_FALSE(bytes.empty()) << *path;
    EXPECT_TRUE(bytes == ReadAll(expected_dir + "/" + name)) << name << " differs";
  }
}

class ViewCacheEquivalenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ViewCacheEquivalenceTest, ViewsEqualUcpReshardAtEveryDp) {
  const fs::path scratch = ScratchDirectory("view_cache");
  const std::string tag = (scratch / "ckpt" / "global_step5").string();
  const uint64_t index_xxh3 = PrepareTag(FixtureTag(GetParam(), "dp4"), tag);
  const std::shared_ptr<const AtomIndex> index = ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  for (const uint32_t dp : {1u, 2u, 8u}) {
    SCOPED_TRACE("dp=" + std::to_string(dp));
    Result<std::unique_ptr<View>> view = View::Open(kAdapter, index, index_xxh3, tag, "", Dp(dp));
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ((*view)->directory(), tag + "/.ucp/views/tp1-pp1-dp" + std::to_string(dp));
    const std::string expected =
        Reshard(tag, dp, (scratch / ("out" + std::to_string(dp))).string());
    ExpectViewEquals(**view, expected);
    EXPECT_EQ((*view)->built(), (*view)->names().size());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ViewCacheEquivalenceTest,
                         ::testing::Values("z2_fp32", "z1_bf16_bf16opt"));

TEST(ViewDirectoryTest, CacheDirectoryNamesTheTagAndItsPathHash) {
  const std::string a = ViewDirectory("/ckpt/a/global_step5", "/cache", Dp(2));
  const std::string b = ViewDirectory("/ckpt/b/global_step5", "/cache", Dp(2));
  EXPECT_THAT(a, ::testing::MatchesRegex("/cache/global_step5-[0-9a-f]{16}/tp1-pp1-dp2"));
  EXPECT_NE(a, b);
  EXPECT_EQ(ViewDirectory("/ckpt/a/global_step5", "", Dp(8)),
            "/ckpt/a/global_step5/.ucp/views/tp1-pp1-dp8");
}

TEST(ViewDirectoryTest, AnExpertSizeAndAPartitionGivenNameTheirOwnViews) {
  Topology target = Dp(2);
  target.pp = 4;
  target.ep = 1;
  EXPECT_EQ(ViewDirectory("/t", "", target), "/t/.ucp/views/tp1-pp4-dp2-ep1");
  target.partition = LayerPartition::kUniform;
  EXPECT_EQ(ViewDirectory("/t", "", target), "/t/.ucp/views/tp1-pp4-dp2-ep1-uniform");
}

TEST(BuildOrderTest, EachProcessStartsItsBuildsAtItsPlaceInTheJob) {
  EXPECT_THAT(BuildOrder(5, JobPlace{0, 4}), ::testing::ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(BuildOrder(5, JobPlace{2, 4}), ::testing::ElementsAre(2, 3, 4, 0, 1));
  EXPECT_THAT(BuildOrder(5, JobPlace{3, 4}), ::testing::ElementsAre(3, 4, 0, 1, 2));
  // More processes than files: neighbours share a start, every file is someone's start.
  std::set<size_t> starts;
  for (uint32_t rank = 0; rank < 16; ++rank) starts.insert(BuildOrder(3, JobPlace{rank, 16})[0]);
  EXPECT_EQ(starts, (std::set<size_t>{0, 1, 2}));
  // Without a place: some rotation of every file, the same for the same process.
  const std::vector<size_t> unplaced = BuildOrder(7, std::nullopt);
  EXPECT_EQ(std::set<size_t>(unplaced.begin(), unplaced.end()).size(), 7u);
  EXPECT_EQ(unplaced[1], (unplaced[0] + 1) % 7);
  EXPECT_EQ(unplaced, BuildOrder(7, std::nullopt));
  EXPECT_TRUE(BuildOrder(0, JobPlace{1, 2}).empty());
}

// A writable copy of the z2_fp32 fixture's DP 4 tag, indexed with chunk hashes, in a scratch
// directory of its own.
class ViewCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = ScratchDirectory("view_cache");
    tag_ = (scratch_ / "global_step5").string();
    index_xxh3_ = PrepareTag(FixtureTag("z2_fp32", "dp4"), tag_);
  }

  // The tag's view at DP `dp`, inside the tag (`cache` empty) or under `cache`.
  Result<std::unique_ptr<View>> Open(uint32_t dp, const std::string& cache = "",
                                     std::optional<JobPlace> place = std::nullopt,
                                     uint64_t part_bytes = 0,
                                     const OwnerLease::Options& lease = {}) const {
    return View::Open(kAdapter, ReadIndex(tag_), index_xxh3_, tag_, cache, Dp(dp), lease, place,
                      part_bytes);
  }

  fs::path scratch_;
  std::string tag_;
  uint64_t index_xxh3_ = 0;
};

TEST_F(ViewCacheTest, AFileClaimedByALiveBuilderIsLeftToItAndAwaited) {
  Result<std::unique_ptr<View>> view = Open(2, "", JobPlace{0, 2});
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  // Another process of the job claimed the model states (its lease, alive) before this one came.
  const std::string claimed = "mp_rank_00_model_states.pt";
  Result<std::optional<OwnerLease>> lease =
      OwnerLease::Acquire((*view)->directory() + "/." + claimed + ".lease", {});
  ASSERT_TRUE(lease.ok() && lease->has_value()) << lease.status().ToString();
  Result<std::string> served = Status::Internal("not yet");
  std::thread reader(
      [&] { served = (*view)->Materialize("zero_pp_rank_0_mp_rank_00_optim_states.pt"); });
  // It builds every other file, leaves the claimed one, and waits.
  const std::string stored = (*view)->directory() + "/" + StoredName(claimed);
  for (const std::string& name : (*view)->names()) {
    if (name == claimed) continue;
    for (int i = 0; i < 2000 && !fs::exists((*view)->directory() + "/" + StoredName(name)); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(fs::exists((*view)->directory() + "/" + StoredName(name))) << name;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(fs::exists(stored));
  EXPECT_FALSE(fs::exists((*view)->directory() + "/verdict"));
  // The claimant gives up without building: the waiter takes the file over.
  lease->reset();
  reader.join();
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  EXPECT_EQ((*view)->built(), (*view)->names().size());
  EXPECT_EQ(ReadAll((*view)->directory() + "/verdict"), "complete\n");
  ExpectViewEquals(**view, Reshard(tag_, 2, (scratch_ / "out").string()));
}

TEST_F(ViewCacheTest, TheViewsCreatorMakesEveryPlaceholderAndADescribeAsksNothingAfterwards) {
  Result<std::unique_ptr<View>> view = Open(8);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const std::string planned = (*view)->directory() + "/.planned/";
  for (const std::string& name : (*view)->names()) {
    EXPECT_TRUE(fs::is_regular_file(planned + StoredName(name))) << name;
  }
  const std::string first = "zero_pp_rank_0_mp_rank_00_optim_states.pt";
  Result<std::string> described = (*view)->Describe(first);
  ASSERT_TRUE(described.ok()) << described.status().ToString();
  EXPECT_EQ(*described, planned + StoredName(first));
  // After the first, a Describe asks the file system nothing: it answers with the path the
  // view's creator made, which it does not look for (removed here to show it).
  fs::remove_all(planned);
  const std::string later = "zero_pp_rank_7_mp_rank_00_optim_states.pt";
  Result<std::string> answered = (*view)->Describe(later);
  ASSERT_TRUE(answered.ok()) << answered.status().ToString();
  EXPECT_EQ(*answered, planned + StoredName(later));
  EXPECT_EQ((*view)->built(), 0u);
}

TEST_F(ViewCacheTest, UnknownNameIsNotFound) {
  Result<std::unique_ptr<View>> view = Open(2);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  Result<std::string> missing = (*view)->Materialize("zero_pp_rank_3_mp_rank_00_optim_states.pt");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

// Builds every file of the view at `target`, starting at a different name per caller, and returns
// how many it built.
Result<uint64_t> BuildAll(const std::string& tag, uint64_t index_xxh3, const Topology& target,
                          size_t start) {
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<View> view,
                       View::Open(kAdapter, ReadIndex(tag), index_xxh3, tag, "", target));
  const std::vector<std::string> names(view->names().begin(), view->names().end());
  for (size_t i = 0; i < names.size(); ++i) {
    UCP_RETURN_IF_ERROR(view->Materialize(names[(start + i) % names.size()]).status());
  }
  return view->built();
}

TEST_F(ViewCacheTest, EachFileIsBuiltOnceAcrossThreadsAndProcesses) {
  constexpr int kThreads = 8;
  constexpr int kChildren = 4;
  int go[2];
  int results[2];
  ASSERT_EQ(::pipe(go), 0);
  ASSERT_EQ(::pipe(results), 0);
  std::vector<pid_t> children;
  for (int c = 0; c < kChildren; ++c) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      char byte;
      if (::read(go[0], &byte, 1) != 1) ::_exit(2);
      Result<uint64_t> built = BuildAll(tag_, index_xxh3_, Dp(8), static_cast<size_t>(c));
      if (!built.ok()) ::_exit(1);
      const uint64_t count = *built;
      ::_exit(::write(results[1], &count, sizeof(count)) == sizeof(count) ? 0 : 3);
    }
    children.push_back(pid);
  }
  std::atomic<bool> start{false};
  std::atomic<uint64_t> built_by_threads{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!start.load()) std::this_thread::yield();
      Result<uint64_t> built = BuildAll(tag_, index_xxh3_, Dp(8), static_cast<size_t>(t));
      if (built.ok()) {
        built_by_threads += *built;
      } else {
        ++failures;
        ADD_FAILURE() << built.status().ToString();
      }
    });
  }
  const std::string release(kChildren, 'x');
  ASSERT_EQ(::write(go[1], release.data(), release.size()), kChildren);
  start = true;
  for (std::thread& thread : threads) thread.join();
  uint64_t built_by_children = 0;
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    uint64_t count = 0;
    ASSERT_EQ(::read(results[0], &count, sizeof(count)), static_cast<ssize_t>(sizeof(count)));
    built_by_children += count;
  }
  for (const int fd : {go[0], go[1], results[0], results[1]}) ::close(fd);
  EXPECT_EQ(failures.load(), 0);

  Result<std::unique_ptr<View>> view = Open(8);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(built_by_threads + built_by_children, (*view)->names().size());
  ExpectViewEquals(**view, Reshard(tag_, 8, (scratch_ / "out").string()));
  EXPECT_EQ((*view)->built(), 0u);
}

// Parts of 32 KiB: the 0.26 MB model states (one storage, the flat fp32 weights, cut in 7) and
// each DP 2 optimizer file are built in parts.
constexpr uint64_t kPartBytes = 32 << 10;

// The parts of every file the view at DP 2 builds in parts, in all.
size_t PartsOfTheView(const AtomIndex& index, const std::string& tag) {
  size_t total = 0;
  const OutputPlan plan = kAdapter.PlanReshard(index, tag, Dp(2)).value();
  for (const ArchiveOutput& archive : plan.archives) {
    const size_t parts = PlanArchiveParts(archive, kPartBytes).value().size();
    if (parts > 1) total += parts;
  }
  return total;
}

// Four processes of one job, each asking for its own file as DeepSpeed's load does: the files
// big enough are built in parts, each part written once by whichever process took it; every file
// is the bytes `ucp reshard` writes, and nothing of the parts is left.
TEST_F(ViewCacheTest, LargeFilesAreBuiltInPartsByTheJobsProcesses) {
  const size_t expected_parts = PartsOfTheView(*ReadIndex(tag_), tag_);
  ASSERT_GE(expected_parts, 3u * 3);  // the model states and the optimizer files are split
  constexpr int kChildren = 4;
  int results[2];
  ASSERT_EQ(::pipe(results), 0);
  std::vector<pid_t> children;
  for (int c = 0; c < kChildren; ++c) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      Result<std::unique_ptr<View>> view =
          Open(2, "", JobPlace{static_cast<uint32_t>(c), kChildren}, kPartBytes);
      if (!view.ok()) ::_exit(1);
      const std::string name =
          c % 2 == 0 ? "mp_rank_00_model_states.pt"
                     : "zero_pp_rank_" + std::to_string(c / 2) + "_mp_rank_00_optim_states.pt";
      if (!(*view)->Materialize(name).ok()) ::_exit(2);
      const uint64_t counts[2] = {(*view)->parts_built(), (*view)->built()};
      ::_exit(::write(results[1], counts, sizeof(counts)) == sizeof(counts) ? 0 : 3);
    }
    children.push_back(pid);
  }
  uint64_t parts = 0;
  uint64_t built = 0;
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    uint64_t counts[2] = {0, 0};
    ASSERT_EQ(::read(results[0], counts, sizeof(counts)), static_cast<ssize_t>(sizeof(counts)));
    parts += counts[0];
    built += counts[1];
  }
  for (const int fd : results) ::close(fd);
  Result<std::unique_ptr<View>> view = Open(2, "", std::nullopt, kPartBytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(parts, expected_parts);
  EXPECT_EQ(built, (*view)->names().size());
  ExpectViewEquals(**view, Reshard(tag_, 2, (scratch_ / "out").string()));
  for (const auto& entry : fs::directory_iterator((*view)->directory())) {
    const std::string file = entry.path().filename().string();
    EXPECT_FALSE(file.ends_with(".parts") || file.ends_with(".lease")) << file;
  }
}

// The owner of a part that died mid-build (its lease left behind, its pid gone) is taken over at
// once; one that hangs, once its lease is stale; the file is the whole build's either way.
TEST_F(ViewCacheTest, APartWhoseOwnerDiedOrHangsIsTakenOver) {
  Result<std::unique_ptr<View>> view = Open(2, "", JobPlace{0, 1}, kPartBytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const std::string dead = (*view)->directory() + "/.mp_rank_00_model_states.pt#part1of7.lease";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Result<std::optional<OwnerLease>> lease = OwnerLease::Acquire(dead, {});
    ::_exit(lease.ok() && lease->has_value() ? 0 : 1);  // dies holding it
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(fs::exists(dead));

  OwnerLease::Options short_lease;
  short_lease.stale_after = std::chrono::milliseconds(300);
  const std::string hung = (*view)->directory() + "/.mp_rank_00_model_states.pt#part0of7.lease";
  const pid_t stopped = ::fork();
  ASSERT_GE(stopped, 0);
  if (stopped == 0) {
    Result<std::optional<OwnerLease>> lease = OwnerLease::Acquire(hung, short_lease);
    if (!lease.ok() || !lease->has_value()) ::_exit(1);
    ::raise(SIGSTOP);  // hangs holding it
    ::_exit(0);
  }
  ASSERT_EQ(::waitpid(stopped, &status, WUNTRACED), stopped);
  ASSERT_TRUE(WIFSTOPPED(status));

  Result<std::unique_ptr<View>> taker = Open(2, "", JobPlace{0, 1}, kPartBytes, short_lease);
  ASSERT_TRUE(taker.ok()) << taker.status().ToString();
  const auto start = std::chrono::steady_clock::now();
  const Result<std::string> served = (*taker)->Materialize("mp_rank_00_model_states.pt");
  // The dead owner's part at once, the hung one's after its lease was seen unchanged that long.
  EXPECT_GE(std::chrono::steady_clock::now() - start, short_lease.stale_after);
  ::kill(stopped, SIGKILL);
  ASSERT_EQ(::waitpid(stopped, &status, 0), stopped);
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  EXPECT_EQ((*taker)->parts_built(), PartsOfTheView(*ReadIndex(tag_), tag_));
  ExpectViewEquals(**taker, Reshard(tag_, 2, (scratch_ / "out").string()));
}

TEST_F(ViewCacheTest, ResavedTagRebuildsTheView) {
  const uint64_t first = index_xxh3_;
  Result<std::unique_ptr<View>> old_view =
      View::Open(kAdapter, ReadIndex(tag_), first, tag_, "", Dp(1));
  ASSERT_TRUE(old_view.ok()) << old_view.status().ToString();
  ExpectViewEquals(**old_view, Reshard(tag_, 1, (scratch_ / "out_first").string()));

  // The same tag saved again by another run (at dp2).
  const uint64_t second = PrepareTag(FixtureTag("z2_fp32", "dp2"), tag_);
  ASSERT_NE(first, second);
  Result<std::unique_ptr<View>> view =
      View::Open(kAdapter, ReadIndex(tag_), second, tag_, "", Dp(1));
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const std::string expected = Reshard(tag_, 1, (scratch_ / "out_second").string());
  ExpectViewEquals(**view, expected);
  EXPECT_EQ((*view)->built(), (*view)->names().size());
  EXPECT_FALSE(ReadAll((scratch_ / "out_first/global_step5/mp_rank_00_model_states.pt").string()) ==
               ReadAll(expected + "/mp_rank_00_model_states.pt"));
}

// Flips one byte in the middle of `path`.
void FlipMiddleByte(const std::string& path) {
  Result<File> file = File::Open(path, File::Mode::kReadWrite);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  Result<uint64_t> size = file->Size();
  ASSERT_TRUE(size.ok());
  std::byte byte{};
  ASSERT_TRUE(file->ReadAt(*size / 2, {&byte, 1}).ok());
  byte ^= std::byte{0x40};
  ASSERT_TRUE(file->WriteAt(*size / 2, {&byte, 1}).ok());
}

TEST_F(ViewCacheTest, WithoutChunkHashesACorruptedSourceFailsTheOpenNamingTheFile) {
  index_xxh3_ = PrepareTag(FixtureTag("z2_fp32", "dp4"), tag_, /*chunk_hashes=*/false);
  const std::string victim = tag_ + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  FlipMiddleByte(victim);
  for (int attempt = 0; attempt < 2; ++attempt) {  // the second finds the verdict in view.json
    Result<std::unique_ptr<View>> view = Open(2);
    ASSERT_FALSE(view.ok());
    EXPECT_EQ(view.status().code(), StatusCode::kCorrupt);
    EXPECT_THAT(view.status().message(), HasSubstr(victim));
  }
  EXPECT_THAT(ReadAll(tag_ + "/.ucp/views/tp1-pp1-dp2/view.json"),
              HasSubstr("\"verified\": false"));
}

TEST_F(ViewCacheTest, ADamagedChunkFailsTheWholeViewForTheJobNamingTheRangeAndAtoms) {
  // dp4 rank 1's partition goes to dp2 rank 0's file, and to no other.
  const std::string victim = tag_ + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  FlipMiddleByte(victim);
  Result<std::unique_ptr<View>> view = Open(2);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  // A file that reads no damaged byte is not served either: the view is read whole or not at all.
  const Result<std::string> healthy = (*view)->Materialize("mp_rank_00_model_states.pt");
  ASSERT_FALSE(healthy.ok());
  EXPECT_EQ(healthy.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(healthy.status().message(), HasSubstr("source " + victim + ": bytes [0, "));
  EXPECT_THAT(healthy.status().message(),
              HasSubstr("/data/2 fails its CRC-32 (it holds exp_avg_sq of blocks.0.fc1.weight"));
  EXPECT_FALSE(
      fs::exists((*view)->directory() + "/served.zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  EXPECT_FALSE((*view)->Materialize("zero_pp_rank_1_mp_rank_00_optim_states.pt").ok());
  // Recorded for the job: no process opens the view again, nor builds another file of it.
  EXPECT_THAT(ReadAll((*view)->directory() + "/verdict"), HasSubstr(victim));
  Result<std::unique_ptr<View>> again = Open(2);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("failed to build a file of it"));
  EXPECT_THAT(again.status().message(), HasSubstr(victim));
}

// A part checks the chunks it reads as a whole build does: the damage fails the view, naming it,
// and the parts' files go.
TEST_F(ViewCacheTest, APartMeetingADamagedChunkFailsTheViewAndLeavesNoPartsFile) {
  FlipMiddleByte(tag_ + "/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  Result<std::unique_ptr<View>> view = Open(2, "", JobPlace{0, 1}, kPartBytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const Result<std::string> served = (*view)->Materialize("mp_rank_00_model_states.pt");
  ASSERT_FALSE(served.ok());
  EXPECT_THAT(served.status().message(), HasSubstr("fails its CRC-32"));
  EXPECT_THAT(served.status().message(), HasSubstr("view: build part "));
  EXPECT_THAT(ReadAll((*view)->directory() + "/verdict"), HasSubstr("fails its CRC-32"));
  for (const auto& entry : fs::directory_iterator((*view)->directory())) {
    EXPECT_FALSE(entry.path().filename().string().ends_with(".parts")) << entry.path();
  }
}

TEST_F(ViewCacheTest, UnderACacheDirectoryAProcessBuildsOnlyWhatItAsksFor) {
  // A node's own disk: the node builds what its ranks read, not the whole view.
  const std::string cache = (scratch_ / "node_cache").string();
  Result<std::unique_ptr<View>> view = Open(2, cache);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const std::string asked = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
  ASSERT_TRUE((*view)->Materialize(asked).ok());
  EXPECT_EQ((*view)->built(), 1u);
  for (const std::string& name : (*view)->names()) {
    EXPECT_EQ(fs::exists((*view)->directory() + "/" + StoredName(name)), name == asked) << name;
  }
  EXPECT_FALSE(fs::exists((*view)->directory() + "/verdict"));

  // A damaged chunk stops the view for what is not built yet, in every process of the node.
  FlipMiddleByte(tag_ + "/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  const Result<std::string> damaged =
      (*view)->Materialize("zero_pp_rank_0_mp_rank_00_optim_states.pt");
  ASSERT_FALSE(damaged.ok());
  EXPECT_THAT(damaged.status().message(), HasSubstr("fails its CRC-32"));
  EXPECT_FALSE((*view)->Materialize("mp_rank_00_model_states.pt").ok());
  EXPECT_FALSE(Open(2, cache).ok());
}

TEST_F(ViewCacheTest, NoFileIsServedBeforeEveryFileIsBuiltAndTheVerdictStands) {
  Result<std::unique_ptr<View>> view = Open(2);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const Result<std::string> first =
      (*view)->Materialize("zero_pp_rank_1_mp_rank_00_optim_states.pt");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ((*view)->built(), (*view)->names().size());
  for (const std::string& name : (*view)->names()) {
    EXPECT_TRUE(fs::exists((*view)->directory() + "/" + StoredName(name))) << name;
  }
  EXPECT_EQ(ReadAll((*view)->directory() + "/verdict"), "complete\n");
  // Damage found after the verdict changes nothing for the job: every file was checked as built.
  FlipMiddleByte(tag_ + "/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  Result<std::unique_ptr<View>> later = Open(2);
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  EXPECT_TRUE((*later)->Materialize("mp_rank_00_model_states.pt").ok());
  EXPECT_EQ((*later)->built(), 0u);
}

}  // namespace
}  // namespace ucp::hooks
