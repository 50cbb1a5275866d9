// Requests psd must refuse with a clear text (issue 11 items 5 and 8): TF's texts for sparse
// gradients, caught by the client before sending and by the daemon; an unknown aggregation.
#include <catch2/catch.hpp>

#include "../client/src/sparse_check.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

TEST_CASE("an unknown aggregation is refused naming the valid ones, not clamped", "[integration][limits]") {
  auto server = StartServer(TestConfig(1));
  auto c = ConnectWorker(server->port(), "w0");
  psclient::VariableOptions o;
  o.trainable = false;
  o.aggregation = static_cast<psclient::Aggregation>(7);
  auto v = c->CreateVariable("acc", {nullptr, DType::kFloat32, {2}}, o);
  REQUIRE_FALSE(v.ok());
  CHECK(v.status().code() == Code::kInvalidArgument);
  CHECK_THAT(v.status().message(), Catch::Contains("unknown variable aggregation 7") &&
                                       Catch::Contains("NONE (0), SUM (1), MEAN (2) and ONLY_FIRST_REPLICA (3)"));
  o.aggregation = psclient::Aggregation::kOnlyFirstReplica;  // the highest valid one still works
  CHECK(c->CreateVariable("acc", {nullptr, DType::kFloat32, {2}}, o).ok());
}

TEST_CASE("sparse gradients the client refuses carry TF's texts", "[integration][sparse]") {
  auto server = StartServer(TestConfig(1));
  auto c = ConnectWorker(server->port(), "w0");
  REQUIRE(c->CreateVariable("emb", {nullptr, DType::kFloat32, {4, 2}}).ok());
  std::vector<float> values(6, 1.0f);
  auto push = [&](std::vector<int64_t> rows, Shape shape) {
    psclient::SparseGradient g;
    g.name = "emb";
    g.indices = std::move(rows);
    g.values.data = values.data();
    g.values.dtype = DType::kFloat32;
    g.values.shape = std::move(shape);
    auto r = c->Push(0, {}, {g});
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Code::kInvalidArgument);
    return r.status().message();
  };
  CHECK(push({}, {}) == "sparse gradient for 'emb': Values cannot be 0-dimensional.");
  CHECK(push({0, 1}, {3, 2}) == "sparse gradient for 'emb': Expected 2 non-empty input values, got 3");
  // What the daemon checks (the row shape against the variable) has TF's texts too.
  CHECK_THAT(push({0}, {1, 3}), Catch::EndsWith("Shape mismatch: expected values dim 1 to be 2, got 3"));
}

TEST_CASE("with the variable's shape known (a cluster), the client checks the dense shape and the rows",
          "[integration][sparse]") {
  using psclient::internal::CheckSparseGradient;
  std::vector<float> values(4, 1.0f);
  const Shape whole{4, 2};
  auto check = [&](std::vector<int64_t> rows, std::optional<Shape> dense_shape) {
    psclient::SparseGradient g;
    g.name = "emb";
    g.values.data = values.data();
    g.values.dtype = DType::kFloat32;
    g.values.shape = {static_cast<int64_t>(rows.size()), 2};
    g.indices = std::move(rows);
    g.dense_shape = std::move(dense_shape);
    return CheckSparseGradient(g, &whole).message();
  };
  CHECK(check({0}, Shape{4, 2}).empty());
  CHECK(check({1}, Shape{4}) == "sparse gradient for 'emb': Shape mismatch: expected shape rank at least 2, got 1");
  CHECK(check({1}, Shape{5, 2}) == "sparse gradient for 'emb': Shape mismatch: expected shape dim 0 to be 4, got 5");
  CHECK(check({1, 4}, std::nullopt) ==
        "sparse gradient for 'emb': Shape mismatch: index of slice 1 exceeded limits of shape; index is 4 exceeded 4");
  CHECK(check({-1}, std::nullopt) == "sparse gradient for 'emb': index of slice 0 is negative: -1");
}
