// TF SparseConditionalAccumulator cases (tf_semantics.md section 2).
#include "core/sparse_accumulator.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

using namespace psd;
using psd::server::Reduction;
using psd::server::SparseAccumulator;
using psd::server::SparseGradRef;
using psd::server::SparseRows;

namespace {

struct Grad {
  std::vector<int64_t> idx;
  std::vector<float> values;
  Shape values_shape;
  std::optional<Shape> dense_shape;
  SparseGradRef Ref() const {
    return {idx.data(),    static_cast<int64_t>(idx.size()), DType::kFloat32, values_shape,
            values.data(), values.size() * sizeof(float),    dense_shape};
  }
};

// The take of an accumulator of one stripe (a variable of at most kMinStripeRows rows).
const SparseRows& One(const SparseAccumulator& acc) {
  REQUIRE(acc.num_stripes() == 1);
  return acc.taken()[0];
}

std::vector<float> Values(const SparseRows& t) {
  const float* p = reinterpret_cast<const float*>(t.values.data());
  return std::vector<float>(p, p + t.values.size() / sizeof(float));
}
std::vector<float> Values(const SparseAccumulator& acc) { return Values(One(acc)); }

// A take's rows come in arrival order per stripe, with each stripe's order listing their
// positions by index (TF sorts the rows themselves), the stripes' rows interleaved granule by
// granule: each stripe's checked to be its own rows in increasing order, then all sorted by index
// here to compare with TF's result.
struct Taken {
  std::vector<int64_t> indices;
  std::vector<float> values;
};
Taken Sorted(const SparseAccumulator& acc) {
  std::vector<std::pair<int64_t, std::vector<float>>> rows;
  for (size_t s = 0; s < acc.taken().size(); ++s) {
    const SparseRows& part = acc.taken()[s];
    const std::vector<float> values = Values(part);
    const size_t n = part.indices.size();
    const size_t dim = n == 0 ? 0 : values.size() / n;
    REQUIRE(part.order.size() == n);
    int64_t last = -1;
    for (uint32_t i : part.order) {
      const int64_t row = part.indices[i];
      REQUIRE(row > last);
      REQUIRE(SparseAccumulator::StripeOf(row, static_cast<int64_t>(acc.taken().size()), acc.taken_granule_rows()) ==
              static_cast<int64_t>(s));
      last = row;
      rows.emplace_back(row, std::vector<float>(values.begin() + static_cast<int64_t>(i * dim),
                                                values.begin() + static_cast<int64_t>((i + 1) * dim)));
    }
  }
  std::sort(rows.begin(), rows.end());
  Taken t;
  for (const auto& [row, values] : rows) {
    t.indices.push_back(row);
    t.values.insert(t.values.end(), values.begin(), values.end());
  }
  return t;
}

}  // namespace

TEST_CASE("rows merge by index and MEAN divides each row by its own count", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {10, 2}, Reduction::kMean, 0);
  Grad a{{1, 4}, {1, 1, 4, 4}, {2, 2}, std::nullopt};
  Grad b{{0, 4, 9}, {2, 2, 6, 8, 3, 3}, {3, 2}, std::nullopt};
  REQUIRE(*acc.ApplyGrad(0, a.Ref()));
  REQUIRE(*acc.ApplyGrad(0, b.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(count == 2);
  CHECK(Sorted(acc).indices == std::vector<int64_t>{0, 1, 4, 9});
  // Row 4 was in both gradients: (4+6)/2, (4+8)/2. The others appeared once: unchanged.
  CHECK(Sorted(acc).values == std::vector<float>{2, 2, 1, 1, 5, 6, 3, 3});
  CHECK(acc.step() == 1);
}

TEST_CASE("a gradient's rows in several calls count once, with its last rows, and merge as one call's", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {10, 2}, Reduction::kMean, 0);
  Grad a{{1, 4}, {1, 1, 4, 4}, {2, 2}, std::nullopt};
  Grad b_first{{0, 4}, {2, 2, 6, 8}, {2, 2}, std::nullopt}, b_rest{{9}, {3, 3}, {1, 2}, std::nullopt};
  REQUIRE(*acc.ApplyGrad(0, b_first.Ref(), /*counts=*/false));
  CHECK(acc.num_accumulated() == 0);
  int count = 0;
  CHECK_FALSE(*acc.TryTakeGrad(1, &count));  // not a whole gradient yet
  REQUIRE(*acc.ApplyGrad(0, b_rest.Ref()));
  CHECK(acc.num_accumulated() == 1);
  REQUIRE(*acc.ApplyGrad(0, a.Ref()));
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(count == 2);
  // As "rows merge by index ...": the first call's rows were kept when the next came.
  CHECK(Sorted(acc).indices == std::vector<int64_t>{0, 1, 4, 9});
  CHECK(Sorted(acc).values == std::vector<float>{2, 2, 1, 1, 5, 6, 3, 3});
}

TEST_CASE("a take between a sparse gradient's calls leaves its first rows out, and its last drops it whole",
          "[sparse]") {
  // TensorFlow's apply_grad is all or nothing: a take sees a whole gradient or none of it. Worker
  // 7's gradient comes in two calls; worker 8's whole one completes the step in between.
  SparseAccumulator acc(DType::kFloat32, {10, 2}, Reduction::kMean, 0);
  Grad a{{1, 4}, {1, 1, 4, 4}, {2, 2}, std::nullopt};
  Grad b_first{{0, 4}, {2, 2, 6, 8}, {2, 2}, std::nullopt}, b_rest{{9}, {3, 3}, {1, 2}, std::nullopt};
  REQUIRE(*acc.ApplyGrad(0, b_first.Ref(), /*counts=*/false, /*source=*/7));
  REQUIRE(*acc.ApplyGrad(0, a.Ref(), /*counts=*/true, /*source=*/8));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(count == 1);
  CHECK(Sorted(acc).indices == std::vector<int64_t>{1, 4});  // none of worker 7's rows
  CHECK(Sorted(acc).values == std::vector<float>{1, 1, 4, 4});
  // Its last rows, computed at step 0, are stale now: the whole gradient goes, nothing is kept.
  CHECK_FALSE(*acc.ApplyGrad(0, b_rest.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.ApplyGrad(1, a.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(Sorted(acc).indices == std::vector<int64_t>{1, 4});
  // A cut-off gradient's rows (DropUnfinished) never count.
  REQUIRE(*acc.ApplyGrad(2, b_first.Ref(), /*counts=*/false, /*source=*/7));
  acc.DropUnfinished(7);
  REQUIRE(*acc.ApplyGrad(2, b_rest.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(Sorted(acc).indices == std::vector<int64_t>{9});
}

TEST_CASE("SUM keeps per-row sums, stale sparse gradients are dropped", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {5, 1}, Reduction::kSum, 2);
  Grad a{{3}, {1}, {1, 1}, std::nullopt};
  CHECK_FALSE(*acc.ApplyGrad(1, a.Ref()));
  CHECK(acc.num_accumulated() == 0);
  REQUIRE(*acc.ApplyGrad(2, a.Ref()));
  REQUIRE(*acc.ApplyGrad(2, a.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(Sorted(acc).values == std::vector<float>{2});
}

TEST_CASE("sparse checks run in TF's order with TF's messages", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {4, 2}, Reduction::kMean, 0);
  auto msg = [&](Grad g) { return acc.ApplyGrad(0, g.Ref()).status().message(); };
  CHECK(msg({{1}, {1}, {}, std::nullopt}) == "Values cannot be 0-dimensional.");
  CHECK(msg({{1, 2}, {1, 1}, {1, 2}, std::nullopt}) == "Expected 2 non-empty input values, got 1");
  CHECK(msg({{1}, {1, 1}, {1, 2}, Shape{4}}) == "Shape mismatch: expected shape rank at least 2, got 1");
  CHECK(msg({{1}, {1, 1}, {1, 2}, Shape{4, 3}}) == "Shape mismatch: expected shape dim 1 to be 2, got 3");
  CHECK(msg({{7}, {1, 1}, {1, 2}, std::nullopt}) ==
        "Shape mismatch: index of slice 0 exceeded limits of shape; index is 7 exceeded 4");
  CHECK(msg({{1}, {1, 1, 1}, {1, 3}, std::nullopt}) == "Shape mismatch: expected values dim 1 to be 2, got 3");
  CHECK(msg({{1}, {1, 1}, {1}, std::nullopt}) == "Shape mismatch: expected values rank at least 2, got 1");
  // A higher rank TF would let through until its apply: psd names the exact rank it needs.
  CHECK(msg({{1}, {1, 1}, {1, 1, 2}, std::nullopt}) == "Shape mismatch: expected values rank 2, got 3");
  // psd's own checks that keep the variable's memory safe.
  CHECK_THAT(msg({{-1}, {1, 1}, {1, 2}, std::nullopt}), Catch::Contains("negative"));
  CHECK_THAT(msg({{2, 1}, {1, 1, 1, 1}, {2, 2}, std::nullopt}), Catch::Contains("strictly increasing"));
  CHECK_THAT(msg({{2, 2}, {1, 1, 1, 1}, {2, 2}, std::nullopt}), Catch::Contains("strictly increasing"));
  CHECK(acc.num_accumulated() == 0);  // nothing was accumulated by any of them
  CHECK(acc.ApplyGrad(0, Grad{{1}, {1, 1}, {1, 2}, Shape{4, 2}}.Ref()).ok());
}

TEST_CASE("after a take, the next sparse gradient starts fresh, a forced take may be empty", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {4, 1}, Reduction::kMean, 0);
  int count = -1;
  acc.ForceTake(&count);
  CHECK(count == 0);
  CHECK(One(acc).indices.empty());
  CHECK(acc.step() == 1);
  REQUIRE(*acc.ApplyGrad(1, Grad{{2}, {5}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  REQUIRE(*acc.ApplyGrad(2, Grad{{3}, {7}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(Sorted(acc).indices == std::vector<int64_t>{3});
  CHECK(Sorted(acc).values == std::vector<float>{7});
  CHECK(acc.TryTakeGrad(0, &count).status().message() == "Argument num_required must be positive, but was 0");
}

namespace {

// TensorFlow's combination (SCA's sorted merge of what is held with each gradient in turn),
// written plainly: the reference psd's row table must match bit for bit.
struct MergeReference {
  std::vector<int64_t> idx;
  std::vector<float> values;  // idx.size() rows of `dim`
  std::vector<int> counts;
  int64_t dim;

  void Add(const std::vector<int64_t>& gi, const std::vector<float>& gv) {
    std::vector<int64_t> oi;
    std::vector<float> ov;
    std::vector<int> oc;
    size_t a = 0, b = 0;
    auto row = [&](const std::vector<float>& v, size_t r) { return v.begin() + static_cast<int64_t>(r) * dim; };
    while (a < idx.size() || b < gi.size()) {
      if (b == gi.size() || (a < idx.size() && idx[a] < gi[b])) {
        oi.push_back(idx[a]);
        ov.insert(ov.end(), row(values, a), row(values, a + 1));
        oc.push_back(counts[a++]);
      } else if (a == idx.size() || gi[b] < idx[a]) {
        oi.push_back(gi[b]);
        ov.insert(ov.end(), row(gv, b), row(gv, b + 1));
        oc.push_back(1);
        ++b;
      } else {
        oi.push_back(idx[a]);
        for (int64_t k = 0; k < dim; ++k) ov.push_back(values[a * dim + k] + gv[b * dim + k]);
        oc.push_back(counts[a++] + 1);
        ++b;
      }
    }
    idx.swap(oi);
    values.swap(ov);
    counts.swap(oc);
  }
};

}  // namespace

TEST_CASE("rows found through the row table sum bit-identically to TF's sorted merge, step after step", "[sparse]") {
  // 12 gradients a step of overlapping random rows (sorted within each, as required), values
  // chosen so that float addition order matters; three steps, so the table must forget each
  // take's rows. MEAN divides per row.
  const int64_t rows = 300, dim = 3;
  // One stripe (the default for so few rows), or 43 (one per 7 rows, dealt 2 rows at a time): the
  // same sums.
  const int64_t stripe_rows = GENERATE(0, 7);
  SparseAccumulator acc(DType::kFloat32, {rows, dim}, Reduction::kMean, 0, stripe_rows, /*granule_rows=*/2);
  CHECK(acc.num_stripes() == (stripe_rows == 0 ? 1 : 43));
  std::mt19937 rng(7);
  for (int64_t step = 0; step < 3; ++step) {
    MergeReference ref{{}, {}, {}, dim};
    for (int g = 0; g < 12; ++g) {
      std::vector<int64_t> gi;
      for (int64_t r = 0; r < rows; ++r) {
        if (rng() % 4 == 0) gi.push_back(r);
      }
      std::vector<float> gv;
      std::uniform_real_distribution<float> value(-1e4f, 1e4f);
      for (size_t i = 0; i < gi.size() * dim; ++i) gv.push_back(value(rng) * (i % 2 ? 1e-3f : 1.f));
      ref.Add(gi, gv);
      Grad grad{gi, gv, {static_cast<int64_t>(gi.size()), dim}, std::nullopt};
      REQUIRE(*acc.ApplyGrad(step, grad.Ref()));
    }
    int count = 0;
    REQUIRE(*acc.TryTakeGrad(12, &count));
    CHECK(count == 12);
    for (size_t r = 0; r < ref.idx.size(); ++r) {
      for (int64_t k = 0; k < dim; ++k) ref.values[r * dim + k] /= static_cast<float>(ref.counts[r]);
    }
    const Taken taken = Sorted(acc);
    REQUIRE(taken.indices == ref.idx);
    const std::vector<float>& got = taken.values;
    REQUIRE(got.size() == ref.values.size());
    CHECK(std::memcmp(got.data(), ref.values.data(), got.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("a take's rows come in arrival order, each with its own count, and the next step starts from nothing",
          "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {10, 1}, Reduction::kMean, 0);
  REQUIRE(*acc.ApplyGrad(0, Grad{{7, 8, 9}, {7, 8, 9}, {3, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.ApplyGrad(0, Grad{{0, 8}, {10, 2}, {2, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.ApplyGrad(0, Grad{{3, 7}, {3, 1}, {2, 1}, std::nullopt}.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(3, &count));
  CHECK(One(acc).indices == std::vector<int64_t>{7, 8, 9, 0, 3});
  CHECK(Values(acc) == std::vector<float>{4, 5, 9, 10, 3});       // 7: (7+1)/2, 8: (8+2)/2
  CHECK(One(acc).order == std::vector<uint32_t>{3, 4, 0, 1, 2});  // 0, 3, 7, 8, 9
  // The engine swaps the result out for the last take's buffers (applied, cleared).
  std::vector<SparseRows> taken;
  acc.ReleaseTaken(&taken);
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].indices == std::vector<int64_t>{7, 8, 9, 0, 3});
  CHECK(taken[0].order == std::vector<uint32_t>{3, 4, 0, 1, 2});
  CHECK(One(acc).indices.empty());
  taken[0].indices.clear();
  taken[0].values.clear();
  taken[0].order.clear();
  acc.ReleaseTaken(&taken);  // given back: the accumulator keeps them
  REQUIRE(*acc.ApplyGrad(1, Grad{{8}, {6}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.ApplyGrad(1, Grad{{2, 8}, {1, 2}, {2, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(One(acc).indices == std::vector<int64_t>{8, 2});
  CHECK(One(acc).order == std::vector<uint32_t>{1, 0});
  CHECK(Values(acc) == std::vector<float>{4, 1});  // 8 was in both: (6+2)/2
}

TEST_CASE("a variable with more rows than the row table can place is refused sparse accumulation", "[sparse]") {
  const Status s = SparseAccumulator::CheckRows(Shape{SparseAccumulator::kMaxRows + 1, 1});
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("at most 4294967294 rows"));
  CHECK(SparseAccumulator::CheckRows(Shape{SparseAccumulator::kMaxRows, 1}).ok());
}

TEST_CASE("a step of many rows, then steps of few: the table shrinks back and every step sums its own rows",
          "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {100000, 1}, Reduction::kSum, 0);
  std::vector<int64_t> all(50000);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i) * 2;
  REQUIRE(*acc.ApplyGrad(0, Grad{all, std::vector<float>(all.size(), 1), {50000, 1}, std::nullopt}.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(1, &count));
  size_t taken_rows = 0;
  for (const SparseRows& part : acc.taken()) taken_rows += part.indices.size();
  CHECK(acc.num_stripes() > 1);
  CHECK(taken_rows == 50000);
  for (int64_t step = 1; step < 4; ++step) {
    REQUIRE(*acc.ApplyGrad(step, Grad{{4, 99999}, {1, 2}, {2, 1}, std::nullopt}.Ref()));
    REQUIRE(*acc.ApplyGrad(step, Grad{{4}, {5}, {1, 1}, std::nullopt}.Ref()));
    REQUIRE(*acc.TryTakeGrad(2, &count));
    CHECK(Sorted(acc).indices == std::vector<int64_t>{4, 99999});
    CHECK(Sorted(acc).values == std::vector<float>{6, 2});
  }
}

TEST_CASE("row buffers never outgrow the variable's rows, and an empty forced take leaves them for the next step",
          "[sparse]") {
  // Two gradients of every row: counted as if new, 2000 rows would be reserved for 1000.
  SparseAccumulator acc(DType::kFloat32, {1000, 1}, Reduction::kSum, 0);
  std::vector<int64_t> all(1000);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const Grad every{all, std::vector<float>(1000, 1), {1000, 1}, std::nullopt};
  int count = 0;
  std::vector<SparseRows> taken;
  for (int64_t step = 0; step < 2; ++step) {  // the engine's round: take, apply (here: clear), give back
    REQUIRE(*acc.ApplyGrad(step, every.Ref()));
    REQUIRE(*acc.ApplyGrad(step, every.Ref()));
    REQUIRE(*acc.TryTakeGrad(2, &count));
    CHECK(One(acc).indices.capacity() <= 1000);
    CHECK(One(acc).values.capacity() <= 1000 * sizeof(float));
    CHECK(One(acc).order.capacity() <= 1000);
    for (SparseRows& part : taken) {
      part.indices.clear();
      part.values.clear();
      part.order.clear();
    }
    acc.ReleaseTaken(&taken);
    REQUIRE(taken.size() == 1);
    CHECK(taken[0].indices.size() == 1000);
    CHECK(Values(acc).empty());
  }
  // A step forced with nothing: the result is empty and holds no buffer (the next step's rows
  // keep theirs: two sets in all, the accumulator's and the engine's).
  acc.ForceTake(&count);
  CHECK(count == 0);
  CHECK(acc.step() == 3);
  CHECK(One(acc).indices.empty());
  CHECK(One(acc).indices.capacity() == 0);
  CHECK(One(acc).values.capacity() == 0);
  REQUIRE(*acc.ApplyGrad(3, Grad{{5}, {2}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(One(acc).indices == std::vector<int64_t>{5});
  CHECK(Values(acc) == std::vector<float>{2});
  CHECK(One(acc).indices.capacity() >= 1000);  // the step's rows went into the buffers kept
}

TEST_CASE("gradients added from several threads at once: every row summed and counted, stripe by stripe",
          "[sparse][parallel]") {
  // 4 threads x 6 gradients a step of random overlapping rows over 37 stripes (dealt 4 rows at a
  // time), BeginAdd and EndAdd under one lock (the engine's variable lock), Add outside it. Values
  // are small integers, so every order of addition gives the same sums: the take must equal the
  // reference exactly.
  const int64_t rows = 1200, dim = 2, stripe_rows = 33;
  SparseAccumulator acc(DType::kFloat32, {rows, dim}, Reduction::kMean, 0, stripe_rows, /*granule_rows=*/4);
  REQUIRE(acc.num_stripes() == 37);
  std::mutex owner;  // the engine's variable lock
  for (int64_t step = 0; step < 3; ++step) {
    constexpr int kThreads = 4, kEach = 6;
    std::vector<Grad> grads;
    std::mt19937 rng(static_cast<uint32_t>(11 + step));
    std::vector<float> sum(static_cast<size_t>(rows * dim), 0);
    std::vector<int> counts(static_cast<size_t>(rows), 0);
    for (int g = 0; g < kThreads * kEach; ++g) {
      Grad grad;
      for (int64_t r = 0; r < rows; ++r) {
        if (rng() % 3 != 0) continue;
        grad.idx.push_back(r);
        ++counts[static_cast<size_t>(r)];
        for (int64_t k = 0; k < dim; ++k) {
          grad.values.push_back(static_cast<float>(rng() % 64));
          sum[static_cast<size_t>(r * dim + k)] += grad.values.back();
        }
      }
      grad.values_shape = {static_cast<int64_t>(grad.idx.size()), dim};
      grads.push_back(std::move(grad));
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int g = t; g < kThreads * kEach; g += kThreads) {
          SparseAccumulator::PendingAdd add;
          {
            std::lock_guard<std::mutex> lock(owner);
            Result<bool> begun = acc.BeginAdd(step, grads[static_cast<size_t>(g)].Ref(), true, 0, &add);
            if (!begun.ok() || !*begun || !add.add) return;  // checked below: every gradient counted
          }
          acc.Add(add);
          std::lock_guard<std::mutex> lock(owner);
          acc.EndAdd();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    REQUIRE(acc.num_accumulated() == kThreads * kEach);
    REQUIRE(acc.in_flight() == 0);
    int count = 0;
    REQUIRE(*acc.TryTakeGrad(kThreads * kEach, &count));
    Taken want;
    size_t capacity = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int c = counts[static_cast<size_t>(r)];
      if (c == 0) continue;
      want.indices.push_back(r);
      for (int64_t k = 0; k < dim; ++k) want.values.push_back(sum[static_cast<size_t>(r * dim + k)] / c);
    }
    for (const SparseRows& part : acc.taken()) capacity += part.indices.capacity();
    const Taken got = Sorted(acc);
    CHECK(got.indices == want.indices);
    CHECK(got.values == want.values);
    CHECK(capacity <= static_cast<size_t>(rows));  // each stripe reserved at most its own rows
    std::vector<SparseRows> given;
    acc.ReleaseTaken(&given);
    REQUIRE(given.size() == 37);
  }
}

TEST_CASE("a gradient sent in parts over many stripes is added whole at its last part", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {100, 1}, Reduction::kSum, 0, /*stripe_rows=*/10, /*granule_rows=*/8);
  REQUIRE(acc.num_stripes() == 10);
  REQUIRE(*acc.ApplyGrad(0, Grad{{1, 15, 40}, {1, 2, 3}, {3, 1}, std::nullopt}.Ref(), /*counts=*/false, 5));
  CHECK(acc.num_accumulated() == 0);
  REQUIRE(*acc.ApplyGrad(0, Grad{{41, 99}, {4, 5}, {2, 1}, std::nullopt}.Ref(), /*counts=*/true, 5));
  REQUIRE(*acc.ApplyGrad(0, Grad{{15, 99}, {10, 10}, {2, 1}, std::nullopt}.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(2, &count));
  CHECK(count == 2);
  const Taken t = Sorted(acc);
  CHECK(t.indices == std::vector<int64_t>{1, 15, 40, 41, 99});
  CHECK(t.values == std::vector<float>{1, 12, 3, 4, 15});
}

TEST_CASE("a variable has at most kMaxStripes stripes, whatever stripe size is asked for", "[sparse]") {
  SparseAccumulator acc(DType::kFloat32, {1000, 1}, Reduction::kSum, 0, /*stripe_rows=*/1, /*granule_rows=*/1);
  CHECK(acc.num_stripes() == 64);  // row r in stripe r mod 64
  REQUIRE(*acc.ApplyGrad(0, Grad{{0, 15, 16, 64, 999}, {1, 2, 3, 4, 5}, {5, 1}, std::nullopt}.Ref()));
  int count = 0;
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.taken()[0].indices == std::vector<int64_t>{0, 64});
  CHECK(acc.taken()[15].indices == std::vector<int64_t>{15});
  CHECK(acc.taken()[16].indices == std::vector<int64_t>{16});
  CHECK(acc.taken()[999 % 64].indices == std::vector<int64_t>{999});
  CHECK(SparseAccumulator(DType::kFloat32, {100000, 1}, Reduction::kSum, 0).num_stripes() == 25);  // 4096 each
  CHECK(SparseAccumulator(DType::kFloat32, {1000000, 8}, Reduction::kSum, 0).num_stripes() == 64);
  // No more stripes than granules: 100 rows dealt 64 at a time make two.
  CHECK(SparseAccumulator(DType::kFloat32, {100, 1}, Reduction::kSum, 0, /*stripe_rows=*/1).num_stripes() == 2);
}

TEST_CASE("a take's rows listed in index order across the stripes, whatever the layout", "[sparse]") {
  // Tables whose last granule is short, with stripes that get no granule (fewer granules than
  // stripes asked for), dealt 1, 2 or 64 rows at a time, and the default (coarse) layout: every
  // row of the take comes once, in increasing order, at the position that holds it.
  struct Layout {
    int64_t rows, stripe_rows, granule_rows;
  };
  for (const Layout& l : {Layout{1000, 1, 1}, Layout{999, 27, 2}, Layout{5000, 100, 64}, Layout{300000, 0, 0},
                          Layout{130, 1, 64}, Layout{5000, 100, 0}}) {
    INFO(l.rows << " rows, stripes of " << l.stripe_rows << ", granules of " << l.granule_rows);
    SparseAccumulator acc(DType::kFloat32, {l.rows, 1}, Reduction::kSum, 0, l.stripe_rows, l.granule_rows);
    std::mt19937 rng(static_cast<uint32_t>(l.rows));
    std::map<int64_t, int> want;  // row: how many gradients held it
    for (int g = 0; g < 3; ++g) {
      Grad grad;
      for (int64_t r = 0; r < l.rows; ++r) {
        if (rng() % 5 != 0 && r != l.rows - 1) continue;
        grad.idx.push_back(r);
        grad.values.push_back(static_cast<float>(r));
        ++want[r];
      }
      grad.values_shape = {static_cast<int64_t>(grad.idx.size()), 1};
      REQUIRE(*acc.ApplyGrad(0, grad.Ref()));
    }
    int count = 0;
    REQUIRE(*acc.TryTakeGrad(3, &count));
    std::vector<int64_t> listed;
    SparseAccumulator::ForEachRowInOrder(
        acc.taken(),
        [&](int64_t row, int64_t stripe, uint32_t position) {
          const SparseRows& part = acc.taken()[static_cast<size_t>(stripe)];
          REQUIRE(part.indices[position] == row);
          const float sum = reinterpret_cast<const float*>(part.values.data())[position];
          CHECK(sum == static_cast<float>(want[row]) * static_cast<float>(row));  // each gave it its index
          listed.push_back(row);
        },
        acc.taken_granule_rows());
    std::vector<int64_t> rows_wanted;
    for (const auto& [row, times] : want) rows_wanted.push_back(row);
    CHECK(listed == rows_wanted);
  }
}

TEST_CASE("granules stay coarse for even rows however many threads add, and come back after a skewed step",
          "[sparse]") {
  // 64 adders against 64 stripes: some stripe always holds more than 1/64 of even rows, so the bar
  // is at least 4 times a stripe's even share (an adder's share of at most num_stripes / 4
  // adders), and the way back at least twice it.
  const int64_t rows = 1000000;
  SparseAccumulator acc(DType::kFloat32, {rows, 1}, Reduction::kSum, 0);
  acc.SetAdders(64);
  REQUIRE(acc.num_stripes() == 64);
  std::mt19937_64 rng(5);
  auto uniform = [&] {
    std::set<int64_t> picked;
    while (picked.size() < 4096) picked.insert(static_cast<int64_t>(rng() % rows));
    Grad grad;
    grad.idx.assign(picked.begin(), picked.end());
    grad.values.assign(grad.idx.size(), 1);
    grad.values_shape = {static_cast<int64_t>(grad.idx.size()), 1};
    return grad;
  };
  int count = 0;
  for (int64_t step = 0; step < 3; ++step) {
    REQUIRE(*acc.ApplyGrad(step, uniform().Ref()));
    REQUIRE(*acc.TryTakeGrad(1, &count));
    CHECK(acc.granule_rows() == SparseAccumulator::kCoarseGranuleRows);
  }
  Grad hot;
  for (int64_t r = 0; r < 4096; ++r) hot.idx.push_back(r);
  hot.values.assign(hot.idx.size(), 1);
  hot.values_shape = {4096, 1};
  REQUIRE(*acc.ApplyGrad(3, hot.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.granule_rows() == SparseAccumulator::kFineGranuleRows);
  REQUIRE(*acc.ApplyGrad(4, uniform().Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.granule_rows() == SparseAccumulator::kCoarseGranuleRows);
}

TEST_CASE("rows that crowd one stripe make the next steps' rows dealt 64 at a time, an even step coarse again",
          "[sparse]") {
  // A vocabulary sorted by frequency puts its hot rows first: under Zipf 1 a third of a batch's
  // 4096 distinct rows of a 1 M-row table are among the first 4096, all in the first coarse
  // granule. After such a step the rows are dealt 64 at a time, so those go to all 64 stripes
  // alike; after a step whose rows would spread evenly over coarse granules, coarse again. Every
  // step's sums are right whatever the layout.
  const int64_t rows = 1000000;
  SparseAccumulator acc(DType::kFloat32, {rows, 2}, Reduction::kSum, 0);
  REQUIRE(acc.num_stripes() == SparseAccumulator::kMaxStripes);
  CHECK(acc.granule_rows() == SparseAccumulator::kCoarseGranuleRows);
  auto make = [](const std::vector<int64_t>& idx) {
    Grad grad;
    grad.idx = idx;
    for (int64_t r : idx) {
      grad.values.push_back(static_cast<float>(r % 1000));
      grad.values.push_back(1);
    }
    grad.values_shape = {static_cast<int64_t>(idx.size()), 2};
    return grad;
  };
  std::vector<int64_t> hot;
  for (int64_t r = 0; r < 4096; ++r) hot.push_back(r);
  hot.push_back(rows - 1);  // the last, short granule's row
  std::vector<int64_t> even;
  for (int64_t r = 0; r < 4096; ++r) even.push_back(r * 244);
  const Grad skewed = make(hot), spread = make(even);
  auto step = [&](int64_t at, const Grad& grad, int64_t dealt) {
    INFO("step " << at);
    REQUIRE(*acc.ApplyGrad(at, grad.Ref()));
    REQUIRE(*acc.ApplyGrad(at, grad.Ref()));
    int count = 0;
    REQUIRE(*acc.TryTakeGrad(2, &count));
    CHECK(acc.taken_granule_rows() == dealt);
    const Taken t = Sorted(acc);
    CHECK(t.indices == grad.idx);
    std::vector<float> doubled;
    for (float v : grad.values) doubled.push_back(2 * v);
    CHECK(t.values == doubled);
  };
  step(0, skewed, SparseAccumulator::kCoarseGranuleRows);  // all but one row in the first stripe
  CHECK(acc.granule_rows() == SparseAccumulator::kFineGranuleRows);
  std::vector<int> in(SparseAccumulator::kMaxStripes, 0);
  for (int64_t r = 0; r < 4096; ++r) ++in[static_cast<size_t>(acc.StripeOf(r))];
  for (int n : in) CHECK(n == 4096 / SparseAccumulator::kMaxStripes);
  step(1, skewed, SparseAccumulator::kFineGranuleRows);
  for (const SparseRows& part : acc.taken()) CHECK(part.indices.size() >= 64);
  CHECK(acc.granule_rows() == SparseAccumulator::kFineGranuleRows);  // still crowded in coarse granules
  step(2, spread, SparseAccumulator::kFineGranuleRows);
  CHECK(acc.granule_rows() == SparseAccumulator::kCoarseGranuleRows);  // even over coarse ones: back
  step(3, spread, SparseAccumulator::kCoarseGranuleRows);
  CHECK(acc.granule_rows() == SparseAccumulator::kCoarseGranuleRows);
}
