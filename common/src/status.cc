#include "psd/status.h"

namespace psd {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case Code::kNotFound:
      return "NOT_FOUND";
    case Code::kAlreadyExists:
      return "ALREADY_EXISTS";
    case Code::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case Code::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case Code::kUnavailable:
      return "UNAVAILABLE";
    case Code::kCancelled:
      return "CANCELLED";
    case Code::kOutOfRange:
      return "OUT_OF_RANGE";
    case Code::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case Code::kInternal:
      return "INTERNAL";
    case Code::kUnauthenticated:
      return "UNAUTHENTICATED";
    case Code::kAborted:
      return "ABORTED";
    case Code::kUnimplemented:
      return "UNIMPLEMENTED";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

}  // namespace psd
