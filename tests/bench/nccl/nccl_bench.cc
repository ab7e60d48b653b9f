// Cost of the NCCL wrappers per call, against the stand-in NCCL (tests/nccl/stand_in_nccl.c).
// run.sh runs this binary without libucp.so, with it, and with it and UCP_DUMP_TOPOLOGY set;
// the difference between the runs is what ucp adds. The types come from the fallback
// declarations of interpose/nccl_abi.h (the same ABI as nccl.h; no CUDA headers needed).
#include <benchmark/benchmark.h>

#include <cstring>

#include "interpose/nccl_abi.h"

namespace {

// The pair PyTorch issues around batched collectives: the hot NCCL path ucp wraps.
void BM_GroupStartEnd(benchmark::State& state) {
  for (auto _ : state) {
    benchmark::DoNotOptimize(ncclGroupStart());
    benchmark::DoNotOptimize(ncclGroupEnd());
  }
}
BENCHMARK(BM_GroupStartEnd);

// A communicator's whole life: unique id, init, destroy (each one recorded by the registry).
void BM_CommLifecycle(benchmark::State& state) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  for (auto _ : state) {
    ncclComm_t comm = nullptr;
    benchmark::DoNotOptimize(ncclGetUniqueId(&id));
    benchmark::DoNotOptimize(ncclCommInitRank(&comm, 8, id, 3));
    benchmark::DoNotOptimize(ncclCommDestroy(comm));
  }
}
BENCHMARK(BM_CommLifecycle);

}  // namespace

BENCHMARK_MAIN();
