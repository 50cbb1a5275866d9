// net::Connection on its own (a test handler, no daemon): what a failure while a frame is read
// leaves behind.
#include "net/connection.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "net/byte_stream.h"
#include "psd.capnp.h"
#include "support/eventually.h"
#include "wire/frame.h"

using namespace psd;
using psd::server::Connection;
using psd::server::ConnectionEnv;
using psd::server::FrameBudget;
using psd::testing::Eventually;

namespace {

// The reply to a broken stream: its status.
std::shared_ptr<wire::OutFrame> ErrorFrame(uint64_t id, const Status& status) {
  auto f = std::make_shared<wire::OutFrame>();
  auto r = f->builder.initRoot<proto::Response>();
  r.setId(id);
  r.setCode(wire::ToWire(status.code()));
  r.setMessage(status.message());
  return f;
}

// Buffers from the heap, but the first one over 64 KiB fails as an mmap the host refuses would.
class FailingOnce : public wire::BufferSource {
 public:
  kj::Array<capnp::word> Take(uint64_t words) override {
    if (words * sizeof(capnp::word) > (64u << 10) && !failed_.exchange(true)) throw std::bad_alloc();
    return kj::heapArray<capnp::word>(words);
  }

 private:
  std::atomic<bool> failed_{false};
};

// Admits a worker at its first frame; counts frames; answers a broken stream with its status.
class Handler : public server::FrameHandler {
 public:
  explicit Handler(std::weak_ptr<Connection> conn) : conn_(std::move(conn)) {}
  void OnFrame(const wire::InFrame& frame) override {
    if (auto c = conn_.lock()) c->set_role(Connection::Role::kWorker);
    bytes_ += frame.body_bytes();
    ++frames_;
  }
  std::shared_ptr<wire::OutFrame> ErrorReply(uint64_t id, const Status& status) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = status;
    }
    return ErrorFrame(id, status);
  }
  Status error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  bool Busy() override { return false; }
  void OnClosed() override { closed_ = true; }

  std::atomic<int> frames_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<bool> closed_{false};

 private:
  std::weak_ptr<Connection> conn_;
  std::mutex mu_;
  Status error_;  // the last ErrorReply's
};

// A frame of about `bytes` (one Data field); false if the connection closed meanwhile.
bool SendFrame(tcp::socket& s, size_t bytes) {
  wire::OutFrame f;
  auto r = f.builder.initRoot<proto::Request>();
  r.setId(1);
  std::vector<uint8_t> data(bytes, 7);
  r.setPeerProof(kj::arrayPtr(data.data(), data.size()));
  return wire::WriteFrame(s, f, std::chrono::steady_clock::now() + std::chrono::seconds(30)).ok();
}

}  // namespace

TEST_CASE("a frame whose buffer cannot be allocated fails its connection and holds up no other", "[net]") {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  FrameBudget budget(4u << 20);
  FailingOnce source;
  ConnectionEnv env;
  env.budget = &budget;
  env.frame_buffers = &source;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const auto port = acceptor.local_endpoint().port();
  std::vector<std::shared_ptr<Connection>> conns;  // touched on the loop's thread only
  std::mutex mu;
  std::vector<std::shared_ptr<Handler>> handlers;  // under mu
  auto handler = [&](size_t k) -> std::shared_ptr<Handler> {
    std::lock_guard<std::mutex> lock(mu);
    return k < handlers.size() ? handlers[k] : nullptr;
  };
  std::function<void()> accept = [&] {
    acceptor.async_accept([&](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;
      auto c = std::make_shared<Connection>(std::move(socket), env, conns.size() + 1);
      auto h = std::make_shared<Handler>(c);
      conns.push_back(c);
      {
        std::lock_guard<std::mutex> lock(mu);
        handlers.push_back(h);
      }
      c->Start(h);
      accept();
    });
  };
  accept();
  std::thread loop([&] { io.run(); });  // an exception escaping a handler would end the test here

  asio::io_context client_io;
  auto dial = [&] {
    tcp::socket s(client_io);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    return s;
  };
  tcp::socket first = dial();
  REQUIRE(SendFrame(first, 100));  // admitted as a worker
  // Its buffer "cannot be allocated" (the connection may close before the frame is all written:
  // psd fails it from its header).
  (void)SendFrame(first, 1 << 20);
  REQUIRE(Eventually([&] { return handler(0) != nullptr; }));
  const std::shared_ptr<Handler> h0 = handler(0);
  REQUIRE(h0 != nullptr);
  REQUIRE(Eventually([&] { return h0->closed_.load(); }));
  CHECK(h0->frames_.load() == 1);
  CHECK(h0->error().code() == Code::kResourceExhausted);
  CHECK_THAT(h0->error().message(), Catch::Contains("could not allocate"));
  // Its budget share went back: the next worker's big frame is read and handled.
  CHECK(Eventually([&] { return budget.in_use() == 0; }));
  tcp::socket second = dial();
  REQUIRE(SendFrame(second, 100));
  REQUIRE(SendFrame(second, 1 << 20));
  REQUIRE(Eventually([&] { return handler(1) != nullptr; }));
  const std::shared_ptr<Handler> h1 = handler(1);
  REQUIRE(h1 != nullptr);
  CHECK(Eventually([&] { return h1->frames_.load() == 2; }));

  asio::post(io, [&] {
    acceptor.close();
    for (auto& c : conns) c->CloseNow();
  });
  guard.reset();
  loop.join();
}

TEST_CASE("a plain-TCP handshake completes on the strand its handler is bound to", "[net]") {
  asio::io_context io;
  // Two threads run the context: a completion posted to the context's own executor instead of the
  // handler's strand would run outside the strand (and with one thread, still not "in" it).
  tcp::socket socket(io);
  socket.open(tcp::v4());  // (registered with the reactor, as an accepted one is)
  server::ByteStream stream(std::move(socket), nullptr);
  auto strand = asio::make_strand(io);
  std::atomic<int> on_strand{0}, off_strand{0}, failed{0};
  for (int i = 0; i < 16; ++i) {
    stream.async_handshake(wire::ssl::stream_base::server,
                           asio::bind_executor(strand, [&](const boost::system::error_code& ec) {
                             if (ec) ++failed;
                             (strand.running_in_this_thread() ? on_strand : off_strand)++;
                           }));
  }
  std::thread other([&] { io.run(); });
  io.run();
  other.join();
  CHECK(failed.load() == 0);
  CHECK(on_strand.load() == 16);
  CHECK(off_strand.load() == 0);
}

namespace {

// Answers request k with a reply whose message is `sizes[k]` bytes of 'a' + k % 26 (past them: 1 KiB),
// and request kLast with one that closes the connection after it.
class Replier : public server::FrameHandler {
 public:
  static constexpr uint64_t kLast = 99;
  Replier(std::weak_ptr<Connection> conn, std::vector<size_t> sizes)
      : conn_(std::move(conn)), sizes_(std::move(sizes)) {}
  static std::string Text(uint64_t id, size_t bytes) { return std::string(bytes, static_cast<char>('a' + id % 26)); }
  void OnFrame(const wire::InFrame& frame) override {
    auto c = conn_.lock();
    if (!c) return;
    c->set_role(Connection::Role::kWorker);
    const uint64_t id = frame.Reader()->getRoot<proto::Request>().getId();
    ++frames_;
    auto f = std::make_shared<wire::OutFrame>();
    auto r = f->builder.initRoot<proto::Response>();
    r.setId(id);
    r.setMessage(Text(id, id < sizes_.size() ? sizes_[id] : 1024));
    if (id == kLast) return c->SendAndClose(f);
    c->Send(f);
  }
  std::shared_ptr<wire::OutFrame> ErrorReply(uint64_t id, const Status& status) override {
    return ErrorFrame(id, status);
  }
  bool Busy() override { return false; }
  void OnClosed() override { closed_ = true; }

  std::atomic<int> frames_{0};
  std::atomic<bool> closed_{false};

 private:
  std::weak_ptr<Connection> conn_;
  std::vector<size_t> sizes_;
};

}  // namespace

// Connection::WriteNext offers a plain-TCP reply to the socket from where it is sent and writes
// what the socket does not take asynchronously: a reply far bigger than the socket's buffers
// (taken in part at once, the rest later), smaller ones queued behind it and written at once or
// later as the reader makes room, reads paused while the queued replies exceed
// --max-queued-reply-bytes and resumed after either kind of write, and a reply sent before a
// close (SendAndClose) that arrives whole before the end of the stream. (Checked by breaking
// them: without the skip of what went out at once, or without the resume after a reply written
// at once, this fails.)
TEST_CASE("replies go out whole and in order whether the socket takes them at once or later and the close follows them",
          "[net]") {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  FrameBudget budget(64u << 20);
  ConnectionEnv env;
  env.budget = &budget;
  // The big reply and ten small ones queued behind it pause the reads; they resume as the replies
  // go out, the first small ones usually at once (the client reads by then).
  env.max_queued_reply_bytes = 33u << 20;
  std::atomic<int> paused{0};
  env.on_reads_paused = [&] { ++paused; };
  std::vector<size_t> sizes(21, 100u << 10);
  sizes[1] = 32u << 20;  // more than loopback's socket buffers hold: the client reads nothing yet
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::shared_ptr<Connection> conn;  // touched on the loop's thread only
  std::shared_ptr<Replier> replier;
  std::atomic<bool> accepted{false};
  acceptor.async_accept([&](boost::system::error_code ec, tcp::socket socket) {
    if (ec) return;
    conn = std::make_shared<Connection>(std::move(socket), env, 1);
    replier = std::make_shared<Replier>(conn, sizes);
    conn->Start(replier);
    accepted = true;
  });
  const auto port = acceptor.local_endpoint().port();
  std::thread loop([&] { io.run(); });

  asio::io_context client_io;
  tcp::socket s(client_io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; id <= 20; ++id) ids.push_back(id);
  ids.push_back(Replier::kLast);
  // Every request first, no reply read: the big one fills the socket's buffers and the rest queue.
  for (uint64_t id : ids) {
    wire::OutFrame f;
    f.builder.initRoot<proto::Request>().setId(id);
    REQUIRE(wire::WriteFrame(s, f, deadline).ok());
  }
  REQUIRE(Eventually([&] { return paused.load() > 0; }));  // the queue of replies stopped the reads
  for (uint64_t id : ids) {
    wire::InFrame in;
    Status read = wire::ReadFrame(s, in, 64u << 20, deadline);
    REQUIRE(read.ok());
    auto reader = in.Reader();
    auto resp = reader->getRoot<proto::Response>();
    CHECK(resp.getId() == id);
    const std::string text = resp.getMessage();
    CHECK(text == Replier::Text(id, id < sizes.size() ? sizes[id] : 1024));
  }
  // The last reply was followed by the close: the stream ends there.
  wire::InFrame after;
  CHECK_FALSE(wire::ReadFrame(s, after, 64u << 20, deadline).ok());
  REQUIRE(accepted.load());
  CHECK(Eventually([&] { return replier->closed_.load(); }));
  CHECK(replier->frames_.load() == static_cast<int>(ids.size()));

  asio::post(io, [&] {
    acceptor.close();
    if (conn) conn->CloseNow();
  });
  guard.reset();
  loop.join();
}
