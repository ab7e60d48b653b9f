#include "core/util/chunked_xxh3.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstddef>
#include <span>
#include <vector>

#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;

// XXH3-64 of each `chunk`-byte slice of `bytes`, one call each: the reference.
std::vector<uint64_t> SliceHashes(const std::vector<std::byte>& bytes, size_t chunk) {
  std::vector<uint64_t> hashes;
  for (size_t at = 0; at < bytes.size(); at += chunk) {
    hashes.push_back(XXH3_64bits(bytes.data() + at, std::min(chunk, bytes.size() - at)));
  }
  return hashes;
}

TEST(ChunkedXxh3Test, WholeAndChunksEqualOneShotHashesWhateverThePieces) {
  constexpr size_t kChunk = 1000;
  for (const size_t size : {size_t{0}, size_t{1}, size_t{999}, size_t{1000}, size_t{1001},
                            size_t{5000}, size_t{12345}}) {
    const std::vector<std::byte> bytes = testing::Pattern(size, static_cast<uint32_t>(size));
    for (const size_t piece : {size_t{1}, size_t{7}, size_t{1000}, size_t{4096}}) {
      ChunkedXxh3 hash(kChunk);
      for (size_t at = 0; at < size; at += piece) {
        hash.Update(std::span(bytes).subspan(at, std::min(piece, size - at)));
      }
      SCOPED_TRACE("size " + std::to_string(size) + ", pieces of " + std::to_string(piece));
      EXPECT_EQ(hash.size(), size);
      EXPECT_EQ(hash.Whole(), XXH3_64bits(bytes.data(), size));
      const ChunkHashes chunks = hash.Chunks();
      EXPECT_EQ(chunks.chunk_bytes, kChunk);
      EXPECT_EQ(chunks.hashes, SliceHashes(bytes, kChunk));
      EXPECT_EQ(chunks.hashes.size(), ChunkCount(size, kChunk));
      EXPECT_EQ(ChunkHashesMismatch(chunks, size), "");
    }
  }
}

TEST(ChunkedXxh3Test, CopiesGoOnIndependently) {
  const std::vector<std::byte> bytes = testing::Pattern(3000, 7);
  ChunkedXxh3 first(1024);
  first.Update(std::span(bytes).first(1500));
  ChunkedXxh3 second = first;
  second.Update(std::span(bytes).subspan(1500));
  EXPECT_EQ(first.size(), 1500u);
  EXPECT_EQ(first.Chunks().hashes, SliceHashes({bytes.begin(), bytes.begin() + 1500}, 1024));
  EXPECT_EQ(second.Whole(), XXH3_64bits(bytes.data(), bytes.size()));
  EXPECT_EQ(second.Chunks().hashes, SliceHashes(bytes, 1024));
}

TEST(ChunkedXxh3Test, TheDefaultChunkIsOneMebibyte) {
  EXPECT_EQ(ChunkedXxh3().chunk_bytes(), uint64_t{1} << 20);
  EXPECT_EQ(ChunkCount((uint64_t{3} << 20) + 1, kHashChunkBytes), 4u);
}

TEST(ChunkedXxh3Test, MismatchSaysWhatIsWrong) {
  EXPECT_EQ(ChunkHashesMismatch({}, 5000), "");  // none recorded
  EXPECT_THAT(ChunkHashesMismatch({1000, {1, 2}}, 5000),
              HasSubstr("2 chunk hashes for 5000 bytes in chunks of 1000 (5 chunks)"));
  EXPECT_EQ(ChunkHashesMismatch({0, {1}}, 5000), "chunk hashes without a chunk size");
}

TEST(ChunkedXxh3Test, HexRoundTripsAndRejectsWhatIsNotIt) {
  const std::vector<uint64_t> hashes = {0x0123456789abcdefULL, 0, ~uint64_t{0}};
  const std::string text = FormatChunkHashes(hashes);
  EXPECT_EQ(text, "0123456789abcdef0000000000000000ffffffffffffffff");
  Result<std::vector<uint64_t>> parsed = ParseChunkHashes(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, hashes);
  EXPECT_TRUE(ParseChunkHashes("").ok());
  EXPECT_THAT(ParseChunkHashes("0123").status().message(), HasSubstr("not a multiple of 16"));
  EXPECT_THAT(ParseChunkHashes("0123456789ABCDEF").status().message(),
              HasSubstr("character 10 is not a lower-case hex digit"));
}

}  // namespace
}  // namespace ucp
