// Throughput of the pickle codec on the data.pkl of a torch.save'd state dict.
#include <benchmark/benchmark.h>

#include <string>

#include "core/format/pickle_reader.h"
#include "core/format/pickle_writer.h"

namespace ucp::pickle {
namespace {

// The pickle torch.save writes for an OrderedDict of `tensors` float tensors, with its
// _metadata state, built through the same node kinds torch's pickle holds.
std::string StateDictPickle(int tensors) {
  Graph g;
  Value* rebuild = g.Global("torch._utils", "_rebuild_tensor_v2");
  Value* storage_type = g.Global("torch", "FloatStorage");
  Value* ordered_dict = g.Global("collections", "OrderedDict");
  Value* storage = g.Str("storage");
  Value* cpu = g.Str("cpu");
  Value* state = g.Object(Construction::kReduce, ordered_dict, g.Tuple({}));
  Value* metadata = g.Dict({});
  for (int i = 0; i < tensors; ++i) {
    Value* pid = g.PersistentId(
        g.Tuple({storage, storage_type, g.Str(std::to_string(i)), cpu, g.Int(4096 * 1024)}));
    Value* tensor = g.Object(Construction::kReduce, rebuild,
                             g.Tuple({pid, g.Int(0), g.Tuple({g.Int(4096), g.Int(1024)}),
                                      g.Tuple({g.Int(1024), g.Int(1)}), g.Bool(false),
                                      g.Object(Construction::kReduce, ordered_dict, g.Tuple({}))}));
    const std::string name =
        "model.layers." + std::to_string(i / 8) + ".weight" + std::to_string(i % 8);
    state->mutable_mutations().push_back({Mutation::Op::kSetItem, g.Str(name), tensor});
    metadata->mutable_entries().emplace_back(g.Str(name), g.Dict({{g.Str("version"), g.Int(1)}}));
  }
  state->mutable_mutations().push_back(
      {Mutation::Op::kBuild, g.Dict({{g.Str("_metadata"), metadata}}), nullptr});
  return WritePickle(state).value();
}

void BM_Read(benchmark::State& s) {
  const std::string bytes = StateDictPickle(static_cast<int>(s.range(0)));
  for (auto _ : s) {
    auto graph = ReadPickle(bytes);
    benchmark::DoNotOptimize(graph.ok());
  }
  s.SetBytesProcessed(static_cast<int64_t>(s.iterations() * bytes.size()));
  s.counters["tensors/s"] = benchmark::Counter(static_cast<double>(s.iterations() * s.range(0)),
                                               benchmark::Counter::kIsRate);
}

void BM_Write(benchmark::State& s) {
  const std::string bytes = StateDictPickle(static_cast<int>(s.range(0)));
  auto graph = ReadPickle(bytes);
  for (auto _ : s) {
    auto out = WritePickle(graph->root());
    benchmark::DoNotOptimize(out.ok());
  }
  s.SetBytesProcessed(static_cast<int64_t>(s.iterations() * bytes.size()));
  s.counters["tensors/s"] = benchmark::Counter(static_cast<double>(s.iterations() * s.range(0)),
                                               benchmark::Counter::kIsRate);
}

BENCHMARK(BM_Read)->Arg(100)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Write)->Arg(100)->Arg(10000)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ucp::pickle

BENCHMARK_MAIN();
