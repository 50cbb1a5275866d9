// Consistency modes, sparse updates, moving averages and learning-rate changes over the wire.
#include <catch2/catch.hpp>
#include <thread>

#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

ConstTensorView View(const std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}

}  // namespace

TEST_CASE("async: no barrier, staleness reported per gradient", "[modes][async]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.mode = server::Mode::kAsync;
  auto server = StartServer(cfg);
  auto a = ConnectWorker(server->port(), "a");
  auto b = ConnectWorker(server->port(), "b");
  CHECK(a->config().mode == "async");
  std::vector<float> zero{0}, one{1};
  REQUIRE(a->CreateVariable("w", View(zero, {1})).ok());
  auto pa = a->Push(0, {{"w", View(one, {1})}}, /*wait_token=*/true, 1000);
  REQUIRE(pa.ok());
  CHECK(pa->token_status.ok());
  CHECK(pa->token == 1);  // the "token" is the global step: no waiting
  auto pb = b->Push(0, {{"w", View(one, {1})}}, true, 1000);
  REQUIRE(pb.ok());
  CHECK(pb->results[0].accepted);
  CHECK(pb->results[0].staleness == 1);
  CHECK(*b->WaitToken(1000) == 2);
  auto st = b->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->max_staleness == 1);
}

TEST_CASE("ssp: a worker too far ahead waits for the slowest", "[modes][ssp]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.mode = server::Mode::kSsp;
  cfg.staleness_bound = 1;
  auto server = StartServer(cfg);
  auto fast = ConnectWorker(server->port(), "fast");
  auto slow = ConnectWorker(server->port(), "slow");
  std::vector<float> zero{0}, g{1};
  REQUIRE(fast->CreateVariable("w", View(zero, {1})).ok());
  REQUIRE(fast->Push(0, {{"w", View(g, {1})}}).ok());
  REQUIRE(fast->WaitToken(1000).ok());  // clock 1, slowest 0: within the bound
  REQUIRE(fast->Push(1, {{"w", View(g, {1})}}).ok());
  auto blocked = fast->WaitToken(200);  // clock 2 vs 0: waits, here until its deadline
  CHECK(blocked.status().code() == Code::kDeadlineExceeded);
  CHECK_THAT(blocked.status().message(), Catch::Contains("staleness bound"));
  Result<int64_t> released = Internal("not run");
  std::thread t([&] { released = fast->WaitToken(5000); });
  REQUIRE(slow->Push(0, {{"w", View(g, {1})}}).ok());
  REQUIRE(slow->WaitToken(1000).ok());  // slow reaches clock 1: fast may go on to 2
  t.join();
  REQUIRE(released.ok());
  CHECK(*released == 3);  // three pushes applied so far
  // A finishing worker releases the others for good.
  REQUIRE(slow->Finish().ok());
  REQUIRE(fast->Push(3, {{"w", View(g, {1})}}).ok());
  CHECK(fast->WaitToken(1000).ok());
}

TEST_CASE("soft sync: the step deadline commits with the gradients that arrived", "[modes][soft]") {
  auto cfg = TestConfig(3, 3, 0);
  cfg.step_deadline_ms = 150;
  auto server = StartServer(cfg);
  auto w = ConnectWorker(server->port(), "w");
  std::vector<float> zero{0}, g{2};
  REQUIRE(w->CreateVariable("w", View(zero, {1})).ok());
  auto out = w->Push(0, {{"w", View(g, {1})}}, true, 5000);  // 1 of 3: the deadline completes it
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  CHECK(out->token == 1);
  CHECK(out->step_gradients == 1);
  std::vector<float> v(1);
  REQUIRE(w->Pull("w", {v.data(), DType::kFloat32, {1}, MemoryKind::kHost}).ok());
  CHECK(v[0] == Approx(-0.02));  // lr 0.01 * the one gradient
}

TEST_CASE("sparse gradients and row pulls through the client", "[modes][sparse]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  auto a = ConnectWorker(server->port(), "a");
  auto b = ConnectWorker(server->port(), "b");
  // 1000 x 4 table created as zeros without sending a tensor's worth of bytes.
  REQUIRE(a->CreateVariable("emb", {nullptr, DType::kFloat32, {1000, 4}, MemoryKind::kHost}).ok());
  // Unsorted, repeated indices: the client sorts and sums them (row 7 gets 1 + 2).
  std::vector<float> va{1, 1, 1, 1, 5, 5, 5, 5, 2, 2, 2, 2};
  psclient::SparseGradient ga{"emb", {7, 900, 7}, View(va, {3, 4}), std::nullopt};
  std::vector<float> vb{1, 1, 1, 1};
  psclient::SparseGradient gb{"emb", {7}, View(vb, {1, 4}), Shape{1000, 4}};
  auto ra = a->Push(0, {}, {ga});
  REQUIRE(ra.ok());
  CHECK(ra->results[0].accepted);
  auto rb = b->Push(0, {}, {gb}, true, 2000);
  REQUIRE(rb.ok());
  REQUIRE(rb->token_status.ok());
  std::vector<float> rows(3 * 4);
  auto step = a->PullRows("emb", {900, 7, 0}, {rows.data(), DType::kFloat32, {3, 4}, MemoryKind::kHost});
  REQUIRE(step.ok());
  CHECK(*step == 1);
  CHECK(rows[0] == Approx(-5));  // row 900: only a's gradient (count 1)
  CHECK(rows[4] == Approx(-2));  // row 7: mean(1 + 2, 1) = 2
  CHECK(rows[8] == 0);           // row 0: untouched
  psclient::SparseGradient bad{"emb", {1000}, View(vb, {1, 4}), std::nullopt};
  auto err = a->Push(1, {}, {bad});
  CHECK(err.status().code() == Code::kInvalidArgument);
  CHECK_THAT(err.status().message(), Catch::Contains("exceeded limits of shape"));
}

TEST_CASE("moving averages, slots and learning-rate changes through the client", "[modes]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.ema_decay = 0.5;
  cfg.optimizer.name = "adam";
  cfg.optimizer.learning_rate = 0.1;
  auto server = StartServer(cfg);
  auto chief = ConnectWorker(server->port(), "chief");
  auto other = ConnectWorker(server->port(), "other");
  CHECK(chief->SlotNames() == std::vector<std::string>{"m", "v"});
  std::vector<float> zero{0}, g{1};
  psclient::VariableOptions opts;
  opts.average = true;
  REQUIRE(chief->CreateVariable("w", View(zero, {1}), opts).ok());
  auto out = chief->Push(0, {{"w", View(g, {1})}}, true, 1000);
  REQUIRE(out.ok());
  std::vector<float> w(1), avg(1), m(1);
  REQUIRE(chief->Pull("w", {w.data(), DType::kFloat32, {1}, MemoryKind::kHost}).ok());
  CHECK(w[0] == Approx(-0.1));  // Adam's first step moves by ~lr
  REQUIRE(chief->PullAverages({{"w", {avg.data(), DType::kFloat32, {1}, MemoryKind::kHost}}}).ok());
  CHECK(avg[0] == Approx(-0.05));
  REQUIRE(chief->GetSlot("w", "m", {m.data(), DType::kFloat32, {1}, MemoryKind::kHost}).ok());
  CHECK(m[0] == Approx(0.1));
  CHECK(other->SetLearningRate(0.5).code() == Code::kFailedPrecondition);
  REQUIRE(chief->SetLearningRate(0.5).ok());
  CHECK(chief->GetStatus()->learning_rate == 0.5);
}
