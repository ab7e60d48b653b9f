#include "core/util/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

#include "core/util/checked.h"

namespace ucp {
namespace {

Result<int> ParsePositive(int value) {
  if (value <= 0) return Status::InvalidArgument("value " + std::to_string(value) + ": not > 0");
  return value;
}

Result<int> Doubled(int value) {
  UCP_ASSIGN_OR_RETURN(int parsed, ParsePositive(value));
  return parsed * 2;
}

TEST(StatusTest, DefaultIsOk) {
  Status status;
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.ToString(), "ok");
}

TEST(StatusTest, CarriesCodeAndMessageWithContext) {
  Status status = Status::Corrupt("central directory: truncated").WithContext("zip: a.pt");
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_EQ(status.ToString(), "corrupt: zip: a.pt: central directory: truncated");
}

TEST(StatusTest, PosixErrorMapsEnoentToNotFound) {
  EXPECT_EQ(PosixError("open /x", ENOENT).code(), StatusCode::kNotFound);
  Status io = PosixError("write /x", ENOSPC);
  EXPECT_EQ(io.code(), StatusCode::kIoError);
  EXPECT_EQ(io.message(), "write /x: No space left on device");
}

TEST(ResultTest, AssignOrReturnPropagates) {
  Result<int> good = Doubled(21);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 42);
  Result<int> bad = Doubled(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "value -1: not > 0");
}

TEST(CheckedTest, DetectsOverflow) {
  EXPECT_EQ(CheckedAdd<uint64_t>(1, 2), 3u);
  EXPECT_FALSE(CheckedAdd<uint64_t>(UINT64_MAX, 1).has_value());
  EXPECT_FALSE(CheckedMul<uint64_t>(1ull << 40, 1ull << 40).has_value());
  EXPECT_TRUE(RangeWithin(10, 5, 15));
  EXPECT_FALSE(RangeWithin(10, 6, 15));
  EXPECT_FALSE(RangeWithin(UINT64_MAX, 2, UINT64_MAX));
}

}  // namespace
}  // namespace ucp
