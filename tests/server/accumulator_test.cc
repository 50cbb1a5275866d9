// TF ConditionalAccumulator cases (tf_semantics.md section 1).
#include "core/accumulator.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace psd;
using psd::server::DenseAccumulator;
using psd::server::Reduction;

namespace {

template <typename T>
Result<bool> Apply(DenseAccumulator& acc, int64_t step, std::vector<T> v, Shape shape) {
  DType dt = sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64;
  return acc.ApplyGrad(step, dt, shape, v.data(), v.size() * sizeof(T));
}

// The take's result: the sum divided by the divisor (the engine fuses that division into the
// optimizer's pass; the arithmetic is TF's `accum /= counter`).
template <typename T>
std::vector<T> Grad(const DenseAccumulator& acc, size_t n) {
  const T* p = acc.grad().as<T>();
  std::vector<T> out(p, p + n);
  for (T& x : out) x /= static_cast<T>(acc.divisor());
  return out;
}

}  // namespace

TEST_CASE("take averages over the count actually accumulated and bumps the step", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {2}, Reduction::kMean, 0);
  REQUIRE(*Apply<float>(acc, 0, {1, 2}, {2}));
  REQUIRE(*Apply<float>(acc, 0, {3, 4}, {2}));
  REQUIRE(*Apply<float>(acc, 5, {5, 9}, {2}));  // a local step ahead of the accumulator is accepted
  CHECK(acc.num_accumulated() == 3);
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));  // 3 >= 2: mean over 3, not 2 (TF #24005 behaviour)
  CHECK(count == 3);
  CHECK(Grad<float>(acc, 2) == std::vector<float>{3, 5});
  CHECK(acc.step() == 1);
  CHECK(acc.num_accumulated() == 0);
}

TEST_CASE("stale gradients are dropped and the counter is unchanged", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {2}, Reduction::kMean, 0);
  acc.SetGlobalStep(3);
  CHECK_FALSE(*Apply<float>(acc, 2, {100, 100}, {2}));  // 2 < 3: stale
  CHECK(acc.num_accumulated() == 0);
  CHECK(*Apply<float>(acc, 3, {1, 1}, {2}));  // equal: fresh (stale iff strictly less)
  CHECK(acc.num_accumulated() == 1);
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(Grad<float>(acc, 2) == std::vector<float>{1, 1});
  CHECK(acc.step() == 4);
}

TEST_CASE("take waits for num_required and rejects a non-positive count", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat64, {3}, Reduction::kMean, 0);
  REQUIRE(*Apply<double>(acc, 0, {1, 2, 3}, {3}));
  int count = 0;
  CHECK_FALSE(*acc.TryTakeGrad(2, &count));
  CHECK(acc.step() == 0);
  auto bad = acc.TryTakeGrad(-1, &count);
  REQUIRE(!bad.ok());
  CHECK(bad.status().message() == "Argument num_required must be positive, but was -1");
  CHECK(acc.TryTakeGrad(0, &count).status().message() == "Argument num_required must be positive, but was 0");
  REQUIRE(*Apply<double>(acc, 0, {3, 2, 1}, {3}));
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(Grad<double>(acc, 3) == std::vector<double>{2, 2, 2});
}

TEST_CASE("SUM reduction returns the raw sum", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {2}, Reduction::kSum, 0);
  REQUIRE(*Apply<float>(acc, 0, {1, 2}, {2}));
  REQUIRE(*Apply<float>(acc, 0, {3, 4}, {2}));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(Grad<float>(acc, 2) == std::vector<float>{4, 6});
}

TEST_CASE("after a take the next accepted gradient starts a fresh sum", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {1}, Reduction::kMean, 0);
  REQUIRE(*Apply<float>(acc, 0, {10}, {1}));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(1, &count));
  REQUIRE(*Apply<float>(acc, 1, {4}, {1}));
  REQUIRE(*Apply<float>(acc, 1, {2}, {1}));
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(Grad<float>(acc, 1) == std::vector<float>{3});
}

TEST_CASE("shape mismatches use TF's message and change nothing", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {3, 2}, Reduction::kMean, 0);
  auto r = Apply<float>(acc, 0, {1, 2, 3, 4}, {2, 2});
  REQUIRE(!r.ok());
  CHECK(r.status().message() == "Shape mismatch: expected [3,2], got [2,2]");
  r = Apply<float>(acc, 0, {1, 2, 3}, {3, 1});
  CHECK(r.status().message() == "Shape mismatch: expected [3,2], got [3,1]");
  CHECK(acc.num_accumulated() == 0);
  // psd validates stale gradients too (TF silently dropped them): a malformed push always errors.
  acc.SetGlobalStep(5);
  CHECK(Apply<float>(acc, 0, {1, 2}, {2}).status().code() == Code::kInvalidArgument);
  // Wrong dtype and wrong byte count.
  std::vector<double> d(6, 1.0);
  CHECK_THAT(acc.ApplyGrad(5, DType::kFloat64, {3, 2}, d.data(), 48).status().message(),
             Catch::Contains("dtype mismatch"));
  std::vector<float> f(5, 1.f);
  CHECK_THAT(acc.ApplyGrad(5, DType::kFloat32, {3, 2}, f.data(), 20).status().message(), Catch::Contains("bytes"));
}

TEST_CASE("set_global_step overwrites, may lower, and keeps pending gradients", "[accumulator]") {
  DenseAccumulator acc(DType::kFloat32, {1}, Reduction::kMean, 0);
  REQUIRE(*Apply<float>(acc, 0, {2}, {1}));
  CHECK_FALSE(acc.SetGlobalStep(4));
  CHECK(acc.step() == 4);
  CHECK(acc.num_accumulated() == 1);
  CHECK(acc.SetGlobalStep(1));  // lowered: reported, still applied
  CHECK(acc.step() == 1);
  REQUIRE(*Apply<float>(acc, 1, {4}, {1}));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(Grad<float>(acc, 1) == std::vector<float>{3});
  CHECK(acc.step() == 2);
}

namespace {

// A float32 gradient of n elements: small integers, so every sum is exact whatever its order.
std::vector<float> Ints(size_t n, int seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(seed) * 13) % 17) - 8);
  return v;
}

}  // namespace

TEST_CASE("concurrent adds of one step sum every gradient, stripe by stripe", "[accumulator][parallel]") {
  // 3.5 stripes: the last one is partial.
  const size_t n = static_cast<size_t>(DenseAccumulator::kStripeElements) * 7 / 2;
  const int kAdders = 6;
  DenseAccumulator acc(DType::kFloat32, {static_cast<int64_t>(n)}, Reduction::kSum, 0);
  std::vector<std::vector<float>> grads;
  for (int k = 0; k < kAdders; ++k) grads.push_back(Ints(n, k));
  for (int round = 0; round < 2; ++round) {  // the second round starts every stripe over
    std::mutex owner;                        // the variable's lock: BeginAdd / EndAdd / take
    for (int k = 0; k < kAdders; ++k) {
      std::lock_guard<std::mutex> lock(owner);
      REQUIRE(acc.BeginAdd(round));
    }
    std::vector<std::thread> threads;
    for (int k = 0; k < kAdders; ++k) {
      threads.emplace_back([&, k] { acc.Add(DType::kFloat32, grads[static_cast<size_t>(k)].data(), {}); });
    }
    for (auto& t : threads) t.join();
    int count = 0;
    for (int k = 0; k < kAdders; ++k) {
      CHECK_FALSE(*acc.TryTakeGrad(1, &count));  // adds still in flight belong to this step
      acc.EndAdd();
    }
    REQUIRE(*acc.TryTakeGrad(1, &count));
    CHECK(count == kAdders);
    const float* sum = acc.grad().as<float>();
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (int k = 0; k < kAdders; ++k) want += grads[static_cast<size_t>(k)][i];
      wrong += sum[i] != want ? 1 : 0;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("deterministic reduction sums in replica order, whatever the arrival order", "[accumulator][deterministic]") {
  // Values whose float sum depends on the order: 1e8 + 1 - 1e8 is 0 one way and 1 the other.
  const std::vector<std::pair<std::string, std::vector<float>>> grads = {
      {"worker-0", {1e8f, 0.1f, 3.3f}}, {"worker-1", {1.0f, 1e-8f, -7.7f}}, {"worker-2", {-1e8f, 0.7f, 1e7f}}};
  auto sum_in = [&](std::vector<int> order) {
    DenseAccumulator acc(DType::kFloat32, {3}, Reduction::kSum, 0, /*deterministic=*/true);
    for (int k : order) {
      REQUIRE(acc.BeginAdd(0));
      acc.Add(DType::kFloat32, grads[static_cast<size_t>(k)].second.data(), grads[static_cast<size_t>(k)].first);
      acc.EndAdd();
    }
    int count = 0;
    REQUIRE(*acc.TryTakeGrad(3, &count));
    const float* p = acc.grad().as<float>();
    return std::vector<float>(p, p + 3);
  };
  std::vector<float> first = sum_in({0, 1, 2});
  // worker-0 + worker-1 + worker-2, in that order, as float32.
  for (size_t i = 0; i < 3; ++i) {
    float want = grads[0].second[i];
    want += grads[1].second[i];
    want += grads[2].second[i];
    CHECK(std::memcmp(&first[i], &want, 4) == 0);
  }
  for (std::vector<int> order : {std::vector<int>{2, 1, 0}, {1, 2, 0}, {2, 0, 1}}) {
    std::vector<float> again = sum_in(order);
    CHECK(std::memcmp(again.data(), first.data(), 12) == 0);
  }
  // Arrival order would not be: 1e8 + (-1e8) + 1 = 1, but 1e8 + 1 + (-1e8) = 0.
  DenseAccumulator plain(DType::kFloat32, {3}, Reduction::kSum, 0);
  for (int k : {0, 2, 1}) REQUIRE(plain.AddChecked(0, DType::kFloat32, grads[static_cast<size_t>(k)].second.data()));
  int count = 0;
  REQUIRE(*plain.TryTakeGrad(3, &count));
  CHECK(plain.grad().as<float>()[0] != first[0]);
}
