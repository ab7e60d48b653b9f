// XXH3-64 of a byte stream as a whole and of each fixed-size chunk of it: the whole-file hash
// the journal and the index have always carried, and the chunk hashes that let a reader check
// only the byte ranges it reads (README "Chunk hashes").
//
// Thread-safety: a value type; one ChunkedXxh3 per stream, copies are independent.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/util/status.h"

namespace ucp {

// The chunk size ucp hashes at: big enough that a 1 TB checkpoint has a million chunk hashes
// (16 MiB of hex in its index), small enough that the partial chunks at the two ends of a range a
// rank reads cost it little (a ZeRO partition of a big model is hundreds of MiB).
inline constexpr uint64_t kHashChunkBytes = uint64_t{1} << 20;

// How many chunks of `chunk_bytes` a file of `size` bytes has (the last may be shorter).
constexpr uint64_t ChunkCount(uint64_t size, uint64_t chunk_bytes) {
  return chunk_bytes == 0 ? 0 : size / chunk_bytes + (size % chunk_bytes != 0 ? 1 : 0);
}

// A file's chunk hashes: XXH3-64 of each `chunk_bytes`-long piece, the last one possibly
// shorter. chunk_bytes 0: none recorded (a journal or index written before them).
struct ChunkHashes {
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> hashes;

  bool recorded() const { return chunk_bytes != 0; }
  bool operator==(const ChunkHashes&) const = default;
};

// "" when `chunks` has one hash per chunk of a `size`-byte file, else what is wrong.
std::string ChunkHashesMismatch(const ChunkHashes& chunks, uint64_t size);

class ChunkedXxh3 {
 public:
  // `chunk_bytes` 0 is taken as 1 rather than dividing by it.
  explicit ChunkedXxh3(uint64_t chunk_bytes = kHashChunkBytes);

  void Update(std::span<const std::byte> bytes);
  void Update(const void* data, size_t size) {
    Update(std::span(static_cast<const std::byte*>(data), size));
  }

  uint64_t size() const { return size_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  // XXH3-64 of every byte so far.
  uint64_t Whole() const;
  // XXH3-64 of each chunk so far, the last one partial when size() is not a multiple of
  // chunk_bytes(): ChunkCount(size(), chunk_bytes()) hashes.
  ChunkHashes Chunks() const;

 private:
  XXH3_state_t whole_;
  XXH3_state_t chunk_;  // the bytes of the chunk being filled
  uint64_t chunk_bytes_;
  uint64_t size_ = 0;
  std::vector<uint64_t> done_;  // the chunks already full
};

// The chunk hashes as one string of 16 lower-case hex digits per chunk (the journal's and the
// index's "chunks" member).
std::string FormatChunkHashes(std::span<const uint64_t> hashes);
// What FormatChunkHashes wrote; kCorrupt naming what is wrong otherwise.
Result<std::vector<uint64_t>> ParseChunkHashes(std::string_view text);

// The chunk hashes of a file of `size` bytes that a JSON object's members "chunk_bytes" and
// "chunks" hold (the journal's, the index's and the atoms store's spelling): none recorded when
// both are absent; kCorrupt naming the member when one comes alone, chunk_bytes is not a positive
// integer, chunks is not FormatChunkHashes' text, or the count does not fit `size`.
Result<ChunkHashes> ChunkHashesFromJson(const nlohmann::json& object, uint64_t size);

// Adds "chunk_bytes" and "chunks" to `object` when `chunks` is recorded.
template <typename Json>
void PutChunkHashes(const ChunkHashes& chunks, Json& object) {
  if (!chunks.recorded()) return;
  object["chunk_bytes"] = chunks.chunk_bytes;
  object["chunks"] = FormatChunkHashes(chunks.hashes);
}

}  // namespace ucp
