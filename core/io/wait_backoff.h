// WaitBackoff: the pauses between the looks of a process waiting for something another process
// holds (a FileLock, an OwnerLease). Each pause doubles from 1 ms up to a twentieth of the time
// waited so far, at least 50 ms and at most `max_poll`: what the waiter waits for is seen at most
// about 5% late, and the thousands of ranks of a job waiting minutes for one holder look about
// once per max_poll each, not 20 times a second.
//
// Thread-safety: one waiter's, used by one thread.
#pragma once

#include <algorithm>
#include <chrono>

namespace ucp {

// The longest pause of ucp's own waits.
inline constexpr std::chrono::milliseconds kMaxPoll = std::chrono::seconds(2);

class WaitBackoff {
 public:
  explicit WaitBackoff(std::chrono::milliseconds max_poll = kMaxPoll)
      : start_(std::chrono::steady_clock::now()), max_poll_(max_poll) {}

  // The pause to take now, at `now`; the next one is longer, up to the ceiling above.
  std::chrono::milliseconds Next(std::chrono::steady_clock::time_point now) {
    const std::chrono::milliseconds pause = pause_;
    const auto twentieth_waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - start_) / 20;
    const std::chrono::milliseconds ceiling =
        std::min(std::max(twentieth_waited, std::chrono::milliseconds{50}), max_poll_);
    pause_ = std::min(pause_ * 2, ceiling);
    return pause;
  }

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::milliseconds max_poll_;
  std::chrono::milliseconds pause_{1};
};

}  // namespace ucp
