// Executor benchmarks (see run.sh). Every figure is bytes per second of output data; the
// baselines copy the four source files whole, one after the other, as `cp -r` does.
#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/torch_archive_writer.h"
#include "core/io/file.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"
#include "core/plan/export_plan.h"

namespace ucp {
namespace {

constexpr uint32_t kRanks = 4;
constexpr uint32_t kAtoms = 64;
constexpr uint64_t kHeaderBytes = 4096;  // where each rank's flat partition starts in its file

std::string ScratchDir() {
  const char* dir = std::getenv("UCP_BENCH_DIR");
  if (dir == nullptr) dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/ucp_bench_executor_" +
         std::to_string(::getpid());
}

uint64_t DivCeil(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// The source tag: four rank files holding a ZeRO-style flat fp32 buffer of 64 atoms of about
// 4 Mi elements each (sizes vary so that partitions cut atoms), and its index.
class Layout {
 public:
  static Layout& Get() {
    static Layout layout;
    return layout;
  }
  const AtomIndex& index() const { return *index_; }
  const std::string& tag_dir() const { return tag_dir_; }
  uint64_t total_elements() const { return total_; }
  uint64_t source_bytes() const { return kRanks * (kHeaderBytes + partition_ * 4); }
  const std::vector<uint64_t>& starts() const { return starts_; }

 private:
  Layout() : tag_dir_(ScratchDir() + "/tag") {
    std::filesystem::create_directories(tag_dir_);
    for (uint32_t a = 0; a < kAtoms; ++a) {
      starts_.push_back(total_);
      total_ += (uint64_t{4} << 20) + (a * 7919u) % 65536u - 32768u;
    }
    starts_.push_back(total_);
    partition_ = DivCeil(total_, kRanks);
    AtomIndexContents c;
    c.framework = "bench";
    c.adapter = "bench";
    c.tag = "tag";
    c.topology = {kRanks, 1, 1, kRanks, 2};
    std::vector<std::byte> chunk(1 << 20);
    for (uint32_t r = 0; r < kRanks; ++r) {
      const std::string name = "rank" + std::to_string(r) + ".bin";
      File file = File::Open(tag_dir_ + "/" + name, File::Mode::kCreate).value();
      const uint64_t size = kHeaderBytes + partition_ * 4;
      for (uint64_t off = 0; off < size; off += chunk.size()) {
        std::memset(chunk.data(), static_cast<int>((off >> 20) + r), chunk.size());
        const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - off));
        if (!file.WriteAt(off, std::span(chunk.data(), n)).ok()) std::abort();
      }
      c.files.push_back({name, size, 0, "optim_states", RankCoordinates{r, 0, 0}});
    }
    for (uint32_t a = 0; a < kAtoms; ++a) {
      const Shape shape{starts_[a + 1] - starts_[a]};
      Atom atom{"p" + std::to_string(a), "fp32", DType::kFloat32, shape, {}};
      for (uint32_t r = 0; r < kRanks; ++r) {
        const uint64_t lo = std::max(starts_[a], r * partition_);
        const uint64_t hi = std::min(starts_[a + 1], (r + 1) * partition_);
        if (lo >= hi) continue;
        atom.fragments.push_back({r, kHeaderBytes + (lo - r * partition_) * 4, DType::kFloat32,
                                  Region::Flat(lo - starts_[a], hi - starts_[a], shape).value()});
      }
      c.atoms.push_back(std::move(atom));
    }
    index_ = std::make_unique<AtomIndex>(AtomIndex::Create(std::move(c)).value());
  }
  ~Layout() { std::filesystem::remove_all(ScratchDir()); }

  std::string tag_dir_;
  uint64_t total_ = 0;
  uint64_t partition_ = 0;
  std::vector<uint64_t> starts_;
  std::unique_ptr<AtomIndex> index_;
};

// The archives of the flat buffer repartitioned over `dp` ranks: one storage per rank file.
OutputPlan ReshardPlan(uint32_t dp) {
  const Layout& layout = Layout::Get();
  const uint64_t partition = DivCeil(layout.total_elements(), dp);
  OutputPlan plan;
  for (uint32_t q = 0; q < dp; ++q) {
    std::vector<Segment> segments;
    for (uint32_t a = 0; a < kAtoms; ++a) {
      const uint64_t lo = std::max(layout.starts()[a], q * partition);
      const uint64_t hi = std::min(layout.starts()[a + 1], (q + 1) * partition);
      if (lo >= hi) continue;
      const Atom& atom = layout.index().atoms()[a];
      const Region region =
          Region::Flat(lo - layout.starts()[a], hi - layout.starts()[a], atom.shape).value();
      AppendSegments(segments, PlanRegion(layout.index(), atom, region).value());
    }
    AppendZeros(segments, partition * 4 - SegmentBytes(segments));
    ArchiveOutput archive;
    archive.path = "out/rank" + std::to_string(q) + ".pt";
    TensorNodeSpec spec;
    spec.storage_key = "0";
    spec.storage_numel = partition;
    spec.shape = {partition};
    archive.graph.set_root(MakeTensorNode(archive.graph, spec).value());
    archive.storages.push_back({"0", std::move(segments)});
    plan.archives.push_back(std::move(archive));
  }
  return plan;
}

void Execute(benchmark::State& state, const OutputPlan& plan) {
  const Layout& layout = Layout::Get();
  const std::string out = ScratchDir() + "/target";
  ExecuteOptions options;
  options.sync = false;
  for (auto _ : state) {
    std::filesystem::create_directories(out);
    const Status status = ExecutePlan(plan, layout.index(), layout.tag_dir(), out, options);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
    state.PauseTiming();
    std::filesystem::remove_all(out);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * plan.DataBytes()));
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  state.counters["maxrss_MiB"] = static_cast<double>(usage.ru_maxrss) / 1024.0;
}

void BM_ReshardDp4ToDp2(benchmark::State& state) { Execute(state, ReshardPlan(2)); }
void BM_ReshardDp4ToDp8(benchmark::State& state) { Execute(state, ReshardPlan(8)); }
void BM_ExportSafetensors(benchmark::State& state) {
  Execute(state, PlanSafetensorsExport(Layout::Get().index(), "fp32",
                                       static_cast<uint64_t>(state.range(0)) << 20)
                     .value());
}

// Copies the four source files whole, one after the other: in the kernel (copy_file_range, as
// coreutils cp does) or through a 128 KiB buffer (read/write).
void CopySources(benchmark::State& state, bool kernel) {
  const Layout& layout = Layout::Get();
  const std::string out = ScratchDir() + "/copy";
  std::vector<std::byte> buffer(128 << 10);
  for (auto _ : state) {
    std::filesystem::create_directories(out);
    for (const IndexedFile& indexed : layout.index().files()) {
      const File source =
          File::Open(layout.tag_dir() + "/" + indexed.path, File::Mode::kRead).value();
      File target = File::Open(out + "/" + indexed.path, File::Mode::kCreate).value();
      if (kernel) {
        if (!CopyRange(source, 0, target, 0, indexed.size).ok()) std::abort();
      } else {
        for (uint64_t off = 0; off < indexed.size; off += buffer.size()) {
          const size_t n =
              static_cast<size_t>(std::min<uint64_t>(buffer.size(), indexed.size - off));
          if (!source.ReadAt(off, std::span(buffer.data(), n)).ok()) std::abort();
          if (!target.Append(std::span(buffer.data(), n)).ok()) std::abort();
        }
      }
      if (!target.Close().ok()) std::abort();
    }
    state.PauseTiming();
    std::filesystem::remove_all(out);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * layout.source_bytes()));
}
void BM_CopyFilesCopyFileRange(benchmark::State& state) { CopySources(state, true); }
void BM_CopyFilesReadWrite(benchmark::State& state) { CopySources(state, false); }

BENCHMARK(BM_CopyFilesCopyFileRange)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
BENCHMARK(BM_CopyFilesReadWrite)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
BENCHMARK(BM_ReshardDp4ToDp2)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
BENCHMARK(BM_ReshardDp4ToDp8)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
// One 1 GiB shard (one writer thread), and 256 MiB shards (four in parallel).
BENCHMARK(BM_ExportSafetensors)
    ->Arg(0)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(5);

}  // namespace
}  // namespace ucp

BENCHMARK_MAIN();
