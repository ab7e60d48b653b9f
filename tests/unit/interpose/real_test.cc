#include "interpose/real.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ucp::real {
namespace {

TEST(RealTest, ResolvesLazilyThenEagerly) {
  // Nothing resolved yet in this process: the first call resolves write on the spot.
  EXPECT_STREQ(ResolutionOf("write"), "unresolved");
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  EXPECT_EQ(write()(fds[1], "abc", 3), 3);
  EXPECT_STREQ(ResolutionOf("write"), "next");
  ResolveAll();
  EXPECT_STREQ(ResolutionOf("close_range"), "next");
  EXPECT_STREQ(ResolutionOf("__xstat"), "next");
  EXPECT_STREQ(ResolutionOf("no_such_symbol"), "unresolved");
  char buffer[4] = {};
  EXPECT_EQ(::read(fds[0], buffer, 3), 3);
  EXPECT_STREQ(buffer, "abc");
  EXPECT_EQ(close()(fds[0]), 0);
  EXPECT_EQ(close()(fds[1]), 0);
}

TEST(RealTest, ResolvedFunctionsBehaveAsLibc) {
  errno = 0;
  EXPECT_EQ(open()("/nonexistent/ucp", O_RDONLY), -1);
  EXPECT_EQ(errno, ENOENT);
  errno = 0;
  EXPECT_EQ(write()(-1, "x", 1), -1);
  EXPECT_EQ(errno, EBADF);
  struct stat st;
  EXPECT_EQ(stat()("/", &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(__xstat()(1, "/", &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
}

}  // namespace
}  // namespace ucp::real
