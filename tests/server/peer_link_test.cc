// A shard link (service/tcp_peer_network.h) writes a stream of messages of any length — a replica
// copy's chunks — whole and in order, with what was sent before and after it around it. A link
// queues at most a few thousand messages; before streams, a copy of more chunks than that (over
// 16 GiB at 4 MiB a chunk) lost its tail on every try and never reached the next shard.
#include <poll.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "psd.capnp.h"
#include "service/peer_codec.h"
#include "service/tcp_peer_network.h"
#include "wire/frame.h"

using namespace psd;
using namespace psd::server;

namespace {

constexpr int kShards = 2;

// The next peer message on `socket` (the link's hello first, then what it was given).
proto::Request::Reader Next(tcp::socket& socket, wire::InFrame& in, std::unique_ptr<capnp::MessageReader>* reader) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  REQUIRE(wire::ReadFrame(socket, in, 64 << 20, deadline).ok());
  *reader = in.Reader();
  return (*reader)->getRoot<proto::Request>();
}

peer::Message Heartbeat(int64_t step) {
  peer::Heartbeat hb;
  hb.chief = 0;
  hb.released = {3, step};
  return peer::Message{0, 3, hb};
}

// Shard 0's links, run on their own thread, to a "shard 1" that is a listener on a port the
// kernel chose, accepted and read from the test's thread. `tls`: a client context (null: TCP).
struct LinkToListener {
  explicit LinkToListener(std::shared_ptr<wire::ssl::context> tls = nullptr)
      : acceptor(here, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)), work(asio::make_work_guard(io)) {
    TcpPeerNetwork::Options options;
    // [0] is this shard: never dialed.
    options.addresses = {"127.0.0.1:1", "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port())};
    options.me = 0;
    options.tls = std::move(tls);
    network = std::make_unique<TcpPeerNetwork>(io, options);
    network->Start();
    runner = std::thread([this] { io.run(); });
  }
  ~LinkToListener() {
    network->Stop();
    work.reset();
    io.stop();
    runner.join();
  }
  // The link's next connection (within 30 s).
  tcp::socket Accept() {
    pollfd pfd{acceptor.native_handle(), POLLIN, 0};
    REQUIRE(::poll(&pfd, 1, 30000) == 1);
    tcp::socket socket(here);
    acceptor.accept(socket);
    return socket;
  }

  asio::io_context here;
  tcp::acceptor acceptor;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  std::unique_ptr<TcpPeerNetwork> network;
  std::thread runner;
};

}  // namespace

TEST_CASE("a shard link sends a stream of more messages than it queues, all of them, in order", "[cluster][net]") {
  LinkToListener link;
  TcpPeerNetwork& network = *link.network;
  tcp::socket socket = link.Accept();
  wire::InFrame in;
  std::unique_ptr<capnp::MessageReader> reader;
  {
    auto hello = Next(socket, in, &reader);
    REQUIRE(hello.isHello());
    CHECK(hello.getHello().getPeer());
    CHECK(hello.getHello().getShardIndex() == 0);
  }

  // 8192 chunks of 16 KiB (128 MiB) sharing one copy's memory, given at once between two
  // heartbeats, while nothing reads them yet: far more than fit in the socket's buffers.
  constexpr uint64_t kChunk = 16 << 10, kChunks = 8192;
  auto copy = std::make_shared<std::string>(kChunk * kChunks, '\0');
  for (size_t i = 0; i < copy->size(); i += 4096) (*copy)[i] = static_cast<char>(i / 4096 * 7 + 1);
  std::atomic<uint64_t> made{0};
  network.Send(1, Heartbeat(1));
  network.SendStream(1, [&, copy]() -> std::optional<peer::Message> {
    if (made == kChunks) return std::nullopt;
    const uint64_t offset = made.fetch_add(1) * kChunk;
    peer::Blob data(copy, copy->data() + offset, kChunk);
    return peer::Message{0, 3, peer::ReplicaChunk{3, 0, {3, 1}, false, offset, copy->size(), data, false}};
  });
  network.Send(1, Heartbeat(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(made < kChunks);  // made as the link writes them, not all at once

  auto step_of = [&](proto::Request::Reader r) {
    REQUIRE(r.isPeer());
    auto m = PeerMessageFromWire(r.getPeer(), kShards);
    REQUIRE(m.ok());
    REQUIRE(std::holds_alternative<peer::Heartbeat>(m->body));
    return std::get<peer::Heartbeat>(m->body).released.step;
  };
  CHECK(step_of(Next(socket, in, &reader)) == 1);
  for (uint64_t i = 0; i < kChunks; ++i) {
    auto r = Next(socket, in, &reader);
    REQUIRE(r.isPeer());
    auto m = PeerMessageFromWire(r.getPeer(), kShards);
    REQUIRE(m.ok());
    REQUIRE(std::holds_alternative<peer::ReplicaChunk>(m->body));
    const auto& c = std::get<peer::ReplicaChunk>(m->body);
    REQUIRE(c.offset == i * kChunk);
    REQUIRE(c.total == copy->size());
    REQUIRE(c.data.view() == std::string_view(copy->data() + c.offset, kChunk));
  }
  CHECK(step_of(Next(socket, in, &reader)) == 2);  // after the stream, as sent
  CHECK(made == kChunks);
}

TEST_CASE("a shard link whose TLS handshake never completes dials again", "[cluster][net]") {
  // Something at the other shard's address accepts the TCP connection and says nothing: the TLS
  // handshake gets kHandshakeTimeout (5 s), then the link dials again. Before, it waited on that
  // connection for good, and dropped everything the cluster sent the shard meanwhile.
  LinkToListener link(std::make_shared<wire::ssl::context>(wire::ssl::context::tls_client));
  std::vector<tcp::socket> held;  // accepted and never answered
  held.push_back(link.Accept());
  held.push_back(link.Accept());  // the second dial, after the first one's 5 s
}
