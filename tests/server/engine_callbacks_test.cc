// The engine's collective callbacks (Reduce and Update `done`) run outside all of its locks, as
// training_engine.h promises (docs/THREADING.md): a callback may call the engine again. Before
// this held, each case below deadlocked on the engine's or the variable's mutex.
#include <catch2/catch.hpp>

#include "config/server_config.h"
#include "core/training_engine.h"

using namespace psd;
using namespace psd::server;

namespace {

std::unique_ptr<TrainingEngine> MakeSyncEngine(int replicas = 1, int total = 1, int init_tokens = 0) {
  ServerConfig c;
  c.replicas_to_aggregate = replicas;
  c.total_replicas = total;
  c.init_tokens = init_tokens;
  REQUIRE(c.Validate().ok());
  return std::make_unique<TrainingEngine>(c, std::move(*MakeOptimizer(c.optimizer)));
}

void CreateNonTrainable(TrainingEngine& e, const std::string& name, bool sync_on_read = false,
                        Aggregation aggregation = Aggregation::kNone) {
  VariableDef d;
  d.name = name;
  d.shape = {2};
  d.trainable = false;
  d.sync_on_read = sync_on_read;
  d.aggregation = aggregation;
  REQUIRE(e.CreateVariable(d).ok());
}

UpdateArgs Assign(const std::vector<float>& value) {
  UpdateArgs a;
  a.name = "acc";
  a.op = UpdateOp::kAssign;
  a.shape = {2};
  a.data = value.data();
  a.bytes = value.size() * sizeof(float);
  return a;
}

float First(TrainingEngine& e) {
  std::vector<PulledValue> out;
  int64_t step = 0;
  REQUIRE(e.Pull({"acc"}, &out, &step).ok());
  return out[0].value->as<float>()[0];
}

}  // namespace

TEST_CASE("update and reduce callbacks may call the engine again (they run outside its locks)",
          "[engine][collectives]") {
  auto e = MakeSyncEngine();
  CreateNonTrainable(*e, "acc");
  std::vector<float> one{1, 1}, two{2, 2};

  SECTION("a cross-replica update staged for the next step") {
    UpdateArgs a = Assign(two);
    a.at_next_step = true;
    int64_t lands = -1;
    REQUIRE(e->Update(a, [&](const Status& s, bool applied, int64_t step) {
               REQUIRE(s.ok());
               REQUIRE(applied);
               CHECK(First(*e) == 0);  // staged: published by the next commit
               lands = step;
             }).ok());
    CHECK(lands == 1);
  }

  SECTION("a cross-replica update applied at once") {
    float seen = -1;
    REQUIRE(e->Update(Assign(two), [&](const Status& s, bool, int64_t) {
               REQUIRE(s.ok());
               seen = First(*e);
             }).ok());
    CHECK(seen == 2);
  }

  SECTION("a stale replica-context update") {
    UpdateArgs a = Assign(one);
    a.cross_replica = false;
    bool first = false;
    REQUIRE(e->Update(a, [&](const Status& s, bool applied, int64_t) { first = s.ok() && applied; }).ok());
    REQUIRE(first);  // round 0 complete (one replica): local step 0 is stale from now on
    int inner = 0;
    bool outer = false;
    REQUIRE(e->Update(a, [&](const Status& s, bool applied, int64_t step) {
               REQUIRE(s.ok());
               CHECK_FALSE(applied);
               CHECK(step == 1);
               // The same variable's round again, from inside the callback.
               REQUIRE(e->Update(a, [&](const Status&, bool again, int64_t) { inner += again ? 100 : 1; }).ok());
               outer = true;
             }).ok());
    CHECK(outer);
    CHECK(inner == 1);
  }

  SECTION("a stale reduce") {
    std::vector<GradRef> values{{"acc", DType::kFloat32, {2}, one.data(), one.size() * sizeof(float)}};
    bool first = false;
    REQUIRE(e->Reduce(false, 0, values, [&](std::vector<ReduceOutcome> o) { first = o[0].accepted; }).ok());
    REQUIRE(first);  // round 0 complete: local step 0 is stale from now on
    int inner = 0;
    bool outer = false;
    REQUIRE(e->Reduce(false, 0, values, [&](std::vector<ReduceOutcome> o) {
               CHECK_FALSE(o[0].accepted);
               CHECK(o[0].step == 1);
               REQUIRE(e->Reduce(false, 0, values, [&](std::vector<ReduceOutcome> again) {
                          inner += again[0].accepted ? 100 : 1;
                        }).ok());
               outer = true;
             }).ok());
    CHECK(outer);
    CHECK(inner == 1);
  }
}

TEST_CASE("a replica's own update names one of the job's replicas", "[engine][collectives]") {
  // A sync-on-read value per replica: a replica number beyond N would add a value nobody reads
  // (a worker naming ever new ones grew the daemon without bound).
  auto engine = MakeSyncEngine(2, 2);
  TrainingEngine& e = *engine;
  CreateNonTrainable(e, "acc", /*sync_on_read=*/true, Aggregation::kSum);
  std::vector<float> three{3, 3};
  UpdateArgs a = Assign(three);
  a.cross_replica = false;
  for (uint32_t replica : {0u, 1u}) {
    a.replica = replica;
    REQUIRE(e.Update(a, [](const Status& s, bool applied, int64_t) { CHECK((s.ok() && applied)); }).ok());
  }
  CHECK(First(e) == 6);  // the sum of both replicas' values
  for (uint32_t replica : {2u, 1000000u}) {
    a.replica = replica;
    Status s = e.Update(a, [](const Status&, bool, int64_t) { FAIL("no callback for a refused update"); });
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains("is not one of the job's 2 replicas"));
  }
  CHECK(First(e) == 6);

  // Only a sync-on-read value is per replica: a SUM round counts updates, whoever sends them (with
  // -R 2 -N 1 the second worker is replica 1, beyond N).
  auto engine2 = MakeSyncEngine(2, 1, /*init_tokens=*/1);
  TrainingEngine& e2 = *engine2;
  CreateNonTrainable(e2, "acc", /*sync_on_read=*/false, Aggregation::kSum);
  int answered = 0;
  for (uint32_t replica : {0u, 1u}) {
    a.replica = replica;
    REQUIRE(e2.Update(a, [&](const Status& s, bool applied, int64_t) { answered += s.ok() && applied; }).ok());
  }
  CHECK(answered == 2);  // the round of two completed
  CHECK(First(e2) == 6);
}
