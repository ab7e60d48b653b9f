#include "core/io/checked_source.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/io/byte_run.h"
#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 4096;

class CheckedSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (testing::ScratchDirectory("checked_source") / "source.bin").string();
    bytes_ = testing::Pattern(5 * kChunk + 100, 3);
    Result<File> file = File::Open(path_, File::Mode::kCreateExclusive);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ASSERT_TRUE(file->WriteAt(0, bytes_).ok());
    ChunkedXxh3 hash(kChunk);
    hash.Update(bytes_);
    chunks_ = hash.Chunks();
  }

  // Flips the byte at `offset` on disk.
  void Damage(uint64_t offset) {
    Result<File> file = File::Open(path_, File::Mode::kReadWrite);
    ASSERT_TRUE(file.ok());
    std::byte flipped = bytes_[offset] ^ std::byte{1};
    ASSERT_TRUE(file->WriteAt(offset, {&flipped, 1}).ok());
  }

  std::string path_;
  std::vector<std::byte> bytes_;
  ChunkHashes chunks_;
};

TEST_F(CheckedSourceTest, ServesTheBytesAskedForAndChecksOnlyTheChunksTheyTouch) {
  Result<File> file = File::Open(path_, File::Mode::kRead);
  ASSERT_TRUE(file.ok());
  const CheckedSource source(*file, bytes_.size(), chunks_);
  ChunkCache cache;
  // Within chunk 1, then across chunks 1..3, in small reads that share cached chunks.
  std::vector<std::byte> out(2 * kChunk + 10);
  ASSERT_TRUE(source.ReadAt(kChunk + 5, std::span(out).first(100), cache).ok());
  EXPECT_EQ(source.checked_chunks(), 1u);
  for (size_t at = 0; at < out.size(); at += 333) {
    const size_t n = std::min<size_t>(333, out.size() - at);
    ASSERT_TRUE(source.ReadAt(kChunk + 5 + at, std::span(out).subspan(at, n), cache).ok());
  }
  EXPECT_EQ(0, std::memcmp(out.data(), bytes_.data() + kChunk + 5, out.size()));
  EXPECT_EQ(source.checked_chunks(), 3u);
  // The short last chunk.
  std::vector<std::byte> tail(100);
  ASSERT_TRUE(source.ReadAt(5 * kChunk, tail, cache).ok());
  EXPECT_EQ(0, std::memcmp(tail.data(), bytes_.data() + 5 * kChunk, tail.size()));
  EXPECT_EQ(source.checked_chunks(), 4u);
}

TEST_F(CheckedSourceTest, DamageFailsOnlyReadsOfItsChunkNamingTheRange) {
  Damage(2 * kChunk + 17);
  Result<File> file = File::Open(path_, File::Mode::kRead);
  ASSERT_TRUE(file.ok());
  const CheckedSource source(*file, bytes_.size(), chunks_, [](uint64_t begin, uint64_t end) {
    return "it holds [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  });
  ChunkCache cache;
  std::vector<std::byte> out(kChunk);
  EXPECT_TRUE(source.ReadAt(0, out, cache).ok());
  EXPECT_TRUE(source.ReadAt(3 * kChunk, out, cache).ok());
  const Status damaged = source.ReadAt(2 * kChunk + 4000, std::span(out).first(10), cache);
  EXPECT_EQ(damaged.code(), StatusCode::kCorrupt);
  EXPECT_THAT(damaged.message(), HasSubstr("source " + path_ + ": bytes [8192, 12288) have XXH3 "));
  EXPECT_THAT(damaged.message(), HasSubstr(": it holds [8192, 12288)"));
  // Still failing on a second read: a chunk that failed is never taken as checked.
  EXPECT_EQ(source.ReadAt(2 * kChunk, std::span(out).first(1), cache).code(), StatusCode::kCorrupt);
  EXPECT_EQ(source.checked_chunks(), 2u);
}

TEST_F(CheckedSourceTest, StreamRunsReadsCheckedRunsThroughTheirSource) {
  Damage(4 * kChunk);
  Result<File> file = File::Open(path_, File::Mode::kRead);
  ASSERT_TRUE(file.ok());
  const CheckedSource source(*file, bytes_.size(), chunks_);
  std::vector<std::byte> buffer(1000), got;
  const auto sink = [&](std::span<const std::byte> piece) {
    got.insert(got.end(), piece.begin(), piece.end());
    return Status::Ok();
  };
  const ByteRun healthy[] = {{&*file, 10, 3 * kChunk, &source}, {nullptr, 0, 7, nullptr}};
  ASSERT_TRUE(StreamRuns(healthy, buffer, sink).ok());
  ASSERT_EQ(got.size(), 3 * kChunk + 7);
  EXPECT_EQ(0, std::memcmp(got.data(), bytes_.data() + 10, 3 * kChunk));
  const ByteRun damaged[] = {{&*file, 4 * kChunk - 5, 10, &source}};
  EXPECT_EQ(StreamRuns(damaged, buffer, sink).code(), StatusCode::kCorrupt);
  // Unchecked, the same run reads the damaged byte without complaint.
  const ByteRun unchecked[] = {{&*file, 4 * kChunk - 5, 10, nullptr}};
  EXPECT_TRUE(StreamRuns(unchecked, buffer, sink).ok());
}

TEST_F(CheckedSourceTest, AFileShorterThanItsIndexIsCorrupt) {
  std::filesystem::resize_file(path_, 3 * kChunk);
  Result<File> file = File::Open(path_, File::Mode::kRead);
  ASSERT_TRUE(file.ok());
  const CheckedSource source(*file, bytes_.size(), chunks_);
  ChunkCache cache;
  std::vector<std::byte> out(10);
  EXPECT_EQ(source.ReadAt(4 * kChunk, out, cache).code(), StatusCode::kCorrupt);
  EXPECT_THAT(source.ReadAt(bytes_.size() - 5, out, cache).message(),
              HasSubstr("is beyond its 20580 indexed bytes"));
}

}  // namespace
}  // namespace ucp
