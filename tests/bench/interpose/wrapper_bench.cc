// The wrappers' own cost, without the system call: this binary links libucp.so's wrapper
// objects into itself (so its calls of write, open, ... reach them, as under LD_PRELOAD) and
// points ucp's real-symbol table at functions that return at once. "wrapped" calls the libc
// name (wrapper + stub), "stub" calls the stub through a pointer; the difference is what a
// wrapper adds to an untracked call. Syscall noise on a shared machine is far larger than that
// difference, which is why this exists beside interpose_bench.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "interpose/gate.h"
#include "interpose/real.h"

namespace {

// The benchmark's own output goes through the same slots: the stubs pass anything that is not
// the benchmark's fd 7 / null_stream on to glibc.
decltype(&::write) libc_write;
decltype(&::fwrite) libc_fwrite;
FILE* null_stream;

ssize_t StubWrite(int fd, const void* data, size_t n) {
  return fd == 7 ? static_cast<ssize_t>(n) : libc_write(fd, data, n);
}
int StubOpen(const char*, int, ...) { return 1000; }
int StubClose(int) { return 0; }
int StubStat(const char* __restrict, struct stat* __restrict) __THROW { return 0; }
size_t StubFwrite(const void* data, size_t size, size_t count, FILE* stream) {
  return stream == null_stream ? count : libc_fwrite(data, size, count, stream);
}

void Install(ucp::real::internal::Symbol symbol, void* fn) {
  ucp::real::internal::g_slots[static_cast<int>(symbol)].store(fn);
}

// The stubs, each behind a pointer the compiler cannot see through.
struct Stubs {
  decltype(&::write) volatile write = &StubWrite;
  decltype(&::open) volatile open = &StubOpen;
  decltype(&::close) volatile close = &StubClose;
  decltype(&::stat) volatile stat = &StubStat;
  decltype(&::fwrite) volatile fwrite = &StubFwrite;
} stubs;

void Setup() {
  using ucp::real::internal::Symbol;
  libc_write = ucp::real::write();
  libc_fwrite = ucp::real::fwrite();
  null_stream = fopen("/dev/null", "w");
  Install(Symbol::k_write, reinterpret_cast<void*>(&StubWrite));
  Install(Symbol::k_open, reinterpret_cast<void*>(&StubOpen));
  Install(Symbol::k_close, reinterpret_cast<void*>(&StubClose));
  Install(Symbol::k_stat, reinterpret_cast<void*>(&StubStat));
  Install(Symbol::k_fwrite, reinterpret_cast<void*>(&StubFwrite));
}

char buffer[8];
struct stat st;

void BM_Write_Wrapped(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(write(7, buffer, sizeof(buffer)));
}
void BM_Write_Stub(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(stubs.write(7, buffer, sizeof(buffer)));
}
void BM_OpenClose_Wrapped(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(close(open("/x", O_RDONLY)));
}
void BM_OpenClose_Stub(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(stubs.close(stubs.open("/x", O_RDONLY)));
}
void BM_OpenCloseWrite_Wrapped(benchmark::State& state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(close(open("/x", O_WRONLY | O_CREAT | O_TRUNC, 0644)));
}
void BM_OpenCloseWrite_Stub(benchmark::State& state) {
  for (auto _ : state) {
    benchmark::DoNotOptimize(stubs.close(stubs.open("/x", O_WRONLY | O_CREAT | O_TRUNC, 0644)));
  }
}
void BM_Stat_Wrapped(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(stat("/x", &st));
}
void BM_Stat_Stub(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(stubs.stat("/x", &st));
}
void BM_Fwrite_Wrapped(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(fwrite(buffer, 1, sizeof(buffer), null_stream));
}
void BM_Fwrite_Stub(benchmark::State& state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(stubs.fwrite(buffer, 1, sizeof(buffer), null_stream));
}

BENCHMARK(BM_Write_Wrapped);
BENCHMARK(BM_Write_Stub);
BENCHMARK(BM_OpenClose_Wrapped);
BENCHMARK(BM_OpenClose_Stub);
BENCHMARK(BM_OpenCloseWrite_Wrapped);
BENCHMARK(BM_OpenCloseWrite_Stub);
BENCHMARK(BM_Stat_Wrapped);
BENCHMARK(BM_Stat_Stub);
BENCHMARK(BM_Fwrite_Wrapped);
BENCHMARK(BM_Fwrite_Stub);

}  // namespace

int main(int argc, char** argv) {
  Setup();
  if (!ucp::InterceptGate()) return 1;  // ucp must be on, or this measures nothing
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
