#include "core/util/xxh3.h"

namespace ucp {
namespace {

bool CpuRunsAvx2() {
  // The preload may hash from a constructor, before libgcc has read the CPU's features.
  __builtin_cpu_init();
  // libgcc reports AVX2 only when the OS also saves the YMM registers (XGETBV).
  return __builtin_cpu_supports("avx2");
}

bool UseAvx2() {
  static const bool use_avx2 = CpuRunsAvx2();
  return use_avx2;
}

}  // namespace

void Xxh3Update(XXH3_state_t& state, std::span<const std::byte> bytes) {
  if (UseAvx2()) {
    detail::Xxh3UpdateAvx2(state, bytes.data(), bytes.size());
  } else {
    XXH3_64bits_update(&state, bytes.data(), bytes.size());
  }
}

std::string_view Xxh3Kernel() { return UseAvx2() ? "avx2" : "sse2"; }

}  // namespace ucp
