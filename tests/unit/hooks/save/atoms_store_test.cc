// Tests core/tag/atoms_store.cc and hooks/save/atoms_materializer.cc on copies of real DeepSpeed
// tags: the shares the ranks write, the store recorded by the last, its bytes against `ucp export`,
// and serving once the framework's files are gone, against `ucp reshard` of the tag as saved.
#include "core/tag/atoms_store.h"
#include "hooks/save/atoms_materializer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/format/safetensors_reader.h"
#include "core/frameworks/deepspeed/zero.h"
#include "core/io/file.h"
#include "core/tag/journal.h"
#include "hooks/serve/view_cache.h"
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

ExecuteOptions OneThread() {
  ExecuteOptions options;
  options.threads = 1;
  return options;
}

// Writes every rank's share of the tag's store, the last one finishing it.
void MakeStore(const std::string& tag, uint64_t index_xxh3) {
  const std::shared_ptr<const AtomIndex> index = ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  const uint32_t world = index->contents().topology.world;
  for (uint32_t rank = 0; rank < world; ++rank) {
    const Status written = WriteStoreShare(*index, index_xxh3, tag, rank, OneThread());
    ASSERT_TRUE(written.ok()) << written.ToString();
    Result<bool> finalized = FinalizeStore(tag, index_xxh3);
    ASSERT_TRUE(finalized.ok()) << finalized.status().ToString();
    EXPECT_EQ(*finalized, rank + 1 == world) << "rank " << rank;
  }
}

// Removes the framework's files of the tag (everything but .ucp/).
void RemoveFrameworkFiles(const std::string& tag) {
  for (const std::string& name : FilesIn(tag)) fs::remove(tag + "/" + name);
}

// `ucp export --format deepspeed-universal` of the tag into `out`.
void ExportUniversal(const std::string& tag, const std::string& out) {
  const std::string command = std::string(UCP_BINARY_DIR) + "/ucp export " + tag +
                              " --format deepspeed-universal --out " + out + " > /dev/null";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

// `a` and `b` hold the same relative paths with the same bytes.
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
    EXPECT_TRUE(ReadAll(a + "/" + path) == ReadAll(b + "/" + path)) << path << " differs";
  }
}

class AtomsStoreTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AtomsStoreTest, StoreHoldsWhatUcpExportWrites) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "global_step5").string();
  const uint64_t index_xxh3 = PrepareTag(FixtureTag(GetParam(), "dp4"), tag);
  Result<StorePlan> plan = PlanStore(*ReadIndex(tag));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  MakeStore(tag, index_xxh3);

  const std::shared_ptr<const AtomIndex> index = ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  ASSERT_TRUE(index->contents().store.has_value());
  EXPECT_EQ(index->contents().store->directory, ".ucp/atoms");
  EXPECT_EQ(index->contents().store->max_shard_bytes, plan->max_shard_bytes);
  EXPECT_THAT(ReadAll(tag + "/.ucp/index.json"), HasSubstr("\"version\": 3"));
  for (const std::string& name : FilesIn(tag + "/.ucp/atoms")) {
    EXPECT_FALSE(name.starts_with("done.")) << name << ": markers outlive the store";
  }

  // Each state's directory is byte for byte what `ucp export` writes at the recorded shard size.
  std::set<std::string> states;
  for (const Atom& atom : index->atoms()) states.insert(atom.state);
  for (const std::string& state : states) {
    SCOPED_TRACE(state);
    const std::string out = (scratch / ("export-" + state)).string();
    const std::string command = std::string(UCP_BINARY_DIR) + "/ucp export " + tag +
                                " --format safetensors --state " + state + " --max-shard-size " +
                                std::to_string(plan->max_shard_bytes) + " --out " + out +
                                " > /dev/null";
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const std::string stored = tag + "/.ucp/atoms/" + state;
    ASSERT_EQ(FilesIn(stored), FilesIn(out));
    for (const std::string& name : FilesIn(out)) {
      EXPECT_TRUE(ReadAll(stored + "/" + name) == ReadAll(out + "/" + name)) << name;
    }
  }
  // The recorded offsets are where export's own headers put each tensor.
  for (const Atom& atom : index->atoms()) {
    ASSERT_TRUE(atom.consolidated.has_value()) << atom.param << "/" << atom.state;
    const IndexedFile& file = index->files()[atom.consolidated->file];
    const std::string exported =
        (scratch / ("export-" + atom.state) / fs::path(file.path).filename()).string();
    Result<SafetensorsHeader> header = SafetensorsHeader::Read(exported);
    ASSERT_TRUE(header.ok()) << header.status().ToString();
    ASSERT_NE(header->Find(atom.param), nullptr) << atom.param;
    EXPECT_EQ(atom.consolidated->offset, header->Find(atom.param)->offset) << atom.param;
  }
}

TEST_P(AtomsStoreTest, ServesFromTheStoreAloneWhatReshardWroteFromTheFiles) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "ckpt" / "global_step5").string();
  const uint64_t index_xxh3 = PrepareTag(FixtureTag(GetParam(), "dp4"), tag);
  MakeStore(tag, index_xxh3);
  const std::string dp2 = Reshard(tag, 2, (scratch / "from-files-2").string());
  const std::string dp4 = Reshard(tag, 4, (scratch / "from-files-4").string());
  ExportUniversal(tag, (scratch / "universal-from-files").string());
  Result<std::optional<AtomIndex>> present = ReadableSources(*ReadIndex(tag), tag);
  ASSERT_TRUE(present.ok()) << present.status().ToString();
  EXPECT_FALSE(present->has_value()) << "the framework's files are there";

  RemoveFrameworkFiles(tag);
  Result<std::optional<AtomIndex>> readable = ReadableSources(*ReadIndex(tag), tag);
  ASSERT_TRUE(readable.ok()) << readable.status().ToString();
  ASSERT_TRUE(readable->has_value());
  const auto over = std::make_shared<const AtomIndex>(std::move(**readable));
  const uint64_t hash_now = HashFile(tag + "/.ucp/index.json").value().xxh3;
  for (const auto& [dp, expected] : {std::pair{2u, dp2}, std::pair{4u, dp4}}) {
    SCOPED_TRACE("dp=" + std::to_string(dp));
    Result<std::unique_ptr<View>> view = View::Open(kAdapter, over, hash_now, tag, "", Dp(dp));
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ((*view)->names(), FilesIn(expected));
    for (const std::string& name : (*view)->names()) {
      Result<std::string> path = (*view)->Materialize(name);
      ASSERT_TRUE(path.ok()) << path.status().ToString();
      EXPECT_TRUE(ReadAll(*path) == ReadAll(expected + "/" + name)) << name << " differs";
    }
  }
  // `ucp reshard` reads the store too.
  const std::string offline = Reshard(tag, 2, (scratch / "from-store").string());
  ExpectSameTree(offline, dp2);
  // And so does `ucp export`.
  ExportUniversal(tag, (scratch / "universal-from-store").string());
  ExpectSameTree((scratch / "universal-from-store").string(),
                 (scratch / "universal-from-files").string());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, AtomsStoreTest,
                         ::testing::Values("z2_fp32", "z1_bf16_bf16opt", "z2_fp32_odd"));

TEST(AtomsStoreTest, SharesOfAnotherIndexDoNotFinishTheStore) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "global_step5").string();
  const uint64_t index_xxh3 = PrepareTag(FixtureTag("z2_fp32", "dp2"), tag);
  const std::shared_ptr<const AtomIndex> index = ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  // Rank 0's marker is of an earlier index.json; rank 1's of this one.
  ASSERT_TRUE(WriteStoreShare(*index, index_xxh3 + 1, tag, 0, OneThread()).ok());
  ASSERT_TRUE(WriteStoreShare(*index, index_xxh3, tag, 1, OneThread()).ok());
  EXPECT_FALSE(FinalizeStore(tag, index_xxh3).value());
  // index.json is not the one the shares were written for.
  EXPECT_FALSE(FinalizeStore(tag, index_xxh3 + 1).value());
  EXPECT_FALSE(ReadIndex(tag)->contents().store.has_value());
  ASSERT_TRUE(WriteStoreShare(*index, index_xxh3, tag, 0, OneThread()).ok());
  EXPECT_TRUE(FinalizeStore(tag, index_xxh3).value());
  EXPECT_TRUE(ReadIndex(tag)->contents().store.has_value());
  EXPECT_EQ(WriteStoreShare(*index, index_xxh3, tag, 2, OneThread()).code(),
            StatusCode::kInvalidArgument);
}

TEST(AtomsStoreTest, ReadableSourcesNamesWhatIsGone) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "global_step5").string();
  const uint64_t index_xxh3 = PrepareTag(FixtureTag("z2_fp32", "dp2"), tag);
  fs::remove(tag + "/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  Result<std::optional<AtomIndex>> no_store = ReadableSources(*ReadIndex(tag), tag);
  EXPECT_EQ(no_store.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_store.status().message(),
              HasSubstr("zero_pp_rank_1_mp_rank_00_optim_states.pt is missing or changed since "
                        "the tag was indexed, and the index has no atoms store"));

  PrepareTag(FixtureTag("z2_fp32", "dp2"), tag);
  MakeStore(tag, index_xxh3);
  RemoveFrameworkFiles(tag);
  fs::remove(tag + "/.ucp/atoms/carried.mp_rank_00_model_states.pt");
  Result<std::optional<AtomIndex>> store_damaged = ReadableSources(*ReadIndex(tag), tag);
  EXPECT_EQ(store_damaged.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      store_damaged.status().message(),
      HasSubstr("and so is the atoms store's .ucp/atoms/carried.mp_rank_00_model_states.pt"));
}

// One AtomsMaterializer per simulated process, told of the files that process saved.
TEST(AtomsMaterializerTest, EveryProcessWritesItsShareOnceTheIndexCoversItsFiles) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "global_step5").string();
  PrepareTag(FixtureTag("z2_fp32", "dp4"), tag);
  const std::string index_path = tag + "/.ucp/index.json";
  const std::string index_text = ReadAll(index_path);
  const std::shared_ptr<const AtomIndex> index = ReadIndex(tag);
  ASSERT_NE(index, nullptr);
  fs::remove(index_path);  // not committed yet

  AtomsMaterializerOptions options;
  options.poll = std::chrono::milliseconds(10);
  std::vector<std::unique_ptr<AtomsMaterializer>> processes;
  for (int rank = 0; rank < 4; ++rank) {
    processes.push_back(std::make_unique<AtomsMaterializer>(options));
  }
  for (const IndexedFile& file : index->files()) {
    const uint32_t rank = file.rank ? file.rank->dp : 0;  // rank 0 also saves the model states
    processes[rank]->OnFileSaved({"deepspeed", tag, file.path, file.size, file.xxh3});
  }
  // A fifth process saved other bytes under rank 3's name: no index ever covers them.
  AtomsMaterializerOptions impatient = options;
  impatient.wait = std::chrono::milliseconds(300);
  AtomsMaterializer stranger(impatient);
  const IndexedFile& rank3 = index->files().back();
  stranger.OnFileSaved({"deepspeed", tag, rank3.path, rank3.size, rank3.xxh3 + 1});

  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(fs::exists(tag + "/.ucp/atoms")) << "a share was written before the commit";
  ASSERT_TRUE(WriteFileAtomically(index_path, index_text).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  for (const auto& process : processes) process->Drain(deadline);
  stranger.Drain(deadline);
  for (const auto& process : processes) EXPECT_EQ(process->shares_written(), 1u);
  EXPECT_EQ(stranger.shares_written(), 0u);
  const std::shared_ptr<const AtomIndex> recorded = ReadIndex(tag);
  ASSERT_NE(recorded, nullptr);
  EXPECT_TRUE(recorded->contents().store.has_value());
}

TEST(AtomsMaterializerTest, ExitDoesNotWaitForAnIndexThatNeverComes) {
  const fs::path scratch = ScratchDirectory("atoms_store");
  const std::string tag = (scratch / "global_step5").string();
  fs::create_directories(tag);
  AtomsMaterializerOptions options;
  options.poll = std::chrono::milliseconds(10);
  options.wait_at_exit = std::chrono::milliseconds(200);
  AtomsMaterializer process(options);
  process.OnFileSaved({"deepspeed", tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt", 10, 1});
  // Drain's own deadline is far; the job gives up wait_at_exit after Drain was called.
  const auto start = std::chrono::steady_clock::now();
  process.Drain(start + std::chrono::minutes(10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::minutes(1));
  EXPECT_EQ(process.shares_written(), 0u);
  EXPECT_FALSE(fs::exists(tag + "/.ucp/atoms"));
}

}  // namespace
}  // namespace ucp::hooks
