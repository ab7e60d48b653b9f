#include "core/util/status.h"

#include <cstring>

namespace ucp {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kIoError: return "I/O error";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string message(context);
  message += ": ";
  message += message_;
  return Status(code_, std::move(message));
}

Status PosixError(std::string_view context, int err) {
  char buffer[256];
  // GNU strerror_r returns the message pointer (possibly not `buffer`).
  const char* text = strerror_r(err, buffer, sizeof(buffer));
  std::string message(context);
  message += ": ";
  message += text;
  return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError, std::move(message));
}

}  // namespace ucp
