// Zero-copy shared buffers (README "Zero-copy shared buffers"): memory from
// Client::AllocateShared is the client's arena, attached to every same-host daemon as the
// connection's segment 1. psd reads gradients from it and writes pulled values into it in place;
// the results are those TCP gives; an arena attached again (a reconnect) or revoked by its worker
// is touched no more through the earlier connection; every offset is checked.
#include <catch2/catch.hpp>
#include <cstring>
#include <thread>

#include "support/raw_peer.h"
#include "support/test_cluster.h"
#include "support/test_server.h"
#include "wire/shm.h"

using namespace psd;
using psd::testing::ConnectWith;
using psd::testing::PushFromShm;
using psd::testing::RawPeer;
using psd::testing::ShmAttach;
using psd::testing::StartServer;
using psd::testing::TestConfig;
using psd::testing::WorkerOptions;

namespace {

constexpr int64_t kRows = 300, kCols = 500;  // 600 KB of float32

void FillGradient(float* g, int step, int worker) {
  for (size_t i = 0; i < static_cast<size_t>(kRows * kCols); ++i) {
    g[i] =
        static_cast<float>((i * 29 + static_cast<size_t>(step) * 7 + static_cast<size_t>(worker) * 3) % 97) * 0.013f -
        0.6f;
  }
}

struct Trained {
  std::vector<float> w;          // after the last step, pulled with the token
  std::vector<uint16_t> w_bf16;  // then pulled as bfloat16
  uint64_t shm_bytes = 0;
};

// Two workers, three sync steps of w [300, 500], the next values with the token. With `shared`,
// gradients, values and the bfloat16 pull live in shared buffers, and the connection's own segment
// (64 KiB) is too small for any of them: only the buffers can carry them through shared memory.
Trained Train(bool shared) {
  auto server = StartServer(TestConfig(2, 2, 0));
  std::unique_ptr<psclient::Client> c[2];
  for (int i = 0; i < 2; ++i) {
    auto o = WorkerOptions(server->port(), "w" + std::to_string(i));
    o.shared_memory_bytes = shared ? 64 << 10 : 0;
    o.shared_buffer_bytes = 16 << 20;
    c[i] = ConnectWith(o);
    REQUIRE(c[i]->shared_memory_shards() == (shared ? 1 : 0));
  }
  const size_t n = static_cast<size_t>(kRows * kCols);
  std::vector<float> init(n, 0.25f);
  REQUIRE(c[0]->CreateVariable("w", ConstTensorView{init.data(), DType::kFloat32, {kRows, kCols}}).ok());
  // Per worker: a gradient and a value buffer, shared or not.
  std::vector<psclient::SharedBuffer> buffers;
  std::vector<std::vector<float>> plain;
  float* grad[2];
  float* value[2];
  for (int i = 0; i < 2; ++i) {
    for (float** at : {&grad[i], &value[i]}) {
      if (shared) {
        auto b = c[i]->AllocateShared(n * sizeof(float));
        REQUIRE(b.ok());
        *at = b->as<float>();
        buffers.push_back(std::move(*b));
      } else {
        plain.emplace_back(n);
        *at = plain.back().data();
      }
    }
  }
  for (int step = 0; step < 3; ++step) {
    std::thread t[2];
    std::string failed[2];  // Catch's assertions are not thread-safe: checked after the joins
    for (int i = 0; i < 2; ++i) {
      t[i] = std::thread([&, i] {
        FillGradient(grad[i], step, i);
        std::vector<std::pair<std::string, TensorView>> after = {{"w", {value[i], DType::kFloat32, {kRows, kCols}}}};
        auto r = c[i]->Push(step, {{"w", {grad[i], DType::kFloat32, {kRows, kCols}}}}, {}, true, 10000, &after);
        if (!r.ok()) {
          failed[i] = r.status().ToString();
        } else if (!r->token_status.ok() || r->accepted() != 1) {
          failed[i] = "token " + r->token_status.ToString() + ", accepted " + std::to_string(r->accepted());
        }
      });
    }
    for (auto& th : t) th.join();
    CHECK(failed[0] == "");
    REQUIRE(failed[1] == "");
  }
  Trained out;
  out.w.assign(value[0], value[0] + n);
  // A plain pull into a shared buffer, converted to bfloat16 by psd on the way.
  std::vector<uint16_t> bf(n);
  uint16_t* bf_at = bf.data();
  if (shared) {
    auto b = c[1]->AllocateShared(n * sizeof(uint16_t));
    REQUIRE(b.ok());
    bf_at = b->as<uint16_t>();
    buffers.push_back(std::move(*b));
  }
  REQUIRE(c[1]->Pull("w", TensorView{bf_at, DType::kBFloat16, {kRows, kCols}}).ok());
  out.w_bf16.assign(bf_at, bf_at + n);
  out.shm_bytes = server->metrics().shm_bytes();
  return out;
}

// A pull of "v" into segment `segment` at `offsets` (one per value).
void PullInto(RawPeer& p, uint64_t id, unsigned segment, const std::vector<uint64_t>& offsets,
              const std::vector<std::string>& names = {"v"}) {
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(id);
  auto pull = req.initPull();
  auto list = pull.initNames(static_cast<unsigned>(names.size()));
  for (size_t i = 0; i < names.size(); ++i) list.set(static_cast<unsigned>(i), names[i]);
  auto target = pull.initToShm();
  target.setSegment(static_cast<uint8_t>(segment));
  auto at = target.initOffsets(static_cast<unsigned>(offsets.size()));
  for (size_t i = 0; i < offsets.size(); ++i) at.set(static_cast<unsigned>(i), offsets[i]);
  p.Send(f);
}

// A raw connection with its own segment and `arena` attached.
void AttachWithArena(RawPeer& p, const std::string& name, wire::SharedSegment& arena) {
  p.Hello(name);
  auto own = wire::SharedSegment::Create(64 << 10, "test");
  REQUIRE(own.ok());
  REQUIRE(ShmAttach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*own)->fd(), arena.fd()) ==
          "OK");
}

}  // namespace

TEST_CASE("gradients and values in shared buffers move in place, with the values TCP gives", "[shm]") {
  Trained shared = Train(true);
  Trained tcp = Train(false);
  const size_t bytes = static_cast<size_t>(kRows * kCols) * sizeof(float);
  // Bit-identical: the same adds in the same order, whatever carried the bytes.
  CHECK(std::memcmp(shared.w.data(), tcp.w.data(), bytes) == 0);
  CHECK(shared.w_bf16 == tcp.w_bf16);
  CHECK(shared.w[0] != 0.25f);  // it trained
  // Every gradient and value went through shared memory, which only the buffers could hold:
  // 3 steps x 2 workers x (gradient + value), and the bfloat16 pull.
  CHECK(shared.shm_bytes >= 12 * bytes + bytes / 2);
  CHECK(tcp.shm_bytes == 0);
}

TEST_CASE("a sliced variable on a cluster is pushed from and pulled into shared buffers in place", "[shm]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.slice_bytes = 4096;  // w [100, 30] float32: three slices, starting at rows 0, 34 and 68
  auto cluster = psd::testing::StartTestCluster(cfg, 3);
  psclient::ClientOptions o;
  o.cluster = cluster.addresses;
  o.worker_name = "w0";
  o.shared_buffer_bytes = 1 << 20;
  auto c = ConnectWith(o);
  REQUIRE(c->shared_memory_shards() == 3);
  std::vector<float> init(3000);
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i % 17) * 0.5f;
  REQUIRE(c->CreateVariable("w", ConstTensorView{init.data(), DType::kFloat32, {100, 30}}).ok());
  auto g = c->AllocateShared(3000 * sizeof(float));
  auto v = c->AllocateShared(3000 * sizeof(float));
  REQUIRE(g.ok());
  REQUIRE(v.ok());
  for (size_t i = 0; i < 3000; ++i) g->as<float>()[i] = static_cast<float>(i % 7);
  uint64_t before = 0;
  for (auto& s : cluster.shards) before += s->metrics().shm_bytes();
  auto r = c->Push(0, {{"w", {g->data(), DType::kFloat32, {100, 30}}}}, true, 5000);
  REQUIRE(r.ok());
  REQUIRE(r->token_status.ok());
  REQUIRE(c->Pull("w", TensorView{v->data(), DType::kFloat32, {100, 30}}).ok());
  uint64_t after = 0;
  for (auto& s : cluster.shards) after += s->metrics().shm_bytes();
  CHECK(after - before == 2 * 3000 * sizeof(float));  // each slice read and written in place
  for (size_t i = 0; i < 3000; ++i) {
    INFO(i);
    REQUIRE(v->as<float>()[i] == Approx(init[i] - 0.01f * static_cast<float>(i % 7)).epsilon(1e-6));
  }
}

TEST_CASE("AllocateShared hands out zeroed blocks of the arena and takes them back", "[shm]") {
  auto server = StartServer(TestConfig(1, 3));
  auto o = WorkerOptions(server->port(), "w0");
  o.shared_buffer_bytes = 1 << 20;
  auto c = ConnectWith(o);
  auto a = c->AllocateShared(1000);
  auto b = c->AllocateShared(300 << 10);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(reinterpret_cast<uintptr_t>(a->data()) % 64 == 0);
  CHECK(reinterpret_cast<uintptr_t>(b->data()) % 64 == 0);
  CHECK(a->bytes() == 1000);
  std::memset(b->data(), 0xab, b->bytes());
  void* b_at = b->data();
  *b = psclient::SharedBuffer();  // gives it back
  auto again = c->AllocateShared(300 << 10);
  REQUIRE(again.ok());
  CHECK(again->data() == b_at);  // first fit: the same block
  const auto* bytes = again->as<const uint8_t>();
  CHECK(std::all_of(bytes, bytes + again->bytes(), [](uint8_t x) { return x == 0; }));

  auto too_big = c->AllocateShared(1 << 20);
  REQUIRE(!too_big.ok());
  CHECK(too_big.status().code() == Code::kResourceExhausted);
  CHECK_THAT(too_big.status().message(), Catch::Contains("shared_buffer_bytes"));
  // Freed blocks join up: the whole arena is one block again.
  *a = psclient::SharedBuffer();
  *again = psclient::SharedBuffer();
  auto whole = c->AllocateShared(1 << 20);
  CHECK(whole.ok());

  // A buffer outlives its client (plain memory then).
  c.reset();
  std::memset(whole->data(), 1, whole->bytes());

  auto none = o;
  none.shared_buffer_bytes = 0;
  auto d = ConnectWith(none);
  auto refused = d->AllocateShared(64);
  REQUIRE(!refused.ok());
  CHECK(refused.status().code() == Code::kFailedPrecondition);
  // A shared buffer where psd is on TCP: plain memory, the same results.
  auto tcp = WorkerOptions(server->port(), "w1");
  tcp.shared_memory_bytes = 0;
  auto t = ConnectWith(tcp);
  auto buf = t->AllocateShared(4 * sizeof(float));
  REQUIRE(buf.ok());
  std::vector<float> four{1, 2, 3, 4};
  REQUIRE(t->CreateVariable("x", ConstTensorView{four.data(), DType::kFloat32, {4}}).ok());
  REQUIRE(t->Pull("x", TensorView{buf->data(), DType::kFloat32, {4}}).ok());
  CHECK(buf->as<float>()[3] == 4.0f);
}

TEST_CASE("shared buffers attached again, or revoked by their worker, are touched no more", "[shm]") {
  auto server = StartServer(TestConfig(1, 3));
  {
    auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
    std::vector<float> v(1000, 1.0f);
    REQUIRE(owner->CreateVariable("v", {v.data(), DType::kFloat32, {1000}}).ok());
  }
  auto arena = wire::SharedSegment::Create(64 << 10, "arena");
  REQUIRE(arena.ok());
  auto* grad = reinterpret_cast<float*>((*arena)->data());
  for (int i = 0; i < 1000; ++i) grad[i] = 1.0f;
  std::string msg;

  RawPeer first(server->port());
  AttachWithArena(first, "first", **arena);
  PushFromShm(first, 2, 0, 1000, 1);
  CHECK(first.Answer(&msg) == Code::kOk);
  PullInto(first, 3, 1, {8192});
  REQUIRE(first.Answer(&msg) == Code::kOk);
  CHECK(reinterpret_cast<float*>((*arena)->data() + 8192)[0] == Approx(1 - 0.01f));

  SECTION("the same arena attached by a new connection: the earlier one reads and writes it no more") {
    RawPeer second(server->port());
    AttachWithArena(second, "second", **arena);
    PushFromShm(first, 4, 0, 1000, 1);
    CHECK(first.Answer(&msg) == Code::kFailedPrecondition);
    CHECK_THAT(msg, Catch::Contains("shared buffers"));
    PullInto(first, 5, 1, {8192});
    CHECK(first.Answer(&msg) == Code::kFailedPrecondition);
    // Its own segment went too (a revoke is the whole connection's).
    PushFromShm(first, 6, 0, 1000, 0);
    CHECK(first.Answer(&msg) == Code::kFailedPrecondition);
    PushFromShm(second, 2, 0, 1000, 1);
    CHECK(second.Answer(&msg) == Code::kOk);
  }
  SECTION("the worker revokes its buffers (its connection broke): refused from then on") {
    auto sock = wire::ConnectAbstract(first.shm_socket);
    REQUIRE(sock.ok());
    REQUIRE(wire::SendWithFds(*sock, wire::kShmRevokeMessage, wire::kShmRevokeBytes, {(*arena)->fd()}).ok());
    char answer[16] = {};
    CHECK(::read(*sock, answer, sizeof(answer)) == 2);
    CHECK(std::string(answer) == "OK");
    ::close(*sock);
    PushFromShm(first, 4, 0, 1000, 1);
    CHECK(first.Answer(&msg) == Code::kFailedPrecondition);
  }
  SECTION("a revoke with another memfd revokes nothing") {
    auto other = wire::SharedSegment::Create(64 << 10, "other");
    REQUIRE(other.ok());
    CHECK(ShmAttach(first.shm_socket, wire::kShmRevokeMessage, (*other)->fd()) == "OK");
    PushFromShm(first, 4, 0, 1000, 1);
    CHECK(first.Answer(&msg) == Code::kOk);
  }
}

TEST_CASE("values asked into shared buffers are checked against them", "[shm]") {
  auto server = StartServer(TestConfig(1, 3));
  {
    auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
    std::vector<float> v(1000, 1.0f);
    REQUIRE(owner->CreateVariable("v", {v.data(), DType::kFloat32, {1000}}).ok());
  }
  std::string msg;
  RawPeer p(server->port());
  SECTION("none attached") {
    p.Hello("raw");
    auto own = wire::SharedSegment::Create(64 << 10, "test");
    REQUIRE(own.ok());
    REQUIRE(ShmAttach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*own)->fd()) == "OK");
    PullInto(p, 2, 1, {0});
    CHECK(p.Answer(&msg) == Code::kFailedPrecondition);
    CHECK_THAT(msg, Catch::Contains("shared buffers"));
    PushFromShm(p, 3, 0, 1000, 1);
    CHECK(p.Answer(&msg) == Code::kFailedPrecondition);
  }
  SECTION("attached") {
    auto arena = wire::SharedSegment::Create(64 << 10, "arena");
    REQUIRE(arena.ok());
    AttachWithArena(p, "raw", **arena);
    PullInto(p, 2, 1, {(64 << 10) - 3996});  // runs past the end
    CHECK(p.Answer(&msg) == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("do not fit"));
    PullInto(p, 3, 1, {~uint64_t{0} - 100});  // no wrap-around
    CHECK(p.Answer(&msg) == Code::kInvalidArgument);
    PullInto(p, 4, 1, {2});  // not a multiple of a float's size
    CHECK(p.Answer(&msg) == Code::kInvalidArgument);
    CHECK_THAT(msg, Catch::Contains("element size"));
    PullInto(p, 5, 1, {0, 4096});  // two offsets for one value
    CHECK(p.Answer(&msg) == Code::kInvalidArgument);
    PushFromShm(p, 6, 2, 1000, 1);  // a misaligned gradient
    CHECK(p.Answer(&msg) == Code::kInvalidArgument);
    PushFromShm(p, 7, 0, 1000, 2);  // no segment 2
    CHECK(p.Answer(&msg) == Code::kFailedPrecondition);
    PullInto(p, 8, 1, {4096});  // and a good one
    REQUIRE(p.Answer(&msg) == Code::kOk);
    CHECK(reinterpret_cast<float*>((*arena)->data() + 4096)[999] == 1.0f);
  }
  // Nothing was pushed: v is whole.
  auto w = ConnectWith(WorkerOptions(server->port(), "healthy"));
  std::vector<float> v(1000);
  REQUIRE(w->Pull("v", {v.data(), DType::kFloat32, {1000}}).ok());
  CHECK(v[0] == 1.0f);
}

TEST_CASE("a worker whose connection was closed attaches its shared buffers again", "[shm]") {
  auto cfg = TestConfig(1);
  cfg.idle_timeout_s = 1;
  auto server = StartServer(cfg);
  auto o = WorkerOptions(server->port(), "w0");
  o.shared_buffer_bytes = 1 << 20;
  auto c = ConnectWith(o);
  auto g = c->AllocateShared(sizeof(float));
  auto v = c->AllocateShared(sizeof(float));
  REQUIRE(g.ok());
  REQUIRE(v.ok());
  *v->as<float>() = 1;
  REQUIRE(c->CreateVariable("v", {v->data(), DType::kFloat32, {}}).ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (server->connection_count() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(server->connection_count() == 0);
  *g->as<float>() = 1;
  auto pushed = c->Push(0, {{"v", {g->data(), DType::kFloat32, {}}}});
  if (!pushed.ok()) {
    CHECK(pushed.status().code() == Code::kUnavailable);
    pushed = c->Push(0, {{"v", {g->data(), DType::kFloat32, {}}}});
  }
  REQUIRE(pushed.ok());
  CHECK(c->shared_memory_shards() == 1);
  CHECK(c->shared_memory_status().empty());
  const uint64_t before = server->metrics().shm_bytes();
  REQUIRE(c->Pull("v", {v->data(), DType::kFloat32, {}}).ok());
  CHECK(*v->as<float>() == Approx(1 - 0.01f).epsilon(1e-6));
  CHECK(server->metrics().shm_bytes() == before + sizeof(float));
}

TEST_CASE("shared buffers bigger than psd maps are not attached, and the client says so", "[shm]") {
  auto cfg = TestConfig(1);
  cfg.shm_max_bytes = 1 << 20;
  auto server = StartServer(cfg);
  auto o = WorkerOptions(server->port(), "w0");
  o.shared_buffer_bytes = 2 << 20;
  auto c = ConnectWith(o);
  CHECK(c->shared_memory_shards() == 1);  // its own segment, cut to 1 MiB
  CHECK_THAT(c->shared_memory_status(), Catch::Contains("--shm-max-bytes"));
  auto b = c->AllocateShared(16);
  REQUIRE(b.ok());
  float one = 1;
  REQUIRE(c->CreateVariable("x", ConstTensorView{&one, DType::kFloat32, {}}).ok());
  REQUIRE(c->Pull("x", TensorView{b->data(), DType::kFloat32, {}}).ok());  // through its own segment
  CHECK(*b->as<float>() == 1.0f);
}
