// Rows through shared memory (README "Shared memory on the same host"): a same-host worker's
// PullRows come through its connection's segment, or land in place in its shared buffers, one
// after another or each at its own place (a sliced variable's rows scattered back into the
// caller's order); a sparse gradient's rows in increasing order are read from its shared buffers
// in place. The rows are those TCP gives, bit for bit; every place is checked before a row is
// read; rows that do not fit the segment's room come in the reply.
#include <catch2/catch.hpp>
#include <cstring>

#include "support/raw_peer.h"
#include "support/test_cluster.h"
#include "support/test_server.h"
#include "wire/shm.h"

using namespace psd;
using namespace psd::testing;

namespace {

constexpr int64_t kRows = 100, kDim = 30;  // emb [100, 30] float32: three slices of 4096 bytes on a cluster

enum class Via { kTcp, kSegment, kBuffers };

struct Pulled {
  std::vector<float> scattered;  // rows {97, 3, 50, 3, 0, 68, 33, 99}
  std::vector<float> run;        // rows 10..59, in order
  std::vector<uint16_t> half;    // rows {97, 3, 50, 3, 0, 68, 33, 99} as bfloat16
  uint64_t shm_bytes = 0;        // the daemons' shared-memory bytes for the three pulls
  uint64_t push_shm_bytes = 0;   // ... for the push
};

const std::vector<int64_t> kScattered = {97, 3, 50, 3, 0, 68, 33, 99};

// One worker trains emb a step (sparse) on one daemon or a 3-shard cluster, then pulls rows `via`.
Pulled TrainAndPull(Via via, bool cluster) {
  auto cfg = TestConfig(1, 1, 0);
  cfg.slice_bytes = 4096;
  std::unique_ptr<server::Server> server;
  TestCluster shards;
  psclient::ClientOptions o;
  if (cluster) {
    shards = StartTestCluster(cfg, 3);
    o.cluster = shards.addresses;
    o.worker_name = "w0";
  } else {
    server = StartServer(cfg);
    o = WorkerOptions(server->port(), "w0");
  }
  // With buffers, a segment too small for the gradient's rows: only the buffers can carry them.
  o.shared_memory_bytes = via == Via::kSegment ? (1 << 20) : via == Via::kBuffers ? 4096 : 0;
  o.shared_buffer_bytes = via == Via::kBuffers ? (1 << 20) : 0;
  auto c = ConnectWith(o);
  REQUIRE(c->shared_memory_shards() == (via == Via::kTcp ? 0 : cluster ? 3 : 1));
  std::vector<float> init(static_cast<size_t>(kRows * kDim));
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i % 23) * 0.125f - 1.0f;
  REQUIRE(c->CreateVariable("emb", ConstTensorView{init.data(), DType::kFloat32, {kRows, kDim}}).ok());
  // The views: plain memory, or shared buffers (then psd reads and writes them in place).
  std::vector<psclient::SharedBuffer> buffers;
  std::vector<std::vector<uint64_t>> plain;
  auto storage = [&](size_t bytes) -> void* {
    if (via != Via::kBuffers) return plain.emplace_back((bytes + 7) / 8).data();
    auto b = c->AllocateShared(bytes);
    REQUIRE(b.ok());
    buffers.push_back(std::move(*b));
    return buffers.back().data();
  };
  auto shm_bytes = [&] {
    uint64_t n = 0;
    if (server) n += server->metrics().shm_bytes();
    for (auto& s : shards.shards) n += s->metrics().shm_bytes();
    return n;
  };
  // A gradient of the odd rows 1..79 (increasing: sent as they are, from the caller's memory).
  auto* g = static_cast<float*>(storage(40 * kDim * sizeof(float)));
  std::vector<int64_t> odd;
  for (int64_t r = 1; r < 80; r += 2) odd.push_back(r);
  for (size_t i = 0; i < 40 * kDim; ++i) g[i] = static_cast<float>(i % 11) * 0.3f - 1.3f;
  psclient::SparseGradient sparse{"emb", odd, {g, DType::kFloat32, {40, kDim}}, std::nullopt};
  auto pushed = c->Push(0, {}, {sparse}, true, 10000);
  REQUIRE(pushed.ok());
  REQUIRE(pushed->token_status.ok());
  const uint64_t before = shm_bytes();
  const int64_t n = static_cast<int64_t>(kScattered.size());
  auto* scattered = static_cast<float*>(storage(static_cast<size_t>(n * kDim) * sizeof(float)));
  auto* run = static_cast<float*>(storage(50 * kDim * sizeof(float)));
  auto* half = static_cast<uint16_t*>(storage(static_cast<size_t>(n * kDim) * sizeof(uint16_t)));
  std::vector<int64_t> run_rows;
  for (int64_t r = 10; r < 60; ++r) run_rows.push_back(r);
  auto s1 = c->PullRows("emb", kScattered, TensorView{scattered, DType::kFloat32, {n, kDim}});
  REQUIRE(s1.ok());
  CHECK(*s1 == 1);
  REQUIRE(c->PullRows("emb", run_rows, TensorView{run, DType::kFloat32, {50, kDim}}).ok());
  REQUIRE(c->PullRows("emb", kScattered, TensorView{half, DType::kBFloat16, {n, kDim}}).ok());
  Pulled out;
  out.scattered.assign(scattered, scattered + n * kDim);
  out.run.assign(run, run + 50 * kDim);
  out.half.assign(half, half + n * kDim);
  out.shm_bytes = shm_bytes() - before;
  out.push_shm_bytes = before;
  return out;
}

// A PullRows of "emb" rows `rows` into segment `segment`: at `offsets` (segment 1), or in the room
// [offset, offset + bytes) (segment 0).
void PullRowsInto(RawPeer& p, uint64_t id, const std::vector<int64_t>& rows, unsigned segment,
                  const std::vector<uint64_t>& offsets, uint64_t offset = 0, uint64_t bytes = 0) {
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(id);
  auto pr = req.initPullRows();
  pr.setName("emb");
  auto list = pr.initRows(static_cast<unsigned>(rows.size()));
  for (size_t i = 0; i < rows.size(); ++i) list.set(static_cast<unsigned>(i), rows[i]);
  auto target = pr.initToShm();
  target.setSegment(static_cast<uint8_t>(segment));
  target.setOffset(offset);
  target.setBytes(bytes);
  auto at = target.initOffsets(static_cast<unsigned>(offsets.size()));
  for (size_t i = 0; i < offsets.size(); ++i) at.set(static_cast<unsigned>(i), offsets[i]);
  p.Send(f);
}

bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("rows pulled through shared memory are the rows TCP gives, on one daemon and on a sliced cluster",
          "[shm][rows]") {
  for (bool cluster : {false, true}) {
    INFO((cluster ? "3-shard cluster" : "one daemon"));
    Pulled tcp = TrainAndPull(Via::kTcp, cluster);
    Pulled segment = TrainAndPull(Via::kSegment, cluster);
    Pulled buffers = TrainAndPull(Via::kBuffers, cluster);
    CHECK(segment.scattered == tcp.scattered);
    CHECK(buffers.scattered == tcp.scattered);
    CHECK(segment.run == tcp.run);
    CHECK(buffers.run == tcp.run);
    CHECK(segment.half == tcp.half);
    CHECK(buffers.half == tcp.half);
    // Row 3 trained, and came twice; row 0 did not train.
    CHECK(tcp.scattered[1 * kDim] != static_cast<float>(3 * kDim % 23) * 0.125f - 1.0f);
    CHECK(std::memcmp(&tcp.scattered[1 * kDim], &tcp.scattered[3 * kDim], kDim * sizeof(float)) == 0);
    CHECK(tcp.scattered[4 * kDim] == -1.0f);
    // The gradient's rows (4800 bytes) went through shared memory; with buffers, in place (on one
    // daemon, the 4096-byte segment could not hold them).
    CHECK(tcp.push_shm_bytes == 0);
    CHECK(segment.push_shm_bytes == 40 * kDim * 4);
    CHECK(buffers.push_shm_bytes == 40 * kDim * 4);
    // Every row went through shared memory (8 + 50 float32 rows, 8 bfloat16 rows), none over TCP.
    const uint64_t rows_bytes = (8 + 50) * kDim * 4 + 8 * kDim * 2;
    CHECK(tcp.shm_bytes == 0);
    CHECK(segment.shm_bytes == rows_bytes);
    CHECK(buffers.shm_bytes == rows_bytes);
  }
}

TEST_CASE("rows that do not fit the segment come in the reply, and a view of the wrong shape is named", "[shm][rows]") {
  auto server = StartServer(TestConfig(1, 3, 0));
  auto o = WorkerOptions(server->port(), "w0");
  o.shared_memory_bytes = 64 << 10;
  auto c = ConnectWith(o);
  REQUIRE(c->shared_memory_shards() == 1);
  std::vector<float> init(2000 * 64);
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i);
  REQUIRE(c->CreateVariable("emb", ConstTensorView{init.data(), DType::kFloat32, {2000, 64}}).ok());
  // 1000 rows of 256 bytes: 250 KiB, more than the 64 KiB segment holds.
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < 1000; ++r) rows.push_back(1999 - 2 * r);
  std::vector<float> out(1000 * 64);
  REQUIRE(c->PullRows("emb", rows, TensorView{out.data(), DType::kFloat32, {1000, 64}}).ok());
  for (size_t i = 0; i < 1000; ++i) {
    INFO(i);
    REQUIRE(out[i * 64 + 5] == init[static_cast<size_t>(rows[i]) * 64 + 5]);
  }
  CHECK(server->metrics().shm_bytes() == 0);
  // 10 rows fit: through the segment.
  REQUIRE(c->PullRows("emb", {7, 1, 7}, TensorView{out.data(), DType::kFloat32, {3, 64}}).ok());
  CHECK(out[64] == 64.0f);
  CHECK(out[128] == 7 * 64.0f);
  CHECK(server->metrics().shm_bytes() == 3 * 256);
  // A view whose rows are not the variable's: the same error as over TCP, naming the shape.
  for (uint64_t shm : {uint64_t{0}, uint64_t{64 << 10}}) {
    INFO("shared memory " << shm);
    auto w = WorkerOptions(server->port(), "w" + std::to_string(shm));
    w.shared_memory_bytes = shm;
    auto d = ConnectWith(w);
    auto wrong = d->PullRows("emb", {1, 2}, TensorView{out.data(), DType::kFloat32, {2, 32}});
    CHECK(wrong.status().code() == Code::kInvalidArgument);
    CHECK_THAT(wrong.status().message(), Catch::Contains("float32 [2,64] but the destination view is float32 [2,32]"));
  }
}

TEST_CASE("rows asked into shared memory are checked before any is read", "[shm][rows]") {
  auto server = StartServer(TestConfig(1, 3));
  {
    auto owner = ConnectWith(WorkerOptions(server->port(), "owner"));
    std::vector<float> v(16 * 4);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i + 1);
    REQUIRE(owner->CreateVariable("emb", {v.data(), DType::kFloat32, {16, 4}}).ok());
  }
  std::string msg;
  RawPeer p(server->port());
  p.Hello("raw");
  auto own = wire::SharedSegment::Create(64 << 10, "test");
  auto arena = wire::SharedSegment::Create(64 << 10, "arena");
  REQUIRE(own.ok());
  REQUIRE(arena.ok());
  REQUIRE(ShmAttach(p.shm_socket, wire::ShmAttachMessage(p.connection_id, p.shm_nonce), (*own)->fd(), (*arena)->fd()) ==
          "OK");
  const uint8_t* a = (*arena)->data();
  PullRowsInto(p, 2, {1, 2}, 1, {(64 << 10) - 16});  // two rows of 16 bytes: the second past the end
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("do not fit") && Catch::Contains("[2, 4] float32"));
  PullRowsInto(p, 3, {1, 2}, 1, {0}, 0, 16);  // within `bytes` of 16: one row only
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  PullRowsInto(p, 4, {1, 2}, 1, {~uint64_t{0} - 8});  // no wrap-around
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  PullRowsInto(p, 5, {1, 2}, 1, {2});  // not a multiple of a float's size
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("element size"));
  PullRowsInto(p, 6, {1, 2, 3}, 1, {0, 64});  // two offsets for three rows
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  CHECK_THAT(msg, Catch::Contains("one per row"));
  PullRowsInto(p, 7, {1, 2, 3}, 1, {0, 64, 64 << 10});  // one row's place outside
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  PullRowsInto(p, 8, {1, 16}, 1, {0});  // a row outside the variable
  CHECK(p.Answer(&msg) == Code::kInvalidArgument);
  PullRowsInto(p, 9, {1}, 2, {0});  // no segment 2
  CHECK(p.Answer(&msg) == Code::kFailedPrecondition);
  // None of them wrote a byte.
  CHECK(AllZero(a, 64 << 10));
  CHECK(AllZero((*own)->data(), 64 << 10));
  // Each row at its own place, in the order asked; repeats allowed.
  PullRowsInto(p, 10, {5, 0, 5}, 1, {4096, 128, 64});
  REQUIRE(p.Answer(&msg) == Code::kOk);
  const float* f = reinterpret_cast<const float*>(a);
  CHECK(f[4096 / 4] == 21.0f);  // row 5: 21..24
  CHECK(f[128 / 4] == 1.0f);    // row 0
  CHECK(f[64 / 4 + 3] == 24.0f);
  // Segment 0's room too small for the rows: they come in the reply instead.
  PullRowsInto(p, 11, {3, 4}, 0, {}, 1024, 16);
  REQUIRE(p.Answer(&msg) == Code::kOk);
  auto value = p.in.Reader()->getRoot<proto::Response>().getPull().getValues()[0];
  CHECK_FALSE(value.getInShm());
  REQUIRE(value.getData().size() >= 32);
  CHECK(reinterpret_cast<const float*>(value.getData().begin())[4] == 17.0f);  // row 4
  CHECK(AllZero((*own)->data(), 64 << 10));
  // ... and in it when they fit.
  PullRowsInto(p, 12, {3, 4}, 0, {}, 1024, 32);
  REQUIRE(p.Answer(&msg) == Code::kOk);
  value = p.in.Reader()->getRoot<proto::Response>().getPull().getValues()[0];
  CHECK(value.getInShm());
  CHECK(value.getShmOffset() == 1024);
  CHECK(reinterpret_cast<const float*>((*own)->data() + 1024)[4] == 17.0f);
}
