// Cost of hooked calls on files ucp does not track. run.sh runs it plain and under
// LD_PRELOAD=libucp.so and prints the difference per call.

#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <utility>

namespace {

// A temporary directory with one small file, removed at exit.
class Scratch {
 public:
  Scratch() {
    char pattern[] = "/tmp/ucp_bench_XXXXXX";
    dir_ = mkdtemp(pattern);
    file_ = dir_ + "/file";
    const int fd = open(file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "0123456789", 10) != 10) abort();
    close(fd);
  }
  ~Scratch() {
    unlink(file_.c_str());
    unlink((dir_ + "/grow").c_str());
    rmdir(dir_.c_str());
  }
  const std::string& dir() const { return dir_; }
  const std::string& file() const { return file_; }

 private:
  std::string dir_;
  std::string file_;
};

Scratch& GetScratch() {
  static Scratch scratch;
  return scratch;
}

// Each benchmark runs in two variants: "hooked" calls the libc name as any program does (so
// under LD_PRELOAD=libucp.so it goes through ucp's wrapper), "direct" calls glibc's own
// definition through a pointer taken from libc.so.6 itself, bypassing any preload. Under the
// preload, hooked - direct is what the wrapper adds, measured in the same process.
template <typename Fn>
Fn Libc(const char* name) {
  static void* const libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  void* fn = libc == nullptr ? nullptr : dlsym(libc, name);
  if (fn == nullptr) abort();
  return reinterpret_cast<Fn>(fn);
}

struct Calls {
  decltype(&::write) write;
  decltype(&::open) open;
  decltype(&::close) close;
  decltype(&::stat) stat;
  decltype(&::fwrite) fwrite;
};

Calls Hooked() { return {&::write, &::open, &::close, &::stat, &::fwrite}; }
Calls Direct() {
  return {Libc<decltype(&::write)>("write"), Libc<decltype(&::open)>("open"),
          Libc<decltype(&::close)>("close"), Libc<decltype(&::stat)>("stat"),
          Libc<decltype(&::fwrite)>("fwrite")};
}

void BM_WriteDevNull(benchmark::State& state, Calls calls) {
  const int fd = open("/dev/null", O_WRONLY);
  char buffer[8] = {};
  for (auto _ : state) benchmark::DoNotOptimize(calls.write(fd, buffer, sizeof(buffer)));
  close(fd);
}

void BM_WriteTmpFile(benchmark::State& state, Calls calls) {
  const std::string path = GetScratch().dir() + "/grow";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  char buffer[8] = {};
  for (auto _ : state) benchmark::DoNotOptimize(calls.write(fd, buffer, sizeof(buffer)));
  close(fd);
  unlink(path.c_str());
}

void BM_OpenCloseRead(benchmark::State& state, Calls calls) {
  const char* path = GetScratch().file().c_str();
  for (auto _ : state) calls.close(calls.open(path, O_RDONLY));
}

void BM_OpenCloseWrite(benchmark::State& state, Calls calls) {
  const char* path = GetScratch().file().c_str();
  for (auto _ : state) calls.close(calls.open(path, O_WRONLY));
}

void BM_Stat(benchmark::State& state, Calls calls) {
  const char* path = GetScratch().file().c_str();
  struct stat st;
  for (auto _ : state) benchmark::DoNotOptimize(calls.stat(path, &st));
}

// Buffered: no system call per iteration, so this shows the wrapper's cost alone.
void BM_FwriteDevNull(benchmark::State& state, Calls calls) {
  FILE* f = fopen("/dev/null", "w");
  char buffer[8] = {};
  for (auto _ : state) benchmark::DoNotOptimize(calls.fwrite(buffer, 1, sizeof(buffer), f));
  fclose(f);
}

void Register() {
  const std::pair<const char*, void (*)(benchmark::State&, Calls)> kBenchmarks[] = {
      {"write_devnull", &BM_WriteDevNull},
      {"write_tmpfile", &BM_WriteTmpFile},
      {"open_close_read", &BM_OpenCloseRead},
      {"open_close_write", &BM_OpenCloseWrite},
      {"stat", &BM_Stat},
      {"fwrite_devnull", &BM_FwriteDevNull}};
  for (const auto& [name, fn] : kBenchmarks) {
    benchmark::RegisterBenchmark((std::string(name) + "/hooked").c_str(), fn, Hooked());
    benchmark::RegisterBenchmark((std::string(name) + "/direct").c_str(), fn, Direct());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Register();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
