// Every optimizer against a reference computed independently here, element by element in double
// precision from the TF/PyTorch formulas, for several steps, float32 and float64.
#include "core/optimizer.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <vector>

using namespace psd;
using namespace psd::server;

namespace {

constexpr int kSteps = 5;
constexpr int kN = 6;

// A deterministic gradient sequence with mixed signs and magnitudes.
double GradAt(int step, int i) { return std::sin(1.3 * i + 0.7 * step) * (1.0 + 0.25 * i); }

// Reference state for one element: value plus named slots.
struct Ref {
  double v;
  std::vector<double> s;
};

using RefStep = std::function<void(Ref&, double g, int t, const OptimizerParams& p)>;

template <typename T>
void RunAndCompare(const OptimizerParams& p, const RefStep& ref_step, double tolerance) {
  auto opt = MakeOptimizer(p);
  REQUIRE(opt.ok());
  DType dtype = sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64;
  std::vector<SlotSpec> specs = (*opt)->Slots();
  std::vector<Buffer> slots;
  for (auto& spec : specs) {
    slots.emplace_back(kN * sizeof(T));
    for (int i = 0; i < kN; ++i) slots.back().as<T>()[i] = static_cast<T>(spec.initial);
  }
  std::vector<T> value(kN), out(kN), grad(kN);
  std::vector<Ref> ref(kN);
  for (int i = 0; i < kN; ++i) {
    value[i] = static_cast<T>(0.5 - 0.2 * i);
    ref[i].v = static_cast<double>(value[i]);
    for (auto& spec : specs) ref[i].s.push_back(spec.initial);
  }
  for (int t = 1; t <= kSteps; ++t) {
    for (int i = 0; i < kN; ++i) grad[i] = static_cast<T>(GradAt(t, i));
    (*opt)->Apply({dtype, kN, value.data(), grad.data(), out.data(), &slots, 0, t, p.learning_rate});
    value = out;
    for (int i = 0; i < kN; ++i) {
      ref_step(ref[i], static_cast<double>(grad[i]), t, p);
      INFO(p.name << " step " << t << " element " << i);
      CHECK(static_cast<double>(value[i]) == Approx(ref[i].v).epsilon(tolerance).margin(tolerance));
      for (size_t k = 0; k < specs.size(); ++k) {
        CHECK(static_cast<double>(slots[k].as<T>()[i]) == Approx(ref[i].s[k]).epsilon(tolerance).margin(tolerance));
      }
    }
  }
}

template <typename T>
void CheckAll(double tol) {
  OptimizerParams p;
  p.learning_rate = 0.1;

  p.name = "sgd";
  RunAndCompare<T>(
      p, [](Ref& r, double g, int, const OptimizerParams& q) { r.v -= q.learning_rate * g; }, tol);

  p.name = "momentum";
  p.momentum = 0.9;
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int, const OptimizerParams& q) {
        r.s[0] = q.momentum * r.s[0] + g;
        r.v -= q.learning_rate * r.s[0];
      },
      tol);
  p.nesterov = true;
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int, const OptimizerParams& q) {
        r.s[0] = q.momentum * r.s[0] + g;
        r.v -= q.learning_rate * g + q.learning_rate * q.momentum * r.s[0];
      },
      tol);
  p.nesterov = false;

  p.name = "adagrad";
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int, const OptimizerParams& q) {
        r.s[0] += g * g;
        r.v -= q.learning_rate * g / std::sqrt(r.s[0]);
      },
      tol);

  p.name = "adam";
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int t, const OptimizerParams& q) {
        // PyTorch/Kingma-Ba form: bias-corrected moments. TF's form puts epsilon inside the
        // corrected step; with epsilon this small both agree to the tolerance used here.
        r.s[0] = q.beta1 * r.s[0] + (1 - q.beta1) * g;
        r.s[1] = q.beta2 * r.s[1] + (1 - q.beta2) * g * g;
        double mhat = r.s[0] / (1 - std::pow(q.beta1, t));
        double vhat = r.s[1] / (1 - std::pow(q.beta2, t));
        r.v -= q.learning_rate * mhat / (std::sqrt(vhat) + q.epsilon);
      },
      std::max(tol, 1e-6));

  p.name = "rmsprop";
  p.rms_momentum = 0.5;
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int, const OptimizerParams& q) {
        r.s[0] = q.rho * r.s[0] + (1 - q.rho) * g * g;
        r.s[1] = q.rms_momentum * r.s[1] + q.learning_rate * g / std::sqrt(r.s[0] + q.epsilon);
        r.v -= r.s[1];
      },
      tol);

  p.name = "ftrl";
  p.l1 = 0.01;
  p.l2 = 0.02;
  RunAndCompare<T>(
      p,
      [](Ref& r, double g, int, const OptimizerParams& q) {
        // McMahan et al. FTRL-Proximal per coordinate, with TF's lr_power = -0.5 and initial
        // accumulator: sigma = (sqrt(n + g^2) - sqrt(n)) / lr.
        double n_new = r.s[0] + g * g;
        double sigma = (std::sqrt(n_new) - std::sqrt(r.s[0])) / q.learning_rate;
        r.s[1] += g - sigma * r.v;
        double z = r.s[1];
        r.v =
            std::abs(z) <= q.l1 ? 0.0 : -(z - (z > 0 ? q.l1 : -q.l1)) / (std::sqrt(n_new) / q.learning_rate + 2 * q.l2);
        r.s[0] = n_new;
      },
      tol);
}

}  // namespace

TEST_CASE("optimizers match their reference formulas (float64)", "[optimizer]") { CheckAll<double>(1e-12); }

TEST_CASE("optimizers match their reference formulas (float32)", "[optimizer]") { CheckAll<float>(2e-5); }

TEST_CASE("slots are named as TF names them", "[optimizer]") {
  OptimizerParams p;
  auto names = [&](const char* n) {
    p.name = n;
    return (*MakeOptimizer(p))->SlotNames();
  };
  CHECK(names("sgd").empty());
  CHECK(names("momentum") == std::vector<std::string>{"momentum"});
  CHECK(names("adagrad") == std::vector<std::string>{"accumulator"});
  CHECK(names("adam") == std::vector<std::string>{"m", "v"});
  CHECK(names("rmsprop") == std::vector<std::string>{"rms", "momentum"});
  CHECK(names("ftrl") == std::vector<std::string>{"accum", "linear"});
}

TEST_CASE("sparse applies touch and list only their rows (lazy slots), dense ones end the slots' lists",
          "[optimizer]") {
  OptimizerParams p;
  p.name = "adam";
  p.learning_rate = 0.1;
  auto opt = MakeOptimizer(p);
  REQUIRE(opt.ok());
  // 4 rows x 2. Replication compares a slot's copy with the one before by the list of what
  // changed: a sparse update lists the rows it writes, a dense one writes every element without
  // listing them, so the list must end (the copy is then compared whole).
  std::vector<float> value{1, 1, 2, 2, 3, 3, 4, 4};
  const Buffer before(32);
  std::vector<Buffer> slots;
  slots.emplace_back(32);
  slots.emplace_back(32);
  for (Buffer& s : slots) s.MarkCopiedFrom(before);
  std::vector<int64_t> rows{1, 3};
  std::vector<float> grad{0.5f, 0.5f, -1.f, -1.f};
  (*opt)->ApplySparse({DType::kFloat32, 2, value.data(), rows.data(), 2, grad.data(), &slots, 1, 0.1});
  CHECK(value[0] == 1.f);
  CHECK(value[4] == 3.f);
  CHECK(value[2] == Approx(2 - 0.1));  // first Adam step moves by ~lr * sign(g)
  CHECK(value[6] == Approx(4 + 0.1));
  for (const Buffer& s : slots) {
    CHECK(s.copied_from() == before.id());
    CHECK(s.changes() == std::vector<std::pair<uint64_t, uint64_t>>{{8, 8}, {24, 8}});
  }
  CHECK(slots[0].as<float>()[0] == 0.f);  // untouched rows keep their moments
  CHECK(slots[0].as<float>()[2] == Approx(0.05));
  for (Buffer& s : slots) s.MarkCopiedFrom(before);
  std::vector<float> dense(8, 0.5f);
  (*opt)->Apply({DType::kFloat32, 8, value.data(), dense.data(), value.data(), &slots, 0, 2, 0.1});
  for (const Buffer& s : slots) CHECK(s.copied_from() == 0);  // written where it does not say: not listed
}

TEST_CASE("bad optimizer settings name the flag", "[optimizer]") {
  OptimizerParams p;
  p.name = "lamb";
  CHECK_THAT(p.Validate().message(), Catch::Contains("--optimizer"));
  p.name = "adam";
  p.beta1 = 1.0;
  CHECK_THAT(p.Validate().message(), Catch::Contains("--beta1"));
  p.beta1 = 0.9;
  p.learning_rate = -1;
  CHECK_THAT(p.Validate().message(), Catch::Contains("--learning-rate"));
}

TEST_CASE("the MEAN's division happens inside the update, exactly as a divide first", "[optimizer]") {
  OptimizerParams p;
  p.name = "momentum";
  p.learning_rate = 0.5;
  auto opt = MakeOptimizer(p);
  REQUIRE(opt.ok());
  std::vector<Buffer> fused_slots, plain_slots;
  fused_slots.emplace_back(12);
  plain_slots.emplace_back(12);
  std::vector<float> value{1, 2, 3}, sum{0.3f, 0.7f, 1.1f}, mean(3), a(3), b(3);
  for (int i = 0; i < 3; ++i) mean[i] = sum[i] / 3.0f;  // TF: accum /= counter
  (*opt)->Apply({DType::kFloat32, 3, value.data(), sum.data(), a.data(), &fused_slots, 0, 1, 0.5, 3.0});
  (*opt)->Apply({DType::kFloat32, 3, value.data(), mean.data(), b.data(), &plain_slots, 0, 1, 0.5, 1.0});
  CHECK(a == b);  // bit for bit
}
