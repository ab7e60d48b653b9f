// Tests core/io/byte_run.cc (StreamRuns) and the writers' gathering entry points built on it
// (ZipWriter::AddRecordFromRuns, TorchArchiveWriter::AddStorageFromRuns,
// SafetensorsWriter::AddFromRuns): every gathered file must be byte-identical to the same file
// written from the same bytes assembled in memory, and a gathered torch archive must load in
// torch.
#include "core/io/byte_run.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/format/safetensors_writer.h"
#include "core/format/torch_archive_writer.h"
#include "core/format/zip_writer.h"
#include "test_bytes.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;

using testing::ReadAll;

class ByteRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::ScratchDirectory("ucp_byte_run_test");
    source_bytes_ = testing::Pattern(1 << 20, 7);
    std::ofstream(Path("source.bin"), std::ios::binary)
        .write(reinterpret_cast<const char*>(source_bytes_.data()),
               static_cast<std::streamsize>(source_bytes_.size()));
    source_ = File::Open(Path("source.bin"), File::Mode::kRead).value();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Runs out of order, adjacent, of zeros, empty, and crossing any buffer size used here; and
  // the bytes they stand for, assembled independently from the pattern.
  std::vector<ByteRun> Runs() const {
    return {{&source_, 1000, 300'000}, {nullptr, 0, 17},        {&source_, 5, 3},
            {&source_, 8, 0},          {&source_, 700'000, 12}, {&source_, 712'000, 90'001},
            {nullptr, 0, 70'000},      {&source_, 0, 3}};
  }
  std::vector<std::byte> Expected() const {
    std::vector<std::byte> out;
    for (const ByteRun& run : Runs()) {
      if (run.file == nullptr) {
        out.insert(out.end(), run.length, std::byte{0});
      } else {
        out.insert(out.end(), source_bytes_.begin() + static_cast<ptrdiff_t>(run.offset),
                   source_bytes_.begin() + static_cast<ptrdiff_t>(run.offset + run.length));
      }
    }
    return out;
  }

  std::filesystem::path dir_;
  std::vector<std::byte> source_bytes_;
  File source_;
};

TEST_F(ByteRunTest, StreamRunsChunksAcrossRuns) {
  const std::vector<ByteRun> runs = Runs();
  EXPECT_EQ(ByteRunsLength(runs).value(), Expected().size());
  for (const size_t buffer_size : {size_t{1}, size_t{4096}, size_t{100'000}, size_t{1} << 21}) {
    std::vector<std::byte> buffer(buffer_size);
    std::vector<std::byte> got;
    size_t chunks = 0;
    const Status status = StreamRuns(runs, buffer, [&](std::span<const std::byte> chunk) {
      ++chunks;
      got.insert(got.end(), chunk.begin(), chunk.end());
      // Every chunk but the last fills the buffer.
      EXPECT_TRUE(chunk.size() == buffer_size || got.size() == Expected().size());
      return Status::Ok();
    });
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(got, Expected()) << buffer_size;
    EXPECT_EQ(chunks, (got.size() + buffer_size - 1) / buffer_size);
  }
}

TEST_F(ByteRunTest, StreamRunsReportsShortSourceAndSinkErrors) {
  std::vector<std::byte> buffer(4096);
  const std::vector<ByteRun> past_end = {{&source_, (1 << 20) - 10, 20}};
  const Status short_source =
      StreamRuns(past_end, buffer, [](std::span<const std::byte>) { return Status::Ok(); });
  EXPECT_EQ(short_source.code(), StatusCode::kCorrupt);
  EXPECT_THAT(short_source.message(), HasSubstr(Path("source.bin")));
  const Status sink = StreamRuns(
      Runs(), buffer, [](std::span<const std::byte>) { return Status::IoError("sink full"); });
  EXPECT_EQ(sink.code(), StatusCode::kIoError);
  const std::vector<ByteRun> overflow = {{nullptr, 0, ~0ull}, {nullptr, 0, 2}};
  EXPECT_EQ(ByteRunsLength(overflow).status().code(), StatusCode::kOutOfRange);
}

// bfloat16 values in a file, widened: each output float32 is the bfloat16's value (its bits the
// float32's high half), whatever the buffer size splits, beside plain runs.
TEST_F(ByteRunTest, WidenedRunsGiveTheBfloat16sAsFloat32) {
  const std::vector<float> values = {1.5f, -2.0f, 0.0f, 3.140625f, -0.0078125f, 65536.0f, 7.0f};
  std::vector<std::byte> bf16;
  for (const float value : values) {
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    ASSERT_EQ(bits & 0xFFFF, 0u) << value << " is not a bfloat16";
    bf16.push_back(static_cast<std::byte>((bits >> 16) & 0xFF));
    bf16.push_back(static_cast<std::byte>(bits >> 24));
  }
  std::ofstream(Path("bf16.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(bf16.data()), static_cast<std::streamsize>(bf16.size()));
  const File file = File::Open(Path("bf16.bin"), File::Mode::kRead).value();
  // Elements 1..6 widened, then source bytes 0..2 as they are.
  const std::vector<ByteRun> runs = {{&file, 2, 24, nullptr, /*widen_bf16=*/true}, {&file, 0, 3}};
  std::vector<std::byte> expected(24);
  std::memcpy(expected.data(), values.data() + 1, 24);
  expected.insert(expected.end(), bf16.begin(), bf16.begin() + 3);
  EXPECT_EQ(ByteRunsLength(runs).value(), 27u);
  for (const size_t buffer_size : {size_t{1}, size_t{3}, size_t{5}, size_t{4096}}) {
    std::vector<std::byte> buffer(buffer_size);
    std::vector<std::byte> got;
    const Status status = StreamRuns(runs, buffer, [&](std::span<const std::byte> chunk) {
      got.insert(got.end(), chunk.begin(), chunk.end());
      return Status::Ok();
    });
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(got, expected) << buffer_size;
  }
  // A safetensors tensor from a widened run is the float32 values (the run passes through memory,
  // not copy_file_range).
  SafetensorsWriter gathered;
  ASSERT_TRUE(gathered.AddFromRuns("t", DType::kFloat32, {6}, std::span(runs).first(1)).ok());
  ASSERT_TRUE(gathered.Write(Path("widened.safetensors")).ok());
  SafetensorsWriter direct;
  ASSERT_TRUE(direct.AddFromMemory("t", DType::kFloat32, {6}, std::span(expected).first(24)).ok());
  ASSERT_TRUE(direct.Write(Path("direct.safetensors")).ok());
  EXPECT_EQ(ReadAll(Path("widened.safetensors")), ReadAll(Path("direct.safetensors")));
  // Not whole float32s: refused.
  std::vector<std::byte> buffer(64);
  const std::vector<ByteRun> ragged = {{&file, 0, 6, nullptr, true}};
  const Status status =
      StreamRuns(ragged, buffer, [](std::span<const std::byte>) { return Status::Ok(); });
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("not whole float32s"));
}

TEST_F(ByteRunTest, ZipRecordFromRunsEqualsRecordFromMemory) {
  const std::vector<std::byte> expected = Expected();
  for (const size_t buffer_size : {size_t{4096}, size_t{256} << 10}) {
    ZipWriter::Options options;
    options.sync = false;
    options.copy_buffer_bytes = buffer_size;
    ZipWriter gathered = ZipWriter::Create(Path("gathered.zip"), options).value();
    ZipWriter direct = ZipWriter::Create(Path("direct.zip"), options).value();
    ASSERT_TRUE(gathered.AddRecord("a", std::string_view("head")).ok());
    ASSERT_TRUE(direct.AddRecord("a", std::string_view("head")).ok());
    const std::vector<ByteRun> runs = Runs();
    ASSERT_TRUE(gathered.AddRecordFromRuns("data/0", runs).ok());
    ASSERT_TRUE(direct.AddRecord("data/0", expected).ok());
    ASSERT_TRUE(gathered.AddRecordFromRuns("empty", {}).ok());
    ASSERT_TRUE(direct.AddRecord("empty", std::span<const std::byte>()).ok());
    ASSERT_TRUE(gathered.Finish().ok());
    ASSERT_TRUE(direct.Finish().ok());
    EXPECT_EQ(ReadAll(Path("gathered.zip")), ReadAll(Path("direct.zip"))) << buffer_size;
  }
}

TEST_F(ByteRunTest, ZipRecordFromShortRunsFailsAndLeavesNothing) {
  ZipWriter::Options options;
  options.sync = false;
  {
    ZipWriter writer = ZipWriter::Create(Path("bad.zip"), options).value();
    const std::vector<ByteRun> runs = {{&source_, 0, 10}, {&source_, (1 << 20) - 5, 10}};
    const Status status = writer.AddRecordFromRuns("x", runs);
    EXPECT_EQ(status.code(), StatusCode::kCorrupt);
    EXPECT_THAT(status.message(), HasSubstr("zip: add record \"archive/x\""));
    EXPECT_EQ(writer.Finish().status().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_FALSE(std::filesystem::exists(Path("bad.zip")));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_),
                          std::filesystem::directory_iterator()),
            1);  // source.bin only: the temporary is gone
}

TEST_F(ByteRunTest, SafetensorsFromRunsEqualsFromMemory) {
  const std::vector<std::byte> expected = Expected();
  ASSERT_EQ(expected.size() % 4, 0u);
  const std::vector<uint64_t> shape = {expected.size() / 4};
  const std::vector<ByteRun> runs = Runs();
  // The zeros run last: the file must still reach its full size.
  const std::vector<ByteRun> zeros = {{&source_, 0, 4}, {nullptr, 0, 60}};
  std::vector<std::byte> zeros_expected(source_bytes_.begin(), source_bytes_.begin() + 4);
  zeros_expected.resize(64);

  SafetensorsWriter gathered;
  ASSERT_TRUE(gathered.AddFromRuns("t", DType::kFloat32, shape, runs).ok());
  ASSERT_TRUE(gathered.AddFromRuns("empty", DType::kBFloat16, {0, 3}, {}).ok());
  ASSERT_TRUE(gathered.AddFromRuns("z", DType::kUInt8, {64}, zeros).ok());
  ASSERT_TRUE(gathered.Write(Path("gathered.safetensors")).ok());
  SafetensorsWriter direct;
  ASSERT_TRUE(direct.AddFromMemory("t", DType::kFloat32, shape, expected).ok());
  ASSERT_TRUE(direct.AddFromMemory("empty", DType::kBFloat16, {0, 3}, {}).ok());
  ASSERT_TRUE(direct.AddFromMemory("z", DType::kUInt8, {64}, zeros_expected).ok());
  ASSERT_TRUE(direct.Write(Path("direct.safetensors")).ok());
  EXPECT_EQ(ReadAll(Path("gathered.safetensors")), ReadAll(Path("direct.safetensors")));

  SafetensorsWriter wrong;
  const Status size = wrong.AddFromRuns("t", DType::kFloat32, {3}, zeros);
  EXPECT_EQ(size.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(size.message(), HasSubstr("runs of 64 bytes given for a tensor of 12"));
}

TEST_F(ByteRunTest, TorchStorageFromRunsEqualsFromMemoryAndLoads) {
  const std::vector<std::byte> expected = Expected();
  const uint64_t numel = expected.size() / 4;
  const auto write = [&](const std::string& name, bool gathered) {
    pickle::Graph graph;
    TensorNodeSpec spec;
    spec.storage_key = "0";
    spec.storage_numel = numel;
    spec.shape = {numel};
    graph.set_root(graph.List({MakeTensorNode(graph, spec).value()}));
    TorchArchiveWriter::Options options;
    options.sync = false;
    options.archive_name = "archive";  // the same record names in both files
    TorchArchiveWriter writer = TorchArchiveWriter::Create(Path(name), options).value();
    const std::vector<ByteRun> runs = Runs();
    ASSERT_TRUE((gathered ? writer.AddStorageFromRuns("0", runs)
                          : writer.AddStorageFromMemory("0", expected))
                    .ok());
    ASSERT_TRUE(writer.Finish(graph.root()).ok());
  };
  write("gathered.pt", true);
  write("direct.pt", false);
  EXPECT_EQ(ReadAll(Path("direct.pt")), ReadAll(Path("gathered.pt")));

  // torch.load sees the gathered bytes; the comparison data is the pattern file, sliced in
  // Python by the same runs.
  std::string runs_py = "[";
  for (const ByteRun& run : Runs()) {
    runs_py += "(" + std::string(run.file ? "True" : "False") + "," + std::to_string(run.offset) +
               "," + std::to_string(run.length) + "),";
  }
  runs_py += "]";
  const std::string script = Path("check.py");
  std::ofstream(script) << "import sys, torch\n"
                        << "src = open(sys.argv[1], 'rb').read()\n"
                        << "want = b''.join(src[o:o + n] if f else bytes(n) for f, o, n in "
                        << runs_py << ")\n"
                        << "t = torch.load(sys.argv[2])[0]\n"
                        << "assert t.dtype == torch.float32 and t.numel() * 4 == len(want)\n"
                        << "assert t.numpy().tobytes() == want\n"
                        << "print('ok')\n";
  const std::string command =
      std::string(UCP_PYTHON) + " " + script + " " + Path("source.bin") + " " + Path("gathered.pt");
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char line[64] = {};
  const size_t n = std::fread(line, 1, sizeof(line) - 1, pipe);
  EXPECT_EQ(::pclose(pipe), 0) << command;
  EXPECT_EQ(std::string(line, n), "ok\n");
}

}  // namespace
}  // namespace ucp
