// bfloat16 / float16 end to end: half-precision gradients into float32 variables (summed in
// float32), values pulled converted to the gradient dtype, half variables kept as float32 master
// weights, sparse halves, a cluster's slices, and a restart from a checkpoint — each checked
// against a reference computed here.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <thread>

#include "psd/half.h"
#include "support/test_cluster.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

std::vector<uint16_t> ToHalf(const std::vector<float>& v, DType dtype) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = dtype == DType::kBFloat16 ? FloatToBFloat16(v[i]) : FloatToFloat16(v[i]);
  }
  return out;
}

float FromHalf(uint16_t h, DType dtype) { return dtype == DType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h); }

ConstTensorView View(const std::vector<uint16_t>& v, DType dtype, Shape shape) {
  return {v.data(), dtype, std::move(shape), MemoryKind::kHost};
}
ConstTensorView View(const std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}
TensorView Out(std::vector<uint16_t>& v, DType dtype, Shape shape) {
  return {v.data(), dtype, std::move(shape), MemoryKind::kHost};
}
TensorView Out(std::vector<float>& v, Shape shape) {
  return {v.data(), DType::kFloat32, std::move(shape), MemoryKind::kHost};
}

// `steps` synchronous steps of one worker pushing the same gradient; returns the local step.
int64_t Steps(psclient::Client& c, const std::string& name, const ConstTensorView& grad, int steps, int64_t step = 0) {
  for (int i = 0; i < steps; ++i) {
    auto out = c.Push(step, {{name, grad}}, {}, true, 5000);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    step = out->token;
  }
  return step;
}

}  // namespace

TEST_CASE("half-precision gradients are averaged in float32 and pulls can ask for halves", "[half]") {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    INFO(DTypeName(dtype));
    auto cfg = TestConfig(2, 2, 0);
    cfg.optimizer.learning_rate = 0.5;
    auto server = StartServer(cfg);
    auto a = ConnectWorker(server->port(), "a");
    auto b = ConnectWorker(server->port(), "b");
    std::vector<float> w0{1.0f, -2.0f, 0.1f, 3.3f};
    REQUIRE(a->CreateVariable("w", View(w0, {4})).ok());
    std::vector<float> ga{0.1f, 0.2f, -0.3f, 1.7f}, gb{0.3f, -0.25f, 0.013f, 2.2f};
    auto ha = ToHalf(ga, dtype), hb = ToHalf(gb, dtype);
    std::vector<uint16_t> pulled(4);
    std::vector<std::pair<std::string, TensorView>> after{{"w", Out(pulled, dtype, {4})}};
    Result<psclient::PushOutcome> out_b = Internal("not run");
    std::thread tb([&] { out_b = b->Push(0, {{"w", View(hb, dtype, {4})}}, {}, true, 5000); });
    auto out_a = a->Push(0, {{"w", View(ha, dtype, {4})}}, {}, true, 5000, &after);
    tb.join();
    REQUIRE(out_a.ok());
    REQUIRE(out_b.ok());
    REQUIRE(out_a->token_status.ok());
    CHECK(out_a->results[0].accepted);
    CHECK(out_a->pulled_step == 1);

    // The reference: the halves' exact values, summed and averaged in float32, one SGD step.
    std::vector<float> want(4), master(4);
    for (size_t i = 0; i < 4; ++i) {
      float mean = (FromHalf(ha[i], dtype) + FromHalf(hb[i], dtype)) / 2.0f;
      want[i] = w0[i] - 0.5f * mean;
    }
    REQUIRE(*a->Pull("w", Out(master, {4})) == 1);
    for (size_t i = 0; i < 4; ++i) CHECK(master[i] == Approx(want[i]).epsilon(1e-6));
    // The half pull (in the push's reply and on its own) is the float32 value rounded once.
    std::vector<uint16_t> again(4);
    REQUIRE(a->Pull("w", Out(again, dtype, {4})).ok());
    for (size_t i = 0; i < 4; ++i) {
      uint16_t rounded = dtype == DType::kBFloat16 ? FloatToBFloat16(master[i]) : FloatToFloat16(master[i]);
      CHECK(pulled[i] == rounded);
      CHECK(again[i] == rounded);
    }
    // A float64 view of a float32 variable is refused with what converts.
    std::vector<double> d(4);
    auto bad = a->Pull("w", TensorView{d.data(), DType::kFloat64, {4}, MemoryKind::kHost});
    CHECK(bad.status().code() == Code::kInvalidArgument);
    CHECK_THAT(bad.status().message(), Catch::Contains("cannot be delivered as float64"));
  }
}

TEST_CASE("a half-precision variable keeps float32 master weights", "[half]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  // float16 has 10 mantissa bits: steps of 2^-13 near 1.0 are below its ulp (2^-10).
  auto init = ToHalf({1.0f, 2.0f}, DType::kFloat16);
  auto info = c->CreateVariable("h", View(init, DType::kFloat16, {2}));
  REQUIRE(info.ok());
  CHECK(info->dtype == DType::kFloat16);
  auto g = ToHalf({std::ldexp(1.0f, -13), 0.0f}, DType::kFloat16);
  int64_t step = Steps(*c, "h", View(g, DType::kFloat16, {2}), 4);
  std::vector<float> master(2);
  std::vector<uint16_t> half(2);
  REQUIRE(c->Pull("h", Out(master, {2})).ok());
  CHECK(master[0] == 1.0f - 4 * std::ldexp(1.0f, -13));  // 1 - 2^-11: the updates were not lost
  REQUIRE(c->Pull("h", Out(half, DType::kFloat16, {2})).ok());
  CHECK(half[0] == FloatToFloat16(master[0]));
  CHECK(half[1] == FloatToFloat16(2.0f));
  // Re-creating it as float32 is a different definition.
  std::vector<float> f{1, 2};
  CHECK(c->CreateVariable("h", View(f, {2})).status().code() == Code::kAlreadyExists);
  // float64 gradients do not mix with halves: TF's dtype text.
  std::vector<double> g64{1, 1};
  auto bad = c->Push(step, {{"h", ConstTensorView{g64.data(), DType::kFloat64, {2}, MemoryKind::kHost}}});
  CHECK(bad.status().code() == Code::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("dtype mismatch: accumulator is float32, gradient is float64"));
}

TEST_CASE("sparse half-precision gradients: repeated rows are summed in float32", "[half]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.learning_rate = 1.0;
  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  REQUIRE(c->CreateVariable("emb", {nullptr, DType::kFloat32, {6, 2}, MemoryKind::kHost}).ok());
  // Rows 4, 1, 4: row 4 gets 1 + 2^-9 twice; in bfloat16 1 + 2^-9 + 1 + 2^-9 would round to 2.
  float x = 1.0f + std::ldexp(1.0f, -7);  // exact in bfloat16
  auto values = ToHalf({x, x, 0.5f, 0.25f, x, x}, DType::kBFloat16);
  psclient::SparseGradient sg{"emb", {4, 1, 4}, View(values, DType::kBFloat16, {3, 2}), std::nullopt};
  auto out = c->Push(0, {}, {sg}, true, 5000);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  std::vector<float> rows(2 * 2);
  REQUIRE(c->PullRows("emb", {4, 1}, Out(rows, {2, 2})).ok());
  CHECK(rows[0] == -2 * x);
  CHECK(rows[1] == -2 * x);
  CHECK(rows[2] == -0.5f);
  CHECK(rows[3] == -0.25f);
  std::vector<uint16_t> half_rows(2 * 2);
  REQUIRE(c->PullRows("emb", {1, 4}, Out(half_rows, DType::kBFloat16, {2, 2})).ok());
  CHECK(half_rows[0] == FloatToBFloat16(-0.5f));
  CHECK(half_rows[2] == FloatToBFloat16(-2 * x));
}

TEST_CASE("a converted pull follows values written in place and buffers reused", "[half]") {
  // The engine updates a sparse table's rows in place and reuses a retired dense value's buffer as
  // the next sum: the same buffer then holds another value, and a conversion kept for it is stale.
  // Over TCP (a same-host pull through shared memory converts into the segment, uncached).
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    INFO(DTypeName(dtype));
    auto cfg = TestConfig(1, 1, 0);
    cfg.optimizer.learning_rate = 1.0;
    auto server = StartServer(cfg);
    auto options = psd::testing::WorkerOptions(server->port(), "w");
    options.shared_memory_bytes = 0;
    options.shared_buffer_bytes = 0;
    auto c = psd::testing::ConnectWith(options);
    REQUIRE(c->CreateVariable("x", {nullptr, DType::kFloat32, {4}, MemoryKind::kHost}).ok());
    REQUIRE(c->CreateVariable("e", {nullptr, DType::kFloat32, {4, 2}, MemoryKind::kHost}).ok());
    auto ones = ToHalf({1, 1, 1, 1}, dtype);
    std::vector<uint16_t> x(4), e(8);
    int64_t step = 0;
    for (int s = 1; s <= 6; ++s) {
      // Dense: pulled at every other step, so each pull meets the buffer the one before converted.
      if (s % 2 == 1) REQUIRE(c->Pull("x", Out(x, dtype, {4})).ok());
      psclient::SparseGradient row{"e", {1}, View(ones, dtype, {1, 2}), std::nullopt};
      auto out = c->Push(step, {{"x", View(ones, dtype, {4})}}, {row}, true, 5000);
      REQUIRE(out.ok());
      REQUIRE(out->token_status.ok());
      step = out->token;
      INFO("step " << s);
      REQUIRE(c->Pull("e", Out(e, dtype, {4, 2})).ok());  // rows updated in place
      CHECK(FromHalf(e[2], dtype) == -s);
      CHECK(FromHalf(e[3], dtype) == -s);
      CHECK(FromHalf(e[0], dtype) == 0);
      if (s % 2 == 0) {
        REQUIRE(c->Pull("x", Out(x, dtype, {4})).ok());
        CHECK(FromHalf(x[0], dtype) == -s);
        CHECK(FromHalf(x[3], dtype) == -s);
      }
    }
  }
}

TEST_CASE("a 3-shard cluster slices, pushes and pulls bfloat16 like one daemon", "[half][cluster]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "momentum";
  cfg.optimizer.learning_rate = 0.5;
  cfg.slice_bytes = 4096;
  auto cluster = psd::testing::StartTestCluster(cfg, 3);
  auto c = psd::testing::ConnectCluster(cluster, "w0");
  std::vector<float> init(1200 * 4);
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i % 17) * 0.125f;
  auto init_b = ToHalf(init, DType::kBFloat16);
  REQUIRE(c->CreateVariable("w", View(init_b, DType::kBFloat16, {1200, 4})).ok());
  auto placed = c->Placement("w");
  REQUIRE(placed.ok());
  CHECK(placed->sliced);
  CHECK(placed->dtype == DType::kBFloat16);
  std::vector<float> g(init.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 5) - 2.0f;
  auto g_b = ToHalf(g, DType::kBFloat16);
  Steps(*c, "w", View(g_b, DType::kBFloat16, {1200, 4}), 2);
  std::vector<float> w(init.size());
  REQUIRE(c->Pull("w", Out(w, {1200, 4})).ok());
  std::vector<uint16_t> wb(init.size());
  REQUIRE(c->Pull("w", Out(wb, DType::kBFloat16, {1200, 4})).ok());
  // Momentum (TF ApplyMomentum, momentum 0.9): accum = 0.9 accum + g; w -= lr * accum.
  for (size_t i = 0; i < w.size(); ++i) {
    float accum = g[i];
    float want = init[i] - 0.5f * accum;
    accum = 0.9f * accum + g[i];
    want -= 0.5f * accum;
    if (w[i] != Approx(want).epsilon(1e-6)) FAIL("element " << i << ": " << w[i] << " want " << want);
    if (wb[i] != FloatToBFloat16(w[i])) FAIL("bfloat16 element " << i);
  }
}

TEST_CASE("a half-precision variable survives a restart bit for bit", "[half][checkpoint]") {
  char tmpl[] = "/tmp/psd-half-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "adam";
  cfg.optimizer.learning_rate = 0.01;
  cfg.checkpoint_dir = dir;
  cfg.checkpoint_every_steps = 2;
  std::vector<float> master_before(3), m_before(3);
  {
    auto server = StartServer(cfg);
    auto c = ConnectWorker(server->port(), "w");
    auto init = ToHalf({0.5f, -1.25f, 3.0f}, DType::kBFloat16);
    REQUIRE(c->CreateVariable("b", View(init, DType::kBFloat16, {3})).ok());
    auto g = ToHalf({0.3f, -0.7f, 0.01f}, DType::kBFloat16);
    Steps(*c, "b", View(g, DType::kBFloat16, {3}), 2);
    for (int i = 0; i < 500 && c->GetStatus()->last_checkpoint_step != 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(c->GetStatus()->last_checkpoint_step == 2);
    REQUIRE(c->Pull("b", Out(master_before, {3})).ok());
    REQUIRE(c->GetSlot("b", "m", Out(m_before, {3})).ok());
  }
  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  CHECK(c->initial_global_step() == 2);
  auto again = c->CreateVariable("b", {nullptr, DType::kBFloat16, {3}, MemoryKind::kHost});
  REQUIRE(again.ok());
  CHECK(!again->created);
  std::vector<float> master(3), m(3);
  REQUIRE(c->Pull("b", Out(master, {3})).ok());
  REQUIRE(c->GetSlot("b", "m", Out(m, {3})).ok());
  CHECK(master == master_before);  // the float32 master, not its bfloat16 rounding
  CHECK(m == m_before);
  std::filesystem::remove_all(dir);
}
