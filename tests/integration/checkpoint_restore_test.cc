// A daemon's whole training state survives a restart through its checkpoint directory.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "daemon/server.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

TEST_CASE("values, slots, averages and the step are restored from the newest checkpoint", "[checkpoint]") {
  char tmpl[] = "/tmp/psd-restore-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "adam";
  cfg.optimizer.learning_rate = 0.1;
  cfg.ema_decay = 0.5;
  cfg.checkpoint_dir = dir;
  cfg.checkpoint_every_steps = 2;

  std::vector<float> w_before(3), m_before(3), avg_before(3), emb_before(2 * 4);
  int64_t step_before = 0;
  {
    auto server = StartServer(cfg);
    auto c = ConnectWorker(server->port(), "w");
    std::vector<float> init{1, 2, 3};
    psclient::VariableOptions opts;
    opts.average = true;
    REQUIRE(c->CreateVariable("w", {init.data(), DType::kFloat32, {3}, MemoryKind::kHost}, opts).ok());
    REQUIRE(c->CreateVariable("emb", {nullptr, DType::kFloat32, {50, 4}, MemoryKind::kHost}).ok());
    std::vector<float> g{0.5f, -1.f, 2.f}, rows{1, 1, 1, 1};
    int64_t local = 0;
    for (int i = 0; i < 4; ++i) {
      psclient::SparseGradient sg{"emb", {7}, {rows.data(), DType::kFloat32, {1, 4}, MemoryKind::kHost}, std::nullopt};
      auto out = c->Push(local, {{"w", {g.data(), DType::kFloat32, {3}, MemoryKind::kHost}}}, {sg}, true, 2000);
      REQUIRE(out.ok());
      REQUIRE(out->token_status.ok());
      local = out->token;
    }
    // Step 4 is a checkpoint step (every 2); wait for the writer thread.
    for (int i = 0; i < 200 && c->GetStatus()->last_checkpoint_step != 4; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(c->GetStatus()->last_checkpoint_step == 4);
    step_before = *c->GlobalStep();
    REQUIRE(c->Pull("w", {w_before.data(), DType::kFloat32, {3}, MemoryKind::kHost}).ok());
    REQUIRE(c->GetSlot("w", "m", {m_before.data(), DType::kFloat32, {3}, MemoryKind::kHost}).ok());
    REQUIRE(c->PullAverages({{"w", {avg_before.data(), DType::kFloat32, {3}, MemoryKind::kHost}}}).ok());
    REQUIRE(c->PullRows("emb", {7, 8}, {emb_before.data(), DType::kFloat32, {2, 4}, MemoryKind::kHost}).ok());
    CHECK(c->RequestCheckpoint().ok());
  }  // the daemon stops (a final checkpoint would be at the same step)

  // A daemon that cannot restore them (another optimizer) fails to start and leaves the directory
  // as it was: before, its stop wrote its empty state as checkpoint step 0 and pruned older ones.
  auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> kept = listing();
  {
    auto refused = cfg;
    refused.optimizer.name = "sgd";
    auto s = server::Server::Create(refused);
    REQUIRE(s.ok());
    Status started = (*s)->Start();
    CHECK_THAT(started.message(), Catch::Contains("optimizer"));
  }
  CHECK(listing() == kept);

  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  CHECK(c->initial_global_step() == step_before);
  std::vector<float> w(3), m(3), avg(3), emb(2 * 4);
  REQUIRE(c->Pull("w", {w.data(), DType::kFloat32, {3}, MemoryKind::kHost}).ok());
  REQUIRE(c->GetSlot("w", "m", {m.data(), DType::kFloat32, {3}, MemoryKind::kHost}).ok());
  REQUIRE(c->PullAverages({{"w", {avg.data(), DType::kFloat32, {3}, MemoryKind::kHost}}}).ok());
  REQUIRE(c->PullRows("emb", {7, 8}, {emb.data(), DType::kFloat32, {2, 4}, MemoryKind::kHost}).ok());
  CHECK(w == w_before);
  CHECK(m == m_before);
  CHECK(avg == avg_before);
  CHECK(emb == emb_before);
  CHECK(emb[0] != 0);  // row 7 was trained
  // Training continues from the restored step.
  std::vector<float> g{1, 1, 1}, rows{1, 1, 1, 1};
  psclient::SparseGradient sg{"emb", {3}, {rows.data(), DType::kFloat32, {1, 4}, MemoryKind::kHost}, std::nullopt};
  auto out = c->Push(step_before, {{"w", {g.data(), DType::kFloat32, {3}, MemoryKind::kHost}}}, {sg}, true, 2000);
  REQUIRE(out.ok());
  CHECK(out->results[0].accepted);
  CHECK(out->token == step_before + 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint request without a checkpoint directory is refused", "[checkpoint]") {
  auto server = StartServer(TestConfig(1, 1, 0));
  auto c = ConnectWorker(server->port(), "w");
  CHECK(c->RequestCheckpoint().code() == Code::kFailedPrecondition);
  CHECK(c->GetStatus()->last_checkpoint_step == -1);
}

TEST_CASE("async on one daemon: --checkpoint-every-steps checkpoints while training goes on", "[checkpoint]") {
  char tmpl[] = "/tmp/psd-async-every-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = TestConfig(1, 1, 0);
  cfg.mode = server::Mode::kAsync;
  cfg.checkpoint_dir = dir;
  cfg.checkpoint_every_steps = 2;
  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  std::vector<float> init{1, 2, 3}, g{0.5f, -1.f, 2.f};
  REQUIRE(c->CreateVariable("w", {init.data(), DType::kFloat32, {3}, MemoryKind::kHost}).ok());
  for (int i = 0; i < 5; ++i) {
    REQUIRE(c->Push(i, {{"w", {g.data(), DType::kFloat32, {3}, MemoryKind::kHost}}}, false, 2000).ok());
  }
  // Pushes 2 and 4 snapshotted (one worker: nothing else moved the step meanwhile); push 5 did not.
  // The writer writes the newest snapshot queued, so step 2's may have been passed over by 4's.
  for (int i = 0; i < 500 && c->GetStatus()->last_checkpoint_step != 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(c->GetStatus()->last_checkpoint_step == 4);
  CHECK(std::filesystem::exists(dir + "/ckpt-00000000000000000004"));
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("ckpt-", 0) != 0) continue;
    INFO(name);
    CHECK((name == "ckpt-00000000000000000002" || name == "ckpt-00000000000000000004"));
  }
  std::filesystem::remove_all(dir);
}
