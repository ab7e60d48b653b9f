// Logging: per-process files through spdlog, never the host's stdout/stderr.
//
// Call order: Configure() once (the preload's constructor, or a CLI's main); before that, and
// when no directory is configured, messages are dropped. Every entry point enters a
// ReentrancyGuard, because spdlog's file sink calls fopen/fwrite, which ucp hooks.
//
// Thread-safety: all functions may be called from any thread at any time; Shutdown() flushes and
// turns logging off for good (the destructor calls it before the process tears down).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace ucp::log {

enum class Level { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Parses "trace|debug|info|warn|error|off"; false for anything else.
bool ParseLevel(std::string_view text, Level* level);

// Opens `<directory>/ucp.<pid>.log` (created on first message). An empty directory leaves
// logging off. Safe to call again (after fork, the child gets its own file).
void Configure(Level level, const std::string& directory);

bool Enabled(Level level) noexcept;
void Write(Level level, std::string_view message) noexcept;
void Flush() noexcept;
void Shutdown() noexcept;

// In a child after fork(): forget the parent's logger without touching its locks (another
// thread may have held them at the fork), and log to the child's own file from now on.
void ResetAfterFork() noexcept;

}  // namespace ucp::log

// Formatting can only throw std::bad_alloc; a log line is never worth failing a hooked call.
#define UCP_LOG(level, ...)                                       \
  do {                                                            \
    if (::ucp::log::Enabled(level)) {                             \
      try {                                                       \
        ::ucp::log::Write(level, ::fmt::format(__VA_ARGS__));     \
      } catch (...) {                                             \
      }                                                           \
    }                                                             \
  } while (0)
#define UCP_LOG_TRACE(...) UCP_LOG(::ucp::log::Level::kTrace, __VA_ARGS__)
#define UCP_LOG_DEBUG(...) UCP_LOG(::ucp::log::Level::kDebug, __VA_ARGS__)
#define UCP_LOG_INFO(...) UCP_LOG(::ucp::log::Level::kInfo, __VA_ARGS__)
#define UCP_LOG_WARN(...) UCP_LOG(::ucp::log::Level::kWarn, __VA_ARGS__)
#define UCP_LOG_ERROR(...) UCP_LOG(::ucp::log::Level::kError, __VA_ARGS__)
