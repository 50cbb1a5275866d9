// Status and Result<T>: errors as values, shared by psd and libpsclient.
//
// A Status is a code that tells the caller what to do (retry, back off, fix the request, give up)
// plus a human-readable message. Result<T> holds either a T or a non-OK Status.
// Thread-safety: plain values; no shared state.
#ifndef PSD_STATUS_H_
#define PSD_STATUS_H_

#include <cassert>
#include <optional>
#include <string>
#include <utility>

#include "psd/export.h"

namespace psd {

// Mirrors the wire enum `Code` in schema/psd.capnp (same order, same values).
enum class Code {
  kOk = 0,
  kInvalidArgument = 1,     // fix the request; retrying will not help
  kNotFound = 2,            // unknown variable or slot
  kAlreadyExists = 3,       // the name exists with a different definition
  kFailedPrecondition = 4,  // out of order (e.g. a call before the handshake)
  kDeadlineExceeded = 5,    // a wait ran past its deadline; nothing was lost; retry
  kUnavailable = 6,         // daemon not reachable or not ready; back off and retry
  kCancelled = 7,           // the daemon is shutting down
  kOutOfRange = 8,          // the token queue is closed: training is over
  kResourceExhausted = 9,   // a frame too big, too many connections
  kInternal = 10,           // a bug
  kUnimplemented = 11,      // not supported by this build/daemon
  kUnauthenticated = 12,    // missing or wrong credentials
  kAborted = 13,            // the cluster restored a checkpoint: re-read the step and the values, go on
};

PSD_EXPORT const char* CodeName(Code code);

class PSD_EXPORT Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: Shape mismatch: ..." (or "OK").
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status Cancelled(std::string m) { return {Code::kCancelled, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
inline Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {Code::kUnimplemented, std::move(m)}; }
inline Status Unauthenticated(std::string m) { return {Code::kUnauthenticated, std::move(m)}; }
inline Status Aborted(std::string m) { return {Code::kAborted, std::move(m)}; }

// Either a value or an error. Accessing value() of an error is a programming error (asserts).
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}                                  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) { assert(!status_.ok()); }  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace psd

#define PSD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::psd::Status psd_status_ = (expr);        \
    if (!psd_status_.ok()) return psd_status_; \
  } while (0)

#endif  // PSD_STATUS_H_
