#include "psd/listen_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace psd {
namespace {

std::string Errno(int err) { return std::strerror(err); }

// The text form of a sockaddr's IP and its port.
SocketAddress FromSockaddr(const sockaddr_storage& ss) {
  SocketAddress a;
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    a.port = ntohs(v4->sin_port);
  } else {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    a.port = ntohs(v6->sin6_port);
  }
  a.ip = text;
  return a;
}

}  // namespace

std::string SocketAddress::ToString() const {
  std::string host = ip.find(':') != std::string::npos ? "[" + ip + "]" : ip;
  return host + ":" + std::to_string(port);
}

Result<int> ListenTcp(const std::string& ip, uint16_t port, SocketAddress* bound, bool reuse_port) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    len = sizeof(sockaddr_in6);
  } else {
    return InvalidArgument("'" + ip + "' is not an IP address to listen on");
  }
  std::string where = SocketAddress{ip, port}.ToString();
  int fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable("cannot listen on " + where + ": socket: " + Errno(errno));
  int one = 1;
  bool ok = ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
            (!reuse_port || ::setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) == 0) &&
            ::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0 && ::listen(fd, SOMAXCONN) == 0;
  socklen_t got = sizeof(ss);
  ok = ok && ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &got) == 0;
  if (!ok) {
    int err = errno;
    ::close(fd);
    return Unavailable("cannot listen on " + where + ": " + Errno(err));
  }
  if (bound != nullptr) *bound = FromSockaddr(ss);
  return fd;
}

Result<SocketAddress> InspectListeningSocket(int fd, const std::string& what) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    return InvalidArgument(what + ": descriptor " + std::to_string(fd) +
                           " is not open in psd; the launcher must pass its listening socket as that descriptor");
  }
  if (!S_ISSOCK(st.st_mode)) {
    return InvalidArgument(what + ": descriptor " + std::to_string(fd) +
                           " is not a socket; pass a listening TCP socket (bound by the launcher)");
  }
  int type = 0, domain = 0, listening = 0;
  socklen_t len = sizeof(int);
  bool known = ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0;
  len = sizeof(int);
  known = known && ::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0;
  len = sizeof(int);
  known = known && ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0;
  if (!known) return InvalidArgument(what + ": cannot inspect descriptor " + std::to_string(fd) + ": " + Errno(errno));
  if (type != SOCK_STREAM || (domain != AF_INET && domain != AF_INET6)) {
    return InvalidArgument(what + ": descriptor " + std::to_string(fd) +
                           " is not a TCP socket (IPv4 or IPv6); psd serves TCP only");
  }
  if (listening == 0) {
    return InvalidArgument(what + ": the socket of descriptor " + std::to_string(fd) +
                           " is not listening; the launcher must bind and listen() before passing it");
  }
  sockaddr_storage ss{};
  socklen_t got = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &got) != 0) {
    return InvalidArgument(what + ": getsockname: " + Errno(errno));
  }
  return FromSockaddr(ss);
}

Status CheckListenAddress(const SocketAddress& bound, const std::string& host, uint16_t port, const std::string& what) {
  bool host_wildcard = host == "0.0.0.0" || host == "::";
  bool same_ip = bound.ip == host || (bound.wildcard() && host_wildcard);
  if (!same_ip) {
    // Compare as addresses, so that e.g. "::0001" and "::1" agree.
    in6_addr a{}, b{};
    int fam = bound.ip.find(':') != std::string::npos ? AF_INET6 : AF_INET;
    same_ip = inet_pton(fam, bound.ip.c_str(), &a) == 1 && inet_pton(fam, host.c_str(), &b) == 1 &&
              std::memcmp(&a, &b, fam == AF_INET6 ? sizeof(in6_addr) : sizeof(in_addr)) == 0;
  }
  if (same_ip && (port == 0 || bound.port == port)) return Status::Ok();
  return InvalidArgument(what + " is bound to " + bound.ToString() + ", but psd is to listen on " +
                         SocketAddress{host, port}.ToString() +
                         " (its --host/--port, or this shard's --cluster entry): bind the socket to that address, "
                         "or fix the flags");
}

}  // namespace psd
