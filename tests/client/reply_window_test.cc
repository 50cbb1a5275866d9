// A batch of requests on one connection against a daemon that holds its reads, as psd does, while
// more than --max-queued-reply-bytes of replies wait to be written: libpsclient sends a batch's
// requests before it reads their replies and reads nothing while it writes, so it must read
// replies before it sends more once too many could be unread (Conn::ReplyWindow), or both sides
// wait on each other until the request deadline.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "psclient/client.h"
#include "wire/frame.h"

using namespace psd;

namespace {

// One connection's psd-like daemon: answers the hello (announcing `hold` as its
// --max-queued-reply-bytes), then each PullRows with the rows asked, [n, 2] float32 whose row r is
// {r, -r}. Replies are written without blocking as far as the socket takes them; while more than
// `hold` bytes of them wait, it reads no request. Its socket buffers are small (64 KiB asked), so
// what TCP itself holds in either direction is a few hundred KiB at most, not the megabytes of the
// batch below: a client that writes on while nothing is read cannot finish.
struct HoldingDaemon {
  explicit HoldingDaemon(uint64_t hold) : acceptor(io) {
    tcp::endpoint at(asio::ip::make_address("127.0.0.1"), 0);
    acceptor.open(at.protocol());
    const int small = 64 << 10;  // before listen(): accepted sockets inherit it, and the window it implies
    ::setsockopt(acceptor.native_handle(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    ::setsockopt(acceptor.native_handle(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    acceptor.bind(at);
    acceptor.listen();
    port = acceptor.local_endpoint().port();
    thread = std::thread([this, hold] { Serve(hold); });
  }
  ~HoldingDaemon() { Join(); }
  // Once the client is gone: its counters are final.
  void Join() {
    if (thread.joinable()) thread.join();
  }

  void Serve(uint64_t hold) {
    tcp::socket s(io);
    boost::system::error_code ec;
    acceptor.accept(s, ec);
    if (ec) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::deque<std::string> queued;  // replies not yet written (the front one maybe in part)
    size_t front_written = 0;
    uint64_t queued_bytes = 0;
    // Writes what the socket takes now; with `wait`, first waits until it takes something.
    auto flush = [&](bool wait) {
      if (wait) {
        pollfd p{s.native_handle(), POLLOUT, 0};
        if (::poll(&p, 1, 100) <= 0) return;
      }
      while (!queued.empty()) {
        const std::string& f = queued.front();
        ssize_t n =
            ::send(s.native_handle(), f.data() + front_written, f.size() - front_written, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n <= 0) return;
        front_written += static_cast<size_t>(n);
        queued_bytes -= static_cast<uint64_t>(n);
        if (front_written < f.size()) return;
        queued.pop_front();
        front_written = 0;
      }
    };
    for (bool hello = true; std::chrono::steady_clock::now() < deadline; hello = false) {
      while (queued_bytes > hold && std::chrono::steady_clock::now() < deadline) {
        held_reads = true;
        flush(/*wait=*/true);
      }
      // The next request (none: the client closed, or stopped sending: the test is over).
      pollfd p{s.native_handle(), POLLIN, 0};
      while (::poll(&p, 1, 100) == 0) {
        flush(false);
        if (std::chrono::steady_clock::now() >= deadline) return;
      }
      wire::InFrame in;
      if (!wire::ReadFrame(s, in, 1 << 30, deadline).ok()) return;
      auto reader = in.Reader();
      auto req = reader->getRoot<proto::Request>();
      wire::OutFrame out;
      std::vector<float> values;  // referenced by the frame until its bytes are taken below
      auto resp = out.builder.initRoot<proto::Response>();
      resp.setId(req.getId());
      if (hello) {
        auto h = resp.initHello();
        h.setProtocolVersion(proto::PROTOCOL_VERSION);
        h.setShards(1);
        h.initConfig().setReplicasToAggregate(1);
        h.setChunkElements(512);
        h.setMaxQueuedReplyBytes(hold);
      } else {
        auto rows = req.getPullRows().getRows();
        values.reserve(rows.size() * 2);
        for (int64_t r : rows) {
          values.push_back(static_cast<float>(r));
          values.push_back(-static_cast<float>(r));
        }
        auto pull = resp.initPull();
        wire::SetTensor(out.builder, pull.initValues(1)[0], DType::kFloat32, {static_cast<int64_t>(rows.size()), 2},
                        values.data(), values.size() * sizeof(float));
        ++lookups;
      }
      std::string bytes;
      for (auto& b : out.Buffers()) bytes.append(static_cast<const char*>(b.data()), b.size());
      queued_bytes += bytes.size();
      queued.push_back(std::move(bytes));
      flush(false);
    }
  }

  asio::io_context io;
  tcp::acceptor acceptor;
  uint16_t port = 0;
  std::thread thread;
  int lookups = 0;          // PullRows answered
  bool held_reads = false;  // it stopped reading at least once
};

}  // namespace

TEST_CASE("a batch reads replies before it sends more once half the daemon's reply hold could be unread",
          "[client][robustness]") {
  // A lookup of 2 Mi rows in replies of 256 KiB (32 Ki rows): 64 requests of 256 KiB each, 16 MiB
  // of them and of their replies, against a 1 MiB hold. Sent whole before any reply was read (as
  // before), the requests stopped going out once the daemon held its reads, and the call failed at
  // its deadline.
  constexpr uint64_t kHold = 1 << 20;
  HoldingDaemon daemon(kHold);
  psclient::ClientOptions o;
  o.port = daemon.port;
  o.worker_name = "w";
  o.connect_timeout_ms = 5000;
  o.request_timeout_ms = 20000;
  o.shared_memory_bytes = 0;
  o.shared_buffer_bytes = 0;
  o.pull_frame_bytes = 256 << 10;
  {
    auto c = psclient::Client::Connect(o);
    REQUIRE(c.ok());
    constexpr size_t kRows = size_t{2} << 20;
    std::vector<int64_t> rows(kRows);
    for (size_t i = 0; i < kRows; ++i) rows[i] = static_cast<int64_t>((i * 7919) % 100003);
    std::vector<float> out(kRows * 2, 0.5f);
    auto step = (*c)->PullRows("table", rows,
                               {out.data(), DType::kFloat32, {static_cast<int64_t>(kRows), 2}, MemoryKind::kHost});
    INFO(step.status().ToString());
    REQUIRE(step.ok());
    size_t wrong = 0;
    for (size_t i = 0; i < kRows; ++i) {
      wrong += out[2 * i] != static_cast<float>(rows[i]) || out[2 * i + 1] != -static_cast<float>(rows[i]);
    }
    CHECK(wrong == 0);
  }
  daemon.Join();
  CHECK(daemon.lookups == 64);
  CHECK_FALSE(daemon.held_reads);  // never more than half the hold unread, so never more queued
}
