#include "fuzz_support.h"

#include <kj/exception.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace psd::fuzz {

void MakeSocketPair(asio::io_context& io, tcp::socket* psd_end, tcp::socket* peer_end) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::perror("socketpair");
    std::abort();
  }
  // Room for a whole input and its replies without blocking either side.
  int buf = 4 << 20;
  ::setsockopt(fds[1], SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fds[0], SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  boost::system::error_code ec;
  *psd_end = tcp::socket(io);
  *peer_end = tcp::socket(io);
  psd_end->assign(tcp::v4(), fds[0], ec);
  if (!ec) peer_end->assign(tcp::v4(), fds[1], ec);
  if (!ec) peer_end->non_blocking(true, ec);
  if (ec) {
    std::fprintf(stderr, "assigning a socketpair: %s\n", ec.message().c_str());
    std::abort();
  }
}

void Feed(tcp::socket& peer_end, const uint8_t* data, size_t size) {
  size = std::min(size, kMaxInputBytes);
  boost::system::error_code ec;
  while (size > 0) {
    size_t n = peer_end.write_some(asio::buffer(data, size), ec);
    if (ec) break;  // buffer full (cannot happen below kMaxInputBytes) or the reader closed
    data += n;
    size -= n;
  }
  peer_end.shutdown(tcp::socket::shutdown_send, ec);
}

size_t Drain(tcp::socket& peer_end) {
  static std::vector<uint8_t> scratch(1 << 16);
  size_t total = 0;
  for (;;) {
    boost::system::error_code ec;
    size_t n = peer_end.read_some(asio::buffer(scratch), ec);
    if (ec || n == 0) return total;
    total += n;
  }
}

void ForEachFrame(const uint8_t* data, size_t size, uint64_t max_frame_bytes, int max_frames,
                  const std::function<void(capnp::MessageReader&)>& on_frame) {
  asio::io_context io;
  tcp::socket psd_end(io), peer_end(io);
  MakeSocketPair(io, &psd_end, &peer_end);
  Feed(peer_end, data, size);
  wire::InFrame in;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (int i = 0; i < max_frames; ++i) {
    Status s = wire::ReadFrame(psd_end, in, max_frame_bytes, deadline, "the fuzz target's frame limit");
    if (!s.ok()) return;
    try {
      auto reader = in.Reader();
      on_frame(*reader);
    } catch (const kj::Exception&) {
      // Malformed message: psd answers INVALID_ARGUMENT and goes on with the next frame.
    }
    in.MaybeRelease(1 << 20);
  }
}

server::ServerConfig FuzzConfig() {
  server::ServerConfig c;
  c.host = "127.0.0.1";
  c.port = 0;
  c.io_threads = 1;
  c.max_frame_bytes = 1 << 20;
  c.max_model_bytes = 4 << 20;
  c.worker_grace_s = 0;
  c.summary_interval_s = 0;
  return c;
}

std::unique_ptr<server::Server> MakeServer(server::ServerConfig config, bool start) {
  auto server = server::Server::Create(std::move(config));
  if (!server.ok()) {
    std::fprintf(stderr, "fuzz config: %s\n", server.status().ToString().c_str());
    std::abort();
  }
  if (start) {
    Status s = (*server)->Start();
    if (!s.ok()) {
      std::fprintf(stderr, "starting psd: %s\n", s.ToString().c_str());
      std::abort();
    }
  }
  return std::move(*server);
}

}  // namespace psd::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}
