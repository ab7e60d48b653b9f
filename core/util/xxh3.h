// XXH3-64 of bulk data with the fastest kernel this CPU runs: AVX2 where the CPU and the OS
// support it, else xxHash's SSE2 baseline (the x86-64 minimum the rest of ucp is built for). The
// kernels give identical hashes. Hashing a checkpoint is memory-bound, so AVX2 gains less than
// its width: 10-35% less time per GiB here (tests/bench/run.sh hash), CPU that the hasher thread
// takes from the trainer's other threads while torch.save writes (tests/bench/save).
//
// Use it for checkpoint bytes; a key or an index document may as well go to XXH3_64bits.
//
// Thread-safety: pure functions; the kernel is chosen once, on first use, thread-safely.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace ucp {

// Feeds `bytes` to `state` (XXH3_64bits_reset before the first call, XXH3_64bits_digest after
// the last), as XXH3_64bits_update does.
void Xxh3Update(XXH3_state_t& state, std::span<const std::byte> bytes);
inline void Xxh3Update(XXH3_state_t& state, const void* data, size_t size) {
  Xxh3Update(state, std::span(static_cast<const std::byte*>(data), size));
}

// The kernel Xxh3Update uses on this machine: "avx2" or "sse2".
std::string_view Xxh3Kernel();

namespace detail {
// The AVX2 kernel, compiled in its own file with -mavx2. Callable only where the CPU supports
// AVX2; exposed so that tests can check it against the baseline.
void Xxh3UpdateAvx2(XXH3_state_t& state, const void* data, size_t size);
}  // namespace detail

}  // namespace ucp
