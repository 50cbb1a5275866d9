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

TEST_CASE("with -R above -N, every worker's own sync-on-read value counts in what is read", "[engine][collectives]") {
  // Workers are numbered below max(N, R): before, reads summed N values and dropped the others'.
  auto engine = MakeSyncEngine(2, 1, /*init_tokens=*/1);
  TrainingEngine& e = *engine;
  CreateNonTrainable(e, "acc", /*sync_on_read=*/true, Aggregation::kSum);
  std::vector<float> one{1, 1}, five{5, 5};
  UpdateArgs a = Assign(one);
  a.op = UpdateOp::kAssignAdd;
  a.cross_replica = false;
  REQUIRE(e.Update(a, [](const Status& s, bool applied, int64_t) { CHECK((s.ok() && applied)); }).ok());
  a = Assign(five);
  a.op = UpdateOp::kAssignAdd;
  a.cross_replica = false;
  a.replica = 1;
  REQUIRE(e.Update(a, [](const Status& s, bool applied, int64_t) { CHECK((s.ok() && applied)); }).ok());
  CHECK(First(e) == 6);
}

TEST_CASE("reduce_to rounds: completed when the required count drops, stale by their values' step, one op each",
          "[engine][collectives]") {
  std::vector<float> one{1, 1}, two{2, 2}, nine{9, 9};
  auto value = [](const std::vector<float>& v) {
    return std::vector<GradRef>{{"acc", DType::kFloat32, {2}, v.data(), v.size() * sizeof(float)}};
  };

  SECTION("a round waiting for a worker that finished completes when the count is lowered") {
    auto e = MakeSyncEngine(2, 2);
    CreateNonTrainable(*e, "acc");
    std::vector<ReduceOutcome> got;
    REQUIRE(e->Reduce(false, 0, value(one), [&](std::vector<ReduceOutcome> o) { got = std::move(o); }).ok());
    CHECK(got.empty());         // one of two
    e->SetRequiredReplicas(1);  // the other worker finished
    REQUIRE(got.size() == 1);   // before, it waited for a value that would never come
    CHECK(got[0].accepted);
    CHECK(First(*e) == 1);
  }

  SECTION("a destination reduced every few steps: a late value of a completed round's step is stale") {
    auto e = MakeSyncEngine(1, 2, /*init_tokens=*/1);
    CreateNonTrainable(*e, "acc");
    std::vector<ReduceOutcome> got;
    auto reduce = [&](int64_t step, const std::vector<float>& v) {
      got.clear();
      REQUIRE(e->Reduce(false, step, value(v), [&](std::vector<ReduceOutcome> o) { got = std::move(o); }).ok());
      REQUIRE(got.size() == 1);
    };
    reduce(0, one);
    CHECK(got[0].step == 0);
    reduce(10, two);
    CHECK(got[0].accepted);
    CHECK(got[0].step == 10);      // the round of the values' step (before: 1, a count of rounds)
    reduce(10, nine);              // a backup's value for step 10, late
    CHECK_FALSE(got[0].accepted);  // before, it started the next round and overwrote the value
    CHECK(First(*e) == 2);
  }

  SECTION("a replica's retry of a round waits for it without counting again") {
    auto e = MakeSyncEngine(2, 2);
    CreateNonTrainable(*e, "acc");
    std::vector<float> answers;
    auto record = [&](std::vector<ReduceOutcome> o) { answers.push_back(o[0].value->as<float>()[0]); };
    REQUIRE(e->Reduce(false, 0, value(one), record, /*replica=*/0).ok());
    REQUIRE(e->Reduce(false, 0, value(one), record, /*replica=*/0).ok());  // its deadline passed: again
    CHECK(answers.empty());  // before, the retry completed the round with replica 0's value twice
    REQUIRE(e->Reduce(false, 0, value(two), record, /*replica=*/1).ok());
    CHECK(answers == std::vector<float>{3, 3, 3});
    CHECK(First(*e) == 3);
  }

  SECTION("a replica's value for a later step while its value of the open round waits is not counted") {
    auto e = MakeSyncEngine(2, 2);
    CreateNonTrainable(*e, "acc");
    std::vector<ReduceOutcome> later;
    REQUIRE(e->Reduce(
                 false, 0, value(one), [](std::vector<ReduceOutcome>) {}, /*replica=*/0)
                .ok());
    REQUIRE(e->Reduce(
                 false, 1, value(nine), [&](std::vector<ReduceOutcome> o) { later = std::move(o); }, 0)
                .ok());
    REQUIRE(later.size() == 1);
    CHECK_FALSE(later[0].accepted);  // before, it was dropped yet answered accepted with round 0's sum
    REQUIRE(e->Reduce(
                 false, 0, value(two), [](std::vector<ReduceOutcome>) {}, /*replica=*/1)
                .ok());
    CHECK(First(*e) == 3);
  }

  SECTION("async: a lagging worker's value still counts (rounds are numbered by their count)") {
    ServerConfig c;
    c.mode = Mode::kAsync;
    c.replicas_to_aggregate = 1;
    c.total_replicas = 2;
    REQUIRE(c.Validate().ok());
    TrainingEngine e(c, std::move(*MakeOptimizer(c.optimizer)));
    CreateNonTrainable(e, "acc");
    std::vector<ReduceOutcome> got;
    auto record = [&](std::vector<ReduceOutcome> o) { got = std::move(o); };
    REQUIRE(e.Reduce(false, 7, value(one), record, 0).ok());  // a fast worker at step 7
    REQUIRE(got.size() == 1);
    CHECK(got[0].step == 0);
    REQUIRE(e.Reduce(false, 3, value(two), record, 1).ok());  // a slow one at step 3
    REQUIRE(got.size() == 1);
    CHECK(got[0].accepted);
    CHECK(First(e) == 2);
  }

  SECTION("a value asking MEAN in a SUM round is refused") {
    auto e = MakeSyncEngine(2, 2);
    CreateNonTrainable(*e, "acc");
    REQUIRE(e->Reduce(false, 0, value(one), [](std::vector<ReduceOutcome>) {}).ok());
    Status s = e->Reduce(true, 0, value(two), [](std::vector<ReduceOutcome>) { FAIL("refused: no answer"); });
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains("this round is a SUM"));
  }
}

TEST_CASE("an update round counts a sender once: its retry waits for the round", "[engine][collectives]") {
  auto engine = MakeSyncEngine(2, 2);
  TrainingEngine& e = *engine;
  CreateNonTrainable(e, "acc", /*sync_on_read=*/false, Aggregation::kSum);
  std::vector<float> three{3, 3}, four{4, 4};
  int answered = 0;
  auto count = [&](const Status& s, bool applied, int64_t) { answered += s.ok() && applied; };
  UpdateArgs a = Assign(three);
  a.cross_replica = false;
  a.sender = 0;
  REQUIRE(e.Update(a, count).ok());
  REQUIRE(e.Update(a, count).ok());  // its deadline passed: the same share again
  CHECK(answered == 0);              // before, the retry completed the round alone (3 + 3)
  UpdateArgs b = Assign(four);
  b.cross_replica = false;
  b.replica = 1;
  b.sender = 1;
  REQUIRE(e.Update(b, count).ok());
  CHECK(answered == 3);
  CHECK(First(e) == 7);
}
