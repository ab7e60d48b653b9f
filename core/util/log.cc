#include "core/util/log.h"

#include <spdlog/logger.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <new>

#include "core/util/reentrancy_guard.h"

namespace ucp::log {
namespace {

struct LogState {
  std::mutex mutex;
  std::atomic<int> level{static_cast<int>(Level::kOff)};
  Level configured_level = Level::kOff;
  std::string directory;
  // Raw pointer on purpose: loggers are never destroyed, since wrappers may log during process
  // teardown, after static destructors ran (LevelDB's NoDestructor idea).
  spdlog::logger* logger = nullptr;
  bool shut_down = false;
};

LogState*& StatePointer() {
  static LogState* state = new LogState();
  return state;
}

LogState& State() { return *StatePointer(); }

spdlog::level::level_enum ToSpdlog(Level level) {
  switch (level) {
    case Level::kTrace:
      return spdlog::level::trace;
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::off;
}

// Creates the per-process logger on first use. Caller holds state.mutex and a guard.
spdlog::logger* EnsureLogger(LogState& state) {
  if (state.logger != nullptr || state.directory.empty()) return state.logger;
  try {
    const std::string path = state.directory + "/ucp." + std::to_string(::getpid()) + ".log";
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    state.logger = new spdlog::logger("ucp", std::move(sink));
    state.logger->set_level(ToSpdlog(state.configured_level));
    state.logger->set_pattern("%Y-%m-%dT%H:%M:%S.%f %P/%t %l %v");
    // Info and above reach the file at once: a trainer process often ends without ucp's
    // shutdown (gloo's threads abort at interpreter exit), and its builds' lines would be lost.
    // Debug and trace lines wait for the next of them.
    state.logger->flush_on(spdlog::level::info);
  } catch (...) {
    // An unwritable log directory turns logging off; it never affects the host.
    state.directory.clear();
    state.level.store(static_cast<int>(Level::kOff), std::memory_order_relaxed);
  }
  return state.logger;
}

}  // namespace

bool ParseLevel(std::string_view text, Level* level) {
  static constexpr std::pair<std::string_view, Level> kNames[] = {
      {"trace", Level::kTrace}, {"debug", Level::kDebug}, {"info", Level::kInfo},
      {"warn", Level::kWarn},   {"error", Level::kError}, {"off", Level::kOff},
  };
  for (const auto& [name, value] : kNames) {
    if (text == name) {
      *level = value;
      return true;
    }
  }
  return false;
}

void Configure(Level level, const std::string& directory) {
  ReentrancyGuard guard;
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.shut_down) return;
  state.configured_level = level;
  state.directory = directory;
  state.logger = nullptr;  // a new directory or pid gets a new file; the old logger is leaked
  const Level effective = directory.empty() ? Level::kOff : level;
  state.level.store(static_cast<int>(effective), std::memory_order_release);
}

bool Enabled(Level level) noexcept {
  return static_cast<int>(level) >= State().level.load(std::memory_order_acquire) &&
         level != Level::kOff;
}

void Write(Level level, std::string_view message) noexcept {
  ReentrancyGuard guard;
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.shut_down || !Enabled(level)) return;
  spdlog::logger* logger = EnsureLogger(state);
  if (logger == nullptr) return;
  try {
    logger->log(ToSpdlog(level), message);
  } catch (...) {
  }
}

void Flush() noexcept {
  ReentrancyGuard guard;
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.logger == nullptr) return;
  try {
    state.logger->flush();
  } catch (...) {
  }
}

void Shutdown() noexcept {
  Flush();
  ReentrancyGuard guard;
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.shut_down = true;
  state.level.store(static_cast<int>(Level::kOff), std::memory_order_release);
}

void ResetAfterFork() noexcept {
  ReentrancyGuard guard;
  // The parent's mutex may be held by a thread that does not exist in the child: start over
  // with a fresh state and leak the old one. Only one thread runs in a child right after fork.
  LogState& old_state = State();
  auto* fresh = new (std::nothrow) LogState();
  if (fresh == nullptr) return;
  fresh->configured_level = old_state.configured_level;
  fresh->directory = old_state.directory;
  fresh->shut_down = old_state.shut_down;
  fresh->level.store(old_state.level.load(std::memory_order_relaxed), std::memory_order_relaxed);
  StatePointer() = fresh;
}

}  // namespace ucp::log
