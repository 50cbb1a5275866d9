// Passed listening sockets (README "Socket activation and --listen-fd"): systemd's LISTEN_PID /
// LISTEN_FDS contract, the checks on a passed descriptor, and a Server serving on one.
#include "psd/listen_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "daemon/server.h"
#include "ops/sd_listen.h"

using psd::server::ops::SdListenFd;

TEST_CASE("systemd socket activation: LISTEN_PID and LISTEN_FDS", "[listen]") {
  CHECK(*SdListenFd(nullptr, nullptr, 42) == -1);
  CHECK(*SdListenFd("42", nullptr, 42) == -1);
  CHECK(*SdListenFd("41", "1", 42) == -1);  // for another process: ignored, as sd_listen_fds does
  CHECK(*SdListenFd("42", "0", 42) == -1);
  CHECK(*SdListenFd("42", "1", 42) == psd::server::ops::kSdListenFdsStart);
  auto two = SdListenFd("42", "2", 42);
  REQUIRE_FALSE(two.ok());
  CHECK_THAT(two.status().message(), Catch::Contains("give the .socket unit a single ListenStream="));
  CHECK_FALSE(SdListenFd("x", "1", 42).ok());
  CHECK_FALSE(SdListenFd("42", "-1", 42).ok());
  CHECK_FALSE(SdListenFd("42", "", 42).ok());
}

TEST_CASE("a passed descriptor must be a listening TCP socket", "[listen]") {
  auto closed = psd::InspectListeningSocket(1000, "--listen-fd 1000");
  REQUIRE_FALSE(closed.ok());
  CHECK_THAT(closed.status().message(), Catch::Contains("--listen-fd 1000: descriptor 1000 is not open"));

  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  auto pipe = psd::InspectListeningSocket(pipe_fds[0], "--listen-fd 5");
  CHECK_THAT(pipe.status().message(), Catch::Contains("is not a socket"));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);

  int udp = ::socket(AF_INET, SOCK_DGRAM, 0);
  REQUIRE(udp >= 0);
  CHECK_THAT(psd::InspectListeningSocket(udp, "x").status().message(), Catch::Contains("is not a TCP socket"));
  ::close(udp);

  int tcp = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(tcp >= 0);
  CHECK_THAT(psd::InspectListeningSocket(tcp, "x").status().message(), Catch::Contains("is not listening"));
  ::close(tcp);

  psd::SocketAddress bound;
  auto fd = psd::ListenTcp("127.0.0.1", 0, &bound);
  REQUIRE(fd.ok());
  CHECK(bound.ip == "127.0.0.1");
  CHECK(bound.port != 0);
  CHECK((::fcntl(*fd, F_GETFD) & FD_CLOEXEC) != 0);
  auto seen = psd::InspectListeningSocket(*fd, "x");
  REQUIRE(seen.ok());
  CHECK(seen->ToString() == bound.ToString());
  ::close(*fd);
}

TEST_CASE("a passed socket must be bound where psd is to listen", "[listen]") {
  psd::SocketAddress loop{"127.0.0.1", 7071}, any{"0.0.0.0", 7071}, v6{"::1", 7071};
  CHECK(psd::CheckListenAddress(loop, "127.0.0.1", 7071, "x").ok());
  CHECK(psd::CheckListenAddress(loop, "127.0.0.1", 0, "x").ok());  // port 0: any port
  CHECK(psd::CheckListenAddress(any, "::", 7071, "x").ok());       // a wildcard serves a wildcard
  CHECK(psd::CheckListenAddress(v6, "::0001", 7071, "x").ok());    // compared as addresses
  CHECK(v6.ToString() == "[::1]:7071");
  auto port = psd::CheckListenAddress(loop, "127.0.0.1", 7072, "--listen-fd 3");
  CHECK_THAT(port.message(), Catch::Contains("--listen-fd 3 is bound to 127.0.0.1:7071, but psd is to listen on "
                                             "127.0.0.1:7072"));
  CHECK_FALSE(psd::CheckListenAddress(any, "127.0.0.1", 7071, "x").ok());
  CHECK_FALSE(psd::CheckListenAddress(loop, "0.0.0.0", 7071, "x").ok());
}

TEST_CASE("a Server serves on a passed socket, and owns it", "[listen]") {
  psd::SocketAddress bound;
  auto fd = psd::ListenTcp("127.0.0.1", 0, &bound);
  REQUIRE(fd.ok());
  psd::server::ServerConfig cfg;
  cfg.port = 0;
  cfg.summary_interval_s = 0;
  cfg.listen_fd = *fd;
  auto s = psd::server::Server::Create(cfg);
  REQUIRE(s.ok());
  auto server = std::move(*s);
  REQUIRE(server->Start().ok());
  CHECK(server->port() == bound.port);
  server->Stop();
  server.reset();
  CHECK(::fcntl(*fd, F_GETFD) == -1);  // closed with the Server

  // Refused (bound elsewhere than --port): closed as well, and the error says both addresses.
  auto other = psd::ListenTcp("127.0.0.1", 0, &bound);
  REQUIRE(other.ok());
  cfg.listen_fd = *other;
  cfg.port = static_cast<uint16_t>(bound.port == 65535 ? 1 : bound.port + 1);
  auto refused = psd::server::Server::Create(cfg);
  REQUIRE(refused.ok());
  auto st = (*refused)->Start();
  CHECK_THAT(st.message(), Catch::Contains("is bound to " + bound.ToString()));
  CHECK(::fcntl(*other, F_GETFD) == -1);
}
