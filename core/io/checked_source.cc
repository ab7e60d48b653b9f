#include "core/io/checked_source.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "core/util/xxh3.h"

namespace ucp {
namespace {

std::string Hex(uint64_t hash) { return FormatChunkHashes(std::span(&hash, 1)); }

}  // namespace

CheckedSource::CheckedSource(const File& file, uint64_t size, ChunkHashes chunks, Describe describe)
    : file_(file),
      size_(size),
      chunks_(std::move(chunks)),
      describe_(std::move(describe)),
      checked_(new std::atomic<bool>[chunks_.hashes.size()]) {
  for (size_t i = 0; i < chunks_.hashes.size(); ++i) checked_[i].store(false);
}

uint64_t CheckedSource::checked_chunks() const {
  uint64_t count = 0;
  for (size_t i = 0; i < chunks_.hashes.size(); ++i) count += checked_[i].load() ? 1 : 0;
  return count;
}

Status CheckedSource::Check(uint64_t chunk, ChunkCache& cache) const {
  const uint64_t begin = chunk * chunks_.chunk_bytes;
  const size_t length = static_cast<size_t>(std::min(chunks_.chunk_bytes, size_ - begin));
  if (cache.bytes == nullptr) {
    cache.bytes.reset(new (std::nothrow) std::byte[chunks_.chunk_bytes]);
    if (cache.bytes == nullptr) {
      return Status::Internal("checked read of " + file_.path() + ": out of memory");
    }
  }
  cache.source = nullptr;  // until the new bytes are in and checked
  UCP_RETURN_IF_ERROR(file_.ReadAt(begin, std::span(cache.bytes.get(), length)));
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  Xxh3Update(state, cache.bytes.get(), length);
  const uint64_t hash = XXH3_64bits_digest(&state);
  if (hash != chunks_.hashes[chunk]) {
    const std::string held = describe_ ? describe_(begin, begin + length) : "";
    return Status::Corrupt("source " + file_.path() + ": bytes [" + std::to_string(begin) + ", " +
                           std::to_string(begin + length) + ") have XXH3 " + Hex(hash) +
                           ", the index says " + Hex(chunks_.hashes[chunk]) +
                           (held.empty() ? "" : ": " + held));
  }
  checked_[chunk].store(true, std::memory_order_release);
  cache.source = this;
  cache.chunk = chunk;
  cache.size = length;
  return Status::Ok();
}

Status CheckedSource::ReadAt(uint64_t offset, std::span<std::byte> out, ChunkCache& cache) const {
  if (offset > size_ || out.size() > size_ - offset) {
    return Status::Corrupt("checked read of " + file_.path() + ": [" + std::to_string(offset) +
                           ", +" + std::to_string(out.size()) + ") is beyond its " +
                           std::to_string(size_) + " indexed bytes");
  }
  while (!out.empty()) {
    const uint64_t chunk = offset / chunks_.chunk_bytes;
    const uint64_t chunk_begin = chunk * chunks_.chunk_bytes;
    const uint64_t chunk_length = std::min(chunks_.chunk_bytes, size_ - chunk_begin);
    const size_t take =
        static_cast<size_t>(std::min<uint64_t>(out.size(), chunk_begin + chunk_length - offset));
    const bool cached = cache.source == this && cache.chunk == chunk;
    if (!cached && checked_[chunk].load(std::memory_order_acquire)) {
      UCP_RETURN_IF_ERROR(file_.ReadAt(offset, out.first(take)));
    } else {
      if (!cached) UCP_RETURN_IF_ERROR(Check(chunk, cache));
      std::memcpy(out.data(), cache.bytes.get() + (offset - chunk_begin), take);
    }
    offset += take;
    out = out.subspan(take);
  }
  return Status::Ok();
}

}  // namespace ucp
