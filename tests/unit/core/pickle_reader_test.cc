#include "core/format/pickle_reader.h"

#include <gtest/gtest.h>

#include <string>

#include "core/format/pickle_writer.h"
#include "tests/unit/core/pickle_test_util.h"

namespace ucp::pickle {
namespace {

using ::ucp::pickle::testing::FilesEndingWith;
using ::ucp::pickle::testing::ReadFileBytes;

// CPython writes every case under protocols 0-5 (plus hand-assembled pickles) and renders each
// with its own unpickler running on stand-ins; ucp's rendering must be the same string.
class PickleCorpusTest : public ::ucp::pickle::testing::PickleCasesTest {
 protected:
  static Graph ReadCase(const std::string& name) {
    auto graph = ReadPickle(ReadFileBytes(cases_dir() / (name + ".pkl")));
    EXPECT_TRUE(graph.ok()) << graph.status().ToString();
    return graph.ok() ? std::move(graph).value() : Graph();
  }
};

TEST_F(PickleCorpusTest, EveryCaseRendersAsPythonSeesIt) {
  const auto files = FilesEndingWith(cases_dir(), ".pkl");
  ASSERT_GT(files.size(), 200u);
  for (const auto& path : files) {
    SCOPED_TRACE(path.filename().string());
    ReadOptions options;
    options.name = path.filename().string();
    auto graph = ReadPickle(ReadFileBytes(path), options);
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    auto rendered = Render(graph->root());
    ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
    EXPECT_EQ(*rendered, ReadFileBytes(path.string() + ".render"));
  }
}

TEST_F(PickleCorpusTest, MemoReferencesAreOneNode) {
  for (int protocol = 0; protocol <= 5; ++protocol) {
    SCOPED_TRACE(protocol);
    const std::string p = ".p" + std::to_string(protocol);
    Graph shared = ReadCase("shared" + p);
    // [shared, shared, {"k": shared}, shared_tuple, shared_tuple]
    const Value* root = shared.root();
    ASSERT_EQ(root->kind(), Kind::kList);
    EXPECT_EQ(root->Item(0), root->Item(1));
    EXPECT_EQ(root->Item(2)->Get("k"), root->Item(0));
    EXPECT_EQ(root->Item(3), root->Item(4));
    EXPECT_NE(root->Item(0), root->Item(3));

    Graph self_list = ReadCase("self_list" + p);
    EXPECT_EQ(self_list.root()->Item(0), self_list.root());
    Graph self_dict = ReadCase("self_dict" + p);
    EXPECT_EQ(self_dict.root()->Get("self"), self_dict.root());
    Graph tuple_cycle = ReadCase("tuple_cycle" + p);
    // t = ([t], "t")
    EXPECT_EQ(tuple_cycle.root()->Item(0)->Item(0), tuple_cycle.root());
  }
}

TEST_F(PickleCorpusTest, NavigatesTorchStyleStructures) {
  // {"w": storage, "v": storage, "other": Storage("1", 10)}, storages pickled as
  // persistent ids ("storage", pickle_classes.Point, key, "cpu", numel).
  Graph graph = ReadCase("persistent.p2");
  const Value* w = graph.root()->Get("w");
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(w->kind(), Kind::kPersistentId);
  const Value* pid = w->pid();
  ASSERT_EQ(pid->kind(), Kind::kTuple);
  EXPECT_EQ(pid->Item(0)->data(), "storage");
  EXPECT_TRUE(pid->Item(1)->IsGlobal("pickle_classes", "Point"));
  EXPECT_EQ(pid->Item(2)->data(), "0");
  EXPECT_EQ(pid->Item(4)->AsInt64(), 4);
  const Value* other = graph.root()->Get("other");
  EXPECT_EQ(other->pid()->Item(2)->data(), "1");
  // The class object is memoized once by CPython, so both pids name one Global node.
  EXPECT_EQ(other->pid()->Item(1), pid->Item(1));
  EXPECT_EQ(graph.root()->Get("missing"), nullptr);

  // OrderedDict([("w", 1), ("b", [2])]) with a _metadata attribute.
  Graph odict = ReadCase("ordered_dict.p2");
  const Value* root = odict.root();
  ASSERT_TRUE(root->IsCallOf("collections", "OrderedDict"));
  EXPECT_EQ(root->construction(), Construction::kReduce);
  EXPECT_EQ(root->Get("w")->AsInt64(), 1);
  EXPECT_EQ(root->Get("b")->Item(0)->AsInt64(), 2);
  ASSERT_NE(root->State(), nullptr);
  EXPECT_EQ(root->State()->Get("_metadata")->Get("")->Get("version")->AsInt64(), 1);

  // dataclass Point(3, 4.5, ["t"]): NEWOBJ + BUILD.
  Graph point = ReadCase("dataclass.p2");
  EXPECT_EQ(point.root()->construction(), Construction::kNewObj);
  EXPECT_TRUE(point.root()->IsCallOf("pickle_classes", "Point"));
  EXPECT_EQ(point.root()->State()->Get("y")->float_value(), 4.5);
}

TEST_F(PickleCorpusTest, EveryTruncationFailsCleanly) {
  for (const char* name :
       {"ordered_dict.p2", "dataclass.p0", "sets.p4", "reduce_all_parts.p5", "ints.p1",
        "raw_text_numbers", "raw_string", "raw_unicode_escape", "raw_inst", "bytearrays.p5"}) {
    SCOPED_TRACE(name);
    const std::string bytes = ReadFileBytes(cases_dir() / (std::string(name) + ".pkl"));
    ASSERT_TRUE(ReadPickle(bytes).ok());
    ReadOptions options;
    options.name = "sample";
    for (size_t n = 0; n < bytes.size(); ++n) {
      auto graph = ReadPickle(std::string_view(bytes).substr(0, n), options);
      ASSERT_FALSE(graph.ok()) << "prefix of " << n << " bytes";
      EXPECT_EQ(graph.status().code(), StatusCode::kCorrupt) << graph.status().ToString();
      EXPECT_EQ(graph.status().message().rfind("pickle: sample offset ", 0), 0u)
          << graph.status().ToString();
    }
  }
}

Status ReadStatus(std::string_view bytes, const ReadLimits& limits = {}) {
  ReadOptions options;
  options.limits = limits;
  return ReadPickle(bytes, options).status();
}

TEST(PickleReaderTest, ReportsOffsetAndOpcode) {
  EXPECT_EQ(ReadStatus(std::string_view("\x80\x02}u.", 5)).message(),
            "pickle: data.pkl offset 3: MARK stack underflow at SETITEMS");
  EXPECT_EQ(ReadStatus(std::string_view("\x80\x02\xff.", 4)).message(),
            "pickle: data.pkl offset 2: unknown opcode 0xff");
  EXPECT_EQ(ReadStatus(std::string_view("\x80\x02.", 3)).message(),
            "pickle: data.pkl offset 2: stack underflow at STOP");
  EXPECT_EQ(ReadStatus(std::string_view("\x80\x02h\x05.", 5)).message(),
            "pickle: data.pkl offset 2: memo key 5 missing at BINGET");
  EXPECT_EQ(ReadStatus(std::string_view("\x80\x02K\x01", 4)).message(),
            "pickle: data.pkl offset 4: truncated input: no STOP opcode");
}

TEST(PickleReaderTest, RejectsMalformedInput) {
  using namespace std::string_literals;
  struct Case {
    std::string bytes;
    StatusCode code;
    std::string what;
  };
  const Case cases[] = {
      {"K\x01"
       "a."s,
       StatusCode::kCorrupt, "stack underflow at APPEND"},
      {"K\x01(\x85."s, StatusCode::kCorrupt, "stack underflow at TUPLE1"},
      {"(K\x01"
       "b."s,
       StatusCode::kCorrupt, "stack underflow at BUILD"},
      {"}(K\x01u."s, StatusCode::kCorrupt, "odd number of items at SETITEMS"},
      {"(K\x01K\x02K\x03"
       "d."s,
       StatusCode::kCorrupt, "odd number of items at DICT"},
      {"]}b."s, StatusCode::kCorrupt, "target is list at BUILD"},
      {"K\x01K\x02"
       "a."s,
       StatusCode::kCorrupt, "target is int at APPEND"},
      {"N\x90."s, StatusCode::kCorrupt, "MARK stack underflow at ADDITEMS"},
      {"(e."s, StatusCode::kCorrupt, "stack underflow at APPENDS"},
      {"NQK\x01"
       "a."s,
       StatusCode::kUnsupported, "target is persistent_id at APPEND"},
      {"cm\nf\n]R."s, StatusCode::kCorrupt, "argument list is a list, not a tuple at REDUCE"},
      {"K\x01K\x02\x93."s, StatusCode::kCorrupt, "module and name must be strs at STACK_GLOBAL"},
      {"(o."s, StatusCode::kCorrupt, "no class in the marked items at OBJ"},
      {"X\x01\x00\x00\x00\xff."s, StatusCode::kCorrupt, "invalid UTF-8 at BINUNICODE"},
      {"U\x03\xed\xa0\x80."s, StatusCode::kCorrupt, "invalid UTF-8 at SHORT_BINSTRING"},
      {"I0x10\n."s, StatusCode::kCorrupt, "malformed integer text at INT"},
      {"Fabc\n."s, StatusCode::kCorrupt, "malformed float text at FLOAT"},
      {"S'abc\n."s, StatusCode::kCorrupt, "the STRING argument must be quoted at STRING"},
      {"Vbad\\u12\n."s, StatusCode::kCorrupt, "malformed \\u escape at UNICODE"},
      {"\x82\x00."s, StatusCode::kCorrupt, "extension code 0 <= 0 at EXT1"},
      {"\x80\x06N."s, StatusCode::kUnsupported, "protocol 6 at PROTO"},
      {"\x97."s, StatusCode::kUnsupported, "out-of-band buffers are not supported at NEXT_BUFFER"},
      {"\x8b\xff\xff\xff\xff."s, StatusCode::kCorrupt, "negative length at LONG4"},
      {"T\xfe\xff\xff\xff."s, StatusCode::kCorrupt, "negative length at BINSTRING"},
      {"B\xff\xff\xff\xff"
       "ab."s,
       StatusCode::kCorrupt, "truncated input: length 4294967295 with 3 bytes left at BINBYTES"},
      {"\x8d\x00\x00\x00\x00\x00\x00\x00\x80."s, StatusCode::kOutOfRange,
       "length 9223372036854775808 over the limit of 4294967296 at BINUNICODE8"},
      {"\x95\xff\x00\x00\x00\x00\x00\x00\x00N."s, StatusCode::kCorrupt,
       "truncated input: frame past the end at FRAME"},
      {"p-1\n."s, StatusCode::kCorrupt, "malformed memo index at PUT"},
      {"Pcaf\xc3\xa9\n."s, StatusCode::kCorrupt, "persistent id is not ASCII at PERSID"},
      {"I" + std::string(4301, '7') + "\n.", StatusCode::kCorrupt, "malformed integer text at INT"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Status status = ReadStatus(c.bytes);
    EXPECT_EQ(status.code(), c.code) << status.ToString();
    const std::string& message = status.message();
    EXPECT_TRUE(message.size() >= c.what.size() &&
                message.compare(message.size() - c.what.size(), c.what.size(), c.what) == 0)
        << message;
  }
}

TEST(PickleReaderTest, EnforcesLimits) {
  // Nested lists 1100 deep, built bottom-up: pushes 1100 lists, appends each into the next.
  std::string deep = std::string(1100, ']') + std::string(1099, 'a') + ".";
  Status status = ReadStatus(deep);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange) << status.ToString();
  EXPECT_NE(status.message().find("nesting deeper than 1000 at APPEND"), std::string::npos);

  ReadLimits limits;
  limits.max_nodes = 10;
  std::string many = "(" + std::string(20, 'N') + "l.";
  EXPECT_EQ(ReadStatus(many, limits).code(), StatusCode::kOutOfRange);
  limits = {};
  limits.max_stack = 5;
  EXPECT_EQ(ReadStatus(many, limits).code(), StatusCode::kOutOfRange);
  limits = {};
  limits.max_marks = 3;
  EXPECT_EQ(ReadStatus("((((N.", limits).code(), StatusCode::kOutOfRange);
  limits = {};
  limits.max_memo = 2;
  EXPECT_EQ(ReadStatus(std::string_view("Nq\x00q\x01q\x02.", 8), limits).code(),
            StatusCode::kOutOfRange);
  limits = {};
  limits.max_payload = 3;
  EXPECT_EQ(ReadStatus("\x8c\x04"
                       "abcd.",
                       limits)
                .code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(ReadPickle("\x8c\x03"
                         "abc.")
                  .ok());
}

TEST(PickleReaderTest, DeepChainsThroughTheMemoStopAtTheWalkers) {
  // Each step appends a fresh list into the previous one after the previous one was itself
  // appended, so only a walk sees the full depth: L0 = [L1], L1 = [L2], ... 5000 deep.
  std::string bytes = std::string("]q\x00", 3);
  for (int i = 0; i < 5000; ++i)
    bytes += std::string(
        "h\x00]q\x00"
        "a0",
        7);
  bytes += ".";
  auto graph = ReadPickle(bytes);
  ASSERT_TRUE(graph.ok()) << graph.status().ToString();
  EXPECT_EQ(Render(graph->root()).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(WritePickle(graph->root()).status().code(), StatusCode::kOutOfRange);
  size_t reachable = 0;
  ASSERT_TRUE(ForEachReachable(graph->root(), [&](Value*) {
                ++reachable;
                return Status::Ok();
              }).ok());
  EXPECT_EQ(reachable, 5001u);
}

TEST(PickleReaderTest, AcceptsFarOffMemoIndices) {
  // LONG_BINPUT/LONG_BINGET 0xfffffff0, then MEMOIZE, which numbers by count (Python's
  // len(memo)) and so takes index 2 after two entries.
  auto graph = ReadPickle(
      std::string_view("Nr\xf0\xff\xff\xffj\xf0\xff\xff\xffq\x00K\x07\x94h\x02\x87.", 21));
  ASSERT_TRUE(graph.ok()) << graph.status().ToString();
  // pickle._loads (the pure-Python unpickler) gives (None, 7, 7).
  EXPECT_EQ(Render(graph->root()).value(), "(None, 7, 7)");
}

TEST(PickleReaderTest, IgnoresBytesAfterStop) {
  auto graph = ReadPickle(std::string_view("K\x07.garbage", 10));
  ASSERT_TRUE(graph.ok());
  EXPECT_EQ(graph->root()->AsInt64(), 7);
}

}  // namespace
}  // namespace ucp::pickle
