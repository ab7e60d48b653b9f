// TEST ONLY: arms core/io's fault injection (core/io/fault_injection.h) from the environment.
// Linked into libucp_faults.so (the objects of libucp.so plus this file); never part of
// libucp.so, which reads no such variable.
//
//   UCP_TEST_FAULTS="PHASE:OP:KIND[:FIRST[:COUNT]],..."
//     PHASE  index | atoms | view | journal | durable   (IoPhaseName)
//     OP     open | read | write | sync | rename | lock (IoOpName)
//     KIND   ENOSPC | EIO | EINTR | ENOLCK: the call fails with that errno;
//            short (read and write only): the call moves half the bytes asked for (at least 1)
//     FIRST  the first matching call that faults, counting from 1 (default 1)
//     COUNT  how many matching calls in a row fault from FIRST on; 0: all of them (default 1).
//            The retry of a call an EINTR interrupted always goes through (EINTR on every call
//            would never end), so EINTR:1:0 interrupts every other call.
//   UCP_TEST_FAULTS_LOG=/abs/file: one line per injected fault, "PHASE OP KIND PATH".
// A malformed specification aborts the process with a message on stderr.

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/io/fault_injection.h"
#include "core/util/reentrancy_guard.h"

namespace {

struct Rule {
  ucp::IoPhase phase;
  ucp::IoOp op;
  int error;  // 0: short
  std::string kind;
  uint64_t first;
  uint64_t count;
  std::atomic<uint64_t> seen{0};
  std::atomic<bool> interrupted{false};  // the last call this rule saw was interrupted
};

[[noreturn]] void Refuse(const std::string& spec, const std::string& why) {
  std::fprintf(stderr, "UCP_TEST_FAULTS: \"%s\": %s\n", spec.c_str(), why.c_str());
  std::abort();
}

std::vector<std::string> Split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t end = text.find(separator, start);
    parts.emplace_back(text.substr(start, end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

uint64_t Number(const std::string& spec, const std::string& text) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0') Refuse(spec, "\"" + text + "\" is not a number");
  return value;
}

std::unique_ptr<Rule> ParseRule(const std::string& spec) {
  const std::vector<std::string> fields = Split(spec, ':');
  if (fields.size() < 3 || fields.size() > 5)
    Refuse(spec, "expected PHASE:OP:KIND[:FIRST[:COUNT]]");
  auto rule = std::make_unique<Rule>();
  bool found = false;
  for (int p = 0; p < ucp::kIoPhaseCount && !found; ++p) {
    rule->phase = static_cast<ucp::IoPhase>(p);
    found = ucp::IoPhaseName(rule->phase) == fields[0];
  }
  if (!found) Refuse(spec, "unknown phase " + fields[0]);
  found = false;
  for (int o = 0; o < ucp::kIoOpCount && !found; ++o) {
    rule->op = static_cast<ucp::IoOp>(o);
    found = ucp::IoOpName(rule->op) == fields[1];
  }
  if (!found) Refuse(spec, "unknown operation " + fields[1]);
  rule->kind = fields[2];
  if (rule->kind == "ENOSPC") {
    rule->error = ENOSPC;
  } else if (rule->kind == "EIO") {
    rule->error = EIO;
  } else if (rule->kind == "EINTR") {
    rule->error = EINTR;
  } else if (rule->kind == "ENOLCK") {
    rule->error = ENOLCK;
  } else if (rule->kind == "short") {
    if (rule->op != ucp::IoOp::kRead && rule->op != ucp::IoOp::kWrite) {
      Refuse(spec, "a short transfer needs read or write");
    }
    rule->error = 0;
  } else {
    Refuse(spec, "unknown kind " + rule->kind);
  }
  rule->first = fields.size() > 3 ? Number(spec, fields[3]) : 1;
  rule->count = fields.size() > 4 ? Number(spec, fields[4]) : 1;
  if (rule->first == 0) Refuse(spec, "FIRST counts from 1");
  return rule;
}

class EnvironmentInjector : public ucp::IoFaultInjector {
 public:
  EnvironmentInjector(const char* spec, const char* log) {
    for (const std::string& part : Split(spec, ',')) {
      if (!part.empty()) rules_.push_back(ParseRule(part));
    }
    if (log != nullptr && *log != '\0') {
      log_fd_ = ::open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
      if (log_fd_ < 0) Refuse(log, "cannot open UCP_TEST_FAULTS_LOG");
    }
  }

  ucp::IoFault Decide(ucp::IoPhase phase, ucp::IoOp op, std::string_view path,
                      size_t bytes) noexcept override {
    // Every rule counts every call it matches, whether or not an earlier rule fires on it.
    const Rule* firing = nullptr;
    for (const std::unique_ptr<Rule>& rule : rules_) {
      if (rule->phase != phase || rule->op != op) continue;
      const uint64_t call = ++rule->seen;
      if (call < rule->first || (rule->count != 0 && call >= rule->first + rule->count)) continue;
      if (rule->error == EINTR && rule->interrupted.exchange(false)) continue;
      if (firing == nullptr) {
        firing = rule.get();
        if (rule->error == EINTR) rule->interrupted = true;
      }
    }
    if (firing == nullptr) return {};
    Log(*firing, path);
    ucp::IoFault fault;
    if (firing->error != 0) {
      fault.error = firing->error;
    } else {
      fault.max_bytes = bytes / 2;
    }
    return fault;
  }

 private:
  void Log(const Rule& rule, std::string_view path) const noexcept {
    if (log_fd_ < 0) return;
    ucp::ReentrancyGuard guard;
    std::string line;
    line.append(ucp::IoPhaseName(rule.phase)).append(" ").append(ucp::IoOpName(rule.op));
    line.append(" ").append(rule.kind).append(" ").append(path).append("\n");
    // One write of a short line to an O_APPEND file: whole, whatever other threads log.
    (void)!::write(log_fd_, line.data(), line.size());
  }

  std::vector<std::unique_ptr<Rule>> rules_;
  int log_fd_ = -1;
};

struct Installer {
  Installer() {
    const char* spec = std::getenv("UCP_TEST_FAULTS");
    if (spec == nullptr || *spec == '\0') return;
    // Lives as long as the process: I/O may run during the other objects' destruction.
    ucp::SetIoFaultInjector(new EnvironmentInjector(spec, std::getenv("UCP_TEST_FAULTS_LOG")));
  }
} installer;

}  // namespace
