// TF ConditionalAccumulator cases (tf_semantics.md section 1).
#include "core/accumulator.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "psd/half.h"
#include "support/failing_storage.h"

using namespace psd;
using psd::server::DenseAccumulator;
using psd::server::Reduction;
using psd::testing::ActiveStorage;

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

// A whole gradient `g` of step `step` added held: `acc` may point at its bytes while `hold` lives.
void AddHeld(DenseAccumulator& acc, int64_t step, const std::vector<float>& g,
             const std::shared_ptr<const void>& hold) {
  REQUIRE(acc.BeginAdd(step));
  acc.Add(DType::kFloat32, g.data(), {}, nullptr, hold);
  acc.EndAdd();
}

// Step 0 of `acc` taken with `g`, and the sum's buffer handed over (as to the engine's apply): step
// 1's round has none until an add takes it.
void RoundWithoutSum(DenseAccumulator& acc, const std::vector<float>& g) {
  int count = 0;
  REQUIRE(acc.AddChecked(0, DType::kFloat32, g.data()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  REQUIRE(acc.ReleaseSum() != nullptr);
  REQUIRE_FALSE(acc.has_sum());
}

}  // namespace

TEST_CASE("concurrent adds of one step sum every gradient, stripe by stripe", "[accumulator][parallel]") {
  // 3.5 stripes: the last one is partial. With helpers, idle pool threads add some of each
  // gradient's stripes (all six adders share the pool, as the engine's adds share its apply threads).
  const size_t n = static_cast<size_t>(DenseAccumulator::kStripeElements) * 7 / 2;
  const int kAdders = 6;
  psd::ThreadPool pool(3);
  const bool helped = GENERATE(false, true);
  psd::ThreadPool* helpers = helped ? &pool : nullptr;
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
      threads.emplace_back([&, k] { acc.Add(DType::kFloat32, grads[static_cast<size_t>(k)].data(), {}, helpers); });
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

namespace {

// Adds elements [offset, offset + n) of `g` as one chunk (the owner's lock is not needed: no
// other thread).
void AddChunk(DenseAccumulator& acc, int64_t step, const std::vector<float>& g, int64_t offset, int64_t n,
              std::string_view replica = {}, psd::ThreadPool* helpers = nullptr, uint64_t source = 0) {
  REQUIRE(acc.BeginAdd(step));
  acc.AddChunk(DType::kFloat32, g.data() + offset, offset, n, replica, helpers, nullptr, source);
  acc.EndAddChunk(offset, n);
}

// Values whose float sums depend on the order they are added in.
std::vector<float> Awkward(size_t n, int seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float big = ((i + static_cast<size_t>(seed)) % 3 == 0) ? 1e8f : 1.0f;
    v[i] =
        (seed % 2 ? -big : big) * 0.37f + static_cast<float>((i * 7 + static_cast<size_t>(seed) * 13) % 101) * 0.013f;
  }
  return v;
}

}  // namespace

TEST_CASE("a gradient sent in chunks sums bit-identically to the same gradient sent whole", "[accumulator][chunks]") {
  const int64_t P = DenseAccumulator::kPartElements;
  // Over two stripes, a partial last part: the middle chunk below spans two stripes' worth, the
  // least that the helpers take a part of.
  const int64_t n = 2 * DenseAccumulator::kStripeElements + 8 * P + 100;
  auto a = Awkward(static_cast<size_t>(n), 1), b = Awkward(static_cast<size_t>(n), 2),
       c = Awkward(static_cast<size_t>(n), 3);
  // With helpers, a pool's threads add some of a chunk's stripes: the same bits.
  psd::ThreadPool pool(2);
  psd::ThreadPool* helpers = GENERATE(false, true) ? &pool : nullptr;
  DenseAccumulator whole(DType::kFloat32, {n}, Reduction::kMean, 0);
  for (auto* g : {&a, &b, &c}) REQUIRE(whole.AddChecked(0, DType::kFloat32, g->data()));
  // The same three in the same order, b in chunks that cross the stripe boundary, sent backwards.
  DenseAccumulator chunked(DType::kFloat32, {n}, Reduction::kMean, 0);
  REQUIRE(chunked.AddChecked(0, DType::kFloat32, a.data()));
  const int64_t cut1 = 3 * P, cut2 = 2 * DenseAccumulator::kStripeElements + 4 * P;
  AddChunk(chunked, 0, b, cut2, n - cut2, {}, helpers);
  CHECK(chunked.num_accumulated() == 1);  // b is not all there yet
  AddChunk(chunked, 0, b, cut1, cut2 - cut1, {}, helpers);
  AddChunk(chunked, 0, b, 0, cut1, {}, helpers);
  CHECK(chunked.num_accumulated() == 2);
  REQUIRE(chunked.AddChecked(0, DType::kFloat32, c.data()));
  int cw = 0, cc = 0;
  REQUIRE(*whole.TryTakeGrad(3, &cw));
  REQUIRE(*chunked.TryTakeGrad(3, &cc));
  CHECK(cw == 3);
  CHECK(cc == 3);
  CHECK(chunked.divisor() == whole.divisor());
  CHECK(std::memcmp(chunked.grad().data(), whole.grad().data(), static_cast<size_t>(n) * 4) == 0);
  // The next round starts every part over, chunks or not.
  std::vector<float> d(static_cast<size_t>(n), 2.0f);
  AddChunk(chunked, 1, d, 0, P);
  AddChunk(chunked, 1, d, P, n - P);
  REQUIRE(*chunked.TryTakeGrad(1, &cc));
  CHECK(cc == 1);
  CHECK(chunked.grad().as<float>()[0] == 2.0f);
  CHECK(chunked.grad().as<float>()[n - 1] == 2.0f);
}

TEST_CASE("each part counts its own gradients: a chunk that never came leaves its parts waiting",
          "[accumulator][chunks]") {
  const int64_t P = DenseAccumulator::kPartElements;
  const int64_t n = 4 * P;
  std::vector<float> one(static_cast<size_t>(n), 1.0f), three(static_cast<size_t>(n), 3.0f),
      five(static_cast<size_t>(n), 5.0f);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kMean, 0);
  // A worker died after its first half: parts 0-1 have its gradient, parts 2-3 do not.
  AddChunk(acc, 0, one, 0, 2 * P);
  REQUIRE(acc.AddChecked(0, DType::kFloat32, three.data()));
  int count = 0;
  CHECK(acc.num_accumulated() == 1);
  CHECK_FALSE(*acc.TryTakeGrad(2, &count));  // parts 2-3 have one gradient, not two
  // A backup worker's whole gradient completes them; parts 0-1 now have three.
  REQUIRE(acc.AddChecked(0, DType::kFloat32, five.data()));
  CHECK(acc.num_accumulated() == 2);
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(count == 2);          // the fewest
  CHECK(acc.divisor() == 1);  // divided part by part
  const float* g = acc.grad().as<float>();
  CHECK(g[0] == (1.0f + 3.0f + 5.0f) / 3.0f);
  CHECK(g[2 * P - 1] == (1.0f + 3.0f + 5.0f) / 3.0f);
  CHECK(g[2 * P] == (3.0f + 5.0f) / 2.0f);
  CHECK(g[n - 1] == (3.0f + 5.0f) / 2.0f);
  // A forced take (soft sync) with one part nobody sent: that part's gradient is zero.
  AddChunk(acc, 1, five, 0, 3 * P);
  acc.ForceTake(&count);
  CHECK(count == 1);
  CHECK(acc.grad().as<float>()[0] / static_cast<float>(acc.divisor()) == 5.0f);
  CHECK(acc.grad().as<float>()[n - 1] == 0.0f);
  // Stale chunks are dropped like stale gradients.
  CHECK_FALSE(acc.BeginAdd(1));
}

TEST_CASE("chunks are checked: aligned to parts, inside the tensor, flat, and of their size", "[accumulator][chunks]") {
  const int64_t P = DenseAccumulator::kPartElements;
  const Shape shape{3, P};  // 3 parts
  auto check = [&](DType dt, Shape s, size_t bytes, int64_t offset) {
    return DenseAccumulator::CheckChunk(DType::kFloat32, shape, dt, s, bytes, offset);
  };
  CHECK(check(DType::kFloat32, {P}, P * 4, P).ok());
  CHECK(check(DType::kFloat32, {3 * P}, 3 * P * 4, 0).ok());
  CHECK(check(DType::kBFloat16, {P}, P * 2, 2 * P).ok());  // halves into a float32 accumulator
  CHECK(check(DType::kFloat32, {P}, P * 4, 100).message().find("not aligned") != std::string::npos);
  CHECK(check(DType::kFloat32, {P - 1}, (P - 1) * 4, 0).message().find("not aligned") != std::string::npos);
  CHECK(check(DType::kFloat32, {2 * P}, 2 * P * 4, 2 * P).message().find("outside") != std::string::npos);
  CHECK(check(DType::kFloat32, {P}, P * 4, 3 * P).message().find("outside") != std::string::npos);
  CHECK(check(DType::kFloat32, {1, P}, P * 4, 0).message().find("flat") != std::string::npos);
  CHECK(check(DType::kFloat32, {P}, P * 4 - 4, 0).message().find("bytes") != std::string::npos);
  CHECK(check(DType::kFloat64, {P}, P * 8, 0).message().find("dtype mismatch") != std::string::npos);
}

TEST_CASE("deterministic reduction of chunks: the sum of whole gradients in replica order, whatever arrives when",
          "[accumulator][chunks][deterministic]") {
  const int64_t P = DenseAccumulator::kPartElements;
  const int64_t n = 3 * P + 7;
  std::vector<std::vector<float>> g = {Awkward(static_cast<size_t>(n), 4), Awkward(static_cast<size_t>(n), 5),
                                       Awkward(static_cast<size_t>(n), 6)};
  const std::vector<std::string> names = {"w0", "w1", "w2"};
  DenseAccumulator whole(DType::kFloat32, {n}, Reduction::kSum, 0, true);
  for (int k : {2, 0, 1}) {
    REQUIRE(whole.BeginAdd(0));
    whole.Add(DType::kFloat32, g[static_cast<size_t>(k)].data(), names[static_cast<size_t>(k)]);
    whole.EndAdd();
  }
  int count = 0;
  REQUIRE(*whole.TryTakeGrad(3, &count));
  // w1 whole; w0 and w2 in chunks, interleaved, their halves in different orders.
  DenseAccumulator mixed(DType::kFloat32, {n}, Reduction::kSum, 0, true);
  AddChunk(mixed, 0, g[2], 2 * P, n - 2 * P, "w2");
  AddChunk(mixed, 0, g[0], 0, P, "w0");
  REQUIRE(mixed.BeginAdd(0));
  mixed.Add(DType::kFloat32, g[1].data(), "w1");
  mixed.EndAdd();
  AddChunk(mixed, 0, g[2], 0, 2 * P, "w2");
  CHECK_FALSE(*mixed.TryTakeGrad(3, &count));
  AddChunk(mixed, 0, g[0], P, n - P, "w0");
  REQUIRE(*mixed.TryTakeGrad(3, &count));
  CHECK(count == 3);
  CHECK(std::memcmp(mixed.grad().data(), whole.grad().data(), static_cast<size_t>(n) * 4) == 0);
}

TEST_CASE("deterministic reduction: a gradient whose chunks did not all come never counts",
          "[accumulator][chunks][deterministic]") {
  // Worker a's push is cut off after its first part (its connection, source 1, closed); a comes
  // back (source 2) and pushes whole chunks; b pushes. The mean is (a + b) / 2 in every part, as
  // TensorFlow's all-or-nothing apply_grad gives. Before, the cut-off part stayed: a counted twice
  // there ((1 + 1 + 4) / 3), and cut pushes filled the slot limit until no gradient was taken.
  const int64_t P = DenseAccumulator::kPartElements;
  const int64_t n = 3 * P;
  std::vector<float> ones(static_cast<size_t>(n), 1.0f), fours(static_cast<size_t>(n), 4.0f);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kMean, 0, true);
  acc.LimitSlots(4);
  for (int cut = 0; cut < 6; ++cut) {  // more cut-off pushes than the limit holds slots
    AddChunk(acc, 0, ones, 0, P, "a", nullptr, 100 + static_cast<uint64_t>(cut));
    acc.DropUnfinished(100 + static_cast<uint64_t>(cut));
  }
  AddChunk(acc, 0, ones, 0, P, "a", nullptr, 1);
  acc.DropUnfinished(2);  // another source's: nothing to drop
  acc.DropUnfinished(1);
  for (int64_t at = 0; at < n; at += P) AddChunk(acc, 0, ones, at, P, "a", nullptr, 2);
  acc.DropUnfinished(2);  // finished: it stays
  int count = 0;
  CHECK_FALSE(*acc.TryTakeGrad(2, &count));
  // A third worker's push stalls after its first chunk (its connection not closed yet): it is
  // not dropped before the take, and still never counts.
  AddChunk(acc, 0, ones, 0, P, "c", nullptr, 4);
  CHECK_FALSE(*acc.TryTakeGrad(2, &count));
  for (int64_t at = 0; at < n; at += P) AddChunk(acc, 0, fours, at, P, "b", nullptr, 3);
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(count == 2);
  const float* sum = static_cast<const float*>(acc.grad().data());
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(sum[i] / static_cast<float>(acc.divisor()) == 2.5f);
  }
}

namespace {

// One add of a sequence: gradient k of `g`, whole (n < 0) or elements [offset, offset + n), held
// (the accumulator may point at its bytes) or not, in float32 or converted to bfloat16 first.
struct Step {
  int k;
  int64_t offset = 0, n = -1;
  bool held = false;
  bool bf16 = false;
};

void Run(DenseAccumulator& acc, const std::vector<std::vector<float>>& g, const std::vector<Step>& steps,
         const std::shared_ptr<const void>& hold, psd::ThreadPool* helpers,
         std::vector<std::vector<uint16_t>>* halves) {
  for (const Step& s : steps) {
    const std::vector<float>& v = g[static_cast<size_t>(s.k)];
    const void* data = v.data();
    DType dtype = DType::kFloat32;
    if (s.bf16) {
      halves->emplace_back(v.size());
      for (size_t i = 0; i < v.size(); ++i) halves->back()[i] = psd::FloatToBFloat16(v[i]);
      data = halves->back().data();
      dtype = DType::kBFloat16;
    }
    const auto h = s.held ? hold : nullptr;
    REQUIRE(acc.BeginAdd(0));
    if (s.n < 0) {
      acc.Add(dtype, data, {}, helpers, h);
      acc.EndAdd();
    } else {
      const size_t es = s.bf16 ? 2 : 4;
      acc.AddChunk(dtype, static_cast<const char*>(data) + static_cast<size_t>(s.offset) * es, s.offset, s.n, {},
                   helpers, h);
      acc.EndAddChunk(s.offset, s.n);
    }
  }
}

// After a take with keep_held: the taken gradient as the engine's apply reads it (TakenGrad, in
// blocks of `block` elements aligned to parts), gathered into one vector.
std::vector<float> TakenGradient(const DenseAccumulator& acc, int64_t n, int64_t block) {
  std::vector<float> out(static_cast<size_t>(n)), scratch(static_cast<size_t>(block));
  for (int64_t b = 0; b < n; b += block) {
    const int64_t end = std::min(n, b + block);
    for (int64_t at = b; at < end;) {
      int64_t run_end = -1;
      const void* g = acc.TakenGrad(acc.grad().data(), at, end, scratch.data(), &run_end);
      REQUIRE(run_end > at);
      REQUIRE(run_end <= end);
      std::memcpy(out.data() + at, g, static_cast<size_t>(run_end - at) * 4);
      at = run_end;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("held gradients sum bit-identically to copied ones, and are let go by the take", "[accumulator][held]") {
  // 2.5 stripes (the last partial, and not a whole part at its end), so runs cross stripes.
  const int64_t P = DenseAccumulator::kPartElements, S = DenseAccumulator::kStripeElements;
  const int64_t n = 2 * S + S / 2 + 100;
  std::vector<std::vector<float>> g;
  for (int k = 0; k < 3; ++k) g.push_back(Awkward(static_cast<size_t>(n), k));
  psd::ThreadPool pool(2);
  psd::ThreadPool* helpers = GENERATE(false, true) ? &pool : nullptr;
  // Held and plain adds, whole and in chunks, a bfloat16 one onto a held float32 one, a chunk that
  // ends mid-stripe, held gradients pending (pointed at after the first: added at the part's next
  // gradient, or read by the take's reader), a plain or bfloat16 gradient after a pending one: the
  // arrival order decides each part's sum (first + second + third), held or not.
  struct Sequence {
    std::vector<Step> steps;
    int required = 3;
  };
  const Step h0{0, 0, -1, true}, h1{1, 0, -1, true}, h2{2, 0, -1, true};
  const std::vector<Sequence> sequences = {
      {{h0, {1}, {2}}},
      {{h0, h1, h2}},
      {{{0, S + 3 * P, n - S - 3 * P, true}, {1, 0, -1, false, true}, {0, 0, S + 3 * P, true}, h2}},
      {{{2, 0, 5 * P, true}, h1, {2, 5 * P, n - 5 * P}, h0}},
      {{h0, h1}, 2},                                                  // first + pending
      {{h0, {2}, h1}},                                                // sum + pending
      {{h0, h1, {2, 0, -1, false, true}}},                            // a bfloat16 gradient after a pending one
      {{{0, 0, 3 * P, true}, h1, {0, 3 * P, n - 3 * P, true}, {2}}},  // held chunks around a pending one
      {{h1}, 1},                                                      // one held gradient: read where it lies
      {{{2}, h0, {1}}},                                               // a plain gradient after a pending one
      {{{2, 0, S + P}, h0, h1, {2, S + P, n - S - P, true}}},
  };
  for (size_t q = 0; q < sequences.size(); ++q) {
    INFO("sequence " << q);
    std::vector<std::vector<uint16_t>> halves;
    DenseAccumulator plain(DType::kFloat32, {n}, Reduction::kMean, 0);
    auto none = std::shared_ptr<const void>();
    Run(plain, g, sequences[q].steps, none, helpers, &halves);
    int count = 0;
    REQUIRE(*plain.TryTakeGrad(sequences[q].required, &count));
    for (bool keep : {false, true}) {
      INFO("keep_held " << keep);
      DenseAccumulator held(DType::kFloat32, {n}, Reduction::kMean, 0);
      auto hold = std::make_shared<int>(0);
      Run(held, g, sequences[q].steps, hold, helpers, &halves);
      CHECK(held.holds() == (hold.use_count() > 1));
      int held_count = 0;
      REQUIRE(*held.TryTakeGrad(sequences[q].required, &held_count, keep));
      CHECK(held_count == count);
      CHECK(held.divisor() == plain.divisor());
      if (!keep) {
        CHECK_FALSE(held.taken_holds());
        CHECK(std::memcmp(held.grad().data(), plain.grad().data(), static_cast<size_t>(n) * 4) == 0);
      } else {
        // Read in place or formed per run: the same bits as the sum, in blocks of 8 parts and of one.
        CHECK(held.taken_holds() == (hold.use_count() > 1));
        for (int64_t block : {8 * P, P}) {
          std::vector<float> taken = TakenGradient(held, n, block);
          CHECK(std::memcmp(taken.data(), plain.grad().data(), static_cast<size_t>(n) * 4) == 0);
        }
        held.DropTakenHolds();
        CHECK_FALSE(held.taken_holds());
      }
      CHECK(hold.use_count() == 1);  // the take (or DropTakenHolds) let the hold go
      CHECK_FALSE(held.holds());
      // The next round starts afresh: nothing of the last one's holds is read.
      std::vector<float> fresh(static_cast<size_t>(n), 0.5f);
      REQUIRE(held.AddChecked(1, DType::kFloat32, fresh.data()));
      REQUIRE(*held.TryTakeGrad(1, &held_count, true));
      CHECK_FALSE(held.taken_holds());
      CHECK(std::memcmp(held.grad().data(), fresh.data(), static_cast<size_t>(n) * 4) == 0);
    }
  }
}

TEST_CASE("a held gradient is read at its part's next add or the take, and copied by ResolveHeld",
          "[accumulator][held]") {
  const int64_t n = DenseAccumulator::kPartElements * 3;
  std::vector<float> a = Ints(static_cast<size_t>(n), 1), b = Ints(static_cast<size_t>(n), 2);
  auto hold = std::make_shared<int>(0);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  int count = 0;

  // Pointed at, not copied: bytes changed before the next add are the ones summed. (The engine
  // passes a hold only for bytes that do not change before ResolveHeld: this shows they are read late.)
  AddHeld(acc, 0, a, hold);
  CHECK(acc.holds());
  CHECK(hold.use_count() == 2);
  std::vector<float> a2 = a;
  for (float& x : a) x += 100;
  REQUIRE(acc.BeginAdd(0));
  acc.Add(DType::kFloat32, b.data(), {}, nullptr);
  acc.EndAdd();
  a = a2;  // too late: the parts have their sums
  REQUIRE(*acc.TryTakeGrad(2, &count));
  for (int64_t i = 0; i < n; ++i)
    REQUIRE(acc.grad().as<float>()[i] == a2[static_cast<size_t>(i)] + 100 + b[static_cast<size_t>(i)]);
  CHECK(hold.use_count() == 1);

  // ResolveHeld copies: the caller may then change its bytes.
  AddHeld(acc, 1, a, hold);
  acc.ResolveHeld();
  CHECK_FALSE(acc.holds());
  CHECK(hold.use_count() == 1);
  for (float& x : a) x = -1e30f;
  REQUIRE(acc.BeginAdd(1));
  acc.Add(DType::kFloat32, b.data(), {}, nullptr);
  acc.EndAdd();
  REQUIRE(*acc.TryTakeGrad(2, &count));
  for (int64_t i = 0; i < n; ++i)
    REQUIRE(acc.grad().as<float>()[i] == a2[static_cast<size_t>(i)] + b[static_cast<size_t>(i)]);

  // A take of one held gradient copies it; nothing points at it afterwards.
  a = a2;
  REQUIRE(acc.BeginAdd(2));
  acc.AddChunk(DType::kFloat32, a.data() + DenseAccumulator::kPartElements, DenseAccumulator::kPartElements,
               DenseAccumulator::kPartElements, {}, nullptr, hold);
  acc.EndAddChunk(DenseAccumulator::kPartElements, DenseAccumulator::kPartElements);
  acc.ForceTake(&count);
  CHECK(count == 1);
  CHECK(hold.use_count() == 1);
  for (float& x : a) x = -1e30f;
  const float* sum = acc.grad().as<float>();
  for (int64_t i = 0; i < n; ++i) {
    const bool sent = i >= DenseAccumulator::kPartElements && i < 2 * DenseAccumulator::kPartElements;
    REQUIRE(sum[i] == (sent ? a2[static_cast<size_t>(i)] : 0.0f));  // a part nobody sent is zero
  }

  // Deterministic accumulators copy every gradient into its replica's slot: no holds.
  DenseAccumulator det(DType::kFloat32, {n}, Reduction::kSum, 0, /*deterministic=*/true);
  REQUIRE(det.BeginAdd(0));
  det.Add(DType::kFloat32, a2.data(), "w0", nullptr, hold);
  det.EndAdd();
  CHECK_FALSE(det.holds());
  CHECK(hold.use_count() == 1);
}

TEST_CASE("a round takes its sum buffer at its first write: a held first gradient leaves time to offer one",
          "[accumulator][held]") {
  const int64_t n = DenseAccumulator::kPartElements * 2 + 5;
  std::vector<float> a = Ints(static_cast<size_t>(n), 3), b = Ints(static_cast<size_t>(n), 4);
  auto hold = std::make_shared<int>(0);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  int count = 0;
  RoundWithoutSum(acc, a);

  // Held: nothing written, no buffer taken; the one offered at the next add is the sum.
  AddHeld(acc, 1, a, hold);
  CHECK_FALSE(acc.has_sum());
  auto offered = std::make_shared<psd::server::Buffer>(static_cast<size_t>(n) * 4);
  const psd::server::Buffer* at = offered.get();
  acc.ProvideSum(std::move(offered));
  CHECK(acc.has_sum());
  REQUIRE(acc.AddChecked(1, DType::kFloat32, b.data()));
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(&acc.grad() == at);
  for (int64_t i = 0; i < n; ++i)
    REQUIRE(acc.grad().as<float>()[i] == a[static_cast<size_t>(i)] + b[static_cast<size_t>(i)]);
  auto sum = acc.ReleaseSum();
  CHECK(sum.get() == at);

  // Not held: the first write takes a buffer of its own (none was offered).
  REQUIRE(acc.AddChecked(2, DType::kFloat32, b.data()));
  CHECK(acc.has_sum());
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(&acc.grad() != at);

  // A take of one held gradient that nothing was offered for copies it into a new buffer.
  REQUIRE(acc.ReleaseSum() != nullptr);
  AddHeld(acc, 3, a, hold);
  REQUIRE(*acc.TryTakeGrad(1, &count));
  REQUIRE(acc.has_sum());
  CHECK(std::memcmp(acc.grad().data(), a.data(), static_cast<size_t>(n) * 4) == 0);

  // An empty variable's take still hands a (zero-byte) sum over.
  DenseAccumulator empty(DType::kFloat32, {0}, Reduction::kMean, 0);
  REQUIRE(empty.AddChecked(0, DType::kFloat32, nullptr));
  REQUIRE(*empty.TryTakeGrad(1, &count));
  REQUIRE(empty.ReleaseSum() != nullptr);
  REQUIRE(empty.AddChecked(1, DType::kFloat32, nullptr));
  REQUIRE(*empty.TryTakeGrad(1, &count));
  CHECK(empty.ReleaseSum() != nullptr);
}

TEST_CASE("an add that runs out of memory after a held first gradient loses neither", "[accumulator][oom]") {
  ActiveStorage storage;
  // Three stripes and a bit: the sum's buffer (over 256 KiB) comes from the storage.
  const int64_t n = 3 * DenseAccumulator::kStripeElements + 100;
  std::vector<float> a = Ints(static_cast<size_t>(n), 1), b = Ints(static_cast<size_t>(n), 2),
                     lost = Ints(static_cast<size_t>(n), 3);
  auto hold = std::make_shared<int>(0);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  int count = 0;
  RoundWithoutSum(acc, b);

  // Held first: pointed at, nothing written, no buffer yet. Then an add that copies needs the
  // buffer and does not get it. Before, it had let go of the held gradient's pointers first (the
  // gradient was lost) and the sum was read from whatever the memory held.
  AddHeld(acc, 1, a, hold);
  REQUIRE_FALSE(acc.has_sum());
  storage->FailNext();
  REQUIRE(acc.BeginAdd(1));
  REQUIRE_THROWS_AS(acc.Add(DType::kFloat32, lost.data(), {}), std::bad_alloc);
  acc.CancelAdd();
  REQUIRE_FALSE(storage->armed());
  REQUIRE(acc.BeginAdd(1));
  acc.Add(DType::kFloat32, b.data(), {});
  acc.EndAdd();
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(count == 2);
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    REQUIRE(acc.grad().as<float>()[i] == a[k] + b[k]);
  }
}

TEST_CASE("the first add of a round that runs out of memory changes nothing, whole or a chunk", "[accumulator][oom]") {
  ActiveStorage storage;
  const int64_t S = DenseAccumulator::kStripeElements, n = 3 * S + 100;
  std::vector<float> a = Ints(static_cast<size_t>(n), 1), b = Ints(static_cast<size_t>(n), 2);
  const bool chunks = GENERATE(false, true);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  int count = 0;
  RoundWithoutSum(acc, b);
  // Before, the failed add had marked its first stripe's parts as written: the next gradient was
  // added to NaN bytes there.
  storage->FailNext();
  REQUIRE(acc.BeginAdd(1));
  if (chunks) {
    REQUIRE_THROWS_AS(acc.AddChunk(DType::kFloat32, a.data(), 0, S, {}), std::bad_alloc);
  } else {
    REQUIRE_THROWS_AS(acc.Add(DType::kFloat32, a.data(), {}), std::bad_alloc);
  }
  acc.CancelAdd();
  REQUIRE_FALSE(storage->armed());
  if (chunks) {
    for (int64_t at = 0; at < n; at += S) AddChunk(acc, 1, b, at, std::min(S, n - at));
  } else {
    REQUIRE(acc.AddChecked(1, DType::kFloat32, b.data()));
  }
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(count == 1);
  REQUIRE(std::memcmp(acc.grad().data(), b.data(), static_cast<size_t>(n) * 4) == 0);
}

TEST_CASE("a round's first two held gradients take no sum buffer, whole or in chunks: a spare offered later can be it",
          "[accumulator][held]") {
  const int64_t S = DenseAccumulator::kStripeElements, n = 3 * S + 100;
  std::vector<float> a = Ints(static_cast<size_t>(n), 1), b = Ints(static_cast<size_t>(n), 2),
                     c = Ints(static_cast<size_t>(n), 3);
  auto hold = std::make_shared<int>(0);
  const bool chunks = GENERATE(false, true);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  int count = 0;
  RoundWithoutSum(acc, a);
  // Chunks of one stripe and a half: each stripe's parts come in two chunks of a gradient.
  const int64_t piece = chunks ? S + S / 2 : n;
  auto add = [&](const std::vector<float>& g) {
    for (int64_t at = 0; at < n; at += piece) {
      const int64_t k = std::min(piece, n - at);
      REQUIRE(acc.BeginAdd(1));
      if (chunks) {
        acc.AddChunk(DType::kFloat32, g.data() + at, at, k, {}, nullptr, hold);
        acc.EndAddChunk(at, k);
      } else {
        acc.Add(DType::kFloat32, g.data(), {}, nullptr, hold);
        acc.EndAdd();
      }
    }
  };
  add(a);
  CHECK_FALSE(acc.has_sum());
  add(b);
  // Chunks: a stripe cut between two chunks of a gradient counts both, so the second gradient's
  // chunk there is its third held add: it takes the buffer (same-host pieces of 4 MiB are whole
  // stripes, and do not).
  CHECK(acc.has_sum() == chunks);
  add(c);  // a third held gradient sums the pending one into the buffer: it took it first
  CHECK(acc.has_sum());
  REQUIRE(*acc.TryTakeGrad(3, &count));  // the held parts resolved into the sum
  CHECK(count == 3);
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    REQUIRE(acc.grad().as<float>()[i] == a[k] + b[k] + c[k]);
  }
}

TEST_CASE("a take that runs out of memory changes nothing: tried again, it takes the gradient", "[accumulator][oom]") {
  ActiveStorage storage;
  const int64_t S = DenseAccumulator::kStripeElements, n = 3 * S + 100, cut = S + S / 2;
  std::vector<float> a = Ints(static_cast<size_t>(n), 1), b = Ints(static_cast<size_t>(n), 2);
  const bool chunks = GENERATE(false, true);
  DenseAccumulator acc(DType::kFloat32, {n}, Reduction::kSum, 0);
  RoundWithoutSum(acc, b);
  // One held gradient, whole or in two chunks: pointed at, nothing written, no buffer. The take
  // (as the engine's: the held parts read by its apply) needs one.
  auto hold = std::make_shared<int>(0);
  if (chunks) {
    for (auto [at, k] : {std::pair<int64_t, int64_t>{0, cut}, {cut, n - cut}}) {
      REQUIRE(acc.BeginAdd(1));
      acc.AddChunk(DType::kFloat32, a.data() + at, at, k, {}, nullptr, hold);
      acc.EndAddChunk(at, k);
    }
  } else {
    AddHeld(acc, 1, a, hold);
  }
  REQUIRE_FALSE(acc.has_sum());
  storage->FailNext();
  int count = 0;
  // Before, a chunked round had been marked settled when it threw: tried again, it had no gradient.
  REQUIRE_THROWS_AS(acc.TryTakeGrad(1, &count, /*keep_held=*/true), std::bad_alloc);
  REQUIRE_FALSE(storage->armed());
  REQUIRE(*acc.TryTakeGrad(1, &count, /*keep_held=*/true));
  CHECK(count == 1);
  std::vector<float> scratch(static_cast<size_t>(n));
  for (int64_t at = 0, end = 0; at < n; at = end) {
    const auto* g = static_cast<const float*>(acc.TakenGrad(acc.grad().data(), at, n, scratch.data(), &end));
    REQUIRE(std::memcmp(g, a.data() + at, static_cast<size_t>(end - at) * sizeof(float)) == 0);
  }
  acc.DropTakenHolds();
  CHECK(hold.use_count() == 1);
}
