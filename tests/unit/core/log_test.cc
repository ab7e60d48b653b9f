// Tests core/util/log.cc: what reaches a process's log file when it ends without ucp's shutdown.
#include "core/util/log.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tests/unit/core/test_bytes.h"

namespace ucp::log {
namespace {

// A process that logs and then ends at once (_exit: no shutdown, no static destructors, as a
// trainer aborted at interpreter exit ends): its info line is in its log, a debug line logged
// after it is not yet.
TEST(LogTest, AnInfoLineReachesTheFileBeforeTheProcessEndsWithoutShutdown) {
  const std::filesystem::path dir = ucp::testing::ScratchDirectory("ucp_log_test");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Configure(Level::kDebug, dir.string());
    Write(Level::kInfo, "view: built served.mp_rank_00_model_states.pt");
    Write(Level::kDebug, "a detail");
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string log = ucp::testing::ReadAll(dir / ("ucp." + std::to_string(pid) + ".log"));
  EXPECT_NE(log.find("info view: built served.mp_rank_00_model_states.pt"), std::string::npos)
      << log;
  EXPECT_EQ(log.find("a detail"), std::string::npos) << log;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ucp::log
