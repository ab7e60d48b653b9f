// Zip codec benchmarks (see run.sh). Every figure is bytes per second of record data.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/format/crc32.h"
#include "core/format/zip_writer.h"
#include "core/io/file.h"

namespace ucp {
namespace {

constexpr uint64_t kArchiveBytes = uint64_t{1} << 30;
constexpr uint64_t kRecordBytes = uint64_t{64} << 20;

std::string ScratchDir() {
  const char* dir = std::getenv("UCP_BENCH_DIR");
  if (dir == nullptr) dir = std::getenv("TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::vector<std::byte> RandomBytes(size_t n) {
  std::vector<std::byte> out(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(&out[i], &x, 8);
  }
  return out;
}

// The 1 GiB source file every copy reads, written once per process and removed at exit.
class Source {
 public:
  static Source& Get() {
    static Source source;
    return source;
  }
  const File& file() const { return file_; }
  const std::vector<uint32_t>& crcs() const { return crcs_; }

 private:
  Source() : path_(ScratchDir() + "/ucp_bench_zip_source_" + std::to_string(::getpid())) {
    file_ = std::move(File::Open(path_, File::Mode::kCreate).value());
    const std::vector<std::byte> chunk = RandomBytes(kRecordBytes);
    for (uint64_t off = 0; off < kArchiveBytes; off += kRecordBytes) {
      // Vary each record so CRCs differ.
      std::vector<std::byte> record = chunk;
      record[0] = static_cast<std::byte>(off >> 26);
      if (!file_.WriteAt(off, record).ok()) std::abort();
      crcs_.push_back(Crc32(record));
    }
  }
  ~Source() { (void)RemoveFile(path_); }

  std::string path_;
  File file_;
  std::vector<uint32_t> crcs_;
};

std::string Target(const char* name) {
  return ScratchDir() + "/ucp_bench_zip_" + name + "_" + std::to_string(::getpid());
}

void BM_Crc32(benchmark::State& state) {
  const std::vector<std::byte> data = RandomBytes(static_cast<size_t>(state.range(0)));
  uint32_t crc = 0;
  for (auto _ : state) {
    crc = Crc32(data, crc);
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
  state.SetLabel(std::string(Crc32Implementation()));
}
BENCHMARK(BM_Crc32)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);

void BM_Crc32Portable(benchmark::State& state) {
  const std::vector<std::byte> data = RandomBytes(static_cast<size_t>(state.range(0)));
  uint32_t crc = 0;
  for (auto _ : state) {
    crc = Crc32Portable(data, crc);
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
  state.SetLabel("slice16");
}
BENCHMARK(BM_Crc32Portable)->Arg(1 << 20)->Arg(64 << 20);

// Baseline 1: the whole 1 GiB with copy_file_range (what cp does).
void BM_PlainCopyKernel(benchmark::State& state) {
  const Source& source = Source::Get();
  const std::string path = Target("copy");
  for (auto _ : state) {
    File out = std::move(File::Open(path, File::Mode::kCreate).value());
    if (!CopyRange(source.file(), 0, out, 0, kArchiveBytes).ok()) std::abort();
    if (!out.Close().ok()) std::abort();
  }
  (void)RemoveFile(path);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArchiveBytes));
}
BENCHMARK(BM_PlainCopyKernel)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

// Baseline 2: the whole 1 GiB through a 4 MiB user-space buffer (pread + pwrite).
void BM_PlainCopyBuffered(benchmark::State& state) {
  const Source& source = Source::Get();
  const std::string path = Target("copybuf");
  std::unique_ptr<std::byte[]> buffer(new std::byte[4 << 20]);
  for (auto _ : state) {
    File out = std::move(File::Open(path, File::Mode::kCreate).value());
    for (uint64_t off = 0; off < kArchiveBytes; off += 4 << 20) {
      if (!source.file().ReadAt(off, {buffer.get(), 4 << 20}).ok()) std::abort();
      if (!out.WriteAt(off, {buffer.get(), 4 << 20}).ok()) std::abort();
    }
    if (!out.Close().ok()) std::abort();
  }
  (void)RemoveFile(path);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArchiveBytes));
}
BENCHMARK(BM_PlainCopyBuffered)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

// The zip writer building a 1 GiB archive of 16 records of 64 MiB streamed from the source.
// Arg 1: CRCs known (copy_file_range); Arg 0: the writer reads and CRCs every byte.
void BM_ZipWriter(benchmark::State& state) {
  const bool known_crc = state.range(0) == 1;
  const Source& source = Source::Get();
  const std::string path = Target("zip");
  for (auto _ : state) {
    ZipWriter::Options options;
    options.sync = false;
    auto writer = ZipWriter::Create(path, options);
    if (!writer.ok()) std::abort();
    for (uint64_t i = 0; i * kRecordBytes < kArchiveBytes; ++i) {
      std::optional<uint32_t> crc;
      if (known_crc) crc = source.crcs()[i];
      if (!writer
               ->AddRecordFromFile("data/" + std::to_string(i), source.file(), i * kRecordBytes,
                                   kRecordBytes, crc)
               .ok()) {
        std::abort();
      }
    }
    if (!writer->Finish().ok()) std::abort();
  }
  (void)RemoveFile(path);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArchiveBytes));
  state.SetLabel(known_crc ? "crc known" : "crc computed");
}
BENCHMARK(BM_ZipWriter)
    ->Arg(1)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();

}  // namespace
}  // namespace ucp

BENCHMARK_MAIN();
