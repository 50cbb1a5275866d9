// TF SparseConditionalAccumulator cases (tf_semantics.md section 2).
#include "core/sparse_accumulator.h"

#include <catch2/catch.hpp>

using namespace psd;
using psd::server::Reduction;
using psd::server::SparseAccumulator;
using psd::server::SparseGradRef;

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

std::vector<float> Values(const SparseAccumulator& acc) {
  const float* p = reinterpret_cast<const float*>(acc.values().data());
  return std::vector<float>(p, p + acc.values().size() / sizeof(float));
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
  CHECK(acc.indices() == std::vector<int64_t>{0, 1, 4, 9});
  // Row 4 was in both gradients: (4+6)/2, (4+8)/2. The others appeared once: unchanged.
  CHECK(Values(acc) == std::vector<float>{2, 2, 1, 1, 5, 6, 3, 3});
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
  CHECK(acc.indices() == std::vector<int64_t>{0, 1, 4, 9});
  CHECK(Values(acc) == std::vector<float>{2, 2, 1, 1, 5, 6, 3, 3});
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
  CHECK(acc.indices() == std::vector<int64_t>{1, 4});  // none of worker 7's rows
  CHECK(Values(acc) == std::vector<float>{1, 1, 4, 4});
  // Its last rows, computed at step 0, are stale now: the whole gradient goes, nothing is kept.
  CHECK_FALSE(*acc.ApplyGrad(0, b_rest.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.ApplyGrad(1, a.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.indices() == std::vector<int64_t>{1, 4});
  // A cut-off gradient's rows (DropUnfinished) never count.
  REQUIRE(*acc.ApplyGrad(2, b_first.Ref(), /*counts=*/false, /*source=*/7));
  acc.DropUnfinished(7);
  REQUIRE(*acc.ApplyGrad(2, b_rest.Ref(), /*counts=*/true, /*source=*/7));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.indices() == std::vector<int64_t>{9});
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
  CHECK(Values(acc) == std::vector<float>{2});
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
  CHECK(acc.indices().empty());
  CHECK(acc.step() == 1);
  REQUIRE(*acc.ApplyGrad(1, Grad{{2}, {5}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  REQUIRE(*acc.ApplyGrad(2, Grad{{3}, {7}, {1, 1}, std::nullopt}.Ref()));
  REQUIRE(*acc.TryTakeGrad(1, &count));
  CHECK(acc.indices() == std::vector<int64_t>{3});
  CHECK(Values(acc) == std::vector<float>{7});
  CHECK(acc.TryTakeGrad(0, &count).status().message() == "Argument num_required must be positive, but was 0");
}
