#include "core/io/byte_run.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/util/checked.h"

namespace ucp {

Result<uint64_t> ByteRunsLength(std::span<const ByteRun> runs) {
  uint64_t total = 0;
  for (const ByteRun& run : runs) {
    const std::optional<uint64_t> sum = CheckedAdd(total, run.length);
    if (!sum) return Status::OutOfRange("byte runs: total length overflows 64 bits");
    total = *sum;
  }
  return total;
}

namespace {

// Reads source bytes [offset, + out.size()) of `run` (through its CheckedSource where it has one).
Status ReadSource(const ByteRun& run, uint64_t offset, std::span<std::byte> out,
                  ChunkCache& cache) {
  if (run.checked != nullptr) return run.checked->ReadAt(offset, out, cache);
  return run.file->ReadAt(offset, out);
}

// Bytes [done, done + piece.size()) of widened run `run`: output byte p is byte p mod 4 of
// float32 p div 4, whose low half is zero and whose high half is that bfloat16's two bytes.
Status ReadWidened(const ByteRun& run, uint64_t done, std::span<std::byte> piece,
                   std::vector<std::byte>& scratch, ChunkCache& cache) {
  const uint64_t first = done / 4;
  const uint64_t end = (done + piece.size() + 3) / 4;
  scratch.resize(static_cast<size_t>(2 * (end - first)));
  UCP_RETURN_IF_ERROR(ReadSource(run, run.offset + 2 * first, scratch, cache));
  for (size_t i = 0; i < piece.size(); ++i) {
    const uint64_t p = done + i;
    const uint64_t byte = p % 4;
    piece[i] = byte < 2 ? std::byte{0} : scratch[2 * (p / 4 - first) + (byte - 2)];
  }
  return Status::Ok();
}

}  // namespace

Status StreamRuns(std::span<const ByteRun> runs, std::span<std::byte> buffer,
                  const std::function<Status(std::span<const std::byte>)>& sink) {
  if (buffer.empty()) return Status::InvalidArgument("byte runs: empty buffer");
  size_t filled = 0;
  ChunkCache cache;
  std::vector<std::byte> scratch;  // a widened piece's bfloat16 source
  for (const ByteRun& run : runs) {
    if (run.widen_bf16 && (run.file == nullptr || run.length % 4 != 0)) {
      return Status::InvalidArgument("byte runs: a widened run of " + std::to_string(run.length) +
                                     " bytes, not whole float32s of a file");
    }
    for (uint64_t done = 0; done < run.length;) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(run.length - done, buffer.size() - filled));
      const std::span<std::byte> piece = buffer.subspan(filled, n);
      if (run.file == nullptr) {
        std::memset(piece.data(), 0, n);
      } else if (run.widen_bf16) {
        UCP_RETURN_IF_ERROR(ReadWidened(run, done, piece, scratch, cache));
      } else {
        UCP_RETURN_IF_ERROR(ReadSource(run, run.offset + done, piece, cache));
      }
      done += n;
      filled += n;
      if (filled == buffer.size()) {
        UCP_RETURN_IF_ERROR(sink(buffer));
        filled = 0;
      }
    }
  }
  if (filled > 0) return sink(buffer.first(filled));
  return Status::Ok();
}

Status WriteRuns(std::span<const ByteRun> runs, File& out, uint64_t at, std::span<std::byte> buffer,
                 const std::function<void(uint64_t)>& progress) {
  return StreamRuns(runs, buffer, [&](std::span<const std::byte> piece) -> Status {
    UCP_RETURN_IF_ERROR(out.WriteAt(at, piece));
    at += piece.size();
    if (progress) progress(piece.size());
    return Status::Ok();
  });
}

}  // namespace ucp
