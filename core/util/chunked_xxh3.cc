#include "core/util/chunked_xxh3.h"

#include <algorithm>

#include "core/util/xxh3.h"

namespace ucp {

ChunkedXxh3::ChunkedXxh3(uint64_t chunk_bytes) : chunk_bytes_(chunk_bytes == 0 ? 1 : chunk_bytes) {
  XXH3_64bits_reset(&whole_);
  XXH3_64bits_reset(&chunk_);
}

void ChunkedXxh3::Update(std::span<const std::byte> bytes) {
  // Both hashes take each piece in turn, so the second reads it from L2, not from memory: hashing
  // is memory-bound, and a second pass over a big write would cost as much as the first.
  constexpr uint64_t kPiece = 64 << 10;
  while (!bytes.empty()) {
    const uint64_t room = chunk_bytes_ - size_ % chunk_bytes_;
    const size_t take = static_cast<size_t>(std::min({room, kPiece, uint64_t{bytes.size()}}));
    Xxh3Update(whole_, bytes.first(take));
    Xxh3Update(chunk_, bytes.first(take));
    size_ += take;
    bytes = bytes.subspan(take);
    if (size_ % chunk_bytes_ == 0) {
      done_.push_back(XXH3_64bits_digest(&chunk_));
      XXH3_64bits_reset(&chunk_);
    }
  }
}

uint64_t ChunkedXxh3::Whole() const { return XXH3_64bits_digest(&whole_); }

ChunkHashes ChunkedXxh3::Chunks() const {
  ChunkHashes chunks{chunk_bytes_, done_};
  if (size_ % chunk_bytes_ != 0) chunks.hashes.push_back(XXH3_64bits_digest(&chunk_));
  return chunks;
}

std::string ChunkHashesMismatch(const ChunkHashes& chunks, uint64_t size) {
  if (!chunks.recorded()) return chunks.hashes.empty() ? "" : "chunk hashes without a chunk size";
  const uint64_t expected = ChunkCount(size, chunks.chunk_bytes);
  if (chunks.hashes.size() == expected) return "";
  return std::to_string(chunks.hashes.size()) + " chunk hashes for " + std::to_string(size) +
         " bytes in chunks of " + std::to_string(chunks.chunk_bytes) + " (" +
         std::to_string(expected) + " chunks)";
}

std::string FormatChunkHashes(std::span<const uint64_t> hashes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text(hashes.size() * 16, '0');
  for (size_t i = 0; i < hashes.size(); ++i) {
    for (int d = 0; d < 16; ++d) text[i * 16 + d] = kDigits[(hashes[i] >> (60 - 4 * d)) & 0xf];
  }
  return text;
}

Result<std::vector<uint64_t>> ParseChunkHashes(std::string_view text) {
  if (text.size() % 16 != 0) {
    return Status::Corrupt("chunk hashes: " + std::to_string(text.size()) +
                           " characters, not a multiple of 16");
  }
  std::vector<uint64_t> hashes(text.size() / 16);
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    uint64_t digit = 0;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return Status::Corrupt("chunk hashes: character " + std::to_string(i) +
                             " is not a lower-case hex digit");
    }
    hashes[i / 16] = hashes[i / 16] << 4 | digit;
  }
  return hashes;
}

Result<ChunkHashes> ChunkHashesFromJson(const nlohmann::json& object, uint64_t size) {
  const auto chunk_bytes = object.find("chunk_bytes");
  const auto chunks = object.find("chunks");
  if ((chunk_bytes == object.end()) != (chunks == object.end())) {
    return Status::Corrupt("\"chunk_bytes\" and \"chunks\" come together");
  }
  if (chunks == object.end()) return ChunkHashes{};
  if (!chunk_bytes->is_number_unsigned() || chunk_bytes->get<uint64_t>() == 0) {
    return Status::Corrupt("\"chunk_bytes\" is not a positive integer");
  }
  if (!chunks->is_string()) return Status::Corrupt("\"chunks\" is not a string");
  ChunkHashes parsed{chunk_bytes->get<uint64_t>(), {}};
  Result<std::vector<uint64_t>> hashes = ParseChunkHashes(chunks->get<std::string>());
  if (!hashes.ok()) return Status::Corrupt("\"chunks\": " + hashes.status().message());
  parsed.hashes = std::move(hashes).value();
  if (const std::string wrong = ChunkHashesMismatch(parsed, size); !wrong.empty()) {
    return Status::Corrupt("\"chunks\": " + wrong);
  }
  return parsed;
}

}  // namespace ucp
