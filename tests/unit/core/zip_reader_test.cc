#include "core/format/zip_reader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/unit/core/zip_test_support.h"

namespace ucp {
namespace {

using testing::Describe;
using testing::Fixtures;
using testing::OracleRecord;
using testing::ReadAll;
using testing::ScratchDir;
using testing::WriteAll;

uint32_t Get32(const std::string& b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}
void Set32(std::string& b, size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); }
void Set16(std::string& b, size_t at, uint16_t v) { std::memcpy(b.data() + at, &v, 2); }

// Offset of the first central directory header ("PK\1\2") in `bytes`.
size_t FirstCentralHeader(const std::string& bytes) {
  return bytes.find(std::string("PK\x01\x02", 4));
}
size_t Eocd(const std::string& bytes) { return bytes.rfind(std::string("PK\x05\x06", 4)); }

void ExpectMatchesOracle(const std::string& path, const std::vector<OracleRecord>& oracle) {
  SCOPED_TRACE(path);
  auto reader = ZipReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  ASSERT_EQ(reader->records().size(), oracle.size());
  for (size_t i = 0; i < oracle.size(); ++i) {
    const ZipRecord& r = reader->records()[i];
    EXPECT_EQ(r.name, oracle[i].name);
    EXPECT_EQ(r.header_offset, oracle[i].header_offset) << r.name;
    EXPECT_EQ(r.data_offset, oracle[i].data_offset) << r.name;
    EXPECT_EQ(r.size, oracle[i].size) << r.name;
    EXPECT_EQ(r.crc32, oracle[i].crc32) << r.name;
    EXPECT_EQ(r.method, oracle[i].method) << r.name;
    EXPECT_TRUE(reader->VerifyCrc(r).ok()) << r.name;
  }
}

void ExpectMatchesOracle(const std::string& path) { ExpectMatchesOracle(path, Describe(path)); }

class ZipReaderTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(Fixtures::Get().error(), "") << Fixtures::Get().error(); }
  static std::string Fixture(const std::string& name) { return Fixtures::Get() / name; }
};

TEST_F(ZipReaderTest, TorchFilesMatchPythonZipfile) {
  for (const std::string& name : Fixtures::TorchFiles()) ExpectMatchesOracle(Fixture(name));
}

TEST_F(ZipReaderTest, PythonZipfileArchivesMatch) {
  ExpectMatchesOracle(Fixture("pystored.zip"));
  ExpectMatchesOracle(Fixture("pyzip64.zip"));
}

TEST_F(ZipReaderTest, EveryDeepSpeedFixtureMatches) {
  const std::filesystem::path root = std::filesystem::path(UCP_SHARED_DIR) / "fixtures/deepspeed";
  if (!std::filesystem::exists(root)) GTEST_SKIP() << "no fixtures at " << root;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (entry.path().extension() == ".pt") files.push_back(entry.path().string());
  }
  ASSERT_FALSE(files.empty());
  std::map<std::string, std::vector<OracleRecord>> by_file;
  for (OracleRecord& r : testing::DescribeAll(files)) by_file[r.file].push_back(std::move(r));
  for (const std::string& file : files) ExpectMatchesOracle(file, by_file[file]);
}

TEST_F(ZipReaderTest, TorchLayoutFacts) {
  auto reader = ZipReader::Open(Fixture("small.pt"));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->archive_name(), "small");  // torch 1.x: the file's stem
  EXPECT_TRUE(reader->zip64());                // miniz always writes the ZIP64 end records
  EXPECT_EQ(reader->records().front().name, "small/data.pkl");
  EXPECT_EQ(reader->records().back().name, "small/version");
  for (const ZipRecord& r : reader->records()) EXPECT_EQ(r.data_offset % 64, 0u) << r.name;

  const ZipRecord* version = reader->Find("version");
  ASSERT_NE(version, nullptr);
  EXPECT_EQ(reader->Find("small/version"), version);
  auto text = reader->ReadRecord(*version);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "3\n");
  auto pkl = reader->Get("data.pkl");
  ASSERT_TRUE(pkl.ok());
  auto head = reader->ReadRecord(**pkl);
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->substr(0, 2), "\x80\x02");  // pickle protocol 2

  EXPECT_EQ(reader->Find("nope"), nullptr);
  EXPECT_EQ(reader->Get("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(reader->ReadRecord(**pkl, 10).status().code(), StatusCode::kOutOfRange);
}

TEST_F(ZipReaderTest, CompressedRecordIsUnsupported) {
  auto reader = ZipReader::Open(Fixture("deflated.zip"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kUnsupported) << reader.status().ToString();
  EXPECT_NE(reader.status().message().find("deflated/data.pkl"), std::string::npos);
  EXPECT_NE(reader.status().message().find("method 8"), std::string::npos);
}

TEST_F(ZipReaderTest, MissingFileIsNotFound) {
  EXPECT_EQ(ZipReader::Open(Fixture("absent.pt")).status().code(), StatusCode::kNotFound);
}

TEST_F(ZipReaderTest, EveryTruncationIsCorrupt) {
  const std::string bytes = ReadAll(Fixture("small.pt"));
  ScratchDir dir;
  const std::string path = dir / "cut.pt";
  for (size_t n = 0; n < bytes.size(); ++n) {
    WriteAll(path, bytes.substr(0, n));
    auto reader = ZipReader::Open(path);
    ASSERT_FALSE(reader.ok()) << "truncated at " << n;
    EXPECT_EQ(reader.status().code(), StatusCode::kCorrupt)
        << n << ": " << reader.status().ToString();
    EXPECT_NE(reader.status().message().find(path), std::string::npos);
  }
}

class MutatedZipTest : public ZipReaderTest {
 protected:
  void SetUp() override {
    ZipReaderTest::SetUp();
    bytes_ = ReadAll(Fixture("small.pt"));
    cd_ = FirstCentralHeader(bytes_);
    eocd_ = Eocd(bytes_);
    ASSERT_NE(cd_, std::string::npos);
    ASSERT_NE(eocd_, std::string::npos);
  }
  Status OpenMutated() {
    const std::string path = dir_ / "mutated.pt";
    WriteAll(path, bytes_);
    return ZipReader::Open(path).status();
  }
  ScratchDir dir_;
  std::string bytes_;
  size_t cd_ = 0;
  size_t eocd_ = 0;
};

TEST_F(MutatedZipTest, BadEndRecordSignatureIsCorrupt) {
  bytes_[eocd_] = 'X';
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("end of central directory"), std::string::npos) << st.message();
}

TEST_F(MutatedZipTest, EndRecordDisagreeingWithZip64RecordIsCorrupt) {
  Set32(bytes_, eocd_ + 16, Get32(bytes_, eocd_ + 16) + 1);  // central directory offset
  EXPECT_EQ(OpenMutated().code(), StatusCode::kCorrupt);
}

TEST_F(MutatedZipTest, CentralDirectoryBeyondFileIsCorrupt) {
  const size_t zip64 = bytes_.rfind(std::string("PK\x06\x06", 4));
  ASSERT_NE(zip64, std::string::npos);
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes_.data() + zip64 + 48, &huge, 8);
  Set32(bytes_, eocd_ + 16, 0xFFFFFFFF);
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
}

TEST_F(MutatedZipTest, TooManyEntriesForTheDirectoryIsCorrupt) {
  const size_t zip64 = bytes_.rfind(std::string("PK\x06\x06", 4));
  const uint64_t many = 1000;
  std::memcpy(bytes_.data() + zip64 + 24, &many, 8);
  std::memcpy(bytes_.data() + zip64 + 32, &many, 8);
  Set16(bytes_, eocd_ + 8, 0xFFFF);
  Set16(bytes_, eocd_ + 10, 0xFFFF);
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
}

TEST_F(MutatedZipTest, RecordLimitIsOutOfRange) {
  const std::string path = dir_ / "limited.pt";
  WriteAll(path, bytes_);
  ZipReader::Limits limits;
  limits.max_records = 3;
  EXPECT_EQ(ZipReader::Open(path, limits).status().code(), StatusCode::kOutOfRange);
}

TEST_F(MutatedZipTest, OverlappingRecordsAreCorrupt) {
  // Grow the first record (data.pkl, described by a data descriptor) in the central directory so
  // that its data runs into the second record's local header.
  const uint32_t size = Get32(bytes_, cd_ + 24);
  Set32(bytes_, cd_ + 20, size + 100);
  Set32(bytes_, cd_ + 24, size + 100);
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("overlap"), std::string::npos) << st.message();
}

TEST_F(MutatedZipTest, DataPastTheDirectoryIsCorrupt) {
  Set32(bytes_, cd_ + 20, 0x7FFFFFF0);
  Set32(bytes_, cd_ + 24, 0x7FFFFFF0);
  EXPECT_EQ(OpenMutated().code(), StatusCode::kCorrupt);
}

TEST_F(MutatedZipTest, LocalNameMismatchIsCorrupt) {
  bytes_[30] = 'X';  // first byte of the first local header's name
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("local header"), std::string::npos) << st.message();
}

TEST_F(MutatedZipTest, CompressedMethodInDirectoryIsUnsupported) {
  Set16(bytes_, cd_ + 10, 8);
  EXPECT_EQ(OpenMutated().code(), StatusCode::kUnsupported);
}

TEST_F(MutatedZipTest, EncryptedRecordIsUnsupported) {
  Set16(bytes_, cd_ + 8, 0x0809);
  EXPECT_EQ(OpenMutated().code(), StatusCode::kUnsupported);
}

TEST_F(MutatedZipTest, DuplicateNamesAreCorrupt) {
  // Rename entry 2 ("small/data/1") to entry 1's name "small/data/0", in both headers.
  auto reader = ZipReader::Open(Fixture("small.pt"));
  ASSERT_TRUE(reader.ok());
  const ZipRecord& second = reader->records()[2];
  const size_t local_name = second.header_offset + 30;
  ASSERT_EQ(bytes_.substr(local_name, 12), "small/data/1");
  bytes_[local_name + 11] = '0';
  const size_t central_name = bytes_.find("small/data/1", cd_);
  ASSERT_NE(central_name, std::string::npos);
  bytes_[central_name + 11] = '0';
  const Status st = OpenMutated();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("duplicate"), std::string::npos) << st.message();
}

TEST_F(MutatedZipTest, BadNameIsCorrupt) {
  const size_t central_name = bytes_.find("small/data.pkl", cd_);
  ASSERT_NE(central_name, std::string::npos);
  bytes_.replace(central_name, 14, "../data.pkl\0\0\0", 14);
  EXPECT_EQ(OpenMutated().code(), StatusCode::kCorrupt);
}

TEST_F(MutatedZipTest, CrcMismatchIsFoundByVerifyCrc) {
  auto clean = ZipReader::Open(Fixture("small.pt"));
  ASSERT_TRUE(clean.ok());
  const ZipRecord& data0 = clean->records()[1];
  bytes_[data0.data_offset + 5] ^= 0x01;
  const std::string path = dir_ / "flipped.pt";
  WriteAll(path, bytes_);
  auto reader = ZipReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const Status st = reader->VerifyCrc(reader->records()[1]);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find(data0.name), std::string::npos) << st.message();
  EXPECT_TRUE(reader->VerifyCrc(reader->records()[0]).ok());
}

// Random byte damage anywhere must give a Status, never a crash or a record outside the file.
TEST_F(MutatedZipTest, RandomDamageNeverEscapesTheFile) {
  const std::string original = bytes_;
  std::mt19937 rng(1234);
  for (int round = 0; round < 500; ++round) {
    bytes_ = original;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      bytes_[rng() % bytes_.size()] = static_cast<char>(rng());
    }
    const std::string path = dir_ / "damaged.pt";
    WriteAll(path, bytes_);
    auto reader = ZipReader::Open(path);
    if (!reader.ok()) continue;
    for (const ZipRecord& r : reader->records()) {
      EXPECT_LE(r.data_offset + r.size, bytes_.size());
      EXPECT_TRUE(IsValidZipRecordName(r.name));
    }
  }
}

TEST(ZipRecordNameTest, Rules) {
  EXPECT_TRUE(IsValidZipRecordName("archive/data/0"));
  EXPECT_TRUE(IsValidZipRecordName("archive/.data/serialization_id"));
  EXPECT_TRUE(IsValidZipRecordName("data.pkl"));
  EXPECT_FALSE(IsValidZipRecordName(""));
  EXPECT_FALSE(IsValidZipRecordName("/abs"));
  EXPECT_FALSE(IsValidZipRecordName("a//b"));
  EXPECT_FALSE(IsValidZipRecordName("a/"));
  EXPECT_FALSE(IsValidZipRecordName("a/../b"));
  EXPECT_FALSE(IsValidZipRecordName("./a"));
  EXPECT_FALSE(IsValidZipRecordName("a\\b"));
  EXPECT_FALSE(IsValidZipRecordName(std::string("a\0b", 3)));
  EXPECT_TRUE(IsValidZipRecordName(std::string(kMaxZipNameBytes, 'a')));
  EXPECT_FALSE(IsValidZipRecordName(std::string(kMaxZipNameBytes + 1, 'a')));
}

}  // namespace
}  // namespace ucp
