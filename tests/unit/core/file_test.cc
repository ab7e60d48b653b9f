#include "core/io/file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

std::span<const std::byte> Bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ucp_file_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string PathOf(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

using ::ucp::testing::Pattern;

TEST_F(FileTest, WriteReadSizeAndAppend) {
  auto file = File::Open(PathOf("a"), File::Mode::kCreate);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_TRUE(file->Append(Bytes("hello ")).ok());
  ASSERT_TRUE(file->Append(Bytes("world")).ok());
  ASSERT_TRUE(file->WriteAt(0, Bytes("J")).ok());
  auto size = file->Size();
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 11u);
  std::string got(11, '\0');
  ASSERT_TRUE(file->ReadAt(0, std::as_writable_bytes(std::span(got))).ok());
  EXPECT_EQ(got, "Jello world");
  ASSERT_TRUE(file->Sync().ok());
  ASSERT_TRUE(file->Close().ok());
  EXPECT_FALSE(file->is_open());
  EXPECT_TRUE(file->Close().ok());
  EXPECT_EQ(std::filesystem::file_size(PathOf("a")), 11u);
}

TEST_F(FileTest, ShortReadIsCorruptAndReadSomeStopsAtEof) {
  auto file = File::Open(PathOf("b"), File::Mode::kCreate);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE(file->WriteAt(0, Bytes("0123456789")).ok());
  std::string buf(8, '\0');
  const Status st = file->ReadAt(5, std::as_writable_bytes(std::span(buf)));
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find(PathOf("b")), std::string::npos) << st.message();
  auto some = file->ReadSomeAt(5, std::as_writable_bytes(std::span(buf)));
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(*some, 5u);
  EXPECT_EQ(buf.substr(0, 5), "56789");
}

TEST_F(FileTest, OpenErrorsNameThePath) {
  auto missing = File::Open(PathOf("missing"), File::Mode::kRead);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(PathOf("missing")), std::string::npos);

  ASSERT_TRUE(File::Open(PathOf("c"), File::Mode::kCreate).ok());
  auto again = File::Open(PathOf("c"), File::Mode::kCreateExclusive);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kIoError);
}

TEST_F(FileTest, ClosedFileIsFailedPrecondition) {
  File file;
  std::byte b{};
  EXPECT_EQ(file.ReadAt(0, {&b, 1}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(file.WriteAt(0, {&b, 1}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(file.Size().status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(FileTest, MoveTransfersOwnership) {
  auto opened = File::Open(PathOf("d"), File::Mode::kCreate);
  ASSERT_TRUE(opened.ok());
  File a = std::move(opened).value();
  const int fd = a.fd();
  File b = std::move(a);
  EXPECT_FALSE(a.is_open());  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  EXPECT_EQ(b.fd(), fd);
  ASSERT_TRUE(b.Append(Bytes("x")).ok());
}

TEST_F(FileTest, CopyRangeCopiesExactBytesAcrossChunks) {
  const std::vector<std::byte> data = Pattern(3 * kCopyChunkBytes + 12345, 7);
  auto src = File::Open(PathOf("src"), File::Mode::kCreate);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(src->WriteAt(0, data).ok());
  auto dst = File::Open(PathOf("dst"), File::Mode::kCreate);
  ASSERT_TRUE(dst.ok());
  ASSERT_TRUE(dst->WriteAt(0, Bytes("HEAD")).ok());
  const uint64_t from = 1001, length = data.size() - 2000;
  ASSERT_TRUE(CopyRange(*src, from, *dst, 4, length).ok());
  std::vector<std::byte> got(length + 4);
  ASSERT_TRUE(dst->ReadAt(0, got).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got.data()), 4), "HEAD");
  EXPECT_TRUE(std::equal(got.begin() + 4, got.end(), data.begin() + from));
}

// Linux (5.19+) refuses copy_file_range between different file system types (EXDEV), so a copy
// from tmpfs to the test folder takes the pread/pwrite path.
TEST_F(FileTest, CopyRangeAcrossFileSystemsFallsBackToBufferedCopy) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  const std::string shm_path = "/dev/shm/ucp_file_test_" + std::to_string(::getpid());
  const std::vector<std::byte> data = Pattern(2 * kCopyChunkBytes + 77, 3);
  auto src = File::Open(shm_path, File::Mode::kCreate);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(src->WriteAt(0, data).ok());
  auto dst = File::Open(PathOf("from_shm"), File::Mode::kCreate);
  ASSERT_TRUE(dst.ok());
  const Status st = CopyRange(*src, 5, *dst, 0, data.size() - 5);
  (void)RemoveFile(shm_path);
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<std::byte> got(data.size() - 5);
  ASSERT_TRUE(dst->ReadAt(0, got).ok());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), data.begin() + 5));
}

TEST_F(FileTest, CopyRangePastSourceEndIsCorrupt) {
  auto src = File::Open(PathOf("s"), File::Mode::kCreate);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(src->WriteAt(0, Bytes("short")).ok());
  auto dst = File::Open(PathOf("t"), File::Mode::kCreate);
  ASSERT_TRUE(dst.ok());
  EXPECT_EQ(CopyRange(*src, 2, *dst, 0, 10).code(), StatusCode::kCorrupt);
}

TEST_F(FileTest, RenameRemoveAndSyncDirectory) {
  ASSERT_TRUE(File::Open(PathOf("r1"), File::Mode::kCreate).ok());
  ASSERT_TRUE(RenameFile(PathOf("r1"), PathOf("r2")).ok());
  EXPECT_FALSE(std::filesystem::exists(PathOf("r1")));
  EXPECT_TRUE(std::filesystem::exists(PathOf("r2")));
  ASSERT_TRUE(SyncDirectory(dir_.string()).ok());
  ASSERT_TRUE(RemoveFile(PathOf("r2")).ok());
  EXPECT_EQ(RemoveFile(PathOf("r2")).code(), StatusCode::kNotFound);
  ASSERT_TRUE(File::Open(PathOf("r3"), File::Mode::kCreate).ok());
  auto t = File::Open(PathOf("r3"), File::Mode::kReadWrite);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(t->Truncate(100).ok());
  EXPECT_EQ(*t->Size(), 100u);
}

TEST_F(FileTest, CreateDirectoriesAndWriteFileAtomically) {
  ASSERT_TRUE(CreateDirectories(PathOf("a/b/c")).ok());
  ASSERT_TRUE(CreateDirectories(PathOf("a/b/c")).ok());  // existing: fine
  EXPECT_TRUE(std::filesystem::is_directory(PathOf("a/b/c")));
  ASSERT_TRUE(File::Open(PathOf("plain"), File::Mode::kCreate).ok());
  EXPECT_FALSE(CreateDirectories(PathOf("plain/sub")).ok());

  const std::string target = PathOf("a/b/c/latest");
  ASSERT_TRUE(WriteFileAtomically(target, "global_step5").ok());
  ASSERT_TRUE(WriteFileAtomically(target, "global_step10", /*sync=*/false).ok());
  auto file = File::Open(target, File::Mode::kRead);
  ASSERT_TRUE(file.ok());
  std::string text(13, '\0');
  ASSERT_TRUE(file->ReadAt(0, std::as_writable_bytes(std::span(text))).ok());
  EXPECT_EQ(text, "global_step10");
  EXPECT_EQ(*file->Size(), 13u);
  // Only the target remains: no temporaries.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(PathOf("a/b/c")),
                          std::filesystem::directory_iterator()),
            1);
  // A directory that does not exist: the error names the temporary's path, nothing is left.
  const Status missing = WriteFileAtomically(PathOf("none/x"), "x");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find(PathOf("none/x")), std::string::npos);
}

// A tag directory "tag" with a file, a subdirectory, links that stay inside it and links that
// leave it, next to an "outside" file with the same bytes (what a hostile tag would point at).
class OpenBeneathTest : public FileTest {
 protected:
  void SetUp() override {
    FileTest::SetUp();
    tag_ = PathOf("tag");
    std::filesystem::create_directories(tag_ + "/sub");
    for (const std::string& path : {tag_ + "/a", tag_ + "/sub/b", PathOf("outside")}) {
      auto file = File::Open(path, File::Mode::kCreate);
      ASSERT_TRUE(file.ok());
      ASSERT_TRUE(file->Append(Bytes("bytes")).ok());
    }
    std::filesystem::create_symlink("sub/b", tag_ + "/inside_link");
    std::filesystem::create_symlink("../a", tag_ + "/sub/up_link");
    std::filesystem::create_symlink("../outside", tag_ + "/relative_escape");
    std::filesystem::create_symlink(PathOf("outside"), tag_ + "/absolute_escape");
    std::filesystem::create_symlink(tag_ + "/a", tag_ + "/absolute_inside");
    std::filesystem::create_symlink("..", tag_ + "/parent_dir");
  }
  std::string tag_;
};

TEST_F(OpenBeneathTest, OpensNamesThatStayInside) {
  for (const char* name : {"a", "sub/b", "inside_link", "sub/up_link", "sub/../a"}) {
    auto file = File::OpenBeneath(tag_, name);
    ASSERT_TRUE(file.ok()) << name << ": " << file.status().ToString();
    EXPECT_EQ(file->path(), tag_ + "/" + name);
    std::string got(5, '\0');
    ASSERT_TRUE(file->ReadAt(0, std::as_writable_bytes(std::span(got))).ok());
    EXPECT_EQ(got, "bytes");
  }
}

TEST_F(OpenBeneathTest, RefusesNamesThatLeave) {
  for (const char* name : {"relative_escape", "absolute_escape", "absolute_inside",
                                 "../outside", "parent_dir/outside", "sub/../../outside"}) {
    auto file = File::OpenBeneath(tag_, name);
    ASSERT_FALSE(file.ok()) << name;
    EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument) << name;
    EXPECT_NE(file.status().message().find(name), std::string::npos) << file.status().message();
    EXPECT_NE(file.status().message().find("refused"), std::string::npos)
        << file.status().message();
  }
}

TEST_F(OpenBeneathTest, MissingNamesAndDirectoriesAreNotFound) {
  EXPECT_EQ(File::OpenBeneath(tag_, "nothing").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(File::OpenBeneath(PathOf("no_tag"), "a").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace ucp
