#include "core/format/crc32.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/core/test_bytes.h"

namespace ucp {
namespace {

using ::ucp::testing::Pattern;

// The published check values of CRC-32/ISO-HDLC (the zip CRC).
TEST(Crc32Test, KnownVectors) {
  EXPECT_EQ(Crc32(std::string_view("")), 0u);
  EXPECT_EQ(Crc32(std::string_view("123456789")), 0xCBF43926u);
  EXPECT_EQ(Crc32(std::string_view("a")), 0xE8B7BE43u);
  EXPECT_EQ(Crc32(std::string_view("The quick brown fox jumps over the lazy dog")), 0x414FA339u);
  const std::vector<std::byte> zeros(32, std::byte{0});
  EXPECT_EQ(Crc32(zeros), 0x190A55ADu);
  const std::vector<std::byte> ones(32, std::byte{0xFF});
  EXPECT_EQ(Crc32(ones), 0xFF6CAB0Bu);
}

// Python's zlib.crc32 is the independent oracle: for a file of pseudo-random bytes it prints the
// CRC of the prefix of each length, and of a misaligned slice, which both implementations must
// reproduce.
TEST(Crc32Test, MatchesZlibOnManyLengthsAndAlignments) {
  const std::vector<std::byte> data = Pattern(1 << 20, 12345);
  const auto path = std::filesystem::temp_directory_path() /
                    ("ucp_crc32_test_" + std::to_string(::getpid()) + ".bin");
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(data.data()),
              static_cast<std::streamsize>(data.size()));
  }
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {1000, 4095, 4096, 4097, 65536 + 13, 1 << 20}) lengths.push_back(n);

  std::string cmd = std::string(UCP_PYTHON) +
                    " -c 'import sys, zlib\n"
                    "d = open(sys.argv[1], \"rb\").read()\n"
                    "for a in sys.argv[2:]:\n"
                    "  s, n = map(int, a.split(\":\"))\n"
                    "  print(zlib.crc32(d[s:s+n]))' " +
                    path.string();
  std::vector<std::pair<size_t, size_t>> cases;
  for (size_t n : lengths) {
    for (size_t start : {size_t{0}, size_t{3}}) {
      if (start + n > data.size()) continue;
      cases.emplace_back(start, n);
      // Appended piece by piece: g++ 12 at -O3 warns falsely (-Wrestrict) on `" " + string`.
      cmd.append(" ").append(std::to_string(start)).append(":").append(std::to_string(n));
    }
  }
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, got);
  ASSERT_EQ(::pclose(pipe), 0) << output;
  std::filesystem::remove(path);

  std::istringstream lines(output);
  size_t checked = 0;
  for (const auto& [start, n] : cases) {
    uint64_t expected = 0;
    ASSERT_TRUE(lines >> expected) << "python printed too few lines";
    const std::span<const std::byte> slice(data.data() + start, n);
    EXPECT_EQ(Crc32(slice), expected) << "start " << start << " length " << n;
    EXPECT_EQ(Crc32Portable(slice), expected) << "start " << start << " length " << n;
    ++checked;
  }
  EXPECT_EQ(checked, cases.size());
}

TEST(Crc32Test, IncrementalEqualsOneShotForAnySplit) {
  const std::vector<std::byte> data = Pattern(5000, 99);
  const uint32_t whole = Crc32(data);
  for (size_t split : {0, 1, 15, 16, 63, 64, 65, 127, 1000, 4999, 5000}) {
    Crc32Stream stream;
    stream.Update(std::span(data).first(split));
    stream.Update(std::span(data).subspan(split));
    EXPECT_EQ(stream.value(), whole) << "split " << split;
    EXPECT_EQ(Crc32(std::span(data).subspan(split), Crc32Portable(std::span(data).first(split))),
              whole);
  }
  Crc32Stream bytewise;
  for (size_t i = 0; i < data.size(); ++i) bytewise.Update(std::span(data).subspan(i, 1));
  EXPECT_EQ(bytewise.value(), whole);
}

// The CRC of a ‖ b from the two CRCs and b's length, for any split, empty halves included, and
// for pieces combined one after another as the parts of one zip record are.
TEST(Crc32Test, CombiningTheCrcsOfTwoPiecesGivesTheCrcOfBoth) {
  const std::vector<std::byte> data = Pattern(5000, 7);
  const uint32_t whole = Crc32(data);
  for (size_t split : {0, 1, 3, 16, 64, 65, 1000, 4095, 4999, 5000}) {
    const std::span<const std::byte> a = std::span(data).first(split);
    const std::span<const std::byte> b = std::span(data).subspan(split);
    EXPECT_EQ(Crc32Combine(Crc32(a), Crc32(b), b.size()), whole) << "split " << split;
  }
  uint32_t combined = 0;
  for (size_t at = 0; at < data.size(); at += 777) {
    const std::span<const std::byte> piece =
        std::span(data).subspan(at, std::min<size_t>(777, data.size() - at));
    combined = Crc32Combine(combined, Crc32(piece), piece.size());
  }
  EXPECT_EQ(combined, whole);
  // A zero run of 2^33 bytes (more than any 32-bit length): shifting by it twice is shifting by
  // its double, checked against the bytes' own CRC at a size that can be hashed.
  const std::vector<std::byte> zeros(1 << 20);
  EXPECT_EQ(Crc32Combine(Crc32(std::span(data).first(100)), Crc32(zeros), zeros.size()),
            Crc32(zeros, Crc32(std::span(data).first(100))));
  const uint32_t z33 = Crc32Combine(0, 0, uint64_t{1} << 33);
  EXPECT_EQ(Crc32Combine(0xDEADBEEF, 0, uint64_t{1} << 34),
            Crc32Combine(Crc32Combine(0xDEADBEEF, 0, uint64_t{1} << 33), 0, uint64_t{1} << 33));
  EXPECT_EQ(z33, 0u);
}

TEST(Crc32Test, ReportsAnImplementation) {
  const std::string_view name = Crc32Implementation();
  EXPECT_TRUE(name == "pclmul" || name == "slice16") << name;
}

}  // namespace
}  // namespace ucp
