#include "core/format/zip_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "core/format/crc32.h"
#include "core/format/zip_reader.h"
#include "tests/unit/core/zip_test_support.h"

namespace ucp {
namespace {

using testing::CommandResult;
using testing::Describe;
using testing::Fixtures;
using testing::OracleRecord;
using testing::ReadAll;
using testing::RunCommand;
using testing::ScratchDir;
using testing::WriteAll;

uint16_t Get16(const std::string& b, size_t at) {
  uint16_t v;
  std::memcpy(&v, b.data() + at, 2);
  return v;
}
uint32_t Get32(const std::string& b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}
uint64_t Get64(const std::string& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

std::vector<std::string> DirectoryListing(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Copies every record of the zip at `source` into a new archive at `target` with the same folder
// name, streaming each record's bytes from the source file. Records with an odd index pass the
// directory's CRC (copy_file_range path), the others are read and CRC'd by the writer.
Status CopyArchive(const std::string& source, const std::string& target,
                   ZipWriter::Options options) {
  UCP_ASSIGN_OR_RETURN(ZipReader reader, ZipReader::Open(source));
  options.archive_name = reader.archive_name();
  UCP_ASSIGN_OR_RETURN(ZipWriter writer, ZipWriter::Create(target, options));
  for (size_t i = 0; i < reader.records().size(); ++i) {
    const ZipRecord& r = reader.records()[i];
    const std::string name = r.name.substr(reader.archive_name().size() + 1);
    std::optional<uint32_t> crc;
    if (i % 2 == 1) crc = r.crc32;
    UCP_RETURN_IF_ERROR(writer.AddRecordFromFile(name, reader.file(), r.data_offset, r.size, crc));
  }
  return writer.Finish().status();
}

class ZipWriterTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(Fixtures::Get().error(), "") << Fixtures::Get().error(); }
  static std::string Fixture(const std::string& name) { return Fixtures::Get() / name; }
  ScratchDir dir_;
};

// The strongest compatibility check: rewriting a torch.save file record by record gives back the
// very bytes torch wrote.
TEST_F(ZipWriterTest, RewritingTorchFilesReproducesThemByteForByte) {
  for (const std::string& name : Fixtures::TorchFiles()) {
    SCOPED_TRACE(name);
    const std::string target = dir_ / name;
    const Status st = CopyArchive(Fixture(name), target, {});
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(ReadAll(target) == ReadAll(Fixture(name))) << "bytes differ from torch's";
  }
  // And for a real DeepSpeed checkpoint file.
  const std::string ds = std::string(UCP_SHARED_DIR) +
                         "/fixtures/deepspeed/z1_bf16/dp2/global_step5/mp_rank_00_model_states.pt";
  if (std::filesystem::exists(ds)) {
    const std::string target = dir_ / "mp_rank_00_model_states.pt";
    ASSERT_TRUE(CopyArchive(ds, target, {}).ok());
    EXPECT_TRUE(ReadAll(target) == ReadAll(ds));
  }
}

TEST_F(ZipWriterTest, OutputPassesUnzipZipinfoAndTorchLoad) {
  for (bool force : {false, true}) {
    SCOPED_TRACE(force ? "forced zip64" : "plain");
    ZipWriter::Options options;
    options.force_zip64 = force;
    const std::string target = dir_ / (force ? "nested64.pt" : "nested.pt");
    ASSERT_TRUE(CopyArchive(Fixture("nested.pt"), target, options).ok());
    CommandResult r = RunCommand("unzip -tq '" + target + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    r = RunCommand("zipinfo -v '" + target + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    r = RunCommand(testing::FixtureScript() + " compare '" + Fixture("nested.pt") + "' '" + target +
                   "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;

    // Python's zipfile agrees on every record and every data offset is 64-byte aligned.
    const std::vector<OracleRecord> oracle = Describe(target);
    auto reader = ZipReader::Open(target);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    ASSERT_EQ(oracle.size(), reader->records().size());
    for (size_t i = 0; i < oracle.size(); ++i) {
      EXPECT_EQ(oracle[i].data_offset % ZipWriter::kAlignment, 0u) << oracle[i].name;
      EXPECT_EQ(oracle[i].data_offset, reader->records()[i].data_offset);
      EXPECT_EQ(oracle[i].crc32, reader->records()[i].crc32);
      EXPECT_TRUE(reader->VerifyCrc(reader->records()[i]).ok());
    }
  }
}

// Torch 2.x names the folder "archive" and adds .format_version, .storage_alignment, byteorder
// and .data/serialization_id around the same records; torch 1.13 loads such a file and the reader
// finds every record by its short name.
TEST_F(ZipWriterTest, Torch2StyleArchiveLoadsAndReads) {
  auto source = ZipReader::Open(Fixture("nested.pt"));
  ASSERT_TRUE(source.ok());
  const std::string target = dir_ / "torch2.pt";
  {
    auto writer = ZipWriter::Create(target);
    ASSERT_TRUE(writer.ok());
    const std::string prefix = source->archive_name() + "/";
    auto copy = [&](const std::string& name) {
      const ZipRecord* r = source->Find(name);
      ASSERT_NE(r, nullptr) << name;
      ASSERT_TRUE(
          writer->AddRecordFromFile(name, source->file(), r->data_offset, r->size, r->crc32).ok());
    };
    copy("data.pkl");
    ASSERT_TRUE(writer->AddRecord(".format_version", std::string_view("1")).ok());
    ASSERT_TRUE(writer->AddRecord(".storage_alignment", std::string_view("64")).ok());
    ASSERT_TRUE(writer->AddRecord("byteorder", std::string_view("little")).ok());
    for (const ZipRecord& r : source->records()) {
      const std::string name = r.name.substr(prefix.size());
      if (name.rfind("data/", 0) == 0) copy(name);
    }
    copy("version");
    ASSERT_TRUE(writer
                    ->AddRecord(".data/serialization_id",
                                std::string_view("1234567890123456789012345678901234567890"))
                    .ok());
    ASSERT_TRUE(writer->Finish().ok());
  }
  const CommandResult r = RunCommand(testing::FixtureScript() + " compare '" +
                                     Fixture("nested.pt") + "' '" + target + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto reader = ZipReader::Open(target);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->archive_name(), "archive");
  auto byteorder = reader->Get("byteorder");
  ASSERT_TRUE(byteorder.ok());
  EXPECT_EQ(*reader->ReadRecord(**byteorder), "little");
  EXPECT_NE(reader->Find(".data/serialization_id"), nullptr);
  EXPECT_EQ(Describe(target).size(), reader->records().size());
}

TEST_F(ZipWriterTest, ForcedZip64WritesTheZip64Structures) {
  ZipWriter::Options options;
  options.force_zip64 = true;
  options.archive_name = "a";
  const std::string target = dir_ / "forced.zip";
  auto writer = ZipWriter::Create(target, options);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->AddRecord("x", std::string_view("hello")).ok());
  ASSERT_TRUE(writer->AddRecord("y", std::string_view("")).ok());
  ASSERT_TRUE(writer->Finish().ok());
  const std::string b = ReadAll(target);

  // Local header of "a/x": a ZIP64 extra (size, 0, offset) before the 'FB' padding field.
  ASSERT_EQ(Get32(b, 0), 0x04034b50u);
  const uint16_t name_len = Get16(b, 26);
  size_t extra = 30 + name_len;
  EXPECT_EQ(Get16(b, extra), 0x0001);
  EXPECT_EQ(Get16(b, extra + 2), 24);
  EXPECT_EQ(Get64(b, extra + 4), 5u);
  EXPECT_EQ(Get64(b, extra + 20), 0u);
  EXPECT_EQ(Get16(b, extra + 28), 0x4246);
  const size_t data = 30 + name_len + Get16(b, 28);
  EXPECT_EQ(data % 64, 0u);
  EXPECT_EQ(b.substr(data, 5), "hello");
  // 24-byte data descriptor with 8-byte sizes.
  EXPECT_EQ(Get32(b, data + 5), 0x08074b50u);
  EXPECT_EQ(Get64(b, data + 5 + 8), 5u);
  EXPECT_EQ(Get64(b, data + 5 + 16), 5u);

  // End records: the 32-bit record holds markers, the ZIP64 record the values.
  const size_t eocd = b.size() - 22;
  ASSERT_EQ(Get32(b, eocd), 0x06054b50u);
  EXPECT_EQ(Get16(b, eocd + 10), 0xFFFF);
  EXPECT_EQ(Get32(b, eocd + 12), 0xFFFFFFFFu);
  EXPECT_EQ(Get32(b, eocd + 16), 0xFFFFFFFFu);
  const size_t locator = eocd - 20;
  ASSERT_EQ(Get32(b, locator), 0x07064b50u);
  const uint64_t z64 = Get64(b, locator + 8);
  ASSERT_EQ(Get32(b, z64), 0x06064b50u);
  EXPECT_EQ(Get64(b, z64 + 32), 2u);
  const uint64_t cd = Get64(b, z64 + 48);
  ASSERT_EQ(Get32(b, cd), 0x02014b50u);
  EXPECT_EQ(Get32(b, cd + 20), 0xFFFFFFFFu);
  EXPECT_EQ(Get32(b, cd + 42), 0xFFFFFFFFu);

  const std::vector<OracleRecord> oracle = Describe(target);
  ASSERT_EQ(oracle.size(), 2u);
  EXPECT_EQ(oracle[0].size, 5u);
  EXPECT_EQ(oracle[0].header_offset, 0u);
  EXPECT_EQ(oracle[1].size, 0u);
  auto reader = ZipReader::Open(target);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_TRUE(reader->zip64());
  EXPECT_EQ(reader->records()[1].header_offset, oracle[1].header_offset);
  CommandResult r = RunCommand("unzip -tq '" + target + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// The size computed without writing equals what Finish writes, for empty records, data sizes on
// both sides of the 64-byte alignment, names of several lengths, with and without forced ZIP64.
TEST_F(ZipWriterTest, PlannedSizeIsTheSizeFinishWrites) {
  const std::vector<std::pair<std::string, size_t>> records = {
      {"data.pkl", 917},
      {"data/0", 0},
      {"data/1", 1},
      {"data/10", 63},
      {"data/2", 64},
      {"data/3", 65},
      {"a/much/longer/record/name/than/the/others", 4096},
      {"version", 2},
      {"byteorder", 6},
      {".data/serialization_id", 40}};
  for (const bool force : {false, true}) {
    for (size_t count = 0; count <= records.size(); ++count) {
      SCOPED_TRACE((force ? "forced zip64, " : "") + std::to_string(count) + " records");
      ZipWriter::Options options;
      options.sync = false;
      options.force_zip64 = force;
      options.archive_name = "mp_rank_00_model_states";
      const std::string target = dir_ / "planned.zip";
      auto writer = ZipWriter::Create(target, options);
      ASSERT_TRUE(writer.ok());
      std::vector<ZipWriter::PlannedRecord> planned;
      for (size_t i = 0; i < count; ++i) {
        const auto& [name, size] = records[i];
        ASSERT_TRUE(writer->AddRecord(name, std::string(size, 'x')).ok());
        planned.push_back({name, size});
      }
      const Result<uint64_t> written = writer->Finish();
      ASSERT_TRUE(written.ok()) << written.status().ToString();
      const Result<uint64_t> size = ZipWriter::PlannedSize(options.archive_name, planned, force);
      ASSERT_TRUE(size.ok()) << size.status().ToString();
      EXPECT_EQ(*size, *written);
      EXPECT_EQ(*size, std::filesystem::file_size(target));
    }
  }
}

// Records whose data others wrote at PlannedDataOffsets, completed by FinishParts (headers,
// the data it is given, descriptors, directory): the bytes one writer writes, with and without
// forced ZIP64 (whose extra fields move the data), empty records included.
TEST_F(ZipWriterTest, AnArchiveCompletedFromItsPartsIsTheArchiveWrittenWhole) {
  const std::vector<std::pair<std::string, size_t>> records = {
      {"data.pkl", 917}, {"data/0", 0},    {"data/1", 1}, {"data/10", 63},
      {"data/2", 64},    {"data/3", 6000}, {"version", 2}};
  const auto bytes = [](size_t size) {
    return std::string(size, static_cast<char>('a' + size % 26));
  };
  std::vector<ZipWriter::PlannedRecord> planned;
  for (const auto& [name, size] : records) planned.push_back({name, size});
  for (const bool force : {false, true}) {
    SCOPED_TRACE(force ? "forced zip64" : "zip64 where needed");
    ZipWriter::Options options;
    options.sync = false;
    options.force_zip64 = force;
    options.archive_name = "mp_rank_00_model_states";
    const std::string whole = dir_ / "whole.zip";
    auto writer = ZipWriter::Create(whole, options);
    ASSERT_TRUE(writer.ok());
    for (const auto& [name, size] : records) ASSERT_TRUE(writer->AddRecord(name, bytes(size)).ok());
    ASSERT_TRUE(writer->Finish().ok());

    // The parts write the data of records 1..5; data.pkl and version come with FinishParts.
    const std::vector<uint64_t> offsets =
        ZipWriter::PlannedDataOffsets(options.archive_name, planned, force).value();
    ASSERT_EQ(offsets.size(), records.size());
    const std::string parts = dir_ / ".parts";
    const std::string target = dir_ / "parts.zip";
    std::vector<std::string> data;
    std::vector<ZipWriter::PartsRecord> finished;
    {
      File file = File::Open(parts, File::Mode::kCreateExclusive).value();
      for (size_t i = 0; i < records.size(); ++i) data.push_back(bytes(records[i].second));
      for (size_t i = records.size() - 1; i-- > 1;) {
        ASSERT_TRUE(file.WriteAt(offsets[i], std::as_bytes(std::span(data[i]))).ok());
      }
    }
    for (size_t i = 0; i < records.size(); ++i) {
      ZipWriter::PartsRecord record{records[i].first, records[i].second, Crc32(data[i]), {}};
      if (i == 0 || i + 1 == records.size()) record.data = std::as_bytes(std::span(data[i]));
      finished.push_back(record);
    }
    const Result<uint64_t> size = ZipWriter::FinishParts(
        target, File::Open(parts, File::Mode::kReadWrite).value(), options, finished);
    ASSERT_TRUE(size.ok()) << size.status().ToString();
    EXPECT_EQ(*size, std::filesystem::file_size(whole));
    EXPECT_TRUE(ReadAll(target) == ReadAll(whole));
    EXPECT_FALSE(std::filesystem::exists(parts));
  }
}

// More than 65535 records: the 32-bit end record can only say 0xFFFF.
TEST_F(ZipWriterTest, MoreThan65535Records) {
  const std::string target = dir_ / "many.zip";
  constexpr size_t kCount = 70000;
  {
    ZipWriter::Options options;
    options.sync = false;
    auto writer = ZipWriter::Create(target, options);
    ASSERT_TRUE(writer.ok());
    for (size_t i = 0; i < kCount; ++i) {
      const std::string v = std::to_string(i);
      ASSERT_TRUE(writer->AddRecord("r/" + v, std::string_view(v)).ok());
    }
    ASSERT_TRUE(writer->Finish().ok());
  }
  const std::string b = ReadAll(target);
  EXPECT_EQ(Get16(b, b.size() - 22 + 10), 0xFFFF);
  auto reader = ZipReader::Open(target);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  ASSERT_EQ(reader->records().size(), kCount);
  auto last = reader->Get("r/69999");
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*reader->ReadRecord(**last), "69999");
  const CommandResult r = RunCommand(std::string(UCP_PYTHON) +
                                     " -c 'import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); "
                                     "print(len(z.infolist()), z.read(\"archive/r/12345\"))' '" +
                                     target + "'");
  EXPECT_EQ(r.output, "70000 b'12345'\n");
}

TEST_F(ZipWriterTest, NothingAppearsBeforeFinishAndAbandonedWritersLeaveNothing) {
  const std::string target = dir_ / "out.pt";
  {
    auto writer = ZipWriter::Create(target);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->AddRecord("data.pkl", std::string_view("abc")).ok());
    EXPECT_TRUE(std::filesystem::exists(writer->temp_path()));
    EXPECT_FALSE(std::filesystem::exists(target));
  }
  EXPECT_TRUE(DirectoryListing(dir_.path()).empty());
}

TEST_F(ZipWriterTest, FailedCopyPoisonsTheWriterAndKeepsTheOldFile) {
  const std::string target = dir_ / "keep.pt";
  WriteAll(target, "previous contents");
  const std::string source_path = dir_ / "source.bin";
  WriteAll(source_path, "0123456789");
  auto source = File::Open(source_path, File::Mode::kRead);
  ASSERT_TRUE(source.ok());
  {
    auto writer = ZipWriter::Create(target);
    ASSERT_TRUE(writer.ok());
    const Status st = writer->AddRecordFromFile("data/0", *source, 4, 100);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find(source_path), std::string::npos) << st.message();
    EXPECT_EQ(writer->AddRecord("data/1", std::string_view("x")).code(),
              StatusCode::kFailedPrecondition);
    EXPECT_EQ(writer->Finish().status().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(ReadAll(target), "previous contents");
  EXPECT_EQ(DirectoryListing(dir_.path()), (std::vector<std::string>{"keep.pt", "source.bin"}));
}

TEST_F(ZipWriterTest, RejectsBadAndDuplicateNames) {
  auto writer = ZipWriter::Create(dir_ / "names.pt");
  ASSERT_TRUE(writer.ok());
  EXPECT_EQ(writer->AddRecord("", std::string_view("")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer->AddRecord("../x", std::string_view("")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer->AddRecord("a//b", std::string_view("")).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(writer->AddRecord("a", std::string_view("1")).ok());
  EXPECT_EQ(writer->AddRecord("a", std::string_view("2")).code(), StatusCode::kInvalidArgument);
  // Rejected names do not poison the writer.
  ASSERT_TRUE(writer->AddRecord("b", std::string_view("2")).ok());
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(writer->AddRecord("c", std::string_view("3")).code(), StatusCode::kFailedPrecondition);

  ZipWriter::Options bad;
  bad.archive_name = "a/b";
  EXPECT_EQ(ZipWriter::Create(dir_ / "bad.pt", bad).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ZipWriterTest, SmallCopyBufferStreamsLargeRecords) {
  ZipWriter::Options options;
  options.copy_buffer_bytes = 4096;
  const std::string target = dir_ / "onebig.pt";
  ASSERT_TRUE(CopyArchive(Fixture("onebig.pt"), target, options).ok());
  EXPECT_TRUE(ReadAll(target) == ReadAll(Fixture("onebig.pt")));
}

}  // namespace
}  // namespace ucp
