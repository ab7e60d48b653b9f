// Status and Result<T>: how every layer below the libc/NCCL boundary reports failure.
//
// No exceptions cross ucp's layers. A function that can fail returns Status (nothing else to
// return) or Result<T>. Messages name the operation and the object, e.g.
//   "zip: central directory of /ckpt/global_step5/mp_rank_00_model_states.pt: truncated".
// errno is turned into a Status in exactly one place, PosixError().
//
// Thread-safety: values; no shared state.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ucp {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the caller's input is malformed (bad config value, bad CLI argument)
  kNotFound,          // a named file, record, key or tensor does not exist
  kCorrupt,           // bytes on disk violate their format (truncated, overlapping, bad checksum)
  kUnsupported,       // well-formed but outside what ucp handles (e.g. compressed zip records)
  kOutOfRange,        // arithmetic or a limit overflowed (sizes, depths, counts)
  kIoError,           // a system call failed; the message carries strerror and the path
  kFailedPrecondition,  // the operation is not valid in the current state
  kInternal,          // a bug in ucp
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "corrupt: zip: ...", or "ok".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>", keeping the code.
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// The single errno → Status mapping: "<context>: <strerror(err)>". ENOENT maps to kNotFound,
// everything else to kIoError. Never reads or changes errno itself.
Status PosixError(std::string_view context, int err);

// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : value_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(value_).ok() && "Result built from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(value_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(value_);
  }
  T& value() & { return std::get<T>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> value_;
};

}  // namespace ucp

#define UCP_STATUS_CONCAT_INNER(a, b) a##b
#define UCP_STATUS_CONCAT(a, b) UCP_STATUS_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK.
#define UCP_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::ucp::Status ucp_status_tmp_ = (expr);            \
    if (!ucp_status_tmp_.ok()) return ucp_status_tmp_; \
  } while (0)

// `UCP_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or returns its Status.
#define UCP_ASSIGN_OR_RETURN(lhs, expr) \
  UCP_ASSIGN_OR_RETURN_IMPL(UCP_STATUS_CONCAT(ucp_result_tmp_, __LINE__), lhs, expr)
#define UCP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
