// Interleavings of the engine's concurrent paths, provoked deterministically through the engine's
// test hook (no sleeps): issue 11 item 8.
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "config/server_config.h"
#include "core/training_engine.h"

using namespace psd;
using namespace psd::server;

namespace {

ServerConfig Config(int replicas) {
  ServerConfig c;
  c.replicas_to_aggregate = replicas;
  c.total_replicas = replicas;
  c.optimizer.learning_rate = 1.0;
  REQUIRE(c.Validate().ok());
  return c;
}

std::unique_ptr<TrainingEngine> MakeEngine(const ServerConfig& c) {
  auto e = std::make_unique<TrainingEngine>(c, std::move(*MakeOptimizer(c.optimizer)));
  e->PushInitTokens(c.resolved_init_tokens);
  return e;
}

void Create(TrainingEngine& e, const std::string& name, Shape shape) {
  VariableDef d;
  d.name = name;
  d.shape = std::move(shape);
  REQUIRE(e.CreateVariable(d).ok());
}

}  // namespace

TEST_CASE("first dense and first sparse pushes racing: the first to validate fixes the kind, the other is refused",
          "[engine][races]") {
  auto e = MakeEngine(Config(2));
  Create(*e, "emb", {4, 2});
  std::promise<void> validated, resume;
  std::shared_future<void> resumed = resume.get_future().share();
  int hook_calls = 0;  // only the dense push's thread reaches the hook first; the sparse one is refused before it
  e->set_test_hook([&](std::string_view point) {
    if (point != "push.validated" || hook_calls++ > 0) return;
    validated.set_value();
    resumed.wait();  // the dense push stays between validation and accumulation
  });
  std::vector<float> dense(8, 1.0f);
  Status dense_status;
  std::thread pusher([&] {
    std::vector<GradOutcome> out;
    dense_status = e->Push(0, {{"emb", DType::kFloat32, {4, 2}, dense.data(), dense.size() * 4}}, &out);
  });
  validated.get_future().wait();
  int64_t rows[1] = {1};
  float values[2] = {1.0f, 1.0f};
  std::vector<GradOutcome> out;
  GradRef sparse{"emb", DType::kFloat32, {1, 2}, values, sizeof(values), rows, 1};
  Status sparse_status = e->Push(0, {sparse}, &out);
  resume.set_value();
  pusher.join();
  INFO(dense_status.ToString() + " / " + sparse_status.ToString());
  CHECK(dense_status.ok());
  CHECK(sparse_status.code() == Code::kInvalidArgument);
  CHECK_THAT(sparse_status.message(), Catch::Contains("takes dense gradients; got a sparse one"));
  CHECK(out.empty());
}

TEST_CASE("a push refused after claiming a variable's kind leaves the kind free", "[engine][races]") {
  auto e = MakeEngine(Config(1));
  Create(*e, "a", {4, 2});
  Create(*e, "b", {2});
  std::vector<float> dense(8, 1.0f), bad(3, 1.0f);
  std::vector<GradOutcome> out;
  // 'a' validates (and claims dense), 'b' does not: the push changes nothing.
  Status s = e->Push(0,
                     {{"a", DType::kFloat32, {4, 2}, dense.data(), dense.size() * 4},
                      {"b", DType::kFloat32, {3}, bad.data(), bad.size() * 4}},
                     &out);
  REQUIRE(s.code() == Code::kInvalidArgument);
  int64_t rows[1] = {2};
  float values[2] = {1.0f, 1.0f};
  s = e->Push(0, {{"a", DType::kFloat32, {1, 2}, values, sizeof(values), rows, 1}}, &out);
  INFO(s.ToString());
  CHECK(s.ok());
}

TEST_CASE("a restore takes each variable's lock before the engine's: a push in flight does not deadlock it",
          "[engine][races]") {
  // Heap state shared with the threads: if the lock order were reversed, they would deadlock and
  // the test reports it and exits without unwinding them.
  struct State {
    std::unique_ptr<TrainingEngine> engine;
    std::promise<void> in_apply, resume, restored;
    std::thread pusher;
    Status restore_status, push_status;
    float grad = 1.0f;
    bool started = false, applied = false;
  };
  auto st = std::make_shared<State>();
  st->engine = MakeEngine(Config(1));
  std::shared_future<void> resumed = st->resume.get_future().share();
  // The push applies (holding the variable's lock, not the engine's) and stops there until the
  // restore has reached the variable; then it goes on and takes the engine's lock.
  st->engine->set_on_apply([st, resumed](double) {
    if (st->applied) return;
    st->applied = true;
    st->in_apply.set_value();
    resumed.wait();
  });
  st->engine->set_test_hook([st](std::string_view point) {
    if (point != "restore.variable" || st->started) return;
    st->started = true;
    st->pusher = std::thread([st] {
      std::vector<GradOutcome> out;
      st->push_status = st->engine->Push(0, {{"w", DType::kFloat32, {}, &st->grad, 4}}, &out);
    });
    st->in_apply.get_future().wait();  // the pusher holds w's lock
    st->resume.set_value();            // it now wants the engine's lock: Restore must not hold it
  });
  ShardSnapshot snap;
  snap.step = 5;
  snap.learning_rate = 1.0;
  snap.optimizer = "sgd";
  VariableSnapshot vs;
  vs.name = "w";
  auto value = std::make_shared<Buffer>(4);
  *value->as<float>() = 3.0f;
  vs.value = value;
  snap.variables.push_back(vs);
  std::thread restorer([st, snap] {
    st->restore_status = st->engine->Restore(snap);
    st->restored.set_value();
  });
  if (st->restored.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    // Only reached on a deadlock (the passing path returns as soon as Restore does).
    std::fprintf(stderr, "FAILED: Restore deadlocked against a push holding a variable's lock (lock order)\n");
    std::_Exit(1);
  }
  restorer.join();
  st->pusher.join();
  INFO(st->restore_status.ToString() + " / " + st->push_status.ToString());
  CHECK(st->started);
  CHECK(st->restore_status.ok());
  CHECK(st->push_status.ok());
}

TEST_CASE("async: a sparse update in place leaves the engine's lock to others and a read of its variable waits for it",
          "[engine][races]") {
  // Heap state shared with the threads: if the update held the engine's lock, the other
  // variable's pull would wait for it forever; the test reports that and exits without unwinding.
  struct State {
    std::unique_ptr<TrainingEngine> engine;
    std::promise<void> in_write, resume, others_done;
    std::thread pusher, others;
    Status push_status, other_pull, other_push;
    int hook_calls = 0;
  };
  auto st = std::make_shared<State>();
  ServerConfig c = Config(1);
  c.mode = Mode::kAsync;
  REQUIRE(c.Validate().ok());
  st->engine = MakeEngine(c);
  TrainingEngine& e = *st->engine;
  Create(e, "emb", {4, 2});
  Create(e, "w", {2});
  float before[8];
  {
    std::vector<PulledValue> got;
    int64_t step = 0;
    REQUIRE(e.Pull({"emb"}, &got, &step).ok());
    std::memcpy(before, got[0].value->data(), sizeof(before));
  }  // no reference kept: the update writes the published value itself
  std::shared_future<void> resumed = st->resume.get_future().share();
  e.set_test_hook([st, resumed](std::string_view point) {
    if (point != "apply.in_place" || st->hook_calls++ > 0) return;
    st->in_write.set_value();
    resumed.wait();  // the update stays between its listing and its write
  });
  static int64_t rows[1] = {1};
  static float grad[2] = {1.0f, 2.0f};
  st->pusher = std::thread([st] {
    std::vector<GradOutcome> out;
    st->push_status = st->engine->Push(0, {{"emb", DType::kFloat32, {1, 2}, grad, sizeof(grad), rows, 1}}, &out);
  });
  st->in_write.get_future().wait();
  // Another variable is pulled and pushed while the update is held.
  st->others = std::thread([st] {
    std::vector<PulledValue> got;
    int64_t step = 0;
    st->other_pull = st->engine->Pull({"w"}, &got, &step);
    static float w_grad[2] = {1.0f, 1.0f};
    std::vector<GradOutcome> out;
    st->other_push = st->engine->Push(0, {{"w", DType::kFloat32, {2}, w_grad, sizeof(w_grad)}}, &out);
    st->others_done.set_value();
  });
  if (st->others_done.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a pull of another variable waited for an in-place sparse update (engine's lock)\n");
    std::_Exit(1);
  }
  st->others.join();
  CHECK(st->other_pull.ok());
  CHECK(st->other_push.ok());
  // A read of the variable being written waits for the write, then sees all of it.
  auto read = std::async(std::launch::async, [&e] {
    std::vector<PulledValue> got;
    int64_t step = 0;
    Status s = e.Pull({"emb"}, &got, &step);
    std::vector<float> values(8);
    if (s.ok()) std::memcpy(values.data(), got[0].value->data(), sizeof(float) * values.size());
    return values;
  });
  CHECK(read.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout);
  st->resume.set_value();
  std::vector<float> after = read.get();
  st->pusher.join();
  INFO(st->push_status.ToString());
  CHECK(st->push_status.ok());
  for (int i = 0; i < 8; ++i) {
    // SGD at learning rate 1: row 1 loses the gradient, the others stay.
    const float want = i == 2 ? before[i] - 1.0f : i == 3 ? before[i] - 2.0f : before[i];
    CHECK(after[static_cast<size_t>(i)] == want);
  }
}
