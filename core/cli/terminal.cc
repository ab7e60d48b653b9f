#include "core/cli/terminal.h"

#include <unistd.h>

#include <cstdio>
#include <iostream>

namespace ucp::cli {

int PrintError(std::string_view command, const Status& status, int exit_code) {
  std::string line = status.ToString();
  for (size_t at = line.find('\n'); at != std::string::npos; at = line.find('\n', at)) {
    line.replace(at, 1, "; ");
  }
  std::cerr << "ucp " << command << ": " << line << "\n";
  return exit_code;
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f %s", value, kUnits[unit]);
  return text;
}

Progress::Progress(std::string command)
    : command_(std::move(command)), enabled_(::isatty(STDERR_FILENO) == 1) {}

void Progress::Update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  drawn_ = true;
  const unsigned percent = total == 0 ? 100 : static_cast<unsigned>(done * 100.0 / total);
  std::fprintf(stderr, "\r\033[Kucp %s: %3u%% %s of %s", command_.c_str(), percent,
               HumanBytes(done).c_str(), HumanBytes(total).c_str());
  std::fflush(stderr);
}

std::function<void(uint64_t, uint64_t)> Progress::Callback() {
  return [this](uint64_t done, uint64_t total) { Update(done, total); };
}

void Progress::Finish() {
  std::lock_guard lock(mutex_);
  if (!drawn_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  drawn_ = false;
}

}  // namespace ucp::cli
