// An in-process psd on 127.0.0.1:0 and libpsclient workers: the synchronous flows end to end.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "psd/cores.h"
#include "support/captured_log.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::CapturedLog;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

ConstTensorView Scalar(const float& v) { return {&v, DType::kFloat32, {}, MemoryKind::kHost}; }

float PullScalar(psclient::Client& c, const std::string& name, int64_t* step = nullptr) {
  float v = -1;
  auto s = c.Pull(name, {&v, DType::kFloat32, {}, MemoryKind::kHost});
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  if (step) *step = *s;
  return v;
}

std::vector<bool> PushScalar(psclient::Client& c, int64_t local_step, const std::string& name, float g) {
  auto out = c.Push(local_step, {{name, Scalar(g)}});
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  std::vector<bool> acc;
  for (auto& r : out->results) acc.push_back(r.accepted);
  return acc;
}

// Polls until cond() holds; fails the test after `ms`.
template <typename F>
void WaitUntil(F cond, int ms = 10000) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!cond()) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace

TEST_CASE("two workers over the wire: the reference flow step by step", "[integration]") {
  auto cfg = TestConfig(2, 2);
  cfg.optimizer.learning_rate = 2.0;
  auto server = StartServer(cfg);
  auto w0 = ConnectWorker(server->port(), "w0");
  auto w1 = ConnectWorker(server->port(), "w1");
  CHECK(w0->is_chief());
  CHECK_FALSE(w1->is_chief());
  CHECK(w0->config().tokens_per_step == 2);
  CHECK(w0->config().init_tokens == 2);

  float zero = 0, one = 1;
  auto created = w0->CreateVariable("var_0", Scalar(zero));
  REQUIRE(created.ok());
  CHECK(created->created);
  REQUIRE(w0->CreateVariable("var_1", Scalar(one)).ok());
  auto again = w1->CreateVariable("var_0", Scalar(one));  // create-or-get: w0's value stands
  REQUIRE(again.ok());
  CHECK_FALSE(again->created);

  CHECK(PushScalar(*w0, 0, "var_0", 0.1f) == std::vector<bool>{true});
  CHECK(PushScalar(*w0, 0, "var_1", 0.9f) == std::vector<bool>{true});
  CHECK(*w0->WaitToken(1000) == 0);
  CHECK(PullScalar(*w1, "var_0") == 0.0f);

  // w1 pushes both gradients in one message with the token wait fused into the reply.
  float g0 = 0.3f, g1 = 1.1f;
  auto out = w1->Push(0, {{"var_0", Scalar(g0)}, {"var_1", Scalar(g1)}}, /*wait_token=*/true, 1000);
  REQUIRE(out.ok());
  CHECK(out->accepted() == 2);
  REQUIRE(out->token_status.ok());
  CHECK(out->token == 0);  // the second init token
  int64_t step = -1;
  CHECK(PullScalar(*w1, "var_0", &step) == Approx(-0.4));
  CHECK(step == 1);
  CHECK(PullScalar(*w1, "var_1") == Approx(-1.0));
  CHECK(*w1->GlobalStep() == 1);

  // The wasted step: both still tag 0.
  auto stale = w0->Push(0, {{"var_0", Scalar(g0)}, {"var_1", Scalar(g1)}}, true, 1000);
  REQUIRE(stale.ok());
  CHECK(stale->stale() == 2);
  CHECK(stale->results[0].step == 1);  // the reply says which step the accumulator is at
  CHECK(stale->token == 1);
  auto st = w0->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->stale_pushes == 2);
  CHECK(st->accepted_pushes == 4);
}

TEST_CASE("a straggler never holds the step: its late gradient is dropped and reported", "[integration]") {
  auto server = StartServer(TestConfig(2, 3, 0));  // 2 to aggregate + 1 backup
  auto w0 = ConnectWorker(server->port(), "fast-0");
  auto w1 = ConnectWorker(server->port(), "fast-1");
  auto slow = ConnectWorker(server->port(), "slow");
  float init = 0;
  REQUIRE(w0->CreateVariable("w", Scalar(init)).ok());

  constexpr int kSteps = 5;
  std::atomic<int> failures{0};  // Catch2 assertions are not thread-safe: count, check later
  auto fast = [&](psclient::Client& c) {
    int64_t local = 0;
    float g = 1;
    // Until the global step reaches kSteps (tokens are shared: counting iterations could leave
    // one fast worker short of gradients), bounded.
    for (int i = 0; local < kSteps && i < 100; ++i) {
      auto out = c.Push(local, {{"w", Scalar(g)}}, true, 5000);
      if (!out.ok() || !out->token_status.ok()) {
        ++failures;
        return;
      }
      local = out->token;
    }
  };
  // The straggler computes its first gradient at step 0 but only delivers it after the two fast
  // workers have finished all their steps: nothing waited for it.
  std::thread t0([&] { fast(*w0); });
  std::thread t1([&] { fast(*w1); });
  t0.join();
  t1.join();
  REQUIRE(failures == 0);
  CHECK(*slow->GlobalStep() >= kSteps);
  float g = 1;
  auto late = slow->Push(0, {{"w", Scalar(g)}}, true, 5000);
  REQUIRE(late.ok());
  CHECK(late->stale() == 1);
  CHECK(late->results[0].step >= kSteps);
  CHECK(late->token_status.ok());  // tokens_per_step = 3: the straggler is not starved
}

TEST_CASE("fewer workers than replicas to aggregate: one worker does several batches", "[integration]") {
  auto server = StartServer(TestConfig(3, 1, 2));  // the minimum init tokens: R - N
  auto w = ConnectWorker(server->port(), "solo");
  float init = 0;
  REQUIRE(w->CreateVariable("w", Scalar(init)).ok());
  int64_t local = 0;
  float g = 1;
  for (int i = 0; i < 9; ++i) {
    auto out = w->Push(local, {{"w", Scalar(g)}}, true, 2000);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    local = out->token;
  }
  CHECK(*w->GlobalStep() == 3);
}

TEST_CASE("a token wait ends at its deadline and loses nothing", "[integration]") {
  auto server = StartServer(TestConfig(1, 1, 0));
  auto w = ConnectWorker(server->port(), "w");
  auto t = w->WaitToken(100);
  CHECK(t.status().code() == Code::kDeadlineExceeded);
  CHECK_THAT(t.status().message(), Catch::Contains("global step 0"));
  float init = 0, g = 1;
  REQUIRE(w->CreateVariable("w", Scalar(init)).ok());
  CHECK(PushScalar(*w, 0, "w", g)[0]);  // completes step 1: one token of 1
  auto again = w->WaitToken(1000);
  REQUIRE(again.ok());
  CHECK(*again == 1);
  CHECK(w->WaitToken(50).status().code() == Code::kDeadlineExceeded);
}

// A push's token wait is parked before its gradients are applied. Answered by that same push (it
// completes the step), it is answered as the handler returns; otherwise its deadline is armed
// then and psd ends it (WorkerSession::FinishInline).
TEST_CASE("a push's own token wait is answered by its own step, or ends at psd's deadline", "[integration]") {
  auto server = StartServer(TestConfig(2, 2, 0));
  auto a = ConnectWorker(server->port(), "a");
  auto b = ConnectWorker(server->port(), "b");
  float init = 0, g = 1;
  REQUIRE(a->CreateVariable("w", Scalar(init)).ok());
  auto first = a->Push(0, {{"w", Scalar(g)}}, true, 150);  // one gradient of 2: no step, no token
  REQUIRE(first.ok());
  CHECK(first->accepted() == 1);
  CHECK(first->token_status.code() == Code::kDeadlineExceeded);
  // psd's own answer at its deadline (the client's would come 10 s later and say no reply came).
  CHECK_THAT(first->token_status.message(), Catch::Contains("no token within 150 ms"));
  auto second = b->Push(0, {{"w", Scalar(g)}}, true, 2000);  // completes step 1 in its own handler
  REQUIRE(second.ok());
  REQUIRE(second->token_status.ok());
  CHECK(second->token == 1);
  auto left = a->WaitToken(1000);  // the step's other token, kept for "a"
  REQUIRE(left.ok());
  CHECK(*left == 1);
  CHECK(*a->GlobalStep() == 1);
  // Nothing waits any more: a's next wait ends at its own deadline again.
  auto none = a->Push(1, {{"w", Scalar(g)}}, true, 100);
  REQUIRE(none.ok());
  CHECK_THAT(none->token_status.message(), Catch::Contains("no token within 100 ms"));
}

TEST_CASE("64 concurrent workers against a daemon with 2 I/O threads", "[integration]") {
  constexpr int kWorkers = 64;
  auto cfg = TestConfig(kWorkers, kWorkers, 0);
  cfg.io_threads = 2;
  auto server = StartServer(cfg);
  std::vector<std::unique_ptr<psclient::Client>> clients;
  for (int i = 0; i < kWorkers; ++i) clients.push_back(ConnectWorker(server->port(), "w" + std::to_string(i)));
  std::vector<float> init(16, 0.f);
  REQUIRE(clients[0]->CreateVariable("w", {init.data(), DType::kFloat32, {16}, MemoryKind::kHost}).ok());
  std::atomic<int> failures{0};
  std::string first_failure;
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      std::vector<float> g(16, 1.f);
      int64_t local = 0;
      // Like a real trainer, loop until the global step (the token) reaches the target: tokens
      // are shared, so a fast worker may take two tokens of one step and push twice while a
      // slower one waits (TF semantics); counting iterations instead could starve a worker.
      for (int iter = 0; local < 3 && iter < 100; ++iter) {
        auto out = clients[i]->Push(local, {{"w", {g.data(), DType::kFloat32, {16}, MemoryKind::kHost}}}, true, 20000);
        if (!out.ok() || !out->token_status.ok()) {
          if (++failures == 1) first_failure = !out.ok() ? out.status().ToString() : out->token_status.ToString();
          return;
        }
        local = out->token;
      }
    });
  }
  for (auto& t : threads) t.join();
  INFO(first_failure);
  CHECK(failures == 0);
  CHECK(*clients[0]->GlobalStep() == 3);
  std::vector<float> v(16);
  REQUIRE(clients[1]->Pull("w", {v.data(), DType::kFloat32, {16}, MemoryKind::kHost}).ok());
  CHECK(v[0] == Approx(-3 * 0.01));
}

TEST_CASE("the chief role moves when the chief disconnects", "[integration]") {
  auto server = StartServer(TestConfig(1, 2, 0));
  auto w0 = ConnectWorker(server->port(), "w0");
  auto w1 = ConnectWorker(server->port(), "w1");
  CHECK(w0->is_chief());
  CHECK_FALSE(w1->GetStatus()->is_chief);
  w0.reset();  // the chief process goes away
  WaitUntil([&] { return w1->GetStatus()->is_chief; });
  CHECK(w1->is_chief());
}

TEST_CASE("workers finishing end the job and release blocked waiters", "[integration]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.exit_when_done = true;
  auto server = StartServer(cfg);
  auto w0 = ConnectWorker(server->port(), "w0");
  auto w1 = ConnectWorker(server->port(), "w1");
  float init = 0, g = 1;
  REQUIRE(w0->CreateVariable("w", Scalar(init)).ok());
  // w1 pushes and blocks on the token; w0 has finished its data and leaves. The step cannot get
  // two gradients any more, so the requirement shrinks and w1 is released with a token.
  Result<psclient::PushOutcome> out = Internal("not run");
  std::thread waiter([&] { out = w1->Push(0, {{"w", Scalar(g)}}, true, 10000); });
  WaitUntil([&] { return server->engine()->tokens().waiters() == 1; });
  REQUIRE(w0->Finish().ok());
  waiter.join();
  REQUIRE(out.ok());
  CHECK(out->token_status.ok());
  CHECK(out->token == 1);
  CHECK(*w1->WaitToken(1000) == 1);  // the step's second token
  // A wait after everyone finished ends with OutOfRange rather than hanging. (A wait blocked when
  // the job ends is released the same way: TokenQueue::Close, token_queue_test.cc. Here the last
  // worker cannot finish while its own call waits: one connection per worker.)
  CHECK_FALSE(server->workers().AllFinished());
  REQUIRE(w1->Finish().ok());
  // The finish's reply goes out before the daemon counts it; a wait parked meanwhile is released
  // by the close.
  WaitUntil([&] { return server->workers().AllFinished(); });
  CHECK(w1->WaitToken(10000).status().code() == Code::kOutOfRange);
  CHECK(server->Wait());  // --exit-when-done: the daemon's wait returns "job done"
}

TEST_CASE("a newer process under a worker's name takes its slot and closes the old connection", "[integration]") {
  // Two connections counted as one worker: the old one's close later marked the worker gone while
  // the new one trained on (or a finished worker's end hid the other's).
  auto server = StartServer(TestConfig(1, 1, 0));
  auto first = ConnectWorker(server->port(), "w");
  float init = 0, g = 1;
  REQUIRE(first->CreateVariable("w", Scalar(init)).ok());
  Status waited;
  std::thread waiter([&] { waited = first->WaitToken(10000).status(); });
  WaitUntil([&] { return server->engine()->tokens().waiters() == 1; });
  auto second = ConnectWorker(server->port(), "w");  // a newer incarnation (a restarted trainer)
  waiter.join();
  CHECK(waited.code() == Code::kUnavailable);  // its connection was closed: the new one is the worker
  CHECK(server->workers().Counts().connected == 1);
  auto out = second->Push(0, {{"w", Scalar(g)}}, true, 10000);
  REQUIRE(out.ok());
  CHECK(out->token_status.ok());
  // The older process cannot come back under the name while the newer one is connected.
  auto again = first->Push(1, {{"w", Scalar(g)}}, true, 2000);
  CHECK(again.status().code() == Code::kFailedPrecondition);
  CHECK_THAT(again.status().message(), Catch::Contains("two trainers share this name"));
}

TEST_CASE("wrong requests get clear errors over the wire", "[integration]") {
  auto server = StartServer(TestConfig(1, 1, 0));
  auto w = ConnectWorker(server->port(), "w");
  std::vector<float> init(6, 0.f);
  REQUIRE(w->CreateVariable("m", {init.data(), DType::kFloat32, {3, 2}, MemoryKind::kHost}).ok());
  auto dup = w->CreateVariable("m", {init.data(), DType::kFloat32, {2, 3}, MemoryKind::kHost});
  CHECK(dup.status().code() == Code::kAlreadyExists);
  std::vector<float> g(4, 1.f);
  auto bad = w->Push(0, {{"m", {g.data(), DType::kFloat32, {2, 2}, MemoryKind::kHost}}});
  CHECK(bad.status().code() == Code::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("Shape mismatch: expected [3,2], got [2,2]"));
  auto unknown = w->Push(0, {{"nope", {g.data(), DType::kFloat32, {2, 2}, MemoryKind::kHost}}});
  CHECK(unknown.status().code() == Code::kNotFound);
  std::vector<double> d(6);
  auto wrong_dtype = w->Pull("m", {d.data(), DType::kFloat64, {3, 2}, MemoryKind::kHost});
  CHECK(wrong_dtype.status().code() == Code::kInvalidArgument);
  auto device = w->Push(0, {{"m", {g.data(), DType::kFloat32, {3, 2}, MemoryKind::kCuda}}});
  CHECK(device.status().code() == Code::kUnimplemented);
  // The connection is still good after all of that.
  CHECK(w->GlobalStep().ok());
}

TEST_CASE("push, barrier and the next pull in one round trip", "[integration]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  auto w = ConnectWorker(server->port(), "w");
  float init = 5, g = 2;
  REQUIRE(w->CreateVariable("w", Scalar(init)).ok());
  float after = -1;
  std::vector<std::pair<std::string, TensorView>> pull{{"w", {&after, DType::kFloat32, {}, MemoryKind::kHost}}};
  auto out = w->Push(0, {{"w", Scalar(g)}}, {}, true, 1000, &pull);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  CHECK(out->pulled_step == 1);
  CHECK(after == 3.0f);
  // An unknown name in the pull is refused before anything is pushed.
  std::vector<std::pair<std::string, TensorView>> bad{{"nope", {&after, DType::kFloat32, {}, MemoryKind::kHost}}};
  auto refused = w->Push(1, {{"w", Scalar(g)}}, {}, true, 1000, &bad);
  CHECK(refused.status().code() == Code::kNotFound);
  CHECK(*w->GlobalStep() == 1);
  CHECK(PullScalar(*w, "w") == 3.0f);
  // Without a token wait the reply still carries the values (the step the push completed).
  auto no_wait = w->Push(1, {{"w", Scalar(g)}}, {}, false, 0, &pull);
  REQUIRE(no_wait.ok());
  CHECK(no_wait->pulled_step == 2);
  CHECK(after == 1.0f);
}

TEST_CASE("a lost worker that comes back after the others finished trains on", "[integration]") {
  // The lost counted as finished: with the rest done the token queue was closed for good, and the
  // returning worker was told "training is over" although the README says it counts again.
  auto cfg = TestConfig(2, 2, 0);
  cfg.worker_grace_s = 0.2;
  auto server = StartServer(cfg);
  auto a = ConnectWorker(server->port(), "a");
  auto b = ConnectWorker(server->port(), "b");
  float init = 0, g = 1;
  REQUIRE(a->CreateVariable("w", Scalar(init)).ok());
  REQUIRE(b->Finish().ok());
  a.reset();  // gone past its grace
  WaitUntil([&] { return server->workers().Counts().lost == 1; });
  auto back = ConnectWorker(server->port(), "a");
  auto out = back->Push(0, {{"w", Scalar(g)}}, true, 10000);
  REQUIRE(out.ok());
  CHECK(out->token_status.ok());  // one gradient makes the step now (b finished)
  CHECK(out->token == 1);
}

TEST_CASE("a worker that vanishes without finishing stops holding the steps after the grace period", "[integration]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.worker_grace_s = 0.2;
  auto server = StartServer(cfg);
  auto w0 = ConnectWorker(server->port(), "w0");
  auto w1 = ConnectWorker(server->port(), "w1");
  float init = 0, g = 1;
  REQUIRE(w0->CreateVariable("w", Scalar(init)).ok());
  w1.reset();  // dies without Finish: TF would wait for its gradient forever (#5022)
  // w0's gradient alone completes the step once w1 is counted as gone.
  auto out = w0->Push(0, {{"w", Scalar(g)}}, true, 10000);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  CHECK(out->token == 1);
  CHECK(server->engine()->required_replicas() == 1);
  // It comes back: the requirement is R again.
  auto back = ConnectWorker(server->port(), "w1");
  CHECK(server->engine()->required_replicas() == 2);
}

TEST_CASE("busy-poll on both sides: the same steps, and the daemon still stops", "[integration][busy_poll]") {
  auto cfg = TestConfig(2, 2);
  cfg.busy_poll = true;
  cfg.io_threads = 1;  // one spinning core is enough here
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  std::vector<std::unique_ptr<psclient::Client>> workers;
  for (const char* name : {"w0", "w1"}) {
    psclient::ClientOptions o = psd::testing::WorkerOptions(server->port(), name);
    o.busy_poll_us = 500;
    workers.push_back(psd::testing::ConnectWith(o));
  }
  float zero = 0;
  REQUIRE(workers[0]->CreateVariable("v", Scalar(zero)).ok());
  for (int64_t step = 0; step < 20; ++step) {
    // Catch's assertions are not thread-safe: the other worker's outcome is checked after the join.
    bool other_ok = false;
    std::thread other([&] {
      float g = 1.0f;
      auto out = workers[1]->Push(step, {{"v", Scalar(g)}}, /*wait_token=*/true, 5000);
      other_ok = out.ok() && out->token_status.ok();
    });
    float g = 3.0f;
    auto out = workers[0]->Push(step, {{"v", Scalar(g)}}, /*wait_token=*/true, 5000);
    other.join();
    REQUIRE(other_ok);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
  }
  int64_t step = 0;
  CHECK(PullScalar(*workers[0], "v", &step) == -40.0f);  // 20 steps of -(1 + 3) / 2
  CHECK(step == 20);
  workers.clear();
  server.reset();  // returns: the polling thread saw the stop
}

TEST_CASE("busy-poll on every core psd may use is warned about at start, and fewer threads are not",
          "[integration][busy_poll]") {
  const int cores = psd::UsableCores();
  {
    CapturedLog log;  // outlives the daemon
    auto cfg = TestConfig(1, 1);
    cfg.busy_poll = true;  // --threads left at 0: one spinning thread per core
    { auto server = StartServer(cfg); }
    CHECK(log.Has("--busy-poll with " + std::to_string(cores) + " I/O thread(s) on the " + std::to_string(cores) +
                  " core(s) psd may use"));
    CHECK(log.Has("give --threads fewer than the cores psd may use"));
  }
  if (cores < 2) return;  // no thread count below the cores to try
  CapturedLog log;
  auto cfg = TestConfig(1, 1);
  cfg.busy_poll = true;
  cfg.io_threads = cores - 1;
  { auto server = StartServer(cfg); }
  CHECK_FALSE(log.Has("--busy-poll with"));
}
