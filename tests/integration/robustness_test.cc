// Hostile peers: malformed, oversized, truncated and unknown frames never crash psd or corrupt
// its state; each gets an error reply or a closed connection.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <random>
#include <thread>

#include "psd/half.h"
#include "service/values_segment.h"
#include "support/eventually.h"
#include "support/failing_storage.h"
#include "support/raw_peer.h"
#include "support/test_server.h"
#include "wire/frame.h"

using namespace psd;
using psd::testing::ConnectWith;
using psd::testing::ConnectWorker;
using psd::testing::Eventually;
using psd::testing::RawPeer;
using psd::testing::StartServer;
using psd::testing::TestConfig;
using psd::testing::WorkerOptions;

namespace {

std::string Words(std::vector<uint32_t> words) {
  return std::string(reinterpret_cast<const char*>(words.data()), words.size() * 4);
}

// A daemon where worker "owner" created the scalar "w" = 5.
std::unique_ptr<server::Server> StartWithVariable(const server::ServerConfig& cfg) {
  auto server = StartServer(cfg);
  auto w = ConnectWorker(server->port(), "owner");
  float five = 5;
  REQUIRE(w->CreateVariable("w", {&five, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  return server;
}

// A daemon whose big buffers come from FailingStorage (tests of what runs out of memory; skip them
// where the values segment holds the buffers), and workers for it over TCP, the values in the
// replies, converted by psd where asked. A call never answered fails within its wait + 10 s.
struct OutOfMemoryDaemon {
  explicit OutOfMemoryDaemon(server::ServerConfig cfg) {
    cfg.values_segment = false;
    server = StartServer(cfg);
  }
  std::unique_ptr<psclient::Client> Worker(const std::string& name) {
    auto o = WorkerOptions(server->port(), name);
    o.shared_memory_bytes = 0;
    o.request_timeout_ms = 5000;
    return ConnectWith(o);
  }
  psd::testing::ActiveStorage storage;  // before the daemon: its buffers come from it
  std::unique_ptr<server::Server> server;
};

// After any abuse, a normal worker still gets served and the variable is intact.
void ExpectHealthy(uint16_t port) {
  auto w = ConnectWorker(port, "healthy");
  float v = -1;
  auto s = w->Pull("w", {&v, DType::kFloat32, {}, MemoryKind::kHost});
  REQUIRE(s.ok());
  CHECK(v == 5.0f);
}

}  // namespace

TEST_CASE("malformed frames get errors and never hurt the daemon", "[robustness]") {
  auto cfg = TestConfig(1, 3, 0);  // N=3: "owner", "healthy" and a raw peer "raw" say hello
  cfg.max_frame_bytes = 1 << 16;
  auto server = StartWithVariable(cfg);
  Code code;
  std::string msg;

  SECTION("too many segments: error, then the connection is closed") {
    RawPeer p(server->port());
    p.SendBytes(Words({0xFFFFFFF0u, 1}));
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kResourceExhausted);
    CHECK(p.ClosedByPeer());
  }
  SECTION("a frame over --max-frame-bytes is refused before allocation") {
    RawPeer p(server->port());
    p.SendBytes(Words({0, 0x40000000u}));  // claims 8 GiB
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kResourceExhausted);
    CHECK_THAT(msg, Catch::Contains("is over psd's --max-frame-bytes (65536 bytes): raise it"));
    CHECK(p.ClosedByPeer());
  }
  SECTION("a truncated frame and a vanished peer") {
    RawPeer p(server->port());
    p.SendBytes(Words({0, 100, 1, 2, 3}));
    p.socket.close();
  }
  SECTION("a well-framed message that is not a valid request stays answerable") {
    RawPeer p(server->port());
    // One segment of 4 words whose root pointer points far outside the segment.
    p.SendBytes(Words({0, 4, 0x7FFFFFF0u, 0x00040000u, 0, 0, 0, 0, 0, 0}));
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("malformed request"));
    p.Hello();  // the same connection still works
  }
  SECTION("requests before hello and from the wrong protocol version") {
    RawPeer p(server->port());
    wire::OutFrame f;
    auto r = f.builder.initRoot<proto::Request>();
    r.setId(9);
    r.initPull().initNames(1).set(0, "w");
    p.Send(f);
    uint64_t id = 0;
    REQUIRE(p.Read(&code, &msg, &id));
    CHECK(code == Code::kFailedPrecondition);
    CHECK(id == 9);
    wire::OutFrame h;
    auto hr = h.builder.initRoot<proto::Request>();
    hr.setId(10);
    hr.initHello().setProtocolVersion(999);
    p.Send(h);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kFailedPrecondition);
    CHECK_THAT(msg, Catch::Contains("protocol version 999"));
  }
  SECTION("an unknown request type") {
    RawPeer p(server->port());
    p.Hello();
    // A Request whose union discriminant (data word 1, bits 0-15) is 77: id=3, which=77.
    p.SendBytes(Words({0, 3, 0, 0x00000002u, 3, 0, 77, 0}));
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kUnimplemented);
  }
  SECTION("chunks of a value that do not follow each other create and update nothing") {
    RawPeer p(server->port());
    p.Hello();
    float values[4] = {1, 2, 3, 4};
    // name, element offset, element count, more: a chunk of "big" (shape [8]).
    auto chunk = [&](const char* name, int64_t offset, int64_t count, bool more) {
      wire::OutFrame f;
      auto r = f.builder.initRoot<proto::Request>();
      r.setId(20);
      auto c = r.initCreateVariable();
      c.setName(name);
      c.setChunked(true);
      c.setChunkOffset(offset);
      c.initChunkedShape(1).set(0, 8);
      c.setMore(more);
      wire::SetTensor(f.builder, c.initInitial(), DType::kFloat32, {count}, values,
                      static_cast<size_t>(count) * sizeof(float));
      p.Send(f);
      REQUIRE(p.Read(&code, &msg));
    };
    chunk("big", 4, 4, true);  // not the first chunk
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("starts at element 4"));
    chunk("big", 0, 4, true);
    CHECK(code == Code::kOk);
    chunk("big", 2, 2, false);  // overlaps the first
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("does not follow"));
    chunk("big", 0, 4, true);
    CHECK(code == Code::kOk);
    chunk("big", 4, 2, false);  // the last chunk ends short of the value
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("ends at byte 24 of 32"));
    // An update's chunk in between drops a create's: its next chunk no longer follows anything.
    chunk("mixed", 0, 4, true);
    CHECK(code == Code::kOk);
    {
      wire::OutFrame f;
      auto r = f.builder.initRoot<proto::Request>();
      r.setId(21);
      auto u = r.initUpdate();
      u.setVariable("mixed");
      u.setOp(proto::UpdateOp::ASSIGN);
      u.setChunked(true);
      u.initChunkedShape(1).set(0, 8);
      u.setMore(true);
      wire::SetTensor(f.builder, u.initValue(), DType::kFloat32, {4}, values, sizeof(values));
      p.Send(f);
      REQUIRE(p.Read(&code, &msg));
      CHECK(code == Code::kNotFound);  // "mixed" is not created yet: refused before anything is held
    }
    chunk("mixed", 4, 4, false);
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("starts at element 4"));
    chunk("huge", 0, 4, true);  // then the connection ends half-way
    CHECK(code == Code::kOk);
    p.socket.close();
    auto w = ConnectWorker(server->port(), "healthy");
    std::vector<float> got(8);
    CHECK(w->Pull("big", {got.data(), DType::kFloat32, {8}, MemoryKind::kHost}).status().code() == Code::kNotFound);
    CHECK(w->Pull("huge", {got.data(), DType::kFloat32, {8}, MemoryKind::kHost}).status().code() == Code::kNotFound);
    CHECK(w->Pull("mixed", {got.data(), DType::kFloat32, {8}, MemoryKind::kHost}).status().code() == Code::kNotFound);
  }
  SECTION("pushes with lying sizes, bad dtypes and bad names") {
    RawPeer p(server->port());
    p.Hello();
    auto push = [&](auto fill) {
      wire::OutFrame f;
      auto r = f.builder.initRoot<proto::Request>();
      r.setId(2);
      auto g = r.initPush().initGrads(1)[0];
      fill(g);
      p.Send(f);
      REQUIRE(p.Read(&code, &msg));
    };
    push([](auto g) {
      g.setName("w");
      g.initGrad().initData(7);  // a float32 scalar needs 4 bytes
    });
    CHECK(code == Code::kInvalidArgument);
    push([](auto g) {
      g.setName("w");
      g.initGrad().setDtype(static_cast<proto::DType>(9));
    });
    CHECK(code == Code::kInvalidArgument);
    push([](auto g) {
      g.setName("w");
      auto t = g.initGrad();
      t.initShape(1).set(0, int64_t{1} << 62);
    });
    CHECK(code == Code::kInvalidArgument);
    push([](auto g) { g.setName("w\n"); });
    CHECK(code == Code::kNotFound);
    // More rows said to follow in a push's last frame (or after a dense gradient): they never would.
    push([](auto g) {
      g.setName("w");
      g.setRowsMore(true);
      g.initGrad().initData(4);  // a well-formed float32 scalar otherwise
    });
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("more rows can only follow"));
  }
  SECTION("pipelined requests: a parked token wait does not hold up later requests") {
    RawPeer p(server->port());
    p.Hello();
    wire::OutFrame wait;
    auto w = wait.builder.initRoot<proto::Request>();
    w.setId(100);
    w.initWaitToken().setTimeoutMs(300);
    p.Send(wait);
    wire::OutFrame status;
    status.builder.initRoot<proto::Request>().setId(101);
    status.builder.getRoot<proto::Request>().setStatus();
    p.Send(status);
    uint64_t id = 0;
    REQUIRE(p.Read(&code, &msg, &id));
    CHECK(id == 101);  // answered while the wait is parked
    CHECK(code == Code::kOk);
    REQUIRE(p.Read(&code, &msg, &id));
    CHECK(id == 100);
    CHECK(code == Code::kDeadlineExceeded);
  }
  SECTION("random garbage, many times") {
    std::mt19937 rng(17);
    for (int i = 0; i < 200; ++i) {
      RawPeer p(server->port());
      uint32_t words = 1 + rng() % 64;
      std::vector<uint32_t> frame{0, words};
      for (uint32_t k = 0; k < words * 2; ++k) frame.push_back(rng());
      p.SendBytes(Words(frame));
      p.Read(&code, &msg);  // any reply (or a close) is fine; a crash is not
    }
  }
  ExpectHealthy(server->port());
}

TEST_CASE("a sparse gradient's rows sent in several frames must keep increasing", "[robustness][chunks]") {
  auto server = StartServer(TestConfig(1, 2, 0));  // "owner" and "raw"; a step takes one gradient
  auto owner = ConnectWorker(server->port(), "owner");
  std::vector<float> zeros(16, 0.0f);
  REQUIRE(owner->CreateVariable("emb", {zeros.data(), DType::kFloat32, {8, 2}, MemoryKind::kHost}).ok());
  RawPeer p(server->port());
  p.Hello("raw");
  Code code;
  std::string msg;
  // One frame of a push: rows `rows` of a gradient of ones for "emb", more to come if `more`
  // (`wait`: it also asks for a token, which only a push's last frame may), computed at `step`.
  auto frame = [&](const std::vector<int64_t>& rows, bool more, bool wait = false, int64_t step = 0) {
    wire::OutFrame f;
    auto r = f.builder.initRoot<proto::Request>();
    r.setId(5);
    auto push = r.initPush();
    push.setMore(more);
    push.setWaitToken(wait);
    push.setLocalStep(step);
    auto g = push.initGrads(1)[0];
    g.setName("emb");
    g.setSparse(true);
    g.setRowsMore(more);
    std::vector<float> ones(rows.size() * 2, 1.0f);
    wire::SetTensor(f.builder, g.initGrad(), DType::kFloat32, {static_cast<int64_t>(rows.size()), 2}, ones.data(),
                    ones.size() * sizeof(float));
    auto idx = g.initIndices(static_cast<unsigned>(rows.size()));
    for (size_t k = 0; k < rows.size(); ++k) idx.set(static_cast<unsigned>(k), rows[k]);
    p.Send(f);
    REQUIRE(p.Read(&code, &msg));
  };
  frame({0, 3}, true);
  CHECK(code == Code::kOk);
  frame({3, 5}, false);  // row 3 again
  CHECK(code == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("must keep increasing across frames"));
  CHECK(server->engine()->global_step() == 0);  // the gradient never completed
  // A frame refused for another reason ends its push too: the next push starts afresh at row 0.
  frame({0, 3}, true);
  CHECK(code == Code::kOk);
  frame({4}, true, /*wait=*/true);
  CHECK(code == Code::kInvalidArgument);
  CHECK(server->engine()->global_step() == 0);
  // ... and the rest of that push is refused too, up to its last frame: it would count as a
  // gradient without its first rows.
  frame({5}, true);
  CHECK(code == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("an earlier frame of this push was refused"));
  frame({6}, false);
  CHECK(code == Code::kInvalidArgument);
  CHECK(server->engine()->global_step() == 0);
  // Rows that do continue: the gradient counts once, with its last rows, and the step is taken.
  frame({0, 3}, true);
  CHECK(code == Code::kOk);
  frame({4, 6}, false);
  CHECK(code == Code::kOk);
  CHECK(server->engine()->global_step() == 1);
  std::vector<float> emb(16, -1.0f);
  REQUIRE(owner->Pull("emb", {emb.data(), DType::kFloat32, {8, 2}, MemoryKind::kHost}).ok());
  for (int row : {1, 2, 5, 7}) CHECK(emb[static_cast<size_t>(row) * 2] == 0.0f);
  for (int row : {3, 4, 6}) CHECK(emb[static_cast<size_t>(row) * 2] == emb[0]);
  CHECK(emb[0] < 0.0f);

  // A take between a gradient's frames (R = 1 of N = 2: "raw" is a backup): "owner"'s whole
  // gradient completes step 1 while raw's is half sent. Raw's last frame is then stale and its
  // whole gradient is dropped, as TensorFlow's all-or-nothing apply_grad. Before, its first rows
  // were in the step (averaged as a whole gradient's) and the push said it was not accepted.
  const std::vector<float> before = emb;
  frame({0, 3}, true, false, /*step=*/1);
  CHECK(code == Code::kOk);
  std::vector<float> g(2, 1.0f);
  psclient::SparseGradient sg{"emb", {1}, {g.data(), DType::kFloat32, {1, 2}, MemoryKind::kHost}, std::nullopt};
  auto pushed = owner->Push(1, {}, {sg});
  REQUIRE(pushed.ok());
  CHECK(server->engine()->global_step() == 2);
  frame({4, 6}, false, false, /*step=*/1);
  CHECK(code == Code::kOk);
  CHECK_FALSE(p.in.Reader()->getRoot<proto::Response>().getPush().getResults()[0].getAccepted());
  REQUIRE(owner->Pull("emb", {emb.data(), DType::kFloat32, {8, 2}, MemoryKind::kHost}).ok());
  for (int row : {0, 2, 3, 4, 5, 6, 7})
    CHECK(emb[static_cast<size_t>(row) * 2] == before[static_cast<size_t>(row) * 2]);
  CHECK(emb[2] < before[2]);  // row 1: owner's

  // A push whose last frame does not end a gradient an earlier frame began is refused: those
  // rows would never count.
  std::vector<float> dense(16, 1.0f);
  REQUIRE(owner->CreateVariable("other", {dense.data(), DType::kFloat32, {16}, MemoryKind::kHost}).ok());
  frame({0, 3}, true, false, /*step=*/2);
  CHECK(code == Code::kOk);
  wire::OutFrame last;
  auto r = last.builder.initRoot<proto::Request>();
  r.setId(6);
  r.initPush().setLocalStep(2);
  auto only = r.getPush().initGrads(1)[0];
  only.setName("other");
  wire::SetTensor(last.builder, only.initGrad(), DType::kFloat32, {16}, dense.data(), dense.size() * sizeof(float));
  p.Send(last);
  REQUIRE(p.Read(&code, &msg));
  CHECK(code == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("does not end it"));
  CHECK(server->engine()->global_step() == 2);
}

TEST_CASE("with an auth token, only peers that present it are served", "[robustness][auth]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.auth_token = "s3cret";
  auto server = StartServer(cfg);
  psclient::ClientOptions o;
  o.port = server->port();
  o.worker_name = "w";
  o.connect_timeout_ms = 2000;
  auto none = psclient::Client::Connect(o);
  CHECK(none.status().code() == Code::kUnauthenticated);
  o.auth_token = "s3creT";
  CHECK(psclient::Client::Connect(o).status().code() == Code::kUnauthenticated);
  o.auth_token = "s3cret";
  auto worker = psclient::Client::Connect(o);
  REQUIRE(worker.ok());
  CHECK((*worker)->is_chief());
  // An operator's tool: authenticated, but not a worker.
  psclient::ClientOptions admin = o;
  admin.observer = true;
  auto observer = psclient::Client::Connect(admin);
  REQUIRE(observer.ok());
  auto st = (*observer)->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->workers_connected == 1);
  CHECK_FALSE(st->is_chief);
  // A raw peer that skips the hello gets nothing but an error.
  RawPeer p(server->port());
  wire::OutFrame f;
  f.builder.initRoot<proto::Request>().setId(5);
  f.builder.getRoot<proto::Request>().setStatus();
  p.Send(f);
  Code code;
  std::string msg;
  REQUIRE(p.Read(&code, &msg));
  CHECK(code == Code::kUnauthenticated);
}

TEST_CASE("a daemon that never answers cannot hang a client: calls end at their deadline", "[robustness]") {
  // A listener that accepts and then says nothing (a stopped or wedged daemon).
  asio::io_context io;
  tcp::acceptor mute(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  psclient::ClientOptions o;
  o.port = mute.local_endpoint().port();
  o.worker_name = "w";
  o.request_timeout_ms = 200;
  auto start = std::chrono::steady_clock::now();
  auto c = psclient::Client::Connect(o);  // the hello gets no reply
  CHECK(c.status().code() == Code::kDeadlineExceeded);
  CHECK_THAT(c.status().message(), Catch::Contains("200 ms"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("a worker beyond N is refused at hello naming -N/-B, reconnects and observers are not",
          "[robustness][hello]") {
  auto server = StartServer(TestConfig(2, 3));  // R=2, N=3 (B=1)
  auto w0 = ConnectWorker(server->port(), "w0");
  auto w1 = ConnectWorker(server->port(), "w1");
  auto w2 = ConnectWorker(server->port(), "w2");
  psclient::ClientOptions o;
  o.port = server->port();
  o.worker_name = "w3";
  o.connect_timeout_ms = 5000;
  auto extra = psclient::Client::Connect(o);
  REQUIRE_FALSE(extra.ok());
  CHECK(extra.status().code() == Code::kResourceExhausted);
  CHECK_THAT(extra.status().message(), Catch::Contains("N=3 workers (-R 2 -B 1)") &&
                                           Catch::Contains("worker 'w3' is refused") &&
                                           Catch::Contains("--total-replicas/-B"));
  // The same name again (a restarted worker process) is always admitted.
  auto again = ConnectWorker(server->port(), "w1");
  CHECK(again->worker_id() == 1);
  // An operator's tool is not a worker.
  o.observer = true;
  auto observer = psclient::Client::Connect(o);
  REQUIRE(observer.ok());
  auto st = (*observer)->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->workers_connected == 3);
}

TEST_CASE("the hello announces --max-frame-bytes, the client refuses bigger requests before sending",
          "[robustness][limits]") {
  auto cfg = TestConfig(1);
  cfg.max_frame_bytes = 64 << 10;
  auto server = StartServer(cfg);
  // A client that sends requests whole (push_frame_bytes 0; by default values and pushes bigger
  // than a frame go in chunks, chunked_push_test.cc).
  psclient::ClientOptions whole = psd::testing::WorkerOptions(server->port(), "w");
  whole.push_frame_bytes = 0;
  whole.shared_memory_bytes = 0;  // frames are what is tested (through shared memory a push is one small frame)
  auto w = psd::testing::ConnectWith(whole);
  std::vector<float> big(100000, 1.0f);  // 400 KB
  auto created =
      w->CreateVariable("big", {big.data(), DType::kFloat32, {static_cast<int64_t>(big.size())}, MemoryKind::kHost});
  REQUIRE_FALSE(created.ok());
  CHECK(created.status().code() == Code::kResourceExhausted);
  CHECK_THAT(created.status().message(), Catch::Contains("the create is 39") &&
                                             Catch::Contains("over psd's --max-frame-bytes 64 KiB") &&
                                             Catch::Contains("raise it on every shard"));
  // The connection is intact: small variables are created, and a push too big is refused the same way.
  std::vector<float> small(1000, 0.0f);
  std::vector<psclient::Gradient> grads;
  for (int i = 0; i < 20; ++i) {
    std::string name = "s" + std::to_string(i);
    REQUIRE(w->CreateVariable(name, {small.data(), DType::kFloat32, {1000}, MemoryKind::kHost}).ok());
    grads.push_back({name, {small.data(), DType::kFloat32, {1000}, MemoryKind::kHost}});
  }
  auto pushed = w->Push(0, grads);  // 80 KB
  REQUIRE_FALSE(pushed.ok());
  CHECK(pushed.status().code() == Code::kResourceExhausted);
  CHECK_THAT(pushed.status().message(), Catch::Contains("the push request is") && Catch::Contains("--max-frame-bytes"));
  auto one = w->Push(0, {{"s0", {small.data(), DType::kFloat32, {1000}, MemoryKind::kHost}}});
  CHECK(one.ok());
}

TEST_CASE("frames sent back to back, a byte at a time or bigger than the read-ahead are each read whole",
          "[robustness][framing]") {
  // psd reads ahead (16 KiB a connection): a read may end inside the next frame's header, table or
  // body, and a body bigger than what is held is read in place after what was.
  auto cfg = TestConfig(1, 3, 0);
  auto server = StartWithVariable(cfg);
  RawPeer p(server->port());
  p.Hello();
  auto bytes_of = [](uint64_t id, const std::string& name) {
    wire::OutFrame f;
    auto r = f.builder.initRoot<proto::Request>();
    r.setId(id);
    r.initPull().initNames(1).set(0, name);
    std::string out;
    for (const auto& b : f.Buffers()) out.append(static_cast<const char*>(b.data()), b.size());
    return out;
  };
  const std::string big_name(40000, 'x');  // a 40 KB frame: past the read-ahead on both ends
  std::string run;
  for (uint64_t id = 100; id < 140; ++id) run += bytes_of(id, id % 10 == 5 ? big_name : "w");
  p.SendBytes(run);  // 40 frames, 4 of them big, in one write
  Code code;
  std::string msg;
  for (uint64_t want = 100; want < 140; ++want) {
    uint64_t id = 0;
    REQUIRE(p.Read(&code, &msg, &id));
    CHECK(id == want);
    if (want % 10 == 5) {
      CHECK(code != Code::kOk);  // no such variable (or a name too long): answered, not lost
    } else {
      CHECK(code == Code::kOk);
    }
  }
  // One frame a byte at a time (each byte its own segment on the wire, TCP_NODELAY).
  p.socket.set_option(tcp::no_delay(true));
  std::string one = bytes_of(200, "w");
  for (char c : one) {
    p.SendBytes(std::string(1, c));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  uint64_t id = 0;
  REQUIRE(p.Read(&code, &msg, &id));
  CHECK(id == 200);
  CHECK(code == Code::kOk);
  ExpectHealthy(server->port());
}

TEST_CASE("before its hello a connection may send only a small hello, and must send it soon", "[robustness][dos]") {
  auto cfg = TestConfig(1, 3, 0);  // N=3: "owner", "raw" and "healthy"
  cfg.hello_timeout_ms = 300;      // the default is 5000
  cfg.max_connections = 4;
  auto server = StartWithVariable(cfg);
  Code code;
  std::string msg;
  SECTION("a frame announcing 200 MB before the hello is refused from its header") {
    // Under --max-frame-bytes (256 MiB), so only the pre-hello bound stops it.
    RawPeer p(server->port());
    p.SendBytes(Words({0, (200u << 20) / 8}));
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kResourceExhausted);
    CHECK_THAT(msg, Catch::Contains("before the hello") && Catch::Contains("say hello first"));
    CHECK(p.ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("a request other than a hello before the hello is refused") {
    RawPeer p(server->port());
    wire::OutFrame f;
    f.builder.initRoot<proto::Request>().setId(4);
    f.builder.getRoot<proto::Request>().setStatus();
    p.Send(f);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kFailedPrecondition);
    CHECK_THAT(msg, Catch::Contains("say hello first"));
  }
  SECTION("a frame of more than a few segments before the hello is refused from its first word") {
    RawPeer p(server->port());
    p.SendBytes(Words({16, 1}));  // 17 segments, the first of one word: its table is never read
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kResourceExhausted);
    CHECK_THAT(msg, Catch::Contains("17 segments before the hello"));
    CHECK(p.ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("a connection that never says hello is closed after --hello-timeout-ms") {
    RawPeer p(server->port());
    CHECK(p.ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("silent connections filling --max-connections do not lock a worker out for long") {
    std::vector<std::unique_ptr<RawPeer>> silent;
    for (int i = 0; i < cfg.max_connections; ++i) silent.push_back(std::make_unique<RawPeer>(server->port()));
    for (auto& p : silent) CHECK(p->ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("a connection that said hello stays open past the hello timeout") {
    RawPeer p(server->port());
    p.Hello();
    CHECK_FALSE(p.ClosedWithin(std::chrono::seconds(1)));
  }
  psclient::ClientOptions o;
  o.port = server->port();
  o.worker_name = "healthy";
  o.connect_timeout_ms = 30000;
  auto w = psclient::Client::Connect(o);
  INFO(w.status().ToString());
  REQUIRE(w.ok());
  float v = -1;
  REQUIRE((*w)->Pull("w", {&v, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  CHECK(v == 5.0f);
  REQUIRE((*w)->Push(0, {{"w", {&v, DType::kFloat32, {}, MemoryKind::kHost}}}).ok());
}

TEST_CASE("at --max-connections the connection that waited longest for its hello makes room", "[robustness][dos]") {
  // Silent connections fill the limit; a worker connecting
  // then gets in at once, and the oldest silent one is closed for it. Before, the worker was
  // refused until a silent one's --hello-timeout-ms passed, so clients that connect and say
  // nothing, reconnecting as they are closed, kept workers out for good.
  auto cfg = TestConfig(1, 3, 0);
  cfg.hello_timeout_ms = 120000;  // only an eviction closes a silent connection in this test
  cfg.max_connections = 4;
  auto server = StartWithVariable(cfg);
  const uint64_t before = server->metrics().connections_accepted();
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < cfg.max_connections; ++i) {
    silent.push_back(std::make_unique<RawPeer>(server->port()));
    const uint64_t want = before + static_cast<uint64_t>(i) + 1;
    REQUIRE(Eventually([&] { return server->metrics().connections_accepted() >= want; }));  // in order
  }
  auto w = psclient::Client::Connect(WorkerOptions(server->port(), "healthy"));
  INFO(w.status().ToString());
  REQUIRE(w.ok());
  float v = -1;
  REQUIRE((*w)->Pull("w", {&v, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  CHECK(v == 5.0f);
  CHECK(silent[0]->ClosedWithin(std::chrono::seconds(30)));
  CHECK_FALSE(silent[3]->ClosedWithin(std::chrono::seconds(1)));
  CHECK(server->metrics().connections_refused() >= 1);
}

TEST_CASE("an idle connection is closed after --idle-timeout-s, a parked wait is not idle", "[robustness][dos]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.idle_timeout_s = 1;
  auto server = StartServer(cfg);
  Code code;
  std::string msg;
  RawPeer p(server->port());
  p.Hello();
  wire::OutFrame wait;
  auto r = wait.builder.initRoot<proto::Request>();
  r.setId(7);
  r.initWaitToken().setTimeoutMs(2500);  // parked past the idle bound: answered, not cut off
  p.Send(wait);
  uint64_t id = 0;
  REQUIRE(p.Read(&code, &msg, &id));
  CHECK(id == 7);
  CHECK(code == Code::kDeadlineExceeded);
  CHECK(p.ClosedWithin(std::chrono::seconds(60)));
}

namespace {

// The bytes of `f` as sent.
std::string FrameBytes(wire::OutFrame& f) {
  std::string bytes;
  for (const auto& b : f.Buffers()) bytes.append(static_cast<const char*>(b.data()), b.size());
  return bytes;
}

}  // namespace

TEST_CASE("a frame on its way in is not idle: --idle-timeout-s counts from its last byte", "[robustness][dos]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.idle_timeout_s = 1;      // --frame-timeout-ms (60 s) bounds a slow frame instead
  cfg.hello_timeout_ms = 300;  // the connection's timer checks for idleness from then on
  auto server = StartWithVariable(cfg);
  RawPeer p(server->port());
  p.Hello();
  // A push of 256 KiB for a variable psd does not have: sent in two halves 2.5 s apart.
  std::vector<float> g(64 << 10, 1.0f);
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(9);
  auto t = req.initPush().initGrads(1)[0];
  t.setName("nope");
  auto grad = t.initGrad();
  grad.setDtype(proto::DType::FLOAT32);
  grad.initShape(1).set(0, g.size());
  grad.setData(capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(g.data()), g.size() * 4));
  const std::string bytes = FrameBytes(f);
  p.SendBytes(bytes.substr(0, bytes.size() / 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  p.SendBytes(bytes.substr(bytes.size() / 2));
  Code code;
  std::string msg;
  uint64_t id = 0;
  REQUIRE(p.Read(&code, &msg, &id));  // answered: the connection was not closed as idle
  CHECK(id == 9);
  CHECK(code == Code::kNotFound);
  CHECK(p.ClosedWithin(std::chrono::seconds(60)));  // idle after the answer: closed then
}

TEST_CASE("a peer that never reads its answers is held up by TCP, not by psd's memory, and loses none",
          "[robustness][dos]") {
  // Requests before the hello each get an error reply. psd stops reading such a connection while
  // 8 replies wait to be written (the kernel's buffers being full), and reads on as they go out.
  auto cfg = TestConfig(1, 2, 0);
  cfg.hello_timeout_ms = 300000;  // the test's own bounds end it
  auto server = StartWithVariable(cfg);
  RawPeer p(server->port());
  wire::OutFrame f;
  f.builder.initRoot<proto::Request>().setId(3);
  f.builder.getRoot<proto::Request>().setStatus();
  const std::string one = FrameBytes(f);
  // About 100 bytes of reply each, 40 MB in all: far more than the kernel holds for a peer that
  // does not read (psd's send buffer grows to tcp_wmem's 4 MiB by default).
  const int n = 400000;
  std::string all;
  all.reserve(one.size() * n);
  for (int i = 0; i < n; ++i) all += one;
  // The reads below make the socket non-blocking: the writer waits for room itself.
  std::thread writer([&, fd = p.socket.native_handle()] {
    size_t sent = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (sent < all.size() && std::chrono::steady_clock::now() < until) {
      ssize_t k = ::send(fd, all.data() + sent, all.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        sent += static_cast<size_t>(k);
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        pollfd w{fd, POLLOUT, 0};
        ::poll(&w, 1, 100);
      } else {
        break;
      }
    }
  });
  const bool paused = Eventually([&] { return server->metrics().reads_paused() >= 1; });
  CHECK(paused);
  int answered = 0;
  Code code = Code::kOk;
  std::string msg;
  while (answered < n && p.Read(&code, &msg)) {
    if (code != Code::kFailedPrecondition) break;
    ++answered;
  }
  writer.join();
  CHECK(answered == n);
  ExpectHealthy(server->port());
}

TEST_CASE("a worker that pipelines requests and never reads is held up at --max-queued-reply-bytes",
          "[robustness][dos]") {
  // 16 pulls of a 4 MiB variable sent at once, nothing read: psd stops reading the worker's
  // requests while more than --max-queued-reply-bytes (8 MiB here) of replies wait, and every
  // request is answered once it reads. Before, only connections without a hello were held up; a
  // worker's 40 `pull_rows` of 4096 rows (each reply a copy) grew psd by 640 MB.
  auto cfg = TestConfig(1, 3, 0);
  cfg.max_queued_reply_bytes = 8 << 20;
  auto server = StartServer(cfg);
  const int64_t n = 1 << 20;  // 4 MiB of float32
  std::vector<float> init(static_cast<size_t>(n), 2.0f);
  auto owner = ConnectWorker(server->port(), "owner");
  REQUIRE(owner->CreateVariable("big", {init.data(), DType::kFloat32, {n}, MemoryKind::kHost}).ok());
  RawPeer p(server->port());
  p.Hello("reader");
  const uint64_t paused_before = server->metrics().reads_paused();
  constexpr int kPulls = 16;  // 64 MiB of replies: far more than the kernel holds for a peer that does not read
  for (int i = 0; i < kPulls; ++i) {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(static_cast<uint64_t>(100 + i));
    req.initPull().initNames(1).set(0, "big");
    p.Send(f);
  }
  CHECK(Eventually([&] { return server->metrics().reads_paused() > paused_before; }));
  for (int i = 0; i < kPulls; ++i) {
    REQUIRE(
        wire::ReadFrame(p.socket, p.in, 16 << 20, std::chrono::steady_clock::now() + std::chrono::seconds(60)).ok());
    auto r = p.in.Reader()->getRoot<proto::Response>();
    REQUIRE(r.getCode() == proto::Code::OK);
    CHECK(r.getId() == static_cast<uint64_t>(100 + i));
  }
}

TEST_CASE("a lookup whose replies outgrow --max-queued-reply-bytes is read as it is sent", "[robustness][dos]") {
  // libpsclient sends a lookup's requests before it reads their replies, and psd reads no request
  // while more than --max-queued-reply-bytes of replies wait: the client learns the bound at hello
  // and reads replies before sending more once half of it could be unread, so psd never holds its
  // reads. 1 Mi rows of a [65536, 2] float32 table in replies of 256 KiB, the bound at 1 MiB.
  // (tests/client/reply_window_test.cc shows the deadlock without it, against small socket
  // buffers; here TCP's own buffers may hide it.)
  auto cfg = TestConfig(1, 2, 0);
  cfg.max_queued_reply_bytes = 1 << 20;
  cfg.shared_memory = false;
  auto server = StartServer(cfg);
  constexpr int64_t kTable = 65536;
  std::vector<float> table(static_cast<size_t>(kTable) * 2);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i);
  auto o = WorkerOptions(server->port(), "w");
  o.pull_frame_bytes = 256 << 10;
  auto w = psd::testing::ConnectWith(o);
  REQUIRE(w->CreateVariable("table", {table.data(), DType::kFloat32, {kTable, 2}, MemoryKind::kHost}).ok());
  const uint64_t paused_before = server->metrics().reads_paused();
  constexpr size_t kRows = size_t{1} << 20;
  std::vector<int64_t> rows(kRows);
  for (size_t i = 0; i < kRows; ++i) rows[i] = static_cast<int64_t>((i * 7919) % kTable);
  std::vector<float> out(kRows * 2, -1.0f);
  auto step = w->PullRows("table", rows, {out.data(), DType::kFloat32, {static_cast<int64_t>(kRows), 2}});
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  size_t wrong = 0;
  for (size_t i = 0; i < kRows; ++i) {
    wrong += out[2 * i] != table[2 * rows[i]] || out[2 * i + 1] != table[2 * rows[i] + 1];
  }
  CHECK(wrong == 0);
  CHECK(server->metrics().reads_paused() == paused_before);
}

TEST_CASE("frames in flight share --max-inflight-bytes: a worker over it waits, a stalled frame is cut off",
          "[robustness][dos][budget]") {
  auto cfg = TestConfig(1, 4, 0);  // "owner", two greedy insiders and "healthy"
  cfg.max_frame_bytes = 4ull << 20;
  cfg.max_inflight_bytes = 8ull << 20;
  cfg.frame_timeout_ms = 1000;
  auto server = StartWithVariable(cfg);
  server::FrameBudget& budget = server->frame_budget();
  // Two workers each announce a frame of just under 4 MiB and never send it: together they hold the whole budget.
  std::vector<std::unique_ptr<RawPeer>> greedy;
  for (const char* name : {"greedy-1", "greedy-2"}) {
    greedy.push_back(std::make_unique<RawPeer>(server->port()));
    greedy.back()->Hello(name);
    greedy.back()->SendBytes(Words({0, (4u << 20) / 8 - 64}) + "partial");
  }
  REQUIRE(Eventually([&] { return budget.in_use() + (1 << 10) >= budget.limit(); }));
  // A real worker's push does not fit: it waits (backpressure, not an error) until psd closes the
  // stalled senders after --frame-timeout-ms, then goes through.
  auto healthy = ConnectWorker(server->port(), "healthy");
  std::vector<float> grad(256 << 10, 1.0f);  // 1 MiB
  float v = -1;
  REQUIRE(healthy->Pull("w", {&v, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  std::vector<float> big(256 << 10, 0.0f);
  auto s = healthy->CreateVariable("big", {big.data(), DType::kFloat32, {int64_t(big.size())}, MemoryKind::kHost});
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  CHECK(budget.waits() >= 1);
  for (auto& g : greedy) CHECK(g->ClosedWithin(std::chrono::seconds(30)));
  CHECK(server->metrics().frame_timeouts() == 2);
  REQUIRE(healthy->Push(0, {{"big", {grad.data(), DType::kFloat32, {int64_t(grad.size())}, MemoryKind::kHost}}}).ok());
  CHECK(budget.peak() <= budget.limit());
  healthy.reset();
  CHECK(Eventually([&] { return budget.in_use() == 0; }));  // every connection gave its share back
}

TEST_CASE("buffers kept for the next frame are given back when a push waits for its share", "[robustness][budget]") {
  // Three workers, one 3 MiB variable, 8 MiB for frames in flight: after two pushes the idle
  // connections keep 6 MiB for their next frame, and the third push (which completes the step)
  // must not wait for them forever.
  auto cfg = TestConfig(3, 3, 0);
  cfg.max_frame_bytes = 4ull << 20;
  cfg.max_inflight_bytes = 8ull << 20;
  auto server = StartServer(cfg);
  const size_t n = (3u << 20) / 4;
  std::vector<float> init(n, 0.0f), grad(n, 1.0f);
  std::vector<std::unique_ptr<psclient::Client>> workers;
  for (int k = 0; k < 3; ++k) {
    psclient::ClientOptions o;
    o.port = server->port();
    o.worker_name = "worker-" + std::to_string(k);
    o.connect_timeout_ms = 5000;
    o.request_timeout_ms = 20000;  // bounds the test if the third push waited forever
    auto c = psclient::Client::Connect(o);
    REQUIRE(c.ok());
    workers.push_back(std::move(*c));
  }
  auto created = workers[0]->CreateVariable("w", {init.data(), DType::kFloat32, {int64_t(n)}, MemoryKind::kHost});
  REQUIRE(created.ok());
  for (auto& w : workers) {
    auto pushed = w->Push(0, {{"w", {grad.data(), DType::kFloat32, {int64_t(n)}, MemoryKind::kHost}}});
    INFO(pushed.status().ToString());
    REQUIRE(pushed.ok());
  }
  CHECK(server->engine()->global_step() == 1);
  CHECK(server->frame_budget().peak() <= server->frame_budget().limit());
  // The frames' buffers, held and kept for reuse, stay within the budget (but for each held
  // buffer's rounding up to a granule).
  const server::FramePool& pool = server->frame_pool();
  CHECK(pool.maps() >= 1);
  CHECK(pool.handed_out_bytes() + pool.kept_bytes() <= pool.limit() + 3 * server::FramePool::kGranule);
  workers.clear();
  CHECK(Eventually([&] { return pool.handed_out_bytes() == 0; }));
  CHECK(pool.kept_bytes() <= pool.limit());
}

TEST_CASE("an unauthenticated flood never touches the frame budget, a worker trains through it",
          "[robustness][dos][budget]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.auth_token = "s3cret";
  cfg.max_frame_bytes = 4ull << 20;
  cfg.max_inflight_bytes = 4ull << 20;
  cfg.hello_timeout_ms = 500;
  cfg.max_connections = 64;
  auto server = StartServer(cfg);
  std::atomic<bool> stop{false};
  std::atomic<int> attacks{0};
  // The attacker: connections that announce 200 MB before a hello, silent ones, half-sent hellos,
  // hellos with a wrong token followed by a big frame — over and over while the worker trains.
  std::thread attacker([&] {
    while (!stop) {
      std::vector<std::unique_ptr<RawPeer>> conns;
      for (int i = 0; i < 8 && !stop; ++i) {
        try {
          auto p = std::make_unique<RawPeer>(server->port());
          switch (i % 4) {
            case 0:
              p->SendBytes(Words({0, (200u << 20) / 8}));
              break;
            case 1:
              break;  // silent
            case 2:
              p->SendBytes(Words({0, 1000}) + "half");
              break;
            case 3: {
              wire::OutFrame f;
              auto h = f.builder.initRoot<proto::Request>();
              h.initHello().setAuthToken("wrong");
              (void)wire::WriteFrame(p->socket, f);
              p->SendBytes(Words({0, (4u << 20) / 8 - 64}));
              break;
            }
          }
          conns.push_back(std::move(p));
        } catch (const std::exception&) {
          // refused at --max-connections: fine, try again
        }
        ++attacks;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  psclient::ClientOptions o;
  o.port = server->port();
  o.worker_name = "worker";
  o.auth_token = "s3cret";
  o.connect_timeout_ms = 30000;
  auto w = psclient::Client::Connect(o);
  INFO(w.status().ToString());
  REQUIRE(w.ok());
  std::vector<float> value(256 << 10, 0.0f), grad(256 << 10, 0.5f);  // 1 MiB
  REQUIRE((*w)->CreateVariable("v", {value.data(), DType::kFloat32, {int64_t(value.size())}, MemoryKind::kHost}).ok());
  for (int step = 0; step < 20; ++step) {
    REQUIRE((*w)->Push(step, {{"v", {grad.data(), DType::kFloat32, {int64_t(grad.size())}, MemoryKind::kHost}}}).ok());
  }
  stop = true;
  attacker.join();
  CHECK(attacks > 0);
  CHECK(server->frame_budget().waits() == 0);
  CHECK(server->frame_budget().peak() <= (2u << 20));  // only the worker's own frames
  REQUIRE((*w)->Pull("v", {value.data(), DType::kFloat32, {int64_t(value.size())}, MemoryKind::kHost}).ok());
  CHECK(value[0] < 0);  // 20 steps of sgd on a positive gradient
}

TEST_CASE("an accepted connection goes to the I/O thread with the fewest live connections", "[robustness][threads]") {
  auto cfg = TestConfig(1, 8, 0);
  cfg.io_threads = 2;
  cfg.hello_timeout_ms = 60000;  // the raw peers below never say hello
  auto server = StartServer(cfg);
  // Connections are counted when accepted and uncounted when psd sees them close: wait (bounded).
  auto reaches = [&](std::vector<int> want) {
    for (int i = 0; i < 2000; ++i) {
      if (server->ConnectionsPerIoThread() == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    INFO("per thread now: " << server->ConnectionsPerIoThread()[0] << ", " << server->ConnectionsPerIoThread()[1]);
    return false;
  };
  auto a = std::make_unique<RawPeer>(server->port());
  REQUIRE(reaches({1, 0}));
  auto b = std::make_unique<RawPeer>(server->port());
  REQUIRE(reaches({1, 1}));
  auto c = std::make_unique<RawPeer>(server->port());
  REQUIRE(reaches({2, 1}));
  a.reset();
  c.reset();
  REQUIRE(reaches({0, 1}));
  // In turn, the next would go to thread 1; by load it goes to thread 0, then (a tie) thread 0.
  auto d = std::make_unique<RawPeer>(server->port());
  REQUIRE(reaches({1, 1}));
  auto e = std::make_unique<RawPeer>(server->port());
  REQUIRE(reaches({2, 1}));
}

TEST_CASE("a closed connection's parked reduce_to keeps neither its frame's memory nor its deadline timer",
          "[robustness][budget]") {
  // Rounds of four replicas; three, one after the other, each send an 8 MiB reduce_to (parked: the
  // fourth never contributes) with a ten-minute deadline, and go. Each connection's body buffer
  // goes back to the pool at its close (the round's waiter still holds the session); before, it
  // stayed, outside the budget, for as long as the round did.
  auto cfg = TestConfig(4, 8, 0);
  cfg.max_frame_bytes = 16ull << 20;
  auto server = StartServer(cfg);
  const size_t n = (8u << 20) / 4;
  std::vector<float> zero(n, 0.0f), mine(n, 1.0f);
  auto owner = ConnectWorker(server->port(), "owner");
  psclient::VariableOptions not_trained;
  not_trained.trainable = false;
  REQUIRE(owner->CreateVariable("total", {zero.data(), DType::kFloat32, {int64_t(n)}, MemoryKind::kHost}, not_trained)
              .ok());
  const server::FramePool& pool = server->frame_pool();
  const uint64_t before = pool.handed_out_bytes();  // the owner's connection keeps its create's buffer
  for (int k = 0; k < 3; ++k) {
    RawPeer peer(server->port());
    peer.Hello("leaver-" + std::to_string(k));
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(7);
    auto r = req.initReduce();
    r.setOp(proto::Reduction::SUM);
    r.setLocalStep(0);
    r.setTimeoutMs(600000);
    auto e = r.initEntries(1)[0];
    e.setDestination("total");
    wire::SetTensor(f.builder, e.initValue(), DType::kFloat32, {int64_t(n)}, mine.data(), n * 4);
    peer.Send(f);
    // A status request after it: its answer says the reduce was read and parked (frames are
    // handled in order), its buffer kept for the connection's next frame.
    wire::OutFrame st;
    auto q = st.builder.initRoot<proto::Request>();
    q.setId(8);
    q.setStatus();
    peer.Send(st);
    Code code;
    std::string message;
    uint64_t id = 0;
    REQUIRE(peer.Read(&code, &message, &id));
    CHECK(id == 8);
    CHECK(pool.handed_out_bytes() >= before + (8u << 20));
  }  // the peer closes
  CHECK(Eventually([&] { return pool.handed_out_bytes() <= before; }));
  // The daemon serves on.
  auto w = ConnectWorker(server->port(), "after");
  std::vector<float> got(n, -1.0f);
  REQUIRE(w->Pull("total", {got.data(), DType::kFloat32, {int64_t(n)}, MemoryKind::kHost}).ok());
  CHECK(got[0] == 0.0f);
}

TEST_CASE("a token wait whose answer finds no memory gives the token back and tells the worker", "[robustness][oom]") {
  // The values asked with the token (pull_after, as bfloat16: a converted copy psd makes) find no
  // memory. The worker hears ResourceExhausted in a reply with its push's results, the token goes
  // back to the queue, and its next wait takes it. The answer runs from a post to the worker's
  // strand (another worker's push completed the step) or inside the push that completed it.
  // Before, the token was lost: the posted answer left the worker waiting past its deadline, the
  // inline one closed its connection.
  if (server::ValuesSegment::Current() != nullptr) return;  // big buffers live in the segment
  const auto cfg = TestConfig(2, 2, 0);  // no initial tokens: the first wait parks until step 0 is done
  OutOfMemoryDaemon daemon(cfg);
  auto& storage = daemon.storage;
  auto& server = daemon.server;
  const bool asked_by_completer = GENERATE(false, true);
  CAPTURE(asked_by_completer);
  auto first = daemon.Worker("first");
  auto second = daemon.Worker("second");
  const int64_t n = 300000;  // its bfloat16 copy, 600 000 bytes, is no other buffer's size
  std::vector<float> zeros(static_cast<size_t>(n), 0.0f), grad(static_cast<size_t>(n), 1.0f);
  REQUIRE(first->CreateVariable("v", {zeros.data(), DType::kFloat32, {n}}).ok());
  std::vector<uint16_t> halves(static_cast<size_t>(n), 0xffff);
  const std::vector<std::pair<std::string, TensorView>> after = {{"v", {halves.data(), DType::kBFloat16, {n}}}};
  const std::vector<psclient::Gradient> grads = {{"v", {grad.data(), DType::kFloat32, {n}}}};
  storage->FailNextOfSize(static_cast<size_t>(n) * 2);
  Result<psclient::PushOutcome> asked = Internal("not run"), other = Internal("not run");
  psclient::Client& asker = asked_by_completer ? *second : *first;
  psclient::Client& plain = asked_by_completer ? *first : *second;
  std::thread t1([&] {
    if (asked_by_completer) {
      other = plain.Push(0, grads, true, 20000);
    } else {
      asked = asker.Push(0, grads, {}, true, 20000, &after);
    }
  });
  const bool in = Eventually([&] { return server->engine()->Stats().accepted >= 1; });
  if (asked_by_completer) {
    asked = asker.Push(0, grads, {}, true, 20000, &after);
  } else {
    other = plain.Push(0, grads, true, 20000);
  }
  t1.join();
  REQUIRE(in);
  REQUIRE(other.ok());
  CHECK(other->token_status.ok());
  INFO(asked.status().ToString());
  REQUIRE(asked.ok());  // the push counted, and the worker heard so
  CHECK(asked->accepted() == 1);
  CHECK_FALSE(storage->armed_for_size());  // the copy found no memory
  CHECK(asked->token_status.code() == Code::kResourceExhausted);
  CHECK_THAT(asked->token_status.message(), Catch::Contains("wait for it again (WaitToken)"));
  CHECK(asked->pulled_step == -1);
  CHECK(server->engine()->global_step() == 1);
  // The token is the worker's to take again, and the values come with a pull.
  auto token = asker.WaitToken(5000);
  INFO(token.status().ToString());
  REQUIRE(token.ok());
  CHECK(*token == 1);
  auto pulled = asker.Pull("v", {halves.data(), DType::kBFloat16, {n}});
  REQUIRE(pulled.ok());
  CHECK(*pulled == 1);
  const float want = -static_cast<float>(cfg.optimizer.learning_rate);  // 0 - lr * mean(1, 1)
  int64_t wrong = 0;
  for (uint16_t h : halves) wrong += h != FloatToBFloat16(want) ? 1 : 0;
  CHECK(wrong == 0);
}

TEST_CASE("a token in a reply that the connection drops unwritten goes back to the queue", "[robustness]") {
  // A worker that does not read: a big pull's reply fills the socket, and the token its wait then
  // takes waits behind it. The worker goes away; the token must not go with a reply never written.
  auto cfg = TestConfig(1, 2, 1);  // one initial token
  auto server = StartServer(cfg);
  const int64_t n = 8 << 20;  // 32 MiB of float32: more than the kernel's socket buffers hold
  std::vector<float> init(static_cast<size_t>(n), 2.0f);
  auto owner = ConnectWorker(server->port(), "owner");
  REQUIRE(owner->CreateVariable("big", {init.data(), DType::kFloat32, {n}, MemoryKind::kHost}).ok());
  REQUIRE(server->engine()->Stats().tokens_queued == 1);
  auto p = std::make_unique<RawPeer>(server->port());
  p->Hello("stuck");
  wire::OutFrame pull;
  auto req = pull.builder.initRoot<proto::Request>();
  req.setId(100);
  req.initPull().initNames(1).set(0, "big");
  p->Send(pull);
  wire::OutFrame wait;
  auto w = wait.builder.initRoot<proto::Request>();
  w.setId(101);
  w.initWaitToken().setTimeoutMs(60000);
  p->Send(wait);
  // The wait took the token; its reply is queued behind the pull's, which the peer does not read.
  REQUIRE(Eventually([&] { return server->engine()->Stats().tokens_queued == 0; }));
  p.reset();  // closed with unread data: reset, and psd's write fails
  CHECK(Eventually([&] { return server->engine()->Stats().tokens_queued == 1; }));
  auto token = owner->WaitToken(5000);  // another worker takes it
  INFO(token.status().ToString());
  CHECK(token.ok());
}

TEST_CASE("a reduce_to whose answer finds no memory is answered RESOURCE_EXHAUSTED and its round stands",
          "[robustness][oom]") {
  // The reduced value goes back in the destination's dtype (bfloat16: a converted copy psd makes
  // for each reply), from a post once the round completes. The first of the two copies finds no
  // memory: that worker hears RESOURCE_EXHAUSTED and reads the result with a pull; the other gets
  // it as usual. Before, the throw reached the I/O loop and the worker waited out its deadline.
  if (server::ValuesSegment::Current() != nullptr) return;  // big buffers live in the segment
  OutOfMemoryDaemon daemon(TestConfig(2, 2));
  auto& storage = daemon.storage;
  auto first = daemon.Worker("first");
  auto second = daemon.Worker("second");
  const int64_t n = 300000;  // its bfloat16 copy, 600 000 bytes, is no other buffer's size
  std::vector<uint16_t> zeros(static_cast<size_t>(n), 0);
  psclient::VariableOptions non_trainable;
  non_trainable.trainable = false;
  REQUIRE(first->CreateVariable("total", {zeros.data(), DType::kBFloat16, {n}}, non_trainable).ok());
  std::vector<float> ones(static_cast<size_t>(n), 1.0f), twos(static_cast<size_t>(n), 2.0f);
  std::vector<uint16_t> got_first(static_cast<size_t>(n), 0xffff), got_second(static_cast<size_t>(n), 0xffff);
  storage->FailNextOfSize(static_cast<size_t>(n) * 2);
  Result<psclient::ReduceResult> r_first = Internal("not run"), r_second = Internal("not run");
  std::thread t([&] {
    r_first = first->ReduceTo(psclient::ReduceOp::kSum, 0, {ones.data(), DType::kFloat32, {n}}, "total",
                              {got_first.data(), DType::kBFloat16, {n}}, 20000);
  });
  r_second = second->ReduceTo(psclient::ReduceOp::kSum, 0, {twos.data(), DType::kFloat32, {n}}, "total",
                              {got_second.data(), DType::kBFloat16, {n}}, 20000);
  t.join();
  CHECK_FALSE(storage->armed_for_size());  // one reply's copy found no memory
  INFO(r_first.status().ToString() << " / " << r_second.status().ToString());
  REQUIRE(r_first.ok() != r_second.ok());
  psclient::Client& refused = r_first.ok() ? *second : *first;
  const Status& why = r_first.ok() ? r_second.status() : r_first.status();
  const Result<psclient::ReduceResult>& answered = r_first.ok() ? r_first : r_second;
  const std::vector<uint16_t>& got = r_first.ok() ? got_first : got_second;
  CHECK(why.code() == Code::kResourceExhausted);
  CHECK_THAT(why.message(), Catch::Contains("read its result (a pull)"));
  CHECK(answered->accepted);
  const uint16_t three = FloatToBFloat16(3.0f);
  int64_t wrong = 0;
  for (uint16_t h : got) wrong += h != three ? 1 : 0;
  CHECK(wrong == 0);
  // The round stands: the refused worker reads the sum.
  std::vector<uint16_t> total(static_cast<size_t>(n), 0xffff);
  REQUIRE(refused.Pull("total", {total.data(), DType::kBFloat16, {n}}).ok());
  wrong = 0;
  for (uint16_t h : total) wrong += h != three ? 1 : 0;
  CHECK(wrong == 0);
}
