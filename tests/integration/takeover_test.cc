// Takeover (--replicas-per-shard 2 --takeover-after-ms): a 3-shard cluster in one process loses a
// shard for good; the next shard serves its part through a stand-in, from the copy it keeps. The
// trainer goes on with retries only, no committed step is lost or applied twice, and a trainer
// that connects afterwards with the original shard list finds the stand-in. In sync mode, in soft
// sync (a step deadline), where a step commits with the gradients that arrived, and in async and
// ssp, where no acknowledged push is lost (a push is acknowledged once the next shard keeps it).
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <thread>

#include "support/http_get.h"
#include "support/test_cluster.h"
#include "support/test_server.h"

using namespace psd;

namespace {

psclient::ConstTensorView View(const std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}
psclient::TensorView Out(std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}

const std::vector<std::string> kVars{"a", "b", "c", "d", "e", "f"};

// One synchronous step: a gradient of ones for every variable, then the token. Retried (with the
// global step read again) while the cluster re-forms: a step is applied once or not at all.
void Step(psclient::Client& c, int64_t* local) {
  std::vector<float> ones(8, 1.f);
  std::vector<psclient::Gradient> grads;
  for (const auto& v : kVars) grads.push_back({v, View(ones, {8})});
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    auto out = c.Push(*local, grads, /*wait_token=*/true, 5000);
    if (out.ok() && out->accepted() == static_cast<int>(kVars.size()) && out->token_status.ok()) {
      *local = out->token;
      return;
    }
    INFO((out.ok() ? out->token_status.ToString() : out.status().ToString()));
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<float> scratch(8);
    auto step = c.Pull({{kVars[0], Out(scratch, {8})}});
    if (step.ok()) *local = *step;  // a stale push was dropped: compute at the step there is
  }
}

// The values of `names` (every variable's by default) and the step they reflect (retried while
// the cluster re-forms).
int64_t PullAll(psclient::Client& c, std::vector<std::vector<float>>* values,
                const std::vector<std::string>& names = kVars) {
  values->assign(names.size(), std::vector<float>(8));
  std::vector<std::pair<std::string, psclient::TensorView>> outs;
  for (size_t i = 0; i < names.size(); ++i) outs.push_back({names[i], Out((*values)[i], {8})});
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    auto step = c.Pull(outs);
    if (step.ok()) return *step;
    INFO(step.status().ToString());
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// A 3-shard cluster of `cfg` with replicas and quick takeovers, and a worker that created kVars.
std::unique_ptr<psclient::Client> StartReplicated(server::ServerConfig cfg, psd::testing::TestCluster* cluster) {
  cfg.replicas_per_shard = 2;
  cfg.heartbeat_ms = 20;
  cfg.election_timeout_ms = 200;
  cfg.takeover_after_ms = 200;
  cfg.optimizer.learning_rate = 0.5;
  cfg.metrics_port = 0;  // each shard's own
  *cluster = psd::testing::StartTestCluster(cfg, 3);
  auto worker = psd::testing::ConnectCluster(*cluster, "w0");
  std::vector<float> zeros(8, 0.f);
  for (const auto& v : kVars) REQUIRE(worker->CreateVariable(v, View(zeros, {8})).ok());
  return worker;
}

// Shard 2 (the next one) runs the one stand-in, and every live shard lists it for shard 1.
void CheckStandInServesShard1(const psd::testing::TestCluster& cluster, const std::string& entry) {
  CHECK(cluster.shards[2]->metrics().stand_ins_started() == 1);
  CHECK(cluster.shards[2]->metrics().stand_in_running());
  CHECK(cluster.shards[0]->metrics().stand_ins_started() == 0);
  for (int k : {0, 2}) {
    auto addresses = cluster.shards[static_cast<size_t>(k)]->coordinator()->Addresses();
    REQUIRE(addresses.size() == 3);
    CHECK(addresses[1] != entry);
    CHECK(addresses[1].rfind("127.0.0.1:", 0) == 0);
  }
  // Shard 2's metrics carry the stand-in's figures beside its own, each family in one group.
  auto m = psd::testing::HttpGet(cluster.shards[2]->metrics_port(), "/metrics");
  REQUIRE(m.status == 200);
  CHECK_THAT(m.body, Catch::Contains("psd_stand_in_running{shard=\"2\"} 1"));
  CHECK_THAT(m.body, Catch::Contains("psd_ready{shard=\"1\",stand_in=\"true\"} 1"));
  CHECK_THAT(m.body, Catch::Contains("psd_global_step{shard=\"1\",stand_in=\"true\"}"));
  CHECK_THAT(m.body, Catch::Contains("psd_cluster_is_chief{shard=\"1\",stand_in=\"true\"}"));
  const size_t family = m.body.find("# TYPE psd_global_step gauge\n");
  REQUIRE(family != std::string::npos);
  CHECK(m.body.find("# TYPE psd_global_step", family + 1) == std::string::npos);
  CHECK(m.body.find("psd_global_step{shard=\"1\",stand_in=\"true\"}", family) ==
        m.body.find("\n", m.body.find("psd_global_step{shard=\"2\"}", family)) + 1);
  // And its /status.json (the status page) says which shard it stands in for, and how that goes.
  auto j = psd::testing::HttpGet(cluster.shards[2]->metrics_port(), "/status.json");
  REQUIRE(j.status == 200);
  CHECK_THAT(j.body,
             Catch::Contains("\"stand_in\":{\"shard\":1,\"ready\":true,\"state\":\"serving\",\"global_step\":"));
  auto own = psd::testing::HttpGet(cluster.shards[0]->metrics_port(), "/status.json");
  REQUIRE(own.status == 200);
  CHECK_THAT(own.body, Catch::Contains("\"stand_in\":null"));
}

// A 3-shard replicated cluster of `cfg` trains 5 steps, loses shard 1 for good, trains 5 more; every
// part must hold exactly the committed steps' updates, and a trainer that connects afterwards with
// the original shard list must find the stand-in. `cfg` has two worker slots (one comes late).
void LoseShardForGood(server::ServerConfig cfg) {
  psd::testing::TestCluster cluster;
  auto worker = StartReplicated(cfg, &cluster);
  int64_t local = 0;
  while (local < 5) Step(*worker, &local);

  // Shard 1 goes (its part: some of the variables), and does not come back.
  const std::string entry = cluster.addresses[1];
  cluster.shards[1]->Stop();
  cluster.shards[1].reset();
  while (local < 10) Step(*worker, &local);

  // Every committed step applied exactly once, on every part: -0.5 x 1 per step (SGD, the mean of
  // ones). (A push the cluster took just before it stopped serving commits a step whose token this
  // worker may not get: it reads the step again, so the steps it pushed are not counted here.)
  // Soft sync commits a step with the gradients each part had: a push cut off by the loss reached
  // some parts only, and the others stay as they were for that step (TF's per-part counts), so a
  // part there may lag the global step, never pass it, and holds at least the 5 steps before.
  std::vector<std::vector<float>> values;
  const int64_t step = PullAll(*worker, &values);
  REQUIRE(step >= 10);
  const bool soft = cfg.step_deadline_ms > 0;
  for (size_t i = 0; i < kVars.size(); ++i) {
    INFO(kVars[i]);
    for (float x : values[i]) {
      if (!soft) REQUIRE(x == -0.5f * static_cast<float>(step));
      REQUIRE(x == values[i][0]);
      REQUIRE(x >= -0.5f * static_cast<float>(step));
      REQUIRE(x <= -2.5f);
      REQUIRE(x * 2 == std::round(x * 2));  // whole steps only
    }
  }
  CheckStandInServesShard1(cluster, entry);

  // A trainer that starts now, with the --cluster list as it was, finds the stand-in.
  psclient::ClientOptions o;
  o.cluster = cluster.addresses;
  o.worker_name = "late";
  o.connect_timeout_ms = 2000;
  auto late = psclient::Client::Connect(o);
  REQUIRE(late.ok());
  // It reads what the first worker reads. (A step may still commit after the first worker
  // stopped: with two tokens per step and one worker pushing, its token wait can return a token
  // left from an earlier step before its last push's step commits. Both read again then.)
  std::vector<std::vector<float>> seen;
  int64_t seen_step = PullAll(**late, &seen);
  int64_t values_step = step;
  for (int i = 0; i < 5 && seen_step != values_step; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    values_step = PullAll(*worker, &values);
    seen_step = PullAll(**late, &seen);
  }
  REQUIRE(seen_step == values_step);
  CHECK(seen == values);
}

// Async/ssp: a worker pushes ones for every variable as fast as it can while shard 1 is stopped
// for good under it; it counts the pushes acknowledged (every part took it) and those sent. Every
// part must hold each acknowledged push (copies on arrival: an acknowledged push is on two
// shards), none twice, and at most the pushes sent: -0.5 x n with acked <= n <= sent.
void LoseShardForGoodOnArrival(server::Mode mode) {
  auto cfg = psd::testing::TestConfig(1, 2, 0);
  cfg.mode = mode;
  psd::testing::TestCluster cluster;
  auto worker = StartReplicated(cfg, &cluster);

  std::atomic<int64_t> acked{0};
  std::atomic<bool> stop{false};
  int64_t sent = 0;
  std::string failure;  // checked after the join (no assertion off the main thread)
  std::thread pusher([&] {
    std::vector<float> ones(8, 1.f), scratch(8);
    std::vector<psclient::Gradient> grads;
    for (const auto& v : kVars) grads.push_back({v, View(ones, {8})});
    int64_t local = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!stop.load()) {
      if (std::chrono::steady_clock::now() > deadline) {
        failure = "the pushes did not go on within 60 s";
        return;
      }
      ++sent;
      auto out = worker->Push(local, grads, /*wait_token=*/mode == server::Mode::kSsp, 5000);
      if (out.ok() && out->accepted() == static_cast<int>(kVars.size()) && out->token_status.ok()) {
        acked.fetch_add(1);
        if (mode == server::Mode::kSsp) local = out->token;
        continue;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto step = worker->Pull({{kVars[0], Out(scratch, {8})}});  // the new epoch, if it re-formed
      if (step.ok()) local = *step;
    }
  });
  auto wait_for = [&](int64_t n) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (acked.load() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  wait_for(30);
  // Shard 1 goes while pushes are in flight, and does not come back.
  const std::string entry = cluster.addresses[1];
  cluster.shards[1]->Stop();
  cluster.shards[1].reset();
  const int64_t before = acked.load();
  wait_for(before + 30);
  stop = true;
  pusher.join();
  REQUIRE(failure.empty());
  REQUIRE(acked.load() >= before + 30);

  std::vector<std::vector<float>> values;
  PullAll(*worker, &values);
  for (size_t i = 0; i < kVars.size(); ++i) {
    INFO(kVars[i] << ": acknowledged " << acked.load() << ", sent " << sent);
    const float x = values[i][0];
    for (float y : values[i]) REQUIRE(y == x);
    REQUIRE(x * 2 == std::round(x * 2));  // whole pushes only
    REQUIRE(-2 * x >= static_cast<float>(acked.load()));
    REQUIRE(-2 * x <= static_cast<float>(sent));
  }
  CheckStandInServesShard1(cluster, entry);
}

}  // namespace

TEST_CASE("takeover: a shard gone for good is served by a stand-in on the next shard, and nothing is lost",
          "[cluster][takeover]") {
  LoseShardForGood(psd::testing::TestConfig(1, 2, 0));
}

TEST_CASE("takeover with soft sync: steps forced by the deadline go on through the stand-in", "[cluster][takeover]") {
  // R = 2 and one worker pushing: every step commits because its deadline forces it, on every
  // shard, the stand-in included (the mean of the one gradient that arrived).
  auto cfg = psd::testing::TestConfig(2, 2, 0);
  cfg.step_deadline_ms = 50;
  LoseShardForGood(cfg);
}

TEST_CASE("takeover in async: no acknowledged push is lost with a shard gone for good", "[cluster][takeover]") {
  LoseShardForGoodOnArrival(server::Mode::kAsync);
}

TEST_CASE("takeover in ssp: no acknowledged push is lost with a shard gone for good", "[cluster][takeover]") {
  LoseShardForGoodOnArrival(server::Mode::kSsp);
}

TEST_CASE("takeover in async: an acknowledged update is kept by the stand-in", "[cluster][takeover]") {
  // Every variable assigned, then its shards lost at once: an update is acknowledged only once the
  // next shard keeps it, so the stand-in serves the assigned values.
  auto cfg = psd::testing::TestConfig(1, 2, 0);
  cfg.mode = server::Mode::kAsync;
  psd::testing::TestCluster cluster;
  auto worker = StartReplicated(cfg, &cluster);
  std::vector<float> assigned(8), zeros(8, 0.f);
  // Non-trainable twins of kVars (update changes those only), placed over the shards the same way.
  std::vector<std::string> names;
  for (const auto& v : kVars) {
    names.push_back(v + "_state");
    REQUIRE(worker->CreateVariable(names.back(), View(zeros, {8}), /*trainable=*/false).ok());
  }
  for (size_t i = 0; i < names.size(); ++i) {
    std::fill(assigned.begin(), assigned.end(), 10.f + static_cast<float>(i));
    auto applied = worker->Update(names[i], psclient::UpdateOp::kAssign, View(assigned, {8}));
    INFO(applied.status().ToString());
    REQUIRE(applied.ok());
    REQUIRE(*applied);
  }
  const std::string entry = cluster.addresses[1];
  cluster.shards[1]->Stop();
  cluster.shards[1].reset();
  std::vector<std::vector<float>> values;
  PullAll(*worker, &values, names);
  for (size_t i = 0; i < names.size(); ++i) {
    INFO(names[i]);
    for (float x : values[i]) REQUIRE(x == 10.f + static_cast<float>(i));
  }
  CheckStandInServesShard1(cluster, entry);
}

TEST_CASE("takeover in async: the global step goes on when the chief is lost", "[cluster][takeover]") {
  // Only a variable of the chief's (shard 0) is pushed: the other shards count none of those
  // pushes. Shard 0 is stopped for good; shard 1 becomes the chief, and the global step (the
  // chief's count) must go on from shard 0's, not from shard 1's own.
  auto cfg = psd::testing::TestConfig(1, 2, 0);
  cfg.mode = server::Mode::kAsync;
  psd::testing::TestCluster cluster;
  auto worker = StartReplicated(cfg, &cluster);
  std::string mine;
  for (const auto& v : kVars) {
    auto p = worker->Placement(v);
    REQUIRE(p.ok());
    if (!p->sliced && p->parts[0].shard == 0) mine = v;
  }
  REQUIRE(!mine.empty());
  std::vector<float> ones(8, 1.f);
  for (int i = 0; i < 30; ++i) REQUIRE(worker->Push(0, {{mine, View(ones, {8})}}).ok());
  auto before = worker->GlobalStep();
  REQUIRE(before.ok());
  REQUIRE(*before >= 30);
  cluster.shards[0]->Stop();
  cluster.shards[0].reset();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {  // until a push goes through the new chief
    auto out = worker->Push(0, {{mine, View(ones, {8})}});
    if (out.ok() && out->accepted() == 1) break;
    INFO((out.ok() ? std::string("not accepted") : out.status().ToString()));
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<float> scratch(8);
    (void)worker->Pull({{mine, Out(scratch, {8})}});  // the new epoch
  }
  auto after = worker->GlobalStep();
  REQUIRE(after.ok());
  CHECK(*after > *before);
  CHECK(cluster.shards[1]->coordinator()->is_chief());
}
