// Listening sockets handed from a launcher to psd (README "Socket activation and --listen-fd"):
// a launcher (psrun, a test, systemd) binds the data port itself — port 0 lets the kernel pick a
// free one, with no guessing and no race — and passes the listening socket to psd, which serves
// on it instead of binding its own. Plain POSIX sockets; no state, thread-safe.
#ifndef PSD_LISTEN_SOCKET_H_
#define PSD_LISTEN_SOCKET_H_

#include <cstdint>
#include <string>

#include "psd/status.h"

namespace psd {

// Where a socket is bound: an IP address as text ("127.0.0.1", "::", "0.0.0.0") and a port.
struct SocketAddress {
  std::string ip;
  uint16_t port = 0;
  bool wildcard() const { return ip == "0.0.0.0" || ip == "::"; }
  std::string ToString() const;  // "127.0.0.1:7070", "[::1]:7070"
};

// Binds a TCP socket to ip:port (port 0: the kernel picks a free one) and listens. Returns its
// descriptor (close-on-exec; the caller owns it) and, in *bound, the address the kernel gave.
// `reuse_port` sets SO_REUSEPORT before binding (see tests/e2e/listen.py for why a test wants it).
// Errors name the address and the reason.
Result<int> ListenTcp(const std::string& ip, uint16_t port, SocketAddress* bound, bool reuse_port = false);

// What a passed descriptor is bound to, after checking that it is an open, listening TCP socket
// (IPv4 or IPv6). `what` names its source in errors ("--listen-fd 3", "LISTEN_FDS").
Result<SocketAddress> InspectListeningSocket(int fd, const std::string& what);

// Whether a socket bound to `bound` serves the listen address host:port that psd's flags (or its
// own --cluster entry) ask for: the same port (port 0 asks for none in particular) and the same
// IP, where a wildcard socket (0.0.0.0, ::) serves a wildcard host. The error says both addresses
// and what to change.
Status CheckListenAddress(const SocketAddress& bound, const std::string& host, uint16_t port, const std::string& what);

}  // namespace psd

#endif  // PSD_LISTEN_SOCKET_H_
