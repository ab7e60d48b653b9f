// Benchmarks of the torch archive codec on one large torch.save file (UCP_BENCH_ARCHIVE, made by
// run.sh): reading its metadata (zip directory + data.pkl, no tensor bytes), rewriting it with
// TorchArchiveWriter (storages streamed from the source's byte ranges), and, for reference in
// the same run, a plain copy of the same number of bytes with the same kernel copy path
// (copy_file_range through core/io). Both writes fsync and go to the source's folder.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/format/torch_archive_reader.h"
#include "core/format/torch_archive_writer.h"
#include "core/io/file.h"

namespace ucp {
namespace {

std::string Source() {
  const char* path = std::getenv("UCP_BENCH_ARCHIVE");
  return path == nullptr ? "" : path;
}

void BM_ReadMetadata(benchmark::State& state) {
  size_t tensors = 0;
  for (auto _ : state) {
    Result<TorchArchiveReader> reader = TorchArchiveReader::Open(Source());
    if (!reader.ok()) {
      state.SkipWithError(reader.status().ToString().c_str());
      return;
    }
    tensors = reader->tensors().size();
    benchmark::DoNotOptimize(tensors);
  }
  state.counters["tensors"] = static_cast<double>(tensors);
}
BENCHMARK(BM_ReadMetadata)->Unit(benchmark::kMillisecond);

void BM_RewriteArchive(benchmark::State& state) {
  Result<TorchArchiveReader> reader = TorchArchiveReader::Open(Source());
  if (!reader.ok()) {
    state.SkipWithError(reader.status().ToString().c_str());
    return;
  }
  const std::string out = Source() + ".rewrite.pt";
  uint64_t bytes = 0;
  for (auto _ : state) {
    Result<uint64_t> size = RewriteArchive(*reader, out);
    if (!size.ok()) {
      state.SkipWithError(size.status().ToString().c_str());
      return;
    }
    bytes += *size;
    state.PauseTiming();
    std::filesystem::remove(out);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}
BENCHMARK(BM_RewriteArchive)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

void BM_PlainCopy(benchmark::State& state) {
  Result<File> source = File::Open(Source(), File::Mode::kRead);
  Result<uint64_t> size = source.ok() ? source->Size() : Result<uint64_t>(source.status());
  if (!size.ok()) {
    state.SkipWithError(size.status().ToString().c_str());
    return;
  }
  const std::string out = Source() + ".copy";
  uint64_t bytes = 0;
  for (auto _ : state) {
    Result<File> copy = File::Open(out, File::Mode::kCreate);
    Status status = copy.ok() ? CopyRange(*source, 0, *copy, 0, *size) : copy.status();
    if (status.ok()) status = copy->Sync();
    if (status.ok()) status = copy->Close();
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    bytes += *size;
    state.PauseTiming();
    std::filesystem::remove(out);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}
BENCHMARK(BM_PlainCopy)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace
}  // namespace ucp

BENCHMARK_MAIN();
