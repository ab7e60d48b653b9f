// CheckedSource: a source file whose bytes are checked against the chunk hashes recorded when it
// was saved (core/util/chunked_xxh3.h), chunk by chunk, the first time a reader touches a chunk.
// A process thus checks exactly the chunks it reads, as it reads them, and reads each byte once:
// a chunk not yet checked is read whole into the reader's ChunkCache, hashed, and the bytes asked
// for are served from there; a chunk already checked is read only where asked.
//
// Thread-safety: ReadAt may be called from any number of threads at once, each with its own
// ChunkCache; two threads meeting the same unchecked chunk both check it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "core/io/file.h"
#include "core/util/chunked_xxh3.h"
#include "core/util/status.h"

namespace ucp {

class CheckedSource;

// One reader's copy of the last chunk it checked.
struct ChunkCache {
  const CheckedSource* source = nullptr;
  uint64_t chunk = 0;
  size_t size = 0;
  std::unique_ptr<std::byte[]> bytes;  // allocated on first use: chunk_bytes
};

class CheckedSource {
 public:
  // What is damaged in the byte range [begin, end) of the file, for error messages ("" when
  // unknown).
  using Describe = std::function<std::string(uint64_t begin, uint64_t end)>;

  // `chunks` must be recorded and fit `size` (ChunkHashesMismatch empty); `file` is borrowed.
  CheckedSource(const File& file, uint64_t size, ChunkHashes chunks, Describe describe = {});

  const File& file() const { return file_; }

  // Reads [offset, offset + out.size()) of the file into `out`, checking every chunk the range
  // touches that no reader has checked yet. kCorrupt when a chunk's bytes do not hash to its
  // recorded hash, naming the file, the byte range and what it holds; kCorrupt too when the file
  // ends early.
  Status ReadAt(uint64_t offset, std::span<std::byte> out, ChunkCache& cache) const;

  // How many chunks have been checked so far (tests, logs).
  uint64_t checked_chunks() const;

 private:
  Status Check(uint64_t chunk, ChunkCache& cache) const;

  const File& file_;
  uint64_t size_;
  ChunkHashes chunks_;
  Describe describe_;
  std::unique_ptr<std::atomic<bool>[]> checked_;  // one flag per chunk
};

}  // namespace ucp
