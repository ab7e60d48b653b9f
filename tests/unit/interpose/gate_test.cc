#include "interpose/gate.h"

#include <gtest/gtest.h>

#include <thread>

namespace ucp {
namespace {

TEST(GateTest, ClosedUntilSwitchedOnAndInsideAGuard) {
  EXPECT_FALSE(InterceptGate());  // nothing switched the layer on in this process
  SetLayerOn(true);
  EXPECT_TRUE(InterceptGate());
  {
    ReentrancyGuard outer;
    EXPECT_FALSE(InterceptGate());
    {
      ReentrancyGuard inner;
      EXPECT_FALSE(InterceptGate());
    }
    EXPECT_FALSE(InterceptGate());
  }
  EXPECT_TRUE(InterceptGate());
  SetLayerOn(false);
  EXPECT_FALSE(InterceptGate());
}

TEST(GateTest, GuardIsPerThread) {
  SetLayerOn(true);
  ReentrancyGuard guard;
  bool other_thread_open = false;
  std::thread([&] { other_thread_open = InterceptGate(); }).join();
  EXPECT_TRUE(other_thread_open);
  EXPECT_FALSE(InterceptGate());
  SetLayerOn(false);
}

TEST(GateTest, ErrnoPreserverRestoresErrno) {
  errno = ENOENT;
  {
    ErrnoPreserver keep;
    errno = EBADF;
  }
  EXPECT_EQ(errno, ENOENT);
}

}  // namespace
}  // namespace ucp
