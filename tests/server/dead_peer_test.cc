// A worker's host that dies sends no FIN: psd notices it by TCP keepalive, set on every accepted
// connection (net/connection.h, Connection::DetectDeadPeer).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "net/connection.h"

using psd::server::Connection;

namespace {

int Option(int fd, int level, int name) {
  int v = -1;
  socklen_t len = sizeof(v);
  REQUIRE(::getsockopt(fd, level, name, &v, &len) == 0);
  return v;
}

}  // namespace

TEST_CASE("a connection asks the kernel to notice a peer whose host died", "[net]") {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  CHECK(Option(fd, SOL_SOCKET, SO_KEEPALIVE) == 0);  // off by default: a dead host went unnoticed
  CHECK(Connection::DetectDeadPeer(fd));
  CHECK(Option(fd, SOL_SOCKET, SO_KEEPALIVE) == 1);
  CHECK(Option(fd, IPPROTO_TCP, TCP_KEEPIDLE) == Connection::kKeepAliveIdleS);
  CHECK(Option(fd, IPPROTO_TCP, TCP_KEEPINTVL) == Connection::kKeepAliveIntervalS);
  CHECK(Option(fd, IPPROTO_TCP, TCP_KEEPCNT) == Connection::kKeepAliveProbes);
  // No TCP_USER_TIMEOUT: it would end a worker's connection whose zero window lasts that long.
  CHECK(Option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT) == 0);
  ::close(fd);
}
