// The TF-style wrapper: TF's argument errors, the hook, init tokens and real training.
#include "psclient/sync_replicas_optimizer.h"

#include <catch2/catch.hpp>
#include <thread>

#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

// Quadratic loss 0.5 * ||w - target||^2: gradient w - target.
psclient::GradientFn Quadratic(float target) {
  return [target](const std::vector<psclient::Variable*>& vars, std::vector<std::optional<psclient::Tensor>>* grads,
                  double* loss) {
    psclient::Tensor g(DType::kFloat32, vars[0]->value().shape());
    const float* w = vars[0]->value().data<float>();
    *loss = 0;
    for (int64_t i = 0; i < g.num_elements(); ++i) {
      g.data<float>()[i] = w[i] - target;
      *loss += 0.5 * (w[i] - target) * (w[i] - target);
    }
    (*grads)[0] = std::move(g);
    return Status::Ok();
  };
}

}  // namespace

TEST_CASE("TF's errors from apply_gradients, the hook and get_init_tokens", "[wrapper]") {
  auto server = StartServer(TestConfig(2, 3, 0));
  auto c = ConnectWorker(server->port(), "w0");
  psclient::SyncReplicasOptimizer opt(*c, 2, 3);
  REQUIRE(opt.status().ok());

  auto hook = opt.make_session_run_hook(true);
  CHECK(hook.begin().message() == "SyncReplicasOptimizer.apply_gradient should be called before using the hook.");
  CHECK(opt.get_init_tokens().status().message() == "get_init_tokens_op() should be called after apply_gradients().");

  psclient::GlobalStep gs;
  CHECK(opt.apply_gradients({}, &gs).status().message() == "Must supply at least one variable");
  psclient::Variable v("v", DType::kFloat32, {2});
  REQUIRE(v.Create(*c).ok());
  std::vector<psclient::GradAndVar> gv(1);
  gv[0].var = &v;
  gv[0].grad = psclient::Tensor(DType::kFloat32, {2});
  CHECK(opt.apply_gradients(gv, nullptr).status().message() == "Global step is required to check staleness");
  std::vector<psclient::GradAndVar> unknown(1);
  unknown[0].grad = psclient::Tensor(DType::kFloat32, {2});
  CHECK(opt.apply_gradients(unknown, &gs).status().message() == "Unknown grad type!");

  auto grads = opt.compute_gradients(Quadratic(1.f), {&v});
  REQUIRE(grads.ok());
  CHECK(hook.begin().ok());
  CHECK(*opt.get_init_tokens() == 2);  // -1 -> replicas_to_aggregate
  CHECK(*opt.get_init_tokens(0) == 0);
  CHECK(opt.get_slot_names().empty());  // sgd has no slots
  auto slot = opt.get_slot(v, "momentum");
  REQUIRE(slot.ok());
  CHECK_FALSE(slot->has_value());
  // The chief's hook checks num_tokens against what the daemon queued (--init-tokens 0 here).
  CHECK(opt.make_session_run_hook(true, 2).after_create_session(1000).code() == Code::kFailedPrecondition);
  CHECK(opt.make_session_run_hook(true, 0).after_create_session(1000).ok());
}

TEST_CASE("too few init tokens is TF's error", "[wrapper]") {
  auto server = StartServer(TestConfig(4, 2, 2));
  auto c = ConnectWorker(server->port(), "w0");
  psclient::SyncReplicasOptimizer opt(*c, 4, 2);
  REQUIRE(opt.status().ok());
  psclient::Variable v("v", DType::kFloat32, {1});
  REQUIRE(v.Create(*c).ok());
  REQUIRE(opt.compute_gradients(Quadratic(0.f), {&v}).ok());
  CHECK(opt.get_init_tokens(1).status().message() ==
        "Too few tokens to finish the first step: 1 (given) vs 2 (needed)");
  CHECK(*opt.get_init_tokens(2) == 2);
}

TEST_CASE("a trainer asking for other replica counts than the daemon's is told so", "[wrapper]") {
  auto server = StartServer(TestConfig(2, 2));
  auto c = ConnectWorker(server->port(), "w0");
  psclient::SyncReplicasOptimizer opt(*c, 3);
  CHECK(opt.status().code() == Code::kFailedPrecondition);
  CHECK_THAT(opt.status().message(), Catch::Contains("--replicas-to-aggregate"));
  psclient::SyncReplicasOptimizer defaults(*c);
  CHECK(defaults.status().ok());
}

TEST_CASE("two trainers minimize a quadratic through psd", "[wrapper]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.optimizer.learning_rate = 0.5;
  auto server = StartServer(cfg);
  auto c0 = ConnectWorker(server->port(), "w0");
  auto c1 = ConnectWorker(server->port(), "w1");
  REQUIRE(c0->is_chief());
  psclient::Variable init("w", DType::kFloat32, {4});
  REQUIRE(init.Create(*c0).ok());  // the chief initializes (zeros)

  Status results[2];
  double losses[2] = {0, 0};
  int64_t steps[2] = {0, 0};
  auto train = [&](psclient::Client& c, int i) {
    psclient::Variable w("w", DType::kFloat32, {4});
    psclient::SyncReplicasOptimizer opt(c, 2, 2);
    psclient::GlobalStep gs;
    auto first = opt.compute_gradients(Quadratic(3.f), {&w});
    if (!first.ok()) {
      results[i] = first.status();
      return;
    }
    auto hook = opt.make_session_run_hook(c.is_chief(), 0);
    Status s = hook.begin();
    if (s.ok()) s = hook.after_create_session(5000);
    auto step = s.ok() ? opt.apply_gradients(*first, &gs) : Result<int64_t>(s);
    while (step.ok() && gs.value < 30) step = opt.minimize(Quadratic(3.f), &gs, {&w});
    results[i] = step.ok() ? Status::Ok() : step.status();
    losses[i] = opt.last_loss();
    steps[i] = gs.value;
  };
  std::thread t0([&] { train(*c0, 0); });
  std::thread t1([&] { train(*c1, 1); });
  t0.join();
  t1.join();
  INFO(results[0].ToString() << " / " << results[1].ToString());
  REQUIRE(results[0].ok());
  REQUIRE(results[1].ok());
  CHECK(steps[0] >= 30);
  std::vector<float> w(4);
  REQUIRE(c0->Pull("w", {w.data(), DType::kFloat32, {4}, MemoryKind::kHost}).ok());
  // Each step halves the distance to 3 (lr 0.5, identical gradients): after 30 steps it is ~0.
  CHECK(w[0] == Approx(3.0).margin(1e-4));
  CHECK(losses[0] < 1e-6);
}

TEST_CASE("a daemon back from nothing: the chief re-creates the variables, the others wait for them", "[wrapper]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.optimizer.learning_rate = 0.5;
  auto server = StartServer(cfg);
  const uint16_t port = server->port();
  auto c0 = ConnectWorker(port, "w0");
  auto c1 = ConnectWorker(port, "w1");
  REQUIRE(c0->is_chief());
  psclient::Variable w0("w", DType::kFloat32, {4}), w1("w", DType::kFloat32, {4});
  REQUIRE(w0.Create(*c0).ok());  // zeros: loss 0.5 * 4 * 3^2 = 18
  psclient::SyncReplicasOptimizer opt0(*c0, 2, 2), opt1(*c1, 2, 2);
  psclient::GlobalStep gs0, gs1;
  // Trains both until the global step reaches `until`; retries what a restart answers.
  auto train = [](psclient::SyncReplicasOptimizer& opt, psclient::Variable& w, psclient::GlobalStep& gs,
                  int64_t until) {
    Status s;
    for (int tries = 0; gs.value < until && tries < 200; ++tries) {
      auto step = opt.minimize(Quadratic(3.f), &gs, {&w});
      s = step.ok() ? Status::Ok() : step.status();
      if (!s.ok() && s.code() != Code::kUnavailable && s.code() != Code::kAborted) return s;
    }
    return gs.value >= until ? Status::Ok() : s;
  };
  Status r0, r1;
  {
    REQUIRE(opt0.compute_gradients(Quadratic(3.f), {&w0}).ok());
    REQUIRE(opt1.compute_gradients(Quadratic(3.f), {&w1}).ok());
    REQUIRE(opt0.make_session_run_hook(true, 0).after_create_session(5000).ok());
    REQUIRE(opt1.make_session_run_hook(false, 0).after_create_session(5000).ok());
    std::thread t0([&] { r0 = train(opt0, w0, gs0, 6); });
    std::thread t1([&] { r1 = train(opt1, w1, gs1, 6); });
    t0.join();
    t1.join();
    INFO(r0.ToString() << " / " << r1.ToString());
    REQUIRE(r0.ok());
    REQUIRE(r1.ok());
  }
  const float trained = w0.value().data<float>()[0];
  CHECK(trained > 2.9f);  // the distance to 3 halves every step

  // psd restarts on the same port without its state.
  server->Stop();
  server.reset();
  cfg.port = port;
  server = StartServer(cfg);
  // The chief says hello first (the first hello is the chief); the other, alone, waits for the
  // variables and gives up at its deadline with what it waited for.
  for (int tries = 0; tries < 100 && !c0->GlobalStep().ok(); ++tries) {
  }
  REQUIRE(c0->is_chief());
  opt1.set_variables_timeout_ms(200);
  for (int tries = 0; tries < 100; ++tries) {
    auto step = opt1.minimize(Quadratic(3.f), &gs1, {&w1});
    r1 = step.ok() ? Status::Ok() : step.status();
    if (r1.code() != Code::kUnavailable && r1.code() != Code::kAborted) break;
  }
  CHECK(r1.code() == Code::kNotFound);
  CHECK_THAT(r1.message(), Catch::Contains("the chief worker did not re-create them within 200 ms"));
  CHECK(opt1.recreated_total() == 0);
  // Now both: the chief brings the variables back from its latest values, training goes on (the
  // global step starts again at 0).
  opt1.set_variables_timeout_ms(10000);
  gs0.value = gs1.value = 0;
  std::thread t0([&] { r0 = train(opt0, w0, gs0, 4); });
  std::thread t1([&] { r1 = train(opt1, w1, gs1, 4); });
  t0.join();
  t1.join();
  INFO(r0.ToString() << " / " << r1.ToString());
  REQUIRE(r0.ok());
  REQUIRE(r1.ok());
  CHECK(opt0.recreated_total() == 1);
  CHECK(opt1.recreated_total() == 0);
  // The loss goes on from the trained values (18 for the zeros psd would otherwise hold).
  CHECK(opt0.last_loss() < 0.5 * 4 * (3 - trained) * (3 - trained) + 1e-6);
  std::vector<float> w(4);
  REQUIRE(c0->Pull("w", {w.data(), DType::kFloat32, {4}, MemoryKind::kHost}).ok());
  CHECK(w[0] > trained);
}
