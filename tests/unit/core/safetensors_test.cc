// Tests core/format/safetensors_{reader,writer}.cc against an independent Python implementation
// (safetensors_tool.py: json + numpy) in both directions, and against malformed headers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/format/safetensors_reader.h"
#include "core/format/safetensors_writer.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

const std::string kTool = std::string(UCP_SOURCE_DIR) + "/tests/unit/core/safetensors_tool.py";

std::string RunTool(const std::string& mode, const std::string& path) {
  const std::string command = std::string(UCP_PYTHON) + " " + kTool + " " + mode + " " + path;
  FILE* pipe = ::popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  EXPECT_EQ(::pclose(pipe), 0) << command;
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  }
  return out;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ucp_safetensors_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A file made of `header` (padded to nothing) and `data`, with a correct length prefix.
  std::string WithHeader(const std::string& name, const std::string& header,
                         const std::string& data) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header.size() >> (8 * i));
    WriteFile(Path(name), bytes + header + data);
    return Path(name);
  }

  std::filesystem::path dir_;
};

TEST_F(SafetensorsTest, ReadsWhatPythonWrites) {
  const Json expected = Json::parse(RunTool("write", Path("py.safetensors")));
  Result<SafetensorsHeader> header = SafetensorsHeader::Read(Path("py.safetensors"));
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  const std::string file = ReadFile(Path("py.safetensors"));
  ASSERT_EQ(header->tensors().size(), expected["tensors"].size());
  for (const auto& [name, want] : expected["tensors"].items()) {
    const SafetensorsTensor* tensor = header->Find(name);
    ASSERT_NE(tensor, nullptr) << name;
    EXPECT_EQ(SafetensorsName(tensor->dtype).value(), want["dtype"].get<std::string>()) << name;
    EXPECT_EQ(tensor->shape, want["shape"].get<std::vector<uint64_t>>()) << name;
    EXPECT_EQ(tensor->offset, want["offset"].get<uint64_t>()) << name;
    EXPECT_EQ(tensor->size, want["size"].get<uint64_t>()) << name;
    EXPECT_EQ(Hex(std::string_view(file).substr(tensor->offset, tensor->size)),
              want["hex"].get<std::string>())
        << name;
  }
  EXPECT_EQ(header->metadata(), (expected["metadata"].get<std::map<std::string, std::string>>()));
  EXPECT_EQ(header->Find("missing"), nullptr);
}

TEST_F(SafetensorsTest, PythonReadsWhatTheWriterWritesFromMemoryAndFileRanges) {
  // Tensors taken from the Python-written file, alternately from memory and by file range.
  const Json source = Json::parse(RunTool("write", Path("src.safetensors")));
  Result<SafetensorsHeader> original = SafetensorsHeader::Read(Path("src.safetensors"));
  ASSERT_TRUE(original.ok()) << original.status().ToString();
  std::vector<std::string> held;
  held.reserve(original->tensors().size());
  SafetensorsWriter writer;
  bool from_memory = true;
  for (const SafetensorsTensor& tensor : original->tensors()) {
    const std::string renamed = "copy/" + tensor.name;
    if (from_memory) {
      held.push_back(Unhex(source["tensors"][tensor.name]["hex"].get<std::string>()));
      ASSERT_TRUE(writer
                      .AddFromMemory(renamed, tensor.dtype, tensor.shape,
                                     std::as_bytes(std::span(held.back())))
                      .ok());
    } else {
      ASSERT_TRUE(writer
                      .AddFromFile(renamed, tensor.dtype, tensor.shape, Path("src.safetensors"),
                                   tensor.offset)
                      .ok());
    }
    from_memory = !from_memory;
  }
  ASSERT_TRUE(writer.SetMetadata("format", "pt").ok());
  const Status written = writer.Write(Path("out.safetensors"));
  ASSERT_TRUE(written.ok()) << written.ToString();

  const Json got = Json::parse(RunTool("read", Path("out.safetensors")));
  EXPECT_EQ(got["metadata"], Json({{"format", "pt"}}));
  ASSERT_EQ(got["tensors"].size(), source["tensors"].size());
  for (const auto& [name, want] : source["tensors"].items()) {
    const Json& have = got["tensors"]["copy/" + name];
    EXPECT_EQ(have["dtype"], want["dtype"]) << name;
    EXPECT_EQ(have["shape"], want["shape"]) << name;
    EXPECT_EQ(have["hex"], want["hex"]) << name;
  }
  // The byte buffer starts 8-aligned and no temporary file is left behind.
  Result<SafetensorsHeader> reread = SafetensorsHeader::Read(Path("out.safetensors"));
  ASSERT_TRUE(reread.ok()) << reread.status().ToString();
  EXPECT_EQ(reread->data_start() % 8, 0u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 2);
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  SafetensorsWriter writer;
  const std::string four(4, 'x');
  const auto bytes = std::as_bytes(std::span(four));
  EXPECT_TRUE(writer.AddFromMemory("a", DType::kFloat32, {1}, bytes).ok());
  EXPECT_THAT(writer.AddFromMemory("a", DType::kFloat32, {1}, bytes).message(),
              HasSubstr("added twice"));
  EXPECT_EQ(writer.AddFromMemory("b", DType::kFloat32, {2}, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.AddFromMemory("__metadata__", DType::kFloat32, {1}, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.AddFromMemory("\xff", DType::kFloat32, {1}, bytes).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.AddFromMemory("c", DType::kComplex128, {}, bytes).code(),
            StatusCode::kUnsupported);
  EXPECT_EQ(writer.AddFromMemory("d", DType::kFloat64, {1ull << 62, 4}, bytes).code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(writer.AddFromFile("e", DType::kFloat32, {4}, Path("nowhere"), 0).ok());
  const Status missing_source = writer.Write(Path("x.safetensors"));
  EXPECT_EQ(missing_source.code(), StatusCode::kNotFound) << missing_source.ToString();
  EXPECT_FALSE(std::filesystem::exists(Path("x.safetensors")));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 0);
}

TEST_F(SafetensorsTest, RejectsMalformedFiles) {
  const std::string four(4, 'x');
  struct Case {
    std::string header;
    std::string data;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"[]", "", "does not begin with '{'"},
      {" {}", "", "does not begin with '{'"},
      {"{\"a\":", "", "not valid JSON"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       four, "duplicate key \"a\""},
      {R"({"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", four, "unsupported dtype"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four, "non-integer"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", four, "do not hold 8 bytes"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", four, "do not hold"},
      {R"({"a":{"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", four,
       "overflows"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", four, "unknown field"},
      {R"({"a":{"dtype":"F32","shape":[1]}})", four, "data_offsets"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", four, "hole"},
      {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
       four, "overlaps"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", four, "not indexed"},
      {R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", four, "past the end"},
      {R"({"__metadata__":{"k":1}})", "", "not a string"},
      {R"({"a":3})", "", "not an object"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = WithHeader("bad" + std::to_string(i), cases[i].header, cases[i].data);
    Result<SafetensorsHeader> header = SafetensorsHeader::Read(path);
    ASSERT_FALSE(header.ok()) << cases[i].header;
    EXPECT_EQ(header.status().code(), StatusCode::kCorrupt) << cases[i].header;
    EXPECT_THAT(header.status().message(), HasSubstr(cases[i].message)) << cases[i].header;
    EXPECT_THAT(header.status().message(), HasSubstr(path));
  }
  // Length prefixes that are too large or run past the file.
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32 bytes
  WriteFile(Path("huge"), huge + "{}");
  EXPECT_THAT(SafetensorsHeader::Read(Path("huge")).status().message(), HasSubstr("exceeds"));
  WriteFile(Path("long"), std::string("\x10\0\0\0\0\0\0\0", 8) + "{}");
  EXPECT_THAT(SafetensorsHeader::Read(Path("long")).status().message(), HasSubstr("past the end"));
  WriteFile(Path("short"), "abc");
  EXPECT_THAT(SafetensorsHeader::Read(Path("short")).status().message(), HasSubstr("shorter"));
  EXPECT_EQ(SafetensorsHeader::Read(Path("absent")).status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, AcceptsEmptyTensorsAtAnyOffsetAndSpacePadding) {
  const std::string header =
      R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"z":{"dtype":"I64","shape":[0,2],"data_offsets":[0,0]}})"
      "   ";
  Result<SafetensorsHeader> parsed = SafetensorsHeader::Read(WithHeader("ok", header, "abcd"));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->tensors().size(), 3u);
  EXPECT_EQ(parsed->Find("a")->offset, 8 + header.size());
  EXPECT_EQ(parsed->Find("e")->size, 0u);
}

TEST_F(SafetensorsTest, ShardedCheckpointThroughItsIndex) {
  const std::string four(4, 'x');
  const auto bytes = std::as_bytes(std::span(four));
  SafetensorsIndex index;
  for (uint32_t shard = 1; shard <= 2; ++shard) {
    SafetensorsWriter writer;
    const std::string name = "layer" + std::to_string(shard) + ".weight";
    ASSERT_TRUE(writer.AddFromMemory(name, DType::kFloat32, {1}, bytes).ok());
    const std::string file = SafetensorsShardName("model", shard, 2);
    ASSERT_TRUE(writer.Write(Path(file)).ok());
    index.weight_map[name] = file;
  }
  EXPECT_EQ(SafetensorsShardName("model", 1, 4), "model-00001-of-00004.safetensors");
  index.total_size = 8;
  index.metadata["format"] = "\"pt\"";
  ASSERT_TRUE(WriteSafetensorsIndex(Path("model.safetensors.index.json"), index).ok());

  Result<SafetensorsShardedReader> reader =
      SafetensorsShardedReader::Open(Path("model.safetensors.index.json"));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  Result<SafetensorsShardedReader::Located> found = reader->Find("layer2.weight");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(*found->file, Path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(found->tensor->size, 4u);
  EXPECT_EQ(reader->index().metadata.at("format"), "\"pt\"");
  EXPECT_EQ(reader->Find("layer3.weight").status().code(), StatusCode::kNotFound);

  index.total_size = 9;
  ASSERT_TRUE(WriteSafetensorsIndex(Path("bad_total.json"), index).ok());
  EXPECT_THAT(SafetensorsShardedReader::Open(Path("bad_total.json")).status().message(),
              HasSubstr("total_size 9"));
  index.total_size.reset();
  index.weight_map["layer2.weight"] = SafetensorsShardName("model", 1, 2);
  ASSERT_TRUE(WriteSafetensorsIndex(Path("missing.json"), index).ok());
  EXPECT_THAT(SafetensorsShardedReader::Open(Path("missing.json")).status().message(),
              HasSubstr("\"layer2.weight\" is not in model-00001-of-00002.safetensors"));
  index.weight_map["ghost"] = SafetensorsShardName("model", 2, 2);
  ASSERT_TRUE(WriteSafetensorsIndex(Path("unmapped.json"), index).ok());
  EXPECT_THAT(SafetensorsShardedReader::Open(Path("unmapped.json")).status().message(),
              HasSubstr("\"layer2.weight\" of model-00002-of-00002.safetensors is not mapped"));
  WriteFile(Path("escape.json"), R"({"weight_map":{"a":"../x.safetensors"}})");
  EXPECT_THAT(SafetensorsShardedReader::Open(Path("escape.json")).status().message(),
              HasSubstr("not a file name"));
}

}  // namespace
}  // namespace ucp
