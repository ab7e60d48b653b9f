// A writable copy of a DeepSpeed fixture tag with a committed index, for the load-side tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include "core/format/atom_index.h"
#include "core/frameworks/deepspeed/zero.h"
#include "core/io/file.h"
#include "core/tag/journal.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp::hooks::testing {

inline const std::string kFixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";

// The fixture tag <config>/<run>/global_step5.
inline std::string FixtureTag(const std::string& config, const std::string& run) {
  return kFixtures + "/" + config + "/" + run + "/global_step5";
}

// Saves the fixture tag's files into `tag_dir` (created; the files of an earlier save there are
// removed first, .ucp/ is kept) and writes its index, as `ucp index` does. Returns the XXH3 of
// index.json's bytes.
inline uint64_t PrepareTag(const std::string& fixture_tag, const std::string& tag_dir,
                           bool chunk_hashes = true) {
  namespace fs = std::filesystem;
  fs::create_directories(tag_dir);
  for (const fs::directory_entry& entry : fs::directory_iterator(tag_dir)) {
    if (entry.is_regular_file()) fs::remove(entry.path());
  }
  for (const fs::directory_entry& entry : fs::directory_iterator(fixture_tag)) {
    if (!entry.is_regular_file()) continue;
    const fs::path to = fs::path(tag_dir) / entry.path().filename();
    fs::copy_file(entry.path(), to);
    fs::permissions(to, fs::perms::owner_read | fs::perms::owner_write);
  }
  const DeepSpeedZeroAdapter adapter;
  IndexOptions options;
  options.trust_journal = false;
  Result<AtomIndex> index = adapter.BuildIndex(tag_dir, options);
  EXPECT_TRUE(index.ok()) << index.status().ToString();
  if (!index.ok()) return 0;
  if (!chunk_hashes) {  // an index as written before chunk hashes
    AtomIndexContents contents = index->contents();
    for (IndexedFile& file : contents.files) file.chunks = {};
    index = AtomIndex::Create(std::move(contents));
    EXPECT_TRUE(index.ok()) << index.status().ToString();
    if (!index.ok()) return 0;
  }
  EXPECT_TRUE(CreateDirectories(tag_dir + "/.ucp").ok());
  const std::string index_path = AtomIndexPath(tag_dir);
  const Status written = index->Write(index_path);
  EXPECT_TRUE(written.ok()) << written.ToString();
  Result<FileDigest> digest = HashFile(index_path);
  EXPECT_TRUE(digest.ok()) << digest.status().ToString();
  return digest.ok() ? digest->xxh3 : 0;
}

// Data parallelism alone at `dp` ranks.
inline Topology Dp(uint32_t dp) { return Topology{.dp = dp, .tp = 1, .pp = 1, .world = dp}; }

// The committed index of `tag_dir`.
inline std::shared_ptr<const AtomIndex> ReadIndex(const std::string& tag_dir) {
  Result<AtomIndex> index = AtomIndex::Read(AtomIndexPath(tag_dir));
  EXPECT_TRUE(index.ok()) << index.status().ToString();
  if (!index.ok()) return nullptr;
  return std::make_shared<const AtomIndex>(std::move(*index));
}

// What `ucp reshard tag_dir --to dp=N --out out` writes: the tag directory it made.
inline std::string Reshard(const std::string& tag_dir, uint32_t dp, const std::string& out) {
  const std::string command = std::string(UCP_BINARY_DIR) + "/ucp reshard " + tag_dir +
                              " --to dp=" + std::to_string(dp) + " --out " + out + " > /dev/null";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return out + "/" + std::filesystem::path(tag_dir).filename().string();
}

// The names of the regular files directly in `dir`.
inline std::set<std::string> FilesIn(const std::string& dir) {
  std::set<std::string> names;
  for (const std::filesystem::directory_entry& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_regular_file()) names.insert(entry.path().filename().string());
  }
  return names;
}

}  // namespace ucp::hooks::testing
