// Same-host shared memory (README "Same-host shared memory"): a worker on the daemon's host moves
// tensors through a sealed memfd it attached over psd's abstract Unix socket; the results are
// those TCP gives; anything doubtful stays on (or falls back to) TCP; nothing a worker does to its
// segment or sends about it can hurt the daemon.
#include "wire/shm.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "core/accumulator.h"
#include "psd/half.h"
#include "service/values_segment.h"
#include "support/eventually.h"
#include "support/failing_storage.h"
#include "support/raw_peer.h"
#include "support/test_server.h"

using namespace psd;
using psd::server::DenseAccumulator;
using psd::testing::ConnectWith;
using psd::testing::PushFromShm;
using psd::testing::RawPeer;
using psd::testing::StartServer;
using psd::testing::TestConfig;
using psd::testing::WorkerOptions;

namespace {

constexpr int64_t kRows = 300, kCols = 500;  // 600 KB of float32

std::vector<float> Gradient(int step, int worker) {
  std::vector<float> g(static_cast<size_t>(kRows * kCols));
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] =
        static_cast<float>((i * 37 + static_cast<size_t>(step) * 11 + static_cast<size_t>(worker) * 5) % 101) * 0.011f -
        0.5f;
  }
  return g;
}

struct Trained {
  std::vector<float> w;          // after the last step, pulled with the token
  std::vector<uint16_t> w_bf16;  // then pulled as bfloat16
  std::vector<float> b;
  int shm_shards[2] = {0, 0};
  int lanes[2] = {0, 0};  // the clients' shared_memory_lanes()
  std::string status[2];  // their shared_memory_status()
};

// Two workers, three sync steps of {w [300, 500], b [7]}, the next values with the token.
// `shm_piece_bytes`: ClientOptions::shm_piece_bytes (the default, 4 MiB, moves w in one piece);
// `shm_lane`: ClientOptions::shm_lane.
Trained Train(server::Server& server, uint64_t shared_memory_bytes, uint64_t shm_piece_bytes = 4 << 20,
              bool shm_lane = true) {
  std::unique_ptr<psclient::Client> c[2];
  for (int i = 0; i < 2; ++i) {
    auto o = WorkerOptions(server.port(), "w" + std::to_string(i));
    o.shared_memory_bytes = shared_memory_bytes;
    o.shm_piece_bytes = shm_piece_bytes;
    o.shm_lane = shm_lane;
    c[i] = ConnectWith(o);
  }
  std::vector<float> init(static_cast<size_t>(kRows * kCols), 0.25f);
  REQUIRE(c[0]->CreateVariable("w", ConstTensorView{init.data(), DType::kFloat32, {kRows, kCols}}).ok());
  REQUIRE(c[0]->CreateVariable("b", ConstTensorView{nullptr, DType::kFloat32, {7}}).ok());
  Trained out;
  out.w.resize(init.size());
  for (int step = 0; step < 3; ++step) {
    std::thread t[2];
    std::string failed[2];  // Catch's assertions are not thread-safe: checked after the joins
    for (int i = 0; i < 2; ++i) {
      t[i] = std::thread([&, i] {
        auto g = Gradient(step, i);
        std::vector<float> b(7, 0.1f * static_cast<float>(i + step));
        std::vector<float> w(g.size());
        std::vector<std::pair<std::string, TensorView>> after = {{"w", {w.data(), DType::kFloat32, {kRows, kCols}}}};
        auto r = c[i]->Push(
            step, {{"w", {g.data(), DType::kFloat32, {kRows, kCols}}}, {"b", {b.data(), DType::kFloat32, {7}}}}, {},
            true, 10000, &after);
        if (!r.ok()) {
          failed[i] = r.status().ToString();
        } else if (!r->token_status.ok() || r->accepted() != 2) {
          failed[i] = "token " + r->token_status.ToString() + ", accepted " + std::to_string(r->accepted());
        }
        if (i == 0 && step == 2) out.w = w;
      });
    }
    for (auto& th : t) th.join();
    CHECK(failed[0] == "");
    REQUIRE(failed[1] == "");
  }
  out.w_bf16.resize(out.w.size());
  REQUIRE(c[1]->Pull("w", TensorView{out.w_bf16.data(), DType::kBFloat16, {kRows, kCols}}).ok());
  out.b.resize(7);
  REQUIRE(c[1]->Pull("b", TensorView{out.b.data(), DType::kFloat32, {7}}).ok());
  for (int i = 0; i < 2; ++i) {
    out.shm_shards[i] = c[i]->shared_memory_shards();
    out.lanes[i] = c[i]->shared_memory_lanes();
    out.status[i] = c[i]->shared_memory_status();
  }
  return out;
}

std::string Attach(const std::string& socket_name, const std::string& message, int fd) {
  return psd::testing::ShmAttach(socket_name, message, fd);
}

void PullToShm(RawPeer& p, uint64_t id, uint64_t offset, uint64_t bytes) {
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(id);
  auto pull = req.initPull();
  pull.initNames(1).set(0, "v");
  pull.initToShm().setOffset(offset);
  pull.getToShm().setBytes(bytes);
  p.Send(f);
}

}  // namespace

TEST_CASE("a same-host worker moves tensors through shared memory, with the values TCP gives", "[shm]") {
  // No initial tokens: each token comes with its step's commit, so the values that come with it
  // are that step's in both runs.
  auto shm_server = StartServer(TestConfig(2, 2, 0));
  auto tcp_server = StartServer(TestConfig(2, 2, 0));
  Trained shm = Train(*shm_server, 1 << 30);
  Trained tcp = Train(*tcp_server, 0);
  CHECK(shm.shm_shards[0] == 1);
  CHECK(shm.shm_shards[1] == 1);
  CHECK(tcp.shm_shards[0] == 0);
  // Bit-identical: the same adds in the same order, whatever carried the bytes.
  CHECK(std::memcmp(shm.w.data(), tcp.w.data(), shm.w.size() * sizeof(float)) == 0);
  CHECK(shm.w_bf16 == tcp.w_bf16);
  CHECK(shm.b == tcp.b);
  // It trained: w[0] = 0.25 - 0.01 * (mean of the two workers' gradients, summed over 3 steps).
  CHECK(shm.w[0] == Approx(0.25 + 0.01 * (0.4725 + 0.3515 + 0.2305)).epsilon(1e-5));
  CHECK(shm_server->metrics().shm_bytes() > 3 * 2 * kRows * kCols * sizeof(float));
  CHECK(tcp_server->metrics().shm_bytes() == 0);
  REQUIRE(shm_server->shm() != nullptr);
  CHECK(shm_server->shm()->attached() == 2);
}

TEST_CASE("a same-host worker's frames travel in a lane with the values TCP gives, frames bigger than its ring too",
          "[shm][lane]") {
  auto lane_server = StartServer(TestConfig(2, 2, 0));
  auto big_server = StartServer(TestConfig(2, 2, 0));
  auto no_lane_server = StartServer(TestConfig(2, 2, 0));
  auto tcp_server = StartServer(TestConfig(2, 2, 0));
  Trained lane = Train(*lane_server, 1 << 30);  // the defaults: shared memory and its lane
  // A 64 KiB segment holds none of w's 600 KB: its gradients and values go in the frames, which
  // stream through the lane's 512 KiB rings both ways.
  Trained big_frames = Train(*big_server, 64 << 10);
  Trained no_lane = Train(*no_lane_server, 1 << 30, 4 << 20, /*shm_lane=*/false);
  Trained tcp = Train(*tcp_server, 0);
  for (int i = 0; i < 2; ++i) {
    CHECK(lane.lanes[i] == 1);
    CHECK(big_frames.lanes[i] == 1);
    CHECK(no_lane.lanes[i] == 0);
    CHECK(tcp.lanes[i] == 0);
    CHECK(lane.status[i] == "");
    CHECK(no_lane.status[i] == "");  // not asked for: nothing to explain
  }
  CHECK(lane_server->metrics().lanes() == 2);
  CHECK(big_server->metrics().lanes() == 2);
  CHECK(no_lane_server->metrics().lanes() == 0);
  CHECK(tcp_server->metrics().lanes() == 0);
  CHECK(big_server->metrics().bytes_in() > 3 * 2 * kRows * kCols * sizeof(float));  // in the frames
  // Bit-identical: the same adds in the same order, whatever carried the bytes.
  for (const Trained* t : {&lane, &big_frames, &no_lane}) {
    CHECK(std::memcmp(t->w.data(), tcp.w.data(), tcp.w.size() * sizeof(float)) == 0);
    CHECK(t->w_bf16 == tcp.w_bf16);
    CHECK(t->b == tcp.b);
  }
}

TEST_CASE("pushes and pulls bigger than a piece move through shared memory in pieces, with the same values", "[shm]") {
  // 64 KiB pieces: w's 600 KB gradient goes in 10 frames, each piece copied into the segment as
  // its frame goes out. Without the values segment its values come back in ranges after the
  // token, each written into the segment; with it, in place with the token.
  auto no_values = TestConfig(2, 2, 0);
  no_values.values_segment = false;
  auto pieces_server = StartServer(no_values);
  auto whole_server = StartServer(no_values);
  auto in_place_server = StartServer(TestConfig(2, 2, 0));
  Trained pieces = Train(*pieces_server, 1 << 30, 64 << 10);
  Trained whole = Train(*whole_server, 1 << 30, 0);
  Trained in_place = Train(*in_place_server, 1 << 30, 64 << 10);
  CHECK(pieces.shm_shards[0] == 1);
  CHECK(whole.shm_shards[0] == 1);
  CHECK(in_place.shm_shards[0] == 1);
  CHECK(std::memcmp(pieces.w.data(), whole.w.data(), pieces.w.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(in_place.w.data(), whole.w.data(), in_place.w.size() * sizeof(float)) == 0);
  CHECK(pieces.w_bf16 == whole.w_bf16);
  CHECK(in_place.w_bf16 == whole.w_bf16);
  CHECK(pieces.b == whole.b);
  CHECK(in_place.b == whole.b);
  CHECK(pieces.w[0] == Approx(0.25 + 0.01 * (0.4725 + 0.3515 + 0.2305)).epsilon(1e-5));
  // The tensors' bytes went through the segments, not the socket, both ways (w's initial value
  // alone goes over TCP: a create does not take shared memory).
  const uint64_t model = kRows * kCols * sizeof(float);
  CHECK(pieces_server->metrics().shm_bytes() > 3 * 2 * 2 * model);
  CHECK(pieces_server->metrics().values_in_place_bytes() == 0);
  CHECK(pieces_server->metrics().bytes_in() < 2 * model);
  CHECK(pieces_server->metrics().bytes_out() < model);
  // In place: the gradients through the segments, w's values (3 steps, 2 workers) read where psd
  // keeps them; only the bfloat16 pull (converted) and b (small, in the heap) were written.
  CHECK(in_place_server->metrics().values_in_place_bytes() == 3 * 2 * model);
  CHECK(in_place_server->metrics().shm_bytes() > 3 * 2 * model);
  CHECK(in_place_server->metrics().shm_bytes() < 3 * 2 * model + model);
  CHECK(in_place_server->metrics().bytes_out() < model);

  // One worker's push of w with its values after: 10 frames of pieces, then the values in 10
  // ranges (written into the segment) or with the token (in place).
  for (bool values_segment : {false, true}) {
    CAPTURE(values_segment);
    auto cfg = TestConfig(1, 1, 0);  // the token comes with the step's commit
    cfg.values_segment = values_segment;
    auto server = StartServer(cfg);
    auto o = WorkerOptions(server->port(), "w0");
    o.shm_piece_bytes = 64 << 10;
    auto c = ConnectWith(o);
    REQUIRE(c->shared_memory_shards() == 1);
    std::vector<float> w(static_cast<size_t>(kRows * kCols), 1.0f), g(w.size());
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 1000);
    REQUIRE(c->CreateVariable("w", ConstTensorView{w.data(), DType::kFloat32, {kRows, kCols}}).ok());
    const uint64_t before = c->requests_sent();
    std::vector<std::pair<std::string, TensorView>> after = {{"w", {w.data(), DType::kFloat32, {kRows, kCols}}}};
    auto r = c->Push(0, {{"w", {g.data(), DType::kFloat32, {kRows, kCols}}}}, {}, true, 10000, &after);
    REQUIRE(r.ok());
    REQUIRE(r->token_status.ok());
    CHECK(r->pulled_step == 1);
    // ceil(600000 / 65536) pieces each way, or the pieces alone
    CHECK(c->requests_sent() - before == (values_segment ? 10u : 20u));
    for (size_t i = 0; i < w.size(); i += 997) REQUIRE(w[i] == Approx(1 - 0.01f * g[i]).epsilon(1e-6));
    CHECK(w.back() == Approx(1 - 0.01f * g.back()).epsilon(1e-6));
  }
}

TEST_CASE("values named in place are read-only to the worker and stay as read until it says it read them", "[shm]") {
  auto server = StartServer(TestConfig(1, 2));  // "trainer" commits a step per push; "raw" reads
  auto trainer = ConnectWith(WorkerOptions(server->port(), "trainer"));
  constexpr int64_t n = 100000;  // 400 KB: kept in the values segment
  std::vector<float> v(n, 1.0f), g(n);
  for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] = static_cast<float>(i % 97);
  REQUIRE(trainer->CreateVariable("v", ConstTensorView{v.data(), DType::kFloat32, {n}}).ok());
  REQUIRE(trainer->Push(0, {{"v", {g.data(), DType::kFloat32, {n}}}}).ok());

  RawPeer p(server->port());
  p.Hello("raw");
  auto seg = wire::SharedSegment::Create(1 << 20, "test");
  REQUIRE(seg.ok());
  std::vector<int> passed;
  REQUIRE(psd::testing::ShmAttach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*seg)->fd(), -1,
                                  &passed) == "OK");
  REQUIRE(passed.size() == 1);
  const int values_fd = passed[0];
  // Never writable through what workers are given, nor opened again writable through /proc (its
  // mode is 0400; root, which the mode does not bind, is the one exception).
  CHECK(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, values_fd, 0) == MAP_FAILED);
  struct stat st {};
  REQUIRE(::fstat(values_fd, &st) == 0);
  CHECK((st.st_mode & 0777) == 0400);
  if (::geteuid() != 0) {
    const std::string again = "/proc/self/fd/" + std::to_string(values_fd);
    CHECK(::open(again.c_str(), O_RDWR | O_CLOEXEC) < 0);
  }
  // Nor by a process that can change its mode back (psd's uid, or root): sealed against every
  // writer but psd's own mapping (a review's worker of psd's uid rewrote every value before).
  CHECK((::fcntl(values_fd, F_GET_SEALS) & F_SEAL_FUTURE_WRITE) != 0);
  REQUIRE(::fchmod(values_fd, 0600) == 0);  // this test is psd's process: its uid
  {
    const std::string again = "/proc/self/fd/" + std::to_string(values_fd);
    const int rw = ::open(again.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(rw >= 0);
    CHECK(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0) == MAP_FAILED);
    CHECK(::pwrite(rw, "x", 1, 0) < 0);
    ::close(rw);
  }
  REQUIRE(::fchmod(values_fd, 0400) == 0);
  auto values = wire::SharedSegment::AdoptReadOnly(values_fd, UINT64_MAX);
  REQUIRE(values.ok());
  CHECK(::mprotect((*values)->data(), 4096, PROT_READ | PROT_WRITE) != 0);

  // A pull of v that may be named in place: segment 2, where psd published it.
  auto pull = [&](uint64_t id, bool in_place, proto::DType dtype, uint64_t values_read) {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(id);
    req.setValuesRead(values_read);
    auto pr = req.initPull();
    pr.initNames(1).set(0, "v");
    pr.initDtypes(1).set(0, dtype);
    auto target = pr.initToShm();
    target.setOffset(0);
    target.setBytes(1 << 20);
    target.setValues(in_place);
    p.Send(f);
    REQUIRE(wire::ReadFrame(p.socket, p.in, 1 << 20).ok());
    auto resp = p.in.Reader()->getRoot<proto::Response>();
    REQUIRE(resp.getCode() == proto::Code::OK);
    REQUIRE(resp.getId() == id);
    auto t = resp.getPull().getValues()[0];
    REQUIRE(t.getInShm());
    return std::pair<unsigned, uint64_t>{t.getShmSegment(), t.getShmOffset()};
  };
  auto [segment, at] = pull(2, true, proto::DType::FLOAT32, 0);
  REQUIRE(segment == wire::kValuesSegment);
  const float* named = reinterpret_cast<const float*>((*values)->At(at, n * sizeof(float)));
  REQUIRE(named != nullptr);
  std::vector<float> read(named, named + n);
  std::vector<float> pulled(n);
  REQUIRE(trainer->Pull("v", {pulled.data(), DType::kFloat32, {n}}).ok());
  CHECK(read == pulled);
  CHECK(read[5] == Approx(1 - 0.01f * 5).epsilon(1e-6));
  // Asked without `values`, or in another dtype: written into the worker's segment, as before.
  CHECK(pull(3, false, proto::DType::FLOAT32, 0).first == 0);
  CHECK(pull(4, true, proto::DType::BFLOAT16, 0).first == 0);

  // The trainer's steps change v, never the buffer "raw" was named and has not said it read.
  for (int step = 1; step <= 4; ++step) {
    REQUIRE(trainer->Push(step, {{"v", {g.data(), DType::kFloat32, {n}}}}).ok());
    REQUIRE(trainer->Pull("v", {pulled.data(), DType::kFloat32, {n}}).ok());
    CHECK(pulled[5] == Approx(1 - 0.01f * 5 * static_cast<float>(step + 1)).epsilon(1e-5));
    CHECK(std::memcmp(named, read.data(), n * sizeof(float)) == 0);
  }
  // Once read (a one-way valuesAck says so), psd lets it go: the buffer leaves the values segment.
  const uint64_t in_use = server::ValuesSegment::Current()->in_use();
  {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setValuesRead(2);
    req.setValuesAck();
    p.Send(f);
    wire::OutFrame status;  // answered after the ack was taken: the same connection, in order
    status.builder.initRoot<proto::Request>().setId(6);
    status.builder.getRoot<proto::Request>().setStatus();
    p.Send(status);
    std::string message;
    uint64_t id = 0;
    Code code = Code::kInternal;
    REQUIRE(p.Read(&code, &message, &id));
    CHECK(id == 6);  // the ack itself is never answered
  }
  CHECK(server::ValuesSegment::Current()->in_use() + n * sizeof(float) <= in_use);
  // A new pull names the current value.
  auto [segment2, at2] = pull(5, true, proto::DType::FLOAT32, 0);
  REQUIRE(segment2 == wire::kValuesSegment);
  const float* now = reinterpret_cast<const float*>((*values)->At(at2, n * sizeof(float)));
  REQUIRE(now != nullptr);
  CHECK(std::memcmp(now, pulled.data(), n * sizeof(float)) == 0);
  CHECK(server->metrics().values_in_place_bytes() >= 2 * n * sizeof(float));

  // A worker that never says it read what it was named holds at most eight versions of the
  // model's values (kHeldModels): before, up to 64 replies, each a version kept alive.
  const uint64_t base = server::ValuesSegment::Current()->in_use();
  for (int step = 5; step < 25; ++step) {
    REQUIRE(trainer->Push(step, {{"v", {g.data(), DType::kFloat32, {n}}}}).ok());
    REQUIRE(pull(static_cast<uint64_t>(10 + step), true, proto::DType::FLOAT32, 0).first == wire::kValuesSegment);
  }
  const uint64_t grown =
      server::ValuesSegment::Current()->in_use() - std::min(base, server::ValuesSegment::Current()->in_use());
  CAPTURE(grown);
  CHECK(grown <= 10 * n * sizeof(float));  // 20 versions without the bound
}

TEST_CASE("shared memory is not used where it is not offered or does not fit", "[shm]") {
  SECTION("psd --no-shared-memory: the worker stays on TCP and says why") {
    auto cfg = TestConfig(1);
    cfg.shared_memory = false;
    auto server = StartServer(cfg);
    auto c = ConnectWith(WorkerOptions(server->port(), "w0"));
    CHECK(c->shared_memory_shards() == 0);
    CHECK_THAT(c->shared_memory_status(), Catch::Contains("not offered"));
    float v = 3;
    REQUIRE(c->CreateVariable("v", {&v, DType::kFloat32, {}}).ok());
    float g = 1;
    REQUIRE(c->Push(0, {{"v", {&g, DType::kFloat32, {}}}}).ok());
    REQUIRE(c->Pull("v", {&v, DType::kFloat32, {}}).ok());
    CHECK(v == Approx(3 - 0.01f * 1).epsilon(1e-6));  // TestConfig: SGD, learning rate 0.01
  }
  SECTION("ClientOptions::shared_memory_bytes 0: off") {
    auto server = StartServer(TestConfig(1));
    auto o = WorkerOptions(server->port(), "w0");
    o.shared_memory_bytes = 0;
    auto c = ConnectWith(o);
    CHECK(c->shared_memory_shards() == 0);
    CHECK_THAT(c->shared_memory_status(), Catch::Contains("off"));
  }
  SECTION("a call bigger than the segment goes over TCP, the smaller ones through it") {
    auto server = StartServer(TestConfig(1));
    auto o = WorkerOptions(server->port(), "w0");
    o.shared_memory_bytes = 64 << 10;
    auto c = ConnectWith(o);
    REQUIRE(c->shared_memory_shards() == 1);
    std::vector<float> big(100'000, 1.0f), small(100, 1.0f);
    REQUIRE(c->CreateVariable("big", {big.data(), DType::kFloat32, {100'000}}).ok());
    REQUIRE(c->CreateVariable("small", {small.data(), DType::kFloat32, {100}}).ok());
    std::vector<float> g(100'000, 2.0f);
    REQUIRE(c->Push(0, {{"big", {g.data(), DType::kFloat32, {100'000}}}, {"small", {g.data(), DType::kFloat32, {100}}}})
                .ok());
    CHECK(server->metrics().shm_bytes() == 0);  // together they do not fit: TCP
    REQUIRE(c->Pull("small", {small.data(), DType::kFloat32, {100}}).ok());
    CHECK(server->metrics().shm_bytes() == 400);
    REQUIRE(c->Pull("big", {big.data(), DType::kFloat32, {100'000}}).ok());
    CHECK(server->metrics().shm_bytes() == 400);
    CHECK(big[99'999] == Approx(1 - 0.02f).epsilon(1e-6));
    CHECK(small[99] == Approx(1 - 0.02f).epsilon(1e-6));
  }
}

TEST_CASE("psd's shared-memory socket maps only a sealed segment sent with its connection's nonce", "[shm]") {
  auto cfg = TestConfig(1, 2);
  cfg.shm_max_bytes = 1 << 20;
  cfg.hello_timeout_ms = 60000;  // an idle connection to the socket is not closed by its timeout here
  auto server = StartServer(cfg);
  auto good = wire::SharedSegment::Create(64 << 10, "test");
  REQUIRE(good.ok());

  SECTION("a wrong nonce is refused and leaves the offer to its worker; the right one is used once") {
    RawPeer p(server->port());
    p.Hello("raw");
    REQUIRE(!p.shm_socket.empty());
    REQUIRE(p.shm_nonce.size() == 32);
    std::string wrong = p.shm_nonce;
    wrong[0] = static_cast<char>(wrong[0] ^ 1);
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, wrong), (*good)->fd()),
               Catch::Contains("without its nonce"));
    // (Before, a guess used the offer up: any local process could push every worker onto TCP.)
    CHECK(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*good)->fd()) == "OK");
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*good)->fd()),
               Catch::Contains("without its nonce"));
    CHECK(server->shm()->refused() == 2);
  }
  SECTION("clients that connect and send nothing make room for a worker: the oldest is closed") {
    // Anyone on the host may connect. Before, each idle connection kept a descriptor until the
    // attach timeout, with no limit: a flood used up psd's descriptors.
    std::vector<int> idle;
    for (int i = 0; i < 64; ++i) {
      auto sock = wire::ConnectAbstract(server->shm()->name());
      REQUIRE(sock.ok());
      idle.push_back(*sock);
    }
    RawPeer p(server->port());
    p.Hello("raw");
    CHECK(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*good)->fd()) == "OK");
    // The first idle one was closed to admit the worker's (end of stream, long before its timeout).
    pollfd pfd{idle.front(), POLLIN, 0};
    REQUIRE(::poll(&pfd, 1, 10000) == 1);
    char c;
    CHECK(::read(idle.front(), &c, 1) == 0);
    for (int fd : idle) ::close(fd);
  }
  SECTION("another connection's id with this nonce is refused") {
    RawPeer p(server->port());
    p.Hello("raw");
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id + 1000, p.shm_nonce), (*good)->fd()),
               Catch::Contains("without its nonce"));
  }
  SECTION("a memfd that may shrink is refused (a shrink under psd's mapping would fault it)") {
    RawPeer p(server->port());
    p.Hello("raw");
    int fd = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, 64 << 10) == 0);
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), fd),
               Catch::Contains("not sealed against shrinking"));
    ::close(fd);
  }
  SECTION("a hugetlbfs memfd is refused (its owner can punch its pages out from under psd's mapping)") {
    RawPeer p(server->port());
    p.Hello("raw");
    int fd = ::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (fd < 0 || ::ftruncate(fd, 2 << 20) != 0 || ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      if (fd >= 0) ::close(fd);
      SUCCEED("this kernel makes no sealable hugetlbfs memfd");
    } else {
      CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), fd),
                 Catch::Contains("not plain shared memory"));
      ::close(fd);
    }
  }
  SECTION("a pipe is refused") {
    RawPeer p(server->port());
    p.Hello("raw");
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), fds[0]),
               Catch::Contains("not a sealable memfd"));
    ::close(fds[0]);
    ::close(fds[1]);
  }
  SECTION("a segment over --shm-max-bytes is refused") {
    RawPeer p(server->port());
    p.Hello("raw");
    auto huge = wire::SharedSegment::Create(2 << 20, "test");
    REQUIRE(huge.ok());
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*huge)->fd()),
               Catch::Contains("--shm-max-bytes"));
  }
  SECTION("a message without a descriptor is refused") {
    RawPeer p(server->port());
    p.Hello("raw");
    CHECK_THAT(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), -1),
               Catch::Contains("one or two descriptors"));
  }
  SECTION("the right segment is mapped: \"OK\"") {
    RawPeer p(server->port());
    p.Hello("raw");
    CHECK(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*good)->fd()) == "OK");
    CHECK(server->shm()->attached() == 1);
  }
  // Whatever came, psd serves a real worker, through shared memory (its 1 GiB segment cut to
  // psd's --shm-max-bytes, which the hello announced).
  auto w = ConnectWith(WorkerOptions(server->port(), "healthy"));
  CHECK(w->shared_memory_shards() == 1);
  CHECK(w->GetStatus().ok());
}

TEST_CASE("tensors said to be in shared memory are checked against the segment", "[shm]") {
  auto server = StartServer(TestConfig(1, 3));  // "owner", "raw" and "healthy" say hello
  {
    auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
    std::vector<float> v(1000, 1.0f);
    REQUIRE(owner->CreateVariable("v", {v.data(), DType::kFloat32, {1000}}).ok());
  }
  RawPeer p(server->port());
  p.Hello("raw");
  Code code;
  std::string msg;

  // No segment attached yet: refused, and nothing is pushed.
  PushFromShm(p, 2, 0, 1000);
  REQUIRE(p.Read(&code, &msg));
  CHECK(code == Code::kFailedPrecondition);
  CHECK_THAT(msg, Catch::Contains("no segment attached"));

  auto seg = wire::SharedSegment::Create(64 << 10, "test");
  REQUIRE(seg.ok());
  REQUIRE(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*seg)->fd()) == "OK");

  SECTION("a gradient that runs past the segment's end") {
    PushFromShm(p, 3, (64 << 10) - 3996, 1000);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("outside this connection's shared-memory segment"));
  }
  SECTION("an offset near 2^64 (no wrap-around)") {
    PushFromShm(p, 3, ~uint64_t{0} - 100, 1000);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
  }
  SECTION("a pull whose room is outside the segment, or too small") {
    PullToShm(p, 3, 60 << 10, 8 << 10);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
    PullToShm(p, 4, 0, 3000);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("do not fit"));
  }
  SECTION("shared memory is taken only for pushed gradients: a create or a reduce value is refused") {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(3);
    auto create = req.initCreateVariable();
    create.setName("x");
    auto t = create.initInitial();
    t.setDtype(proto::DType::FLOAT32);
    t.initShape(1).set(0, 10);
    t.setInShm(true);
    p.Send(f);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("shared memory"));
  }
  SECTION("a gradient in the segment is applied, and a pull lands there") {
    auto* g = reinterpret_cast<float*>((*seg)->data() + 4096);
    for (int i = 0; i < 1000; ++i) g[i] = static_cast<float>(i);
    PushFromShm(p, 3, 4096, 1000);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kOk);
    PullToShm(p, 4, 8192, 4000);
    REQUIRE(p.Read(&code, &msg));
    REQUIRE(code == Code::kOk);
    auto* v = reinterpret_cast<const float*>((*seg)->data() + 8192);
    CHECK(v[0] == 1.0f);
    CHECK(v[999] == Approx(1 - 0.01f * 999).epsilon(1e-6));
  }
  // The variable is whole and psd serves: a push past the segment changed nothing.
  auto w = ConnectWith(WorkerOptions(server->port(), "healthy"));
  std::vector<float> v(1000);
  REQUIRE(w->Pull("v", {v.data(), DType::kFloat32, {1000}}).ok());
  CHECK(v[0] == 1.0f);
}

TEST_CASE("a worker scribbling on its segment while psd reads it hurts no one else", "[shm]") {
  auto server = StartServer(TestConfig(1, 2));
  auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
  float five = 5;
  REQUIRE(owner->CreateVariable("w", {&five, DType::kFloat32, {}}).ok());
  std::vector<float> zeros(1 << 16, 0.0f);
  REQUIRE(owner->CreateVariable("v", {zeros.data(), DType::kFloat32, {1 << 16}}).ok());

  RawPeer p(server->port());
  p.Hello("scribbler");
  auto seg = wire::SharedSegment::Create(1 << 20, "test");
  REQUIRE(seg.ok());
  REQUIRE(Attach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*seg)->fd()) == "OK");
  // Another thread (as another process would) rewrites the gradient's bytes the whole time.
  std::atomic<bool> stop{false};
  std::thread scribbler([&] {
    uint32_t x = 1;
    auto* words = reinterpret_cast<volatile uint32_t*>((*seg)->data());
    while (!stop.load()) {
      for (size_t i = 0; i < (1u << 16); i += 7) words[i] = (x = x * 1664525u + 1013904223u);
    }
  });
  Code code;
  std::string msg;
  for (uint64_t i = 0; i < 20; ++i) {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(10 + i);
    auto push = req.initPush();
    push.setLocalStep(static_cast<int64_t>(i));
    auto g = push.initGrads(1)[0];
    g.setName("v");
    auto t = g.initGrad();
    t.setDtype(proto::DType::FLOAT32);
    t.initShape(1).set(0, 1 << 16);
    t.setInShm(true);
    t.setShmOffset(0);
    p.Send(f);
    REQUIRE(p.Read(&code, &msg));
    CHECK(code == Code::kOk);
  }
  stop = true;
  scribbler.join();
  // Its own variable holds whatever it sent; everything else is as it was, and psd serves.
  float w = 0;
  REQUIRE(owner->Pull("w", {&w, DType::kFloat32, {}}).ok());
  CHECK(w == 5.0f);
}

TEST_CASE("a worker whose connection was closed attaches a new segment on its next call", "[shm]") {
  auto cfg = TestConfig(1);
  cfg.idle_timeout_s = 1;
  auto server = StartServer(cfg);
  auto c = ConnectWith(WorkerOptions(server->port(), "w0"));
  REQUIRE(c->shared_memory_shards() == 1);
  float v = 1;
  REQUIRE(c->CreateVariable("v", {&v, DType::kFloat32, {}}).ok());
  // psd closes the idle connection (bounded wait: the test's own limit).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (server->connection_count() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(server->connection_count() == 0);
  const uint64_t before = c->connection_epoch();
  float g = 1;
  // The first call finds the connection gone (UNAVAILABLE, nothing pushed); the next reconnects.
  auto pushed = c->Push(0, {{"v", {&g, DType::kFloat32, {}}}});
  if (!pushed.ok()) {
    CHECK(pushed.status().code() == Code::kUnavailable);
    pushed = c->Push(0, {{"v", {&g, DType::kFloat32, {}}}});
  }
  REQUIRE(pushed.ok());
  CHECK(c->connection_epoch() > before);
  CHECK(c->shared_memory_shards() == 1);
  CHECK(c->shared_memory_lanes() == 1);  // its frames in a new lane (the old one went with its connection)
  CHECK(server->shm()->attached() == 2);
  CHECK(server->metrics().lanes() == 2);
  REQUIRE(c->Pull("v", {&v, DType::kFloat32, {}}).ok());
  CHECK(v == Approx(1 - 0.01f).epsilon(1e-6));
}

TEST_CASE("a sparse gradient's rows go through shared memory, its indices in the frame", "[shm]") {
  std::vector<float> results[2];
  uint64_t shm_bytes[2] = {0, 0};
  for (int shm = 0; shm < 2; ++shm) {
    auto server = StartServer(TestConfig(1, 1, 0));
    auto o = WorkerOptions(server->port(), "w0");
    o.shared_memory_bytes = shm ? (1 << 20) : 0;
    auto c = ConnectWith(o);
    REQUIRE(c->shared_memory_shards() == shm);
    std::vector<float> init(100 * 8, 1.0f);
    REQUIRE(c->CreateVariable("emb", {init.data(), DType::kFloat32, {100, 8}}).ok());
    // Rows 7, 3 and 7 again (coalesced), then 99.
    std::vector<float> values(4 * 8);
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
    psclient::SparseGradient g{"emb", {7, 3, 7, 99}, {values.data(), DType::kFloat32, {4, 8}}, std::nullopt};
    REQUIRE(c->Push(0, {}, {g}, true, 10000).ok());
    results[shm].resize(init.size());
    REQUIRE(c->Pull("emb", {results[shm].data(), DType::kFloat32, {100, 8}}).ok());
    shm_bytes[shm] = server->metrics().shm_bytes();
  }
  CHECK(results[0] == results[1]);
  CHECK(results[1][7 * 8] != 1.0f);  // row 7 moved
  CHECK(results[1][0] == 1.0f);      // row 0 did not
  CHECK(shm_bytes[0] == 0);
  CHECK(shm_bytes[1] >= 3 * 8 * sizeof(float));  // the coalesced rows (and the pull's values)
}

namespace {

// A push frame `id` at `local_step` of one float32 gradient `name` of `n` elements (`*grad`, its
// bytes for the caller to place). With `pull_into_segment`, the push asks for v's value (of `total`
// elements) with the token, written at offset 0 of the worker's segment: where v's gradient is, as
// the client puts it.
void StartPush(wire::OutFrame& f, uint64_t id, int64_t local_step, bool more, bool wait_token, const std::string& name,
               int64_t n, int64_t total, bool pull_into_segment, proto::Gradient::Builder* gradient) {
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(id);
  auto push = req.initPush();
  push.setLocalStep(local_step);
  push.setMore(more);
  push.setWaitToken(wait_token);
  push.setTimeoutMs(10000);
  *gradient = push.initGrads(1)[0];
  gradient->setName(name);
  auto grad = gradient->initGrad();
  grad.setDtype(proto::DType::FLOAT32);
  grad.initShape(1).set(0, static_cast<uint64_t>(n));
  if (pull_into_segment) {
    push.initPullAfter(1).set(0, "v");
    auto to = push.initPullToShm();
    to.setOffset(0);
    to.setBytes(static_cast<uint64_t>(total) * 4);
    to.setSegment(0);
  }
}

// A push of elements [offset, offset + n) of v's gradient, from their place in `p`'s segment (a
// chunk unless it is all of v's `total`).
void PushFromSegment(RawPeer& p, uint64_t id, int64_t offset, int64_t n, int64_t total, bool more, bool wait_token,
                     bool pull_into_segment = false, int64_t local_step = 0) {
  wire::OutFrame f;
  proto::Gradient::Builder t(nullptr);
  StartPush(f, id, local_step, more, wait_token, "v", n, total, pull_into_segment, &t);
  if (n != total) {
    t.setChunk(true);
    t.setChunkOffset(offset);
  }
  t.getGrad().setInShm(true);
  t.getGrad().setShmOffset(static_cast<uint64_t>(offset) * 4);
  p.Send(f);
}

}  // namespace

TEST_CASE("what psd points at in a worker's segment is copied before the worker is answered", "[shm][held]") {
  // psd adds a step's first gradient in a worker's segment to the second in one pass, reading it
  // where the worker wrote it (DenseAccumulator, "Held gradients"). Once answered, the worker may
  // write there again: here it does at once, and the step still has the gradient it sent. Answered
  // before the step: a push in two frames whose last does not wait for the token (the first was
  // held, as the worker's pushes had waited so far), and one that gets one of the initial tokens.
  // Or the worker went away (the test unmaps its side; psd keeps the pages it reads). Or the
  // initial token's answer carries the next values, which psd writes where the gradient is.
  const int mode = GENERATE(0, 1, 2, 3);
  const int64_t n = DenseAccumulator::kStripeElements + 3 * DenseAccumulator::kPartElements;  // over a stripe
  auto cfg = TestConfig(2, 2, mode == 2 ? 0 : -1);
  auto server = StartServer(cfg);
  auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
  REQUIRE(owner->shared_memory_shards() == 1);
  std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
  REQUIRE(owner->CreateVariable("v", {zeros.data(), DType::kFloat32, {n}}).ok());

  auto p = std::make_unique<RawPeer>(server->port());
  p->Hello("a");
  auto seg = wire::SharedSegment::Create(8 << 20, "test");
  REQUIRE(seg.ok());
  REQUIRE(Attach(p->shm_socket, wire::ShmAttachMessage(p->connection_id, p->shm_nonce), (*seg)->fd()) == "OK");
  std::vector<float> ga(static_cast<size_t>(n)), gb(static_cast<size_t>(n));
  for (size_t i = 0; i < ga.size(); ++i) {
    ga[i] = static_cast<float>(i % 1000) * 0.37f - 11.0f;
    gb[i] = static_cast<float>(i % 777) * -0.11f + 3.0f;
  }
  std::memcpy((*seg)->data(), ga.data(), ga.size() * 4);
  std::string msg;
  if (mode == 0) {
    const int64_t half = 256 * DenseAccumulator::kPartElements;
    PushFromSegment(*p, 1, 0, half, n, /*more=*/true, /*wait_token=*/false);
    REQUIRE(p->Answer(&msg) == Code::kOk);
    PushFromSegment(*p, 2, half, n - half, n, /*more=*/false, /*wait_token=*/false);
  } else {
    PushFromSegment(*p, 1, 0, n, n, /*more=*/false, /*wait_token=*/true, /*pull_into_segment=*/mode == 3);
  }
  if (mode != 2) {
    REQUIRE(p->Answer(&msg) == Code::kOk);
    if (mode == 3) {  // the values of step 0 (zeros) came where the gradient was
      const auto* f = reinterpret_cast<const float*>((*seg)->data());
      CHECK(std::all_of(f, f + n, [](float x) { return x == 0.0f; }));
    }
    // The call is over: the worker writes its next gradient where the last one was.
    auto* f = reinterpret_cast<float*>((*seg)->data());
    for (int64_t i = 0; i < n; ++i) f[i] = 1e30f;
  } else {
    // Its wait parked (no initial tokens), then it is gone: its segment with it, on its side.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (server->engine()->Stats().accepted < 1 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    REQUIRE(server->engine()->Stats().accepted == 1);
    p.reset();
    seg->reset();
  }
  std::vector<float> after(static_cast<size_t>(n));
  std::vector<std::pair<std::string, TensorView>> outs = {{"v", {after.data(), DType::kFloat32, {n}}}};
  auto r = owner->Push(0, {{"v", {gb.data(), DType::kFloat32, {n}}}}, {}, true, 10000, &outs);
  REQUIRE(r.ok());
  REQUIRE(r->token_status.ok());
  REQUIRE(owner->Pull("v", {after.data(), DType::kFloat32, {n}}).ok());
  const float a = static_cast<float>(cfg.optimizer.learning_rate);
  int64_t wrong = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const float want = 0.0f - a * ((ga[i] + gb[i]) / 2.0f);  // SGD of the mean, as psd computes it
    wrong += std::memcmp(&after[i], &want, 4) != 0 ? 1 : 0;
  }
  CHECK(wrong == 0);
  CHECK(server->engine()->global_step() == 1);
}

namespace {

// A psd whose big buffers come from the failing storage (tests/support/failing_storage.h), which is
// set once per process: before any psd's values segment could be (off here; ctest runs each test
// case in a process of its own, while a whole-binary run has opened one by now: `skip`). Variable
// "v" (CreateV) and a reader of its value at step 0, so the buffer step 0's commit retires is not
// free for step 1's sum; two gradients of it.
struct OutOfMemoryPsd {
  OutOfMemoryPsd() {
    if (skip) {
      WARN("skipped: an earlier test case of this process opened psd's values segment");
      return;
    }
    storage.emplace();
    cfg.values_segment = false;
    server = StartServer(cfg);
    for (size_t i = 0; i < ga.size(); ++i) {
      ga[i] = static_cast<float>(i % 1000) * 0.37f - 11.0f;
      gb[i] = static_cast<float>(i % 777) * -0.11f + 3.0f;
    }
  }
  void CreateV(psclient::Client& c) {
    REQUIRE(c.CreateVariable("v", {zeros.data(), DType::kFloat32, {n}}).ok());
    int64_t step = -1;
    REQUIRE(server->engine()->Pull({"v"}, &reader, &step).ok());
  }
  psd::testing::FailingStorage* failing() { return storage->operator->(); }

  const bool skip = server::ValuesSegment::Current() != nullptr;
  std::optional<psd::testing::ActiveStorage> storage;
  const int64_t n = DenseAccumulator::kStripeElements + 3 * DenseAccumulator::kPartElements;
  server::ServerConfig cfg = TestConfig(2, 2);
  std::unique_ptr<server::Server> server;
  std::vector<float> zeros = std::vector<float>(static_cast<size_t>(n), 0.0f);
  std::vector<float> ga = std::vector<float>(static_cast<size_t>(n));
  std::vector<float> gb = std::vector<float>(static_cast<size_t>(n));
  std::vector<server::PulledValue> reader;
};

}  // namespace

TEST_CASE("a reply waits while psd has no memory to copy what it points at in the worker's segment",
          "[shm][held][oom]") {
  OutOfMemoryPsd o;
  if (o.skip) return;
  auto* storage = o.failing();
  const int64_t n = o.n;
  const auto& cfg = o.cfg;
  const auto& server = o.server;
  const auto& ga = o.ga;
  const auto& gb = o.gb;
  auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
  std::vector<float> small(16, 0.0f);
  o.CreateV(*owner);
  REQUIRE(owner->CreateVariable("s", {small.data(), DType::kFloat32, {16}}).ok());
  const std::vector<psclient::Gradient> owner_grads = {{"v", {gb.data(), DType::kFloat32, {n}}},
                                                       {"s", {small.data(), DType::kFloat32, {16}}}};
  for (int i = 0; i < 2; ++i) REQUIRE(owner->Push(0, owner_grads, false, 10000).ok());  // step 0: two gradients
  REQUIRE(psd::testing::Eventually([&] { return server->engine()->global_step() == 1; }));

  auto p = std::make_unique<RawPeer>(server->port());
  p->Hello("a");
  auto seg = wire::SharedSegment::Create(8 << 20, "test");
  REQUIRE(seg.ok());
  REQUIRE(Attach(p->shm_socket, wire::ShmAttachMessage(p->connection_id, p->shm_nonce), (*seg)->fd()) == "OK");
  std::memcpy((*seg)->data(), ga.data(), ga.size() * 4);
  // Step 1, a push in two frames: "v" from the segment first (held: psd points at it, no sum
  // written), then "s" in the frame, whose answer ends the call.
  auto push_s = [&](uint64_t id, bool pull_into_segment, bool wait_token) {
    wire::OutFrame f;
    proto::Gradient::Builder t(nullptr);
    StartPush(f, id, 1, /*more=*/false, wait_token, "s", 16, n, pull_into_segment, &t);
    t.getGrad().setData(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(small.data()), small.size() * 4));
    p->Send(f);
  };
  std::string msg;
  PushFromSegment(*p, 1, 0, n, n, /*more=*/true, /*wait_token=*/false, false, /*local_step=*/1);
  REQUIRE(p->Answer(&msg) == Code::kOk);
  if (GENERATE(false, true)) {
    // The last frame takes one of the initial tokens: its answer waits, every try finding no
    // memory, and the worker goes away meanwhile. The token goes back to the queue.
    const int64_t queued = server->engine()->Stats().tokens_queued;
    constexpr int kFailures = 1 << 30;
    storage->FailNext(kFailures);
    push_s(2, /*pull_into_segment=*/false, /*wait_token=*/true);
    // Two tries failed (the answer's and the first retry's): the answer waits.
    REQUIRE(psd::testing::Eventually([&] { return storage->left() <= kFailures - 2; }));
    CHECK(server->engine()->Stats().tokens_queued == queued - 1);
    p.reset();
    CHECK(psd::testing::Eventually([&] { return server->engine()->Stats().tokens_queued == queued; }));
    storage->FailNext(0);
    return;
  }
  // The answer must first copy "v" out of the segment, into a sum that finds no memory; it brings
  // the values of "v" into the segment, over the gradient, once that is copied.
  storage->FailNext();
  const auto sent = std::chrono::steady_clock::now();
  push_s(2, /*pull_into_segment=*/true, /*wait_token=*/false);
  REQUIRE(p->Answer(&msg) == Code::kOk);  // before: the reply was lost, the hold kept, the worker waiting
  CHECK(std::chrono::steady_clock::now() - sent >= std::chrono::milliseconds(50));  // a try 50 ms later
  REQUIRE_FALSE(storage->armed());
  const float a = static_cast<float>(cfg.optimizer.learning_rate);
  auto* f = reinterpret_cast<float*>((*seg)->data());
  int64_t wrong_values = 0;
  for (size_t i = 0; i < ga.size(); ++i) {
    const float once = 0.0f - a * ((gb[i] + gb[i]) / 2.0f);
    wrong_values += std::memcmp(&f[i], &once, 4) != 0 ? 1 : 0;
  }
  CHECK(wrong_values == 0);  // step 1's values
  // Answered: the worker writes its segment again; the step keeps the gradient it was sent.
  for (int64_t i = 0; i < n; ++i) f[i] = 1e30f;
  REQUIRE(owner->Push(1, owner_grads, false, 10000).ok());
  REQUIRE(psd::testing::Eventually([&] { return server->engine()->global_step() == 2; }));
  std::vector<float> after(static_cast<size_t>(n));
  REQUIRE(owner->Pull("v", {after.data(), DType::kFloat32, {n}}).ok());
  int64_t wrong = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const float once = 0.0f - a * ((gb[i] + gb[i]) / 2.0f);
    const float want = once - a * ((ga[i] + gb[i]) / 2.0f);
    wrong += std::memcmp(&after[i], &want, 4) != 0 ? 1 : 0;
  }
  CHECK(wrong == 0);
}

TEST_CASE("a step whose take finds no memory is taken by psd's retry 50 ms later, every worker answered",
          "[shm][held][oom]") {
  OutOfMemoryPsd o;
  if (o.skip) return;
  auto* storage = o.failing();
  auto a = ConnectWith(WorkerOptions(o.server->port(), "a"));
  auto b = ConnectWith(WorkerOptions(o.server->port(), "b"));
  REQUIRE(a->shared_memory_shards() == 1);
  REQUIRE(b->shared_memory_shards() == 1);
  o.CreateV(*a);
  // Both workers push from their segments and wait for the token: psd points at their gradients,
  // and writes no sum, so a step's take needs one. Their waits outlast this test's bounds: only
  // psd's own retry takes a step whose take found no memory (no later push comes to try it).
  auto both = [&](int64_t local_step) {
    constexpr int64_t kWaitMs = 600000;
    Result<psclient::PushOutcome> ra = psd::Internal("not run"), rb = psd::Internal("not run");
    std::thread ta([&] { ra = a->Push(local_step, {{"v", {o.ga.data(), DType::kFloat32, {o.n}}}}, true, kWaitMs); });
    // b's push comes second (a's gradient is in), so b's completes the step and its take.
    const bool a_in =
        psd::testing::Eventually([&] { return o.server->engine()->Stats().accepted >= 2 * local_step + 1; });
    std::thread tb([&] { rb = b->Push(local_step, {{"v", {o.gb.data(), DType::kFloat32, {o.n}}}}, true, kWaitMs); });
    const bool taken = psd::testing::Eventually([&] { return o.server->engine()->global_step() == local_step + 1; });
    if (!taken) o.server->Stop();  // the waits end (failed), so the threads do
    ta.join();
    tb.join();
    REQUIRE(a_in);
    REQUIRE(taken);
    REQUIRE(ra.ok());
    REQUIRE(rb.ok());
    CHECK(ra->token_status.ok());
    CHECK(rb->token_status.ok());
  };
  both(0);
  REQUIRE(o.server->engine()->global_step() == 1);
  storage->FailNext();  // step 1's take: no memory for its sum
  const auto started = std::chrono::steady_clock::now();
  both(1);  // the take waits for memory; psd's retry timer takes it
  CHECK(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(50));
  REQUIRE_FALSE(storage->armed());
  CHECK(o.server->engine()->global_step() == 2);
  std::vector<float> after(static_cast<size_t>(o.n));
  REQUIRE(a->Pull("v", {after.data(), DType::kFloat32, {o.n}}).ok());
  const float lr = static_cast<float>(o.cfg.optimizer.learning_rate);
  int64_t wrong = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const float once = 0.0f - lr * ((o.ga[i] + o.gb[i]) / 2.0f);
    const float want = once - lr * ((o.ga[i] + o.gb[i]) / 2.0f);
    wrong += std::memcmp(&after[i], &want, 4) != 0 ? 1 : 0;
  }
  CHECK(wrong == 0);
}
