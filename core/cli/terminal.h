// What the commands print besides their results: one-line errors and a progress line.
//
// Thread-safety: PrintError is for the main thread. A Progress may be updated from any thread
// (ExecutePlan serialises its progress calls); Finish runs after the last update.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>

#include "core/util/status.h"

namespace ucp::cli {

// Prints `ucp <command>: <status>` on one line of stderr (newlines in the message become "; ")
// and returns `exit_code`.
int PrintError(std::string_view command, const Status& status, int exit_code);

// "ucp <command>: 42% 1.1 GiB of 2.6 GiB", redrawn in place on stderr at most ten times a
// second, only when stderr is a terminal; silent otherwise, so scripts and logs see nothing.
class Progress {
 public:
  explicit Progress(std::string command);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Records that `done` of `total` bytes are written.
  void Update(uint64_t done, uint64_t total);
  // A callback for ExecuteOptions::progress; `this` must outlive its use.
  std::function<void(uint64_t, uint64_t)> Callback();
  // Clears the line (when anything was drawn).
  void Finish();

 private:
  std::string command_;
  bool enabled_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
  std::mutex mutex_;
};

// "1.5 GiB", "640 B": bytes for people.
std::string HumanBytes(uint64_t bytes);

}  // namespace ucp::cli
