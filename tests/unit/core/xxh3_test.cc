#include "core/util/xxh3.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <span>
#include <vector>

namespace ucp {
namespace {

// Sizes around every internal boundary of XXH3: the short-input cases (0, 1-3, 4-8, 9-16,
// 17-128, 129-240), one stripe (64), the internal buffer (256), a block (1024), and large inputs
// that end mid-stripe.
constexpr size_t kSizes[] = {
    0,   1,   3,   4,   8,    9,    16,   17,   64,    128,           129,           240,
    241, 255, 256, 257, 1023, 1024, 1025, 4096, 65537, (1 << 20) + 7, (3 << 20) + 61};

std::vector<std::byte> RandomBytes(size_t size, std::mt19937_64& random) {
  std::vector<std::byte> bytes(size);
  for (std::byte& byte : bytes) byte = static_cast<std::byte>(random());
  return bytes;
}

// The hash of `bytes` fed to `update` in random pieces (empty ones included).
template <typename Update>
uint64_t HashInPieces(const std::vector<std::byte>& bytes, std::mt19937_64& random, Update update) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  size_t done = 0;
  while (done < bytes.size()) {
    const size_t piece = std::min<size_t>(bytes.size() - done, random() % 300'000);
    update(state, bytes.data() + done, piece);
    done += piece;
  }
  return XXH3_64bits_digest(&state);
}

// The XXH3-64 of `bytes` through the dispatched kernel.
uint64_t DispatchedHash(std::span<const std::byte> bytes) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  Xxh3Update(state, bytes);
  return XXH3_64bits_digest(&state);
}

TEST(Xxh3Test, KnownValuesMatchXxhsum) {
  // `printf '' | xxhsum -H3`, `printf ucp | xxhsum -H3`, `head -c 1000 /dev/zero | xxhsum -H3`.
  EXPECT_EQ(DispatchedHash({}), 0x2d06800538d394c2u);
  EXPECT_EQ(DispatchedHash(std::as_bytes(std::span("ucp", 3))), 0x43b58183de8e3e5cu);
  const std::vector<std::byte> zeros(1000);
  EXPECT_EQ(DispatchedHash(zeros), 0x24c1ea6074dd588cu);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  Xxh3Update(state, zeros.data(), 999);
  Xxh3Update(state, zeros.data(), 1);
  EXPECT_EQ(XXH3_64bits_digest(&state), 0x24c1ea6074dd588cu);
}

// The dispatched kernel, fed in any pieces, gives the baseline's hash (this file is compiled
// without -mavx2, so XXH3_64bits here is xxHash's SSE2 kernel).
TEST(Xxh3Test, DispatchedKernelMatchesBaseline) {
  std::mt19937_64 random(7);
  for (const size_t size : kSizes) {
    const std::vector<std::byte> bytes = RandomBytes(size, random);
    const uint64_t baseline = XXH3_64bits(bytes.data(), bytes.size());
    EXPECT_EQ(DispatchedHash(bytes), baseline) << size;
    EXPECT_EQ(HashInPieces(bytes, random,
                           [](XXH3_state_t& state, const std::byte* data, size_t n) {
                             Xxh3Update(state, data, n);
                           }),
              baseline)
        << size;
  }
}

TEST(Xxh3Test, Avx2KernelMatchesBaseline) {
  if (Xxh3Kernel() != "avx2") GTEST_SKIP() << "this CPU does not run AVX2";
  std::mt19937_64 random(11);
  for (const size_t size : kSizes) {
    const std::vector<std::byte> bytes = RandomBytes(size, random);
    const uint64_t baseline = XXH3_64bits(bytes.data(), bytes.size());
    EXPECT_EQ(HashInPieces(bytes, random,
                           [](XXH3_state_t& state, const std::byte* data, size_t n) {
                             detail::Xxh3UpdateAvx2(state, data, n);
                           }),
              baseline)
        << size;
    // A state may pass between the kernels mid-stream (the two share its layout).
    bool avx2 = false;
    EXPECT_EQ(HashInPieces(bytes, random,
                           [&avx2](XXH3_state_t& state, const std::byte* data, size_t n) {
                             if (avx2) {
                               detail::Xxh3UpdateAvx2(state, data, n);
                             } else {
                               XXH3_64bits_update(&state, data, n);
                             }
                             avx2 = !avx2;
                           }),
              baseline)
        << size;
  }
}

TEST(Xxh3Test, KernelIsTheFastestThisCpuRuns) {
  __builtin_cpu_init();
  EXPECT_EQ(Xxh3Kernel(), __builtin_cpu_supports("avx2") ? "avx2" : "sse2");
}

}  // namespace
}  // namespace ucp
