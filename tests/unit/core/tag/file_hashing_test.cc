#include "core/tag/file_hashing.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace ucp {
namespace {

namespace fs = std::filesystem;

// `xxhsum -H3 FILE` (an independent implementation): "XXH3 (FILE) = <16 hex digits>".
std::string Xxhsum(const std::string& path) {
  FILE* pipe = ::popen(("xxhsum -H3 '" + path + "'").c_str(), "r");
  if (pipe == nullptr) return "";
  char line[4096] = {};
  const bool read = std::fgets(line, sizeof(line), pipe) != nullptr;
  ::pclose(pipe);
  const std::string text = read ? line : "";
  const size_t equals = text.rfind("= ");
  return equals == std::string::npos ? "" : text.substr(equals + 2, 16);
}

class FileHashingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ucp_file_hashing_test.XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    tag_ = pattern;
    Write("empty.pt", "");
    std::string big(3 * (1 << 20) + 12345, '\0');  // several of HashFile's 1 MiB reads
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
    Write("big.pt", big);
    Write("small.pt", "zero_pp_rank_0");
  }
  void TearDown() override { fs::remove_all(tag_); }

  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream(tag_ + "/" + name, std::ios::binary) << bytes;
    names_.push_back(name);
  }

  // A close record of `name` as it is on disk now, saying `xxh3`.
  JournalRecord Record(const std::string& name, uint64_t xxh3) const {
    const std::optional<FileOnDisk> on_disk = StatFileOnDisk(tag_ + "/" + name);
    EXPECT_TRUE(on_disk.has_value()) << name;
    JournalRecord record;
    record.path = name;
    record.size = on_disk.value_or(FileOnDisk{}).size;
    record.xxh3 = xxh3;
    record.stamp = on_disk.value_or(FileOnDisk{}).stamp;
    record.time_ns = 1;  // no clock is compared: the oldest time does as well as any
    record.pid = ::getpid();
    record.framework = "deepspeed";
    return record;
  }

  std::string tag_;
  std::vector<std::string> names_;
};

TEST_F(FileHashingTest, HashesEveryFileInParallelAsXxhsumDoes) {
  for (const unsigned threads : {1u, 2u, 8u}) {
    Result<std::vector<FileDigest>> digests = HashTagFiles(tag_, names_, {threads, false});
    ASSERT_TRUE(digests.ok()) << digests.status().ToString();
    ASSERT_EQ(digests->size(), names_.size());
    for (size_t i = 0; i < names_.size(); ++i) {
      EXPECT_EQ((*digests)[i].size, fs::file_size(tag_ + "/" + names_[i]));
      EXPECT_EQ(FormatXxh3((*digests)[i].xxh3), Xxhsum(tag_ + "/" + names_[i])) << names_[i];
    }
  }
}

TEST_F(FileHashingTest, ReusesAJournalRecordOnlyWhileItDescribesTheFile) {
  // A recorded hash no file has: seeing it back proves the file was not read.
  const uint64_t recorded = 0x0123456789abcdefull;
  JournalRecord big = Record("big.pt", recorded);
  big.size += 1;
  JournalRecord empty = Record("empty.pt", recorded);
  empty.stamp->mtime_ns -= 1;  // the file was modified after this close
  for (const JournalRecord& record : {Record("small.pt", recorded), big, empty}) {
    ASSERT_TRUE(AppendJournalRecord(tag_, record).ok());
  }

  Result<std::vector<FileDigest>> trusted = HashTagFiles(tag_, names_, {2, true});
  ASSERT_TRUE(trusted.ok()) << trusted.status().ToString();
  EXPECT_NE((*trusted)[0].xxh3, recorded);  // empty.pt: another mtime
  EXPECT_NE((*trusted)[1].xxh3, recorded);  // big.pt: another size
  EXPECT_EQ((*trusted)[2].xxh3, recorded);  // small.pt: size, inode and mtime match
  EXPECT_EQ(FormatXxh3((*trusted)[1].xxh3), Xxhsum(tag_ + "/big.pt"));

  Result<std::vector<FileDigest>> fresh = HashTagFiles(tag_, names_, {2, false});
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(FormatXxh3((*fresh)[2].xxh3), Xxhsum(tag_ + "/small.pt"));
}

// Two processes writing one file at once (DeepSpeed's folded AutoEP expert files) can leave bytes
// that neither wrote whole, while each close record hashes its own writer's bytes: such a file is
// read, not taken from a record, even where one record matches it on disk.
TEST_F(FileHashingTest, AFileTwoProcessesClosedAtItsInodeIsHashedFromDisk) {
  const uint64_t recorded = 0x0123456789abcdefull;
  JournalRecord last = Record("small.pt", recorded);
  JournalRecord other = last;
  other.pid = last.pid + 1;
  other.stamp->mtime_ns -= 1;  // the other writer closed first
  JournalRecord alone = Record("big.pt", recorded);
  for (const JournalRecord& record : {other, last, alone}) {
    ASSERT_TRUE(AppendJournalRecord(tag_, record).ok());
  }
  Result<std::vector<FileDigest>> trusted = HashTagFiles(tag_, names_, {2, true});
  ASSERT_TRUE(trusted.ok()) << trusted.status().ToString();
  EXPECT_EQ(FormatXxh3((*trusted)[2].xxh3), Xxhsum(tag_ + "/small.pt"));
  EXPECT_EQ((*trusted)[1].xxh3, recorded);  // big.pt: one writer, its record trusted
}

TEST_F(FileHashingTest, MissingFileIsNamed) {
  names_.push_back("zero_pp_rank_7_mp_rank_00_optim_states.pt");
  Result<std::vector<FileDigest>> digests = HashTagFiles(tag_, names_, {2, true});
  ASSERT_FALSE(digests.ok());
  EXPECT_EQ(digests.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(digests.status().message(),
              ::testing::HasSubstr("zero_pp_rank_7_mp_rank_00_optim_states.pt"));
}

}  // namespace
}  // namespace ucp
