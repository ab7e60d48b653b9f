#include "core/format/pickle_writer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/format/pickle_reader.h"
#include "tests/unit/core/pickle_test_util.h"

namespace ucp::pickle {
namespace {

using ::ucp::pickle::testing::FilesEndingWith;
using ::ucp::pickle::testing::FreshDir;
using ::ucp::pickle::testing::ReadFileBytes;
using ::ucp::pickle::testing::RunPython;
using ::ucp::pickle::testing::WriteFileBytes;

using PickleWriterCorpusTest = ::ucp::pickle::testing::PickleCasesTest;

Result<std::string> Rewrite(const std::string& bytes) {
  UCP_ASSIGN_OR_RETURN(Graph graph, ReadPickle(bytes));
  return WritePickle(graph.root());
}

// What CPython's protocol 2 pickler wrote, ucp reads and writes back byte for byte.
TEST_F(PickleWriterCorpusTest, ProtocolTwoRoundTripIsByteExact) {
  const auto files = FilesEndingWith(cases_dir(), ".p2.pkl");
  ASSERT_GT(files.size(), 30u);
  for (const auto& path : files) {
    SCOPED_TRACE(path.filename().string());
    const std::string original = ReadFileBytes(path);
    auto rewritten = Rewrite(original);
    ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
    if (*rewritten != original) {
      size_t at = 0;
      while (at < original.size() && at < rewritten->size() && original[at] == (*rewritten)[at]) {
        ++at;
      }
      ADD_FAILURE() << "first difference at byte " << at << " of " << original.size();
    }
  }
}

// Every case, from every protocol, rewritten as protocol 2, loads in CPython to the same
// values with the same sharing: under stand-ins, and with the real classes.
TEST_F(PickleWriterCorpusTest, EveryCaseRoundTripsThroughPython) {
  const auto files = FilesEndingWith(cases_dir(), ".pkl");
  for (const auto& path : files) {
    SCOPED_TRACE(path.filename().string());
    auto rewritten = Rewrite(ReadFileBytes(path));
    ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
    ASSERT_EQ(rewritten->substr(0, 2), std::string("\x80\x02"));
    WriteFileBytes(path.string() + ".out", *rewritten);
  }
  std::string output;
  EXPECT_EQ(RunPython("check_roundtrip.py", "--real " + cases_dir().string(), &output), 0)
      << output;
  EXPECT_NE(output.find("checked " + std::to_string(files.size()) + ", 0 mismatches"),
            std::string::npos)
      << output;
}

// A graph built from scratch, the way the archive layer builds a state dict: the Python
// stand-in walker must see what Render describes.
TEST(PickleWriterTest, WritesGraphsBuiltInCpp) {
  Graph g;
  Value* rebuild = g.Global("torch._utils", "_rebuild_tensor_v2");
  Value* storage_type = g.Global("torch", "FloatStorage");
  Value* cpu = g.Str("cpu");
  Value* state =
      g.Object(Construction::kReduce, g.Global("collections", "OrderedDict"), g.Tuple({}));
  for (int i = 0; i < 3; ++i) {
    Value* pid = g.PersistentId(g.Tuple({g.Str("storage"), storage_type, g.Str(std::to_string(i)),
                                         cpu, g.Int(int64_t{1} << (10 + i))}));
    Value* tensor =
        g.Object(Construction::kReduce, rebuild,
                 g.Tuple({pid, g.Int(0), g.Tuple({g.Int(4), g.Int(256 << i)}),
                          g.Tuple({g.Int(256 << i), g.Int(1)}), g.Bool(false),
                          g.Object(Construction::kReduce, g.Global("collections", "OrderedDict"),
                                   g.Tuple({}))}));
    state->mutable_mutations().push_back(
        {Mutation::Op::kSetItem, g.Str("layer" + std::to_string(i) + ".weight"), tensor});
  }
  Value* shared =
      g.List({g.Float(std::nan("")), g.Float(-0.0), g.IntFromBytes(std::string(40, '\xff'))});
  Value* root = g.Dict({{g.Str("module"), state},
                        {g.Str("a"), shared},
                        {g.Str("b"), shared},
                        {g.Str("bytes"), g.Bytes(std::string("\x00\xff", 2))},
                        {g.Str("set"), g.Set({g.Int(1), g.Str("x")})},
                        {g.Str("big"), g.IntFromBytes(std::string(300, '\x7f'))}});
  shared->mutable_items().push_back(shared);
  auto bytes = WritePickle(root);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto expected = Render(root);
  ASSERT_TRUE(expected.ok());

  // Protocol 2 spells bytes and sets as reductions of builtins; with those resolved, Python
  // sees exactly the graph.
  const auto dir = FreshDir("writer_scratch");
  const std::string file = (dir / "scratch.pkl").string();
  WriteFileBytes(file, *bytes);
  std::string resolved;
  ASSERT_EQ(RunPython("pickle_walk.py", "--resolve-builtins " + file, &resolved), 0) << resolved;
  EXPECT_EQ(resolved, *expected + "\n");

  // ucp reads back what Python sees literally, and writes the same bytes again.
  std::string literal;
  ASSERT_EQ(RunPython("pickle_walk.py", file, &literal), 0) << literal;
  auto again = ReadPickle(*bytes);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(Render(again->root()).value() + "\n", literal);
  EXPECT_EQ(WritePickle(again->root()).value(), *bytes);
  EXPECT_EQ(again->root()->Get("a"), again->root()->Get("b"));
  std::filesystem::remove_all(dir);
}

TEST(PickleWriterTest, PlainDataLoadsWithPythonsOwnUnpickler) {
  Graph g;
  Value* inner = g.List({g.Int(1)});
  Value* root = g.Dict({{g.Str("a"), inner},
                        {g.Str("b"), inner},
                        {g.Str("f"), g.Float(std::numeric_limits<double>::infinity())},
                        {g.Str("t"), g.Tuple({g.None(), g.Bool(true), g.Str("caf\xc3\xa9")})},
                        {g.Str("ba"), g.ByteArray("xyz")},
                        {g.Str("fs"), g.FrozenSet({g.Int(-5)})},
                        {g.Str("n"), g.Int(-(int64_t{1} << 40))}});
  auto bytes = WritePickle(root);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  const auto dir = FreshDir("writer_plain");
  WriteFileBytes(dir / "plain.pkl", *bytes);
  WriteFileBytes(dir / "check.py",
                 "import math, pickle, sys\n"
                 "d = pickle.load(open(sys.argv[1], 'rb'))\n"
                 "assert d['a'] is d['b'] and d['a'] == [1], d\n"
                 "assert math.isinf(d['f']) and d['f'] > 0\n"
                 "assert d['t'] == (None, True, 'caf\\u00e9')\n"
                 "assert d['ba'] == bytearray(b'xyz') and type(d['ba']) is bytearray\n"
                 "assert d['fs'] == frozenset({-5}) and d['n'] == -2**40\n"
                 "assert list(d) == ['a', 'b', 'f', 't', 'ba', 'fs', 'n']\n"
                 "print('ok')\n");
  const std::string command = std::string(UCP_PYTHON) + " " + (dir / "check.py").string() + " " +
                              (dir / "plain.pkl").string() + " >" + (dir / "log").string() +
                              " 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << ReadFileBytes(dir / "log");
  std::filesystem::remove_all(dir);
}

TEST(PickleWriterTest, RejectsWhatProtocolTwoCannotSay) {
  Graph g;
  EXPECT_EQ(WritePickle(nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WritePickle(g.Str("\xff")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WritePickle(g.Global("a\nb", "c")).status().code(), StatusCode::kInvalidArgument);
  // A tuple containing itself with no mutable container in between cannot be built by any
  // pickle, so it cannot be written either.
  Value* tuple = g.Tuple({g.Int(1)});
  tuple->mutable_items().push_back(tuple);
  EXPECT_EQ(WritePickle(tuple).status().code(), StatusCode::kInvalidArgument);
  // Through a list it can: CPython writes the tuple inside, then POPs and fetches it.
  Value* list = g.List({});
  Value* tuple2 = g.Tuple({list});
  list->mutable_items().push_back(tuple2);
  auto bytes = WritePickle(tuple2);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto back = ReadPickle(*bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->root()->Item(0)->Item(0), back->root());

  // A set holding itself through a list (a fuzzer find: ADDITEMS of a list that holds the set)
  // would be written twice over, the set being memoized only after its items; Python's sets hold
  // only hashable values, so it is refused.
  Value* set = g.Set({g.Int(1)});
  set->mutable_items().push_back(g.List({set}));
  EXPECT_NE(WritePickle(set).status().message().find("a set contains itself"), std::string::npos);

  // A nested name becomes one getattr reduction per dot, two levels each once read back (a
  // fuzzer find: the write used to succeed and the read-back graph not to write again).
  EXPECT_EQ(WritePickle(g.Global("m", std::string(600, '.'))).status().code(),
            StatusCode::kOutOfRange);
  auto dotted = WritePickle(g.Global("m", std::string(400, '.')));
  ASSERT_TRUE(dotted.ok()) << dotted.status().ToString();
  auto dotted_back = ReadPickle(*dotted);
  ASSERT_TRUE(dotted_back.ok()) << dotted_back.status().ToString();
  EXPECT_EQ(WritePickle(dotted_back->root()).value(), *dotted);

  Value* deep = g.List({});
  for (uint32_t i = 0; i < kMaxDepth + 5; ++i) deep = g.List({deep});
  EXPECT_EQ(WritePickle(deep).status().code(), StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace ucp::pickle
