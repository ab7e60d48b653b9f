// Overflow-checked integer arithmetic for sizes and offsets read from untrusted files.
//
// Every size computed from checkpoint bytes (numel × itemsize, offset + length, header sizes)
// goes through these, so a crafted file cannot wrap an allocation or a bounds check.
#pragma once

#include <cstdint>
#include <optional>

namespace ucp {

template <typename T>
[[nodiscard]] std::optional<T> CheckedAdd(T a, T b) {
  T out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

template <typename T>
[[nodiscard]] std::optional<T> CheckedMul(T a, T b) {
  T out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// True when [offset, offset + length) lies within [0, limit) without overflow.
[[nodiscard]] inline bool RangeWithin(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

}  // namespace ucp
