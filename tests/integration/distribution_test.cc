// Distribution-aware primitives (seed 003, TF StrategyExtended) through libpsclient: reduce_to and
// batch_reduce_to, broadcast_to, update ops, aggregated and sync-on-read variables, role queries —
// with several replicas (one client each, on threads), on one daemon and on a 3-shard cluster.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <thread>

#include "support/test_cluster.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

psclient::ConstTensorView View(const std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}
psclient::TensorView Out(std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}

// One daemon, or a 3-shard cluster, with clients for `replicas` workers (connected in order, so
// client i has replica id i).
struct Job {
  std::vector<std::unique_ptr<server::Server>> servers;
  std::vector<std::string> cluster;
  std::vector<std::unique_ptr<psclient::Client>> replicas;
};

Job StartJob(server::ServerConfig cfg, int shards, int replicas) {
  Job job;
  if (shards == 1) {
    job.servers.push_back(StartServer(cfg));
  } else {
    auto cluster = psd::testing::StartTestCluster(cfg, shards);
    job.servers = std::move(cluster.shards);
    job.cluster = std::move(cluster.addresses);
  }
  for (int r = 0; r < replicas; ++r) {
    if (shards == 1) {
      job.replicas.push_back(ConnectWorker(job.servers[0]->port(), "replica-" + std::to_string(r)));
    } else {
      psclient::ClientOptions o;
      o.cluster = job.cluster;
      o.worker_name = "replica-" + std::to_string(r);
      auto c = psclient::Client::Connect(o);
      INFO(c.status().ToString());
      REQUIRE(c.ok());
      job.replicas.push_back(std::move(*c));
    }
  }
  return job;
}

// Runs fn(replica index) on one thread per replica; returns what each returned.
template <typename Fn>
auto OnEveryReplica(int n, Fn fn) {
  using R = decltype(fn(0));
  std::vector<std::optional<R>> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { out[static_cast<size_t>(i)] = fn(i); });
  for (auto& t : threads) t.join();
  std::vector<R> got;
  for (auto& o : out) got.push_back(std::move(*o));
  return got;
}

psclient::VariableOptions NonTrainable(psclient::Aggregation agg = psclient::Aggregation::kNone,
                                       bool sync_on_read = false) {
  psclient::VariableOptions o;
  o.trainable = false;
  o.aggregation = agg;
  o.sync_on_read = sync_on_read;
  return o;
}

}  // namespace

TEST_CASE("reduce_to: the seed's merge_call example, sum of 3 + replica_id", "[distribution]") {
  for (int shards : {1, 3}) {
    INFO("shards " << shards);
    Job job = StartJob(TestConfig(3), shards, 3);
    std::vector<float> zero{0};
    REQUIRE(job.replicas[0]->CreateVariable("total", View(zero, {1}), NonTrainable()).ok());
    for (int r = 0; r < 3; ++r) CHECK(job.replicas[static_cast<size_t>(r)]->worker_id() == static_cast<uint32_t>(r));
    auto sums = OnEveryReplica(3, [&](int r) {
      std::vector<float> mine{3.f + static_cast<float>(job.replicas[static_cast<size_t>(r)]->worker_id())}, got{-1};
      auto res = job.replicas[static_cast<size_t>(r)]->ReduceTo(psclient::ReduceOp::kSum, 0, View(mine, {1}), "total",
                                                                Out(got, {1}), 5000);
      return std::make_pair(res.ok() && res->accepted, got[0]);
    });
    for (auto& [ok, value] : sums) {
      CHECK(ok);
      CHECK(value == 12);  // 3 + 4 + 5
    }
    std::vector<float> total{0};
    REQUIRE(job.replicas[1]->Pull("total", Out(total, {1})).ok());
    CHECK(total[0] == 12);
    // The next round, MEAN; a value tagged with the finished round's step is stale.
    auto means = OnEveryReplica(3, [&](int r) {
      std::vector<float> mine{3.f + static_cast<float>(r)}, got{-1};
      auto res = job.replicas[static_cast<size_t>(r)]->ReduceTo(psclient::ReduceOp::kMean, 1, View(mine, {1}), "total",
                                                                Out(got, {1}), 5000);
      return std::make_pair(res.ok() && res->accepted && res->step == 1, got[0]);
    });
    for (auto& [ok, value] : means) {
      CHECK(ok);
      CHECK(value == 4);
    }
    std::vector<float> late{100}, got{-1};
    auto stale = job.replicas[0]->ReduceTo(psclient::ReduceOp::kSum, 0, View(late, {1}), "total", Out(got, {1}));
    REQUIRE(stale.ok());
    CHECK_FALSE(stale->accepted);
    CHECK(got[0] == 4);  // the destination's current value
    // Trainable destinations belong to their optimizer.
    REQUIRE(job.replicas[0]->CreateVariable("w", View(zero, {1})).ok());
    CHECK(job.replicas[0]->ReduceTo(psclient::ReduceOp::kSum, 2, View(zero, {1}), "w").status().code() ==
          Code::kInvalidArgument);
  }
}

TEST_CASE("batch_reduce_to: 100 small tensors in one round trip per shard", "[distribution]") {
  Job job = StartJob(TestConfig(1), 3, 1);
  psclient::Client& c = *job.replicas[0];
  std::vector<float> zeros(4, 0.f);
  std::vector<std::vector<float>> values(100), results(100, std::vector<float>(4, -1));
  std::vector<psclient::ReduceItem> items;
  for (int i = 0; i < 100; ++i) {
    std::string name = "metric/" + std::to_string(i);
    REQUIRE(c.CreateVariable(name, View(zeros, {4}), NonTrainable()).ok());
    values[static_cast<size_t>(i)] = {static_cast<float>(i), 1, 2, 3};
  }
  for (int i = 0; i < 100; ++i) {
    items.push_back({View(values[static_cast<size_t>(i)], {4}), "metric/" + std::to_string(i),
                     Out(results[static_cast<size_t>(i)], {4})});
  }
  auto map = c.GetPlacementMap();
  REQUIRE(map.ok());
  int shards_used = 0;
  for (uint64_t b : map->shard_bytes) shards_used += b > 0 ? 1 : 0;
  CHECK(shards_used == 3);
  uint64_t before = c.requests_sent();
  auto got = c.BatchReduceTo(psclient::ReduceOp::kSum, 0, items);
  REQUIRE(got.ok());
  CHECK(c.requests_sent() - before == 3);  // one per shard
  for (int i = 0; i < 100; ++i) {
    CHECK((*got)[static_cast<size_t>(i)].accepted);
    CHECK(results[static_cast<size_t>(i)] == values[static_cast<size_t>(i)]);  // R = 1: the sum of one
  }
  // A pack size hint of 10 values per message: each shard's ~34 values go in 4 messages.
  before = c.requests_sent();
  got = c.BatchReduceTo(psclient::ReduceOp::kSum, 1, items, {10 * 16, 5000});
  REQUIRE(got.ok());
  uint64_t packed = c.requests_sent() - before;
  CHECK(packed >= 10);
  CHECK(packed <= 15);
  // 100 separate reduce_to calls: 100 requests.
  before = c.requests_sent();
  for (int i = 0; i < 100; ++i)
    REQUIRE(c.ReduceTo(psclient::ReduceOp::kSum, 2, items[static_cast<size_t>(i)].value,
                       items[static_cast<size_t>(i)].destination)
                .ok());
  CHECK(c.requests_sent() - before == 100);
}

TEST_CASE("update ops and broadcast_to act where the variable lives", "[distribution]") {
  for (int shards : {1, 3}) {
    INFO("shards " << shards);
    auto cfg = TestConfig(2);
    cfg.slice_bytes = 4096;
    Job job = StartJob(cfg, shards, 2);
    psclient::Client& chief = *job.replicas[0];
    psclient::Client& other = *job.replicas[1];
    CHECK(chief.should_init());
    CHECK(chief.should_checkpoint());
    CHECK_FALSE(other.should_init());
    CHECK_FALSE(other.should_save_summary());
    auto workers = other.WorkerDevices();
    REQUIRE(workers.ok());
    CHECK(*workers == std::vector<std::string>{"replica-0", "replica-1"});
    CHECK(other.ParameterDevices().size() == static_cast<size_t>(shards));

    std::vector<float> v(2000, 1.f);  // 8000 bytes: sliced over the cluster
    REQUIRE(chief.CreateVariable("avg", View(v, {1000, 2}), NonTrainable()).ok());
    std::vector<float> twos(2000, 2.f), got(2000);
    REQUIRE(chief.Update("avg", psclient::UpdateOp::kAssignAdd, View(twos, {1000, 2})).ok());  // 3
    REQUIRE(chief.Update("avg", psclient::UpdateOp::kAssignSub, View(v, {1000, 2})).ok());     // 2
    psclient::UpdateOptions half;
    half.factor = 0.5;
    REQUIRE(chief.Update("avg", psclient::UpdateOp::kScale, {}, half).ok());  // 1
    REQUIRE(other.Pull("avg", Out(got, {1000, 2})).ok());
    CHECK(got.front() == 1);
    CHECK(got.back() == 1);
    // broadcast_to: the chief sets a value; every replica reads it.
    std::vector<float> seven(2000, 7.f), zeros(2000, 0.f);
    REQUIRE(chief.CreateVariable("lr_scale", View(zeros, {1000, 2}), NonTrainable()).ok());
    REQUIRE(chief.BroadcastTo(View(seven, {1000, 2}), {"avg", "lr_scale"}).ok());
    for (auto* c : {&chief, &other}) {
      REQUIRE(c->Pull("lr_scale", Out(got, {1000, 2})).ok());
      CHECK(got[1234] == 7);
      REQUIRE(c->Pull("avg", Out(got, {1000, 2})).ok());
      CHECK(got[0] == 7);
    }
    std::vector<float> one{1};
    REQUIRE(chief.CreateVariable("trained", View(one, {1})).ok());
    CHECK(chief.Update("trained", psclient::UpdateOp::kAssign, View(one, {1})).status().code() ==
          Code::kInvalidArgument);
    // broadcast_to at the next step: staged until the step commits, then every replica (and
    // every shard) reads it at that same step.
    std::vector<float> nine(2000, 9.f);
    REQUIRE(chief.BroadcastTo(View(nine, {1000, 2}), {"lr_scale"}, /*at_next_step=*/true).ok());
    REQUIRE(other.Pull("lr_scale", Out(got, {1000, 2})).ok());
    CHECK(got[0] == 7);  // not yet
    auto pushed = OnEveryReplica(2, [&](int r) {
      return job.replicas[static_cast<size_t>(r)]->Push(0, {{"trained", View(one, {1})}}).ok();
    });
    CHECK(pushed == std::vector<bool>{true, true});
    for (int i = 0; i < 500 && *chief.GlobalStep() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (auto* c : {&chief, &other}) {
      auto step = c->Pull("lr_scale", Out(got, {1000, 2}));
      REQUIRE(step.ok());
      CHECK(*step == 1);
      CHECK(got[0] == 9);
      CHECK(got[1999] == 9);
    }
  }
}

TEST_CASE("assignments by replicas combine by the variable's aggregation", "[distribution]") {
  for (int shards : {1, 3}) {
    INFO("shards " << shards);
    Job job = StartJob(TestConfig(2), shards, 2);
    std::vector<float> zero{0};
    using psclient::Aggregation;
    for (auto [name, agg] :
         {std::pair{"none", Aggregation::kNone}, std::pair{"sum", Aggregation::kSum},
          std::pair{"mean", Aggregation::kMean}, std::pair{"first", Aggregation::kOnlyFirstReplica}}) {
      REQUIRE(job.replicas[0]->CreateVariable(name, View(zero, {1}), NonTrainable(agg)).ok());
    }
    auto assign = [&](const std::string& var, std::vector<float> per_replica, int64_t step) {
      return OnEveryReplica(2, [&, var, per_replica, step](int r) {
        std::vector<float> mine{per_replica[static_cast<size_t>(r)]};
        psclient::UpdateOptions o;
        o.cross_replica = false;
        o.local_step = step;
        o.timeout_ms = 5000;
        auto applied =
            job.replicas[static_cast<size_t>(r)]->Update(var, psclient::UpdateOp::kAssign, View(mine, {1}), o);
        return applied.ok() ? (*applied ? 1 : 0) : -static_cast<int>(applied.status().code());
      });
    };
    auto read = [&](const std::string& var) {
      std::vector<float> got{-1};
      REQUIRE(job.replicas[1]->Pull(var, Out(got, {1})).ok());
      return got[0];
    };
    // NONE: replicas that disagree get an error and nothing changes; agreeing ones apply.
    auto disagree = assign("none", {1, 2}, 0);
    CHECK(disagree[0] == -static_cast<int>(Code::kInvalidArgument));
    CHECK(disagree[1] == -static_cast<int>(Code::kInvalidArgument));
    CHECK(read("none") == 0);
    CHECK(assign("none", {5, 5}, 1) == std::vector<int>{1, 1});
    CHECK(read("none") == 5);
    CHECK(assign("sum", {3, 4}, 0) == std::vector<int>{1, 1});
    CHECK(read("sum") == 7);
    CHECK(assign("mean", {3, 4}, 0) == std::vector<int>{1, 1});
    CHECK(read("mean") == 3.5);
    CHECK(assign("first", {8, 9}, 0) == std::vector<int>{1, 0});  // replica 1's is ignored
    CHECK(read("first") == 8);
  }
}

TEST_CASE("sync-on-read variables: per-replica values, aggregated reads, the seed's restore rule", "[distribution]") {
  char tmpl[] = "/tmp/psd-sor-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = TestConfig(2);
  cfg.checkpoint_dir = dir;
  using psclient::Aggregation;
  auto add = [](psclient::Client& c, const std::string& var, float x) {
    std::vector<float> v{x};
    psclient::UpdateOptions o;
    o.cross_replica = false;
    REQUIRE(c.Update(var, psclient::UpdateOp::kAssignAdd, View(v, {1}), o).ok());
  };
  auto read = [](psclient::Client& c, const std::string& var) {
    std::vector<float> got{-1};
    REQUIRE(c.Pull(var, Out(got, {1})).ok());
    return got[0];
  };
  {
    Job job = StartJob(cfg, 1, 2);
    std::vector<float> zero{0};
    REQUIRE(job.replicas[0]->CreateVariable("count", View(zero, {1}), NonTrainable(Aggregation::kSum, true)).ok());
    REQUIRE(job.replicas[0]->CreateVariable("loss", View(zero, {1}), NonTrainable(Aggregation::kMean, true)).ok());
    add(*job.replicas[0], "count", 3);
    add(*job.replicas[1], "count", 5);
    add(*job.replicas[0], "loss", 2);
    add(*job.replicas[1], "loss", 6);
    CHECK(read(*job.replicas[0], "count") == 8);
    CHECK(read(*job.replicas[0], "loss") == 4);
    // A sync-on-read variable is not trainable, and NONE cannot combine a read.
    psclient::VariableOptions bad = NonTrainable(Aggregation::kSum, true);
    bad.trainable = true;
    CHECK(job.replicas[0]->CreateVariable("x", View(zero, {1}), bad).status().code() == Code::kInvalidArgument);
    CHECK(
        job.replicas[0]->CreateVariable("y", View(zero, {1}), NonTrainable(Aggregation::kNone, true)).status().code() ==
        Code::kInvalidArgument);
    REQUIRE(job.replicas[0]->RequestCheckpoint().ok());
    for (int i = 0; i < 200 && job.replicas[0]->GetStatus()->last_checkpoint_step < 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(job.replicas[0]->GetStatus()->last_checkpoint_step == 0);
  }
  // Restored: the SUM variable gives each replica 8 / 2, the MEAN one 4 as is.
  Job job = StartJob(cfg, 1, 2);
  CHECK(read(*job.replicas[0], "count") == 8);
  CHECK(read(*job.replicas[0], "loss") == 4);
  add(*job.replicas[0], "count", 1);  // replica 0: 4 + 1, replica 1: 4
  CHECK(read(*job.replicas[1], "count") == 9);
  add(*job.replicas[1], "loss", 2);  // replica 0: 4, replica 1: 6
  CHECK(read(*job.replicas[1], "loss") == 5);
  std::filesystem::remove_all(dir);
}

TEST_CASE("reduce_to and a replica's update answer DEADLINE_EXCEEDED when a replica does not come", "[distribution]") {
  Job job = StartJob(TestConfig(2), 1, 2);
  std::vector<float> zero{0};
  REQUIRE(job.replicas[0]->CreateVariable("total", View(zero, {1}), NonTrainable()).ok());
  REQUIRE(job.replicas[0]->CreateVariable("summed", View(zero, {1}), NonTrainable(psclient::Aggregation::kSum)).ok());
  // Only replica 0 comes: its call is answered at its deadline, naming it; its value still counts.
  std::vector<float> mine{3}, got{-1};
  auto alone = job.replicas[0]->ReduceTo(psclient::ReduceOp::kSum, 0, View(mine, {1}), "total", Out(got, {1}), 300);
  REQUIRE_FALSE(alone.ok());
  CHECK(alone.status().code() == Code::kDeadlineExceeded);
  CHECK_THAT(alone.status().message(), Catch::Contains("not every replica contributed within 300 ms"));
  std::vector<float> theirs{4};
  auto completed =
      job.replicas[1]->ReduceTo(psclient::ReduceOp::kSum, 0, View(theirs, {1}), "total", Out(got, {1}), 5000);
  REQUIRE(completed.ok());
  CHECK(completed->accepted);
  CHECK(got[0] == 7);
  psclient::UpdateOptions o;
  o.cross_replica = false;
  o.local_step = 0;
  o.timeout_ms = 300;
  auto assigned = job.replicas[0]->Update("summed", psclient::UpdateOp::kAssign, View(mine, {1}), o);
  REQUIRE_FALSE(assigned.ok());
  CHECK(assigned.status().code() == Code::kDeadlineExceeded);
  CHECK_THAT(assigned.status().message(), Catch::Contains("update: not every replica assigned within 300 ms"));
  o.timeout_ms = 5000;
  auto second = job.replicas[1]->Update("summed", psclient::UpdateOp::kAssign, View(theirs, {1}), o);
  REQUIRE(second.ok());
  CHECK(*second);
  std::vector<float> summed{-1};
  REQUIRE(job.replicas[1]->Pull("summed", Out(summed, {1})).ok());
  CHECK(summed[0] == 7);
}
