// The daemon's sparse checks use TF's texts (tf_semantics.md §2.1), including the wording TF uses
// once gradients are already accumulating (issue 11 item 5).
#include <catch2/catch.hpp>
#include <memory>

#include "config/server_config.h"
#include "core/training_engine.h"

using namespace psd;
using namespace psd::server;

namespace {

struct SparseEngine {
  SparseEngine() {
    ServerConfig c;
    c.replicas_to_aggregate = 2;  // a gradient stays accumulated until a second one arrives
    c.total_replicas = 2;
    REQUIRE(c.Validate().ok());
    engine = std::make_unique<TrainingEngine>(c, std::move(*MakeOptimizer(c.optimizer)));
    VariableDef d;
    d.name = "emb";
    d.shape = {4, 2};
    REQUIRE(engine->CreateVariable(d).ok());
  }
  Status Push(Shape values_shape, std::vector<int64_t> rows, std::optional<Shape> dense_shape = std::nullopt) {
    std::vector<float> values(static_cast<size_t>(NumElements(values_shape)), 1.0f);
    std::vector<GradOutcome> out;
    GradRef g{"emb",
              DType::kFloat32,
              values_shape,
              values.data(),
              values.size() * 4,
              rows.data(),
              static_cast<int64_t>(rows.size()),
              dense_shape};
    return engine->Push(0, {g}, &out);
  }
  std::unique_ptr<TrainingEngine> engine;
};

}  // namespace

TEST_CASE("values rank: 'at least' before gradients accumulate, the accumulated rank after", "[engine][sparse]") {
  SparseEngine e;
  Status s = e.Push({1}, {0});
  CHECK_THAT(s.message(), Catch::EndsWith("Shape mismatch: expected values rank at least 2, got 1"));
  s = e.Push({1, 2, 1}, {0});  // more dims than the variable's rows have: the exact rank psd needs
  CHECK_THAT(s.message(), Catch::EndsWith("Shape mismatch: expected values rank 2, got 3"));
  REQUIRE(e.Push({1, 2}, {1}).ok());  // accumulating now (1 of 2)
  s = e.Push({1}, {0});
  CHECK_THAT(s.message(), Catch::EndsWith("Shape mismatch: expected values rank 2, got 1"));
  s = e.Push({1, 3}, {0});
  CHECK_THAT(s.message(), Catch::EndsWith("Shape mismatch: expected values dim 1 to be 2, got 3"));
}

TEST_CASE("the daemon's other sparse checks carry TF's texts", "[engine][sparse]") {
  SparseEngine e;
  CHECK_THAT(e.Push({}, {0}).message(), Catch::EndsWith("Values cannot be 0-dimensional."));
  CHECK_THAT(e.Push({3, 2}, {0, 1}).message(), Catch::EndsWith("Expected 2 non-empty input values, got 3"));
  CHECK_THAT(e.Push({1, 2}, {0}, Shape{4}).message(),
             Catch::EndsWith("Shape mismatch: expected shape rank at least 2, got 1"));
  CHECK_THAT(e.Push({1, 2}, {0}, Shape{5, 2}).message(),
             Catch::EndsWith("Shape mismatch: expected shape dim 0 to be 4, got 5"));
  CHECK_THAT(e.Push({1, 2}, {4}).message(),
             Catch::EndsWith("Shape mismatch: index of slice 0 exceeded limits of shape; index is 4 exceeded 4"));
}
