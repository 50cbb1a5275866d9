// Resolve + TCP connect bounded by a deadline (ClientOptions::connect_timeout_ms).
#ifndef PSCLIENT_SRC_CONNECT_H_
#define PSCLIENT_SRC_CONNECT_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "psd/status.h"
#include "wire/asio.h"

namespace psclient::internal {

// Connects `socket` (closed or fresh, of `socket`'s io_context) to host:port before `deadline`.
// An IP address needs no lookup; a name is looked up by the system resolver on a helper thread,
// which is abandoned (it finishes on its own) if the deadline passes first. Each address the
// name has is tried in turn with a non-blocking connect waited on with poll(), so a host that
// never answers (packets dropped, a full accept queue) costs at most the time left.
// Errors: kUnavailable, naming host:port and what failed ("within the connect deadline" when
// time ran out). The socket is left blocking, as asio::connect leaves it.
psd::Status ConnectBefore(psd::tcp::socket& socket, const std::string& host, uint16_t port,
                          std::chrono::steady_clock::time_point deadline);

// Reads a short answer (at most 512 bytes) from `fd` until its end, or until `deadline`:
// what was read, or a description of what went wrong. With `passed`, the descriptors that came
// with it go there (the caller owns them), at most kMaxAnswerFds; any other is closed.
inline constexpr size_t kMaxAnswerFds = 5;
std::string ReadAnswer(int fd, std::chrono::steady_clock::time_point deadline, std::vector<int>* passed = nullptr);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_CONNECT_H_
