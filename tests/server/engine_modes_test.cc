// The engine beyond plain sync: sparse updates, moving averages, learning-rate changes, soft sync,
// async, per-variable optimizers.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <thread>

#include "config/server_config.h"
#include "core/sparse_accumulator.h"
#include "core/training_engine.h"

using namespace psd;
using namespace psd::server;

namespace {

ServerConfig Cfg(int replicas, int total, double lr = 1.0) {
  ServerConfig c;
  c.replicas_to_aggregate = replicas;
  c.total_replicas = total;
  c.init_tokens = 0;
  c.optimizer.learning_rate = lr;
  return c;
}

std::unique_ptr<TrainingEngine> Make(ServerConfig c) {
  REQUIRE(c.Validate().ok());
  return std::make_unique<TrainingEngine>(c, std::move(*MakeOptimizer(c.optimizer)));
}

void Create(TrainingEngine& e, const std::string& name, std::vector<float> init, Shape shape, bool average = false,
            std::string optimizer = "") {
  VariableDef d;
  d.name = name;
  d.shape = shape;
  d.initial = init.data();
  d.initial_bytes = init.size() * 4;
  d.average = average;
  d.optimizer = optimizer;
  auto r = e.CreateVariable(d);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
}

std::vector<float> Read(TrainingEngine& e, const std::string& name, bool averages = false) {
  std::vector<PulledValue> v;
  int64_t step;
  REQUIRE(e.Pull({name}, &v, &step, averages).ok());
  const float* p = v[0].value->as<float>();
  return std::vector<float>(p, p + v[0].value->bytes() / 4);
}

GradOutcome PushDense(TrainingEngine& e, int64_t local, const std::string& name, std::vector<float> g, Shape shape) {
  std::vector<GradOutcome> out;
  std::vector<GradRef> refs{{name, DType::kFloat32, shape, g.data(), g.size() * 4}};
  Status s = e.Push(local, refs, &out);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return out[0];
}

// A sync engine of 2 workers with `optimizer` whose committed states are kept (TakeCommitted), as
// with replicas: each step's copy lists what changed since the one before.
std::unique_ptr<TrainingEngine> KeptEngine(const std::string& optimizer) {
  auto c = Cfg(2, 2);
  c.optimizer.name = optimizer;
  auto e = Make(c);
  e->set_keep_committed(true);
  return e;
}

GradOutcome PushSparse(TrainingEngine& e, int64_t local, const std::string& name, std::vector<int64_t> idx,
                       std::vector<float> values, int64_t row) {
  std::vector<GradOutcome> out;
  GradRef ref{name, DType::kFloat32, {static_cast<int64_t>(idx.size()), row}, values.data(), values.size() * 4};
  ref.indices = idx.data();
  ref.nnz = static_cast<int64_t>(idx.size());
  std::vector<GradRef> refs{ref};
  Status s = e.Push(local, refs, &out);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return out[0];
}

}  // namespace

TEST_CASE("sparse gradients update only their rows, averaged per row, at the step's commit", "[engine][sparse]") {
  auto e = Make(Cfg(2, 2));
  Create(*e, "emb", {0, 0, 1, 1, 2, 2, 3, 3}, {4, 2});
  CHECK(PushSparse(*e, 0, "emb", {1}, {2, 2}, 2).accepted);
  CHECK(Read(*e, "emb")[2] == 1);  // nothing visible before the step commits
  CHECK(PushSparse(*e, 0, "emb", {1, 3}, {4, 4, 1, 1}, 2).accepted);
  CHECK(e->global_step() == 1);
  // Row 1: 1 - mean(2, 4) = -2; row 3: 3 - 1 = 2 (its own count is 1); rows 0 and 2 untouched.
  CHECK(Read(*e, "emb") == std::vector<float>{0, 0, -2, -2, 2, 2, 2, 2});
  // A variable takes one kind of gradient.
  std::vector<float> dense(8, 1);
  std::vector<GradOutcome> out;
  std::vector<GradRef> refs{{"emb", DType::kFloat32, {4, 2}, dense.data(), 32}};
  CHECK_THAT(e->Push(1, refs, &out).message(), Catch::Contains("takes sparse gradients"));
  // Selected rows, any order, repeats allowed, handed to the sink in the order asked.
  struct Rows : RowSink {
    Shape shape;
    std::vector<std::pair<size_t, std::vector<float>>> got;
    Status Begin(DType dtype, DType, const Shape& s) override {
      shape = s;
      CHECK(dtype == DType::kFloat32);
      return Status::Ok();
    }
    void Row(size_t i, const uint8_t* src) override {
      const float* f = reinterpret_cast<const float*>(src);
      got.emplace_back(i, std::vector<float>(f, f + 2));
    }
  } rows;
  auto step = e->ReadRows("emb", {3, 1, 3}, rows);
  REQUIRE(step.ok());
  CHECK(*step == 1);
  CHECK(rows.shape == Shape{3, 2});
  CHECK(rows.got == std::vector<std::pair<size_t, std::vector<float>>>{{0, {2, 2}}, {1, {-2, -2}}, {2, {2, 2}}});
  // A row outside the variable: refused before any row is read.
  Rows none;
  CHECK(e->ReadRows("emb", {0, 4}, none).status().code() == Code::kInvalidArgument);
  CHECK(none.got.empty());
  // A sink that refuses the layout: nothing is read.
  struct Refuse : Rows {
    Status Begin(DType, DType, const Shape&) override { return InvalidArgument("no"); }
  } refuse;
  CHECK(e->ReadRows("emb", {1}, refuse).status().message() == "no");
  CHECK(refuse.got.empty());
  // The rows are read outside the engine's lock, all of one step: a step committed while they are
  // read (here from the sink itself, which would deadlock under the lock) changes a copy.
  struct PushMidway : Rows {
    TrainingEngine* engine = nullptr;
    void Row(size_t i, const uint8_t* src) override {
      if (i == 1) {
        CHECK(PushSparse(*engine, 1, "emb", {1, 3}, {1, 1, 1, 1}, 2).accepted);
        CHECK(PushSparse(*engine, 1, "emb", {1, 3}, {1, 1, 1, 1}, 2).accepted);
        CHECK(engine->global_step() == 2);
      }
      Rows::Row(i, src);
    }
  } midway;
  midway.engine = e.get();
  step = e->ReadRows("emb", {3, 1, 3}, midway);
  REQUIRE(step.ok());
  CHECK(*step == 1);
  CHECK(midway.got == std::vector<std::pair<size_t, std::vector<float>>>{{0, {2, 2}}, {1, {-2, -2}}, {2, {2, 2}}});
  CHECK(Read(*e, "emb") == std::vector<float>{0, 0, -3, -3, 2, 2, 1, 1});
}

TEST_CASE("moving averages follow TF's rule, num_updates included", "[engine][ema]") {
  auto c = Cfg(1, 1);
  c.ema_decay = 0.5;
  auto e = Make(c);
  Create(*e, "w", {0}, {1}, /*average=*/true);
  CHECK(Read(*e, "w", true) == std::vector<float>{0});  // shadow starts at the initial value
  PushDense(*e, 0, "w", {1}, {1});                      // w = -1
  CHECK(Read(*e, "w", true)[0] == Approx(-0.5));
  PushDense(*e, 1, "w", {1}, {1});  // w = -2
  CHECK(Read(*e, "w", true)[0] == Approx(-0.5 - 0.5 * (-0.5 + 2)));

  auto c2 = Cfg(1, 1);
  c2.ema_decay = 0.99;
  c2.ema_num_updates = true;
  auto e2 = Make(c2);
  Create(*e2, "w", {0}, {1}, true);
  PushDense(*e2, 0, "w", {1}, {1});  // step 1: decay = min(0.99, 2/11)
  CHECK(Read(*e2, "w", true)[0] == Approx(0 - (1 - 2.0 / 11) * (0 + 1)));
  // A variable without an average has none to read.
  Create(*e2, "plain", {0}, {1});
  std::vector<PulledValue> v;
  int64_t step;
  CHECK(e2->Pull({"plain"}, &v, &step, true).code() == Code::kNotFound);
  VariableDef bad;
  bad.name = "x";
  bad.average = true;
  auto e3 = Make(Cfg(1, 1));
  CHECK(e3->CreateVariable(bad).status().code() == Code::kFailedPrecondition);
}

TEST_CASE("concurrent async pushes each update the moving average once, in turn", "[engine][ema]") {
  // Each update reads the shadow the one before wrote: two computed from the same shadow would
  // lose one (a race of pushes on different connections).
  auto c = Cfg(1, 4);
  c.mode = Mode::kAsync;
  c.ema_decay = 0.99;
  auto e = Make(c);
  const int64_t n = 1 << 18;  // long enough to compute that updates overlap without the turns
  Create(*e, "w", std::vector<float>(n, 0.0f), {n}, /*average=*/true);
  PushDense(*e, 0, "w", std::vector<float>(n, -1.0f), {n});  // w = 1 from here on
  constexpr int kThreads = 4, kPushes = 20;
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&e, n] {
      std::vector<float> zero(n, 0.0f);
      for (int i = 0; i < kPushes; ++i) {
        std::vector<GradOutcome> out;
        std::vector<GradRef> refs{{"w", DType::kFloat32, {n}, zero.data(), zero.size() * 4}};
        if (!e->Push(i, refs, &out).ok()) std::abort();
      }
    });
  }
  for (auto& w : workers) w.join();
  float expect = 0.0f;  // the engine's float arithmetic, one update per push
  for (int u = 0; u < 1 + kThreads * kPushes; ++u) expect = expect - static_cast<float>(1 - 0.99) * (expect - 1.0f);
  auto shadow = Read(*e, "w", true);
  CHECK(shadow[0] == expect);
  CHECK(std::count(shadow.begin(), shadow.end(), expect) == n);
}

TEST_CASE("deterministic mode: gradients waiting for a take are bounded", "[engine][deterministic]") {
  // Each waits in a model-sized slot until the take: a worker pushing a variable for future steps
  // over and over while the step stays open (another variable not taken yet) grew the daemon.
  auto c = Cfg(1, 1);
  c.deterministic = true;
  auto e = Make(c);
  Create(*e, "w", {0}, {1});
  Create(*e, "u", {0}, {1});
  CHECK(PushDense(*e, 0, "w", {1}, {1}).accepted);  // taken: the step waits for u
  int accepted = 0;
  for (int i = 0; i < 50; ++i) accepted += PushDense(*e, 1000, "w", {1}, {1}).accepted;
  CHECK(accepted == 2 * 1 + 8);  // twice the larger of -N and -R, and 8 more
  CHECK(PushDense(*e, 0, "u", {1}, {1}).accepted);
  CHECK(e->global_step() == 1);  // the step committed; the waiting ones make step 2's take
  CHECK(PushDense(*e, 1, "u", {1}, {1}).accepted);
  CHECK(e->global_step() == 2);
  CHECK(Read(*e, "w") == std::vector<float>{-2});  // 0 - 1 (step 1) - the mean of 10 ones (step 2)
}

TEST_CASE("the open step names the variables it still waits for", "[engine]") {
  // What a token wait's timeout says: a variable no worker sends a gradient for holds every step
  // (TensorFlow's accumulator would too), and the message names it.
  auto e = Make(Cfg(2, 2, 1.0));
  Create(*e, "a", {0}, {1});
  Create(*e, "b", {0}, {1});
  CHECK(e->WaitingVariables() == "'a' (0 of 2), 'b' (0 of 2)");
  PushDense(*e, 0, "a", {1}, {1});
  CHECK(e->WaitingVariables() == "'a' (1 of 2), 'b' (0 of 2)");
  CHECK(e->WaitingVariables(1) == "'a' (1 of 2) and 1 more");
  PushDense(*e, 0, "a", {1}, {1});  // a is taken; the step waits for b alone
  CHECK(e->global_step() == 0);
  CHECK(e->WaitingVariables() == "'b' (0 of 2)");
  PushDense(*e, 0, "b", {1}, {1});
  PushDense(*e, 0, "b", {1}, {1});
  CHECK(e->global_step() == 1);
  CHECK(e->WaitingVariables() == "'a' (0 of 2), 'b' (0 of 2)");
}

TEST_CASE("a learning-rate change takes effect from the next step", "[engine]") {
  auto e = Make(Cfg(2, 2, 1.0));
  Create(*e, "w", {0}, {1});
  PushDense(*e, 0, "w", {1}, {1});
  REQUIRE(e->SetLearningRate(10.0).ok());  // mid-step: this step still uses 1.0
  PushDense(*e, 0, "w", {1}, {1});
  CHECK(Read(*e, "w")[0] == Approx(-1));
  PushDense(*e, 1, "w", {1}, {1});
  PushDense(*e, 1, "w", {1}, {1});
  CHECK(Read(*e, "w")[0] == Approx(-11));
  CHECK(e->SetLearningRate(-1).code() == Code::kInvalidArgument);
}

TEST_CASE("soft sync: a deadline commits the step with what arrived", "[engine][soft]") {
  auto c = Cfg(3, 3);
  c.step_deadline_ms = 100;
  auto e = Make(c);
  Create(*e, "a", {0}, {1});
  Create(*e, "b", {5}, {1});
  int64_t started = -1;
  e->set_on_step_started([&](int64_t s) { started = s; });
  StepInfo info{};
  e->set_on_commit([&](const StepInfo& i) { info = i; });
  PushDense(*e, 0, "a", {2}, {1});
  CHECK(started == 0);
  e->ForceStep(0);  // what the server's timer does at the deadline
  CHECK(e->global_step() == 1);
  CHECK(info.forced);
  CHECK(info.min_gradients == 0);  // b got nothing: its value stays
  CHECK(info.max_gradients == 1);
  CHECK(Read(*e, "a")[0] == Approx(-2));
  CHECK(Read(*e, "b")[0] == 5);
  e->ForceStep(0);  // a stale deadline does nothing
  CHECK(e->global_step() == 1);
  CHECK_FALSE(PushDense(*e, 0, "a", {1}, {1}).accepted);  // late for step 0: stale
}

TEST_CASE("soft sync: a variable with no gradient makes the step's fewest 0, whichever is taken first",
          "[engine][soft]") {
  // The forced takes go in the variables' order: here the empty one first. Its 0 was read as
  // "none yet" and the next variable's 1 reported as the fewest.
  auto c = Cfg(3, 3);
  c.step_deadline_ms = 100;
  auto e = Make(c);
  Create(*e, "a", {5}, {1});
  Create(*e, "b", {0}, {1});
  StepInfo info{};
  e->set_on_commit([&](const StepInfo& i) { info = i; });
  PushDense(*e, 0, "b", {2}, {1});
  e->ForceStep(0);
  CHECK(e->global_step() == 1);
  CHECK(info.min_gradients == 0);
  CHECK(info.max_gradients == 1);
  CHECK(Read(*e, "a")[0] == 5);
}

TEST_CASE("soft sync: parts of a variable no chunk reached keep their value and momentum", "[engine][soft]") {
  // Step 0 gives every element momentum; in step 1 only the first part's chunk comes before the
  // deadline. The other parts' gradient was taken as zero and momentum still moved them (-1.9
  // where a variable that got nothing at all stays put); now they stay as they are.
  const int64_t P = TrainingEngine::kChunkElements;
  auto c = Cfg(1, 1);
  c.optimizer.name = "momentum";
  c.step_deadline_ms = 100;
  auto e = Make(c);
  Create(*e, "w", std::vector<float>(static_cast<size_t>(3 * P), 0.0f), {3 * P});
  PushDense(*e, 0, "w", std::vector<float>(static_cast<size_t>(3 * P), 1.0f), {3 * P});  // w = -1, momentum 1
  REQUIRE(e->global_step() == 1);
  std::vector<float> ones(static_cast<size_t>(P), 1.0f);
  std::vector<GradOutcome> out;
  GradRef chunk{"w", DType::kFloat32, {P}, ones.data(), ones.size() * 4};
  chunk.chunk_offset = 0;
  REQUIRE(e->Push(1, {chunk}, &out, "w0", /*more=*/true).ok());
  e->ForceStep(1);
  REQUIRE(e->global_step() == 2);
  std::vector<float> w = Read(*e, "w");
  for (int64_t i = 0; i < 3 * P; ++i) {
    INFO("element " << i);
    REQUIRE(w[static_cast<size_t>(i)] == Approx(i < P ? -2.9f : -1.0f));  // -1 - (0.9 * 1 + 1); unchanged
  }
  // Their momentum did not move either: a whole gradient of zeros next moves them by 0.9 * 1.
  PushDense(*e, 2, "w", std::vector<float>(static_cast<size_t>(3 * P), 0.0f), {3 * P});
  w = Read(*e, "w");
  CHECK(w[static_cast<size_t>(P)] == Approx(-1.9f));
  CHECK(w[0] == Approx(-2.9f - 0.9f * 1.9f));
}

TEST_CASE("soft sync: a fraction of the workers completes a step", "[engine][soft]") {
  auto c = Cfg(4, 4);
  c.soft_sync_fraction = 0.5;
  auto e = Make(c);
  CHECK(e->required_replicas() == 2);
  Create(*e, "w", {0}, {1});
  PushDense(*e, 0, "w", {1}, {1});
  PushDense(*e, 0, "w", {3}, {1});
  CHECK(e->global_step() == 1);
  CHECK(Read(*e, "w")[0] == Approx(-2));
}

TEST_CASE("async: every push is applied on arrival and its staleness reported", "[engine][async]") {
  auto c = Cfg(1, 2, 1.0);
  c.mode = Mode::kAsync;
  c.staleness_lr = StalenessLr::kInverse;
  auto e = Make(c);
  Create(*e, "w", {0}, {1});
  auto o1 = PushDense(*e, 0, "w", {1}, {1});
  CHECK(o1.accepted);
  CHECK(o1.staleness == 0);
  CHECK(e->global_step() == 1);
  CHECK(Read(*e, "w")[0] == Approx(-1));
  auto o2 = PushDense(*e, 0, "w", {1}, {1});  // computed at step 0, applied at 1: staleness 1
  CHECK(o2.staleness == 1);
  CHECK(Read(*e, "w")[0] == Approx(-2));
  auto o3 = PushDense(*e, 0, "w", {1}, {1});  // staleness 2: lr / 2
  CHECK(o3.staleness == 2);
  CHECK(Read(*e, "w")[0] == Approx(-2.5));
  CHECK(e->Stats().max_staleness == 2);
  Create(*e, "emb", {0, 0, 0}, {3, 1});
  PushSparse(*e, 3, "emb", {2}, {4}, 1);
  CHECK(Read(*e, "emb") == std::vector<float>{0, 0, -4});
}

TEST_CASE("a gradient's staleness saturates for any local_step a worker sends", "[engine][async]") {
  // INT64_MIN is a valid (very stale) local_step: global - local_step overflowed (found by fuzzing).
  for (Mode mode : {Mode::kSync, Mode::kAsync}) {
    auto c = Cfg(1, 1, 1.0);
    c.mode = mode;
    auto e = Make(c);
    Create(*e, "w", {0}, {1});
    PushDense(*e, 0, "w", {1}, {1});  // one step applied: global step 1
    auto o = PushDense(*e, INT64_MIN, "w", {1}, {1});
    CHECK(o.staleness == INT64_MAX);
    CHECK(o.accepted == (mode == Mode::kAsync));  // sync: stale, dropped
    CHECK(PushDense(*e, INT64_MAX, "w", {1}, {1}).staleness == 0);
  }
}

TEST_CASE("a variable can name its own optimizer, its slots follow it", "[engine]") {
  auto e = Make(Cfg(1, 1, 0.5));
  Create(*e, "w", {0}, {1}, false, "momentum");
  Create(*e, "v", {0}, {1});
  CHECK(e->SlotNames("w") == std::vector<std::string>{"momentum"});
  CHECK(e->SlotNames("v").empty());
  std::vector<float> g{1};
  std::vector<GradOutcome> out;
  std::vector<GradRef> refs{{"w", DType::kFloat32, {1}, g.data(), 4}, {"v", DType::kFloat32, {1}, g.data(), 4}};
  REQUIRE(e->Push(0, refs, &out).ok());
  REQUIRE(e->Push(1, refs, &out).ok());
  CHECK(Read(*e, "w")[0] == Approx(-0.5 - 0.5 * 1.9));  // momentum 0.9: accum 1 then 1.9
  CHECK(Read(*e, "v")[0] == Approx(-1.0));
  auto slot = e->GetSlot("w", "momentum");
  REQUIRE(slot.ok());
  CHECK(slot->value->as<float>()[0] == Approx(1.9));
  // A range of a slot: only those elements are copied, as a flat [count].
  Create(*e, "m", {0, 0, 0, 0, 0, 0}, {2, 3}, false, "momentum");
  std::vector<float> gm{1, 2, 3, 4, 5, 6};
  REQUIRE(e->Push(2, {{"m", DType::kFloat32, {2, 3}, gm.data(), 24}, refs[0], refs[1]}, &out).ok());
  auto part = e->GetSlot("m", "momentum", 2, 3);
  REQUIRE(part.ok());
  CHECK(part->shape == Shape{3});
  REQUIRE(part->value->bytes() == 3 * 4);
  CHECK(part->value->as<float>()[0] == 3);
  CHECK(part->value->as<float>()[2] == 5);
  CHECK(e->GetSlot("m", "momentum", 4, 3).status().code() == Code::kInvalidArgument);  // past the end
  CHECK(e->GetSlot("m", "momentum", 0, 0).status().code() == Code::kInvalidArgument);
  VariableDef bad;
  bad.name = "x";
  bad.optimizer = "lbfgs";
  CHECK(e->CreateVariable(bad).status().code() == Code::kInvalidArgument);
}

TEST_CASE("deterministic reduction: the same gradients give bit-identical parameters in any arrival order",
          "[engine][deterministic]") {
  const std::vector<std::pair<std::string, std::vector<float>>> grads = {
      {"worker-0", {1e8f, 0.1f}}, {"worker-1", {1.0f, 1e-8f}}, {"worker-2", {-1e8f, 0.7f}}};
  auto train = [&](std::vector<int> order) {
    auto c = Cfg(3, 3, 1.0);
    c.reduction = Reduction::kSum;
    c.deterministic = true;
    auto e = Make(c);
    Create(*e, "w", {0, 0}, {2});
    for (int k : order) {
      auto& [name, g] = grads[static_cast<size_t>(k)];
      std::vector<GradOutcome> out;
      std::vector<GradRef> refs{{"w", DType::kFloat32, {2}, g.data(), 8}};
      REQUIRE(e->Push(0, refs, &out, name).ok());
      REQUIRE(out[0].accepted);
    }
    REQUIRE(e->global_step() == 1);
    return Read(*e, "w");
  };
  std::vector<float> first = train({0, 1, 2});
  CHECK(first[0] == 0.0f);  // -(1e8 + 1 + -1e8) in float32, worker-0's first
  for (std::vector<int> order : {std::vector<int>{2, 1, 0}, {2, 0, 1}, {1, 2, 0}}) {
    std::vector<float> again = train(order);
    CHECK(std::memcmp(again.data(), first.data(), 8) == 0);
  }
}

TEST_CASE("deterministic reduction needs --mode sync", "[config][deterministic]") {
  auto c = Cfg(1, 1);
  c.deterministic = true;
  c.mode = Mode::kAsync;
  Status s = c.Validate();
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("--deterministic needs --mode sync") != std::string::npos);
}

TEST_CASE("a sparse step lists the rows it wrote in the value copy it makes and in the slots copy of the next snapshot",
          "[engine][sparse][replicas]") {
  auto e = Make(Cfg(1, 1));
  e->set_keep_committed(true);
  Create(*e, "emb", std::vector<float>(16 * 4, 1.0f), {16, 4});
  REQUIRE(PushSparse(*e, 0, "emb", {3}, {1, 1, 1, 1}, 4).accepted);
  auto first = e->TakeCommitted();  // keeps the value of step 1 (as a replica's copy does)
  REQUIRE(first);
  const Buffer& before = *first->variables[0].value;
  REQUIRE(PushSparse(*e, 1, "emb", {2, 9}, std::vector<float>(8, 1.0f), 4).accepted);
  auto second = e->TakeCommitted();
  REQUIRE(second);
  const Buffer& after = *second->variables[0].value;
  REQUIRE(&after != &before);  // copied on write: the kept value is as it was
  CHECK(before.as<float>()[9 * 4] == 1.0f);
  CHECK(after.as<float>()[9 * 4] == 0.0f);
  CHECK(after.copied_from() == before.id());
  auto changes = after.changes();  // the rows as the step applied them (the order is the accumulator's)
  std::sort(changes.begin(), changes.end());
  CHECK(changes == std::vector<std::pair<uint64_t, uint64_t>>{{2 * 16, 16}, {9 * 16, 16}});
  // Slots (updated in place) are copied at each snapshot; the copy lists the slot rows a sparse
  // step wrote since the previous snapshot's copy.
  auto a = Make([] {
    auto c = Cfg(1, 1);
    c.optimizer.name = "adam";
    return c;
  }());
  a->set_keep_committed(true);
  Create(*a, "emb", std::vector<float>(16 * 4, 1.0f), {16, 4});
  REQUIRE(PushSparse(*a, 0, "emb", {3}, {1, 1, 1, 1}, 4).accepted);
  auto slots_before = a->TakeCommitted();
  REQUIRE(PushSparse(*a, 1, "emb", {2, 9}, std::vector<float>(8, 1.0f), 4).accepted);
  auto slots_after = a->TakeCommitted();
  REQUIRE(slots_before);
  REQUIRE(slots_after);
  const auto& s0 = slots_before->variables[0].slots;
  const auto& s1 = slots_after->variables[0].slots;
  REQUIRE(s0.size() == 2);  // m, v
  REQUIRE(s1.size() == 2);
  for (size_t k = 0; k < 2; ++k) {
    INFO(s1[k].first);
    CHECK(s1[k].second->copied_from() == s0[k].second->id());
    auto rows_written = s1[k].second->changes();
    std::sort(rows_written.begin(), rows_written.end());
    CHECK(rows_written == std::vector<std::pair<uint64_t, uint64_t>>{{2 * 16, 16}, {9 * 16, 16}});
    CHECK(s0[k].second->as<float>()[9 * 4] == 0.0f);  // the earlier copy is as it was
    CHECK(s1[k].second->as<float>()[9 * 4] != 0.0f);
  }
  // A dense step writes a whole new value and lists nothing: the next copy is compared whole.
  auto d = Make(Cfg(1, 1));
  d->set_keep_committed(true);
  Create(*d, "w", {0, 0}, {2});
  REQUIRE(PushDense(*d, 0, "w", {1, 1}, {2}).accepted);
  auto kept = d->TakeCommitted();
  REQUIRE(PushDense(*d, 1, "w", {1, 1}, {2}).accepted);
  auto next = d->TakeCommitted();
  REQUIRE(kept);
  REQUIRE(next);
  CHECK(next->variables[0].value->copied_from() == 0);
  CHECK(next->variables[0].value->as<float>()[0] == -2.0f);
}

TEST_CASE("a step's rows from several workers are applied and listed in increasing order, in few ranges",
          "[engine][sparse][replicas]") {
  // Two workers' interleaved rows: applied as they arrived (0, 2, ..., 14, then 1, 3, ..., 15) the
  // value copy's list would hold 16 ranges, and with more workers over a big table it outgrows
  // its limit and every copy becomes a whole one. In order, neighbouring rows make one range.
  for (const char* optimizer : {"sgd", "adam"}) {
    INFO(optimizer);
    auto e = KeptEngine(optimizer);
    Create(*e, "emb", std::vector<float>(32 * 2, 1.0f), {32, 2});
    REQUIRE(PushSparse(*e, 0, "emb", {30}, {1, 1}, 2).accepted);
    REQUIRE(PushSparse(*e, 0, "emb", {31}, {1, 1}, 2).accepted);
    auto first = e->TakeCommitted();
    REQUIRE(first);
    std::vector<int64_t> even, odd;
    for (int64_t r = 0; r < 16; r += 2) {
      even.push_back(r);
      odd.push_back(r + 1);
    }
    REQUIRE(PushSparse(*e, 1, "emb", even, std::vector<float>(16, 1.0f), 2).accepted);
    REQUIRE(PushSparse(*e, 1, "emb", odd, std::vector<float>(16, 3.0f), 2).accepted);
    auto second = e->TakeCommitted();
    REQUIRE(second);
    const Buffer& after = *second->variables[0].value;
    CHECK(after.copied_from() == first->variables[0].value->id());
    CHECK(after.changes() == std::vector<std::pair<uint64_t, uint64_t>>{{0, 16 * 8}});
    for (const auto& [name, slot] : second->variables[0].slots) {
      INFO(name);
      CHECK(slot->changes() == std::vector<std::pair<uint64_t, uint64_t>>{{0, 16 * 8}});
    }
    if (std::string(optimizer) == "sgd") {  // lr 1: each row moved by its own gradient
      CHECK(Read(*e, "emb")[0] == 0.0f);
      CHECK(Read(*e, "emb")[2] == -2.0f);
      CHECK(Read(*e, "emb")[32] == 1.0f);
    }
  }
}

TEST_CASE("a sparse table whose copies are kept is written into the value they let go, brought up to date",
          "[engine][sparse][replicas]") {
  // As with replicas: the last two committed states are kept (TakeCommitted), so each step copies
  // the table on write — into the value of three steps ago, once its copy is let go, updating only
  // the rows the two steps since wrote — and each snapshot's slot copies go into the copies of three
  // snapshots ago likewise. The same steps on an engine that keeps nothing (the table written in
  // place, its snapshots' slots copied whole) must give the same values and slots, and every kept
  // copy must stay as it was.
  for (const std::string optimizer : {"sgd", "adam"}) {
    INFO(optimizer);
    auto cfg = Cfg(1, 1);
    cfg.optimizer.name = optimizer;
    auto kept = Make(cfg);
    kept->set_keep_committed(true);
    auto plain = Make(cfg);
    const std::vector<float> init(64 * 4, 0.5f);
    Create(*kept, "emb", init, {64, 4});
    Create(*plain, "emb", init, {64, 4});
    // A kept state, and the plain engine's value and slots at that step (bytes: a snapshot of it
    // kept would make it copy on write too).
    std::deque<std::pair<ShardSnapshot, std::vector<std::string>>> copies;
    uint64_t seed = 99;
    for (int64_t step = 0; step < 12; ++step) {
      std::vector<int64_t> rows;
      for (int k = 0; k < 3; ++k) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t row = static_cast<int64_t>((seed >> 33) % 64);
        if (std::find(rows.begin(), rows.end(), row) == rows.end()) rows.push_back(row);
      }
      std::sort(rows.begin(), rows.end());
      std::vector<float> grad;
      for (int64_t row : rows) {
        for (int j = 0; j < 4; ++j) grad.push_back(static_cast<float>(step + 1) * 0.125f + static_cast<float>(row + j));
      }
      REQUIRE(PushSparse(*kept, step, "emb", rows, grad, 4).accepted);
      REQUIRE(PushSparse(*plain, step, "emb", rows, grad, 4).accepted);
      INFO("step " << step);
      CHECK(Read(*kept, "emb") == Read(*plain, "emb"));
      auto snap = kept->TakeCommitted();
      REQUIRE(snap);
      std::vector<std::string> want;
      {
        auto same = plain->SnapshotIfAtBoundary();
        REQUIRE(same);
        auto bytes = [](const std::shared_ptr<const Buffer>& b) {
          return std::string(static_cast<const char*>(b->data()), b->bytes());
        };
        want.push_back(bytes(same->variables[0].value));
        for (const auto& [slot, buffer] : same->variables[0].slots) want.push_back(bytes(buffer));
      }
      copies.emplace_back(std::move(*snap), std::move(want));
      if (copies.size() > 2) copies.pop_front();
      for (const auto& [copy, values] : copies) {
        const VariableSnapshot& a = copy.variables[0];
        REQUIRE(values.size() == 1 + a.slots.size());
        CHECK((a.value->bytes() == values[0].size() &&
               std::memcmp(a.value->data(), values[0].data(), values[0].size()) == 0));
        for (size_t k = 0; k < a.slots.size(); ++k) {
          const Buffer& slot = *a.slots[k].second;
          CHECK((slot.bytes() == values[k + 1].size() &&
                 std::memcmp(slot.data(), values[k + 1].data(), values[k + 1].size()) == 0));
        }
      }
    }
  }
}

TEST_CASE("sync sparse accumulation charges its row bookkeeping to --max-model-bytes once, before any row is taken",
          "[engine][sparse]") {
  ServerConfig c = Cfg(1, 1);
  c.max_model_bytes = 12000;
  auto e = Make(c);
  Create(*e, "emb", std::vector<float>(100), {100, 1});  // 400 bytes x 4 + 1024 = 2624
  CHECK(e->Stats().model_bytes == 2624);
  CHECK(PushSparse(*e, 0, "emb", {3}, {1}, 1).accepted);
  const uint64_t with_rows = 2624 + SparseAccumulator::BookkeepingBytes(100);
  CHECK(e->Stats().model_bytes == with_rows);
  CHECK(PushSparse(*e, 1, "emb", {4}, {1}, 1).accepted);  // charged once
  CHECK(e->Stats().model_bytes == with_rows);
  Create(*e, "small", std::vector<float>(50), {50, 1});  // 1824: 11248 held; its rows need 3400 more
  std::vector<int64_t> idx{1};
  std::vector<float> one{2};
  GradRef ref{"small", DType::kFloat32, {1, 1}, one.data(), 4};
  ref.indices = idx.data();
  ref.nnz = 1;
  std::vector<GradOutcome> out;
  const Status refused = e->Push(2, {ref}, &out);
  CHECK(refused.code() == Code::kResourceExhausted);
  CHECK_THAT(refused.message(), Catch::Contains("--max-model-bytes"));
  CHECK_THAT(refused.message(), Catch::Contains("'small'"));
  CHECK(e->Stats().model_bytes == with_rows + 1824);  // nothing charged
  CHECK(e->global_step() == 2);                       // nothing taken
  CHECK(Read(*e, "small")[1] == 0);
  // The push changed nothing, so the variable may still take dense gradients.
  CHECK(PushDense(*e, 2, "small", std::vector<float>(50, 1), {50, 1}).accepted);
  CHECK(PushSparse(*e, 2, "emb", {5}, {1}, 1).accepted);
  CHECK(e->global_step() == 3);
  CHECK(Read(*e, "small")[1] == -1);  // 0 - lr 1 x 1
}

TEST_CASE("a table of several row stripes: workers' rows applied and listed in increasing order across them",
          "[engine][sparse][replicas]") {
  // 12000 rows: stripes of 4096 (0..4095, 4096..8191, 8192..11999). Two workers' interleaved rows
  // across both boundaries are updated stripe by stripe (in parallel) and listed in one pass in
  // increasing order: three ranges, as if there were one stripe.
  for (const char* optimizer : {"sgd", "adam"}) {
    INFO(optimizer);
    auto e = KeptEngine(optimizer);
    Create(*e, "emb", std::vector<float>(12000, 1.0f), {12000, 1});
    REQUIRE(PushSparse(*e, 0, "emb", {5}, {1}, 1).accepted);
    REQUIRE(PushSparse(*e, 0, "emb", {6}, {1}, 1).accepted);
    auto first = e->TakeCommitted();
    REQUIRE(first);
    REQUIRE(PushSparse(*e, 1, "emb", {4094, 4096, 8190, 8192, 11999}, {1, 2, 3, 4, 5}, 1).accepted);
    REQUIRE(PushSparse(*e, 1, "emb", {4095, 4097, 8191, 8193, 11999}, {6, 7, 8, 9, 5}, 1).accepted);
    auto second = e->TakeCommitted();
    REQUIRE(second);
    const Buffer& after = *second->variables[0].value;
    CHECK(after.copied_from() == first->variables[0].value->id());
    const std::vector<std::pair<uint64_t, uint64_t>> ranges{{4094 * 4, 16}, {8190 * 4, 16}, {11999 * 4, 4}};
    CHECK(after.changes() == ranges);
    for (const auto& [name, slot] : second->variables[0].slots) {
      INFO(name);
      CHECK(slot->changes() == ranges);
    }
    if (std::string(optimizer) == "sgd") {  // lr 1, MEAN per row: each row moved by its own average
      const std::vector<float> v = Read(*e, "emb");
      CHECK(v[4094] == 0.0f);
      CHECK(v[4095] == -5.0f);
      CHECK(v[4096] == -1.0f);
      CHECK(v[8193] == -8.0f);
      CHECK(v[11999] == -4.0f);  // (5 + 5) / 2
      CHECK(v[4093] == 1.0f);
    }
  }
}

TEST_CASE(
    "a step whose rows crowd one stripe: the next steps' rows dealt finely, applied in index ranges, listed in "
    "order",
    "[engine][sparse][replicas]") {
  // 300000 rows: 64 stripes, dealt 4096 rows at a time at first. Step 0's rows (0..4095) all fall
  // in the first stripe, more than an adder's share (2 adders: -N 2, 4 I/O threads), so step 1's
  // are dealt 64 at a time and applied in contiguous index ranges on the apply threads: every row
  // moved by its own average, the value's and the slots' lists of changes in index order.
  for (const char* optimizer : {"sgd", "adam"}) {
    INFO(optimizer);
    ServerConfig c = Cfg(2, 2);
    c.optimizer.name = optimizer;
    c.io_threads = 4;
    auto e = Make(c);
    e->set_keep_committed(true);
    const int64_t rows = 300000;
    Create(*e, "emb", std::vector<float>(rows, 1.0f), {rows, 1});
    std::vector<int64_t> low, high, all;
    for (int64_t r = 0; r < 4096; ++r) (r < 2048 ? low : high).push_back(r);
    all = low;
    all.insert(all.end(), high.begin(), high.end());
    REQUIRE(PushSparse(*e, 0, "emb", low, std::vector<float>(low.size(), 1), 1).accepted);
    REQUIRE(PushSparse(*e, 0, "emb", high, std::vector<float>(high.size(), 1), 1).accepted);
    auto first = e->TakeCommitted();
    REQUIRE(first);
    CHECK(e->LastSparseGranuleRows("emb") == SparseAccumulator::kCoarseGranuleRows);
    // Step 1: the first push holds the upper half of every 64-row granule (3 each), the second
    // every row, each its own value (row / 1000), and the last row: in each fine stripe the upper
    // rows arrive first, so where a row's sum lies is not its place in index order.
    std::vector<int64_t> upper, every = all;
    for (int64_t r : all) {
      if (r % 64 >= 32) upper.push_back(r);
    }
    every.push_back(rows - 1);
    std::vector<float> own;
    for (int64_t r : every) own.push_back(static_cast<float>(r) / 1000);
    REQUIRE(PushSparse(*e, 1, "emb", upper, std::vector<float>(upper.size(), 3), 1).accepted);
    REQUIRE(PushSparse(*e, 1, "emb", every, own, 1).accepted);
    auto second = e->TakeCommitted();
    REQUIRE(second);
    CHECK(e->LastSparseGranuleRows("emb") == SparseAccumulator::kFineGranuleRows);
    const Buffer& after = *second->variables[0].value;
    CHECK(after.copied_from() == first->variables[0].value->id());
    const std::vector<std::pair<uint64_t, uint64_t>> ranges{{0, 4096 * 4}, {(rows - 1) * 4, 4}};
    CHECK(after.changes() == ranges);
    for (const auto& [name, slot] : second->variables[0].slots) {
      INFO(name);
      CHECK(slot->changes() == ranges);
    }
    if (std::string(optimizer) == "sgd") {  // lr 1, MEAN per row: 1 - 1 at step 0, then each row's mean
      const std::vector<float> v = Read(*e, "emb");
      for (int64_t r = 0; r < 4096; ++r) {
        const float mine = static_cast<float>(r) / 1000;
        INFO("row " << r);
        REQUIRE(v[static_cast<size_t>(r)] == (r % 64 >= 32 ? 0.0f - (3.0f + mine) / 2.0f : 0.0f - mine));
      }
      CHECK(v[rows - 1] == 1.0f - static_cast<float>(rows - 1) / 1000);
      CHECK(v[4096] == 1.0f);
      CHECK(v[rows - 2] == 1.0f);
    }
  }
}

TEST_CASE("a sparse gradient kept until its last frame is charged to --max-model-bytes while it is kept",
          "[engine][sparse]") {
  ServerConfig c = Cfg(1, 1);
  auto e = Make(c);
  Create(*e, "emb", std::vector<float>(100), {100, 1});
  REQUIRE(PushSparse(*e, 0, "emb", {0}, {1}, 1).accepted);  // the bookkeeping's charge, once
  const uint64_t base = e->Stats().model_bytes;
  std::vector<GradOutcome> out;
  auto part = [&](int64_t step, std::vector<int64_t> idx, bool more, uint64_t source) {
    std::vector<float> values(idx.size(), 1.0f);
    GradRef ref{"emb", DType::kFloat32, {static_cast<int64_t>(idx.size()), 1}, values.data(), values.size() * 4};
    ref.indices = idx.data();
    ref.nnz = static_cast<int64_t>(idx.size());
    ref.rows_more = more;
    ref.source = source;
    return e->Push(step, {ref}, &out, {}, more);
  };
  REQUIRE(part(1, {1, 2}, true, 7).ok());
  CHECK(e->Stats().model_bytes == base + 2 * 8 + 2 * 4);  // its rows so far: indices and values
  REQUIRE(part(1, {3}, false, 7).ok());                   // the last frame: added whole, let go
  CHECK(e->Stats().model_bytes == base);
  CHECK(e->global_step() == 2);
  CHECK(Read(*e, "emb")[2] == -1.0f);
  SECTION("a frame whose rows do not fit is refused, naming the flag; a cut-off push gives back what it held") {
    e = nullptr;
    c.max_model_bytes = base + 100;
    e = Make(c);
    Create(*e, "emb", std::vector<float>(100), {100, 1});
    REQUIRE(PushSparse(*e, 0, "emb", {0}, {1}, 1).accepted);
    REQUIRE(e->Stats().model_bytes == base);
    REQUIRE(part(1, {1, 2}, true, 7).ok());
    const Status refused = part(1, {10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, true, 7);
    CHECK(refused.code() == Code::kResourceExhausted);
    CHECK_THAT(refused.message(), Catch::Contains("--max-model-bytes"));
    CHECK_THAT(refused.message(), Catch::Contains("several frames"));
    CHECK(e->Stats().model_bytes == base + 24);  // nothing more charged
    e->DropUnfinishedChunks(7);                  // as the connection does for a refused frame
    CHECK(e->Stats().model_bytes == base);
    CHECK(e->global_step() == 1);  // nothing of it counted
  }
  SECTION("the refusal comes before any gradient of the push is added") {
    e = nullptr;
    c.max_model_bytes = base + 1024 + 16 + 8;  // room for a small dense variable, and less than 24 more
    e = Make(c);
    Create(*e, "emb", std::vector<float>(100), {100, 1});
    REQUIRE(PushSparse(*e, 0, "emb", {0}, {1}, 1).accepted);
    Create(*e, "dense", {5}, {1});
    const uint64_t held = e->Stats().model_bytes;
    const int64_t accepted = e->Stats().accepted;
    std::vector<float> one{1.0f}, rows(3, 1.0f);
    std::vector<int64_t> idx{1, 2, 3};
    GradRef dense{"dense", DType::kFloat32, {1}, one.data(), 4};
    GradRef sparse{"emb", DType::kFloat32, {3, 1}, rows.data(), 12};
    sparse.indices = idx.data();
    sparse.nnz = 3;
    sparse.rows_more = true;
    sparse.source = 9;
    const Status refused = e->Push(1, {dense, sparse}, &out, {}, /*more=*/true);
    CHECK(refused.code() == Code::kResourceExhausted);
    CHECK(e->Stats().accepted == accepted);  // the dense gradient before it was not added either
    CHECK(e->Stats().model_bytes == held);
    CHECK(PushDense(*e, 1, "dense", {1}, {1}).accepted);  // and may be sent again, once
    CHECK(PushSparse(*e, 1, "emb", {4}, {1}, 1).accepted);
    CHECK(e->global_step() == 2);
    CHECK(Read(*e, "dense")[0] == 4.0f);  // 5 - lr 1 x 1, not x 2
  }
}
