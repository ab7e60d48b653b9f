// ByteRun: a run of bytes to be written, taken from an open File or made of zeros, and the one
// loop that streams a sequence of runs through a bounded buffer.
//
// Writers that gather a record or tensor from many places (the reshard executor's segments) take
// a span of runs; the bytes are read chunk by chunk, never held whole.
//
// Thread-safety: StreamRuns only reads the runs' files (pread); several threads may stream runs
// of the same File (or CheckedSource) at once, each with its own buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "core/io/checked_source.h"
#include "core/io/file.h"
#include "core/util/status.h"

namespace ucp {

// `length` bytes at `offset` of `file`, or `length` zero bytes when `file` is null. The File is
// borrowed: it must stay open while the run is used. With `checked` (whose file() is `file`), the
// bytes are read through it, checked against the file's chunk hashes; writers then never move
// them with copy_file_range, which would leave them unseen. With `widen_bf16` the source holds
// bfloat16 and the run its float32 values, as torch's .float() gives them: `length` bytes (a
// multiple of 4) from the length / 2 bytes at `offset`, each bfloat16 the high half of its
// float32 (little-endian); such runs too always pass through memory.
struct ByteRun {
  const File* file = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  const CheckedSource* checked = nullptr;
  bool widen_bf16 = false;
};

// Total bytes of `runs`; kOutOfRange when the sum overflows 64 bits.
[[nodiscard]] Result<uint64_t> ByteRunsLength(std::span<const ByteRun> runs);

// Reads the bytes of `runs`, in order, into `buffer` and hands each filled chunk to `sink`
// (every chunk buffer.size() bytes except the last; a chunk may span several runs). Stops at the
// first error, from a read (a source ending early is kCorrupt) or from `sink`.
[[nodiscard]] Status StreamRuns(std::span<const ByteRun> runs, std::span<std::byte> buffer,
                                const std::function<Status(std::span<const std::byte>)>& sink);

// Streams `runs` (StreamRuns) into `out` from byte `at` on, calling `progress` (when set) with the
// size of each piece written. For bytes that must pass through memory (checked runs); the caller
// syncs and closes `out`.
[[nodiscard]] Status WriteRuns(std::span<const ByteRun> runs, File& out, uint64_t at,
                               std::span<std::byte> buffer,
                               const std::function<void(uint64_t)>& progress);

}  // namespace ucp
