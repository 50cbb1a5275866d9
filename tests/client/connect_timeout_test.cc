// Client::Connect is bounded by ClientOptions::connect_timeout_ms from resolve to hello (issue 11
// item 8). Deterministic stand-ins for a daemon that never answers: a listener whose accept
// queue is full (Linux drops the SYN, so the TCP connect itself never completes) and a listener
// that accepts at the kernel level but never answers the hello.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "psclient/client.h"
#include "support/test_server.h"

namespace {

// A listener on 127.0.0.1:0 that never accepts.
struct Listener {
  explicit Listener(int backlog) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    REQUIRE(::listen(fd, backlog) == 0);
    socklen_t len = sizeof(a);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    addr = a;
    port = ntohs(a.sin_port);
  }
  ~Listener() {
    for (int c : clients) ::close(c);
    ::close(fd);
  }
  // Connections waiting in the accept queue (TCP_INFO of a listener: tcpi_unacked).
  unsigned Queued() const {
    tcp_info info{};
    socklen_t len = sizeof(info);
    REQUIRE(::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0);
    return info.tcpi_unacked;
  }
  // Fills the accept queue (backlog 0: one connection fills it) and waits until the kernel has
  // queued it, so the next SYN is dropped.
  void Fill() {
    int c = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(c >= 0);
    clients.push_back(c);
    REQUIRE(::connect(c, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
    for (int i = 0; i < 100000 && Queued() < 1; ++i) std::this_thread::yield();
    REQUIRE(Queued() >= 1);
  }
  int fd = -1;
  sockaddr_in addr{};
  uint16_t port = 0;
  std::vector<int> clients;
};

psclient::ClientOptions Options(uint16_t port, int connect_timeout_ms) {
  psclient::ClientOptions o;
  o.port = port;
  o.worker_name = "w";
  o.connect_timeout_ms = connect_timeout_ms;
  o.request_timeout_ms = 600000;  // the old, unbounded hello would wait this long
  return o;
}

// Connect with a 300 ms connect timeout; it must fail with kUnavailable, long before the old
// unbounded waits (the kernel's SYN retries, request_timeout_ms) would end. Returns the message.
std::string FailedConnect(uint16_t port) {
  auto t0 = std::chrono::steady_clock::now();
  auto c = psclient::Client::Connect(Options(port, 300));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_FALSE(c.ok());
  INFO(c.status().ToString() << " after " << s << " s");
  CHECK(c.status().code() == psd::Code::kUnavailable);
  CHECK(s < 30);  // a loose bound: 300 ms are expected
  return c.status().message();
}

}  // namespace

TEST_CASE("a connect that is never accepted gives up at connect_timeout_ms", "[client][races]") {
  Listener l(0);
  l.Fill();
  CHECK_THAT(FailedConnect(l.port), Catch::Contains("not accepted within the connect deadline") &&
                                        Catch::Contains("ClientOptions::connect_timeout_ms = 300 ms"));
}

TEST_CASE("a daemon that accepts but never answers the hello costs at most connect_timeout_ms", "[client][races]") {
  Listener l(16);
  CHECK_THAT(FailedConnect(l.port), Catch::Contains("did not answer its hello in time"));
}

TEST_CASE("a host name is resolved within the connect deadline", "[client][races]") {
  auto server = psd::testing::StartServer(psd::testing::TestConfig(1));
  psclient::ClientOptions o = Options(server->port(), 5000);
  o.host = "localhost";
  auto c = psclient::Client::Connect(o);
  INFO(c.status().ToString());
  CHECK(c.ok());
}
