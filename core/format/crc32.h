// CRC-32 as zip, gzip and PNG define it: reflected polynomial 0xEDB88320, initial value
// 0xFFFFFFFF, final XOR 0xFFFFFFFF (the value Python's zlib.crc32 and `crc32` in zip headers
// hold). Crc32("123456789") == 0xCBF43926.
//
// The implementation is chosen once per process from the CPU: carry-less multiplication folding
// (PCLMULQDQ, x86-64 with SSE4.1) when available, else table-driven slicing-by-16.
//
// Thread-safety: pure functions over caller-owned bytes; Crc32Stream is a plain value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace ucp {

// CRC-32 of `data` continuing from `crc`, the finished CRC of the bytes before it (0 for none):
// Crc32(b, Crc32(a)) == Crc32(a ‖ b), like zlib's crc32(crc, buf, len).
[[nodiscard]] uint32_t Crc32(std::span<const std::byte> data, uint32_t crc = 0);
[[nodiscard]] uint32_t Crc32(std::string_view data, uint32_t crc = 0);

// The CRC-32 of a ‖ b from crc_a = Crc32(a), crc_b = Crc32(b) and b's length, without the bytes
// (zlib's crc32_combine): what lets several processes CRC the pieces of one zip record they each
// write, and one of them put the record's CRC in the archive. O(log length_b).
[[nodiscard]] uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// Incremental form for data that arrives in chunks: Update() any number of times, then value().
class Crc32Stream {
 public:
  void Update(std::span<const std::byte> data) { crc_ = Crc32(data, crc_); }
  // The CRC-32 of everything passed to Update so far (0 for nothing).
  uint32_t value() const { return crc_; }

 private:
  uint32_t crc_ = 0;
};

// Which implementation Crc32 uses on this machine: "pclmul" or "slice16" (for benchmarks).
std::string_view Crc32Implementation();

// The portable slicing-by-16 implementation, whatever the CPU (for tests and benchmarks).
[[nodiscard]] uint32_t Crc32Portable(std::span<const std::byte> data, uint32_t crc = 0);

}  // namespace ucp
