// The daemon-side SyncReplicasOptimizer, step by step (tf_semantics.md sections 1 and 3).
#include "core/training_engine.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "config/server_config.h"
#include "core/accumulator.h"
#include "support/failing_storage.h"

using namespace psd;
using namespace psd::server;

namespace {

ServerConfig Config(int replicas, int total, int init_tokens, double lr = 2.0) {
  ServerConfig c;
  c.replicas_to_aggregate = replicas;
  c.total_replicas = total;
  c.init_tokens = init_tokens;
  c.optimizer.learning_rate = lr;
  REQUIRE(c.Validate().ok());
  return c;
}

struct Engine {
  explicit Engine(const ServerConfig& c) : engine(c, std::move(*MakeOptimizer(c.optimizer))) {
    engine.PushInitTokens(c.resolved_init_tokens);
  }

  template <typename T = float>
  void Create(const std::string& name, std::vector<T> init, Shape shape = {}) {
    VariableDef d;
    d.name = name;
    d.dtype = sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64;
    d.shape = shape;
    d.initial = init.data();
    d.initial_bytes = init.size() * sizeof(T);
    auto r = engine.CreateVariable(d);
    REQUIRE(r.ok());
  }

  // Pushes one scalar gradient per variable; returns accepted flags.
  template <typename T = float>
  std::vector<bool> Push(int64_t local_step, std::vector<std::pair<std::string, T>> grads) {
    std::vector<GradRef> refs;
    for (auto& [name, g] : grads) {
      refs.push_back({name, sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64, {}, &g, sizeof(T)});
    }
    std::vector<GradOutcome> out;
    Status s = engine.Push(local_step, refs, &out);
    INFO(s.ToString());
    REQUIRE(s.ok());
    std::vector<bool> accepted;
    for (auto& o : out) accepted.push_back(o.accepted);
    return accepted;
  }

  int64_t TakeToken() {
    int64_t token = -1;
    auto id = engine.tokens().Wait([&](Status s, int64_t t) { token = s.ok() ? t : -2; });
    REQUIRE(id == 0);  // a token must be available: these tests never block
    return token;
  }

  template <typename T = float>
  T Value(const std::string& name, int64_t* step = nullptr) {
    std::vector<PulledValue> vals;
    int64_t s = 0;
    REQUIRE(engine.Pull({name}, &vals, &s).ok());
    if (step) *step = s;
    return vals[0].value->as<T>()[0];
  }

  TrainingEngine engine;
};

}  // namespace

TEMPLATE_TEST_CASE("two workers, two to aggregate: one wasted step with default init tokens", "[engine]", float,
                   double) {
  using T = TestType;
  Engine e(Config(2, 2, -1));  // TF default: R = 2 init tokens carrying step 0
  e.Create<T>("var_0", {0.0});
  e.Create<T>("var_1", {1.0});
  CHECK(e.engine.tokens().size() == 2);

  // Worker 0 pushes and takes an init token; nothing is applied yet.
  CHECK(e.Push<T>(0, {{"var_0", T(0.1)}, {"var_1", T(0.9)}}) == std::vector<bool>{true, true});
  CHECK(e.TakeToken() == 0);
  CHECK(e.engine.global_step() == 0);
  CHECK(e.Value<T>("var_0") == T(0.0));

  // Worker 1's gradients complete the step: mean, SGD with lr 2, step 1, two tokens of 1.
  CHECK(e.Push<T>(0, {{"var_0", T(0.3)}, {"var_1", T(1.1)}}) == std::vector<bool>{true, true});
  CHECK(e.engine.global_step() == 1);
  int64_t step = -1;
  CHECK(e.Value<T>("var_0", &step) == Approx(0.0 - 2.0 * (0.1 + 0.3) / 2));
  CHECK(step == 1);
  CHECK(e.Value<T>("var_1") == Approx(1.0 - 2.0 * (0.9 + 1.1) / 2));
  CHECK(e.TakeToken() == 0);  // worker 1 gets the second init token
  CHECK(e.engine.tokens().size() == 2);

  // Both workers' next gradients are tagged 0 < 1: dropped (TF's "wasted" step).
  CHECK(e.Push<T>(0, {{"var_0", T(5)}, {"var_1", T(5)}}) == std::vector<bool>{false, false});
  CHECK(e.TakeToken() == 1);
  CHECK(e.Push<T>(0, {{"var_0", T(5)}, {"var_1", T(5)}}) == std::vector<bool>{false, false});
  CHECK(e.TakeToken() == 1);
  CHECK(e.engine.global_step() == 1);

  // Now both are at local step 1 and the next step goes through.
  CHECK(e.Push<T>(1, {{"var_0", T(0.1)}, {"var_1", T(0.1)}}) == std::vector<bool>{true, true});
  CHECK(e.Push<T>(1, {{"var_0", T(0.3)}, {"var_1", T(0.3)}}) == std::vector<bool>{true, true});
  CHECK(e.engine.global_step() == 2);
  CHECK(e.Value<T>("var_0") == Approx(-0.4 - 2.0 * 0.2));
  CHECK(e.TakeToken() == 2);
  auto stats = e.engine.Stats();
  CHECK(stats.accepted == 8);
  CHECK(stats.stale == 4);
}

TEST_CASE("three workers, two to aggregate, one backup: the late gradient is dropped", "[engine]") {
  Engine e(Config(2, 3, 0, 1.0));  // minimum init tokens (R - N < 0): nothing wasted
  e.Create("w", {1.0f});
  CHECK(e.Push(0, {{"w", 0.2f}})[0]);
  CHECK(e.Push(0, {{"w", 0.4f}})[0]);  // the step commits without the third worker
  CHECK(e.engine.global_step() == 1);
  CHECK(e.Value<float>("w") == Approx(1.0 - 0.3));
  CHECK(e.engine.tokens().size() == 3);       // max(N, R) tokens: the backup is not starved
  CHECK_FALSE(e.Push(0, {{"w", 100.f}})[0]);  // the straggler: stale, reported
  CHECK(e.Value<float>("w") == Approx(0.7));
  for (int i = 0; i < 3; ++i) CHECK(e.TakeToken() == 1);
  CHECK(e.Push(1, {{"w", 0.1f}})[0]);
  CHECK(e.Push(1, {{"w", 0.1f}})[0]);
  CHECK(e.engine.global_step() == 2);
}

TEST_CASE("fewer workers than replicas to aggregate: several batches per update", "[engine]") {
  Engine e(Config(3, 1, -1, 1.0));  // R=3 init tokens, 3 tokens per step
  e.Create("w", {0.0f});
  CHECK(e.Push(0, {{"w", 1.f}})[0]);
  CHECK(e.TakeToken() == 0);
  CHECK(e.Push(0, {{"w", 2.f}})[0]);
  CHECK(e.TakeToken() == 0);
  CHECK(e.Push(0, {{"w", 3.f}})[0]);
  CHECK(e.engine.global_step() == 1);
  CHECK(e.Value<float>("w") == Approx(-2.0));
  CHECK(e.TakeToken() == 0);
  CHECK(e.engine.tokens().size() == 3);
}

TEST_CASE("a pull never sees a half-applied step", "[engine]") {
  Engine e(Config(1, 1, 0, 1.0));
  e.Create("a", {10.0f});
  e.Create("b", {20.0f});
  CHECK(e.Push(0, {{"a", 1.f}})[0]);  // a is taken and applied (staged), b is not
  int64_t step = -1;
  CHECK(e.Value<float>("a", &step) == 10.0f);
  CHECK(step == 0);
  CHECK(e.Push(0, {{"b", 1.f}})[0]);
  CHECK(e.Value<float>("a", &step) == 9.0f);
  CHECK(e.Value<float>("b") == 19.0f);
  CHECK(step == 1);
}

TEST_CASE("an invalid push changes nothing", "[engine]") {
  Engine e(Config(2, 2, 0, 1.0));
  e.Create("a", {0.0f});
  e.Create("b", {0.0f, 0.0f}, {2});
  float g = 1;
  std::vector<float> bad(3, 1.f);
  std::vector<GradRef> refs{{"a", DType::kFloat32, {}, &g, 4}, {"b", DType::kFloat32, {3}, bad.data(), 12}};
  std::vector<GradOutcome> out;
  Status s = e.engine.Push(0, refs, &out);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("Shape mismatch: expected [2], got [3]"));
  // Unknown variable, duplicate variable.
  std::vector<GradRef> unknown{{"nope", DType::kFloat32, {}, &g, 4}};
  CHECK(e.engine.Push(0, unknown, &out).code() == Code::kNotFound);
  std::vector<GradRef> dup{{"a", DType::kFloat32, {}, &g, 4}, {"a", DType::kFloat32, {}, &g, 4}};
  CHECK(e.engine.Push(0, dup, &out).code() == Code::kInvalidArgument);
  // Had "a" counted the rejected push, one more gradient would complete its take.
  std::vector<float> two(2, 1.f);
  std::vector<GradRef> good{{"a", DType::kFloat32, {}, &g, 4}, {"b", DType::kFloat32, {2}, two.data(), 8}};
  REQUIRE(e.engine.Push(0, good, &out).ok());
  CHECK(e.engine.global_step() == 0);
  REQUIRE(e.engine.Push(0, good, &out).ok());
  CHECK(e.engine.global_step() == 1);
}

TEST_CASE("create-or-get is idempotent and rejects a different definition", "[engine]") {
  Engine e(Config(1, 1, 0));
  e.Create("w", {1.0f, 2.0f}, {2});
  VariableDef again;
  again.name = "w";
  again.dtype = DType::kFloat32;
  again.shape = {2};
  auto r = e.engine.CreateVariable(again);
  REQUIRE(r.ok());
  CHECK_FALSE(r->created);
  CHECK(e.Value<float>("w") == 1.0f);  // the first definition's value stands
  again.shape = {3};
  auto bad = e.engine.CreateVariable(again);
  CHECK(bad.status().code() == Code::kAlreadyExists);
  CHECK_THAT(bad.status().message(), Catch::Contains("[2]") && Catch::Contains("[3]"));
  again.shape = {2};
  again.dtype = DType::kFloat64;
  CHECK(e.engine.CreateVariable(again).status().code() == Code::kAlreadyExists);
  VariableDef badname;
  badname.name = "has space";
  CHECK(e.engine.CreateVariable(badname).status().code() == Code::kInvalidArgument);
  VariableDef badinit;
  badinit.name = "x";
  badinit.shape = {4};
  float one = 1;
  badinit.initial = &one;
  badinit.initial_bytes = 4;
  CHECK(e.engine.CreateVariable(badinit).status().code() == Code::kInvalidArgument);
}

TEST_CASE("lowering the requirement completes a step that was waiting", "[engine]") {
  Engine e(Config(3, 3, 0, 1.0));
  e.Create("w", {0.0f});
  CHECK(e.Push(0, {{"w", 2.f}})[0]);
  CHECK(e.Push(0, {{"w", 4.f}})[0]);
  CHECK(e.engine.global_step() == 0);
  e.engine.SetRequiredReplicas(2);  // a worker finished
  CHECK(e.engine.global_step() == 1);
  CHECK(e.Value<float>("w") == Approx(-3.0));
}

TEST_CASE("non-trainable variables take no gradients and do not hold steps", "[engine]") {
  Engine e(Config(1, 1, 0, 1.0));
  e.Create("w", {0.0f});
  VariableDef d;
  d.name = "counter";
  d.shape = {};
  d.trainable = false;
  REQUIRE(e.engine.CreateVariable(d).ok());
  float g = 1;
  std::vector<GradOutcome> out;
  std::vector<GradRef> refs{{"counter", DType::kFloat32, {}, &g, 4}};
  CHECK(e.engine.Push(0, refs, &out).code() == Code::kInvalidArgument);
  CHECK(e.Push(0, {{"w", 1.f}})[0]);
  CHECK(e.engine.global_step() == 1);
}

TEST_CASE("variables beyond --max-model-bytes are refused before anything is allocated", "[engine]") {
  ServerConfig c = Config(1, 1, 0);
  c.max_model_bytes = 4096;
  Engine e(c);
  VariableDef big;
  big.name = "big";
  big.shape = {1 << 20};
  auto r = e.engine.CreateVariable(big);
  CHECK(r.status().code() == Code::kResourceExhausted);
  CHECK_THAT(r.status().message(), Catch::Contains("--max-model-bytes"));
  VariableDef small;
  small.name = "small";
  small.shape = {64};  // 256 bytes, x4 for a trainable variable
  CHECK(e.engine.CreateVariable(small).ok());
  CHECK(e.engine.CreateVariable(small).ok());  // create-or-get costs nothing
  // Empty variables are not free: ever new names run into the limit too.
  int created = 0;
  Status last;
  for (int i = 0; i < 100 && last.ok(); ++i) {
    VariableDef empty;
    empty.name = "empty" + std::to_string(i);
    empty.shape = {0};
    last = e.engine.CreateVariable(empty).status();
    if (last.ok()) ++created;
  }
  CHECK(last.code() == Code::kResourceExhausted);
  CHECK(created == 2);  // 4096 bytes: the small variable (1024 + 1024) and two empty ones (1024 each)
}

namespace {

// A cluster shard's commit, as the coordinator sees it: every prepared step is recorded.
class RecordingCommit final : public StepCommit {
 public:
  explicit RecordingCommit(std::vector<PreparedStep>* seen) : seen_(seen) {}
  bool commits_locally() const override { return false; }
  void OnPrepared(const PreparedStep& p) override { seen_->push_back(p); }

 private:
  std::vector<PreparedStep>* seen_;
};

}  // namespace

TEST_CASE("step commit: a shard's engine reports a prepared step and publishes only at CommitPrepared",
          "[engine][step_commit]") {
  Engine e(Config(2, 2, 0, 1.0));
  std::vector<PreparedStep> seen;
  e.engine.set_step_commit(std::make_unique<RecordingCommit>(&seen));
  e.Create("w", std::vector<float>{10.0f});
  e.Push(0, {{"w", 2.0f}});
  CHECK(seen.empty());  // one of two gradients: not prepared yet
  e.Push(0, {{"w", 4.0f}});
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].step == 0);
  CHECK(seen[0].takes == 1);
  CHECK(seen[0].min_gradients == 2);
  CHECK(seen[0].max_gradients == 2);
  CHECK_FALSE(seen[0].forced);
  int64_t step = -1;
  CHECK(e.Value("w", &step) == 10.0f);  // staged, not published
  CHECK(step == 0);
  CHECK(e.engine.tokens().size() == 0);
  REQUIRE(e.engine.CommitPrepared(0, false, 0).ok());
  CHECK(e.Value("w", &step) == 7.0f);  // 10 - 1.0 * mean(2, 4)
  CHECK(step == 1);
  CHECK(e.engine.tokens().size() == 0);  // the chief's coordinator releases the tokens, not the shard
  CHECK(e.engine.CommitPrepared(0, false, 0).code() == Code::kFailedPrecondition);  // committed once
}

TEST_CASE("step commit: an engine with no trainable variable reports every step at once", "[engine][step_commit]") {
  Engine e(Config(1, 1, 0, 1.0));
  std::vector<PreparedStep> seen;
  e.engine.set_step_commit(std::make_unique<RecordingCommit>(&seen));
  e.engine.ReportIfIdle();
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].takes == 0);
  e.engine.ReportIfIdle();  // still prepared: not reported twice
  CHECK(seen.size() == 1);
  REQUIRE(e.engine.CommitPrepared(0, false, 0).ok());
  CHECK(e.engine.global_step() == 1);
}

TEST_CASE("the taken sum becomes the new value, and a buffer a reader holds is never reused", "[engine][memory]") {
  // One replica, SGD with lr 2: value -= 2 * g. The commit publishes the buffer the gradients
  // were summed in; the next step's sum goes into the retired value's buffer, unless a pull
  // still holds it.
  Engine e(Config(1, 1, 0));
  e.Create<float>("w", {10.0f, 20.0f, 30.0f}, {3});
  auto pull = [&] {
    std::vector<PulledValue> out;
    int64_t step = 0;
    REQUIRE(e.engine.Pull({"w"}, &out, &step).ok());
    REQUIRE(out.size() == 1);
    return out[0].value;
  };
  auto push = [&](int64_t step, std::vector<float> g) {
    std::vector<GradRef> refs = {{"w", DType::kFloat32, {3}, g.data(), g.size() * sizeof(float)}};
    std::vector<GradOutcome> out;
    REQUIRE(e.engine.Push(step, refs, &out).ok());
    REQUIRE(out[0].accepted);
  };
  auto values = [](const std::shared_ptr<const Buffer>& b) {
    const float* p = b->as<float>();
    return std::vector<float>(p, p + 3);
  };
  push(0, {1, 1, 1});
  auto held = pull();  // step 1's value, held across the next two steps
  CHECK(values(held) == std::vector<float>{8, 18, 28});
  push(1, {2, 2, 2});
  auto second = pull();
  CHECK(values(second) == std::vector<float>{4, 14, 24});
  push(2, {0.5f, 0.5f, 0.5f});  // the retired step-1 buffer is still held: the sum goes elsewhere
  CHECK(values(held) == std::vector<float>{8, 18, 28});
  CHECK(values(pull()) == std::vector<float>{3, 13, 23});
  CHECK(e.engine.global_step() == 3);
  // Nobody holds the retired buffers now: the steps go on reusing them, and the values stay right.
  held.reset();
  second.reset();
  for (int64_t s = 3; s < 6; ++s) push(s, {1, 1, 1});
  CHECK(values(pull()) == std::vector<float>{-3, 7, 17});
}

TEMPLATE_TEST_CASE("held gradients give the parameters of copied ones with every optimizer, whole and in chunks",
                   "[engine][held]", float, double) {
  using T = TestType;
  const DType dtype = sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64;
  // A variable whose apply is split over the apply threads (over 1 Mi elements, ending mid-block)
  // and a small one: the take's apply reads the held gradients in blocks (ApplyTaken), and each
  // block's slots must line up with its values.
  const int64_t big = (int64_t{1} << 20) + 700, small = 1000;
  const std::string optimizer = GENERATE("sgd", "momentum", "adagrad", "adam", "rmsprop", "ftrl");
  const bool chunks = GENERATE(false, true);
  INFO(optimizer << (chunks ? ", in chunks" : ", whole"));
  ServerConfig c = Config(2, 2, -1, 0.1);
  c.optimizer.name = optimizer;
  c.apply_threads = 2;
  REQUIRE(c.Validate().ok());
  Engine plain(c), held(c);
  for (Engine* e : {&plain, &held}) {
    std::vector<T> w(static_cast<size_t>(big)), b(static_cast<size_t>(small));
    for (size_t i = 0; i < w.size(); ++i) w[i] = T(0.5) + static_cast<T>(i % 97) * T(0.01);
    for (size_t i = 0; i < b.size(); ++i) b[i] = T(-0.25) + static_cast<T>(i % 13) * T(0.03);
    e->Create<T>("w", w, {big});
    e->Create<T>("b", b, {small});
  }
  auto hold = std::make_shared<int>(0);
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<std::vector<T>> grads;  // left as they are until the step's take, as a worker does
    for (int k = 0; k < 2; ++k) {
      auto gradient = [&](int64_t n) {
        std::vector<T> g(static_cast<size_t>(n));
        for (size_t i = 0; i < g.size(); ++i) {
          g[i] = static_cast<T>(static_cast<int64_t>((i * 7 + static_cast<size_t>(k) * 13 + step * 5) % 101) - 50) *
                 T(0.001);
        }
        return g;
      };
      grads.push_back(gradient(big));
      grads.push_back(gradient(small));
      const std::vector<T>& gw = grads[grads.size() - 2];
      const std::vector<T>& gb = grads.back();
      for (Engine* e : {&plain, &held}) {
        const auto h = e == &held ? std::shared_ptr<const void>(hold) : nullptr;
        std::vector<GradOutcome> out;
        if (!chunks) {
          std::vector<GradRef> refs = {{"w", dtype, {big}, gw.data(), gw.size() * sizeof(T)},
                                       {"b", dtype, {small}, gb.data(), gb.size() * sizeof(T)}};
          for (GradRef& r : refs) r.hold = h;
          REQUIRE(e->engine.Push(step, refs, &out).ok());
        } else {  // "w" in two frames' chunks (the first ends at a part boundary), "b" whole with the last
          const int64_t cut = 301 * TrainingEngine::kChunkElements;
          GradRef first{"w", dtype, {cut}, gw.data(), static_cast<size_t>(cut) * sizeof(T)};
          first.chunk_offset = 0;
          first.hold = h;
          REQUIRE(e->engine.Push(step, {first}, &out, {}, /*more=*/true).ok());
          GradRef rest{"w", dtype, {big - cut}, gw.data() + cut, static_cast<size_t>(big - cut) * sizeof(T)};
          rest.chunk_offset = cut;
          rest.hold = h;
          GradRef whole{"b", dtype, {small}, gb.data(), gb.size() * sizeof(T)};
          whole.hold = h;
          REQUIRE(e->engine.Push(step, {rest, whole}, &out).ok());
        }
      }
    }
    CHECK(hold.use_count() == 1);  // the take's apply read them and let them go
    for (const char* name : {"w", "b"}) {
      std::vector<PulledValue> a, b;
      int64_t sa = 0, sb = 0;
      REQUIRE(plain.engine.Pull({name}, &a, &sa).ok());
      REQUIRE(held.engine.Pull({name}, &b, &sb).ok());
      CHECK(sa == step + 1);
      CHECK(sb == step + 1);
      REQUIRE(a[0].value->bytes() == b[0].value->bytes());
      INFO(name << " at step " << step + 1);
      CHECK(std::memcmp(a[0].value->data(), b[0].value->data(), a[0].value->bytes()) == 0);
    }
  }
}

namespace {

// An engine (2 replicas, SGD at 0.5) with "w", over 256 KiB (its sum's buffer comes from the
// storage) and a few stripes, and two gradients; step 0 committed while a reader keeps step 0's
// value, so the buffer that commit retired is not free to be step 1's sum.
struct AfterStepZero {
  AfterStepZero() : e(Config(2, 2, 0, 0.5)) {
    for (size_t i = 0; i < g0.size(); ++i) {
      g0[i] = static_cast<float>(i % 5);
      g1[i] = static_cast<float>(i % 3) - 1.0f;
    }
    e.Create<float>("w", w, {n});
    int64_t step = 0;
    REQUIRE(e.engine.Pull({"w"}, &reader, &step).ok());
    Push(0, g0, nullptr);
    Push(0, g1, nullptr);
    REQUIRE(e.engine.global_step() == 1);
  }
  // A gradient of "w" for `step`; `hold`: the engine may point at its bytes (a same-host worker's).
  void Push(int64_t step, const std::vector<float>& g, std::shared_ptr<const void> hold) {
    GradRef r{"w", DType::kFloat32, {n}, g.data(), g.size() * sizeof(float)};
    r.hold = std::move(hold);
    std::vector<GradOutcome> out;
    Status s = e.engine.Push(step, {r}, &out);
    INFO(s.ToString());
    REQUIRE(s.ok());
    REQUIRE(out.size() == 1);
    CHECK(out[0].accepted);
  }
  // Elements of "w" that are not what two steps of (g0 + g1) / 2 give.
  int64_t WrongAfterTwoSteps() {
    std::vector<PulledValue> vals;
    int64_t step = -1;
    REQUIRE(e.engine.Pull({"w"}, &vals, &step).ok());
    CHECK(step == 2);
    const float* got = vals[0].value->as<float>();
    int64_t wrong = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      const float once = 1.0f - 0.5f * ((g0[i] + g1[i]) / 2.0f);
      wrong += got[i] == once - 0.5f * ((g0[i] + g1[i]) / 2.0f) ? 0 : 1;
    }
    return wrong;
  }

  Engine e;
  const int64_t n = 3 * DenseAccumulator::kStripeElements + 7;
  std::vector<float> w = std::vector<float>(static_cast<size_t>(n), 1.0f);
  std::vector<float> g0 = std::vector<float>(static_cast<size_t>(n));
  std::vector<float> g1 = std::vector<float>(static_cast<size_t>(n));
  std::vector<PulledValue> reader;
};

}  // namespace

TEST_CASE("a take that runs out of memory leaves its step open, and a retry takes it", "[engine][oom]") {
  psd::testing::ActiveStorage storage;
  AfterStepZero z;
  int deferred = 0;
  z.e.engine.set_on_take_deferred([&] { ++deferred; });
  // Held gradients (a same-host worker's) write no sum: step 1's take needs a new buffer.
  auto hold = std::make_shared<int>(0);
  z.Push(1, z.g0, hold);
  storage->FailNext();
  z.Push(1, z.g1, hold);  // added and counted; its take finds no memory: before, the push failed (its gradient counted)
  REQUIRE_FALSE(storage->armed());
  CHECK(deferred == 1);
  CHECK(z.e.engine.global_step() == 1);
  z.e.engine.RetryDeferredTakes();
  CHECK(z.e.engine.global_step() == 2);
  z.e.engine.RetryDeferredTakes();  // nothing deferred any more
  CHECK(z.e.engine.global_step() == 2);
  CHECK(deferred == 1);
  CHECK(z.WrongAfterTwoSteps() == 0);
  CHECK(hold.use_count() == 1);  // the take's apply read the held gradients and let them go
}

TEST_CASE("held gradients that find no memory to be copied out stay held, and a later try copies them",
          "[engine][oom][held]") {
  psd::testing::ActiveStorage storage;
  AfterStepZero z;
  // A same-host worker's gradient, in its segment: the accumulator points at it, no sum written.
  std::vector<float> segment(z.g0);
  auto hold = std::make_shared<int>(0);
  z.Push(1, segment, hold);
  CHECK(hold.use_count() > 1);
  // Its answer copies what is pointed at into the sum, which needs a buffer: none to be had.
  storage->FailNext();
  CHECK_FALSE(z.e.engine.ResolveHeld());
  REQUIRE_FALSE(storage->armed());
  CHECK(hold.use_count() > 1);  // still held: the worker is not answered, its bytes stay as they are
  CHECK(z.e.engine.ResolveHeld());
  CHECK(hold.use_count() == 1);  // copied: the worker may write its segment again
  std::fill(segment.begin(), segment.end(), 1e30f);
  std::vector<PulledValue> reader1;  // keeps step 1's value, which step 1's commit retires
  int64_t step = -1;
  REQUIRE(z.e.engine.Pull({"w"}, &reader1, &step).ok());
  z.Push(1, z.g1, nullptr);
  REQUIRE(z.e.engine.global_step() == 2);
  CHECK(z.WrongAfterTwoSteps() == 0);
  // The retired buffer, read when the gradient came, is free when it is copied out: the copy goes
  // there, and nothing is allocated.
  z.Push(2, segment, hold);
  CHECK(hold.use_count() > 1);
  reader1.clear();
  storage->FailNext();
  CHECK(z.e.engine.ResolveHeld());
  CHECK(storage->armed());
  CHECK(hold.use_count() == 1);
}

TEST_CASE("a forced take that ran out of memory is forced again only while its step is open", "[engine][oom]") {
  psd::testing::ActiveStorage storage;
  Engine e(Config(2, 2, 0, 0.5));
  const int64_t n = 3 * DenseAccumulator::kStripeElements + 7;
  std::vector<float> w(static_cast<size_t>(n), 1.0f), g(static_cast<size_t>(n), 2.0f);
  e.Create<float>("w", w, {n});
  int deferred = 0;
  e.engine.set_on_take_deferred([&] { ++deferred; });
  auto push = [&](int64_t step, std::shared_ptr<const void> hold) {
    GradRef r{"w", DType::kFloat32, {n}, g.data(), g.size() * sizeof(float)};
    r.hold = std::move(hold);
    std::vector<GradOutcome> out;
    REQUIRE(e.engine.Push(step, {r}, &out).ok());
  };
  std::vector<PulledValue> reader;  // keeps step 0's value: no spare to be step 1's sum
  int64_t step = 0;
  REQUIRE(e.engine.Pull({"w"}, &reader, &step).ok());
  push(0, nullptr);
  push(0, nullptr);
  REQUIRE(e.engine.global_step() == 1);
  auto hold = std::make_shared<int>(0);
  push(1, hold);  // held: no sum written
  storage->FailNext();
  e.engine.ForceStep(1);  // the step deadline: its forced take finds no memory
  REQUIRE_FALSE(storage->armed());
  CHECK(deferred == 1);
  CHECK(e.engine.global_step() == 1);
  push(1, hold);  // the second gradient comes in time after all: the step is taken as usual
  CHECK(e.engine.global_step() == 2);
  // The retry finds step 1 committed: it forces nothing (a forced step 2 would commit it empty).
  e.engine.RetryDeferredTakes();
  CHECK(e.engine.global_step() == 2);
  REQUIRE(e.engine.Pull({"w"}, &reader, &step).ok());
  CHECK(step == 2);
  CHECK(reader[0].value->as<float>()[0] == 1.0f - 0.5f * 2.0f - 0.5f * 2.0f);
}

namespace {

// A sparse gradient of `rows` (each row `width` copies of `value`) to "emb" at `step`.
void PushRows(TrainingEngine& e, int64_t step, std::vector<int64_t> rows, int64_t width, float value) {
  std::vector<float> values(rows.size() * static_cast<size_t>(width), value);
  GradRef r{"emb", DType::kFloat32, {static_cast<int64_t>(rows.size()), width}, values.data(), values.size() * 4};
  r.indices = rows.data();
  r.nnz = static_cast<int64_t>(rows.size());
  std::vector<GradOutcome> out;
  Status s = e.Push(step, {r}, &out);
  INFO(s.ToString());
  REQUIRE(s.ok());
  REQUIRE(out.size() == 1);
  CHECK(out[0].accepted);
}

// Both snapshots' values and slots, byte for byte.
void CheckSameState(const ShardSnapshot& a, const ShardSnapshot& b) {
  CHECK(a.step == b.step);
  REQUIRE(a.variables.size() == b.variables.size());
  for (size_t i = 0; i < a.variables.size(); ++i) {
    const VariableSnapshot& x = a.variables[i];
    const VariableSnapshot& y = b.variables[i];
    INFO(x.name << " at step " << a.step);
    REQUIRE(x.value->bytes() == y.value->bytes());
    CHECK(std::memcmp(x.value->data(), y.value->data(), x.value->bytes()) == 0);
    REQUIRE(x.slots.size() == y.slots.size());
    for (size_t k = 0; k < x.slots.size(); ++k) {
      INFO(x.slots[k].first);
      REQUIRE(x.slots[k].second->bytes() == y.slots[k].second->bytes());
      CHECK(std::memcmp(x.slots[k].second->data(), y.slots[k].second->data(), x.slots[k].second->bytes()) == 0);
    }
  }
}

}  // namespace

TEST_CASE("a commit that runs out of memory for a sparse variable's copy commits nothing, and a retry commits it",
          "[engine][oom][sparse]") {
  psd::testing::ActiveStorage storage;
  Engine e(Config(2, 2, 0, 0.5));
  const int64_t rows = 1024, width = 128;  // 512 KiB: the value's copy comes from the storage
  e.Create<float>("emb", std::vector<float>(static_cast<size_t>(rows * width), 1.0f), {rows, width});
  int deferred = 0;
  e.engine.set_on_take_deferred([&] { ++deferred; });
  // A reader holds step 0's value: the commit's update writes a copy of it, not the value read.
  std::vector<PulledValue> reader;
  int64_t step = -1;
  REQUIRE(e.engine.Pull({"emb"}, &reader, &step).ok());
  PushRows(e.engine, 0, {1, 5}, width, 2.0f);
  storage->FailNext();
  PushRows(e.engine, 0, {5, 9}, width, 4.0f);  // accepted; the commit finds no memory for the copy
  REQUIRE_FALSE(storage->armed());
  CHECK(deferred == 1);
  // Nothing of the step happened: the step, the value, the tokens (before, the push threw with
  // the step half committed).
  CHECK(e.engine.global_step() == 0);
  CHECK(e.engine.tokens().size() == 0);
  std::vector<PulledValue> now;
  REQUIRE(e.engine.Pull({"emb"}, &now, &step).ok());
  CHECK(step == 0);
  CHECK(now[0].value->as<float>()[5 * width] == 1.0f);
  now.clear();
  e.engine.RetryDeferredTakes();
  CHECK(e.engine.global_step() == 1);
  CHECK(e.engine.tokens().size() == 2);
  CHECK(deferred == 1);
  REQUIRE(e.engine.Pull({"emb"}, &now, &step).ok());
  CHECK(step == 1);
  const float* got = now[0].value->as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    // Rows 1 and 9 from one gradient each, row 5 the mean of two; the rest untouched.
    const float want = r == 1 ? 0.0f : r == 5 ? -0.5f : r == 9 ? -1.0f : 1.0f;
    INFO("row " << r);
    REQUIRE(got[r * width] == want);
    REQUIRE(got[r * width + width - 1] == want);
  }
  CHECK(reader[0].value->as<float>()[5 * width] == 1.0f);  // the reader's value is as it was
  e.engine.RetryDeferredTakes();                           // nothing deferred any more
  CHECK(e.engine.global_step() == 1);
  PushRows(e.engine, 1, {0}, width, 1.0f);
  PushRows(e.engine, 1, {0}, width, 1.0f);
  CHECK(e.engine.global_step() == 2);
}

TEST_CASE("a variable created while a commit waits for memory joins the next step", "[engine][oom][sparse]") {
  psd::testing::ActiveStorage storage;
  Engine e(Config(2, 2, 0, 0.5));
  const int64_t rows = 1024, width = 128;
  e.Create<float>("emb", std::vector<float>(static_cast<size_t>(rows * width), 1.0f), {rows, width});
  e.engine.set_on_take_deferred([] {});
  std::vector<PulledValue> reader;  // the commit's update writes a copy
  int64_t step = -1;
  REQUIRE(e.engine.Pull({"emb"}, &reader, &step).ok());
  PushRows(e.engine, 0, {1}, width, 2.0f);
  storage->FailNext();
  PushRows(e.engine, 0, {2}, width, 2.0f);
  REQUIRE_FALSE(storage->armed());
  REQUIRE(e.engine.global_step() == 0);
  // Created now, it has no gradient of step 0 to wait for: the retry commits step 0 (before, the
  // new variable held the commit, or a later take committed twice).
  e.Create<float>("late", {5.0f});
  e.engine.RetryDeferredTakes();
  CHECK(e.engine.global_step() == 1);
  CHECK(e.Value("late") == 5.0f);
  PushRows(e.engine, 1, {3}, width, 2.0f);
  PushRows(e.engine, 1, {3}, width, 2.0f);
  CHECK(e.engine.global_step() == 1);  // "late" is in step 1
  CHECK(e.Push(1, {{"late", 2.0f}}) == std::vector<bool>{true});
  CHECK(e.Push(1, {{"late", 4.0f}}) == std::vector<bool>{true});
  CHECK(e.engine.global_step() == 2);
  CHECK(e.Value("late") == 5.0f - 0.5f * 3.0f);
  e.engine.RetryDeferredTakes();  // nothing deferred: no second commit
  CHECK(e.engine.global_step() == 2);
}

TEST_CASE("a commit that waits for memory with no retry armed is tried again at the next push",
          "[engine][oom][sparse]") {
  psd::testing::ActiveStorage storage;
  int calls = 0;  // (before the engine: its callback counts here)
  Engine e(Config(2, 2, 0, 0.5));
  const int64_t rows = 1024, width = 128;
  e.Create<float>("emb", std::vector<float>(static_cast<size_t>(rows * width), 1.0f), {rows, width});
  e.engine.set_on_take_deferred([&] {
    ++calls;
    throw std::bad_alloc();  // the daemon could not post its retry either
  });
  std::vector<PulledValue> reader;
  int64_t step = -1;
  REQUIRE(e.engine.Pull({"emb"}, &reader, &step).ok());
  PushRows(e.engine, 0, {1}, width, 2.0f);
  storage->FailNext(2);  // the commit, and its retry at the end of the same push
  PushRows(e.engine, 0, {2}, width, 2.0f);
  REQUIRE_FALSE(storage->armed());
  CHECK(calls == 2);
  CHECK(e.engine.global_step() == 0);
  // A worker that gave up waiting pushes again (stale now): the commit is tried, and made.
  std::vector<float> values(static_cast<size_t>(width), 1.0f);
  int64_t row = 4;
  GradRef r{"emb", DType::kFloat32, {1, width}, values.data(), values.size() * 4};
  r.indices = &row;
  r.nnz = 1;
  std::vector<GradOutcome> out;
  REQUIRE(e.engine.Push(0, {r}, &out).ok());
  CHECK_FALSE(out[0].accepted);
  CHECK(e.engine.global_step() == 1);
  CHECK(e.engine.tokens().size() == 2);
  CHECK(calls == 2);
  std::vector<PulledValue> now;
  REQUIRE(e.engine.Pull({"emb"}, &now, &step).ok());
  CHECK(step == 1);
  for (int64_t k = 0; k < 5; ++k) {  // rows 1 and 2 from one gradient each; the stale row 4 is not in it
    INFO("row " << k);
    CHECK(now[0].value->as<float>()[k * width] == (k == 1 || k == 2 ? 0.0f : 1.0f));
  }
  CHECK(reader[0].value->as<float>()[width] == 1.0f);
}

TEST_CASE("a commit whose snapshot runs out of memory commits, and the next commit takes the snapshot",
          "[engine][oom]") {
  psd::testing::ActiveStorage storage;
  // Momentum: a slot, copied at each snapshot (over 256 KiB: from the storage). The engine under
  // test checkpoints every 2 steps; its twin, which never runs out, every step.
  auto config = [](int every) {
    ServerConfig c = Config(2, 2, 0, 0.5);
    c.optimizer.name = "momentum";
    c.checkpoint_every_steps = every;
    return c;
  };
  Engine e(config(2)), twin(config(1));
  const int64_t n = 3 * DenseAccumulator::kStripeElements + 7;
  std::vector<float> w(static_cast<size_t>(n), 1.0f);
  std::vector<ShardSnapshot> snapshots, twins;
  for (Engine* x : {&e, &twin}) x->Create<float>("w", w, {n});
  e.engine.set_on_snapshot([&](ShardSnapshot s) { snapshots.push_back(std::move(s)); });
  twin.engine.set_on_snapshot([&](ShardSnapshot s) { twins.push_back(std::move(s)); });
  auto push = [n](TrainingEngine& x, int64_t step, float g) {
    std::vector<float> grad(static_cast<size_t>(n), g);
    std::vector<GradOutcome> out;
    Status s = x.Push(step, {{"w", DType::kFloat32, {n}, grad.data(), grad.size() * 4}}, &out);
    INFO(s.ToString());
    REQUIRE(s.ok());
  };
  for (int64_t step = 0; step < 4; ++step) {
    for (Engine* x : {&e, &twin}) {
      push(x->engine, step, 1.0f + static_cast<float>(step));
      if (x == &e && step == 1) storage->FailNext();  // step 2's snapshot (its slot's copy)
      push(x->engine, step, 2.0f);
      CHECK(x->engine.global_step() == step + 1);
      CHECK(x->TakeToken() == step + 1);  // its tokens went out
      CHECK(x->TakeToken() == step + 1);
    }
    if (step == 1) REQUIRE_FALSE(storage->armed());
  }
  // Step 2's checkpoint missed; taken at step 3's commit instead, then step 4's as planned.
  REQUIRE(snapshots.size() == 2);
  REQUIRE(twins.size() == 4);
  CHECK(snapshots[0].step == 3);
  CHECK(snapshots[1].step == 4);
  CheckSameState(snapshots[0], twins[2]);
  CheckSameState(snapshots[1], twins[3]);
}

TEST_CASE("a replica's copy that runs out of memory is missed, and the copies after it are whole and right",
          "[engine][oom][replicas]") {
  psd::testing::ActiveStorage storage;
  ServerConfig c = Config(2, 2, 0, 0.5);
  c.optimizer.name = "adam";  // two slots, updated in place: their copies are brought up to date from lists
  Engine e(c), twin(c);
  const int64_t rows = 1024, width = 128;
  for (Engine* x : {&e, &twin}) {
    x->Create<float>("emb", std::vector<float>(static_cast<size_t>(rows * width), 1.0f), {rows, width});
    x->engine.set_keep_committed(true);
  }
  for (int64_t step = 0; step < 8; ++step) {
    for (Engine* x : {&e, &twin}) {
      PushRows(x->engine, step, {step, 100 + step}, width, 1.0f);
      // Step 3's copy (its first slot's; from step 4 on the oldest of three kept copies is reused).
      if (x == &e && step == 2) storage->FailNext();
      PushRows(x->engine, step, {100 + step, 500}, width, 2.0f);
      CHECK(x->engine.global_step() == step + 1);
    }
    if (step == 2) REQUIRE_FALSE(storage->armed());
    std::optional<ShardSnapshot> mine = e.engine.TakeCommitted(), theirs = twin.engine.TakeCommitted();
    REQUIRE(theirs);
    INFO("step " << step + 1);
    if (step == 2) {
      CHECK_FALSE(mine);  // missed: the replicas ask for it again (KeepCopy takes one from the engine)
      continue;
    }
    REQUIRE(mine);
    CheckSameState(*mine, *theirs);
  }
}
