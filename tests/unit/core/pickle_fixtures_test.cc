// The data.pkl of every torch.save'd file among the DeepSpeed fixtures: ucp reads it as
// CPython's unpickler on stand-ins sees it, and writes it back byte for byte (torch.save uses
// CPython's protocol 2 pickler).
#include <gtest/gtest.h>

#include <string>

#include "core/format/pickle_reader.h"
#include "core/format/pickle_writer.h"
#include "tests/unit/core/pickle_test_util.h"

namespace ucp::pickle {
namespace {

using ::ucp::pickle::testing::FilesEndingWith;
using ::ucp::pickle::testing::FreshDir;
using ::ucp::pickle::testing::ReadFileBytes;
using ::ucp::pickle::testing::RunPython;
using ::ucp::pickle::testing::WriteFileBytes;

TEST(PickleFixturesTest, EveryDeepSpeedDataPklReadsAndRoundTrips) {
  const std::string fixtures = std::string(UCP_SHARED_DIR) + "/fixtures/deepspeed";
  if (!std::filesystem::exists(fixtures)) GTEST_SKIP() << fixtures << " is absent";
  const auto dir = FreshDir("fixtures");
  std::string output;
  ASSERT_EQ(RunPython("extract_fixtures.py", fixtures + " " + dir.string(), &output), 0) << output;
  const auto files = FilesEndingWith(dir, ".pkl");
  ASSERT_GT(files.size(), 100u);
  size_t byte_exact = 0;
  for (const auto& path : files) {
    const std::string source = ReadFileBytes(path.string() + ".source");
    SCOPED_TRACE(source);
    const std::string original = ReadFileBytes(path);
    ReadOptions options;
    options.name = source;
    auto graph = ReadPickle(original, options);
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    auto rendered = Render(graph->root());
    ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
    EXPECT_EQ(*rendered, ReadFileBytes(path.string() + ".render"));
    auto rewritten = WritePickle(graph->root());
    ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
    byte_exact += *rewritten == original;
    EXPECT_EQ(*rewritten, original);
    WriteFileBytes(path.string() + ".out", *rewritten);
  }
  EXPECT_EQ(byte_exact, files.size());
  output.clear();
  EXPECT_EQ(RunPython("check_roundtrip.py", dir.string(), &output), 0) << output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ucp::pickle
