#include "core/util/path.h"

#include <gtest/gtest.h>

namespace ucp {
namespace {

TEST(PathTest, LexicallyNormal) {
  EXPECT_EQ(LexicallyNormal("/"), "/");
  EXPECT_EQ(LexicallyNormal("//"), "/");
  EXPECT_EQ(LexicallyNormal("/a/b"), "/a/b");
  EXPECT_EQ(LexicallyNormal("/a//b/"), "/a/b");
  EXPECT_EQ(LexicallyNormal("/a/./b/."), "/a/b");
  EXPECT_EQ(LexicallyNormal("/a/../b"), "/b");
  EXPECT_EQ(LexicallyNormal("/a/b/../../.."), "/");
  EXPECT_EQ(LexicallyNormal("/../a"), "/a");
  EXPECT_EQ(LexicallyNormal("/a/..b/.c"), "/a/..b/.c");
}

TEST(PathTest, RelativeInputIsRejected) {
  EXPECT_EQ(LexicallyNormal(""), "");
  EXPECT_EQ(LexicallyNormal("a/b"), "");
  EXPECT_EQ(LexicallyNormal("./a"), "");
}

TEST(PathTest, JoinAndNormalize) {
  EXPECT_EQ(JoinAndNormalize("/ckpt/run", "global_step5/x.pt"), "/ckpt/run/global_step5/x.pt");
  EXPECT_EQ(JoinAndNormalize("/ckpt/run/", "../other/./x.pt"), "/ckpt/other/x.pt");
  EXPECT_EQ(JoinAndNormalize("/ckpt", "/abs/x.pt"), "/abs/x.pt");
  EXPECT_EQ(JoinAndNormalize("/ckpt", "."), "/ckpt");
  EXPECT_EQ(JoinAndNormalize("relative", "x"), "");
}

TEST(PathTest, IsNormalRelativePath) {
  EXPECT_TRUE(IsNormalRelativePath("x.pt"));
  EXPECT_TRUE(IsNormalRelativePath("zero/wte.weight/fp32.pt"));
  EXPECT_TRUE(IsNormalRelativePath(".ucp/index.json"));
  EXPECT_TRUE(IsNormalRelativePath("a/..b/c.."));
  EXPECT_FALSE(IsNormalRelativePath(""));
  EXPECT_FALSE(IsNormalRelativePath("/x"));
  EXPECT_FALSE(IsNormalRelativePath("x/"));
  EXPECT_FALSE(IsNormalRelativePath("a//b"));
  EXPECT_FALSE(IsNormalRelativePath("./a"));
  EXPECT_FALSE(IsNormalRelativePath("a/."));
  EXPECT_FALSE(IsNormalRelativePath("a/../b"));
  EXPECT_FALSE(IsNormalRelativePath(".."));
}

}  // namespace
}  // namespace ucp
