#include "core/io/byte_run.h"

#include <algorithm>
#include <cstring>
#include <optional>

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

Status StreamRuns(std::span<const ByteRun> runs, std::span<std::byte> buffer,
                  const std::function<Status(std::span<const std::byte>)>& sink) {
  if (buffer.empty()) return Status::InvalidArgument("byte runs: empty buffer");
  size_t filled = 0;
  ChunkCache cache;
  for (const ByteRun& run : runs) {
    for (uint64_t done = 0; done < run.length;) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(run.length - done, buffer.size() - filled));
      const std::span<std::byte> piece = buffer.subspan(filled, n);
      if (run.file == nullptr) {
        std::memset(piece.data(), 0, n);
      } else if (run.checked != nullptr) {
        UCP_RETURN_IF_ERROR(run.checked->ReadAt(run.offset + done, piece, cache));
      } else {
        UCP_RETURN_IF_ERROR(run.file->ReadAt(run.offset + done, piece));
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
