// XXH3-64 over 1 GiB in 16 MiB buffers: the SSE2 baseline (this file is built without -mavx2),
// the AVX2 kernel, what Xxh3Update dispatches to, and ChunkedXxh3 (whole and chunk hashes, what
// the save path computes). See run.sh.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <string>
#include <vector>

#include "core/util/chunked_xxh3.h"
#include "core/util/xxh3.h"

namespace ucp {
namespace {

constexpr size_t kBufferBytes = 16 << 20;
constexpr size_t kBuffers = 64;

const std::vector<std::vector<std::byte>>& Buffers() {
  static const auto* buffers = [] {
    auto* made = new std::vector<std::vector<std::byte>>(kBuffers);
    for (size_t i = 0; i < kBuffers; ++i) {
      (*made)[i].resize(kBufferBytes);
      for (size_t j = 0; j < kBufferBytes; ++j) (*made)[i][j] = static_cast<std::byte>(i * 31 + j);
    }
    return made;
  }();
  return *buffers;
}

template <typename Update>
void HashGiB(benchmark::State& state, Update update) {
  const auto& buffers = Buffers();
  for (auto _ : state) {
    XXH3_state_t hash;
    XXH3_64bits_reset(&hash);
    for (const auto& buffer : buffers) update(hash, buffer.data(), buffer.size());
    benchmark::DoNotOptimize(XXH3_64bits_digest(&hash));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBuffers * kBufferBytes));
}

void BM_Xxh3Sse2(benchmark::State& state) {
  HashGiB(state, [](XXH3_state_t& hash, const std::byte* data, size_t size) {
    XXH3_64bits_update(&hash, data, size);
  });
}
BENCHMARK(BM_Xxh3Sse2)->Unit(benchmark::kMillisecond);

void BM_Xxh3Avx2(benchmark::State& state) {
  if (Xxh3Kernel() != "avx2") {
    state.SkipWithError("this CPU does not run AVX2");
    return;
  }
  HashGiB(state, [](XXH3_state_t& hash, const std::byte* data, size_t size) {
    detail::Xxh3UpdateAvx2(hash, data, size);
  });
}
BENCHMARK(BM_Xxh3Avx2)->Unit(benchmark::kMillisecond);

void BM_Xxh3Dispatched(benchmark::State& state) {
  state.SetLabel(std::string(Xxh3Kernel()));
  HashGiB(state, [](XXH3_state_t& hash, const std::byte* data, size_t size) {
    Xxh3Update(hash, data, size);
  });
}
BENCHMARK(BM_Xxh3Dispatched)->Unit(benchmark::kMillisecond);

// What the save path computes: the whole hash and 1 MiB chunk hashes, in one pass.
void BM_ChunkedXxh3(benchmark::State& state) {
  state.SetLabel(std::string(Xxh3Kernel()));
  const auto& buffers = Buffers();
  for (auto _ : state) {
    ChunkedXxh3 hash;
    for (const auto& buffer : buffers) hash.Update(buffer.data(), buffer.size());
    benchmark::DoNotOptimize(hash.Whole());
    benchmark::DoNotOptimize(hash.Chunks());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBuffers * kBufferBytes));
}
BENCHMARK(BM_ChunkedXxh3)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ucp
BENCHMARK_MAIN();
