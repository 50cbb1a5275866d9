// Pushes bigger than a frame: the client cuts them into frames of whole parts, the daemon adds
// each chunk as it arrives, and the result is the one a whole push gives.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <thread>

#include "../client/src/frame_plan.h"
#include "psd/half.h"
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

std::unique_ptr<psclient::Client> Connect(uint16_t port, const std::string& name, uint64_t push_frame_bytes,
                                          uint64_t pull_frame_bytes = 16 << 20) {
  psclient::ClientOptions o = WorkerOptions(port, name);
  o.push_frame_bytes = push_frame_bytes;
  o.pull_frame_bytes = pull_frame_bytes;
  o.shared_memory_bytes = 0;  // frames are what is tested: TCP only (shm_test.cc: shared memory)
  return ConnectWith(o);
}

// A gradient whose float sums depend on the order of the adds.
std::vector<float> Gradient(size_t n, int step, int worker) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] =
        static_cast<float>((i * 31 + static_cast<size_t>(step) * 7 + static_cast<size_t>(worker) * 13) % 97) * 0.0137f -
        (worker ? 0.3f : 0.6f);
  }
  return g;
}

constexpr size_t kW = 100'000;  // 400 KB of float32: several 64 KiB frames

// A worker whose replies may be at most 100 KiB (less than kW floats: only ranges can read them),
// asking for 48 KiB ranges.
psclient::ClientOptions SmallReplies(uint16_t port, const std::string& name) {
  psclient::ClientOptions o = WorkerOptions(port, name);
  o.max_frame_bytes = 100 << 10;
  o.pull_frame_bytes = 48 << 10;
  o.shared_memory_bytes = 0;
  return o;
}
constexpr size_t kB = 10;

// Three sync steps of two workers, each step's pushes side by side: step_of(client, worker, step).
template <typename StepOf>
void TwoWorkersThreeSteps(psclient::Client& w0, psclient::Client& w1, StepOf step_of) {
  for (int step = 0; step < 3; ++step) {
    std::thread other([&] { step_of(w1, 1, step); });
    step_of(w0, 0, step);
    other.join();
  }
}

// Two workers, three sync steps of {w, b}; returns w then b after the last step.
std::vector<float> Train(server::ServerConfig cfg, uint64_t push_frame_bytes, uint64_t pull_frame_bytes = 16 << 20) {
  auto server = StartServer(cfg);
  auto w0 = Connect(server->port(), "w0", push_frame_bytes, pull_frame_bytes);
  auto w1 = Connect(server->port(), "w1", push_frame_bytes, pull_frame_bytes);
  REQUIRE(w0->CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {1000, 100}}).ok());
  REQUIRE(w0->CreateVariable("b", ConstTensorView{nullptr, DType::kFloat32, {kB}}).ok());
  auto step_of = [&](psclient::Client& c, int worker, int step) {
    auto w = Gradient(kW, step, worker), b = Gradient(kB, step, worker + 5);
    auto out = c.Push(step, {{"w", {w.data(), DType::kFloat32, {1000, 100}}}, {"b", {b.data(), DType::kFloat32, {kB}}}},
                      /*wait_token=*/true, 10000);
    REQUIRE(out.ok());
    CHECK(out->accepted() == 2);
    REQUIRE(out->token_status.ok());
  };
  TwoWorkersThreeSteps(*w0, *w1, step_of);
  std::vector<float> w(kW), b(kB);
  REQUIRE(*w0->Pull("w", TensorView{w.data(), DType::kFloat32, {1000, 100}}) == 3);
  REQUIRE(*w0->Pull("b", TensorView{b.data(), DType::kFloat32, {kB}}) == 3);
  auto st = w0->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->accepted_pushes == 12);  // a chunked gradient counts once
  w.insert(w.end(), b.begin(), b.end());
  return w;
}

}  // namespace

TEST_CASE("a push bigger than --max-frame-bytes travels in chunks and trains exactly as a whole push",
          "[integration][chunks]") {
  auto small = TestConfig(2, 2);
  small.max_frame_bytes = 64 << 10;
  auto chunked = Train(small, 4 << 20);  // limited to the daemon's 64 KiB frames
  auto whole = Train(TestConfig(2, 2), 0);
  REQUIRE(chunked.size() == whole.size());
  CHECK(std::memcmp(chunked.data(), whole.data(), whole.size() * sizeof(float)) == 0);
  CHECK(whole[0] != 0.0f);
  // Frames of a few parts, pushed and pulled: the same again.
  auto tiny = Train(TestConfig(2, 2), 8 << 10, 8 << 10);
  CHECK(std::memcmp(tiny.data(), whole.data(), whole.size() * sizeof(float)) == 0);
}

namespace {

// Two workers, three sync steps of a sparse gradient of 3000 rows x 16 float32 (about 216 KB with
// its indices) for a [5000, 16] table, MEAN; returns the table after the last step.
std::vector<float> TrainSparse(server::ServerConfig cfg, uint64_t push_frame_bytes) {
  cfg.reduction = server::Reduction::kMean;
  auto server = StartServer(cfg);
  auto w0 = Connect(server->port(), "w0", push_frame_bytes);
  auto w1 = Connect(server->port(), "w1", push_frame_bytes);
  constexpr int64_t kRows = 5000, kDim = 16, kNnz = 3000;
  REQUIRE(w0->CreateVariable("emb", ConstTensorView{nullptr, DType::kFloat32, {kRows, kDim}}).ok());
  auto step_of = [&](psclient::Client& c, int worker, int step) {
    std::vector<int64_t> rows;  // overlapping row sets: rows both workers send are averaged over 2
    for (int64_t r = 0; r < kNnz; ++r) rows.push_back((r * (worker ? 3 : 1) + step) % kRows);
    auto values = Gradient(static_cast<size_t>(kNnz * kDim), step, worker);
    psclient::SparseGradient g{"emb", rows, {values.data(), DType::kFloat32, {kNnz, kDim}}, std::nullopt};
    auto out = c.Push(step, {}, {g}, /*wait_token=*/true, 10000);
    REQUIRE(out.ok());
    CHECK(out->accepted() == 1);
    REQUIRE(out->token_status.ok());
  };
  TwoWorkersThreeSteps(*w0, *w1, step_of);
  std::vector<float> emb(static_cast<size_t>(kRows * kDim));
  REQUIRE(*w0->Pull("emb", TensorView{emb.data(), DType::kFloat32, {kRows, kDim}}) == 3);
  auto st = w0->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->accepted_pushes == 6);  // a sparse gradient sent in several frames counts once
  return emb;
}

}  // namespace

TEST_CASE("a sparse gradient bigger than --max-frame-bytes travels in runs of rows and trains as a whole one",
          "[integration][chunks]") {
  auto small = TestConfig(2, 2);
  small.max_frame_bytes = 64 << 10;
  auto chunked = TrainSparse(small, 4 << 20);  // limited to the daemon's 64 KiB frames
  auto whole = TrainSparse(TestConfig(2, 2), 0);
  REQUIRE(chunked.size() == whole.size());
  CHECK(std::memcmp(chunked.data(), whole.data(), whole.size() * sizeof(float)) == 0);
  CHECK(whole[16] != 0.0f);
  // Tiny frames of a few rows each: the same again.
  auto tiny = TrainSparse(TestConfig(2, 2), 4 << 10);
  CHECK(std::memcmp(tiny.data(), whole.data(), whole.size() * sizeof(float)) == 0);
}

TEST_CASE("a client that sends pushes whole gets RESOURCE_EXHAUSTED naming the flag before it sends",
          "[integration][chunks]") {
  auto cfg = TestConfig(1, 1);
  cfg.max_frame_bytes = 64 << 10;
  auto server = StartServer(cfg);
  auto c = Connect(server->port(), "w0", /*push_frame_bytes=*/0);
  auto made = c->CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {static_cast<int64_t>(kW)}});
  INFO(made.status().ToString());
  REQUIRE(made.ok());
  auto g = Gradient(kW, 0, 0);
  auto out = c->Push(0, {{"w", {g.data(), DType::kFloat32, {static_cast<int64_t>(kW)}}}});
  REQUIRE(out.status().code() == Code::kResourceExhausted);
  CHECK(out.status().message().find("--max-frame-bytes 64 KiB") != std::string::npos);
  CHECK(*c->GlobalStep() == 0);  // nothing was applied
}

TEST_CASE("async: a push sent in chunks is one global step, applied chunk by chunk", "[integration][chunks]") {
  auto cfg = TestConfig(1, 1);
  cfg.mode = server::Mode::kAsync;
  cfg.max_frame_bytes = 64 << 10;
  cfg.optimizer.learning_rate = 0.5;
  auto server = StartServer(cfg);
  auto c = Connect(server->port(), "w0", 4 << 20);
  const int64_t n = static_cast<int64_t>(kW);
  REQUIRE(c->CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {n}}).ok());
  auto g = Gradient(kW, 0, 0);
  for (int step = 0; step < 2; ++step) {
    auto out = c->Push(step, {{"w", {g.data(), DType::kFloat32, {n}}}});
    REQUIRE(out.ok());
    CHECK(out->accepted() == 1);
  }
  CHECK(*c->GlobalStep() == 2);
  std::vector<float> w(kW);
  REQUIRE(c->Pull("w", TensorView{w.data(), DType::kFloat32, {n}}).ok());
  size_t wrong = 0;
  for (size_t i = 0; i < kW; ++i) {
    float want = 0.0f - 0.5f * g[i];
    want = want - 0.5f * g[i];
    wrong += w[i] != want ? 1 : 0;
  }
  CHECK(wrong == 0);
}

TEST_CASE("a value bigger than a reply frame is pulled in element ranges, converted, and after the token",
          "[integration][chunks]") {
  auto cfg = TestConfig(1, 2);  // a second worker reads whole below
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  psclient::ClientOptions o = SmallReplies(server->port(), "w0");
  auto c = ConnectWith(o);
  psclient::Client& w0 = *c;
  const int64_t n = static_cast<int64_t>(kW);
  REQUIRE(w0.CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {1000, 100}}).ok());
  REQUIRE(w0.CreateVariable("b", ConstTensorView{nullptr, DType::kFloat32, {kB}}).ok());
  auto g = Gradient(kW, 0, 0), gb = Gradient(kB, 0, 1);
  std::vector<float> w(kW, -1.0f), b(kB, -1.0f);
  std::vector<std::pair<std::string, TensorView>> after = {{"w", {w.data(), DType::kFloat32, {1000, 100}}},
                                                           {"b", {b.data(), DType::kFloat32, {kB}}}};
  auto out = w0.Push(0, {{"w", {g.data(), DType::kFloat32, {1000, 100}}}, {"b", {gb.data(), DType::kFloat32, {kB}}}},
                     {}, /*wait_token=*/true, 10000, &after);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  CHECK(out->pulled_step == 1);
  size_t wrong = 0;
  for (size_t i = 0; i < kW; ++i) wrong += w[i] != 0.0f - g[i] ? 1 : 0;
  for (size_t i = 0; i < kB; ++i) wrong += b[i] != 0.0f - gb[i] ? 1 : 0;
  CHECK(wrong == 0);
  // A plain pull of both, and one in bfloat16 (converted by psd, then read in ranges).
  std::vector<float> again(kW);
  REQUIRE(*w0.Pull({{"b", {b.data(), DType::kFloat32, {kB}}}, {"w", {again.data(), DType::kFloat32, {1000, 100}}}}) ==
          1);
  CHECK(std::memcmp(again.data(), w.data(), kW * sizeof(float)) == 0);
  // A view of another shape is refused as a small value's is, though each range is flat (psd checks
  // the whole shape each range names); before, a flat view of the same bytes was filled.
  auto flat = w0.Pull("w", TensorView{again.data(), DType::kFloat32, {n}});
  CHECK(flat.status().code() == Code::kInvalidArgument);
  CHECK_THAT(flat.status().message(), Catch::Contains("'w' is float32 [1000,100] but the destination view is"));
  std::vector<uint16_t> half(kW);
  REQUIRE(w0.Pull("w", TensorView{half.data(), DType::kBFloat16, {1000, 100}}).ok());
  std::vector<float> widened(kW);
  psd::ConvertElements(half.data(), DType::kBFloat16, widened.data(), DType::kFloat32, kW);
  wrong = 0;
  for (size_t i = 0; i < kW; ++i) wrong += std::abs(widened[i] - w[i]) > std::abs(w[i]) * 0.01f ? 1 : 0;
  CHECK(wrong == 0);
  // pull_frame_bytes above max_frame_bytes: the replies still fit max_frame_bytes.
  o.pull_frame_bytes = 1ull << 30;
  o.worker_name = "w1";
  auto other = ConnectWith(o);
  std::fill(again.begin(), again.end(), 0.0f);
  REQUIRE(other->Pull("w", TensorView{again.data(), DType::kFloat32, {1000, 100}}).ok());
  CHECK(std::memcmp(again.data(), w.data(), kW * sizeof(float)) == 0);
}

TEST_CASE("a slot bigger than a reply frame is read in element ranges", "[integration][chunks]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "momentum";
  cfg.optimizer.learning_rate = 1.0;
  cfg.optimizer.momentum = 0.9;
  auto server = StartServer(cfg);
  auto c = ConnectWith(SmallReplies(server->port(), "w0"));
  REQUIRE(c->CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {1000, 100}}).ok());
  auto g0 = Gradient(kW, 0, 0), g1 = Gradient(kW, 1, 0);
  REQUIRE(c->Push(0, {{"w", {g0.data(), DType::kFloat32, {1000, 100}}}}, true, 10000).ok());
  REQUIRE(c->Push(1, {{"w", {g1.data(), DType::kFloat32, {1000, 100}}}}, true, 10000).ok());
  std::vector<float> m(kW, -1.0f);
  REQUIRE(c->GetSlot("w", "momentum", TensorView{m.data(), DType::kFloat32, {1000, 100}}).ok());
  size_t wrong = 0;  // TF's momentum accumulator: 0.9 * g0 + g1
  for (size_t i = 0; i < kW; ++i) {
    const float want = 0.9f * g0[i] + g1[i];
    wrong += std::abs(m[i] - want) > 1e-6f * (std::abs(want) + 1) ? 1 : 0;
  }
  CHECK(wrong == 0);
  std::vector<uint16_t> half(kW);  // converted by psd, then read in ranges
  REQUIRE(c->GetSlot("w", "momentum", TensorView{half.data(), DType::kBFloat16, {1000, 100}}).ok());
  CHECK(half[kW - 1] == psd::FloatToBFloat16(m[kW - 1]));
}

TEST_CASE("more rows than a reply frame holds are read in several replies", "[integration][chunks]") {
  auto server = StartServer(TestConfig(1, 1, 0));
  auto c = ConnectWith(SmallReplies(server->port(), "w0"));  // replies of 48 KiB: 122 rows of 400 B
  std::vector<float> init = Gradient(kW, 3, 1);
  REQUIRE(c->CreateVariable("w", ConstTensorView{init.data(), DType::kFloat32, {1000, 100}}).ok());
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < 1500; ++i) rows.push_back((i * 7919) % 1000);  // any order, repeats: 600 KB
  std::vector<float> got(rows.size() * 100, -1.0f);
  auto step = c->PullRows("w", rows, TensorView{got.data(), DType::kFloat32, {1500, 100}});
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  CHECK(*step == 0);
  size_t wrong = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t j = 0; j < 100; ++j) wrong += got[i * 100 + j] != init[static_cast<size_t>(rows[i]) * 100 + j];
  }
  CHECK(wrong == 0);
  // Converted by psd, in several replies too; a row outside the variable is refused before any.
  std::vector<uint16_t> half(rows.size() * 100);
  REQUIRE(c->PullRows("w", rows, TensorView{half.data(), DType::kBFloat16, {1500, 100}}).ok());
  CHECK(half[1499 * 100 + 99] == psd::FloatToBFloat16(init[static_cast<size_t>(rows[1499]) * 100 + 99]));
  rows.push_back(1000);
  got.resize(rows.size() * 100);
  auto bad = c->PullRows("w", rows, TensorView{got.data(), DType::kFloat32, {1501, 100}});
  CHECK(bad.status().code() == Code::kInvalidArgument);
}

TEST_CASE("an initial value bigger than --max-frame-bytes is created in chunks, whole or not at all",
          "[integration][chunks]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.max_frame_bytes = 1 << 20;
  auto server = StartServer(cfg);
  auto c = Connect(server->port(), "w0", 1 << 20);
  constexpr size_t kN = 800'003;  // 3.2 MB: four chunks, the last one short
  std::vector<float> init = Gradient(kN, 1, 0);
  auto created =
      c->CreateVariable("big", {init.data(), DType::kFloat32, {static_cast<int64_t>(kN)}, MemoryKind::kHost});
  REQUIRE(created.ok());
  CHECK(created->created);
  CHECK(created->shape == Shape{static_cast<int64_t>(kN)});
  std::vector<float> got(kN);
  REQUIRE(c->Pull("big", {got.data(), DType::kFloat32, {static_cast<int64_t>(kN)}, MemoryKind::kHost}).ok());
  CHECK(got == init);
  // Half precision in chunks, stored as float32 (one conversion, at creation).
  std::vector<uint16_t> half(kN);
  for (size_t i = 0; i < kN; ++i) half[i] = psd::FloatToBFloat16(init[i]);
  REQUIRE(
      c->CreateVariable("big16", {half.data(), DType::kBFloat16, {static_cast<int64_t>(kN)}, MemoryKind::kHost}).ok());
  std::vector<uint16_t> half_back(kN);
  REQUIRE(c->Pull("big16", {half_back.data(), DType::kBFloat16, {static_cast<int64_t>(kN)}, MemoryKind::kHost}).ok());
  CHECK(half_back == half);
  // A client that sends values whole gets the frame limit named, as for pushes.
  auto whole = Connect(server->port(), "w1", 0);
  auto refused =
      whole->CreateVariable("whole", {init.data(), DType::kFloat32, {static_cast<int64_t>(kN)}, MemoryKind::kHost});
  CHECK(refused.status().code() == Code::kResourceExhausted);
}

TEST_CASE("an update bigger than --max-frame-bytes travels in chunks and is made whole, once",
          "[integration][chunks]") {
  auto cfg = TestConfig(2, 3, 0);  // a replica-context round is two replicas' shares
  cfg.max_frame_bytes = 1 << 20;
  auto server = StartServer(cfg);
  auto c = Connect(server->port(), "w0", 1 << 20);
  constexpr size_t kN = 800'003;  // 3.2 MB: four chunks, the last one short
  const Shape shape{static_cast<int64_t>(kN)};
  std::vector<float> a = Gradient(kN, 1, 0), b = Gradient(kN, 2, 1);
  REQUIRE(c->CreateVariable("state", {nullptr, DType::kFloat32, shape}, /*trainable=*/false).ok());
  auto pull = [&](const std::string& name) {
    std::vector<float> got(kN);
    REQUIRE(c->Pull(name, {got.data(), DType::kFloat32, shape, MemoryKind::kHost}).ok());
    return got;
  };
  // Cross-replica assign, then assign_add: each is one update, made with the last chunk.
  REQUIRE(*c->Update("state", psclient::UpdateOp::kAssign, {a.data(), DType::kFloat32, shape, MemoryKind::kHost}));
  CHECK(pull("state") == a);
  REQUIRE(*c->Update("state", psclient::UpdateOp::kAssignAdd, {b.data(), DType::kFloat32, shape, MemoryKind::kHost}));
  std::vector<float> sum(kN);
  for (size_t i = 0; i < kN; ++i) sum[i] = a[i] + b[i];
  CHECK(pull("state") == sum);
  // bfloat16 chunks are converted to the variable's float32 once the value is whole.
  std::vector<uint16_t> half(kN);
  for (size_t i = 0; i < kN; ++i) half[i] = psd::FloatToBFloat16(a[i]);
  REQUIRE(*c->Update("state", psclient::UpdateOp::kAssign, {half.data(), DType::kBFloat16, shape, MemoryKind::kHost}));
  std::vector<float> widened(kN);
  psd::ConvertElements(half.data(), DType::kBFloat16, widened.data(), DType::kFloat32, kN);
  CHECK(pull("state") == widened);
  // Replica context: two replicas' chunked shares of one round combine by MEAN.
  psclient::VariableOptions mean;
  mean.trainable = false;
  mean.aggregation = psclient::Aggregation::kMean;
  REQUIRE(c->CreateVariable("avg", {nullptr, DType::kFloat32, shape}, mean).ok());
  auto other = Connect(server->port(), "w1", 1 << 20);
  psclient::UpdateOptions share;
  share.cross_replica = false;
  share.timeout_ms = 20000;
  psd::Status second_status;  // Catch's assertions are not thread-safe: checked after the join
  std::thread second([&] {
    second_status =
        other->Update("avg", psclient::UpdateOp::kAssign, {b.data(), DType::kFloat32, shape, MemoryKind::kHost}, share)
            .status();
  });
  CHECK(
      c->Update("avg", psclient::UpdateOp::kAssign, {a.data(), DType::kFloat32, shape, MemoryKind::kHost}, share).ok());
  second.join();
  CHECK(second_status.ok());
  std::vector<float> got = pull("avg");
  size_t wrong = 0;
  for (size_t i = 0; i < kN; ++i) wrong += std::abs(got[i] - (a[i] + b[i]) / 2) > 1e-6f ? 1 : 0;
  CHECK(wrong == 0);
  // A client that sends values whole gets the frame limit named, and nothing changes.
  auto whole = Connect(server->port(), "w2", 0);
  auto refused =
      whole->Update("state", psclient::UpdateOp::kAssign, {b.data(), DType::kFloat32, shape, MemoryKind::kHost});
  CHECK(refused.status().code() == Code::kResourceExhausted);
  CHECK(pull("state") == widened);
}

TEST_CASE("push frames: every frame within the limit, every byte once, chunks of whole parts", "[chunks]") {
  using psclient::internal::kFrameEntryOverhead;
  using psclient::internal::PlanFrames;
  const uint64_t part = 512;
  // Whole gradients that fit go in one frame (no chunk daemon, or a push under the limit).
  CHECK(PlanFrames({100, 200}, {4, 4}, {5}, {10}, 0, part).size() == 1);
  CHECK(PlanFrames({100, 200}, {4, 4}, {5}, {10}, 1 << 20, 0).size() == 1);
  CHECK(PlanFrames({100, 200}, {4, 4}, {5}, {10}, 1 << 20, part).size() == 1);
  // FitsOneFrame (a pull's planning skips PlanFrames with it) says exactly when that is so: at the
  // limit's byte, every entry counted with its overhead.
  using psclient::internal::FitsOneFrame;
  const uint64_t all = 100 + 200 + 5 * 10 + 3 * kFrameEntryOverhead;
  CHECK(FitsOneFrame({100, 200}, {5}, {10}, 0, part));
  CHECK(FitsOneFrame({100, 200}, {5}, {10}, 1, 0));
  for (uint64_t limit : {all - 1, all, all + 1}) {
    INFO("limit " << limit);
    const bool one = PlanFrames({100, 200}, {4, 4}, {5}, {10}, limit, part).size() == 1;
    CHECK(FitsOneFrame({100, 200}, {5}, {10}, limit, part) == one);
    CHECK(one == (limit >= all));
  }
  for (uint64_t limit : {uint64_t{4096}, uint64_t{60} << 10, uint64_t{1} << 20}) {
    // Small, big (float32 and float64), exactly-a-frame and partial-last-part gradients, and sparse
    // ones: small, empty, bigger than every limit (rows of 264 bytes), and rows over 4 KiB.
    std::vector<uint64_t> dense = {40'000, 400'000, 8, limit - kFrameEntryOverhead, 3 * 2048 + 12, 1'000'000};
    std::vector<uint64_t> elem = {4, 4, 8, 4, 4, 8};
    std::vector<uint64_t> rows = {10, 0, 20'000, 2}, row_bytes = {100, 264, 264, 5000};
    auto frames = PlanFrames(dense, elem, rows, row_bytes, limit, part);
    std::vector<uint64_t> next(dense.size(), 0), next_row(rows.size(), 0);
    std::vector<int> pieces(rows.size(), 0);
    for (const auto& f : frames) {
      uint64_t used = 0;
      for (const auto& p : f.dense) {
        INFO("limit " << limit << " entry " << p.entry << " offset " << p.offset << " bytes " << p.bytes);
        CHECK(p.offset == next[p.entry]);  // in order, no gap, no overlap
        next[p.entry] += p.bytes;
        const uint64_t part_bytes = part * elem[p.entry];
        CHECK(p.offset % part_bytes == 0);
        CHECK((p.bytes % part_bytes == 0 || p.offset + p.bytes == dense[p.entry]));
        used += p.bytes + kFrameEntryOverhead;
      }
      for (const auto& p : f.sparse) {
        INFO("limit " << limit << " sparse " << p.entry << " rows " << p.row_begin << ".." << p.row_end);
        CHECK(p.row_begin == next_row[p.entry]);  // whole rows, in order, each once
        CHECK((p.row_end > p.row_begin || rows[p.entry] == 0));
        next_row[p.entry] = p.row_end;
        ++pieces[p.entry];
        used += (p.row_end - p.row_begin) * row_bytes[p.entry] + kFrameEntryOverhead;
      }
      CHECK((used <= limit || f.dense.size() + f.sparse.size() == 1));  // only a lone part or row may be over
      CHECK(f.dense.size() + f.sparse.size() > 0);
    }
    CHECK(next == dense);
    CHECK(next_row == rows);
    CHECK(pieces[0] == 1);  // small ones travel whole
    CHECK(pieces[1] == 1);
    CHECK(pieces[2] > 1);  // 5.3 MB: cut into runs of rows
    CHECK(pieces[3] == (limit < 10000 + kFrameEntryOverhead ? 2 : 1));
  }
}

TEST_CASE("a push with a frame psd would refuse for its size sends none of its frames", "[integration][chunks]") {
  // The dense gradient goes in chunks that fit; the sparse one has a row bigger than a frame,
  // which cannot be cut. Found before anything is sent, the dense chunks are not added alone.
  auto cfg = TestConfig(1, 1);
  cfg.max_frame_bytes = 64 << 10;
  auto server = StartServer(cfg);
  auto c = Connect(server->port(), "w0", 4 << 20);
  const int64_t n = static_cast<int64_t>(kW);
  REQUIRE(c->CreateVariable("w", ConstTensorView{nullptr, DType::kFloat32, {n}}).ok());
  constexpr int64_t kRow = 32 << 10;  // 128 KiB of float32 per row
  REQUIRE(c->CreateVariable("emb", ConstTensorView{nullptr, DType::kFloat32, {4, kRow}}).ok());
  auto g = Gradient(kW, 0, 0);
  std::vector<float> row(kRow, 1.0f);
  psclient::SparseGradient s{"emb", {2}, {row.data(), DType::kFloat32, {1, kRow}}, std::nullopt};
  auto out = c->Push(0, {{"w", {g.data(), DType::kFloat32, {n}}}}, {s});
  REQUIRE(out.status().code() == Code::kResourceExhausted);
  CHECK(out.status().message().find("--max-frame-bytes 64 KiB") != std::string::npos);
  CHECK(server->engine()->Stats().accepted == 0);  // not even the dense gradient
  CHECK(*c->GlobalStep() == 0);
}

TEST_CASE("deterministic mode: a push cut off mid-gradient never counts, its worker's next push does",
          "[integration][chunks]") {
  // Worker a sends the first chunk of its gradient and its connection closes; a connects again and
  // pushes ones whole, b pushes fours: every element moves by the mean, (1 + 4) / 2. Before, the
  // cut-off chunk stayed in its parts' sums (a counted twice there: (1 + 1 + 4) / 3), and cut-off
  // pushes used up the step's slots until no gradient was taken at all.
  auto cfg = TestConfig(2, 2);
  cfg.deterministic = true;
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  constexpr int64_t n = 64 << 10;  // 256 KiB: 128 parts
  std::vector<float> zero(n, 0.0f), ones(n, 1.0f), fours(n, 4.0f);
  auto b = Connect(server->port(), "b", 0);
  REQUIRE(b->CreateVariable("w", ConstTensorView{zero.data(), DType::kFloat32, {n}}).ok());
  const int64_t chunk = 8 * server::TrainingEngine::kChunkElements;
  for (int cut = 0; cut < 12; ++cut) {  // more than the step's slots (2 x max(N, R) + 8)
    RawPeer a(server->port());
    a.Hello("a");
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(2);
    auto p = req.initPush();
    p.setLocalStep(0);
    p.setMore(true);
    auto g = p.initGrads(1)[0];
    g.setName("w");
    g.setChunk(true);
    g.setChunkOffset(0);
    wire::SetTensor(f.builder, g.initGrad(), DType::kFloat32, {chunk}, ones.data(), static_cast<size_t>(chunk) * 4);
    a.Send(f);
    Code code;
    std::string message;
    REQUIRE(a.Read(&code, &message));  // taken (more to come)
    REQUIRE(code == Code::kOk);
  }  // closed mid-push
  auto a = Connect(server->port(), "a", 0);
  std::thread pa([&] {
    auto out = a->Push(0, {{"w", ConstTensorView{ones.data(), DType::kFloat32, {n}}}}, {}, true, 20000);
    CHECK(out.ok());
  });
  auto out = b->Push(0, {{"w", ConstTensorView{fours.data(), DType::kFloat32, {n}}}}, {}, true, 20000);
  pa.join();
  REQUIRE(out.ok());
  CHECK(out->token_status.ok());
  std::vector<float> w(n);
  REQUIRE(*b->Pull("w", TensorView{w.data(), DType::kFloat32, {n}}) == 1);
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(w[static_cast<size_t>(i)] == -2.5f);
  }
}

TEST_CASE("a value arriving in chunks is checked before its memory is taken", "[integration][chunks]") {
  // One 200-byte chunk named a value of 4 billion elements for a variable that does not exist:
  // psd took 16 GB of address space for it, charged to nothing, and answered `none`.
  auto cfg = TestConfig(1, 4);
  cfg.max_model_bytes = 64ull << 20;
  cfg.max_frame_bytes = 1 << 20;
  auto server = StartServer(cfg);
  auto owner = Connect(server->port(), "owner", 1 << 20);
  std::vector<float> zero(1000, 0.0f), some(50, 1.0f);
  REQUIRE(owner->CreateVariable("v", {zero.data(), DType::kFloat32, {1000}}, /*trainable=*/false).ok());
  RawPeer raw(server->port());
  raw.Hello("raw");
  auto send = [&](bool update, const std::string& name, int64_t elements) {
    wire::OutFrame f;
    auto req = f.builder.initRoot<proto::Request>();
    req.setId(9);
    if (update) {
      auto u = req.initUpdate();
      u.setVariable(name);
      u.setOp(proto::UpdateOp::ASSIGN);
      u.setCrossReplica(true);
      u.setChunked(true);
      u.setChunkOffset(0);
      u.initChunkedShape(1).set(0, elements);
      u.setMore(true);
      wire::SetTensor(f.builder, u.initValue(), DType::kFloat32, {50}, some.data(), 200);
    } else {
      auto c = req.initCreateVariable();
      c.setName(name);
      c.setChunked(true);
      c.setChunkOffset(0);
      c.initChunkedShape(1).set(0, elements);
      c.setMore(true);
      wire::SetTensor(f.builder, c.initInitial(), DType::kFloat32, {50}, some.data(), 200);
    }
    raw.Send(f);
    Code code;
    std::string message;
    REQUIRE(raw.Read(&code, &message));
    return std::make_pair(code, message);
  };
  auto [code, message] = send(true, "nope", 4'000'000'000);
  CHECK(code == Code::kNotFound);
  std::tie(code, message) = send(true, "v", 4'000'000'000);
  CHECK(code == Code::kInvalidArgument);
  CHECK_THAT(message, Catch::Contains("for a variable of shape [1000]"));
  // Nor a create naming an existing variable with another shape (it skipped both checks).
  std::tie(code, message) = send(false, "v", 4'000'000'000);
  CHECK(code == Code::kAlreadyExists);
  CHECK_THAT(message, Catch::Contains("exists as [1000]"));
  // A new variable's value is reserved against --max-model-bytes while its chunks arrive: two of
  // 40 MB do not fit 64 MB, on one connection or on several.
  std::tie(code, message) = send(false, "big", 10'000'000);
  CHECK(code == Code::kOk);
  auto other = Connect(server->port(), "other", 1 << 20);
  std::vector<float> big(10'000'000, 0.5f);
  auto refused = other->CreateVariable("big2", {big.data(), DType::kFloat32, {10'000'000}}, false);
  CHECK(refused.status().code() == Code::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("--max-model-bytes"));
  // The first one's chunks stop (its connection closes): the reservation goes with them.
  raw.socket.close();
  CHECK(Eventually([&] {
    return other->CreateVariable("big2", {big.data(), DType::kFloat32, {10'000'000}}, false).ok();
  }));
}
