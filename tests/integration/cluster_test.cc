// A psd cluster in one process (3 shards on 127.0.0.1) against a single daemon: the client's
// fan-out over sliced variables — dense and sparse gradients, pulls, rows, slots — must give the
// same numbers, and placement must honour colocation.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "support/test_cluster.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

using Cluster = psd::testing::TestCluster;

Cluster StartCluster(server::ServerConfig cfg, int shards) { return psd::testing::StartTestCluster(cfg, shards); }
using psd::testing::ConnectCluster;

psclient::ConstTensorView View(const std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}
psclient::TensorView Out(std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}

std::vector<float> Ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((i * 37) % 101) / 101.f - scale / 2;
  return v;
}

struct Observed {
  std::vector<float> w, emb, b, rows, emb_rows, momentum;
  int64_t step = 0;
};

// The same three steps of training (dense, sparse across slice boundaries, whole) on `c`.
Observed Train(psclient::Client& c) {
  std::vector<float> w0 = Ramp(100 * 30, 1), e0 = Ramp(80 * 32, 0.5f), b0{1, 2, 3, 4, 5};
  REQUIRE(c.CreateVariable("w", View(w0, {100, 30})).ok());
  REQUIRE(c.CreateVariable("emb", View(e0, {80, 32})).ok());
  REQUIRE(c.CreateVariable("b", View(b0, {5})).ok());
  int64_t local = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> gw = Ramp(100 * 30, 0.1f * static_cast<float>(step + 1)), gb{0.5f, -0.5f, 1, 0, 2};
    std::vector<int64_t> idx{54, 0, 26, 27, 79, 53, 27};  // across all three slices, one repeated
    std::vector<float> gv = Ramp(idx.size() * 32, 0.3f);
    psclient::SparseGradient sg{"emb", idx, View(gv, {static_cast<int64_t>(idx.size()), 32}), Shape{80, 32}};
    auto out = c.Push(local, {{"w", View(gw, {100, 30})}, {"b", View(gb, {5})}}, {sg}, true, 5000);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    CHECK(out->accepted() == 3);
    local = out->token;
  }
  Observed o;
  o.w.resize(100 * 30);
  o.emb.resize(80 * 32);
  o.b.resize(5);
  auto step = c.Pull({{"w", Out(o.w, {100, 30})}, {"emb", Out(o.emb, {80, 32})}, {"b", Out(o.b, {5})}});
  REQUIRE(step.ok());
  o.step = *step;
  o.rows.resize(5 * 30);
  REQUIRE(c.PullRows("w", {99, 0, 33, 34, 33}, Out(o.rows, {5, 30})).ok());
  o.emb_rows.resize(3 * 32);
  REQUIRE(c.PullRows("emb", {27, 26, 79}, Out(o.emb_rows, {3, 32})).ok());
  o.momentum.resize(100 * 30);
  REQUIRE(c.GetSlot("w", "momentum", Out(o.momentum, {100, 30})).ok());
  return o;
}

void RequireNear(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  INFO(what);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).margin(1e-6));
}

// What `train` gives on one daemon of `cfg`, then on 3 shards of it with --replicas-per-shard 2
// (left running in *cluster, for its metrics).
using Training = std::function<std::vector<float>(psclient::Client&)>;
std::pair<std::vector<float>, std::vector<float>> OnOneAndReplicated(server::ServerConfig cfg, const Training& train,
                                                                     Cluster* cluster) {
  std::vector<float> single;
  {
    auto server = StartServer(cfg);
    auto c = ConnectWorker(server->port(), "w0");
    single = train(*c);
  }
  cfg.replicas_per_shard = 2;
  *cluster = StartCluster(cfg, 3);
  auto c = ConnectCluster(*cluster, "w0");
  return {std::move(single), train(*c)};
}

}  // namespace

TEST_CASE("a 3-shard cluster trains sliced variables exactly like one daemon, in every mode", "[cluster]") {
  // Async/ssp: one push = one global step; every shard holds a part of every push here, so each
  // counted 3, as the chief did.
  for (auto mode : {server::Mode::kSync, server::Mode::kAsync, server::Mode::kSsp}) {
    INFO(server::ModeName(mode));
    auto cfg = TestConfig(1, 1, 0);  // no init token: every push completes a step
    cfg.optimizer.name = "momentum";
    cfg.optimizer.learning_rate = 0.5;
    cfg.slice_bytes = 4096;
    cfg.mode = mode;
    Observed single, sharded;
    {
      auto server = StartServer(cfg);
      auto c = ConnectWorker(server->port(), "w0");
      single = Train(*c);
    }
    auto cluster = StartCluster(cfg, 3);
    auto c = ConnectCluster(cluster, "w0");
    CHECK(c->shards() == 3);
    sharded = Train(*c);
    CHECK(single.step == 3);
    CHECK(sharded.step == 3);
    RequireNear(single.w, sharded.w, "w");
    RequireNear(single.emb, sharded.emb, "emb");
    RequireNear(single.b, sharded.b, "b");
    RequireNear(single.rows, sharded.rows, "rows of w");
    RequireNear(single.emb_rows, sharded.emb_rows, "rows of emb");
    RequireNear(single.momentum, sharded.momentum, "momentum of w");

    // The placement behind it: 12000 and 10240 bytes over 4096-byte slices: three slices each.
    auto w = c->Placement("w");
    REQUIRE(w.ok());
    CHECK(w->sliced);
    REQUIRE(w->parts.size() == 3);
    CHECK(w->parts[0].row_end - w->parts[0].row_begin == 34);
    auto map = c->GetPlacementMap();
    REQUIRE(map.ok());
    REQUIRE(map->shard_bytes.size() == 3);
    CHECK(map->shard_bytes[0] + map->shard_bytes[1] + map->shard_bytes[2] == 12000 + 10240 + 20);
    auto status = c->GetStatus();
    REQUIRE(status.ok());
    CHECK(status->shards == 3);
    CHECK(status->cluster_state == "running");
    CHECK(status->missing_shards.empty());
    CHECK(status->global_step == 3);
  }
}

TEST_CASE("a sparse gradient with no rows for some slices still counts on every slice", "[cluster]") {
  // Each slice of a sliced variable counts its own gradients towards a step, as TensorFlow's
  // partitioned variables: a slice a worker's rows miss gets an empty gradient from it. Before, it
  // got none, and a sync step waited for it until the token timeout.
  auto cfg = TestConfig(1, 1, 0);
  cfg.slice_bytes = 4096;  // emb's 10240 bytes: three slices
  auto cluster = StartCluster(cfg, 3);
  auto c = ConnectCluster(cluster, "w0");
  std::vector<float> e0 = Ramp(80 * 32, 0.5f);
  REQUIRE(c->CreateVariable("emb", View(e0, {80, 32})).ok());
  auto emb = c->Placement("emb");
  REQUIRE(emb.ok());
  REQUIRE(emb->parts.size() == 3);
  int64_t local = 0;
  for (int64_t row : {int64_t{1}, int64_t{79}}) {  // in the first slice only, then in the last only
    std::vector<float> g(32, 1.0f);
    psclient::SparseGradient sg{"emb", {row}, View(g, {1, 32}), Shape{80, 32}};
    auto out = c->Push(local, {}, {sg}, true, 10000);
    REQUIRE(out.ok());
    INFO(out->token_status.ToString());
    REQUIRE(out->token_status.ok());
    local = out->token;
  }
  std::vector<float> after(80 * 32);
  auto step = c->Pull({{"emb", Out(after, {80, 32})}});
  REQUIRE(step.ok());
  CHECK(*step == 2);
  for (size_t row = 0; row < 80; ++row) {
    const bool touched = row == 1 || row == 79;
    CHECK((after[row * 32] != e0[row * 32]) == touched);
  }
}

TEST_CASE("sparse steps on a replicated cluster reach the next shard as differences, rebuilt there in place",
          "[cluster][replicas]") {
  // An embedding of 4096 rows of 16 floats sliced over 3 shards (85 KiB each), 4 rows a step: each
  // shard's copy goes to the next one as the difference from the one before (a few hundred bytes),
  // and from the fifth step on the next shard replays the differences over the storage of the copy
  // it let go, no copy of the base. Every copy rebuilt is checked against its owner's checksum;
  // the training matches one daemon's.
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = 4096 * 16 * 4 / 3 + 64;
  constexpr int kSteps = 20;
  auto train = [&](psclient::Client& c) {
    std::vector<float> table = Ramp(4096 * 16, 1);
    REQUIRE(c.CreateVariable("emb", View(table, {4096, 16})).ok());
    int64_t local = 0;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<int64_t> rows{step, 1000 + 7 * step, 2100 + step, 4095 - step};  // on every shard
      std::vector<float> g = Ramp(rows.size() * 16, 0.1f * static_cast<float>(step + 1));
      psclient::SparseGradient sg{"emb", rows, View(g, {4, 16}), Shape{4096, 16}};
      auto out = c.Push(local, {}, {sg}, true, 10000);
      REQUIRE(out.ok());
      REQUIRE(out->token_status.ok());
      local = out->token;
    }
    std::vector<float> got(4096 * 16);
    REQUIRE(c.Pull({{"emb", Out(got, {4096, 16})}}).ok());
    return got;
  };
  Cluster cluster;
  auto [single, replicated] = OnOneAndReplicated(cfg, train, &cluster);
  RequireNear(single, replicated, "emb");
  for (size_t k = 0; k < 3; ++k) {
    INFO("shard " << k);
    const auto& m = cluster.shards[k]->metrics();
    // The first copy of the epoch goes whole (85 KiB); the rest are differences of a few rows.
    CHECK(m.replica_received() < 85 * 1024 + kSteps * 8 * 1024);
    // Steps 2-4 are rebuilt from a copy of their base (no copy let go yet); from step 5 on, in
    // place over the storage of the copy of three steps before, replaying three differences (15
    // and 12 of 16 here; a copy sent again whole when an acknowledgement is late — a slow
    // sanitizer run — starts the chain over, so the bounds leave room for that).
    CHECK(m.replica_from_base() + m.replica_replayed() >= kSteps / 2);
    CHECK(m.replica_replayed() >= 1);
    // Every 16th own copy's checksum, made from the engine's lists of changes, is checked against
    // a hash of every block: the lists missed no write.
    CHECK(m.replica_audits() >= 1);
    CHECK(m.replica_unlisted() == 0);
  }
}

TEST_CASE("dense steps on a replicated cluster: each big copy is put together in the storage of one let go",
          "[cluster][replicas]") {
  // A 52.8 MB variable over 3 shards: each part (17.6 MB) changes whole every step and goes to the
  // next shard whole. A copy of 16 MiB or more arrives into the storage of the one the next shard
  // let go (ServerShardHost::CopyStorage), not into fresh pages: two copies held and that storage
  // between steps (psd_replica_held_bytes, which counts it). Training matches one daemon's, bit for bit.
  constexpr int64_t kRows = 13200, kCols = 1000;
  constexpr int kSteps = 6;
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = kRows * kCols * 4 / 3 + 64;
  auto train = [&](psclient::Client& c) {
    std::vector<float> w = Ramp(kRows * kCols, 1);
    REQUIRE(c.CreateVariable("w", View(w, {kRows, kCols})).ok());
    int64_t local = 0;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<float> g = Ramp(kRows * kCols, 0.1f * static_cast<float>(step + 1));
      auto out = c.Push(local, {{"w", View(g, {kRows, kCols})}}, {}, true, 30000);
      REQUIRE(out.ok());
      REQUIRE(out->token_status.ok());
      local = out->token;
    }
    REQUIRE(c.Pull({{"w", Out(w, {kRows, kCols})}}).ok());
    return w;
  };
  Cluster cluster;
  auto [single, replicated] = OnOneAndReplicated(cfg, train, &cluster);
  CHECK(replicated == single);
  constexpr uint64_t kPart = kRows * kCols * 4 / 3;
  for (size_t k = 0; k < 3; ++k) {
    INFO("shard " << k);
    const auto& m = cluster.shards[k]->metrics();
    CHECK(m.replica_received() >= kSteps * kPart);  // whole copies
    // Counted at each heartbeat: two copies held and the storage of the third.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (m.replica_held() < kPart * 5 / 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    CHECK(m.replica_held() >= kPart * 5 / 2);
    CHECK(m.replica_held() < kPart * 7 / 2);
  }
}

TEST_CASE("a cluster whose shards are IPv6 addresses ([::1]:port) forms and trains", "[cluster]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "momentum";
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = 4096;
  auto cluster = psd::testing::StartTestCluster(cfg, 2, "::1");
  REQUIRE(cluster.addresses[0].rfind("[::1]:", 0) == 0);
  auto c = ConnectCluster(cluster, "w0");  // served only once the shards' links formed the cluster
  CHECK(c->shards() == 2);
  Observed o = Train(*c);
  CHECK(o.step == 3);
}

TEST_CASE("colocate_with is honoured across 3 shards", "[cluster]") {
  auto cfg = TestConfig(1);
  cfg.slice_bytes = 4096;
  auto cluster = StartCluster(cfg, 3);
  auto c = ConnectCluster(cluster, "w0");
  std::vector<float> zeros(64 * 32);
  REQUIRE(c->CreateVariable("table", View(zeros, {64, 32})).ok());  // 8192 bytes: sliced
  for (const char* name : {"x", "y", "z"}) REQUIRE(c->CreateVariable(name, View(zeros, {4})).ok());
  psclient::VariableOptions with_table;
  with_table.colocate_with = "table";
  REQUIRE(c->CreateVariable("table_acc", View(zeros, {64, 32}), with_table).ok());
  psclient::VariableOptions with_z;
  with_z.colocate_with = "z";
  REQUIRE(c->CreateVariable("z_bias", View(zeros, {1}), with_z).ok());
  auto table = c->Placement("table"), acc = c->Placement("table_acc");
  auto z = c->Placement("z"), bias = c->Placement("z_bias");
  REQUIRE((table.ok() && acc.ok() && z.ok() && bias.ok()));
  REQUIRE(table->parts.size() == acc->parts.size());
  for (size_t i = 0; i < table->parts.size(); ++i) {
    CHECK(acc->parts[i].shard == table->parts[i].shard);
    CHECK(acc->parts[i].row_begin == table->parts[i].row_begin);
  }
  CHECK(bias->parts[0].shard == z->parts[0].shard);
  {
    auto scope = c->ColocateVarsWith("x");  // colocate_vars_with(x): a scope for the creations inside it
    REQUIRE(c->CreateVariable("x_m", View(zeros, {4})).ok());
    REQUIRE(c->CreateVariable("x_v", View(zeros, {4})).ok());
  }
  REQUIRE(c->CreateVariable("after", View(zeros, {64 * 32})).ok());  // 8192 bytes: sliced again, no scope
  auto x = c->Placement("x"), xm = c->Placement("x_m"), xv = c->Placement("x_v"), after = c->Placement("after");
  REQUIRE((x.ok() && xm.ok() && xv.ok() && after.ok()));
  CHECK(xm->parts[0].shard == x->parts[0].shard);
  CHECK(xv->parts[0].shard == x->parts[0].shard);
  CHECK(after->sliced);
  psclient::VariableOptions missing;
  missing.colocate_with = "nope";
  CHECK(c->CreateVariable("orphan", View(zeros, {1}), missing).status().code() == Code::kNotFound);
  // Another definition under an existing name is refused by the placement, before any shard.
  CHECK(c->CreateVariable("x", View(zeros, {5})).status().code() == Code::kAlreadyExists);
}

// --- every consistency mode on a cluster ---------------------------------------------------------

namespace {

// A small variable (4 floats) of `c` placed on a shard other than the chief; "" if none is.
std::string OffChief(psclient::Client& c, int count) {
  std::vector<float> zeros(4, 1.f);
  std::string found;
  for (int i = 0; i < count; ++i) {
    std::string name = "small" + std::to_string(i);
    REQUIRE(c.CreateVariable(name, View(zeros, {4})).ok());
    auto p = c.Placement(name);
    REQUIRE(p.ok());
    if (found.empty() && p->parts[0].shard != c.chief_shard()) found = name;
  }
  return found;
}

}  // namespace

TEST_CASE("async on a cluster: a push with no part on the chief still counts one global step there", "[cluster]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.mode = server::Mode::kAsync;
  cfg.optimizer.learning_rate = 0.5;
  auto cluster = StartCluster(cfg, 3);
  auto c = ConnectCluster(cluster, "w0");
  std::string name = OffChief(*c, 6);
  REQUIRE(!name.empty());
  std::vector<float> g{1, 2, 3, 4};
  int64_t local = 0;
  for (int i = 0; i < 4; ++i) {
    auto out = c->Push(local, {{name, View(g, {4})}}, true, 5000);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    CHECK(out->token == i + 1);  // the chief's count, after this push
    local = out->token;
  }
  auto step = c->GlobalStep();
  REQUIRE(step.ok());
  CHECK(*step == 4);
  std::vector<float> v(4);
  auto pulled = c->Pull(name, Out(v, {4}));
  REQUIRE(pulled.ok());
  CHECK(*pulled == 4);  // the variable's shard counted the same 4 pushes
  for (int i = 0; i < 4; ++i) CHECK(v[static_cast<size_t>(i)] == Approx(1.f - 4 * 0.5f * g[static_cast<size_t>(i)]));
}

TEST_CASE("ssp on a cluster: the chief's gate holds a worker more than the bound ahead", "[cluster]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.mode = server::Mode::kSsp;
  cfg.staleness_bound = 1;
  auto cluster = StartCluster(cfg, 3);
  auto fast = ConnectCluster(cluster, "fast");
  auto slow = ConnectCluster(cluster, "slow");
  std::string name = OffChief(*fast, 6);  // the fast worker's pushes reach the chief with no gradient
  REQUIRE(!name.empty());
  std::vector<float> g{1, 1, 1, 1};
  auto push = [&](psclient::Client& c, int64_t timeout_ms) {
    auto out = c.Push(0, {{name, View(g, {4})}}, true, timeout_ms);
    REQUIRE(out.ok());
    return out->token_status;
  };
  CHECK(push(*fast, 5000).ok());                              // clock 1, the slowest at 0
  CHECK(push(*fast, 300).code() == Code::kDeadlineExceeded);  // clock 2: two ahead of "slow"
  CHECK(push(*slow, 5000).ok());                              // "slow" at 1: "fast" is within the bound
  CHECK(push(*fast, 5000).ok());
}

TEST_CASE("soft sync on a cluster: a step deadline on one shard forces the step on every shard", "[cluster]") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.step_deadline_ms = 200;
  cfg.optimizer.learning_rate = 0.5;
  auto cluster = StartCluster(cfg, 3);
  auto c = ConnectCluster(cluster, "w0");
  auto idle = ConnectCluster(cluster, "w1");  // connected, never pushes: no step gets 2 gradients
  std::string name = OffChief(*c, 6);
  REQUIRE(!name.empty());
  // Only `name`'s shard sees a gradient: the other shards' parts commit only because the chief
  // orders the step forced there when that shard's deadline passes.
  std::vector<float> g{1, 2, 3, 4};
  auto out = c->Push(0, {{name, View(g, {4})}}, true, 10000);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  CHECK(out->token == 1);
  std::vector<float> v(4), other(4);
  auto pulled = c->Pull({{name, Out(v, {4})}, {"small0", Out(other, {4})}});
  REQUIRE(pulled.ok());
  CHECK(*pulled == 1);
  for (int i = 0; i < 4; ++i) CHECK(v[static_cast<size_t>(i)] == Approx(1.f - 0.5f * g[static_cast<size_t>(i)]));
  if (name != "small0") CHECK(other == std::vector<float>(4, 1.f));  // nobody pushed it: it stays
  for (int k = 0; k < 3; ++k) {
    auto st = c->GetShardStatus(k);
    REQUIRE(st.ok());
    CHECK(st->global_step == 1);
  }
}

namespace {

// The checkpoint tests' cluster: momentum, a [100, 30] variable in three slices, a checkpoint
// every 2 steps into `dir` (each shard its own subdirectory).
server::ServerConfig CheckpointingConfig(const std::string& dir, server::Mode mode) {
  auto cfg = TestConfig(1, 1, 0);
  cfg.mode = mode;
  cfg.optimizer.name = "momentum";
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = 4096;
  cfg.checkpoint_dir = dir;
  cfg.checkpoint_every_steps = 2;
  return cfg;
}

// Creates the checkpoint tests' variable and trains it 4 steps; `w`, `momentum`: then.
void TrainFourSteps(psclient::Client& c, std::vector<float>* w, std::vector<float>* momentum) {
  std::vector<float> w0 = Ramp(100 * 30, 1);
  REQUIRE(c.CreateVariable("w", View(w0, {100, 30})).ok());  // three slices, one per shard
  int64_t local = 0;
  for (int i = 0; i < 4; ++i) {
    std::vector<float> g = Ramp(100 * 30, 0.1f * static_cast<float>(i + 1));
    auto out = c.Push(local, {{"w", View(g, {100, 30})}}, true, 5000);
    REQUIRE(out.ok());
    local = out->token;
  }
  REQUIRE(c.Pull("w", Out(*w, {100, 30})).ok());
  REQUIRE(c.GetSlot("w", "momentum", Out(*momentum, {100, 30})).ok());
}

// True once every one of `shards` reports checkpoint `step` sealed (within 10 s).
bool SealedEverywhere(psclient::Client& c, int shards, int64_t step) {
  for (int i = 0; i < 200; ++i) {
    bool sealed = true;
    for (int k = 0; k < shards; ++k) {
      auto st = c.GetShardStatus(k);
      sealed = sealed && st.ok() && st->last_checkpoint_step == step;
    }
    if (sealed) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace

TEST_CASE("async on a cluster: checkpoints are ordered by the chief and restored on every shard", "[cluster]") {
  char tmpl[] = "/tmp/psd-async-cluster-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = CheckpointingConfig(dir, server::Mode::kAsync);
  std::vector<float> w(100 * 30), momentum(100 * 30);
  {
    auto cluster = StartCluster(cfg, 3);
    auto c = ConnectCluster(cluster, "w0");
    TrainFourSteps(*c, &w, &momentum);
    // The count stays at 4 now: the chief orders checkpoint 4 (every 2 steps) and every shard
    // seals it.
    REQUIRE(SealedEverywhere(*c, 3, 4));
  }
  auto cluster = StartCluster(cfg, 3);  // the same checkpoint directories, new ports
  auto c = ConnectCluster(cluster, "w0");
  auto step = c->GlobalStep();
  REQUIRE(step.ok());
  CHECK(*step == 4);
  std::vector<float> w_after(100 * 30), m_after(100 * 30);
  auto pulled = c->Pull("w", Out(w_after, {100, 30}));
  REQUIRE(pulled.ok());
  CHECK(*pulled == 4);
  REQUIRE(c->GetSlot("w", "momentum", Out(m_after, {100, 30})).ok());
  CHECK(w_after == w);
  CHECK(m_after == momentum);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a shard that missed the newest seal gets it with the restore order: no rollback, no wait",
          "[cluster][checkpoint]") {
  char tmpl[] = "/tmp/psd-reseal-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = CheckpointingConfig(dir, server::Mode::kSync);
  std::vector<float> w(100 * 30), momentum(100 * 30);
  {
    auto cluster = StartCluster(cfg, 3);
    auto c = ConnectCluster(cluster, "w0");
    TrainFourSteps(*c, &w, &momentum);
    REQUIRE(SealedEverywhere(*c, 3, 4));  // checkpoint 4 (every 2 steps)
  }
  // Shard 1 holds its part of step 4 but not the manifest: as if it had been restarted between
  // writing its part and the chief's seal. Before, the cluster waited three election timeouts for
  // it and then rolled back to checkpoint 2.
  const std::string manifest = dir + "/shard1/ckpt-00000000000000000004/MANIFEST";
  REQUIRE(std::filesystem::exists(manifest));
  std::filesystem::remove(manifest);
  auto started = std::chrono::steady_clock::now();
  auto cluster = StartCluster(cfg, 3);  // the same checkpoint directories, new ports
  auto c = ConnectCluster(cluster, "w0");
  const double formed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  auto step = c->GlobalStep();
  REQUIRE(step.ok());
  CHECK(*step == 4);
  std::vector<float> w_after(100 * 30), m_after(100 * 30);
  REQUIRE(c->Pull("w", Out(w_after, {100, 30})).ok());
  REQUIRE(c->GetSlot("w", "momentum", Out(m_after, {100, 30})).ok());
  CHECK(w_after == w);
  CHECK(m_after == momentum);
  CHECK(std::filesystem::exists(manifest));  // written from the restore order
  // Reported, not asserted (timings are the bench's): no longer the three-election-timeout wait.
  std::printf("reseal: the cluster served checkpoint 4 %.2f s after its shards started\n", formed_s);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a sliced variable's initial value travels in chunks to each of its shards", "[cluster][chunks]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.slice_bytes = 64 << 10;
  auto cluster = StartCluster(cfg, 3);
  psclient::ClientOptions o;
  o.cluster = cluster.addresses;
  o.worker_name = "w0";
  o.connect_timeout_ms = 20000;
  o.push_frame_bytes = 4096;  // 4 KiB chunks: a 64 KiB slice in 16 frames
  auto c = psd::testing::ConnectWith(o);
  std::vector<float> w0 = Ramp(100 * 300, 1);  // 120 KB: two slices
  auto created = c->CreateVariable("w", View(w0, {100, 300}));
  REQUIRE(created.ok());
  CHECK(created->created);
  auto p = c->Placement("w");
  REQUIRE(p.ok());
  CHECK(p->parts.size() == 2);
  std::vector<float> got(100 * 300);
  REQUIRE(c->Pull("w", Out(got, {100, 300})).ok());
  CHECK(got == w0);
}

TEST_CASE("a client given fewer shards than the cluster has refuses a placement it cannot follow", "[cluster]") {
  // An observer skips the shard-count check; the chief's map then named a shard it had no
  // connection for, and the pull indexed past its connections (a crash).
  auto cfg = TestConfig(1, 1, 0);
  cfg.slice_bytes = 4096;
  auto cluster = StartCluster(cfg, 3);
  auto worker = ConnectCluster(cluster, "w0");
  std::vector<float> w(3072, 1.0f);
  REQUIRE(worker->CreateVariable("w", {w.data(), DType::kFloat32, {3072}, MemoryKind::kHost}).ok());
  auto placed = worker->Placement("w");
  REQUIRE(placed.ok());
  REQUIRE(placed->parts.size() == 3);
  psclient::ClientOptions o;
  o.cluster = {cluster.addresses[0], cluster.addresses[1]};
  o.worker_name = "watcher";
  o.observer = true;
  o.connect_timeout_ms = 20000;
  auto observer = psd::testing::ConnectWith(o);
  std::vector<float> out(3072);
  Status s = observer->Pull("w", {out.data(), DType::kFloat32, {3072}, MemoryKind::kHost}).status();
  CHECK(s.code() == Code::kInternal);
  CHECK_THAT(s.message(), Catch::Contains("names shard 2 of a cluster of 2"));
  // The cluster's own worker is unaffected.
  REQUIRE(worker->Pull("w", {out.data(), DType::kFloat32, {3072}, MemoryKind::kHost}).ok());
  CHECK(out[3071] == 1.0f);
}
