// A psd cluster in one process (3 shards on 127.0.0.1) against a single daemon: the client's
// fan-out over sliced variables — dense and sparse gradients, pulls, rows, slots — must give the
// same numbers, and placement must honour colocation.
#include <unistd.h>

#include <catch2/catch.hpp>
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

}  // namespace

TEST_CASE("a 3-shard cluster trains sliced variables exactly like one daemon", "[cluster]") {
  auto cfg = TestConfig(1, 1, 0);  // no init token: every push completes a step
  cfg.optimizer.name = "momentum";
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = 4096;
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
