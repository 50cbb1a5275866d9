// The request lane (README "Same-host shared memory", common/wire/shm_lane.h), driven by hand: a
// worker's frames, both ways, travel in shared-memory rings psd made for it (a real client's
// training through one: shm_test.cc); a worker that asks for it without one, scribbles on its
// indices or dies mid-frame loses its own connection and nothing else.
#include "wire/shm_lane.h"

#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "support/eventually.h"
#include "support/raw_peer.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWith;
using psd::testing::Eventually;
using psd::testing::RawPeer;
using psd::testing::StartServer;
using psd::testing::TestConfig;
using psd::testing::WorkerOptions;

namespace {

// A hand-driven worker on a lane: hello and attach over TCP (asking for the lane), then frames in
// the lane, each wait bounded by the test's own limit.
struct LanePeer {
  explicit LanePeer(uint16_t port) : tcp(port) {
    tcp.Hello("lane");
    auto seg = wire::SharedSegment::Create(64 << 10, "test");
    REQUIRE(seg.ok());
    segment = *seg;
    std::vector<int> fds;
    const std::string answer =
        testing::ShmAttach(tcp.shm_socket, wire::ShmAttachMessage(tcp.connection_id, tcp.shm_nonce, /*lane=*/true),
                           segment->fd(), -1, &fds);
    // "OK", the values segment's descriptor when there is one, then the lane's four.
    REQUIRE(answer.rfind("OK", 0) == 0);
    REQUIRE(answer.size() >= std::strlen(wire::kShmAnswerLane));
    REQUIRE(answer.substr(answer.size() - std::strlen(wire::kShmAnswerLane)) == wire::kShmAnswerLane);
    REQUIRE(fds.size() >= wire::ShmLane::kFds);
    std::vector<int> lane_fds(fds.end() - wire::ShmLane::kFds, fds.end());
    for (size_t i = 0; i + wire::ShmLane::kFds < fds.size(); ++i) ::close(fds[i]);
    auto adopted = wire::ShmLane::Adopt(lane_fds);
    REQUIRE(adopted.ok());
    lane = *adopted;
  }
  void UseLane() {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(0);
    req.setUseLane();
    tcp.Send(f);
  }
  // Sleeps until the lane's doorbell rings (false: not within 30 s, or the TCP connection ended).
  bool Wait(wire::ShmLane::Wait what) {
    if (!lane->PrepareWait(what)) return true;
    pollfd p[2] = {{lane->WaitFd(what), POLLIN, 0}, {tcp.socket.native_handle(), POLLIN, 0}};
    const int r = ::poll(p, 2, 30000);
    lane->FinishWait(what);
    return r > 0 && p[1].revents == 0;
  }
  void Send(wire::OutFrame& f) {
    auto parts = f.Buffers();
    const size_t total = asio::buffer_size(parts);
    size_t done = 0;
    while (done < total) {
      done += lane->Write(parts.data(), parts.data() + parts.size(), done);
      if (done < total) REQUIRE(Wait(wire::ShmLane::Wait::kRoom));
    }
  }
  // The next reply in the lane: its code and id.
  Code Answer(uint64_t* id) {
    auto read = [&](void* dst, size_t n) {
      auto* p = static_cast<uint8_t*>(dst);
      while (n > 0) {
        const size_t k = lane->Read(p, n);
        p += k;
        n -= k;
        if (n > 0 && k == 0 && !Wait(wire::ShmLane::Wait::kData)) return Unavailable("no reply in the lane");
      }
      return Status::Ok();
    };
    wire::InFrame in;
    REQUIRE(wire::ReadFrameWith(read, in, 1 << 20, "test").ok());
    auto r = in.Reader();
    auto resp = r->getRoot<proto::Response>();
    *id = resp.getId();
    return wire::FromWire(resp.getCode());
  }
  void SendStatus(uint64_t id) {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(id);
    req.setStatus();
    Send(f);
  }
  // The worker's own mapping of the lane's first page (the rings' indices).
  uint64_t* Index(size_t byte_offset) {
    if (page == nullptr) {
      void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, lane->Fds()[0], 0);
      REQUIRE(p != MAP_FAILED);
      page = static_cast<uint8_t*>(p);
    }
    return reinterpret_cast<uint64_t*>(page + byte_offset);
  }
  ~LanePeer() {
    if (page != nullptr) ::munmap(page, 4096);
  }

  RawPeer tcp;
  std::shared_ptr<wire::SharedSegment> segment;
  std::shared_ptr<wire::ShmLane> lane;
  uint8_t* page = nullptr;
};

// A real worker trains a step on `server` (psd serves others whatever one connection did).
void OthersAreServed(server::Server& server) {
  auto c = ConnectWith(WorkerOptions(server.port(), "other"));
  float v = 1, g = 1;
  REQUIRE(c->CreateVariable("v", {&v, DType::kFloat32, {}}).ok());
  auto pushed = c->Push(0, {{"v", {&g, DType::kFloat32, {}}}}, {}, true, 10000);
  REQUIRE(pushed.ok());
  REQUIRE(c->Pull("v", {&v, DType::kFloat32, {}}).ok());
  CHECK(v == Approx(1 - 0.01f).epsilon(1e-6));
}

}  // namespace

TEST_CASE("frames in a lane get their replies in the lane and the TCP connection stays open beside it", "[shm][lane]") {
  auto server = StartServer(TestConfig(1, 3));
  LanePeer p(server->port());
  p.UseLane();
  for (uint64_t id = 10; id < 15; ++id) p.SendStatus(id);  // pipelined
  for (uint64_t id = 10; id < 15; ++id) {
    uint64_t got = 0;
    CHECK(p.Answer(&got) == Code::kOk);
    CHECK(got == id);
  }
  CHECK(server->metrics().lanes() == 1);
  CHECK(server->connection_count() == 1);
}

TEST_CASE("requests a worker wrote in its lane before it closed its end are still served", "[shm][lane]") {
  // As over TCP, where the bytes sent before a FIN are read: a worker that writes a request and
  // exits at once (a create, here) has it done.
  auto server = StartServer(TestConfig(1, 3));
  {
    LanePeer p(server->port());
    p.UseLane();
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(3);
    auto create = req.initCreateVariable();
    create.setName("late");
    create.initInitial().setDtype(proto::DType::FLOAT32);
    create.getInitial().initShape(1).set(0, 2);
    p.Send(f);
    boost::system::error_code ec;
    p.tcp.socket.close(ec);
  }
  CHECK(Eventually([&] { return server->connection_count() == 0; }));
  auto c = ConnectWith(WorkerOptions(server->port(), "reader"));
  float v[2] = {1, 1};
  REQUIRE(c->Pull("late", {v, DType::kFloat32, {2}}).ok());
  CHECK(v[0] == 0.0f);
}

TEST_CASE("useLane from a worker that has no lane closes its connection, saying why", "[shm][lane]") {
  auto server = StartServer(TestConfig(1, 3));
  RawPeer p(server->port());
  p.Hello("raw");
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(0);
  req.setUseLane();
  p.Send(f);
  std::string message;
  CHECK(p.Answer(&message) == Code::kFailedPrecondition);
  CHECK_THAT(message, Catch::Contains("useLane without a lane"));
  CHECK(p.ClosedByPeer());
  OthersAreServed(*server);
}

TEST_CASE("a worker that breaks its lane or dies mid-frame loses its own connection and nothing else", "[shm][lane]") {
  auto server = StartServer(TestConfig(1, 3));
  LanePeer p(server->port());
  p.UseLane();
  p.SendStatus(7);  // the lane works first
  uint64_t id = 0;
  REQUIRE(p.Answer(&id) == Code::kOk);
  REQUIRE(id == 7);

  SECTION("a request ring's tail beyond what it can hold") {
    // The request ring's tail (the worker's index) is at byte 64 of the lane's first page.
    *p.Index(64) = *p.Index(64) + (1ull << 40);
    // Rings psd's doorbell for requests (the lane's second descriptor), as a write would.
    const uint64_t one = 1;
    REQUIRE(::write(p.lane->Fds()[1], &one, sizeof(one)) == sizeof(one));
    CHECK(p.tcp.ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("a reply ring's head past what psd wrote") {
    *p.Index(512) = 1ull << 40;  // the reply ring's head (the worker's index)
    p.SendStatus(8);             // psd's reply finds no room it could trust
    CHECK(p.tcp.ClosedWithin(std::chrono::seconds(30)));
  }
  SECTION("half a frame in the lane, then the worker's end (a crash closes its descriptors)") {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(9);
    req.setStatus();
    std::vector<uint8_t> bytes;
    for (const auto& b : f.Buffers()) {
      const auto* at = static_cast<const uint8_t*>(b.data());
      bytes.insert(bytes.end(), at, at + b.size());
    }
    REQUIRE(p.lane->Write(bytes.data(), bytes.size() / 2) == bytes.size() / 2);  // it dies mid-copy
    boost::system::error_code ec;
    p.tcp.socket.close(ec);
    p.lane.reset();
    CHECK(Eventually([&] { return server->connection_count() == 0; }));
  }
  OthersAreServed(*server);
}
